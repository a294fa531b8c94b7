//! The inbox (issue 12), on every backend: receiving. The same id three times is one row;
//! two consumers of one message each get it; payloads and headers round-trip byte for
//! byte; a batch answers per message, in order, with in-batch duplicates, earlier
//! duplicates and refused messages told apart; bad ids and oversized payloads are typed
//! refusals that write nothing; concurrent receivers of the same ids store each once.
//! Workers: 4 workers × 2,000 messages, each processed exactly once; a poison message dead
//! after its attempts, the others done, then re-queued and processed once; a worker
//! stopped mid-handler (its task aborted) taken over after its lease, and a message that
//! stops its worker every time dead after its attempts; a paused worker's stale claim
//! refused; graceful shutdown. Every case reads the rows back (effects and marks).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_runtime::InvalidMessageId;
use dedup_runtime::inbox::{
    BatchReport, DEFAULT_MAX_PAYLOAD_LEN, HINT_GAP, Inbox, InboxError, InboxHandler, InboxMessage,
    Incoming, MAX_BATCH, Processed, Received, Refused, Worker,
};
use dedup_suite::unique;
use tokio::sync::Notify;
use tokio::time::timeout;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// The lease of the heartbeat tests, and their heartbeat.
const LEASE: Duration = Duration::from_millis(250);
const BEAT: Duration = Duration::from_millis(50);

/// Holds a handler: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Hold {
    entered: Notify,
    go: Notify,
}

impl Hold {
    async fn here(&self) {
        self.entered.notify_one();
        self.go.notified().await;
    }
}

/// What a row holds: payload, headers, state, attempts.
type Stored = (Option<Vec<u8>>, Option<Vec<u8>>, i64, i64);

macro_rules! inbox_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        group = $group:literal,
        state = $state:literal,
        expire = $expire:literal,
        age = $age:literal,
        url = |$db_ident:ident| $url:expr,
        $(takeover_mid_handler = $takeover:literal,)?
    ) => {
        mod $backend {
            use super::*;

            /// The handler: one effect row per run; fails while `poison` names the message;
            /// stops at `hold` (if any) before its effect.
            #[derive(Default)]
            struct Effects {
                poison: std::sync::Mutex<Option<String>>,
                hold: Option<Arc<Hold>>,
                runs: AtomicU32,
            }

            impl InboxHandler<$db> for Effects {
                type Error = String;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), String> {
                    self.runs.fetch_add(1, Ordering::SeqCst);
                    if let Some(hold) = &self.hold {
                        hold.here().await;
                    }
                    sqlx::query($effect)
                        .bind(message.id())
                        .execute(&mut *tx)
                        .await
                        .map_err(|error| error.to_string())?;
                    let poisoned = self.poison.lock().unwrap().as_deref() == Some(message.id());
                    if poisoned {
                        return Err(format!("cannot process {}: poison", message.id()));
                    }
                    Ok(())
                }
            }

            async fn setup(pool: &sqlx::Pool<$db>) {
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                dedup_suite::ddl(pool, $effects).await;
            }

            /// Effect rows per message id of `consumer` (ids are `<consumer>/<n>`).
            async fn effects(pool: &sqlx::Pool<$db>, consumer: &str) -> HashMap<String, i64> {
                sqlx::query_as($group)
                    .bind(format!("{consumer}/%"))
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            /// A row's state, attempts and last error.
            async fn state(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                id: &str,
            ) -> (i64, i64, Option<String>) {
                sqlx::query_as($state)
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Every claim of `consumer` ends now, on the database's clock.
            async fn expire(pool: &sqlx::Pool<$db>, consumer: &str) {
                sqlx::query($expire)
                    .bind(consumer)
                    .execute(pool)
                    .await
                    .unwrap();
            }

            async fn receive_all(inbox: &Inbox<$db>, count: usize) -> Vec<String> {
                let ids: Vec<String> = (0..count)
                    .map(|n| format!("{}/{n}", inbox.consumer()))
                    .collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|id| Incoming::new(id.as_str(), b"p"))
                    .collect();
                for answer in inbox.receive_batch(&batch).await.unwrap() {
                    assert_eq!(answer, Ok(Received::Stored));
                }
                ids
            }

            /// A worker's `process_batch` in a task of its own, `configure`d, its handler
            /// stopping at `hold` before each effect.
            fn held_worker(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                hold: &Arc<Hold>,
                configure: fn(Worker<$db>) -> Worker<$db>,
            ) -> tokio::task::JoinHandle<Result<BatchReport, InboxError>> {
                let (pool, consumer, hold) = (pool.clone(), consumer.to_owned(), hold.clone());
                tokio::spawn(async move {
                    let inbox = Inbox::new(&pool, &consumer).unwrap();
                    let handler = Effects {
                        hold: Some(hold),
                        ..Effects::default()
                    };
                    configure(inbox.worker()).process_batch(&handler).await
                })
            }

            /// A worker's `run` in a task of its own, `configure`d, until `stop` is
            /// notified, its handler stopping at `hold` before each effect; the task
            /// returns the handler's runs.
            fn held_run(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                hold: &Arc<Hold>,
                stop: &Arc<Notify>,
                configure: fn(Worker<$db>) -> Worker<$db>,
            ) -> tokio::task::JoinHandle<u32> {
                let (pool, consumer, hold, stop) =
                    (pool.clone(), consumer.to_owned(), hold.clone(), stop.clone());
                tokio::spawn(async move {
                    let inbox = Inbox::new(&pool, &consumer).unwrap();
                    let handler = Effects {
                        hold: Some(hold),
                        ..Effects::default()
                    };
                    configure(inbox.worker()).run(&handler, stop.notified()).await.unwrap();
                    handler.runs.load(Ordering::SeqCst)
                })
            }

            /// 4 workers, 2,000 messages: each processed exactly once, effects and marks.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn four_workers_process_each_message_exactly_once() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-workers");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 2_000).await;
                assert_eq!(
                    inbox.backlog(500).await.unwrap(),
                    500,
                    "counted up to the limit"
                );
                assert_eq!(inbox.backlog(5_000).await.unwrap(), 2_000);
                let handler = Arc::new(Effects::default());
                let workers: Vec<_> = (0..4)
                    .map(|_| {
                        let (pool, consumer, handler) =
                            (pool.clone(), consumer.clone(), handler.clone());
                        tokio::spawn(async move {
                            let inbox = Inbox::new(&pool, &consumer).unwrap();
                            let worker = inbox.worker().batch(8);
                            let mut processed = 0;
                            loop {
                                let batch = worker.process_batch(&*handler).await.unwrap();
                                assert_eq!(
                                    (batch.failed, batch.dead, batch.lost),
                                    (0, 0, 0),
                                    "{batch:?}"
                                );
                                processed += batch.processed;
                                if batch.claimed == 0 {
                                    return processed;
                                }
                            }
                        })
                    })
                    .collect();
                let mut total = 0;
                for worker in workers {
                    total += worker.await.unwrap();
                }
                assert_eq!(total, 2_000);
                // A transaction the database ended (a deadlock) runs again: its handler too,
                // its first run rolled back.
                let runs = handler.runs.load(Ordering::SeqCst);
                assert!(runs >= 2_000, "{runs} runs");
                println!("handler runs: {runs} for 2000 messages");
                let effects = effects(&pool, &consumer).await;
                assert_eq!(effects.len(), 2_000);
                assert!(
                    effects.values().all(|&n| n == 1),
                    "every effect exactly once"
                );
                for id in [&ids[0], &ids[999], &ids[1_999]] {
                    assert_eq!(
                        state(&pool, &consumer, id).await,
                        (2, 1, None),
                        "{id}: processed on its first attempt"
                    );
                }
                let stats = inbox.stats().await.unwrap();
                assert_eq!(
                    (stats.pending, stats.claimed, stats.processed, stats.dead),
                    (0, 0, 2_000, 0)
                );
                assert_eq!(stats.oldest_pending, None);
            }

            /// Retention: processed rows older than the age go, in batches; pending and
            /// dead rows and younger processed ones stay; an age shorter than the broker's
            /// redelivery window is refused before anything is deleted. With
            /// `drop_payloads`, the mark drops the payload at once.
            #[tokio::test]
            async fn pruning_keeps_the_redelivery_window_and_never_touches_unfinished_rows() {
                const DAY: Duration = Duration::from_secs(24 * 60 * 60);
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-prune");
                let inbox = Inbox::new(pool, &consumer).unwrap().drop_payloads(true);
                let ids = receive_all(&inbox, 6).await;
                let handler = Effects::default();
                *handler.poison.lock().unwrap() = Some(ids[5].clone());
                let worker = inbox.worker().batch(4).max_attempts(1);
                worker.process_batch(&handler).await.unwrap(); // 0..=3 processed
                let (payload, headers, row_state, _) = row(pool, &consumer, &ids[0]).await.unwrap();
                assert_eq!(
                    (payload, headers, row_state),
                    (None, None, 2),
                    "payload dropped with the mark"
                );
                for id in &ids[..2] {
                    sqlx::query($age)
                        .bind(&consumer)
                        .bind(id)
                        .execute(pool)
                        .await
                        .unwrap();
                }
                let refused = inbox.prune(DAY, 2 * DAY).await;
                assert!(
                    matches!(
                        refused,
                        Err(dedup_runtime::PruneError::WindowTooShort { .. })
                    ),
                    "{refused:?}"
                );
                assert_eq!(rows(pool, &consumer).await, 6, "nothing deleted");
                worker.process_batch(&handler).await.unwrap(); // 4 processed, 5 dead
                let mut seen = Vec::new();
                let done = dedup_runtime::Prune::new(7 * DAY, 2 * DAY)
                    .batch_size(1)
                    .pause(Duration::ZERO)
                    .run_inbox(&inbox, |progress| seen.push(progress.deleted))
                    .await
                    .unwrap();
                assert_eq!((done.deleted, done.batches), (2, 3));
                assert_eq!(seen, [1, 2, 2], "one row per batch, then the batch that found none");
                assert_eq!(rows(pool, &consumer).await, 4);
                assert!(row(pool, &consumer, &ids[0]).await.is_none());
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.processed, stats.dead), (3, 1));
                assert_eq!(inbox.prune(7 * DAY, 2 * DAY).await.unwrap(), 0);
            }

            /// An ordering key: 4 workers, 4 keys × 40 messages received interleaved — each
            /// key's messages run one at a time, in receive order; a failing head holds up
            /// its own key only.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_ordering_key_runs_its_messages_one_at_a_time_in_order() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-ordered");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let keys = ["k0", "k1", "k2", "k3"];
                let ids: Vec<(String, &str)> = (0..160)
                    .map(|n| (format!("{consumer}/{n}"), keys[n % 4]))
                    .collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|(id, key)| Incoming::new(id.as_str(), b"p").ordering_key(key))
                    .collect();
                for chunk in batch.chunks(16) {
                    inbox.receive_batch(chunk).await.unwrap();
                }
                let runs = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
                /// Records each run, and fails the test if two of one key ever overlap.
                struct Recorder(
                    Arc<std::sync::Mutex<Vec<String>>>,
                    Arc<std::sync::Mutex<HashMap<String, u32>>>,
                );
                impl InboxHandler<$db> for Recorder {
                    type Error = String;
                    async fn handle(
                        &self,
                        tx: &mut $conn,
                        message: &InboxMessage,
                    ) -> Result<(), String> {
                        let key = message
                            .ordering_key()
                            .expect("received with a key")
                            .to_owned();
                        {
                            let mut running = self.1.lock().unwrap();
                            let count = running.entry(key.clone()).or_default();
                            *count += 1;
                            assert_eq!(*count, 1, "two messages of {key} at once");
                        }
                        self.0.lock().unwrap().push(message.id().to_owned());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        let effect = sqlx::query($effect)
                            .bind(message.id())
                            .execute(&mut *tx)
                            .await;
                        *self.1.lock().unwrap().get_mut(&key).unwrap() -= 1;
                        effect.map(drop).map_err(|e| e.to_string())
                    }
                }
                let in_flight = Arc::new(std::sync::Mutex::new(HashMap::new()));
                let workers: Vec<_> = (0..4)
                    .map(|_| {
                        let (pool, consumer) = (pool.clone(), consumer.clone());
                        let handler = Recorder(runs.clone(), in_flight.clone());
                        tokio::spawn(async move {
                            let inbox = Inbox::new(&pool, &consumer).unwrap();
                            // (A failed attempt, a deadlock say, comes back at once.)
                            let worker = inbox
                                .worker()
                                .batch(4)
                                .backoff(Duration::from_millis(1), Duration::from_millis(5));
                            timeout(PATIENCE, async {
                                loop {
                                    let batch = worker.process_batch(&handler).await.unwrap();
                                    if batch.claimed == 0 {
                                        let stats = inbox.stats().await.unwrap();
                                        if stats.pending == 0 && stats.claimed == 0 {
                                            return;
                                        }
                                    }
                                    tokio::time::sleep(Duration::from_millis(2)).await;
                                }
                            })
                            .await
                            .expect("all processed");
                        })
                    })
                    .collect();
                for worker in workers {
                    worker.await.unwrap();
                }
                // A transaction the database ended (a deadlock) runs again, its first run
                // rolled back, before the next of its key can be claimed: the order is
                // that of each message's first run.
                let all_runs = runs.lock().unwrap().clone();
                let mut runs: Vec<String> = Vec::new();
                for id in all_runs {
                    if !runs.contains(&id) {
                        runs.push(id);
                    }
                }
                assert_eq!(runs.len(), 160, "each run");
                for key in keys {
                    let expected: Vec<&String> = ids
                        .iter()
                        .filter(|(_, k)| *k == key)
                        .map(|(id, _)| id)
                        .collect();
                    let seen: Vec<&String> =
                        runs.iter().filter(|id| expected.contains(id)).collect();
                    assert_eq!(seen, expected, "{key}: in receive order");
                }
                assert_eq!(effects(&pool, &consumer).await.len(), 160);

                // A failing head holds up its key only.
                let consumer = unique("inbox-ordered-head");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids: Vec<String> = (0..4).map(|n| format!("{consumer}/{n}")).collect();
                let keyed = [("a", 0), ("a", 1), ("b", 2), ("b", 3)];
                for (key, n) in keyed {
                    inbox
                        .receive(Incoming::new(ids[n].as_str(), b"p").ordering_key(key))
                        .await
                        .unwrap();
                }
                let handler = Effects::default();
                *handler.poison.lock().unwrap() = Some(ids[0].clone());
                let worker = inbox
                    .worker()
                    .backoff(Duration::from_secs(60), Duration::from_secs(60));
                for _ in 0..3 {
                    worker.process_batch(&handler).await.unwrap();
                }
                let done = effects(&pool, &consumer).await;
                assert_eq!(done.len(), 2, "b's two, not a's second: {done:?}");
                assert!(done.contains_key(&ids[2]) && done.contains_key(&ids[3]));
                assert_eq!(
                    state(&pool, &consumer, &ids[1]).await.0,
                    0,
                    "a's second waits"
                );
                let refused = inbox
                    .receive(Incoming::new("x", b"p").ordering_key(""))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(refused, InboxError::Refused(Refused::InvalidOrderingKey(_))),
                    "{refused:?}"
                );
            }

            /// A poison message fails each attempt, with backoff persisted, and is dead
            /// after its last; the others are processed meanwhile. Re-queued after a fix,
            /// it is processed once.
            #[tokio::test]
            async fn poison_is_dead_after_its_attempts_then_requeued_once() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-poison");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 10).await;
                let handler = Effects::default();
                *handler.poison.lock().unwrap() = Some(ids[3].clone());
                let worker = inbox
                    .worker()
                    .max_attempts(3)
                    .backoff(Duration::from_millis(1), Duration::from_millis(5))
                    .poll_interval(Duration::from_millis(5));
                let (mut failed, mut dead) = (0, 0);
                for _ in 0..200 {
                    let batch = worker.process_batch(&handler).await.unwrap();
                    failed += batch.failed;
                    dead += batch.dead;
                    if dead == 1 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                assert_eq!(
                    (failed, dead),
                    (2, 1),
                    "two failures, then dead on the third"
                );
                let (row_state, attempts, last_error) = state(pool, &consumer, &ids[3]).await;
                assert_eq!((row_state, attempts), (3, 3));
                assert_eq!(
                    last_error.as_deref(),
                    Some(format!("cannot process {}: poison", ids[3]).as_str())
                );
                let done = effects(pool, &consumer).await;
                assert_eq!(
                    done.len(),
                    9,
                    "the others are processed, the poison's effects rolled back"
                );
                let listed = inbox.dead(100).await.unwrap();
                assert_eq!(listed.len(), 1);
                assert_eq!(
                    (listed[0].id.as_str(), listed[0].attempts),
                    (ids[3].as_str(), 3)
                );
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.pending, stats.processed, stats.dead), (0, 9, 1));
                assert_eq!(
                    inbox.backlog(100).await.unwrap(),
                    0,
                    "dead rows are no backlog"
                );

                // Fixed: re-queued, processed once, never taken for a duplicate of itself.
                *handler.poison.lock().unwrap() = None;
                assert!(inbox.requeue(ids[3].as_str()).await.unwrap());
                assert!(
                    !inbox.requeue(ids[3].as_str()).await.unwrap(),
                    "not dead any more"
                );
                let batch = worker.process_batch(&handler).await.unwrap();
                assert_eq!((batch.claimed, batch.processed), (1, 1));
                assert_eq!(effects(pool, &consumer).await.get(&ids[3]), Some(&1));
                assert_eq!(state(pool, &consumer, &ids[3]).await.0, 2);
                assert!(
                    !inbox.discard(ids[3].as_str()).await.unwrap(),
                    "only dead rows are discarded"
                );
                // A redelivery of it is still a duplicate.
                assert_eq!(
                    inbox
                        .receive(Incoming::new(ids[3].as_str(), b"p"))
                        .await
                        .unwrap(),
                    Received::Duplicate
                );
            }

            /// A worker stopped during its handler (its task aborted: a killed process, for
            /// the database) leaves the row claimed; after the lease another takes it. A
            /// message that stops its worker every time is dead after its attempts.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stopped_worker_s_row_is_taken_over_and_dead_after_its_attempts() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-stopped");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 1).await;
                for attempt in 1..=2 {
                    let hold = Arc::new(Hold::default());
                    let task = held_worker(&pool, &consumer, &hold, |worker| worker.max_attempts(2));
                    timeout(PATIENCE, hold.entered.notified())
                        .await
                        .expect("in the handler");
                    task.abort();
                    assert!(task.await.unwrap_err().is_cancelled());
                    let (row_state, attempts, _) = state(&pool, &consumer, &ids[0]).await;
                    assert_eq!(
                        (row_state, attempts),
                        (1, attempt),
                        "claimed, the attempt counted"
                    );
                    expire(&pool, &consumer).await;
                }
                let worker = inbox.worker().max_attempts(2);
                let batch = worker.process_batch(&Effects::default()).await.unwrap();
                assert_eq!(
                    (batch.claimed, batch.dead),
                    (0, 1),
                    "buried, not run a third time"
                );
                let (row_state, attempts, last_error) = state(&pool, &consumer, &ids[0]).await;
                assert_eq!((row_state, attempts), (3, 2));
                assert!(last_error.unwrap().contains("the worker stopped"));
                assert!(
                    effects(&pool, &consumer).await.is_empty(),
                    "no effect committed"
                );

                // The operator discards it: a dedup record, not run.
                assert!(inbox.discard(ids[0].as_str()).await.unwrap());
                assert_eq!(state(&pool, &consumer, &ids[0]).await.0, 2);
            }

            /// A worker paused past its lease resumes after another took the row over: its
            /// mark is refused, nothing of it commits, the message is processed once.
            #[tokio::test]
            async fn a_paused_worker_loses_its_claim_and_changes_nothing() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-paused");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 1).await;
                let paused = inbox.worker().batch(1);
                let claims = paused.claim().await.unwrap();
                assert_eq!(claims.messages().len(), 1);
                expire(pool, &consumer).await; // paused past its lease
                let handler = Effects::default();
                let batch = inbox.worker().process_batch(&handler).await.unwrap();
                assert_eq!((batch.claimed, batch.processed), (1, 1), "taken over");
                let (_, attempts, _) = state(pool, &consumer, &ids[0]).await;
                assert_eq!(attempts, 2);
                let late = paused
                    .process(&claims, &claims.messages()[0], &handler)
                    .await
                    .unwrap();
                assert_eq!(late, Processed::Lost);
                // (Its handler ran on PostgreSQL and MariaDB, not on SQLite, which marks
                // first.)
                assert!(handler.runs.load(Ordering::SeqCst) <= 2);
                assert_eq!(
                    effects(pool, &consumer).await.get(&ids[0]),
                    Some(&1),
                    "the stale claim committed nothing"
                );
                assert_eq!(state(pool, &consumer, &ids[0]).await.0, 2);
                assert_eq!(
                    paused.release(&claims).await.unwrap(),
                    0,
                    "nothing of it to release"
                );
            }

            /// Shutdown while a handler runs: it finishes and commits; the rows claimed
            /// with it and not started are released at once, their attempt not counted.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn graceful_shutdown_finishes_the_message_in_hand_and_releases_the_rest() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-shutdown");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 4).await;
                let hold = Arc::new(Hold::default());
                let stop = Arc::new(Notify::new());
                let task = held_run(&pool, &consumer, &hold, &stop, |worker| worker.batch(4));
                timeout(PATIENCE, hold.entered.notified())
                    .await
                    .expect("the first message in hand");
                stop.notify_one();
                hold.go.notify_one();
                let runs = timeout(PATIENCE, task).await.expect("run returns").unwrap();
                assert_eq!(runs, 1, "nothing started after the shutdown");
                let effects = effects(&pool, &consumer).await;
                assert_eq!(effects.len(), 1);
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.processed, stats.pending, stats.claimed), (1, 3, 0));
                let released: Vec<_> = ids.iter().filter(|id| !effects.contains_key(*id)).collect();
                for id in released {
                    assert_eq!(
                        state(&pool, &consumer, id).await,
                        (0, 0, None),
                        "{id}: released, attempt not counted"
                    );
                }
                // Another worker takes them at once, without waiting for a lease.
                let batch = inbox
                    .worker()
                    .process_batch(&Effects::default())
                    .await
                    .unwrap();
                assert_eq!(batch.processed, 3);
            }

            /// Sleeps `first` in its first run, then writes its effect.
            struct Slow {
                first: Duration,
                runs: AtomicU32,
                entered: Notify,
            }

            impl InboxHandler<$db> for Slow {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), sqlx::Error> {
                    if self.runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        self.entered.notify_one();
                        tokio::time::sleep(self.first).await;
                    }
                    sqlx::query($effect).bind(message.id()).execute(&mut *tx).await?;
                    Ok(())
                }
            }

            /// A handler that runs longer than the lease keeps its claim: the heartbeat
            /// renews the lease of the rows not finished, so a second worker trying after
            /// four leases gets nothing, and the first processes both messages.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_heartbeat_keeps_a_long_handler_s_claim_past_its_lease() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-heartbeat");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 2).await;
                let lease = LEASE;
                let slow = Arc::new(Slow {
                    first: 5 * lease,
                    runs: AtomicU32::new(0),
                    entered: Notify::new(),
                });
                let task = tokio::spawn({
                    let (pool, consumer, slow) = (pool.clone(), consumer.clone(), slow.clone());
                    async move {
                        let inbox = Inbox::new(&pool, &consumer).unwrap();
                        let worker = inbox
                            .worker()
                            .lease(lease)
                            .heartbeat(BEAT)
                            .batch(2);
                        worker.process_batch(&*slow).await
                    }
                });
                timeout(PATIENCE, slow.entered.notified())
                    .await
                    .expect("in the handler");
                tokio::time::sleep(4 * lease).await;
                // (SQLite: waits for the first transaction's commit, its only writer.)
                let other = inbox
                    .worker()
                    .lease(lease)
                    .process_batch(&Effects::default())
                    .await
                    .unwrap();
                assert_eq!(other.claimed, 0, "both rows still leased to the first worker");
                let batch = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
                assert_eq!(
                    (batch.claimed, batch.processed, batch.lost),
                    (2, 2, 0),
                    "{batch:?}"
                );
                let effects = effects(&pool, &consumer).await;
                for id in &ids {
                    assert_eq!(effects.get(id), Some(&1), "{id}");
                    assert_eq!(state(&pool, &consumer, id).await, (2, 1, None), "{id}");
                }
            }

            /// A worker stopped mid-handler (its task aborted: a killed process, for the
            /// database) stops renewing: its row is taken over a lease after its last
            /// heartbeat, and processed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_claim_is_taken_over_once_its_heartbeat_stops() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-heartbeat-stops");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 1).await;
                let hold = Arc::new(Hold::default());
                let task = held_worker(&pool, &consumer, &hold, |worker| {
                    worker.lease(LEASE).heartbeat(BEAT)
                });
                let lease = LEASE;
                timeout(PATIENCE, hold.entered.notified())
                    .await
                    .expect("in the handler");
                tokio::time::sleep(3 * lease).await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                let stopped = std::time::Instant::now();
                let worker = inbox.worker().lease(lease);
                let handler = Effects::default();
                let taken = timeout(PATIENCE, async {
                    loop {
                        let batch = worker.process_batch(&handler).await.unwrap();
                        if batch.claimed > 0 {
                            return batch;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .expect("taken over");
                println!(
                    "taken over {} ms after the worker stopped (lease {} ms)",
                    stopped.elapsed().as_millis(),
                    lease.as_millis()
                );
                assert_eq!((taken.claimed, taken.processed), (1, 1));
                assert_eq!(effects(&pool, &consumer).await.get(&ids[0]), Some(&1));
                assert_eq!(state(&pool, &consumer, &ids[0]).await, (2, 2, None));
            }

            /// Shutdown while a handler hangs: past the shutdown deadline it is cancelled,
            /// its transaction rolled back, and its row released with the unstarted one;
            /// another worker processes both at once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_still_running_at_the_shutdown_deadline_is_rolled_back_and_released()
            {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-deadline");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 2).await;
                let hold = Arc::new(Hold::default());
                let stop = Arc::new(Notify::new());
                let task = held_run(&pool, &consumer, &hold, &stop, |worker| {
                    worker
                        .batch(2)
                        .shutdown_deadline(Duration::from_millis(200))
                });
                timeout(PATIENCE, hold.entered.notified())
                    .await
                    .expect("the first message in hand");
                stop.notify_one(); // and the handler never finishes
                let runs = timeout(PATIENCE, task).await.expect("run returns").unwrap();
                assert_eq!(runs, 1);
                assert!(effects(&pool, &consumer).await.is_empty(), "rolled back");
                for id in &ids {
                    assert_eq!(
                        state(&pool, &consumer, id).await,
                        (0, 0, None),
                        "{id}: released, attempt not counted"
                    );
                }
                let batch = inbox
                    .worker()
                    .process_batch(&Effects::default())
                    .await
                    .unwrap();
                assert_eq!(batch.processed, 2);
                let effects = effects(&pool, &consumer).await;
                assert!(ids.iter().all(|id| effects.get(id) == Some(&1)), "{effects:?}");
            }

            /// A handler that ends the transaction itself (a `ROLLBACK` of its own) and
            /// returns `Ok`: its effect is gone, and so the mark never commits — the
            /// attempt is a failure, the message pending for the next.
            #[tokio::test]
            async fn a_handler_that_rolls_its_transaction_back_gets_no_mark() {
                struct RollsBack;

                impl InboxHandler<$db> for RollsBack {
                    type Error = sqlx::Error;

                    async fn handle(
                        &self,
                        tx: &mut $conn,
                        message: &InboxMessage,
                    ) -> Result<(), sqlx::Error> {
                        sqlx::query($effect).bind(message.id()).execute(&mut *tx).await?;
                        sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await?;
                        Ok(())
                    }
                }

                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-rolls-back");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 1).await;
                let batch = inbox
                    .worker()
                    .backoff(Duration::ZERO, Duration::ZERO)
                    .process_batch(&RollsBack)
                    .await
                    .unwrap();
                assert_eq!((batch.claimed, batch.processed, batch.failed), (1, 0, 1));
                assert!(effects(pool, &consumer).await.is_empty());
                let (row_state, attempts, last_error) = state(pool, &consumer, &ids[0]).await;
                assert_eq!((row_state, attempts), (0, 1), "pending, one attempt used");
                let last_error = last_error.unwrap();
                assert!(last_error.contains("transaction back"), "{last_error}");
                // The next attempt, by a handler that does not, processes it once.
                let batch = inbox
                    .worker()
                    .process_batch(&Effects::default())
                    .await
                    .unwrap();
                assert_eq!(batch.processed, 1);
                assert_eq!(effects(pool, &consumer).await.get(&ids[0]), Some(&1));
            }

            /// A handler that kills its process every time (`examples/inbox_worker.rs`, a
            /// child process that SIGKILLs itself mid-transaction on one message): started
            /// again after each death, the worker buries that message after its 3
            /// attempts — counted at the claim — and every other message is processed,
            /// each once, none dead.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_that_kills_its_process_every_time_is_dead_after_its_attempts() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let consumer = unique("inbox-kills");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids: Vec<String> = (0..40).map(|n| format!("{consumer}/{n}")).collect();
                let poison = &ids[5];
                let incoming: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|id| {
                        let payload: &[u8] = if id == poison { b"kill" } else { b"p" };
                        Incoming::new(id.as_str(), payload)
                    })
                    .collect();
                for answer in inbox.receive_batch(&incoming).await.unwrap() {
                    assert_eq!(answer, Ok(Received::Stored));
                }
                let program = examples("inbox_worker").await;
                let url: String = {
                    let $db_ident = &db;
                    let _ = $db_ident;
                    $url
                };
                let (mut kills, mut runs) = (0, 0);
                loop {
                    runs += 1;
                    assert!(runs <= 8, "still not done after {runs} runs");
                    let mut child = tokio::process::Command::new(&program)
                        .env("DATABASE_URL", &url)
                        .env("DEDUP_INBOX_CONSUMER", &consumer)
                        .stdout(std::process::Stdio::null())
                        .kill_on_drop(true)
                        .spawn()
                        .expect("start the worker");
                    let status = timeout(PATIENCE, child.wait())
                        .await
                        .expect("the worker ends")
                        .unwrap();
                    if status.success() {
                        break;
                    }
                    use std::os::unix::process::ExitStatusExt as _;
                    assert_eq!(status.signal(), Some(9), "killed by its handler: {status}");
                    kills += 1;
                }
                println!("worker runs: {runs}, killed by the handler: {kills}");
                assert_eq!(kills, 3, "one death per attempt, then dead");
                let (row_state, attempts, last_error) = state(pool, &consumer, poison).await;
                assert_eq!((row_state, attempts), (3, 3), "dead after its 3 attempts");
                assert!(last_error.unwrap().contains("the worker stopped"));
                let effects = effects(pool, &consumer).await;
                assert_eq!(effects.get(poison), None, "its effect rolled back each time");
                for id in ids.iter().filter(|id| *id != poison) {
                    assert_eq!(effects.get(id), Some(&1), "{id}: processed once");
                    let (row_state, attempts, _) = state(pool, &consumer, id).await;
                    assert_eq!(row_state, 2, "{id}: processed");
                    assert!(attempts <= 2, "{id}: {attempts} attempts");
                }
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.processed, stats.dead, stats.pending, stats.claimed), (39, 1, 0, 0));
            }

            $(
            /// A worker paused mid-handler past its lease (no heartbeat: a paused process,
            /// for the database) loses the row to another, which processes it; resumed,
            /// its mark is refused and its effect rolled back: the message processed once.
            #[doc = $takeover]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_worker_paused_mid_handler_loses_the_row_and_its_effect_rolls_back() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("inbox-paused-mid");
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let ids = receive_all(&inbox, 1).await;
                let hold = Arc::new(Hold::default());
                // No heartbeat while it is paused.
                let task = held_worker(&pool, &consumer, &hold, |worker| {
                    worker.lease(Duration::from_secs(7200)).heartbeat(Duration::from_secs(3600))
                });
                timeout(PATIENCE, hold.entered.notified())
                    .await
                    .expect("in the handler");
                expire(&pool, &consumer).await; // paused past its lease
                let batch = inbox
                    .worker()
                    .process_batch(&Effects::default())
                    .await
                    .unwrap();
                assert_eq!((batch.claimed, batch.processed), (1, 1), "taken over");
                hold.go.notify_one(); // resumed: writes its effect, then marks
                let late = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
                assert_eq!((late.processed, late.lost), (0, 1), "{late:?}");
                assert_eq!(
                    effects(&pool, &consumer).await.get(&ids[0]),
                    Some(&1),
                    "the late effect rolled back"
                );
                assert_eq!(state(&pool, &consumer, &ids[0]).await, (2, 2, None));
            }
            )?

            async fn row(pool: &sqlx::Pool<$db>, consumer: &str, id: &str) -> Option<Stored> {
                sqlx::query_as($row)
                    .bind(consumer)
                    .bind(id)
                    .fetch_optional(pool)
                    .await
                    .unwrap()
            }

            async fn rows(pool: &sqlx::Pool<$db>, consumer: &str) -> i64 {
                sqlx::query_scalar($count)
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            #[tokio::test]
            async fn the_same_id_three_times_is_one_pending_row() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-thrice");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let answers = [
                    inbox
                        .receive(Incoming::new("evt_1", b"first"))
                        .await
                        .unwrap(),
                    inbox
                        .receive(Incoming::new("evt_1", b"second"))
                        .await
                        .unwrap(),
                    inbox
                        .receive(Incoming::new("evt_1", b"third"))
                        .await
                        .unwrap(),
                ];
                assert_eq!(
                    answers,
                    [Received::Stored, Received::Duplicate, Received::Duplicate]
                );
                assert_eq!(rows(pool, &consumer).await, 1);
                let stored = row(pool, &consumer, "evt_1").await.unwrap();
                assert_eq!(
                    stored,
                    (Some(b"first".to_vec()), None, 0, 0),
                    "the first copy, pending"
                );
            }

            #[tokio::test]
            async fn two_consumers_of_one_message_each_store_it() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let (billing, shipping) = (unique("inbox-billing"), unique("inbox-shipping"));
                for consumer in [&billing, &shipping] {
                    let inbox = Inbox::new(pool, consumer).unwrap();
                    assert_eq!(
                        inbox.receive(Incoming::new("evt_7", b"x")).await.unwrap(),
                        Received::Stored
                    );
                    assert_eq!(rows(pool, consumer).await, 1);
                }
            }

            #[tokio::test]
            async fn payloads_and_headers_round_trip_byte_for_byte() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-bytes");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let binary: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
                let json =
                    "{\"name\": \"Zoë\", \"emoji\": \"🦀\", \"nul\": \"\\u0000\"}".as_bytes();
                let headers = b"{\"traceparent\": \"00-4bf92f3577b34da6-00f067aa0ba902b7-01\"}";
                let empty: &[u8] = b"";
                inbox
                    .receive(Incoming::new("binary", &binary))
                    .await
                    .unwrap();
                inbox
                    .receive(Incoming::new("json", json).headers(headers))
                    .await
                    .unwrap();
                inbox
                    .receive(Incoming::new("empty", empty).headers(empty))
                    .await
                    .unwrap();
                assert_eq!(
                    row(pool, &consumer, "binary").await.unwrap().0.as_deref(),
                    Some(&binary[..])
                );
                let (payload, stored_headers, _, _) = row(pool, &consumer, "json").await.unwrap();
                assert_eq!(payload.as_deref(), Some(json));
                assert_eq!(stored_headers.as_deref(), Some(&headers[..]));
                let (payload, stored_headers, _, _) = row(pool, &consumer, "empty").await.unwrap();
                assert_eq!(
                    (payload.as_deref(), stored_headers.as_deref()),
                    (Some(empty), Some(empty))
                );
            }

            #[tokio::test]
            async fn a_batch_answers_each_message_in_order() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-batch");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                inbox
                    .receive(Incoming::new("old", b"stored before"))
                    .await
                    .unwrap();
                let big = vec![7u8; DEFAULT_MAX_PAYLOAD_LEN + 1];
                let answers = inbox
                    .receive_batch(&[
                        Incoming::new("a", b"1"),
                        Incoming::new("old", b"again"),
                        Incoming::new("b", b"2"),
                        Incoming::new("a", b"1 again"),
                        Incoming::new("", b"no id"),
                        Incoming::new("big", &big),
                        Incoming::new("b", b"2 again"),
                    ])
                    .await
                    .unwrap();
                assert_eq!(
                    answers,
                    vec![
                        Ok(Received::Stored),
                        Ok(Received::Duplicate),
                        Ok(Received::Stored),
                        Ok(Received::DuplicateInBatch { first: 0 }),
                        Err(Refused::InvalidMessageId(InvalidMessageId::Empty)),
                        Err(Refused::PayloadTooLarge {
                            len: DEFAULT_MAX_PAYLOAD_LEN + 1,
                            max: DEFAULT_MAX_PAYLOAD_LEN
                        }),
                        Ok(Received::DuplicateInBatch { first: 2 }),
                    ]
                );
                assert_eq!(rows(pool, &consumer).await, 3, "old, a, b");
                assert_eq!(
                    row(pool, &consumer, "a").await.unwrap().0.as_deref(),
                    Some(&b"1"[..])
                );
                assert_eq!(
                    row(pool, &consumer, "old").await.unwrap().0.as_deref(),
                    Some(&b"stored before"[..])
                );
                assert!(row(pool, &consumer, "big").await.is_none());
            }

            #[tokio::test]
            async fn a_batch_longer_than_one_statement_is_stored_in_chunks() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-chunks");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let count = 2 * MAX_BATCH + 10;
                let ids: Vec<String> = (0..count).map(|n| format!("m{n}")).collect();
                let payloads: Vec<Vec<u8>> =
                    (0..count).map(|n| n.to_string().into_bytes()).collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .zip(&payloads)
                    .map(|(id, payload)| Incoming::new(id.as_str(), payload))
                    .collect();
                let first = inbox.receive_batch(&batch[..MAX_BATCH / 2]).await.unwrap();
                assert!(first.iter().all(|answer| *answer == Ok(Received::Stored)));
                let answers = inbox.receive_batch(&batch).await.unwrap();
                assert_eq!(answers.len(), count);
                for (n, answer) in answers.iter().enumerate() {
                    let expected = if n < MAX_BATCH / 2 {
                        Received::Duplicate
                    } else {
                        Received::Stored
                    };
                    assert_eq!(*answer, Ok(expected), "message {n}");
                }
                assert_eq!(rows(pool, &consumer).await, count as i64);
                assert_eq!(
                    row(pool, &consumer, "m2009").await.unwrap().0.as_deref(),
                    Some(&b"2009"[..])
                );
            }

            #[tokio::test]
            async fn bad_ids_and_oversized_payloads_are_refused_and_write_nothing() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-refused");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let long = "x".repeat(dedup_runtime::MAX_MESSAGE_ID_LEN + 1);
                for id in ["", "a\0b", long.as_str()] {
                    let refused = inbox.receive(Incoming::new(id, b"p")).await.unwrap_err();
                    assert!(
                        matches!(refused, InboxError::Refused(Refused::InvalidMessageId(_))),
                        "{refused:?}"
                    );
                    assert!(
                        InvalidMessageId::find(&refused).is_some(),
                        "found through the chain"
                    );
                }
                let small = inbox.clone().max_payload_len(4);
                let refused = small
                    .receive(Incoming::new("five", b"12345"))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(
                        refused,
                        InboxError::Refused(Refused::PayloadTooLarge { len: 5, max: 4 })
                    ),
                    "{refused:?}"
                );
                assert!(
                    refused.to_string().contains("limit of 4 bytes"),
                    "{refused}"
                );
                let headers = vec![b'h'; dedup_runtime::inbox::MAX_HEADERS_LEN + 1];
                let refused = inbox
                    .receive(Incoming::new("h", b"p").headers(&headers))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(
                        refused,
                        InboxError::Refused(Refused::HeadersTooLarge { .. })
                    ),
                    "{refused:?}"
                );
                assert_eq!(rows(pool, &consumer).await, 0);
                assert_eq!(
                    small.receive(Incoming::new("four", b"1234")).await.unwrap(),
                    Received::Stored
                );
                assert!(Inbox::new(pool, "").is_err(), "an invalid consumer");
            }

            #[tokio::test]
            async fn a_missing_table_is_a_typed_error() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let inbox = Inbox::new(pool, "inbox-missing")
                    .unwrap()
                    .in_table("dedup_no_such_inbox")
                    .unwrap();
                let error = inbox.receive(Incoming::new("evt", b"p")).await.unwrap_err();
                assert!(
                    matches!(error, InboxError::MissingTable { .. }),
                    "{error:?}"
                );
            }

            /// Two receivers of the same 200 ids at once (a broker redelivering to another
            /// consumer process): each id is one row and exactly one `Stored` answer.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_receivers_store_each_id_once() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                dedup_runtime::inbox::migrate(&pool).await.unwrap();
                let consumer = unique("inbox-concurrent");
                let receiver = |batched: bool| {
                    let (pool, consumer) = (pool.clone(), consumer.clone());
                    tokio::spawn(async move {
                        let inbox = Inbox::new(&pool, &consumer).unwrap();
                        let ids: Vec<String> = (0..200).map(|n| format!("c{n}")).collect();
                        let mut stored = Vec::new();
                        if batched {
                            for chunk in ids.chunks(10) {
                                let batch: Vec<Incoming<'_>> = chunk
                                    .iter()
                                    .map(|id| Incoming::new(id.as_str(), b"p"))
                                    .collect();
                                for (id, answer) in
                                    chunk.iter().zip(inbox.receive_batch(&batch).await.unwrap())
                                {
                                    if answer == Ok(Received::Stored) {
                                        stored.push(id.clone());
                                    }
                                }
                            }
                        } else {
                            for id in &ids {
                                if inbox
                                    .receive(Incoming::new(id.as_str(), b"p"))
                                    .await
                                    .unwrap()
                                    == Received::Stored
                                {
                                    stored.push(id.clone());
                                }
                            }
                        }
                        stored
                    })
                };
                let (one, two) = (receiver(false), receiver(true));
                let (one, two) = (one.await.unwrap(), two.await.unwrap());
                let mut all: Vec<String> = one.into_iter().chain(two).collect();
                all.sort();
                let before = all.len();
                all.dedup();
                assert_eq!(before, 200, "exactly one Stored answer per id");
                assert_eq!(all.len(), 200);
                assert_eq!(rows(&pool, &consumer).await, 200);
            }
        }
    };
}

inbox_suite!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    row = "SELECT payload, headers, state::int8, attempts::int8 FROM inbox_messages \
           WHERE consumer = $1 AND message_id = $2",
    count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = $1",
    effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects (message_id text NOT NULL)",
    effect = "INSERT INTO inbox_test_effects (message_id) VALUES ($1)",
    group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE $1 \
             GROUP BY message_id",
    state = "SELECT state::int8, attempts::int8, last_error FROM inbox_messages \
             WHERE consumer = $1 AND message_id = $2",
    expire = "UPDATE inbox_messages SET lease_until = clock_timestamp() - interval '1 second' \
              WHERE consumer = $1 AND state = 1",
    age = "UPDATE inbox_messages SET processed_at = clock_timestamp() - interval '10 days' \
           WHERE consumer = $1 AND message_id = $2",
    url = |db| dedup_suite::postgres_url(),
    takeover_mid_handler = "PostgreSQL: the handler's transaction holds no lock on the row.",
);
inbox_suite!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    row = "SELECT payload, headers, CAST(state AS SIGNED), CAST(attempts AS SIGNED) \
           FROM inbox_messages WHERE consumer = ? AND message_id = ?",
    count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?",
    effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    effect = "INSERT INTO inbox_test_effects (message_id) VALUES (?)",
    group = "SELECT CAST(message_id AS CHAR), COUNT(*) FROM inbox_test_effects \
             WHERE message_id LIKE ? GROUP BY message_id",
    state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error \
             FROM inbox_messages WHERE consumer = ? AND message_id = ?",
    expire = "UPDATE inbox_messages SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
              WHERE consumer = ? AND state = 1",
    age = "UPDATE inbox_messages SET processed_at = UTC_TIMESTAMP(6) - INTERVAL 10 DAY \
           WHERE consumer = ? AND message_id = ?",
    url = |db| dedup_suite::mysql_url(),
    takeover_mid_handler = "MariaDB: the handler's transaction holds no lock on the row.",
);
inbox_suite!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    row = "SELECT payload, headers, state, attempts FROM inbox_messages \
           WHERE consumer = ?1 AND message_id = ?2",
    count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?1",
    effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects (message_id TEXT NOT NULL)",
    effect = "INSERT INTO inbox_test_effects (message_id) VALUES (?1)",
    group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE ?1 \
             GROUP BY message_id",
    state = "SELECT state, attempts, last_error FROM inbox_messages \
             WHERE consumer = ?1 AND message_id = ?2",
    expire = "UPDATE inbox_messages \
              SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND state = 1",
    age = "UPDATE inbox_messages SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days') \
           WHERE consumer = ?1 AND message_id = ?2",
    url = |db| format!("sqlite:{}", db.path().display()),
);

/// This file's example programs, built once: the operator's command and the worker the
/// process-killing test starts.
async fn examples(name: &'static str) -> std::path::PathBuf {
    tokio::task::spawn_blocking(move || {
        dedup_suite::example_binary("", &["inbox", "inbox_worker"], name)
    })
    .await
    .unwrap()
}

/// No full scans as the inbox grows (PostgreSQL's plans, read with `EXPLAIN`): with
/// 20,000 processed rows and a few pending ones, the claim of pending rows, the takeover
/// of expired claims and the dead-row listing each go through their partial index.
#[tokio::test]
async fn postgres_claims_use_the_partial_indexes() {
    let pool = dedup_suite::postgres().await;
    dedup_runtime::inbox::migrate(&pool).await.unwrap();
    let consumer = unique("inbox-explain");
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, payload, state, processed_at) \
         SELECT $1, 'done-' || g, 'p', 2, clock_timestamp() FROM generate_series(1, 20000) AS g",
    )
    .bind(&consumer)
    .execute(&pool)
    .await
    .unwrap();
    let inbox = Inbox::new(&pool, &consumer).unwrap();
    for n in 0..5 {
        inbox
            .receive(Incoming::new(&format!("new-{n}"), b"p"))
            .await
            .unwrap();
    }
    sqlx::query("ANALYZE inbox_messages")
        .execute(&pool)
        .await
        .unwrap();
    for (query, index) in [
        (
            "SELECT consumer, message_id FROM inbox_messages AS m WHERE consumer = $1 \
             AND state = 0 AND next_attempt_at <= clock_timestamp() \
             AND (m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM inbox_messages AS e \
             WHERE e.consumer = m.consumer AND e.ordering_key = m.ordering_key \
             AND e.seq < m.seq AND e.state <> 2)) \
             ORDER BY next_attempt_at, seq LIMIT 16 FOR UPDATE SKIP LOCKED",
            "inbox_messages_pending_idx",
        ),
        (
            "SELECT consumer, message_id FROM inbox_messages WHERE consumer = $1 AND state = 1 \
             AND lease_until <= clock_timestamp() AND attempts < 5 ORDER BY lease_until, seq LIMIT 1 \
             FOR UPDATE SKIP LOCKED",
            "inbox_messages_claimed_idx",
        ),
        (
            "SELECT message_id FROM inbox_messages WHERE consumer = $1 AND state = 3 ORDER BY seq \
             LIMIT 100",
            "inbox_messages_dead_idx",
        ),
    ] {
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
            .bind(&consumer)
            .fetch_all(&pool)
            .await
            .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains(index), "{query}\n{plan}");
        assert!(!plan.contains("Seq Scan"), "{query}\n{plan}");
    }
    sqlx::query("DELETE FROM inbox_messages WHERE consumer = $1")
        .bind(&consumer)
        .execute(&pool)
        .await
        .unwrap();
}

/// `examples/inbox.rs`, the operator's command, run as a process against a SQLite file:
/// `stats`, `dead` with the last error, `requeue` and `discard` of dead rows only, and
/// exit status 2 for bad arguments.
#[tokio::test]
async fn the_operator_command_lists_requeues_and_discards_dead_messages() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::inbox::migrate(&*db).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO inbox_messages (consumer, message_id, payload, state, attempts, last_error) \
         VALUES ('ops', 'evt_dead_1', x'00', 3, 5, 'cannot parse: missing field `cents`'), \
                ('ops', 'evt_dead_2', x'00', 3, 5, 'boom'), \
                ('ops', 'evt_pending', x'00', 0, 0, NULL)",
    )
    .execute(&*db)
    .await
    .unwrap();
    let program = examples("inbox").await;
    let url = format!("sqlite:{}", db.path().display());
    let run = |args: &[&str]| {
        let output = std::process::Command::new(&program)
            .args(args)
            .args(["--database-url", &url, "--consumer", "ops"])
            .env_remove("DATABASE_URL")
            .output()
            .expect("run the inbox command");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["stats"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("pending             1") && out.contains("dead                2"),
        "{out}"
    );
    let (code, out, _) = run(&["dead"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("evt_dead_1  after 5 attempt(s): cannot parse: missing field `cents`"),
        "{out}"
    );
    let (code, out, _) = run(&["requeue", "evt_dead_1", "evt_pending"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("evt_dead_1  re-queued") && out.contains("evt_pending  not dead"),
        "{out}"
    );
    let (code, out, _) = run(&["discard", "evt_dead_2"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("evt_dead_2  discarded"), "{out}");
    let states: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT message_id, state, attempts FROM inbox_messages WHERE consumer = 'ops' ORDER BY message_id",
    )
    .fetch_all(&*db)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![
            ("evt_dead_1".to_owned(), 0, 0),
            ("evt_dead_2".to_owned(), 2, 5),
            ("evt_pending".to_owned(), 0, 0),
        ]
    );
    let (code, _, err) = run(&["requeue"]);
    assert_eq!(code, Some(2), "no id: a usage error");
    assert!(err.contains("no message id given"), "{err}");
    let (code, _, err) = run(&["requeue", ""]);
    assert_eq!(code, Some(2), "an invalid id: {err}");
}

/// PostgreSQL's hints: a worker whose poll interval is a minute processes a message at
/// once when the receiving inbox notifies; with its LISTEN connection killed, it still
/// processes what arrives, by polling (and its listener reconnects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_workers_wake_on_a_hint_and_survive_a_killed_listener() {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    struct Count(Arc<AtomicU32>);
    impl InboxHandler<sqlx::Postgres> for Count {
        type Error = String;
        async fn handle(&self, _: &mut sqlx::PgConnection, _: &InboxMessage) -> Result<(), String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    let name = unique("dedup-inbox-listen");
    let options: PgConnectOptions = dedup_suite::postgres_url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name))
        .await
        .unwrap();
    dedup_runtime::inbox::migrate(&pool).await.unwrap();
    let consumer = unique("inbox-listen");
    let processed = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let (pool, consumer, processed, stop) = (
            pool.clone(),
            consumer.clone(),
            processed.clone(),
            stop.clone(),
        );
        async move {
            let inbox = Inbox::new(&pool, &consumer).unwrap();
            // A poll interval of a minute: only a hint makes it look within the test.
            let worker = inbox.worker().poll_interval(Duration::from_secs(60));
            worker
                .run(&Count(processed), stop.notified())
                .await
                .unwrap();
        }
    });
    let observer = dedup_suite::postgres().await;
    let listening = || async {
        let listeners: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&name)
        .fetch_one(&observer)
        .await
        .unwrap();
        listeners
    };
    let wait_for = |count: u32| {
        let processed = processed.clone();
        async move {
            timeout(PATIENCE, async {
                while processed.load(Ordering::SeqCst) < count {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
        }
    };
    timeout(PATIENCE, async {
        while listening().await == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the worker listens");
    // Let the worker go idle first (its first empty claim), then receive with a hint.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let inbox = Inbox::new(&pool, &consumer).unwrap().notify_workers(true);
    inbox.receive(Incoming::new("evt_1", b"p")).await.unwrap();
    wait_for(1)
        .await
        .expect("woken by the hint, not the one-minute poll");

    // The LISTEN connection dies: the listener reconnects, and the next hint wakes it.
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&name)
    .fetch_all(&observer)
    .await
    .unwrap();
    assert_eq!(killed, vec![true], "one listener killed");
    let mut n = 1;
    let woken = timeout(PATIENCE, async {
        loop {
            n += 1;
            inbox
                .receive(Incoming::new(format!("evt_{n}").as_str(), b"p"))
                .await
                .unwrap();
            tokio::time::sleep(HINT_GAP * 5).await;
            if processed.load(Ordering::SeqCst) >= 2 {
                break;
            }
        }
    })
    .await;
    woken.expect("processed again after the listener was killed");
    stop.notify_one();
    timeout(PATIENCE, worker)
        .await
        .expect("the worker stops")
        .unwrap();
    let stats = inbox.stats().await.unwrap();
    assert_eq!(stats.processed as u32, processed.load(Ordering::SeqCst));
}
