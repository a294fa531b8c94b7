use dedup_runtime::{Outcome, idempotent};
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

// A caller written against the generated signature: it type-checks against the placeholder
// emitted next to the error, so the error above is the only one.
async fn consume(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    match mark_paid(pool, "evt_1").await? {
        Outcome::Processed(()) => println!("processed"),
        Outcome::Duplicate(_) => println!("seen before"),
    }
    Ok(())
}

fn main() {
    let _ = consume;
}
