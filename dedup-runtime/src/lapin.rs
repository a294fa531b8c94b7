//! RabbitMQ through [lapin](https://docs.rs/lapin): how often a delivery has been delivered,
//! for [`AckPolicy::decide`](crate::AckPolicy::decide), and the lapin call for each [`Ack`].
//!
//! *Available on crate feature `lapin` only* (lapin 4). The feature turns on none of
//! lapin's own features: your own lapin dependency picks its runtime and TLS stack.
//!
//! ```no_run
//! use dedup_runtime::lapin::{delivery_count, settle};
//! use dedup_runtime::{AckPolicy, Outcome};
//! use lapin::message::Delivery;
//! use sqlx::{Sqlite, SqlitePool};
//! # async fn apply(_: &SqlitePool, _: &str) -> Result<Outcome<()>, sqlx::Error> { todo!() }
//!
//! // For each delivery of a consumer with manual acknowledgements:
//! async fn handle(
//!     pool: &SqlitePool,
//!     policy: &AckPolicy<Sqlite>,
//!     delivery: &Delivery,
//! ) -> Result<(), lapin::Error> {
//!     let id = delivery.properties.message_id().as_ref().map_or("", |id| id.as_str());
//!     let result = apply(pool, id).await; // an #[idempotent] handler
//!     settle(delivery, policy.decide(&result, delivery_count(delivery))).await
//! }
//! ```
//!
//! `examples/rabbitmq.rs` is a complete consumer built on these two functions.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use ::lapin::Acker;
use ::lapin::message::Delivery;
use ::lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use ::lapin::types::AMQPValue;

use crate::ack::Ack;

mod consumer;

pub use consumer::{ConsumeError, MessageIdFrom, RabbitMqConsumer};

/// Quorum queues: how many earlier deliveries of the message failed (RabbitMQ ≥ 4.3 counts
/// only failures: a `basic.reject`, a consumer gone; before, every return).
const DELIVERY_COUNT: &str = "x-delivery-count";
/// Quorum queues, RabbitMQ ≥ 4.3: how many times the message was handed to a consumer
/// before, failed or not (a `basic.nack` with requeue counts here only).
const ACQUIRED_COUNT: &str = "x-acquired-count";

/// Which delivery of its message `delivery` is, counting from 1, as
/// [`AckPolicy::decide`](crate::AckPolicy::decide) takes it.
///
/// RabbitMQ says it in one of three ways, and this reads them all:
///
/// - **Quorum queues** count the *earlier* deliveries in the header `x-delivery-count`
///   (absent on the first delivery), and from RabbitMQ 4.3 also in `x-acquired-count`:
///   the count is the larger of the two plus 1. (From 4.3 `x-delivery-count` counts only
///   failed deliveries — `basic.reject`, a consumer gone — and a `basic.nack` with requeue,
///   which [`settle`] sends for [`Ack::Retry`], advances only `x-acquired-count`.)
/// - **Classic queues** (and streams) count nothing; they set the `redelivered` flag on
///   every delivery after the first: the count is then 2, "more than once".
/// - Otherwise it is 1: the first delivery.
///
/// It is never less than 2 for a delivery flagged `redelivered`. A header that is not an
/// integer, or is negative, is ignored as if absent; a count never overflows (it
/// saturates at `u64::MAX`).
///
/// ```
/// use dedup_runtime::lapin::delivery_count;
/// use lapin::message::Delivery;
/// use lapin::types::{AMQPValue, FieldTable};
///
/// let first = Delivery::mock(1, "".into(), "payments".into(), false, Vec::new());
/// assert_eq!(delivery_count(&first), 1);
///
/// // A classic queue only flags a redelivery.
/// let again = Delivery::mock(2, "".into(), "payments".into(), true, Vec::new());
/// assert_eq!(delivery_count(&again), 2);
///
/// // A quorum queue counts the deliveries before this one.
/// let mut third = Delivery::mock(3, "".into(), "payments".into(), true, Vec::new());
/// let mut headers = FieldTable::default();
/// headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
/// third.properties = third.properties.with_headers(headers);
/// assert_eq!(delivery_count(&third), 3);
/// ```
pub fn delivery_count(delivery: &Delivery) -> u64 {
    let headers = delivery.properties.headers().as_ref();
    let earlier = [DELIVERY_COUNT, ACQUIRED_COUNT]
        .into_iter()
        .filter_map(|name| headers.and_then(|headers| headers.inner().get(name)))
        .filter_map(earlier_deliveries)
        .max();
    count(earlier, delivery.redelivered)
}

/// The 1-based count from the number of earlier deliveries RabbitMQ reported (if it did)
/// and the `redelivered` flag.
fn count(earlier: Option<u64>, redelivered: bool) -> u64 {
    let flagged = if redelivered { 2 } else { 1 };
    earlier.map_or(flagged, |earlier| earlier.saturating_add(1).max(flagged))
}

/// A count header's value: a non-negative integer of any width (RabbitMQ sends a signed
/// 64-bit `long`; a message re-published by a client may carry a narrower one).
fn earlier_deliveries(value: &AMQPValue) -> Option<u64> {
    match *value {
        AMQPValue::ShortShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(n.into()),
        AMQPValue::ShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::ShortUInt(n) => Some(n.into()),
        AMQPValue::LongInt(n) => u64::try_from(n).ok(),
        AMQPValue::LongUInt(n) => Some(n.into()),
        AMQPValue::LongLongInt(n) => u64::try_from(n).ok(),
        _ => None,
    }
}

/// Tells RabbitMQ what [`AckPolicy::decide`](crate::AckPolicy::decide) decided for
/// `delivery` (of a consumer with manual acknowledgements):
///
/// | `ack` | lapin call |
/// | --- | --- |
/// | [`Ack::Ack`] | `basic_ack` |
/// | [`Ack::Retry { after }`](Ack::Retry) | wait `after` here, then `basic_nack` with `requeue: true` |
/// | [`Ack::DeadLetter`] | `basic_reject` with `requeue: false`: to the queue's dead-letter exchange |
///
/// - **A retry holds its message while it waits**, and with it one of the channel's
///   prefetch slots (`basic_qos`): RabbitMQ has no delayed requeue of its own. While the
///   database is away, a channel that takes no new message is the back-pressure wanted;
///   for long delays, a TTL-and-dead-letter "retry queue" is the alternative. Dropping the
///   future while it waits sends nothing: the message stays unacknowledged until the
///   channel closes, then RabbitMQ delivers it again.
/// - **A dead letter goes to the queue's `x-dead-letter-exchange`.** Declare one: without
///   it RabbitMQ drops a rejected message. On a quorum queue, a message that exceeds its
///   `x-delivery-limit` is dead-lettered (or dropped) by RabbitMQ itself.
/// - An acknowledgement lapin can no longer send — the delivery was already settled, or
///   its channel closed, also while the acknowledgement was on its way — is a no-op
///   (`Ok(())`): RabbitMQ delivers an unacknowledged message again, and the dedup record
///   makes that copy a duplicate.
///
/// # Errors
/// The channel's error when the call fails on its way to the broker.
pub async fn settle(delivery: &Delivery, ack: Ack) -> Result<(), ::lapin::Error> {
    let acker = &delivery.acker;
    match ack {
        Ack::Ack => {
            settled(acker, acker.ack(BasicAckOptions::default())).await?;
        }
        Ack::Retry { after } => {
            tokio::time::sleep(after).await;
            let requeue = BasicNackOptions {
                requeue: true,
                multiple: false,
            };
            settled(acker, acker.nack(requeue)).await?;
        }
        Ack::DeadLetter => {
            let to_dead_letter_exchange = BasicRejectOptions { requeue: false };
            settled(acker, acker.reject(to_dead_letter_exchange)).await?;
        }
    }
    Ok(())
}

/// How often a settlement still under way looks whether its channel has ended.
const SETTLEMENT_CHECK: Duration = Duration::from_millis(50);

/// `settlement` — an `ack`, `nack` or `reject` through `acker` — or `Ok(false)`, not sent,
/// once `acker`'s channel has ended with the settlement still under way.
///
/// lapin 4 can leave a settlement pending for ever when the connection fails as it is
/// sent: its frame goes to an I/O loop that has stopped, and nothing answers it (seen as
/// a consumer that never noticed a cut connection). lapin marks the channel's deliveries
/// poisoned when the channel ends; the broker delivers an unsettled message again.
pub(crate) async fn settled(
    acker: &Acker,
    settlement: impl Future<Output = Result<bool, ::lapin::Error>>,
) -> Result<bool, ::lapin::Error> {
    let mut settlement = pin!(settlement);
    loop {
        match tokio::time::timeout(SETTLEMENT_CHECK, settlement.as_mut()).await {
            Ok(sent) => return sent,
            Err(_) if acker.poisoned() => return Ok(false),
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use ::lapin::types::{FieldTable, LongString};

    use super::*;

    fn delivery(redelivered: bool, headers: &[(&str, AMQPValue)]) -> Delivery {
        let mut delivery = Delivery::mock(1, "".into(), "q".into(), redelivered, Vec::new());
        if !headers.is_empty() {
            let mut table = FieldTable::default();
            for (name, value) in headers {
                table.insert((*name).into(), value.clone());
            }
            delivery.properties = delivery.properties.clone().with_headers(table);
        }
        delivery
    }

    #[test]
    fn without_a_count_the_redelivered_flag_decides() {
        assert_eq!(delivery_count(&delivery(false, &[])), 1);
        assert_eq!(delivery_count(&delivery(true, &[])), 2);
        // Headers, but no count among them.
        let other = [(
            "x-first-death-reason",
            AMQPValue::LongString("rejected".into()),
        )];
        assert_eq!(delivery_count(&delivery(false, &other)), 1);
        assert_eq!(delivery_count(&delivery(true, &other)), 2);
    }

    #[test]
    fn a_count_header_counts_earlier_deliveries() {
        for (earlier, expected) in [(1, 2), (2, 3), (19, 20)] {
            let headers = [(DELIVERY_COUNT, AMQPValue::LongLongInt(earlier))];
            assert_eq!(delivery_count(&delivery(true, &headers)), expected);
        }
        // Every integer width RabbitMQ or a re-publishing client may use.
        for value in [
            AMQPValue::ShortShortInt(4),
            AMQPValue::ShortShortUInt(4),
            AMQPValue::ShortInt(4),
            AMQPValue::ShortUInt(4),
            AMQPValue::LongInt(4),
            AMQPValue::LongUInt(4),
            AMQPValue::LongLongInt(4),
        ] {
            let headers = [(DELIVERY_COUNT, value.clone())];
            assert_eq!(delivery_count(&delivery(true, &headers)), 5, "{value:?}");
        }
    }

    #[test]
    fn the_larger_of_the_two_counts_wins() {
        // RabbitMQ 4.3: requeued with `basic.nack` three times, never failed.
        let nacked = [
            (DELIVERY_COUNT, AMQPValue::LongLongInt(0)),
            (ACQUIRED_COUNT, AMQPValue::LongLongInt(3)),
        ];
        assert_eq!(delivery_count(&delivery(true, &nacked)), 4);
        let acquired_only = [(ACQUIRED_COUNT, AMQPValue::LongInt(1))];
        assert_eq!(delivery_count(&delivery(true, &acquired_only)), 2);
        let both = [
            (DELIVERY_COUNT, AMQPValue::LongLongInt(5)),
            (ACQUIRED_COUNT, AMQPValue::LongLongInt(2)),
        ];
        assert_eq!(delivery_count(&delivery(true, &both)), 6);
    }

    #[test]
    fn zero_negative_and_malformed_counts_fall_back_to_the_flag() {
        // Zero earlier deliveries, but flagged: at least the second.
        let zero = [(DELIVERY_COUNT, AMQPValue::LongLongInt(0))];
        assert_eq!(delivery_count(&delivery(false, &zero)), 1);
        assert_eq!(delivery_count(&delivery(true, &zero)), 2);
        for value in [
            AMQPValue::LongLongInt(-1),
            AMQPValue::LongLongInt(i64::MIN),
            AMQPValue::ShortShortInt(-3),
            AMQPValue::LongString(LongString::from("3")),
            AMQPValue::Double(3.0),
            AMQPValue::Boolean(true),
            AMQPValue::Void,
        ] {
            let headers = [(DELIVERY_COUNT, value.clone())];
            assert_eq!(delivery_count(&delivery(false, &headers)), 1, "{value:?}");
            assert_eq!(delivery_count(&delivery(true, &headers)), 2, "{value:?}");
        }
    }

    #[test]
    fn counts_do_not_overflow() {
        let huge = [(DELIVERY_COUNT, AMQPValue::LongLongInt(i64::MAX))];
        assert_eq!(delivery_count(&delivery(true, &huge)), i64::MAX as u64 + 1);
        assert_eq!(count(Some(u64::MAX), true), u64::MAX);
        assert_eq!(count(Some(u64::MAX - 1), false), u64::MAX);
    }
}

/// Publishes an outbox's rows to RabbitMQ, for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each to the exchange given here with the
/// row's destination as its routing key — on the default exchange `""`, straight to the
/// queue of that name — persistent, `mandatory`, with the outgoing id as the AMQP
/// `message-id`, the key the consumer downstream dedups on. A send is `Ok` only once the
/// broker confirmed it (publisher confirms): a `nack`, or a return because nothing
/// routed it, is an error, and the relay tries again later. A return is matched to its
/// row **by the `message-id` it carries**, never by the order the broker's answers came
/// in (RabbitMQ returns an unroutable message at once, before the confirms of messages
/// published earlier).
///
/// The publisher owns its connection: it connects with the URI and properties given to
/// [`connect`](Self::connect), and when the connection or its channel is lost (a broker
/// restart, a cut network, a channel closed by the broker) it connects again for the
/// next claim. A claim sent while the broker cannot be reached fails with an error the
/// relay takes for that ([`PublishError::is_unreachable`]): its rows go back with their
/// attempts not counted. A claim whose confirms did not all come back in time leaves
/// its channel too, so that no late answer of one claim is read as another's.
///
/// The row's trace context, if it has one
/// ([`OutboxMessage::traceparent`](crate::outbox::OutboxMessage::traceparent)), goes as the
/// AMQP header `traceparent`; the row's headers
/// ([`OutboxMessage::headers`](crate::outbox::OutboxMessage::headers)) go in the AMQP
/// headers table as long strings (bytes as they are). A table holds one value per name:
/// of a name added twice, the last is sent.
///
/// ```no_run
/// use dedup_runtime::lapin::RabbitMqPublisher;
/// use dedup_runtime::outbox::Outbox;
/// use lapin::ConnectionProperties;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let uri = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// let publisher = RabbitMqPublisher::connect(uri, ConnectionProperties::default(), "").await?;
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RabbitMqPublisher {
    uri: String,
    properties: ::lapin::ConnectionProperties,
    exchange: String,
    confirm_timeout: std::time::Duration,
    /// The connection and its confirm-mode channel; `None` once lost, until the next
    /// claim connects again. Clones share it.
    link: std::sync::Arc<tokio::sync::Mutex<Option<Link>>>,
}

/// A connection and the channel the publisher sends on.
struct Link {
    connection: ::lapin::Connection,
    channel: ::lapin::Channel,
}

impl Link {
    fn up(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    /// Closes the connection, if it still answers within a second.
    async fn close(self) {
        let closing = self.connection.close(200, "dedup: reconnecting".into());
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), closing).await;
    }
}

impl std::fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the URI: it may hold a password.
        f.debug_struct("RabbitMqPublisher")
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitMqPublisher {
    /// Connects to the broker at `uri` (an `amqp://` URI, as
    /// [`lapin::Connection::connect`](::lapin::Connection::connect) takes it) with
    /// `properties`, opens a channel in confirm mode, and publishes to `exchange`. The
    /// same URI and properties serve every later connection.
    ///
    /// # Errors
    /// The first connection's error: a wrong URI or credentials, or a broker not there
    /// at start (a service would rather fail at start than run without its broker).
    pub async fn connect(
        uri: &str,
        properties: ::lapin::ConnectionProperties,
        exchange: &str,
    ) -> Result<Self, ::lapin::Error> {
        let publisher = RabbitMqPublisher {
            uri: uri.to_owned(),
            properties,
            exchange: exchange.to_owned(),
            confirm_timeout: std::time::Duration::from_secs(30),
            link: std::sync::Arc::default(),
        };
        let link = publisher.open().await?;
        *publisher.link.lock().await = Some(link);
        Ok(publisher)
    }

    /// How long a send waits for the broker's confirm (30 s by default): a confirm not
    /// back in time fails its message ([`PublishError::ConfirmTimedOut`]), which the relay
    /// sends again later with the same id. A claim's confirms share one deadline.
    pub fn confirm_timeout(self, timeout: std::time::Duration) -> Self {
        RabbitMqPublisher {
            confirm_timeout: timeout,
            ..self
        }
    }

    /// A new connection and confirm-mode channel.
    async fn open(&self) -> Result<Link, ::lapin::Error> {
        let connection = ::lapin::Connection::connect(&self.uri, self.properties.clone()).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(::lapin::options::ConfirmSelectOptions::default())
            .await?;
        Ok(Link {
            connection,
            channel,
        })
    }
}

/// Why [`RabbitMqPublisher`] could not send a message.
#[derive(Debug)]
#[non_exhaustive]
pub enum PublishError {
    /// The client or the connection failed (see [`is_unreachable`](Self::is_unreachable)),
    /// or the broker closed the channel over this message (an AMQP channel error).
    Lapin(::lapin::Error),
    /// The broker refused the message (`basic.nack`).
    Nacked,
    /// Nothing routed the message (no queue bound, or no queue of that name): returned.
    Unroutable,
    /// The broker's confirm did not come within the
    /// [`confirm_timeout`](RabbitMqPublisher::confirm_timeout): the broker may have the
    /// message or not; it is sent again later, with the same id.
    ConfirmTimedOut,
}

impl PublishError {
    /// Whether the broker could not be reached: no connection could be made, or it was
    /// lost (an I/O error, a missed heartbeat, the broker closing the connection with
    /// `CONNECTION_FORCED`, as it does when it stops), or the channel was already closed
    /// when the message was to go out. The relay counts no attempt for these
    /// ([`Publisher::unreachable`](crate::outbox::Publisher::unreachable)); a refusal of
    /// the message itself (a nack, a return, an AMQP channel error such as an unknown
    /// exchange) and a confirm not back in time are not.
    pub fn is_unreachable(&self) -> bool {
        use ::lapin::ErrorKind;

        /// AMQP's `connection-forced`: an operator or a stopping broker closed it.
        const CONNECTION_FORCED: u16 = 320;
        let PublishError::Lapin(error) = self else {
            return false;
        };
        match error.kind() {
            ErrorKind::IOError(_)
            | ErrorKind::RuntimeShutdownError(_)
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannelState(..)
            | ErrorKind::InvalidChannel(_)
            | ErrorKind::MissingHeartbeatError => true,
            ErrorKind::ProtocolError(amqp) => amqp.get_id() == CONNECTION_FORCED,
            _ => false,
        }
    }
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PublishError::Lapin(error) => write!(f, "RabbitMQ: {error}"),
            PublishError::Nacked => f.write_str("RabbitMQ refused the message (nack)"),
            PublishError::Unroutable => {
                f.write_str("RabbitMQ returned the message: nothing routed it to a queue")
            }
            PublishError::ConfirmTimedOut => {
                f.write_str("RabbitMQ did not confirm the message in time")
            }
        }
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PublishError::Lapin(error) => Some(error),
            _ => None,
        }
    }
}

impl From<::lapin::Error> for PublishError {
    fn from(error: ::lapin::Error) -> Self {
        PublishError::Lapin(error)
    }
}

/// What the broker answered for one message, before returns are matched by id.
enum Answer {
    /// `basic.ack`.
    Acked,
    Failed(PublishError),
}

impl RabbitMqPublisher {
    /// Puts `message` on `channel`; the confirm to await.
    async fn start(
        &self,
        channel: &::lapin::Channel,
        message: &crate::outbox::OutboxMessage,
    ) -> Result<::lapin::PublisherConfirm, ::lapin::Error> {
        use ::lapin::BasicProperties;
        use ::lapin::options::BasicPublishOptions;

        let id = message.id().to_string();
        let mut properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        let mut headers = ::lapin::types::FieldTable::default();
        // A table: one value per name, the last of a name's.
        for (name, value) in message.headers() {
            headers.insert(
                name.into(),
                ::lapin::types::AMQPValue::LongString(value.into()),
            );
        }
        if let Some(traceparent) = message.traceparent() {
            headers.insert(
                "traceparent".into(),
                ::lapin::types::AMQPValue::LongString(traceparent.into()),
            );
        }
        if !headers.inner().is_empty() {
            properties = properties.with_headers(headers);
        }
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        channel
            .basic_publish(
                self.exchange.as_str().into(),
                message.destination().into(),
                options,
                message.payload(),
                properties,
            )
            .await
    }

    /// A confirm, awaited until `deadline`; a returned message it carries — whichever
    /// message of the claim that was — goes into `returned` by its `message-id`
    /// (`None`: one came back without an id).
    async fn confirmed(
        confirm: ::lapin::PublisherConfirm,
        deadline: tokio::time::Instant,
        returned: &mut Vec<Option<String>>,
    ) -> Answer {
        use ::lapin::Confirmation;

        let confirmation = match tokio::time::timeout_at(deadline, confirm).await {
            Err(_) => return Answer::Failed(PublishError::ConfirmTimedOut),
            Ok(Err(error)) => return Answer::Failed(error.into()),
            Ok(Ok(confirmation)) => confirmation,
        };
        let (acked, carried) = match confirmation {
            Confirmation::Ack(carried) => (true, carried),
            Confirmation::Nack(carried) => (false, carried),
            Confirmation::NotRequested => (false, None),
        };
        if let Some(message) = carried {
            let id = message.delivery.properties.message_id().as_ref();
            returned.push(id.map(|id| id.as_str().to_owned()));
        }
        if acked {
            Answer::Acked
        } else {
            Answer::Failed(PublishError::Nacked)
        }
    }
}

impl crate::outbox::Publisher for RabbitMqPublisher {
    type Error = PublishError;
    const SYSTEM: &'static str = "rabbitmq";

    fn unreachable(error: &PublishError) -> bool {
        error.is_unreachable()
    }

    async fn publish(&self, message: &crate::outbox::OutboxMessage) -> Result<(), PublishError> {
        self.publish_batch(std::slice::from_ref(message))
            .await
            .pop()
            .unwrap_or(Err(PublishError::ConfirmTimedOut))
    }

    /// Every message on the channel first, then their confirms, awaited together until
    /// the [`confirm_timeout`](RabbitMqPublisher::confirm_timeout): a `nack`, a return
    /// (matched by the `message-id` it carries) or a confirm not back in time fails that
    /// message only. Connects again first if the connection or channel was lost.
    async fn publish_batch(
        &self,
        messages: &[crate::outbox::OutboxMessage],
    ) -> Vec<Result<(), PublishError>> {
        let mut link = self.link.lock().await;
        if !link.as_ref().is_some_and(Link::up) {
            if let Some(lost) = link.take() {
                lost.close().await;
            }
            match self.open().await {
                Ok(opened) => *link = Some(opened),
                Err(error) => {
                    return messages
                        .iter()
                        .map(|_| Err(PublishError::Lapin(error.clone())))
                        .collect();
                }
            }
        }
        let channel = &link.as_ref().expect("connected just now").channel;
        // The sends are bounded too: lapin may never answer one made as the connection
        // fails (its frame goes to an I/O loop that has stopped).
        let sending = tokio::time::Instant::now() + self.confirm_timeout;
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            confirms.push(
                match tokio::time::timeout_at(sending, self.start(channel, message)).await {
                    Ok(started) => started.map_err(PublishError::from),
                    Err(_) => Err(PublishError::ConfirmTimedOut),
                },
            );
        }
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        let mut returned = Vec::new();
        let mut answers = Vec::with_capacity(messages.len());
        for confirm in confirms {
            answers.push(match confirm {
                Ok(confirm) => Self::confirmed(confirm, deadline, &mut returned).await,
                Err(error) => Answer::Failed(error),
            });
        }
        // A confirm not back in time may come later, with a return another claim would
        // take for its own: this channel is done. So is one the broker closed.
        let abandoned = answers.iter().any(|answer| match answer {
            Answer::Failed(error) => {
                matches!(error, PublishError::ConfirmTimedOut) || error.is_unreachable()
            }
            Answer::Acked => false,
        });
        if abandoned && let Some(done) = link.take() {
            done.close().await;
        }
        drop(link);
        // A return without an id cannot be placed: every message acknowledged with it is
        // sent again (the consumer dedups what had arrived).
        let unplaced = returned.iter().any(Option::is_none);
        let returned: std::collections::HashSet<String> = returned.into_iter().flatten().collect();
        messages
            .iter()
            .zip(answers)
            .map(|(message, answer)| match answer {
                Answer::Acked
                    if unplaced || returned.contains(message.id().to_string().as_str()) =>
                {
                    Err(PublishError::Unroutable)
                }
                Answer::Acked => Ok(()),
                Answer::Failed(error) => Err(error),
            })
            .collect()
    }
}
