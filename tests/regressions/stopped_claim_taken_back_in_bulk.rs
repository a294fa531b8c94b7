//! Issue 24, item 5: a claim's attempt was counted for every row it took, and a stopped
//! worker's (or relay's) rows were taken over one per claim, each counting another attempt:
//! rows that never started lost attempts with every stop, and a worker stalled or cut off
//! from its database often enough buried messages whose handler never ran, as dead "the
//! worker stopped". A stopped claim is now taken back in bulk at the next claim: its first
//! unfinished row in the claim's order — the one in hand — keeps its attempt (dead with
//! the stop's text if it was the last), and the others get theirs back.
//!
//! The stopped worker is a claim nobody works through (`Worker::claim`, then nothing), or
//! a relay task aborted in its publisher; its lease is ended on the database's clock.

use std::sync::Arc;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_suite::{unique, unique_table};
use tokio::sync::Notify;

/// Processes every message; writes nothing of its own.
struct Nothing;

/// Holds the publish of a `hold` payload forever (its relay is aborted there); sends the
/// others.
struct Holding {
    held: Arc<Notify>,
}

impl Publisher for Holding {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        if message.payload() == b"hold" {
            self.held.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     inbox_state = $inbox_state:literal, inbox_expire = $inbox_expire:literal,
     outbox_state = $outbox_state:literal, outbox_expire = $outbox_expire:literal) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Nothing {
                type Error = sqlx::Error;

                async fn handle(&self, _: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    Ok(())
                }
            }

            async fn inbox_row(pool: &sqlx::Pool<$db>, consumer: &str, id: &str) -> (i64, i64, Option<String>) {
                sqlx::query_as($inbox_state)
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn receive(inbox: &Inbox<$db>, ids: &[&str]) {
                let messages: Vec<Incoming<'_>> =
                    ids.iter().map(|id| Incoming::new(id, b"p")).collect();
                for answer in inbox.receive_batch(&messages).await.unwrap() {
                    answer.unwrap();
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_workers_rows_come_back_at_once_and_only_the_one_in_hand_spent_its_attempt() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-takeback");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                receive(&inbox, &["m0", "m1", "m2", "m3"]).await;
                // Worker A claims all four and stops.
                let stopped = inbox.worker().max_attempts(2).batch(4).claim().await.unwrap();
                assert_eq!(stopped.messages().len(), 4);
                sqlx::query($inbox_expire).bind(&consumer).execute(pool).await.unwrap();
                // The next claim takes them all back, and processes all of them.
                let batch = inbox
                    .worker()
                    .max_attempts(2)
                    .batch(4)
                    .process_batch(&Nothing)
                    .await
                    .unwrap();
                assert_eq!((batch.claimed, batch.processed, batch.dead), (4, 4, 0));
                assert_eq!(inbox_row(pool, &consumer, "m0").await, (2, 2, None), "m0 was in hand");
                for id in ["m1", "m2", "m3"] {
                    assert_eq!(
                        inbox_row(pool, &consumer, id).await,
                        (2, 1, None),
                        "{id} never started: its first attempt processed it"
                    );
                }

                // On its last attempt, the row in hand is dead with what happened; the
                // rest are processed at their first.
                receive(&inbox, &["n0", "n1", "n2"]).await;
                let stopped = inbox.worker().max_attempts(1).batch(3).claim().await.unwrap();
                assert_eq!(stopped.messages().len(), 3);
                sqlx::query($inbox_expire).bind(&consumer).execute(pool).await.unwrap();
                let batch = inbox
                    .worker()
                    .max_attempts(1)
                    .batch(3)
                    .process_batch(&Nothing)
                    .await
                    .unwrap();
                assert_eq!((batch.claimed, batch.processed, batch.dead), (2, 2, 1));
                let (state, attempts, error) = inbox_row(pool, &consumer, "n0").await;
                assert_eq!((state, attempts), (3, 1));
                let error = error.unwrap();
                assert!(
                    error.starts_with("attempt 1: the worker stopped during this attempt"),
                    "{error}"
                );
                for id in ["n1", "n2"] {
                    assert_eq!(inbox_row(pool, &consumer, id).await, (2, 1, None), "{id}");
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_relays_rows_come_back_at_once_and_only_the_one_in_hand_spent_its_attempt() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_takeback");
                dedup_runtime::outbox::migrate_table(pool, &table).await.unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-takeback", "evt").unwrap();
                let payloads: [&[u8]; 4] = [b"hold", b"a", b"b", b"c"];
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for (slot, payload) in payloads.iter().enumerate() {
                    let message = cause.nth_outgoing(slot as u32, "events", payload);
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();
                // A relay claims all four and stops in the first send.
                let held = Arc::new(Notify::new());
                let task = tokio::spawn({
                    let (pool, outbox, held) = ((*db).clone(), outbox.clone(), held.clone());
                    async move {
                        let relay = outbox.relay(&pool).max_attempts(2).batch(4);
                        relay.relay_batch(&Holding { held }).await
                    }
                });
                tokio::time::timeout(std::time::Duration::from_secs(15), held.notified())
                    .await
                    .expect("the relay in its first send");
                task.abort();
                let _ = task.await;
                let expire = format!($outbox_expire, table);
                sqlx::query(sqlx::AssertSqlSafe(expire)).execute(pool).await.unwrap();
                // The next relay takes them all back; the first (in hand) is held again.
                let publisher = Holding { held: Arc::new(Notify::new()) };
                let state = |id: dedup_runtime::outbox::OutgoingId| {
                    let sql = format!($outbox_state, table);
                    async move {
                        sqlx::query_as::<_, (i64, i64, i64)>(sqlx::AssertSqlSafe(sql))
                            .bind(id.to_string())
                            .fetch_one(pool)
                            .await
                            .unwrap()
                    }
                };
                let relay = outbox.relay(pool).max_attempts(2).batch(4);
                let second = tokio::time::timeout(
                    std::time::Duration::from_millis(500),
                    relay.relay_batch(&publisher),
                )
                .await;
                assert!(second.is_err(), "held in the first send again");
                // (state, attempts, whether its lease ended): all four claimed again, under
                // the new relay's live lease.
                assert_eq!(state(ids[0]).await, (1, 2, 0), "the one in hand: its second attempt");
                for id in &ids[1..] {
                    assert_eq!(state(*id).await, (1, 1, 0), "{id}: never sent, its first attempt");
                }
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    inbox_state = "SELECT state::int8, attempts::int8, last_error FROM inbox_messages \
                   WHERE consumer = $1 AND message_id = $2",
    inbox_expire = "UPDATE inbox_messages SET lease_until = clock_timestamp() - interval '1 second' \
                    WHERE consumer = $1 AND state = 1",
    outbox_state = "SELECT state::int8, attempts::int8, \
                    (lease_until <= clock_timestamp())::int::int8 FROM {} WHERE id = $1::uuid",
    outbox_expire = "UPDATE {} SET lease_until = clock_timestamp() - interval '1 second' \
                     WHERE state = 1"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    inbox_state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error \
                   FROM inbox_messages WHERE consumer = ? AND message_id = ?",
    inbox_expire = "UPDATE inbox_messages SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
                    WHERE consumer = ? AND state = 1",
    outbox_state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), \
                    CAST(lease_until <= UTC_TIMESTAMP(6) AS SIGNED) FROM {} \
                    WHERE id = UNHEX(REPLACE(?, '-', ''))",
    outbox_expire = "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
                     WHERE state = 1"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    inbox_state = "SELECT state, attempts, last_error FROM inbox_messages \
                   WHERE consumer = ?1 AND message_id = ?2",
    inbox_expire = "UPDATE inbox_messages SET lease_until = \
                    strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
                    WHERE consumer = ?1 AND state = 1",
    outbox_state = "SELECT state, attempts, \
                    lease_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') FROM {} \
                    WHERE id = unhex(replace(?1, '-', ''))",
    outbox_expire = "UPDATE {} SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                     '-1 seconds') WHERE state = 1"
);
