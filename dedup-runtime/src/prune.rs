//! Pruning: deleting processed ids once the broker can no longer redeliver them.
//!
//! A processed id must outlive every copy of its message. [`Prune`] therefore takes the
//! broker's redelivery window as well as the age to prune at, and refuses an age shorter
//! than the window before it touches the database. It deletes in short, bounded batches
//! (one transaction each) and rests between them, so that consumers keep claiming ids
//! while it runs.
//!
//! The cutoff is read once from the database server's clock, in SQL, and the same
//! predicate guards every `DELETE`; what each backend writes is in `prune/<backend>.rs`.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::{Database, Pool};

use crate::backend::Backend;
use crate::retry;
use crate::table::{DEFAULT_TABLE, InvalidTableName, Table};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// How many rows one batch of [`Prune::run`] deletes unless told otherwise
/// ([`Prune::batch_size`]): small enough that each transaction takes milliseconds.
pub const DEFAULT_PRUNE_BATCH: u32 = 2_000;

/// The largest batch [`Prune::batch_size`] accepts: beyond it a batch holds its locks (and,
/// on SQLite, the database's write lock) long enough for consumers to notice.
pub const MAX_PRUNE_BATCH: u32 = 50_000;

/// Unless told otherwise, a run rests after each batch this many times as long as the
/// batch took. Measured with four consumers on a 2-core machine: pruning flat out cut
/// their rate by half on PostgreSQL and MariaDB and to 3 % on SQLite (whose waiting
/// writers poll for the lock and lose it to a pruner that never lets go); resting as long
/// as each batch took left them 70–90 % of it, and still pruned 200,000 ids in 2 to 8 s.
const REST_FACTOR: u32 = 1;

/// The largest age [`Prune`] accepts (about 1,000 years): every backend can subtract it
/// from its clock. Nothing is that old.
pub const MAX_PRUNE_AGE: Duration = Duration::from_secs(1_000 * 365 * 24 * 60 * 60);

/// Deletes processed ids older than an age, in bounded batches, never earlier than the
/// broker's redelivery window allows.
///
/// Build it with [`Prune::new`], narrow it to one consumer or another table if needed,
/// then [`run`](Prune::run) it (or look first with [`stats`](Prune::stats)).
///
/// ```
/// use std::time::Duration;
///
/// use dedup_runtime::{Prune, PruneError};
///
/// const DAY: Duration = Duration::from_secs(24 * 60 * 60);
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), PruneError> {
/// // `sqlite::memory:` gives every connection its own database: one connection here.
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// dedup_runtime::migrate(&pool).await?;
///
/// // The broker redelivers for up to 2 days: keep a week of ids.
/// let done = Prune::new(7 * DAY, 2 * DAY)
///     .run(&pool, |progress| {
///         eprintln!("{} ids deleted, {:.0}/s", progress.deleted, progress.rate());
///     })
///     .await?;
/// assert_eq!(done.deleted, 0);
///
/// // Pruning at 1 day would delete ids the broker may still redeliver: refused.
/// let refused = Prune::new(DAY, 2 * DAY).run(&pool, |_| {}).await;
/// assert!(matches!(refused, Err(PruneError::WindowTooShort { .. })));
/// # Ok(()) }
/// ```
///
/// # What it runs
///
/// First the cutoff, on the server's clock (`now() - age` on PostgreSQL,
/// `UTC_TIMESTAMP(6) - INTERVAL … MICROSECOND` on MySQL and MariaDB, `strftime(…, 'now',
/// '-N seconds')` on SQLite), where the age is `older_than` plus
/// [`STAMP_AFTER`](crate::STAMP_AFTER): a `processed_at` lies at most that much before its
/// transaction's commit, from which the redelivery window counts. It is read once: ids that age past it while the run goes on are left
/// for the next run, so a run always ends. Then batches until one deletes fewer rows than
/// the batch size, each its own short transaction that deletes the oldest ids below the
/// cutoff through the `processed_at` index:
///
/// - PostgreSQL: `DELETE … WHERE ctid = ANY(ARRAY(SELECT ctid … ORDER BY processed_at
///   LIMIT n)) AND processed_at < cutoff`, in a transaction told to walk the index in
///   order (`SET LOCAL enable_sort = off`) whatever the table's statistics say.
/// - MySQL / MariaDB: `DELETE … JOIN (SELECT consumer, message_id … IGNORE INDEX (PRIMARY)
///   WHERE processed_at < cutoff ORDER BY processed_at LIMIT n)`, at `READ COMMITTED` so
///   that no gap lock blocks a consumer's insert.
/// - SQLite: `DELETE … WHERE (consumer, message_id) IN (SELECT … LIMIT n)`, after `BEGIN
///   IMMEDIATE`; the write lock is held for one batch only.
///
/// After each batch the run rests as long as the batch took (see
/// [`pause`](Prune::pause)), so that consumers keep their speed. A deadlock, lock
/// timeout or `SQLITE_BUSY` runs the batch again (up to
/// [`MAX_ATTEMPTS`](crate::MAX_ATTEMPTS) times, with backoff). Dropping the future
/// cancels the run between or inside a batch: a batch commits whole or not at all.
///
/// # Rows not processed are kept
///
/// A row whose `state` is set is not a processed id: a mark or lease in progress (held by
/// its `owner` until `expires_at`), or an outcome unknown that waits for an operator.
/// Every `DELETE` above also requires `state IS NULL`, so such a row survives every run,
/// whatever its age and whatever the cutoff: deleting an unexpired lease would let a
/// second copy run while the first still works, and deleting an unknown row would hide a
/// lost effect. [`ConsumerStats::unresolved`] counts them. Plain handlers never write
/// `state`: for them nothing changes. A table created by migration `0001` that
/// [`migrate`] has not upgraded yet lacks the column, and the run fails with the database's
/// unknown-column error, deleting nothing: run [`migrate`] first.
///
/// [`migrate`]: crate::migrate
///
/// # Clocks and formats
///
/// The cutoff and `processed_at` come from the same clock: the server's (PostgreSQL,
/// MySQL, MariaDB) or the machine's (SQLite), and no session setting shifts one against
/// the other:
///
/// - PostgreSQL: `processed_at` is a `timestamptz`, an instant. The cutoff is read back
///   as ISO 8601 text in UTC, which every session parses as the same instant, whatever
///   its `DateStyle` and `TimeZone` (application code may change them on pooled
///   sessions).
/// - MySQL / MariaDB: `processed_at` is a `DATETIME(6)` in UTC (the claim writes
///   `UTC_TIMESTAMP(6)`), and pruning reads `UTC_TIMESTAMP(6)`, never `NOW(6)`: the
///   sessions' `time_zone` plays no part. Rows you insert yourself must be in UTC.
/// - SQLite: the comparison is on the text `strftime('%Y-%m-%dT%H:%M:%fZ')` that the
///   column's default writes (UTC); rows you insert yourself must use that format.
#[derive(Debug, Clone)]
pub struct Prune {
    pub(crate) older_than: Duration,
    redelivery_window: Duration,
    consumer: Option<String>,
    table: String,
    pub(crate) batch_size: u32,
    pause: Option<Duration>,
}

impl Prune {
    /// Prunes ids processed more than `older_than` ago, for a broker that may deliver a
    /// message again up to `redelivery_window` after it was processed.
    ///
    /// Nothing is checked yet: [`run`](Prune::run) and [`stats`](Prune::stats) refuse an
    /// `older_than` shorter than `redelivery_window` with
    /// [`PruneError::WindowTooShort`] ([`check`](Prune::check) asks without a database).
    /// The guide's ["Sizing the redelivery window"][sizing] says how to size it for
    /// RabbitMQ, NATS JetStream, Redis Streams, MQTT, Kafka and SQS.
    ///
    /// [sizing]: https://github.com/dedup-rs/dedup/blob/main/guide/src/operating.md#sizing-the-redelivery-window
    ///
    /// ```
    /// # use std::time::Duration;
    /// let hour = Duration::from_secs(3600);
    /// let prune = dedup_runtime::Prune::new(72 * hour, 48 * hour)
    ///     .consumer("billing")
    ///     .in_table("audit.processed_messages")?
    ///     .batch_size(5_000)
    ///     .pause(Duration::from_millis(20));
    /// assert!(prune.check().is_ok());
    /// # Ok::<(), dedup_runtime::InvalidTableName>(())
    /// ```
    pub fn new(older_than: Duration, redelivery_window: Duration) -> Prune {
        Prune {
            older_than,
            redelivery_window,
            consumer: None,
            table: DEFAULT_TABLE.to_owned(),
            batch_size: DEFAULT_PRUNE_BATCH,
            pause: None,
        }
    }

    /// Prunes only the ids of this consumer (the `consumer = "…"` of its handlers);
    /// without it, every consumer's.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let prune = dedup_runtime::Prune::new(week, week).consumer("email-sender");
    /// # drop(prune);
    /// ```
    pub fn consumer(mut self, consumer: impl Into<String>) -> Prune {
        self.consumer = Some(consumer.into());
        self
    }

    /// Prunes the dedup table `table`, as in `#[idempotent(table = "…")]`, instead of
    /// `processed_messages`; the name is checked here, as every type of this crate checks
    /// a table name where it is given.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let prune = dedup_runtime::Prune::new(week, week).in_table("audit.processed_messages")?;
    /// assert!(prune.check().is_ok());
    /// assert!(dedup_runtime::Prune::new(week, week).in_table("t; DROP TABLE users").is_err());
    /// # Ok::<(), dedup_runtime::InvalidTableName>(())
    /// ```
    pub fn in_table(mut self, table: &str) -> Result<Prune, InvalidTableName> {
        self.table = Table::new(table)?.name().to_owned();
        Ok(self)
    }

    /// Rows per batch (transaction): 1 to [`MAX_PRUNE_BATCH`], [`DEFAULT_PRUNE_BATCH`]
    /// by default. Anything else is refused with [`PruneError::InvalidBatchSize`].
    ///
    /// ```
    /// # use std::time::Duration;
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let prune = dedup_runtime::Prune::new(week, week).batch_size(0);
    /// assert!(matches!(prune.check(), Err(dedup_runtime::PruneError::InvalidBatchSize { .. })));
    /// ```
    pub fn batch_size(mut self, rows: u32) -> Prune {
        self.batch_size = rows;
        self
    }

    /// Sleeps this long between batches, instead of the default rest.
    ///
    /// By default a run rests after each batch as long as the batch took (waiting for
    /// locks included): it takes at most about half of one connection's time, and slows
    /// down by itself when consumers keep the database busy, so they keep their speed.
    /// `pause(Duration::ZERO)` prunes flat out, for a maintenance window; a longer pause
    /// is gentler still.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let gentle = dedup_runtime::Prune::new(week, week).pause(Duration::from_millis(50));
    /// # drop(gentle);
    /// ```
    pub fn pause(mut self, pause: Duration) -> Prune {
        self.pause = Some(pause);
        self
    }

    /// Whether [`run`](Prune::run) would accept these settings: the checks it makes
    /// before it touches the database.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use dedup_runtime::{Prune, PruneError};
    ///
    /// let hour = Duration::from_secs(3600);
    /// assert!(Prune::new(48 * hour, 48 * hour).check().is_ok());
    /// match Prune::new(hour, 48 * hour).check() {
    ///     Err(PruneError::WindowTooShort { older_than, redelivery_window }) => {
    ///         assert_eq!((older_than, redelivery_window), (hour, 48 * hour));
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// ```
    pub fn check(&self) -> Result<(), PruneError> {
        self.validate().map(drop)
    }

    /// How far back the cutoff lies: the age, plus [`STAMP_AFTER`](crate::STAMP_AFTER),
    /// the most a `processed_at` may lie before its transaction's commit.
    pub(crate) fn cutoff_age(&self) -> Duration {
        self.older_than.saturating_add(crate::STAMP_AFTER)
    }

    pub(crate) fn validate(&self) -> Result<Table, PruneError> {
        if self.older_than < self.redelivery_window {
            return Err(PruneError::WindowTooShort {
                older_than: self.older_than,
                redelivery_window: self.redelivery_window,
            });
        }
        if self.older_than > MAX_PRUNE_AGE {
            return Err(PruneError::AgeTooLarge {
                age: self.older_than,
                max: MAX_PRUNE_AGE,
            });
        }
        if self.batch_size == 0 || self.batch_size > MAX_PRUNE_BATCH {
            return Err(PruneError::InvalidBatchSize {
                size: self.batch_size,
                max: MAX_PRUNE_BATCH,
            });
        }
        Ok(Table::new(&self.table)?)
    }

    /// Deletes the ids older than the age, batch by batch, calling `progress` after each
    /// batch; returns the last progress (`done` is `true`).
    ///
    /// Refuses, before anything runs, an age shorter than the redelivery window, an age
    /// over [`MAX_PRUNE_AGE`] or an invalid batch size. Never deletes an id
    /// younger than the age on the database's clock. See [`Prune`] for the SQL.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dedup_runtime::PruneError> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new()
    /// #     .max_connections(1)
    /// #     .connect("sqlite::memory:")
    /// #     .await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// let day = Duration::from_secs(24 * 3600);
    /// // Three ids processed 10 days ago, one just now.
    /// sqlx::raw_sql(
    ///     "INSERT INTO processed_messages (consumer, message_id, processed_at) VALUES \
    ///      ('billing', 'a', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days')), \
    ///      ('billing', 'b', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days')), \
    ///      ('billing', 'c', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days')), \
    ///      ('billing', 'd', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))",
    /// )
    /// .execute(&pool)
    /// .await?;
    ///
    /// let mut seen = Vec::new();
    /// let done = dedup_runtime::Prune::new(7 * day, 2 * day)
    ///     .consumer("billing")
    ///     .batch_size(2)
    ///     .run(&pool, |progress| seen.push(progress.deleted))
    ///     .await?;
    /// assert_eq!(done.deleted, 3);
    /// assert_eq!(seen, [2, 3]); // two batches
    /// assert!(done.done);
    /// # Ok(()) }
    /// ```
    ///
    /// The future is `Send` whenever `progress` is, as are those of
    /// [`run_inbox`](Prune::run_inbox) and [`run_outbox`](Prune::run_outbox): a service
    /// prunes in a task of its own, beside its consumers.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new()
    /// #     .max_connections(1)
    /// #     .connect("sqlite::memory:")
    /// #     .await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// let day = Duration::from_secs(24 * 3600);
    /// let prune = dedup_runtime::Prune::new(7 * day, 2 * day);
    /// let pruning = tokio::spawn(async move { prune.run(&pool, |_| {}).await });
    /// assert!(pruning.await??.done);
    /// # Ok(()) }
    /// ```
    pub async fn run<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        progress: impl FnMut(&PruneProgress),
    ) -> Result<PruneProgress, PruneError> {
        let table = self.validate()?;
        let cutoff = DB::cutoff(pool, self.cutoff_age()).await?;
        let ids = ProcessedIds {
            pool,
            table: &table,
            consumer: self.consumer.as_deref(),
            limit: self.batch_size,
            after: None,
        };
        self.batches(cutoff, progress, ids).await
    }

    /// The loop of every run: `rows` batch by batch until one deletes fewer than the
    /// batch size, a rest after each ([`pause`](Prune::pause), or as long as the batch
    /// took), and the progress after each.
    pub(crate) async fn batches(
        &self,
        cutoff: String,
        mut progress: impl FnMut(&PruneProgress),
        mut rows: impl PrunedRows,
    ) -> Result<PruneProgress, PruneError> {
        let started = Instant::now();
        let mut state = PruneProgress {
            deleted: 0,
            last_batch: 0,
            batches: 0,
            elapsed: Duration::ZERO,
            done: false,
            cutoff,
        };
        loop {
            let batch_started = Instant::now();
            let deleted = rows.delete_batch(&state.cutoff).await?;
            let batch_time = batch_started.elapsed();
            state.deleted += deleted;
            state.last_batch = deleted;
            state.batches += 1;
            state.elapsed = started.elapsed();
            state.done = deleted < u64::from(self.batch_size);
            progress(&state);
            if state.done {
                return Ok(state);
            }
            let rest = match self.pause {
                Some(pause) => pause,
                None => batch_time.saturating_mul(REST_FACTOR),
            };
            if !rest.is_zero() {
                tokio::time::sleep(rest).await;
            }
        }
    }

    /// Per consumer (only this prune's consumer, if one is set): how many ids the table
    /// holds, how many a run would delete now, how many are not processed (kept at any
    /// age), and how old the oldest ones are.
    ///
    /// Refuses the same settings as [`run`](Prune::run) does. It reads the whole table
    /// (one grouped scan), so on a large table it takes a while; it deletes nothing,
    /// which makes it the dry run.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dedup_runtime::PruneError> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new()
    /// #     .max_connections(1)
    /// #     .connect("sqlite::memory:")
    /// #     .await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// sqlx::raw_sql(
    ///     "INSERT INTO processed_messages (consumer, message_id, processed_at) VALUES \
    ///      ('billing', 'a', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days')), \
    ///      ('billing', 'b', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 hour'))",
    /// )
    /// .execute(&pool)
    /// .await?;
    ///
    /// let day = Duration::from_secs(24 * 3600);
    /// let stats = dedup_runtime::Prune::new(7 * day, 2 * day).stats(&pool).await?;
    /// assert_eq!(stats.len(), 1);
    /// let billing = &stats[0];
    /// assert_eq!((billing.consumer.as_str(), billing.ids, billing.prunable), ("billing", 2, 1));
    /// assert_eq!(billing.kept(), 1);
    /// assert!(billing.oldest > 9 * day);
    /// assert!(billing.oldest_kept.unwrap() < day);
    /// # Ok(()) }
    /// ```
    pub async fn stats<DB: Backend>(
        &self,
        pool: &Pool<DB>,
    ) -> Result<Vec<ConsumerStats>, PruneError> {
        let table = self.validate()?;
        let cutoff = DB::cutoff(pool, self.cutoff_age()).await?;
        DB::stats(pool, &table, self.consumer.as_deref(), &cutoff)
            .await
            .map_err(|error| PruneError::from_database::<DB>(&table, error))
    }
}

/// The rows a run deletes, one batch at a time: the dedup table's processed ids
/// ([`ProcessedIds`]), an inbox's processed rows (`inbox.rs`), an outbox's sent rows
/// (`outbox.rs`). [`Prune::batches`] drives any of them.
///
/// Why a trait and not an `AsyncFnMut(&str) -> Result<u64, PruneError>` closure, which the
/// loop once took: the future of such a closure borrows the closure, its captures and its
/// argument for lifetimes the loop picks at each call, and rustc cannot prove it `Send`
/// for every one of them ("implementation of `Send` is not general enough"), so no prune
/// could be `tokio::spawn`ed (`tests/regressions/prunes_could_not_be_spawned.rs`). The
/// future of a method on a struct that holds the run's borrows it can; and declared
/// `Send` here, it is checked at each impl, not first at a service's `tokio::spawn`.
pub(crate) trait PrunedRows: Send {
    /// Deletes one batch of at most the batch size, in one short transaction, transient
    /// failures tried again; how many rows it deleted. `cutoff` is the run's, read when
    /// it began.
    fn delete_batch(
        &mut self,
        cutoff: &str,
    ) -> impl Future<Output = Result<u64, PruneError>> + Send;
}

/// The dedup table's processed ids older than the cutoff, only `consumer`'s if set.
struct ProcessedIds<'a, DB: Database> {
    pool: &'a Pool<DB>,
    table: &'a Table,
    consumer: Option<&'a str>,
    limit: u32,
    /// The oldest `processed_at` a batch may find: where the last one stopped. Without it
    /// each batch would walk the index again past the rows it must skip (other
    /// consumers' old ids, or deleted entries not yet purged).
    after: Option<String>,
}

impl<DB: Backend> PrunedRows for ProcessedIds<'_, DB> {
    async fn delete_batch(&mut self, cutoff: &str) -> Result<u64, PruneError> {
        let (pool, table, consumer, limit) = (self.pool, self.table, self.consumer, self.limit);
        let after = self.after.as_deref();
        let (deleted, last) = retry::retry_transient::<DB, _, _>(|| {
            DB::delete_batch(pool, table, consumer, cutoff, after, limit)
        })
        .await
        .map_err(|error| PruneError::from_database::<DB>(table, error))?;
        if last.is_some() {
            self.after = last;
        }
        Ok(deleted)
    }
}

/// Where a [`Prune::run`] stands, passed to its progress callback after every batch.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), dedup_runtime::PruneError> {
/// use std::time::Duration;
///
/// let week = Duration::from_secs(7 * 24 * 3600);
/// let done = dedup_runtime::Prune::new(week, week)
///     .run(&pool, |progress| {
///         eprintln!(
///             "{} ids deleted in {} batches, {:.0}/s, up to {}",
///             progress.deleted,
///             progress.batches,
///             progress.rate(),
///             progress.cutoff,
///         );
///     })
///     .await?;
/// assert!(done.done);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PruneProgress {
    /// Rows deleted so far.
    pub deleted: u64,
    /// Rows deleted by the last batch.
    pub last_batch: u64,
    /// Batches (transactions) run so far.
    pub batches: u64,
    /// Time since the first batch began.
    pub elapsed: Duration,
    /// Whether this was the last batch.
    pub done: bool,
    /// The cutoff in UTC, as the database printed it: ids processed before it are
    /// deleted. Its format is fixed per backend, whatever the session's settings:
    /// PostgreSQL `2026-11-12T07:35:19.681609Z` (ISO 8601, microseconds), MySQL and
    /// MariaDB `2026-11-12 07:35:19.681609` (a `DATETIME(6)`'s text, in UTC), SQLite
    /// `2026-11-12T07:35:19.681Z` (the column's own format, milliseconds).
    pub cutoff: String,
}

impl PruneProgress {
    /// Rows deleted per second so far.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dedup_runtime::PruneError> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
    /// #     .connect("sqlite::memory:").await?;
    /// # dedup_runtime::migrate(&pool).await?;
    /// # let week = Duration::from_secs(7 * 24 * 3600);
    /// let done = dedup_runtime::Prune::new(week, week).run(&pool, |_| {}).await?;
    /// assert_eq!(done.rate(), 0.0); // nothing to delete
    /// # Ok(()) }
    /// ```
    pub fn rate(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.deleted as f64 / seconds
        } else {
            0.0
        }
    }
}

/// One consumer's ids in the dedup table, from [`Prune::stats`]. Ages are measured on the
/// database's clock.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), dedup_runtime::PruneError> {
/// use std::time::Duration;
///
/// let day = Duration::from_secs(24 * 3600);
/// for consumer in dedup_runtime::Prune::new(7 * day, 4 * day).stats(&pool).await? {
///     println!(
///         "{}: {} ids, {} to delete, {} to keep, the oldest {:?} old",
///         consumer.consumer,
///         consumer.ids,
///         consumer.prunable,
///         consumer.kept(),
///         consumer.oldest,
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The consumer, as in `#[idempotent(consumer = "…")]`.
    pub consumer: String,
    /// Ids the table holds for it.
    pub ids: u64,
    /// Of those, how many are processed and older than the prune's age: what a run would
    /// delete now.
    pub prunable: u64,
    /// Age of its oldest id.
    pub oldest: Duration,
    /// Age of its oldest id that a run would keep; `None` when it would delete them all.
    pub oldest_kept: Option<Duration>,
    /// Of its ids, how many are not processed (`state` set: in progress, or outcome
    /// unknown): a run keeps them whatever their age. Counted in [`kept`](Self::kept).
    pub unresolved: u64,
}

impl ConsumerStats {
    /// Ids a run would keep: `ids - prunable`.
    ///
    /// See [`Prune::stats`] for an example.
    pub fn kept(&self) -> u64 {
        self.ids.saturating_sub(self.prunable)
    }
}

/// Why [`Prune`] refused to run or stopped.
///
/// ```
/// use std::time::Duration;
///
/// use dedup_runtime::{Prune, PruneError};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// let day = Duration::from_secs(24 * 3600);
///
/// // Refused before anything runs: the broker may redeliver for 4 days.
/// let early = Prune::new(day, 4 * day).run(&pool, |_| {}).await;
/// assert!(matches!(early, Err(PruneError::WindowTooShort { .. })));
///
/// // Nobody ran `migrate` on this database: the dry run says so.
/// match Prune::new(7 * day, 4 * day).stats(&pool).await {
///     Err(error @ PruneError::MissingTable { .. }) => {
///         assert!(error.to_string().starts_with(
///             "the dedup table `processed_messages` does not exist in this database"
///         ));
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum PruneError {
    /// The age is shorter than the broker's redelivery window: pruning would delete ids
    /// of messages that can still arrive again, and a redelivery would run twice.
    /// Nothing was deleted.
    WindowTooShort {
        /// The age asked for.
        older_than: Duration,
        /// The redelivery window declared.
        redelivery_window: Duration,
    },
    /// The age is over [`MAX_PRUNE_AGE`]. Nothing was deleted.
    AgeTooLarge {
        /// The age asked for.
        age: Duration,
        /// The largest accepted.
        max: Duration,
    },
    /// The table name is not a plain SQL identifier (from [`Prune::in_table`], for `?` in
    /// a function that returns `PruneError`). Nothing was deleted.
    InvalidTable(InvalidTableName),
    /// The batch size is 0 or over the maximum. Nothing was deleted.
    InvalidBatchSize {
        /// The size asked for.
        size: u32,
        /// The largest accepted.
        max: u32,
    },
    /// The dedup table does not exist in the pool's database (or schema): nothing was
    /// deleted. Create it with [`migrate`](crate::migrate) (or
    /// [`migrate_table`](crate::migrate_table) for a `table = "…"` of your own), or point
    /// the prune at the database and table your consumers write. Recognised by code:
    /// PostgreSQL `42P01`, MySQL/MariaDB 1146, SQLite's `SQLITE_ERROR` with its fixed
    /// `no such table: <name>` for this table's name.
    MissingTable {
        /// The table, as given to [`Prune::in_table`] (`processed_messages` by default).
        table: Table,
        /// The database's error.
        error: sqlx::Error,
    },
    /// The database failed. The batches before the failing one are committed; the
    /// failing one is not.
    Database(sqlx::Error),
}

impl PruneError {
    /// `error` from a statement on `table`: [`PruneError::MissingTable`] when it says
    /// that the table does not exist.
    pub(crate) fn from_database<DB: Backend>(table: &Table, error: sqlx::Error) -> PruneError {
        if DB::is_missing_table(&error, table) {
            PruneError::MissingTable {
                table: table.clone(),
                error,
            }
        } else {
            PruneError::Database(error)
        }
    }
}

impl fmt::Display for PruneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PruneError::WindowTooShort {
                older_than,
                redelivery_window,
            } => write!(
                f,
                "refusing to prune ids younger than the redelivery window: older than \
                 {older_than:?} is shorter than the declared window of {redelivery_window:?}, \
                 so a redelivered message could be processed twice"
            ),
            PruneError::AgeTooLarge { age, max } => {
                write!(f, "prune age {age:?} is over the maximum of {max:?}")
            }
            PruneError::InvalidTable(error) => error.fmt(f),
            PruneError::InvalidBatchSize { size, max } => {
                write!(f, "prune batch size {size} is not between 1 and {max}")
            }
            PruneError::MissingTable { table, .. } => write!(
                f,
                "the dedup table `{table}` does not exist in this database: create it with \
                 `dedup_runtime::migrate` (`migrate_table` for a `table = \"…\"` of your own), \
                 or prune the database and table your consumers write"
            ),
            PruneError::Database(error) => write!(f, "pruning failed: {error}"),
        }
    }
}

impl StdError for PruneError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            PruneError::InvalidTable(error) => Some(error),
            PruneError::MissingTable { error, .. } | PruneError::Database(error) => Some(error),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for PruneError {
    fn from(error: sqlx::Error) -> Self {
        PruneError::Database(error)
    }
}

impl From<InvalidTableName> for PruneError {
    fn from(error: InvalidTableName) -> Self {
        PruneError::InvalidTable(error)
    }
}

/// The pruning concern of [`Backend`]: each backend's pruning SQL, in `prune/<db>.rs`.
pub trait PruneSql: Database {
    /// The cutoff `now - age` on the database's clock, as text its comparisons accept on
    /// every session (see [`PruneProgress::cutoff`] for the formats).
    #[doc(hidden)]
    fn cutoff(
        pool: &Pool<Self>,
        age: Duration,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send + '_;

    /// Deletes up to `limit` ids processed before `cutoff` (and not before `after`),
    /// never a row whose `state` is set, oldest first, in one short transaction; returns how many it deleted and the
    /// newest `processed_at` among them (in the cutoff's format): no id left to delete
    /// is older.
    #[doc(hidden)]
    fn delete_batch<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: Option<&'a str>,
        cutoff: &'a str,
        after: Option<&'a str>,
        limit: u32,
    ) -> impl Future<Output = Result<(u64, Option<String>), sqlx::Error>> + Send + 'a;

    /// Per-consumer counts and ages, relative to `cutoff`.
    #[doc(hidden)]
    fn stats<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
        consumer: Option<&'a str>,
        cutoff: &'a str,
    ) -> impl Future<Output = Result<Vec<ConsumerStats>, sqlx::Error>> + Send + 'a;
}

/// `age` in whole microseconds, rounded up: rounding never moves the cutoff later.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
fn micros_up(age: Duration) -> i64 {
    let micros = age.as_nanos().div_ceil(1_000);
    i64::try_from(micros).unwrap_or(i64::MAX)
}

/// A count from the database as `u64` (a count is never negative).
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// An age in seconds from the database; a row from the future (clock skew) is 0 old.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
fn age_from_secs(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(MAX_PRUNE_AGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_never_moves_the_cutoff_later() {
        assert_eq!(micros_up(Duration::from_nanos(1)), 1);
        assert_eq!(micros_up(Duration::from_nanos(1_000)), 1);
        assert_eq!(micros_up(Duration::from_nanos(1_001)), 2);
        assert_eq!(micros_up(MAX_PRUNE_AGE), 31_536_000_000_000_000);
        assert_eq!(micros_up(Duration::MAX), i64::MAX);
    }

    #[test]
    fn refusals_need_no_database() {
        let hour = Duration::from_secs(3600);
        assert!(matches!(
            Prune::new(hour, hour + Duration::from_nanos(1)).check(),
            Err(PruneError::WindowTooShort { .. })
        ));
        assert!(Prune::new(hour, hour).check().is_ok());
        assert!(Prune::new(Duration::ZERO, Duration::ZERO).check().is_ok());
        assert!(matches!(
            Prune::new(Duration::MAX, hour).check(),
            Err(PruneError::AgeTooLarge { .. })
        ));
        assert!(matches!(
            Prune::new(hour, hour)
                .batch_size(MAX_PRUNE_BATCH + 1)
                .check(),
            Err(PruneError::InvalidBatchSize { .. })
        ));
        assert!(Prune::new(hour, hour).in_table("a.b.c").is_err());
        let error = Prune::new(hour, 2 * hour).check().unwrap_err();
        assert!(error.to_string().contains("redelivery window"), "{error}");
    }

    #[test]
    fn ages_from_the_database() {
        assert_eq!(age_from_secs(-3.0), Duration::ZERO);
        assert_eq!(age_from_secs(f64::NAN), Duration::ZERO);
        assert_eq!(age_from_secs(1.5), Duration::from_millis(1500));
        assert_eq!(age_from_secs(f64::INFINITY), MAX_PRUNE_AGE);
    }
}
