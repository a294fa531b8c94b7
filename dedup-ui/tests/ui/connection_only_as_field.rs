use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Transfer {
    pub id: String,
    pub tx: String,
}

#[idempotent(consumer = "ledger", key = msg.id)]
async fn record(tx: &mut PgConnection, msg: &Transfer) -> Result<(), sqlx::Error> {
    println!("recording transfer {}", msg.tx);
    Ok(())
}

fn main() {}
