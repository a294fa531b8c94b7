//! The operator's tools on the dedup table: "was this id processed, and when?"
//! ([`Ledger::processed_at`]) and "forget this id, so that its next delivery runs the
//! handler again" ([`Ledger::forget`]), for one consumer and one id at a time.
//!
//! One trait, [`LedgerBackend`], one file per backend (`ledger/<backend>.rs`): a lookup by
//! primary key that reads `processed_at` as microseconds since the Unix epoch computed
//! in SQL from the value the database's clock stored (of a processed row only: `state
//! IS NULL`), and a `DELETE` by primary key.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Database, Pool};

use crate::backend::Backend;
use crate::key::{InvalidMessageId, MessageKey};
use crate::names::{InvalidConsumer, check_consumer};
use crate::table::{DEFAULT_TABLE, InvalidTableName, Table};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The dedup table seen by an operator: whether a consumer has processed a message id,
/// and when ([`processed_at`](Ledger::processed_at)), and the deliberate removal of one
/// id's record for a replay ([`forget`](Ledger::forget)).
///
/// These are tools for a person (or a runbook) looking at one message, not for handlers:
/// a handler never needs to ask (`#[idempotent]` claims the id in the same transaction as
/// the work, which a lookup followed by the work could never do), and must never forget.
/// The `dedup` command's `dedup ids lookup|forget` is the same for an operator (crate
/// `dedup-cli`: `cargo install --path dedup-cli` in a clone).
///
/// ```
/// use dedup_runtime::{Ledger, LedgerError, Outcome, idempotent};
///
/// #[idempotent(consumer = "billing", key = id)]
/// async fn charge(tx: &mut sqlx::SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO charges (message_id) VALUES (?)")
///         .bind(id)
///         .execute(&mut *tx)
///         .await?;
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), LedgerError> {
/// // `sqlite::memory:` gives every connection its own database: one connection here.
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// dedup_runtime::migrate(&pool).await?;
/// sqlx::raw_sql("CREATE TABLE charges (message_id TEXT NOT NULL)").execute(&pool).await?;
/// let ledger = Ledger::new(&pool);
///
/// // Not processed yet.
/// assert_eq!(ledger.processed_at("billing", "evt_91c2").await?, None);
/// assert!(charge(&pool, "evt_91c2").await?.is_processed());
/// // Processed, at a time of the database's clock.
/// let at = ledger.processed_at("billing", "evt_91c2").await?.unwrap();
/// assert!(at > std::time::UNIX_EPOCH);
/// // Another consumer has not processed it; and ids compare byte for byte.
/// assert_eq!(ledger.processed_at("email-sender", "evt_91c2").await?, None);
/// assert_eq!(ledger.processed_at("billing", "EVT_91C2").await?, None);
/// # Ok(()) }
/// ```
///
/// # What a lookup sees
///
/// A lookup reads the committed rows of the table and takes no row lock: it never waits
/// for a handler's transaction, and one that has claimed the id and not committed yet is
/// not seen (the id reads as not processed until that commit). `None` means there is no
/// processed record: the id was never
/// processed by that consumer, or its record was pruned ([`Prune`](crate::Prune)) or
/// forgotten, or its handler used `unique = …` alone (which records no id).
/// A row that is not processed — its `state` is set: a mark or lease in progress, or an
/// outcome unknown — reads as `None` too: its `processed_at` is when the claim began, not
/// when the work was done, and a lookup must never call such a message processed. (A table
/// created by migration `0001` and not upgraded by [`migrate`](crate::migrate) yet lacks `state`: the lookup fails
/// with the database's unknown-column error.)
/// The time is `processed_at` as the database's clock wrote it (see
/// [`STAMP_AFTER`](crate::STAMP_AFTER) for what it measures), converted exactly, to the
/// microsecond (SQLite: the millisecond), whatever the session's time zone.
///
/// # Forgetting is the operator's replay
///
/// [`forget`](Ledger::forget) deletes the record of one id for one consumer, on its own
/// (committed at once, outside any transaction of yours). The **next delivery of that id
/// runs the handler's body again**: its effects happen a second time. It undoes nothing
/// the first run did. That is what an operator wants when the first run was wrong — a bug
/// fixed since, data repaired — and the message is to be replayed (moved back from a
/// dead-letter queue, republished, an offset reset). To forget every id of a consumer, or
/// every id older than an age, use [`Prune`](crate::Prune) (`.consumer("…")`), which
/// deletes in bounded batches.
#[derive(Debug)]
pub struct Ledger<DB: Database> {
    pool: Pool<DB>,
    table: Table,
}

// By hand: a derive would want `DB: Clone`.
impl<DB: Database> Clone for Ledger<DB> {
    fn clone(&self) -> Self {
        Ledger {
            pool: self.pool.clone(),
            table: self.table.clone(),
        }
    }
}

impl<DB: Backend> Ledger<DB> {
    /// The ledger of the default dedup table, [`DEFAULT_TABLE`] (`processed_messages`), on
    /// `pool` (a clone of it: the ledger owns its handle, and can move into a task).
    pub fn new(pool: &Pool<DB>) -> Ledger<DB> {
        Ledger {
            pool: pool.clone(),
            table: Table::new(DEFAULT_TABLE).expect("the default table name is valid"),
        }
    }

    /// The same ledger on the dedup table `table`, as in `#[idempotent(table = "…")]`: a
    /// plain SQL identifier, optionally schema-qualified, checked here. Anything else is
    /// refused before a statement is sent.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dedup_runtime::LedgerError> {
    /// # let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// use dedup_runtime::Ledger;
    ///
    /// let audit = Ledger::new(&pool).in_table("main.audit_processed")?;
    /// assert_eq!(audit.table().name(), "main.audit_processed");
    /// assert!(Ledger::new(&pool).in_table("t; DROP TABLE users").is_err());
    /// # Ok(()) }
    /// ```
    pub fn in_table(self, table: &str) -> Result<Ledger<DB>, InvalidTableName> {
        Ok(Ledger {
            table: Table::new(table)?,
            ..self
        })
    }

    /// The dedup table this ledger reads and deletes from.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// When `consumer` processed the message `id`, or `None` if the table has no record
    /// of it (never processed, pruned, forgotten, or in a transaction not committed yet)
    /// or only a record that is not processed (`state` set: in progress, outcome unknown).
    ///
    /// `id` is any [`MessageKey`] (`&str`, `String`, an integer, a `uuid::Uuid`), refused
    /// exactly as a handler refuses it ([`LedgerError::InvalidMessageId`]); `consumer` as
    /// `#[idempotent(consumer = "…")]` refuses it ([`LedgerError::InvalidConsumer`]).
    /// Ids and consumers compare byte for byte: `A` is not `a`, `a` is not `a `.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dedup_runtime::LedgerError> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
    /// #     .connect("sqlite::memory:").await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// use std::time::{Duration, UNIX_EPOCH};
    ///
    /// use dedup_runtime::{InvalidMessageId, Ledger, LedgerError};
    ///
    /// sqlx::raw_sql(
    ///     "INSERT INTO processed_messages (consumer, message_id, processed_at) \
    ///      VALUES ('billing', '42', '2001-09-09T01:46:40.123Z')",
    /// )
    /// .execute(&pool)
    /// .await?;
    /// let ledger = Ledger::new(&pool);
    /// let at = UNIX_EPOCH + Duration::from_millis(1_000_000_000_123);
    /// assert_eq!(ledger.processed_at("billing", 42).await?, Some(at)); // an integer key
    /// assert_eq!(ledger.processed_at("billing", "42").await?, Some(at)); // the same id
    ///
    /// let refused = ledger.processed_at("billing", "").await;
    /// assert!(matches!(refused, Err(LedgerError::InvalidMessageId(InvalidMessageId::Empty))));
    /// # Ok(()) }
    /// ```
    pub async fn processed_at(
        &self,
        consumer: &str,
        id: impl MessageKey,
    ) -> Result<Option<SystemTime>, LedgerError> {
        check_consumer(consumer)?;
        let key = id.message_id();
        let id = key.validate()?;
        let micros = DB::processed_at_micros(&self.pool, &self.table, consumer, id)
            .await
            .map_err(|error| self.classify(error))?;
        match micros {
            None => Ok(None),
            Some(Some(micros)) => Ok(Some(from_epoch_micros(micros))),
            // Only a row written by hand, whose `processed_at` the database cannot read
            // as a time (SQLite stores text).
            Some(None) => Err(LedgerError::Database(sqlx::Error::Decode(
                format!(
                    "the `processed_at` of message id {id:?} of consumer {consumer:?} in `{}` \
                     is not a time",
                    self.table.name()
                )
                .into(),
            ))),
        }
    }

    /// Deletes the record that `consumer` processed the message `id`, so that **the next
    /// delivery of that id runs the handler's body again**; `true` if there was a record.
    ///
    /// The operator's replay tool, never something a handler calls: it undoes none of the
    /// first run's effects, and it is committed at once, on a connection of the pool. Only
    /// that one row goes: the same id of other consumers, and every other id, stay. A row
    /// not processed (in progress, outcome unknown) goes too: its next delivery runs the
    /// handler again. `id`
    /// and `consumer` are refused as in [`processed_at`](Ledger::processed_at), before
    /// anything is deleted.
    ///
    /// While a handler's transaction holds the same id (claimed, not yet committed), the
    /// backends differ: PostgreSQL does not see the uncommitted row and returns `false`
    /// at once (the row commits afterwards, and stays); MySQL, MariaDB and SQLite wait for
    /// that transaction (its row lock, SQLite's write lock) and then delete the row it
    /// committed. Forget after the handler has returned.
    ///
    /// ```
    /// use dedup_runtime::{Ledger, Outcome, idempotent};
    ///
    /// #[idempotent(consumer = "billing", key = id)]
    /// async fn charge(tx: &mut sqlx::SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    ///     sqlx::query("INSERT INTO charges (message_id) VALUES (?)")
    ///         .bind(id)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dedup_runtime::LedgerError> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
    /// #     .connect("sqlite::memory:").await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// # sqlx::raw_sql("CREATE TABLE charges (message_id TEXT NOT NULL)").execute(&pool).await?;
    /// assert!(charge(&pool, "evt_91c2").await?.is_processed());
    /// assert!(charge(&pool, "evt_91c2").await?.is_duplicate()); // a redelivery: nothing runs
    ///
    /// // The charge was wrong and has been refunded: replay the message.
    /// let ledger = Ledger::new(&pool);
    /// assert!(ledger.forget("billing", "evt_91c2").await?);
    /// assert!(charge(&pool, "evt_91c2").await?.is_processed()); // the body ran again
    /// let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM charges")
    ///     .fetch_one(&pool)
    ///     .await?;
    /// assert_eq!(charges, 2);
    ///
    /// // Nothing to forget: `false`, nothing deleted.
    /// assert!(!ledger.forget("billing", "evt_unknown").await?);
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, consumer: &str, id: impl MessageKey) -> Result<bool, LedgerError> {
        check_consumer(consumer)?;
        let key = id.message_id();
        let id = key.validate()?;
        let forgotten = DB::forget(&self.pool, &self.table, consumer, id)
            .await
            .map_err(|error| self.classify(error))?;
        if forgotten {
            tracing::info!(
                table = self.table.name(),
                consumer,
                message_id = id,
                "message id forgotten: its next delivery runs the handler again"
            );
        }
        Ok(forgotten)
    }

    /// The ids of `consumer` that are not processed — leases and marks — oldest expiry
    /// first, at most `limit` of them: what an operator looks at after a crash.
    ///
    /// Each says what it waits for ([`Unresolved::status`]):
    /// [`OutcomeUnknown`](UnresolvedStatus::OutcomeUnknown) rows — a mark-first call whose
    /// owner never completed it: the effect may or may not have happened — wait for an
    /// operator: [`resolve`](Self::resolve) them once you know (from the provider's own
    /// records, say). Pruning never deletes any of these rows.
    ///
    /// ```
    /// use dedup_runtime::{Lease, LeaseOutcome, Ledger, Resolution, UnresolvedStatus, idempotent};
    ///
    /// /// The audit ping that must never repeat: at most once.
    /// #[idempotent(consumer = "audit", key = id, effect = "mark-first", lease = "30s")]
    /// async fn ping(lease: &mut Lease<'_, sqlx::Sqlite>, id: &str) -> Result<(), sqlx::Error> {
    ///     Ok(()) // the call to the auditor
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
    /// #     .connect("sqlite::memory:").await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// // A delivery marked `evt_7` and died before its call; its lease has ended.
    /// sqlx::raw_sql(
    ///     "INSERT INTO processed_messages (consumer, message_id, state, owner, expires_at) \
    ///      VALUES ('audit', 'evt_7', 2, x'00', '2001-01-01T00:00:00.000Z')",
    /// )
    /// .execute(&pool)
    /// .await?;
    /// // Its redelivery is acknowledged without a call: outcome unknown.
    /// assert!(ping(&pool, "evt_7").await?.is_duplicate());
    ///
    /// let ledger = Ledger::new(&pool);
    /// let stuck = ledger.unresolved("audit", 100).await?;
    /// assert_eq!(stuck.len(), 1);
    /// assert_eq!(stuck[0].message_id(), "evt_7");
    /// assert_eq!(stuck[0].status(), UnresolvedStatus::OutcomeUnknown);
    ///
    /// // The auditor never got it: run it again at the next delivery (a replay).
    /// assert!(ledger.resolve("audit", "evt_7", Resolution::Retry).await?);
    /// assert!(ping(&pool, "evt_7").await?.is_processed());
    /// assert!(ledger.unresolved("audit", 100).await?.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn unresolved(
        &self,
        consumer: &str,
        limit: u32,
    ) -> Result<Vec<Unresolved>, LedgerError> {
        check_consumer(consumer)?;
        let rows = DB::unresolved(&self.pool, &self.table, consumer, i64::from(limit))
            .await
            .map_err(|error| self.classify(error))?;
        Ok(rows
            .into_iter()
            .map(|(id, state, remaining_us)| {
                let remaining = Duration::from_micros(u64::try_from(remaining_us).unwrap_or(0));
                let status = match state {
                    _ if !remaining.is_zero() => UnresolvedStatus::InProgress { remaining },
                    2 => UnresolvedStatus::OutcomeUnknown,
                    _ => UnresolvedStatus::LeaseExpired,
                };
                Unresolved {
                    message_id: String::from_utf8_lossy(&id).into_owned(),
                    status,
                }
            })
            .collect())
    }

    /// Resolves a row that is not processed and whose lease has ended — above all an
    /// outcome unknown — the way an operator decided: [`Resolution::Done`] records the
    /// message as processed (the effect did happen), [`Resolution::Retry`] deletes the row,
    /// so that the next delivery (or a replay) runs the handler again (it did not).
    /// `true` when a row was resolved; `false` when there was none to resolve: no row, a
    /// processed one, or a lease still running (its owner is at work: leave it).
    pub async fn resolve(
        &self,
        consumer: &str,
        id: impl MessageKey,
        resolution: Resolution,
    ) -> Result<bool, LedgerError> {
        // Checked before a connection is taken.
        check_consumer(consumer)?;
        let key = id.message_id();
        let id = key.validate()?;
        let mut conn = self.pool.acquire().await.map_err(LedgerError::Database)?;
        self.resolve_on(&mut conn, consumer, id, resolution).await
    }

    /// [`resolve`](Self::resolve) on `conn`, inside its transaction if it is in one: the
    /// resolution commits with the rest of your work (the `dedup` command records the
    /// operator's request id beside it, so that a retried request resolves once).
    pub async fn resolve_on(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        id: impl MessageKey,
        resolution: Resolution,
    ) -> Result<bool, LedgerError> {
        check_consumer(consumer)?;
        let key = id.message_id();
        let id = key.validate()?;
        let done = resolution == Resolution::Done;
        let resolved = DB::resolve(conn, &self.table, consumer, id, done)
            .await
            .map_err(|error| self.classify(error))?;
        if resolved {
            tracing::info!(
                table = self.table.name(),
                consumer,
                message_id = id,
                ?resolution,
                "unresolved message id resolved by an operator"
            );
        }
        Ok(resolved)
    }

    fn classify(&self, error: sqlx::Error) -> LedgerError {
        if DB::is_missing_table(&error, &self.table) {
            LedgerError::MissingTable {
                table: self.table.clone(),
                error,
            }
        } else {
            LedgerError::Database(error)
        }
    }
}

/// Microseconds since the Unix epoch (negative before it) as a `SystemTime`.
fn from_epoch_micros(micros: i64) -> SystemTime {
    let offset = Duration::from_micros(micros.unsigned_abs());
    let time = if micros >= 0 {
        UNIX_EPOCH.checked_add(offset)
    } else {
        UNIX_EPOCH.checked_sub(offset)
    };
    // Every platform's `SystemTime` spans the ±292,000 years an `i64` of microseconds can.
    time.unwrap_or(UNIX_EPOCH)
}

/// Why a [`Ledger`] lookup or forget failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LedgerError {
    /// The message id is one no handler accepts (empty, over
    /// [`MAX_MESSAGE_ID_LEN`](crate::MAX_MESSAGE_ID_LEN) bytes, containing NUL). Nothing
    /// was read or deleted.
    InvalidMessageId(InvalidMessageId),
    /// The consumer name is one no handler can have (empty, over [`MAX_CONSUMER_LEN`](crate::MAX_CONSUMER_LEN)
    /// bytes, containing NUL). Nothing was read or deleted.
    InvalidConsumer(InvalidConsumer),
    /// The table name is not a plain SQL identifier (from [`Ledger::in_table`], for
    /// `?` in a function that returns `LedgerError`).
    InvalidTable(InvalidTableName),
    /// The dedup table does not exist: not migrated yet ([`migrate`](crate::migrate),
    /// [`migrate_table`](crate::migrate_table)), a name other than the handlers' `table =
    /// "…"`, or another schema / database than the connection's. Told apart by the
    /// database's code: PostgreSQL `42P01`, MySQL and MariaDB 1146; SQLite's
    /// `SQLITE_ERROR` with its fixed, untranslated `no such table: …` message.
    MissingTable {
        /// The table asked for.
        table: Table,
        /// The database's error.
        error: sqlx::Error,
    },
    /// Any other database failure. A forget that failed deleted nothing.
    Database(sqlx::Error),
}

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerError::InvalidMessageId(error) => error.fmt(f),
            LedgerError::InvalidConsumer(error) => error.fmt(f),
            LedgerError::InvalidTable(error) => error.fmt(f),
            LedgerError::MissingTable { table, .. } => write!(
                f,
                "the dedup table `{}` does not exist: create it with `migrate` or \
                 `migrate_table`, or name the table of the handlers' `table = \"…\"`",
                table.name()
            ),
            LedgerError::Database(error) => {
                write!(f, "reading or deleting a message id failed: {error}")
            }
        }
    }
}

impl StdError for LedgerError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LedgerError::InvalidMessageId(error) => Some(error),
            LedgerError::InvalidConsumer(error) => Some(error),
            LedgerError::InvalidTable(error) => Some(error),
            LedgerError::MissingTable { error, .. } => Some(error),
            LedgerError::Database(error) => Some(error),
        }
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(error: sqlx::Error) -> Self {
        LedgerError::Database(error)
    }
}

impl From<InvalidMessageId> for LedgerError {
    fn from(error: InvalidMessageId) -> Self {
        LedgerError::InvalidMessageId(error)
    }
}

impl From<InvalidConsumer> for LedgerError {
    fn from(error: InvalidConsumer) -> Self {
        LedgerError::InvalidConsumer(error)
    }
}

impl From<InvalidTableName> for LedgerError {
    fn from(error: InvalidTableName) -> Self {
        LedgerError::InvalidTable(error)
    }
}

/// A dedup row that is not processed, as [`Ledger::unresolved`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    message_id: String,
    status: UnresolvedStatus,
}

impl Unresolved {
    /// The message id (bytes that are not UTF-8 shown as `U+FFFD`).
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// What the row waits for.
    pub fn status(&self) -> UnresolvedStatus {
        self.status
    }
}

/// What an unresolved row waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnresolvedStatus {
    /// Its owner's lease has `remaining` left (on the database's clock): a call is running.
    InProgress {
        /// The lease's time left.
        remaining: Duration,
    },
    /// A send-first lease whose owner stopped without completing it: the next delivery
    /// takes it over and calls again.
    LeaseExpired,
    /// A mark-first mark whose owner never completed its call: the effect may or may not
    /// have happened, and nothing calls again. An operator resolves it
    /// ([`Ledger::resolve`]).
    OutcomeUnknown,
}

/// An operator's decision about an unresolved row ([`Ledger::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resolution {
    /// The effect happened: record the message as processed (its redeliveries are
    /// duplicates).
    Done,
    /// The effect did not happen: delete the row, so that the next delivery of the message
    /// (or a replay) runs the handler again.
    Retry,
}

/// How one backend looks up and deletes one dedup row. Part of [`Backend`].
pub trait LedgerBackend: Database {
    /// `Some` when the row `(consumer, id)` exists and is processed (`state IS NULL`),
    /// with its `processed_at` in
    /// microseconds since the Unix epoch, computed by the database (`None` inside when
    /// it cannot read the value as a time).
    #[doc(hidden)]
    fn processed_at_micros<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> impl Future<Output = Result<Option<Option<i64>>, sqlx::Error>> + Send + 'a;

    /// Deletes the row `(consumer, id)`; whether there was one.
    #[doc(hidden)]
    fn forget<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The rows of `consumer` whose `state` is set: id, state, microseconds left on
    /// the lease (0 once expired), oldest expiry first.
    #[doc(hidden)]
    fn unresolved<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: &'a str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Vec<u8>, i64, i64)>, sqlx::Error>> + Send + 'a;

    /// Marks processed (`done`) or deletes the row `(consumer, id)` if its `state` is set
    /// and its lease has ended; whether it did.
    #[doc(hidden)]
    fn resolve<'a>(
        conn: &'a mut Self::Connection,
        table: &'a Table,
        consumer: &'a str,
        id: &'a str,
        done: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_micros() {
        assert_eq!(from_epoch_micros(0), UNIX_EPOCH);
        assert_eq!(
            from_epoch_micros(1_000_000_000_123_456),
            UNIX_EPOCH + Duration::from_micros(1_000_000_000_123_456)
        );
        assert_eq!(
            from_epoch_micros(-14_182_939_500_000),
            UNIX_EPOCH - Duration::from_micros(14_182_939_500_000)
        );
    }
}
