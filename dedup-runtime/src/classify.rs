//! Error classification: what a database error means for the message. Transient (run it
//! again), a unique violation (perhaps the business key of a duplicate), the database
//! away (a redelivery will do). By SQLSTATE or vendor code, never by message text, except
//! where a backend names a violated key only in its message (see each backend's file).
//!
//! One trait, [`ClassifyBackend`], one file per backend; every question walks the error's
//! chain of sources with the one walker, [`chain::find`].

use std::error::Error as StdError;
use std::future::Future;

use sqlx::Database;
use sqlx::error::DatabaseError;

use crate::chain;
use crate::table::Table;

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// How one backend's errors read. Each method looks at one link of a chain (not its
/// sources): the chain is walked here, once for all backends.
pub trait ClassifyBackend: Database {
    /// Whether this error is a transient failure the database causes under concurrency.
    #[doc(hidden)]
    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool;

    /// Whether this database error says the database is away, not that the message is
    /// bad: the connection was lost, the server is shutting down or out of resources.
    #[doc(hidden)]
    fn is_unavailable_link(error: &dyn DatabaseError) -> bool;

    /// The unique violation this error reports, if it is one.
    #[doc(hidden)]
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation>;

    /// Whether `error`, from a statement on `table`, says that the table does not exist:
    /// for [`PruneError::MissingTable`](crate::PruneError::MissingTable) and
    /// [`LedgerError::MissingTable`](crate::LedgerError::MissingTable).
    #[doc(hidden)]
    fn is_missing_table(error: &sqlx::Error, table: &Table) -> bool;

    /// Which of `names` (the `unique = …` of a handler) `violation` is. Runs on the
    /// failed transaction's connection before it is rolled back, for backends that have
    /// to look the constraint up.
    #[doc(hidden)]
    fn matching<'c>(
        conn: &'c mut Self::Connection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> impl Future<Output = Option<&'static str>> + Send + 'c;
}

/// A unique violation as a backend reports it.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// PostgreSQL's constraint name, MySQL's key name, SQLite's expression index name.
    Named(String),
    /// SQLite names the table and columns: `UNIQUE constraint failed: t.a, t.b`.
    Columns { table: String, columns: Vec<String> },
}

/// Whether `error`, or any error in its chain of sources, is transient on `DB`.
pub(crate) fn is_transient<DB: ClassifyBackend>(error: &(dyn StdError + 'static)) -> bool {
    chain::find_either(error, |link| DB::is_transient_link(link).then_some(())).is_some()
}

/// The unique violation reported by `error` or any error in its chain of sources.
pub(crate) fn unique_violation<DB: ClassifyBackend>(
    error: &(dyn StdError + 'static),
) -> Option<Violation> {
    chain::find_either(error, DB::unique_violation_link)
}

/// Whether `error`'s chain says the database could not be reached or is going away: the
/// driver lost the connection, the pool gave up, or the server said so.
pub(crate) fn is_unavailable<DB: ClassifyBackend>(error: &(dyn StdError + 'static)) -> bool {
    chain::find(error, |link, database| {
        let unavailable = matches!(
            link.downcast_ref::<sqlx::Error>(),
            Some(
                sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::WorkerCrashed
            )
        ) || link.is::<std::io::Error>()
            || database.is_some_and(DB::is_unavailable_link);
        unavailable.then_some(())
    })
    .is_some()
}

/// The name in `names` that a named violation is (compared exactly: it is the name the
/// server reports).
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
fn matching_name(violation: &Violation, names: &'static [&'static str]) -> Option<&'static str> {
    match violation {
        Violation::Named(reported) => names.iter().copied().find(|name| name == reported),
        Violation::Columns { .. } => None,
    }
}

/// Whether `error` carries the SQLSTATE of a database that is away ([`unavailable_code`]).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
fn unavailable_sqlstate(error: &dyn DatabaseError) -> bool {
    error.code().is_some_and(|code| unavailable_code(&code))
}

/// The SQLSTATEs of a database that is away, not of a bad message: the classes `08`
/// (connection exception), `53` (insufficient resources) and `57` (operator
/// intervention), and the two codes of class `25` with which PostgreSQL ends a session
/// whose transaction took too long: `25P03` (idle_in_transaction_session_timeout) and
/// `25P04` (transaction_timeout, PostgreSQL 17). Both are FATAL: the server rolled the
/// transaction back and closed the connection, and a redelivery on another one succeeds.
/// The rest of class `25` (invalid transaction state, such as `25P02`, a statement in an
/// aborted transaction) is the handler's doing: permanent. SQLite reports numeric result
/// codes, not SQLSTATEs: it has none of these.
fn unavailable_code(code: &str) -> bool {
    code.len() == 5
        && (matches!(
            code.as_bytes()[..2],
            [b'0', b'8'] | [b'5', b'3'] | [b'5', b'7']
        ) || matches!(code, "25P03" | "25P04"))
}

#[cfg(test)]
mod tests {
    use super::unavailable_code;

    #[test]
    fn sqlstates_of_a_database_that_is_away() {
        for code in [
            "08006", "08P01", "53300", "57P01", "57P05", "57014", "25P03", "25P04",
        ] {
            assert!(unavailable_code(code), "{code}");
        }
        // Invalid transaction states the handler caused, constraint and data errors.
        for code in [
            "25P02", "25001", "25006", "23505", "22001", "42P01", "40001", "", "08",
        ] {
            assert!(!unavailable_code(code), "{code}");
        }
    }
}
