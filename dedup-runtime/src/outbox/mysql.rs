//! MySQL and MariaDB: `BINARY(16)` ids, `VARBINARY` names (byte order), `LONGBLOB`
//! payloads, times in UTC on the server's clock. No partial indexes: the relay's indexes
//! lead with `state`.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql, Pool};

use super::{Inserted, OutboxBackend, Row};
use crate::classify::mysql::{ER_DUP_ENTRY, error_number};
use crate::schema::Table;

impl OutboxBackend for MySql {
    fn outbox_ddl(table: &Table) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {name} (\n    \
             id              BINARY(16) NOT NULL,\n    \
             seq             BIGINT NOT NULL AUTO_INCREMENT,\n    \
             consumer        VARBINARY(255) NOT NULL,\n    \
             cause_id        VARBINARY(255) NOT NULL,\n    \
             slot            VARBINARY(255) NOT NULL,\n    \
             destination     VARBINARY(255) NOT NULL,\n    \
             payload         LONGBLOB NOT NULL,\n    \
             headers         BLOB NULL,\n    \
             ordering_key    VARBINARY(255) NULL,\n    \
             created_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
             attempts        INT NOT NULL DEFAULT 0,\n    \
             next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             owner           BINARY(16) NULL,\n    \
             lease_until     DATETIME(6) NULL,\n    \
             last_error      TEXT NULL,\n    \
             sent_at         DATETIME(6) NULL,\n    \
             PRIMARY KEY (id),\n    \
             UNIQUE KEY seq_key (seq),\n    \
             KEY unsent_idx (state, next_attempt_at, seq),\n    \
             KEY claimed_idx (state, lease_until),\n    \
             KEY ordering_idx (ordering_key, seq),\n    \
             KEY sent_idx (state, sent_at)\n\
             ) ENGINE = InnoDB",
            name = table.name()
        )]
    }

    async fn outbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        crate::schema::mysql::create_locked(pool, Self::outbox_ddl(table)).await
    }

    /// A plain insert: InnoDB rolls back only the statement on its duplicate-key error
    /// (1062: only the primary key can raise it here), never the caller's transaction.
    async fn outbox_insert<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c Table,
        row: &'c Row<'c>,
    ) -> Result<Inserted, sqlx::Error> {
        let name = table.name();
        let id = row.id.as_uuid();
        let insert = format!(
            "INSERT INTO {name} (id, consumer, cause_id, slot, destination, payload, headers, \
             ordering_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        );
        let inserted = sqlx::query(AssertSqlSafe(insert))
            .bind(&id.as_bytes()[..])
            .bind(row.consumer)
            .bind(row.cause_id)
            .bind(row.slot)
            .bind(row.destination)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.ordering_key)
            .execute(&mut *conn)
            .await;
        match inserted {
            Ok(_) => return Ok(Inserted::Stored),
            Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => {}
            Err(error) => return Err(error),
        }
        // A locking read: the row another transaction committed after this one's snapshot.
        let select =
            format!("SELECT destination, payload FROM {name} WHERE id = ? LOCK IN SHARE MODE");
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
