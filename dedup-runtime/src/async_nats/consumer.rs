//! The hosted NATS JetStream consumer: [`JetStreamConsumer`].

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use ::async_nats::HeaderMap;
use ::async_nats::connection::State;
use ::async_nats::jetstream::consumer::pull::{self, Batch};
use ::async_nats::jetstream::consumer::{Consumer, PullConsumer};
use ::async_nats::jetstream::{AckKind, Context};
use futures_util::{FutureExt as _, StreamExt as _};
use sqlx::Pool;
use tokio::sync::watch;

use crate::ack::{Ack, AckPolicy};
use crate::ack::{AckOutcome, DecideError};
use crate::backend::Backend;
use crate::batch::BatchOutcome;
use crate::consume::calls::{self, Batches, Calls, Plain};
use crate::consume::{Consumed, Message, TraceParent};

/// Where a JetStream consumer reads each message's id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIdFrom {
    /// The header `Message-Id`: where [`JetStreamPublisher`](super::JetStreamPublisher)
    /// puts the outgoing id. The default.
    MessageId,
    /// The header `Nats-Msg-Id`, JetStream's own duplicate-window id (the publisher sets
    /// it too). JetStream drops a copy published within the stream's duplicate window;
    /// the consumer's dedup holds beyond it.
    NatsMsgId,
    /// The header of that name.
    Header(String),
    /// The message's stream sequence, in decimal. Safe only where a message is published
    /// once: a producer's retry is stored again under a new sequence, and dedup would
    /// not see it as a copy — this guards against redeliveries only. And only while the
    /// stream lives: a stream deleted and created again (or purged with its sequence
    /// reset) numbers from 1 again, and its new messages would read as duplicates of the
    /// old ones. Give each stream its own `#[idempotent(consumer = …)]` name.
    StreamSequence,
}

/// The headers a dead letter's copy carries, beside the original's: where it came from
/// and why it was dead-lettered.
pub mod provenance {
    /// The stream the message was read from.
    pub const STREAM: &str = "Dedup-Source-Stream";
    /// The subject it was published to.
    pub const SUBJECT: &str = "Dedup-Source-Subject";
    /// Its sequence in that stream.
    pub const SEQUENCE: &str = "Dedup-Source-Sequence";
    /// The durable consumer that read it.
    pub const CONSUMER: &str = "Dedup-Source-Consumer";
    /// Which delivery of it was dead-lettered (JetStream's count, from 1).
    pub const DELIVERY_COUNT: &str = "Dedup-Delivery-Count";
    /// The handler's error, as its `Display` writes it (line breaks made spaces, cut at
    /// [`ERROR_LIMIT`] bytes with a `…`); absent when the handler returned no error.
    pub const ERROR: &str = "Dedup-Error";
    /// The longest error text kept, in bytes.
    pub const ERROR_LIMIT: usize = crate::consume::shared::ERROR_LIMIT;
}

/// Runs an `#[idempotent]` handler for every message of a durable JetStream pull
/// consumer, and owns everything between the server and the handler:
///
/// - **Settles after the transaction.** Each message is acknowledged only once its
///   handler returned: processed (committed) or a duplicate → `+ACK`, confirmed by the
///   server (a double ack); a transient failure → `-NAK` with [`AckPolicy`]'s delay, and
///   JetStream delivers it again then; a permanent failure → a copy published to the
///   [dead subject](Self::dead_subject) and confirmed by the stream that captures it,
///   then `+TERM`, confirmed. The copy has the payload and headers of the message (but
///   for the `Nats-…` directives, `Nats-Msg-Id` kept) and the [`provenance`] headers.
///   A copy that cannot be stored (no stream captures the subject) leaves the message
///   unsettled: JetStream delivers it again after the ack wait. A crash between the copy
///   and the `+TERM` delivers it again too, so the dead stream may hold it twice, never
///   zero times.
/// - **Bounds what it holds**: each of its [`concurrency`](Self::concurrency) workers
///   pulls at most [`batch`](Self::batch) messages at a time, processes them one at a
///   time in the order they came, and pulls again once the pull is done. Keep a batch's
///   worth of handler time under the consumer's ack wait; the message in hand is kept
///   from redelivery while its handler runs (`+WPI` every third of the ack wait, read
///   from the consumer's configuration), the ones waiting behind it are not.
/// - **Survives its server**: async-nats connects again by itself; a pull lost with the
///   connection is issued again once the client is back (waiting 100 ms, doubling up to
///   5 s, while a pull fails), and the messages in hand whose acknowledgement could not
///   be sent are dropped — JetStream delivers them again after the ack wait, and the
///   dedup record makes a committed one a duplicate.
/// - **Stops gracefully** when the future given to [`run`](Self::run) completes: it
///   stops pulling, finishes the message in hand within the
///   [`shutdown_deadline`](Self::shutdown_deadline) (one not finished by then is
///   dropped — its transaction rolls back — and handed back with a `-NAK` without delay,
///   so that it comes back at once), settles it, hands back what it had pulled and not
///   started (`-NAK` without delay), and flushes the client — in that order. The pull
///   is closed before the hand-backs go out, so that they are not delivered straight
///   back to it; a message the server sends in that moment comes back after the ack
///   wait.
///
/// The message's id is its `Message-Id` header unless [`message_id`](Self::message_id)
/// says otherwise; its payload, headers and delivery count
/// ([`delivery_count`](super::delivery_count)) go to the handler in a [`Message`] whose
/// [`destination`](Message::destination) is the subject. The durable consumer needs
/// explicit acknowledgements (`AckPolicy::Explicit`) and should have a `max_deliver`
/// (JetStream's default is unlimited): a message past it stays in the stream, neither
/// delivered nor dead-lettered.
///
/// ```no_run
/// use dedup_runtime::async_nats::JetStreamConsumer;
/// use dedup_runtime::consume::Message;
/// use dedup_runtime::idempotent;
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
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let jetstream = async_nats::jetstream::new(client);
/// let consumer = JetStreamConsumer::new(jetstream, "PAYMENTS", "payments");
/// let shutdown = std::future::pending(); // SIGTERM, in a service
/// let consumed = consumer
///     .run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, shutdown)
///     .await?;
/// println!("{consumed:?}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct JetStreamConsumer {
    context: Context,
    stream: String,
    durable: String,
    create: Option<pull::Config>,
    batch: usize,
    concurrency: usize,
    message_id: MessageIdFrom,
    dead_subject: Option<String>,
    shutdown_deadline: Duration,
    trace_parent: Option<TraceParent>,
}

impl std::fmt::Debug for JetStreamConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the context: its client is the application's, and says nothing of this one.
        f.debug_struct("JetStreamConsumer")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("create", &self.create.is_some())
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("message_id", &self.message_id)
            .field("dead_subject", &self.dead_subject)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("trace_parent", &self.trace_parent.is_some())
            .finish_non_exhaustive()
    }
}

/// Why [`JetStreamConsumer::run`] ended before its shutdown.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The stream or the durable consumer could not be found (or created, with
    /// [`create_with`](JetStreamConsumer::create_with)) at start: a wrong name, no
    /// JetStream, a server not there. A service would rather fail at start than run
    /// without its consumer. Once it has started, the consumer pulls again by itself.
    Start(::async_nats::Error),
}

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumeError::Start(error) => {
                write!(f, "NATS JetStream consumer could not start: {error}")
            }
        }
    }
}

impl std::error::Error for ConsumeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsumeError::Start(error) => Some(&**error),
        }
    }
}

// The first and the longest wait before pulling again after a failed pull: `RECONNECT`.
use crate::consume::shared::{self, Meter, RECONNECT};
/// How long a pull waits on the server for messages: also the longest a pull lost with
/// its connection could linger, had the loss gone unseen.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// How often a waiting pull looks at the connection.
const WATCH: Duration = Duration::from_millis(100);
/// JetStream's default ack wait, for a consumer that reports none.
const ACK_WAIT: Duration = Duration::from_secs(30);

impl JetStreamConsumer {
    /// A consumer of the durable pull consumer `durable` of `stream`, through `context`:
    /// one worker, batches of 16, ids from `Message-Id`, dead letters to
    /// `<subject>.dead`, a 10 s shutdown deadline. The durable consumer must exist,
    /// unless [`create_with`](Self::create_with) says how to create it.
    pub fn new(context: Context, stream: &str, durable: &str) -> Self {
        JetStreamConsumer {
            context,
            stream: stream.to_owned(),
            durable: durable.to_owned(),
            create: None,
            batch: 16,
            concurrency: 1,
            message_id: MessageIdFrom::MessageId,
            dead_subject: None,
            shutdown_deadline: Duration::from_secs(10),
            trace_parent: None,
        }
    }

    /// Creates the durable consumer at start with `config` (its `durable_name` set to
    /// the consumer's name) if it does not exist. One that exists keeps its own
    /// configuration: JetStream does not apply `config` to it.
    pub fn create_with(self, config: pull::Config) -> Self {
        JetStreamConsumer {
            create: Some(config),
            ..self
        }
    }

    /// Messages each pull asks for at most (16 by default; at least 1): what each
    /// worker holds at most.
    pub fn batch(self, messages: usize) -> Self {
        JetStreamConsumer {
            batch: messages.max(1),
            ..self
        }
    }

    /// Workers, each pulling and processing one message at a time (1 by default; at
    /// least 1). More than one processes that many messages at once, and the stream's
    /// order is not kept across them.
    pub fn concurrency(self, workers: usize) -> Self {
        JetStreamConsumer {
            concurrency: workers.max(1),
            ..self
        }
    }

    /// Where each message's id is read ([`MessageIdFrom::MessageId`] by default).
    pub fn message_id(self, from: MessageIdFrom) -> Self {
        JetStreamConsumer {
            message_id: from,
            ..self
        }
    }

    /// The subject dead letters are published to (by default the message's subject
    /// with `.dead` appended). A stream must capture it.
    pub fn dead_subject(self, subject: &str) -> Self {
        JetStreamConsumer {
            dead_subject: Some(subject.to_owned()),
            ..self
        }
    }

    /// How long the message in hand may still take once shutdown began (10 s by
    /// default). Keep it under the grace period of whatever stops the process.
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        JetStreamConsumer {
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
        JetStreamConsumer {
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

    /// Consumes until `shutdown` completes, calling `handler` for each message and
    /// settling it as `policy` decides; returns what it did. `Err` only when it could
    /// not start ([`ConsumeError::Start`]); after that, a lost connection or a failed
    /// pull is pulled again, and the run ends only with `shutdown`.
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

    /// Consumes until `shutdown` completes, handing messages to an
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

    /// Consumes until `shutdown` completes, handing each worker's messages to `handler`
    /// in batches: the messages its pull has brought when the last batch ended, in
    /// stream order, at most `max` (at least 1; each pull asks for at least `max`,
    /// whatever [`batch`](Self::batch) says). No batch waits for more messages than are
    /// there: a quiet stream gives batches of one. `handler` is given the pool and the
    /// batch, both its own: `|pool, batch| async move { apply(&pool, &batch).await }` for
    /// an `#[idempotent(batch = fresh, key = |msg| msg.id())]` handler `apply(tx, fresh:
    /// &[&Message])`: one transaction claims every id, runs the body over the fresh ones,
    /// and commits (see [`batch`](crate::batch)).
    ///
    /// Each message is settled as its [`BatchItem`](crate::batch::BatchItem) says,
    /// through `policy`, as the plain form settles it — the batch's settlements sent
    /// together, one wait for all: processed, a duplicate or a copy of one → `+ACK`
    /// (confirmed); a transient failure (or an item in progress under another
    /// delivery's lease) → `-NAK` with its delay; a permanent failure, an invalid id or a
    /// fingerprint mismatch → a copy to the dead subject, then `+TERM`. A batch whose
    /// call failed as a whole is decided on that error for each message. While the call
    /// runs, every message of the batch gets its `+WPI`; a batch not finished within the
    /// shutdown deadline is handed back whole.
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
        let consumer = JetStreamConsumer {
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
        let bound = self.bind().await.map_err(ConsumeError::Start)?;
        let ack_wait = match bound.cached_info().config.ack_wait {
            Duration::ZERO => ACK_WAIT,
            wait => wait,
        };
        let (stop, stopping) = watch::channel(false);
        let meter = Meter::new("nats", &self.stream, &self.durable);
        let workers = futures_util::future::join_all((0..self.concurrency).map(|_| {
            let worker = Worker {
                consumer: self,
                pull: bound.clone(),
                pool,
                policy,
                calls,
                stopping: stopping.clone(),
                progress: (ack_wait / 3).max(Duration::from_millis(10)),
                meter: &meter,
                seen: Consumed::default(),
            };
            worker.run()
        }));
        let mut workers = pin!(workers);
        let mut shutdown = pin!(shutdown);
        let finished = std::future::poll_fn(|context| {
            if let Poll::Ready(done) = workers.as_mut().poll(context) {
                return Poll::Ready(Some(done));
            }
            shutdown.as_mut().poll(context).map(|()| None)
        })
        .await;
        let done = match finished {
            Some(done) => done,
            None => {
                // The workers stop pulling, finish (or drop) the message in hand, settle
                // it and hand back the rest.
                let _ = stop.send(true);
                workers.await
            }
        };
        let mut consumed = Consumed::default();
        for worker in &done {
            consumed.add(worker);
        }
        meter.finish(&consumed);
        // The hand-backs are plain publications: out before the run returns.
        let client = self.context.client();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.flush()).await;
        Ok(consumed)
    }

    /// The durable consumer, found (or created).
    async fn bind(&self) -> Result<PullConsumer, ::async_nats::Error> {
        let stream = self.context.get_stream(&self.stream).await?;
        let bound: Consumer<pull::Config> = match &self.create {
            Some(config) => {
                let config = pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ..config.clone()
                };
                stream.get_or_create_consumer(&self.durable, config).await?
            }
            None => stream.get_consumer(&self.durable).await?,
        };
        Ok(bound)
    }
}

/// One worker's loop.
struct Worker<'w, DB: Backend, C> {
    consumer: &'w JetStreamConsumer,
    pull: PullConsumer,
    pool: &'w Pool<DB>,
    policy: &'w AckPolicy<DB>,
    calls: &'w C,
    stopping: watch::Receiver<bool>,
    /// How often the message in hand is kept from redelivery (`+WPI`).
    progress: Duration,
    meter: &'w Meter,
    /// What the metrics recorded of this worker's counts.
    seen: Consumed,
}

/// How a pull ended.
enum Ended {
    Shutdown,
    /// Done (its messages all came, or it expired): pull again.
    Done,
    /// Ended by the server with an error status (a consumer deleted, too many pulls
    /// waiting): pull again after a pause.
    Refused,
    /// The connection was lost under it.
    Lost,
}

/// What became of a message.
enum Processed {
    /// Settled, or left for redelivery with the connection up.
    Settled,
    /// Not settled: the connection is lost.
    Lost,
    /// Shutdown's deadline passed first: to hand back.
    Unfinished(Vec<::async_nats::jetstream::Message>),
}

/// What a wait on a pull saw first.
enum Next<T> {
    Message(T),
    Stop,
    Lost,
}

impl<DB: Backend, C: Calls<DB>> Worker<'_, DB, C> {
    async fn run(mut self) -> Consumed {
        let mut consumed = Consumed::default();
        let client = self.consumer.context.client();
        let mut wait = RECONNECT.0;
        let mut lost = false;
        loop {
            if self.stopped() {
                return consumed;
            }
            if client.connection_state() != State::Connected {
                lost = true;
                if !self.pause(WATCH).await {
                    return consumed;
                }
                continue;
            }
            let connects = client.statistics().connects.load(Ordering::Relaxed);
            let request = self
                .pull
                .batch()
                .max_messages(self.consumer.batch)
                .expires(PULL_EXPIRES)
                .messages()
                .await;
            let batch = match request {
                Ok(batch) => batch,
                Err(error) => {
                    tracing::warn!(%error, stream = %self.consumer.stream,
                        consumer = %self.consumer.durable,
                        "NATS JetStream consumer: could not pull; trying again");
                    if !self.pause(wait).await {
                        return consumed;
                    }
                    wait = (wait * 2).min(RECONNECT.1);
                    continue;
                }
            };
            if lost {
                consumed.reconnects += 1;
                lost = false;
            }
            match self.consume(batch, &client, connects, &mut consumed).await {
                Ended::Shutdown => return consumed,
                Ended::Done => wait = RECONNECT.0,
                Ended::Refused => {
                    if !self.pause(wait).await {
                        return consumed;
                    }
                    wait = (wait * 2).min(RECONNECT.1);
                }
                Ended::Lost => {
                    tracing::warn!(stream = %self.consumer.stream,
                        consumer = %self.consumer.durable,
                        "NATS JetStream consumer: connection lost; pulling again once back");
                    lost = true;
                }
            }
        }
    }

    fn stopped(&self) -> bool {
        shared::stopped(&self.stopping)
    }

    /// Waits `wait`; `false` once shutdown began.
    async fn pause(&mut self, wait: Duration) -> bool {
        shared::pause(&self.stopping, wait).await
    }

    /// Processes the pull's messages until it ends, shutdown or the connection's loss
    /// (`connects` changed since the pull went out).
    async fn consume(
        &mut self,
        mut batch: Batch,
        client: &::async_nats::Client,
        connects: u64,
        consumed: &mut Consumed,
    ) -> Ended {
        let statistics = client.statistics();
        loop {
            let next = {
                let mut stopping = self.stopping.clone();
                let stop = stopping.wait_for(|stop| *stop);
                let mut stop = pin!(stop);
                let mut next = pin!(batch.next());
                loop {
                    // Before each wait too: a pull whose messages keep coming would not
                    // wait long enough to look otherwise.
                    let away = client.connection_state() != State::Connected
                        || statistics.connects.load(Ordering::Relaxed) != connects;
                    if away {
                        break Next::Lost;
                    }
                    let mut watch = pin!(tokio::time::sleep(WATCH));
                    let seen = std::future::poll_fn(|context| {
                        if let Poll::Ready(next) = next.as_mut().poll(context) {
                            return Poll::Ready(Some(Next::Message(next)));
                        }
                        if stop.as_mut().poll(context).is_ready() {
                            return Poll::Ready(Some(Next::Stop));
                        }
                        watch.as_mut().poll(context).map(|()| None)
                    })
                    .await;
                    if let Some(seen) = seen {
                        break seen;
                    }
                }
            };
            let first = match next {
                Next::Stop => {
                    self.stop(batch, Vec::new(), consumed).await;
                    return Ended::Shutdown;
                }
                Next::Lost => return Ended::Lost,
                Next::Message(None) => return Ended::Done,
                Next::Message(Some(Err(error))) => {
                    tracing::debug!(%error, "NATS JetStream consumer: pull ended by the server");
                    return Ended::Refused;
                }
                Next::Message(Some(Ok(message))) => message,
            };
            // A batch: what the pull has brought already, without waiting for more.
            let mut messages = vec![first];
            let mut ended = None;
            while messages.len() < self.calls.max() {
                match batch.next().now_or_never() {
                    Some(Some(Ok(message))) => messages.push(message),
                    Some(None) => {
                        ended = Some(Ended::Done);
                        break;
                    }
                    Some(Some(Err(error))) => {
                        tracing::debug!(%error, "NATS JetStream consumer: pull ended by the server");
                        ended = Some(Ended::Refused);
                        break;
                    }
                    None => break,
                }
            }
            let processed = self.process(messages, consumed).await;
            self.meter.catch_up(&mut self.seen, consumed);
            match processed {
                Processed::Settled => {}
                Processed::Lost => return Ended::Lost,
                Processed::Unfinished(messages) => {
                    self.stop(batch, messages, consumed).await;
                    return Ended::Shutdown;
                }
            }
            if let Some(ended) = ended {
                return ended;
            }
            if self.stopped() {
                self.stop(batch, Vec::new(), consumed).await;
                return Ended::Shutdown;
            }
        }
    }

    /// Runs the handler for `messages` and settles each, the settlements sent together.
    async fn process(
        &mut self,
        messages: Vec<::async_nats::jetstream::Message>,
        consumed: &mut Consumed,
    ) -> Processed {
        let consumer = self.consumer;
        let handed: Vec<Message> = messages
            .iter()
            .map(|message| self::message(message, &consumer.message_id))
            .collect();
        let destination = match (self.calls.batches(), handed.first()) {
            (false, Some(first)) => first.destination().to_owned(),
            _ => consumer.stream.clone(),
        };
        let span = calls::span(
            self.calls,
            "nats",
            &destination,
            Some(&consumer.durable),
            &handed,
            consumer.trace_parent,
        );
        if let Some(Ok(info)) = messages.last().map(::async_nats::jetstream::Message::info) {
            self.meter.lag(None, info.pending);
        }
        let call = self.calls.call(self.pool, self.policy, handed, &span);
        let started = std::time::Instant::now();
        let Some(settlements) = self.within_deadline(call, &messages).await else {
            // Shutdown's deadline passed: the call was dropped, its transaction rolled
            // back. The messages go back once the pull is closed.
            return Processed::Unfinished(messages);
        };
        self.meter.processed(started);
        let sent = futures_util::future::join_all(messages.iter().zip(settlements).map(
            |(message, (ack, error))| {
                let (span, worker) = (&span, &*self);
                async move {
                    let sent = match ack {
                        Ack::Ack => message.double_ack().await,
                        Ack::Retry { after } => {
                            if let Some((_, error)) = &error {
                                tracing::debug!(parent: span, %error, ?after,
                                    "NATS JetStream consumer: transient failure; retried");
                            }
                            message.ack_with(AckKind::Nak(Some(after))).await
                        }
                        Ack::DeadLetter => {
                            let error = error.map(|(_, text)| text);
                            if let Some(error) = &error {
                                tracing::warn!(parent: span, %error,
                                    "NATS JetStream consumer: permanent failure; dead-lettered");
                            }
                            worker.dead_letter(message, error.as_deref()).await
                        }
                    };
                    if let Err(error) = &sent {
                        tracing::warn!(parent: span, %error,
                            "NATS JetStream consumer: not settled; delivered again after the ack wait");
                    }
                    (ack, sent.is_ok())
                }
            },
        ))
        .await;
        let mut all_sent = true;
        for (ack, sent) in sent {
            let counter = match (sent, ack) {
                (true, Ack::Ack) => &mut consumed.acknowledged,
                (true, Ack::Retry { .. }) => &mut consumed.retried,
                (true, Ack::DeadLetter) => &mut consumed.dead_lettered,
                // Not sent or not confirmed: JetStream delivers the message again after
                // its ack wait.
                (false, _) => &mut consumed.dropped,
            };
            *counter += 1;
            all_sent &= sent;
        }
        if all_sent || self.consumer.context.client().connection_state() == State::Connected {
            Processed::Settled
        } else {
            Processed::Lost
        }
    }

    /// `call`, or `None` if shutdown began and its deadline passed first; meanwhile
    /// `+WPI` for each of `messages` every [`progress`](Worker::progress).
    async fn within_deadline<T>(
        &mut self,
        call: impl Future<Output = T>,
        messages: &[::async_nats::jetstream::Message],
    ) -> Option<T> {
        let deadline = self.consumer.shutdown_deadline;
        let mut stopping = self.stopping.clone();
        let cutoff = async move {
            let _ = stopping.wait_for(|stop| *stop).await;
            tokio::time::sleep(deadline).await;
        };
        let mut call = pin!(call);
        let mut cutoff = pin!(cutoff);
        loop {
            let mut tick = pin!(tokio::time::sleep(self.progress));
            let step = std::future::poll_fn(|context| {
                if let Poll::Ready(done) = call.as_mut().poll(context) {
                    return Poll::Ready(Some(Some(done)));
                }
                if cutoff.as_mut().poll(context).is_ready() {
                    return Poll::Ready(Some(None));
                }
                tick.as_mut().poll(context).map(|()| None)
            })
            .await;
            match step {
                Some(done) => return done,
                // Working still: JetStream restarts the message's ack wait.
                None => {
                    let progress = messages
                        .iter()
                        .map(|message| message.ack_with(AckKind::Progress));
                    let _ = futures_util::future::join_all(progress).await;
                }
            }
        }
    }

    /// A copy of `message` to the dead subject, confirmed by its stream, then `+TERM`,
    /// confirmed.
    async fn dead_letter(
        &self,
        message: &::async_nats::jetstream::Message,
        error: Option<&str>,
    ) -> Result<(), ::async_nats::Error> {
        let subject = match &self.consumer.dead_subject {
            Some(subject) => subject.clone(),
            None => format!("{}.dead", message.subject),
        };
        let mut headers = super::dead_letter_headers(message.headers.as_ref());
        headers.insert(provenance::SUBJECT, message.subject.as_str());
        headers.insert(provenance::CONSUMER, self.consumer.durable.as_str());
        let info = message.info()?;
        headers.insert(provenance::STREAM, info.stream);
        headers.insert(
            provenance::SEQUENCE,
            info.stream_sequence.to_string().as_str(),
        );
        headers.insert(
            provenance::DELIVERY_COUNT,
            super::delivery_count(message).to_string().as_str(),
        );
        if let Some(error) = error {
            headers.insert(provenance::ERROR, shared::header_text(error).as_str());
        }
        message
            .context
            .publish_with_headers(subject, headers, message.payload.clone())
            .await?
            .await?;
        message.double_ack_with(AckKind::Term).await
    }

    /// Hands `message` back unprocessed (`-NAK` without delay), counted: `requeued` when
    /// sent, `dropped` when not.
    async fn hand_back(&self, message: &::async_nats::jetstream::Message, consumed: &mut Consumed) {
        if message.ack_with(AckKind::Nak(None)).await.is_ok() {
            consumed.requeued += 1;
        } else {
            consumed.dropped += 1;
        }
    }

    /// Shutdown: the pull closed, then `unfinished` and the messages the pull brought
    /// and not started handed back. Not the other way round: a message handed back while
    /// the pull is open would come straight back into it.
    async fn stop(
        &mut self,
        mut batch: Batch,
        unfinished: Vec<::async_nats::jetstream::Message>,
        consumed: &mut Consumed,
    ) {
        let mut back = unfinished;
        while let Ok(Some(Ok(message))) =
            tokio::time::timeout(Duration::from_millis(100), batch.next()).await
        {
            back.push(message);
        }
        // Unsubscribed before the hand-backs go out, on the same connection: the server
        // delivers nothing more to this pull.
        drop(batch);
        for message in &back {
            self.hand_back(message, consumed).await;
        }
    }
}

/// The [`Message`] of `message`.
fn message(message: &::async_nats::jetstream::Message, from: &MessageIdFrom) -> Message {
    let headers: Vec<(String, Vec<u8>)> = message
        .headers
        .as_ref()
        .into_iter()
        .flat_map(HeaderMap::iter)
        .flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(move |value| (name.to_owned(), value.as_str().as_bytes().to_vec()))
        })
        .collect();
    let header = |wanted: &str| {
        headers
            .iter()
            .find(|(name, _)| name == wanted)
            .and_then(|(_, value)| String::from_utf8(value.clone()).ok())
    };
    let id = match from {
        MessageIdFrom::MessageId => header("Message-Id"),
        MessageIdFrom::NatsMsgId => header(::async_nats::header::NATS_MESSAGE_ID.as_ref()),
        MessageIdFrom::Header(name) => header(name),
        MessageIdFrom::StreamSequence => message
            .info()
            .ok()
            .map(|info| info.stream_sequence.to_string()),
    };
    Message {
        id: id.unwrap_or_default(),
        payload: message.payload.to_vec(),
        headers,
        delivery: super::delivery_count(message),
        destination: message.subject.to_string(),
    }
}
