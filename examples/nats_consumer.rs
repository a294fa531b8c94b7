//! A NATS JetStream → PostgreSQL service with an outbox event, on the consumer dedup hosts:
//! each order applied once, whatever JetStream redelivers and whenever the process dies
//! (`kill -9` included), and one `accepted` event per order, sent on by the relay.
//!
//! `cargo run --features brokers --example nats_consumer`; SIGTERM or Ctrl-C stops it.
//! Settings: `NATS_URL`, `DATABASE_URL`, `STREAM` (`ORDERS`, on `SUBJECT`, `orders`; dead
//! letters to `orders.dead` in `ORDERS_DEAD`), `EVENTS_SUBJECT` (`order-events`, in
//! `ORDERS_EVENTS`), `ACK_WAIT_MS` (`30000`, for the durable consumer `orders` it creates).
//! An order's id is its `Message-Id` header; one without is dead-lettered.

use std::sync::Arc;

use async_nats::jetstream::{self, consumer::pull, stream};
use dedup_runtime::async_nats::{JetStreamConsumer, JetStreamPublisher};
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::{consume::Message, idempotent};
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

type Events = (Outbox, String); // its own outbox table (its relay sends only its events)
const OUTBOX: &str = "nats_orders_outbox";
const CONSUMER: &str = "nats-orders"; // the attribute's and the `Cause`'s

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

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (stream, subject) = (setting("STREAM", "ORDERS"), setting("SUBJECT", "orders"));
    let events = setting("EVENTS_SUBJECT", "order-events");
    let ack_wait = std::time::Duration::from_millis(setting("ACK_WAIT_MS", "30000").parse()?);
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

    // The streams of the orders, their dead letters and the events, created if missing.
    let nats = setting("NATS_URL", "nats://127.0.0.1:4222");
    let js = jetstream::new(async_nats::connect(nats).await?);
    let dead = format!("{subject}.dead");
    for (suffix, subject) in [("", &subject), ("_DEAD", &dead), ("_EVENTS", &events)] {
        let mut config = stream::Config::from(format!("{stream}{suffix}").as_str());
        config.subjects = vec![subject.clone()];
        js.get_or_create_stream(config).await?;
    }
    let publisher = JetStreamPublisher::new(js.clone());
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let relay = outbox.relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let events = Arc::new((outbox, events)); // the outbox, and where its events go
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let events = events.clone();
        async move { apply(&pool, &msg, &events).await }
    };
    let durable = pull::Config {
        ack_wait,
        max_deliver: 20,
        ..Default::default()
    };
    let consumer = JetStreamConsumer::new(js, &stream, "orders")
        .create_with(durable)
        .concurrency(4);
    let consumed = consumer.run(&pool, handler, stopped(stopping)).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
