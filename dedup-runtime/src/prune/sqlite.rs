//! SQLite: `BEGIN IMMEDIATE`, then `DELETE` of the oldest keys below the cutoff.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Pool, Row, Sqlite};

use super::{ConsumerStats, PruneBackend, age_from_secs, count, micros_up};
use crate::schema::Table;

/// The format of the column's default: the cutoff must be written the same way for the
/// text comparison to be a time comparison.
const CUTOFF: &str = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1)";

/// SQLITE_ERROR: a generic error, whose message says which. SQLite's messages are never
/// translated, and this one has one fixed format, `no such table: <name as written>`.
const SQLITE_ERROR: &str = "1";

/// Whether SQLite's error `code` and `message` say that `table` does not exist.
fn no_such_table(code: Option<&str>, message: &str, table: &Table) -> bool {
    code == Some(SQLITE_ERROR) && message.strip_prefix("no such table: ") == Some(table.name())
}

impl PruneBackend for Sqlite {
    fn is_missing_table(error: &sqlx::Error, table: &Table) -> bool {
        error
            .as_database_error()
            .is_some_and(|error| no_such_table(error.code().as_deref(), error.message(), table))
    }

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
        // through the `processed_at` index, checking the cutoff again on each row.
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
            "FROM {name} WHERE processed_at < ?1{after_sql}{consumer_sql} \
             ORDER BY processed_at LIMIT ?2"
        );
        let newest = format!("SELECT MAX(processed_at) FROM (SELECT processed_at {batch})");
        let delete = format!(
            "DELETE FROM {name} WHERE (consumer, message_id) IN \
             (SELECT consumer, message_id {batch}) AND processed_at < ?1"
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
            "SELECT consumer, COUNT(*), SUM(processed_at < ?1), \
             (julianday('now') - julianday(MIN(processed_at))) * 86400.0, \
             (julianday('now') - julianday(MIN(CASE WHEN processed_at >= ?1 \
                 THEN processed_at END))) * 86400.0 \
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
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_such_table_names_this_table() {
        let table = Table::new("processed_messages").unwrap();
        let qualified = Table::new("main.processed_messages").unwrap();
        let message = "no such table: processed_messages";
        assert!(no_such_table(Some("1"), message, &table));
        assert!(!no_such_table(Some("1"), message, &qualified));
        assert!(no_such_table(
            Some("1"),
            "no such table: main.processed_messages",
            &qualified
        ));
        // Another table (a trigger's), another code, another message.
        assert!(!no_such_table(
            Some("1"),
            "no such table: audit_log",
            &table
        ));
        assert!(!no_such_table(Some("5"), message, &table));
        assert!(!no_such_table(
            Some("1"),
            "no such column: processed_at",
            &table
        ));
        assert!(!no_such_table(None, message, &table));
    }
}
