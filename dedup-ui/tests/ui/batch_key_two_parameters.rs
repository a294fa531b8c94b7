use dedup_runtime::idempotent;
use sqlx::PgConnection;

struct Order {
    id: String,
    amount: f64,
}

#[idempotent(consumer = "billing", batch = orders, key = |order, n| order.id)]
async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> {
    for order in orders {
        let _ = order.amount;
        sqlx::query("SELECT $1").bind(&order.id).execute(&mut *tx).await?;
    }
    Ok(())
}

fn main() {}
