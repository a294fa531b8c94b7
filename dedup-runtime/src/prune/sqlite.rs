//! SQLite: `BEGIN IMMEDIATE`, then `DELETE` of the oldest keys below the cutoff.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Pool, Row, Sqlite};

use super::{ConsumerStats, PruneSql, age_from_secs, count, micros_up};
use crate::table::Table;

/// The format of the column's default: the cutoff must be written the same way for the
/// text comparison to be a time comparison.
const CUTOFF: &str = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1)";

impl PruneSql for Sqlite {
    async fn cutoff(pool: &Pool<Self>, age: Duration) -> Result<String, sqlx::Error> {
        // SQLite's clock has millisecond resolution: round the age up to whole
        // milliseconds, so that the cutoff is never later than `now - age`.
        let millis = u64::try_from(micros_up(age)).unwrap_or(0).div_ceil(1_000);
        let modifier = format!("-{}.{:03} seconds", millis / 1_000, millis % 1_000);
        sqlx::query_scalar(CUTOFF)
            .bind(modifier)
            .fetch_one(pool)
            .await
    }

    async fn delete_batch<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: Option<&'a str>,
        cutoff: &'a str,
        after: Option<&'a str>,
        limit: u32,
    ) -> Result<(u64, Option<String>), sqlx::Error> {
        // `DELETE … LIMIT` needs a compile-time option, and `RETURNING` a recent SQLite:
        // select the batch's newest `processed_at`, then delete the same oldest keys
        // through the `processed_at` index, checking the cutoff again on each row. `state IS
        // NULL` on both: a row in progress or of unknown outcome is never deleted, at any age.
        let name = table.name();
        let mut next = 2;
        let mut param = || {
            next += 1;
            format!("?{next}")
        };
        let after_sql =
            after.map_or_else(String::new, |_| format!(" AND processed_at >= {}", param()));
        // `+consumer`: SQLite's way to keep a term from choosing the index. On the primary
        // key it would read and sort all of the consumer's old ids for every batch.
        let consumer_sql =
            consumer.map_or_else(String::new, |_| format!(" AND +consumer = {}", param()));
        let batch = format!(
            "FROM {name} WHERE processed_at < ?1 AND state IS NULL{after_sql}{consumer_sql} \
             ORDER BY processed_at LIMIT ?2"
        );
        let newest = format!("SELECT MAX(processed_at) FROM (SELECT processed_at {batch})");
        let delete = format!(
            "DELETE FROM {name} WHERE (consumer, message_id) IN \
             (SELECT consumer, message_id {batch}) AND processed_at < ?1 AND state IS NULL"
        );
        // Writers queue for the lock at BEGIN instead of failing on upgrade.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut last = sqlx::query_scalar(AssertSqlSafe(newest))
            .bind(cutoff)
            .bind(i64::from(limit));
        let mut query = sqlx::query(AssertSqlSafe(delete))
            .bind(cutoff)
            .bind(i64::from(limit));
        if let Some(after) = after {
            last = last.bind(after);
            query = query.bind(after);
        }
        if let Some(consumer) = consumer {
            last = last.bind(consumer);
            query = query.bind(consumer);
        }
        let last: Option<String> = last.fetch_one(&mut *tx).await?;
        let deleted = query.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok((deleted, last))
    }

    async fn stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: Option<&'a str>,
        cutoff: &'a str,
    ) -> Result<Vec<ConsumerStats>, sqlx::Error> {
        let name = table.name();
        let by_consumer = if consumer.is_some() {
            " WHERE consumer = ?2"
        } else {
            ""
        };
        let sql = format!(
            "SELECT consumer, COUNT(*), SUM(processed_at < ?1 AND state IS NULL), \
             (julianday('now') - julianday(MIN(processed_at))) * 86400.0, \
             (julianday('now') - julianday(MIN(CASE WHEN processed_at >= ?1 \
                 OR state IS NOT NULL THEN processed_at END))) * 86400.0, \
             SUM(state IS NOT NULL) \
             FROM {name}{by_consumer} GROUP BY consumer ORDER BY consumer"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(cutoff);
        if let Some(consumer) = consumer {
            query = query.bind(consumer);
        }
        let rows = query.fetch_all(pool).await?;
        rows.iter()
            .map(|row| {
                Ok(ConsumerStats {
                    consumer: row.try_get(0)?,
                    ids: count(row.try_get(1)?),
                    prunable: count(row.try_get(2)?),
                    oldest: age_from_secs(row.try_get(3)?),
                    oldest_kept: row.try_get::<Option<f64>, _>(4)?.map(age_from_secs),
                    unresolved: count(row.try_get(5)?),
                })
            })
            .collect()
    }
}
