//! The crash harnesses' batch-form service: for `BROKER` (`rabbitmq`, `nats`, `redis`,
//! `mqtt`, `kafka`), the service of `examples/<broker>_consumer.rs` — the same settings,
//! tables, consumer name, outbox and relay — with the consumer's batch form
//! (`run_batches`, up to `BATCH` messages a transaction, 100 by default) in place of the
//! plain one. The harnesses in `tests/consumers/*_crash.rs` kill it as they kill the
//! examples, and check the same database and broker state: the batch form keeps every
//! promise the plain one does. Not an example: the examples are what a user copies.

use std::error::Error;
use std::sync::Arc;

use dedup_runtime::batch::{Batch, BatchHandler};
use dedup_runtime::consume::Message;
use dedup_runtime::outbox::{Cause, Outbox, Publisher};
use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;

type Stop = Shared<BoxFuture<'static, ()>>;
type Relaying = JoinHandle<Result<(), dedup_runtime::outbox::OutboxError>>;

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// One example's service: where its orders go, its consumer's name (its dedup rows' and
/// its events' ids'), its outbox table and where its events go.
struct Service {
    insert: &'static str,
    consumer: &'static str,
    outbox: Outbox,
    events: String,
}

impl BatchHandler<Postgres, Message> for Service {
    type Error = sqlx::Error;

    /// The example's `apply`, for each fresh order of the batch: the order and its
    /// `accepted` event, in the batch's transaction with the dedup rows.
    async fn handle(&self, tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
        for msg in fresh {
            sqlx::query(self.insert)
                .bind(msg.id())
                .bind(msg.payload())
                .execute(&mut *tx)
                .await?;
            let cause = Cause::new(self.consumer, msg.id())?;
            let event = cause.outgoing("accepted", &self.events, msg.payload())?;
            self.outbox.enqueue(&mut *tx, &event).await?;
        }
        Ok(())
    }
}

/// The tables, the relay through `publisher`, and the batch handler the consumer runs.
async fn serve<P: Publisher + 'static>(
    pool: &PgPool,
    orders: &'static str,
    service: Service,
    outbox_table: &str,
    publisher: P,
    stop: &Stop,
) -> Result<(Relaying, BatchFn), Box<dyn Error>> {
    dedup_runtime::migrate(pool).await?;
    dedup_runtime::outbox::migrate_table(pool, outbox_table).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {orders} (message_id text, body bytea)"
    )))
    .execute(pool)
    .await?;
    let relay = service.outbox.relay(pool);
    let until = stop.clone();
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });
    let batch = Arc::new((Batch::new(service.consumer)?, service));
    let handler: BatchFn = Arc::new(move |pool, messages| {
        let batch = batch.clone();
        async move {
            let (batch, service) = &*batch;
            batch.run(&pool, &messages, |msg| msg.id(), service).await
        }
        .boxed()
    });
    Ok((relaying, handler))
}

type BatchResult = Result<dedup_runtime::batch::BatchOutcome<sqlx::Error>, sqlx::Error>;
type BatchFn = Arc<dyn Fn(PgPool, Arc<[Message]>) -> BoxFuture<'static, BatchResult> + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let broker = setting("BROKER", "");
    let max: usize = setting("BATCH", "100").parse()?;
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    let mut term = signal(SignalKind::terminate())?;
    let stop: Stop = async move {
        let _ = term.recv().await;
    }
    .boxed()
    .shared();
    let (relaying, consumed) = match broker.as_str() {
        "rabbitmq" => rabbitmq(&pool, max, &stop).await?,
        "nats" => nats(&pool, max, &stop).await?,
        "redis" => redis(&pool, max, &stop).await?,
        "mqtt" => mqtt(&pool, max, &stop).await?,
        "kafka" => kafka(&pool, max, &stop).await?,
        other => {
            return Err(format!("BROKER={other:?}: rabbitmq, nats, redis, mqtt or kafka").into());
        }
    };
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}

type Ran = (Relaying, dedup_runtime::consume::Consumed);

/// `examples/rabbitmq_consumer.rs`.
async fn rabbitmq(pool: &PgPool, max: usize, stop: &Stop) -> Result<Ran, Box<dyn Error>> {
    use dedup_runtime::lapin::{RabbitMqConsumer, RabbitMqPublisher};
    use lapin::options::QueueDeclareOptions;
    use lapin::{Connection, ConnectionProperties};

    let amqp = setting("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let queue = setting("QUEUE", "orders");
    let events = setting("EVENTS_QUEUE", "order-events");
    let properties = ConnectionProperties::default();
    let setup = Connection::connect(&amqp, properties.clone()).await?;
    let channel = setup.create_channel().await?;
    let durable = QueueDeclareOptions::durable();
    channel
        .queue_declare(events.as_str().into(), durable, Default::default())
        .await?;
    let publisher = RabbitMqPublisher::connect(&amqp, properties.clone(), "").await?;
    let service = Service {
        insert: "INSERT INTO example_orders (message_id, body) VALUES ($1, $2)",
        consumer: "orders",
        outbox: Outbox::new().in_table("orders_outbox")?,
        events,
    };
    let (relaying, handler) = serve(
        pool,
        "example_orders",
        service,
        "orders_outbox",
        publisher,
        stop,
    )
    .await?;
    let consumer = RabbitMqConsumer::new(&amqp, properties, &queue)
        .declare(true)
        .concurrency(4);
    let consumed = consumer
        .run_batches(pool, max, |pool, batch| handler(pool, batch), stop.clone())
        .await?;
    Ok((relaying, consumed))
}

/// `examples/nats_consumer.rs`.
async fn nats(pool: &PgPool, max: usize, stop: &Stop) -> Result<Ran, Box<dyn Error>> {
    use async_nats::jetstream::{self, consumer::pull, stream};
    use dedup_runtime::async_nats::{JetStreamConsumer, JetStreamPublisher};

    let (stream, subject) = (setting("STREAM", "ORDERS"), setting("SUBJECT", "orders"));
    let events = setting("EVENTS_SUBJECT", "order-events");
    let ack_wait = std::time::Duration::from_millis(setting("ACK_WAIT_MS", "30000").parse()?);
    let js =
        jetstream::new(async_nats::connect(setting("NATS_URL", "nats://127.0.0.1:4222")).await?);
    let dead = format!("{subject}.dead");
    for (suffix, subject) in [("", &subject), ("_DEAD", &dead), ("_EVENTS", &events)] {
        let mut config = stream::Config::from(format!("{stream}{suffix}").as_str());
        config.subjects = vec![subject.clone()];
        js.get_or_create_stream(config).await?;
    }
    let service = Service {
        insert: "INSERT INTO example_orders (message_id, body) VALUES ($1, $2)",
        consumer: "nats-orders",
        outbox: Outbox::new().in_table("nats_orders_outbox")?,
        events,
    };
    let publisher = JetStreamPublisher::new(js.clone());
    let (relaying, handler) = serve(
        pool,
        "example_orders",
        service,
        "nats_orders_outbox",
        publisher,
        stop,
    )
    .await?;
    let durable = pull::Config {
        ack_wait,
        max_deliver: 20,
        ..Default::default()
    };
    let consumer = JetStreamConsumer::new(js, &stream, "orders")
        .create_with(durable)
        .concurrency(4);
    let consumed = consumer
        .run_batches(pool, max, |pool, batch| handler(pool, batch), stop.clone())
        .await?;
    Ok((relaying, consumed))
}

/// `examples/redis_consumer.rs`.
async fn redis(pool: &PgPool, max: usize, stop: &Stop) -> Result<Ran, Box<dyn Error>> {
    use dedup_runtime::redis::{RedisStreamsConsumer, RedisStreamsPublisher};

    let client = redis::Client::open(setting("REDIS_URL", "redis://127.0.0.1:6379"))?;
    let (stream, group, member) = (
        setting("STREAM", "orders"),
        setting("GROUP", "orders"),
        setting("MEMBER", "orders-0"),
    );
    let table = setting("OUTBOX_TABLE", "outbox_messages");
    let service = Service {
        insert: "INSERT INTO example_orders (message_id, body) VALUES ($1, $2)",
        consumer: "orders",
        outbox: Outbox::new().in_table(&table)?,
        events: setting("EVENTS_STREAM", "order-events"),
    };
    let publisher = RedisStreamsPublisher::new(client.clone());
    let (relaying, handler) =
        serve(pool, "example_orders", service, &table, publisher, stop).await?;
    let consumer = RedisStreamsConsumer::new(client, &stream, &group, &member);
    let consumed = consumer
        .run_batches(pool, max, |pool, batch| handler(pool, batch), stop.clone())
        .await?;
    Ok((relaying, consumed))
}

/// `examples/mqtt_consumer.rs`.
async fn mqtt(pool: &PgPool, max: usize, stop: &Stop) -> Result<Ran, Box<dyn Error>> {
    use dedup_runtime::rumqttc::{MqttConsumer, MqttPublisher};
    use rumqttc::v5::MqttOptions;

    let (host, port): (String, u16) = (
        setting("MQTT_HOST", "127.0.0.1"),
        setting("MQTT_PORT", "1883").parse()?,
    );
    let topic = setting("TOPIC", "orders");
    let client_id = setting("CLIENT_ID", "orders-consumer");
    let service = Service {
        insert: "INSERT INTO example_mqtt_orders (message_id, body) VALUES ($1, $2)",
        consumer: "mqtt-orders",
        outbox: Outbox::new().in_table("mqtt_orders_outbox")?,
        events: setting("EVENTS_TOPIC", "order-events"),
    };
    let relay_id = format!("{client_id}-relay");
    let publisher = MqttPublisher::new(MqttOptions::new(relay_id, &host, port));
    let (relaying, handler) = serve(
        pool,
        "example_mqtt_orders",
        service,
        "mqtt_orders_outbox",
        publisher,
        stop,
    )
    .await?;
    let consumer = MqttConsumer::new(MqttOptions::new(client_id, &host, port), &topic);
    let consumed = consumer
        .run_batches(pool, max, |pool, batch| handler(pool, batch), stop.clone())
        .await?;
    Ok((relaying, consumed))
}

/// `examples/kafka_consumer.rs`.
async fn kafka(pool: &PgPool, max: usize, stop: &Stop) -> Result<Ran, Box<dyn Error>> {
    use dedup_runtime::lapin::RabbitMqPublisher;
    use dedup_runtime::rdkafka::KafkaConsumer;
    use lapin::{ConnectionProperties as Amqp, options::QueueDeclareOptions as Declare};

    let amqp = setting("AMQP_URL", "amqp://127.0.0.1:5672");
    let queue = setting("EVENTS_QUEUE", "order-events");
    let connection = lapin::Connection::connect(&amqp, Amqp::default()).await?;
    let (declare, options) = (connection.create_channel().await?, Declare::durable());
    declare
        .queue_declare(queue.as_str().into(), options, Default::default())
        .await?;
    let publisher = RabbitMqPublisher::connect(&amqp, Amqp::default(), "").await?;
    let service = Service {
        insert: "INSERT INTO kafka_orders (message_id, body) VALUES ($1, $2)",
        consumer: "kafka-orders",
        outbox: Outbox::new().in_table("kafka_orders_outbox")?,
        events: queue,
    };
    let (relaying, handler) = serve(
        pool,
        "kafka_orders",
        service,
        "kafka_orders_outbox",
        publisher,
        stop,
    )
    .await?;
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", "127.0.0.1:9092");
    config.set("group.id", "orders");
    for (name, value) in std::env::vars().filter(|(name, _)| name.starts_with("KAFKA_")) {
        config.set(name[6..].to_lowercase().replace('_', "."), value);
    }
    let consumer = KafkaConsumer::new(config, &setting("TOPIC", "orders"))
        .offsets_in_database(setting("OFFSETS", "kafka") == "database");
    let consumed = consumer
        .run_batches(pool, max, |pool, batch| handler(pool, batch), stop.clone())
        .await?;
    Ok((relaying, consumed))
}
