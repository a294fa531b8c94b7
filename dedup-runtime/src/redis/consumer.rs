//! The hosted Redis Streams consumer: [`RedisStreamsConsumer`].

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, RedisError, RedisResult, Value};
use sqlx::Pool;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ack::{Ack, AckOutcome, AckPolicy, DecideError};
use crate::backend::Backend;
use crate::batch::BatchOutcome;
use crate::consume::calls::{self, Batches, Calls, Plain};
use crate::consume::{Consumed, Message, TraceParent};

/// Where a Redis Streams consumer reads each entry's message id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIdFrom {
    /// The entry's field of that name: `id` by default, where
    /// [`RedisStreamsPublisher`](super::RedisStreamsPublisher) puts the outgoing id.
    Field(String),
    /// The entry id Redis assigned (`1733356800000-0`). Safe only when an entry is added
    /// exactly once: a producer that adds it again (a retry after a lost `XADD` reply, a
    /// relay killed between its send and its mark) makes an entry with a **new** entry id,
    /// which dedup cannot recognise as the same message.
    EntryId,
}

/// The field holding an entry's payload.
const BODY: &str = "body";

/// Runs an `#[idempotent]` handler for every entry of a Redis stream, as one member
/// (consumer) of a consumer group, and owns everything between Redis and the handler:
///
/// - **Reads its own pending entries first.** At start and after each reconnection it
///   reads the entries Redis delivered to this member and that were never acknowledged
///   (`XREADGROUP … 0`), then new ones (`>`), [`batch`](Self::batch) at a time, waiting
///   at most [`block`](Self::block) for new ones. Give each process a **stable member
///   name** (a pod name, a host name; not a random one): a restarted process then finds
///   what its previous life held. Do not remove a member that still has pending entries
///   (`XGROUP DELCONSUMER` drops them from the group: they are never delivered again).
/// - **Takes over a crashed member's entries.** Every [`claim_idle`](Self::claim_idle)/2
///   it runs `XAUTOCLAIM` for the group's entries pending longer than `claim_idle` with
///   any member, follows its cursor to the end of the pending entries list, and processes
///   what it claimed; ids Redis 7 reports deleted from the stream are acknowledged.
/// - **Settles after the transaction.** Each entry is settled only once its handler
///   returned: processed (committed) or a duplicate → `XACK`; a transient failure → left
///   pending (no `XACK`) and held in process for [`AckPolicy`]'s delay, then taken again
///   with `XCLAIM` to this member (which counts a delivery) and processed again — other
///   entries go on meanwhile, so a retried entry is processed after later ones; a permanent failure → `XADD <stream>.dead` with the entry's
///   fields and its provenance, and `XACK`, in one `MULTI`/`EXEC`. An entry delivered more
///   than [`max_deliveries`](Self::max_deliveries) times is dead-lettered without calling
///   the handler: a poison entry that kills the process each time ends there. Delivery
///   counts come from one `XPENDING` per batch.
/// - **Survives its connection**: on a failed command (Redis restarted, the network cut;
///   or an error reply, such as `NOGROUP` for a stream deleted meanwhile, whose group the
///   new connection creates again) it drops the connection, waits (100 ms, doubling up to 5 s), connects again and goes
///   back to its own pending entries. An entry whose `XACK` was lost stays pending and is
///   processed again: the dedup record makes it a duplicate.
/// - **Stops gracefully** when the future given to [`run`](Self::run) completes: it stops
///   reading, finishes the entry in hand within the
///   [`shutdown_deadline`](Self::shutdown_deadline) (one not finished by then is dropped:
///   its transaction rolls back), settles it — in that order. What it read and did not
///   settle stays pending with this member, for its next start (or another member's
///   `XAUTOCLAIM`).
///
/// An entry's id is its field `id` unless [`message_id`](Self::message_id) says
/// otherwise, its payload the field `body`, its other fields the [`Message`]'s headers.
/// An entry without the id field is dead-lettered (its id is empty, which the handler's
/// key check refuses). The group is created at start if missing (`XGROUP CREATE <stream>
/// <group> $ MKSTREAM`: new entries only, unless [`group_from_start`](Self::group_from_start)).
///
/// ```no_run
/// use dedup_runtime::consume::Message;
/// use dedup_runtime::idempotent;
/// use dedup_runtime::redis::RedisStreamsConsumer;
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
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// // A stable member name: the pod's, the host's.
/// let consumer = RedisStreamsConsumer::new(client, "payments", "billing", "billing-0");
/// let shutdown = std::future::pending(); // SIGTERM, in a service
/// let consumed = consumer
///     .run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, shutdown)
///     .await?;
/// println!("{consumed:?}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsConsumer {
    client: Client,
    stream: String,
    group: String,
    member: String,
    dead_stream: String,
    batch: usize,
    block: Duration,
    claim_idle: Duration,
    max_deliveries: u64,
    message_id: MessageIdFrom,
    from_start: bool,
    shutdown_deadline: Duration,
    trace_parent: Option<TraceParent>,
}

impl std::fmt::Debug for RedisStreamsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the client: its connection info may hold a password.
        f.debug_struct("RedisStreamsConsumer")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("member", &self.member)
            .field("dead_stream", &self.dead_stream)
            .field("batch", &self.batch)
            .field("block", &self.block)
            .field("claim_idle", &self.claim_idle)
            .field("max_deliveries", &self.max_deliveries)
            .field("message_id", &self.message_id)
            .field("from_start", &self.from_start)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("trace_parent", &self.trace_parent.is_some())
            .finish_non_exhaustive()
    }
}

/// Why [`RedisStreamsConsumer::run`] ended before its shutdown.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The first connection failed (a wrong address or password, Redis not there at
    /// start), or creating the group did (the key holds something else than a stream):
    /// a service would rather fail at start than run without its stream. Once it has
    /// consumed, the consumer connects again by itself.
    Start(RedisError),
}

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumeError::Start(error) => {
                write!(f, "Redis Streams consumer could not start: {error}")
            }
        }
    }
}

impl std::error::Error for ConsumeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsumeError::Start(error) => Some(error),
        }
    }
}

use crate::consume::shared::{self, Meter, RECONNECT};

impl RedisStreamsConsumer {
    /// A consumer of `stream` through `client`, as the member `member` of `group`: batches
    /// of 16, a 1 s `BLOCK`, `XAUTOCLAIM` of entries idle for 60 s, at most 10 deliveries,
    /// ids from the field `id`, dead letters to `<stream>.dead`, a 10 s shutdown deadline.
    pub fn new(client: Client, stream: &str, group: &str, member: &str) -> Self {
        RedisStreamsConsumer {
            client,
            stream: stream.to_owned(),
            group: group.to_owned(),
            member: member.to_owned(),
            dead_stream: format!("{stream}.dead"),
            batch: 16,
            block: Duration::from_secs(1),
            claim_idle: Duration::from_secs(60),
            max_deliveries: 10,
            message_id: MessageIdFrom::Field("id".to_owned()),
            from_start: false,
            shutdown_deadline: Duration::from_secs(10),
            trace_parent: None,
        }
    }

    /// Entries read at once (`COUNT`; 16 by default, at least 1): what the consumer holds
    /// at most, besides the ones held for a retry.
    pub fn batch(self, entries: usize) -> Self {
        RedisStreamsConsumer {
            batch: entries.max(1),
            ..self
        }
    }

    /// How long a read waits for new entries (`BLOCK`; 1 s by default, at least 1 ms).
    pub fn block(self, wait: Duration) -> Self {
        RedisStreamsConsumer {
            block: wait.max(Duration::from_millis(1)),
            ..self
        }
    }

    /// How long an entry stays pending with a member before another takes it over with
    /// `XAUTOCLAIM` (60 s by default; checked every half of it). It must exceed the
    /// slowest handler: an entry still being processed when it passes is processed a
    /// second time by the member that claimed it (the dedup record keeps its effects
    /// once, but the work is done twice).
    pub fn claim_idle(self, idle: Duration) -> Self {
        RedisStreamsConsumer {
            claim_idle: idle.max(Duration::from_millis(2)),
            ..self
        }
    }

    /// Deliveries after which an entry is dead-lettered without calling the handler
    /// (10 by default, at least 1): an entry that crashes the process each time it is
    /// processed is delivered again and again otherwise.
    pub fn max_deliveries(self, deliveries: u64) -> Self {
        RedisStreamsConsumer {
            max_deliveries: deliveries.max(1),
            ..self
        }
    }

    /// Where each entry's id is read ([`MessageIdFrom::Field`] `id` by default).
    pub fn message_id(self, from: MessageIdFrom) -> Self {
        RedisStreamsConsumer {
            message_id: from,
            ..self
        }
    }

    /// The stream dead letters are added to (`<stream>.dead` by default).
    pub fn dead_stream(self, stream: &str) -> Self {
        RedisStreamsConsumer {
            dead_stream: stream.to_owned(),
            ..self
        }
    }

    /// Whether a group created at start reads the stream from its first entry (`XGROUP
    /// CREATE … 0`) rather than only the entries added from then on (`$`, the default).
    /// A group that exists is left as it is.
    pub fn group_from_start(self, from_start: bool) -> Self {
        RedisStreamsConsumer { from_start, ..self }
    }

    /// How long the entry in hand may still take once shutdown began (10 s by default).
    /// Keep it under the grace period of whatever stops the process.
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        RedisStreamsConsumer {
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
        RedisStreamsConsumer {
            trace_parent: Some(hook),
            ..self
        }
    }

    /// Consumes until `shutdown` completes, deciding with the default
    /// [`AckPolicy`]; see [`run_with`](Self::run_with).
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

    /// Consumes until `shutdown` completes, calling `handler` for each entry and settling
    /// it as `policy` decides; returns what it did. `Err` only when it could not start
    /// ([`ConsumeError::Start`]); after that, a lost connection is made again, and the
    /// run ends only with `shutdown`.
    ///
    /// `handler` is given the pool and the message, both its own (so that its future is
    /// `'static` and can go to a task): `|pool, msg| async move { apply(&pool, &msg).await }`
    /// for an `#[idempotent]` handler `apply(tx, msg: &Message)`. Its outcome is one
    /// [`AckPolicy`] takes ([`Outcome`](crate::Outcome),
    /// [`LeaseOutcome`](crate::LeaseOutcome), [`StoredOutcome`](crate::StoredOutcome)),
    /// and so is its error (an [`Error`](std::error::Error)).
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
        self.consume(pool, policy, &Plain::new(handler), shutdown)
            .await
    }

    /// Consumes until `shutdown` completes, handing entries to an
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

    /// Consumes until `shutdown` completes, handing the entries of each read to
    /// `handler` in batches: in stream order, at most `max` (at least 1; each read asks
    /// for at least `max` entries, whatever [`batch`](Self::batch) says). No batch
    /// waits for more entries than a read brought: a quiet stream gives batches of one.
    /// `handler` is given the pool and the batch, both its own: `|pool, batch| async move
    /// { apply(&pool, &batch).await }` for an `#[idempotent(batch = fresh, key = |msg|
    /// msg.id())]` handler `apply(tx, fresh: &[&Message])`: one transaction claims every
    /// id, runs the body over the fresh ones, and commits (see [`batch`](crate::batch)).
    ///
    /// Each entry is settled as its [`BatchItem`](crate::batch::BatchItem) says, through
    /// `policy`, as the plain form settles it: processed, a duplicate or a copy of one →
    /// acknowledged, the batch's in one `XACK`; a transient failure (or an item in
    /// progress under another delivery's lease) → left pending and taken again once its
    /// delay passed; a permanent failure, an invalid id or a fingerprint mismatch → to
    /// the dead stream, acknowledged with it. A batch whose call failed as a whole is
    /// decided on that error for each entry. An entry over
    /// [`max_deliveries`](Self::max_deliveries) goes to the dead stream without a call;
    /// a batch not finished within the shutdown deadline stays pending with this member.
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
        let calls = Batches::new(handler, max);
        let consumer = RedisStreamsConsumer {
            batch: self.batch.max(calls.max()),
            ..self.clone()
        };
        consumer.consume(pool, policy, &calls, shutdown).await
    }

    /// Both forms' run.
    async fn consume<DB: Backend, C: Calls<DB>>(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        calls: &C,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError> {
        // The first connection, so that a wrong address or stream fails the run at once.
        let connection = self.connect().await.map_err(ConsumeError::Start)?;
        let (stop, stopping) = watch::channel(false);
        let meter = Meter::new("redis", &self.stream, &self.group);
        let worker = Worker {
            consumer: self,
            pool,
            policy,
            calls,
            stopping,
            connection: Some(connection),
            own: Some("0".to_owned()),
            held: Vec::new(),
            next_claim: Instant::now(),
            consumed: Consumed::default(),
            meter: &meter,
            seen: Consumed::default(),
            next_lag: std::time::Instant::now(),
        };
        let mut work = pin!(worker.run());
        let finished = shared::first(work.as_mut(), shutdown).await;
        let consumed = match finished {
            Some(done) => done,
            None => {
                let _ = stop.send(true);
                work.await
            }
        };
        meter.finish(&consumed);
        Ok(consumed)
    }

    /// A connection of the consumer's own (a blocking read holds it), and the group,
    /// created if missing.
    async fn connect(&self) -> RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(self.block + Duration::from_secs(10)));
        let mut connection = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let created: RedisResult<Value> = ::redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(if self.from_start { "0" } else { "$" })
            .arg("MKSTREAM")
            .query_async(&mut connection)
            .await;
        match created {
            Err(error) if error.code() != Some("BUSYGROUP") => Err(error),
            _ => Ok(connection),
        }
    }
}

/// An entry as read: its id, and its fields (`None`: deleted from the stream while
/// pending).
struct Entry {
    id: String,
    fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

/// An entry left pending after a transient failure, to take again once `due`.
struct Held {
    id: String,
    due: Instant,
    after: Duration,
}

/// Whether entries were read for the first time (`XREADGROUP … >`) or again (this
/// member's pending entries, `XCLAIM`, `XAUTOCLAIM`).
#[derive(Clone, Copy)]
enum Reads {
    New,
    Again,
}

/// What comes after an entry.
enum Flow {
    Next,
    Stop,
}

/// The consumer's loop, on one connection at a time.
struct Worker<'w, DB: Backend, C> {
    consumer: &'w RedisStreamsConsumer,
    pool: &'w Pool<DB>,
    policy: &'w AckPolicy<DB>,
    calls: &'w C,
    stopping: watch::Receiver<bool>,
    connection: Option<MultiplexedConnection>,
    /// While reading its own pending entries: the entry id to read after.
    own: Option<String>,
    held: Vec<Held>,
    next_claim: Instant,
    consumed: Consumed,
    meter: &'w Meter,
    /// What the metrics recorded of `consumed`.
    seen: Consumed,
    /// When the lag is recorded next.
    next_lag: std::time::Instant,
}

impl<DB: Backend, C: Calls<DB>> Worker<'_, DB, C> {
    async fn run(mut self) -> Consumed {
        let mut wait = RECONNECT.0;
        while !self.stopped() {
            let mut redis = match self.connection.clone() {
                Some(redis) => redis,
                None => {
                    if !self.pause(wait).await {
                        break;
                    }
                    wait = (wait * 2).min(RECONNECT.1);
                    match self.consumer.connect().await {
                        Ok(redis) => {
                            self.consumed.reconnects += 1;
                            self.own = Some("0".to_owned());
                            self.connection = Some(redis.clone());
                            redis
                        }
                        Err(error) => {
                            tracing::warn!(%error, stream = %self.consumer.stream,
                                "Redis Streams consumer: could not connect; trying again");
                            continue;
                        }
                    }
                }
            };
            match self.step(&mut redis).await {
                Ok(Flow::Next) => wait = RECONNECT.0,
                Ok(Flow::Stop) => break,
                Err(error) => {
                    tracing::warn!(%error, stream = %self.consumer.stream,
                        "Redis Streams consumer: command failed; connecting again");
                    self.connection = None;
                }
            }
        }
        // Held for a retry: pending with this member, taken again at its next start.
        self.consumed.requeued += self.held.len() as u64;
        self.consumed
    }

    fn stopped(&self) -> bool {
        shared::stopped(&self.stopping)
    }

    /// Waits `wait`; `false` once shutdown began.
    async fn pause(&mut self, wait: Duration) -> bool {
        shared::pause(&self.stopping, wait).await
    }

    /// One read and what it brought: the retries due, else the own pending entries, else
    /// a claim, else new entries.
    async fn step(&mut self, redis: &mut MultiplexedConnection) -> RedisResult<Flow> {
        let now = Instant::now();
        if self.held.iter().any(|held| held.due <= now) {
            let entries = self.retake(redis, now).await?;
            return self.process_all(redis, entries, Reads::Again).await;
        }
        if let Some(after) = self.own.clone() {
            let entries = self.read(redis, &after).await?;
            self.own = entries.last().map(|last| last.id.clone());
            return self.process_all(redis, entries, Reads::Again).await;
        }
        if self.next_claim <= now {
            let flow = self.claim(redis).await?;
            self.next_claim = Instant::now() + self.consumer.claim_idle / 2;
            return Ok(flow);
        }
        let next = self
            .held
            .iter()
            .map(|held| held.due)
            .fold(self.next_claim, Instant::min);
        let block = self.consumer.block.min(next.saturating_duration_since(now));
        let read = {
            let mut stopping = self.stopping.clone();
            let mut stop = pin!(stopping.wait_for(|stop| *stop));
            let mut read = pin!(self.read_new(redis, block));
            std::future::poll_fn(|context| {
                if let std::task::Poll::Ready(read) = read.as_mut().poll(context) {
                    return std::task::Poll::Ready(Some(read));
                }
                stop.as_mut().poll(context).map(|_| None)
            })
            .await
        };
        // Stop reading at once: what the dropped read delivered, if anything, stays
        // pending with this member.
        let Some(entries) = read else {
            return Ok(Flow::Stop);
        };
        let entries = entries?;
        self.process_all(redis, entries, Reads::New).await
    }

    /// `XREADGROUP GROUP <group> <member> COUNT <batch> STREAMS <stream> <after>`: this
    /// member's pending entries after `after`.
    async fn read(
        &self,
        redis: &mut MultiplexedConnection,
        after: &str,
    ) -> RedisResult<Vec<Entry>> {
        let consumer = self.consumer;
        let reply: Value = ::redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&consumer.group)
            .arg(&consumer.member)
            .arg("COUNT")
            .arg(consumer.batch)
            .arg("STREAMS")
            .arg(&consumer.stream)
            .arg(after)
            .query_async(redis)
            .await?;
        read_reply(&reply)
    }

    /// `XREADGROUP … BLOCK <ms> STREAMS <stream> >`: new entries, waiting up to `block`.
    async fn read_new(
        &self,
        redis: &mut MultiplexedConnection,
        block: Duration,
    ) -> RedisResult<Vec<Entry>> {
        let consumer = self.consumer;
        let reply: Value = ::redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&consumer.group)
            .arg(&consumer.member)
            .arg("COUNT")
            .arg(consumer.batch)
            .arg("BLOCK")
            .arg(u64::try_from(block.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg("STREAMS")
            .arg(&consumer.stream)
            .arg(">")
            .query_async(redis)
            .await?;
        read_reply(&reply)
    }

    /// `XCLAIM <stream> <group> <member> <idle> <id>…`: the held entries due, taken again
    /// by this member, which counts a delivery. One another member took over meanwhile
    /// (idle for less than its hold), or deleted, is not returned: it is no longer ours.
    async fn retake(
        &mut self,
        redis: &mut MultiplexedConnection,
        now: Instant,
    ) -> RedisResult<Vec<Entry>> {
        let (due, held): (Vec<Held>, Vec<Held>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|held| held.due <= now);
        self.held = held;
        let idle = due.iter().map(|held| held.after).min().unwrap_or_default();
        let consumer = self.consumer;
        let mut command = ::redis::cmd("XCLAIM");
        command
            .arg(&consumer.stream)
            .arg(&consumer.group)
            .arg(&consumer.member)
            .arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX));
        for held in &due {
            command.arg(&held.id);
        }
        let reply: Value = command.query_async(redis).await?;
        entries("XCLAIM", &reply)
    }

    /// `XAUTOCLAIM` from the start of the group's pending entries to their end, each batch
    /// processed as it comes; the ids Redis 7 reports deleted acknowledged.
    async fn claim(&mut self, redis: &mut MultiplexedConnection) -> RedisResult<Flow> {
        const COMMAND: &str = "XAUTOCLAIM";
        let consumer = self.consumer;
        let mut cursor = "0-0".to_owned();
        loop {
            let reply: Value = ::redis::cmd(COMMAND)
                .arg(&consumer.stream)
                .arg(&consumer.group)
                .arg(&consumer.member)
                .arg(u64::try_from(consumer.claim_idle.as_millis()).unwrap_or(u64::MAX))
                .arg(&cursor)
                .arg("COUNT")
                .arg(consumer.batch)
                .query_async(redis)
                .await?;
            // Redis 7: [next cursor, entries, ids deleted from the stream]; 6.2: the
            // first two (a deleted entry comes as [id, nil]).
            let (next, claimed, deleted) = match array(COMMAND, &reply)? {
                [next, claimed] => (next, claimed, None),
                [next, claimed, deleted] => (next, claimed, Some(deleted)),
                _ => return Err(unexpected(COMMAND, &reply)),
            };
            cursor = text(COMMAND, next)?;
            if let Some(deleted) = deleted {
                let ids = array(COMMAND, deleted)?
                    .iter()
                    .map(|id| text(COMMAND, id))
                    .collect::<RedisResult<Vec<_>>>()?;
                self.ack(redis, &ids).await?;
            }
            let claimed = entries(COMMAND, claimed)?;
            if let Flow::Stop = self.process_all(redis, claimed, Reads::Again).await? {
                return Ok(Flow::Stop);
            }
            if cursor == "0-0" {
                return Ok(Flow::Next);
            }
        }
    }

    /// Processes `entries` in order, in calls of up to the handler's `max`, with their
    /// delivery counts: 1 for new entries (`XREADGROUP … >` delivers an entry for the
    /// first time), else from one `XPENDING`.
    async fn process_all(
        &mut self,
        redis: &mut MultiplexedConnection,
        entries: Vec<Entry>,
        reads: Reads,
    ) -> RedisResult<Flow> {
        if entries.is_empty() {
            return Ok(Flow::Next);
        }
        if self.meter.lag_due(&mut self.next_lag)
            && let Err(error) = self.lag(redis).await
        {
            // Only a gauge: a connection that failed fails the next command too.
            tracing::debug!(%error, "Redis Streams consumer: no lag from XINFO GROUPS");
        }
        let counts = match reads {
            Reads::New => entries.iter().map(|entry| (entry.id.clone(), 1)).collect(),
            Reads::Again => match self.delivery_counts(redis, &entries).await {
                Ok(counts) => counts,
                Err(error) => {
                    self.consumed.dropped += entries.len() as u64;
                    return Err(error);
                }
            },
        };
        let mut left = entries.len();
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            if self.stopped() {
                // Not started: pending with this member, for its next start.
                self.consumed.requeued += left as u64;
                return Ok(Flow::Stop);
            }
            let mut call = Vec::new();
            while call.len() < self.calls.max() {
                let Some(entry) = entries.next() else { break };
                left -= 1;
                // Read again (its own pending entries after a reconnection): no longer
                // held.
                self.held.retain(|held| held.id != entry.id);
                // Missing from `XPENDING`: acknowledged, or another member's by now.
                if let Some(&count) = counts.get(&entry.id) {
                    call.push((entry, count));
                }
            }
            if call.is_empty() {
                continue;
            }
            let taken = call.len();
            let processed = self.process(redis, call).await;
            self.meter.catch_up(&mut self.seen, &self.consumed);
            match processed {
                Ok(Flow::Next) => {}
                Ok(Flow::Stop) => {
                    self.consumed.requeued += left as u64;
                    return Ok(Flow::Stop);
                }
                Err(error) => {
                    self.consumed.dropped += (left + taken) as u64;
                    return Err(error);
                }
            }
        }
        Ok(Flow::Next)
    }

    /// `XINFO GROUPS <stream>`: the group's `lag` (entries not yet delivered to it;
    /// Redis 7), recorded as the consumer's lag. Nothing when Redis does not know it.
    async fn lag(&self, redis: &mut MultiplexedConnection) -> RedisResult<()> {
        const COMMAND: &str = "XINFO";
        let reply: Value = ::redis::cmd(COMMAND)
            .arg("GROUPS")
            .arg(&self.consumer.stream)
            .query_async(redis)
            .await?;
        for group in array(COMMAND, &reply)? {
            let fields: Vec<(&Value, &Value)> = match group {
                Value::Map(pairs) => pairs.iter().map(|(k, v)| (k, v)).collect(),
                other => array(COMMAND, other)?
                    .chunks_exact(2)
                    .map(|pair| (&pair[0], &pair[1]))
                    .collect(),
            };
            let field = |name: &str| {
                fields
                    .iter()
                    .find(|(key, _)| text(COMMAND, key).is_ok_and(|key| key == name))
                    .map(|(_, value)| *value)
            };
            let ours = field("name").is_some_and(|name| {
                text(COMMAND, name).is_ok_and(|name| name == self.consumer.group)
            });
            if ours {
                if let Some(lag) = field("lag").and_then(|lag| integer(COMMAND, lag).ok()) {
                    self.meter.lag(None, lag);
                }
                break;
            }
        }
        Ok(())
    }

    /// `XPENDING <stream> <group> <first> <last> <n> <member>`: how often each of
    /// `entries`, pending with this member, has been delivered.
    async fn delivery_counts(
        &self,
        redis: &mut MultiplexedConnection,
        entries: &[Entry],
    ) -> RedisResult<HashMap<String, u64>> {
        const COMMAND: &str = "XPENDING";
        let consumer = self.consumer;
        let (first, last) =
            entries
                .iter()
                .fold((&entries[0].id, &entries[0].id), |(lo, hi), entry| {
                    (
                        if entry_order(&entry.id) < entry_order(lo) {
                            &entry.id
                        } else {
                            lo
                        },
                        if entry_order(&entry.id) > entry_order(hi) {
                            &entry.id
                        } else {
                            hi
                        },
                    )
                });
        // Between the first and the last, this member may also hold entries for a retry.
        let reply: Value = ::redis::cmd(COMMAND)
            .arg(&consumer.stream)
            .arg(&consumer.group)
            .arg(first)
            .arg(last)
            .arg(entries.len() + self.held.len() + consumer.batch)
            .arg(&consumer.member)
            .query_async(redis)
            .await?;
        let mut counts = HashMap::new();
        for item in array(COMMAND, &reply)? {
            match array(COMMAND, item)? {
                [id, _member, _idle, deliveries] => {
                    counts.insert(text(COMMAND, id)?, integer(COMMAND, deliveries)?);
                }
                _ => return Err(unexpected(COMMAND, item)),
            }
        }
        Ok(counts)
    }

    /// Runs the handler for `entries` (each with its delivery count) and settles each:
    /// the acknowledgements in one `XACK`.
    async fn process(
        &mut self,
        redis: &mut MultiplexedConnection,
        entries: Vec<(Entry, u64)>,
    ) -> RedisResult<Flow> {
        let consumer = self.consumer;
        let mut acks = Vec::new();
        let mut called = Vec::with_capacity(entries.len());
        for (entry, count) in entries {
            match &entry.fields {
                // Deleted from the stream while pending: nothing to process.
                None => acks.push(entry.id),
                Some(fields) if count > consumer.max_deliveries => {
                    tracing::warn!(entry = %entry.id, deliveries = count,
                        "Redis Streams consumer: over max_deliveries; dead-lettered unprocessed");
                    let error = format!(
                        "delivered {count} times, over max_deliveries ({})",
                        consumer.max_deliveries
                    );
                    self.dead_letter(redis, &entry, fields, count, &error)
                        .await?;
                    self.consumed.dead_lettered += 1;
                }
                Some(_) => called.push((entry, count)),
            }
        }
        if called.is_empty() {
            self.ack(redis, &acks).await?;
            return Ok(Flow::Next);
        }
        let messages: Vec<Message> = called
            .iter()
            .map(|(entry, count)| {
                let fields = entry.fields.as_deref().unwrap_or_default();
                message(&entry.id, fields, *count, consumer)
            })
            .collect();
        let span = calls::span(
            self.calls,
            "redis",
            &consumer.stream,
            Some(&consumer.group),
            &messages,
            consumer.trace_parent,
        );
        let call = self.calls.call(self.pool, self.policy, messages, &span);
        let started = std::time::Instant::now();
        let Some(settlements) = self.within_deadline(call).await else {
            // Shutdown's deadline passed: the call was dropped, its transaction rolled
            // back. The entries stay pending with this member.
            self.ack(redis, &acks).await?;
            self.consumed.requeued += called.len() as u64;
            return Ok(Flow::Stop);
        };
        self.meter.processed(started);
        let mut acknowledged = 0;
        for ((entry, count), (ack, error)) in called.iter().zip(settlements) {
            match ack {
                Ack::Ack => {
                    acks.push(entry.id.clone());
                    acknowledged += 1;
                }
                Ack::Retry { after } => {
                    if let Some((_, error)) = &error {
                        tracing::debug!(parent: &span, %error, ?after,
                            "Redis Streams consumer: transient failure; retried");
                    }
                    // Left pending; taken again (`XCLAIM`) once `after` passed.
                    self.held.push(Held {
                        id: entry.id.clone(),
                        due: Instant::now() + after,
                        after,
                    });
                    self.consumed.retried += 1;
                }
                Ack::DeadLetter => {
                    let error = error.map_or_else(
                        || "dead-lettered by the policy".to_owned(),
                        |(_, text)| text,
                    );
                    tracing::warn!(parent: &span, %error,
                        "Redis Streams consumer: permanent failure; dead-lettered");
                    let fields = entry.fields.as_deref().unwrap_or_default();
                    self.dead_letter(redis, entry, fields, *count, &error)
                        .await?;
                    self.consumed.dead_lettered += 1;
                }
            }
        }
        self.ack(redis, &acks).await?;
        self.consumed.acknowledged += acknowledged;
        Ok(Flow::Next)
    }

    /// `call`, or `None` if shutdown began and its deadline passed first.
    async fn within_deadline<T>(&mut self, call: impl Future<Output = T>) -> Option<T> {
        shared::within_deadline(&self.stopping, self.consumer.shutdown_deadline, call).await
    }

    /// `XACK <stream> <group> <id>…`: the entries leave the pending entries list.
    async fn ack(&self, redis: &mut MultiplexedConnection, ids: &[String]) -> RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let _acknowledged: Value = ::redis::cmd("XACK")
            .arg(&self.consumer.stream)
            .arg(&self.consumer.group)
            .arg(ids)
            .query_async(redis)
            .await?;
        Ok(())
    }

    /// `MULTI`, `XADD <dead stream> * <fields…> <provenance…>`, `XACK`, `EXEC`: the entry's
    /// copy in the dead stream and its acknowledgement, both or neither. The provenance
    /// fields: `dead-stream`, `dead-entry`, `dead-group`, `dead-consumer`,
    /// `dead-deliveries`, `dead-error`.
    async fn dead_letter(
        &self,
        redis: &mut MultiplexedConnection,
        entry: &Entry,
        fields: &[(Vec<u8>, Vec<u8>)],
        count: u64,
        error: &str,
    ) -> RedisResult<()> {
        let consumer = self.consumer;
        let mut pipeline = ::redis::pipe();
        pipeline.atomic();
        pipeline.cmd("XADD").arg(&consumer.dead_stream).arg("*");
        for (field, value) in fields {
            pipeline.arg(field.as_slice()).arg(value.as_slice());
        }
        pipeline
            .arg("dead-stream")
            .arg(&consumer.stream)
            .arg("dead-entry")
            .arg(&entry.id)
            .arg("dead-group")
            .arg(&consumer.group)
            .arg("dead-consumer")
            .arg(&consumer.member)
            .arg("dead-deliveries")
            .arg(count)
            .arg("dead-error")
            .arg(error)
            .ignore();
        pipeline
            .cmd("XACK")
            .arg(&consumer.stream)
            .arg(&consumer.group)
            .arg(&entry.id)
            .ignore();
        let () = pipeline.query_async(redis).await?;
        Ok(())
    }
}

/// An entry id (`<ms>-<seq>`) as numbers, to order ids as Redis does.
fn entry_order(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

/// The [`Message`] of the entry `entry` with `fields`, its `count`th delivery.
fn message(
    entry: &str,
    fields: &[(Vec<u8>, Vec<u8>)],
    count: u64,
    consumer: &RedisStreamsConsumer,
) -> Message {
    let id_field = match &consumer.message_id {
        MessageIdFrom::Field(name) => Some(name.as_bytes()),
        MessageIdFrom::EntryId => None,
    };
    let mut id = id_field.is_none().then(|| entry.to_owned());
    let mut payload = Vec::new();
    let mut headers = Vec::with_capacity(fields.len());
    for (field, value) in fields {
        if Some(field.as_slice()) == id_field {
            id = String::from_utf8(value.clone()).ok();
        } else if field == BODY.as_bytes() {
            payload.clone_from(value);
        } else {
            headers.push((String::from_utf8_lossy(field).into_owned(), value.clone()));
        }
    }
    Message {
        id: id.unwrap_or_default(),
        payload,
        headers,
        delivery: count,
        destination: consumer.stream.clone(),
    }
}

fn unexpected(command: &'static str, reply: &Value) -> RedisError {
    RedisError::from((
        ::redis::ErrorKind::UnexpectedReturnType,
        command,
        format!("unexpected reply {reply:?}"),
    ))
}

fn text(command: &'static str, value: &Value) -> RedisResult<String> {
    match value {
        Value::BulkString(bytes) => {
            String::from_utf8(bytes.clone()).map_err(|_| unexpected(command, value))
        }
        Value::SimpleString(text) => Ok(text.clone()),
        _ => Err(unexpected(command, value)),
    }
}

fn bytes(command: &'static str, value: &Value) -> RedisResult<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Ok(bytes.clone()),
        Value::SimpleString(text) => Ok(text.clone().into_bytes()),
        _ => Err(unexpected(command, value)),
    }
}

fn integer(command: &'static str, value: &Value) -> RedisResult<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).map_err(|_| unexpected(command, value)),
        _ => Err(unexpected(command, value)),
    }
}

fn array<'v>(command: &'static str, value: &'v Value) -> RedisResult<&'v [Value]> {
    match value {
        Value::Array(items) => Ok(items),
        _ => Err(unexpected(command, value)),
    }
}

/// `[[entry id, [field, value, …] or nil], …]`; a nil item (`XCLAIM` of a deleted entry on
/// Redis 6.2) left out.
fn entries(command: &'static str, value: &Value) -> RedisResult<Vec<Entry>> {
    let mut out = Vec::new();
    for item in array(command, value)? {
        if let Value::Nil = item {
            continue;
        }
        let [id, fields] = array(command, item)? else {
            return Err(unexpected(command, item));
        };
        let fields = match fields {
            Value::Nil => None,
            fields => {
                let flat = array(command, fields)?;
                if flat.len() % 2 != 0 {
                    return Err(unexpected(command, fields));
                }
                let mut pairs = Vec::with_capacity(flat.len() / 2);
                for pair in flat.chunks_exact(2) {
                    pairs.push((bytes(command, &pair[0])?, bytes(command, &pair[1])?));
                }
                Some(pairs)
            }
        };
        out.push(Entry {
            id: text(command, id)?,
            fields,
        });
    }
    Ok(out)
}

/// `XREADGROUP`'s reply for one stream: nil (nothing within `BLOCK`) or
/// `[[stream, entries]]` (RESP3: a map of stream to entries).
fn read_reply(value: &Value) -> RedisResult<Vec<Entry>> {
    const COMMAND: &str = "XREADGROUP";
    match value {
        Value::Nil => Ok(Vec::new()),
        Value::Array(streams) => match streams.as_slice() {
            [] => Ok(Vec::new()),
            [stream] => match array(COMMAND, stream)? {
                [_name, found] => entries(COMMAND, found),
                _ => Err(unexpected(COMMAND, stream)),
            },
            _ => Err(unexpected(COMMAND, value)),
        },
        Value::Map(streams) => match streams.as_slice() {
            [] => Ok(Vec::new()),
            [(_name, found)] => entries(COMMAND, found),
            _ => Err(unexpected(COMMAND, value)),
        },
        _ => Err(unexpected(COMMAND, value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consumer(from: MessageIdFrom) -> RedisStreamsConsumer {
        let client = Client::open("redis://127.0.0.1:6379").expect("a valid address");
        RedisStreamsConsumer::new(client, "orders", "billing", "billing-0").message_id(from)
    }

    fn fields() -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            ("id", "m-1"),
            ("body", "payload"),
            ("trace-id", "t-1"),
            ("key", "k-1"),
        ]
        .into_iter()
        .map(|(field, value)| (field.into(), value.into()))
        .collect()
    }

    #[test]
    fn the_id_field_the_body_and_the_rest_as_headers() {
        let message = message(
            "1-0",
            &fields(),
            2,
            &consumer(MessageIdFrom::Field("id".into())),
        );
        assert_eq!(message.id(), "m-1");
        assert_eq!(message.payload(), b"payload");
        let headers: Vec<_> = message.headers().collect();
        assert_eq!(headers, [("trace-id", &b"t-1"[..]), ("key", &b"k-1"[..])]);
        assert_eq!(
            (message.delivery_count(), message.destination()),
            (2, "orders")
        );
    }

    #[test]
    fn another_field_or_the_entry_id() {
        let by_key = message(
            "1-0",
            &fields(),
            1,
            &consumer(MessageIdFrom::Field("key".into())),
        );
        assert_eq!(by_key.id(), "k-1");
        assert_eq!(by_key.header("id"), Some(&b"m-1"[..]));
        let by_entry = message("1-0", &fields(), 1, &consumer(MessageIdFrom::EntryId));
        assert_eq!(by_entry.id(), "1-0");
        let none = message(
            "1-0",
            &fields()[1..],
            1,
            &consumer(MessageIdFrom::Field("id".into())),
        );
        assert_eq!(none.id(), "", "no id field: an empty id, dead-lettered");
    }

    #[test]
    fn entry_ids_order_as_redis_orders_them() {
        assert!(entry_order("9-0") < entry_order("10-0"));
        assert!(entry_order("10-2") < entry_order("10-10"));
    }
}
