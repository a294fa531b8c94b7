//! Technique 1 on every backend: the dedup claim and the handler's work commit together.
//!
//! Each case runs on PostgreSQL and MariaDB (the machine's servers) and on a temporary
//! SQLite file; the same module is instantiated once per backend by `backend_suite!`.
//! Message ids are unique per run (`dedup_suite::unique`), because the servers keep the
//! dedup table between runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use dedup_runtime::{Duplicate, InvalidMessageId, MAX_MESSAGE_ID_LEN, Outcome, idempotent};

/// A delivery as a consumer would receive it.
#[derive(Debug, Clone)]
pub struct Msg {
    pub id: String,
    /// Make the body fail after its effect (the effect must be rolled back).
    pub fail: bool,
    /// Make the body panic after its effect.
    pub panic: bool,
}

impl Msg {
    pub fn new(id: impl Into<String>) -> Self {
        Msg {
            id: id.into(),
            fail: false,
            panic: false,
        }
    }
}

macro_rules! backend_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        effects_ddl = $effects_ddl:literal,
        insert_effect = $insert_effect:literal,
        select_ids = $select_ids:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $effects_ddl).await;
                pool
            }

            async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_effects", "message_id", id).await
            }

            async fn claims(pool: &Pool<Db>, consumer: &str, id: &str) -> i64 {
                dedup_suite::claims(pool, consumer, id).await
            }

            #[idempotent(consumer = "core-effects", key = msg.id)]
            async fn record(tx: &mut $conn, msg: &Msg) -> Result<u32, sqlx::Error> {
                sqlx::query($insert_effect)
                    .bind("core-effects")
                    .bind(&msg.id)
                    .execute(&mut *tx)
                    .await?;
                if msg.fail {
                    return Err(sqlx::Error::Protocol("the body failed on purpose".into()));
                }
                assert!(!msg.panic, "the body panicked on purpose");
                Ok(7)
            }

            #[idempotent(consumer = "core-other", key = msg.id)]
            async fn record_other(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect)
                    .bind("core-other")
                    .bind(&msg.id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            #[tokio::test]
            async fn processed_then_duplicate() {
                let pool = pool().await;
                let msg = Msg::new(dedup_suite::unique("first"));
                assert_eq!(record(&*pool, &msg).await.unwrap(), Outcome::Processed(7));
                let again = record(&*pool, &msg).await.unwrap();
                assert_eq!(again, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(effects(&pool, &msg.id).await, 1);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 1);
            }

            #[tokio::test]
            async fn consumers_are_independent() {
                let pool = pool().await;
                let msg = Msg::new(dedup_suite::unique("shared"));
                assert!(record(&*pool, &msg).await.unwrap().is_processed());
                assert!(record_other(&*pool, &msg).await.unwrap().is_processed());
                assert!(record(&*pool, &msg).await.unwrap().is_duplicate());
                assert!(record_other(&*pool, &msg).await.unwrap().is_duplicate());
                assert_eq!(effects(&pool, &msg.id).await, 2);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 1);
                assert_eq!(claims(&pool, "core-other", &msg.id).await, 1);
            }

            #[tokio::test]
            async fn body_error_commits_nothing_and_redelivery_processes() {
                let pool = pool().await;
                let mut msg = Msg::new(dedup_suite::unique("fails"));
                msg.fail = true;
                let error = record(&*pool, &msg).await.unwrap_err();
                assert!(matches!(error, sqlx::Error::Protocol(_)), "{error:?}");
                assert_eq!(effects(&pool, &msg.id).await, 0);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 0);

                msg.fail = false;
                assert_eq!(record(&*pool, &msg).await.unwrap(), Outcome::Processed(7));
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            #[tokio::test]
            async fn body_panic_commits_nothing_and_redelivery_processes() {
                let pool = pool().await;
                let mut msg = Msg::new(dedup_suite::unique("panics"));
                msg.panic = true;
                let task_pool = (*pool).clone();
                let task_msg = msg.clone();
                let joined = tokio::spawn(async move { record(&task_pool, &task_msg).await }).await;
                assert!(joined.unwrap_err().is_panic());
                assert_eq!(effects(&pool, &msg.id).await, 0);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 0);

                msg.panic = false;
                assert_eq!(record(&*pool, &msg).await.unwrap(), Outcome::Processed(7));
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            #[tokio::test]
            async fn cancelled_mid_transaction_commits_nothing() {
                let pool = pool().await;
                let msg = Msg::new(dedup_suite::unique("cancelled"));
                let entered = Arc::new(tokio::sync::Notify::new());

                #[idempotent(consumer = "core-effects", key = msg.id)]
                async fn stalls(
                    tx: &mut $conn,
                    msg: &Msg,
                    entered: &tokio::sync::Notify,
                ) -> Result<(), sqlx::Error> {
                    sqlx::query($insert_effect)
                        .bind("core-effects")
                        .bind(&msg.id)
                        .execute(&mut *tx)
                        .await?;
                    entered.notify_one();
                    std::future::pending::<()>().await;
                    Ok(())
                }

                let (task_pool, task_msg, task_entered) =
                    ((*pool).clone(), msg.clone(), entered.clone());
                let task =
                    tokio::spawn(async move { stalls(&task_pool, &task_msg, &task_entered).await });
                entered.notified().await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());

                assert_eq!(effects(&pool, &msg.id).await, 0);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 0);
                assert_eq!(record(&*pool, &msg).await.unwrap(), Outcome::Processed(7));
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// 8 tasks, 300 messages each delivered 3 times in shuffled order.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn storm() {
                const MESSAGES: usize = 300;
                const COPIES: usize = 3;
                const TASKS: usize = 8;
                let pool = pool().await;
                let run = dedup_suite::unique("storm");
                let mut deliveries: Vec<Msg> = (0..MESSAGES)
                    .flat_map(|n| std::iter::repeat_n(Msg::new(format!("{run}-{n}")), COPIES))
                    .collect();
                dedup_suite::Shuffle::new(0x5eed).shuffle(&mut deliveries);
                let queue = Arc::new(std::sync::Mutex::new(deliveries));

                let mut tasks = Vec::new();
                for _ in 0..TASKS {
                    let (pool, queue) = ((*pool).clone(), queue.clone());
                    tasks.push(tokio::spawn(async move {
                        let (mut processed, mut duplicates) = (0, 0);
                        loop {
                            let next = queue.lock().unwrap().pop();
                            let Some(msg) = next else { break };
                            match record(&pool, &msg).await.expect("no delivery fails") {
                                Outcome::Processed(_) => processed += 1,
                                Outcome::Duplicate(_) => duplicates += 1,
                            }
                        }
                        (processed, duplicates)
                    }));
                }
                let (mut processed, mut duplicates) = (0, 0);
                for task in tasks {
                    let (p, d) = task.await.unwrap();
                    processed += p;
                    duplicates += d;
                }
                assert_eq!(processed, MESSAGES);
                assert_eq!(duplicates, MESSAGES * (COPIES - 1));

                let like = format!("{run}-%");
                let total: i64 = sqlx::query_scalar(concat!(
                    "SELECT COUNT(*) FROM dedup_effects WHERE message_id LIKE ",
                    $select_ids
                ))
                .bind(&like)
                .fetch_one(&*pool)
                .await
                .unwrap();
                assert_eq!(total, MESSAGES as i64, "exactly one effect per message");
                for n in [0, MESSAGES / 2, MESSAGES - 1] {
                    assert_eq!(effects(&pool, &format!("{run}-{n}")).await, 1);
                }
            }

            /// 8 copies of one message at the same moment: one effect.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn simultaneous_copies() {
                let pool = pool().await;
                let msg = Msg::new(dedup_suite::unique("copies"));
                let barrier = Arc::new(tokio::sync::Barrier::new(8));
                let tasks: Vec<_> = (0..8)
                    .map(|_| {
                        let (pool, msg, barrier) = ((*pool).clone(), msg.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            record(&pool, &msg).await
                        })
                    })
                    .collect();
                let mut processed = 0;
                for task in tasks {
                    if task.await.unwrap().expect("no copy fails").is_processed() {
                        processed += 1;
                    }
                }
                assert_eq!(processed, 1);
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            #[tokio::test]
            async fn savepoint_inside_callers_transaction() {
                let pool = pool().await;
                let msg = Msg::new(dedup_suite::unique("savepoint"));

                // The caller rolls back: the claim and the effect go with it.
                let mut tx = pool.begin().await.unwrap();
                assert!(record(&mut tx, &msg).await.unwrap().is_processed());
                assert!(record(&mut tx, &msg).await.unwrap().is_duplicate());
                tx.rollback().await.unwrap();
                assert_eq!(effects(&pool, &msg.id).await, 0);
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 0);

                // A failing handler rolls back its savepoint only: the caller's own work stays.
                let mut tx = pool.begin().await.unwrap();
                sqlx::query($insert_effect)
                    .bind("caller")
                    .bind(&msg.id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let mut failing = msg.clone();
                failing.fail = true;
                assert!(record(&mut tx, &failing).await.is_err());
                assert!(record(&mut tx, &msg).await.unwrap().is_processed());
                tx.commit().await.unwrap();
                assert_eq!(
                    effects(&pool, &msg.id).await,
                    2,
                    "the caller's row and one effect"
                );
                assert_eq!(claims(&pool, "core-effects", &msg.id).await, 1);
                assert!(record(&*pool, &msg).await.unwrap().is_duplicate());

                // A plain connection, not in a transaction: the handler owns its transaction.
                let other = Msg::new(dedup_suite::unique("connection"));
                let mut conn = pool.acquire().await.unwrap();
                assert!(record(&mut conn, &other).await.unwrap().is_processed());
                assert!(record(&mut *conn, &other).await.unwrap().is_duplicate());
            }

            #[tokio::test]
            async fn bad_ids_are_typed_errors_and_write_nothing() {
                let pool = pool().await;
                let calls = AtomicU32::new(0);

                #[idempotent(consumer = "core-bad-ids", key = id)]
                async fn counted(
                    tx: &mut $conn,
                    id: &str,
                    calls: &AtomicU32,
                ) -> Result<(), sqlx::Error> {
                    calls.fetch_add(1, Ordering::SeqCst);
                    sqlx::query($insert_effect)
                        .bind("core-bad-ids")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                }

                let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
                let cases = [
                    ("".to_owned(), InvalidMessageId::Empty),
                    (
                        long.clone(),
                        InvalidMessageId::TooLong {
                            len: long.len(),
                            max: MAX_MESSAGE_ID_LEN,
                        },
                    ),
                    (
                        "evt\0x".to_owned(),
                        InvalidMessageId::ContainsNul { position: 3 },
                    ),
                ];
                for (id, expected) in cases {
                    let error = counted(&*pool, &id, &calls).await.unwrap_err();
                    assert!(
                        matches!(error, sqlx::Error::InvalidArgument(_)),
                        "{error:?}"
                    );
                    assert_eq!(InvalidMessageId::find(&error), Some(expected), "{id:?}");
                }
                assert_eq!(calls.load(Ordering::SeqCst), 0, "the body never ran");
                assert_eq!(effects(&pool, "").await, 0);

                // The longest id is accepted, and stored whole.
                let run = dedup_suite::unique("l");
                let longest = format!("{run}{}", "é".repeat((MAX_MESSAGE_ID_LEN - run.len()) / 2));
                assert!(
                    longest.len() <= MAX_MESSAGE_ID_LEN && longest.len() >= MAX_MESSAGE_ID_LEN - 1
                );
                assert!(
                    counted(&*pool, &longest, &calls)
                        .await
                        .unwrap()
                        .is_processed()
                );
                assert!(
                    counted(&*pool, &longest, &calls)
                        .await
                        .unwrap()
                        .is_duplicate()
                );
                assert_eq!(claims(&pool, "core-bad-ids", &longest).await, 1);
            }

            /// Ids are data: SQL metacharacters are stored as they are, and ids that differ
            /// only in case, trailing space or Unicode normalisation are different messages.
            #[tokio::test]
            async fn ids_compare_byte_for_byte() {
                let pool = pool().await;
                let run = dedup_suite::unique("meta");
                let suffixes = [
                    "'; DROP TABLE processed_messages; --",
                    "\" OR 1=1 --",
                    "back\\slash",
                    "100%_like",
                    "$1 ?",
                    "a",
                    "A",
                    "a ",
                    "caf\u{e9}",
                    "cafe\u{301}",
                    "\u{1F600} emoji",
                    "tab\tnewline\n",
                ];
                for suffix in suffixes {
                    let msg = Msg::new(format!("{run}{suffix}"));
                    assert!(
                        record(&*pool, &msg).await.unwrap().is_processed(),
                        "{suffix:?}"
                    );
                }
                for suffix in suffixes {
                    let msg = Msg::new(format!("{run}{suffix}"));
                    assert!(
                        record(&*pool, &msg).await.unwrap().is_duplicate(),
                        "{suffix:?}"
                    );
                    assert_eq!(effects(&pool, &msg.id).await, 1, "{suffix:?}");
                    assert_eq!(
                        claims(&pool, "core-effects", &msg.id).await,
                        1,
                        "{suffix:?}"
                    );
                }
            }
        }
    };
}

backend_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_effects \
                   (consumer text NOT NULL, message_id text NOT NULL)",
    insert_effect = "INSERT INTO dedup_effects (consumer, message_id) VALUES ($1, $2)",
    select_ids = "$1",
);

backend_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_effects \
                   (consumer VARBINARY(255) NOT NULL, message_id VARBINARY(255) NOT NULL, \
                    KEY (message_id)) ENGINE = InnoDB",
    insert_effect = "INSERT INTO dedup_effects (consumer, message_id) VALUES (?, ?)",
    select_ids = "?",
);

backend_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_effects \
                   (consumer TEXT NOT NULL, message_id TEXT NOT NULL)",
    insert_effect = "INSERT INTO dedup_effects (consumer, message_id) VALUES (?, ?)",
    select_ids = "?",
);
