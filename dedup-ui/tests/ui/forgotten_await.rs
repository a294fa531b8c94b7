// A statement left without `.await`: the UPDATE never runs while the dedup row commits.
// rustc only warns about an unused future; in a handler's body it is an error.
use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(id)
        .execute(&mut *tx);
    Ok(())
}

fn main() {}
