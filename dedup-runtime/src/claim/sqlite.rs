//! SQLite: `BEGIN IMMEDIATE` so that writers wait for the lock instead of failing,
//! `INSERT … ON CONFLICT DO NOTHING`, and a commit that notices an automatic rollback.

use sqlx::sqlite::SqliteConnection;
use sqlx::{Connection, Sqlite, Transaction};

use sqlx_core::transaction::TransactionManager;

use super::{ClaimBackend, Claimed, Claiming, Statements, Tx};
use crate::claim::Found;
use crate::dialect::sqlite::BEGIN;
use crate::rolled_back::RolledBack;
use crate::stored::{Recalled, Remembered, fetch_recalled};

type Manager = <Sqlite as sqlx::Database>::TransactionManager;

/// After a failed `COMMIT` or `ROLLBACK` of a transaction the handler owns: whether SQLite
/// had ended the transaction by itself (an automatic rollback: `SQLITE_FULL`, an I/O
/// error, `RAISE(ROLLBACK, …)`, `ON CONFLICT ROLLBACK`), and sqlx's bookkeeping brought
/// back to no transaction either way.
///
/// sqlx still counts the transaction open (its end failed), so it would answer the
/// connection's next `BEGIN IMMEDIATE` with `InvalidSavePointStatement` for as long as
/// the connection lives. A plain `BEGIN` succeeds exactly when SQLite is in autocommit
/// mode; then there is a transaction again for sqlx's own `ROLLBACK` to end.
async fn repair(tx: &mut sqlx::Transaction<'_, Sqlite>) -> bool {
    let ended = sqlx::raw_sql("BEGIN").execute(&mut **tx).await.is_ok();
    if let Err(error) = Manager::rollback(&mut **tx).await {
        tracing::debug!(%error, "rollback after an automatic rollback failed");
    }
    ended
}

impl ClaimBackend for Sqlite {
    fn claim_sql(statements: &Statements) -> &'static str {
        statements.sqlite
    }

    async fn claim<'c>(
        conn: &'c mut SqliteConnection,
        _: &'static Statements,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Claiming, sqlx::Error> {
        let done = super::execute_keyed::<Self>(conn, sql, consumer, id).await?;
        Ok(if done.rows_affected() == 1 {
            Claiming::Inserted
        } else {
            Claiming::Found(None)
        })
    }

    async fn inspect<'c>(
        conn: &'c mut SqliteConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row = match sqlx::query(statements.sqlite_inspect)
            .bind(consumer)
            .bind(id)
            .fetch_optional(conn)
            .await
        {
            Ok(row) => row,
            // A table of migration `0001`, not upgraded yet: no `state`, only processed rows.
            Err(error) if crate::claim::missing_state_column(&error) => {
                return Ok(Some(Found::PROCESSED));
            }
            Err(error) => return Err(error),
        };
        row.map(|row| Found::from_sqlite(&row, 0)).transpose()
    }

    async fn recall<'c>(
        conn: &'c mut SqliteConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<Option<Recalled>, sqlx::Error> {
        let sql = statements.sqlite_recall;
        fetch_recalled::<Self, i64>(conn, sql, consumer, id).await
    }

    async fn store<'c>(
        conn: &'c mut SqliteConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        remembered: Remembered<'c>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(statements.sqlite_store)
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
        conn: &'c mut SqliteConnection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        fingerprint: Option<&'c [u8]>,
        _: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = match fingerprint {
            None => {
                let sql = statements.sqlite_take_over;
                super::execute_keyed::<Self>(conn, sql, consumer, id).await?
            }
            Some(fingerprint) => {
                sqlx::query(statements.sqlite_take_over_printed)
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
        conn: &'c mut SqliteConnection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> Result<(), sqlx::Error> {
        super::execute_keyed::<Self>(conn, sql, consumer, id)
            .await
            .map(drop)
    }

    fn stamp_sql(statements: &Statements) -> Option<&'static str> {
        Some(statements.sqlite_stamp)
    }

    /// SQLite has no aborted state: a transaction it rolled back by itself makes `COMMIT`
    /// fail ("no transaction is active"). The commit goes through sqlx's transaction
    /// manager, so that the `Transaction` stays at hand for [`repair`].
    async fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<Claimed<'t>>,
        _: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = tx.tx;
        let mut result = Ok(());
        if let Some(claimed) = claimed.filter(|claimed| claimed.slow) {
            result = Self::stamp(
                &mut tx,
                claimed.statements.sqlite_stamp,
                claimed.consumer,
                claimed.id,
            )
            .await;
        }
        if result.is_ok() {
            result = Manager::commit(&mut tx).await;
        }
        match result {
            // Committed, and counted so by sqlx; dropping `tx` would send its worker a
            // `ROLLBACK` to skip. `tx` only borrows the connection (the handler begins
            // every transaction on `&mut` a connection), so forgetting it leaks nothing.
            Ok(()) => {
                std::mem::forget(tx);
                Ok(())
            }
            Err(error) if repair(&mut tx).await => Err(RolledBack::error("SQLite", Some(error))),
            Err(error) => Err(error),
        }
    }

    async fn rollback_owned<'t>(
        tx: Tx<'t, Self>,
        pooled: bool,
        wrote: bool,
    ) -> Result<(), sqlx::Error> {
        let mut tx = tx.tx;
        if pooled && !wrote {
            drop(tx);
            return Ok(());
        }
        match Manager::rollback(&mut tx).await {
            Ok(()) => Ok(()),
            Err(error) => {
                repair(&mut tx).await;
                Err(error)
            }
        }
    }

    fn begin_owned(
        conn: &mut SqliteConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin_with(BEGIN)
    }

    fn begin_nested(
        conn: &mut SqliteConnection,
        _: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        conn.begin()
    }
}
