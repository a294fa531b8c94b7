use dedup_runtime::idempotent;

#[idempotent(consumer = "billing", key = id)]
pub struct PaymentReceived {
    pub id: String,
}

fn main() {}
