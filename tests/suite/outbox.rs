//! The outbox on PostgreSQL, MariaDB and SQLite (a temporary file): outgoing ids derived
//! from the cause, pinned by a table of values; an enqueue commits with its transaction or
//! rolls back with it; the same message twice is one row; the same id with another payload
//! is a typed error that leaves the caller's transaction usable; bad input is refused
//! before anything is written; inside an `#[idempotent]` body. Every case reads the rows
//! back.

use std::sync::Arc;

use dedup_runtime::outbox::{
    Cause, Enqueued, Health, InvalidCause, MAX_HEADERS_LEN, MAX_NAME_LEN, NAMESPACE, Outbox,
    OutboxError, OutboxMessage, OutgoingId, Publisher, Refused,
};
use dedup_runtime::{Duplicate, InvalidMessageId, Outcome, idempotent};
use dedup_suite::{unique, unique_table};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;

/// A publisher for the relay's tests, in the process: what a broker received, in order;
/// fails every send of a `poison` payload; holds the send of a `hold` payload until
/// released (`held` tells it got there). It also checks that no message is ever in two
/// sends at once.
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<(OutgoingId, String, Vec<u8>)>>,
    attempts: Mutex<HashMap<OutgoingId, u32>>,
    in_flight: Mutex<HashSet<OutgoingId>>,
    overlaps: std::sync::atomic::AtomicU32,
    held: Notify,
    release: Notify,
}

impl Publisher for Recorder {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        if !self.in_flight.lock().unwrap().insert(message.id()) {
            self.overlaps
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        *self
            .attempts
            .lock()
            .unwrap()
            .entry(message.id())
            .or_default() += 1;
        if message.payload() == b"hold" {
            self.held.notify_one();
            self.release.notified().await;
        }
        tokio::task::yield_now().await;
        self.in_flight.lock().unwrap().remove(&message.id());
        if message.payload() == b"poison" {
            return Err(format!("the broker refused {}", message.id()));
        }
        self.sent.lock().unwrap().push((
            message.id(),
            message.destination().to_owned(),
            message.payload().to_vec(),
        ));
        Ok(())
    }
}

impl Recorder {
    fn sent_ids(&self) -> Vec<OutgoingId> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _, _)| *id)
            .collect()
    }
}

/// A publisher that records the ids it sent, and never waits.
struct Quick(Mutex<Vec<OutgoingId>>);

impl Publisher for Quick {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push(message.id());
        Ok(())
    }
}

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

/// The outgoing ids of a few causes, as Python's `uuid.uuid5(NAMESPACE, consumer + "\0" +
/// id + "\0" + slot)` computes them: the scheme is the contract with every downstream
/// consumer, and never changes.
#[test]
fn outgoing_ids_are_uuid5_of_the_cause() {
    assert_eq!(
        NAMESPACE,
        uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_URL,
            b"https://github.com/dedup-rs/dedup/outbox"
        )
    );
    assert_eq!(
        NAMESPACE.to_string(),
        "f05ab860-2a3e-578c-897a-484e8894600b"
    );
    for (consumer, incoming, slot, id) in [
        (
            "billing",
            "evt_91c2",
            "invoice-created",
            "d52783e3-eaa0-5242-b33a-713ba7314074",
        ),
        (
            "billing",
            "evt_91c2",
            "0",
            "7bf0ced6-b86c-5a82-9307-5b3e83081f68",
        ),
        ("billing", "42", "0", "cf283d54-4a74-58d3-9800-bcae0a7f3ed0"),
        (
            "audit",
            "evt_91c2",
            "invoice-created",
            "6bd2b18b-b347-5d9d-b15a-e9999b98e422",
        ),
        (
            "billing",
            "évt",
            "a b",
            "918141a6-4cf8-58b8-a8a7-a8c4602b757a",
        ),
        ("a", "b", "c", "650a349e-1748-5269-a350-c138a283c8a8"),
    ] {
        let derived = OutgoingId::derive(consumer, incoming, slot).unwrap();
        assert_eq!(derived.to_string(), id, "{consumer} {incoming} {slot}");
        assert_eq!(derived.as_uuid().get_version_num(), 5);
    }
    // The id is the text `MessageKey` gives: the integer 42 is the id "42".
    let cause = Cause::new("billing", 42_u64).unwrap();
    assert_eq!(
        cause.nth_id(0).to_string(),
        "cf283d54-4a74-58d3-9800-bcae0a7f3ed0"
    );
    assert_eq!(cause.nth_id(0), cause.id("0").unwrap());
    assert_ne!(cause.nth_id(0), cause.nth_id(1));
    // Downstream it is a message key: its text.
    let id = OutgoingId::derive("a", "b", "c").unwrap();
    assert_eq!(
        dedup_runtime::MessageKey::message_id(&id).as_str(),
        "650a349e-1748-5269-a350-c138a283c8a8"
    );
    assert_eq!(OutgoingId::from_uuid(id.as_uuid()), id);
}

#[test]
fn bad_causes_and_slots_are_refused() {
    assert!(matches!(
        Cause::new("", "evt"),
        Err(InvalidCause::Consumer(_))
    ));
    assert!(matches!(
        Cause::new("billing", ""),
        Err(InvalidCause::MessageId(InvalidMessageId::Empty))
    ));
    assert!(matches!(
        Cause::new("billing", "a\0b"),
        Err(InvalidCause::MessageId(InvalidMessageId::ContainsNul {
            position: 1
        }))
    ));
    let cause = Cause::new("billing", "evt").unwrap();
    assert_eq!(cause.id(""), Err(InvalidCause::EmptySlot));
    assert_eq!(
        cause.id("a\0"),
        Err(InvalidCause::SlotContainsNul { position: 1 })
    );
    let long = "s".repeat(MAX_NAME_LEN + 1);
    assert_eq!(
        cause.id(&long),
        Err(InvalidCause::SlotTooLong { len: 256, max: 255 })
    );
    assert_eq!(
        cause.id(&long).unwrap_err().to_string(),
        "invalid outgoing slot: it is 256 bytes, over the limit of 255"
    );
    assert!(cause.id(&long[..MAX_NAME_LEN]).is_ok());
}

/// What a row holds: destination, payload, headers, ordering key, consumer, cause id,
/// slot, state, attempts.
type Stored = (
    String,
    Vec<u8>,
    Option<Vec<u8>>,
    Option<String>,
    String,
    String,
    String,
    i64,
    i64,
);

macro_rules! outbox_suite {
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

            async fn setup(pool: &sqlx::Pool<$db>) {
                dedup_runtime::outbox::migrate(pool).await.unwrap();
                dedup_suite::ddl(pool, $effects).await;
            }

            async fn row(pool: &sqlx::Pool<$db>, id: OutgoingId) -> Option<Stored> {
                sqlx::query_as($row)
                    .bind(id.to_string())
                    .fetch_optional(pool)
                    .await
                    .unwrap()
            }

            /// Rows of `consumer`'s causes.
            async fn rows(pool: &sqlx::Pool<$db>, consumer: &str) -> i64 {
                sqlx::query_scalar($count)
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn effects(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                sqlx::query_scalar($effect_count)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// An outbox of its own for a relay test (relays take every row of their
            /// table), migrated.
            async fn own_outbox(pool: &sqlx::Pool<$db>) -> Outbox {
                let table = unique_table("outbox");
                dedup_runtime::outbox::migrate_table(pool, &table).await.unwrap();
                Outbox::new().in_table(&table).unwrap()
            }

            /// Enqueues one message per payload, slots 0, 1, …, in one transaction.
            async fn enqueue_all(
                pool: &sqlx::Pool<$db>,
                outbox: &Outbox,
                cause: &Cause,
                payloads: &[&[u8]],
            ) -> Vec<OutgoingId> {
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for (index, payload) in payloads.iter().enumerate() {
                    let message = cause.nth_outgoing(index as u32, "events", payload);
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();
                ids
            }

            /// A row's state, attempts and last error.
            async fn state(
                pool: &sqlx::Pool<$db>,
                outbox: &Outbox,
                id: OutgoingId,
            ) -> (i64, i64, Option<String>) {
                let sql = format!($state, outbox.table().name());
                sqlx::query_as(sqlx::AssertSqlSafe(sql))
                    .bind(id.to_string())
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Every claim of `outbox` ends now, on the database's clock.
            async fn expire(pool: &sqlx::Pool<$db>, outbox: &Outbox) {
                let sql = format!($expire, outbox.table().name());
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await
                    .unwrap();
            }

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

            /// Stats by state, the oldest unsent row's age, the relay's last sign of life
            /// and the health it gives; pruning deletes sent rows only.
            #[tokio::test]
            async fn stats_health_and_pruning() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let minute = Duration::from_secs(60);
                assert_eq!(
                    outbox.health(pool, minute).await.unwrap(),
                    Health::RelayStale { last_seen: None },
                    "no relay ever ran"
                );
                let cause = Cause::new("outbox-stats", "evt_1").unwrap();
                enqueue_all(pool, &outbox, &cause, &[b"a", b"poison", b"c"]).await;
                let before = outbox.stats(pool).await.unwrap();
                assert_eq!(
                    (before.unsent, before.claimed, before.sent, before.dead),
                    (3, 0, 0, 0)
                );
                assert!(before.oldest_unsent.unwrap() < minute);
                assert_eq!(before.relay_last_seen, None);

                let relayed = outbox
                    .relay(pool)
                    .max_attempts(1)
                    .relay_batch(&Recorder::default())
                    .await
                    .unwrap();
                assert_eq!((relayed.sent, relayed.dead), (2, 1));
                let after = outbox.stats(pool).await.unwrap();
                assert_eq!(
                    (after.unsent, after.claimed, after.sent, after.dead),
                    (0, 0, 2, 1)
                );
                assert_eq!(after.oldest_unsent, None);
                assert!(after.relay_last_seen.unwrap() < minute);
                assert_eq!(outbox.health(pool, minute).await.unwrap(), Health::Healthy);

                let hour = Duration::from_secs(3600);
                let prune = |age, window| dedup_runtime::Prune::new(age, window);
                let early = prune(minute, hour).run_outbox(&outbox, pool, |_| {}).await;
                assert!(
                    matches!(early, Err(dedup_runtime::PruneError::WindowTooShort { .. })),
                    "{early:?}"
                );
                let young = prune(hour, hour).run_outbox(&outbox, pool, |_| {}).await.unwrap();
                assert_eq!((young.deleted, young.done), (0, true));
                #[allow(deprecated)] // the old shape, kept working
                let old_shape = outbox.prune(pool, hour).await.unwrap();
                assert_eq!(old_shape, 0);
                assert_eq!(outbox.stats(pool).await.unwrap().sent, 2, "nothing deleted yet");
                tokio::time::sleep(Duration::from_millis(5)).await;
                let mut seen = Vec::new();
                let done = prune(Duration::ZERO, Duration::ZERO)
                    .batch_size(1)
                    .run_outbox(&outbox, pool, |progress| seen.push(progress.deleted))
                    .await
                    .unwrap();
                assert_eq!(done.deleted, 2, "the sent rows");
                assert_eq!(seen, [1, 2, 2], "one row per batch, then the batch that found none");
                let pruned = outbox.stats(pool).await.unwrap();
                assert_eq!((pruned.sent, pruned.dead), (0, 1), "the dead row kept");
            }

            /// The operator's calls: a dead row listed with its error, re-queued and then
            /// sent once; another discarded, recorded as sent and never sent.
            #[tokio::test]
            async fn dead_rows_are_listed_requeued_and_discarded() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = own_outbox(pool).await;
                let cause = Cause::new("outbox-dead", "evt_1").unwrap();
                let ids = enqueue_all(pool, &outbox, &cause, &[b"poison", b"poison"]).await;
                let relay = outbox.relay(pool).max_attempts(1);
                let relayed = relay.relay_batch(&Recorder::default()).await.unwrap();
                assert_eq!(relayed.dead, 2);
                let dead = outbox.dead(pool, 10).await.unwrap();
                assert_eq!(dead.iter().map(|row| row.id).collect::<Vec<_>>(), ids);
                assert_eq!((dead[0].destination.as_str(), dead[0].attempts), ("events", 1));
                assert!(dead[0].last_error.as_deref().unwrap().contains("the broker refused"));

                // The first re-queued, and its broker takes it this time.
                assert!(outbox.requeue(pool, ids[0]).await.unwrap());
                assert!(!outbox.requeue(pool, ids[0]).await.unwrap(), "no longer dead");
                let quick = Quick(Mutex::new(Vec::new()));
                assert_eq!(relay.relay_batch(&quick).await.unwrap().sent, 1);
                assert_eq!(quick.0.lock().unwrap().clone(), [ids[0]]);
                assert_eq!(state(pool, &outbox, ids[0]).await.0, 2);

                // The second discarded: recorded as sent, never sent.
                assert!(outbox.discard(pool, ids[1]).await.unwrap());
                assert_eq!(relay.relay_batch(&quick).await.unwrap().claimed, 0);
                assert_eq!(quick.0.lock().unwrap().len(), 1);
                let (row_state, _, last_error) = state(pool, &outbox, ids[1]).await;
                assert_eq!(row_state, 2);
                assert!(last_error.is_some(), "its error kept");
                assert!(outbox.dead(pool, 10).await.unwrap().is_empty());
            }

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
                let relayed = outbox.relay(pool).batch(10).relay_batch(&publisher).await.unwrap();
                assert_eq!(
                    (relayed.claimed, relayed.sent, relayed.failed, relayed.lost),
                    (5, 4, 1, 0)
                );
                assert_eq!(publisher.batches.lock().unwrap().clone(), [5], "one batch of 5");
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
                    let (pool, outbox, publisher, stop) =
                        (pool.clone(), outbox.clone(), publisher.clone(), stop.clone());
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
                    assert_eq!(state(&pool, &outbox, id).await, (2, 1, None), "{id}: finished");
                }
                for id in after {
                    assert_eq!(state(&pool, &outbox, id).await, (0, 0, None), "{id}: not claimed");
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
                    let expected: Vec<String> = (0..8).map(|round| format!("{key}/{round}")).collect();
                    assert_eq!(of_key, expected, "{key} in enqueue order");
                }
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

            #[tokio::test]
            async fn an_enqueue_commits_with_its_transaction_and_rolls_back_with_it() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-tx");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let payload = b"\x00\xff{\"cents\": 4200}\n";
                let message = cause
                    .outgoing("invoice", "invoices", payload)
                    .unwrap()
                    .headers(br#"{"type": "invoice"}"#)
                    .ordering_key("order-42");

                let mut tx = pool.begin().await.unwrap();
                assert_eq!(
                    outbox.enqueue(&mut *tx, &message).await.unwrap(),
                    Enqueued::Stored
                );
                tx.rollback().await.unwrap();
                assert_eq!(row(pool, message.id()).await, None, "rolled back: no row");

                let mut tx = pool.begin().await.unwrap();
                assert_eq!(
                    outbox.enqueue(&mut *tx, &message).await.unwrap(),
                    Enqueued::Stored
                );
                tx.commit().await.unwrap();
                assert_eq!(
                    row(pool, message.id()).await,
                    Some((
                        "invoices".to_owned(),
                        payload.to_vec(),
                        Some(br#"{"type": "invoice"}"#.to_vec()),
                        Some("order-42".to_owned()),
                        consumer.clone(),
                        "evt_1".to_owned(),
                        "invoice".to_owned(),
                        0,
                        0,
                    )),
                    "committed: the row, byte for byte, unsent"
                );
            }

            #[tokio::test]
            async fn the_same_message_twice_is_one_row() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-twice");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let first = cause.nth_outgoing(0, "invoices", b"a");
                let second = cause.nth_outgoing(1, "invoices", b"a");
                let mut tx = pool.begin().await.unwrap();
                for (message, expected) in [
                    (&first, Enqueued::Stored),
                    (&first, Enqueued::Duplicate),
                    (&second, Enqueued::Stored),
                ] {
                    assert_eq!(outbox.enqueue(&mut *tx, message).await.unwrap(), expected);
                }
                tx.commit().await.unwrap();
                // The handler runs again (its commit's outcome was lost): the same ids.
                let again = Cause::new(&consumer, "evt_1").unwrap();
                let mut tx = pool.begin().await.unwrap();
                for index in 0..2 {
                    let message = again.nth_outgoing(index, "invoices", b"a");
                    assert_eq!(
                        outbox.enqueue(&mut *tx, &message).await.unwrap(),
                        Enqueued::Duplicate
                    );
                }
                tx.commit().await.unwrap();
                assert_eq!(rows(pool, &consumer).await, 2);
            }

            /// The same id with another payload is a typed error, and the caller's
            /// transaction goes on: its other writes commit (no aborted PostgreSQL
            /// transaction, no InnoDB rollback).
            #[tokio::test]
            async fn another_payload_under_the_same_id_is_a_conflict_and_the_transaction_goes_on() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-conflict");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let original = cause.outgoing("invoice", "invoices", b"4200").unwrap();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &original).await.unwrap();
                tx.commit().await.unwrap();

                let mut tx = pool.begin().await.unwrap();
                for changed in [
                    cause.outgoing("invoice", "invoices", b"4300").unwrap(),
                    cause.outgoing("invoice", "refunds", b"4200").unwrap(),
                ] {
                    match outbox.enqueue(&mut *tx, &changed).await {
                        Err(OutboxError::Conflict { id }) => assert_eq!(id, original.id()),
                        other => panic!("expected a conflict, got {other:?}"),
                    }
                }
                let effect = unique("effect");
                sqlx::query($effect)
                    .bind(&effect)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                assert_eq!(effects(pool, &effect).await, 1, "the transaction committed");
                let stored = row(pool, original.id()).await.unwrap();
                assert_eq!(
                    (stored.0.as_str(), stored.1.as_slice()),
                    ("invoices", &b"4200"[..])
                );
                let error = OutboxError::Conflict { id: original.id() };
                assert!(error.to_string().contains("use another slot"), "{error}");
            }

            #[tokio::test]
            async fn bad_input_is_refused_and_writes_nothing() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new().max_payload_len(16);
                let consumer = unique("outbox-refused");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let long = "d".repeat(MAX_NAME_LEN + 1);
                let headers = vec![b'h'; MAX_HEADERS_LEN + 1];
                let mut tx = pool.begin().await.unwrap();
                let cases = [
                    cause.nth_outgoing(0, "", b"p"),
                    cause.nth_outgoing(1, "a\0b", b"p"),
                    cause.nth_outgoing(2, &long, b"p"),
                    cause.nth_outgoing(3, "invoices", &[0; 17]),
                    cause.nth_outgoing(4, "invoices", b"p").headers(&headers),
                    cause.nth_outgoing(5, "invoices", b"p").ordering_key(""),
                ];
                let mut refusals = Vec::new();
                for message in &cases {
                    match outbox.enqueue(&mut *tx, message).await {
                        Err(OutboxError::Refused(refused)) => refusals.push(refused),
                        other => panic!("expected a refusal, got {other:?}"),
                    }
                }
                tx.commit().await.unwrap();
                assert_eq!(
                    refusals,
                    [
                        Refused::InvalidDestination("it is empty".into()),
                        Refused::InvalidDestination("it contains a NUL byte at 1".into()),
                        Refused::InvalidDestination(
                            "it is 256 bytes, over the limit of 255".into()
                        ),
                        Refused::PayloadTooLarge { len: 17, max: 16 },
                        Refused::HeadersTooLarge {
                            len: MAX_HEADERS_LEN + 1,
                            max: MAX_HEADERS_LEN
                        },
                        Refused::InvalidOrderingKey("it is empty".into()),
                    ]
                );
                assert_eq!(
                    OutboxError::Refused(refusals[3].clone()).to_string(),
                    "outgoing message refused by the outbox: the payload is 17 bytes, over \
                     the outbox's limit of 16 bytes: it is refused, never truncated"
                );
                assert_eq!(rows(pool, &consumer).await, 0);
            }

            #[tokio::test]
            async fn a_missing_table_is_a_typed_error() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = Outbox::new().in_table("outbox_never_created").unwrap();
                let cause = Cause::new("outbox-missing", "evt_1").unwrap();
                let mut conn = pool.acquire().await.unwrap();
                match outbox
                    .enqueue(&mut *conn, &cause.nth_outgoing(0, "invoices", b"p"))
                    .await
                {
                    Err(error @ OutboxError::MissingTable { .. }) => assert!(
                        error.to_string().contains("outbox_never_created"),
                        "{error}"
                    ),
                    other => panic!("expected a missing table, got {other:?}"),
                }
            }

            /// Two transactions enqueue the same message at once: one stores it, the
            /// other waits for it and finds it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_enqueues_of_one_message_store_one_row() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("outbox-concurrent");
                let barrier = Arc::new(tokio::sync::Barrier::new(2));
                let tasks: Vec<_> = (0..2)
                    .map(|_| {
                        let (pool, consumer, barrier) =
                            (pool.clone(), consumer.clone(), barrier.clone());
                        tokio::spawn(async move {
                            let outbox = Outbox::new();
                            let cause = Cause::new(&consumer, "evt_1").unwrap();
                            let message = cause.nth_outgoing(0, "invoices", b"p");
                            barrier.wait().await;
                            let mut tx = pool.begin_with($begin_writing).await.unwrap();
                            let enqueued = outbox.enqueue(&mut *tx, &message).await.unwrap();
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            tx.commit().await.unwrap();
                            enqueued
                        })
                    })
                    .collect();
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                answers.sort_by_key(|answer| *answer == Enqueued::Duplicate);
                assert_eq!(answers, [Enqueued::Stored, Enqueued::Duplicate]);
                assert_eq!(rows(&pool, &consumer).await, 1);
            }

            /// In an `#[idempotent]` body: the event commits with the effect and the dedup
            /// record; the redelivery is a duplicate and enqueues nothing; a failed body
            /// leaves no event.
            #[tokio::test]
            async fn inside_an_idempotent_body_the_event_commits_with_the_effect() {
                #[idempotent(consumer = "outbox-handler", key = id)]
                async fn handle(tx: &mut $conn, id: &str, fail: bool) -> Result<(), sqlx::Error> {
                    sqlx::query($effect).bind(id).execute(&mut *tx).await?;
                    let cause = Cause::new("outbox-handler", id)?;
                    let event = cause.outgoing("paid", "payments", id.as_bytes())?;
                    Outbox::new().enqueue(&mut *tx, &event).await?;
                    if fail {
                        return Err(sqlx::Error::Protocol("the body failed on purpose".into()));
                    }
                    Ok(())
                }

                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let id = unique("evt");
                let event = OutgoingId::derive("outbox-handler", id.as_str(), "paid").unwrap();
                assert!(handle(pool, &id, true).await.is_err());
                assert_eq!(
                    row(pool, event).await,
                    None,
                    "a failed body leaves no event"
                );
                assert_eq!(effects(pool, &id).await, 0);
                assert_eq!(
                    handle(pool, &id, false).await.unwrap(),
                    Outcome::Processed(())
                );
                assert_eq!(
                    handle(pool, &id, false).await.unwrap(),
                    Outcome::Duplicate(Duplicate::AlreadyProcessed)
                );
                let stored = row(pool, event).await.expect("the event");
                assert_eq!(
                    (stored.0.as_str(), stored.1),
                    ("payments", id.clone().into_bytes())
                );
                assert_eq!(effects(pool, &id).await, 1);
                assert_eq!(dedup_suite::claims(pool, "outbox-handler", &id).await, 1);
            }
        }
    };
}

outbox_suite!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    row = "SELECT destination, payload, headers, ordering_key, consumer, cause_id, slot, \
           state::int8, attempts::int8 FROM outbox_messages WHERE id = $1::uuid",
    count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = $1",
    effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects (message_id text NOT NULL)",
    effect = "INSERT INTO outbox_test_effects (message_id) VALUES ($1)",
    effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = $1",
    begin_writing = "BEGIN",
    state = "SELECT state::int8, attempts::int8, last_error FROM {} WHERE id = $1::uuid",
    expire = "UPDATE {} SET lease_until = clock_timestamp() - interval '1 second' WHERE state = 1",
    late_commits = "PostgreSQL allocates `seq` at the insert, and commits in any order.",
);
outbox_suite!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    row = "SELECT CAST(destination AS CHAR), payload, headers, CAST(ordering_key AS CHAR), \
           CAST(consumer AS CHAR), CAST(cause_id AS CHAR), CAST(slot AS CHAR), \
           CAST(state AS SIGNED), CAST(attempts AS SIGNED) FROM outbox_messages \
           WHERE id = UNHEX(REPLACE(?, '-', ''))",
    count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = ?",
    effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    effect = "INSERT INTO outbox_test_effects (message_id) VALUES (?)",
    effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = ?",
    begin_writing = "BEGIN",
    state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error FROM {} \
             WHERE id = UNHEX(REPLACE(?, '-', ''))",
    expire = "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE state = 1",
    late_commits =
        "MariaDB allocates `seq` (AUTO_INCREMENT) at the insert, and commits in any order.",
);
outbox_suite!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    row = "SELECT destination, payload, headers, ordering_key, consumer, cause_id, slot, \
           state, attempts FROM outbox_messages WHERE id = unhex(replace(?1, '-', ''))",
    count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = ?1",
    effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects (message_id TEXT NOT NULL)",
    effect = "INSERT INTO outbox_test_effects (message_id) VALUES (?1)",
    effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = ?1",
    begin_writing = "BEGIN IMMEDIATE",
    state = "SELECT state, attempts, last_error FROM {} WHERE id = unhex(replace(?1, '-', ''))",
    expire = "UPDATE {} SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE state = 1",
);

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

/// The operator's command (`examples/outbox.rs`) on a SQLite outbox with two dead rows:
/// stats, the dead rows with their error, one re-queued, one discarded, then pruned.
#[tokio::test]
async fn the_operator_command_lists_requeues_discards_and_prunes() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("outbox-ops", "evt_1").unwrap();
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for index in 0..2 {
        let message = cause.nth_outgoing(index, "events", b"poison");
        outbox.enqueue(&mut *tx, &message).await.unwrap();
        ids.push(message.id());
    }
    tx.commit().await.unwrap();
    let relayed = outbox
        .relay(&*db)
        .max_attempts(1)
        .relay_batch(&Recorder::default())
        .await
        .unwrap();
    assert_eq!(relayed.dead, 2);

    let program =
        tokio::task::spawn_blocking(|| dedup_suite::example_binary("", &["outbox"], "outbox"))
            .await
            .unwrap();
    let url = format!("sqlite:{}", db.path().display());
    let run = |args: Vec<String>| {
        let output = std::process::Command::new(&program)
            .args(&args)
            .args(["--database-url", &url])
            .env_remove("DATABASE_URL")
            .output()
            .expect("run the outbox command");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let words = |text: &[&str]| {
        text.iter()
            .map(|word| (*word).to_owned())
            .collect::<Vec<_>>()
    };
    let (code, out, err) = run(words(&["stats"]));
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("dead              2"), "{out}");
    assert!(out.contains("a relay last ran"), "{out}");
    let (code, out, _) = run(words(&["dead"]));
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&format!(
            "{}  to events  after 1 attempt(s): the broker refused",
            ids[0]
        )),
        "{out}"
    );
    let (code, out, _) = run(vec!["requeue".to_owned(), ids[0].to_string()]);
    assert_eq!(code, Some(0));
    assert!(out.contains(&format!("{}  re-queued", ids[0])), "{out}");
    let (code, out, _) = run(vec!["discard".to_owned(), ids[1].to_string()]);
    assert_eq!(code, Some(0));
    assert!(out.contains(&format!("{}  discarded", ids[1])), "{out}");
    let (code, _, err) = run(words(&["requeue", "not-a-uuid"]));
    assert_eq!(code, Some(2), "a bad id is a usage error");
    assert!(err.contains("not an outgoing id"), "{err}");
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (code, out, _) = run(words(&["prune", "--older-than-hours", "0"]));
    assert_eq!(code, Some(0));
    assert!(
        out.contains("1 sent message(s)"),
        "the discarded row: {out}"
    );
    let stats = outbox.stats(&*db).await.unwrap();
    assert_eq!(
        (stats.unsent, stats.sent, stats.dead),
        (1, 0, 0),
        "the re-queued row waits for the relay"
    );
}
