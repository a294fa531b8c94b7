//! MySQL and MariaDB: `DELETE` joined to the oldest keys below the cutoff, at `READ COMMITTED`.
//!
//! `processed_at` is a `DATETIME(6)`: a wall-clock reading with no zone, which the claim
//! writes in UTC (`UTC_TIMESTAMP(6)`) whatever the writer session's `time_zone`. Every
//! clock reading here is therefore `UTC_TIMESTAMP(6)` too, never `NOW(6)`, whose value
//! follows the pruner session's `time_zone`: a pruner on `+05:00` would put the cutoff
//! five hours in the future and delete fresh ids. The cutoff travels as the text of a
//! `DATETIME(6)` (`2026-11-12 07:35:19.681609`), which no session setting changes on its
//! way back in through `CAST(? AS DATETIME(6))`.

use std::time::Duration;

use sqlx::{AssertSqlSafe, MySql, Pool, Row};

use super::{ConsumerStats, PruneSql, count, micros_up};
use crate::table::Table;

/// `READ COMMITTED` for this transaction only, so the pooled connection keeps its
/// defaults: under `REPEATABLE READ` the range scan would take next-key locks, and with no
/// young row after the old ones, the lock on the index's end would block every consumer's
/// insert until the batch commits. One statement with the `START TRANSACTION`, so that no
/// cancellation can leave the setting behind for the connection's next user.
const BEGIN_READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

impl PruneSql for MySql {
    async fn cutoff(pool: &Pool<Self>, age: Duration) -> Result<String, sqlx::Error> {
        // UTC, like `processed_at`, whatever this session's `time_zone` is.
        sqlx::query_scalar("SELECT CAST(UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AS CHAR)")
            .bind(micros_up(age))
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
        // The oldest keys come from the `processed_at` index (it holds the primary key
        // too), and are deleted by primary key. Given `consumer = ?`, the optimizer would
        // rather range-scan the primary key, then sort and lock every old row of the
        // consumer for each batch (measured: 143 ms instead of 30 ms per batch of 2,000):
        // `IGNORE INDEX (PRIMARY)` rules that out; single-table `DELETE` takes no index
        // hint, hence the join. `state IS NULL` on both: a row in progress or of unknown
        // outcome is never deleted, at any age. MySQL has no `DELETE … RETURNING`: the batch's newest
        // `processed_at` is read first, in the same transaction, by the same query.
        let name = table.name();
        let after_sql = after.map_or("", |_| " AND processed_at >= CAST(? AS DATETIME(6))");
        let consumer_sql = consumer.map_or("", |_| " AND consumer = ?");
        let batch = format!(
            "FROM {name} IGNORE INDEX (PRIMARY) \
             WHERE processed_at < CAST(? AS DATETIME(6)) AND state IS NULL{after_sql}{consumer_sql} \
             ORDER BY processed_at LIMIT ?"
        );
        let newest = format!(
            "SELECT CAST(MAX(processed_at) AS CHAR) FROM (SELECT processed_at {batch}) AS batch"
        );
        let delete = format!(
            "DELETE gone FROM {name} AS gone \
             JOIN (SELECT consumer, message_id {batch}) AS batch USING (consumer, message_id) \
             WHERE gone.processed_at < CAST(? AS DATETIME(6)) AND gone.state IS NULL"
        );
        let mut tx = pool.begin_with(BEGIN_READ_COMMITTED).await?;
        let mut last = sqlx::query_scalar(AssertSqlSafe(newest)).bind(cutoff);
        let mut query = sqlx::query(AssertSqlSafe(delete)).bind(cutoff);
        if let Some(after) = after {
            last = last.bind(after);
            query = query.bind(after);
        }
        if let Some(consumer) = consumer {
            last = last.bind(consumer);
            query = query.bind(consumer);
        }
        let last: Option<String> = last.bind(limit).fetch_one(&mut *tx).await?;
        let deleted = query
            .bind(limit)
            .bind(cutoff)
            .execute(&mut *tx)
            .await?
            .rows_affected();
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
            " WHERE consumer = ?"
        } else {
            ""
        };
        let sql = format!(
            "SELECT consumer, COUNT(*), \
             CAST(SUM(processed_at < CAST(? AS DATETIME(6)) AND state IS NULL) AS SIGNED), \
             TIMESTAMPDIFF(MICROSECOND, MIN(processed_at), UTC_TIMESTAMP(6)), \
             TIMESTAMPDIFF(MICROSECOND, \
                 MIN(CASE WHEN processed_at >= CAST(? AS DATETIME(6)) OR state IS NOT NULL \
                     THEN processed_at END), \
                 UTC_TIMESTAMP(6)), \
             CAST(SUM(state IS NOT NULL) AS SIGNED) \
             FROM {name}{by_consumer} GROUP BY consumer ORDER BY consumer"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(cutoff).bind(cutoff);
        if let Some(consumer) = consumer {
            query = query.bind(consumer);
        }
        let rows = query.fetch_all(pool).await?;
        let age = |micros: i64| Duration::from_micros(count(micros));
        rows.iter()
            .map(|row| {
                let consumer: Vec<u8> = row.try_get(0)?;
                Ok(ConsumerStats {
                    // Consumer names come from string literals: always UTF-8.
                    consumer: String::from_utf8_lossy(&consumer).into_owned(),
                    ids: count(row.try_get(1)?),
                    prunable: count(row.try_get(2)?),
                    oldest: age(row.try_get(3)?),
                    oldest_kept: row.try_get::<Option<i64>, _>(4)?.map(age),
                    unresolved: count(row.try_get(5)?),
                })
            })
            .collect()
    }
}
