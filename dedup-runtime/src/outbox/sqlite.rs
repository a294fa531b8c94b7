//! SQLite: `BLOB` ids (the UUID's 16 bytes), times as UTC text on the database's clock.

use sqlx::sqlite::SqliteConnection;
use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{Inserted, OutboxBackend, Row};
use crate::schema::Table;

const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

fn index_name(table: &Table, suffix: &str) -> String {
    match table.schema() {
        Some(schema) => format!("{schema}.{}_{suffix}", table.base()),
        None => format!("{}_{suffix}", table.base()),
    }
}

impl OutboxBackend for Sqlite {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        let (name, base) = (table.name(), table.base());
        vec![
            // `seq` is the rowid: enqueue order.
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 seq             INTEGER PRIMARY KEY,\n    \
                 id              BLOB NOT NULL UNIQUE CHECK (length(id) = 16),\n    \
                 consumer        TEXT NOT NULL,\n    \
                 cause_id        TEXT NOT NULL,\n    \
                 slot            TEXT NOT NULL,\n    \
                 destination     TEXT NOT NULL,\n    \
                 payload         BLOB NOT NULL,\n    \
                 headers         BLOB,\n    \
                 ordering_key    TEXT,\n    \
                 created_at      TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        INTEGER NOT NULL DEFAULT 0,\n    \
                 next_attempt_at TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 owner           BLOB,\n    \
                 lease_until     TEXT,\n    \
                 last_error      TEXT,\n    \
                 sent_at         TEXT\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (next_attempt_at, seq) WHERE state = 0",
                index_name(table, "unsent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (ordering_key, seq) \
                 WHERE ordering_key IS NOT NULL AND state <> 2",
                index_name(table, "ordering_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (sent_at) WHERE state = 2",
                index_name(table, "sent_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::sqlite::create_locked(pool, Self::outbox_ddl(table)).await
    }

    async fn outbox_insert<'c>(
        conn: &'c mut SqliteConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.as_uuid();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT (id) DO NOTHING"
        );
        let done = sqlx::query(AssertSqlSafe(insert))
            .bind(&id.as_bytes()[..])
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
        let select = format!("SELECT CAST(destination AS BLOB), payload FROM {name} WHERE id = ?1");
        let (destination, payload): (Vec<u8>, Vec<u8>) = sqlx::query_as(AssertSqlSafe(select))
            .bind(&id.as_bytes()[..])
            .fetch_one(conn)
            .await?;
        Ok(Inserted::Existing {
            destination,
            payload,
        })
    }
}
