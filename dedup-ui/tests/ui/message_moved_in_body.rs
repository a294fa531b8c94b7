use dedup_runtime::idempotent;
use sqlx::PgConnection;

pub struct Email {
    pub id: String,
    pub body: String,
}

#[idempotent(consumer = "email-sender", key = msg.id)]
async fn send_email(tx: &mut PgConnection, msg: Email) -> Result<(), sqlx::Error> {
    let body: String = msg.body;
    sqlx::query("INSERT INTO outbox (body) VALUES ($1)")
        .bind(body)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn main() {}
