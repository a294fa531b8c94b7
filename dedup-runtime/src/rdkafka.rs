//! Kafka through [rust-rdkafka](https://docs.rs/rdkafka) (feature `rdkafka`): the hosted
//! consumer [`KafkaConsumer`], which runs an `#[idempotent]` handler for every record of a
//! topic as a member of a consumer group, and the outbox's publisher [`KafkaPublisher`].
//!
//! The feature turns on none of rdkafka's own features but `tokio`: your own rdkafka
//! dependency picks librdkafka's build, TLS, SASL and compression.

use std::time::Duration;

use ::rdkafka::ClientConfig;
use ::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use ::rdkafka::message::{Header, OwnedHeaders};
use ::rdkafka::producer::{FutureProducer, FutureRecord};

use crate::outbox::{OutboxMessage, Publisher};

mod consumer;

pub use consumer::{ConsumeError, KafkaConsumer, MessageIdFrom, provenance};

/// Publishes an outbox's rows to Kafka, for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each to the row's destination as its
/// topic, with the outgoing id in the record header `id` (UTF-8) — where the consumer
/// downstream reads it (`examples/kafka.rs`, `MESSAGE_ID=header:id`) — and the row's
/// ordering key, if any, as the record key, so that the messages of one key go to one
/// partition, in order. A send is `Ok` once the broker acknowledged the record; with the
/// producer of [`producer_config`](KafkaPublisher::producer_config) (`acks=all`,
/// `enable.idempotence=true`) that is once every in-sync replica has it, and the broker
/// drops the producer's own retried copies of a record.
/// The row's trace context, if it has one, goes as the record header `traceparent`.
///
/// A claim's records are all handed to the producer before any delivery is awaited.
/// The row's headers ([`OutboxMessage::headers`](crate::outbox::OutboxMessage::headers))
/// go as record headers, in order, before `id` and `traceparent`.
///
/// The publisher makes its producer from the configuration given to
/// [`new`](Self::new), and makes a new one when librdkafka reports the producer's
/// state lost for good (a fatal error: an idempotent producer fenced or out of
/// sequence after a broker restart); librdkafka itself reconnects to the brokers. A
/// record that failed for the brokers' absence or the producer's state, not for
/// anything in it, costs its row no attempt ([`Publisher::unreachable`]).
///
/// ```no_run
/// use dedup_runtime::outbox::Outbox;
/// use dedup_runtime::rdkafka::KafkaPublisher;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = KafkaPublisher::new(KafkaPublisher::producer_config("127.0.0.1:9092"))?;
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaPublisher {
    config: ClientConfig,
    /// The producer in use; replaced after a fatal error. Clones share it.
    producer: std::sync::Arc<std::sync::Mutex<FutureProducer>>,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher").finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher through a producer made from `config` (see
    /// [`producer_config`](Self::producer_config)); the same configuration makes the
    /// producer that replaces one lost to a fatal error.
    ///
    /// # Errors
    /// librdkafka's, when it refuses the configuration.
    pub fn new(config: ClientConfig) -> Result<Self, KafkaError> {
        let producer = config.create()?;
        Ok(KafkaPublisher {
            config,
            producer: std::sync::Arc::new(std::sync::Mutex::new(producer)),
        })
    }

    /// The producer to send through: the one in use, or — when it reported a fatal
    /// error — a new one.
    fn producer(&self) -> Result<FutureProducer, KafkaError> {
        use ::rdkafka::producer::Producer as _;

        let mut producer = self.producer.lock().expect("not poisoned");
        if let Some(fatal) = producer.client().fatal_error() {
            tracing::warn!(
                error = %fatal.1,
                "outbox: the Kafka producer reported a fatal error; making a new one"
            );
            *producer = self.config.create()?;
        }
        Ok(producer.clone())
    }

    /// Replaces `lost`, the producer a claim went through, after a record failed with an
    /// error of the producer's state (fenced, out of sequence, an unknown producer id):
    /// librdkafka reports these on each record, not always as a fatal error, and the same
    /// producer would fail every later record with them.
    fn replace(&self, lost: &FutureProducer, error: &KafkaError) {
        use ::rdkafka::producer::Producer as _;

        let mut producer = self.producer.lock().expect("not poisoned");
        // Another claim may have replaced it already.
        if !std::ptr::eq(producer.client().native_ptr(), lost.client().native_ptr()) {
            return;
        }
        match self.config.create() {
            Ok(fresh) => {
                tracing::warn!(%error, "outbox: the Kafka producer's state was lost; made a new one");
                *producer = fresh;
            }
            Err(create) => tracing::warn!(
                %error, %create,
                "outbox: the Kafka producer's state was lost, and a new one could not be made"
            ),
        }
    }

    /// A producer's configuration for the outbox: `bootstrap.servers`, `acks=all`,
    /// `enable.idempotence=true` and a 30 s `message.timeout.ms` (a record not
    /// acknowledged in that time fails its row, which the relay sends again later with the
    /// same id). Add your own settings (TLS, SASL, compression) before
    /// [`new`](Self::new).
    pub fn producer_config(bootstrap_servers: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", bootstrap_servers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("message.timeout.ms", "30000");
        config
    }
}

/// An error of the producer's own state rather than of the record or the brokers'
/// reach: a new producer does not have it.
fn producer_lost(error: &KafkaError) -> bool {
    matches!(
        error,
        KafkaError::MessageProduction(
            RDKafkaErrorCode::Fatal
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::OutOfOrderSequenceNumber
                | RDKafkaErrorCode::UnknownProducerId
        )
    )
}

/// How long a record may wait for room in the producer's queue before its send fails.
const QUEUE_WAIT: Duration = Duration::from_secs(30);

impl Publisher for KafkaPublisher {
    type Error = KafkaError;
    const SYSTEM: &'static str = "kafka";

    /// librdkafka reconnects by itself; a record it could not deliver because no broker
    /// answered — `message.timeout.ms` passed (`MessageTimedOut`), every broker down, a
    /// transport failure, a queue that stayed full — failed for the broker's absence, and
    /// costs its row no attempt. A refusal (a record too large, an unknown topic, an
    /// authorisation error) counts.
    ///
    /// So does an error of the producer's own state, which the next claim's new producer
    /// does not have: fenced, out of sequence, an unknown producer id, a fatal error.
    fn unreachable(error: &KafkaError) -> bool {
        matches!(
            error,
            KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut
                    | RDKafkaErrorCode::AllBrokersDown
                    | RDKafkaErrorCode::BrokerTransportFailure
                    | RDKafkaErrorCode::QueueFull
                    | RDKafkaErrorCode::NetworkException
                    | RDKafkaErrorCode::RequestTimedOut
                    | RDKafkaErrorCode::Fatal
                    | RDKafkaErrorCode::ProducerFenced
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::OutOfOrderSequenceNumber
                    | RDKafkaErrorCode::UnknownProducerId
                    | RDKafkaErrorCode::PurgeQueue
                    | RDKafkaErrorCode::PurgeInflight
            ) | KafkaError::Canceled
        )
    }

    async fn publish(&self, message: &OutboxMessage) -> Result<(), KafkaError> {
        self.publish_batch(std::slice::from_ref(message))
            .await
            .pop()
            .unwrap_or(Err(KafkaError::Canceled))
    }

    /// Every record handed to the producer first, then their deliveries awaited: a record
    /// the broker refused or did not acknowledge within `message.timeout.ms` fails alone.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), KafkaError>> {
        let ids: Vec<String> = messages
            .iter()
            .map(|message| message.id().to_string())
            .collect();
        let producer = match self.producer() {
            Ok(producer) => producer,
            Err(error) => return messages.iter().map(|_| Err(error.clone())).collect(),
        };
        let mut deliveries = Vec::with_capacity(messages.len());
        for (message, id) in messages.iter().zip(&ids) {
            // The message's own first (names the outbox checked), the publisher's after.
            let mut headers = OwnedHeaders::new();
            for (name, value) in message.headers() {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            headers = headers.insert(Header {
                key: "id",
                value: Some(id.as_str()),
            });
            if let Some(traceparent) = message.traceparent() {
                headers = headers.insert(Header {
                    key: "traceparent",
                    value: Some(traceparent),
                });
            }
            let mut record = FutureRecord::<str, [u8]>::to(message.destination())
                .payload(message.payload())
                .headers(headers);
            if let Some(key) = message.ordering_key() {
                record = record.key(key);
            }
            // Handed over at once (`send_result`); a full queue is waited out.
            let waited = tokio::time::Instant::now() + QUEUE_WAIT;
            let delivery = loop {
                match producer.send_result(record) {
                    Ok(delivery) => break Ok(delivery),
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if tokio::time::Instant::now() < waited =>
                    {
                        record = back;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err((error, _)) => break Err(error),
                }
            };
            deliveries.push(delivery);
        }
        let mut answers = Vec::with_capacity(messages.len());
        for delivery in deliveries {
            answers.push(match delivery {
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((error, _))) => Err(error),
                    Err(_) => Err(KafkaError::Canceled),
                },
                Err(error) => Err(error),
            });
        }
        if let Some(error) = answers
            .iter()
            .find_map(|answer| answer.as_ref().err().filter(|error| producer_lost(error)))
        {
            self.replace(&producer, error);
        }
        answers
    }
}
