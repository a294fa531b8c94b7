use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) {
    let _ = sqlx::query("SELECT 1").execute(&mut *tx).await;
    let _ = id;
}

fn main() {}
