// A send-first body that moves out of a message taken by value: the body runs at most
// once, but it is called from the loop that retries the claim, so it cannot use the
// message up. The note says so (not "a retry runs the body again").
use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Email {
    pub id: String,
    pub body: String,
}

async fn send(_body: String) {}

#[idempotent(consumer = "email-sender", key = msg.id, effect = "send-first")]
async fn send_email(tx: &mut PgConnection, msg: Email) -> Result<(), sqlx::Error> {
    send(msg.body).await;
    Ok(())
}

fn main() {}
