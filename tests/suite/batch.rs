//! Batches (`dedup_runtime::batch`) on the real servers and a temporary SQLite file: the
//! ids claimed in one statement, the body run once over the fresh messages, one commit;
//! in-batch copies, overlapping batches at once, poison isolation by splitting, transient
//! failures retried without a split, bad ids, business keys. Every case asserts the
//! effect rows and the dedup rows, not only the outcome. Message ids are unique per run
//! (`dedup_suite::unique`): the servers keep their tables between runs.

use std::sync::atomic::{AtomicUsize, Ordering};

use dedup_runtime::batch::{Batch, BatchHandler, BatchItem, BatchOutcome};
use dedup_runtime::{Duplicate, InvalidMessageId};
use dedup_suite::unique;

/// One delivered message.
#[derive(Debug, Clone)]
struct Msg {
    id: String,
    /// Its business key (`order_key`, unique in the effects table).
    order: String,
    poison: bool,
}

impl Msg {
    fn new(id: &str) -> Msg {
        Msg {
            id: id.to_owned(),
            order: format!("order-{id}"),
            poison: false,
        }
    }

    fn poison(id: &str) -> Msg {
        Msg {
            poison: true,
            ..Msg::new(id)
        }
    }
}

/// A body's error: the database's, or a poison message.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("poison message {0}")]
    Poison(String),
}

fn ids(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix}-{n:03}")).collect()
}

fn messages(ids: &[String]) -> Vec<Msg> {
    ids.iter().map(|id| Msg::new(id)).collect()
}

fn kinds<E>(outcome: &BatchOutcome<E>) -> Vec<&'static str> {
    outcome
        .items()
        .iter()
        .map(|item| match item {
            BatchItem::Processed => "processed",
            BatchItem::Duplicate(Duplicate::AlreadyProcessed) => "duplicate",
            BatchItem::Duplicate(Duplicate::BusinessKey { .. }) => "business key",
            BatchItem::Duplicate(_) => "other duplicate",
            BatchItem::Failed(_) => "failed",
            BatchItem::SameAs { .. } => "same as",
            BatchItem::Invalid(_) => "invalid",
            _ => "unknown",
        })
        .collect()
}

macro_rules! batch_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        pool = $pool:expr,
        ddl = $ddl:expr,
        insert = $insert:expr,
        raise_transient = $raise:expr $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::{AssertSqlSafe, Pool};

            type Db = <$conn as sqlx::Connection>::Database;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $ddl).await;
                pool
            }

            /// The body: one effect row per fresh message, a poison message fails it;
            /// `seen` collects the ids of every run.
            #[derive(Default)]
            struct Apply {
                seen: std::sync::Mutex<Vec<Vec<String>>>,
            }

            impl Apply {
                fn runs(&self) -> Vec<Vec<String>> {
                    self.seen.lock().unwrap().clone()
                }
            }

            /// One effect row per message of `fresh`.
            async fn insert_effects(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    sqlx::query($insert)
                        .bind(&msg.id)
                        .bind(&msg.order)
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            }

            impl BatchHandler<Db, Msg> for Apply {
                type Error = BodyError;

                async fn handle(&self, tx: &mut $conn, fresh: &[&Msg]) -> Result<(), BodyError> {
                    self.seen
                        .lock()
                        .unwrap()
                        .push(fresh.iter().map(|m| m.id.clone()).collect());
                    insert_effects(tx, fresh).await?;
                    if let Some(bad) = fresh.iter().find(|m| m.poison) {
                        return Err(BodyError::Poison(bad.id.clone()));
                    }
                    Ok(())
                }
            }

            /// The same effects; its first two runs end in a transient error.
            #[derive(Default)]
            struct Flaky {
                runs: AtomicUsize,
                sizes: std::sync::Mutex<Vec<usize>>,
            }

            impl BatchHandler<Db, Msg> for Flaky {
                type Error = BodyError;

                async fn handle(&self, tx: &mut $conn, fresh: &[&Msg]) -> Result<(), BodyError> {
                    self.sizes.lock().unwrap().push(fresh.len());
                    insert_effects(tx, fresh).await?;
                    if self.runs.fetch_add(1, Ordering::SeqCst) < 2 {
                        sqlx::raw_sql($raise).execute(&mut *tx).await?;
                    }
                    Ok(())
                }
            }

            async fn run(
                pool: &Pool<Db>,
                batch: &Batch,
                msgs: &[Msg],
                handler: &Apply,
            ) -> BatchOutcome<BodyError> {
                batch
                    .run(pool, msgs, |m| m.id.as_str(), handler)
                    .await
                    .unwrap()
            }

            /// Effect rows per id among `ids`.
            async fn effects(pool: &Pool<Db>, ids: &[String]) -> Vec<i64> {
                let mut counts = Vec::new();
                for id in ids {
                    counts.push(dedup_suite::rows(pool, "dedup_batch_effects", "message_id", id).await);
                }
                counts
            }

            /// Dedup rows of `consumer` per id among `ids`.
            async fn claims(pool: &Pool<Db>, consumer: &str, ids: &[String]) -> Vec<i64> {
                let mut counts = Vec::new();
                for id in ids {
                    counts.push(dedup_suite::claims(pool, consumer, id).await);
                }
                counts
            }

            /// The attribute form of `Apply`'s body: the generated `record(db, &[Msg])`.
            #[dedup_runtime::idempotent(
                consumer = "batch-attribute",
                batch = orders,
                key = |order| order.id.as_str(),
                unique = "dedup_batch_effects_order_key",
            )]
            async fn record(tx: &mut $conn, orders: &[&Msg]) -> Result<(), BodyError> {
                insert_effects(tx, orders).await?;
                match orders.iter().find(|m| m.poison) {
                    Some(bad) => Err(BodyError::Poison(bad.id.clone())),
                    None => Ok(()),
                }
            }

            /// Its consumer.
            const ATTRIBUTE: &str = "batch-attribute";

            #[tokio::test]
            async fn the_attribute_form_processes_the_fresh_ones_once() {
                let pool = pool().await;
                let prefix = unique("attr");
                let (a, b, c) = (format!("{prefix}-a"), format!("{prefix}-b"), format!("{prefix}-c"));
                let outcome = record(&*pool, &messages(&[a.clone(), b.clone(), a.clone()]))
                    .await
                    .unwrap();
                assert_eq!(kinds(&outcome), ["processed", "processed", "same as"]);
                assert!((0..3).all(|n| outcome.ack(n)));
                let again = record(&*pool, &messages(&[a.clone(), b.clone(), c.clone()]))
                    .await
                    .unwrap();
                assert_eq!(kinds(&again), ["duplicate", "duplicate", "processed"]);
                let all = [a, b, c];
                assert_eq!(effects(&pool, &all).await, [1, 1, 1]);
                assert_eq!(claims(&pool, ATTRIBUTE, &all).await, [1, 1, 1]);
            }

            #[tokio::test]
            async fn the_attribute_form_isolates_a_poison_message() {
                let pool = pool().await;
                let ids = ids(&unique("attr-poison"), 20);
                let mut msgs = messages(&ids);
                msgs[7] = Msg::poison(&ids[7]);
                let outcome = record(&*pool, &msgs).await.unwrap();
                assert_eq!((outcome.processed(), outcome.failed()), (19, 1));
                assert!(
                    matches!(&outcome.items()[7], BatchItem::Failed(BodyError::Poison(id)) if *id == ids[7])
                );
                let mut expected = vec![1; 20];
                expected[7] = 0;
                assert_eq!(effects(&pool, &ids).await, expected);
                assert_eq!(claims(&pool, ATTRIBUTE, &ids).await, expected);
            }

            #[tokio::test]
            async fn the_attribute_form_reports_bad_ids_and_business_keys_per_message() {
                let pool = pool().await;
                let ids = ids(&unique("attr-keys"), 4);
                let mut msgs = messages(&ids);
                msgs[1].id = String::new();
                // The same order as message 0, under another id: its business key.
                msgs[3].order = msgs[0].order.clone();
                let outcome = record(&*pool, &msgs).await.unwrap();
                assert_eq!(kinds(&outcome), ["processed", "invalid", "processed", "business key"]);
                assert!(matches!(outcome.items()[1], BatchItem::Invalid(InvalidMessageId::Empty)));
                assert!(outcome.ack(3), "a business-key duplicate is acknowledged");
                assert_eq!(effects(&pool, &ids).await, [1, 0, 1, 0]);
                assert_eq!(claims(&pool, ATTRIBUTE, &ids).await, [1, 0, 1, 0]);
            }

            #[tokio::test]
            async fn the_attribute_form_runs_in_the_callers_transaction() {
                let pool = pool().await;
                let ids = ids(&unique("attr-tx"), 5);
                let mut tx = pool.begin().await.unwrap();
                let outcome = record(&mut tx, &messages(&ids)).await.unwrap();
                assert_eq!(outcome.processed(), 5);
                tx.rollback().await.unwrap();
                assert_eq!(effects(&pool, &ids).await, [0; 5], "rolled back with the caller");
                assert_eq!(claims(&pool, ATTRIBUTE, &ids).await, [0; 5]);
                let mut tx = pool.begin().await.unwrap();
                let outcome = record(&mut *tx, &messages(&ids)).await.unwrap();
                assert_eq!(outcome.processed(), 5);
                tx.commit().await.unwrap();
                assert_eq!(effects(&pool, &ids).await, [1; 5]);
                assert_eq!(claims(&pool, ATTRIBUTE, &ids).await, [1; 5]);
                // A plain connection: the batch's own transaction on it.
                let mut conn = pool.acquire().await.unwrap();
                let again = record(&mut conn, &messages(&ids)).await.unwrap();
                assert_eq!(again.duplicates(), 5);
            }

            #[tokio::test]
            async fn a_fresh_batch_is_processed_in_one_transaction() {
                let pool = pool().await;
                let consumer = unique("batch-fresh");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("fresh"), 20);
                let seen = Apply::default();
                let outcome = run(&pool, &batch, &messages(&ids), &seen).await;
                assert_eq!(outcome.processed(), 20);
                assert!((0..20).all(|n| outcome.ack(n)));
                assert_eq!(outcome.splits(), 0);
                assert_eq!(seen.runs().len(), 1, "one run of the body");
                assert_eq!(seen.runs()[0], ids, "in input order");
                assert_eq!(effects(&pool, &ids).await, vec![1; 20]);
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![1; 20]);
            }

            #[tokio::test]
            async fn a_batch_of_duplicates_runs_no_body() {
                let pool = pool().await;
                let consumer = unique("batch-dup");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("dup"), 10);
                let seen = Apply::default();
                run(&pool, &batch, &messages(&ids), &seen).await;
                let again = run(&pool, &batch, &messages(&ids), &seen).await;
                assert_eq!(kinds(&again), vec!["duplicate"; 10]);
                assert!((0..10).all(|n| again.ack(n)));
                assert_eq!(seen.runs().len(), 1, "no second run of the body");
                assert_eq!(effects(&pool, &ids).await, vec![1; 10]);
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![1; 10]);
            }

            #[tokio::test]
            async fn a_mixed_batch_runs_the_body_on_the_fresh_ones_only() {
                let pool = pool().await;
                let consumer = unique("batch-mixed");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("mixed"), 10);
                let seen = Apply::default();
                let old: Vec<String> = ids.iter().step_by(2).cloned().collect();
                run(&pool, &batch, &messages(&old), &seen).await;
                let outcome = run(&pool, &batch, &messages(&ids), &seen).await;
                let expected: Vec<&str> = (0..10)
                    .map(|n| if n % 2 == 0 { "duplicate" } else { "processed" })
                    .collect();
                assert_eq!(kinds(&outcome), expected);
                let new: Vec<String> = ids.iter().skip(1).step_by(2).cloned().collect();
                assert_eq!(seen.runs()[1], new, "the fresh ones, in input order");
                assert_eq!(effects(&pool, &ids).await, vec![1; 10]);
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![1; 10]);
            }

            #[tokio::test]
            async fn in_batch_copies_collapse_and_are_acknowledged_together() {
                let pool = pool().await;
                let consumer = unique("batch-copies");
                let batch = Batch::new(&consumer).unwrap();
                let prefix = unique("copies");
                let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
                let msgs = messages(&[a.clone(), b.clone(), a.clone()]);
                let seen = Apply::default();
                let outcome = run(&pool, &batch, &msgs, &seen).await;
                assert_eq!(kinds(&outcome), ["processed", "processed", "same as"]);
                assert!(matches!(outcome.items()[2], BatchItem::SameAs { first: 0 }));
                assert!(outcome.ack(2) && matches!(outcome.settled(2), BatchItem::Processed));
                assert_eq!(seen.runs()[0], [a.clone(), b.clone()], "a once");
                assert_eq!(effects(&pool, &[a.clone(), b.clone()]).await, [1, 1]);
                assert_eq!(claims(&pool, &consumer, &[a, b]).await, [1, 1]);
            }

            /// Two batches at once, overlapping by half: every id is claimed by exactly
            /// one, and each body saw exactly the ids its batch won.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn overlapping_batches_at_once_split_the_ids_between_them() {
                let pool = pool().await;
                let consumer = unique("batch-overlap");
                let all = ids(&unique("overlap"), 90);
                for round in 0..3 {
                    let round_ids: Vec<String> =
                        all.iter().map(|id| format!("{id}-{round}")).collect();
                    let (first, second) = (round_ids[..60].to_vec(), round_ids[30..].to_vec());
                    let tasks: Vec<_> = [first.clone(), second.clone()]
                        .into_iter()
                        .map(|ids| {
                            let (pool, consumer) = ((*pool).clone(), consumer.clone());
                            tokio::spawn(async move {
                                let batch = Batch::new(&consumer).unwrap();
                                let seen = Apply::default();
                                let outcome = run(&pool, &batch, &messages(&ids), &seen).await;
                                let won: Vec<String> = ids
                                    .iter()
                                    .zip(outcome.items())
                                    .filter(|(_, item)| matches!(item, BatchItem::Processed))
                                    .map(|(id, _)| id.clone())
                                    .collect();
                                assert!((0..ids.len()).all(|n| outcome.ack(n)));
                                let ran: Vec<String> = seen.runs().concat();
                                assert_eq!(ran, won, "the body saw exactly the ids it won");
                                won
                            })
                        })
                        .collect();
                    let mut won = Vec::new();
                    for task in tasks {
                        won.push(task.await.unwrap());
                    }
                    let mut union: Vec<String> = won.concat();
                    union.sort();
                    assert_eq!(union, round_ids, "each id won by exactly one batch");
                    assert_eq!(effects(&pool, &round_ids).await, vec![1; 90]);
                    assert_eq!(claims(&pool, &consumer, &round_ids).await, vec![1; 90]);
                }
            }

            #[tokio::test]
            async fn a_poison_message_fails_alone_and_the_other_49_commit() {
                let pool = pool().await;
                let consumer = unique("batch-poison");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("poison"), 50);
                let mut msgs = messages(&ids);
                msgs[37] = Msg::poison(&ids[37]);
                let seen = Apply::default();
                let outcome = run(&pool, &batch, &msgs, &seen).await;
                assert_eq!(outcome.processed(), 49);
                assert_eq!(outcome.failed(), 1);
                assert!(
                    matches!(&outcome.items()[37], BatchItem::Failed(BodyError::Poison(id)) if *id == ids[37])
                );
                assert!(!outcome.ack(37));
                // log2(50) < 6: one split per level, each at most two transactions.
                assert!(outcome.splits() <= 6, "{} splits", outcome.splits());
                assert!(seen.runs().len() <= 13, "{} body runs", seen.runs().len());
                let mut expected = vec![1; 50];
                expected[37] = 0;
                assert_eq!(effects(&pool, &ids).await, expected, "the poison's effect rolled back");
                assert_eq!(claims(&pool, &consumer, &ids).await, expected);
                // The poison message again, alone: it fails again (nothing was recorded).
                let again = run(&pool, &batch, &msgs[37..38], &seen).await;
                assert_eq!(kinds(&again), ["failed"]);
            }

            #[tokio::test]
            async fn an_all_poison_batch_of_32_ends() {
                let pool = pool().await;
                let consumer = unique("batch-all-poison");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("all-poison"), 32);
                let msgs: Vec<Msg> = ids.iter().map(|id| Msg::poison(id)).collect();
                let seen = Apply::default();
                let outcome = run(&pool, &batch, &msgs, &seen).await;
                assert_eq!(outcome.failed(), 32);
                assert_eq!(outcome.splits(), 31, "a full binary split");
                assert_eq!(seen.runs().len(), 63);
                assert_eq!(effects(&pool, &ids).await, vec![0; 32]);
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![0; 32]);
            }

            /// A transient failure of the body runs the same batch again: no split.
            #[tokio::test]
            async fn a_transient_failure_retries_the_whole_batch() {
                let pool = pool().await;
                let consumer = unique("batch-transient");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("transient"), 12);
                let msgs = messages(&ids);
                let flaky = Flaky::default();
                let outcome = batch
                    .run(&*pool, &msgs, |m| m.id.as_str(), &flaky)
                    .await
                    .unwrap();
                assert_eq!(*flaky.sizes.lock().unwrap(), [12, 12, 12], "the whole batch every time");
                assert_eq!(flaky.runs.load(Ordering::SeqCst), 3, "two failures, then success");
                assert_eq!(outcome.processed(), 12);
                assert_eq!(outcome.splits(), 0);
                assert_eq!(effects(&pool, &ids).await, vec![1; 12], "the failed runs rolled back");
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![1; 12]);
            }

            #[tokio::test]
            async fn a_bad_id_is_refused_and_the_rest_is_processed() {
                let pool = pool().await;
                let consumer = unique("batch-bad-id");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("bad-id"), 3);
                let mut msgs = messages(&ids);
                msgs.insert(1, Msg::new(""));
                msgs.insert(3, Msg::new("nul\0byte"));
                let seen = Apply::default();
                let outcome = run(&pool, &batch, &msgs, &seen).await;
                assert_eq!(
                    kinds(&outcome),
                    ["processed", "invalid", "processed", "invalid", "processed"]
                );
                assert!(matches!(outcome.items()[1], BatchItem::Invalid(InvalidMessageId::Empty)));
                assert!(!outcome.ack(1));
                assert_eq!(seen.runs()[0], ids);
                assert_eq!(effects(&pool, &ids).await, [1, 1, 1]);
                assert_eq!(claims(&pool, &consumer, &ids).await, [1, 1, 1]);
            }

            #[tokio::test]
            async fn an_empty_batch_and_a_batch_of_bad_ids_run_nothing() {
                let pool = pool().await;
                let batch = Batch::new(&unique("batch-empty")).unwrap();
                let seen = Apply::default();
                let empty = run(&pool, &batch, &[], &seen).await;
                assert!(empty.items().is_empty());
                let bad = run(&pool, &batch, &[Msg::new(""), Msg::new("")], &seen).await;
                assert_eq!(kinds(&bad), ["invalid", "invalid"], "each refused, none a copy");
                assert!(seen.runs().is_empty(), "no body run");
            }

            /// With `unique`, a message whose business key was processed before (under
            /// another id) is a duplicate; the batch splits to find it, the rest commit.
            #[tokio::test]
            async fn a_business_key_violation_is_that_message_s_duplicate() {
                let pool = pool().await;
                let consumer = unique("batch-business-key");
                let batch = Batch::new(&consumer)
                    .unwrap()
                    .unique(&["dedup_batch_effects_order_key"]);
                let ids = ids(&unique("business-key"), 8);
                let seen = Apply::default();
                let mut first = Msg::new(&format!("{}-earlier", ids[5]));
                first.order = format!("order-{}", ids[5]);
                run(&pool, &batch, &[first], &seen).await;
                let outcome = run(&pool, &batch, &messages(&ids), &seen).await;
                let mut expected = vec!["processed"; 8];
                expected[5] = "business key";
                assert_eq!(kinds(&outcome), expected);
                assert!(outcome.ack(5));
                assert!(matches!(
                    outcome.items()[5],
                    BatchItem::Duplicate(Duplicate::BusinessKey { constraint: "dedup_batch_effects_order_key" })
                ));
                let mut rows = vec![1; 8];
                rows[5] = 0;
                assert_eq!(effects(&pool, &ids).await, rows);
                assert_eq!(claims(&pool, &consumer, &ids).await, rows, "no dedup row for it");
            }

            /// In the caller's transaction: each sub-batch a savepoint, the processed
            /// rows committed with the caller's transaction, or rolled back with it.
            #[tokio::test]
            async fn inside_a_callers_transaction_it_commits_and_rolls_back_with_it() {
                let pool = pool().await;
                let consumer = unique("batch-caller-tx");
                let batch = Batch::new(&consumer).unwrap();
                let ids = ids(&unique("caller-tx"), 10);
                let mut msgs = messages(&ids);
                msgs[6] = Msg::poison(&ids[6]);
                let seen = Apply::default();

                let mut tx = pool.begin().await.unwrap();
                let outcome = batch
                    .run_on(&mut *tx, &msgs, |m| m.id.as_str(), &seen)
                    .await
                    .unwrap();
                assert_eq!((outcome.processed(), outcome.failed()), (9, 1));
                assert!(outcome.splits() >= 1, "split around the poison");
                tx.rollback().await.unwrap();
                assert_eq!(effects(&pool, &ids).await, vec![0; 10], "rolled back with the caller's");
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![0; 10]);

                let mut tx = pool.begin().await.unwrap();
                let outcome = batch
                    .run_on(&mut *tx, &msgs, |m| m.id.as_str(), &seen)
                    .await
                    .unwrap();
                assert_eq!((outcome.processed(), outcome.failed()), (9, 1));
                tx.commit().await.unwrap();
                let mut rows = vec![1; 10];
                rows[6] = 0;
                assert_eq!(effects(&pool, &ids).await, rows, "committed with the caller's");
                assert_eq!(claims(&pool, &consumer, &ids).await, rows);

                // A plain connection, outside a transaction: as with the pool.
                let mut conn = pool.acquire().await.unwrap();
                let again = batch
                    .run_on(&mut *conn, &msgs, |m| m.id.as_str(), &seen)
                    .await
                    .unwrap();
                assert_eq!((again.duplicates(), again.failed()), (9, 1));
            }

            #[tokio::test]
            async fn a_custom_table() {
                let pool = pool().await;
                let table = dedup_suite::unique_table("batch_table");
                dedup_runtime::migrate_table(&*pool, &table).await.unwrap();
                let consumer = unique("batch-table");
                let batch = Batch::new(&consumer).unwrap().in_table(&table).unwrap();
                let ids = ids(&unique("table"), 5);
                let seen = Apply::default();
                assert_eq!(run(&pool, &batch, &messages(&ids), &seen).await.processed(), 5);
                let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {table}"
                )))
                .fetch_one(&*pool)
                .await
                .unwrap();
                assert_eq!(rows, 5);
                assert_eq!(claims(&pool, &consumer, &ids).await, vec![0; 5], "not in the default table");
                let again = run(&pool, &batch, &messages(&ids), &seen).await;
                assert_eq!(again.duplicates(), 5);
            }
        }
    };
}

batch_suite!(
    postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    ddl = "CREATE TABLE IF NOT EXISTS dedup_batch_effects (message_id text NOT NULL, \
           order_key text NOT NULL); \
           CREATE UNIQUE INDEX IF NOT EXISTS dedup_batch_effects_order_key \
           ON dedup_batch_effects (order_key)",
    insert = "INSERT INTO dedup_batch_effects (message_id, order_key) VALUES ($1, $2)",
    raise_transient = "DO $$ BEGIN RAISE EXCEPTION 'simulated serialization failure' \
                       USING ERRCODE = '40001'; END $$",
);

batch_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    ddl = "CREATE TABLE IF NOT EXISTS dedup_batch_effects (message_id VARBINARY(255) NOT NULL, \
           order_key VARBINARY(255) NOT NULL, KEY (message_id), \
           UNIQUE KEY dedup_batch_effects_order_key (order_key)) ENGINE = InnoDB",
    insert = "INSERT INTO dedup_batch_effects (message_id, order_key) VALUES (?, ?)",
    raise_transient = "SIGNAL SQLSTATE '40001' \
                       SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'simulated deadlock'",
);

batch_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    ddl = "CREATE TABLE IF NOT EXISTS dedup_batch_effects (message_id TEXT NOT NULL, \
           order_key TEXT NOT NULL); \
           CREATE UNIQUE INDEX IF NOT EXISTS dedup_batch_effects_order_key \
           ON dedup_batch_effects (order_key)",
    insert = "INSERT INTO dedup_batch_effects (message_id, order_key) VALUES (?1, ?2)",
    raise_transient = "PRAGMA wal_checkpoint(PASSIVE)",
);

#[test]
fn the_consumer_is_checked() {
    assert!(Batch::new("").is_err());
    assert!(
        Batch::new("billing")
            .unwrap()
            .in_table("no such; table")
            .is_err()
    );
}
