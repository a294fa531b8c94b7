//! A Kafka → PostgreSQL service with an outbox event, on the consumer dedup hosts: each
//! order applied once, whatever Kafka redelivers and whenever the process dies (`kill -9`
//! included), and one `accepted` event per order, relayed to a Kafka topic.
//!
//! `cargo run --features brokers --example kafka_consumer`; SIGTERM or Ctrl-C stops it.
//! Settings: `KAFKA_BROKERS` (`127.0.0.1:9092`), `DATABASE_URL`, `TOPIC` (`orders`; its
//! dead letters go to `orders.dead`, created if missing), `GROUP` (`orders`) and
//! `EVENTS_TOPIC` (`order-events`). Any other `KAFKA_<NAME>` is the librdkafka setting
//! `<name>` (`KAFKA_SESSION_TIMEOUT_MS=6000` → `session.timeout.ms`). An order's id is its
//! record header `id`; one without is dead-lettered.

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::idempotent;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::rdkafka::{KafkaConsumer, KafkaPublisher};
use rdkafka::ClientConfig;
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Applies an order and enqueues its event, in one transaction with the dedup record.
#[idempotent(consumer = CONSUMER, key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message, to: &Events) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_kafka_orders (message_id, body) VALUES ($1, $2)")
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
const OUTBOX: &str = "kafka_orders_outbox";
const CONSUMER: &str = "kafka-orders"; // the attribute's and the `Cause`'s

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// `bootstrap.servers` and every `KAFKA_<NAME>` setting as librdkafka's `<name>`.
fn kafka_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set(
        "bootstrap.servers",
        setting("KAFKA_BROKERS", "127.0.0.1:9092"),
    );
    for (name, value) in std::env::vars() {
        if let Some(name) = name
            .strip_prefix("KAFKA_")
            .filter(|name| *name != "BROKERS")
        {
            config.set(name.to_lowercase().replace('_', "."), value);
        }
    }
    config
}

async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let topic = setting("TOPIC", "orders");
    let events = setting("EVENTS_TOPIC", "order-events");
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, OUTBOX).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_kafka_orders (message_id text, body bytea)")
        .execute(&pool)
        .await?;

    // SIGTERM or Ctrl-C: the consumer and the relay finish what they hold, then stop.
    let (stop, stopping) = watch::channel(false);
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        let _ = stop.send(true);
    });

    // The relay sends the events to their topic.
    let publisher = KafkaPublisher::new(KafkaPublisher::producer_config(&setting(
        "KAFKA_BROKERS",
        "127.0.0.1:9092",
    )))?;
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let relay = outbox.relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let events = Arc::new((outbox, events)); // the outbox, and where its events go
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let events = events.clone();
        async move { apply(&pool, &msg, &events).await }
    };
    let mut config = kafka_config();
    config.set("group.id", setting("GROUP", "orders"));
    let consumer = KafkaConsumer::new(config, &topic);
    let consumed = consumer.run(&pool, handler, stopped(stopping)).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
