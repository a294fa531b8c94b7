//! A worker's `run` and the claims it holds, on every backend: shutdown finishes the
//! message in hand and releases the rest; a handler still running at the shutdown deadline
//! is rolled back and released; a heartbeat keeps a long handler's claim past its lease,
//! and once it stops the claim is taken over. On PostgreSQL, a worker wakes on a hint and
//! survives a killed listener.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_runtime::inbox::{HINT_GAP, Inbox, InboxHandler, InboxMessage, Incoming, Worker};
use dedup_suite::unique;
use tokio::sync::Notify;
use tokio::time::timeout;

use super::*;

/// The lease of the heartbeat tests, and their heartbeat.
const LEASE: Duration = Duration::from_millis(250);
const BEAT: Duration = Duration::from_millis(50);

macro_rules! running_suite {
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
                let (pool, consumer, hold, stop) = (
                    pool.clone(),
                    consumer.to_owned(),
                    hold.clone(),
                    stop.clone(),
                );
                tokio::spawn(async move {
                    let inbox = Inbox::new(&pool, &consumer).unwrap();
                    let handler = Effects {
                        hold: Some(hold),
                        ..Effects::default()
                    };
                    configure(inbox.worker())
                        .run(&handler, stop.notified())
                        .await
                        .unwrap();
                    handler.runs.load(Ordering::SeqCst)
                })
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
                    sqlx::query($effect)
                        .bind(message.id())
                        .execute(&mut *tx)
                        .await?;
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
                        let worker = inbox.worker().lease(lease).heartbeat(BEAT).batch(2);
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
                assert_eq!(
                    other.claimed, 0,
                    "both rows still leased to the first worker"
                );
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
                assert!(
                    ids.iter().all(|id| effects.get(id) == Some(&1)),
                    "{effects:?}"
                );
            }
        }
    };
}

inbox_backends!(running_suite);

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
