//! The hosted MQTT consumer: [`MqttConsumer`].

use std::collections::VecDeque;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use ::rumqttc::Outgoing;
use ::rumqttc::v5::mqttbytes::QoS;
use ::rumqttc::v5::mqttbytes::v5::{
    Packet, PubAckReason, Publish, PublishProperties, SubscribeReasonCode,
};
use ::rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use sqlx::Pool;
use tokio::sync::{mpsc, watch};

use crate::ack::{Ack, AckOutcome, AckPolicy, DecideError};
use crate::backend::Backend;
use crate::batch::BatchOutcome;
use crate::consume::calls::{self, Batches, Calls, Plain, Settlement};
use crate::consume::{Consumed, Message, TraceParent};

use super::{MESSAGE_ID, MQTT_MAX_PACKET};

/// The user properties a dead letter carries after the original's: where it came from
/// and why it was dead-lettered.
pub mod provenance {
    /// The topic the message was published to.
    pub const TOPIC: &str = "dedup-source-topic";
    /// The client id of the consumer's session that read it.
    pub const CLIENT: &str = "dedup-source-client";
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

/// Runs an `#[idempotent]` handler for every message of an MQTT subscription (MQTT 5
/// through rumqttc's `v5` client, QoS 1), and owns everything between the broker and the
/// handler:
///
/// - **A persistent session.** The consumer connects with the client id of the
///   [`MqttOptions`] given here, **clean start off** and a **session expiry** (it sets
///   both; the expiry is the options' own if they have one, else *never*: in MQTT 5 a
///   session without one ends with its connection, and the messages sent meanwhile with
///   it). The broker keeps the subscription and the messages it sent and had no `PUBACK`
///   for, and sends them again when the session connects again. Use one stable client id
///   per consumer process (a second connection with the same id takes the session over).
/// - **No size limit of its own.** Unless the options set a maximum packet size, the
///   consumer announces MQTT's own ([`MQTT_MAX_PACKET`]): rumqttc's default of 10 KiB
///   would make a larger message fail the connection each time it came. A limit of yours
///   is announced to the broker, which then discards the larger messages for this session
///   (MQTT 5's rule): they never reach the consumer.
/// - **`PUBACK` after the transaction, in arrival order.** Acknowledgements are manual
///   (the consumer sets it: rumqttc's default acknowledges on receipt, before the
///   handler, and a crash then loses the message). MQTT wants `PUBACK`s in the order the
///   messages came, so one message is handled at a time, in order.
/// - **Retries in process.** MQTT has no negative acknowledgement and redelivers only on
///   a new connection: `Ack::Retry { after }` waits `after` and calls the handler again
///   (its delivery count one more), holding the later messages back meanwhile.
/// - **Dead letters** go to the dead topic (`<topic>/dead` by default; a shared
///   subscription's `$share/<group>/` prefix left out) at QoS 1 with the original payload
///   and user properties, and the [`provenance`] after them (source topic, client id,
///   attempts, error class and text); the original is acknowledged once the broker
///   accepted the copy (a crash in between sends the copy twice, never zero times). MQTT
///   keeps a message only for a topic someone is subscribed to: subscribe a persistent
///   session of yours to the dead topic before dead letters come. A copy the broker
///   refuses, or answers with *no matching subscribers*, is not an acknowledged dead
///   letter: the original stays unacknowledged, the consumer waits 5 s and connects
///   again, and the message comes back (a warning says why each time).
/// - **Survives its broker**: when the connection is lost the message in hand is not
///   acknowledged (its packet id belongs to the old connection, and the broker may give
///   it to another message on the new one), and the consumer connects again (waiting
///   100 ms, doubling up to 5 s); the broker sends the unacknowledged messages again, and
///   the dedup record makes a committed one a duplicate.
/// - **Stops gracefully** when the future given to [`run`](Self::run) completes: it
///   takes no new message, finishes the one in hand within the
///   [`shutdown_deadline`](Self::shutdown_deadline) (one not finished is dropped: its
///   transaction rolls back), acknowledges it, and disconnects; the messages it had
///   received and not started stay with the session, for the next start.
///
/// The message id is the user property `message-id` ([`MESSAGE_ID`]; another with
/// [`id_property`](Self::id_property)): where [`MqttPublisher`](super::MqttPublisher)
/// writes it. A message without it has no id: the handler refuses its empty id, and it
/// is dead-lettered. [`Message::payload`] is the payload byte for byte, and
/// [`Message::headers`] the other user properties, in order. The topic may be a shared
/// subscription (`$share/<group>/<topic>`): the broker then spreads the messages over
/// the group's sessions.
///
/// ```no_run
/// use dedup_runtime::consume::Message;
/// use dedup_runtime::idempotent;
/// use dedup_runtime::rumqttc::MqttConsumer;
/// use rumqttc::v5::MqttOptions;
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
/// let options = MqttOptions::new("payments-consumer-1", "127.0.0.1", 1883);
/// let consumer = MqttConsumer::new(options, "payments");
/// let shutdown = std::future::pending(); // SIGTERM, in a service
/// let consumed = consumer
///     .run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, shutdown)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MqttConsumer {
    options: MqttOptions,
    topic: String,
    dead_topic: String,
    id_property: String,
    shutdown_deadline: Duration,
    trace_parent: Option<TraceParent>,
}

impl std::fmt::Debug for MqttConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttConsumer")
            .field("client_id", &self.options.client_id())
            .field("broker", &self.options.broker_address())
            .field("topic", &self.topic)
            .field("dead_topic", &self.dead_topic)
            .field("id_property", &self.id_property)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("trace_parent", &self.trace_parent.is_some())
            .finish_non_exhaustive()
    }
}

/// Why [`MqttConsumer::run`] ended before its shutdown.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The first connection or subscription failed (a broker not there at start, a
    /// refused client id, a subscription the broker did not grant at QoS 1 or more): a
    /// service would rather fail at start. Once it has consumed, the consumer connects
    /// again by itself.
    Start(String),
}

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumeError::Start(error) => write!(f, "MQTT consumer could not start: {error}"),
        }
    }
}

impl std::error::Error for ConsumeError {}

use crate::consume::shared::{self, Meter, RECONNECT};
/// How long a connection, a subscription or a dead letter's `PUBACK` may take.
const WIRE: Duration = Duration::from_secs(30);

impl MqttConsumer {
    /// A consumer of `topic` (a topic filter; `$share/<group>/<topic>` for a shared
    /// subscription) at QoS 1, connecting with `options` (clean start off, a session
    /// expiry, manual acknowledgements set here), the id from the user property
    /// `message-id`, dead letters to `<topic>/dead`, a 10 s shutdown deadline.
    pub fn new(options: MqttOptions, topic: &str) -> Self {
        let unshared = topic
            .strip_prefix("$share/")
            .and_then(|rest| rest.split_once('/'))
            .map_or(topic, |(_, topic)| topic);
        MqttConsumer {
            options,
            topic: topic.to_owned(),
            dead_topic: format!("{unshared}/dead"),
            id_property: MESSAGE_ID.to_owned(),
            shutdown_deadline: Duration::from_secs(10),
            trace_parent: None,
        }
    }

    /// Where dead letters go (`<topic>/dead` by default).
    pub fn dead_topic(self, topic: &str) -> Self {
        MqttConsumer {
            dead_topic: topic.to_owned(),
            ..self
        }
    }

    /// The user property that holds the message id (`message-id`, [`MESSAGE_ID`], by
    /// default: where [`MqttPublisher`](super::MqttPublisher) writes it). Compared
    /// exactly; the first of that name counts.
    pub fn id_property(self, name: &str) -> Self {
        MqttConsumer {
            id_property: name.to_owned(),
            ..self
        }
    }

    /// How long the message in hand may still take once shutdown began (10 s by
    /// default).
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        MqttConsumer {
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
        MqttConsumer {
            trace_parent: Some(hook),
            ..self
        }
    }

    /// Consumes until `shutdown` completes, deciding with the default [`AckPolicy`]; see
    /// [`run_with`](Self::run_with).
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

    /// Consumes until `shutdown` completes, calling `handler` for each message (given the
    /// pool and the message, both its own: `|pool, msg| async move { apply(&pool,
    /// &msg).await }`) and settling it as `policy` decides; returns what it did. `Err`
    /// only when it could not start ([`ConsumeError::Start`]).
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

    /// Consumes until `shutdown` completes, handing messages to `handler` in batches:
    /// the messages received when the last batch ended, in arrival order, at most `max`
    /// (at least 1). No batch waits for more messages than have come: a quiet topic
    /// gives batches of one. `handler` is given the pool and the batch, both its own:
    /// `|pool, batch| async move { apply(&pool, &batch).await }` for an
    /// `#[idempotent(batch = fresh, key = |msg| msg.id())]` handler `apply(tx, fresh:
    /// &[&Message])`: one transaction claims every id, runs the body over the fresh
    /// ones, and commits (see [`batch`](crate::batch)).
    ///
    /// Each message is settled as its [`BatchItem`](crate::batch::BatchItem) says,
    /// through `policy`: processed, a duplicate or a copy of one → acknowledged; a
    /// transient failure (or an item in progress under another delivery's lease) → the
    /// batch's unsettled messages handed to the handler again, together, after the
    /// longest of their delays (their delivery counts one more); a permanent failure,
    /// an invalid id or a fingerprint mismatch → a dead letter. A batch whose call
    /// failed as a whole is decided on that error for each message. Once every message
    /// of the batch is settled, the dead letters are sent and the `PUBACK`s follow, in
    /// arrival order. At shutdown, a batch not settled whole is acknowledged not at all:
    /// its messages stay with the session, and the next start finds the committed ones
    /// duplicates.
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
        self.consume(pool, policy, &Batches::new(handler, max), shutdown)
            .await
    }

    /// Both forms' run.
    async fn consume<DB: Backend, C: Calls<DB>>(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        calls: &C,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Consumed, ConsumeError> {
        let first = self
            .connect(calls.max())
            .await
            .map_err(ConsumeError::Start)?;
        let (stop, stopping) = watch::channel(false);
        let meter = Meter::new("mqtt", &self.topic, "");
        let worker = Worker {
            consumer: self,
            pool,
            policy,
            calls,
            stopping,
            consumed: Consumed::default(),
            meter: &meter,
            seen: Consumed::default(),
        };
        let mut work = pin!(worker.run(first));
        let finished = shared::first(work.as_mut(), shutdown).await;
        let consumed = match finished {
            Some(consumed) => consumed,
            None => {
                let _ = stop.send(true);
                work.await
            }
        };
        meter.finish(&consumed);
        Ok(consumed)
    }

    /// A connection, subscribed (its `SUBACK` granted at QoS 1 or more); `batch`: the
    /// most messages a call settles at once.
    async fn connect(&self, batch: usize) -> Result<Session, String> {
        let mut options = self.options.clone();
        if options.session_expiry_interval().is_none() {
            // MQTT 5: 0xFFFF_FFFF, the session never expires.
            options.set_session_expiry_interval(Some(u32::MAX));
        }
        if options.max_packet_size().is_none() {
            options.set_max_packet_size(Some(MQTT_MAX_PACKET as u32));
        }
        options.set_clean_start(false).set_manual_acks(true);
        // The client's requests to its event loop: room for a whole batch's `PUBACK`s
        // (and a few more), so that settling a batch never waits for the loop to make
        // room midway (with 64, batches of 100 ran at 0.85-0.90 of a hand-written loop
        // with room for 256; with room, 0.95-0.97).
        let (client, events) = AsyncClient::new(options, batch.max(48) + 16);
        let (tell, wire) = mpsc::unbounded_channel();
        let mut session = Session {
            client,
            wire,
            poller: tokio::spawn(poll(events, tell)),
            waiting: VecDeque::new(),
            gone: None,
        };
        session
            .client
            .subscribe(&self.topic, QoS::AtLeastOnce)
            .await
            .map_err(|error| error.to_string())?;
        let granted = session
            .wait_for("the subscription's SUBACK", |wire| match wire {
                Wire::SubAck(granted) => Some(*granted),
                _ => None,
            })
            .await?;
        if !granted {
            return Err(format!(
                "the broker refused the subscription to {:?} at QoS 1",
                self.topic
            ));
        }
        Ok(session)
    }
}

/// What the connection's poller reports.
enum Wire {
    Publish(Publish),
    /// The subscription's answer: granted at QoS 1 or more.
    SubAck(bool),
    /// A `PUBLISH` of ours written, with its packet id.
    Published(u16),
    /// The broker's `PUBACK` of one of ours, and its reason.
    PubAck(u16, PubAckReason),
    Lost(String),
}

/// One connection: the client, what its event loop reports, the messages that came
/// while a dead letter was awaited.
struct Session {
    client: AsyncClient,
    wire: mpsc::UnboundedReceiver<Wire>,
    poller: tokio::task::JoinHandle<()>,
    waiting: VecDeque<Publish>,
    /// The loss [`try_next`](Session::try_next) read, if it did.
    gone: Option<String>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

impl Session {
    /// The first report `wanted` picks (keeping messages that come meanwhile), within
    /// [`WIRE`]; `Err` when the connection is lost first.
    async fn wait_for<T>(
        &mut self,
        what: &str,
        wanted: impl Fn(&Wire) -> Option<T>,
    ) -> Result<T, String> {
        let waiting = &mut self.waiting;
        let wire = &mut self.wire;
        let found = tokio::time::timeout(WIRE, async {
            while let Some(event) = wire.recv().await {
                if let Some(found) = wanted(&event) {
                    return Ok(found);
                }
                match event {
                    Wire::Publish(publish) => waiting.push_back(publish),
                    Wire::Lost(error) => return Err(error),
                    _ => {}
                }
            }
            Err("the connection ended".to_owned())
        })
        .await;
        match found {
            Ok(found) => found,
            Err(_) => Err(format!("no {what} within {WIRE:?}")),
        }
    }

    /// A message that has come already, without waiting; `None` when none has (or the
    /// connection is lost: [`lost`](Self::lost) says so).
    fn try_next(&mut self) -> Option<Publish> {
        if let Some(publish) = self.waiting.pop_front() {
            return Some(publish);
        }
        loop {
            match self.wire.try_recv() {
                Ok(Wire::Publish(publish)) => return Some(publish),
                Ok(Wire::Lost(error)) => {
                    // Kept for `lost`, which the acknowledgements ask first.
                    self.gone = Some(error);
                    return None;
                }
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// Whether the connection is lost (a report of it waiting, or the poller gone).
    fn lost(&mut self) -> bool {
        if self.gone.is_some() {
            return true;
        }
        loop {
            match self.wire.try_recv() {
                Ok(Wire::Publish(publish)) => self.waiting.push_back(publish),
                Ok(Wire::Lost(_)) | Err(mpsc::error::TryRecvError::Disconnected) => return true,
                Ok(_) => {}
                Err(mpsc::error::TryRecvError::Empty) => return false,
            }
        }
    }
}

/// The [`Message`] of `publish`: its id the first user property named `id_property`,
/// its headers the other user properties.
fn message(publish: &Publish, id_property: &str) -> Message {
    let mut id = None;
    let mut headers = Vec::new();
    for (name, value) in publish
        .properties
        .iter()
        .flat_map(|properties| &properties.user_properties)
    {
        if id.is_none() && name == id_property {
            id = Some(value.clone());
        } else {
            headers.push((name.clone(), value.as_bytes().to_vec()));
        }
    }
    Message {
        id: id.unwrap_or_default(),
        payload: publish.payload.to_vec(),
        headers,
        delivery: if publish.dup { 2 } else { 1 },
        destination: String::from_utf8_lossy(&publish.topic).into_owned(),
    }
}

/// Polls the event loop until the connection fails, reporting what the consumer waits
/// for. Publishing from here would deadlock the loop: the consumer's task publishes.
async fn poll(mut events: EventLoop, wire: mpsc::UnboundedSender<Wire>) {
    loop {
        let event = match events.poll().await {
            Ok(Event::Incoming(Packet::Publish(publish))) => Wire::Publish(publish),
            Ok(Event::Incoming(Packet::SubAck(ack))) => Wire::SubAck(ack.return_codes.iter().all(
                |code| matches!(code, SubscribeReasonCode::Success(qos) if *qos != QoS::AtMostOnce),
            )),
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => Wire::Published(pkid),
            Ok(Event::Incoming(Packet::PubAck(ack))) => Wire::PubAck(ack.pkid, ack.reason),
            Ok(_) => continue,
            Err(error) => {
                let _ = wire.send(Wire::Lost(error.to_string()));
                return;
            }
        };
        if wire.send(event).is_err() {
            return;
        }
    }
}

struct Worker<'w, DB: Backend, C> {
    consumer: &'w MqttConsumer,
    pool: &'w Pool<DB>,
    policy: &'w AckPolicy<DB>,
    calls: &'w C,
    stopping: watch::Receiver<bool>,
    consumed: Consumed,
    meter: &'w Meter,
    /// What the metrics recorded of `consumed`.
    seen: Consumed,
}

/// What became of one message.
enum Settled {
    Done,
    /// The connection is lost: connect again.
    Lost,
    /// Shutdown: the message was not acknowledged.
    Stopped,
}

impl<DB: Backend, C: Calls<DB>> Worker<'_, DB, C> {
    async fn run(mut self, first: Session) -> Consumed {
        let mut session = Some(first);
        let mut wait = RECONNECT.0;
        loop {
            let mut current = match session.take() {
                Some(current) => current,
                None => {
                    if *self.stopping.borrow() {
                        return self.consumed;
                    }
                    match self.consumer.connect(self.calls.max()).await {
                        Ok(current) => {
                            self.consumed.reconnects += 1;
                            wait = RECONNECT.0;
                            current
                        }
                        Err(error) => {
                            tracing::warn!(%error, topic = %self.consumer.topic,
                                "MQTT consumer: could not connect; trying again");
                            if !self.pause(wait).await {
                                return self.consumed;
                            }
                            wait = (wait * 2).min(RECONNECT.1);
                            continue;
                        }
                    }
                }
            };
            loop {
                let publish = match current.waiting.pop_front() {
                    Some(publish) => Some(publish),
                    None => self.next(&mut current).await,
                };
                let Some(publish) = publish else {
                    if *self.stopping.borrow() {
                        self.disconnect(current).await;
                        return self.consumed;
                    }
                    tracing::warn!(topic = %self.consumer.topic,
                        "MQTT consumer: connection lost; connecting again");
                    break;
                };
                if publish.qos == QoS::AtMostOnce {
                    continue; // nothing to acknowledge, nothing redelivered
                }
                // A batch: what has come already, without waiting for more.
                let mut publishes = vec![publish];
                while publishes.len() < self.calls.max() {
                    match current.try_next() {
                        Some(publish) if publish.qos == QoS::AtMostOnce => {}
                        Some(publish) => publishes.push(publish),
                        None => break,
                    }
                }
                let settled = self.process(&mut current, &publishes).await;
                self.meter.catch_up(&mut self.seen, &self.consumed);
                match settled {
                    Settled::Done => {}
                    Settled::Lost => break,
                    Settled::Stopped => {
                        self.disconnect(current).await;
                        return self.consumed;
                    }
                }
                if *self.stopping.borrow() {
                    self.disconnect(current).await;
                    return self.consumed;
                }
            }
        }
    }

    /// The next message; `None` once shutdown began or the connection is lost.
    async fn next(&mut self, session: &mut Session) -> Option<Publish> {
        let mut stopping = self.stopping.clone();
        let stop = stopping.wait_for(|stop| *stop);
        let mut stop = pin!(stop);
        loop {
            let wire = {
                let mut recv = pin!(session.wire.recv());
                std::future::poll_fn(|context| {
                    if let std::task::Poll::Ready(wire) = recv.as_mut().poll(context) {
                        return std::task::Poll::Ready(Some(wire));
                    }
                    stop.as_mut().poll(context).map(|_| None)
                })
                .await?
            };
            match wire {
                Some(Wire::Publish(publish)) => return Some(publish),
                Some(Wire::Lost(_)) | None => return None,
                Some(_) => {}
            }
        }
    }

    /// Waits `wait`; `false` once shutdown began.
    async fn pause(&mut self, wait: Duration) -> bool {
        shared::pause(&self.stopping, wait).await
    }

    /// Runs the handler until every message of `publishes` is settled (retries in
    /// process, the unsettled ones together), then sends the dead letters and the
    /// acknowledgements, in arrival order.
    async fn process(&mut self, session: &mut Session, publishes: &[Publish]) -> Settled {
        let id_property = self.consumer.id_property.as_str();
        let mut messages: Vec<Message> = publishes
            .iter()
            .map(|publish| message(publish, id_property))
            .collect();
        let mut settled: Vec<Option<Settlement>> = vec![None; publishes.len()];
        loop {
            let open: Vec<usize> = (0..publishes.len())
                .filter(|&n| settled[n].is_none())
                .collect();
            if open.is_empty() {
                break;
            }
            let batch: Vec<Message> = open.iter().map(|&n| messages[n].clone()).collect();
            let consumer = self.consumer;
            let span = calls::span(
                self.calls,
                "mqtt",
                &messages[open[0]].destination,
                None,
                &batch,
                consumer.trace_parent,
            );
            let call = self.calls.call(self.pool, self.policy, batch, &span);
            let started = std::time::Instant::now();
            let Some(settlements) = self.within_deadline(call).await else {
                // Shutdown's deadline passed: the call was dropped and rolled back; the
                // messages stay with the session, unacknowledged.
                self.consumed.requeued += publishes.len() as u64;
                return Settled::Stopped;
            };
            self.meter.processed(started);
            let mut wait = None;
            for (&n, (ack, error)) in open.iter().zip(settlements) {
                match ack {
                    Ack::Retry { after } => {
                        if let Some((_, error)) = &error {
                            tracing::debug!(parent: &span, %error, ?after,
                                "MQTT consumer: transient failure; retried in process");
                        }
                        self.consumed.retried += 1;
                        messages[n].delivery += 1;
                        wait = Some(wait.unwrap_or(Duration::ZERO).max(after));
                    }
                    Ack::DeadLetter => {
                        let text = error
                            .as_ref()
                            .map_or("dead-lettered by the policy", |(_, text)| text.as_str());
                        tracing::warn!(parent: &span, error = %text,
                            "MQTT consumer: permanent failure; dead-lettered");
                        settled[n] = Some((ack, error));
                    }
                    Ack::Ack => settled[n] = Some((ack, None)),
                }
            }
            if let Some(wait) = wait
                && !self.pause(wait).await
            {
                self.consumed.requeued += publishes.len() as u64;
                return Settled::Stopped;
            }
        }
        for ((publish, message), settlement) in publishes.iter().zip(&messages).zip(settled) {
            let dead = match settlement {
                Some((Ack::DeadLetter, error)) => Some(error),
                _ => None,
            };
            let is_dead = dead.is_some();
            if let Some(error) = dead
                && let Err(refused) = self.dead_letter(session, publish, message, error).await
            {
                tracing::warn!(error = %refused, dead_topic = %self.consumer.dead_topic,
                    "MQTT consumer: the dead letter was not accepted; the message stays \
                     unacknowledged, and comes back on the next connection");
                self.consumed.dropped += 1;
                if !self.pause(RECONNECT.1).await {
                    return Settled::Stopped;
                }
                return Settled::Lost;
            }
            // The packet id belongs to this connection: a lost one takes the
            // acknowledgement with it, and the broker sends the message again on the next.
            if session.lost() || session.client.ack(publish).await.is_err() {
                self.consumed.dropped += 1;
                return Settled::Lost;
            }
            if is_dead {
                self.consumed.dead_lettered += 1;
            } else {
                self.consumed.acknowledged += 1;
            }
        }
        Settled::Done
    }

    /// The original payload and user properties, with the provenance after them, to the
    /// dead topic at QoS 1; `Ok` once the broker accepted it.
    async fn dead_letter(
        &mut self,
        session: &mut Session,
        publish: &Publish,
        message: &Message,
        error: Option<(&'static str, String)>,
    ) -> Result<(), String> {
        let mut user_properties: Vec<(String, String)> = publish
            .properties
            .iter()
            .flat_map(|properties| properties.user_properties.iter().cloned())
            .collect();
        user_properties.push((provenance::TOPIC.to_owned(), message.destination.clone()));
        user_properties.push((
            provenance::CLIENT.to_owned(),
            self.consumer.options.client_id(),
        ));
        user_properties.push((
            provenance::ATTEMPTS.to_owned(),
            message.delivery.to_string(),
        ));
        if let Some((class, text)) = error {
            user_properties.push((provenance::ERROR_CLASS.to_owned(), class.to_owned()));
            user_properties.push((provenance::ERROR.to_owned(), shared::header_text(&text)));
        }
        let properties = PublishProperties {
            user_properties,
            ..PublishProperties::default()
        };
        session
            .client
            .publish_with_properties(
                &self.consumer.dead_topic,
                QoS::AtLeastOnce,
                false,
                publish.payload.clone(),
                properties,
            )
            .await
            .map_err(|error| error.to_string())?;
        let pkid = session
            .wait_for("the dead letter to be written", |wire| match wire {
                Wire::Published(pkid) => Some(*pkid),
                _ => None,
            })
            .await?;
        let reason = session
            .wait_for(
                "the broker's PUBACK of the dead letter",
                |wire| match wire {
                    Wire::PubAck(acked, reason) if *acked == pkid => Some(*reason),
                    _ => None,
                },
            )
            .await?;
        match reason {
            PubAckReason::Success => Ok(()),
            PubAckReason::NoMatchingSubscribers => Err(format!(
                "no session is subscribed to the dead topic {:?} (PUBACK: no matching \
                 subscribers): subscribe one before dead letters come",
                self.consumer.dead_topic
            )),
            refusal => Err(format!(
                "the broker refused the dead letter (PUBACK: {refusal:?})"
            )),
        }
    }

    /// `call`, or `None` if shutdown began and its deadline passed first.
    async fn within_deadline<T>(&mut self, call: impl Future<Output = T>) -> Option<T> {
        shared::within_deadline(&self.stopping, self.consumer.shutdown_deadline, call).await
    }

    /// Disconnects once the acknowledgements queued before are written.
    async fn disconnect(&mut self, mut session: Session) {
        if session.client.disconnect().await.is_ok() {
            // The poller ends when the event loop has sent the DISCONNECT (after the
            // PUBACKs queued before it) and the connection closes.
            let poller = &mut session.poller;
            let _ = tokio::time::timeout(Duration::from_secs(5), poller).await;
        }
    }
}
