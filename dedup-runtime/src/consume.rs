//! What every hosted consumer shares, whatever its broker: the [`Message`] a handler is
//! given, and what a run did ([`Consumed`]).
//!
//! A hosted consumer ([`lapin::RabbitMqConsumer`](crate::lapin::RabbitMqConsumer),
//! [`redis::RedisStreamsConsumer`](crate::redis::RedisStreamsConsumer),
//! [`rumqttc::MqttConsumer`](crate::rumqttc::MqttConsumer),
//! [`async_nats::JetStreamConsumer`](crate::async_nats::JetStreamConsumer),
//! [`rdkafka::KafkaConsumer`](crate::rdkafka::KafkaConsumer))
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
//!
//! # Metrics
//!
//! With the feature `metrics`, every hosted consumer records, through the [`metrics`](https://docs.rs/metrics)
//! facade, with the labels `system` (`rabbitmq`, `kafka`, `nats`, `redis`, `mqtt`),
//! `destination` (the queue, topic, stream or subject consumed) and `group` (the
//! consumer group or durable consumer; empty where the broker has none):
//!
//! | name | kind | more labels | what |
//! | --- | --- | --- | --- |
//! | `dedup_consumer_messages_total` | counter | `outcome`: `acknowledged`, `retried`, `dead_lettered`, `requeued`, `dropped` | messages, by what the consumer told the broker (the fields of [`Consumed`]) |
//! | `dedup_consumer_process_duration_seconds` | histogram | | one handler call, its transaction included |
//! | `dedup_consumer_lag` | gauge | `partition` (Kafka) | what the broker says is left: Kafka's consumer lag per partition from librdkafka's statistics (`statistics.interval.ms`, set to 5 s unless yours says otherwise), JetStream's pending count at each message; RabbitMQ's ready messages in the queue (a passive `queue.declare`) and Redis Streams' entries not yet delivered to the group (`XINFO GROUPS`, its `lag`), each asked at the first message and every 5 s after; not recorded for MQTT, whose broker does not tell |
//!
//! The handler's own metrics (`dedup_processed_total`, …) are recorded as well, by the
//! `#[idempotent]` handler itself.

/// A consumer's trace hook ([`KafkaConsumer::trace_parent`](crate::rdkafka::KafkaConsumer::trace_parent)
/// and the others'): called with each message's consumer span and the message, before
/// the handler runs (for a batch, once per message with the batch's span). This crate
/// depends on `tracing` alone; the hook is where your OpenTelemetry integration connects
/// the span to the producer's context from the message's `traceparent` header: with
/// `tracing-opentelemetry`, extract a context from the headers with
/// `TraceContextPropagator` and call `span.set_parent(context)` (a batch's span:
/// `span.add_link(…)`). Paired with the outbox's
/// [`trace_context`](crate::outbox::Outbox::trace_context) hook, one trace runs from the
/// producer through the handler, its outbox event and the relay to the next consumer
/// (the suite's `tests/consumers/trace.rs` shows both hooks, and checks the trace).
pub type TraceParent = fn(&tracing::Span, &Message);

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
    /// `id`; NATS: the `Message-Id` header; Kafka: the record header `id`; MQTT: the user
    /// property `message-id`). Empty when the
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
    /// Kafka: the record's headers, a null value as no bytes. MQTT: the user properties but
    /// the id, each value as its UTF-8 bytes).
    pub fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_slice()))
    }

    /// The value of the first header named `name` (compared as the broker compares:
    /// exactly on RabbitMQ, Redis, NATS, Kafka and MQTT).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers().find(|(key, _)| *key == name).map(|(_, v)| v)
    }

    /// Which delivery of the message this is, counting from 1, as
    /// [`AckPolicy::decide`](crate::AckPolicy::decide) takes it (Kafka, which keeps no
    /// count: the consumer's own calls of the handler for this record, from 1).
    pub fn delivery_count(&self) -> u64 {
        self.delivery
    }

    /// Where it came from: the queue (RabbitMQ), the stream (Redis), the subject (NATS),
    /// the topic (Kafka, MQTT).
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

#[cfg(any(
    feature = "lapin",
    feature = "async-nats",
    feature = "rdkafka",
    feature = "redis",
    feature = "rumqttc"
))]
pub(crate) mod calls;

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
// With some of the brokers' features alone, some of what the five share goes unused.
#[cfg_attr(
    not(all(
        feature = "lapin",
        feature = "async-nats",
        feature = "rdkafka",
        feature = "redis",
        feature = "rumqttc"
    )),
    allow(dead_code)
)]
pub(crate) mod shared {
    use std::future::Future;

    use super::Consumed;
    use std::pin::pin;
    use std::task::Poll;
    use std::time::Duration;

    use tokio::sync::watch;

    /// A consumer's metrics (feature `metrics`; without it, nothing): see the table in
    /// [the module's docs](crate::consume#metrics).
    #[derive(Clone, Default)]
    pub(crate) struct Meter {
        #[cfg(feature = "metrics")]
        inner: Option<std::sync::Arc<Instruments>>,
    }

    #[cfg(feature = "metrics")]
    struct Instruments {
        #[cfg_attr(not(feature = "rdkafka"), allow(dead_code))] // Kafka's partitions'
        labels: Vec<metrics::Label>,
        acknowledged: metrics::Counter,
        retried: metrics::Counter,
        dead_lettered: metrics::Counter,
        requeued: metrics::Counter,
        dropped: metrics::Counter,
        duration: metrics::Histogram,
        lag: metrics::Gauge,
        /// Kafka: one gauge per partition, made on the run's own thread (where a
        /// thread-local recorder is, if any): the lag is set on the poll thread.
        partitions: std::sync::OnceLock<Vec<metrics::Gauge>>,
        /// What the counters recorded so far, all workers together.
        recorded: std::sync::Mutex<Consumed>,
    }

    /// `now` minus `seen`, field by field (0 where `seen` is ahead).
    #[cfg(feature = "metrics")]
    fn minus(now: &Consumed, seen: &Consumed) -> Consumed {
        Consumed {
            acknowledged: now.acknowledged.saturating_sub(seen.acknowledged),
            retried: now.retried.saturating_sub(seen.retried),
            dead_lettered: now.dead_lettered.saturating_sub(seen.dead_lettered),
            requeued: now.requeued.saturating_sub(seen.requeued),
            dropped: now.dropped.saturating_sub(seen.dropped),
            reconnects: now.reconnects.saturating_sub(seen.reconnects),
        }
    }

    #[cfg(feature = "metrics")]
    impl Instruments {
        /// Increments each counter by what `now` counts beyond `seen`.
        fn record(&self, seen: &Consumed, now: &Consumed) {
            let delta = minus(now, seen);
            for (counter, by) in [
                (&self.acknowledged, delta.acknowledged),
                (&self.retried, delta.retried),
                (&self.dead_lettered, delta.dead_lettered),
                (&self.requeued, delta.requeued),
                (&self.dropped, delta.dropped),
            ] {
                if by > 0 {
                    counter.increment(by);
                }
            }
        }
    }

    impl Meter {
        /// The metrics of a consumer of `destination` on `system` (OpenTelemetry's
        /// `messaging.system` names), in `group` (empty when the broker has none).
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
        pub(crate) fn new(system: &'static str, destination: &str, group: &str) -> Meter {
            #[cfg(feature = "metrics")]
            {
                let labels = vec![
                    metrics::Label::new("system", system),
                    metrics::Label::new("destination", destination.to_owned()),
                    metrics::Label::new("group", group.to_owned()),
                ];
                let counter = |outcome: &'static str| {
                    let mut labels = labels.clone();
                    labels.push(metrics::Label::new("outcome", outcome));
                    metrics::counter!("dedup_consumer_messages_total", labels)
                };
                let instruments = Instruments {
                    acknowledged: counter("acknowledged"),
                    retried: counter("retried"),
                    dead_lettered: counter("dead_lettered"),
                    requeued: counter("requeued"),
                    dropped: counter("dropped"),
                    duration: metrics::histogram!(
                        "dedup_consumer_process_duration_seconds",
                        labels.clone()
                    ),
                    lag: metrics::gauge!("dedup_consumer_lag", labels.clone()),
                    labels,
                    partitions: std::sync::OnceLock::new(),
                    recorded: std::sync::Mutex::default(),
                };
                Meter {
                    inner: Some(std::sync::Arc::new(instruments)),
                }
            }
            #[cfg(not(feature = "metrics"))]
            Meter {}
        }

        /// Records what a worker's `now` counts beyond its `seen`, and makes `seen` `now`:
        /// after each message, so that the counters move as the consumer works.
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
        pub(crate) fn catch_up(&self, seen: &mut Consumed, now: &Consumed) {
            #[cfg(feature = "metrics")]
            if let Some(meter) = &self.inner {
                let mut recorded = meter.recorded.lock().unwrap_or_else(|p| p.into_inner());
                meter.record(seen, now);
                recorded.add(&minus(now, seen));
            }
            *seen = *now;
        }

        /// The run's end: records what `total` counts beyond what the workers recorded
        /// (what they counted on paths without a [`catch_up`](Self::catch_up)).
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
        pub(crate) fn finish(&self, total: &Consumed) {
            #[cfg(feature = "metrics")]
            if let Some(meter) = &self.inner {
                let mut recorded = meter.recorded.lock().unwrap_or_else(|p| p.into_inner());
                meter.record(&recorded, total);
                *recorded = *total;
            }
        }

        /// Records one handler call's duration, from `started`.
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
        pub(crate) fn processed(&self, started: std::time::Instant) {
            #[cfg(feature = "metrics")]
            if let Some(meter) = &self.inner {
                meter.duration.record(started.elapsed().as_secs_f64());
            }
        }

        /// Records the consumer's lag as the broker told it: messages not yet delivered
        /// (or not yet acknowledged), for one `partition` where the broker has them.
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables, dead_code))]
        pub(crate) fn lag(&self, partition: Option<i32>, lag: u64) {
            #[cfg(feature = "metrics")]
            if let Some(meter) = &self.inner {
                #[allow(clippy::cast_precision_loss)]
                let lag = lag as f64;
                match partition {
                    None => meter.lag.set(lag),
                    Some(partition) => {
                        let gauges = meter.partitions.get();
                        let index = usize::try_from(partition).ok();
                        if let Some(gauge) = gauges.zip(index).and_then(|(g, i)| g.get(i)) {
                            gauge.set(lag);
                        }
                    }
                }
            }
        }

        /// Whether the lag is to be asked of the broker now (every [`LAG_INTERVAL`],
        /// from the first message; never without feature `metrics`), and when next.
        #[cfg_attr(not(feature = "metrics"), allow(unused_variables, dead_code))]
        pub(crate) fn lag_due(&self, next: &mut std::time::Instant) -> bool {
            #[cfg(feature = "metrics")]
            if self.inner.is_some() {
                let now = std::time::Instant::now();
                if now >= *next {
                    *next = now + LAG_INTERVAL;
                    return true;
                }
            }
            false
        }

        /// Kafka: makes the lag gauges of partitions `0..count`, once.
        #[cfg_attr(
            any(not(feature = "metrics"), not(feature = "rdkafka")),
            allow(unused_variables, dead_code)
        )]
        pub(crate) fn partitions(&self, count: usize) {
            #[cfg(feature = "metrics")]
            if let Some(meter) = &self.inner {
                let _ = meter.partitions.set(
                    (0..count)
                        .map(|partition| {
                            let mut labels = meter.labels.clone();
                            labels.push(metrics::Label::new("partition", partition.to_string()));
                            metrics::gauge!("dedup_consumer_lag", labels)
                        })
                        .collect(),
                );
            }
        }
    }

    /// How often RabbitMQ and Redis Streams consumers ask their broker for the lag.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) const LAG_INTERVAL: Duration = Duration::from_secs(5);

    /// The first and the longest wait before a consumer connects again.
    pub(crate) const RECONNECT: (Duration, Duration) =
        (Duration::from_millis(100), Duration::from_secs(5));

    /// Whether shutdown began.
    #[allow(dead_code)] // with one broker's feature alone, its consumer may not use it
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
    #[allow(dead_code)] // with one broker's feature alone, its consumer may not use it
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
        not(any(feature = "async-nats", feature = "rdkafka", feature = "rumqttc")),
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
    #[allow(dead_code)] // with one broker's feature alone, its consumer may not use it
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
