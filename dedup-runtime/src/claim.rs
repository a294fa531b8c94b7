//! Claim and commit: how each backend begins the handler's transaction, inserts the dedup
//! row, and commits only what really is committed. One trait, [`ClaimBackend`], one file
//! per backend; the SQL of a table is fixed at compile time ([`Statements`]).

use std::future::Future;
use std::sync::atomic::AtomicBool;

use sqlx::{Database, Transaction};

use crate::stored::{Recalled, Remembered};

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

/// The statements of one dedup table, one per backend, fixed at compile time.
///
/// Built by `statements!("table")`, so that nothing is formatted per call.
#[doc(hidden)]
#[derive(Debug)]
pub struct Statements {
    /// The table, as written in the attribute.
    pub table: &'static str,
    /// PostgreSQL's claim: `INSERT … ON CONFLICT DO NOTHING`, one row affected when it
    /// inserted. A duplicate then looks at the row it found ([`postgres_inspect`]).
    ///
    /// [`postgres_inspect`]: Self::postgres_inspect
    pub postgres: &'static str,
    /// The look at a found row reading `state` and `expires_at` by name, once the table
    /// has them: those two columns, not the whole row converted (a stored result
    /// included), as [`postgres_inspect`](Self::postgres_inspect) reads a table of migration `0001`.
    pub postgres_inspect_named: &'static str,
    pub mysql: &'static str,
    pub sqlite: &'static str,
    /// Moves `processed_at` to the end of a slow transaction (see [`STAMP_AFTER`](crate::STAMP_AFTER)).
    pub postgres_stamp: &'static str,
    pub sqlite_stamp: &'static str,
    /// MySQL's commit of a transaction slower than [`STAMP_AFTER`](crate::STAMP_AFTER):
    /// the row's `processed_at` moves to the commit time, the commit fails unless the row
    /// is still this transaction's own, and the session leaves autocommit mode again.
    pub mysql_commit_stamped: &'static str,
    /// MySQL's claim inside a caller's transaction: a plain insert that leaves the session
    /// variables of an outer handler's (slow) commit as they are.
    pub mysql_nested: &'static str,
    /// For a claim that found the row there: its `state` and the microseconds left until
    /// its `expires_at` (a row in progress under a lease, see [`crate::lease`]).
    pub postgres_inspect: &'static str,
    pub mysql_inspect: &'static str,
    pub sqlite_inspect: &'static str,
    /// Takes over an expired send-first lease (`state = 1`) as this transaction's claim:
    /// the row becomes processed, with the effect, when the transaction commits.
    pub postgres_take_over: &'static str,
    pub mysql_take_over: &'static str,
    pub sqlite_take_over: &'static str,
    /// The take-over of a handler with a fingerprint (the last parameter): only over a
    /// row that has none or the same one. Its recall compared them before; this keeps it
    /// so if the row changed in between (as the leased and the batch take-overs do).
    pub postgres_take_over_printed: &'static str,
    pub mysql_take_over_printed: &'static str,
    pub sqlite_take_over_printed: &'static str,
    /// For a handler with a stored result or a fingerprint, a claim that found the row:
    /// what it remembers (see [`crate::stored`]). MySQL: a locking read, the latest
    /// committed row.
    pub postgres_recall: &'static str,
    pub mysql_recall: &'static str,
    pub sqlite_recall: &'static str,
    /// Writes the result, its version and the fingerprint into the claimed row, just
    /// before the commit. A fingerprint the row has stays (`COALESCE`): a handler without
    /// one that takes over a send-first lease claimed with one (a rolling upgrade or
    /// downgrade runs both) must not erase it, and a handler with one compared it first
    /// (its recall).
    pub postgres_store: &'static str,
    pub mysql_store: &'static str,
    pub sqlite_store: &'static str,
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
/// time zone, and remembers the row in session variables for a slow transaction's commit.
/// The handler's own transaction begins with a savepoint, and its commit releases it
/// first: gone with a transaction InnoDB ended (a deadlock the body swallowed), the
/// release fails (1305) and the `COMMIT` after it in the same query is not run:
///
/// ```sql
/// SET autocommit = 0; SAVEPOINT dedup_alive; INSERT INTO t …
/// -- the body
/// RELEASE SAVEPOINT dedup_alive; SET autocommit = 1  -- which commits
/// ```
///
/// A transaction slower than [`STAMP_AFTER`](crate::STAMP_AFTER) moves the row's
/// `processed_at` to the commit time instead, as on PostgreSQL, and fails with an
/// out-of-range sum (1690, an error whatever the `sql_mode`) unless the row is still this
/// transaction's own:
///
/// ```sql
/// UPDATE t SET processed_at = UTC_TIMESTAMP(6)
///  WHERE consumer = @dedup_consumer AND message_id = @dedup_message_id
///    AND processed_at = @dedup_claimed_at;           -- only this transaction's own row
/// SELECT 18446744073709551615 + (ROW_COUNT() <> 1);  -- error 1690 unless it was there
/// SET autocommit = 1                                 -- which commits
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __statements {
    ($table:literal) => {{
        const STATEMENTS: &$crate::__private::Statements = &$crate::__private::Statements {
            table: $table,
            // The insert alone, which says whether it inserted: the fresh message sends
            // what a hand-written transaction sends. A duplicate pays a second statement
            // to learn what it found (`postgres_inspect`, or `postgres_inspect_named`
            // once the table has `state` and `expires_at`).
            postgres: ::core::concat!(
                "INSERT INTO ",
                $table,
                " (consumer, message_id, processed_at) VALUES ($1, $2, clock_timestamp()) \
                 ON CONFLICT DO NOTHING"
            ),
            postgres_inspect_named: ::core::concat!(
                "SELECT p.state, GREATEST(0, (EXTRACT(EPOCH FROM p.expires_at - clock_timestamp()) \
                 * 1000000)::int8) FROM ",
                $table,
                " p WHERE consumer = $1 AND message_id = $2"
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
            mysql_commit_stamped: ::core::concat!(
                "UPDATE ",
                $table,
                " SET processed_at = UTC_TIMESTAMP(6) \
                 WHERE consumer = @dedup_consumer AND message_id = @dedup_message_id \
                 AND processed_at = @dedup_claimed_at; \
                 SELECT 18446744073709551615 + (ROW_COUNT() <> 1); \
                 SET autocommit = 1"
            ),
            mysql_nested: ::core::concat!(
                "INSERT INTO ",
                $table,
                " (consumer, message_id, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))"
            ),
            postgres_inspect: ::core::concat!(
                "SELECT (to_jsonb(p) ->> 'state')::int2, GREATEST(0, (EXTRACT(EPOCH FROM \
                 (to_jsonb(p) ->> 'expires_at')::timestamptz - clock_timestamp()) \
                 * 1000000)::int8) FROM ",
                $table,
                " p WHERE consumer = $1 AND message_id = $2"
            ),
            // A locking read: the latest committed row, whatever snapshot a caller's
            // transaction holds.
            mysql_inspect: ::core::concat!(
                "SELECT state, GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), \
                 expires_at)) FROM ",
                $table,
                " WHERE consumer = ? AND message_id = ? LOCK IN SHARE MODE"
            ),
            sqlite_inspect: ::core::concat!(
                "SELECT state, CAST(max(0, (julianday(expires_at) - julianday('now')) \
                 * 86400000000.0) AS INTEGER) FROM ",
                $table,
                " WHERE consumer = ?1 AND message_id = ?2"
            ),
            // What fences a take-over against the row changing after the claim read it.
            // PostgreSQL's reads lock nothing (neither `DO NOTHING` nor the plain
            // selects), but the UPDATE checks its WHERE again on the row's latest version:
            // `state = 1` refuses a row completed, or taken over by a plain handler or a
            // batch (processed, or locked until it is), and a released one is gone;
            // `expires_at` refuses one that another leased delivery claimed or took over,
            // while its lease runs. Nothing but the fingerprint refuses one whose new
            // lease ran out too before this statement ran (a handler stalled longer than
            // that lease): the printed take-over below checks it. MySQL's claim and
            // reads hold a shared lock on the row until the transaction ends (the failed
            // insert's, `LOCK IN SHARE MODE`), and SQLite's transaction holds the write
            // lock from its claim on: there nothing changes the row in between, and the
            // check is the same anyway.
            postgres_take_over: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = clock_timestamp() \
                 WHERE consumer = $1 AND message_id = $2 AND state = 1 \
                 AND expires_at <= clock_timestamp()"
            ),
            postgres_take_over_printed: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = clock_timestamp() \
                 WHERE consumer = $1 AND message_id = $2 AND state = 1 \
                 AND expires_at <= clock_timestamp() \
                 AND (fingerprint IS NULL OR fingerprint = $3)"
            ),
            // The first parameter: whether the transaction is the handler's own; then
            // `processed_at` is the session variable a slow commit compares with
            // (set just before), and otherwise now.
            mysql_take_over: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = IF(?, @dedup_claimed_at, UTC_TIMESTAMP(6)) \
                 WHERE consumer = ? AND message_id = ? AND state = 1 \
                 AND expires_at <= UTC_TIMESTAMP(6)"
            ),
            mysql_take_over_printed: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = IF(?, @dedup_claimed_at, UTC_TIMESTAMP(6)) \
                 WHERE consumer = ? AND message_id = ? AND state = 1 \
                 AND expires_at <= UTC_TIMESTAMP(6) \
                 AND (fingerprint IS NULL OR fingerprint = ?)"
            ),
            sqlite_take_over: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 WHERE consumer = ?1 AND message_id = ?2 AND state = 1 \
                 AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
            ),
            sqlite_take_over_printed: ::core::concat!(
                "UPDATE ",
                $table,
                " SET state = NULL, owner = NULL, expires_at = NULL, \
                 processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 WHERE consumer = ?1 AND message_id = ?2 AND state = 1 \
                 AND expires_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 AND (fingerprint IS NULL OR fingerprint = ?3)"
            ),
            postgres_recall: ::core::concat!(
                "SELECT result, result_version, fingerprint FROM ",
                $table,
                " WHERE consumer = $1 AND message_id = $2"
            ),
            mysql_recall: ::core::concat!(
                "SELECT result, result_version, fingerprint FROM ",
                $table,
                " WHERE consumer = ? AND message_id = ? LOCK IN SHARE MODE"
            ),
            sqlite_recall: ::core::concat!(
                "SELECT result, result_version, fingerprint FROM ",
                $table,
                " WHERE consumer = ?1 AND message_id = ?2"
            ),
            postgres_store: ::core::concat!(
                "UPDATE ",
                $table,
                " SET result = $3, result_version = $4, fingerprint = COALESCE(fingerprint, $5) \
                 WHERE consumer = $1 AND message_id = $2"
            ),
            mysql_store: ::core::concat!(
                "UPDATE ",
                $table,
                " SET result = ?, result_version = ?, fingerprint = COALESCE(fingerprint, ?) \
                 WHERE consumer = ? AND message_id = ?"
            ),
            sqlite_store: ::core::concat!(
                "UPDATE ",
                $table,
                " SET result = ?3, result_version = ?4, fingerprint = COALESCE(fingerprint, ?5) \
                 WHERE consumer = ?1 AND message_id = ?2"
            ),
        };
        STATEMENTS
    }};
}

/// How one backend runs a handler's transaction: begin, claim, commit, roll back.
pub trait ClaimBackend: Database {
    #[doc(hidden)]
    fn claim_sql(statements: &Statements) -> &'static str;

    /// The statement that moves a claimed row's `processed_at` to now, for a transaction
    /// that ran long between its claim and its commit; `None` where the handler's own
    /// commit moves it itself (MySQL: `Statements::mysql_commit_stamped`).
    #[doc(hidden)]
    fn stamp_sql(statements: &Statements) -> Option<&'static str>;

    /// Whether a transaction of the handler's changes the session (MySQL's
    /// `autocommit`): a pooled connection whose call ended before the handler restored it
    /// (cancelled, panicked) is closed instead of going back to the pool.
    #[doc(hidden)]
    const CHANGES_SESSION: bool = false;

    /// Inserts the dedup row, or answers what it found there. `sql` is one of
    /// `statements`' (the claim or the nested claim).
    #[doc(hidden)]
    fn claim<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<Claiming, sqlx::Error>> + Send + 'c;

    /// The claim's statement inside a caller's transaction (a savepoint). MySQL: one that
    /// leaves the session variables of an outer handler's (slow) commit alone.
    #[doc(hidden)]
    fn nested_claim_sql(statements: &Statements) -> &'static str {
        Self::claim_sql(statements)
    }

    /// For a claim that found the row there: what it says, `None` when it is gone (a
    /// lease released in between).
    #[doc(hidden)]
    fn inspect<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<Option<Found>, sqlx::Error>> + Send + 'c;

    /// Takes over an expired send-first lease as this transaction's claim; `Ok(false)`
    /// when the row is not one (any more), or, with this delivery's `fingerprint`, is
    /// printed with another one (then through the `*_take_over_printed` statement).
    /// `owned`: the transaction is the handler's own (MySQL: the session variables of a
    /// slow commit are set for the row).
    #[doc(hidden)]
    fn take_over<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        fingerprint: Option<&'c [u8]>,
        owned: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// For a claim that found the row there, under a handler with a stored result or a
    /// fingerprint: what the row remembers; `None` when it is gone.
    #[doc(hidden)]
    fn recall<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<Option<Recalled>, sqlx::Error>> + Send + 'c;

    /// Writes the handler's result (with its version) and the fingerprint into the
    /// claimed row, in the handler's transaction.
    #[doc(hidden)]
    fn store<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
        remembered: Remembered<'c>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Runs `sql` (a [`ClaimBackend::stamp_sql`]) for the claimed row.
    #[doc(hidden)]
    fn stamp<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static str,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Begins a transaction the handler owns (SQLite: `BEGIN IMMEDIATE`; MySQL: out of
    /// autocommit mode first). With `business_keys`, the session is prepared for
    /// `ClassifyBackend::unique_violation_link`.
    #[doc(hidden)]
    fn begin_owned(
        conn: &mut Self::Connection,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_;

    /// The claim sent with `BEGIN`, in one round trip, for a transaction the handler
    /// owns on a pooled connection (only there: one that the call leaves holding a
    /// transaction sqlx does not count is closed; a lent one could not be cleaned up);
    /// `None` where the backend keeps them apart (PostgreSQL, where folding them measured
    /// slower).
    ///
    /// Sent with `begin_with`, it answers `Ok` once the row is in, this transaction's
    /// own. An error leaves on the connection a transaction that sqlx does not count
    /// (MySQL: open, out of autocommit mode);
    /// [`found_row`](Self::found_row) says whether it is the row found there, and
    /// [`look_processed`](Self::look_processed) or [`begin_again`](Self::begin_again)
    /// then rolls it back.
    #[doc(hidden)]
    fn begin_claim_sql(
        statements: &Statements,
        consumer: &str,
        id: &str,
        business_keys: bool,
    ) -> Option<String> {
        let _ = (statements, consumer, id, business_keys);
        None
    }

    /// Whether an error of the [claim sent with `BEGIN`](Self::begin_claim_sql) is the dedup row
    /// found there (a duplicate, or a row under a lease).
    #[doc(hidden)]
    fn found_row(error: &sqlx::Error) -> bool {
        let _ = error;
        false
    }

    /// After the [claim sent with `BEGIN`](Self::begin_claim_sql) found the row: rolls its
    /// transaction back and begins another, in one round trip, to look at the row.
    #[doc(hidden)]
    fn begin_again(
        conn: &mut Self::Connection,
        business_keys: bool,
    ) -> impl Future<Output = Result<Transaction<'_, Self>, sqlx::Error>> + Send + '_ {
        Self::begin_owned(conn, business_keys)
    }

    /// After the [claim sent with `BEGIN`](Self::begin_claim_sql) found the row: rolls
    /// that transaction back and reads, in the same round trip and outside any
    /// transaction, whether the row is a processed one — a duplicate, the call over.
    /// `Ok(Some(false))`: rolled back, the row is not (in progress, an unknown outcome, or
    /// gone): begin again and look as before. `Ok(None)`: not done here (nothing sent).
    #[doc(hidden)]
    fn look_processed<'c>(
        conn: &'c mut Self::Connection,
        statements: &'static Statements,
        consumer: &'static str,
        id: &'c str,
    ) -> impl Future<Output = Result<Option<bool>, sqlx::Error>> + Send + 'c {
        let _ = (conn, statements, consumer, id);
        std::future::ready(Ok(None))
    }

    /// Commits a transaction the handler owns — only if the database has not rolled it
    /// back by itself in the meantime ([`RolledBack`](crate::RolledBack)). `claimed`: the
    /// statements of its dedup row, if it claimed one. `pooled`: the connection goes
    /// back to a pool (which flushes queued statements at once); otherwise it is the
    /// caller's, and nothing may be left queued or open on it.
    #[doc(hidden)]
    fn commit_owned<'t>(
        tx: Tx<'t, Self>,
        claimed: Option<Claimed<'t>>,
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
}

/// What a claim statement did.
#[doc(hidden)]
pub enum Claiming {
    /// The row is in, this transaction's own.
    Inserted,
    /// The row was there; what it says, if the claim read it (PostgreSQL, in the same
    /// statement) — otherwise `ClaimBackend::inspect` looks.
    Found(Option<Found>),
}

/// One attempt's transaction (or savepoint), as the generated code holds it between
/// [`Run::begin`](crate::run::Run::begin) and its commit or abort.
#[doc(hidden)]
pub struct Tx<'h, DB: Database> {
    pub(crate) tx: Transaction<'h, DB>,
    /// The handle's flag: set while the session is changed (see `input::Handle`).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) unclean: &'h AtomicBool,
}

/// The claimed dedup row, as the backend's commit needs it.
pub struct Claimed<'c> {
    pub statements: &'static Statements,
    pub consumer: &'static str,
    pub id: &'c str,
    /// Claimed more than [`STAMP_AFTER`](crate::STAMP_AFTER) ago: its `processed_at` must be moved.
    pub slow: bool,
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

/// Appends `bytes` as hexadecimal digits: how an id goes into a statement that cannot
/// bind it (a claim sent with `BEGIN`, a simple query). Only `0-9a-f` is written, so no
/// id can end the literal around it or change the statement, whatever the session's
/// string settings (`standard_conforming_strings`, `NO_BACKSLASH_ESCAPES`).
#[cfg_attr(not(feature = "mysql"), allow(dead_code))]
pub(crate) fn push_hex(sql: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2);
    for byte in bytes {
        sql.push(char::from(DIGITS[usize::from(byte >> 4)]));
        sql.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
}

/// Ends a transaction whose end the backend has already sent as plain SQL (so that sqlx
/// still counts it open): a pooled connection's pool flushes the queued `ROLLBACK` with
/// the ping it sends anyway; on a caller's connection it is sent now, so that nothing is
/// left queued or open. Its failure changes nothing of what was committed.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) async fn discard<DB: Database>(tx: Transaction<'_, DB>, pooled: bool) {
    if pooled {
        drop(tx);
    } else if let Err(error) = tx.rollback().await {
        tracing::debug!(%error, "closing the transaction's bookkeeping failed");
    }
}

/// Rolls `tx` back, logging a failure: the error that made us roll back is the one that
/// matters.
pub(crate) async fn rollback_logged<DB: Database>(tx: Transaction<'_, DB>) {
    if let Err(error) = tx.rollback().await {
        tracing::debug!(%error, "rollback failed; the transaction is discarded");
    }
}

/// What the row says when the claim found it there.
#[doc(hidden)]
pub struct Found {
    /// `None`: processed; `Some(1)` a send-first lease; `Some(2)` a mark-first mark.
    pub(crate) state: Option<i64>,
    /// Microseconds left until `expires_at`, on the database's clock (0 once expired).
    pub(crate) remaining_us: Option<i64>,
}

impl Found {
    /// The `state` and microseconds-left columns at `at` and `at + 1` of a PostgreSQL row
    /// (`state` is a `smallint`).
    #[cfg(feature = "postgres")]
    pub(crate) fn from_postgres(
        row: &sqlx::postgres::PgRow,
        at: usize,
    ) -> Result<Found, sqlx::Error> {
        use sqlx::Row;
        Ok(Found {
            state: row.try_get::<Option<i16>, _>(at)?.map(i64::from),
            remaining_us: row.try_get(at + 1)?,
        })
    }

    /// The same of a MySQL or MariaDB row (`state` is a `TINYINT`).
    #[cfg(feature = "mysql")]
    pub(crate) fn from_mysql(row: &sqlx::mysql::MySqlRow, at: usize) -> Result<Found, sqlx::Error> {
        use sqlx::Row;
        Ok(Found {
            state: row.try_get::<Option<i8>, _>(at)?.map(i64::from),
            remaining_us: row.try_get(at + 1)?,
        })
    }

    /// The same of an SQLite row.
    #[cfg(feature = "sqlite")]
    pub(crate) fn from_sqlite(
        row: &sqlx::sqlite::SqliteRow,
        at: usize,
    ) -> Result<Found, sqlx::Error> {
        use sqlx::Row;
        Ok(Found {
            state: row.try_get(at)?,
            remaining_us: row.try_get(at + 1)?,
        })
    }
}

#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
impl Found {
    /// A processed row (also what every row of a `0001` table, which has no `state`, is).
    pub(crate) const PROCESSED: Found = Found {
        state: None,
        remaining_us: None,
    };
}

/// Whether `error` says the dedup table has no `state` column: a table of migration `0001` that
/// `migrate` has not upgraded yet, whose rows are all processed. MySQL by its number
/// (1054); SQLite has no code for it but its message, of a statement of ours.
#[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
pub(crate) fn missing_state_column(error: &sqlx::Error) -> bool {
    #[cfg(feature = "mysql")]
    if crate::dialect::mysql::error_number(error) == Some(crate::dialect::mysql::ER_BAD_FIELD) {
        return true;
    }
    error
        .as_database_error()
        .is_some_and(|error| error.message().starts_with("no such column"))
}
