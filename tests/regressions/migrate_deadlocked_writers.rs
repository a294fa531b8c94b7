//! Issue 25 (the trace context's column) and 26 (the inbox's fingerprints): on PostgreSQL
//! the outbox's and the inbox's `migrate` ran `ALTER TABLE … ADD COLUMN IF NOT EXISTS`
//! every time, after the `CREATE INDEX IF NOT EXISTS` of the same transaction. The `ALTER`
//! takes an `ACCESS EXCLUSIVE` lock even when the column is there, and the index a
//! `SHARE` lock before it: a service starting (`migrate` at start-up) while a worker held
//! the table in a transaction (a claim's `FOR UPDATE`) waited for it, and the worker's
//! next write waited for `migrate`'s `SHARE` lock — a deadlock, one of the two killed
//! ("deadlock detected", seen in `tests/suite/inbox/` when tests migrate beside a running
//! worker). The column is now added only when the catalog lacks it, in a transaction of
//! its own.
//!
//! The worker's transaction holds `ROW SHARE` (what `FOR UPDATE` takes) while `migrate`
//! runs, then takes `ROW EXCLUSIVE` (what its write takes), under a lock timeout: with the
//! bug, `migrate` queues for its `ACCESS EXCLUSIVE` behind the worker while holding
//! `SHARE`, and one of the two fails.

use std::time::Duration;

use dedup_suite::unique_table;
use sqlx::{AssertSqlSafe, PgPool};

/// A writer that holds `table` as a worker's claim does, while `migrate` runs, then writes.
async fn migrate_beside_a_writer<F, Fut>(pool: &PgPool, table: &str, migrate: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'static,
{
    let mut writer = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE {table} IN ROW SHARE MODE"
    )))
    .execute(&mut *writer)
    .await
    .unwrap();
    let migrating = tokio::spawn(migrate());
    // `migrate` has had the time to take what it takes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *writer)
        .await
        .unwrap();
    let wrote = sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE {table} IN ROW EXCLUSIVE MODE"
    )))
    .execute(&mut *writer)
    .await;
    let committed = writer.commit().await;
    let migrated = tokio::time::timeout(Duration::from_secs(20), migrating)
        .await
        .expect("migrate ends")
        .unwrap();
    assert!(
        wrote.is_ok(),
        "the writer's write, while migrate ran: {wrote:?}"
    );
    committed.unwrap();
    migrated.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_migrate_leaves_a_running_writer_alone() {
    let pool = dedup_suite::postgres().await;
    let table = unique_table("regr_outbox_migrate");
    dedup_runtime::outbox::migrate_table(&pool, &table)
        .await
        .unwrap();
    let again = {
        let (pool, table) = (pool.clone(), table.clone());
        move || async move { dedup_runtime::outbox::migrate_table(&pool, &table).await }
    };
    migrate_beside_a_writer(&pool, &table, again).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_migrate_leaves_a_running_writer_alone() {
    let pool = dedup_suite::postgres().await;
    let table = unique_table("regr_inbox_migrate");
    dedup_runtime::inbox::migrate_table(&pool, &table)
        .await
        .unwrap();
    let again = {
        let (pool, table) = (pool.clone(), table.clone());
        move || async move { dedup_runtime::inbox::migrate_table(&pool, &table).await }
    };
    migrate_beside_a_writer(&pool, &table, again).await;
}
