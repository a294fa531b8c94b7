use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "email-sender", key = id, effect = "send-first", effect = "send-first")]
async fn send_email(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    println!("sending the email for {id}");
    Ok(())
}

fn main() {}
