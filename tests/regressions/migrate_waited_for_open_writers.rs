//! PostgreSQL: `migrate` ran `CREATE INDEX IF NOT EXISTS` on every call — on the dedup
//! table (`…_processed_at_idx`) and on the inbox's and the outbox's tables. The statement
//! takes its `SHARE` lock before it looks whether the index exists: it waited for every
//! open transaction that had written to the table (a handler's claim, its `enqueue`, a
//! receive), and every writer after it queued behind it. A service starting beside one
//! long handler transaction stalled every other handler until that transaction ended.
//! (The MySQL counterpart: `mysql_migrate_waited_for_open_transactions`.) An index that
//! exists is now left alone: the catalog is asked first (`to_regclass`, no lock).

use std::time::Duration;

use dedup_runtime::{Outcome, idempotent};
use dedup_suite::unique_table;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

#[idempotent(consumer = "regress-pg-migrate", key = id)]
async fn handle(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

/// Holds `table` as a writer's open transaction does (`ROW EXCLUSIVE`) while `migrate`
/// runs beside it, and while `beside` (another writer) runs: both must end first.
async fn migrate_beside_an_open_writer<M, B>(pool: &PgPool, table: &str, migrate: M, beside: B)
where
    M: std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'static,
    B: std::future::Future<Output = ()>,
{
    let mut open = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE {table} IN ROW EXCLUSIVE MODE"
    )))
    .execute(&mut *open)
    .await
    .unwrap();
    let migrating = tokio::spawn(migrate);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let wrote = tokio::time::timeout(Duration::from_secs(10), beside).await;
    let migrated = tokio::time::timeout(Duration::from_secs(10), migrating).await;
    open.rollback().await.unwrap();
    wrote.expect("a writer beside migrate is not stalled");
    migrated
        .expect("migrate does not wait for the open transaction")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_migrate_beside_an_open_handler_stalls_no_claim() {
    let pool = dedup_suite::postgres().await;
    let table = unique_table("regr_pg_migrate_dedup");
    dedup_runtime::migrate_table(&pool, &table).await.unwrap();
    let again = {
        let (pool, table) = (pool.clone(), table.clone());
        async move { dedup_runtime::migrate_table(&pool, &table).await }
    };
    let writer = {
        let pool = pool.clone();
        let table = table.clone();
        async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_id) VALUES ('w', 'w')"
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    migrate_beside_an_open_writer(&pool, &table, again, writer).await;
    // And the default table, with a generated handler's claim beside it.
    let id = dedup_suite::unique("claim");
    let again = {
        let pool = pool.clone();
        async move { dedup_runtime::migrate(&pool).await }
    };
    let claim = async {
        assert_eq!(handle(&pool, &id).await.unwrap(), Outcome::Processed(()));
    };
    migrate_beside_an_open_writer(&pool, "processed_messages", again, claim).await;
    assert_eq!(
        dedup_suite::claims(&pool, "regress-pg-migrate", &id).await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_and_outbox_migrate_beside_an_open_writer() {
    let pool = dedup_suite::postgres().await;
    for outbox in [false, true] {
        let table = unique_table(if outbox {
            "regr_pg_migrate_out"
        } else {
            "regr_pg_migrate_in"
        });
        let migrate = |pool: PgPool, table: String| async move {
            if outbox {
                dedup_runtime::outbox::migrate_table(&pool, &table).await
            } else {
                dedup_runtime::inbox::migrate_table(&pool, &table).await
            }
        };
        migrate(pool.clone(), table.clone()).await.unwrap();
        let writer = {
            let (pool, table) = (pool.clone(), table.clone());
            // What a receive or an enqueue takes, in a transaction of its own.
            async move {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "BEGIN; LOCK TABLE {table} IN ROW EXCLUSIVE MODE; COMMIT"
                )))
                .execute(&pool)
                .await
                .unwrap();
            }
        };
        migrate_beside_an_open_writer(&pool, &table, migrate(pool.clone(), table.clone()), writer)
            .await;
    }
}
