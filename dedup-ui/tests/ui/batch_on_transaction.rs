use dedup_runtime::idempotent;
use sqlx::{Postgres, Transaction};

struct Order {
    id: String,
}

#[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]
async fn bill(tx: &mut Transaction<'_, Postgres>, orders: &[&Order]) -> Result<(), sqlx::Error> {
    for order in orders {
        sqlx::query("SELECT $1").bind(&order.id).execute(&mut **tx).await?;
    }
    Ok(())
}

fn main() {}
