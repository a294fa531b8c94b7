use dedup_runtime::{Lease, idempotent};

#[idempotent(consumer = "charges", key = id, effect = "send-first", lease = "30s", lease = "60s")]
async fn charge(lease: &mut Lease<'_, sqlx::Postgres>, id: &str) -> Result<(), sqlx::Error> {
    println!("charging for {id}");
    Ok(())
}

fn main() {}
