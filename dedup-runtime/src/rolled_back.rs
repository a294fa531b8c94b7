//! The typed error for a transaction the database ended before the handler's commit.

use std::error::Error as StdError;
use std::fmt;

/// The database rolled the handler's transaction back by itself, before the handler's
/// commit, although the body returned `Ok`: **nothing was committed**, neither the
/// body's effects nor the dedup record, and a redelivery processes the message.
///
/// It happens when the body swallows a database error and goes on:
///
/// - **PostgreSQL**: a statement in the body failed (`let _ = insert.execute(&mut *tx)
///   .await;` on a unique violation, a failed lookup turned into `.ok()`). The
///   transaction is aborted, and PostgreSQL would answer the `COMMIT` with `ROLLBACK`
///   and no error. The handler commits with a statement in front of `COMMIT`, in the same
///   round trip, that fails with SQLSTATE `25P02` in an aborted transaction.
/// - **MySQL / MariaDB**: InnoDB rolled the whole transaction back on a deadlock (1213)
///   and the body went on. The handler keeps the session out of autocommit for the
///   transaction's duration, so that what the body wrote after the rollback is not
///   committed statement by statement, and sends `COMMIT` only after releasing, in the
///   same round trip, the savepoint its transaction began with (gone with the rolled-back
///   transaction: the release fails with 1305). A handler with a business key and no
///   dedup row (`unique = …` alone) is checked the same way.
/// - **SQLite**: an automatic rollback — `SQLITE_FULL`, an I/O error, a trigger's
///   `RAISE(ROLLBACK, …)`, `ON CONFLICT ROLLBACK` — ended the transaction. (With the
///   error swallowed, SQLite runs the body's later statements in autocommit mode, each
///   committed on its own: no library can undo those. Never swallow a database error in a
///   body.)
///
/// When the handler owns the transaction it runs the call again, like a transient
/// failure (a swallowed deadlock usually succeeds the second time), up to
/// [`MAX_ATTEMPTS`](crate::MAX_ATTEMPTS) times — a handler with `effect = "send-first"`
/// not at all, since its body may have called out; then this error reaches the caller,
/// inside [`sqlx::Error::AnyDriverError`], through the handler's `From<sqlx::Error>`.
/// [`AckPolicy`](crate::AckPolicy) dead-letters it: a body that fails the same way on
/// every attempt is a bug to fix, and the dead-letter queue keeps the message for a replay.
///
/// ```
/// use dedup_runtime::RolledBack;
///
/// fn explain(error: &sqlx::Error) -> &'static str {
///     if RolledBack::find(error).is_some() {
///         "the body swallowed a database error: nothing was committed"
///     } else {
///         "another failure"
///     }
/// }
/// # assert_eq!(explain(&sqlx::Error::RowNotFound), "another failure");
/// ```
#[derive(Debug)]
pub struct RolledBack {
    database: &'static str,
    source: Option<sqlx::Error>,
}

impl RolledBack {
    /// The error for `database` (`sqlx::Database::NAME`), with the error that revealed the
    /// rollback, if any, as its source.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn error(database: &'static str, source: Option<sqlx::Error>) -> sqlx::Error {
        sqlx::Error::AnyDriverError(Box::new(RolledBack { database, source }))
    }

    /// The database, as `sqlx::Database::NAME` spells it (`PostgreSQL`, `MySQL`, `SQLite`).
    pub fn database(&self) -> &'static str {
        self.database
    }

    /// Finds a `RolledBack` in `error` or its chain of [`source`](StdError::source)s, so
    /// that it can be recognised behind `sqlx::Error`, a `thiserror` enum or
    /// `anyhow::Error` (pass `error.as_ref()`).
    pub fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a RolledBack> {
        let mut link = Some(error);
        while let Some(error) = link {
            if let Some(found) = error.downcast_ref::<RolledBack>() {
                return Some(found);
            }
            link = error.source();
        }
        None
    }
}

impl fmt::Display for RolledBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rolled the handler's transaction back before its commit, although the body \
             returned Ok: a statement in the body failed and the body went on. Nothing was \
             committed (neither the effects nor the dedup record); never swallow a database \
             error in an `#[idempotent]` body",
            self.database
        )
    }
}

impl StdError for RolledBack {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_ref()
            .map(|error| error as &(dyn StdError + 'static))
    }
}
