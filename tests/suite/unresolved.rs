//! Rows that are not processed — `state` set: 1 in progress (a mark or lease held by
//! `owner` until `expires_at`), 2 outcome unknown — on every backend: pruning never deletes
//! them, at any age and whatever their lease's expiry, and counts them
//! (`ConsumerStats::unresolved`); the ledger never reports them as processed.
//!
//! Nothing writes such rows yet (mark-first and leases come later): the tests insert them
//! by hand, with `processed_at` backdated. Each case runs on PostgreSQL, MariaDB and a
//! temporary SQLite file, in a table of its own.

use std::collections::BTreeSet;
use std::time::Duration;

use dedup_runtime::{Ledger, Prune};
use sqlx::AssertSqlSafe;

const DAY: i64 = 24 * 3600;

macro_rules! unresolved_suite {
    (
        $backend:ident,
        db = $db:ty,
        pool = $pool:expr,
        // Inserts (consumer, id, processed `age` seconds ago, state, owner, lease expiring
        // `expires_in` seconds from now, negative for a past expiry). Binds in that order.
        insert = $insert:literal,
        ids = $ids:literal $(,)?
    ) => {
        mod $backend {
            use super::*;

            type Db = $db;

            async fn insert(
                pool: &sqlx::Pool<Db>,
                table: &str,
                id: &str,
                age: i64,
                state: Option<i16>,
                expires_in: Option<i64>,
            ) {
                let owner = state.map(|_| vec![0xA5u8; 16]);
                sqlx::query(AssertSqlSafe(format!($insert, t = table)))
                    .bind("c")
                    .bind(id)
                    .bind(age)
                    .bind(state)
                    .bind(owner)
                    .bind(expires_in)
                    .execute(pool)
                    .await
                    .unwrap_or_else(|error| panic!("{id}: {error}"));
            }

            async fn ids(pool: &sqlx::Pool<Db>, table: &str) -> BTreeSet<String> {
                sqlx::query_scalar(AssertSqlSafe(format!($ids, t = table)))
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect()
            }

            #[tokio::test]
            async fn pruning_keeps_rows_not_processed_at_any_age() {
                let pool = $pool;
                let table = dedup_suite::unique_table("unresolved");
                {
                    let _one_at_a_time = dedup_suite::ddl_lock().await;
                    dedup_runtime::migrate_table(&*pool, &table).await.unwrap();
                }
                for i in 0..5 {
                    insert(&pool, &table, &format!("done-{i}"), 30 * DAY, None, None).await;
                }
                // An hour old: kept at a day, gone at age zero (the cutoff keeps `STAMP_AFTER`).
                insert(&pool, &table, "fresh", 3600, None, None).await;
                // Leases held (expiring in a minute), a lease expired long ago, marks of
                // unknown outcome: all 30 days old.
                insert(&pool, &table, "lease-a", 30 * DAY, Some(1), Some(60)).await;
                insert(&pool, &table, "lease-b", 30 * DAY, Some(1), Some(60)).await;
                insert(
                    &pool,
                    &table,
                    "lease-expired",
                    30 * DAY,
                    Some(1),
                    Some(-29 * DAY),
                )
                .await;
                insert(
                    &pool,
                    &table,
                    "unknown-a",
                    30 * DAY,
                    Some(2),
                    Some(-29 * DAY),
                )
                .await;
                insert(&pool, &table, "unknown-b", 30 * DAY, Some(2), None).await;
                let unresolved: BTreeSet<String> = [
                    "lease-a",
                    "lease-b",
                    "lease-expired",
                    "unknown-a",
                    "unknown-b",
                ]
                .map(String::from)
                .into();

                let day = Duration::from_secs(DAY as u64);
                let prune = Prune::new(day, day)
                    .in_table(table.as_str())
                    .unwrap()
                    .batch_size(2);
                let stats = prune.stats(&*pool).await.unwrap();
                assert_eq!(stats.len(), 1, "{stats:?}");
                let c = &stats[0];
                assert_eq!((c.ids, c.prunable, c.unresolved), (11, 5, 5), "{c:?}");
                assert_eq!(c.kept(), 6);
                // The oldest kept row is an unresolved one, 30 days old.
                assert!(c.oldest_kept.unwrap() > 29 * day, "{c:?}");

                let done = prune.run(&*pool, |_| {}).await.unwrap();
                assert_eq!(done.deleted, 5, "{done:?}");
                let mut left = unresolved.clone();
                left.insert("fresh".to_owned());
                assert_eq!(ids(&pool, &table).await, left);

                // Even at age zero (everything processed goes) they stay.
                let zero = Prune::new(Duration::ZERO, Duration::ZERO)
                    .in_table(table.as_str())
                    .unwrap();
                let done = zero.run(&*pool, |_| {}).await.unwrap();
                assert_eq!(done.deleted, 1, "only `fresh`: {done:?}");
                assert_eq!(ids(&pool, &table).await, unresolved);
                let stats = zero.stats(&*pool).await.unwrap();
                let c = &stats[0];
                assert_eq!((c.ids, c.prunable, c.unresolved), (5, 0, 5), "{c:?}");
                assert!(c.oldest_kept.unwrap() > 29 * day, "{c:?}");

                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
                    .execute(&*pool)
                    .await
                    .unwrap();
            }

            #[tokio::test]
            async fn the_ledger_does_not_report_rows_not_processed() {
                let pool = $pool;
                let table = dedup_suite::unique_table("unresolved_ledger");
                {
                    let _one_at_a_time = dedup_suite::ddl_lock().await;
                    dedup_runtime::migrate_table(&*pool, &table).await.unwrap();
                }
                insert(&pool, &table, "done", 60, None, None).await;
                insert(&pool, &table, "in-progress", 60, Some(1), Some(60)).await;
                insert(&pool, &table, "unknown", 60, Some(2), Some(-1)).await;
                let ledger = Ledger::new(&*pool).in_table(&table).unwrap();
                assert!(ledger.processed_at("c", "done").await.unwrap().is_some());
                assert_eq!(ledger.processed_at("c", "in-progress").await.unwrap(), None);
                assert_eq!(ledger.processed_at("c", "unknown").await.unwrap(), None);
                // Forgetting one releases it (documented): the row goes.
                assert!(ledger.forget("c", "in-progress").await.unwrap());
                assert!(!ledger.forget("c", "in-progress").await.unwrap());
                let left = ids(&pool, &table).await;
                assert_eq!(left, ["done", "unknown"].map(String::from).into());

                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
                    .execute(&*pool)
                    .await
                    .unwrap();
            }
        }
    };
}

unresolved_suite!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    insert = "INSERT INTO {t} (consumer, message_id, processed_at, state, owner, expires_at) \
              VALUES ($1, $2, now() - make_interval(secs => $3::float8), $4, $5, \
              now() + make_interval(secs => $6::float8))",
    ids = "SELECT message_id FROM {t}",
);

unresolved_suite!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    insert = "INSERT INTO {t} (consumer, message_id, processed_at, state, owner, expires_at) \
              VALUES (?, ?, UTC_TIMESTAMP(6) - INTERVAL ? SECOND, ?, ?, \
              UTC_TIMESTAMP(6) + INTERVAL ? SECOND)",
    ids = "SELECT CAST(message_id AS CHAR) FROM {t}",
);

unresolved_suite!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    insert = "INSERT INTO {t} (consumer, message_id, processed_at, state, owner, expires_at) \
              VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || ?3 || ' seconds'), \
              ?4, ?5, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?6 || ' seconds'))",
    ids = "SELECT message_id FROM {t}",
);
