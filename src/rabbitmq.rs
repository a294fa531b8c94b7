//! The RabbitMQ topology of `examples/rabbitmq.rs`, for the tests that publish to it or
//! settle against it, and the tests' own channel to the broker (feature `brokers`).

use lapin::options::{
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

/// The machine's RabbitMQ.
pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A channel in confirm mode on a connection of the test's own. Panics when RabbitMQ is
/// not reachable: a test's setup.
pub async fn channel() -> Channel {
    let connection = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .unwrap_or_else(|error| panic!("RabbitMQ is not reachable at {AMQP}: {error}"));
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // The connection lives as long as its channel is used.
    std::mem::forget(connection);
    channel
}

/// Messages ready in `queue` (not those delivered and not yet settled), and its consumers.
pub async fn depth(channel: &Channel, queue: &str) -> (u32, u32) {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    (declared.message_count(), declared.consumer_count())
}

/// Declares `queue` (a quorum queue when `quorum`, classic otherwise) with its
/// dead-letter exchange `queue.dlx` and the queue `queue.dead` behind it, durable, as
/// `examples/rabbitmq.rs` declares them: RabbitMQ refuses to redeclare a queue with other
/// arguments, so the two must agree. Panics when the broker refuses: a test's setup.
pub async fn declare(channel: &Channel, queue: &str, quorum: bool) {
    let (dlx, dead) = (format!("{queue}.dlx"), format!("{queue}.dead"));
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await
        .expect("declare the dead-letter exchange");
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .expect("declare the dead-letter queue");
    channel
        .queue_bind(
            dead.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the dead-letter queue");
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    if quorum {
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .expect("declare the queue");
}
