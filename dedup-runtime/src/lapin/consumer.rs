//! The hosted RabbitMQ consumer: [`RabbitMqConsumer`].

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use ::lapin::message::Delivery;
use ::lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use ::lapin::types::{AMQPValue, FieldTable};
use ::lapin::{Channel, Connection, ConnectionProperties};
use futures_util::{FutureExt as _, StreamExt as _};
use sqlx::Pool;
use tokio::sync::{Mutex, watch};

use crate::ack::{Ack, AckPolicy};
use crate::ack::{AckOutcome, DecideError};
use crate::backend::Backend;
use crate::batch::BatchOutcome;
use crate::consume::calls::{self, Batches, Calls, Plain};
use crate::consume::{Consumed, Message, TraceParent};
use crate::lapin::settled;

/// Where a RabbitMQ consumer reads each message's id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageIdFrom {
    /// The AMQP `message-id` property: where [`RabbitMqPublisher`](super::RabbitMqPublisher)
    /// puts the outgoing id, and the AMQP convention. The default.
    MessageId,
    /// The header of that name (a string value).
    Header(String),
}

/// Runs an `#[idempotent]` handler for every message of a RabbitMQ queue, and owns
/// everything between the broker and the handler:
///
/// - **Settles after the transaction.** Each message is acknowledged only once its
///   handler returned: processed (committed) or a duplicate → `basic.ack` (in the batch
///   form, a batch's acknowledgements as one `basic.ack` with `multiple` when none of
///   its messages is retried); a transient
///   failure → held for [`AckPolicy`]'s delay, then `basic.reject` with `requeue` (quorum
///   queues count only rejects toward their `x-delivery-limit`); a permanent failure →
///   `basic.reject` without `requeue`, to the queue's dead-letter exchange. Failures are
///   settled one by one, never with `multiple`.
/// - **Bounds what it holds**: each of its [`concurrency`](Self::concurrency) channels
///   takes at most [`prefetch`](Self::prefetch) unacknowledged messages, and processes
///   one at a time, in the order the channel received them.
/// - **Survives its broker**: when the connection or a channel is lost (a broker
///   restart, a cut network, a consumer cancelled by the broker), the messages in hand
///   are dropped unsettled — their acknowledgement cannot be sent any more, and is never
///   sent on a new channel — and the consumer connects again (waiting 100 ms, doubling up
///   to 5 s, while it cannot). RabbitMQ delivers the dropped messages again; the dedup
///   record makes a committed one a duplicate.
/// - **Stops gracefully** when the future given to [`run`](Self::run) completes: it
///   stops taking messages (`basic.cancel`), finishes the message in hand within the
///   [`shutdown_deadline`](Self::shutdown_deadline) (one not finished by then is
///   dropped: its transaction rolls back), settles it, hands back what it had fetched
///   and not started (`basic.nack` with `requeue`, which does not count as a failed
///   delivery), closes its channels and its connection — in that order.
///
/// The message's id is its `message-id` property unless [`message_id`](Self::message_id)
/// says otherwise; its payload, headers and delivery count
/// ([`delivery_count`](super::delivery_count)) go to the handler in a
/// [`Message`]. Declare the dead-letter exchange on the queue
/// (`x-dead-letter-exchange`): without one, RabbitMQ drops a rejected message.
///
/// ```no_run
/// use dedup_runtime::consume::Message;
/// use dedup_runtime::idempotent;
/// use dedup_runtime::lapin::RabbitMqConsumer;
/// use lapin::ConnectionProperties;
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
/// let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let consumer = RabbitMqConsumer::new(uri, ConnectionProperties::default(), "payments");
/// let shutdown = std::future::pending(); // SIGTERM, in a service
/// let consumed = consumer
///     .run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, shutdown)
///     .await?;
/// println!("{consumed:?}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RabbitMqConsumer {
    uri: String,
    properties: ConnectionProperties,
    queue: String,
    prefetch: u16,
    concurrency: usize,
    message_id: MessageIdFrom,
    shutdown_deadline: Duration,
    trace_parent: Option<TraceParent>,
    declare: bool,
    dead_letters_by_policy: bool,
}

impl std::fmt::Debug for RabbitMqConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the URI: it may hold a password.
        f.debug_struct("RabbitMqConsumer")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .field("message_id", &self.message_id)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("trace_parent", &self.trace_parent.is_some())
            .field("declare", &self.declare)
            .field("dead_letters_by_policy", &self.dead_letters_by_policy)
            .finish_non_exhaustive()
    }
}

/// Why [`RabbitMqConsumer::run`] ended before its shutdown.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The first connection failed (a wrong URI or credentials, a broker not there at
    /// start), or its first subscription did (no such queue, no permission): a service
    /// would rather fail at start than run without its queue. Once it has consumed,
    /// the consumer connects again by itself.
    Start(::lapin::Error),
    /// The queue is a quorum queue whose arguments set a delivery limit
    /// (`x-delivery-limit`) and no dead-letter exchange: RabbitMQ would drop a message
    /// once it reaches the limit — and every retry (`basic.reject` with requeue, the
    /// only settlement quorum queues count) spends a delivery. Give the queue
    /// `x-dead-letter-exchange` (or let the consumer declare it, [`declare`]), or, if
    /// a policy gives it one, say so: [`dead_letters_by_policy`].
    ///
    /// [`declare`]: RabbitMqConsumer::declare
    /// [`dead_letters_by_policy`]: RabbitMqConsumer::dead_letters_by_policy
    NoDeadLetterExchange {
        /// The queue.
        queue: String,
        /// Its `x-delivery-limit`.
        delivery_limit: i64,
    },
}

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumeError::Start(error) => write!(f, "RabbitMQ consumer could not start: {error}"),
            ConsumeError::NoDeadLetterExchange {
                queue,
                delivery_limit,
            } => write!(
                f,
                "RabbitMQ consumer could not start: the quorum queue `{queue}` has a delivery \
                 limit ({delivery_limit}) and no dead-letter exchange, so RabbitMQ would drop a \
                 message that reaches it (each retry counts); declare it with \
                 `x-dead-letter-exchange` (or `declare(true)`), or, if a policy gives it one, \
                 set `dead_letters_by_policy(true)`"
            ),
        }
    }
}

impl std::error::Error for ConsumeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConsumeError::Start(error) => Some(error),
            ConsumeError::NoDeadLetterExchange { .. } => None,
        }
    }
}

/// How long connecting, opening a channel and subscribing may take together.
const SUBSCRIBE: Duration = Duration::from_secs(30);
/// How long a channel's or a connection's close is awaited: lapin may never answer one
/// sent as the connection fails.
const CLOSE: Duration = Duration::from_secs(5);

use crate::consume::shared::{self, Meter, RECONNECT};

impl RabbitMqConsumer {
    /// A consumer of `queue` on the broker at `uri` (as
    /// [`lapin::Connection::connect`](::lapin::Connection::connect) takes it), with
    /// `properties`: one channel, a prefetch of 16, ids from `message-id`, a 10 s
    /// shutdown deadline.
    pub fn new(uri: &str, properties: ConnectionProperties, queue: &str) -> Self {
        RabbitMqConsumer {
            uri: uri.to_owned(),
            properties,
            queue: queue.to_owned(),
            prefetch: 16,
            concurrency: 1,
            message_id: MessageIdFrom::MessageId,
            shutdown_deadline: Duration::from_secs(10),
            trace_parent: None,
            declare: false,
            dead_letters_by_policy: false,
        }
    }

    /// Whether the consumer declares its queue at start (off by default: the queue is
    /// yours): the durable queue with `x-dead-letter-exchange = <queue>.dlx`, the durable
    /// fanout exchange `<queue>.dlx` and the durable queue `<queue>.dead` bound to it,
    /// where dead letters land. Declaring is idempotent; a queue that exists with other
    /// arguments — without that dead-letter exchange, say, where RabbitMQ would drop a
    /// rejected message — is refused by RabbitMQ (`PRECONDITION_FAILED`), and the run
    /// fails at start ([`ConsumeError::Start`]).
    pub fn declare(self, declare: bool) -> Self {
        RabbitMqConsumer { declare, ..self }
    }

    /// Says that a policy gives the queue its dead-letter exchange (off by default), so
    /// that the start-up check does not refuse a quorum queue whose arguments have a
    /// delivery limit and no dead-letter exchange
    /// ([`ConsumeError::NoDeadLetterExchange`]): a policy is invisible to a client.
    pub fn dead_letters_by_policy(self, by_policy: bool) -> Self {
        RabbitMqConsumer {
            dead_letters_by_policy: by_policy,
            ..self
        }
    }

    /// Unacknowledged messages the broker sends each channel ahead (16 by default; at
    /// least 1): what the consumer holds at most per channel.
    pub fn prefetch(self, messages: u16) -> Self {
        RabbitMqConsumer {
            prefetch: messages.max(1),
            ..self
        }
    }

    /// Channels, each processing one message at a time (1 by default; at least 1).
    /// More than one processes that many messages at once, and the queue's order is not
    /// kept across them.
    pub fn concurrency(self, channels: usize) -> Self {
        RabbitMqConsumer {
            concurrency: channels.max(1),
            ..self
        }
    }

    /// Where each message's id is read ([`MessageIdFrom::MessageId`] by default).
    pub fn message_id(self, from: MessageIdFrom) -> Self {
        RabbitMqConsumer {
            message_id: from,
            ..self
        }
    }

    /// How long the message in hand may still take once shutdown began (10 s by
    /// default). Keep it under the grace period of whatever stops the process.
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        RabbitMqConsumer {
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
        RabbitMqConsumer {
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
    /// not start ([`ConsumeError::Start`]); after that, a lost connection is connected
    /// again, and the run ends only with `shutdown`.
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

    /// Consumes until `shutdown` completes, handing each channel's messages to `handler`
    /// in batches: the messages the channel has received when the last batch ended, in
    /// the order it received them, at most `max` (at least 1; each channel's
    /// [`prefetch`](Self::prefetch) is raised to `max` if lower, so that a batch can
    /// fill). No batch waits for more messages than are there: a quiet queue gives
    /// batches of one. `handler` is given the pool and the batch, both its own:
    /// `|pool, batch| async move { apply(&pool, &batch).await }` for an
    /// `#[idempotent(batch = fresh, key = |msg| msg.id())]` handler `apply(tx, fresh:
    /// &[&Message])`: one transaction claims every id, runs the body over the fresh
    /// ones, and commits (see [`batch`](crate::batch)).
    ///
    /// Each message is settled as its [`BatchItem`](crate::batch::BatchItem) says,
    /// through `policy`, as the plain form settles it: processed, a duplicate or a copy
    /// of one → `basic.ack`; a transient failure (or an item in progress under another
    /// delivery's lease) → held for the longest delay among the batch's, then
    /// `basic.reject` with `requeue`; a permanent failure, an invalid id or a
    /// fingerprint mismatch → `basic.reject` without `requeue`, to the dead-letter
    /// exchange. A batch whose call failed as a whole is decided on that error for each
    /// message. A batch not finished within the shutdown deadline is handed back whole.
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
        let consumer = RabbitMqConsumer {
            prefetch: self
                .prefetch
                .max(u16::try_from(calls.max()).unwrap_or(u16::MAX)),
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
        let link = Link {
            consumer: self,
            connection: Mutex::new(None),
            subscribed: std::sync::Mutex::new(Vec::new()),
        };
        if self.declare {
            link.declare().await.map_err(ConsumeError::Start)?;
        }
        if !self.dead_letters_by_policy {
            link.check_dead_letters().await?;
        }
        // The first subscription, so that a wrong URI or queue fails the run at once.
        let mut first = Vec::with_capacity(self.concurrency);
        for _ in 0..self.concurrency {
            first.push(link.subscribe().await.map_err(ConsumeError::Start)?);
        }
        let (stop, stopping) = watch::channel(false);
        let meter = Meter::new("rabbitmq", &self.queue, "");
        let workers = futures_util::future::join_all(first.into_iter().map(|subscription| {
            let worker = Worker {
                consumer: self,
                link: &link,
                pool,
                policy,
                calls,
                stopping: stopping.clone(),
                meter: &meter,
                seen: Consumed::default(),
                next_lag: std::time::Instant::now(),
            };
            worker.run(subscription)
        }));
        let mut workers = pin!(workers);
        let finished = shared::first(workers.as_mut(), shutdown).await;
        let done = match finished {
            Some(done) => done,
            None => {
                // The workers hear of it first (so that a subscription the cancel ends is
                // not taken for a lost one, nor made again), the broker next: no more
                // deliveries on any channel, while the messages in hand finish (or meet
                // the deadline) and what was fetched ahead is handed back.
                let _ = stop.send(true);
                futures_util::future::join(link.cancel_all(), workers)
                    .await
                    .1
            }
        };
        let mut consumed = Consumed::default();
        for worker in &done {
            consumed.add(worker);
        }
        meter.finish(&consumed);
        if let Some(connection) = link.connection.lock().await.take() {
            let closing = connection.close(200, "dedup: consumer stopped".into());
            let _ = tokio::time::timeout(CLOSE, closing).await;
        }
        Ok(consumed)
    }
}

/// The connection the consumer's channels share, made again when lost.
struct Link<'c> {
    consumer: &'c RabbitMqConsumer,
    connection: Mutex<Option<Connection>>,
    /// Every channel consuming and its consumer tag, for the cancels at shutdown.
    subscribed: std::sync::Mutex<Vec<(Channel, ::lapin::types::ShortString)>>,
}

/// A channel consuming the queue.
struct Subscription {
    channel: Channel,
    deliveries: ::lapin::Consumer,
}

impl Link<'_> {
    /// A new channel with its prefetch, consuming the queue; a new connection first if
    /// the one in use is lost.
    async fn subscribe(&self) -> Result<Subscription, ::lapin::Error> {
        // Bounded: a connection that died without lapin noticing yet could hold a step
        // for ever. A subscription that failed leaves its connection for a new one.
        let made = tokio::time::timeout(SUBSCRIBE, self.try_subscribe()).await;
        let made = made.unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "RabbitMQ did not answer the subscription in time",
            )
            .into())
        });
        if made.is_err() {
            *self.connection.lock().await = None;
        }
        made
    }

    async fn try_subscribe(&self) -> Result<Subscription, ::lapin::Error> {
        let channel = {
            let mut connection = self.connection.lock().await;
            if !connection
                .as_ref()
                .is_some_and(|connection| connection.status().connected())
            {
                *connection = None;
                let made =
                    Connection::connect(&self.consumer.uri, self.consumer.properties.clone())
                        .await?;
                *connection = Some(made);
            }
            connection
                .as_ref()
                .expect("connected just now")
                .create_channel()
                .await?
        };
        channel
            .basic_qos(self.consumer.prefetch, BasicQosOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                self.consumer.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut subscribed = self.subscribed.lock().expect("not poisoned");
        subscribed.retain(|(channel, _)| channel.status().connected());
        subscribed.push((channel.clone(), deliveries.tag()));
        drop(subscribed);
        Ok(Subscription {
            channel,
            deliveries,
        })
    }

    /// The queue, its dead-letter exchange and its dead queue ([`RabbitMqConsumer::declare`]).
    async fn declare(&self) -> Result<(), ::lapin::Error> {
        use ::lapin::ExchangeKind;
        use ::lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};

        let queue = &self.consumer.queue;
        let (dlx, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
        let channel = {
            let mut connection = self.connection.lock().await;
            let made =
                Connection::connect(&self.consumer.uri, self.consumer.properties.clone()).await?;
            let channel = made.create_channel().await?;
            *connection = Some(made);
            channel
        };
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                dlx.as_str().into(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(
                dead.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                dead.as_str().into(),
                dlx.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(dlx.as_str().into()),
        );
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                arguments,
            )
            .await?;
        let _ = tokio::time::timeout(CLOSE, channel.close(200, "dedup: declared".into())).await;
        Ok(())
    }

    /// Refuses a quorum queue whose arguments have a delivery limit and no dead-letter
    /// exchange ([`ConsumeError::NoDeadLetterExchange`]). A client cannot read a queue's
    /// arguments, but RabbitMQ names them: a declaration whose arguments differ from the
    /// queue's is refused with the first that differs and its value ("inequivalent arg
    /// 'x-delivery-limit' … current is the value '5' of type 'signedint'"), so the
    /// arguments are learnt one refusal at a time (each on a channel of its own, which the
    /// refusal closes) until a declaration matches — which changes nothing. A queue that
    /// does not exist is left to the subscription's error; a refusal that cannot be read
    /// ends the check without refusing.
    async fn check_dead_letters(&self) -> Result<(), ConsumeError> {
        use ::lapin::options::QueueDeclareOptions;

        let queue = self.consumer.queue.as_str();
        let connection = Connection::connect(&self.consumer.uri, self.consumer.properties.clone())
            .await
            .map_err(ConsumeError::Start)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let exists = connection
            .create_channel()
            .await
            .map_err(ConsumeError::Start)?
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        let mut arguments = FieldTable::default();
        // A quorum queue is durable; a classic one that is not says so at once.
        let options = QueueDeclareOptions::durable();
        let mut matched = false;
        for _ in 0..32 {
            if exists.is_err() {
                break;
            }
            let channel = connection
                .create_channel()
                .await
                .map_err(ConsumeError::Start)?;
            let declared = channel
                .queue_declare(queue.into(), options, arguments.clone())
                .await;
            match declared {
                Ok(_) => {
                    let _ =
                        tokio::time::timeout(CLOSE, channel.close(200, "dedup: checked".into()))
                            .await;
                    matched = true;
                    break;
                }
                Err(error) => match inequivalent(&error.to_string()) {
                    Some((name, value)) => {
                        arguments.insert(name.into(), value);
                    }
                    None => break,
                },
            }
        }
        let _ = tokio::time::timeout(CLOSE, connection.close(200, "dedup: checked".into())).await;
        if !matched {
            return Ok(());
        }
        let table = arguments.inner();
        let quorum = matches!(table.get("x-queue-type"),
            Some(AMQPValue::LongString(kind)) if kind.as_bytes() == b"quorum");
        let limit = table.get("x-delivery-limit").and_then(integer);
        let dead_letters = table.contains_key("x-dead-letter-exchange");
        match limit {
            Some(delivery_limit) if quorum && !dead_letters => {
                Err(ConsumeError::NoDeadLetterExchange {
                    queue: queue.to_owned(),
                    delivery_limit,
                })
            }
            _ => Ok(()),
        }
    }

    /// `basic.cancel` on every channel consuming: the broker sends nothing more, while
    /// the messages in hand finish.
    async fn cancel_all(&self) {
        let subscribed = std::mem::take(&mut *self.subscribed.lock().expect("not poisoned"));
        for (channel, tag) in subscribed {
            let cancel = channel.basic_cancel(tag, BasicCancelOptions::default());
            let _ = tokio::time::timeout(Duration::from_secs(5), cancel).await;
        }
    }
}

/// One channel's loop.
struct Worker<'w, DB: Backend, C> {
    consumer: &'w RabbitMqConsumer,
    link: &'w Link<'w>,
    pool: &'w Pool<DB>,
    policy: &'w AckPolicy<DB>,
    calls: &'w C,
    stopping: watch::Receiver<bool>,
    meter: &'w Meter,
    /// What the metrics recorded of this worker's counts.
    seen: Consumed,
    /// When the lag is recorded next.
    next_lag: std::time::Instant,
}

/// How a subscription ended.
enum Ended {
    Shutdown,
    Lost,
}

impl<DB: Backend, C: Calls<DB>> Worker<'_, DB, C> {
    async fn run(mut self, first: Subscription) -> Consumed {
        let mut consumed = Consumed::default();
        let mut subscription = Some(first);
        let mut wait = RECONNECT.0;
        loop {
            let current = match subscription.take() {
                Some(current) => current,
                None => {
                    if self.stopped() {
                        return consumed;
                    }
                    match self.link.subscribe().await {
                        Ok(current) => {
                            consumed.reconnects += 1;
                            wait = RECONNECT.0;
                            current
                        }
                        Err(error) => {
                            tracing::warn!(%error, queue = %self.consumer.queue,
                                "RabbitMQ consumer: could not subscribe; trying again");
                            if !self.pause(wait).await {
                                return consumed;
                            }
                            wait = (wait * 2).min(RECONNECT.1);
                            continue;
                        }
                    }
                }
            };
            match self.consume(current, &mut consumed).await {
                Ended::Shutdown => return consumed,
                Ended::Lost => {
                    tracing::warn!(queue = %self.consumer.queue,
                        "RabbitMQ consumer: channel or connection lost; connecting again");
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

    /// Processes the subscription's deliveries until shutdown or its loss.
    async fn consume(&mut self, mut current: Subscription, consumed: &mut Consumed) -> Ended {
        loop {
            let next = {
                let mut stopping = self.stopping.clone();
                let stop = stopping.wait_for(|stop| *stop);
                let mut stop = pin!(stop);
                let mut next = pin!(current.deliveries.next());
                std::future::poll_fn(|context| {
                    if let std::task::Poll::Ready(next) = next.as_mut().poll(context) {
                        return std::task::Poll::Ready(Some(next));
                    }
                    stop.as_mut().poll(context).map(|_| None)
                })
                .await
            };
            let first = match next {
                None => {
                    self.stop(current, consumed).await;
                    return Ended::Shutdown;
                }
                Some(Some(Ok(delivery))) => delivery,
                // Cancelled by the broker (the queue deleted, a node down) or the channel
                // closed: subscribe again.
                Some(None | Some(Err(_))) => return Ended::Lost,
            };
            // A batch: what the channel has received already, without waiting for more.
            let mut deliveries = vec![first];
            let mut lost = false;
            while deliveries.len() < self.calls.max() {
                match current.deliveries.next().now_or_never() {
                    Some(Some(Ok(delivery))) => deliveries.push(delivery),
                    Some(None | Some(Err(_))) => {
                        lost = true;
                        break;
                    }
                    None => break,
                }
            }
            let settled = self.process(deliveries, consumed).await;
            self.meter.catch_up(&mut self.seen, consumed);
            if settled && self.meter.lag_due(&mut self.next_lag) {
                self.lag(&current.channel).await;
            }
            if !settled || lost {
                return Ended::Lost;
            }
            if self.stopped() {
                self.stop(current, consumed).await;
                return Ended::Shutdown;
            }
        }
    }

    /// Runs the handler for `deliveries` and settles each; `false` when a settlement
    /// could not be sent (the channel is lost).
    async fn process(&mut self, mut deliveries: Vec<Delivery>, consumed: &mut Consumed) -> bool {
        let consumer = self.consumer;
        let messages: Vec<Message> = deliveries
            .iter_mut()
            .map(|delivery| message(delivery, &consumer.message_id, &consumer.queue))
            .collect();
        let span = calls::span(
            self.calls,
            "rabbitmq",
            &consumer.queue,
            None,
            &messages,
            consumer.trace_parent,
        );
        let call = self.calls.call(self.pool, self.policy, messages, &span);
        let started = std::time::Instant::now();
        let Some(settlements) = self.within_deadline(call).await else {
            // Shutdown's deadline passed: the call was dropped, its transaction rolled
            // back. Hand the messages back, counting no failure.
            let mut sent = true;
            for delivery in &deliveries {
                sent &= hand_back(delivery, consumed).await;
            }
            return sent;
        };
        self.meter.processed(started);
        // Without a retry in the batch, its acknowledgements go as one `basic.ack` with
        // `multiple`, after the dead letters' rejects: every delivery of this channel
        // before the batch is settled already (a batch is settled whole before the next
        // is taken), so the acknowledgement covers exactly the batch's processed ones.
        let together = deliveries.len() > 1
            && !settlements
                .iter()
                .any(|(ack, _)| matches!(ack, Ack::Retry { .. }));
        let mut acknowledged = Vec::new();
        // Dead letters and (one by one) acknowledgements first; the retries after the
        // longest of their delays (RabbitMQ has no delayed requeue).
        let mut all_sent = true;
        let mut retries = Vec::new();
        let mut wait = Duration::ZERO;
        for (delivery, (ack, error)) in deliveries.iter().zip(settlements) {
            let sent = match ack {
                Ack::Ack if together => {
                    acknowledged.push(delivery);
                    continue;
                }
                Ack::Ack => {
                    let acker = &delivery.acker;
                    let options = ::lapin::options::BasicAckOptions::default();
                    settled(acker, acker.ack(options)).await
                }
                Ack::Retry { after } => {
                    if let Some((_, error)) = &error {
                        tracing::debug!(parent: &span, %error, ?after,
                            "RabbitMQ consumer: transient failure; retried");
                    }
                    wait = wait.max(after);
                    retries.push(delivery);
                    continue;
                }
                Ack::DeadLetter => {
                    let error = error.map_or_else(
                        || "dead-lettered by the policy".to_owned(),
                        |(_, text)| text,
                    );
                    tracing::warn!(parent: &span, %error,
                        "RabbitMQ consumer: permanent failure; dead-lettered");
                    let acker = &delivery.acker;
                    settled(acker, acker.reject(BasicRejectOptions { requeue: false })).await
                }
            };
            all_sent &= count(sent, ack, consumed);
        }
        if let Some(last) = acknowledged.last() {
            let multiple = ::lapin::options::BasicAckOptions { multiple: true };
            let sent = settled(&last.acker, last.acker.ack(multiple)).await;
            let sent = matches!(sent, Ok(true));
            for _ in &acknowledged {
                let sent = if sent { Ok(true) } else { Ok(false) };
                all_sent &= count(sent, Ack::Ack, consumed);
            }
        }
        if retries.is_empty() {
            return all_sent;
        }
        // Held while they wait; at shutdown they go back at once, as ones not started
        // would.
        if !self.pause(wait).await {
            for delivery in retries {
                all_sent &= hand_back(delivery, consumed).await;
            }
            return all_sent;
        }
        for delivery in retries {
            let acker = &delivery.acker;
            let sent = settled(acker, acker.reject(BasicRejectOptions { requeue: true })).await;
            all_sent &= count(sent, Ack::Retry { after: wait }, consumed);
        }
        all_sent
    }

    /// `call`, or `None` if shutdown began and its deadline passed first.
    async fn within_deadline<T>(&mut self, call: impl Future<Output = T>) -> Option<T> {
        shared::within_deadline(&self.stopping, self.consumer.shutdown_deadline, call).await
    }

    /// Records the queue's ready messages (a passive `queue.declare`) as the lag.
    async fn lag(&self, channel: &Channel) {
        let passive = ::lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declare = channel.queue_declare(
            self.consumer.queue.as_str().into(),
            passive,
            FieldTable::default(),
        );
        if let Ok(Ok(queue)) = tokio::time::timeout(Duration::from_secs(5), declare).await {
            self.meter.lag(None, u64::from(queue.message_count()));
        }
    }

    /// Shutdown: no more deliveries, the ones fetched and not started handed back, the
    /// channel closed.
    async fn stop(&mut self, mut current: Subscription, consumed: &mut Consumed) {
        // Cancelled already by `consume` when shutdown began; what the channel had
        // fetched ahead comes out of the stream after the cancel.
        while let Ok(Some(Ok(delivery))) =
            tokio::time::timeout(Duration::from_millis(100), current.deliveries.next()).await
        {
            if requeue(&delivery).await {
                consumed.requeued += 1;
            }
        }
        let closing = current.channel.close(200, "dedup: consumer stopped".into());
        let _ = tokio::time::timeout(CLOSE, closing).await;
    }
}

/// Counts a settlement by what reached the broker: one not sent (the channel gone, or
/// the delivery settled already) leaves the message to be delivered again. Whether it
/// was sent.
fn count(sent: ::lapin::Result<bool>, ack: Ack, consumed: &mut Consumed) -> bool {
    let counter = match sent {
        Ok(true) => match ack {
            Ack::Ack => &mut consumed.acknowledged,
            Ack::Retry { .. } => &mut consumed.retried,
            Ack::DeadLetter => &mut consumed.dead_lettered,
        },
        Ok(false) | Err(_) => &mut consumed.dropped,
    };
    *counter += 1;
    matches!(sent, Ok(true))
}

/// The argument a `PRECONDITION_FAILED` refusal of a declaration names, with the value
/// the queue has ("inequivalent arg 'NAME' for queue … but current is the value 'VALUE'
/// of type 'TYPE'"); `None` for another refusal, or a type not read here.
fn inequivalent(refusal: &str) -> Option<(String, AMQPValue)> {
    let (_, rest) = refusal.split_once("inequivalent arg '")?;
    let (name, rest) = rest.split_once('\'')?;
    let (_, rest) = rest.split_once("current is the value '")?;
    let (value, rest) = rest.split_once("' of type '")?;
    let (kind, _) = rest.split_once('\'')?;
    let value = match kind {
        "longstr" => AMQPValue::LongString(value.into()),
        "signedint" => AMQPValue::LongInt(value.parse().ok()?),
        "long" => AMQPValue::LongLongInt(value.parse().ok()?),
        "short" => AMQPValue::ShortInt(value.parse().ok()?),
        "byte" => AMQPValue::ShortShortInt(value.parse().ok()?),
        "unsignedint" => AMQPValue::LongUInt(value.parse().ok()?),
        "unsignedshort" => AMQPValue::ShortUInt(value.parse().ok()?),
        "unsignedbyte" => AMQPValue::ShortShortUInt(value.parse().ok()?),
        "bool" => AMQPValue::Boolean(value.parse().ok()?),
        _ => return None,
    };
    Some((name.to_owned(), value))
}

/// An integer argument's value.
fn integer(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        _ => return None,
    })
}

/// [`requeue`], counted: `requeued` when sent, `dropped` (and `false`) when the channel
/// is gone.
async fn hand_back(delivery: &Delivery, consumed: &mut Consumed) -> bool {
    let sent = requeue(delivery).await;
    if sent {
        consumed.requeued += 1;
    } else {
        consumed.dropped += 1;
    }
    sent
}

/// Hands `delivery` back unprocessed: `basic.nack` with `requeue`, which quorum queues do
/// not count as a failed delivery. Whether it was sent.
async fn requeue(delivery: &Delivery) -> bool {
    let back = BasicNackOptions {
        requeue: true,
        multiple: false,
    };
    let acker = &delivery.acker;
    matches!(settled(acker, acker.nack(back)).await, Ok(true))
}

/// The [`Message`] of `delivery`, its payload moved out.
fn message(delivery: &mut Delivery, from: &MessageIdFrom, queue: &str) -> Message {
    let headers: Vec<(String, Vec<u8>)> = delivery
        .properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter_map(|(name, value)| Some((name.to_string(), header_bytes(value)?)))
                .collect()
        })
        .unwrap_or_default();
    let id = match from {
        MessageIdFrom::MessageId => delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        MessageIdFrom::Header(name) => headers
            .iter()
            .find(|(key, _)| key == name)
            .and_then(|(_, value)| String::from_utf8(value.clone()).ok()),
    };
    Message {
        id: id.unwrap_or_default(),
        // The delivery's own bytes: it is settled through its acker, without them.
        payload: std::mem::take(&mut delivery.data),
        headers,
        delivery: super::delivery_count(delivery),
        destination: queue.to_owned(),
    }
}

/// A header's value as bytes: strings and byte arrays as they are, numbers and booleans
/// as their decimal text; `None` for tables, arrays and the rest.
fn header_bytes(value: &AMQPValue) -> Option<Vec<u8>> {
    Some(match value {
        AMQPValue::LongString(text) => text.as_bytes().to_vec(),
        AMQPValue::ShortString(text) => text.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(bytes) => bytes.as_slice().to_vec(),
        AMQPValue::Boolean(flag) => flag.to_string().into_bytes(),
        AMQPValue::ShortShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortInt(n) => n.to_string().into_bytes(),
        AMQPValue::ShortUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongUInt(n) => n.to_string().into_bytes(),
        AMQPValue::LongLongInt(n) => n.to_string().into_bytes(),
        AMQPValue::Timestamp(n) => n.to_string().into_bytes(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RabbitMQ 3.10's refusals, as a declaration gets them.
    #[test]
    fn a_refusal_names_the_argument_and_its_value() {
        let refusal = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue \
                       'q' in vhost '/': received none but current is the value '5' of type \
                       'signedint'";
        assert_eq!(
            inequivalent(refusal),
            Some(("x-delivery-limit".to_owned(), AMQPValue::LongInt(5)))
        );
        let refusal = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in \
                       vhost '/': received none but current is the value 'quorum' of type \
                       'longstr'";
        assert_eq!(
            inequivalent(refusal),
            Some((
                "x-queue-type".to_owned(),
                AMQPValue::LongString("quorum".into())
            ))
        );
        // Ours has it, the queue not: nothing to learn.
        let refusal = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in \
                       vhost '/': received the value 'quorum' of type 'longstr' but current \
                       is none";
        assert_eq!(inequivalent(refusal), None);
        assert_eq!(inequivalent("NOT_FOUND - no queue 'q'"), None);
    }
}
