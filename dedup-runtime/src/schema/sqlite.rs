//! SQLite: a `WITHOUT ROWID` table, its `processed_at` as ISO 8601 text in UTC.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{SchemaBackend, Table};
use crate::claim::sqlite::BEGIN;

impl SchemaBackend for Sqlite {
    fn ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        let index = match table.schema() {
            Some(schema) => format!("{schema}.{}_processed_at_idx", table.base()),
            None => format!("{}_processed_at_idx", table.base()),
        };
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 consumer     TEXT NOT NULL,\n    \
                 message_id   TEXT NOT NULL,\n    \
                 processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),\n    \
                 PRIMARY KEY (consumer, message_id)\n\
                 ) WITHOUT ROWID"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {index} ON {} (processed_at)",
                table.base()
            ),
        ]
    }

    async fn create(pool: &Pool<Self>, ddl: Vec<String>) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with(BEGIN).await?;
        for statement in ddl {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }
}
