//! The outbox's MQTT publisher (feature `rumqttc`): [`MqttPublisher`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ::rumqttc::Outgoing;
use ::rumqttc::v5::mqttbytes::QoS;
use ::rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties};
use ::rumqttc::v5::{AsyncClient, ClientError, ConnectionError, Event, EventLoop, MqttOptions};
use bytes::Bytes;
use tokio::sync::{Mutex, mpsc};

use crate::outbox::{OutboxMessage, Publisher};

mod consumer;

pub use consumer::{ConsumeError, MqttConsumer, provenance};

/// The largest packet MQTT can carry: a remaining length of 268,435,455 bytes (four
/// bytes of variable-length encoding) after a fixed header of five.
pub const MQTT_MAX_PACKET: usize = 268_435_455 + 5;

/// The MQTT 5 user property that carries a message's id, where
/// [`MqttPublisher`] writes it and [`MqttConsumer`] reads it by default.
pub const MESSAGE_ID: &str = "message-id";

/// Publishes an outbox's rows to an MQTT broker (MQTT 5 through rumqttc's `v5` client),
/// for the relay ([`Relay::run`](crate::outbox::Relay::run)): each row a `PUBLISH` at
/// QoS 1 (not retained) to the topic named by its destination, its payload byte for
/// byte, and `Ok` once the broker accepted it with its `PUBACK`.
///
/// **The outgoing id is the user property `message-id`** ([`MESSAGE_ID`]), where
/// [`MqttConsumer`] reads it. A row sent again — after a lost `PUBACK`, or by another
/// relay after a stall — carries the same id, which the consumer dedups. The row's
/// headers ([`Outgoing::header`](crate::outbox::Outgoing::header)) go as user
/// properties before it, in order, and its trace context, if it has one, as the user
/// property `traceparent`. MQTT's user properties are text: a header whose value is not
/// UTF-8, or holds a NUL, fails its row by itself ([`MqttPublishError::InvalidHeader`])
/// rather than go without it. The ordering key is not sent (a session delivers one
/// topic's QoS 1 messages in order).
///
/// **A `PUBACK` that refuses is a failure.** MQTT 5's `PUBACK` carries a reason: a
/// refusal (not authorized, quota exceeded, …) fails the row
/// ([`MqttPublishError::Refused`]), and so does *no matching subscribers*
/// ([`MqttPublishError::NoSubscribers`]): an MQTT broker keeps a message only for the
/// sessions subscribed to its topic, so the message went nowhere — the outbox does not
/// call it sent. Subscribe the consumer's persistent session before the relay sends, or
/// say that such messages may go nowhere with
/// [`allow_no_subscribers`](Self::allow_no_subscribers).
///
/// The publisher owns its connection: it connects with `options` at the first send, keeps
/// the connection open between claims (a task of its own answers the broker's keep-alive),
/// and connects again at the next claim after one was lost. Give it a client id of its own
/// (a second connection with the same id takes the session over and the broker closes the
/// first) and a clean start (rumqttc's default): a row whose `PUBACK` did not come is sent
/// again by the relay, not by the session.
///
/// A claim's `PUBLISH`es are all written before any `PUBACK` is awaited, and its `PUBACK`s
/// share one deadline ([`confirm_timeout`](Self::confirm_timeout), 30 s): a row not
/// answered in time fails ([`MqttPublishError::ConfirmTimedOut`]) and the connection is
/// dropped, so that nothing of that claim is still in flight when the next one starts.
/// A lost connection fails every row of the claim not answered yet. A row whose packet
/// would be larger than [`max_packet_size`](Self::max_packet_size) is not sent at all and
/// fails by itself ([`MqttPublishError::TooLarge`]); a topic MQTT does not allow (empty,
/// with `+` or `#`) fails by itself too ([`MqttPublishError::InvalidTopic`]).
///
/// ```no_run
/// use dedup_runtime::outbox::Outbox;
/// use dedup_runtime::rumqttc::MqttPublisher;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let options = rumqttc::v5::MqttOptions::new("orders-relay", "127.0.0.1", 1883);
/// let publisher = MqttPublisher::new(options);
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
pub struct MqttPublisher {
    options: MqttOptions,
    confirm_timeout: Duration,
    max_packet: usize,
    no_subscribers: bool,
    /// The connection, between claims too; `None` before the first claim and after one
    /// that did not end cleanly. One claim at a time holds it.
    session: Mutex<Option<Session>>,
}

impl std::fmt::Debug for MqttPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttPublisher")
            .field("client_id", &self.options.client_id())
            .field("broker", &self.options.broker_address())
            .field("confirm_timeout", &self.confirm_timeout)
            .field("max_packet_size", &self.max_packet)
            .field("allow_no_subscribers", &self.no_subscribers)
            .finish_non_exhaustive()
    }
}

impl MqttPublisher {
    /// A publisher connecting with `options` (at its first send).
    pub fn new(options: MqttOptions) -> Self {
        MqttPublisher {
            options,
            confirm_timeout: Duration::from_secs(30),
            max_packet: MQTT_MAX_PACKET,
            no_subscribers: false,
            session: Mutex::new(None),
        }
    }

    /// Whether a `PUBACK` saying *no matching subscribers* counts as sent (`false` by
    /// default: the row fails with [`MqttPublishError::NoSubscribers`], counting an
    /// attempt, and is sent again later). Set it for topics where a message nobody is
    /// subscribed to may go nowhere.
    pub fn allow_no_subscribers(self, allow: bool) -> Self {
        MqttPublisher {
            no_subscribers: allow,
            ..self
        }
    }

    /// How long a claim waits for the broker's `PUBACK`s (30 s by default, one deadline
    /// for the whole claim): a row not answered in time fails
    /// ([`MqttPublishError::ConfirmTimedOut`]), and is sent again later with the same id.
    pub fn confirm_timeout(self, timeout: Duration) -> Self {
        MqttPublisher {
            confirm_timeout: timeout,
            ..self
        }
    }

    /// The largest `PUBLISH` packet sent, in bytes, fixed header, topic and properties
    /// included ([`MQTT_MAX_PACKET`], the protocol's own limit, by default). Set it to the
    /// broker's limit (its `CONNACK`'s maximum packet size; Mosquitto's `max_packet_size`)
    /// so that a row too large for the broker fails by itself, with
    /// [`MqttPublishError::TooLarge`], instead of failing the claim it is in.
    pub fn max_packet_size(self, bytes: usize) -> Self {
        MqttPublisher {
            max_packet: bytes.min(MQTT_MAX_PACKET),
            ..self
        }
    }

    /// A new connection: the client, and the task that polls its event loop.
    fn connect(&self) -> Session {
        let (client, events) = AsyncClient::new(self.options.clone(), 64);
        let (tell, wire) = mpsc::unbounded_channel();
        Session {
            client,
            wire,
            poller: tokio::spawn(poll(events, tell)),
        }
    }

    /// Sends `messages` (already checked) and collects their `PUBACK`s into `answers`.
    /// Returns whether the connection can serve the next claim.
    async fn exchange(
        &self,
        session: &mut Session,
        messages: Vec<(usize, Prepared)>,
        answers: &mut [Option<Result<(), MqttPublishError>>],
    ) -> bool {
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        let sending = async {
            // Index (into `answers`) of each message handed to the event loop, in order.
            let mut handed = Vec::with_capacity(messages.len());
            for (index, prepared) in messages {
                match session
                    .client
                    .publish_bytes_with_properties(
                        prepared.topic,
                        QoS::AtLeastOnce,
                        false,
                        prepared.payload,
                        prepared.properties,
                    )
                    .await
                {
                    Ok(()) => handed.push(index),
                    Err(error) => return (handed, Some(error)),
                }
            }
            (handed, None)
        };
        let Ok((handed, refused)) = tokio::time::timeout_at(deadline, sending).await else {
            fill(answers, || MqttPublishError::ConfirmTimedOut);
            return false;
        };
        if let Some(error) = &refused {
            // The event loop is gone (its task ended with the connection): the rest of
            // the claim was not handed over.
            let text = error.to_string();
            fill(answers, || MqttPublishError::Client(text.clone()));
        }
        // `Outgoing::Publish` events come in the order the requests were handed over.
        let mut written = 0;
        let mut in_flight: HashMap<u16, usize> = HashMap::new();
        let mut open = handed.len();
        while open > 0 {
            let event = match tokio::time::timeout_at(deadline, session.wire.recv()).await {
                Ok(Some(event)) => event,
                Ok(None) => Wire::Lost(None),
                Err(_) => {
                    fill(answers, || MqttPublishError::ConfirmTimedOut);
                    return false;
                }
            };
            match event {
                Wire::Written(pkid) => {
                    if let Some(&index) = handed.get(written) {
                        in_flight.insert(pkid, index);
                    }
                    written += 1;
                }
                Wire::Acked(pkid, reason) => {
                    if let Some(index) = in_flight.remove(&pkid) {
                        answers[index] = Some(match reason {
                            PubAckReason::Success => Ok(()),
                            PubAckReason::NoMatchingSubscribers if self.no_subscribers => Ok(()),
                            PubAckReason::NoMatchingSubscribers => {
                                Err(MqttPublishError::NoSubscribers)
                            }
                            refusal => Err(MqttPublishError::Refused(format!("{refusal:?}"))),
                        });
                        open -= 1;
                    }
                }
                Wire::Lost(error) => {
                    let error = error.map(Arc::new);
                    fill(answers, || MqttPublishError::Connection(error.clone()));
                    return false;
                }
            }
        }
        refused.is_none()
    }
}

/// Fails every message without an answer yet.
fn fill(
    answers: &mut [Option<Result<(), MqttPublishError>>],
    error: impl Fn() -> MqttPublishError,
) {
    for answer in answers.iter_mut().filter(|answer| answer.is_none()) {
        *answer = Some(Err(error()));
    }
}

/// One connection: the client and what its event loop's task reports.
struct Session {
    client: AsyncClient,
    wire: mpsc::UnboundedReceiver<Wire>,
    poller: tokio::task::JoinHandle<()>,
}

impl Session {
    /// Whether the connection is still up: nothing but a loss can be waiting between
    /// claims (every `PUBLISH` of a clean claim was answered).
    fn up(&mut self) -> bool {
        loop {
            match self.wire.try_recv() {
                Ok(Wire::Lost(_)) | Err(mpsc::error::TryRecvError::Disconnected) => {
                    return false;
                }
                Ok(_) => {}
                Err(mpsc::error::TryRecvError::Empty) => return true,
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

/// What the event loop's task reports.
enum Wire {
    /// A `PUBLISH` was written, under this packet id.
    Written(u16),
    /// The broker's `PUBACK` for this packet id, and its reason.
    Acked(u16, PubAckReason),
    /// The connection is gone (the task has ended).
    Lost(Option<ConnectionError>),
}

/// Polls the event loop until the connection fails (rumqttc would reconnect on the next
/// poll; the publisher starts a new session instead, so that no old `PUBLISH` is sent
/// again under its feet) or the publisher is gone.
async fn poll(mut events: EventLoop, wire: mpsc::UnboundedSender<Wire>) {
    loop {
        let event = match events.poll().await {
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => Wire::Written(pkid),
            Ok(Event::Incoming(Packet::PubAck(ack))) => Wire::Acked(ack.pkid, ack.reason),
            Ok(_) => continue,
            Err(error) => {
                let _ = wire.send(Wire::Lost(Some(error)));
                return;
            }
        };
        if wire.send(event).is_err() {
            return;
        }
    }
}

impl Publisher for MqttPublisher {
    type Error = MqttPublishError;
    const SYSTEM: &'static str = "mqtt";

    /// [`MqttPublishError::Connection`] and [`MqttPublishError::Client`] (the connection
    /// could not be made, or was lost with the claim out): the broker could not be
    /// reached, and the rows cost no attempt. A `PUBACK` not back in time or refusing, a
    /// packet too large, a topic that cannot be published to, a header MQTT cannot carry
    /// count.
    fn unreachable(error: &MqttPublishError) -> bool {
        matches!(
            error,
            MqttPublishError::Connection(_) | MqttPublishError::Client(_)
        )
    }

    async fn publish(&self, message: &OutboxMessage) -> Result<(), MqttPublishError> {
        let mut answers = self.publish_batch(std::slice::from_ref(message)).await;
        answers.pop().unwrap_or(Ok(()))
    }

    /// Every `PUBLISH` of the claim written, then their `PUBACK`s awaited together.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), MqttPublishError>> {
        let mut answers: Vec<Option<Result<(), MqttPublishError>>> =
            messages.iter().map(|_| None).collect();
        let mut sendable = Vec::with_capacity(messages.len());
        for (index, message) in messages.iter().enumerate() {
            match self.prepare(message) {
                Ok(prepared) => sendable.push((index, prepared)),
                Err(error) => answers[index] = Some(Err(error)),
            }
        }
        if !sendable.is_empty() {
            let mut session = self.session.lock().await;
            if !session.as_mut().is_some_and(Session::up) {
                *session = Some(self.connect());
            }
            let connection = session.as_mut().expect("a session was just made");
            if !self.exchange(connection, sendable, &mut answers).await {
                *session = None;
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or(Err(MqttPublishError::ConfirmTimedOut)))
            .collect()
    }
}

impl MqttPublisher {
    /// The `PUBLISH` of `message`: its topic, payload and user properties, checked and
    /// sized ([`packet_size`]), each copied once, as `exchange` hands them to the client.
    fn prepare(&self, message: &OutboxMessage) -> Result<Prepared, MqttPublishError> {
        let topic = message.destination();
        if !publishable(topic) {
            return Err(MqttPublishError::InvalidTopic(topic.to_owned()));
        }
        let mut user_properties = Vec::new();
        for (name, value) in message.headers() {
            match std::str::from_utf8(value) {
                Ok(text) if !text.contains('\0') => {
                    user_properties.push((name.to_owned(), text.to_owned()));
                }
                _ => {
                    return Err(MqttPublishError::InvalidHeader(format!(
                        "the header {name:?} is not an MQTT user property's value (UTF-8 \
                         text without NUL)"
                    )));
                }
            }
        }
        user_properties.push((MESSAGE_ID.to_owned(), message.id().to_string()));
        if let Some(traceparent) = message.traceparent() {
            user_properties.push(("traceparent".to_owned(), traceparent.to_owned()));
        }
        let size = packet_size(topic, &user_properties, message.payload().len());
        if size > self.max_packet {
            return Err(MqttPublishError::TooLarge {
                size,
                max: self.max_packet,
            });
        }
        Ok(Prepared {
            topic: topic.to_owned(),
            payload: Bytes::copy_from_slice(message.payload()),
            properties: PublishProperties {
                user_properties,
                ..PublishProperties::default()
            },
        })
    }
}

/// A row's `PUBLISH`, checked: what `publish_bytes_with_properties` takes.
struct Prepared {
    topic: String,
    payload: Bytes,
    properties: PublishProperties,
}

/// The bytes of an MQTT 5 `PUBLISH` at QoS 1 with only user properties (MQTT 5.0
/// §3.3): the fixed header (one byte and the remaining length's variable-length
/// encoding), then the topic (two length bytes and the name), the packet id (two), the
/// properties' length (variable-length) and the properties (per user property its
/// identifier byte and two length-prefixed strings), then the payload.
fn packet_size(topic: &str, user_properties: &[(String, String)], payload: usize) -> usize {
    let properties: usize = user_properties
        .iter()
        .map(|(name, value)| 1 + 2 + name.len() + 2 + value.len())
        .sum();
    let remaining = 2 + topic.len() + 2 + variable_length_size(properties) + properties + payload;
    1 + variable_length_size(remaining) + remaining
}

/// The bytes of MQTT's variable byte integer encoding of `n` (seven bits a byte).
fn variable_length_size(n: usize) -> usize {
    match n {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// MQTT's rules for a topic name to publish to: 1 to 65,535 bytes of UTF-8, no
/// wildcard (`+`, `#`), no NUL.
fn publishable(topic: &str) -> bool {
    !topic.is_empty() && topic.len() <= usize::from(u16::MAX) && !topic.contains(['+', '#', '\0'])
}

/// Why [`MqttPublisher`] could not send a message.
#[derive(Debug)]
#[non_exhaustive]
pub enum MqttPublishError {
    /// The connection failed (refused, reset, timed out) before the broker answered; the
    /// connection error when there is one. Sent again later, with the same id.
    Connection(Option<Arc<ConnectionError>>),
    /// The client could not take the message (its event loop had stopped): the text of
    /// rumqttc's error.
    Client(String),
    /// The broker's `PUBACK` did not come within the
    /// [`confirm_timeout`](MqttPublisher::confirm_timeout): the broker may have the
    /// message or not; it is sent again later, with the same id.
    ConfirmTimedOut,
    /// The packet would be `size` bytes, over the
    /// [`max_packet_size`](MqttPublisher::max_packet_size) `max`: not sent.
    TooLarge {
        /// The packet's size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The destination is not a topic MQTT publishes to (empty, longer than 65,535 bytes,
    /// with a wildcard `+` or `#`, or with a NUL): not sent.
    InvalidTopic(String),
    /// One of the row's headers cannot be an MQTT user property (its value is not UTF-8
    /// text, or holds a NUL): not sent rather than sent without it. Says which.
    InvalidHeader(String),
    /// The broker's `PUBACK` said *no matching subscribers*: no session is subscribed to
    /// the topic, and the message went nowhere (unless
    /// [`allow_no_subscribers`](MqttPublisher::allow_no_subscribers)).
    NoSubscribers,
    /// The broker's `PUBACK` refused the message, for the reason named (rumqttc's name of
    /// the reason code: `NotAuthorized`, `QuotaExceeded`, `TopicNameInvalid`, …).
    Refused(String),
}

impl std::fmt::Display for MqttPublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MqttPublishError::Connection(Some(error)) => write!(f, "MQTT connection: {error}"),
            MqttPublishError::Connection(None) => f.write_str("MQTT connection lost"),
            MqttPublishError::Client(error) => write!(f, "MQTT client: {error}"),
            MqttPublishError::ConfirmTimedOut => {
                f.write_str("the MQTT broker did not acknowledge the message (PUBACK) in time")
            }
            MqttPublishError::TooLarge { size, max } => write!(
                f,
                "the MQTT packet would be {size} bytes, over the publisher's limit of {max}"
            ),
            MqttPublishError::InvalidHeader(why) => f.write_str(why),
            MqttPublishError::NoSubscribers => f.write_str(
                "the MQTT broker has no subscriber for the topic (PUBACK: no matching \
                 subscribers): the message went nowhere",
            ),
            MqttPublishError::Refused(reason) => {
                write!(f, "the MQTT broker refused the message (PUBACK: {reason})")
            }
            MqttPublishError::InvalidTopic(topic) => write!(
                f,
                "{topic:?} is not an MQTT topic to publish to (empty, over 65,535 bytes, with \
                 a wildcard or a NUL)"
            ),
        }
    }
}

impl std::error::Error for MqttPublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            MqttPublishError::Connection(Some(error)) => Some(&**error),
            _ => None,
        }
    }
}

impl From<ClientError> for MqttPublishError {
    fn from(error: ClientError) -> Self {
        MqttPublishError::Client(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use ::rumqttc::v5::mqttbytes::QoS;
    use ::rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};

    /// `packet_size` counts what rumqttc writes, at each boundary of the remaining
    /// length's encoding (one to four bytes) and of the properties' length.
    #[test]
    fn packet_size_is_rumqttc_s() {
        let header = |value: usize| ("k".repeat(3), "v".repeat(value));
        for (properties, payload) in [
            (vec![], 0),
            (vec![header(0)], 1),
            (vec![header(120)], 0),
            (vec![header(121), header(7)], 100),
            (vec![header(20_000)], 127),
            (vec![header(5)], 16_383),
            (vec![header(5), header(9)], 2_097_151),
            (vec![header(5)], 2_097_200),
        ] {
            let size = super::packet_size("orders/created", &properties, payload);
            let mut publish = Publish::new(
                "orders/created",
                QoS::AtLeastOnce,
                vec![0u8; payload],
                Some(PublishProperties {
                    user_properties: properties.clone(),
                    ..PublishProperties::default()
                }),
            );
            publish.pkid = 1;
            assert_eq!(
                size,
                publish.size(),
                "{} properties, {payload} bytes",
                properties.len()
            );
        }
    }
}
