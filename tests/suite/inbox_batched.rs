//! The inbox's workers in batch mode (issue 25, item 5), on every backend:
//! `Worker::process_batched` / `run_batched` run a claim's messages through one
//! `BatchHandler` call in one transaction. A claim is one handler call over every message
//! in the claim's order, each marked processed with its effect; a poison message splits
//! the claim in halves down to itself — the others commit, it alone fails (its backoff,
//! its error), or is dead after its last attempt; a worker that stalls past its lease
//! loses its claims to another and nothing is applied twice; per-message and batch
//! workers on one consumer process every message once; `run_batched` stops at its
//! signal. Every case reads the rows back (effects and marks).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_runtime::batch::BatchHandler;
use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming, Received};
use dedup_suite::unique;
use tokio::sync::Notify;
use tokio::time::timeout;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// Dead: a row whose attempts are used up.
const DEAD: i64 = 3;

macro_rules! batched_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        handle = $handle:ty,
        effects = $effects:literal,
        effects_columns = $effects_columns:literal,
        test_group = $test_group:literal,
        effect = $effect:literal,
        group = $group:literal,
        state = $state:literal,
        expire = $expire:literal,
        url = |$db_ident:ident| $url:expr,
        $(stall = $stall:literal,)?
    ) => {
        mod $backend {
            use super::*;

            /// The batch handler: one effect row per message, one statement each; fails
            /// when `poison` is among its messages; stops at `hold` (if any) first. Keeps
            /// the ids of each call.
            #[derive(Default)]
            struct Effects {
                poison: Option<String>,
                hold: Option<Arc<(Notify, Notify)>>,
                calls: Mutex<Vec<Vec<String>>>,
            }

            impl BatchHandler<$db, InboxMessage> for Effects {
                type Error = std::io::Error;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    messages: &[&InboxMessage],
                ) -> Result<(), std::io::Error> {
                    self.calls
                        .lock()
                        .unwrap()
                        .push(messages.iter().map(|m| m.id().to_owned()).collect());
                    if let Some(hold) = &self.hold {
                        hold.0.notify_one();
                        hold.1.notified().await;
                    }
                    for message in messages {
                        sqlx::query($effect)
                            .bind(message.id())
                            .execute(&mut *tx)
                            .await
                            .map_err(std::io::Error::other)?;
                    }
                    if let Some(poison) = &self.poison
                        && messages.iter().any(|m| m.id() == poison)
                    {
                        return Err(std::io::Error::other(format!("cannot process {poison}: poison")));
                    }
                    Ok(())
                }
            }

            impl Effects {
                fn sizes(&self) -> Vec<usize> {
                    self.calls.lock().unwrap().iter().map(Vec::len).collect()
                }
            }

            /// The per-message handler: the same effect.
            struct One;

            impl InboxHandler<$db> for One {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), sqlx::Error> {
                    sqlx::query($effect).bind(message.id()).execute(&mut *tx).await?;
                    Ok(())
                }
            }

            async fn setup() -> ($handle, String) {
                let db = $pool;
                dedup_runtime::inbox::migrate(&*db).await.unwrap();
                dedup_suite::ddl(&*db, $effects).await;
                (db, unique("inbox-batched"))
            }

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

            async fn receive_all(inbox: &Inbox<$db>, count: usize) -> Vec<String> {
                let ids: Vec<String> = (0..count)
                    .map(|n| format!("{}/{n:04}", inbox.consumer()))
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

            /// A claim of 10: one handler call with all 10 in the claim's (receive)
            /// order, one commit; every row processed on its first attempt, every effect
            /// once. Nothing left: the next call claims nothing.
            #[tokio::test]
            async fn a_claim_is_one_handler_call_in_one_transaction() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 10).await;
                let handler = Effects::default();
                let worker = inbox.worker().batch(10);
                let done = worker.process_batched(&handler).await.unwrap();
                assert_eq!((done.claimed, done.processed, done.failed, done.lost), (10, 10, 0, 0));
                assert_eq!(*handler.calls.lock().unwrap(), vec![ids.clone()]);
                let effects = effects(&db, &consumer).await;
                assert_eq!(effects.len(), 10);
                assert!(effects.values().all(|&n| n == 1), "{effects:?}");
                for id in &ids {
                    assert_eq!(state(&db, &consumer, id).await, (2, 1, None), "{id}");
                }
                let again = worker.process_batched(&handler).await.unwrap();
                assert_eq!(again.claimed, 0);
                assert_eq!(handler.sizes(), vec![10]);
            }

            /// A poison message among 8: the claim splits in halves down to it (calls of
            /// 8, 4, 4, 2, 1, 1, 2), the 7 others commit, it alone fails — pending again
            /// after its backoff, its error kept, its effect rolled back.
            #[tokio::test]
            async fn a_poison_message_splits_the_claim_and_fails_alone() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 8).await;
                let handler = Effects {
                    poison: Some(ids[5].clone()),
                    ..Effects::default()
                };
                let done = inbox.worker().batch(8).process_batched(&handler).await.unwrap();
                assert_eq!((done.claimed, done.processed, done.failed, done.dead), (8, 7, 1, 0));
                assert_eq!(handler.sizes(), vec![8, 4, 4, 2, 1, 1, 2]);
                let effects = effects(&db, &consumer).await;
                assert_eq!(effects.len(), 7, "{effects:?}");
                assert!(!effects.contains_key(&ids[5]));
                assert!(effects.values().all(|&n| n == 1), "{effects:?}");
                let (poison_state, attempts, error) = state(&db, &consumer, &ids[5]).await;
                assert_eq!((poison_state, attempts), (0, 1));
                assert!(error.is_some_and(|e| e.contains("poison")));
                for (n, id) in ids.iter().enumerate().filter(|(n, _)| *n != 5) {
                    assert_eq!(state(&db, &consumer, id).await, (2, 1, None), "{n}");
                }
            }

            /// On its last attempt the poison message is dead; the others commit.
            #[tokio::test]
            async fn a_poison_message_is_dead_after_its_last_attempt() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 4).await;
                let handler = Effects {
                    poison: Some(ids[0].clone()),
                    ..Effects::default()
                };
                let worker = inbox.worker().batch(4).max_attempts(1);
                let done = worker.process_batched(&handler).await.unwrap();
                assert_eq!((done.processed, done.failed, done.dead), (3, 0, 1));
                let (dead_state, attempts, error) = state(&db, &consumer, &ids[0]).await;
                assert_eq!((dead_state, attempts), (DEAD, 1));
                assert!(error.is_some_and(|e| e.contains("poison")));
                assert_eq!(effects(&db, &consumer).await.len(), 3);
            }

            /// Per-message and batch workers on one consumer, side by side: 600
            /// messages, each processed once, effects and marks.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn per_message_and_batch_workers_share_a_consumer() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 600).await;
                let pool: sqlx::Pool<$db> = (*db).clone();
                let workers: Vec<_> = (0..4)
                    .map(|n| {
                        let (pool, consumer) = (pool.clone(), consumer.clone());
                        tokio::spawn(async move {
                            let inbox = Inbox::new(&pool, &consumer).unwrap();
                            let worker = inbox.worker().batch(16);
                            let handler = Effects::default();
                            let mut processed = 0;
                            loop {
                                let done = if n % 2 == 0 {
                                    worker.process_batched(&handler).await.unwrap()
                                } else {
                                    worker.process_batch(&One).await.unwrap()
                                };
                                assert_eq!((done.failed, done.dead, done.lost), (0, 0, 0), "{done:?}");
                                processed += done.processed;
                                if done.claimed == 0 {
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
                assert_eq!(total, 600);
                let effects = effects(&db, &consumer).await;
                assert_eq!(effects.len(), 600);
                assert!(effects.values().all(|&n| n == 1), "every effect exactly once");
                for id in [&ids[0], &ids[299], &ids[599]] {
                    assert_eq!(state(&db, &consumer, id).await.0, 2, "{id}");
                }
            }

            /// `run_batched` processes what comes, in claims, until its signal; then it
            /// returns, nothing claimed left behind.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn run_batched_processes_until_its_signal() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 30).await;
                let stop = Arc::new(Notify::new());
                let task = {
                    let (pool, consumer, stop) = ((*db).clone(), consumer.clone(), stop.clone());
                    tokio::spawn(async move {
                        let inbox = Inbox::new(&pool, &consumer).unwrap();
                        let handler = Effects::default();
                        let worker = inbox.worker().batch(10).poll_interval(Duration::from_millis(20));
                        worker.run_batched(&handler, stop.notified()).await.unwrap();
                        handler.sizes()
                    })
                };
                timeout(PATIENCE, async {
                    while effects(&db, &consumer).await.len() < 30 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .expect("all 30 processed");
                stop.notify_one();
                let sizes = timeout(PATIENCE, task).await.expect("stopped").unwrap();
                assert_eq!(sizes, vec![10, 10, 10]);
                for id in &ids {
                    assert_eq!(state(&db, &consumer, id).await.0, 2, "{id}");
                }
                let stats = inbox.stats().await.unwrap();
                assert_eq!((stats.pending, stats.claimed, stats.processed), (0, 0, 30));
            }

            /// A message on a later attempt (it failed before) runs in a transaction of
            /// its own, in its place in the claim's order; the fresh ones after it
            /// together.
            #[tokio::test]
            async fn a_retried_message_runs_alone() {
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 2).await;
                let failing = Effects {
                    poison: Some(ids[0].clone()),
                    ..Effects::default()
                };
                let worker = inbox
                    .worker()
                    .batch(10)
                    .backoff(Duration::from_millis(1), Duration::from_millis(1));
                let first = worker.process_batched(&failing).await.unwrap();
                assert_eq!((first.processed, first.failed), (1, 1), "{first:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                let fresh: Vec<String> = (10..13).map(|n| format!("{consumer}/{n:04}")).collect();
                for id in &fresh {
                    inbox.receive(Incoming::new(id.as_str(), b"p")).await.unwrap();
                }
                let healed = Effects::default();
                let second = worker.process_batched(&healed).await.unwrap();
                assert_eq!((second.claimed, second.processed), (4, 4), "{second:?}");
                let mut expected = vec![vec![ids[0].clone()]];
                expected.push(fresh.clone());
                assert_eq!(*healed.calls.lock().unwrap(), expected);
                assert_eq!(state(&db, &consumer, &ids[0]).await.0, 2);
                assert_eq!(effects(&db, &consumer).await.len(), 5);
            }

            /// A batch handler that kills its process every time
            /// (`examples/inbox_worker.rs` with `DEDUP_INBOX_BATCHED`, a child process that
            /// SIGKILLs itself mid-transaction on one message of its claim): started again
            /// after each death, the worker buries that message after its 3 attempts, and
            /// every other message is processed once, none dead — those taken down with
            /// it lose at most one attempt.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_handler_that_kills_its_process_every_time_is_dead_after_its_attempts() {
                let (db, consumer) = setup().await;
                let pool: &sqlx::Pool<$db> = &db;
                sqlx::query(concat!("CREATE TABLE IF NOT EXISTS inbox_test_effects ", $effects_columns))
                    .execute(pool)
                    .await
                    .unwrap();
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids: Vec<String> = (0..40).map(|n| format!("{consumer}/{n:04}")).collect();
                let poison = &ids[5];
                let incoming: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|id| {
                        let payload: &[u8] = if id == poison { b"kill" } else { b"p" };
                        Incoming::new(id.as_str(), payload)
                    })
                    .collect();
                inbox.receive_batch(&incoming).await.unwrap();
                let program = tokio::task::spawn_blocking(|| {
                    dedup_suite::example_binary("", &["inbox_worker"], "inbox_worker")
                })
                .await
                .unwrap();
                let url: String = {
                    let $db_ident = &db;
                    let _ = $db_ident;
                    $url
                };
                let (mut kills, mut runs) = (0, 0);
                loop {
                    runs += 1;
                    assert!(runs <= 24, "still not done after {runs} runs");
                    let mut child = tokio::process::Command::new(&program)
                        .env("DATABASE_URL", &url)
                        .env("DEDUP_INBOX_CONSUMER", &consumer)
                        .env("DEDUP_INBOX_BATCHED", "1")
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
                println!("batch-mode worker runs: {runs}, killed by the handler: {kills}");
                let (row_state, attempts, last_error) = state(pool, &consumer, poison).await;
                assert_eq!((row_state, attempts), (DEAD, 3), "dead after its 3 attempts");
                assert!(last_error.unwrap().contains("the worker stopped"));
                // The poison was charged 3 times; each kill before it charged one message
                // in front of it in its transaction, at most once each.
                assert!((3..=8).contains(&kills), "{kills} kills");
                let effects: HashMap<String, i64> = sqlx::query_as($test_group)
                    .bind(format!("{consumer}/%"))
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect();
                assert_eq!(effects.get(poison), None, "its effect rolled back each time");
                for id in ids.iter().filter(|id| *id != poison) {
                    assert_eq!(effects.get(id), Some(&1), "{id}: processed once");
                    let (row_state, attempts, _) = state(pool, &consumer, id).await;
                    assert_eq!(row_state, 2, "{id}: processed");
                    assert!(attempts <= 2, "{id}: {attempts} attempts");
                }
            }

            $(
            /// A worker stalls in its handler past its lease; another takes its claims
            /// over and processes them. The stalled worker's mark then finds none of its
            /// rows its own: it rolls back, counts them lost, and no effect is applied
            /// twice.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stalled_worker_loses_its_claims_and_nothing_doubles() {
                let _why: &str = $stall;
                let (db, consumer) = setup().await;
                let inbox = Inbox::new(&*db, &consumer).unwrap();
                let ids = receive_all(&inbox, 6).await;
                let hold = Arc::new((Notify::new(), Notify::new()));
                let stalled = {
                    let (pool, consumer, hold) = ((*db).clone(), consumer.clone(), hold.clone());
                    tokio::spawn(async move {
                        let inbox = Inbox::new(&pool, &consumer).unwrap();
                        let handler = Effects {
                            hold: Some(hold),
                            ..Effects::default()
                        };
                        let worker = inbox
                            .worker()
                            .batch(6)
                            .lease(Duration::from_secs(60))
                            .heartbeat(Duration::from_secs(30));
                        worker.process_batched(&handler).await.unwrap()
                    })
                };
                timeout(PATIENCE, hold.0.notified()).await.expect("the handler began");
                sqlx::query($expire).bind(&consumer).execute(&*db).await.unwrap();
                let other = Effects::default();
                let taken = inbox.worker().batch(6).process_batched(&other).await.unwrap();
                assert_eq!((taken.claimed, taken.processed), (6, 6), "{taken:?}");
                hold.1.notify_one();
                let done = timeout(PATIENCE, stalled).await.expect("ended").unwrap();
                assert_eq!((done.claimed, done.processed, done.lost), (6, 0, 6), "{done:?}");
                let effects = effects(&db, &consumer).await;
                assert_eq!(effects.len(), 6);
                assert!(effects.values().all(|&n| n == 1), "{effects:?}");
                for id in &ids {
                    assert_eq!(state(&db, &consumer, id).await.0, 2, "{id}");
                }
            }
            )?
        }
    };
}

batched_suite!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    handle = Box<sqlx::PgPool>,
    effects = "CREATE TABLE IF NOT EXISTS inbox_batched_effects (message_id text NOT NULL)",
    effects_columns = "(message_id text NOT NULL)",
    test_group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE $1 \
                  GROUP BY message_id",
    effect = "INSERT INTO inbox_batched_effects (message_id) VALUES ($1)",
    group = "SELECT message_id, COUNT(*) FROM inbox_batched_effects WHERE message_id LIKE $1 \
             GROUP BY message_id",
    state = "SELECT state::int8, attempts::int8, last_error FROM inbox_messages \
             WHERE consumer = $1 AND message_id = $2",
    expire = "UPDATE inbox_messages SET lease_until = clock_timestamp() - interval '1 second' \
              WHERE consumer = $1 AND state = 1",
    url = |db| dedup_suite::postgres_url(),
    stall = "PostgreSQL: the handler's transaction holds no lock on the rows.",
);
batched_suite!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    handle = Box<sqlx::MySqlPool>,
    effects = "CREATE TABLE IF NOT EXISTS inbox_batched_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    effects_columns = "(message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    test_group = "SELECT CAST(message_id AS CHAR), COUNT(*) FROM inbox_test_effects \
                  WHERE message_id LIKE ? GROUP BY message_id",
    effect = "INSERT INTO inbox_batched_effects (message_id) VALUES (?)",
    group = "SELECT CAST(message_id AS CHAR), COUNT(*) FROM inbox_batched_effects \
             WHERE message_id LIKE ? GROUP BY message_id",
    state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error \
             FROM inbox_messages WHERE consumer = ? AND message_id = ?",
    expire = "UPDATE inbox_messages SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
              WHERE consumer = ? AND state = 1",
    url = |db| dedup_suite::mysql_url(),
    stall = "MariaDB: the handler's transaction holds no lock on the rows.",
);
batched_suite!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    handle = dedup_suite::TempSqlite,
    effects = "CREATE TABLE IF NOT EXISTS inbox_batched_effects (message_id TEXT NOT NULL)",
    effects_columns = "(message_id TEXT NOT NULL)",
    test_group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE ?1 \
                  GROUP BY message_id",
    effect = "INSERT INTO inbox_batched_effects (message_id) VALUES (?1)",
    group = "SELECT message_id, COUNT(*) FROM inbox_batched_effects WHERE message_id LIKE ?1 \
             GROUP BY message_id",
    state = "SELECT state, attempts, last_error FROM inbox_messages \
             WHERE consumer = ?1 AND message_id = ?2",
    expire = "UPDATE inbox_messages \
              SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND state = 1",
    url = |db| format!("sqlite:{}", db.path().display()),
);

/// A transient database error inside the batch handler (a deadlock, seen through the
/// error's `source()`) runs the same transaction again, without splitting the claim.
#[tokio::test]
async fn postgres_a_deadlock_in_the_handler_runs_the_claim_again_whole() {
    struct DeadlockOnce {
        calls: Mutex<Vec<usize>>,
    }

    impl BatchHandler<sqlx::Postgres, InboxMessage> for DeadlockOnce {
        type Error = sqlx::Error;

        async fn handle(
            &self,
            tx: &mut sqlx::PgConnection,
            messages: &[&InboxMessage],
        ) -> Result<(), sqlx::Error> {
            let first = {
                let mut calls = self.calls.lock().unwrap();
                calls.push(messages.len());
                calls.len() == 1
            };
            for message in messages {
                sqlx::query("INSERT INTO inbox_batched_effects (message_id) VALUES ($1)")
                    .bind(message.id())
                    .execute(&mut *tx)
                    .await?;
            }
            if first {
                sqlx::raw_sql(
                    "DO $$ BEGIN RAISE EXCEPTION 'staged' USING ERRCODE = '40P01'; END $$",
                )
                .execute(&mut *tx)
                .await?;
            }
            Ok(())
        }
    }

    let db = dedup_suite::postgres().await;
    dedup_runtime::inbox::migrate(&db).await.unwrap();
    dedup_suite::ddl(
        &db,
        "CREATE TABLE IF NOT EXISTS inbox_batched_effects (message_id text NOT NULL)",
    )
    .await;
    let consumer = unique("inbox-batched");
    let inbox = Inbox::new(&db, &consumer).unwrap();
    let ids: Vec<String> = (0..5).map(|n| format!("{consumer}/{n}")).collect();
    let incoming: Vec<Incoming<'_>> = ids.iter().map(|id| Incoming::new(id, b"p")).collect();
    inbox.receive_batch(&incoming).await.unwrap();
    let handler = DeadlockOnce {
        calls: Mutex::new(Vec::new()),
    };
    let done = inbox
        .worker()
        .batch(5)
        .process_batched(&handler)
        .await
        .unwrap();
    assert_eq!((done.processed, done.failed), (5, 0), "{done:?}");
    assert_eq!(
        *handler.calls.lock().unwrap(),
        vec![5, 5],
        "run again whole, not split"
    );
    let effects: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM inbox_batched_effects WHERE message_id LIKE $1")
            .bind(format!("{consumer}/%"))
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(effects, 5, "the first run's effects rolled back");
}
