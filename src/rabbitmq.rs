//! The RabbitMQ topology of `examples/rabbitmq.rs`, for the tests that publish to it or
//! settle against it (feature `brokers`).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

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
