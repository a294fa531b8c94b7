//! PostgreSQL: `INSERT … ON CONFLICT DO NOTHING`, SQLSTATE classification.

use std::error::Error as StdError;

use sqlx::postgres::{PgConnection, PgDatabaseError};
use sqlx::{AssertSqlSafe, Connection, Pool, Postgres, Transaction};

use super::{Backend, Statements, Violation};
use crate::migrate::Table;

super::connection_impls!(Postgres, PgConnection);

/// serialization_failure, deadlock_detected, lock_not_available (lock_timeout).
const TRANSIENT: [&str; 3] = ["40001", "40P01", "55P03"];

const UNIQUE_VIOLATION: &str = "23505";

/// Serialises concurrent `migrate` calls: `CREATE … IF NOT EXISTS` alone races on the
/// catalog's unique indexes. The number is arbitrary and stable ("dedup" + 1).
const MIGRATE_LOCK: i64 = 0x6465_6475_7000_0001;

impl Backend for Postgres {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.postgres
    }

    async fn claim<'c>(
        conn: &'c mut PgConnection,
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
        conn: &mut PgConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
    }

    fn begin_pool(
        pool: &Pool<Self>,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_ {
        pool.begin()
    }

    fn begin_nested(
        conn: &mut PgConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
    }

    /// SQLSTATE 23505 (unique_violation) carries the constraint's name in its own field.
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation> {
        let error = error.downcast_ref::<PgDatabaseError>()?;
        if error.code() != UNIQUE_VIOLATION {
            return None;
        }
        error
            .constraint()
            .map(|name| Violation::Named(name.to_owned()))
    }

    async fn matching(
        _: &mut PgConnection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> Option<&'static str> {
        super::matching_name(&violation, names)
    }

    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool {
        error
            .downcast_ref::<PgDatabaseError>()
            .is_some_and(|error| TRANSIENT.contains(&error.code()))
    }

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
