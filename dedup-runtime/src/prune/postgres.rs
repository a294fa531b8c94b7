//! PostgreSQL: `DELETE` by `ctid` of the oldest rows below the cutoff, found in index order.
//!
//! Two timestamps travel as text between statements, and so between pooled sessions: the
//! cutoff, and each batch's newest `processed_at` (where the next batch starts). A
//! `timestamptz` cast to text is printed in the session's `DateStyle` and `TimeZone`,
//! which application code may have changed on any pooled session: `SET DateStyle = 'SQL,
//! DMY'` prints `12/11/2026 …`, which a session on the default `MDY` reads as December
//! 11th; `Asia/Kolkata` prints the abbreviation `IST`, which every session reads back as
//! Israel's +02. So nothing here is printed with `::text`: `utc_text!` writes an instant
//! as ISO 8601 in UTC (`2026-11-12T07:35:19.681609Z`), which `::timestamptz` reads back as
//! the same instant under every `DateStyle` and `TimeZone`, to the microsecond.

use std::time::Duration;

use sqlx::postgres::types::PgInterval;
use sqlx::{AssertSqlSafe, Pool, Postgres, Row};

use super::{ConsumerStats, PruneSql, age_from_secs, count, micros_up};
use crate::table::Table;

/// Walk the `processed_at` index in order and stop after `limit` rows. Without it, a
/// planner that underestimates the old rows (a table never analyzed, or grown since)
/// picks a bitmap scan that reads and sorts every old row, for every batch: measured
/// 110 ms instead of 7 ms per batch of 2,000 among 200,000. `LOCAL`: this transaction only.
const INDEX_ORDER: &str = "SET LOCAL enable_sort = off";

/// SQL for the instant `$instant` as text that every session reads back as the same instant:
/// ISO 8601 in UTC, to the microsecond, `2026-11-12T07:35:19.681609Z`.
macro_rules! utc_text {
    ($instant:literal) => {
        concat!(
            "to_char((",
            $instant,
            ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
        )
    };
}

impl PruneSql for Postgres {
    async fn cutoff(pool: &Pool<Self>, age: Duration) -> Result<String, sqlx::Error> {
        // An interval of microseconds only is an absolute duration (no calendar days); the
        // text is ISO 8601 in UTC, whatever this session's DateStyle and TimeZone.
        let age = PgInterval {
            months: 0,
            days: 0,
            microseconds: micros_up(age),
        };
        sqlx::query_scalar(concat!("SELECT ", utc_text!("now() - $1")))
            .bind(age)
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
        // PostgreSQL's DELETE has no LIMIT: pick the oldest rows' physical ids through the
        // `processed_at` index (a TID scan, where `ctid IN (…)` could become a join over the
        // whole table), delete those, and check the cutoff again on each row, so that no
        // row younger than it can go whatever the subquery returned. `state IS NULL` on
        // both: a row in progress or of unknown outcome is never deleted, at any age.
        let name = table.name();
        let mut next = 2;
        let mut param = || {
            next += 1;
            format!("${next}")
        };
        let after_sql = after.map_or_else(String::new, |_| {
            format!(" AND processed_at >= {}::timestamptz", param())
        });
        let consumer_sql =
            consumer.map_or_else(String::new, |_| format!(" AND consumer = {}", param()));
        let sql = format!(
            "WITH gone AS (\
             DELETE FROM {name} WHERE ctid = ANY(ARRAY(\
             SELECT ctid FROM {name} \
             WHERE processed_at < $1::timestamptz AND state IS NULL{after_sql}{consumer_sql} \
             ORDER BY processed_at LIMIT $2)) \
             AND processed_at < $1::timestamptz AND state IS NULL{consumer_sql} \
             RETURNING processed_at) \
             SELECT count(*), {newest} FROM gone",
            newest = utc_text!("max(processed_at)"),
        );
        let mut query = sqlx::query_as(AssertSqlSafe(sql))
            .bind(cutoff)
            .bind(i64::from(limit));
        if let Some(after) = after {
            query = query.bind(after);
        }
        if let Some(consumer) = consumer {
            query = query.bind(consumer);
        }
        let mut tx = pool.begin().await?;
        sqlx::raw_sql(INDEX_ORDER).execute(&mut *tx).await?;
        let (deleted, last): (i64, Option<String>) = query.fetch_one(&mut *tx).await?;
        tx.commit().await?;
        Ok((count(deleted), last))
    }

    async fn stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: Option<&'a str>,
        cutoff: &'a str,
    ) -> Result<Vec<ConsumerStats>, sqlx::Error> {
        let name = table.name();
        let by_consumer = if consumer.is_some() {
            " WHERE consumer = $2"
        } else {
            ""
        };
        let sql = format!(
            "SELECT consumer, count(*), \
             count(*) FILTER (WHERE processed_at < $1::timestamptz AND state IS NULL), \
             extract(epoch FROM now() - min(processed_at))::float8, \
             extract(epoch FROM now() - min(processed_at) \
                 FILTER (WHERE processed_at >= $1::timestamptz OR state IS NOT NULL))::float8, \
             count(*) FILTER (WHERE state IS NOT NULL) \
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
