//! What each database does differently, behind one sealed trait.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::atomic::AtomicBool;

use sqlx::error::DatabaseError;
use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, Transaction};

use crate::migrate::Table;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The statements of one dedup table, one per backend, fixed at compile time.
///
/// Built by `statements!("table")`, so that nothing is formatted per call.
#[doc(hidden)]
#[derive(Debug)]
pub struct Statements {
    pub table: &'static str,
    pub postgres: &'static str,
    pub mysql: &'static str,
    pub sqlite: &'static str,
    /// Moves `processed_at` to the end of a slow transaction (see `run::STAMP_AFTER`).
    pub postgres_stamp: &'static str,
    pub sqlite_stamp: &'static str,
    /// MySQL's checked commit: stamps the dedup row with the commit time, fails unless
    /// the row is still this transaction's own, commits, and leaves autocommit mode again.
    pub mysql_commit: &'static str,
}

/// The statements for a table name literal, as a `&'static Statements`.
///
/// PostgreSQL and SQLite insert or do nothing (zero rows means a duplicate); the row's
/// `processed_at` is the claim statement's own time (PostgreSQL: `clock_timestamp()`, not
/// the transaction's start). MySQL and MariaDB have no `DO NOTHING`: `INSERT IGNORE` would
/// turn other errors into warnings and the driver reports found rows for `ON DUPLICATE
/// KEY UPDATE`, so the claim is a plain insert whose duplicate-key error (1062, for this
/// statement only ever the table's primary key) means a duplicate; MySQL keeps the
/// transaction usable after it. It writes `processed_at` in UTC whatever the session's
/// time zone, and remembers the row in session variables for the checked commit:
///
/// ```sql
/// UPDATE t SET processed_at = UTC_TIMESTAMP(6)
///  WHERE consumer = @dedup_consumer AND message_id = @dedup_message_id
///    AND processed_at = @dedup_claimed_at;           -- only this transaction's own row
/// SELECT (SELECT 1 UNION ALL SELECT 1 FROM DUAL WHERE ROW_COUNT() <> 1);
///                                                     -- error 1242 unless it was there
/// COMMIT; SET autocommit = 1
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __statements {
    ($table:literal) => {{
        const STATEMENTS: &$crate::__private::Statements = &$crate::__private::Statements {
            table: $table,
            postgres: ::core::concat!(
                "INSERT INTO ",
                $table,
                " (consumer, message_id, processed_at) VALUES ($1, $2, clock_timestamp()) \
                 ON CONFLICT DO NOTHING"
            ),
            mysql: ::core::concat!(
                "INSERT INTO ",
                $table,
                " (consumer, message_id, processed_at) \
                 VALUES (@dedup_consumer := ?, @dedup_message_id := ?, \
                 @dedup_claimed_at := UTC_TIMESTAMP(6))"
            ),
            sqlite: ::core::concat!(
                "INSERT INTO ",
                $table,
                " (consumer, message_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
            ),
            postgres_stamp: ::core::concat!(
                "UPDATE ",
                $table,
                " SET processed_at = clock_timestamp() WHERE consumer = $1 AND message_id = $2"
            ),
            sqlite_stamp: ::core::concat!(
                "UPDATE ",
                $table,
                " SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 WHERE consumer = ?1 AND message_id = ?2"
            ),
            mysql_commit: ::core::concat!(
                "UPDATE ",
                $table,
                " SET processed_at = UTC_TIMESTAMP(6) \
                 WHERE consumer = @dedup_consumer AND message_id = @dedup_message_id \
                 AND processed_at = @dedup_claimed_at; \
                 SELECT (SELECT 1 UNION ALL SELECT 1 FROM DUAL WHERE ROW_COUNT() <> 1); \
                 COMMIT; SET autocommit = 1"
            ),
        };
        STATEMENTS
    }};
}

mod sealed {
    pub trait Sealed {}
}

/// A database `dedup` supports: `sqlx::Postgres` (feature `postgres`), `sqlx::Sqlite`
/// (feature `sqlite`) and `sqlx::MySql` (feature `mysql`, also for MariaDB).
///
/// Sealed: its methods are the library's internals.
pub trait Backend: Database + sealed::Sealed {
    #[doc(hidden)]
    fn claim_sql(statements: &Statements) -> &'static str;

    /// The statement that moves a claimed row's `processed_at` to now, for a transaction
    /// that ran long between its claim and its commit; `None` where the commit itself
    /// always writes the commit time (MySQL).
    #[doc(hidden)]
    fn stamp_sql(statements: &Statements) -> Option<&'static str>;

    /// Whether a transaction of the handler's changes the session (MySQL's
    /// `autocommit`): a pooled connection whose call ended before the handler restored it
    /// (cancelled, panicked) is closed instead of going back to the pool.
    #[doc(hidden)]
    const CHANGES_SESSION: bool = false;

    /// Inserts the dedup row; `Ok(false)` when it was already there.
    #[doc(hidden)]
    fn claim<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// Runs `sql` (a [`Backend::stamp_sql`]) for the claimed row.
    #[doc(hidden)]
    fn stamp<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Begins a transaction the handler owns (SQLite: `BEGIN IMMEDIATE`; MySQL: out of
    /// autocommit mode first). With `business_keys`, the session is prepared for
    /// [`Backend::unique_violation_link`].
    #[doc(hidden)]
    fn begin_owned(
        conn: &mut Self::Connection,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_;

    /// Commits a transaction the handler owns — only if the database has not rolled it
    /// back by itself in the meantime ([`RolledBack`](crate::RolledBack)). `claimed`: the
    /// statements of its dedup row, if it claimed one. `pooled`: the connection goes
    /// back to a pool (which flushes queued statements at once); otherwise it is the
    /// caller's, and nothing may be left queued or open on it.
    #[doc(hidden)]
    fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<crate::run::Claimed<'t>>,
        pooled: bool,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// Rolls back a transaction the handler owns. `wrote`: anything beyond a failed or
    /// empty claim may have been written (a pooled duplicate's rollback may be queued).
    #[doc(hidden)]
    fn rollback_owned<'t>(
        tx: Tx<'t, Self>,
        pooled: bool,
        wrote: bool,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// Begins a savepoint inside the caller's transaction.
    #[doc(hidden)]
    fn begin_nested(
        conn: &mut Self::Connection,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_;

    /// The unique violation this one error (not its sources) reports, if it is one.
    #[doc(hidden)]
    fn unique_violation_link(error: &(dyn StdError + 'static)) -> Option<Violation>;

    /// Which of `names` (the `unique = …` of a handler) `violation` is. Runs on the
    /// failed transaction's connection before it is rolled back, for backends that have
    /// to look the constraint up.
    #[doc(hidden)]
    fn matching<'c>(
        conn: &'c mut Self::Connection,
        violation: Violation,
        names: &'static [&'static str],
    ) -> impl Future<Output = Option<&'static str>> + Send + 'c;

    /// Whether this one error (not its sources) is a transient failure the database
    /// causes under concurrency: classified by SQLSTATE or vendor code, never by text.
    #[doc(hidden)]
    fn is_transient_link(error: &(dyn StdError + 'static)) -> bool;

    /// The statements that create `table` and its pruning index, and upgrade an existing
    /// one.
    #[doc(hidden)]
    fn ddl(table: &Table) -> Vec<String>;

    /// Runs `ddl` so that concurrent migrations do not trip over each other.
    #[doc(hidden)]
    fn create(
        pool: &Pool<Self>,
        ddl: Vec<String>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;
}

/// Runs `sql`, one of a table's [`Statements`], with the two parameters every one of them
/// takes: the consumer and the message id. The one place they are bound, for every
/// backend's claim and stamp.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) async fn execute_keyed<'c, DB>(
    conn: &'c mut DB::Connection,
    sql: &'static str,
    consumer: &'static str,
    id: &'c str,
) -> Result<DB::QueryResult, sqlx::Error>
where
    DB: Database,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query(sql).bind(consumer).bind(id).execute(conn).await
}

/// Ends a transaction whose end the backend has already sent as plain SQL (so that sqlx
/// still counts it open): a pooled connection's pool flushes the queued `ROLLBACK` with
/// the ping it sends anyway; on a caller's connection it is sent now, so that nothing is
/// left queued or open. Its failure changes nothing of what was committed.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) async fn discard<DB: Backend>(tx: Transaction<'_, DB>, pooled: bool) {
    if pooled {
        drop(tx);
    } else if let Err(error) = tx.rollback().await {
        tracing::debug!(%error, "closing the transaction's bookkeeping failed");
    }
}

/// The first `Some` that `look` finds in `error`'s chain of sources. `look` sees each
/// link, and the database error it carries, if any: a `sqlx::Error::Database`, or the
/// boxed `DatabaseError` that `#[error(transparent)]` wrappers forward `source()` to (its
/// concrete type is the box itself).
pub(crate) fn find_in_chain<T>(
    error: &(dyn StdError + 'static),
    look: impl Fn(&(dyn StdError + 'static), Option<&dyn DatabaseError>) -> Option<T>,
) -> Option<T> {
    let mut link = Some(error);
    while let Some(error) = link {
        let database = match error.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Database(database)) => Some(&**database),
            _ => error
                .downcast_ref::<Box<dyn DatabaseError>>()
                .map(|database| &**database),
        };
        if let Some(found) = look(error, database) {
            return Some(found);
        }
        link = error.source();
    }
    None
}

/// `look` applied to the database error of a link first, then to the link itself.
fn either<T>(
    look: impl Fn(&(dyn StdError + 'static)) -> Option<T>,
) -> impl Fn(&(dyn StdError + 'static), Option<&dyn DatabaseError>) -> Option<T> {
    move |link, database| {
        database
            .and_then(|database| look(database.as_error()))
            .or_else(|| look(link))
    }
}

/// Whether `error`, or any error in its chain of sources, is transient on `DB`.
pub(crate) fn is_transient<DB: Backend>(error: &(dyn StdError + 'static)) -> bool {
    find_in_chain(
        error,
        either(|link| DB::is_transient_link(link).then_some(())),
    )
    .is_some()
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

/// The name in `names` that a named violation is (compared exactly: it is the name the
/// server reports).
pub(crate) fn matching_name(
    violation: &Violation,
    names: &'static [&'static str],
) -> Option<&'static str> {
    match violation {
        Violation::Named(reported) => names.iter().copied().find(|name| name == reported),
        Violation::Columns { .. } => None,
    }
}

/// The unique violation reported by `error` or any error in its chain of sources.
pub(crate) fn unique_violation<DB: Backend>(error: &(dyn StdError + 'static)) -> Option<Violation> {
    find_in_chain(error, either(DB::unique_violation_link))
}

/// Where a handler's transaction comes from: a pool, or a connection the caller lends
/// (possibly inside the caller's own transaction). Lives for one call of the generated
/// function, across its attempts.
#[doc(hidden)]
pub struct Handle<'a, DB: Database> {
    pub(crate) source: Source<'a, DB>,
    /// Set while the session of a pooled connection is changed by an unfinished
    /// transaction (MySQL's autocommit): if the call ends here, the connection is closed.
    pub(crate) unclean: AtomicBool,
}

pub(crate) enum Source<'a, DB: Database> {
    /// The pool, and the connection of the current attempt.
    Pool(&'a Pool<DB>, Option<PoolConnection<DB>>),
    Conn(&'a mut DB::Connection),
}

impl<'a, DB: Database> Handle<'a, DB> {
    fn new(source: Source<'a, DB>) -> Self {
        Handle {
            source,
            unclean: AtomicBool::new(false),
        }
    }
}

impl<DB: Database> Drop for Handle<'_, DB> {
    fn drop(&mut self) {
        if *self.unclean.get_mut()
            && let Source::Pool(_, Some(conn)) = &mut self.source
        {
            conn.close_on_drop();
        }
    }
}

/// One attempt's transaction (or savepoint), as the generated code holds it between
/// [`Run::begin`](crate::run::Run::begin) and its commit or abort.
#[doc(hidden)]
pub struct Tx<'h, DB: Database> {
    pub(crate) tx: Transaction<'h, DB>,
    /// The handle's flag: set while the session is changed (see [`Handle`]).
    pub(crate) unclean: &'h AtomicBool,
}

/// What the function generated by `#[idempotent]` accepts in place of the handler's
/// connection: `&Pool<DB>`, or `&mut` a connection, a `PoolConnection` or a `Transaction`
/// of the same database.
///
/// With a pool the handler begins and commits its own transaction, and retries transient
/// failures. With a connection that is already inside a transaction, the handler runs in
/// a savepoint: if the caller rolls back, the dedup record and the effects go with it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot run this `#[idempotent]` handler on `{DB}`",
    label = "expected `&Pool<{DB}>`, or `&mut` a connection or `Transaction` of `{DB}`",
    note = "pass `&pool`, or `&mut conn` / `&mut tx` to run inside your own connection or \
            transaction; the handler's first parameter decides the database"
)]
pub trait Db<'a, DB: Backend> {
    #[doc(hidden)]
    fn into_handle(self) -> Handle<'a, DB>;
}

impl<'a, DB: Backend> Db<'a, DB> for &'a Pool<DB> {
    fn into_handle(self) -> Handle<'a, DB> {
        Handle::new(Source::Pool(self, None))
    }
}

impl<'a, DB: Backend> Db<'a, DB> for &'a mut Transaction<'_, DB> {
    fn into_handle(self) -> Handle<'a, DB> {
        Handle::new(Source::Conn(&mut **self))
    }
}

impl<'a, DB: Backend> Db<'a, DB> for &'a mut PoolConnection<DB> {
    fn into_handle(self) -> Handle<'a, DB> {
        Handle::new(Source::Conn(&mut **self))
    }
}

/// The types a handler may declare as its first parameter (behind `&mut`): the backend's
/// connection type, or `sqlx::Transaction<'_, DB>`. Its `Database` picks the backend.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a connection an `#[idempotent]` handler can run on",
    label = "the handler's first parameter is the connection its body works on",
    note = "write `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection`, \
            `&mut sqlx::MySqlConnection` or `&mut sqlx::Transaction<'_, DB>`"
)]
pub trait HandlerConnection<'t> {
    /// The database the handler runs on.
    type Database: Backend;

    /// The handler's view of the generated transaction.
    #[doc(hidden)]
    fn from_transaction<'a>(tx: &'a mut Tx<'t, Self::Database>) -> &'a mut Self;
}

#[diagnostic::do_not_recommend]
impl<'t, DB: Backend> HandlerConnection<'t> for Transaction<'t, DB> {
    type Database = DB;

    fn from_transaction<'a>(tx: &'a mut Tx<'t, DB>) -> &'a mut Self {
        &mut tx.tx
    }
}

/// The per-connection impls of [`Db`] and [`HandlerConnection`] for one backend.
macro_rules! connection_impls {
    ($database:ty, $connection:ty) => {
        impl crate::backend::sealed::Sealed for $database {}

        impl<'a> crate::backend::Db<'a, $database> for &'a mut $connection {
            fn into_handle(self) -> crate::backend::Handle<'a, $database> {
                crate::backend::Handle::new(crate::backend::Source::Conn(self))
            }
        }

        #[diagnostic::do_not_recommend]
        impl<'t> crate::backend::HandlerConnection<'t> for $connection {
            type Database = $database;

            fn from_transaction<'a>(tx: &'a mut crate::backend::Tx<'t, $database>) -> &'a mut Self {
                &mut *tx.tx
            }
        }
    };
}
pub(crate) use connection_impls;

/// Rolls `tx` back, logging a failure: the error that made us roll back is the one that
/// matters.
pub(crate) async fn rollback_logged<DB: Backend>(tx: Transaction<'_, DB>) {
    if let Err(error) = tx.rollback().await {
        tracing::debug!(%error, "rollback failed; the transaction is discarded");
    }
}
