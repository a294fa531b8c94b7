//! The outbox's trace context (issue 25, item 4) on PostgreSQL, MariaDB and SQLite: a
//! W3C `traceparent` given to an outgoing message (or by the outbox's `trace_context`
//! hook) is stored with the row and handed to the publisher byte for byte; a message
//! without one has none; a value that is not a `traceparent` (one byte short or over,
//! uppercase, a zero trace or parent id, another version) is refused before anything is
//! written, whoever gave it; an outbox table made before the column gets it from
//! `migrate_table`.

use std::sync::Mutex;

use dedup_runtime::outbox::{
    Cause, Outbox, OutboxError, OutboxMessage, Publisher, Refused, TRACEPARENT_LEN,
};
use dedup_suite::{unique, unique_table};

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const HOOKED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

/// What the relay handed over: each message's payload and trace context.
#[derive(Default)]
struct Seen(Mutex<Vec<(Vec<u8>, Option<String>)>>);

impl Publisher for Seen {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push((
            message.payload().to_vec(),
            message.traceparent().map(str::to_owned),
        ));
        Ok(())
    }
}

fn hook() -> Option<String> {
    Some(HOOKED.to_owned())
}

fn bad_hook() -> Option<String> {
    Some("00-xyz".to_owned())
}

macro_rules! trace_suite {
    (
        $backend:ident,
        db = $db:ty,
        pool = $pool:expr,
        count = $count:literal,
        old_column = $old_column:literal,
    ) => {
        mod $backend {
            use super::*;

            async fn rows(pool: &sqlx::Pool<$db>, table: &str, consumer: &str) -> i64 {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, table)))
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Given, hooked, none: each reaches the publisher as it was enqueued.
            #[tokio::test]
            async fn the_trace_context_reaches_the_publisher() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::outbox::migrate(pool).await.unwrap();
                let table = unique_table("outbox_trace");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let plain = Outbox::new().in_table(&table).unwrap();
                let hooked = plain.clone().trace_context(hook);
                let cause = Cause::new("outbox-trace", unique("in")).unwrap();
                let mut tx = pool.begin().await.unwrap();
                let given = cause.nth_outgoing(0, "d", b"given").traceparent(PARENT);
                // The hook does not override a context given to the message.
                hooked.enqueue(&mut *tx, &given).await.unwrap();
                hooked
                    .enqueue(&mut *tx, &cause.nth_outgoing(1, "d", b"hooked"))
                    .await
                    .unwrap();
                plain
                    .enqueue(&mut *tx, &cause.nth_outgoing(2, "d", b"none"))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                let seen = Seen::default();
                let relayed = plain.relay(pool).relay_batch(&seen).await.unwrap();
                assert_eq!(relayed.sent, 3);
                assert_eq!(
                    *seen.0.lock().unwrap(),
                    vec![
                        (b"given".to_vec(), Some(PARENT.to_owned())),
                        (b"hooked".to_vec(), Some(HOOKED.to_owned())),
                        (b"none".to_vec(), None),
                    ]
                );
            }

            /// Every way a value is not a traceparent is refused, nothing written; the
            /// length is exactly 55.
            #[tokio::test]
            async fn a_bad_traceparent_is_refused_before_anything_is_written() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::outbox::migrate(pool).await.unwrap();
                let outbox = Outbox::new();
                let consumer = unique("outbox-trace-bad");
                let cause = Cause::new(&consumer, "in-1").unwrap();
                assert_eq!(PARENT.len(), TRACEPARENT_LEN);
                let long = format!("{PARENT}0");
                let upper = PARENT.to_uppercase();
                let zero_trace = format!("00-{}-00f067aa0ba902b7-01", "0".repeat(32));
                let zero_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01";
                let version = "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
                let dashes = "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
                for bad in [
                    "",
                    &PARENT[..54],
                    long.as_str(),
                    upper.as_str(),
                    zero_trace.as_str(),
                    zero_parent,
                    version,
                    dashes,
                ] {
                    let mut tx = pool.begin().await.unwrap();
                    let message = cause.nth_outgoing(0, "d", b"p").traceparent(bad);
                    let error = outbox.enqueue(&mut *tx, &message).await.unwrap_err();
                    assert!(
                        matches!(error, OutboxError::Refused(Refused::InvalidTraceparent(_))),
                        "{bad:?}: {error}"
                    );
                    tx.commit().await.unwrap();
                }
                let mut tx = pool.begin().await.unwrap();
                let error = outbox
                    .clone()
                    .trace_context(bad_hook)
                    .enqueue(&mut *tx, &cause.nth_outgoing(0, "d", b"p"))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(error, OutboxError::Refused(Refused::InvalidTraceparent(_))),
                    "the hook's value is checked too: {error}"
                );
                tx.commit().await.unwrap();
                assert_eq!(rows(pool, "outbox_messages", &consumer).await, 0);
                let mut tx = pool.begin().await.unwrap();
                let good = cause.nth_outgoing(0, "d", b"p").traceparent(PARENT);
                outbox.enqueue(&mut *tx, &good).await.unwrap();
                tx.commit().await.unwrap();
                assert_eq!(rows(pool, "outbox_messages", &consumer).await, 1);
            }

            /// An outbox table made before the trace context was stored: `migrate_table`
            /// adds the column, and run again changes nothing.
            #[tokio::test]
            async fn migrate_adds_the_column_to_an_older_table() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("outbox_trace_old");
                let ddl = dedup_runtime::outbox::schema_sql::<$db>(&table).unwrap();
                let old = ddl.replace($old_column, "");
                assert_ne!(old, ddl, "the column is in the current DDL");
                sqlx::raw_sql(sqlx::AssertSqlSafe(old))
                    .execute(pool)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let consumer = unique("outbox-trace-old");
                let cause = Cause::new(&consumer, "in-1").unwrap();
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let mut tx = pool.begin().await.unwrap();
                let message = cause.nth_outgoing(0, "d", b"p").traceparent(PARENT);
                outbox.enqueue(&mut *tx, &message).await.unwrap();
                tx.commit().await.unwrap();
                let seen = Seen::default();
                assert_eq!(outbox.relay(pool).relay_batch(&seen).await.unwrap().sent, 1);
                assert_eq!(
                    *seen.0.lock().unwrap(),
                    vec![(b"p".to_vec(), Some(PARENT.to_owned()))]
                );
                assert_eq!(rows(pool, &table, &consumer).await, 1);
            }
        }
    };
}

trace_suite!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    count = "SELECT COUNT(*) FROM {} WHERE consumer = $1",
    old_column = "traceparent     text,\n    ",
);
trace_suite!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    count = "SELECT COUNT(*) FROM {} WHERE consumer = ?",
    old_column = "traceparent     VARBINARY(55) NULL,\n    ",
);
trace_suite!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    count = "SELECT COUNT(*) FROM {} WHERE consumer = ?1",
    old_column = "traceparent     TEXT,\n    ",
);
