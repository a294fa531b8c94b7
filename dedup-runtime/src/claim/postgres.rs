//! PostgreSQL: `INSERT … ON CONFLICT DO NOTHING`, and a commit that fails where
//! PostgreSQL would quietly roll back.

use sqlx::postgres::{PgConnection, PgDatabaseError};
use sqlx::{Connection, Postgres, Transaction};

use super::{ClaimBackend, Claimed, Claiming, Statements, Tx};
use crate::claim::Found;
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, Remembered, fetch_recalled};

/// in_failed_sql_transaction: a statement other than `COMMIT`/`ROLLBACK` in an aborted
/// transaction.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// The handler's `COMMIT`, in one round trip. In a transaction that a failed statement
/// aborted, PostgreSQL answers a plain `COMMIT` with the command tag `ROLLBACK` and no
/// error, and sqlx keeps the server's transaction status to itself: the `SET LOCAL` in
/// front fails with `25P02` there, and the rest of the query string is skipped (it sets a
/// placeholder setting of our own for the instant before the commit, and returns no row).
/// `AND CHAIN` opens an empty transaction for sqlx's bookkeeping (it still counts the
/// handler's transaction open) to end: with the `ROLLBACK` it queues, which a pooled
/// connection's pool sends with the ping it sends anyway. Measured against `SELECT 1;
/// COMMIT; BEGIN`, the statement this replaced, it is one statement and one row fewer,
/// and what was left of the benchmark's gap to a hand-written unchecked `COMMIT`.
const CHECKED_COMMIT: &str = "SET LOCAL dedup.checked_commit = on; COMMIT AND CHAIN";

fn is_aborted(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<PgDatabaseError>())
        .is_some_and(|error| error.code() == IN_FAILED_TRANSACTION)
}

/// `error`, or the typed [`RolledBack`] that it reveals (`25P02`: a statement in a
/// transaction that a failed statement aborted).
pub(crate) fn revealed(error: sqlx::Error) -> sqlx::Error {
    if is_aborted(&error) {
        RolledBack::error("PostgreSQL", Some(error))
    } else {
        error
    }
}

impl ClaimBackend for Postgres {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.postgres
    }

    /// The insert alone: one row affected when it inserted. A row there (or one committed
    /// while the insert waited for it) is for `inspect` to look at: the fresh message pays
    /// nothing for the duplicate's case.
    async fn claim<'c>(
        conn: &'c mut PgConnection,
        _: &'static Statements,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Claiming, sqlx::Error> {
        let done = super::execute_keyed::<Self>(conn, sql, consumer, id).await?;
        if done.rows_affected() == 1 {
            Ok(Claiming::Inserted)
        } else {
            Ok(Claiming::Found(None))
        }
    }

    async fn inspect<'c>(
        conn: &'c mut PgConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Found>, sqlx::Error> {
        let sql = if crate::schema::postgres::upgraded(&mut *conn, statements.table).await? {
            statements.postgres_inspect_named
        } else {
            statements.postgres_inspect
        };
        let row = sqlx::query(sql)
            .bind(consumer)
            .bind(id)
            .fetch_optional(conn)
            .await?;
        row.map(|row| Found::from_postgres(&row, 0)).transpose()
    }

    async fn recall<'c>(
        conn: &'c mut PgConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        let sql = statements.postgres_recall;
        fetch_recalled::<Self, i32>(conn, sql, consumer, id).await
    }

    async fn store<'c>(
        conn: &'c mut PgConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        remembered: Remembered<'c>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(statements.postgres_store)
            .bind(consumer)
            .bind(id)
            .bind(remembered.result)
            .bind(remembered.version)
            .bind(remembered.fingerprint)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn take_over<'c>(
        conn: &'c mut PgConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        fingerprint: Option<&'c [u8]>,
        _: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = match fingerprint {
            None => {
                let sql = statements.postgres_take_over;
                super::execute_keyed::<Self>(conn, sql, consumer, id).await?
            }
            Some(fingerprint) => {
                sqlx::query(statements.postgres_take_over_printed)
                    .bind(consumer)
                    .bind(id)
                    .bind(fingerprint)
                    .execute(conn)
                    .await?
            }
        };
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
}
