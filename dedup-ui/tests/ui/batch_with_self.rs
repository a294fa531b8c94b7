use dedup_runtime::idempotent;
use sqlx::PgConnection;

struct Order {
    id: String,
}

struct Billing;

impl Billing {
    #[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]
    async fn bill(&self, tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> {
        for order in orders {
            sqlx::query("SELECT $1").bind(&order.id).execute(&mut *tx).await?;
        }
        Ok(())
    }
}

fn main() {}
