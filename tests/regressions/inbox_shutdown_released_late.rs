//! Issue 24, item 10: once `Worker::run`'s shutdown signal had come, the claimed rows not
//! started yet were released only after the message in hand finished (or at the shutdown
//! deadline), though the docs say at once: another worker waited for a slow handler
//! before it could take them. The worker now releases them as soon as the signal comes,
//! all but the row in hand, which its handler finishes and marks. On PostgreSQL and
//! MariaDB the release is seen while the handler is still held; on SQLite the handler's
//! transaction holds the only write lock, so the release waits for it — the end state is
//! checked there. Everywhere: the row in hand processed, the others pending with their
//! attempt not counted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_suite::unique;
use tokio::sync::Notify;

/// Holds the first message until `go`; the others pass.
#[derive(Default)]
struct Slow {
    held: Notify,
    go: Notify,
    finished: AtomicBool,
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, early = $early:expr,
     attempts = $attempts:literal) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Slow {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    _: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), sqlx::Error> {
                    if message.id() == "first" {
                        self.held.notify_one();
                        self.go.notified().await;
                        self.finished.store(true, Ordering::SeqCst);
                    }
                    Ok(())
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_unstarted_rows_are_released_at_the_signal() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-shutdown-release");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                for id in ["first", "second", "third"] {
                    inbox.receive(Incoming::new(id, b"p")).await.unwrap();
                }
                let slow = Slow::default();
                let stop = Notify::new();
                let worker = inbox
                    .worker()
                    .batch(3)
                    .shutdown_deadline(Duration::from_secs(60));
                let script = async {
                    slow.held.notified().await;
                    stop.notify_waiters();
                    if $early {
                        tokio::time::timeout(Duration::from_secs(10), async {
                            while inbox.stats().await.unwrap().pending < 2 {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        })
                        .await
                        .expect("the two unstarted rows are released while the first is held");
                        assert!(!slow.finished.load(Ordering::SeqCst));
                    } else {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    slow.go.notify_one();
                };
                let (ran, ()) = tokio::time::timeout(Duration::from_secs(30), async {
                    tokio::join!(worker.run(&slow, stop.notified()), script)
                })
                .await
                .expect("run returns once the message in hand is done");
                ran.unwrap();
                assert!(slow.finished.load(Ordering::SeqCst));
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.processed, stats.pending, stats.claimed), (1, 2, 0));
                let attempts: Vec<i64> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe($attempts.to_owned()))
                        .bind(&consumer)
                        .fetch_all(pool)
                        .await
                        .unwrap();
                assert_eq!(
                    attempts,
                    [0, 0],
                    "the released rows' attempts are not counted"
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    early = true,
    attempts = "SELECT attempts::int8 FROM inbox_messages WHERE consumer = $1 AND state = 0"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    early = true,
    attempts =
        "SELECT CAST(attempts AS SIGNED) FROM inbox_messages WHERE consumer = ? AND state = 0"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    early = false,
    attempts = "SELECT attempts FROM inbox_messages WHERE consumer = ?1 AND state = 0"
);
