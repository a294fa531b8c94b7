//! Issue 24, items 14, 15 and 16, on every backend where they apply:
//!
//! - 15: PostgreSQL's outbox `prune` with a very large age failed with an interval
//!   overflow (the age in microseconds, `i64::MAX` for `Duration::MAX`, times
//!   `interval '1 microsecond'`) instead of deleting nothing. `Outbox::prune` is gone
//!   (outbox rows are pruned as every table is, by `Prune::run_outbox`); there the
//!   largest age, `MAX_PRUNE_AGE`, reaches the statement and deletes nothing, on every
//!   backend, and a larger one is refused before any statement (`AgeTooLarge`).
//! - 14: SQLite: a relay on an outbox whose tables were never created failed with an
//!   untyped `Database` error, because its first statement writes the relays' sign of
//!   life into `<table>_relay`, a name the classifier did not know. It is
//!   `OutboxError::MissingTable` now, as on PostgreSQL and MariaDB.
//! - 16: the README said an empty outbox payload is refused, and it was accepted. It is
//!   accepted (brokers carry empty bodies), stored empty and sent empty, and the README
//!   says so.

use std::sync::Mutex;
use std::time::Duration;

use dedup_runtime::outbox::{Cause, Outbox, OutboxError, OutboxMessage, Publisher};
use dedup_runtime::{Prune, PruneError};
use dedup_suite::unique_table;

/// What the relay sent: each message's payload.
#[derive(Default)]
struct Payloads(Mutex<Vec<Vec<u8>>>);

impl Publisher for Payloads {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push(message.payload().to_vec());
        Ok(())
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, payload = $payload:literal) => {
        mod $backend {
            use super::*;

            /// One sent row (an empty payload), then prunes: the largest ages delete
            /// nothing and fail nothing; an age of zero deletes the row.
            #[tokio::test]
            async fn a_huge_prune_age_deletes_nothing_and_an_empty_payload_is_sent() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("outbox_regress");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-outbox-prune", "evt_1").unwrap();
                let message = cause.nth_outgoing(0, "events", b"");
                let mut conn = pool.acquire().await.unwrap();
                outbox.enqueue(&mut *conn, &message).await.unwrap();
                drop(conn);
                let stored: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    $payload,
                    outbox.table().name()
                )))
                .fetch_one(pool)
                .await
                .unwrap();
                assert!(stored.is_empty(), "the empty payload is stored empty");

                let sent = Payloads::default();
                let relayed = outbox.relay(pool).relay_batch(&sent).await.unwrap();
                assert_eq!(relayed.sent, 1);
                assert_eq!(*sent.0.lock().unwrap(), vec![Vec::<u8>::new()]);

                // The largest age pruning takes reaches the statement: nothing is that
                // old. Past it, `Prune` refuses the age before any statement.
                let oldest = dedup_runtime::MAX_PRUNE_AGE;
                let done = Prune::new(oldest, oldest)
                    .run_outbox(&outbox, pool, |_| {})
                    .await
                    .unwrap();
                assert_eq!(
                    done.deleted, 0,
                    "older than {oldest:?}: nothing is that old"
                );
                for age in [
                    Duration::MAX,
                    Duration::from_secs(u64::MAX / 2),
                    oldest + Duration::from_secs(1),
                ] {
                    let refused = Prune::new(age, oldest)
                        .run_outbox(&outbox, pool, |_| {})
                        .await;
                    assert!(
                        matches!(refused, Err(PruneError::AgeTooLarge { .. })),
                        "older than {age:?}: {refused:?}"
                    );
                }
                assert_eq!(outbox.stats(pool).await.unwrap().sent, 1, "the row is kept");
                tokio::time::sleep(Duration::from_millis(5)).await;
                let done = Prune::new(Duration::ZERO, Duration::ZERO)
                    .run_outbox(&outbox, pool, |_| {})
                    .await
                    .unwrap();
                assert_eq!(done.deleted, 1);
                assert_eq!(outbox.stats(pool).await.unwrap().sent, 0);
            }

            /// A relay on tables never created: `MissingTable`, naming the outbox.
            #[tokio::test]
            async fn a_relay_on_a_missing_table_is_a_typed_error() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = Outbox::new()
                    .in_table("outbox_regress_never_created")
                    .unwrap();
                match outbox.relay(pool).relay_batch(&Payloads::default()).await {
                    Err(error @ OutboxError::MissingTable { .. }) => assert!(
                        error.to_string().contains("outbox_regress_never_created"),
                        "{error}"
                    ),
                    other => panic!("expected a missing table, got {other:?}"),
                }
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    payload = "SELECT payload FROM {}"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    payload = "SELECT payload FROM {}"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    payload = "SELECT payload FROM {}"
);
