//! Issue 24, item 9: on PostgreSQL, `Relay::run` and `Worker::run` listened for hints on
//! a connection taken from the caller's pool for as long as they ran: on a pool of one
//! connection nothing was left for the claims, every claim timed out, and the loop
//! retried forever, visible only in the logs. The listener now has a connection of its
//! own, outside the pool's count. Checked on every backend (the others poll): a relay and
//! a worker, each on a pool of one connection, send and process what is waiting.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, OutgoingId, Publisher};
use dedup_suite::{unique, unique_table};
use tokio::sync::Notify;

const MESSAGES: usize = 5;

struct Sent(Mutex<Vec<OutgoingId>>);

impl Publisher for Sent {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push(message.id());
        Ok(())
    }
}

struct Count(AtomicUsize);

/// Waits up to 30 s for `done`.
async fn until(what: &str, done: impl Fn() -> bool) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within 30 s on a pool of one connection"));
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Count {
                type Error = sqlx::Error;

                async fn handle(&self, _: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    self.0.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_relay_and_a_worker_run_on_a_pool_of_one_connection() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox_table = unique_table("regress_one_conn_outbox");
                dedup_runtime::outbox::migrate_table(pool, &outbox_table)
                    .await
                    .unwrap();
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let outbox = Outbox::new().in_table(&outbox_table).unwrap();
                let cause = Cause::new("regress-one-conn", "evt_1").unwrap();
                let mut tx = pool.begin().await.unwrap();
                for n in 0..MESSAGES {
                    let message = cause.nth_outgoing(n as u32, "events", b"p");
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                }
                tx.commit().await.unwrap();
                let consumer = unique("regress-one-conn");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                for n in 0..MESSAGES {
                    inbox.receive(Incoming::new(&n, b"p")).await.unwrap();
                }

                let sent = Sent(Mutex::new(Vec::new()));
                let processed = Count(AtomicUsize::new(0));
                let stop = Notify::new();
                let relay = outbox.relay(pool).poll_interval(Duration::from_millis(50));
                let worker = inbox.worker().poll_interval(Duration::from_millis(50));
                let running = async {
                    let (relayed, worked) = tokio::join!(
                        relay.run(&sent, stop.notified()),
                        worker.run(&processed, stop.notified()),
                    );
                    relayed.unwrap();
                    worked.unwrap();
                };
                let checks = async {
                    until("the relay sends", || {
                        sent.0.lock().unwrap().len() == MESSAGES
                    })
                    .await;
                    until("the worker processes", || {
                        processed.0.load(Ordering::SeqCst) == MESSAGES
                    })
                    .await;
                    stop.notify_waiters();
                };
                tokio::join!(running, checks);
                let stats = outbox.stats(pool).await.unwrap();
                assert_eq!(stats.sent, MESSAGES as u64);
                assert_eq!(inbox.stats().await.unwrap().processed, MESSAGES as u64);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(one(&dedup_suite::postgres_url()).await)
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(one(&dedup_suite::mysql_url()).await)
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite_with(1, Duration::from_secs(10)).await
);

/// A pool of exactly one connection on the server at `url`.
async fn one<DB: dedup_runtime::Backend>(url: &str) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .unwrap()
}
