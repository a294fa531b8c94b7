//! The inbox (technique 3): store each incoming message keyed by `(consumer, message id)`,
//! acknowledge the broker at once, and process from the table later.
//!
//! **Receiving** is one short statement: the message's payload (bytes, kept byte for
//! byte), optional headers (bytes too: their encoding is yours, JSON say) and the time it
//! was received (the database's clock). A message already in the inbox — a redelivery, a
//! duplicate the broker cannot know of — is rejected by the insert itself, and the answer
//! says so ([`Received::Duplicate`]). Either way the caller acknowledges the broker: the
//! message is durably in the inbox.
//!
//! ```
//! use dedup_runtime::inbox::{Inbox, Incoming, Received};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
//! #     .connect("sqlite::memory:").await?;
//! dedup_runtime::inbox::migrate(&pool).await?; // creates `inbox_messages`
//! let inbox = Inbox::new(&pool, "billing")?;
//! let payload = br#"{"order": 42, "cents": 4200}"#;
//! assert_eq!(inbox.receive(Incoming::new("evt_91c2", payload)).await?, Received::Stored);
//! // The broker delivers it again: nothing new is stored; acknowledge it all the same.
//! assert_eq!(inbox.receive(Incoming::new("evt_91c2", payload)).await?, Received::Duplicate);
//!
//! // Many at once, one statement, one answer per message in their order.
//! let answers = inbox
//!     .receive_batch(&[
//!         Incoming::new("evt_1", b"a"),
//!         Incoming::new("evt_91c2", b"b"), // stored before
//!         Incoming::new("evt_1", b"a"),    // twice in this batch
//!         Incoming::new("", b"c"),         // an invalid id: refused, the others go in
//!     ])
//!     .await?;
//! assert_eq!(answers[0], Ok(Received::Stored));
//! assert_eq!(answers[1], Ok(Received::Duplicate));
//! assert_eq!(answers[2], Ok(Received::DuplicateInBatch { first: 0 }));
//! assert!(answers[3].is_err());
//! # Ok(()) }
//! ```
//!
//! The key is `(consumer, message_id)`: two consumers of one message each store and
//! process it. Ids are refused exactly as `#[idempotent]` refuses them
//! ([`InvalidMessageId`](crate::InvalidMessageId)); a payload over the inbox's limit
//! ([`DEFAULT_MAX_PAYLOAD_LEN`], up to [`MAX_PAYLOAD_LEN`]) is refused with a typed error
//! that names the limit, never truncated.
//!
//! **Processing** is a [`Worker`]'s ([`Inbox::worker`]): it claims due rows under an owner
//! token and a lease (the attempt counted at the claim), renews the lease by a heartbeat
//! while it works through them, runs an [`InboxHandler`] on each in a transaction that
//! ends with the row's "processed" mark — owner-checked, so that a worker that lost its
//! claim (paused past its lease, then resumed) commits nothing: its handler's effects
//! roll back — and persists a failure as the next attempt's time and the error's text;
//! after the last attempt the row is dead, for an operator ([`Inbox::dead`],
//! [`Inbox::requeue`], [`Inbox::discard`], [`Inbox::stats`]).
//!
//! On PostgreSQL and MariaDB the handler's transaction holds no lock on the row until its
//! mark, so that a worker stopped mid-handler (a pause, a dead network) loses the row to
//! another a lease after its last heartbeat. On SQLite the transaction holds the
//! database's only write lock from its start: no other worker claims anything meanwhile,
//! and the transaction renews the claim's other rows before it commits.
//!
//! **SQLite: a receipt waits for the handler in hand.** Receiving writes too, so on SQLite
//! [`Inbox::receive`] waits while a worker's handler transaction is open — up to the
//! connection's busy timeout (sqlx's default is 5 s; `SqliteConnectOptions::busy_timeout`
//! sets it). Past it, the receipt fails with SQLite's `SQLITE_BUSY`
//! ([`InboxError::Database`], a transient failure for
//! [`Failure::of`](crate::Failure::of)): nothing was stored, do not acknowledge, and the
//! broker redelivers. So that the broker is acknowledged at once, keep handler
//! transactions short (well under the busy timeout): do slow calls outside the database
//! in an `#[idempotent(effect = "send-first", lease = "…")]` handler, whose call runs with
//! no transaction open, or put the inbox on PostgreSQL or MariaDB, whose receipts never
//! wait for a handler.
//!
//! The table, `inbox_messages` by default, comes from [`migrate`] (or [`migrate_table`]),
//! or from the shipped `0003_inbox_messages.sql` of your backend ([`schema_sql`] prints
//! it). Its rows: `state` 0 pending, 1 claimed by a worker (`owner`, `lease_until`), 2
//! processed, 3 dead; `attempts`, `next_attempt_at` and `last_error` for retries.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;

use sqlx::{Database, Pool};

use crate::backend::Backend;
use crate::key::{MessageId, MessageKey};
use crate::names::{InvalidConsumer, check_consumer};
use crate::retry::retry_transient;
use crate::stored::{Fingerprint, FingerprintMismatch, fingerprint};
use crate::table::{InvalidTableName, Table};

mod backend;
mod error;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod worker;

#[doc(hidden)]
pub use backend::StatsRow;
pub use backend::{InboxBackend, InboxOperatorBackend};
pub use error::{InboxError, Refused};

use crate::random::Owner;
pub use worker::{BatchReport, Claims, InboxHandler, InboxMessage, Processed, Worker};

use worker::{Claimed, ClaimedMany};

/// The default inbox table.
pub const DEFAULT_TABLE: &str = "inbox_messages";

/// The payload limit of an [`Inbox`] unless [`Inbox::max_payload_len`] sets another: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_LEN: usize = 1 << 20;

/// The largest payload limit an inbox accepts: 8 MiB, well inside what every backend
/// takes in one statement by default (MariaDB's and MySQL's `max_allowed_packet` is 16 MiB
/// or more). Larger messages belong in object storage, with their address in the inbox.
pub const MAX_PAYLOAD_LEN: usize = 8 << 20;

/// The headers' limit: 64 KiB.
pub const MAX_HEADERS_LEN: usize = 64 << 10;

/// Rows one statement of [`Inbox::receive_batch`] inserts at most; a longer batch is sent
/// in chunks of this many (still one answer per message).
pub const MAX_BATCH: usize = 1_000;

/// Creates the inbox table `inbox_messages` and its indexes if they do not exist.
/// Idempotent; safe to run from several processes at once.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    migrate_table(pool, DEFAULT_TABLE).await
}

/// [`migrate`] for an inbox table of another name (`schema.name` allowed).
pub async fn migrate_table<DB: Backend>(pool: &Pool<DB>, table: &str) -> Result<(), sqlx::Error> {
    let table = Table::new(table).map_err(sqlx::Error::config)?;
    DB::inbox_create(pool, &table).await
}

/// The statements [`migrate_table`] runs, for your own migration tool: the shipped
/// `migrations/<backend>/0003_inbox_messages.sql` is this for `inbox_messages`.
pub fn schema_sql<DB: Backend>(table: &str) -> Result<String, InvalidTableName> {
    let table = Table::new(table)?;
    Ok(DB::inbox_ddl(&table)
        .into_iter()
        .map(|statement| statement + ";\n")
        .collect())
}

/// One message to store: its id (any [`MessageKey`]), its payload and, optionally, its
/// headers.
#[derive(Debug, Clone)]
pub struct Incoming<'a> {
    id: MessageId<'a>,
    payload: &'a [u8],
    headers: Option<&'a [u8]>,
    ordering_key: Option<&'a str>,
}

impl<'a> Incoming<'a> {
    /// The message `id` with `payload`, no headers.
    pub fn new<K: MessageKey + ?Sized>(id: &'a K, payload: &'a [u8]) -> Self {
        Incoming {
            id: id.message_id(),
            payload,
            headers: None,
            ordering_key: None,
        }
    }

    /// With `headers`, stored as given (encode them as you like: JSON, a protobuf…).
    pub fn headers(mut self, headers: &'a [u8]) -> Self {
        self.headers = Some(headers);
        self
    }

    /// With an ordering key: messages of one consumer with the same key are processed one
    /// at a time, in the order they were received, whatever the number of workers; a
    /// failing message holds up the later ones of its key only (until it succeeds, or is
    /// re-queued or discarded once dead). Checked as message ids are (1 to 255 bytes, no
    /// NUL).
    ///
    /// Receive order: a message received after another one's [`Inbox::receive`] (or
    /// [`Inbox::receive_batch`]) returned runs after it; within one batch, the batch's
    /// order. Two receipts of one key at the same moment, from two receivers, have no
    /// order between them (the one stored first may be seen second).
    pub fn ordering_key(mut self, key: &'a str) -> Self {
        self.ordering_key = Some(key);
        self
    }
}

/// What the inbox did with one message. Every answer means "acknowledge the broker".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Received {
    /// Stored, pending: a worker will process it.
    Stored,
    /// The inbox already held `(consumer, message id)`: a redelivery or a duplicate;
    /// nothing was written.
    Duplicate,
    /// The same id came earlier in the same batch, at index `first`: one row for both.
    DuplicateInBatch {
        /// The index of the first message with this id in the batch.
        first: usize,
    },
}

/// A claimed inbox row whose claim's lease ended, by its id.
#[doc(hidden)]
pub type Expired = crate::queue::Expired<String>;

/// Takes back, in bulk, the claims whose lease ended ([`crate::queue::take_back`]: the
/// row in hand keeps its attempt, dead with [`STOPPED`] if it was the last; the others
/// get theirs back); how many it buried.
pub(crate) async fn reclaim<DB: Backend>(
    pool: &Pool<DB>,
    table: &Table,
    consumer: &str,
    max_attempts: u32,
) -> Result<u64, sqlx::Error> {
    let expired = DB::inbox_expired(pool, table, consumer).await?;
    crate::queue::take_back(&expired, max_attempts, |owner, id, dead| {
        DB::inbox_reclaim(pool, table, consumer, owner, id, dead)
    })
    .await
}

/// One row to insert, validated.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct Row<'a> {
    pub(crate) id: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: Option<&'a [u8]>,
    pub(crate) ordering_key: Option<&'a str>,
    /// The payload's SHA-256, when the inbox compares payloads ([`Inbox::fingerprints`]).
    pub(crate) fingerprint: Option<Fingerprint>,
}

impl Row<'_> {
    /// The fingerprint as the column takes it.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn fingerprint(&self) -> Option<&[u8]> {
        self.fingerprint
            .as_ref()
            .map(|fingerprint| &fingerprint[..])
    }
}

/// A stored row's id and its payload's fingerprint (`None`: stored without one).
#[doc(hidden)]
pub type StoredFingerprint = (String, Option<Vec<u8>>);

/// What a processing mark adds to its `SET` when the inbox drops payloads once processed
/// ([`Inbox::drop_payloads`]).
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
fn payload_dropped(drop_payload: bool) -> &'static str {
    if drop_payload {
        ", payload = NULL, headers = NULL"
    } else {
        ""
    }
}

/// A dead inbox row, as [`Inbox::dead`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadMessage {
    /// The message id.
    pub id: String,
    /// The attempts made.
    pub attempts: u32,
    /// The last attempt's error: the handler's, or that its worker stopped.
    pub last_error: Option<String>,
}

/// One consumer's inbox at a glance ([`Inbox::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStats {
    /// Waiting for a worker (due now or after their backoff).
    pub pending: u64,
    /// Claimed by a worker, in flight.
    pub claimed: u64,
    /// Processed (kept as the dedup record until pruned).
    pub processed: u64,
    /// Dead: their attempts used up, waiting for an operator.
    pub dead: u64,
    /// How long ago the oldest pending row was received (database clock).
    pub oldest_pending: Option<std::time::Duration>,
}

/// The `last_error` of a row buried because its worker stopped during its last attempt.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
const STOPPED: &str = ": the worker stopped during this attempt, before the end of its \
                       lease (it crashed, was killed, lost the database, or was paused past \
                       the lease)";

/// Pruning an inbox: [`Prune`](crate::Prune)'s loop on the inbox's processed rows.
impl crate::Prune {
    /// Deletes the processed rows of `inbox`'s consumer, in its table, processed more
    /// than the age ago, as [`run`](crate::Prune::run) does the dedup table's: batch by batch,
    /// with the same rest between batches and the same refusals before anything runs
    /// (an age shorter than the redelivery window: a processed row is the dedup record
    /// of its receipt). Pending, claimed and dead rows are never deleted. A consumer or
    /// table set on this `Prune` plays no part: the inbox's are used.
    ///
    /// [`PruneProgress::cutoff`](crate::PruneProgress::cutoff) is the cutoff when the run began; each batch computes
    /// `now − age` on the database's clock again (never earlier).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// use dedup_runtime::{Prune, inbox::Inbox};
    ///
    /// dedup_runtime::inbox::migrate(&pool).await?;
    /// let inbox = Inbox::new(&pool, "billing")?;
    /// let day = Duration::from_secs(24 * 3600);
    /// let done = Prune::new(7 * day, 4 * day).run_inbox(&inbox, |_| {}).await?;
    /// assert_eq!((done.deleted, done.done), (0, true));
    /// # Ok(()) }
    /// ```
    pub async fn run_inbox<DB: Backend>(
        &self,
        inbox: &Inbox<DB>,
        progress: impl FnMut(&crate::PruneProgress),
    ) -> Result<crate::PruneProgress, crate::PruneError> {
        self.validate()?;
        let cutoff = DB::cutoff(inbox.pool(), self.cutoff_age()).await?;
        let rows = ProcessedRows {
            inbox,
            age_us: crate::clock::micros(self.cutoff_age()),
            limit: i64::from(self.batch_size),
        };
        self.batches(cutoff, progress, rows).await
    }
}

/// An inbox's processed rows older than the age, each batch's cutoff `now − age` on the
/// database's clock.
struct ProcessedRows<'a, DB: Database> {
    inbox: &'a Inbox<DB>,
    age_us: i64,
    limit: i64,
}

impl<DB: Backend> crate::prune::PrunedRows for ProcessedRows<'_, DB> {
    async fn delete_batch(&mut self, _cutoff: &str) -> Result<u64, crate::PruneError> {
        let (pool, table, consumer) =
            (self.inbox.pool(), self.inbox.table(), self.inbox.consumer());
        let (age_us, limit) = (self.age_us, self.limit);
        retry_transient::<DB, _, _>(|| DB::inbox_prune(pool, table, consumer, age_us, limit))
            .await
            .map_err(|error| crate::PruneError::from_database::<DB>(table, error))
    }
}

/// One consumer's inbox: receive messages into it (and, with a worker, process them).
pub struct Inbox<DB: Database> {
    pool: Pool<DB>,
    table: Table,
    consumer: String,
    max_payload_len: usize,
    drop_payloads: bool,
    /// [`Inbox::fingerprints`].
    fingerprints: bool,
    /// With [`Inbox::notify_workers`]: when the last hint went out, shared by clones.
    notify: Option<std::sync::Arc<crate::queue::Hints>>,
}

/// The shortest time between two hints from one inbox (and its clones): a burst of
/// receipts costs one `NOTIFY`, not one per message (a `NOTIFY` takes a lock that
/// serialises the commits of every session that sends one).
pub const HINT_GAP: std::time::Duration = crate::queue::HINT_GAP;

impl<DB: Database> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            consumer: self.consumer.clone(),
            max_payload_len: self.max_payload_len,
            drop_payloads: self.drop_payloads,
            fingerprints: self.fingerprints,
            notify: self.notify.clone(),
        }
    }
}

impl<DB: Database> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.table.name())
            .field("consumer", &self.consumer)
            .field("max_payload_len", &self.max_payload_len)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// The inbox of `consumer` in `inbox_messages`, on `pool` (a clone of it: the inbox
    /// owns its handle, and it and its clones and workers can move into tasks).
    /// `consumer` is checked as `#[idempotent(consumer = "…")]` checks it.
    pub fn new(pool: &Pool<DB>, consumer: &str) -> Result<Self, InvalidConsumer> {
        check_consumer(consumer)?;
        Ok(Inbox {
            pool: pool.clone(),
            table: Table::new(DEFAULT_TABLE).expect("the default table name is valid"),
            consumer: consumer.to_owned(),
            max_payload_len: DEFAULT_MAX_PAYLOAD_LEN,
            drop_payloads: false,
            fingerprints: false,
            notify: None,
        })
    }

    /// The same inbox in the table `table` (create it with [`migrate_table`]), a plain or
    /// schema-qualified SQL identifier, checked here.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// use dedup_runtime::inbox::Inbox;
    ///
    /// let inbox = Inbox::new(&pool, "billing")?.in_table("audit_inbox")?;
    /// assert_eq!(inbox.table().name(), "audit_inbox");
    /// assert!(Inbox::new(&pool, "billing")?.in_table("t; DROP TABLE users").is_err());
    /// # Ok(()) }
    /// ```
    pub fn in_table(self, table: &str) -> Result<Self, InvalidTableName> {
        Ok(Inbox {
            table: Table::new(table)?,
            ..self
        })
    }

    /// Sets the payload limit, at most [`MAX_PAYLOAD_LEN`] (a larger one is capped there).
    pub fn max_payload_len(self, len: usize) -> Self {
        Inbox {
            max_payload_len: len.min(MAX_PAYLOAD_LEN),
            ..self
        }
    }

    /// Whether receiving wakes idle workers at once (PostgreSQL: a `NOTIFY` after a
    /// receipt that stored something, at most one per [`HINT_GAP`] from this inbox and
    /// its clones). A hint only: workers poll all the same, so a lost hint or a dead
    /// listening connection delays nothing beyond their poll interval. A no-op on SQLite
    /// and MySQL/MariaDB, whose workers poll. Off by default.
    pub fn notify_workers(self, notify: bool) -> Self {
        Inbox {
            notify: notify.then(|| std::sync::Arc::new(crate::queue::Hints::new())),
            ..self
        }
    }

    /// Sends a hint to the workers if one is due; a failure is only logged (the workers
    /// poll).
    async fn hint(&self) {
        let Some(hints) = &self.notify else { return };
        if !hints.take(HINT_GAP) {
            return; // one went out less than HINT_GAP ago, or another receiver sends it
        }
        if let Err(error) = DB::wake_notify(&self.pool, &self.table).await {
            tracing::debug!(%error, "inbox: the hint to the workers failed; they poll");
        }
    }

    /// Whether a worker drops a message's payload and headers when it marks the row
    /// processed (in the same transaction), to save space: the row stays, as the dedup
    /// record, until pruned. Off by default.
    pub fn drop_payloads(self, drop: bool) -> Self {
        Inbox {
            drop_payloads: drop,
            ..self
        }
    }

    /// Whether the inbox compares payloads (off by default): each message's SHA-256 is
    /// stored with its row (kept when [`drop_payloads`](Self::drop_payloads) clears the
    /// payload), and a receive that finds its id stored compares: the same id with
    /// another payload is [`Refused::FingerprintMismatch`] (dead-letter it), never taken
    /// for a redelivery; an identical redelivery, before or after processing, is
    /// [`Received::Duplicate`]. A row stored without a fingerprint (received with this
    /// off, or before this version) has nothing to compare: a duplicate. The whole
    /// payload is compared, byte for byte: turn it on where a copy of a message is always
    /// the same bytes (a broker's redelivery is), not where a producer re-encodes a
    /// retried message (a timestamp inside, JSON re-serialised) — there every retry would
    /// be refused; an `#[idempotent]` handler's `fingerprint = …` can name the part that
    /// matters instead. Costs a hash per receive (microseconds for a few KiB) and, for a
    /// duplicate, one look at the stored fingerprint.
    pub fn fingerprints(self, compare: bool) -> Self {
        Inbox {
            fingerprints: compare,
            ..self
        }
    }

    /// Deletes this consumer's processed rows processed more than `older_than` ago:
    /// `Prune::new(older_than, redelivery_window).run_inbox(self, |_| {})`, with its
    /// batches of [`DEFAULT_PRUNE_BATCH`](crate::DEFAULT_PRUNE_BATCH) and a rest as long
    /// as each batch took, so that receivers and workers keep going. Processed rows are
    /// the dedup record of the receipt: like every prune, this refuses an age shorter
    /// than the broker's `redelivery_window` before it touches anything
    /// ([`PruneError::WindowTooShort`](crate::PruneError::WindowTooShort)). Pending,
    /// claimed and dead rows are never deleted. Returns how many rows it deleted;
    /// [`Prune::run_inbox`](crate::Prune::run_inbox) takes a batch size, a pause and a
    /// progress callback.
    pub async fn prune(
        &self,
        older_than: std::time::Duration,
        redelivery_window: std::time::Duration,
    ) -> Result<u64, crate::PruneError> {
        let done = crate::Prune::new(older_than, redelivery_window)
            .run_inbox(self, |_| {})
            .await?;
        Ok(done.deleted)
    }

    /// The pool the inbox works on.
    pub(crate) fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The consumer whose inbox this is.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The inbox table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    fn check<'a>(&self, message: &'a Incoming<'a>) -> Result<Row<'a>, Refused> {
        let id = message.id.validate().map_err(Refused::InvalidMessageId)?;
        if message.payload.len() > self.max_payload_len {
            return Err(Refused::PayloadTooLarge {
                len: message.payload.len(),
                max: self.max_payload_len,
            });
        }
        if let Some(headers) = message.headers
            && headers.len() > MAX_HEADERS_LEN
        {
            return Err(Refused::HeadersTooLarge {
                len: headers.len(),
                max: MAX_HEADERS_LEN,
            });
        }
        if let Some(key) = message.ordering_key {
            MessageId::borrowed(key)
                .validate()
                .map_err(Refused::InvalidOrderingKey)?;
        }
        Ok(Row {
            id,
            payload: message.payload,
            headers: message.headers,
            ordering_key: message.ordering_key,
            fingerprint: self.fingerprints.then(|| fingerprint(message.payload)),
        })
    }

    /// For the rows a receive found stored already: the mismatch of each whose stored
    /// fingerprint is another (by index in `rows`).
    async fn mismatches(
        &self,
        rows: &[&Row<'_>],
    ) -> Result<Vec<(usize, FingerprintMismatch)>, InboxError> {
        if !self.fingerprints || rows.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = rows.iter().map(|row| row.id).collect();
        let stored = retry_transient::<DB, _, _>(|| {
            DB::inbox_fingerprints(&self.pool, &self.table, &self.consumer, &ids)
        })
        .await
        .map_err(|error| self.classify(error))?;
        let stored: HashMap<String, Vec<u8>> = stored
            .into_iter()
            .filter_map(|(id, fingerprint)| Some((id, fingerprint?)))
            .collect();
        Ok(rows
            .iter()
            .enumerate()
            .filter_map(|(index, row)| {
                let received = row.fingerprint?;
                let stored = stored.get(row.id)?;
                FingerprintMismatch::between(&self.consumer, row.id, stored, received)
                    .map(|mismatch| (index, mismatch))
            })
            .collect())
    }

    /// Stores one message, or finds it stored already; one statement (and, for a
    /// duplicate, one look at the stored fingerprint: the same id with another payload is
    /// [`Refused::FingerprintMismatch`], see [`fingerprints`](Self::fingerprints)).
    /// Acknowledge the broker once this returns `Ok`; on `Err(InboxError::Refused(_))`
    /// dead-letter it; on another error, nothing is known to be stored: let the broker
    /// redeliver.
    pub async fn receive(&self, message: Incoming<'_>) -> Result<Received, InboxError> {
        let row = self
            .check(&message)
            .inspect_err(|_| self.count_received("refused", 1))?;
        let rows = [row];
        let stored = retry_transient::<DB, _, _>(|| {
            DB::inbox_insert(&self.pool, &self.table, &self.consumer, &rows)
        })
        .await
        .map_err(|error| self.classify(error))?;
        if stored.first().copied().unwrap_or(false) {
            self.count_received("stored", 1);
            self.hint().await;
            return Ok(Received::Stored);
        }
        if let Some((_, mismatch)) = self.mismatches(&[&rows[0]]).await?.pop() {
            self.count_received("refused", 1);
            return Err(InboxError::Refused(Refused::FingerprintMismatch(mismatch)));
        }
        self.count_received("duplicate", 1);
        Ok(Received::Duplicate)
    }

    /// Stores many messages in one statement (per [`MAX_BATCH`] of them; on MySQL and
    /// MariaDB also per what fits the server's `max_allowed_packet`), for consumers that
    /// acknowledge in batches: one answer per message, in their order. A message refused
    /// (a bad id, a payload over the limit, an id stored already with another payload)
    /// gets its `Err` and the others are stored; the same id twice in the batch is one
    /// row, and the second answer says [`Received::DuplicateInBatch`] (with another
    /// payload: [`Refused::FingerprintMismatch`]). Every copy of an id that is refused for
    /// the fingerprint stored with it is refused, the second as the first, so that no copy
    /// is acknowledged that [`receive`](Self::receive) would refuse. `Err` for the whole
    /// call only when the database
    /// failed: then nothing is known to be stored (a deadlock or lock timeout, which
    /// stored nothing, is tried again first).
    ///
    /// Receive order is the batch's order (a worker claims by due time, then receive
    /// order; the messages of one ordering key run in it). Two batches at the same moment
    /// with ids in common do not fail: on PostgreSQL the rows are inserted in the ids'
    /// byte order whatever the batch's order, so that they wait for each other instead of
    /// deadlocking; on MySQL and MariaDB the ids already stored are read first, without
    /// locks, and left out of the insert (a duplicate would lock its row), so that only
    /// ids new at the same moment can meet; and everywhere a deadlock or lock timeout is
    /// tried again.
    pub async fn receive_batch(
        &self,
        messages: &[Incoming<'_>],
    ) -> Result<Vec<Result<Received, Refused>>, InboxError> {
        let mut answers: Vec<Option<Result<Received, Refused>>> = vec![None; messages.len()];
        // The rows to insert, each with the index of its message.
        let mut rows: Vec<(usize, Row<'_>)> = Vec::with_capacity(messages.len());
        // Each id's first message in the batch, and its payload's fingerprint.
        let mut first_of: HashMap<&str, (usize, Option<Fingerprint>)> =
            HashMap::with_capacity(messages.len());
        for (index, message) in messages.iter().enumerate() {
            match self.check(message) {
                Err(refused) => answers[index] = Some(Err(refused)),
                Ok(row) => match first_of.get(row.id) {
                    // The same id twice in the batch with two payloads: the second is
                    // refused, as it would be in a batch of its own.
                    Some(&(_, Some(stored)))
                        if row.fingerprint.is_some_and(|received| received != stored) =>
                    {
                        let received = row.fingerprint.unwrap_or_default();
                        let mismatch =
                            FingerprintMismatch::new(&self.consumer, row.id, stored, received);
                        answers[index] = Some(Err(Refused::FingerprintMismatch(mismatch)));
                    }
                    Some(&(first, _)) => {
                        answers[index] = Some(Ok(Received::DuplicateInBatch { first }));
                    }
                    None => {
                        first_of.insert(row.id, (index, row.fingerprint));
                        rows.push((index, row));
                    }
                },
            }
        }
        for chunk in rows.chunks(MAX_BATCH) {
            let (indexes, chunk): (Vec<usize>, Vec<Row<'_>>) = chunk
                .iter()
                .map(|(index, row)| {
                    (
                        *index,
                        Row {
                            id: row.id,
                            payload: row.payload,
                            headers: row.headers,
                            ordering_key: row.ordering_key,
                            fingerprint: row.fingerprint,
                        },
                    )
                })
                .unzip();
            // A deadlock or a lock timeout rolled the statement back: nothing of it was
            // stored; insert it again, as the claims do.
            let stored = retry_transient::<DB, _, _>(|| {
                DB::inbox_insert(&self.pool, &self.table, &self.consumer, &chunk)
            })
            .await
            .map_err(|error| self.classify(error))?;
            // The duplicates, compared with what is stored.
            let duplicates: Vec<(usize, &Row<'_>)> = indexes
                .iter()
                .zip(&chunk)
                .zip(&stored)
                .filter(|(_, stored)| !**stored)
                .map(|((index, row), _)| (*index, row))
                .collect();
            let found: Vec<&Row<'_>> = duplicates.iter().map(|(_, row)| *row).collect();
            for (at, mismatch) in self.mismatches(&found).await? {
                answers[duplicates[at].0] = Some(Err(Refused::FingerprintMismatch(mismatch)));
            }
            for (index, stored) in indexes.into_iter().zip(stored) {
                answers[index].get_or_insert(Ok(if stored {
                    Received::Stored
                } else {
                    Received::Duplicate
                }));
            }
        }
        // A copy of an id refused for its stored fingerprint is refused too: it carries
        // the first copy's payload (another one was refused above), so it is the same
        // mismatch, and acknowledging it would drop what `receive` refuses.
        let mut answers: Vec<Result<Received, Refused>> = answers
            .into_iter()
            .map(|answer| answer.expect("every message has its answer"))
            .collect();
        for index in 0..answers.len() {
            if let Ok(Received::DuplicateInBatch { first }) = answers[index]
                && let Err(Refused::FingerprintMismatch(mismatch)) = &answers[first]
            {
                answers[index] = Err(Refused::FingerprintMismatch(mismatch.clone()));
            }
        }
        let count = |wanted: fn(&Result<Received, Refused>) -> bool| {
            answers.iter().filter(|answer| wanted(answer)).count() as u64
        };
        let stored = count(|answer| *answer == Ok(Received::Stored));
        self.count_received("stored", stored);
        self.count_received(
            "duplicate",
            count(|answer| {
                matches!(
                    answer,
                    Ok(Received::Duplicate | Received::DuplicateInBatch { .. })
                )
            }),
        );
        self.count_received("refused", count(Result::is_err));
        if stored > 0 {
            self.hint().await;
        }
        Ok(answers)
    }

    /// The dead rows, oldest first, at most `limit`: each with its attempts and last error.
    pub async fn dead(&self, limit: u32) -> Result<Vec<DeadMessage>, InboxError> {
        let rows = DB::inbox_dead(&self.pool, &self.table, &self.consumer, i64::from(limit))
            .await
            .map_err(|error| self.classify(error))?;
        Ok(rows
            .into_iter()
            .map(|(id, attempts, last_error)| DeadMessage {
                id,
                attempts: attempts.max(0) as u32,
                last_error,
            })
            .collect())
    }

    /// Re-queues the dead row `id`: pending again, due now, its attempts back to 0; a
    /// worker processes it once (its row is its own, never taken for a duplicate of
    /// itself). `false` when `id` is not dead.
    pub async fn requeue(&self, id: impl MessageKey) -> Result<bool, InboxError> {
        self.resolve_dead(id, true).await
    }

    /// Discards the dead row `id`: recorded as processed without running (so that a
    /// redelivery is still a duplicate), its last error kept. `false` when `id` is not
    /// dead.
    pub async fn discard(&self, id: impl MessageKey) -> Result<bool, InboxError> {
        self.resolve_dead(id, false).await
    }

    /// [`requeue`](Self::requeue) (`requeue`) or [`discard`](Self::discard) the dead row `id`.
    async fn resolve_dead(&self, id: impl MessageKey, requeue: bool) -> Result<bool, InboxError> {
        let key = id.message_id();
        let id = key
            .validate()
            .map_err(|error| InboxError::Refused(Refused::InvalidMessageId(error)))?;
        let done = DB::inbox_resolve(&self.pool, &self.table, &self.consumer, id, requeue)
            .await
            .map_err(|error| self.classify(error))?;
        if done {
            let what = if requeue { "re-queued" } else { "discarded" };
            tracing::info!(
                consumer = self.consumer,
                message_id = id,
                "dead inbox message {what}"
            );
        }
        Ok(done)
    }

    /// The rows waiting for a worker (pending or claimed), counted up to `limit` and no
    /// further, through the workers' index: cheap enough to ask every few deliveries.
    ///
    /// Back-pressure: when it reaches your bound, stop taking deliveries from the broker
    /// (RabbitMQ: cancel the consumer, or stop acknowledging so that the prefetch window
    /// fills; JetStream: stop fetching) and resume once it is below again — the broker
    /// keeps the messages meanwhile, and the inbox does not grow without bound.
    ///
    /// ```
    /// # use dedup_runtime::inbox::{Inbox, Incoming};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
    /// # dedup_runtime::inbox::migrate(&pool).await?;
    /// let inbox = Inbox::new(&pool, "billing")?;
    /// const BOUND: u64 = 10_000;
    /// # inbox.receive(Incoming::new("evt_1", b"p")).await?;
    /// if inbox.backlog(BOUND).await? >= BOUND {
    ///     // pause the broker consumer; look again in a second
    /// }
    /// assert_eq!(inbox.backlog(BOUND).await?, 1);
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self, limit: u64) -> Result<u64, InboxError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let count = DB::inbox_backlog(&self.pool, &self.table, &self.consumer, limit)
            .await
            .map_err(|error| self.classify(error))?;
        Ok(count.max(0) as u64)
    }

    /// The counts by state and the age of the oldest pending row. Reads every row of the
    /// consumer (processed ones included): an operator's call, not one per message.
    pub async fn stats(&self) -> Result<InboxStats, InboxError> {
        let (pending, claimed, processed, dead, oldest) =
            DB::inbox_stats(&self.pool, &self.table, &self.consumer)
                .await
                .map_err(|error| self.classify(error))?;
        let count = |n: i64| n.max(0) as u64;
        for (state, n) in [
            ("pending", pending),
            ("claimed", claimed),
            ("processed", processed),
            ("dead", dead),
        ] {
            crate::metrics::inbox_gauge(
                "dedup_inbox_rows",
                &self.consumer,
                Some(("state", state)),
                count(n) as f64,
            );
        }
        crate::metrics::inbox_gauge(
            "dedup_inbox_oldest_pending_seconds",
            &self.consumer,
            None,
            oldest.map_or(0.0, |us| count(us) as f64 / 1e6),
        );
        Ok(InboxStats {
            pending: count(pending),
            claimed: count(claimed),
            processed: count(processed),
            dead: count(dead),
            oldest_pending: oldest.map(|us| std::time::Duration::from_micros(count(us))),
        })
    }

    fn count_received(&self, outcome: &'static str, count: u64) {
        crate::metrics::consumer_count(
            "dedup_inbox_received_total",
            &self.consumer,
            ("outcome", outcome),
            count,
        );
    }

    fn classify(&self, error: sqlx::Error) -> InboxError {
        if DB::is_missing_table(&error, &self.table) {
            InboxError::MissingTable {
                table: self.table.clone(),
                error,
            }
        } else {
            InboxError::Database(error)
        }
    }
}
