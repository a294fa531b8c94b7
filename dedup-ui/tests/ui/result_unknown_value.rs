use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "charges", key = id, result = "kept")]
async fn charge(tx: &mut PgConnection, id: &str) -> Result<u64, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(id.len() as u64)
}

fn main() {}
