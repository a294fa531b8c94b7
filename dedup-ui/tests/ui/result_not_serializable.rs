use dedup_runtime::idempotent;
use sqlx::PgConnection;

/// A reply without `Serialize` / `Deserialize`.
pub struct Charge {
    pub id: String,
}

#[idempotent(consumer = "charges", key = id, result = "stored")]
async fn charge(tx: &mut PgConnection, id: &str) -> Result<Charge, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(Charge { id: id.to_owned() })
}

fn main() {}
