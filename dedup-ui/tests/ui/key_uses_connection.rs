use dedup_runtime::idempotent;
use sqlx::PgConnection;

async fn session_id(tx: &mut PgConnection) -> String {
    let _ = tx;
    String::new()
}

#[idempotent(consumer = "billing", key = session_id(tx))]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

fn main() {}
