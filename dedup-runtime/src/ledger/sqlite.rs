//! SQLite: `processed_at` is text, `%Y-%m-%dT%H:%M:%fZ` in UTC (the column's default);
//! `julianday` reads it (or any time format SQLite knows) and the milliseconds since the
//! Unix epoch are computed from it, rounded to the millisecond SQLite stores.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::LedgerBackend;
use crate::dialect::sqlite::BEGIN;
use crate::table::Table;

impl LedgerBackend for Sqlite {
    async fn processed_at_micros<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> Result<Option<Option<i64>>, sqlx::Error> {
        // The Julian day of the Unix epoch is 2440587.5. A Julian day as a double is
        // exact to well under a millisecond until the year 9999: rounding gives back the
        // milliseconds SQLite parsed. NULL for text that is not a time.
        let sql = format!(
            "SELECT CAST(round((julianday(processed_at) - 2440587.5) * 86400000.0) \
             AS INTEGER) * 1000 FROM {} \
             WHERE consumer = ?1 AND message_id = ?2 AND state IS NULL",
            table.name()
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .fetch_optional(pool)
            .await
    }

    async fn forget<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> Result<bool, sqlx::Error> {
        // Like every writer of the library: the write lock at BEGIN, so that a handler
        // holding it makes this wait (busy timeout) instead of fail with `SQLITE_BUSY`.
        let sql = format!(
            "DELETE FROM {} WHERE consumer = ?1 AND message_id = ?2",
            table.name()
        );
        let mut tx = pool.begin_with(BEGIN).await?;
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    async fn unresolved<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<Vec<(Vec<u8>, i64, i64)>, sqlx::Error> {
        let sql = format!(
            "SELECT CAST(message_id AS BLOB), state, CAST(max(0, (julianday(expires_at) - julianday('now')) * 86400000000.0) AS INTEGER) FROM {} WHERE consumer = ?1 AND state IS NOT NULL ORDER BY expires_at LIMIT ?2",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(limit)
            .fetch_all(pool)
            .await
    }

    async fn resolve<'a>(
        conn: &'a mut sqlx::SqliteConnection,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        done: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = if done {
            format!(
                "UPDATE {} SET state = NULL, owner = NULL, expires_at = NULL, processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE consumer = ?1 AND message_id = ?2 AND state IS NOT NULL AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
                table.name()
            )
        } else {
            format!(
                "DELETE FROM {} WHERE consumer = ?1 AND message_id = ?2 AND state IS NOT NULL AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
                table.name()
            )
        };
        let result = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .execute(conn)
            .await?;
        Ok(result.rows_affected() == 1)
    }
}
