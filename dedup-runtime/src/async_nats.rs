//! NATS JetStream through [async-nats](https://docs.rs/async-nats): how often a message has
//! been delivered, for [`AckPolicy::decide`](crate::AckPolicy::decide), and the
//! acknowledgement for each [`Ack`].
//!
//! *Available on crate feature `async-nats` only* (async-nats 0.51, its `jetstream`
//! feature). The feature turns on no crypto provider or TLS stack of async-nats: your own
//! async-nats dependency picks them (it needs `ring` or `aws-lc-rs`; its default features
//! include `ring`).
//!
//! ```no_run
//! use async_nats::jetstream;
//! use dedup_runtime::async_nats::{delivery_count, settle};
//! use dedup_runtime::{AckPolicy, Outcome};
//! use sqlx::{Sqlite, SqlitePool};
//! # async fn apply(_: &SqlitePool, _: &str) -> Result<Outcome<()>, sqlx::Error> { todo!() }
//!
//! // For each message of a pull consumer with `AckPolicy::Explicit`:
//! async fn handle(
//!     pool: &SqlitePool,
//!     policy: &AckPolicy<Sqlite>,
//!     message: &jetstream::Message,
//! ) -> Result<(), async_nats::Error> {
//!     let headers = message.headers.as_ref();
//!     let id = headers.and_then(|h| h.get("Message-Id")).map_or("", |id| id.as_str());
//!     let result = apply(pool, id).await; // an #[idempotent] handler
//!     let ack = policy.decide(&result, delivery_count(message));
//!     // A dead letter is copied to `payments.dead` (a stream must capture it), then ended.
//!     settle(message, ack, Some("payments.dead")).await
//! }
//! ```
//!
//! `examples/nats.rs` is a complete consumer built on these two functions.
//! [`JetStreamConsumer`] hosts the whole loop instead — pulls, settling, dead letters,
//! shutdown, reconnection — around an `#[idempotent]` handler; `examples/nats_consumer.rs`
//! is a service built on it.

use ::async_nats::HeaderMap;
use ::async_nats::jetstream::{AckKind, Message};

use crate::ack::Ack;

mod consumer;

pub use consumer::{ConsumeError, JetStreamConsumer, MessageIdFrom, provenance};

/// Which delivery of its message `message` is, counting from 1, as
/// [`AckPolicy::decide`](crate::AckPolicy::decide) takes it: JetStream's own count, the
/// `delivered` field of the message's [`info`](Message::info) (its `$JS.ACK.…` reply
/// subject), which is 1 on the first delivery and counts every delivery, a `-NAK` included.
///
/// async-nats gives that count as an `i64`; a value below 1 (JetStream sends none) is read
/// as 1. A message whose reply subject is not a JetStream acknowledgement subject (not
/// delivered by a JetStream consumer, so it cannot be acknowledged either) counts as 1.
pub fn delivery_count(message: &Message) -> u64 {
    message
        .info()
        .map_or(1, |info| from_delivered(info.delivered))
}

/// JetStream's `delivered`, 1-based, as an unsigned count of at least 1.
fn from_delivered(delivered: i64) -> u64 {
    u64::try_from(delivered).unwrap_or(0).max(1)
}

/// Tells JetStream what [`AckPolicy::decide`](crate::AckPolicy::decide) decided for
/// `message` (of a consumer with explicit acknowledgements):
///
/// | `ack` | acknowledgement |
/// | --- | --- |
/// | [`Ack::Ack`] | `+ACK`, and waits for the server to confirm it (`double_ack`) |
/// | [`Ack::Retry { after }`](Ack::Retry) | `-NAK` with delay `after`: JetStream redelivers it then, until the consumer's `max_deliver` |
/// | [`Ack::DeadLetter`] | with `dead_letter_subject`, a copy published there and confirmed by its stream first; then `+TERM`, confirmed |
///
/// - **"Acked" means acked**: `+ACK` and `+TERM` wait for the server's reply (within the
///   JetStream context's timeout), so a crash after `settle` returns cannot bring the
///   message back. `-NAK` is sent without waiting: if it is lost, the ack wait redelivers.
/// - **JetStream has no dead-letter queue.** `+TERM` only stops redelivery (the server
///   publishes a `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>`
///   advisory naming the stream sequence; the message stays in a limits-retention stream
///   until its limits remove it). Pass `Some(subject)` to park the message where an
///   operator can find it: its payload and headers are published to `subject`, which a
///   stream must capture (otherwise the publication fails and the message is not
///   terminated), before the `+TERM`. A crash between the two redelivers the message, so
///   that stream may then hold it twice, never zero times. Headers that direct a
///   publication (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`, `Nats-Rollup`,
///   `Nats-TTL`, any `Nats-…` header but `Nats-Msg-Id`) are left out of the copy: meant
///   for the original stream, they would make the copy fail or act on the dead-letter
///   stream. With `None`, dead-lettering is the `+TERM` alone.
///
/// # Errors
/// The client's error when an acknowledgement cannot be sent or is not confirmed, or when
/// the dead-letter copy is not stored (then nothing was terminated).
pub async fn settle(
    message: &Message,
    ack: Ack,
    dead_letter_subject: Option<&str>,
) -> Result<(), ::async_nats::Error> {
    match ack {
        Ack::Ack => message.double_ack().await?,
        Ack::Retry { after } => message.ack_with(AckKind::Nak(Some(after))).await?,
        Ack::DeadLetter => {
            if let Some(subject) = dead_letter_subject {
                message
                    .context
                    .publish_with_headers(
                        subject.to_owned(),
                        dead_letter_headers(message.headers.as_ref()),
                        message.payload.clone(),
                    )
                    .await?
                    .await?;
            }
            message.double_ack_with(AckKind::Term).await?;
        }
    }
    Ok(())
}

/// The headers of a dead letter's copy: the original's but for those that direct a
/// JetStream publication (`Nats-…`); `Nats-Msg-Id` stays, so that the dead-letter stream
/// drops a second copy within its duplicate window.
fn dead_letter_headers(original: Option<&HeaderMap>) -> HeaderMap {
    let mut copy = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        let text: &str = name.as_ref();
        let directive = text
            .get(..5)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
            && !text.eq_ignore_ascii_case("nats-msg-id");
        if directive {
            continue;
        }
        for value in values {
            copy.append(name.clone(), value.clone());
        }
    }
    copy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivered_counts_are_at_least_one() {
        assert_eq!(from_delivered(1), 1);
        assert_eq!(from_delivered(2), 2);
        assert_eq!(from_delivered(20), 20);
        assert_eq!(from_delivered(i64::MAX), i64::MAX as u64);
        // JetStream counts from 1; anything else is read as the first delivery.
        assert_eq!(from_delivered(0), 1);
        assert_eq!(from_delivered(-1), 1);
        assert_eq!(from_delivered(i64::MIN), 1);
    }

    #[test]
    fn dead_letter_copies_keep_the_message_headers_only() {
        let mut original = HeaderMap::new();
        original.insert("Message-Id", "evt_91c2");
        original.append("Trace", "a");
        original.append("Trace", "b");
        original.insert("Nats-Msg-Id", "evt_91c2");
        original.insert("Nats-Expected-Stream", "PAYMENTS");
        original.insert("Nats-Expected-Last-Sequence", "41");
        original.insert("nats-rollup", "sub");
        original.insert("Nats-TTL", "1h");
        let copy = dead_letter_headers(Some(&original));
        let mut names: Vec<&str> = copy.iter().map(|(name, _)| name.as_ref()).collect();
        names.sort_unstable();
        assert_eq!(names, ["Message-Id", "Nats-Msg-Id", "Trace"]);
        let traces: Vec<&str> = copy.get_all("Trace").map(|v| v.as_str()).collect();
        assert_eq!(traces, ["a", "b"]);
        assert_eq!(copy.get("Message-Id").map(|v| v.as_str()), Some("evt_91c2"));
        assert!(dead_letter_headers(None).is_empty());
    }
}

/// Publishes an outbox's rows to NATS JetStream, for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each to the row's destination as its
/// subject, with the outgoing id in two headers — `Message-Id`, the id the consumer
/// downstream keys on (as `examples/nats.rs` reads it), and `Nats-Msg-Id`, so that
/// JetStream's own duplicate window drops a re-send within it too. A send is `Ok` once the
/// stream acknowledged it (a duplicate JetStream dropped counts: the stream has the
/// message).
/// The row's trace context, if it has one, goes as the header `traceparent`.
///
/// A claim's acknowledgements share **one** deadline, the
/// [`ack_timeout`](Self::ack_timeout): a stalled server holds a claim for one time-out,
/// not one per message. The async-nats client reconnects by itself; a claim during which
/// it was not connected fails with errors the relay takes for an unreachable broker
/// ([`JetStreamPublishError::is_unreachable`]): its rows go back with their attempts not
/// counted.
///
/// The row's headers ([`OutboxMessage::headers`](crate::outbox::OutboxMessage::headers))
/// go as NATS headers, in order. NATS header values are text: a value that is not UTF-8,
/// or holds a line break, fails its message's send (an attempt counted; its text on the
/// row), never sent without it.
///
/// ```no_run
/// use dedup_runtime::async_nats::JetStreamPublisher;
/// use dedup_runtime::outbox::Outbox;
///
/// # async fn relay(pool: sqlx::PgPool, client: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = JetStreamPublisher::new(async_nats::jetstream::new(client));
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JetStreamPublisher {
    context: ::async_nats::jetstream::Context,
    ack_timeout: std::time::Duration,
}

impl JetStreamPublisher {
    /// A publisher on `context`, with an [`ack_timeout`](Self::ack_timeout) of 5 s.
    pub fn new(context: ::async_nats::jetstream::Context) -> Self {
        JetStreamPublisher {
            context,
            ack_timeout: std::time::Duration::from_secs(5),
        }
    }

    /// How long a claim waits for the stream's acknowledgements, all of them together
    /// (5 s by default, async-nats' own time-out for one): a message not acknowledged by
    /// then fails, and the relay sends it again later with the same id. The context's
    /// own time-out still bounds each acknowledgement; set it no shorter than this.
    pub fn ack_timeout(self, timeout: std::time::Duration) -> Self {
        JetStreamPublisher {
            ack_timeout: timeout,
            ..self
        }
    }

    /// Publishes `message` to its subject; the stream's acknowledgement to await.
    async fn start(
        &self,
        message: &crate::outbox::OutboxMessage,
    ) -> Result<
        ::async_nats::jetstream::context::PublishAckFuture,
        ::async_nats::jetstream::context::PublishError,
    > {
        use ::async_nats::HeaderValue;
        use ::async_nats::jetstream::context::{PublishError, PublishErrorKind};

        let id = message.id().to_string();
        let mut headers = HeaderMap::new();
        // The message's own first (names the outbox checked), the publisher's after.
        for (name, value) in message.headers() {
            let value = std::str::from_utf8(value)
                .ok()
                .and_then(|value| value.parse::<HeaderValue>().ok())
                .ok_or_else(|| {
                    let why = format!(
                        "the header {name:?} is not a NATS header value (UTF-8 text \
                         without line breaks)"
                    );
                    PublishError::with_source(PublishErrorKind::Other, why)
                })?;
            headers.append(name, value);
        }
        headers.insert("Message-Id", id.as_str());
        headers.insert(::async_nats::header::NATS_MESSAGE_ID, id.as_str());
        if let Some(traceparent) = message.traceparent() {
            headers.insert("traceparent", traceparent);
        }
        self.context
            .publish_with_headers(
                message.destination().to_owned(),
                headers,
                message.payload().to_vec().into(),
            )
            .await
    }
}

/// Why [`JetStreamPublisher`] could not send a message: async-nats' error, and whether
/// the server could not be reached meanwhile.
#[derive(Debug)]
pub struct JetStreamPublishError {
    error: ::async_nats::jetstream::context::PublishError,
    unreachable: bool,
}

impl JetStreamPublishError {
    /// async-nats' error.
    pub fn error(&self) -> &::async_nats::jetstream::context::PublishError {
        &self.error
    }

    /// Whether the server could not be reached: the client was not connected when the
    /// claim went out, lost its connection (or connected again) before the claim's
    /// acknowledgements were in, or the connection broke under the message. A message
    /// not acknowledged by a server that stayed connected (a stalled server, a stream
    /// that does not answer) is not: that failure counts an attempt.
    pub fn is_unreachable(&self) -> bool {
        self.unreachable
    }
}

impl std::fmt::Display for JetStreamPublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.unreachable {
            write!(f, "NATS server not reachable: {}", self.error)
        } else {
            write!(f, "NATS JetStream: {}", self.error)
        }
    }
}

impl std::error::Error for JetStreamPublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl crate::outbox::Publisher for JetStreamPublisher {
    type Error = JetStreamPublishError;
    const SYSTEM: &'static str = "nats";

    fn unreachable(error: &JetStreamPublishError) -> bool {
        error.is_unreachable()
    }

    async fn publish(&self, message: &crate::outbox::OutboxMessage) -> Result<(), Self::Error> {
        let mut answers = self.publish_batch(std::slice::from_ref(message)).await;
        answers.pop().unwrap_or(Ok(()))
    }

    /// Every message published first, then the stream's acknowledgements awaited until
    /// one deadline for all ([`ack_timeout`](JetStreamPublisher::ack_timeout)): a message
    /// not acknowledged fails alone.
    async fn publish_batch(
        &self,
        messages: &[crate::outbox::OutboxMessage],
    ) -> Vec<Result<(), Self::Error>> {
        use ::async_nats::connection::State;
        use ::async_nats::jetstream::context::{PublishError, PublishErrorKind};
        use std::sync::atomic::Ordering;

        let client = self.context.client();
        let statistics = client.statistics();
        let connects = statistics.connects.load(Ordering::Relaxed);
        let was_up = client.connection_state() == State::Connected;
        let deadline = tokio::time::Instant::now() + self.ack_timeout;
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            acks.push(tokio::time::timeout_at(deadline, self.start(message)).await);
        }
        let mut answers = Vec::with_capacity(messages.len());
        for ack in acks {
            // Each acknowledgement's own time-out starts when it is first awaited: the
            // shared deadline is what bounds the claim.
            let answer = match ack {
                Ok(Ok(ack)) => match tokio::time::timeout_at(deadline, ack).await {
                    Ok(answer) => answer.map(|_| ()),
                    Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
                },
                Ok(Err(error)) => Err(error),
                Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
            };
            answers.push(answer);
        }
        let away = !was_up
            || client.connection_state() != State::Connected
            || statistics.connects.load(Ordering::Relaxed) != connects;
        answers
            .into_iter()
            .map(|answer| {
                answer.map_err(|error| {
                    let unreachable = match error.kind() {
                        PublishErrorKind::BrokenPipe => true,
                        PublishErrorKind::TimedOut | PublishErrorKind::Other => away,
                        _ => false,
                    };
                    JetStreamPublishError { error, unreachable }
                })
            })
            .collect()
    }
}
