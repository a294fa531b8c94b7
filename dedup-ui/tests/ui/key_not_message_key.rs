use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Received {
    pub at: std::time::SystemTime,
}

#[idempotent(consumer = "billing", key = msg.at)]
async fn mark_paid(tx: &mut PgConnection, msg: &Received) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = msg;
    Ok(())
}

fn main() {}
