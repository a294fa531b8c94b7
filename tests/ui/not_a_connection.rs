use dedup_runtime::idempotent;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut String, id: &str) -> Result<(), sqlx::Error> {
    tx.push_str(id);
    Ok(())
}

fn main() {}
