// An error in the attribute's arguments, with a caller written against the generated
// signature (`&pool` in, `Outcome` out): the caller type-checks against the placeholder the
// macro emits next to the error, so the empty consumer is the only error.
use dedup_runtime::{Outcome, idempotent};
use sqlx::PgConnection;

pub struct Paid {
    pub id: String,
    pub order_id: i64,
}

#[idempotent(consumer = "", key = msg.id)]
async fn mark_paid(tx: &mut PgConnection, msg: &Paid) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
        .bind(msg.order_id)
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
