use dedup_runtime::idempotent;

#[idempotent(consumer = "billing", key = "evt_1")]
async fn mark_paid() -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {}
