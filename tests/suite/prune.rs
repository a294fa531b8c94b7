//! Pruning on every backend: nothing younger than the age goes, a window longer than the
//! age is refused, and 200,000 ids go while four consumers keep processing messages.
//!
//! Each case runs on PostgreSQL and MariaDB (the machine's servers) and on a temporary
//! SQLite file, instantiated once per backend by `prune_suite!`. Every test prunes a
//! dedicated table (rows backdated by inserting `processed_at`), never the shared
//! `processed_messages`, and drops it at the end. The concurrent case needs a table name
//! literal for its handler: one fixed table per backend, emptied at its start.
//!
//! These are correctness tests: how fast pruning goes, and how much it slows the
//! consumers, is the benchmark's to measure (`benches/dedup/prune.rs`, its pruning figures).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dedup_runtime::{Outcome, Prune, PruneError, PruneProgress, idempotent};

const MINUTE: i64 = 60;
const DAY: i64 = 24 * 60 * MINUTE;

fn secs(seconds: i64) -> Duration {
    Duration::from_secs(seconds.unsigned_abs())
}

/// A table name no other test or run uses (the servers keep tables between runs).
fn fresh_table() -> String {
    dedup_suite::unique_table("prune")
}

/// `progress` was reported once per batch, growing, and only the last one is `done`.
fn check_progress(seen: &[PruneProgress], done: &PruneProgress, batch: u64) {
    assert_eq!(seen.last(), Some(done));
    let mut deleted = 0;
    for (n, progress) in seen.iter().enumerate() {
        deleted += progress.last_batch;
        assert_eq!(progress.deleted, deleted);
        assert_eq!(progress.batches, n as u64 + 1);
        assert_eq!(progress.done, n + 1 == seen.len());
        assert_eq!(progress.cutoff, done.cutoff);
        if !progress.done {
            assert_eq!(progress.last_batch, batch, "only the last batch is short");
        }
    }
    assert!(done.last_batch < batch);
}

macro_rules! prune_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        // Inserts ids `prefix0..=prefix{last}` for a consumer, id `i` aged `first + i * step`
        // seconds. Binds: consumer, prefix, first, step.
        insert_aged = $insert_aged:literal,
        ids = $ids:literal,
        // The storm handler's `table = …`: a `literal` forwarded to the attribute (in an
        // invisible group, which it accepts: tests/regressions/macro_rules_invisible_groups.rs).
        storm_table = $storm_table:literal,
        storm_effects = $storm_effects:literal,
        storm_effects_ddl = $storm_effects_ddl:literal,
        storm_insert_effect = $storm_insert_effect:literal,
        storm_effects_counts = $storm_effects_counts:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::{AssertSqlSafe, Pool};

            type Db = $db;

            async fn create(pool: &Pool<Db>, table: &str) {
                let _one_at_a_time = dedup_suite::ddl_lock().await;
                dedup_runtime::migrate_table(pool, table).await.unwrap();
            }

            async fn drop_table(pool: &Pool<Db>, table: &str) {
                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                    .execute(pool)
                    .await
                    .unwrap();
            }

            async fn insert_aged(
                pool: &Pool<Db>,
                table: &str,
                consumer: &str,
                prefix: &str,
                count: i64,
                first: i64,
                step: i64,
            ) {
                let sql = format!($insert_aged, t = table, last = count - 1);
                let done = sqlx::query(AssertSqlSafe(sql))
                    .bind(consumer)
                    .bind(prefix)
                    .bind(first)
                    .bind(step)
                    .execute(pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), count as u64);
            }

            async fn ids(pool: &Pool<Db>, table: &str, consumer: &str) -> BTreeSet<String> {
                sqlx::query_scalar(AssertSqlSafe(format!($ids, t = table)))
                    .bind(consumer)
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            fn expected(prefixes: &[(&str, std::ops::Range<i64>)]) -> BTreeSet<String> {
                prefixes
                    .iter()
                    .flat_map(|(prefix, range)| range.clone().map(move |i| format!("{prefix}{i}")))
                    .collect()
            }

            /// Two consumers' ids aged from 2 hours under the age to 2 hours over it, one a
            /// minute apart, plus fresh ones. The run takes seconds, so an id a minute
            /// under the age at insertion is still under it when pruned.
            #[tokio::test]
            async fn deletes_only_ids_older_than_the_age() {
                let pool = $pool;
                let table = fresh_table();
                create(&pool, &table).await;
                let older_than = secs(2 * DAY);
                let first = 2 * DAY - 120 * MINUTE;
                insert_aged(&pool, &table, "a", "a-", 241, first, MINUTE).await;
                insert_aged(&pool, &table, "b", "b-", 241, first, MINUTE).await;
                insert_aged(&pool, &table, "a", "fresh-", 20, 0, 1).await;

                // Consumer `a` only, in batches of 7. Id 120 is exactly at the age when
                // inserted: either outcome is right, so it is left out of the comparison.
                let mut seen = Vec::new();
                let done = Prune::new(older_than, secs(DAY))
                    .in_table(table.as_str())
                    .unwrap()
                    .consumer("a")
                    .batch_size(7)
                    .run(&*pool, |progress| seen.push(progress.clone()))
                    .await
                    .unwrap();
                check_progress(&seen, &done, 7);
                assert!((120..=121).contains(&done.deleted), "{done:?}");
                let mut left = ids(&pool, &table, "a").await;
                left.remove("a-120");
                assert_eq!(left, expected(&[("a-", 0..120), ("fresh-", 0..20)]));
                assert_eq!(ids(&pool, &table, "b").await, expected(&[("b-", 0..241)]));

                // What a run over every consumer would do now.
                let prune = Prune::new(older_than, secs(DAY))
                    .in_table(table.as_str())
                    .unwrap();
                let stats = prune.stats(&*pool).await.unwrap();
                assert_eq!(stats.len(), 2, "{stats:?}");
                let (a, b) = (&stats[0], &stats[1]);
                assert_eq!((a.consumer.as_str(), b.consumer.as_str()), ("a", "b"));
                assert!(
                    (140..=141).contains(&a.ids) && a.prunable <= a.ids - 140,
                    "{a:?}"
                );
                assert!(a.oldest < older_than + secs(MINUTE), "{a:?}");
                assert_eq!(b.ids, 241);
                assert!((120..=121).contains(&b.prunable), "{b:?}");
                assert_eq!(b.kept(), b.ids - b.prunable);
                let oldest = secs(2 * DAY + 120 * MINUTE);
                assert!(
                    b.oldest >= oldest && b.oldest < oldest + secs(MINUTE),
                    "{b:?}"
                );
                let kept = b.oldest_kept.unwrap();
                assert!(
                    kept < older_than + dedup_runtime::STAMP_AFTER
                        && kept >= older_than - secs(2 * MINUTE),
                    "{b:?}"
                );

                let done = prune.run(&*pool, |_| {}).await.unwrap();
                assert!(done.done && (120..=122).contains(&done.deleted), "{done:?}");
                let mut left = ids(&pool, &table, "b").await;
                left.remove("b-120");
                assert_eq!(left, expected(&[("b-", 0..120)]));
                let mut left = ids(&pool, &table, "a").await;
                left.remove("a-120");
                assert_eq!(left, expected(&[("a-", 0..120), ("fresh-", 0..20)]));
                for stats in prune.stats(&*pool).await.unwrap() {
                    assert_eq!(stats.prunable, 0, "{stats:?}");
                    // The cutoff keeps `STAMP_AFTER` as a margin past the age.
                    assert!(
                        stats.oldest < older_than + dedup_runtime::STAMP_AFTER,
                        "{stats:?}"
                    );
                }
                drop_table(&pool, &table).await;
            }

            #[tokio::test]
            async fn refuses_an_age_shorter_than_the_window() {
                let pool = $pool;
                let table = fresh_table();
                create(&pool, &table).await;
                insert_aged(&pool, &table, "c", "old-", 50, 3 * DAY, 1).await;
                let all = expected(&[("old-", 0..50)]);

                let short = Prune::new(secs(DAY), secs(2 * DAY))
                    .in_table(table.as_str())
                    .unwrap();
                match short.run(&*pool, |_| panic!("no batch may run")).await {
                    Err(PruneError::WindowTooShort {
                        older_than,
                        redelivery_window,
                    }) => assert_eq!((older_than, redelivery_window), (secs(DAY), secs(2 * DAY))),
                    other => panic!("{other:?}"),
                }
                assert!(matches!(
                    short.stats(&*pool).await,
                    Err(PruneError::WindowTooShort { .. })
                ));
                let barely = Prune::new(secs(DAY) - Duration::from_nanos(1), secs(DAY))
                    .in_table(table.as_str())
                    .unwrap();
                assert!(matches!(
                    barely.run(&*pool, |_| {}).await,
                    Err(PruneError::WindowTooShort { .. })
                ));

                let ok = || Prune::new(secs(DAY), secs(DAY));
                for bad in ["x; DROP TABLE processed_messages", "a.b.c", ""] {
                    assert!(ok().in_table(bad).is_err());
                }
                let refused = ok()
                    .in_table(table.as_str())
                    .unwrap()
                    .batch_size(0)
                    .run(&*pool, |_| {})
                    .await;
                assert!(matches!(
                    refused,
                    Err(PruneError::InvalidBatchSize { size: 0, .. })
                ));
                // A table that does not exist, for the run and for the dry run: recognised
                // by the backend's code, and the message says how to create it.
                let absent = fresh_table();
                let missing = [
                    ok().in_table(absent.as_str())
                        .unwrap()
                        .run(&*pool, |_| {})
                        .await
                        .unwrap_err(),
                    ok().in_table(absent.as_str())
                        .unwrap()
                        .stats(&*pool)
                        .await
                        .unwrap_err(),
                ];
                for missing in missing {
                    match &missing {
                        PruneError::MissingTable { table, error } => {
                            assert_eq!(table, &absent);
                            assert!(error.as_database_error().is_some(), "{error:?}");
                        }
                        other => panic!("{other:?}"),
                    }
                    let text = missing.to_string();
                    assert!(
                        text.starts_with(&format!("the dedup table `{absent}` does not exist"))
                            && text.contains("migrate"),
                        "{text}"
                    );
                    assert!(std::error::Error::source(&missing).is_some());
                }
                assert_eq!(ids(&pool, &table, "c").await, all, "nothing was deleted");

                // An age equal to the window is allowed.
                let done = Prune::new(secs(2 * DAY), secs(2 * DAY))
                    .in_table(table.as_str())
                    .unwrap()
                    .run(&*pool, |_| {})
                    .await
                    .unwrap();
                assert_eq!(done.deleted, 50);
                assert!(ids(&pool, &table, "c").await.is_empty());
                drop_table(&pool, &table).await;
            }

            #[idempotent(consumer = "prune-storm", key = id, table = $storm_table)]
            async fn handle(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($storm_insert_effect)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// 200,000 ids aged 3 to 5 days, pruned at 2 days, while four consumer tasks
            /// process fresh messages, each delivered twice (the copy by another task, so
            /// copies race). No consumer sees an error, every message has exactly one
            /// effect, every fresh id survives, and every old id goes.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn prunes_200k_ids_while_4_consumers_process() {
                const OLD: i64 = 200_000;
                const WORKERS: usize = 4;
                let pool = $pool;
                let table = $storm_table;
                drop_table(&pool, table).await;
                create(&pool, table).await;
                sqlx::raw_sql($storm_effects_ddl)
                    .execute(&*pool)
                    .await
                    .unwrap();
                insert_aged(&pool, table, "prune-storm", "old-", OLD, 3 * DAY, 1).await;

                let run = dedup_suite::unique("storm");
                let next = Arc::new(AtomicU64::new(0));
                let stop = Arc::new(AtomicBool::new(false));
                let workers: Vec<_> = (0..WORKERS)
                    .map(|_| {
                        let (pool, run) = ((*pool).clone(), run.clone());
                        let (next, stop) = (next.clone(), stop.clone());
                        tokio::spawn(async move {
                            let (mut processed, mut duplicates) = (0u64, 0u64);
                            let mut count = |outcome: Outcome<()>| match outcome {
                                Outcome::Processed(()) => processed += 1,
                                Outcome::Duplicate(_) => duplicates += 1,
                            };
                            while !stop.load(Ordering::SeqCst) {
                                let k = next.fetch_add(1, Ordering::SeqCst);
                                count(handle(&pool, &format!("{run}-{k}")).await?);
                                if k > 0 {
                                    // The copy of the previous message, which another task
                                    // may be processing right now.
                                    count(handle(&pool, &format!("{run}-{}", k - 1)).await?);
                                }
                            }
                            Ok::<_, sqlx::Error>((processed, duplicates))
                        })
                    })
                    .collect();

                // The consumers are under way before the prune starts.
                tokio::time::timeout(Duration::from_secs(15), async {
                    while next.load(Ordering::SeqCst) < 2 * WORKERS as u64 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await
                .expect("the consumers process messages");
                let before = next.load(Ordering::SeqCst);
                let done = Prune::new(secs(2 * DAY), secs(DAY))
                    .in_table(table)
                    .unwrap()
                    .run(&*pool, |_| {})
                    .await
                    .unwrap();
                let during = next.load(Ordering::SeqCst) - before;
                stop.store(true, Ordering::SeqCst);
                let (mut processed, mut duplicates) = (0, 0);
                for worker in workers {
                    let (p, d) = worker.await.unwrap().expect("no consumer sees an error");
                    processed += p;
                    duplicates += d;
                }
                let messages = next.load(Ordering::SeqCst);

                assert_eq!(done.deleted, OLD as u64, "{done:?}");
                // What the test is about: the prune ran while the consumers processed. How
                // much it slowed them is the benchmark's figure, not asserted here.
                assert!(during > 0, "the consumers kept processing during the prune");
                assert_eq!(processed, messages, "each message processed once");
                assert_eq!(
                    duplicates,
                    messages - 1,
                    "each copy acknowledged as a duplicate"
                );
                let left = ids(&pool, table, "prune-storm").await;
                let fresh: BTreeSet<String> = (0..messages).map(|k| format!("{run}-{k}")).collect();
                assert_eq!(
                    left, fresh,
                    "every fresh id survives, every old one is gone"
                );
                let (effects, distinct): (i64, i64) = sqlx::query_as($storm_effects_counts)
                    .fetch_one(&*pool)
                    .await
                    .unwrap();
                assert_eq!((effects, distinct), (messages as i64, messages as i64));
                for k in (0..messages).step_by(97) {
                    let again = handle(&*pool, &format!("{run}-{k}")).await.unwrap();
                    assert!(again.is_duplicate(), "{k}");
                }
                drop_table(&pool, table).await;
                drop_table(&pool, $storm_effects).await;
            }
        }
    };
}

prune_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    insert_aged = "INSERT INTO {t} (consumer, message_id, processed_at) \
                   SELECT $1, $2 || i, now() - make_interval(secs => ($3 + i * $4)::float8) \
                   FROM generate_series(0, {last}) i",
    ids = "SELECT message_id FROM {t} WHERE consumer = $1",
    storm_table = "prune_storm_postgres",
    storm_effects = "prune_storm_effects_postgres",
    storm_effects_ddl = "DROP TABLE IF EXISTS prune_storm_effects_postgres; \
                         CREATE TABLE prune_storm_effects_postgres (message_id text NOT NULL)",
    storm_insert_effect = "INSERT INTO prune_storm_effects_postgres (message_id) VALUES ($1)",
    storm_effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                            FROM prune_storm_effects_postgres",
);

prune_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    // MariaDB's sequence engine: its recursive CTEs stop at 1,000 rows by default.
    insert_aged = "INSERT INTO {t} (consumer, message_id, processed_at) \
                   SELECT ?, CONCAT(?, seq), NOW(6) - INTERVAL (? + seq * ?) SECOND \
                   FROM seq_0_to_{last}",
    ids = "SELECT CAST(message_id AS CHAR) FROM {t} WHERE consumer = ?",
    storm_table = "prune_storm_mysql",
    storm_effects = "prune_storm_effects_mysql",
    storm_effects_ddl = "DROP TABLE IF EXISTS prune_storm_effects_mysql; \
                         CREATE TABLE prune_storm_effects_mysql \
                         (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    storm_insert_effect = "INSERT INTO prune_storm_effects_mysql (message_id) VALUES (?)",
    storm_effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                            FROM prune_storm_effects_mysql",
);

prune_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    insert_aged = "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < {last}) \
                   INSERT INTO {t} (consumer, message_id, processed_at) \
                   SELECT ?1, ?2 || i, \
                   strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?3 + i * ?4) || ' seconds') \
                   FROM s",
    ids = "SELECT message_id FROM {t} WHERE consumer = ?",
    storm_table = "prune_storm_sqlite",
    storm_effects = "prune_storm_effects_sqlite",
    storm_effects_ddl = "DROP TABLE IF EXISTS prune_storm_effects_sqlite; \
                         CREATE TABLE prune_storm_effects_sqlite (message_id TEXT NOT NULL)",
    storm_insert_effect = "INSERT INTO prune_storm_effects_sqlite (message_id) VALUES (?)",
    storm_effects_counts = "SELECT COUNT(*), COUNT(DISTINCT message_id) \
                            FROM prune_storm_effects_sqlite",
);

/// On SQLite `processed_at` is text, compared as text: the cutoff must be written exactly
/// like the column's default, or the comparison would not be a time comparison.
#[tokio::test]
async fn sqlite_cutoff_is_written_like_the_column_default() {
    let pool = dedup_suite::sqlite().await;
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('shape', 'now')")
        .execute(&*pool)
        .await
        .unwrap();
    let written: String =
        sqlx::query_scalar("SELECT processed_at FROM processed_messages WHERE consumer = 'shape'")
            .fetch_one(&*pool)
            .await
            .unwrap();
    let done = Prune::new(Duration::from_millis(1_500), Duration::ZERO)
        .run(&*pool, |_| {})
        .await
        .unwrap();
    let shape = |text: &str| -> String {
        text.chars()
            .map(|c| if c.is_ascii_digit() { '9' } else { c })
            .collect()
    };
    assert_eq!(shape(&done.cutoff), "9999-99-99T99:99:99.999Z");
    assert_eq!(shape(&done.cutoff), shape(&written));
    assert!(done.cutoff < written, "{} < {written}", done.cutoff);
    assert_eq!(done.deleted, 0, "the row is younger than the age");
}
