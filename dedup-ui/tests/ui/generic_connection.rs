use dedup_runtime::idempotent;

#[idempotent(consumer = "billing", key = id)]
async fn mark_paid<C>(tx: &mut C, id: &str) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut C: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

fn main() {}
