//! PostgreSQL: `INSERT … SELECT … FROM unnest($2) ON CONFLICT DO NOTHING RETURNING`.

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Postgres};

use super::BatchBackend;
use crate::schema::Table;

impl BatchBackend for Postgres {
    async fn claim_many<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        _: &'c [u8; 16],
    ) -> Result<Vec<String>, sqlx::Error> {
        // `WITH ORDINALITY … ORDER BY`: the rows go in the array's order (byte order).
        let sql = format!(
            "INSERT INTO {} (consumer, message_id, processed_at) \
             SELECT $1, id, clock_timestamp() FROM unnest($2::text[]) WITH ORDINALITY AS u(id, n) \
             ORDER BY n ON CONFLICT DO NOTHING RETURNING message_id",
            table.name()
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .fetch_all(conn)
            .await
    }

    async fn seal_many<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        consumer: &'c str,
        fresh: &'c [&'c str],
        _: &'c [u8; 16],
        slow: bool,
    ) -> Result<(), sqlx::Error> {
        if !slow {
            return Ok(());
        }
        let sql = format!(
            "UPDATE {} SET processed_at = clock_timestamp() \
             WHERE consumer = $1 AND message_id = ANY($2::text[])",
            table.name()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(fresh)
            .execute(conn)
            .await
            .map(drop)
            .map_err(crate::claim::postgres::revealed)
    }
}
