//! The inbox's workers, on every backend: 4 workers × 2,000 messages, each processed
//! exactly once; a poison message dead after its attempts, the others done, then re-queued
//! and processed once; a worker stopped mid-handler (its task aborted) taken over after its
//! lease, and a message that stops its worker every time (in this process, or a child
//! process that kills itself) dead after its attempts; a paused worker's stale claim
//! refused, its effect rolled back; a handler that rolls its transaction back gets no mark.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming, Processed, Received};
use dedup_suite::unique;
use tokio::time::timeout;

use super::*;

macro_rules! workers_suite {
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
            use crate::inbox::common::$backend::*;

            /// Every claim of `consumer` ends now, on the database's clock.
            async fn expire(pool: &sqlx::Pool<$db>, consumer: &str) {
                sqlx::query($expire)
                    .bind(consumer)
                    .execute(pool)
                    .await
                    .unwrap();
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
        }
    };
}

inbox_backends!(workers_suite);
