//! A RabbitMQ → PostgreSQL service with an outbox event, on the consumer dedup hosts:
//! each order applied once, whatever RabbitMQ redelivers and whenever the process dies
//! (`kill -9` included), and one `accepted` event per order, sent on by the relay.
//!
//! `cargo run --features brokers --example rabbitmq_consumer`; SIGTERM or Ctrl-C stops it.
//! Settings: `AMQP_URL`, `DATABASE_URL`, `QUEUE` (`orders`; declared with its dead-letter
//! exchange `orders.dlx` and dead queue `orders.dead`) and `EVENTS_QUEUE`
//! (`order-events`). An order's id is its AMQP `message-id`; one without is dead-lettered.

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::idempotent;
use dedup_runtime::lapin::{RabbitMqConsumer, RabbitMqPublisher};
use dedup_runtime::outbox::{Cause, Outbox};
use lapin::options::QueueDeclareOptions;
use lapin::{Connection, ConnectionProperties};
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Applies an order and enqueues its event, in one transaction with the dedup record.
#[idempotent(consumer = CONSUMER, key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message, to: &Events) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_orders (message_id, body) VALUES ($1, $2)")
        .bind(msg.id())
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new(CONSUMER, msg.id())?;
    let event = cause.outgoing("accepted", &to.1, msg.payload())?;
    to.0.enqueue(&mut *tx, &event).await?;
    Ok(())
}

/// The service's outbox (its own table: its relay sends only its events), and where to.
type Events = (Outbox, String);
const OUTBOX: &str = "orders_outbox";
const CONSUMER: &str = "orders"; // the attribute's and the `Cause`'s

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let amqp = setting("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let queue = setting("QUEUE", "orders");
    let events = setting("EVENTS_QUEUE", "order-events");
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, OUTBOX).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_orders (message_id text, body bytea)")
        .execute(&pool)
        .await?;

    // SIGTERM or Ctrl-C: the consumer and the relay finish what they hold, then stop.
    let (stop, stopping) = watch::channel(false);
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        let _ = stop.send(true);
    });

    // The relay sends the events to their queue (declared: a send to no queue is retried).
    let properties = ConnectionProperties::default();
    let setup = Connection::connect(&amqp, properties.clone()).await?;
    let (channel, durable) = (
        setup.create_channel().await?,
        QueueDeclareOptions::durable(),
    );
    channel
        .queue_declare(events.as_str().into(), durable, Default::default())
        .await?;
    let publisher = RabbitMqPublisher::connect(&amqp, properties.clone(), "").await?;
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let relay = outbox.relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let events = Arc::new((outbox, events)); // the outbox, and where its events go
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let events = events.clone();
        async move { apply(&pool, &msg, &events).await }
    };
    let consumer = RabbitMqConsumer::new(&amqp, properties, &queue)
        .declare(true)
        .concurrency(4);
    let consumed = consumer.run(&pool, handler, stopped(stopping)).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
