use dedup_runtime::{Lease, idempotent};

// A leased body writes its result in `lease.transaction()`, not on a pool of its own.
#[idempotent(consumer = "charges", key = id, effect = "send-first", lease = "30s")]
async fn charge(
    lease: &mut Lease<'_, sqlx::Postgres>,
    id: &str,
    pool: &sqlx::PgPool,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO charges (message_id) VALUES ($1)")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

fn main() {}
