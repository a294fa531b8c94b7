//! The outbox's Kafka publisher (feature `rdkafka`): [`KafkaPublisher`].

use std::time::Duration;

use ::rdkafka::ClientConfig;
use ::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use ::rdkafka::message::{Header, OwnedHeaders};
use ::rdkafka::producer::{FutureProducer, FutureRecord};

use crate::outbox::{OutboxMessage, Publisher};

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
/// The row's headers are not sent (their encoding is yours).
///
/// ```no_run
/// use dedup_runtime::outbox::Outbox;
/// use dedup_runtime::rdkafka::KafkaPublisher;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let producer = KafkaPublisher::producer_config("127.0.0.1:9092").create()?;
/// let publisher = KafkaPublisher::new(producer);
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher").finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher through `producer`.
    pub fn new(producer: FutureProducer) -> Self {
        KafkaPublisher { producer }
    }

    /// A producer's configuration for the outbox: `bootstrap.servers`, `acks=all`,
    /// `enable.idempotence=true` and a 30 s `message.timeout.ms` (a record not
    /// acknowledged in that time fails its row, which the relay sends again later with the
    /// same id). Add your own settings (TLS, SASL, compression) before `create()`.
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

/// How long a record may wait for room in the producer's queue before its send fails.
const QUEUE_WAIT: Duration = Duration::from_secs(30);

impl Publisher for KafkaPublisher {
    type Error = KafkaError;
    const SYSTEM: &'static str = "kafka";

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
        let mut deliveries = Vec::with_capacity(messages.len());
        for (message, id) in messages.iter().zip(&ids) {
            let mut headers = OwnedHeaders::new().insert(Header {
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
                match self.producer.send_result(record) {
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
        answers
    }
}
