use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Order {
    pub id: i64,
}

#[idempotent(unique = "receipts_order_id_key", effect = "send-first")]
async fn send_receipt(tx: &mut PgConnection, order: &Order) -> Result<(), sqlx::Error> {
    println!("sending the receipt for order {}", order.id);
    Ok(())
}

fn main() {}
