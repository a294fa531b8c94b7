//! The brokers the relay publishes to (feature `brokers`).

use crate::Error;
use crate::outbox::DESTINATION;

/// The brokers the relay publishes to (feature `brokers`): the local RabbitMQ
/// (`DEDUP_TEST_AMQP_URL`) and NATS JetStream (`DEDUP_TEST_NATS_URL`), a queue and a
/// stream for the rows' destination, emptied after each measure.
pub(crate) struct Brokers {
    pub(crate) rabbitmq: dedup_runtime::lapin::RabbitMqPublisher,
    channel: lapin::Channel,
    pub(crate) jetstream: dedup_runtime::async_nats::JetStreamPublisher,
    stream: async_nats::jetstream::stream::Stream,
    /// For the hand-written relays (`-- relay`): a channel in confirm mode, and the
    /// JetStream context.
    pub(crate) hand_channel: lapin::Channel,
    pub(crate) context: async_nats::jetstream::Context,
}

impl Brokers {
    pub(crate) async fn connect() -> Result<Brokers, Error> {
        let amqp = std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let nats = std::env::var("DEDUP_TEST_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let connection = lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default())
            .await
            .map_err(|error| format!("RabbitMQ at {amqp}: {error}"))?;
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                DESTINATION.into(),
                lapin::options::QueueDeclareOptions::durable(),
                lapin::types::FieldTable::default(),
            )
            .await?;
        let rabbitmq = dedup_runtime::lapin::RabbitMqPublisher::connect(
            &amqp,
            lapin::ConnectionProperties::default(),
            "",
        )
        .await?;
        let client = async_nats::connect(&nats)
            .await
            .map_err(|error| format!("NATS at {nats}: {error}"))?;
        let context = async_nats::jetstream::new(client);
        // Made afresh: a stream left by an earlier run may capture other subjects.
        let _ = context.delete_stream("DEDUP_BENCH_RELAY").await;
        let stream = context
            .create_stream(async_nats::jetstream::stream::Config {
                name: "DEDUP_BENCH_RELAY".to_owned(),
                subjects: vec![DESTINATION.to_owned()],
                ..Default::default()
            })
            .await?;
        let hand_channel = connection.create_channel().await?;
        hand_channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        let brokers = Brokers {
            rabbitmq,
            channel,
            jetstream: dedup_runtime::async_nats::JetStreamPublisher::new(context.clone()),
            stream,
            hand_channel,
            context,
        };
        brokers.purge().await?;
        Ok(brokers)
    }

    /// Empties the queue and the stream.
    pub(crate) async fn purge(&self) -> Result<(), Error> {
        self.channel
            .queue_purge(
                DESTINATION.into(),
                lapin::options::QueuePurgeOptions::default(),
            )
            .await?;
        self.stream.purge().await?;
        Ok(())
    }
}
