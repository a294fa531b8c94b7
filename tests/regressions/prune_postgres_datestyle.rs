//! PostgreSQL pruning read timestamps back as text printed in the session's `DateStyle`
//! and `TimeZone` — the cutoff (`(now() - $1)::text`) and each batch's newest
//! `processed_at` (`max(processed_at)::text`) — and parsed that text again, possibly on
//! another pooled session. A cutoff printed day first (`SET DateStyle = 'SQL, DMY'` left
//! behind by application code) was read month first: `Prune::new(19 days, 19 days)`
//! deleted an id processed a second ago. In a zone whose abbreviation means something
//! else on input (`Asia/Kolkata` prints `IST`, read back as Israel's +02), the cutoff
//! moved 3.5 h later (issue 8, defect 9).
//!
//! Every test prunes a table of its own and drops it at the end.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dedup_runtime::Prune;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Executor as _};

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// Day first, in a zone whose abbreviation (`IST`) reads back as another zone's.
const DAY_FIRST: &str = "SET DateStyle = 'SQL, DMY'; SET TimeZone = 'Asia/Kolkata'";
/// sqlx's own session defaults.
const DEFAULTS: &str = "SET DateStyle = 'ISO, MDY'; SET TimeZone = 'UTC'";

/// A table holding a fresh id, one 19 days less an hour old (both under the age of
/// 19 days), and three 20 days and more old, an hour apart.
async fn aged_table(pool: &PgPool) -> String {
    drop(dedup_suite::postgres().await); // reachable (or a loud failure), migrated
    let table = dedup_suite::unique_table("regress_datestyle");
    dedup_runtime::migrate_table(pool, &table).await.unwrap();
    pool.execute(AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer, message_id, processed_at) VALUES \
         ('ds', 'fresh', now() - interval '1 second'), \
         ('ds', 'young', now() - interval '19 days' + interval '1 hour'), \
         ('ds', 'old-0', now() - interval '20 days'), \
         ('ds', 'old-1', now() - interval '20 days 1 hour'), \
         ('ds', 'old-2', now() - interval '20 days 2 hours')"
    )))
    .await
    .unwrap();
    table
}

async fn ids(pool: &PgPool, table: &str) -> BTreeSet<String> {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT message_id FROM {table}")))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// `stats` agrees with what `run` then deletes: the three old ids, batch by batch.
async fn prune_keeps_the_young(pool: &PgPool, table: &str) {
    let prune = Prune::new(19 * DAY, 19 * DAY).in_table(table).unwrap();
    let stats = prune.stats(pool).await.unwrap();
    assert_eq!(stats.len(), 1, "{stats:?}");
    assert_eq!((stats[0].ids, stats[0].prunable), (5, 3), "{stats:?}");
    assert!(stats[0].oldest >= 20 * DAY + 2 * HOUR, "{stats:?}");
    let kept = stats[0].oldest_kept.expect("two ids are kept");
    assert!(
        kept > 19 * DAY - 2 * HOUR && kept < 19 * DAY,
        "oldest kept {kept:?}"
    );

    // One id per batch: each batch starts where the last one's newest id was.
    let done = prune.batch_size(1).run(pool, |_| {}).await.unwrap();
    assert_eq!(done.deleted, 3, "{done:?}");
    let shape: String = done
        .cutoff
        .chars()
        .map(|c| if c.is_ascii_digit() { '9' } else { c })
        .collect();
    assert_eq!(shape, "9999-99-99T99:99:99.999999Z", "{}", done.cutoff);
    assert_eq!(
        ids(pool, table).await,
        BTreeSet::from(["fresh".to_owned(), "young".to_owned()])
    );
    pool.execute(AssertSqlSafe(format!("DROP TABLE {table}")))
        .await
        .unwrap();
}

/// Every other checkout of the pool's one connection finds it as application code left
/// it (day first, `Asia/Kolkata`), the others as sqlx set it up: the cutoff is printed on
/// one session and read on the next.
#[tokio::test]
async fn cutoff_printed_day_first_is_not_read_month_first() {
    let checkouts = Arc::new(AtomicU64::new(0));
    let counter = checkouts.clone();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .before_acquire(move |conn, _| {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let style = if n.is_multiple_of(2) {
                    DAY_FIRST
                } else {
                    DEFAULTS
                };
                conn.execute(style).await?;
                Ok(true)
            })
        })
        .connect(&dedup_suite::postgres_url())
        .await
        .expect("PostgreSQL is not reachable");
    let table = aged_table(&pool).await;
    // Even checkouts are day first: make the next one (the probe's) even.
    if !checkouts.load(Ordering::SeqCst).is_multiple_of(2) {
        pool.execute("SELECT 1").await.unwrap();
    }
    let day_first: String = sqlx::query_scalar("SELECT now()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(day_first.ends_with(" IST"), "{day_first}");
    // An odd checkout, so that the cutoffs of `stats` and `run` are printed day first and
    // read on the next checkout, on sqlx's defaults.
    pool.execute("SELECT 1").await.unwrap();
    prune_keeps_the_young(&pool, &table).await;
}

/// Every session day first in `Asia/Kolkata`: printed and read on the same session, the
/// `IST` of the text still read back as +02.
#[tokio::test]
async fn a_zone_abbreviation_is_not_read_as_another_zone() {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| Box::pin(async move { conn.execute(DAY_FIRST).await.map(drop) }))
        .connect(&dedup_suite::postgres_url())
        .await
        .expect("PostgreSQL is not reachable");
    let table = aged_table(&pool).await;
    prune_keeps_the_young(&pool, &table).await;
}
