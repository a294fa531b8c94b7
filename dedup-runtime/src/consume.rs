//! What every hosted consumer shares, whatever its broker: the [`Message`] a handler is
//! given, and what a run did ([`Consumed`]).
//!
//! A hosted consumer ([`lapin::RabbitMqConsumer`](crate::lapin::RabbitMqConsumer),
//! [`redis::RedisStreamsConsumer`](crate::redis::RedisStreamsConsumer),
//! [`rumqttc::MqttConsumer`](crate::rumqttc::MqttConsumer),
//! [`async_nats::JetStreamConsumer`](crate::async_nats::JetStreamConsumer))
//! owns everything between the broker and an `#[idempotent]` handler: it takes each
//! message's id from where the broker's convention (and this crate's publishers) put it,
//! calls the handler, lets [`AckPolicy`](crate::AckPolicy) decide, and settles the
//! message with the broker **after** the handler's transaction committed — or rolled
//! back. The handler stays an ordinary `#[idempotent]` function over [`Message`]:
//!
//! ```
//! use dedup_runtime::consume::Message;
//! use dedup_runtime::idempotent;
//!
//! #[idempotent(consumer = "payments", key = msg.id())]
//! async fn apply(tx: &mut sqlx::SqliteConnection, msg: &Message) -> Result<(), sqlx::Error> {
//!     sqlx::query("INSERT INTO payments (body) VALUES (?1)")
//!         .bind(msg.payload())
//!         .execute(&mut *tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! // What a consumer's `run` takes: a closure given the pool and the message, both the
//! // call's own (`Pool<DB>`, `Arc<Message>`), so that its future can go to a task.
//! // In place: `consumer.run(&pool, |pool, msg| async move { apply(&pool, &msg).await }, …)`.
//! ```
//!
//! Decode the payload inside the handler: a payload that does not decode is an error of
//! the handler, which `AckPolicy` dead-letters (a permanent failure), in the same
//! transaction that would have recorded the message.

/// A message as a hosted consumer hands it to its handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) id: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) delivery: u64,
    pub(crate) destination: String,
}

impl Message {
    /// Its id, the key to dedup on, taken from where the consumer was told to read it
    /// (RabbitMQ: the `message-id` property by default; Redis Streams: the entry's field
    /// `id`; NATS: the `Message-Id` header; MQTT: the payload's first line). Empty when the
    /// message carries none: the handler's key check refuses it as an invalid id, and
    /// `AckPolicy` dead-letters it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The payload, byte for byte.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Its headers, name and value, in the order the broker gave them (RabbitMQ: the
    /// AMQP headers table; a string or byte array as its bytes, a number or a boolean as
    /// its decimal text; other values left out. Redis Streams: the entry's fields but the
    /// id and `body`. NATS: each value of a header that has several as a pair of its own.
    /// MQTT 3.1.1: none).
    pub fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_slice()))
    }

    /// The value of the first header named `name` (compared as the broker compares:
    /// RabbitMQ, Redis and NATS exactly).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().find(|(key, _)| *key == name).map(|(_, v)| v)
    }

    /// Which delivery of the message this is, counting from 1, as
    /// [`AckPolicy::decide`](crate::AckPolicy::decide) takes it.
    pub fn delivery_count(&self) -> u64 {
        self.delivery
    }

    /// Where it came from: the queue (RabbitMQ), the stream (Redis), the subject (NATS),
    /// the topic (MQTT).
    pub fn destination(&self) -> &str {
        &self.destination
    }
}

/// What a consumer's run did, by what it told the broker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Consumed {
    /// Acknowledged after the handler's transaction committed, or found processed (a
    /// duplicate).
    pub acknowledged: u64,
    /// Handed back for a later delivery after a transient failure (`Ack::Retry`; Redis
    /// Streams: left pending, and held in process for its delay).
    pub retried: u64,
    /// Sent to the dead destination (`Ack::DeadLetter`).
    pub dead_lettered: u64,
    /// Handed back unprocessed at shutdown: fetched and not started, or not finished
    /// within the shutdown deadline (its transaction rolled back). Redis Streams: left
    /// pending with the member, for its next start.
    pub requeued: u64,
    /// In hand when the connection or channel was lost: not settled (their
    /// acknowledgement could not be sent any more, or, on NATS, was not confirmed, or a
    /// dead letter's copy was not stored); the broker delivers them again (Redis Streams:
    /// they stay pending, read again after the reconnection).
    pub dropped: u64,
    /// Times the consumer connected again after losing its connection or channel (NATS:
    /// pulled again once the client, which reconnects by itself, was back).
    pub reconnects: u64,
}

impl Consumed {
    #[cfg_attr(
        not(any(feature = "lapin", feature = "async-nats", feature = "rdkafka")),
        allow(dead_code)
    )]
    pub(crate) fn add(&mut self, other: &Consumed) {
        self.acknowledged += other.acknowledged;
        self.retried += other.retried;
        self.dead_lettered += other.dead_lettered;
        self.requeued += other.requeued;
        self.dropped += other.dropped;
        self.reconnects += other.reconnects;
    }
}

/// What the hosted consumers share in their loops: the shutdown signal as their workers
/// see it, the pause that gives way to it, the deadline of the call in hand, the wait
/// before connecting again.
#[cfg(any(
    feature = "lapin",
    feature = "async-nats",
    feature = "rdkafka",
    feature = "redis",
    feature = "rumqttc"
))]
pub(crate) mod shared {
    use std::future::Future;
    use std::pin::pin;
    use std::task::Poll;
    use std::time::Duration;

    use tokio::sync::watch;

    /// The first and the longest wait before a consumer connects again.
    pub(crate) const RECONNECT: (Duration, Duration) =
        (Duration::from_millis(100), Duration::from_secs(5));

    /// Whether shutdown began.
    pub(crate) fn stopped(stopping: &watch::Receiver<bool>) -> bool {
        *stopping.borrow()
    }

    /// Waits `wait`; `false` once shutdown began (at once if it had).
    pub(crate) async fn pause(stopping: &watch::Receiver<bool>, wait: Duration) -> bool {
        let mut stopping = stopping.clone();
        let stop = stopping.wait_for(|stop| *stop);
        tokio::time::timeout(wait, stop).await.is_err()
    }

    /// `call`, or `None` if shutdown began and `deadline` passed after it first: the
    /// call is then dropped (a handler's transaction rolls back).
    pub(crate) async fn within_deadline<T>(
        stopping: &watch::Receiver<bool>,
        deadline: Duration,
        call: impl Future<Output = T>,
    ) -> Option<T> {
        let mut stopping = stopping.clone();
        let cutoff = async move {
            let _ = stopping.wait_for(|stop| *stop).await;
            tokio::time::sleep(deadline).await;
        };
        first(call, cutoff).await
    }

    /// The longest error text a dead letter's header keeps, in bytes.
    #[cfg_attr(
        not(any(feature = "async-nats", feature = "rdkafka")),
        allow(dead_code)
    )]
    pub(crate) const ERROR_LIMIT: usize = 1024;

    /// `text` as a header value: no control characters (a line break would end a NATS
    /// header), at most [`ERROR_LIMIT`] bytes, cut at a character boundary with a `…`.
    #[cfg_attr(
        not(any(feature = "async-nats", feature = "rdkafka")),
        allow(dead_code)
    )]
    pub(crate) fn header_text(text: &str) -> String {
        let mut value: String = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        if value.len() > ERROR_LIMIT {
            let mut cut = ERROR_LIMIT - '…'.len_utf8();
            while !value.is_char_boundary(cut) {
                cut -= 1;
            }
            value.truncate(cut);
            value.push('…');
        }
        value
    }

    /// `work`'s output if it ends first, `None` if `other` does.
    pub(crate) async fn first<T>(
        work: impl Future<Output = T>,
        other: impl Future<Output = ()>,
    ) -> Option<T> {
        let mut work = pin!(work);
        let mut other = pin!(other);
        std::future::poll_fn(|context| {
            if let Poll::Ready(done) = work.as_mut().poll(context) {
                return Poll::Ready(Some(done));
            }
            other.as_mut().poll(context).map(|()| None)
        })
        .await
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn error_texts_fit_one_header() {
            assert_eq!(header_text("a\r\nb\tc"), "a  b c");
            let long = "é".repeat(1000);
            let value = header_text(&long);
            assert!(value.len() <= ERROR_LIMIT, "{}", value.len());
            assert!(value.ends_with('…'));
            assert_eq!(header_text("short"), "short");
        }
    }
}
