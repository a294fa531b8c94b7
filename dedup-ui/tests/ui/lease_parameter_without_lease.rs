use dedup_runtime::{Lease, idempotent};

// A `Lease` without a policy that runs the call under one.
#[idempotent(consumer = "charges", key = id)]
async fn charge(lease: &mut Lease<'_, sqlx::Postgres>, id: &str) -> Result<(), sqlx::Error> {
    println!("charging for {id}");
    Ok(())
}

fn main() {}
