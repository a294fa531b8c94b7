//! The outbox's MQTT publisher (feature `rumqttc`): [`MqttPublisher`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ::rumqttc::{
    AsyncClient, ClientError, ConnectionError, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS,
};
use tokio::sync::{Mutex, mpsc};

use crate::outbox::{OutboxMessage, Publisher};

mod consumer;

pub use consumer::{ConsumeError, MqttConsumer};

/// The largest packet MQTT 3.1.1 can carry: a remaining length of 268,435,455 bytes
/// (four bytes of variable-length encoding) after a fixed header of five.
pub const MQTT_MAX_PACKET: usize = 268_435_455 + 5;

/// Publishes an outbox's rows to an MQTT broker (MQTT 3.1.1 through rumqttc), for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each row a `PUBLISH` at QoS 1 (not
/// retained) to the topic named by its destination, and `Ok` once the broker answered it
/// with its `PUBACK`.
///
/// **The outgoing id is the payload's first line**: the packet's payload is
/// `<id>\n<payload>` — the id as text (a UUID's 36 characters), a line feed, then the row's
/// payload byte for byte. MQTT 3.1.1 has no headers and no message id of its own that
/// survives a re-send (the packet id names one exchange on one connection), so the id
/// travels in the payload, where the consumer downstream reads it (`examples/mqtt.rs`
/// parses exactly this form). A row sent again — after a lost `PUBACK`, or by another
/// relay after a stall — carries the same first line, which the consumer dedups. The
/// row's trace context and ordering key are not sent (a session delivers one topic's QoS 1
/// messages in order); a row with headers fails by itself
/// ([`MqttPublishError::Headers`]): MQTT 3.1.1 has nowhere to put them.
///
/// The publisher owns its connection: it connects with `options` at the first send, keeps
/// the connection open between claims (a task of its own answers the broker's keep-alive),
/// and connects again at the next claim after one was lost. Give it a client id of its own
/// (a second connection with the same id takes the session over and the broker closes the
/// first) and, usually, a clean session: a row whose `PUBACK` did not come is sent again by
/// the relay, not by the session.
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
/// let options = rumqttc::MqttOptions::new("orders-relay", "127.0.0.1", 1883);
/// let publisher = MqttPublisher::new(options);
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
pub struct MqttPublisher {
    options: MqttOptions,
    confirm_timeout: Duration,
    max_packet: usize,
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
            .finish_non_exhaustive()
    }
}

impl MqttPublisher {
    /// A publisher connecting with `options` (at its first send). The outgoing packet limit
    /// in `options` is replaced by [`max_packet_size`](Self::max_packet_size).
    pub fn new(options: MqttOptions) -> Self {
        MqttPublisher {
            options,
            confirm_timeout: Duration::from_secs(30),
            max_packet: MQTT_MAX_PACKET,
            session: Mutex::new(None),
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

    /// The largest `PUBLISH` packet sent, in bytes, fixed header included
    /// ([`MQTT_MAX_PACKET`], the protocol's own limit, by default). Set it to the broker's
    /// limit (Mosquitto's `message_size_limit`, plus the topic and the id's line) so that a
    /// row too large for the broker fails by itself, with
    /// [`MqttPublishError::TooLarge`], instead of failing the claim it is in.
    pub fn max_packet_size(self, bytes: usize) -> Self {
        MqttPublisher {
            max_packet: bytes.min(MQTT_MAX_PACKET),
            ..self
        }
    }

    /// A new connection: the client, and the task that polls its event loop.
    fn connect(&self) -> Session {
        let mut options = self.options.clone();
        let incoming = options.max_packet_size();
        options.set_max_packet_size(incoming, self.max_packet);
        let (client, events) = AsyncClient::new(options, 64);
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
        messages: &[(usize, &OutboxMessage)],
        answers: &mut [Option<Result<(), MqttPublishError>>],
    ) -> bool {
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        let sending = async {
            // Index (into `answers`) of each message handed to the event loop, in order.
            let mut handed = Vec::with_capacity(messages.len());
            for &(index, message) in messages {
                let mut payload = Vec::with_capacity(ID_LINE + message.payload().len());
                payload.extend_from_slice(message.id().to_string().as_bytes());
                payload.push(b'\n');
                payload.extend_from_slice(message.payload());
                match session
                    .client
                    .publish(message.destination(), QoS::AtLeastOnce, false, payload)
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
                Wire::Acked(pkid) => {
                    if let Some(index) = in_flight.remove(&pkid) {
                        answers[index] = Some(Ok(()));
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

/// `<36-character UUID>\n`.
const ID_LINE: usize = 37;

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
    /// The broker's `PUBACK` for this packet id.
    Acked(u16),
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
            Ok(Event::Incoming(Packet::PubAck(ack))) => Wire::Acked(ack.pkid),
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
    /// reached, and the rows cost no attempt. A PUBACK not back in time, a packet too
    /// large, a topic that cannot be published to count.
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
            let topic = message.destination();
            let remaining = 2 + topic.len() + 2 + ID_LINE + message.payload().len();
            let size = 1 + length_bytes(remaining) + remaining;
            if size > self.max_packet {
                answers[index] = Some(Err(MqttPublishError::TooLarge {
                    size,
                    max: self.max_packet,
                }));
            } else if !publishable(topic) {
                answers[index] = Some(Err(MqttPublishError::InvalidTopic(topic.to_owned())));
            } else if message.headers().next().is_some() {
                answers[index] = Some(Err(MqttPublishError::Headers));
            } else {
                sendable.push((index, message));
            }
        }
        if !sendable.is_empty() {
            let mut session = self.session.lock().await;
            if !session.as_mut().is_some_and(Session::up) {
                *session = Some(self.connect());
            }
            let connection = session.as_mut().expect("a session was just made");
            if !self.exchange(connection, &sendable, &mut answers).await {
                *session = None;
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or(Err(MqttPublishError::ConfirmTimedOut)))
            .collect()
    }
}

/// MQTT 3.1.1's rules for a topic name to publish to: 1 to 65,535 bytes of UTF-8, no
/// wildcard (`+`, `#`), no NUL.
fn publishable(topic: &str) -> bool {
    !topic.is_empty() && topic.len() <= usize::from(u16::MAX) && !topic.contains(['+', '#', '\0'])
}

/// Bytes of MQTT's variable-length encoding of `remaining`.
fn length_bytes(remaining: usize) -> usize {
    match remaining {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
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
    /// The row has headers ([`Outgoing::header`](crate::outbox::Outgoing::header)), and
    /// MQTT 3.1.1 has nowhere to put them: not sent rather than sent without them.
    Headers,
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
            MqttPublishError::Headers => f.write_str(
                "the message has headers, which MQTT 3.1.1 cannot carry: put what they say \
                 in the payload, or send it through another broker",
            ),
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
