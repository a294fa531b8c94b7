use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Option<u64> {
    let _ = (tx, id);
    None
}

fn main() {}
