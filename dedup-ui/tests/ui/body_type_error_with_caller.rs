// A type error inside the body, with a caller written against the generated signature:
// the caret is under the body's own token, and the caller shows no error of its own.
use dedup_runtime::{Outcome, idempotent};
use sqlx::PgConnection;

pub struct Paid {
    pub id: String,
    pub order_id: i64,
}

#[idempotent(consumer = "billing", key = msg.id)]
async fn mark_paid(tx: &mut PgConnection, msg: &Paid) -> Result<(), sqlx::Error> {
    let order: i32 = msg.order_id;
    sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
        .bind(order)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn consume(pool: &sqlx::PgPool, msg: &Paid) -> Result<(), sqlx::Error> {
    match mark_paid(pool, msg).await? {
        Outcome::Processed(()) => println!("order {} paid", msg.order_id),
        Outcome::Duplicate(_) => println!("{} seen before", msg.id),
    }
    Ok(())
}

fn main() {
    let _ = consume;
}
