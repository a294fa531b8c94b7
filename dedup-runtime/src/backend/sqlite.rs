//! SQLite: `BEGIN IMMEDIATE` so that writers wait for the lock instead of failing,
//! `INSERT … ON CONFLICT DO NOTHING`, extended result codes.

use std::error::Error as StdError;

use sqlx::error::DatabaseError;
use sqlx::sqlite::{SqliteConnection, SqliteError};
use sqlx::{AssertSqlSafe, Connection, Pool, Sqlite, Transaction};

use super::{Backend, Statements};
use crate::migrate::Table;

super::connection_impls!(Sqlite, SqliteConnection);

/// SQLITE_BUSY and SQLITE_LOCKED, the primary codes under every extended code.
const TRANSIENT: [i64; 2] = [5, 6];

/// Takes the write lock at `BEGIN`: a deferred transaction that reads first and writes
/// later can fail with `SQLITE_BUSY` without waiting, where this one waits.
const BEGIN: &str = "BEGIN IMMEDIATE";

impl Backend for Sqlite {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.sqlite
    }

    async fn claim<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(sql)
            .bind(consumer)
            .bind(id)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    fn begin_owned(
        conn: &mut SqliteConnection,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin_with(BEGIN)
    }

    fn begin_pool(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_ {
        pool.begin_with(BEGIN)
    }

    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        // The driver reports the extended result code as its decimal number.
        error
            .downcast_ref::<SqliteError>()
            .and_then(|error| error.code())
            .and_then(|code| code.parse::<i64>().ok())
            .is_some_and(|code| TRANSIENT.contains(&(code & 0xff)))
    }

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
