//! Issue 24, item 13: `Lease::extend` after `Lease::transaction` failed with `LeaseLost`
//! though the lease was still the call's own: the completion transaction had already
//! marked the row processed (`state` NULL), and the renewal's statement requires a row in
//! progress. From the completion transaction on, the row is locked until its commit and
//! nobody can take it over: `extend` has nothing to renew and succeeds. Checked on every
//! backend, with the call's result and its dedup row read back.

use dedup_runtime::{Lease, LeaseOutcome, idempotent};
use dedup_suite::unique;

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, effects = $effects:literal, record = $record:literal) => {
        mod $backend {
            use super::*;

            /// Writes the result in the completion transaction, then renews the lease
            /// (a long tail of work after the write, say), then renews again.
            #[idempotent(consumer = "regress-extend", key = id, effect = "send-first", lease = "30s")]
            async fn call(lease: &mut Lease<'_, $db>, id: &str) -> Result<u32, sqlx::Error> {
                lease.extend().await?; // before: a renewal by statement
                let tx = lease.transaction().await?;
                sqlx::query($record).bind(id).execute(&mut *tx).await?;
                lease.extend().await?;
                lease.extend().await?;
                Ok(7)
            }

            #[tokio::test]
            async fn extend_after_the_completion_transaction_keeps_the_lease() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                let id = unique("regress-extend");
                let outcome = call(pool, &id).await.unwrap();
                assert_eq!(outcome, LeaseOutcome::Processed(7));
                assert_eq!(
                    dedup_suite::rows(pool, "regress_extend_results", "message_id", &id).await,
                    1,
                    "the result committed with the mark"
                );
                assert_eq!(
                    dedup_suite::rows(pool, "processed_messages", "message_id", &id).await,
                    1
                );
                // The row is processed: a copy is a duplicate, and the body does not run.
                let again = call(pool, &id).await.unwrap();
                assert!(again.is_duplicate(), "{again:?}");
                assert_eq!(
                    dedup_suite::rows(pool, "regress_extend_results", "message_id", &id).await,
                    1
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_extend_results (message_id text NOT NULL)",
    record = "INSERT INTO regress_extend_results (message_id) VALUES ($1)"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_extend_results \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    record = "INSERT INTO regress_extend_results (message_id) VALUES (?)"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS regress_extend_results (message_id TEXT NOT NULL)",
    record = "INSERT INTO regress_extend_results (message_id) VALUES (?1)"
);
