//! MySQL and MariaDB: `processed_at` is a `DATETIME(6)` in UTC (a wall-clock reading with
//! no zone); `TIMESTAMPDIFF` from the epoch's `DATETIME` reads it as microseconds since
//! the Unix epoch, whatever the session's `time_zone` (`UNIX_TIMESTAMP` would apply it).

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, Pool};

use super::LedgerBackend;
use crate::schema::Table;

/// ER_NO_SUCH_TABLE: also for a table in a database that does not exist.
const ER_NO_SUCH_TABLE: u16 = 1146;

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
             processed_at) FROM {} WHERE consumer = ? AND message_id = ?",
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

    fn is_missing_table(error: &sqlx::Error) -> bool {
        error
            .as_database_error()
            .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
            .is_some_and(|error| error.number() == ER_NO_SUCH_TABLE)
    }
}
