//! MariaDB/MySQL pruning computed its cutoff on the pruner session's clock (`NOW(6)`),
//! in that session's `time_zone`, while `processed_at` is a zone-less `DATETIME(6)` that
//! the claim writes in UTC (`UTC_TIMESTAMP(6)`). With the pruner's sessions on `+05:00`,
//! `Prune::new(1h, 1h)` deleted an id processed a second ago; on `-05:00` it kept ids
//! hours past the age, and `stats` measured ages five hours off (issue 8, defect 5).
//!
//! Every test prunes a table of its own, rows written the way the claim writes them
//! (`UTC_TIMESTAMP(6)`), and drops it at the end.

use std::collections::BTreeSet;
use std::time::Duration;

use dedup_runtime::Prune;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Row};

const HOUR: Duration = Duration::from_secs(3600);
const MINUTE: Duration = Duration::from_secs(60);

/// A pool whose sessions run in `zone` (sqlx's default is `+00:00`).
async fn pool_in(zone: &str) -> MySqlPool {
    drop(dedup_suite::mysql().await); // reachable (or a loud failure), migrated
    let options: MySqlConnectOptions = dedup_suite::mysql_url().parse().unwrap();
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(options.timezone(Some(zone.to_owned())))
        .await
        .expect("MariaDB is not reachable");
    // The setting is real: the session's clock is `zone`, UTC_TIMESTAMP is not.
    let row = sqlx::query(
        "SELECT @@session.time_zone, \
         TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(6), NOW(6))",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let session: String = row.get(0);
    assert_eq!(session, zone);
    let offset: i64 = row.get(1);
    let expected = match zone {
        "+05:00" => 300,
        "-05:00" => -300,
        _ => 0,
    };
    assert_eq!(offset, expected, "the session's clock is {zone}");
    pool
}

async fn ids(pool: &MySqlPool, table: &str) -> BTreeSet<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT CAST(message_id AS CHAR) FROM {table}"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// A pruner whose sessions run in `zone`, on a table holding an id processed a second
/// ago and one processed two hours ago (both in UTC, as the claim writes them):
/// `Prune::new(1h, 1h)` counts and deletes the old one only.
async fn prunes_on_utc_with_sessions_in(zone: &str) {
    let pool = pool_in(zone).await;
    let table = dedup_suite::unique_table("regress_tz");
    dedup_runtime::migrate_table(&pool, &table).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer, message_id, processed_at) VALUES \
         ('tz', 'fresh', UTC_TIMESTAMP(6) - INTERVAL 1 SECOND), \
         ('tz', 'old', UTC_TIMESTAMP(6) - INTERVAL 2 HOUR)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let prune = Prune::new(HOUR, HOUR).in_table(table.as_str()).unwrap();
    let stats = prune.stats(&pool).await.unwrap();
    assert_eq!(stats.len(), 1, "{stats:?}");
    let tz = &stats[0];
    assert_eq!((tz.ids, tz.prunable), (2, 1), "{zone}: {tz:?}");
    assert!(
        tz.oldest >= 2 * HOUR && tz.oldest < 2 * HOUR + MINUTE,
        "{zone}: oldest {:?}",
        tz.oldest
    );
    let kept = tz.oldest_kept.expect("the fresh id is kept");
    assert!(
        kept >= Duration::from_secs(1) && kept < MINUTE,
        "{zone}: oldest kept {kept:?}"
    );

    let done = prune.run(&pool, |_| {}).await.unwrap();
    assert_eq!(done.deleted, 1, "{zone}: {done:?}");
    assert_eq!(
        ids(&pool, &table).await,
        BTreeSet::from(["fresh".to_owned()]),
        "{zone}: the fresh id stays, the old one goes"
    );

    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}

/// The dangerous direction: a clock ahead of UTC moved the cutoff into the future.
#[tokio::test]
async fn pruner_ahead_of_utc_keeps_a_fresh_id() {
    prunes_on_utc_with_sessions_in("+05:00").await;
}

/// A clock behind UTC kept ids hours past the age.
#[tokio::test]
async fn pruner_behind_utc_deletes_an_old_id() {
    prunes_on_utc_with_sessions_in("-05:00").await;
}

/// The converse: a pruner in UTC, rows written the new way.
#[tokio::test]
async fn pruner_in_utc() {
    prunes_on_utc_with_sessions_in("+00:00").await;
}
