use dedup_runtime::{Outcome, idempotent};
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

// A caller written against the generated function: it must add no error of its own.
async fn consume(pool: &sqlx::PgPool) -> Result<bool, sqlx::Error> {
    Ok(matches!(mark_paid(pool, "evt_1").await?, Outcome::Processed(())))
}

fn main() {
    drop(consume);
}
