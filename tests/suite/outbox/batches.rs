//! The relay in batches, on every backend: it hands each claim to `publish_batch` once,
//! and a nack fails that row only; a stalled batch's mark changes nothing; shutdown
//! mid-batch finishes the batch and claims nothing more; ordering keys hold under two
//! batching relays.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dedup_runtime::outbox::{Cause, OutboxMessage, Publisher};
use tokio::sync::Notify;

use super::*;

/// A publisher that sends each claim together (`publish_batch`): it records the size of
/// every batch and each message's payload in the order it went out, refuses a `nack`
/// payload alone, and holds a batch with a `hold` payload until released.
#[derive(Default)]
struct Batching {
    batches: Mutex<Vec<usize>>,
    sent: Mutex<Vec<Vec<u8>>>,
    held: Notify,
    release: Notify,
}

impl Publisher for Batching {
    type Error = String;

    async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
        Err("the relay sends through publish_batch".to_owned())
    }

    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), String>> {
        self.batches.lock().unwrap().push(messages.len());
        if messages.iter().any(|message| message.payload() == b"hold") {
            self.held.notify_one();
            self.release.notified().await;
        }
        messages
            .iter()
            .map(|message| {
                if message.payload() == b"nack" {
                    return Err("nacked by the broker".to_owned());
                }
                self.sent.lock().unwrap().push(message.payload().to_vec());
                Ok(())
            })
            .collect()
    }
}

macro_rules! batches_suite {
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

            /// The relay hands its whole claim to `publish_batch` once, and marks what the
            /// broker has: a nack of one row in the batch fails that row only (its attempt,
            /// its error, due again later), the others are sent.
            #[tokio::test]
            async fn a_nack_in_a_batch_fails_that_row_only() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-batch-nack", "evt_1").unwrap();
                let payloads: [&[u8]; 5] = [b"a", b"b", b"nack", b"d", b"e"];
                let ids = enqueue_all(pool, &outbox, &cause, &payloads).await;
                let publisher = Batching::default();
                let relayed = outbox
                    .relay(pool)
                    .batch(10)
                    .relay_batch(&publisher)
                    .await
                    .unwrap();
                assert_eq!(
                    (relayed.claimed, relayed.sent, relayed.failed, relayed.lost),
                    (5, 4, 1, 0)
                );
                assert_eq!(
                    publisher.batches.lock().unwrap().clone(),
                    [5],
                    "one batch of 5"
                );
                for (id, payload) in ids.iter().zip(payloads) {
                    let (state, attempts, error) = state(pool, &outbox, *id).await;
                    if payload == b"nack" {
                        assert_eq!((state, attempts), (0, 1), "failed alone, due again");
                        assert!(error.unwrap().contains("nacked by the broker"));
                    } else {
                        assert_eq!((state, attempts, error), (2, 1, None), "sent");
                    }
                }
            }

            /// A relay stalled in its batch past its lease (no heartbeat) loses the rows
            /// to another relay, which sends them; resumed, its one mark for the batch
            /// changes nothing: duplicate sends with the same ids, never a lost row.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stalled_batch_s_mark_changes_nothing() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-batch-stale", "evt_1").unwrap();
                let ids = enqueue_all(&pool, &outbox, &cause, &[b"hold", b"b", b"c"]).await;
                let publisher = Arc::new(Batching::default());
                let stale = tokio::spawn({
                    let (pool, outbox, publisher) =
                        (pool.clone(), outbox.clone(), publisher.clone());
                    async move {
                        let relay = outbox
                            .relay(&pool)
                            .lease(Duration::from_secs(7200))
                            .heartbeat(Duration::from_secs(3600));
                        relay.relay_batch(&*publisher).await
                    }
                });
                tokio::time::timeout(Duration::from_secs(15), publisher.held.notified())
                    .await
                    .expect("in the batch");
                expire(&pool, &outbox).await; // paused past its lease
                let quick = Quick(Mutex::new(Vec::new()));
                let taken = outbox.relay(&pool).relay_batch(&quick).await.unwrap();
                assert_eq!((taken.claimed, taken.sent), (3, 3), "taken back and sent");
                publisher.release.notify_one();
                let late = stale.await.unwrap().unwrap();
                assert_eq!((late.sent, late.lost), (0, 3), "{late:?}");
                for id in ids {
                    // Sent by the second relay; its first row (the stalled claim's first)
                    // kept the stalled attempt, the others got theirs back.
                    let (state, _, error) = state(&pool, &outbox, id).await;
                    assert_eq!((state, error), (2, None), "{id}");
                }
            }

            /// At the shutdown signal, a claim whose sends had begun is finished — its
            /// confirms awaited, its rows marked — and nothing more is claimed.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_mid_batch_finishes_the_batch_and_claims_nothing_more() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-batch-shutdown", "evt_1").unwrap();
                let first = enqueue_all(&pool, &outbox, &cause, &[b"hold", b"b", b"c"]).await;
                let publisher = Arc::new(Batching::default());
                let stop = Arc::new(Notify::new());
                let task = tokio::spawn({
                    let (pool, outbox, publisher, stop) = (
                        pool.clone(),
                        outbox.clone(),
                        publisher.clone(),
                        stop.clone(),
                    );
                    async move {
                        let relay = outbox.relay(&pool).poll_interval(Duration::from_millis(20));
                        relay.run(&*publisher, stop.notified()).await
                    }
                });
                tokio::time::timeout(Duration::from_secs(15), publisher.held.notified())
                    .await
                    .expect("in the batch");
                stop.notify_one();
                let later = Cause::new("outbox-batch-shutdown", "evt_2").unwrap();
                let after = enqueue_all(&pool, &outbox, &later, &[b"x", b"y"]).await;
                publisher.release.notify_one();
                tokio::time::timeout(Duration::from_secs(15), task)
                    .await
                    .expect("run returns")
                    .unwrap()
                    .unwrap();
                for id in first {
                    assert_eq!(
                        state(&pool, &outbox, id).await,
                        (2, 1, None),
                        "{id}: finished"
                    );
                }
                for id in after {
                    assert_eq!(
                        state(&pool, &outbox, id).await,
                        (0, 0, None),
                        "{id}: not claimed"
                    );
                }
                assert_eq!(publisher.batches.lock().unwrap().clone(), [3]);
            }

            /// Two relays sending batches at once: each row once, and the messages of each
            /// ordering key in the order they were enqueued (each committed before the next).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ordering_keys_hold_under_two_batching_relays() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let outbox = own_outbox(&pool).await;
                let cause = Cause::new("outbox-batch-keys", "evt_1").unwrap();
                let mut slot = 0;
                for round in 0..8 {
                    for key in ["k0", "k1", "k2"] {
                        let payload = format!("{key}/{round}");
                        let message = cause
                            .nth_outgoing(slot, "events", payload.as_bytes())
                            .ordering_key(key);
                        slot += 1;
                        let mut tx = pool.begin().await.unwrap();
                        outbox.enqueue(&mut *tx, &message).await.unwrap();
                        tx.commit().await.unwrap();
                    }
                }
                let publisher = Arc::new(Batching::default());
                let relays = (0..2).map(|_| {
                    let (pool, outbox, publisher) =
                        (pool.clone(), outbox.clone(), publisher.clone());
                    tokio::spawn(async move {
                        let relay = outbox.relay(&pool).batch(5);
                        let mut sent = 0;
                        for _ in 0..200 {
                            let relayed = relay.relay_batch(&*publisher).await.unwrap();
                            sent += relayed.sent;
                            if relayed.claimed == 0 && publisher.sent.lock().unwrap().len() == 24 {
                                break;
                            }
                        }
                        sent
                    })
                });
                let mut sent = 0;
                for relay in relays {
                    sent += relay.await.unwrap();
                }
                assert_eq!(sent, 24, "each row marked once");
                let order = publisher.sent.lock().unwrap().clone();
                assert_eq!(order.len(), 24, "each row sent once");
                for key in ["k0", "k1", "k2"] {
                    let of_key: Vec<String> = order
                        .iter()
                        .map(|payload| String::from_utf8(payload.clone()).unwrap())
                        .filter(|payload| payload.starts_with(key))
                        .collect();
                    let expected: Vec<String> =
                        (0..8).map(|round| format!("{key}/{round}")).collect();
                    assert_eq!(of_key, expected, "{key} in enqueue order");
                }
            }
        }
    };
}

outbox_backends!(batches_suite);
