//! The outbox, the inbox's mirror image: a handler that publishes writes its outgoing
//! messages to an outbox table **in its own transaction**, with its effects and its dedup
//! record, and a relay publishes them after the commit.
//!
//! Without it, a consumer that publishes after its commit has a hole that deduplication
//! makes permanent: killed between the commit and the publish, it gets the message again,
//! recognises it as a duplicate, skips it — and the event is never published. With the
//! outbox, the outgoing message commits with the effect or not at all.
//!
//! **Outgoing ids are derived from the cause**: [`Cause::id`] is a UUIDv5 of the consumer,
//! the incoming message's id and a slot the handler names (or the index of the message
//! among those it sends, [`Cause::nth_id`]). A handler that runs twice for one message —
//! after a commit whose outcome was lost, a replay after the dedup window, a copy without
//! the outbox in front — sends the same ids again, and a deduplicating consumer
//! downstream (`#[idempotent(key = …)]` on the outgoing id) collapses them. Every hop
//! dedups at its own endpoint, with ids that cooperate.
//!
//! ```
//! use dedup_runtime::outbox::{Cause, Enqueued, Outbox};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
//! #     .connect("sqlite::memory:").await?;
//! dedup_runtime::outbox::migrate(&pool).await?; // creates `outbox_messages`
//! let outbox = Outbox::new();
//!
//! // In the handler of the incoming message `evt_91c2`, on its transaction:
//! let mut tx = pool.begin().await?;
//! let cause = Cause::new("billing", "evt_91c2")?;
//! let invoice = cause.outgoing("invoice-created", "invoices", br#"{"cents": 4200}"#)?;
//! assert_eq!(invoice.id().to_string(), "d52783e3-eaa0-5242-b33a-713ba7314074");
//! assert_eq!(outbox.enqueue(&mut *tx, &invoice).await?, Enqueued::Stored);
//! // The same message again (the handler ran twice): nothing new.
//! assert_eq!(outbox.enqueue(&mut *tx, &invoice).await?, Enqueued::Duplicate);
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! **In a handler's own error type.** The outbox has two errors: [`InvalidCause`] (from
//! [`Cause::new`], [`Cause::id`] and [`Cause::outgoing`]) and [`OutboxError`] (from
//! [`Outbox::enqueue`]). Both convert into `sqlx::Error` with `?` (a database failure as
//! it was, the rest as `sqlx::Error::InvalidArgument`). A handler with an error enum of
//! its own gives it one variant for each — with `thiserror`, `#[error(transparent)]
//! Cause(#[from] InvalidCause)` and `#[error(transparent)] Outbox(#[from] OutboxError)`
//! — and writes `?` at every call, no `map_err`. [`AckPolicy`](crate::AckPolicy) reads
//! through the variants: a transient database failure inside `enqueue` (a deadlock, a
//! lost connection) is retried, a conflict or a refusal is dead-lettered.
//!
//! The table, `outbox_messages` by default, comes from [`migrate`] (or [`migrate_table`]),
//! or from the shipped `0004_outbox_messages.sql` of your backend ([`schema_sql`] prints
//! it). Its rows: `state` 0 unsent, 1 claimed by a relay (`owner`, `lease_until`), 2 sent,
//! 3 dead; `attempts`, `next_attempt_at` and `last_error` for the relay's retries; the
//! cause (`consumer`, `cause_id`, `slot`) each message was derived from.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool};
use uuid::Uuid;

use crate::backend::Backend;
use crate::table::{InvalidTableName, Table};

mod backend;
mod headers;
mod ids;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod relay;
#[cfg(feature = "sqlite")]
mod sqlite;

use crate::random::Owner;
pub use backend::OutboxBackend;
pub use headers::{Headers, RESERVED_HEADERS};
pub use ids::{Cause, InvalidCause, OutgoingId};
pub use relay::{OutboxMessage, Publisher, Relay, Relayed};

/// A claimed outbox row whose claim's lease ended, by its id.
#[doc(hidden)]
pub type ExpiredOutgoing = crate::queue::Expired<OutgoingId>;

/// Takes back, in bulk, the claims whose lease ended ([`crate::queue::take_back`]: the
/// relay sends its claim one row at a time in `seq` order; the row it was sending keeps
/// its attempt, dead with [`STOPPED`] if it was the last; the others get theirs back); how
/// many it buried.
pub(crate) async fn reclaim<DB: Backend>(
    pool: &Pool<DB>,
    table: &Table,
    max_attempts: u32,
) -> Result<u64, sqlx::Error> {
    let expired = DB::outbox_expired(pool, table).await?;
    crate::queue::take_back(&expired, max_attempts, |owner, id, dead| {
        DB::outbox_reclaim(pool, table, owner, *id, dead)
    })
    .await
}

/// The `last_error` of a row buried because its relay stopped during its last attempt.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
const STOPPED: &str = ": the relay stopped during this attempt, before the end of its \
                       lease (it crashed, was killed, lost the database, or was paused past \
                       the lease)";

/// The default outbox table.
pub const DEFAULT_TABLE: &str = "outbox_messages";

/// The payload limit of an [`Outbox`] unless [`Outbox::max_payload_len`] sets another: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_LEN: usize = 1 << 20;

/// The largest payload limit an outbox accepts: 8 MiB (see
/// [`inbox::MAX_PAYLOAD_LEN`](crate::inbox::MAX_PAYLOAD_LEN)).
pub const MAX_PAYLOAD_LEN: usize = 8 << 20;

/// The headers' limit: 64 KiB, encoded as the row keeps them (each pair's name and value
/// and 5 bytes).
pub const MAX_HEADERS_LEN: usize = 64 << 10;

/// The longest destination, slot or ordering key, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// The namespace of every outgoing id: the UUIDv5 of the URL
/// `https://github.com/dedup-rs/dedup/outbox` in the URL namespace,
/// `f05ab860-2a3e-578c-897a-484e8894600b`.
pub const NAMESPACE: Uuid = Uuid::from_u128(0xf05a_b860_2a3e_578c_897a_484e_8894_600b);

/// Creates the outbox table `outbox_messages` and its indexes if they do not exist.
/// Idempotent; safe to run from several processes at once.
pub async fn migrate<DB: Backend>(pool: &Pool<DB>) -> Result<(), sqlx::Error> {
    migrate_table(pool, DEFAULT_TABLE).await
}

/// [`migrate`] for an outbox table of another name (`schema.name` allowed).
pub async fn migrate_table<DB: Backend>(pool: &Pool<DB>, table: &str) -> Result<(), sqlx::Error> {
    let table = Table::new(table).map_err(sqlx::Error::config)?;
    DB::outbox_create(pool, &table).await
}

/// The statements [`migrate_table`] runs, for your own migration tool: the shipped
/// `migrations/<backend>/0004_outbox_messages.sql` is this for `outbox_messages`.
pub fn schema_sql<DB: Backend>(table: &str) -> Result<String, InvalidTableName> {
    let table = Table::new(table)?;
    Ok(DB::outbox_ddl(&table)
        .into_iter()
        .map(|statement| statement + ";\n")
        .collect())
}

/// One outgoing message, made by [`Cause::outgoing`] or [`Cause::nth_outgoing`].
#[derive(Debug, Clone)]
pub struct Outgoing<'a> {
    id: OutgoingId,
    cause: &'a Cause,
    slot: Cow<'a, str>,
    destination: &'a str,
    payload: &'a [u8],
    /// The headers' pairs, encoded as the row keeps them (empty: none).
    headers: Vec<u8>,
    ordering_key: Option<&'a str>,
    traceparent: Option<&'a str>,
}

impl<'a> Outgoing<'a> {
    fn new(
        cause: &'a Cause,
        id: OutgoingId,
        slot: Cow<'a, str>,
        destination: &'a str,
        payload: &'a [u8],
    ) -> Self {
        Outgoing {
            id,
            cause,
            slot,
            destination,
            payload,
            headers: Vec::new(),
            ordering_key: None,
            traceparent: None,
        }
    }

    /// Adds a header: a name and its value, which every publisher of this crate sends as
    /// the broker's own header (Kafka record headers, the AMQP headers table, NATS
    /// headers, Redis Streams entry fields) and every hosted consumer gives back to its
    /// handler ([`Message::header`](crate::consume::Message::header)). Headers keep
    /// their order; a name may come more than once. At enqueue, a name must be 1 to 255
    /// bytes of an HTTP token (letters, digits and ``!#$%&'*+-.^_`|~``) and none of
    /// [`RESERVED_HEADERS`] (the publishers' own: the id, the body, the trace context),
    /// and all of them together at most [`MAX_HEADERS_LEN`] bytes
    /// ([`Refused::InvalidHeader`], [`Refused::HeadersTooLarge`]). Values are bytes; a
    /// broker whose headers are text (NATS) is sent only values that are (see its
    /// publisher).
    ///
    /// ```
    /// # use dedup_runtime::outbox::Cause;
    /// # let cause = Cause::new("billing", "evt_91c2").unwrap();
    /// let invoice = cause
    ///     .outgoing("invoice-created", "invoices", b"{}")?
    ///     .header("content-type", "application/json")
    ///     .header("tenant", "acme");
    /// # Ok::<(), dedup_runtime::outbox::InvalidCause>(())
    /// ```
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        headers::push(&mut self.headers, name, value.as_ref());
        self
    }

    /// An ordering key: the relay sends the messages of one key one at a time, each once
    /// the ones before it are sent (or dead and then re-queued or discarded).
    ///
    /// Which order: **a message enqueued after another of its key committed is sent after
    /// it** — whatever the number of producers and relays. That is the order a reader of
    /// the table can see: a transaction still open is invisible, so of two messages in
    /// transactions open at the same time, the one committed first may go first even if
    /// it was enqueued second (the relay does not wait for a transaction it cannot see);
    /// once both are committed before the relay reaches the key, they go in enqueue order.
    /// To send a key's messages in the order your code decided, enqueue them in one
    /// transaction, or each after the previous one committed.
    pub fn ordering_key(self, key: &'a str) -> Self {
        Outgoing {
            ordering_key: Some(key),
            ..self
        }
    }

    /// The trace context to send it with: a W3C `traceparent` value
    /// (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase), the span
    /// that enqueued it as your OpenTelemetry propagator writes it. Stored with the row;
    /// the relay hands it to the publisher, which sends it as the broker's `traceparent`
    /// header (RabbitMQ, JetStream, Kafka; Redis Streams a field; MQTT 3.1.1 has no
    /// headers), so that one trace links the handler, the relay's send and the consumer
    /// downstream. A value that is not one is refused ([`Refused::InvalidTraceparent`]).
    /// Without it, the outbox's [`trace_context`](Outbox::trace_context) hook, if any,
    /// gives it.
    pub fn traceparent(self, traceparent: &'a str) -> Self {
        Outgoing {
            traceparent: Some(traceparent),
            ..self
        }
    }

    /// Its id.
    pub fn id(&self) -> OutgoingId {
        self.id
    }

    /// Its cause.
    pub fn cause(&self) -> &Cause {
        self.cause
    }

    /// Its slot.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Where the relay sends it (a queue, an exchange and routing key, a subject: the
    /// publisher's to interpret).
    pub fn destination(&self) -> &str {
        self.destination
    }

    /// The payload, byte for byte.
    pub fn payload(&self) -> &[u8] {
        self.payload
    }
}

/// What [`Outbox::enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Stored, to be sent once the transaction commits.
    Stored,
    /// The outbox held this message already (the same id, destination and payload): a
    /// handler that ran again. Nothing changed; the first one's headers stand.
    Duplicate,
}

/// Why an outgoing message was refused before anything was written.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refused {
    /// The destination is empty, over [`MAX_NAME_LEN`] bytes, or contains NUL.
    InvalidDestination(String),
    /// The ordering key is empty, over [`MAX_NAME_LEN`] bytes, or contains NUL.
    InvalidOrderingKey(String),
    /// The payload is longer than the outbox's limit.
    PayloadTooLarge {
        /// The payload's length in bytes.
        len: usize,
        /// The outbox's limit ([`Outbox::max_payload_len`]).
        max: usize,
    },
    /// The headers ([`Outgoing::header`]), as the row keeps them, are longer than
    /// [`MAX_HEADERS_LEN`].
    HeadersTooLarge {
        /// The headers' length in bytes, encoded as the row keeps them.
        len: usize,
        /// [`MAX_HEADERS_LEN`].
        max: usize,
    },
    /// A header's name ([`Outgoing::header`]) is empty, over 255 bytes, not an HTTP token
    /// or one of [`RESERVED_HEADERS`]: why.
    InvalidHeader(String),
    /// The trace context ([`Outgoing::traceparent`], or the outbox's
    /// [`trace_context`](Outbox::trace_context) hook) is not a W3C `traceparent`: why.
    InvalidTraceparent(String),
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::InvalidDestination(why) => write!(f, "invalid destination: {why}"),
            Refused::InvalidOrderingKey(why) => write!(f, "invalid ordering key: {why}"),
            Refused::PayloadTooLarge { len, max } => write!(
                f,
                "the payload is {len} bytes, over the outbox's limit of {max} bytes: it is \
                 refused, never truncated"
            ),
            Refused::HeadersTooLarge { len, max } => write!(
                f,
                "the headers are {len} bytes, over the outbox's limit of {max} bytes"
            ),
            Refused::InvalidHeader(why) => write!(f, "invalid header: {why}"),
            Refused::InvalidTraceparent(why) => write!(f, "invalid traceparent: {why}"),
        }
    }
}

impl std::error::Error for Refused {}

/// Why [`Outbox::enqueue`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum OutboxError {
    /// The message was refused before anything was written.
    Refused(Refused),
    /// The outbox holds another message under this id: another destination or payload
    /// for the same cause and slot. A handler must send the same message for the same
    /// cause on every run; two different messages need two slots.
    Conflict {
        /// The id both messages derive.
        id: OutgoingId,
    },
    /// The outbox table does not exist: run [`migrate`] (or [`migrate_table`]) first.
    MissingTable {
        /// The table the outbox uses.
        table: Table,
        /// The database's error.
        error: sqlx::Error,
    },
    /// The database failed.
    Database(sqlx::Error),
    /// The relay's heartbeat is not shorter than its lease: a claim would run out between
    /// two renewals. Refused by [`Relay::relay_batch`](Relay::relay_batch) and
    /// [`Relay::run`](Relay::run) before they claim anything.
    HeartbeatNotUnderLease {
        /// [`Relay::heartbeat`](Relay::heartbeat).
        heartbeat: Duration,
        /// [`Relay::lease`](Relay::lease).
        lease: Duration,
    },
}

impl fmt::Display for OutboxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OutboxError::Refused(refused) => {
                write!(f, "outgoing message refused by the outbox: {refused}")
            }
            OutboxError::Conflict { id } => write!(
                f,
                "the outbox holds another message under the id {id}: the same cause and slot \
                 must send the same destination and payload on every run (use another slot)"
            ),
            OutboxError::MissingTable { table, .. } => write!(
                f,
                "the outbox table `{}` does not exist: run `dedup_runtime::outbox::migrate` first",
                table.name()
            ),
            OutboxError::Database(error) => write!(f, "outbox: {error}"),
            OutboxError::HeartbeatNotUnderLease { heartbeat, lease } => write!(
                f,
                "the outbox relay's heartbeat ({heartbeat:?}) is not shorter than its lease \
                 ({lease:?}): its claims would run out between renewals; set a heartbeat of \
                 at most a third of the lease, or leave it unset"
            ),
        }
    }
}

impl std::error::Error for OutboxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OutboxError::Refused(refused) => Some(refused),
            OutboxError::Conflict { .. } | OutboxError::HeartbeatNotUnderLease { .. } => None,
            OutboxError::MissingTable { error, .. } | OutboxError::Database(error) => Some(error),
        }
    }
}

/// For a handler whose error type is built `From<sqlx::Error>` (as `#[idempotent]`
/// bodies' often are): the database's own error as it was — so that a transient failure
/// is still retried — and a refusal or a conflict as `sqlx::Error::InvalidArgument` with
/// this error's text.
impl From<OutboxError> for sqlx::Error {
    fn from(error: OutboxError) -> sqlx::Error {
        match error {
            OutboxError::Database(error) | OutboxError::MissingTable { error, .. } => error,
            other => sqlx::Error::InvalidArgument(other.to_string()),
        }
    }
}

/// A dead outgoing message ([`Outbox::dead`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadOutgoing {
    /// Its id.
    pub id: OutgoingId,
    /// Where it was to go.
    pub destination: String,
    /// The attempts made.
    pub attempts: u32,
    /// The last attempt's error: the publisher's, or that its relay stopped.
    pub last_error: Option<String>,
}

/// The shortest time between two of [`Outbox::hint`]'s `NOTIFY`s from one outbox (and its
/// clones), as the inbox's ([`inbox::HINT_GAP`](crate::inbox::HINT_GAP)).
pub const HINT_GAP: Duration = crate::queue::HINT_GAP;

/// What [`Outbox::stats`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Waiting for a relay (due now or after their backoff).
    pub unsent: u64,
    /// Claimed by a relay, being sent.
    pub claimed: u64,
    /// Sent (kept until pruned).
    pub sent: u64,
    /// Dead: their attempts used up, waiting for an operator.
    pub dead: u64,
    /// How long ago the oldest unsent row was enqueued.
    pub oldest_unsent: Option<Duration>,
    /// How long ago a relay last ran; `None` if none ever did.
    pub relay_last_seen: Option<Duration>,
}

/// What [`Outbox::health`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// A relay ran within the allowed silence.
    Healthy,
    /// No relay ran within it.
    RelayStale {
        /// How long ago one last ran; `None` if none ever did.
        last_seen: Option<Duration>,
    },
}

/// An outbox table, and the payload limit it enforces. Cheap to clone; it holds no pool:
/// [`enqueue`](Self::enqueue) writes on the caller's connection.
#[derive(Debug, Clone)]
pub struct Outbox {
    table: Table,
    max_payload_len: usize,
    /// With [`Outbox::notify_relay`]: when the last hint went out, shared by clones.
    hints: Option<std::sync::Arc<crate::queue::Hints>>,
    /// [`Outbox::trace_context`].
    trace_context: Option<fn() -> Option<String>>,
}

/// Pruning an outbox: [`Prune`](crate::Prune)'s loop on the outbox's sent rows.
impl crate::Prune {
    /// Deletes `outbox`'s rows sent more than the age ago, as [`run`](crate::Prune::run) does the
    /// dedup table's: batch by batch, with the same rest and the same refusals. Unsent,
    /// claimed and dead rows are never deleted. A sent row's only use left is to make a
    /// handler that runs again for its cause find it (`Enqueued::Duplicate`): keep it as
    /// long as the broker may redeliver that cause — the redelivery window; once pruned,
    /// such a handler sends the message again with the same id, which the consumer
    /// downstream dedups. A consumer or table set on this `Prune` plays no part.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// use dedup_runtime::{Prune, outbox::Outbox};
    ///
    /// dedup_runtime::outbox::migrate(&pool).await?;
    /// let day = Duration::from_secs(24 * 3600);
    /// let done = Prune::new(7 * day, 4 * day)
    ///     .run_outbox(&Outbox::new(), &pool, |_| {})
    ///     .await?;
    /// assert_eq!((done.deleted, done.done), (0, true));
    /// # Ok(()) }
    /// ```
    pub async fn run_outbox<DB: Backend>(
        &self,
        outbox: &Outbox,
        pool: &Pool<DB>,
        progress: impl FnMut(&crate::PruneProgress),
    ) -> Result<crate::PruneProgress, crate::PruneError> {
        self.validate()?;
        let table = outbox.table();
        // `sent_at` is written by the relay's mark, a statement of its own: the age needs
        // no margin for a long transaction.
        let cutoff = DB::cutoff(pool, self.older_than).await?;
        let rows = SentRows {
            pool,
            table,
            age_us: crate::clock::micros(self.older_than),
            limit: i64::from(self.batch_size),
        };
        self.batches(cutoff, progress, rows).await
    }
}

/// An outbox's sent rows older than the age, each batch's cutoff `now − age` on the
/// database's clock.
struct SentRows<'a, DB: Database> {
    pool: &'a Pool<DB>,
    table: &'a Table,
    age_us: i64,
    limit: i64,
}

impl<DB: Backend> crate::prune::PrunedRows for SentRows<'_, DB> {
    async fn delete_batch(&mut self, _cutoff: &str) -> Result<u64, crate::PruneError> {
        let (pool, table, age_us, limit) = (self.pool, self.table, self.age_us, self.limit);
        crate::retry::retry_transient::<DB, _, _>(|| DB::outbox_prune(pool, table, age_us, limit))
            .await
            .map_err(|error| crate::PruneError::from_database::<DB>(table, error))
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new()
    }
}

impl Outbox {
    /// The outbox in `outbox_messages`, with a payload limit of 1 MiB.
    pub fn new() -> Outbox {
        Outbox {
            table: Table::new(DEFAULT_TABLE).expect("the default table name is valid"),
            max_payload_len: DEFAULT_MAX_PAYLOAD_LEN,
            hints: None,
            trace_context: None,
        }
    }

    /// The same outbox in the table `table` (`schema.name` allowed), created by
    /// [`migrate_table`]; the name is checked here.
    ///
    /// ```
    /// use dedup_runtime::outbox::Outbox;
    ///
    /// let outbox = Outbox::new().in_table("audit.outbox")?;
    /// assert_eq!(outbox.table().name(), "audit.outbox");
    /// assert!(Outbox::new().in_table("t; DROP TABLE users").is_err());
    /// # Ok::<(), dedup_runtime::InvalidTableName>(())
    /// ```
    pub fn in_table(self, table: &str) -> Result<Outbox, InvalidTableName> {
        Ok(Outbox {
            table: Table::new(table)?,
            ..self
        })
    }

    /// The payload limit, at most [`MAX_PAYLOAD_LEN`].
    pub fn max_payload_len(self, max: usize) -> Outbox {
        Outbox {
            max_payload_len: max.min(MAX_PAYLOAD_LEN),
            ..self
        }
    }

    /// The table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Where the trace context of a message enqueued without one
    /// ([`Outgoing::traceparent`]) comes from: `hook` is called at each such
    /// [`enqueue`](Self::enqueue), in the handler's span, and returns the W3C
    /// `traceparent` of the current span, or `None`. This crate depends on `tracing`
    /// only; with `tracing-opentelemetry` the hook is a few lines of yours (the current
    /// span's context through your propagator). A value that is not a `traceparent` is
    /// refused, as the setter's is.
    ///
    /// ```
    /// use dedup_runtime::outbox::Outbox;
    ///
    /// fn current_traceparent() -> Option<String> {
    ///     // With tracing-opentelemetry: inject `tracing::Span::current().context()`
    ///     // through `TraceContextPropagator` and return its `traceparent` entry.
    ///     None
    /// }
    ///
    /// let outbox = Outbox::new().trace_context(current_traceparent);
    /// ```
    pub fn trace_context(self, hook: fn() -> Option<String>) -> Outbox {
        Outbox {
            trace_context: Some(hook),
            ..self
        }
    }

    /// Whether [`hint`](Self::hint) wakes idle relays (PostgreSQL: a `NOTIFY`, at most
    /// one per [`HINT_GAP`] from this outbox and its clones). Off by default.
    pub fn notify_relay(self, notify: bool) -> Outbox {
        Outbox {
            hints: notify.then(|| std::sync::Arc::new(crate::queue::Hints::new())),
            ..self
        }
    }

    /// After the transaction that enqueued has committed (an `#[idempotent]` handler
    /// that returned `Processed`, your own `tx.commit()`): wakes an idle relay at once,
    /// on PostgreSQL, with [`notify_relay`](Self::notify_relay) on. A hint only, sent on
    /// the pool outside any transaction (a `NOTIFY` inside the handler's would hold the
    /// lock every notifying commit takes): relays poll all the same, so a lost hint, or a
    /// hint not sent, delays nothing beyond their poll interval. A no-op otherwise, and
    /// on SQLite and MySQL/MariaDB, whose relays poll. A failure is only logged.
    pub async fn hint<DB: Backend>(&self, pool: &Pool<DB>) {
        let Some(hints) = &self.hints else { return };
        if !hints.take(HINT_GAP) {
            return;
        }
        if let Err(error) = DB::wake_notify(pool, &self.table).await {
            tracing::debug!(%error, "outbox: the hint to the relay failed; it polls");
        }
    }

    /// Writes `message` to the outbox on `conn` — the handler's transaction: the
    /// `#[idempotent]` body's `tx`, or `&mut *tx` of a plain `sqlx::Transaction` — so that
    /// it commits with the handler's effects, or rolls back with them. One insert (and,
    /// when the id is there already, a read of that row): [`Enqueued::Duplicate`] when the
    /// outbox holds the same message, [`OutboxError::Conflict`] when it holds another one
    /// under the same id. It never aborts the caller's transaction (no duplicate-key error
    /// inside a PostgreSQL transaction; on MySQL InnoDB rolls back only the statement).
    pub async fn enqueue<C: OutboxConnection>(
        &self,
        conn: &mut C,
        message: &Outgoing<'_>,
    ) -> Result<Enqueued, OutboxError> {
        self.check(message).map_err(OutboxError::Refused)?;
        let hooked = match (message.traceparent, self.trace_context) {
            (None, Some(hook)) => hook(),
            _ => None,
        };
        if let Some(traceparent) = &hooked {
            check_traceparent(traceparent).map_err(OutboxError::Refused)?;
        }
        let row = Row {
            id: message.id,
            consumer: &message.cause.consumer,
            cause_id: &message.cause.incoming,
            slot: &message.slot,
            destination: message.destination,
            payload: message.payload,
            headers: (!message.headers.is_empty()).then_some(message.headers.as_slice()),
            ordering_key: message.ordering_key,
            traceparent: message.traceparent.or(hooked.as_deref()),
        };
        let conn = conn.connection();
        let inserted = <C::Database as OutboxBackend>::outbox_insert(conn, &self.table, &row)
            .await
            .map_err(|error| self.classify::<C::Database>(error))?;
        match inserted {
            Inserted::Stored => Ok(Enqueued::Stored),
            Inserted::Existing {
                destination,
                payload,
            } if destination == message.destination.as_bytes() && payload == message.payload => {
                Ok(Enqueued::Duplicate)
            }
            Inserted::Existing { .. } => Err(OutboxError::Conflict { id: message.id }),
        }
    }

    /// The outbox's rows by state, how long the oldest unsent one has waited and when a
    /// relay last ran (all on the database's clock); also recorded as the gauges
    /// `dedup_outbox_rows{table, state}`, `dedup_outbox_oldest_unsent_seconds{table}` and
    /// `dedup_outbox_relay_last_seen_seconds{table}` (feature `metrics`).
    pub async fn stats<DB: Backend>(&self, pool: &Pool<DB>) -> Result<OutboxStats, OutboxError> {
        let (unsent, claimed, sent, dead, oldest, seen) = DB::outbox_stats(pool, &self.table)
            .await
            .map_err(|error| self.classify::<DB>(error))?;
        let count = |n: i64| n.max(0) as u64;
        let ago = |us: Option<i64>| us.map(|us| Duration::from_micros(count(us)));
        let stats = OutboxStats {
            unsent: count(unsent),
            claimed: count(claimed),
            sent: count(sent),
            dead: count(dead),
            oldest_unsent: ago(oldest),
            relay_last_seen: ago(seen),
        };
        for (state, n) in [
            ("unsent", stats.unsent),
            ("claimed", stats.claimed),
            ("sent", stats.sent),
            ("dead", stats.dead),
        ] {
            crate::metrics::outbox_gauge(
                "dedup_outbox_rows",
                self.table.name(),
                Some(("state", state)),
                n as f64,
            );
        }
        crate::metrics::outbox_gauge(
            "dedup_outbox_oldest_unsent_seconds",
            self.table.name(),
            None,
            stats.oldest_unsent.map_or(0.0, |age| age.as_secs_f64()),
        );
        if let Some(seen) = stats.relay_last_seen {
            crate::metrics::outbox_gauge(
                "dedup_outbox_relay_last_seen_seconds",
                self.table.name(),
                None,
                seen.as_secs_f64(),
            );
        }
        Ok(stats)
    }

    /// Whether a relay has run within `max_silence` (a relay records that it ran at most
    /// once a second, idle or not): [`Health::RelayStale`] when none has — never, or not
    /// since — so that a relay that silently stopped turns a health check red instead of
    /// leaving messages unsent for days.
    pub async fn health<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        max_silence: Duration,
    ) -> Result<Health, OutboxError> {
        let stats = self.stats(pool).await?;
        Ok(match stats.relay_last_seen {
            Some(seen) if seen <= max_silence => Health::Healthy,
            last_seen => Health::RelayStale { last_seen },
        })
    }

    /// Up to `limit` dead rows, oldest first, each with its attempts and last error.
    pub async fn dead<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        limit: u32,
    ) -> Result<Vec<DeadOutgoing>, OutboxError> {
        DB::outbox_dead(pool, &self.table, i64::from(limit))
            .await
            .map_err(|error| self.classify::<DB>(error))
    }

    /// Re-queues the dead row `id`: unsent again, due now, its attempts back to 0, for
    /// the relay to send. `false` when `id` is not dead.
    pub async fn requeue<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        id: OutgoingId,
    ) -> Result<bool, OutboxError> {
        self.resolve_dead(pool, id, true).await
    }

    /// Discards the dead row `id`: recorded as sent without sending (so that a handler
    /// that runs again for its cause finds it, and does not send it either), its last
    /// error kept; pruned with the sent rows. `false` when `id` is not dead.
    pub async fn discard<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        id: OutgoingId,
    ) -> Result<bool, OutboxError> {
        self.resolve_dead(pool, id, false).await
    }

    async fn resolve_dead<DB: Backend>(
        &self,
        pool: &Pool<DB>,
        id: OutgoingId,
        requeue: bool,
    ) -> Result<bool, OutboxError> {
        let done = DB::outbox_resolve(pool, &self.table, id, requeue)
            .await
            .map_err(|error| self.classify::<DB>(error))?;
        if done {
            let what = if requeue { "re-queued" } else { "discarded" };
            tracing::info!(id = %id, "dead outbox message {what}");
        }
        Ok(done)
    }

    fn check(&self, message: &Outgoing<'_>) -> Result<(), Refused> {
        check_name(message.destination).map_err(Refused::InvalidDestination)?;
        if let Some(key) = message.ordering_key {
            check_name(key).map_err(Refused::InvalidOrderingKey)?;
        }
        if message.payload.len() > self.max_payload_len {
            return Err(Refused::PayloadTooLarge {
                len: message.payload.len(),
                max: self.max_payload_len,
            });
        }
        if message.headers.len() > MAX_HEADERS_LEN {
            return Err(Refused::HeadersTooLarge {
                len: message.headers.len(),
                max: MAX_HEADERS_LEN,
            });
        }
        headers::check(&message.headers).map_err(Refused::InvalidHeader)?;
        if let Some(traceparent) = message.traceparent {
            check_traceparent(traceparent)?;
        }
        Ok(())
    }

    /// `MissingTable` when the outbox table, or the relays' table beside it
    /// ([`relay_table`]: `migrate` creates both), does not exist.
    fn classify<DB: Backend>(&self, error: sqlx::Error) -> OutboxError {
        let relay_table_missing = || {
            Table::new(&relay_table(&self.table))
                .is_ok_and(|relay| DB::is_missing_table(&error, &relay))
        };
        if DB::is_missing_table(&error, &self.table) || relay_table_missing() {
            OutboxError::MissingTable {
                table: self.table.clone(),
                error,
            }
        } else {
            OutboxError::Database(error)
        }
    }
}

/// The rules of a destination or an ordering key: 1 to 255 bytes, no NUL.
/// The length of a version-00 W3C `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;

/// A W3C `traceparent` of version `00`: `00-` 32 hex digits (not all zero) `-` 16 hex
/// digits (not all zero) `-` 2 hex digits, lowercase, 55 bytes in all.
fn check_traceparent(value: &str) -> Result<(), Refused> {
    let refuse = |why: &str| Err(Refused::InvalidTraceparent(format!("{value:?}: {why}")));
    let bytes = value.as_bytes();
    if bytes.len() != TRACEPARENT_LEN {
        return refuse(&format!(
            "{} bytes, where a traceparent has {TRACEPARENT_LEN}",
            bytes.len()
        ));
    }
    let hex = |range: std::ops::Range<usize>| {
        bytes[range]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    if !(bytes[2] == b'-' && bytes[35] == b'-' && bytes[52] == b'-') {
        return refuse("not four fields joined by '-'");
    }
    if !(hex(0..2) && hex(3..35) && hex(36..52) && hex(53..55)) {
        return refuse("the fields are not lowercase hex digits");
    }
    if &bytes[0..2] != b"00" {
        return refuse("only version 00 is stored");
    }
    if bytes[3..35].iter().all(|b| *b == b'0') {
        return refuse("the trace id is all zeros");
    }
    if bytes[36..52].iter().all(|b| *b == b'0') {
        return refuse("the parent id is all zeros");
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        Err("it is empty".to_owned())
    } else if name.len() > MAX_NAME_LEN {
        Err(format!(
            "it is {} bytes, over the limit of {MAX_NAME_LEN}",
            name.len()
        ))
    } else if let Some(position) = name.bytes().position(|byte| byte == 0) {
        Err(format!("it contains a NUL byte at {position}"))
    } else {
        Ok(())
    }
}

/// A connection an outgoing message can be enqueued on: `sqlx::PgConnection`,
/// `sqlx::MySqlConnection`, `sqlx::SqliteConnection` — what an `#[idempotent]` body's
/// `tx` is, and what `&mut *tx` of a `sqlx::Transaction` or a pooled connection gives.
pub trait OutboxConnection: Send + crate::backend::Sealed {
    /// Its database.
    #[doc(hidden)]
    type Database: Backend;

    /// Itself, as its database's connection.
    #[doc(hidden)]
    fn connection(&mut self) -> &mut <Self::Database as Database>::Connection;
}

macro_rules! outbox_connections {
    ($($feature:literal => $connection:ty, $database:ty),* $(,)?) => {$(
        #[cfg(feature = $feature)]
        impl crate::backend::Sealed for $connection {}
        #[cfg(feature = $feature)]
        impl OutboxConnection for $connection {
            type Database = $database;

            fn connection(&mut self) -> &mut $connection {
                self
            }
        }
    )*};
}

outbox_connections! {
    "mysql" => sqlx::MySqlConnection, sqlx::MySql,
    "postgres" => sqlx::PgConnection, sqlx::Postgres,
    "sqlite" => sqlx::SqliteConnection, sqlx::Sqlite,
}

/// One row to insert, validated.
#[doc(hidden)]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub struct Row<'a> {
    pub(crate) id: OutgoingId,
    pub(crate) consumer: &'a str,
    pub(crate) cause_id: &'a str,
    pub(crate) slot: &'a str,
    pub(crate) destination: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: Option<&'a [u8]>,
    pub(crate) ordering_key: Option<&'a str>,
    pub(crate) traceparent: Option<&'a str>,
}

/// What [`OutboxBackend::outbox_stats`] reads.
#[doc(hidden)]
pub type StatsRow = (i64, i64, i64, i64, Option<i64>, Option<i64>);

/// The table the relays' sign of life is kept in: the outbox's name and `_relay`.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn relay_table(table: &Table) -> String {
    format!("{}_relay", table.name())
}

/// What an insert found.
#[doc(hidden)]
pub enum Inserted {
    Stored,
    /// A row with the id was there: its destination and payload.
    Existing {
        destination: Vec<u8>,
        payload: Vec<u8>,
    },
}
