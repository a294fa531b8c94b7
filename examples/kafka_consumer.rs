//! Kafka → PostgreSQL + outbox → RabbitMQ: each order (id: header `id`) applied once whatever
//! Kafka redelivers or the process dies, an `accepted` event per order; SIGTERM stops it.
//! `KAFKA_<NAME>` is librdkafka's `<name>` (`KAFKA_BOOTSTRAP_SERVERS`, `KAFKA_GROUP_ID`);
//! `TOPIC` (dead letters: `<topic>.dead`), `OFFSETS=database` (offsets kept in the database
//! too), `DATABASE_URL`, `AMQP_URL`, `EVENTS_QUEUE`.

use dedup_runtime::consume::Message;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::{idempotent, lapin::RabbitMqPublisher, rdkafka::KafkaConsumer};
use futures_util::FutureExt as _;
use lapin::{ConnectionProperties as Amqp, options::QueueDeclareOptions as Declare};
use sqlx::{PgConnection, PgPool};
use std::sync::Arc;
use tokio::signal::unix::{SignalKind, signal};

const CONSUMER: &str = "kafka-orders"; // the attribute's and the `Cause`'s
const OUTBOX: &str = "kafka_orders_outbox"; // the service's own outbox table
const ORDERS: &str = "CREATE TABLE IF NOT EXISTS kafka_orders (message_id text, body bytea)";
type Events = (Outbox, String); // the outbox, and the queue its events go to

/// Applies an order and enqueues its event, in one transaction with the dedup record.
#[idempotent(consumer = CONSUMER, key = msg.id())]
async fn apply(tx: &mut PgConnection, msg: &Message, to: &Events) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO kafka_orders (message_id, body) VALUES ($1, $2)")
        .bind(msg.id())
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new(CONSUMER, msg.id())?;
    to.0.enqueue(&mut *tx, &cause.outgoing("accepted", &to.1, msg.payload())?)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let setting = |name: &str, or: &str| std::env::var(name).unwrap_or_else(|_| or.to_owned());
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, OUTBOX).await?;
    sqlx::raw_sql(ORDERS).execute(&pool).await?;
    let mut term = signal(SignalKind::terminate())?; // SIGTERM or Ctrl-C: finish, then stop
    let ctrl_c = tokio::signal::ctrl_c();
    let stop = async move {
        tokio::select! { _ = term.recv() => {}, _ = ctrl_c => {} }
    };
    let stop = stop.boxed().shared();

    // The relay: events to their RabbitMQ queue (declared), through the default exchange.
    let amqp = setting("AMQP_URL", "amqp://127.0.0.1:5672");
    let queue = setting("EVENTS_QUEUE", "order-events");
    let connection = lapin::Connection::connect(&amqp, Amqp::default()).await?;
    let (declare, options) = (connection.create_channel().await?, Declare::durable());
    let declared = declare.queue_declare(queue.as_str().into(), options, Default::default());
    declared.await?;
    let publisher = RabbitMqPublisher::connect(&amqp, Amqp::default(), "").await?;
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let (relay, until) = (outbox.relay(&pool), stop.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });
    // The consumer: orders from Kafka, as a member of the group `orders` by default.
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", "127.0.0.1:9092");
    config.set("group.id", "orders");
    for (name, value) in std::env::vars().filter(|(name, _)| name.starts_with("KAFKA_")) {
        config.set(name[6..].to_lowercase().replace('_', "."), value);
    }
    let events = Arc::new((outbox, queue));
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let events = events.clone();
        async move { apply(&pool, &msg, &events).await }
    };
    let consumer = KafkaConsumer::new(config, &setting("TOPIC", "orders"))
        .offsets_in_database(setting("OFFSETS", "kafka") == "database");
    let consumed = consumer.run(&pool, handler, stop).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
