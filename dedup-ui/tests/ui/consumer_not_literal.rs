use dedup_runtime::idempotent;
use sqlx::PgConnection;

fn consumer() -> &'static str {
    "billing"
}

#[idempotent(consumer = consumer(), key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

fn main() {}
