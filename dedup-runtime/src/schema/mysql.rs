//! MySQL and MariaDB: `VARBINARY` ids (byte order), `processed_at` in UTC.

use sqlx::{AssertSqlSafe, MySql, Pool};

use super::{SchemaBackend, Table};

impl SchemaBackend for MySql {
    fn ddl(table: &Table) -> Vec<String> {
        // VARBINARY: ids compare byte for byte, with no case folding and no PAD SPACE
        // (`a` and `a ` are different messages). `processed_at` is UTC whatever the
        // sessions' time zones (the claim and the commit write `UTC_TIMESTAMP(6)`, pruning
        // compares with it); the `ALTER` upgrades a table created with the session-zone
        // default of earlier versions (metadata only, idempotent).
        let name = table.name();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {name} (\n    \
             consumer     VARBINARY(255) NOT NULL,\n    \
             message_id   VARBINARY(255) NOT NULL,\n    \
             processed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             PRIMARY KEY (consumer, message_id),\n    \
             KEY processed_at_idx (processed_at)\n\
             ) ENGINE = InnoDB"
            ),
            format!("ALTER TABLE {name} ALTER COLUMN processed_at SET DEFAULT (UTC_TIMESTAMP(6))"),
        ]
    }

    async fn create(pool: &Pool<Self>, ddl: Vec<String>) -> Result<(), sqlx::Error> {
        // MySQL DDL commits implicitly; `IF NOT EXISTS` under the metadata lock is enough.
        let mut conn = pool.acquire().await?;
        for statement in ddl {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}
