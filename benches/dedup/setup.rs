//! Setup, written once for both backends on what [`Sql`](crate::target::Sql) says of
//! each: the tables, the big dedup table (filled once, kept between runs), the pruned
//! table, and the resets between runs.

use std::time::Instant;

use sqlx::{AssertSqlSafe, Pool};

use crate::Error;
use crate::config::Config;
use crate::target::Target;

/// Runs `statements` one by one on one connection (PostgreSQL runs a multi-statement
/// string as one transaction, where `VACUUM` is not allowed).
pub(crate) async fn execute<DB: sqlx::Database, S: AsRef<str>>(
    pool: &Pool<DB>,
    statements: &[S],
) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let mut conn = pool.acquire().await?;
    for statement in statements {
        sqlx::raw_sql(AssertSqlSafe(statement.as_ref().to_string()))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// The dedup table, the effects, and the big dedup table: filled once (about two minutes
/// for 10 million rows), then only emptied of the ids the runs added.
pub(crate) async fn setup<DB: Target>(pool: &Pool<DB>, config: &Config) -> Result<(), Error> {
    tables(pool).await?;
    let big = config.big_table();
    if DB::filled(pool, big).await? == Some(config.big_rows) {
        // The ids a previous run added are the ones newer than the fill's.
        let delete = format!("DELETE FROM {big} WHERE processed_at >= '2021-01-01'");
        DB::execute(pool, &[delete, DB::tidy(big)]).await?;
        return Ok(());
    }
    let name = DB::BACKEND.name();
    eprintln!(
        "{name}: filling {big} with {} rows (once)…",
        config.big_rows
    );
    let began = Instant::now();
    DB::execute(pool, &[format!("DROP TABLE IF EXISTS {big}")]).await?;
    dedup_runtime::migrate_table(pool, big).await?;
    DB::execute(pool, &DB::fill_big(big, config.big_rows)).await?;
    eprintln!("{name}: filled {big} in {:.0?}", began.elapsed());
    Ok(())
}

/// The dedup table `dedup_bench`, the effects and `dedup_bench_meta`, if missing.
pub(crate) async fn tables<DB: Target>(pool: &Pool<DB>) -> Result<(), Error> {
    dedup_runtime::migrate_table(pool, "dedup_bench").await?;
    DB::execute(pool, &DB::CREATE).await?;
    Ok(())
}

/// A fresh `dedup_bench_prune` holding `rows` ids aged 3 days and up, one a second apart.
pub(crate) async fn prune_setup<DB: Target>(pool: &Pool<DB>, rows: i64) -> Result<(), Error> {
    DB::execute(pool, &["DROP TABLE IF EXISTS dedup_bench_prune"]).await?;
    dedup_runtime::migrate_table(pool, "dedup_bench_prune").await?;
    let fill = DB::fill_prune(rows);
    DB::execute(pool, &[fill, DB::tidy("dedup_bench_prune")]).await?;
    Ok(())
}

/// Empties the small tables, so that every (round, tasks) block starts alike.
pub(crate) async fn reset<DB: Target>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    DB::execute(pool, &DB::reset_sql()).await
}

/// Empties the inbox table and the effects.
pub(crate) async fn inbox_reset<DB: Target>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    DB::execute(pool, &DB::inbox_reset_sql()).await
}

/// Empties the outbox table.
pub(crate) async fn outbox_reset<DB: Target>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    DB::execute(pool, &DB::outbox_reset_sql()).await
}
