//! Issue 24, item 17: the outbox's metrics carried no label that told two outboxes apart
//! (the README said `consumer`), so two outbox tables in one process overwrote each
//! other's gauges; and `dedup_inbox_processed_total` (like the relay's
//! `dedup_outbox_relayed_total`) missed what a batch had committed when the batch then
//! ended with an error. The outbox's metrics now carry its `table` (one outbox table
//! serves every consumer), and both batches count what they did before they return the
//! error. Checked on PostgreSQL and MariaDB (the labels and the counting are the
//! backend-neutral code's), each with a recorder of the test's own.

use std::future::Future;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_suite::{unique, unique_table};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// What a recorder recorded: `(name, sorted labels, value)`.
type Recorded = Vec<(String, Vec<(String, String)>, DebugValue)>;

/// Runs `test` with a recorder of its own, on a runtime of this thread; returns what it
/// recorded.
fn recorded(test: impl Future<Output = ()>) -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let mut labels: Vec<(String, String)> = key
                .key()
                .labels()
                .map(|label| (label.key().to_owned(), label.value().to_owned()))
                .collect();
            labels.sort();
            (key.key().name().to_owned(), labels, value)
        })
        .collect()
}

fn value<'a>(metrics: &'a Recorded, name: &str, labels: &[(&str, &str)]) -> Option<&'a DebugValue> {
    let mut wanted: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    wanted.sort();
    metrics
        .iter()
        .find(|(found, labels, _)| found == name && *labels == wanted)
        .map(|(_, _, value)| value)
}

/// Processes `first`; at `second`, closes the pool and fails, so that recording the
/// failure fails and the batch ends with an error.
struct ClosesThePool<DB: sqlx::Database>(sqlx::Pool<DB>);

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for ClosesThePool<$db> {
                type Error = String;

                async fn handle(&self, _: &mut $conn, message: &InboxMessage) -> Result<(), String> {
                    if message.id() == "first" {
                        return Ok(());
                    }
                    drop(self.0.close()); // closed at once; the future only waits
                    Err("the pool is closed".to_owned())
                }
            }

            #[test]
            fn two_outboxes_keep_their_own_gauges() {
                let (first, second) = (unique_table("regress_metrics_a"), unique_table("regress_metrics_b"));
                let metrics = recorded(async {
                    let db = $pool;
                    let pool: &sqlx::Pool<$db> = &db;
                    for (table, messages) in [(&first, 2u32), (&second, 3)] {
                        dedup_runtime::outbox::migrate_table(pool, table).await.unwrap();
                        let outbox = Outbox::new().in_table(table).unwrap();
                        let cause = Cause::new("regress-metrics", "evt").unwrap();
                        let mut tx = pool.begin().await.unwrap();
                        for n in 0..messages {
                            outbox.enqueue(&mut *tx, &cause.nth_outgoing(n, "events", b"p")).await.unwrap();
                        }
                        tx.commit().await.unwrap();
                        assert_eq!(outbox.stats(pool).await.unwrap().unsent, u64::from(messages));
                    }
                });
                for (table, messages) in [(&first, 2.0), (&second, 3.0)] {
                    let unsent = value(&metrics, "dedup_outbox_rows", &[("table", table), ("state", "unsent")]);
                    assert!(
                        matches!(unsent, Some(DebugValue::Gauge(v)) if v.0 == messages),
                        "{table}: {unsent:?}"
                    );
                    assert!(value(&metrics, "dedup_outbox_oldest_unsent_seconds", &[("table", table)]).is_some());
                }
            }

            #[test]
            fn a_batch_that_ends_with_an_error_counts_what_it_committed() {
                let consumer = unique("regress-metrics-early");
                let metrics = recorded(async {
                    let db = $pool;
                    let pool: &sqlx::Pool<$db> = &db;
                    dedup_runtime::inbox::migrate(pool).await.unwrap();
                    let inbox = Inbox::new(pool, &consumer).unwrap();
                    inbox.receive(Incoming::new("first", b"p")).await.unwrap();
                    inbox.receive(Incoming::new("second", b"p")).await.unwrap();
                    let handler = ClosesThePool(pool.clone());
                    let ended = inbox.worker().batch(2).process_batch(&handler).await;
                    assert!(ended.is_err(), "{ended:?}");
                    // The first one's effect and mark committed before the error.
                    let other = $pool;
                    let other: &sqlx::Pool<$db> = &other;
                    let stats = Inbox::new(other, &consumer).unwrap().stats().await.unwrap();
                    assert_eq!(stats.processed, 1);
                });
                let processed = value(
                    &metrics,
                    "dedup_inbox_processed_total",
                    &[("consumer", &consumer), ("outcome", "processed")],
                );
                assert!(matches!(processed, Some(DebugValue::Counter(1))), "{processed:?}");
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await)
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await)
);
