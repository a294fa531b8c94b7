//! Issue 8, defect 5 (the writer's half) — MariaDB/MySQL: `processed_at` was written in
//! the consumer session's time zone (`DEFAULT CURRENT_TIMESTAMP(6)`), compared with a
//! cutoff in the pruner's: with consumers on `-05:00` and the pruner on the default,
//! `Prune::new(1h, 1h)` deleted a 1-second-old id, and the redelivery doubled the effect.
//! The claim and the commit now write `UTC_TIMESTAMP(6)`, and pruning compares in UTC.

use std::time::Duration;

use dedup_runtime::{Prune, idempotent};
use sqlx::MySqlConnection;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

/// A table created the way earlier versions did, with the session-zone default (and the
/// columns of 0.2 added by hand, which pruning reads, without `migrate`'s upgrade of the
/// default).
const TABLE: &str = "regress_tz_processed";

#[idempotent(consumer = "regress-my-tz", key = id, table = "regress_tz_processed")]
async fn handler(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[tokio::test]
async fn a_consumer_in_another_zone_writes_utc_and_its_ids_survive_pruning() {
    let pruner = dedup_suite::mysql().await;
    dedup_suite::ddl(
        &pruner,
        &format!(
            "CREATE TABLE IF NOT EXISTS {TABLE} (consumer VARBINARY(255) NOT NULL, \
             message_id VARBINARY(255) NOT NULL, \
             processed_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), \
             PRIMARY KEY (consumer, message_id), KEY processed_at_idx (processed_at)) \
             ENGINE = InnoDB; \
             ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS state TINYINT NULL, \
             ADD COLUMN IF NOT EXISTS owner BINARY(16) NULL, \
             ADD COLUMN IF NOT EXISTS expires_at DATETIME(6) NULL"
        ),
    )
    .await;
    let options: MySqlConnectOptions = dedup_suite::mysql_url().parse().unwrap();
    let consumer = MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(options.timezone(Some("-05:00".to_owned())))
        .await
        .unwrap();
    let zone: String = sqlx::query_scalar("SELECT @@session.time_zone")
        .fetch_one(&consumer)
        .await
        .unwrap();
    assert_eq!(zone, "-05:00");

    let id = dedup_suite::unique("tz");
    assert!(handler(&consumer, &id).await.unwrap().is_processed());
    let age: i64 = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(SECOND, processed_at, UTC_TIMESTAMP(6)) FROM regress_tz_processed \
         WHERE consumer = 'regress-my-tz' AND message_id = ?",
    )
    .bind(&id)
    .fetch_one(&pruner)
    .await
    .unwrap();
    assert!((0..60).contains(&age), "processed_at is UTC: {age} s old");

    let hour = Duration::from_secs(3600);
    Prune::new(hour, hour)
        .consumer("regress-my-tz")
        .in_table(TABLE)
        .unwrap()
        .run(&pruner, |_| {})
        .await
        .unwrap();
    let left = dedup_suite::claims_in(&pruner, TABLE, "regress-my-tz", &id).await;
    assert_eq!(left, 1, "a second-old id is not pruned at an hour");
    assert!(handler(&consumer, &id).await.unwrap().is_duplicate());
}

/// The table's default is UTC too, upgraded in place by `migrate`.
#[tokio::test]
async fn migrate_upgrades_the_default_to_utc() {
    let pool = dedup_suite::mysql().await;
    let table = dedup_suite::unique_table("regress_tz");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {table}; \
         CREATE TABLE {table} (consumer VARBINARY(255) NOT NULL, \
         message_id VARBINARY(255) NOT NULL, \
         processed_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), \
         PRIMARY KEY (consumer, message_id), KEY processed_at_idx (processed_at)) ENGINE = InnoDB"
    )))
    .execute(&pool)
    .await
    .unwrap();
    dedup_runtime::migrate_table(&pool, &table).await.unwrap();
    dedup_runtime::migrate_table(&pool, &table).await.unwrap();
    let default: String = sqlx::query_scalar(
        "SELECT COLUMN_DEFAULT FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'processed_at'",
    )
    .bind(&table)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        default.to_lowercase().contains("utc_timestamp"),
        "{default}"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}
