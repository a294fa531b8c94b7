use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "charges", key = id, lease = "30s")]
async fn charge(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    println!("charging for {id}");
    Ok(())
}

fn main() {}
