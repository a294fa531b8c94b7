//! Issue 24, item 12: the outbox docs said an ordering key's messages go "in the order
//! they were enqueued", but the relay sees only committed rows: X enqueued in a
//! transaction still open and Y (same key) enqueued and committed after it were sent Y,
//! X. The docs now say the order that holds — a message enqueued after another of its key
//! committed is sent after it; of two transactions open at the same time, the one that
//! commits first may go first — and these tests check exactly that: with concurrent
//! producers on one key while a relay runs (every backend), and the open-transaction case
//! itself (PostgreSQL and MariaDB; SQLite's single writer cannot hold two open writes).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_suite::unique_table;

const PRODUCERS: usize = 4;
const EACH: usize = 12;

/// Records the payloads it sends, in order.
#[derive(Default)]
struct Sent(Mutex<Vec<String>>);

impl Publisher for Sent {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        let payload = String::from_utf8(message.payload().to_vec()).unwrap();
        self.0.lock().unwrap().push(payload);
        Ok(())
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            /// Producers that each enqueue their messages one transaction after another,
            /// all on one key, while a relay runs: every producer's messages are sent in
            /// its order, each once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_enqueued_after_another_committed_is_sent_after_it() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_outbox_order");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let sent = Sent::default();
                let producing = AtomicBool::new(true);
                let producers = (0..PRODUCERS).map(|producer| {
                    let outbox = outbox.clone();
                    async move {
                        let cause = Cause::new("regress-order", format!("p{producer}")).unwrap();
                        for n in 0..EACH {
                            let payload = format!("p{producer}-{n:02}");
                            let message = cause
                                .nth_outgoing(n as u32, "events", payload.as_bytes())
                                .ordering_key("the-key");
                            let mut tx = pool.begin().await.unwrap();
                            outbox.enqueue(&mut *tx, &message).await.unwrap();
                            tx.commit().await.unwrap();
                        }
                    }
                });
                let produce = async {
                    futures_util::future::join_all(producers).await;
                    producing.store(false, Ordering::SeqCst);
                };
                let relay = outbox.relay(pool).batch(4);
                let relaying = async {
                    loop {
                        let done = !producing.load(Ordering::SeqCst);
                        let relayed = relay.relay_batch(&sent).await.unwrap();
                        if done && relayed.claimed == 0 {
                            break;
                        }
                        if relayed.claimed == 0 {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                    }
                };
                tokio::join!(produce, relaying);
                let sent = sent.0.into_inner().unwrap();
                assert_eq!(sent.len(), PRODUCERS * EACH, "each once: {sent:?}");
                for producer in 0..PRODUCERS {
                    let prefix = format!("p{producer}-");
                    let own: Vec<&String> = sent
                        .iter()
                        .filter(|payload| payload.starts_with(&prefix))
                        .collect();
                    let mut ordered = own.clone();
                    ordered.sort();
                    assert_eq!(own, ordered, "producer {producer}'s messages in its order");
                }
                assert_eq!(
                    outbox.stats(pool).await.unwrap().sent,
                    (PRODUCERS * EACH) as u64
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await)
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await)
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await
);

/// The open-transaction case, where two writers can be open at once (not SQLite, whose
/// open transaction holds the only write lock).
macro_rules! open_transactions {
    ($backend:ident, db = $db:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            /// X enqueued in a transaction still open, Y (same key) enqueued and committed
            /// after it: the relay cannot see X, sends Y, and X once it commits — the
            /// exception the docs name.
            #[tokio::test]
            async fn of_two_open_transactions_the_first_committed_may_go_first() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_outbox_open");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-open", "evt").unwrap();
                let x = cause.nth_outgoing(0, "events", b"X").ordering_key("k");
                let y = cause.nth_outgoing(1, "events", b"Y").ordering_key("k");
                let mut open = pool.begin().await.unwrap();
                outbox.enqueue(&mut *open, &x).await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &y).await.unwrap();
                tx.commit().await.unwrap();
                let sent = Sent::default();
                let relay = outbox.relay(pool);
                assert_eq!(relay.relay_batch(&sent).await.unwrap().sent, 1);
                open.commit().await.unwrap();
                assert_eq!(relay.relay_batch(&sent).await.unwrap().sent, 1);
                assert_eq!(*sent.0.lock().unwrap(), ["Y", "X"]);
            }
        }
    };
}

mod open {
    use super::*;

    open_transactions!(
        postgres,
        db = sqlx::Postgres,
        pool = Box::new(dedup_suite::postgres().await)
    );
    open_transactions!(
        mysql,
        db = sqlx::MySql,
        pool = Box::new(dedup_suite::mysql().await)
    );
}
