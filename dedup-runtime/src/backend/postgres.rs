//! PostgreSQL: `INSERT … ON CONFLICT DO NOTHING`, SQLSTATE classification.

use std::error::Error as StdError;

use sqlx::postgres::{PgConnection, PgDatabaseError};
use sqlx::{AssertSqlSafe, Connection, Pool, Postgres, Transaction};

use super::{Backend, Statements, Tx, Violation};
use crate::migrate::Table;
use crate::rolled_back::RolledBack;
use crate::run::Claimed;

super::connection_impls!(Postgres, PgConnection);

/// serialization_failure, deadlock_detected, lock_not_available (lock_timeout).
const TRANSIENT: [&str; 3] = ["40001", "40P01", "55P03"];

const UNIQUE_VIOLATION: &str = "23505";

/// in_failed_sql_transaction: a statement other than `COMMIT`/`ROLLBACK` in an aborted
/// transaction.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// The handler's `COMMIT`, in one round trip. In a transaction that a failed statement
/// aborted, PostgreSQL answers a plain `COMMIT` with the command tag `ROLLBACK` and no
/// error, and sqlx keeps the server's transaction status to itself: the `SELECT` in front
/// fails with `25P02` there, and the rest of the query string is skipped. The `BEGIN`
/// behind opens an empty transaction for sqlx's bookkeeping (it still counts the handler's
/// transaction open) to end: with the `ROLLBACK` it queues, which a pooled connection's
/// pool sends with the ping it sends anyway.
const CHECKED_COMMIT: &str = "SELECT 1; COMMIT; BEGIN";

fn is_aborted(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<PgDatabaseError>())
        .is_some_and(|error| error.code() == IN_FAILED_TRANSACTION)
}

/// `error`, or the typed [`RolledBack`] that it reveals.
fn revealed(error: sqlx::Error) -> sqlx::Error {
    if is_aborted(&error) {
        RolledBack::error("PostgreSQL", Some(error))
    } else {
        error
    }
}

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
        let done = super::execute_keyed::<Self>(conn, sql, consumer, id).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn stamp<'c>(
        conn: &'c mut PgConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<(), sqlx::Error> {
        super::execute_keyed::<Self>(conn, sql, consumer, id)
            .await
            .map(drop)
    }

    fn stamp_sql(statements: &Statements) -> Option<&'static str> {
        Some(statements.postgres_stamp)
    }

    async fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<Claimed<'t>>,
        pooled: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = tx.tx;
        if let Some(claimed) = claimed.filter(|claimed| claimed.slow)
            && let Err(error) = Self::stamp(
                &mut tx,
                claimed.statements.postgres_stamp,
                claimed.consumer,
                claimed.id,
            )
            .await
        {
            super::rollback_logged(tx).await;
            return Err(revealed(error));
        }
        match sqlx::raw_sql(CHECKED_COMMIT).execute(&mut *tx).await {
            Ok(_) => {
                super::discard(tx, pooled).await;
                Ok(())
            }
            Err(error) => {
                // Aborted (still open, to be rolled back) or a failed COMMIT (over; the
                // ROLLBACK then only warns): either way sqlx's count comes back to zero.
                super::rollback_logged(tx).await;
                Err(revealed(error))
            }
        }
    }

    async fn rollback_owned<'t>(
        tx: Tx<'t, Self>,
        pooled: bool,
        wrote: bool,
    ) -> Result<(), sqlx::Error> {
        if pooled && !wrote {
            drop(tx);
            Ok(())
        } else {
            tx.tx.rollback().await
        }
    }

    fn begin_owned(
        conn: &mut PgConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
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
