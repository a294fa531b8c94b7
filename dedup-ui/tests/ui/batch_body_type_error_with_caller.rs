use dedup_runtime::batch::BatchOutcome;
use dedup_runtime::idempotent;
use sqlx::PgConnection;

struct Order {
    id: String,
}

#[idempotent(consumer = "billing", batch = orders, key = |order| order.id)]
async fn bill(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), sqlx::Error> {
    for order in orders {
        let n: u32 = order.id;
        sqlx::query("SELECT $1").bind(n as i64).execute(&mut *tx).await?;
    }
    Ok(())
}

// The caller is written against the generated function: it adds no error of its own.
async fn consume(pool: &sqlx::PgPool, orders: &[Order]) -> Result<usize, sqlx::Error> {
    let outcome: BatchOutcome<sqlx::Error> = bill(pool, orders).await?;
    Ok(outcome.processed())
}

fn main() {
    let _ = consume;
}
