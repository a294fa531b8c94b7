//! PostgreSQL: `uuid` ids, `bytea` payloads, `timestamptz` times on the server's clock,
//! partial indexes for the rows a relay looks for.

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::{Inserted, OutboxBackend, Row};
use crate::schema::Table;

fn index_name(table: &Table, suffix: &str) -> String {
    format!("{}_{suffix}", table.base())
}

impl OutboxBackend for Postgres {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 id              uuid PRIMARY KEY,\n    \
                 seq             bigint GENERATED ALWAYS AS IDENTITY,\n    \
                 consumer        text COLLATE \"C\" NOT NULL,\n    \
                 cause_id        text COLLATE \"C\" NOT NULL,\n    \
                 slot            text COLLATE \"C\" NOT NULL,\n    \
                 destination     text COLLATE \"C\" NOT NULL,\n    \
                 payload         bytea NOT NULL,\n    \
                 headers         bytea,\n    \
                 ordering_key    text COLLATE \"C\",\n    \
                 created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 state           smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        integer NOT NULL DEFAULT 0,\n    \
                 next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),\n    \
                 owner           bytea,\n    \
                 lease_until     timestamptz,\n    \
                 last_error      text,\n    \
                 sent_at         timestamptz\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (next_attempt_at, seq) WHERE state = 0",
                index_name(table, "unsent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (sent_at) WHERE state = 2",
                index_name(table, "sent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {name} (seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::postgres::create_locked(pool, Self::outbox_ddl(table)).await
    }

    /// `ON CONFLICT DO NOTHING`: a duplicate never aborts the caller's transaction.
    async fn outbox_insert<'c>(
        conn: &'c mut PgConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.to_string();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key) VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING"
        );
        let done = sqlx::query(AssertSqlSafe(insert))
            .bind(&id)
            .bind(row.consumer)
            .bind(row.cause_id)
            .bind(row.slot)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.ordering_key)
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 1 {
            return Ok(Inserted::Stored);
        }
        let select = format!(
            "SELECT convert_to(destination, 'UTF8'), payload FROM {name} WHERE id = $1::uuid"
        );
        let (destination, payload): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(select))
            .bind(&id)
            .fetch_one(conn)
            .await?;
        Ok(Inserted::Existing {
            destination,
            payload,
        })
    }
}
