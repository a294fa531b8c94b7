use dedup_runtime::{Lease, idempotent};

#[idempotent(consumer = "charges", key = id, unique = "charges_order_key", effect = "mark-first")]
async fn charge(lease: &mut Lease<'_, sqlx::Postgres>, id: &str) -> Result<(), sqlx::Error> {
    println!("charging for {id}");
    Ok(())
}

fn main() {}
