// `let _ =` of a future: no rustc warning at all, and the UPDATE never runs.
use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    let _ = sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
        .bind(id)
        .execute(&mut *tx);
    Ok(())
}

fn main() {}
