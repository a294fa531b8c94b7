use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(unique = [])]
async fn ship(tx: &mut PgConnection, order_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)").bind(order_id).execute(&mut *tx).await?;
    Ok(())
}

fn main() {}
