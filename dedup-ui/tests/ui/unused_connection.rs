use dedup_runtime::{Outcome, idempotent};
use sqlx::PgConnection;

#[idempotent(consumer = "email-sender", key = id)]
async fn send_email(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    println!("sending the email for {id}");
    Ok(())
}

// A caller written against the generated signature: it type-checks against the placeholder
// emitted next to the error, so the error above is the only one.
async fn consume(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    match send_email(pool, "evt_1").await? {
        Outcome::Processed(()) => println!("processed"),
        Outcome::Duplicate(_) => println!("seen before"),
    }
    Ok(())
}

fn main() {
    let _ = consume;
}
