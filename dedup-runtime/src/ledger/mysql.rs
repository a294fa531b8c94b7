//! MySQL and MariaDB: `processed_at` is a `DATETIME(6)` in UTC (a wall-clock reading with
//! no zone); `TIMESTAMPDIFF` from the epoch's `DATETIME` reads it as microseconds since
//! the Unix epoch, whatever the session's `time_zone` (`UNIX_TIMESTAMP` would apply it).

use sqlx::{AssertSqlSafe, MySql, Pool};

use super::LedgerBackend;
use crate::table::Table;

impl LedgerBackend for MySql {
    async fn processed_at_micros<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> Result<Option<Option<i64>>, sqlx::Error> {
        // A consistent (non-locking) read: it neither waits for nor sees a handler's
        // uncommitted claim.
        let sql = format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, CAST('1970-01-01 00:00:00' AS DATETIME(6)), \
             processed_at) FROM {} WHERE consumer = ? AND message_id = ? AND state IS NULL",
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
        // By primary key, in autocommit: it locks that one row (waiting for a handler
        // that holds it) and no gap.
        let sql = format!(
            "DELETE FROM {} WHERE consumer = ? AND message_id = ?",
            table.name()
        );
        let done = sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(id)
            .execute(pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn unresolved<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> Result<Vec<(Vec<u8>, i64, i64)>, sqlx::Error> {
        let sql = format!(
            "SELECT message_id, CAST(state AS SIGNED), CAST(GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at)) AS SIGNED) FROM {} WHERE consumer = ? AND state IS NOT NULL ORDER BY expires_at LIMIT ?",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(limit)
            .fetch_all(pool)
            .await
    }

    async fn resolve<'a>(
        conn: &'a mut sqlx::MySqlConnection,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        done: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = if done {
            format!(
                "UPDATE {} SET state = NULL, owner = NULL, expires_at = NULL, processed_at = UTC_TIMESTAMP(6) WHERE consumer = ? AND message_id = ? AND state IS NOT NULL AND expires_at <= UTC_TIMESTAMP(6)",
                table.name()
            )
        } else {
            format!(
                "DELETE FROM {} WHERE consumer = ? AND message_id = ? AND state IS NOT NULL AND expires_at <= UTC_TIMESTAMP(6)",
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
