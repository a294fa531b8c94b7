use dedup_runtime::idempotent;
use sqlx::PgConnection;

// Mark-first commits its mark before the call: the body holds a lease, not a transaction.
#[idempotent(consumer = "audit-ping", key = id, effect = "mark-first")]
async fn ping(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    println!("pinging the auditor for {id}");
    Ok(())
}

fn main() {}
