//! The two-hop crash harness's second hop (`tests/consumers/two_hop.rs`): the service
//! downstream of an example, consuming the `accepted` events the example's relay sends —
//! from a RabbitMQ queue (`BROKER=rabbitmq`: `AMQP_URL`, `EVENTS_QUEUE`; the RabbitMQ and
//! the Kafka examples send there) or a JetStream stream (`BROKER=nats`: `NATS_URL`,
//! `EVENTS_STREAM`) — with the library's consumer and an `#[idempotent]` handler keyed
//! on the event's id (the outbox's derived id): each event applied once into
//! `example_events`, whatever the relay sent twice. `DATABASE_URL`; SIGTERM stops it.

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::idempotent;
use futures_util::FutureExt as _;
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};

#[idempotent(consumer = "order-events", key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_events (message_id, body) VALUES ($1, $2)")
        .bind(msg.id())
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_events (message_id text, body bytea)")
        .execute(&pool)
        .await?;
    let mut term = signal(SignalKind::terminate())?;
    let stop = async move {
        let _ = term.recv().await;
    }
    .boxed();
    let handler = |pool: PgPool, msg: Arc<Message>| async move { apply(&pool, &msg).await };
    let consumed = match setting("BROKER", "").as_str() {
        "rabbitmq" => {
            use dedup_runtime::lapin::RabbitMqConsumer;
            let amqp = setting("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
            let queue = setting("EVENTS_QUEUE", "order-events");
            let properties = lapin::ConnectionProperties::default();
            RabbitMqConsumer::new(&amqp, properties, &queue)
                .concurrency(2)
                .run(&pool, handler, stop)
                .await?
        }
        "nats" => {
            use async_nats::jetstream::{self, consumer::pull};
            use dedup_runtime::async_nats::JetStreamConsumer;
            let nats = setting("NATS_URL", "nats://127.0.0.1:4222");
            let js = jetstream::new(async_nats::connect(nats).await?);
            let durable = pull::Config {
                ack_wait: std::time::Duration::from_secs(5),
                ..Default::default()
            };
            JetStreamConsumer::new(js, &setting("EVENTS_STREAM", "ORDERS_EVENTS"), "events")
                .create_with(durable)
                .concurrency(2)
                .run(&pool, handler, stop)
                .await?
        }
        other => return Err(format!("BROKER={other:?}: rabbitmq or nats").into()),
    };
    println!("stopped: {consumed:?}");
    Ok(())
}
