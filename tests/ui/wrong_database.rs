use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

async fn consume(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    mark_paid(pool, "evt_1").await?;
    Ok(())
}

fn main() {
    let _ = consume;
}
