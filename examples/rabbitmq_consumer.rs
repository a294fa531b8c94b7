//! A RabbitMQ → PostgreSQL service with an outbox event, on the consumer dedup hosts:
//! each order applied once, whatever RabbitMQ redelivers and whenever the process dies
//! (`kill -9` included), and one `accepted` event per order, sent on by the relay.
//!
//! ```text
//! cargo run --features brokers --example rabbitmq_consumer   # SIGTERM or Ctrl-C stops it
//! ```
//!
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
#[idempotent(consumer = "orders", key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message, events: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_orders (message_id, body) VALUES ($1, $2)")
        .bind(msg.id())
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new("orders", msg.id())?;
    let event = cause.outgoing("accepted", events, msg.payload())?;
    Outbox::new().enqueue(&mut *tx, &event).await?;
    Ok(())
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Completes once `stopping` says so.
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let amqp = setting("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let (queue, events) = (
        setting("QUEUE", "orders"),
        setting("EVENTS_QUEUE", "order-events"),
    );
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate(&pool).await?;
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

    // The relay sends the events to their queue (declared here: a publisher's send to
    // no queue is returned, and retried).
    let properties = ConnectionProperties::default();
    let setup = Connection::connect(&amqp, properties.clone()).await?;
    let durable = QueueDeclareOptions::durable();
    let channel = setup.create_channel().await?;
    channel
        .queue_declare(events.as_str().into(), durable, Default::default())
        .await?;
    let publisher = RabbitMqPublisher::connect(&amqp, properties.clone(), "").await?;
    let relay = Outbox::new().relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let events: Arc<str> = events.into();
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
