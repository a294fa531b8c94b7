use dedup_runtime::{Lease, idempotent};

#[idempotent(consumer = "charges", key = id, effect = "send-first", lease = "48h")]
async fn charge(lease: &mut Lease<'_, sqlx::Postgres>, id: &str) -> Result<(), sqlx::Error> {
    println!("charging for {id}");
    Ok(())
}

fn main() {}
