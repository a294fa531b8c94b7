use dedup_runtime::idempotent;
use sqlx::PgConnection;

const CONSUMER: &str = "";

#[idempotent(consumer = CONSUMER, key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

fn main() {}
