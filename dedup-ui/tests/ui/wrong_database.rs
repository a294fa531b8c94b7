// Three errors for one mistake, and no way to one: the generated function is generic over
// what the caller passes (`impl Db<'_, Postgres>`, so that a pool, a connection or a
// transaction all work), and the future it returns captures that type, so rustc checks
// the unmet bound at the argument, again where the call forms the future, and again at
// `.await`. Each error names the same fix.
use dedup_runtime::idempotent;
use sqlx::PgConnection;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

async fn consume(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    mark_paid(pool, "evt_1").await?;
    Ok(())
}

fn main() {
    let _ = consume;
}
