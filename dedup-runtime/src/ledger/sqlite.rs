//! SQLite: `processed_at` is text, `%Y-%m-%dT%H:%M:%fZ` in UTC (the column's default);
//! `julianday` reads it (or any time format SQLite knows) and the milliseconds since the
//! Unix epoch are computed from it, rounded to the millisecond SQLite stores.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::LedgerBackend;
use crate::claim::sqlite::BEGIN;
use crate::schema::Table;

/// SQLITE_ERROR, the generic code that a missing table shares with every other error of
/// a statement's preparation.
const SQLITE_ERROR: &str = "1";

/// What SQLite says, after [`SQLITE_ERROR`], when the table (or its attached schema) does
/// not exist. Fixed in SQLite's source (`"no such table: %s"`) and never translated.
const NO_SUCH_TABLE: &str = "no such table: ";

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
             AS INTEGER) * 1000 FROM {} WHERE consumer = ?1 AND message_id = ?2",
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

    fn is_missing_table(error: &sqlx::Error) -> bool {
        error.as_database_error().is_some_and(|error| {
            error.code().as_deref() == Some(SQLITE_ERROR)
                && error.message().starts_with(NO_SUCH_TABLE)
        })
    }
}
