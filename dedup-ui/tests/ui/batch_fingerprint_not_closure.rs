use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Order {
    pub id: String,
    pub body: Vec<u8>,
}

#[idempotent(consumer = "billing", batch = orders, key = |order| order.id, fingerprint = orders[0].body)]
async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

fn main() {}
