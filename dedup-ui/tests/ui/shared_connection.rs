use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &PgConnection, id: &str) -> Result<(), sqlx::Error> {
    let _ = (tx, id);
    Ok(())
}

fn main() {}
