use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(unique = "shipments_order_id_key", unique = "shipments_tracking_key")]
async fn ship(tx: &mut PgConnection, order_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)").bind(order_id).execute(&mut *tx).await?;
    Ok(())
}

fn main() {}
