//! An MQTT → PostgreSQL service with an outbox event, on the consumer dedup hosts: each
//! order applied once, whatever the broker redelivers and whenever the process dies
//! (`kill -9` included), and one `accepted` event per order, sent on by the relay.
//!
//! ```text
//! cargo run --features brokers --example mqtt_consumer   # SIGTERM or Ctrl-C stops it
//! ```
//!
//! Settings: `MQTT_HOST` (`127.0.0.1`), `MQTT_PORT` (`1883`), `DATABASE_URL`, `TOPIC`
//! (`orders`; dead letters to `orders/dead`), `EVENTS_TOPIC` (`order-events`) and
//! `CLIENT_ID` (`orders-consumer`: the persistent session, one process at a time). MQTT 5:
//! an order's id is its user property `message-id` (one without is dead-lettered), and an
//! event is sent once a session is subscribed to its topic (else it waits in the outbox).

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::idempotent;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::rumqttc::{MqttConsumer, MqttPublisher};
use rumqttc::v5::MqttOptions;
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Applies an order and enqueues its event, in one transaction with the dedup record.
#[idempotent(consumer = CONSUMER, key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message, to: &Events) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_mqtt_orders (message_id, body) VALUES ($1, $2)")
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
const OUTBOX: &str = "mqtt_orders_outbox";
const CONSUMER: &str = "mqtt-orders"; // the attribute's and the `Cause`'s

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (host, port) = (
        setting("MQTT_HOST", "127.0.0.1"),
        setting("MQTT_PORT", "1883").parse()?,
    );
    let topic = setting("TOPIC", "orders");
    let events = setting("EVENTS_TOPIC", "order-events");
    let client_id = setting("CLIENT_ID", "orders-consumer");
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, OUTBOX).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_mqtt_orders (message_id text, body bytea)")
        .execute(&pool)
        .await?;

    // SIGTERM or Ctrl-C: the consumer and the relay finish what they hold, then stop.
    let (stop, stopping) = watch::channel(false);
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        let _ = stop.send(true);
    });

    let relay_id = format!("{client_id}-relay");
    let publisher = MqttPublisher::new(MqttOptions::new(relay_id, &host, port));
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let relay = outbox.relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let events = Arc::new((outbox, events)); // the outbox, and where its events go
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let events = events.clone();
        async move { apply(&pool, &msg, &events).await }
    };
    let consumer = MqttConsumer::new(MqttOptions::new(client_id, &host, port), &topic);
    let consumed = consumer.run(&pool, handler, stopped(stopping)).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
