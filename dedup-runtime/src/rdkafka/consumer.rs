//! The hosted Kafka consumer: [`KafkaConsumer`].
//!
//! Two sides meet here. A thread of the consumer's own polls librdkafka (its
//! `BaseConsumer`): rebalance callbacks, offset commits and the pause of a partition that
//! is not keeping up all happen on it, one at a time, so that a commit never races a
//! revocation. Each assigned partition has a *lane* on the async side, driven inside
//! [`KafkaConsumer::run`]'s own future: its records in offset order, one at a time, each
//! through the handler and [`AckPolicy`], then marked finished. The poll thread commits
//! the offset after the last finished record of each partition — never past a record in
//! flight.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use ::rdkafka::client::DefaultClientContext;
use ::rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use ::rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use ::rdkafka::message::{Header, Headers, Message as _, OwnedHeaders, OwnedMessage};
use ::rdkafka::producer::{FutureProducer, FutureRecord};
use ::rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use sqlx::Pool;
use tokio::sync::{mpsc, oneshot, watch};

use crate::ack::{Ack, AckOutcome, AckPolicy, DecideError};
use crate::backend::Backend;
use crate::batch::BatchOutcome;
use crate::consume::calls::{Settlement, item_settlement};
use crate::consume::shared::{self, Meter};
use crate::consume::{Consumed, Message, TraceParent};
use crate::offsets::{OffsetRow, PENDING, Pending};

/// Where a Kafka consumer reads each record's id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIdFrom {
    /// The record header of that name, as UTF-8; of several headers of that name, the
    /// last (Kafka's `lastHeader`). `Header("id")` is the default: where
    /// [`KafkaPublisher`](super::KafkaPublisher) puts the outgoing id.
    Header(String),
    /// The record's key, as UTF-8. Only where every record has a key of its own: a key
    /// names an entity, and two messages about one entity share it.
    Key,
}

/// The headers a dead letter's copy carries, beside the original's: where it came from
/// and why it was dead-lettered.
pub mod provenance {
    /// The topic the record was read from.
    pub const TOPIC: &str = "dedup-source-topic";
    /// Its partition there (decimal).
    pub const PARTITION: &str = "dedup-source-partition";
    /// Its offset in that partition (decimal).
    pub const OFFSET: &str = "dedup-source-offset";
    /// Its timestamp, milliseconds since the epoch (decimal); absent when it had none.
    pub const TIMESTAMP: &str = "dedup-source-timestamp";
    /// The consumer group that read it (`group.id`).
    pub const GROUP: &str = "dedup-source-group";
    /// How many times the handler was called for it by this consumer (decimal, from 1).
    pub const ATTEMPTS: &str = "dedup-attempts";
    /// The Rust type of the handler's error; absent when the handler returned no error.
    pub const ERROR_CLASS: &str = "dedup-error-class";
    /// The handler's error, as its `Display` writes it (control characters made spaces,
    /// cut at [`ERROR_LIMIT`] bytes with a `…`); absent when the handler returned no
    /// error.
    pub const ERROR: &str = "dedup-error";
    /// The longest error text kept, in bytes.
    pub const ERROR_LIMIT: usize = crate::consume::shared::ERROR_LIMIT;
}

/// Runs an `#[idempotent]` handler for every record of a Kafka topic, as a member of a
/// consumer group, and owns everything between the broker and the handler:
///
/// - **Each partition in offset order, partitions side by side.** A partition's records
///   go through the handler one at a time, in order; the records of different partitions
///   run at the same time (on the caller's task: no task is spawned).
/// - **Commits after the transaction, never past a record in flight.** The consumer
///   commits offsets itself (`enable.auto.commit` and `enable.auto.offset.store` are set
///   to `false`): every [`commit_interval`](Self::commit_interval), for each partition,
///   the offset after its last *finished* record — processed (committed) or a duplicate,
///   dead-lettered, or given up at its attempts' limit. A record whose transaction has not
///   committed is never covered, so a crash delivers it again, and the dedup record makes
///   a committed one a duplicate.
/// - **Rebalances.** When partitions are revoked (eager or `cooperative-sticky`
///   assignment), the consumer stops their lanes, lets the record in hand finish (within
///   the [`shutdown_deadline`](Self::shutdown_deadline); one not finished by then is
///   dropped and its transaction rolls back), and commits their offsets synchronously
///   *inside* the revoke callback, before the partitions leave. Partitions **lost**
///   (the member fell out of the group) are never committed: another member owns them.
/// - **Retries in place.** [`AckPolicy`]'s `Retry { after }`: the record waits `after`
///   in its lane, which holds the partition's later records — Kafka's order is kept — and
///   is handed to the handler again. Kafka keeps no delivery count: the count the
///   handler and the policy see is this consumer's own, from 1 (a record read again after
///   a restart or a rebalance starts at 1 again).
/// - **Dead letters** (`Ack::DeadLetter`): a copy of the record — payload, key and headers
///   — plus the [`provenance`] headers, produced to the [dead topic](Self::dead_topic)
///   (`<topic>.dead` by default) on the same partition number, and its offset committed
///   once the broker acknowledged the copy — at once, not at the next interval. The dead
///   topic is created at start with
///   the topic's partition count when it does not exist; one with fewer partitions is
///   refused ([`ConsumeError::DeadTopic`]). A process killed between the copy and the
///   offset's commit copies the record again when it is read again: a dead letter is
///   stored at least once, and its [`provenance`] (topic, partition, offset) tells copies
///   apart.
/// - **Bounds what it holds**: at most [`prefetch`](Self::prefetch) records per
///   partition wait in its lane; when a lane is full the consumer stops taking records,
///   and a partition full for a second is paused (and resumed when its lane has drained
///   to half), so that one slow partition does not hold the others. The poll loop keeps
///   running, so the member stays in its group (`max.poll.interval.ms`) during a long
///   handler.
/// - **Survives its broker**: librdkafka reconnects by itself; records are not lost by a
///   cut connection, and a commit that failed is made again at the next interval.
/// - **Stops gracefully** when the future given to [`run`](Self::run) completes: it stops
///   taking records, lets the record in hand of each partition finish within the
///   [`shutdown_deadline`](Self::shutdown_deadline) (those not finished by then are
///   dropped, their transactions rolled back), commits what finished synchronously, and
///   closes the consumer (leaving its group) — in that order.
///
/// The consumer is made from your [`ClientConfig`] (`bootstrap.servers`, `group.id` —
/// required —, security, timeouts): the consumer takes it as it is, but for the two
/// commit settings above and `auto.offset.reset`, set to `earliest` unless you set it (a
/// new group starts at the first record, not after the last). The dead letters' producer
/// is made from the same configuration, with `acks=all` and idempotence.
///
/// ```no_run
/// use dedup_runtime::consume::Message;
/// use dedup_runtime::idempotent;
/// use dedup_runtime::rdkafka::KafkaConsumer;
/// use rdkafka::ClientConfig;
///
/// #[idempotent(consumer = "payments", key = msg.id())]
/// async fn apply(tx: &mut sqlx::PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO payments (body) VALUES ($1)")
///         .bind(msg.payload())
///         .execute(&mut *tx)
///         .await?;
///     Ok(())
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = ClientConfig::new();
/// config
///     .set("bootstrap.servers", "127.0.0.1:9092")
///     .set("group.id", "payments");
/// let consumer = KafkaConsumer::new(config, "payments");
/// let shutdown = std::future::pending(); // SIGTERM, in a service
/// let consumed = consumer
///     .run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, shutdown)
///     .await?;
/// println!("{consumed:?}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaConsumer {
    config: ClientConfig,
    topic: String,
    dead_topic: Option<String>,
    message_id: MessageIdFrom,
    prefetch: usize,
    shutdown_deadline: Duration,
    trace_parent: Option<TraceParent>,
    commit_interval: Duration,
    offsets_in_database: bool,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the configuration: it may hold a password (`sasl.password`).
        f.debug_struct("KafkaConsumer")
            .field("topic", &self.topic)
            .field("group", &self.config.get("group.id"))
            .field("dead_topic", &self.dead_topic())
            .field("message_id", &self.message_id)
            .field("prefetch", &self.prefetch)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("trace_parent", &self.trace_parent.is_some())
            .field("commit_interval", &self.commit_interval)
            .field("offsets_in_database", &self.offsets_in_database)
            .finish_non_exhaustive()
    }
}

/// Why [`KafkaConsumer::run`] ended before its shutdown.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The configuration has no `group.id`: without a group there are no committed
    /// offsets, and every start would read from `auto.offset.reset` again.
    NoGroup,
    /// The topic does not exist (or the broker did not answer its metadata in time).
    NoTopic(String),
    /// The dead topic has fewer partitions than the topic: a dead letter goes to its
    /// record's partition number.
    DeadTopic {
        /// The dead topic.
        topic: String,
        /// Its partitions.
        partitions: usize,
        /// The partitions it needs at least: the topic's.
        needed: usize,
    },
    /// librdkafka refused the configuration, the subscription or the dead topic's
    /// creation.
    Start(KafkaError),
    /// Offsets-in-database mode: the offsets' table could not be created.
    Database(sqlx::Error),
    /// [`offsets_in_database`](KafkaConsumer::offsets_in_database) is on for
    /// [`run_batches`](KafkaConsumer::run_batches): a batch's transactions do not write
    /// the partition's position (the mode is for [`run`](KafkaConsumer::run) and
    /// [`run_with`](KafkaConsumer::run_with)), so the run is refused rather than keep
    /// nothing in the database.
    OffsetsInBatches,
}

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumeError::NoGroup => write!(
                f,
                "Kafka consumer could not start: its configuration has no `group.id`; set \
                 one (`config.set(\"group.id\", \"…\")`): its committed offsets are the \
                 consumer's progress"
            ),
            ConsumeError::NoTopic(topic) => {
                write!(f, "Kafka consumer could not start: no topic `{topic}`")
            }
            ConsumeError::DeadTopic {
                topic,
                partitions,
                needed,
            } => write!(
                f,
                "Kafka consumer could not start: dead topic `{topic}` has {partitions} \
                 partitions, fewer than the topic's {needed}; a dead letter goes to its \
                 record's partition number, so give it {needed} or more"
            ),
            ConsumeError::Start(error) => write!(f, "Kafka consumer could not start: {error}"),
            ConsumeError::Database(error) => write!(
                f,
                "Kafka consumer could not start: the offsets' table `dedup_kafka_offsets` \
                 could not be created: {error}"
            ),
            ConsumeError::OffsetsInBatches => write!(
                f,
                "Kafka consumer could not start: `offsets_in_database(true)` works with \
                 `run` and `run_with` only (a batch's transactions do not write the \
                 partition's position); turn it off for `run_batches`, or use `run`"
            ),
        }
    }
}

impl std::error::Error for ConsumeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsumeError::Start(error) => Some(error),
            ConsumeError::Database(error) => Some(error),
            _ => None,
        }
    }
}

/// How often the finished offsets are committed again even when unchanged.
const RECOMMIT: Duration = Duration::from_secs(5);

/// How long a partition's lane may stay full before the partition is paused.
const STALL: Duration = Duration::from_secs(1);
/// How long the start may wait for the broker's metadata.
const METADATA: Duration = Duration::from_secs(10);
/// The poll's wait when nothing comes.
const POLL: Duration = Duration::from_millis(100);

impl KafkaConsumer {
    /// A consumer of `topic` made from `config` (which must name a `group.id`): ids from
    /// the header `id`, a prefetch of 64 records per partition, offsets committed every
    /// second, a 10 s shutdown deadline, dead letters to `<topic>.dead`.
    pub fn new(config: ClientConfig, topic: &str) -> Self {
        KafkaConsumer {
            config,
            topic: topic.to_owned(),
            dead_topic: None,
            message_id: MessageIdFrom::Header("id".to_owned()),
            prefetch: 64,
            shutdown_deadline: Duration::from_secs(10),
            trace_parent: None,
            commit_interval: Duration::from_secs(1),
            offsets_in_database: false,
        }
    }

    /// The topic dead letters go to (`<topic>.dead` by default).
    pub fn dead_topic(&self) -> String {
        self.dead_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dead", self.topic))
    }

    /// Dead letters go to `topic` instead of `<topic>.dead`.
    pub fn with_dead_topic(self, topic: &str) -> Self {
        KafkaConsumer {
            dead_topic: Some(topic.to_owned()),
            ..self
        }
    }

    /// Where each record's id is read ([`MessageIdFrom::Header`]`("id")` by default).
    pub fn message_id(self, from: MessageIdFrom) -> Self {
        KafkaConsumer {
            message_id: from,
            ..self
        }
    }

    /// Records each partition's lane holds at most before the consumer stops taking
    /// records (64 by default; at least 1).
    pub fn prefetch(self, records: usize) -> Self {
        KafkaConsumer {
            prefetch: records.max(1),
            ..self
        }
    }

    /// How often the finished offsets are committed (1 s by default; at least 10 ms).
    /// A shorter interval means fewer records delivered again after a crash, all of them
    /// found duplicates.
    pub fn commit_interval(self, interval: Duration) -> Self {
        KafkaConsumer {
            commit_interval: interval.max(Duration::from_millis(10)),
            ..self
        }
    }

    /// Whether each partition's position is also kept in the database (off by default;
    /// [`run`](Self::run) and [`run_with`](Self::run_with) only: `run_batches` refuses
    /// it, [`ConsumeError::OffsetsInBatches`]). On, the consumer creates
    /// the table `dedup_kafka_offsets` (consumer group, topic, partition → next offset) at
    /// start, and each record's handler writes the offset after the record **in its own
    /// transaction**, just before its `COMMIT` — one row per partition, moved forward,
    /// never back. A duplicate or a failure commits nothing, so it moves nothing (the
    /// Kafka commit does). On each assignment the consumer starts a partition at the greater of
    /// its stored offset and the group's committed offset; a partition with nothing stored
    /// starts at the group's position (its committed offset, or `auto.offset.reset`),
    /// never at offset 0. Offsets are still committed to Kafka as without it.
    ///
    /// What it buys: the position commits with the work, so a lost or failed Kafka commit
    /// (a crash before the next interval, a broker away) does not send the partition's
    /// committed records again — and the group's offsets can be reset or lost without
    /// the consumer reading back what it did. The handler's dedup rows are still written
    /// (the handler is an ordinary `#[idempotent]` function), and still needed whenever a
    /// record can come twice *at different offsets*: a producer that retried without
    /// idempotence, a message re-published upstream or replayed to another topic, two
    /// topics feeding one consumer name. Only where each record is its own id — an
    /// idempotent producer, nothing re-published — would the offset alone be enough to
    /// recognise what was done; dedup keeps both.
    pub fn offsets_in_database(self, on: bool) -> Self {
        KafkaConsumer {
            offsets_in_database: on,
            ..self
        }
    }

    /// How long a record in hand may still take once shutdown began or its partition was
    /// revoked (10 s by default). Keep it under the grace period of whatever stops the
    /// process, and under `max.poll.interval.ms`.
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        KafkaConsumer {
            shutdown_deadline: deadline,
            ..self
        }
    }

    /// The hook that connects each message's consumer span to the producer's trace
    /// (none by default): called with the span — `process`, OpenTelemetry's messaging
    /// names as its fields — and the message, before the handler runs. Set the span's
    /// parent from the message's `traceparent` header through your propagator (with
    /// `tracing-opentelemetry`: `span.set_parent(propagator.extract(&carrier))`), so that
    /// one trace runs from the producer (an outbox's relay sends the `traceparent` its
    /// [`trace_context`](crate::outbox::Outbox::trace_context) hook gave) through this
    /// handler. See [`TraceParent`].
    pub fn trace_parent(self, hook: TraceParent) -> Self {
        KafkaConsumer {
            trace_parent: Some(hook),
            ..self
        }
    }

    /// Consumes until `shutdown` completes, deciding with the default [`AckPolicy`];
    /// see [`run_with`](Self::run_with).
    pub async fn run<DB, F, Fut, O, E>(
        &self,
        pool: &Pool<DB>,
        handler: F,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError>
    where
        DB: Backend,
        F: Fn(Pool<DB>, Arc<Message>) -> Fut + Send + Sync,
        Fut: Future<Output = Result<O, E>> + Send + 'static,
        O: AckOutcome + Send,
        E: DecideError + std::fmt::Display + Send,
    {
        self.run_with(pool, &AckPolicy::new(), handler, shutdown)
            .await
    }

    /// Consumes until `shutdown` completes, calling `handler` for each record and
    /// settling it as `policy` decides; returns what it did. `Err` only when it could not
    /// start; after that the run ends only with `shutdown`.
    ///
    /// `handler` is given the pool and the message, both its own (so that its future is
    /// `'static`): `|pool, msg| async move { apply(&pool, &msg).await }` for an
    /// `#[idempotent]` handler `apply(tx, msg: &Message)`.
    ///
    /// In the [`Consumed`] it returns, `acknowledged` counts records finished as
    /// processed or duplicates, `retried` the handler's calls made again, `dead_lettered`
    /// the copies the dead topic acknowledged, and `requeued` the records taken and left
    /// unfinished at shutdown or at a revocation (read again by whoever owns the partition
    /// next). `dropped` and `reconnects` stay 0: librdkafka reconnects by itself.
    pub async fn run_with<DB, F, Fut, O, E>(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        handler: F,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError>
    where
        DB: Backend,
        F: Fn(Pool<DB>, Arc<Message>) -> Fut + Send + Sync,
        Fut: Future<Output = Result<O, E>> + Send + 'static,
        O: AckOutcome + Send,
        E: DecideError + std::fmt::Display + Send,
    {
        let Started {
            group,
            dead,
            producer,
            meter,
            shared,
            lanes_started,
            poll_ended,
        } = self.start(self.stored_offsets(pool).await?).await?;
        let lane = LaneContext {
            consumer: self,
            group: &group,
            dead: &dead,
            producer: &producer,
            pool,
            policy,
            handler: &handler,
            shared: &shared,
            meter: &meter,
        };
        let ended = Ended {
            shared: &shared,
            meter: &meter,
            lanes_started,
            poll_ended,
        };
        Ok(ended.drive(shutdown, |start| lane.run(start)).await)
    }

    /// Consumes until `shutdown` completes, handing each partition's records to an
    /// `#[idempotent(batch = …)]` handler up to `max` at a time, deciding with the
    /// default [`AckPolicy`]; see [`run_batches_with`](Self::run_batches_with).
    pub async fn run_batches<DB, F, Fut, E, B>(
        &self,
        pool: &Pool<DB>,
        max: usize,
        handler: F,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError>
    where
        DB: Backend,
        F: Fn(Pool<DB>, Arc<[Message]>) -> Fut + Send + Sync,
        Fut: Future<Output = Result<BatchOutcome<E>, B>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        B: std::error::Error + Send + 'static,
    {
        self.run_batches_with(pool, max, &AckPolicy::new(), handler, shutdown)
            .await
    }

    /// Consumes until `shutdown` completes, handing the records of each partition to
    /// `handler` in batches: the records its lane holds when the last batch ended, in
    /// offset order, at most `max` (at least 1). The lane holds at least twice `max`,
    /// whatever [`prefetch`](Self::prefetch) says, so that the next batch gathers while
    /// one is in the handler (with `max` alone, a full lane stopped the poll for the
    /// whole call, and the batch after it was what had come back in between: a third of
    /// the hand-written consumer's rate, in the consumers benchmark). `handler` is given the pool and the batch, both
    /// its own: `|pool, batch| async move { apply(&pool, &batch).await }` for an
    /// `#[idempotent(batch = fresh, key = |msg| msg.id())]` handler `apply(tx, fresh:
    /// &[&Message])`: one transaction claims every id, runs the body over the fresh ones,
    /// and commits (see [`batch`](crate::batch)).
    ///
    /// Each record is settled as its [`BatchItem`](crate::batch::BatchItem) says, through `policy`: processed, a
    /// duplicate or a copy of one → finished; a failure the policy calls transient (or
    /// an item in progress under another delivery's lease) → the batch's unsettled
    /// records are handed to the handler again, together, after the longest of their
    /// delays; a permanent failure, an invalid id or a fingerprint mismatch → a dead
    /// letter. A batch whose call failed as a whole is decided on that error for all its
    /// records. The offset after the batch is committed once every record of it is
    /// settled and its dead letters acknowledged; at shutdown or revocation, only the
    /// records before the first unsettled one count as finished. Within a batch, a
    /// record retried is applied after the records of the batch that were not.
    pub async fn run_batches_with<DB, F, Fut, E, B>(
        &self,
        pool: &Pool<DB>,
        max: usize,
        policy: &AckPolicy<DB>,
        handler: F,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError>
    where
        DB: Backend,
        F: Fn(Pool<DB>, Arc<[Message]>) -> Fut + Send + Sync,
        Fut: Future<Output = Result<BatchOutcome<E>, B>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        B: std::error::Error + Send + 'static,
    {
        if self.offsets_in_database {
            return Err(ConsumeError::OffsetsInBatches);
        }
        let max = max.max(1);
        let consumer = KafkaConsumer {
            prefetch: self.prefetch.max(max.saturating_mul(2)),
            ..self.clone()
        };
        let Started {
            group,
            dead,
            producer,
            meter,
            shared,
            lanes_started,
            poll_ended,
        } = consumer.start(None).await?;
        let lane = LaneContext {
            consumer: &consumer,
            group: &group,
            dead: &dead,
            producer: &producer,
            pool,
            policy,
            handler: &handler,
            shared: &shared,
            meter: &meter,
        };
        let ended = Ended {
            shared: &shared,
            meter: &meter,
            lanes_started,
            poll_ended,
        };
        Ok(ended
            .drive(shutdown, |start| lane.run_batches(start, max))
            .await)
    }

    /// In offsets-in-database mode: the table made, and how the poll thread reads the
    /// stored offsets (on the caller's runtime); `None` otherwise.
    async fn stored_offsets<DB: Backend>(
        &self,
        pool: &Pool<DB>,
    ) -> Result<Option<StoredOffsets>, ConsumeError> {
        if !self.offsets_in_database {
            return Ok(None);
        }
        DB::offsets_migrate(pool)
            .await
            .map_err(ConsumeError::Database)?;
        let group = self.config.get("group.id").unwrap_or_default().to_owned();
        let (pool, topic) = (pool.clone(), self.topic.clone());
        let runtime = tokio::runtime::Handle::current();
        Ok(Some(Box::new(move || {
            runtime.block_on(DB::offsets_read(&pool, &group, &topic))
        })))
    }

    /// Checks the group, the topic and the dead topic (creating it if missing),
    /// subscribes and starts the poll thread.
    async fn start(&self, stored: Option<StoredOffsets>) -> Result<Started, ConsumeError> {
        let group = self
            .config
            .get("group.id")
            .filter(|group| !group.is_empty())
            .ok_or(ConsumeError::NoGroup)?
            .to_owned();
        let producer = self.dead_producer()?;
        let meter = Meter::new("kafka", &self.topic, &group);
        let (starts, lanes_started) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::default());
        let (consumer, partitions, dead_partitions) =
            self.connect(shared.clone(), &meter, starts, stored).await?;
        meter.partitions(partitions);
        let dead = self.dead_topic();
        match dead_partitions {
            Some(found) if found < partitions => {
                return Err(ConsumeError::DeadTopic {
                    topic: dead,
                    partitions: found,
                    needed: partitions,
                });
            }
            Some(_) => {}
            None => self.create_dead_topic(&dead, partitions).await?,
        }
        consumer
            .subscribe(&[self.topic.as_str()])
            .map_err(ConsumeError::Start)?;
        let (polled, poll_ended) = oneshot::channel();
        let poller = Poller {
            consumer,
            shared: shared.clone(),
            prefetch: self.prefetch,
            commit_interval: self.commit_interval,
        };
        std::thread::Builder::new()
            .name(format!("dedup-kafka-{}", self.topic))
            .spawn(move || {
                poller.run();
                let _ = polled.send(());
            })
            .map_err(|_| ConsumeError::Start(KafkaError::Global(RDKafkaErrorCode::Fail)))?;
        Ok(Started {
            group,
            dead,
            producer,
            meter,
            shared,
            lanes_started,
            poll_ended,
        })
    }

    /// The consumer (not yet subscribed), the topic's partition count and the dead
    /// topic's (`None` when it does not exist), from the broker's metadata.
    async fn connect(
        &self,
        shared: Arc<Shared>,
        meter: &Meter,
        starts: mpsc::UnboundedSender<LaneStart>,
        stored: Option<StoredOffsets>,
    ) -> Result<(BaseConsumer<Context>, usize, Option<usize>), ConsumeError> {
        let mut config = self.config.clone();
        config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        // The group's committed offsets, read at an assignment by a client of their own
        // (the consumer's own cannot answer inside its rebalance callback). It is never
        // polled: no statistics for it, whose events would pile up unread.
        let stored = match stored {
            None => None,
            Some(read) => {
                let mut reader = config.clone();
                reader.remove("statistics.interval.ms");
                let reader: BaseConsumer = reader.create().map_err(ConsumeError::Start)?;
                Some((read, reader))
            }
        };
        #[cfg(feature = "metrics")]
        if config.get("statistics.interval.ms").is_none() {
            // The lag, as a gauge (see `consume`'s metrics).
            config.set("statistics.interval.ms", "5000");
        }
        let context = Context {
            shared,
            stored,
            started_at: Mutex::default(),
            meter: meter.clone(),
            topic: self.topic.clone(),
            deadline: self.shutdown_deadline,
            starts: Mutex::new(Some(starts)),
        };
        let consumer: BaseConsumer<Context> = config
            .create_with_context(context)
            .map_err(ConsumeError::Start)?;
        let (topic, dead) = (self.topic.clone(), self.dead_topic());
        // Metadata calls block: on a thread of the runtime's blocking pool.
        let counted = tokio::task::spawn_blocking(move || {
            let count = |name: &str| -> KafkaResult<Option<usize>> {
                let metadata = consumer.fetch_metadata(Some(name), METADATA)?;
                Ok(metadata
                    .topics()
                    .iter()
                    .find(|found| found.name() == name && found.error().is_none())
                    .map(|found| found.partitions().len())
                    .filter(|&partitions| partitions > 0))
            };
            let partitions = count(&topic);
            let dead_partitions = count(&dead);
            (consumer, partitions, dead_partitions)
        })
        .await
        .map_err(|_| ConsumeError::NoTopic(self.topic.clone()))?;
        let (consumer, partitions, dead_partitions) = counted;
        let partitions = partitions
            .map_err(ConsumeError::Start)?
            .ok_or_else(|| ConsumeError::NoTopic(self.topic.clone()))?;
        let dead_partitions = dead_partitions.map_err(ConsumeError::Start)?;
        Ok((consumer, partitions, dead_partitions))
    }

    /// Creates the dead topic with `partitions` partitions and the broker's default
    /// replication; one created meanwhile by someone else is fine.
    async fn create_dead_topic(&self, dead: &str, partitions: usize) -> Result<(), ConsumeError> {
        let admin: AdminClient<DefaultClientContext> = self
            .producer_config()
            .create()
            .map_err(ConsumeError::Start)?;
        let count = i32::try_from(partitions).unwrap_or(i32::MAX);
        let topic = NewTopic::new(dead, count, TopicReplication::Fixed(-1));
        let options = AdminOptions::new().operation_timeout(Some(METADATA));
        let created = admin
            .create_topics([&topic], &options)
            .await
            .map_err(ConsumeError::Start)?;
        for result in created {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, code)) => return Err(ConsumeError::Start(KafkaError::AdminOp(code))),
            }
        }
        Ok(())
    }

    /// The user's configuration without what only a consumer takes.
    fn producer_config(&self) -> ClientConfig {
        let mut config = self.config.clone();
        for key in [
            "group.id",
            "group.instance.id",
            "group.protocol",
            "group.remote.assignor",
            "enable.auto.commit",
            "enable.auto.offset.store",
            "auto.commit.interval.ms",
            "auto.offset.reset",
            "partition.assignment.strategy",
            "session.timeout.ms",
            "heartbeat.interval.ms",
            "max.poll.interval.ms",
            "isolation.level",
            "enable.partition.eof",
            "check.crcs",
            "fetch.wait.max.ms",
            "fetch.min.bytes",
            "fetch.max.bytes",
            "fetch.message.max.bytes",
            "queued.min.messages",
            "queued.max.messages.kbytes",
            "statistics.interval.ms",
        ] {
            config.remove(key);
        }
        config
    }

    /// The dead letters' producer: every replica has a copy before its offset commits.
    fn dead_producer(&self) -> Result<FutureProducer, ConsumeError> {
        let mut config = self.producer_config();
        config.set("acks", "all").set("enable.idempotence", "true");
        config.create().map_err(ConsumeError::Start)
    }
}

/// A consumer started by [`KafkaConsumer::start`].
struct Started {
    group: String,
    dead: String,
    producer: FutureProducer,
    meter: Meter,
    shared: Arc<Shared>,
    lanes_started: mpsc::UnboundedReceiver<LaneStart>,
    poll_ended: oneshot::Receiver<()>,
}

/// What a run waits on to end: its lanes, then the poll thread.
struct Ended<'r> {
    shared: &'r Shared,
    meter: &'r Meter,
    lanes_started: mpsc::UnboundedReceiver<LaneStart>,
    poll_ended: oneshot::Receiver<()>,
}

impl Ended<'_> {
    /// Drives the lanes `lane` makes of each partition assigned until shutdown, then
    /// until they ended; then waits for the poll thread's final commit and close.
    async fn drive<L: Future<Output = Consumed>>(
        mut self,
        shutdown: impl Future<Output = ()>,
        lane: impl Fn(LaneStart) -> L,
    ) -> Consumed {
        let mut lanes = FuturesUnordered::new();
        let mut consumed = Consumed::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stopping = false;
        let mut started_open = true;
        std::future::poll_fn(|context| {
            use std::task::Poll;
            if !stopping && shutdown.as_mut().poll(context).is_ready() {
                stopping = true;
                self.shared.stop();
            }
            while started_open {
                match self.lanes_started.poll_recv(context) {
                    Poll::Ready(Some(start)) => lanes.push(lane(start)),
                    Poll::Ready(None) => started_open = false,
                    Poll::Pending => break,
                }
            }
            while let Poll::Ready(Some(done)) = lanes.poll_next_unpin(context) {
                consumed.add(&done);
            }
            // The poll thread drops its end once it stopped; then no lane starts any more.
            if !started_open && lanes.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        // Every lane ended: the poll thread makes the final commit and closes.
        self.shared.lanes_ended();
        let _ = self.poll_ended.await;
        self.meter.finish(&consumed);
        consumed
    }
}

/// What the poll thread and the lanes share, under one lock.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a lane finished or dropped a record, when shutdown began and when
    /// every lane ended.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The assigned partitions.
    parts: HashMap<i32, Part>,
    /// Assignments so far: each lane's generation, so that a lane of an earlier
    /// assignment of a partition touches nothing of the present one.
    generations: u64,
    stopping: bool,
    lanes_ended: bool,
    /// A dead letter finished: commit at the poll thread's next turn rather than at the
    /// interval, so that a crash copies it again as rarely as can be.
    commit_soon: bool,
}

/// An assigned partition, as the poll thread and its lane see it.
struct Part {
    generation: u64,
    /// Its lane's records.
    records: mpsc::UnboundedSender<OwnedMessage>,
    /// Told to its lane when it must leave (revoked, shutdown): the record in hand gets
    /// the deadline, the rest are dropped.
    leave: watch::Sender<bool>,
    /// The offset after its last finished record: what a commit commits.
    finished: Option<i64>,
    /// The last offset committed (or sent to be).
    committed: Option<i64>,
    /// Records given to the lane and not finished or dropped yet.
    held: usize,
    /// A record in the handler.
    busy: bool,
    paused: bool,
    full_since: Option<Instant>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Shutdown began: every lane leaves, the poll thread stops taking records.
    fn stop(&self) {
        let mut state = self.lock();
        state.stopping = true;
        for part in state.parts.values() {
            let _ = part.leave.send(true);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Asks the poll thread to commit at its next turn.
    fn commit_soon(&self) {
        self.lock().commit_soon = true;
        self.changed.notify_all();
    }

    fn lanes_ended(&self) {
        self.lock().lanes_ended = true;
        self.changed.notify_all();
    }

    /// Runs `change` on the partition if it is still the lane's assignment.
    fn update(&self, partition: i32, generation: u64, change: impl FnOnce(&mut Part)) {
        let mut state = self.lock();
        if let Some(part) = state.parts.get_mut(&partition)
            && part.generation == generation
        {
            change(part);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// The offsets to commit, for `partitions` (all assigned when `None`): those past the
    /// last commit, or all when `again`.
    fn offsets(
        state: &mut State,
        topic: &str,
        partitions: Option<&[i32]>,
        again: bool,
    ) -> TopicPartitionList {
        let mut list = TopicPartitionList::new();
        for (&partition, part) in &mut state.parts {
            if partitions.is_some_and(|wanted| !wanted.contains(&partition)) {
                continue;
            }
            if let Some(next) = part.finished
                && (again || part.committed.is_none_or(|committed| committed < next))
                && list
                    .add_partition_offset(topic, partition, Offset::Offset(next))
                    .is_ok()
            {
                part.committed = Some(next);
            }
        }
        list
    }
}

/// A partition assigned: its lane's start.
struct LaneStart {
    partition: i32,
    generation: u64,
    records: mpsc::UnboundedReceiver<OwnedMessage>,
    leave: watch::Receiver<bool>,
}

/// The consumer's context: the rebalance callbacks, on the poll thread.
struct Context {
    shared: Arc<Shared>,
    /// Offsets-in-database mode: the stored offsets, and a client that reads the group's
    /// committed ones.
    stored: Option<(StoredOffsets, BaseConsumer)>,
    /// The offsets the last assignment started at from the database, for
    /// `post_rebalance` to commit to Kafka too (else the group's offset would stay
    /// behind until the partition's next record).
    started_at: Mutex<HashMap<i32, i64>>,
    meter: Meter,
    topic: String,
    deadline: Duration,
    /// Where assigned partitions' lanes are sent to be driven; `None` once stopped.
    starts: Mutex<Option<mpsc::UnboundedSender<LaneStart>>>,
}

impl ClientContext for Context {
    /// librdkafka's statistics: each assigned partition's consumer lag, as a gauge.
    fn stats(&self, statistics: ::rdkafka::Statistics) {
        let Some(topic) = statistics.topics.get(&self.topic) else {
            return;
        };
        let assigned = self.shared.lock();
        for (&partition, stats) in &topic.partitions {
            if assigned.parts.contains_key(&partition)
                && let Ok(lag) = u64::try_from(stats.consumer_lag)
            {
                self.meter.lag(Some(partition), lag);
            }
        }
    }
}

/// Reads every partition's stored offset (offsets-in-database mode), from the poll thread.
type StoredOffsets = Box<dyn Fn() -> Result<Vec<(i32, i64)>, sqlx::Error> + Send + Sync>;

impl Context {
    /// Offsets-in-database mode: each assigned partition that has a stored offset starts
    /// at the greater of it and the group's committed offset.
    fn start_at_stored(&self, list: &mut TopicPartitionList) {
        let Some((read, reader)) = &self.stored else {
            return;
        };
        let stored: HashMap<i32, i64> = match read() {
            Ok(rows) => rows.into_iter().collect(),
            Err(error) => {
                tracing::warn!(%error, topic = %self.topic,
                    "Kafka consumer: stored offsets not read; starting at the group's");
                return;
            }
        };
        let committed: HashMap<i32, i64> = reader
            .committed_offsets(list.clone(), METADATA)
            .map(|committed| {
                committed
                    .elements_for_topic(&self.topic)
                    .iter()
                    .filter_map(|element| match element.offset() {
                        Offset::Offset(offset) => Some((element.partition(), offset)),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let assigned: Vec<i32> = list
            .elements_for_topic(&self.topic)
            .iter()
            .map(|element| element.partition())
            .collect();
        let mut started_at = self.started_at.lock().unwrap_or_else(|p| p.into_inner());
        for partition in assigned {
            if let Some(&at) = stored.get(&partition) {
                let at = at.max(committed.get(&partition).copied().unwrap_or(-1));
                let _ = list.set_partition_offset(&self.topic, partition, Offset::Offset(at));
                started_at.insert(partition, at);
            }
        }
    }
}

impl ConsumerContext for Context {
    /// librdkafka's default, but for the stored offsets set on an assignment first.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        error: ::rdkafka::types::RDKafkaRespErr,
        list: &mut TopicPartitionList,
    ) {
        use ::rdkafka::consumer::RebalanceProtocol;
        use ::rdkafka::types::RDKafkaRespErr;

        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        match error {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                self.start_at_stored(list);
                self.pre_rebalance(consumer, &Rebalance::Assign(list));
                let assigned = if cooperative {
                    consumer.incremental_assign(list)
                } else {
                    consumer.assign(list)
                };
                if let Err(error) = assigned {
                    tracing::warn!(%error, topic = %self.topic, "Kafka consumer: assign failed");
                }
                self.post_rebalance(consumer, &Rebalance::Assign(list));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.pre_rebalance(consumer, &Rebalance::Revoke(list));
                let unassigned = if cooperative {
                    consumer.incremental_unassign(list)
                } else {
                    consumer.unassign()
                };
                if let Err(error) = unassigned {
                    tracing::warn!(%error, topic = %self.topic, "Kafka consumer: unassign failed");
                }
                self.post_rebalance(consumer, &Rebalance::Revoke(list));
            }
            other => {
                // As librdkafka's default: the partitions given (cooperative) or all of
                // them (eager) are unassigned, and nothing is committed — they may be
                // another member's already.
                let error = KafkaError::Rebalance(other.into());
                tracing::warn!(%error, topic = %self.topic, "Kafka consumer: rebalance failed");
                let mut state = self.shared.lock();
                let dropped: Vec<i32> = if cooperative {
                    list.elements_for_topic(&self.topic)
                        .iter()
                        .map(|element| element.partition())
                        .collect()
                } else {
                    state.parts.keys().copied().collect()
                };
                for partition in dropped {
                    if let Some(part) = state.parts.remove(&partition) {
                        let _ = part.leave.send(true);
                    }
                }
                drop(state);
                let unassigned = if cooperative {
                    consumer.incremental_unassign(list)
                } else {
                    consumer.unassign()
                };
                if let Err(error) = unassigned {
                    tracing::warn!(%error, topic = %self.topic, "Kafka consumer: unassign failed");
                }
            }
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let revoked: Vec<i32> = match rebalance {
            Rebalance::Revoke(list) => list
                .elements_for_topic(&self.topic)
                .iter()
                .map(|element| element.partition())
                .collect(),
            // An error unassigns everything, and commits nothing: the partitions may be
            // another member's already.
            // A failed rebalance is handled in `rebalance` itself.
            Rebalance::Error(_) | Rebalance::Assign(_) => return,
        };
        let lost = consumer.assignment_lost();
        let mut state = self.shared.lock();
        for partition in &revoked {
            if let Some(part) = state.parts.get(partition) {
                let _ = part.leave.send(true);
            }
        }
        // The records in hand finish (or meet the deadline, which drops them) first.
        let until = Instant::now() + self.deadline + Duration::from_secs(1);
        while revoked
            .iter()
            .any(|partition| state.parts.get(partition).is_some_and(|part| part.busy))
        {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        let offsets = Shared::offsets(&mut state, &self.topic, Some(&revoked), false);
        for partition in &revoked {
            state.parts.remove(partition);
        }
        drop(state);
        if lost {
            tracing::warn!(topic = %self.topic, partitions = ?revoked,
                "Kafka consumer: partitions lost; their offsets are not committed");
        } else if offsets.count() > 0
            && let Err(error) = consumer.commit(&offsets, CommitMode::Sync)
        {
            tracing::warn!(%error, topic = %self.topic, partitions = ?revoked,
                "Kafka consumer: the commit of revoked partitions failed; \
                 their finished records will be read again, as duplicates");
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(list) = rebalance else {
            return;
        };
        // A partition this member paused before it was revoked may come back paused
        // (librdkafka keeps an application's pause across an incremental assignment):
        // its new lane is empty, so it starts resumed.
        if let Err(error) = consumer.resume(list) {
            tracing::debug!(%error, topic = %self.topic, "Kafka consumer: resume at assignment");
        }
        let starts = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        let Some(starts) = starts.as_ref() else {
            return;
        };
        let mut started_at =
            std::mem::take(&mut *self.started_at.lock().unwrap_or_else(|p| p.into_inner()));
        let mut state = self.shared.lock();
        for element in list.elements_for_topic(&self.topic) {
            state.generations += 1;
            let generation = state.generations;
            let (records, lane_records) = mpsc::unbounded_channel();
            let (leave, lane_leave) = watch::channel(state.stopping);
            let partition = element.partition();
            state.parts.insert(
                partition,
                Part {
                    generation,
                    records,
                    leave,
                    // A start at a stored offset is committed to Kafka at the next turn.
                    finished: started_at.remove(&partition),
                    committed: None,
                    held: 0,
                    busy: false,
                    paused: false,
                    full_since: None,
                },
            );
            let _ = starts.send(LaneStart {
                partition,
                generation,
                records: lane_records,
                leave: lane_leave,
            });
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // Nothing is lost: the records after the group's committed offset are read
            // again, as duplicates; the next commit carries the offsets again.
            tracing::warn!(%error, topic = %self.topic, offsets = ?offsets.to_topic_map(),
                "Kafka consumer: offset commit failed");
            let mut state = self.shared.lock();
            for element in offsets.elements_for_topic(&self.topic) {
                if let Some(part) = state.parts.get_mut(&element.partition()) {
                    part.committed = None;
                }
            }
        }
    }
}

/// The poll thread: takes records and hands them to their lanes, pauses and resumes,
/// commits.
struct Poller {
    consumer: BaseConsumer<Context>,
    shared: Arc<Shared>,
    prefetch: usize,
    commit_interval: Duration,
}

impl Poller {
    fn run(self) {
        let topic = self.consumer.context().topic.clone();
        let (mut last_commit, mut last_full) = (Instant::now(), Instant::now());
        loop {
            if self.shared.lock().stopping {
                break;
            }
            if self.hold_back(&topic) {
                // A lane is full and not yet paused: wait for it to make room.
                let state = self.shared.lock();
                let _ = self
                    .shared
                    .changed
                    .wait_timeout(state, Duration::from_millis(20));
            } else {
                match self.consumer.poll(POLL) {
                    Some(Ok(record)) => self.dispatch(record.detach()),
                    Some(Err(error)) => {
                        tracing::debug!(%error, topic = %topic, "Kafka consumer: poll error");
                    }
                    None => {}
                }
            }
            let soon = std::mem::take(&mut self.shared.lock().commit_soon);
            if soon || last_commit.elapsed() >= self.commit_interval {
                last_commit = Instant::now();
                // Now and then every finished offset again, changed or not: a commit the
                // group did not keep (a stale one from a member revoked meanwhile that
                // landed after it, a broker that lost it) is made good.
                let again = last_full.elapsed() >= RECOMMIT;
                if again {
                    last_full = last_commit;
                }
                self.commit(&topic, CommitMode::Async, again);
            }
        }
        // Stopped: no lane starts any more; the lanes finish their records in hand.
        self.consumer
            .context()
            .starts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        {
            let mut state = self.shared.lock();
            for part in state.parts.values_mut() {
                let (closed, _) = mpsc::unbounded_channel();
                part.records = closed;
            }
            while !state.lanes_ended {
                state = self
                    .shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
        self.commit(&topic, CommitMode::Sync, true);
        // Dropping the consumer closes it: it leaves the group (its revoke callback
        // finds nothing more to commit).
        drop(self.consumer);
    }

    /// Gives `record` to its partition's lane, if the partition is still assigned.
    fn dispatch(&self, record: OwnedMessage) {
        let mut state = self.shared.lock();
        let Some(part) = state.parts.get_mut(&record.partition()) else {
            return;
        };
        if part.records.send(record).is_ok() {
            part.held += 1;
        }
    }

    /// Pauses the partitions whose lanes stayed full for [`STALL`], resumes the paused
    /// ones whose lanes drained to half; whether a lane is full and not paused (the poll
    /// must wait).
    fn hold_back(&self, topic: &str) -> bool {
        let now = Instant::now();
        let (mut pause, mut resume) = (TopicPartitionList::new(), TopicPartitionList::new());
        let mut wait = false;
        {
            let mut state = self.shared.lock();
            for (&partition, part) in &mut state.parts {
                if part.paused {
                    if part.held <= self.prefetch / 2 {
                        part.paused = false;
                        part.full_since = None;
                        resume.add_partition(topic, partition);
                    }
                } else if part.held >= self.prefetch {
                    let since = *part.full_since.get_or_insert(now);
                    if now.duration_since(since) >= STALL {
                        part.paused = true;
                        pause.add_partition(topic, partition);
                    } else {
                        wait = true;
                    }
                } else {
                    part.full_since = None;
                }
            }
        }
        if pause.count() > 0
            && let Err(error) = self.consumer.pause(&pause)
        {
            tracing::warn!(%error, "Kafka consumer: pause failed");
        }
        if resume.count() > 0
            && let Err(error) = self.consumer.resume(&resume)
        {
            tracing::warn!(%error, "Kafka consumer: resume failed");
        }
        wait
    }

    /// Commits the finished offsets past the last commit (all of them when `again`).
    fn commit(&self, topic: &str, mode: CommitMode, again: bool) {
        let offsets = Shared::offsets(&mut self.shared.lock(), topic, None, again);
        if offsets.count() == 0 {
            return;
        }
        if let Err(error) = self.consumer.commit(&offsets, mode) {
            tracing::warn!(%error, topic, "Kafka consumer: offset commit failed");
            let mut state = self.shared.lock();
            for part in state.parts.values_mut() {
                part.committed = None;
            }
        }
    }
}

/// What every lane of one run shares.
struct LaneContext<'r, DB: Backend, H> {
    consumer: &'r KafkaConsumer,
    group: &'r str,
    dead: &'r str,
    producer: &'r FutureProducer,
    pool: &'r Pool<DB>,
    policy: &'r AckPolicy<DB>,
    handler: &'r H,
    shared: &'r Shared,
    meter: &'r Meter,
}

/// How a record's handling ended.
enum Handled {
    /// Finished: its offset may be committed.
    Finished,
    /// Left unfinished (shutdown, revocation): its partition's next owner reads it again.
    Left,
}

impl<DB, H, Fut, O, E> LaneContext<'_, DB, H>
where
    DB: Backend,
    H: Fn(Pool<DB>, Arc<Message>) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
    O: AckOutcome + Send,
    E: DecideError + std::fmt::Display + Send,
{
    /// One partition's lane: its records in order, until its channel closes.
    async fn run(&self, start: LaneStart) -> Consumed {
        let LaneStart {
            partition,
            generation,
            mut records,
            leave,
        } = start;
        let (mut consumed, mut seen) = (Consumed::default(), Consumed::default());
        let mut left = false;
        while let Some(record) = records.recv().await {
            if left || shared::stopped(&leave) {
                // Not started: its partition's next owner (or next start) reads it.
                consumed.requeued += 1;
                self.shared
                    .update(partition, generation, |part| part.held -= 1);
                self.meter.catch_up(&mut seen, &consumed);
                continue;
            }
            self.shared
                .update(partition, generation, |part| part.busy = true);
            let (offset, dead) = (record.offset(), consumed.dead_lettered);
            let handled = self.handle(record, &leave, &mut consumed).await;
            if matches!(handled, Handled::Left) {
                // The records after it must not finish before it: the lane leaves.
                left = true;
                consumed.requeued += 1;
            }
            self.shared.update(partition, generation, |part| {
                part.busy = false;
                part.held -= 1;
                if matches!(handled, Handled::Finished) {
                    part.finished = Some(offset + 1);
                }
            });
            if consumed.dead_lettered > dead {
                self.shared.commit_soon();
            }
            self.meter.catch_up(&mut seen, &consumed);
        }
        self.meter.catch_up(&mut seen, &consumed);
        consumed
    }

    /// Calls the handler for `record` until the policy settles it.
    async fn handle(
        &self,
        record: OwnedMessage,
        leave: &watch::Receiver<bool>,
        consumed: &mut Consumed,
    ) -> Handled {
        let (partition, offset) = (record.partition(), record.offset());
        let mut message = Arc::new(self.message(&record));
        let span = tracing::info_span!(
            "process",
            messaging.system = "kafka",
            messaging.operation.type = "process",
            messaging.destination.name = %self.consumer.topic,
            messaging.consumer.group.name = %self.group,
            messaging.destination.partition.id = partition,
            messaging.kafka.offset = offset,
            messaging.message.id = %message.id(),
            traceparent = tracing::field::Empty,
        );
        if let Some(traceparent) = message.header("traceparent")
            && let Ok(traceparent) = std::str::from_utf8(traceparent)
        {
            span.record("traceparent", traceparent);
        }
        if let Some(hook) = self.consumer.trace_parent {
            hook(&span, &message);
        }
        loop {
            let attempt = message.delivery;
            let call = tracing::Instrument::instrument(
                (self.handler)(self.pool.clone(), message.clone()),
                span.clone(),
            );
            // Offsets-in-database mode: the handler's own transaction writes the position.
            let pending = self.consumer.offsets_in_database.then(|| Pending {
                id: message.id().to_owned(),
                row: OffsetRow {
                    group: self.group.to_owned(),
                    topic: self.consumer.topic.clone(),
                    partition,
                    next: offset + 1,
                },
            });
            let call = PENDING.scope(pending, call);
            let (deadline, started) = (self.consumer.shutdown_deadline, Instant::now());
            let Some(result) = shared::within_deadline(leave, deadline, call).await else {
                // Past the deadline: dropped, its transaction rolled back.
                return Handled::Left;
            };
            self.meter.processed(started);
            match self.policy.decide(&result, attempt) {
                Ack::Ack => {
                    consumed.acknowledged += 1;
                    return Handled::Finished;
                }
                Ack::Retry { after } => {
                    if let Err(error) = &result {
                        let _entered = span.enter();
                        tracing::debug!(%error, ?after, attempt,
                            "Kafka consumer: transient failure; retried in place");
                    }
                    if !shared::pause(leave, after).await {
                        return Handled::Left;
                    }
                    consumed.retried += 1;
                    let next = Message {
                        delivery: attempt + 1,
                        ..Message::clone(&message)
                    };
                    message = Arc::new(next);
                }
                Ack::DeadLetter => {
                    let error = result.as_ref().err().map(|error| {
                        (
                            std::any::type_name::<E>(),
                            shared::header_text(&error.to_string()),
                        )
                    });
                    if let Some((_, text)) = &error {
                        let _entered = span.enter();
                        tracing::warn!(error = %text, attempt,
                            "Kafka consumer: permanent failure; dead-lettered");
                    }
                    if !self.dead_letter(&record, attempt, error, leave).await {
                        return Handled::Left;
                    }
                    consumed.dead_lettered += 1;
                    return Handled::Finished;
                }
            }
        }
    }
}

impl<DB, H, Fut, E, B> LaneContext<'_, DB, H>
where
    DB: Backend,
    H: Fn(Pool<DB>, Arc<[Message]>) -> Fut + Send + Sync,
    Fut: Future<Output = Result<BatchOutcome<E>, B>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    B: std::error::Error + Send + 'static,
{
    /// One partition's lane in batches: what it holds, up to `max`, per call.
    async fn run_batches(&self, start: LaneStart, max: usize) -> Consumed {
        let LaneStart {
            partition,
            generation,
            mut records,
            leave,
        } = start;
        let (mut consumed, mut seen) = (Consumed::default(), Consumed::default());
        let mut left = false;
        while let Some(first) = records.recv().await {
            let mut batch = vec![first];
            while batch.len() < max {
                match records.try_recv() {
                    Ok(record) => batch.push(record),
                    Err(_) => break,
                }
            }
            let taken = batch.len();
            if left || shared::stopped(&leave) {
                consumed.requeued += taken as u64;
                self.shared
                    .update(partition, generation, |part| part.held -= taken);
                self.meter.catch_up(&mut seen, &consumed);
                continue;
            }
            self.shared
                .update(partition, generation, |part| part.busy = true);
            let offsets: Vec<i64> = batch.iter().map(|record| record.offset()).collect();
            let dead = consumed.dead_lettered;
            let finished = self.handle_batch(batch, &leave, &mut consumed).await;
            if finished < taken {
                // The records after an unsettled one must not finish before it.
                left = true;
                consumed.requeued += (taken - finished) as u64;
            }
            self.shared.update(partition, generation, |part| {
                part.busy = false;
                part.held -= taken;
                if let Some(last) = finished.checked_sub(1) {
                    part.finished = Some(offsets[last] + 1);
                }
            });
            if consumed.dead_lettered > dead {
                self.shared.commit_soon();
            }
            self.meter.catch_up(&mut seen, &consumed);
        }
        self.meter.catch_up(&mut seen, &consumed);
        consumed
    }

    /// Calls the handler for `records` until each is settled, then produces the dead
    /// letters; how many records, from the first, finished (all, unless the lane had to
    /// leave first).
    async fn handle_batch(
        &self,
        records: Vec<OwnedMessage>,
        leave: &watch::Receiver<bool>,
        consumed: &mut Consumed,
    ) -> usize {
        let messages: Vec<Message> = records.iter().map(|record| self.message(record)).collect();
        let span = tracing::info_span!(
            "process",
            messaging.system = "kafka",
            messaging.operation.type = "process",
            messaging.destination.name = %self.consumer.topic,
            messaging.consumer.group.name = %self.group,
            messaging.destination.partition.id = records[0].partition(),
            messaging.kafka.offset = records[0].offset(),
            messaging.batch.message_count = records.len(),
        );
        if let Some(hook) = self.consumer.trace_parent {
            // A batch's span: the hook links it to each message's producer.
            for message in &messages {
                hook(&span, message);
            }
        }
        let mut settled: Vec<Option<Settlement>> = vec![None; records.len()];
        let mut attempts = vec![1_u64; records.len()];
        let mut attempt = 1_u64;
        loop {
            let open: Vec<usize> = (0..records.len())
                .filter(|&n| settled[n].is_none())
                .collect();
            if open.is_empty() {
                break;
            }
            let batch: Arc<[Message]> = open
                .iter()
                .map(|&n| Message {
                    delivery: attempt,
                    ..messages[n].clone()
                })
                .collect();
            let call = tracing::Instrument::instrument(
                (self.handler)(self.pool.clone(), batch),
                span.clone(),
            );
            let (deadline, started) = (self.consumer.shutdown_deadline, Instant::now());
            let Some(result) = shared::within_deadline(leave, deadline, call).await else {
                return acknowledged_first(&settled, consumed);
            };
            self.meter.processed(started);
            let acks: Vec<Settlement> = match &result {
                Ok(outcome) => (0..open.len())
                    .map(|k| item_settlement(self.policy, outcome.settled(k), attempt))
                    .collect(),
                Err(error) => {
                    let ack = self.policy.decide_error(error, attempt);
                    let text = shared::header_text(&error.to_string());
                    let failed = (std::any::type_name::<B>(), text);
                    open.iter().map(|_| (ack, Some(failed.clone()))).collect()
                }
            };
            let mut wait = None;
            for (&n, (ack, error)) in open.iter().zip(acks) {
                attempts[n] = attempt;
                match ack {
                    Ack::Retry { after } => {
                        wait = Some(wait.unwrap_or(Duration::ZERO).max(after));
                        consumed.retried += 1;
                    }
                    ack => settled[n] = Some((ack, error)),
                }
            }
            if let Some(wait) = wait {
                let _entered = span.enter();
                tracing::debug!(
                    ?wait,
                    attempt,
                    "Kafka consumer: transient failures in a batch; its unsettled records retried"
                );
                if !shared::pause(leave, wait).await {
                    return acknowledged_first(&settled, consumed);
                }
                attempt += 1;
            }
        }
        for (n, record) in records.iter().enumerate() {
            match settled[n].take() {
                Some((Ack::DeadLetter, error)) => {
                    if let Some((_, text)) = &error {
                        let _entered = span.enter();
                        tracing::warn!(error = %text, offset = record.offset(),
                            "Kafka consumer: permanent failure in a batch; dead-lettered");
                    }
                    if !self.dead_letter(record, attempts[n], error, leave).await {
                        return n;
                    }
                    consumed.dead_lettered += 1;
                }
                _ => consumed.acknowledged += 1,
            }
        }
        records.len()
    }
}

/// How many records, from the first, are settled by an acknowledgement (their dead
/// letters, if any, are not produced yet), counted as acknowledged.
fn acknowledged_first(settled: &[Option<Settlement>], consumed: &mut Consumed) -> usize {
    let first = settled
        .iter()
        .take_while(|settlement| matches!(settlement, Some((Ack::Ack, _))))
        .count();
    consumed.acknowledged += first as u64;
    first
}

impl<DB: Backend, H> LaneContext<'_, DB, H> {
    /// The [`Message`] of `record`, at its first delivery.
    fn message(&self, record: &OwnedMessage) -> Message {
        Message {
            id: record_id(record, &self.consumer.message_id),
            payload: record.payload().map(<[u8]>::to_vec).unwrap_or_default(),
            headers: record_headers(record),
            delivery: 1,
            destination: self.consumer.topic.clone(),
        }
    }

    /// Produces the record's copy to the dead topic, on its partition number, until the
    /// broker acknowledges it; `false` if the lane had to leave first.
    async fn dead_letter(
        &self,
        record: &OwnedMessage,
        attempts: u64,
        error: Option<(&str, String)>,
        leave: &watch::Receiver<bool>,
    ) -> bool {
        let mut headers = OwnedHeaders::new();
        if let Some(original) = record.headers() {
            for header in original.iter() {
                headers = headers.insert(header);
            }
        }
        let timestamp = record.timestamp().to_millis().map(|ms| ms.to_string());
        let mut provenance = vec![
            (provenance::TOPIC, record.topic().to_owned()),
            (provenance::PARTITION, record.partition().to_string()),
            (provenance::OFFSET, record.offset().to_string()),
            (provenance::GROUP, self.group.to_owned()),
            (provenance::ATTEMPTS, attempts.to_string()),
        ];
        if let Some(timestamp) = timestamp {
            provenance.push((provenance::TIMESTAMP, timestamp));
        }
        if let Some((class, text)) = error {
            provenance.push((provenance::ERROR_CLASS, class.to_owned()));
            provenance.push((provenance::ERROR, text));
        }
        for (key, value) in &provenance {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut wait = shared::RECONNECT.0;
        loop {
            let mut copy = FutureRecord::<[u8], [u8]>::to(self.dead)
                .partition(record.partition())
                .headers(headers.clone());
            if let Some(key) = record.key() {
                copy = copy.key(key);
            }
            if let Some(payload) = record.payload() {
                copy = copy.payload(payload);
            }
            let sent = shared::first(self.producer.send(copy, Duration::from_secs(30)), async {
                let mut leave = leave.clone();
                let _ = leave.wait_for(|leave| *leave).await;
                tokio::time::sleep(self.consumer.shutdown_deadline).await;
            })
            .await;
            match sent {
                Some(Ok(_)) => return true,
                None => return false,
                Some(Err((error, _))) => {
                    tracing::warn!(%error, topic = %self.dead,
                        "Kafka consumer: dead letter not stored; trying again");
                    if !shared::pause(leave, wait).await {
                        return false;
                    }
                    wait = (wait * 2).min(shared::RECONNECT.1);
                }
            }
        }
    }
}

/// The record's id, as `from` says; empty when it has none.
fn record_id(record: &OwnedMessage, from: &MessageIdFrom) -> String {
    let bytes = match from {
        MessageIdFrom::Key => record.key(),
        MessageIdFrom::Header(name) => record.headers().and_then(|headers| {
            headers
                .iter()
                .filter(|header| header.key == name)
                .last()
                .map(|header| header.value.unwrap_or_default())
        }),
    };
    bytes
        .and_then(|bytes| std::str::from_utf8(bytes).ok())
        .unwrap_or_default()
        .to_owned()
}

/// The record's headers, in order; a null value as no bytes.
fn record_headers(record: &OwnedMessage) -> Vec<(String, Vec<u8>)> {
    record
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|header| {
                    (
                        header.key.to_owned(),
                        header.value.unwrap_or_default().to_vec(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}
