use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Payment {
    pub id: String,
    pub payload: Vec<u8>,
}

#[idempotent(unique = "payments_order_key", fingerprint = msg.payload)]
async fn charge(tx: &mut PgConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO payments (id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn main() {}
