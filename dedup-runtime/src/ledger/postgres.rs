//! PostgreSQL: `processed_at` is a `timestamptz`, an instant; `extract(epoch …)` reads it
//! as seconds since the Unix epoch (an exact `numeric` since PostgreSQL 14), whatever the
//! session's `TimeZone`.

use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::LedgerBackend;
use crate::table::Table;

impl LedgerBackend for Postgres {
    async fn processed_at_micros<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> Result<Option<Option<i64>>, sqlx::Error> {
        let sql = format!(
            "SELECT (extract(epoch FROM processed_at) * 1000000)::int8 FROM {} \
             WHERE consumer = $1 AND message_id = $2 AND state IS NULL",
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
        let sql = format!(
            "DELETE FROM {} WHERE consumer = $1 AND message_id = $2",
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
            "SELECT convert_to(message_id, 'UTF8'), state::int8, GREATEST(0, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000000)::int8) FROM {} WHERE consumer = $1 AND state IS NOT NULL ORDER BY expires_at LIMIT $2",
            table.name()
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(limit)
            .fetch_all(pool)
            .await
    }

    async fn resolve<'a>(
        conn: &'a mut sqlx::PgConnection,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        done: bool,
    ) -> Result<bool, sqlx::Error> {
        let sql = if done {
            format!(
                "UPDATE {} SET state = NULL, owner = NULL, expires_at = NULL, processed_at = clock_timestamp() WHERE consumer = $1 AND message_id = $2 AND state IS NOT NULL AND expires_at <= clock_timestamp()",
                table.name()
            )
        } else {
            format!(
                "DELETE FROM {} WHERE consumer = $1 AND message_id = $2 AND state IS NOT NULL AND expires_at <= clock_timestamp()",
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
