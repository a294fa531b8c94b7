use dedup_runtime::idempotent;
use sqlx::PgPool;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(pool: &PgPool, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(pool).await?;
    let _ = id;
    Ok(())
}

fn main() {}
