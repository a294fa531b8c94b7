use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    let _ = (tx, id);
    Ok(())
}

fn main() {}
