//! PostgreSQL: `bytea` payloads, `timestamptz` times on the server's clock, partial
//! indexes for the rows a worker looks for, and a batch insert of `unnest`ed arrays.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::{InboxBackend, Row};
use crate::schema::Table;

/// The lock `migrate` takes for the dedup table; the inbox's DDL takes the same one.
const MIGRATE_LOCK: i64 = 0x6465_6475_7000_0001;

fn index_name(table: &Table, suffix: &str) -> String {
    format!("{}_{suffix}", table.base())
}

impl InboxBackend for Postgres {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 consumer        text COLLATE \"C\" NOT NULL,\n    \
                 message_id      text COLLATE \"C\" NOT NULL,\n    \
                 seq             bigint GENERATED ALWAYS AS IDENTITY,\n    \
                 payload         bytea,\n    \
                 headers         bytea,\n    \
                 received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        integer NOT NULL DEFAULT 0,\n    \
                 next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 owner           bytea,\n    \
                 lease_until     timestamptz,\n    \
                 last_error      text,\n    \
                 processed_at    timestamptz,\n    \
                 PRIMARY KEY (consumer, message_id)\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, next_attempt_at, seq) \
                 WHERE state = 0",
                index_name(table, "pending_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (processed_at) WHERE state = 2",
                index_name(table, "processed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (consumer, seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        for statement in Self::inbox_ddl(table) {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn inbox_insert<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        rows: &'a [Row<'a>],
    ) -> Result<Vec<bool>, sqlx::Error> {
        if let [row] = rows {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, payload, headers) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                table.name()
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .execute(pool)
                .await?;
            return Ok(vec![done.rows_affected() == 1]);
        }
        let sql = format!(
            "INSERT INTO {} (consumer, message_id, payload, headers) \
             SELECT $1, id, payload, headers \
             FROM unnest($2::text[], $3::bytea[], $4::bytea[]) AS m (id, payload, headers) \
             ON CONFLICT DO NOTHING RETURNING message_id",
            table.name()
        );
        let ids: Vec<&str> = rows.iter().map(|row| row.id).collect();
        let payloads: Vec<&[u8]> = rows.iter().map(|row| row.payload).collect();
        let headers: Vec<Option<&[u8]>> = rows.iter().map(|row| row.headers).collect();
        let stored: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(consumer)
            .bind(ids)
            .bind(payloads)
            .bind(headers)
            .fetch_all(pool)
            .await?;
        let stored: HashSet<String> = stored.into_iter().collect();
        Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
    }
}
