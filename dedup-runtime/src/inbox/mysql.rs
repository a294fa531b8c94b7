//! MySQL and MariaDB: `VARBINARY` ids (byte order), `LONGBLOB` payloads, times in UTC on
//! the server's clock. No `RETURNING` on MySQL 8 and no way to tell an inserted row from a
//! kept one by the affected-row count of a multi-row insert: each batch carries a random
//! receipt, written only by the rows it inserts (`ON DUPLICATE KEY UPDATE` keeps the old
//! row as it was), and the rows whose receipt is the batch's are the ones it stored. No
//! partial indexes: the worker's index is on `(consumer, state, next_attempt_at)`.

use std::collections::HashSet;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, Pool};

use super::{InboxBackend, Row};
use crate::classify::mysql::ER_DUP_ENTRY;
use crate::schema::Table;

/// The named lock `migrate` takes; the inbox's DDL takes the same one.
const MIGRATE_LOCK: &str = "dedup_runtime.migrate";
const MIGRATE_LOCK_WAIT: i32 = 120;

impl InboxBackend for MySql {
    fn inbox_ddl(table: &Table) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {name} (\n    \
             seq             BIGINT NOT NULL AUTO_INCREMENT,\n    \
             consumer        VARBINARY(255) NOT NULL,\n    \
             message_id      VARBINARY(255) NOT NULL,\n    \
             payload         LONGBLOB NULL,\n    \
             headers         BLOB NULL,\n    \
             received_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             state           TINYINT NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2, 3)),\n    \
             attempts        INT NOT NULL DEFAULT 0,\n    \
             next_attempt_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),\n    \
             owner           BINARY(16) NULL,\n    \
             lease_until     DATETIME(6) NULL,\n    \
             last_error      TEXT NULL,\n    \
             processed_at    DATETIME(6) NULL,\n    \
             receipt         BINARY(16) NULL,\n    \
             PRIMARY KEY (consumer, message_id),\n    \
             UNIQUE KEY seq_key (seq),\n    \
             KEY work_idx (consumer, state, next_attempt_at),\n    \
             KEY processed_idx (state, processed_at)\n\
             ) ENGINE = InnoDB",
            name = table.name()
        )]
    }

    async fn inbox_create(pool: &Pool<Self>, table: &Table) -> Result<(), sqlx::Error> {
        let mut conn = pool.acquire().await?.detach();
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATE_LOCK)
            .bind(MIGRATE_LOCK_WAIT)
            .fetch_one(&mut conn)
            .await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "migrate: another `migrate` held the lock `{MIGRATE_LOCK}` for over \
                 {MIGRATE_LOCK_WAIT} s"
            )));
        }
        for statement in Self::inbox_ddl(table) {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut conn)
                .await?;
        }
        sqlx::Connection::close(conn).await
    }

    async fn inbox_insert<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        rows: &'a [Row<'a>],
    ) -> Result<Vec<bool>, sqlx::Error> {
        if let [row] = rows {
            // One row: a plain insert, whose duplicate-key error (1062: only the primary
            // key can raise it here) is the duplicate.
            let sql = format!(
                "INSERT INTO {} (consumer, message_id, payload, headers) VALUES (?, ?, ?, ?)",
                table.name()
            );
            let result = sqlx::query(AssertSqlSafe(sql))
                .bind(consumer)
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .execute(pool)
                .await;
            return match result {
                Ok(_) => Ok(vec![true]),
                Err(error)
                    if error
                        .as_database_error()
                        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
                        .is_some_and(|error| error.number() == ER_DUP_ENTRY) =>
                {
                    Ok(vec![false])
                }
                Err(error) => Err(error),
            };
        }
        let receipt = crate::lease::new_token();
        let mut sql = format!(
            "INSERT INTO {} (consumer, message_id, payload, headers, receipt) VALUES ",
            table.name()
        );
        for index in 0..rows.len() {
            if index > 0 {
                sql.push_str(", ");
            }
            sql.push_str("(?, ?, ?, ?, ?)");
        }
        // A no-op update: the existing row stays as it was, receipt included.
        sql.push_str(" ON DUPLICATE KEY UPDATE consumer = consumer");
        let mut insert = sqlx::query(AssertSqlSafe(sql));
        for row in rows {
            insert = insert
                .bind(consumer)
                .bind(row.id)
                .bind(row.payload)
                .bind(row.headers)
                .bind(&receipt[..]);
        }
        let mut check = format!(
            "SELECT CAST(message_id AS CHAR) FROM {} WHERE consumer = ? AND receipt = ? \
             AND message_id IN (",
            table.name()
        );
        for index in 0..rows.len() {
            check.push_str(if index > 0 { ", ?" } else { "?" });
        }
        check.push(')');
        let mut select = sqlx::query_scalar::<_, String>(AssertSqlSafe(check))
            .bind(consumer)
            .bind(&receipt[..]);
        for row in rows {
            select = select.bind(row.id);
        }
        let mut conn = pool.acquire().await?;
        insert.execute(&mut *conn).await?;
        let stored: HashSet<String> = select.fetch_all(&mut *conn).await?.into_iter().collect();
        Ok(rows.iter().map(|row| stored.contains(row.id)).collect())
    }
}
