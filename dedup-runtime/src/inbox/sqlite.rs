//! SQLite: payloads as `BLOB`, times as `processed_at`'s ISO 8601 text in UTC, partial
//! indexes for the rows a worker looks for, and a multi-row `INSERT … RETURNING`.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{InboxBackend, Row};
use crate::claim::sqlite::BEGIN;
use crate::schema::Table;

const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

fn index_name(table: &Table, suffix: &str) -> String {
    match table.schema() {
        Some(schema) => format!("{schema}.{}_{suffix}", table.base()),
        None => format!("{}_{suffix}", table.base()),
    }
}

impl InboxBackend for Sqlite {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        let (name, base) = (table.name(), table.base());
        vec![
            // `seq` is the rowid: receive order.
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 seq             INTEGER PRIMARY KEY,\n    \
                 consumer        TEXT NOT NULL,\n    \
                 message_id      TEXT NOT NULL,\n    \
                 payload         BLOB,\n    \
                 headers         BLOB,\n    \
                 received_at     TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 state           INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
                 attempts        INTEGER NOT NULL DEFAULT 0,\n    \
                 next_attempt_at TEXT NOT NULL DEFAULT ({NOW}),\n    \
                 owner           BLOB,\n    \
                 lease_until     TEXT,\n    \
                 last_error      TEXT,\n    \
                 processed_at    TEXT,\n    \
                 UNIQUE (consumer, message_id)\n)"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, next_attempt_at, seq) \
                 WHERE state = 0",
                index_name(table, "pending_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, lease_until) WHERE state = 1",
                index_name(table, "claimed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (processed_at) WHERE state = 2",
                index_name(table, "processed_idx")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {base} (consumer, seq) WHERE state = 3",
                index_name(table, "dead_idx")
            ),
        ]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with(BEGIN).await?;
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
        let mut sql = format!(
            "INSERT INTO {} (consumer, message_id, payload, headers) VALUES ",
            table.name()
        );
        // Numbered parameters only: sqlx counts anonymous ones on their own, from 1.
        for index in 0..rows.len() {
            if index > 0 {
                sql.push_str(", ");
            }
            let first = 2 + 3 * index;
            sql.push_str(&format!("(?1, ?{first}, ?{}, ?{})", first + 1, first + 2));
        }
        sql.push_str(" ON CONFLICT DO NOTHING RETURNING message_id");
        let mut query = sqlx::query_scalar::<_, String>(AssertSqlSafe(sql)).bind(consumer);
        for row in rows {
            query = query.bind(row.id).bind(row.payload).bind(row.headers);
        }
        let stored: HashSet<String> = query.fetch_all(pool).await?.into_iter().collect();
        Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
    }
}
