//! PostgreSQL: `text COLLATE "C"` ids (byte order), an advisory lock around the DDL.

use sqlx::{AssertSqlSafe, Pool, Postgres};

use super::{SchemaBackend, Table};

/// Serialises concurrent `migrate` calls: `CREATE … IF NOT EXISTS` alone races on the
/// catalog's unique indexes. The number is arbitrary and stable ("dedup" + 1).
const MIGRATE_LOCK: i64 = 0x6465_6475_7000_0001;

impl SchemaBackend for Postgres {
    fn ddl(table: &Table) -> Vec<String> {
        let name = table.name();
        let index = format!("{}_processed_at_idx", table.base());
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
                 consumer     text COLLATE \"C\" NOT NULL,\n    \
                 message_id   text COLLATE \"C\" NOT NULL,\n    \
                 processed_at timestamptz NOT NULL DEFAULT now(),\n    \
                 PRIMARY KEY (consumer, message_id)\n)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {index} ON {name} (processed_at)"),
        ]
    }

    async fn create(pool: &Pool<Self>, ddl: Vec<String>) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        for statement in ddl {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }
}
