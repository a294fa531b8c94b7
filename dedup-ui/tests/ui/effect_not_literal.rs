use dedup_runtime::idempotent;
use sqlx::PgConnection;

const SEND_FIRST: &str = "send-first";

#[idempotent(consumer = "email-sender", key = id, effect = SEND_FIRST)]
async fn send_email(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    println!("sending the email for {id} ({SEND_FIRST})");
    Ok(())
}

fn main() {}
