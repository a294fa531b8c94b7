//! The relay, message by message, on every backend: each row sent once, in order, and
//! marked sent; a poison row dead after its attempts while the rest flow; an ordering
//! key's dead head blocks only its key; 4 relays send each row once and never at once; a
//! stale relay's mark is refused; `run` relays until shutdown; rows committed out of
//! sequence order are all sent. On PostgreSQL, an idle relay wakes on a hint.

use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::outbox::{Cause, Outbox};
use dedup_suite::{unique, unique_table};
use tokio::sync::Notify;

use super::*;

macro_rules! relay_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        effect_count = $effect_count:literal,
        begin_writing = $begin_writing:literal,
        state = $state:literal,
        expire = $expire:literal,
        $(late_commits = $late:literal,)?
    ) => {
        mod $backend {
            use super::*;
            use crate::outbox::common::$backend::*;

            /// The relay commits its claim, sends each row with its id, destination and
            /// payload, in enqueue order, and marks it sent: a later pass finds nothing.
            #[tokio::test]
            async fn the_relay_sends_each_row_once_in_order_and_marks_it_sent() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-relay", "evt_1").unwrap();
                let payloads: [&[u8]; 5] = [b"a", b"b", b"\x00\xff", b"d", b"e"];
                let ids = enqueue_all(pool, &outbox, &cause, &payloads).await;
                let recorder = Recorder::default();
                let relay = outbox.relay(pool).batch(3);
                let first = relay.relay_batch(&recorder).await.unwrap();
                assert_eq!((first.claimed, first.sent), (3, 3));
                let second = relay.relay_batch(&recorder).await.unwrap();
                assert_eq!((second.claimed, second.sent), (2, 2));
                assert_eq!(relay.relay_batch(&recorder).await.unwrap().claimed, 0);
                let sent = recorder.sent.lock().unwrap().clone();
                let expected: Vec<_> = ids
                    .iter()
                    .zip(payloads)
                    .map(|(id, payload)| (*id, "events".to_owned(), payload.to_vec()))
                    .collect();
                assert_eq!(sent, expected);
                for id in ids {
                    assert_eq!(state(pool, &outbox, id).await, (2, 1, None), "{id}: sent");
                }
            }

            /// A poison row (the broker refuses it every time) is dead after its attempts,
            /// its error kept; the rows around it are sent, each once.
            #[tokio::test]
            async fn a_poison_row_goes_dead_after_its_attempts_while_the_rest_flow() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-poison", "evt_1").unwrap();
                let ids = enqueue_all(pool, &outbox, &cause, &[b"a", b"poison", b"c"]).await;
                let recorder = Recorder::default();
                let relay = outbox
                    .relay(pool)
                    .max_attempts(3)
                    .backoff(Duration::ZERO, Duration::ZERO);
                let mut dead = 0;
                for _ in 0..10 {
                    let relayed = relay.relay_batch(&recorder).await.unwrap();
                    dead += relayed.dead;
                    if relayed.claimed == 0 {
                        break;
                    }
                }
                assert_eq!(dead, 1);
                assert_eq!(recorder.sent_ids(), [ids[0], ids[2]]);
                assert_eq!(recorder.attempts.lock().unwrap()[&ids[1]], 3);
                let (row_state, attempts, last_error) = state(pool, &outbox, ids[1]).await;
                assert_eq!((row_state, attempts), (3, 3), "dead after 3 attempts");
                assert!(last_error.unwrap().contains("the broker refused"));
            }

            /// Messages of one ordering key go one at a time, in enqueue order; a dead
            /// head holds up its own key only.
            #[tokio::test]
            async fn an_ordering_key_s_dead_head_blocks_only_its_key() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-keys", "evt_1").unwrap();
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for (slot, payload, key) in [
                    ("k1-a", &b"poison"[..], Some("k1")),
                    ("k1-b", b"b", Some("k1")),
                    ("k2-a", b"c", Some("k2")),
                    ("k2-b", b"d", Some("k2")),
                    ("free", b"e", None),
                ] {
                    let mut message = cause.outgoing(slot, "events", payload).unwrap();
                    if let Some(key) = key {
                        message = message.ordering_key(key);
                    }
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();
                let recorder = Recorder::default();
                let relay = outbox.relay(pool).max_attempts(1);
                for _ in 0..10 {
                    if relay.relay_batch(&recorder).await.unwrap().claimed == 0 {
                        break;
                    }
                }
                let sent = recorder.sent_ids();
                assert_eq!(sent.len(), 3, "{sent:?}");
                assert!(sent.contains(&ids[4]));
                let k2: Vec<_> = sent
                    .iter()
                    .filter(|id| **id == ids[2] || **id == ids[3])
                    .collect();
                assert_eq!(k2, [&ids[2], &ids[3]], "k2 in order");
                assert_eq!(state(pool, &outbox, ids[0]).await.0, 3, "k1's head dead");
                assert_eq!(state(pool, &outbox, ids[1]).await, (0, 0, None), "k1 held up");
            }

            /// 4 relays over 200 rows: every row sent exactly once, and never by two
            /// relays at once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn four_relays_send_each_row_once_and_never_at_once() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-relays", "evt_1").unwrap();
                let payloads: Vec<Vec<u8>> =
                    (0..200).map(|n| format!("m{n}").into_bytes()).collect();
                let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
                let ids = enqueue_all(&pool, &outbox, &cause, &refs).await;
                let recorder = Arc::new(Recorder::default());
                let relays: Vec<_> = (0..4)
                    .map(|_| {
                        let (pool, outbox, recorder) =
                            (pool.clone(), outbox.clone(), recorder.clone());
                        tokio::spawn(async move {
                            let relay = outbox.relay(&pool).batch(8);
                            loop {
                                let relayed = relay.relay_batch(&*recorder).await.unwrap();
                                assert_eq!((relayed.lost, relayed.failed), (0, 0));
                                if relayed.claimed == 0 {
                                    return;
                                }
                            }
                        })
                    })
                    .collect();
                for relay in relays {
                    relay.await.unwrap();
                }
                assert_eq!(
                    recorder.overlaps.load(std::sync::atomic::Ordering::SeqCst),
                    0
                );
                let mut sent = recorder.sent_ids();
                assert_eq!(sent.len(), 200, "each once");
                sent.sort();
                sent.dedup();
                assert_eq!(sent.len(), 200);
                for id in [ids[0], ids[99], ids[199]] {
                    assert_eq!(state(&pool, &outbox, id).await, (2, 1, None));
                }
            }

            /// A relay paused in a send past its lease (no heartbeat) loses the row to
            /// another relay, which sends it; resumed, its mark is refused: a duplicate
            /// send with the same id, never a second row or a lost one.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_relay_s_mark_is_refused() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-stale", "evt_1").unwrap();
                let ids = enqueue_all(&pool, &outbox, &cause, &[b"hold"]).await;
                let recorder = Arc::new(Recorder::default());
                let stale = tokio::spawn({
                    let (pool, outbox, recorder) =
                        (pool.clone(), outbox.clone(), recorder.clone());
                    async move {
                        let relay = outbox
                            .relay(&pool)
                            .lease(Duration::from_secs(7200))
                            .heartbeat(Duration::from_secs(3600));
                        relay.relay_batch(&*recorder).await
                    }
                });
                tokio::time::timeout(Duration::from_secs(15), recorder.held.notified())
                    .await
                    .expect("in the send");
                expire(&pool, &outbox).await; // paused past its lease
                let quick = Quick(Mutex::new(Vec::new()));
                let taken = outbox.relay(&pool).relay_batch(&quick).await.unwrap();
                assert_eq!((taken.claimed, taken.sent), (1, 1), "taken over and sent");
                recorder.release.notify_one();
                let late = stale.await.unwrap().unwrap();
                assert_eq!((late.sent, late.lost), (0, 1), "{late:?}");
                assert_eq!(quick.0.lock().unwrap().clone(), ids, "sent again, same id");
                assert_eq!(recorder.sent_ids(), ids, "the stale send happened too");
                assert_eq!(state(&pool, &outbox, ids[0]).await, (2, 2, None));
            }

            /// `run` sends what arrives until its shutdown signal, then returns.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn run_relays_until_shutdown() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let recorder = Arc::new(Recorder::default());
                let stop = Arc::new(Notify::new());
                let task = tokio::spawn({
                    let (pool, outbox, recorder, stop) =
                        (pool.clone(), outbox.clone(), recorder.clone(), stop.clone());
                    async move {
                        let relay = outbox.relay(&pool).poll_interval(Duration::from_millis(20));
                        relay.run(&*recorder, stop.notified()).await.unwrap();
                    }
                });
                let cause = Cause::new("outbox-run", "evt_1").unwrap();
                let ids = enqueue_all(&pool, &outbox, &cause, &[b"a", b"b"]).await;
                tokio::time::timeout(Duration::from_secs(15), async {
                    while recorder.sent_ids().len() < 2 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("both sent");
                stop.notify_one();
                tokio::time::timeout(Duration::from_secs(15), task)
                    .await
                    .expect("run returns")
                    .unwrap();
                assert_eq!(recorder.sent_ids(), ids);
            }

            $(
            /// Rows are selected by their own state, never by a cursor: a row whose
            /// transaction commits after a later-numbered one is sent too.
            #[doc = $late]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rows_committed_out_of_sequence_order_are_all_sent() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-late", "evt_1").unwrap();
                let early = cause.outgoing("early", "events", b"early").unwrap();
                let mut slow = pool.begin().await.unwrap();
                outbox.enqueue(&mut *slow, &early).await.unwrap(); // the lower seq
                let later = enqueue_all(&pool, &outbox, &cause, &[b"later"]).await;
                let recorder = Recorder::default();
                let relay = outbox.relay(&pool);
                assert_eq!(relay.relay_batch(&recorder).await.unwrap().sent, 1);
                slow.commit().await.unwrap();
                assert_eq!(relay.relay_batch(&recorder).await.unwrap().sent, 1);
                assert_eq!(recorder.sent_ids(), [later[0], early.id()]);
            }
            )?
        }
    };
}

outbox_backends!(relay_suite);

/// PostgreSQL: a relay idle on a one-minute poll sends a message at once when the
/// handler's side hints after its commit (`Outbox::hint`, `LISTEN`/`NOTIFY`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relay_wakes_on_a_hint() {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    let name = unique("dedup-outbox-listen");
    let options: PgConnectOptions = dedup_suite::postgres_url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name))
        .await
        .unwrap();
    let table = unique_table("outbox");
    dedup_runtime::outbox::migrate_table(&pool, &table)
        .await
        .unwrap();
    let outbox = Outbox::new().in_table(&table).unwrap().notify_relay(true);
    let recorder = Arc::new(Recorder::default());
    let stop = Arc::new(Notify::new());
    let relay = tokio::spawn({
        let (pool, outbox, recorder, stop) =
            (pool.clone(), outbox.clone(), recorder.clone(), stop.clone());
        async move {
            // A poll interval of a minute: only a hint makes it look within the test.
            let relay = outbox.relay(&pool).poll_interval(Duration::from_secs(60));
            relay.run(&*recorder, stop.notified()).await.unwrap();
        }
    });
    let observer = dedup_suite::postgres().await;
    tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let listeners: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND query LIKE 'LISTEN%'",
            )
            .bind(&name)
            .fetch_one(&observer)
            .await
            .unwrap();
            if listeners > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the relay listens");
    // Let the relay go idle first (its first empty claim), then enqueue and hint.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cause = Cause::new("outbox-hint", "evt_1").unwrap();
    let message = cause.nth_outgoing(0, "events", b"p");
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut *tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    outbox.hint(&pool).await;
    tokio::time::timeout(Duration::from_secs(15), async {
        while recorder.sent_ids().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("woken by the hint, not the one-minute poll");
    assert_eq!(recorder.sent_ids(), [message.id()]);
    stop.notify_one();
    tokio::time::timeout(Duration::from_secs(15), relay)
        .await
        .expect("run returns")
        .unwrap();
}
