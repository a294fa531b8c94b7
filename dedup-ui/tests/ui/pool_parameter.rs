// The body touches `tx` and does its real work on a pool it was given: that work commits
// on its own, outside the handler's transaction, and a redelivery applies it again.
use dedup_runtime::idempotent;
use sqlx::{PgConnection, PgPool};

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, pool: &PgPool, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

fn main() {}
