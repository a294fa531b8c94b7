use dedup_runtime::idempotent;
use sqlx::PgConnection;

struct Order {
    id: String,
}

struct Billing;

impl Billing {
    const INSERT: &'static str = "INSERT INTO bills (order_id) VALUES ($1)";

    #[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]
    async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> {
        for order in orders {
            sqlx::query(Self::INSERT).bind(&order.id).execute(&mut *tx).await?;
        }
        Ok(())
    }
}

fn main() {}
