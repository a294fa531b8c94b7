use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[derive(Debug)]
pub struct BillingError;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), BillingError> {
    sqlx::query("SELECT 1").execute(&mut *tx).await.map_err(|_| BillingError)?;
    let _ = id;
    Ok(())
}

fn main() {}
