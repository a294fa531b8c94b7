use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Payment {
    pub id: String,
    pub amount: u64,
}

#[idempotent(consumer = "charges", key = msg.id, fingerprint = msg.amount)]
async fn charge(tx: &mut PgConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

fn main() {}
