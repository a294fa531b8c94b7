//! The consumers group: `cargo bench --bench dedup --features brokers -- consumers` (and,
//! tiny, in the smoke run). Each hosted consumer against the same consumer written by
//! hand with the same client, on PostgreSQL: `messages` (2,000; for batches ten times
//! that) fresh messages are published untimed to each side's destination of its own,
//! then both sides run **at once**, each taking all of its own; each side's rate is the
//! messages it committed while both ran — from the later of the two first commits
//! (connecting, and Kafka's join of its group, are not the per-message cost) until the
//! earlier of the two last ones. Run one after the other, the two sides met different
//! moments of the machine, and a side's rate moved by ±20 % from run to run; run
//! together they meet the same load. Each side runs in a task of its own, and each has
//! a dedup table of its own, emptied (`TRUNCATE`) before every run. In every round each
//! (broker, form) once, in an order that turns with the round, and which side starts
//! first turns too. Messages per second, the median over the rounds; the ratio is the
//! median of the rounds' ratios.
//!
//! The work is the same on both sides: per message a dedup row (with its time, indexed,
//! for pruning) and an effect row in one transaction, then the broker's acknowledgement after the commit. The library's side is
//! an `#[idempotent]` handler (the plain form, one message a transaction) or an
//! `#[idempotent(batch = …)]` one (`run_batches`, up to 100 a transaction: one claim
//! statement, one multi-row insert); the hand-written side is the loop an expert writes
//! with the same client — for the plain form `BEGIN`, `INSERT … ON CONFLICT DO NOTHING`
//! into a dedup table of its own, the effect, `COMMIT`, acknowledge; for batches one
//! `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING RETURNING`, the effects of the
//! fresh ones in one statement, `COMMIT`, the acknowledgements:
//!
//! - RabbitMQ (lapin): a prefetch of 16 (plain) or 100 (batches), `basic.ack` per message
//!   (batches: one `multiple` ack of the last);
//! - NATS JetStream (async-nats): pulls of 16 (plain) or 100 (batches), a confirmed
//!   `+ACK` per message (batches: all sent, then all awaited);
//! - Redis Streams (redis): `XREADGROUP COUNT 16` (plain) or 100, `XACK` per entry
//!   (batches: one `XACK`);
//! - Kafka (rdkafka, the suite's tansu on `DEDUP_TEST_KAFKA_BROKERS`, one partition): a
//!   `StreamConsumer` of a group of its own, offsets stored after the commit and committed
//!   by librdkafka every 5 s (`enable.auto.offset.store = false`); batches: what has come
//!   when the last one ended, up to 100, the last offset stored (the time to join the
//!   group is in both sides' figure);
//! - MQTT 5 (rumqttc, a Mosquitto of the bench's own: the machine's keeps at most 1,000
//!   messages for an offline session): a persistent session, QoS 1, manual `PUBACK` per
//!   message after the commit (batches: what has come, up to 100, then the `PUBACK`s in
//!   order).
//!
//! `DEDUP_BENCH_CONSUMERS=kafka,batches` runs only the brokers and forms it names (a
//! comma-separated list; a kind it names none of runs whole).
//!
//! `target/dedup-bench/consumers.csv`:
//! `broker,form,library_per_s,handwritten_per_s,ratio_vs_handwritten`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dedup_runtime::consume::Message;
use futures_util::{FutureExt as _, StreamExt as _};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

use crate::Error;

/// Messages per transaction in the batch form.
const BATCH: usize = 100;

#[dedup_runtime::idempotent(
    consumer = "bench-consumer",
    key = msg.id(),
    table = "dedup_bench_consumer_processed"
)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO dedup_bench_consumer_effects (message_id) VALUES ($1)")
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[dedup_runtime::idempotent(
    consumer = "bench-consumer",
    batch = fresh,
    key = |msg| msg.id(),
    table = "dedup_bench_consumer_processed"
)]
async fn apply_batch(tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = fresh.iter().map(|msg| msg.id()).collect();
    sqlx::query(
        "INSERT INTO dedup_bench_consumer_effects (message_id) SELECT * FROM unnest($1::text[])",
    )
    .bind(&ids)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The hand-written transaction of one message.
async fn by_hand(pool: &PgPool, id: &str) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(
        "INSERT INTO dedup_bench_consumer_dedup (consumer, message_id) VALUES ('bench', $1) \
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if fresh {
        sqlx::query("INSERT INTO dedup_bench_consumer_effects (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// The hand-written transaction of a batch.
async fn by_hand_batch(pool: &PgPool, ids: &[String]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let fresh: Vec<String> = sqlx::query_scalar(
        "INSERT INTO dedup_bench_consumer_dedup (consumer, message_id) \
         SELECT 'bench', * FROM unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING message_id",
    )
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO dedup_bench_consumer_effects (message_id) SELECT * FROM unnest($1::text[])",
    )
    .bind(&fresh)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Broker {
    RabbitMq,
    JetStream,
    Redis,
    Kafka,
    Mqtt,
}

impl Broker {
    const ALL: [Broker; 5] = [
        Broker::RabbitMq,
        Broker::JetStream,
        Broker::Redis,
        Broker::Kafka,
        Broker::Mqtt,
    ];

    fn name(self) -> &'static str {
        match self {
            Broker::RabbitMq => "rabbitmq",
            Broker::JetStream => "jetstream",
            Broker::Redis => "redis",
            Broker::Kafka => "kafka",
            Broker::Mqtt => "mqtt",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Form {
    Plain,
    Batches,
}

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Plain => "plain",
            Form::Batches => "batches",
        }
    }

    /// What the consumer holds ahead: the library's default for the plain form, the
    /// batch for batches.
    fn ahead(self) -> usize {
        match self {
            Form::Plain => 16,
            Form::Batches => BATCH,
        }
    }
}

/// Whether `name` (a broker's or a form's) is in `DEDUP_BENCH_CONSUMERS`, a
/// comma-separated list such as `kafka,batches`; everything when it is unset. A list
/// naming no broker (or no form) keeps all of them.
fn chosen(name: &str) -> bool {
    let Ok(list) = std::env::var("DEDUP_BENCH_CONSUMERS") else {
        return true;
    };
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    let brokers = Broker::ALL.map(Broker::name);
    let forms = [Form::Plain.name(), Form::Batches.name()];
    let kind: &[&str] = if brokers.contains(&name) {
        &brokers
    } else {
        &forms
    };
    names.contains(&name) || !names.iter().any(|listed| kind.contains(listed))
}

/// One side's consumer until `progress` has all its messages; when it had.
async fn run_side(
    clients: &Clients,
    pg: &PgPool,
    broker: Broker,
    form: Form,
    library_side: bool,
    name: &str,
    progress: Progress,
) -> Result<Instant, Error> {
    let timed = async {
        progress.all().await;
        Instant::now()
    };
    let work = async {
        if library_side {
            library(clients, pg, broker, form, name, &progress).await
        } else {
            hand(clients, pg, broker, form, name, &progress).await
        }
    };
    let (ended, worked) = tokio::join!(timed, work);
    worked.map(|()| ended)
}

/// Counts the messages committed; `all` completes when `messages` are.
#[derive(Clone)]
struct Progress {
    done: Arc<AtomicUsize>,
    notify: Arc<Notify>,
    messages: usize,
    /// When the first commit was counted, and how many messages it had.
    first: Arc<std::sync::OnceLock<(Instant, usize)>>,
}

impl Progress {
    fn new(messages: usize) -> Self {
        Progress {
            done: Arc::default(),
            notify: Arc::default(),
            messages,
            first: Arc::default(),
        }
    }

    fn add(&self, n: usize) {
        let _ = self.first.set((Instant::now(), n));
        if self.done.fetch_add(n, Ordering::Relaxed) + n >= self.messages {
            self.notify.notify_one();
        }
    }

    async fn all(&self) {
        while self.done.load(Ordering::Relaxed) < self.messages {
            let notified = self.notify.notified();
            if self.done.load(Ordering::Relaxed) >= self.messages {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
        }
    }
}

/// The brokers' clients.
struct Clients {
    amqp: String,
    channel: lapin::Channel,
    _connection: lapin::Connection,
    js: async_nats::jetstream::Context,
    redis: redis::Client,
    kafka: String,
    mosquitto: dedup_suite::mosquitto::Mosquitto,
}

/// The Kafka client configuration of the bench's broker.
fn kafka_config(brokers: &str) -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    config
}

/// A Kafka consumer's configuration: a group of its own, short session intervals.
fn kafka_member(brokers: &str, group: &str) -> rdkafka::ClientConfig {
    let mut config = kafka_config(brokers);
    config
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("auto.offset.reset", "earliest");
    config
}

/// The options of the MQTT session `client_id` on the bench's Mosquitto.
fn mqtt_options(port: u16, client_id: &str) -> rumqttc::v5::MqttOptions {
    rumqttc::v5::MqttOptions::new(client_id, "127.0.0.1", port)
}

impl Clients {
    async fn connect() -> Result<Clients, Error> {
        let amqp = std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let connection =
            lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        let nats = std::env::var("DEDUP_TEST_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let js = async_nats::jetstream::new(async_nats::connect(nats).await?);
        let redis = redis::Client::open(
            std::env::var("DEDUP_TEST_REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
        )?;
        let kafka = std::env::var("DEDUP_TEST_KAFKA_BROKERS")
            .unwrap_or_else(|_| "127.0.0.1:19092".to_owned());
        let mosquitto = dedup_suite::mosquitto::Mosquitto::start("bench-consumers", "");
        Ok(Clients {
            amqp,
            channel,
            _connection: connection,
            js,
            redis,
            kafka,
            mosquitto,
        })
    }

    /// A destination of its own holding `ids`, published untimed.
    async fn fill(&self, broker: Broker, name: &str, ids: &[String]) -> Result<(), Error> {
        match broker {
            Broker::RabbitMq => {
                self.channel
                    .queue_declare(
                        name.into(),
                        lapin::options::QueueDeclareOptions::default(),
                        Default::default(),
                    )
                    .await?;
                let mut confirms = Vec::with_capacity(ids.len());
                for id in ids {
                    let properties =
                        lapin::BasicProperties::default().with_message_id(id.as_str().into());
                    confirms.push(
                        self.channel
                            .basic_publish(
                                "".into(),
                                name.into(),
                                Default::default(),
                                b"body",
                                properties,
                            )
                            .await?,
                    );
                }
                for confirm in confirms {
                    confirm.await?;
                }
            }
            Broker::JetStream => {
                let mut config = async_nats::jetstream::stream::Config::from(name);
                config.subjects = vec![format!("{name}.in")];
                let stream = self.js.create_stream(config).await?;
                stream
                    .create_consumer(async_nats::jetstream::consumer::pull::Config {
                        durable_name: Some("bench".to_owned()),
                        ..Default::default()
                    })
                    .await?;
                // Acknowledgements awaited 500 at a time: async-nats holds back a publish
                // while too many are in flight, and only awaiting them frees it.
                for chunk in ids.chunks(500) {
                    let mut acks = Vec::with_capacity(chunk.len());
                    for id in chunk {
                        let mut headers = async_nats::HeaderMap::new();
                        headers.insert("Message-Id", id.as_str());
                        acks.push(
                            self.js
                                .publish_with_headers(format!("{name}.in"), headers, "body".into())
                                .await?,
                        );
                    }
                    for ack in acks {
                        ack.await?;
                    }
                }
            }
            Broker::Redis => {
                let mut redis = self.redis.get_multiplexed_async_connection().await?;
                let () = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(name)
                    .arg("bench")
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut redis)
                    .await?;
                let mut pipeline = redis::pipe();
                for id in ids {
                    pipeline
                        .cmd("XADD")
                        .arg(name)
                        .arg("*")
                        .arg("id")
                        .arg(id)
                        .arg("body")
                        .arg("body")
                        .ignore();
                }
                let () = pipeline.query_async(&mut redis).await?;
            }
            Broker::Kafka => {
                use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
                use rdkafka::message::{Header, OwnedHeaders};
                use rdkafka::producer::{FutureProducer, FutureRecord};
                let admin: AdminClient<rdkafka::client::DefaultClientContext> =
                    kafka_config(&self.kafka).create()?;
                let topic = NewTopic::new(name, 1, TopicReplication::Fixed(1));
                for created in admin.create_topics([&topic], &AdminOptions::new()).await? {
                    created.map_err(|(topic, code)| format!("create {topic}: {code}"))?;
                }
                let producer: FutureProducer = kafka_config(&self.kafka).create()?;
                let sends = ids.iter().map(|id| {
                    let headers = OwnedHeaders::new().insert(Header {
                        key: "id",
                        value: Some(id.as_str()),
                    });
                    producer.send(
                        FutureRecord::<str, str>::to(name)
                            .payload("body")
                            .headers(headers),
                        Duration::from_secs(30),
                    )
                });
                for sent in futures_util::future::join_all(sends).await {
                    sent.map_err(|(error, _)| error)?;
                }
            }
            Broker::Mqtt => {
                use dedup_suite::mosquitto::{publish, session, wire};
                let port = self.mosquitto.port();
                session(port, name, name).await;
                let messages: Vec<_> = ids.iter().map(|id| wire(Some(id), b"body")).collect();
                publish(port, name, &messages).await;
            }
        }
        Ok(())
    }

    /// Removes the destination.
    async fn drop_destination(&self, broker: Broker, name: &str) -> Result<(), Error> {
        match broker {
            Broker::RabbitMq => {
                self.channel
                    .queue_delete(name.into(), Default::default())
                    .await?;
            }
            Broker::JetStream => {
                self.js.delete_stream(name).await?;
            }
            Broker::Redis => {
                let mut redis = self.redis.get_multiplexed_async_connection().await?;
                let _: i64 = redis::cmd("DEL").arg(name).query_async(&mut redis).await?;
            }
            Broker::Kafka => {
                use rdkafka::admin::{AdminClient, AdminOptions};
                let admin: AdminClient<rdkafka::client::DefaultClientContext> =
                    kafka_config(&self.kafka).create()?;
                let _ = admin.delete_topics(&[name], &AdminOptions::new()).await?;
            }
            // The session goes with the bench's Mosquitto.
            Broker::Mqtt => {}
        }
        Ok(())
    }
}

/// The library's consumer of `name`, until `progress` is complete.
async fn library(
    clients: &Clients,
    pool: &PgPool,
    broker: Broker,
    form: Form,
    name: &str,
    progress: &Progress,
) -> Result<(), Error> {
    let plain = {
        let progress = progress.clone();
        move |pool: PgPool, msg: Arc<Message>| {
            let progress = progress.clone();
            async move {
                let outcome = apply(&pool, &msg).await;
                if outcome.is_ok() {
                    progress.add(1);
                }
                outcome
            }
        }
    };
    let batches = {
        let progress = progress.clone();
        move |pool: PgPool, batch: Arc<[Message]>| {
            let progress = progress.clone();
            async move {
                let outcome = apply_batch(&pool, &batch).await;
                if let Ok(settled) = &outcome {
                    progress.add((0..batch.len()).filter(|&n| settled.ack(n)).count());
                }
                outcome
            }
        }
    };
    let stop = progress.all();
    // Every consumer's two forms have the same signatures, on types of their own.
    macro_rules! run {
        ($consumer:expr) => {
            match form {
                Form::Plain => $consumer.run(pool, plain, stop).await.map(drop)?,
                Form::Batches => $consumer
                    .run_batches(pool, BATCH, batches, stop)
                    .await
                    .map(drop)?,
            }
        };
    }
    match broker {
        Broker::RabbitMq => {
            use dedup_runtime::lapin::RabbitMqConsumer;
            let properties = lapin::ConnectionProperties::default();
            let consumer = RabbitMqConsumer::new(&clients.amqp, properties, name);
            run!(consumer);
        }
        Broker::JetStream => {
            use dedup_runtime::async_nats::JetStreamConsumer;
            let consumer = JetStreamConsumer::new(clients.js.clone(), name, "bench");
            run!(consumer);
        }
        Broker::Redis => {
            use dedup_runtime::redis::RedisStreamsConsumer;
            let consumer = RedisStreamsConsumer::new(clients.redis.clone(), name, "bench", "m");
            run!(consumer);
        }
        Broker::Kafka => {
            use dedup_runtime::rdkafka::KafkaConsumer;
            let consumer = KafkaConsumer::new(kafka_member(&clients.kafka, name), name);
            run!(consumer);
        }
        Broker::Mqtt => {
            use dedup_runtime::rumqttc::MqttConsumer;
            let options = mqtt_options(clients.mosquitto.port(), name);
            let consumer = MqttConsumer::new(options, name);
            run!(consumer);
        }
    }
    Ok(())
}

/// The same consumer written by hand, until `progress` is complete.
async fn hand(
    clients: &Clients,
    pool: &PgPool,
    broker: Broker,
    form: Form,
    name: &str,
    progress: &Progress,
) -> Result<(), Error> {
    let max = form.ahead();
    let mut work = std::pin::pin!(async {
        match broker {
            Broker::RabbitMq => hand_rabbitmq(clients, pool, form, name, progress).await,
            Broker::JetStream => hand_jetstream(clients, pool, max, name, progress, form).await,
            Broker::Redis => hand_redis(clients, pool, max, name, progress, form).await,
            Broker::Kafka => hand_kafka(clients, pool, name, progress, form).await,
            Broker::Mqtt => hand_mqtt(clients, pool, name, progress, form).await,
        }
    });
    // The loops run until stopped: the progress says when.
    tokio::select! {
        done = &mut work => done,
        () = progress.all() => Ok(()),
    }
}

async fn hand_rabbitmq(
    clients: &Clients,
    pool: &PgPool,
    form: Form,
    name: &str,
    progress: &Progress,
) -> Result<(), Error> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let connection =
        lapin::Connection::connect(&clients.amqp, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(form.ahead() as u16, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            name.into(),
            "".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await?;
    while let Some(first) = deliveries.next().await {
        let first = first?;
        match form {
            Form::Plain => {
                let id = message_id(&first);
                by_hand(pool, &id).await?;
                first.ack(BasicAckOptions::default()).await?;
                progress.add(1);
            }
            Form::Batches => {
                let mut batch = vec![first];
                while batch.len() < BATCH {
                    match deliveries.next().now_or_never() {
                        Some(Some(delivery)) => batch.push(delivery?),
                        _ => break,
                    }
                }
                let ids: Vec<String> = batch.iter().map(message_id).collect();
                by_hand_batch(pool, &ids).await?;
                let last = batch.last().expect("one at least");
                last.ack(BasicAckOptions { multiple: true }).await?;
                progress.add(batch.len());
            }
        }
    }
    Ok(())
}

fn message_id(delivery: &lapin::message::Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default()
}

async fn hand_jetstream(
    clients: &Clients,
    pool: &PgPool,
    max: usize,
    name: &str,
    progress: &Progress,
    form: Form,
) -> Result<(), Error> {
    let stream = clients.js.get_stream(name).await?;
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("bench").await?;
    let id_of = |message: &async_nats::jetstream::Message| {
        message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Message-Id"))
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default()
    };
    loop {
        let mut pulled = consumer
            .batch()
            .max_messages(max)
            .expires(Duration::from_secs(1))
            .messages()
            .await?;
        match form {
            Form::Plain => {
                while let Some(message) = pulled.next().await {
                    let message = message?;
                    by_hand(pool, &id_of(&message)).await?;
                    message.double_ack().await?;
                    progress.add(1);
                }
            }
            Form::Batches => {
                let mut batch = Vec::with_capacity(max);
                while let Some(message) = pulled.next().await {
                    batch.push(message?);
                    while batch.len() < max {
                        match pulled.next().now_or_never() {
                            Some(Some(message)) => batch.push(message?),
                            _ => break,
                        }
                    }
                    let ids: Vec<String> = batch.iter().map(id_of).collect();
                    by_hand_batch(pool, &ids).await?;
                    let acks = batch.iter().map(|message| message.double_ack());
                    for acked in futures_util::future::join_all(acks).await {
                        acked?;
                    }
                    progress.add(batch.len());
                    batch.clear();
                }
            }
        }
    }
}

async fn hand_redis(
    clients: &Clients,
    pool: &PgPool,
    max: usize,
    name: &str,
    progress: &Progress,
    form: Form,
) -> Result<(), Error> {
    let mut redis = clients.redis.get_multiplexed_async_connection().await?;
    loop {
        let reply: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("bench")
            .arg("m")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(1000)
            .arg("STREAMS")
            .arg(name)
            .arg(">")
            .query_async(&mut redis)
            .await?;
        let entries = entries(&reply);
        match form {
            Form::Plain => {
                for (entry, id) in &entries {
                    by_hand(pool, id).await?;
                    let _: i64 = redis::cmd("XACK")
                        .arg(name)
                        .arg("bench")
                        .arg(entry)
                        .query_async(&mut redis)
                        .await?;
                    progress.add(1);
                }
            }
            Form::Batches if !entries.is_empty() => {
                let ids: Vec<String> = entries.iter().map(|(_, id)| id.clone()).collect();
                by_hand_batch(pool, &ids).await?;
                let mut ack = redis::cmd("XACK");
                ack.arg(name).arg("bench");
                for (entry, _) in &entries {
                    ack.arg(entry);
                }
                let _: i64 = ack.query_async(&mut redis).await?;
                progress.add(entries.len());
            }
            Form::Batches => {}
        }
    }
}

async fn hand_kafka(
    clients: &Clients,
    pool: &PgPool,
    name: &str,
    progress: &Progress,
    form: Form,
) -> Result<(), Error> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{Consumer as _, StreamConsumer};
    let mut config = kafka_member(&clients.kafka, name);
    config.set("enable.auto.offset.store", "false");
    let consumer: StreamConsumer = config.create()?;
    consumer.subscribe(&[name])?;
    let id_of = |message: &rdkafka::message::BorrowedMessage<'_>| {
        use rdkafka::message::Headers as _;
        message
            .headers()
            .and_then(|headers| headers.iter().find(|header| header.key == "id"))
            .and_then(|header| header.value)
            .map(|value| String::from_utf8_lossy(value).into_owned())
            .unwrap_or_default()
    };
    loop {
        let first = consumer.recv().await?;
        match form {
            Form::Plain => {
                by_hand(pool, &id_of(&first)).await?;
                consumer.store_offset_from_message(&first)?;
                progress.add(1);
            }
            Form::Batches => {
                let mut ids = vec![id_of(&first)];
                let mut last = first;
                while ids.len() < BATCH {
                    match consumer.recv().now_or_never() {
                        Some(next) => {
                            let next = next?;
                            ids.push(id_of(&next));
                            last = next;
                        }
                        None => break,
                    }
                }
                by_hand_batch(pool, &ids).await?;
                consumer.store_offset_from_message(&last)?;
                progress.add(ids.len());
            }
        }
    }
}

async fn hand_mqtt(
    clients: &Clients,
    pool: &PgPool,
    name: &str,
    progress: &Progress,
    form: Form,
) -> Result<(), Error> {
    use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
    use rumqttc::v5::{AsyncClient, Event};
    let mut options = mqtt_options(clients.mosquitto.port(), name);
    options
        .set_clean_start(false)
        .set_session_expiry_interval(Some(u32::MAX))
        .set_manual_acks(true)
        .set_max_packet_size(Some(1 << 20));
    let (client, mut events) = AsyncClient::new(options, 256);
    let (tell, mut publishes) = tokio::sync::mpsc::unbounded_channel::<Publish>();
    /// Stops the event loop's task however the loop below ends (dropped when the
    /// progress is complete, too).
    struct Poller(tokio::task::JoinHandle<()>);
    impl Drop for Poller {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    // The event loop polled all the time, on a task of its own; the messages to this one.
    let _poller = Poller(tokio::spawn(async move {
        while let Ok(event) = events.poll().await {
            if let Event::Incoming(Packet::Publish(publish)) = event
                && tell.send(publish).is_err()
            {
                return;
            }
        }
    }));
    let id_of = |publish: &Publish| {
        publish
            .properties
            .iter()
            .flat_map(|properties| &properties.user_properties)
            .find(|(key, _)| key == "message-id")
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    while let Some(first) = publishes.recv().await {
        match form {
            Form::Plain => {
                by_hand(pool, &id_of(&first)).await?;
                client.ack(&first).await?;
                progress.add(1);
            }
            Form::Batches => {
                let mut batch = vec![first];
                while batch.len() < BATCH {
                    match publishes.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let ids: Vec<String> = batch.iter().map(id_of).collect();
                by_hand_batch(pool, &ids).await?;
                for publish in &batch {
                    client.ack(publish).await?;
                }
                progress.add(batch.len());
            }
        }
    }
    Ok(())
}

/// The entries of an `XREADGROUP` reply: (entry id, the field `id`).
fn entries(reply: &redis::Value) -> Vec<(String, String)> {
    use redis::Value;
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(text) => text.clone(),
        _ => String::new(),
    };
    let mut found = Vec::new();
    let streams = match reply {
        Value::Array(streams) => streams.as_slice(),
        Value::Map(pairs) => {
            for (_, entries) in pairs {
                collect(entries, &text, &mut found);
            }
            return found;
        }
        _ => return found,
    };
    for stream in streams {
        if let Value::Array(pair) = stream
            && let [_, entries] = pair.as_slice()
        {
            collect(entries, &text, &mut found);
        }
    }
    found
}

fn collect(
    entries: &redis::Value,
    text: &impl Fn(&redis::Value) -> String,
    found: &mut Vec<(String, String)>,
) {
    use redis::Value;
    let Value::Array(entries) = entries else {
        return;
    };
    for entry in entries {
        if let Value::Array(pair) = entry
            && let [entry, Value::Array(fields)] = pair.as_slice()
        {
            let id = fields
                .chunks_exact(2)
                .find(|field| text(&field[0]) == "id")
                .map(|field| text(&field[1]))
                .unwrap_or_default();
            found.push((text(entry), id));
        }
    }
}

type Key = (&'static str, &'static str, bool);

/// A side's task: its result once it ends; aborted when dropped (the other side failed).
struct Spawned(tokio::task::JoinHandle<Result<Instant, Error>>);

impl std::future::Future for Spawned {
    type Output = Result<Instant, Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(context)
            .map(|joined| joined.map_err(Error::from).and_then(|ended| ended))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the group: `rounds` interleaved rounds of `messages` each; writes `consumers.csv`.
pub(crate) async fn run(
    pg: &PgPool,
    dir: &Path,
    rounds: usize,
    messages: usize,
) -> Result<(), Error> {
    // The hand-written dedup table is one that can be pruned, as the library's: the time
    // of each row, indexed. (A table of ids alone, the first form of this group, was
    // an index less per message than the work compared.)
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS dedup_bench_consumer_effects (message_id text NOT NULL); \
         DROP TABLE IF EXISTS dedup_bench_consumer_dedup; \
         CREATE TABLE dedup_bench_consumer_dedup (consumer text NOT NULL, \
         message_id text NOT NULL, processed_at timestamptz NOT NULL DEFAULT clock_timestamp(), \
         PRIMARY KEY (consumer, message_id)); \
         CREATE INDEX ON dedup_bench_consumer_dedup (processed_at)",
    )
    .execute(pg)
    .await?;
    dedup_runtime::migrate(pg).await?;
    dedup_runtime::migrate_table(pg, "dedup_bench_consumer_processed").await?;
    let clients = Arc::new(Clients::connect().await?);
    let mut samples: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
    let mut run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_micros());
    for round in 0..rounds {
        let mut plan = Vec::new();
        for broker in Broker::ALL
            .into_iter()
            .filter(|broker| chosen(broker.name()))
        {
            for form in [Form::Plain, Form::Batches] {
                if chosen(form.name()) {
                    plan.push((broker, form));
                }
            }
        }
        let turn = round % plan.len();
        plan.rotate_left(turn);
        for (broker, form) in plan {
            // Batches of 100 get ten times the messages: 2,000 would be 20 batches.
            let messages = match form {
                Form::Plain => messages,
                Form::Batches => messages * 10,
            };
            // Each side its own destination, filled untimed; ids that say whose they are.
            let mut sides = Vec::new();
            for library_side in [true, false] {
                run_id += 1;
                let name = format!("dedup-bench-consumer-{run_id}");
                let ids: Vec<String> = (0..messages).map(|n| format!("{run_id}-{n}")).collect();
                clients.fill(broker, &name, &ids).await?;
                sides.push((library_side, name, run_id, Progress::new(messages)));
            }
            // Untimed: the tables as every run finds them — each side's dedup table
            // empty. (The library's rows deleted from `processed_messages` instead left
            // their dead tuples there: after a few runs the library's claim cost a
            // third more than the hand-written one in its truncated table.)
            sqlx::raw_sql(
                "TRUNCATE dedup_bench_consumer_effects, dedup_bench_consumer_dedup, \
                 dedup_bench_consumer_processed",
            )
            .execute(pg)
            .await?;
            // Both sides at once, so that both meet the same load at the same moment
            // (the machine's drift moved the sequential runs by ±20 %); which starts first
            // turns with the round.
            if round % 2 == 1 {
                sides.reverse();
            }
            let started = Instant::now();
            // Each side a task of its own on the runtime's workers: in one task (a join)
            // the side polled first was polled first at every wake-up, and the side that
            // started second measured up to a fifth slower, whichever it was.
            let side = |k: usize| {
                let (library_side, name, _, progress) = &sides[k];
                let (clients, pg, name) = (clients.clone(), pg.clone(), name.clone());
                let (library_side, progress) = (*library_side, progress.clone());
                Spawned(tokio::spawn(async move {
                    run_side(&clients, &pg, broker, form, library_side, &name, progress).await
                }))
            };
            let (first, second) = (side(0), side(1));
            // Each side's count, every millisecond, until it has all its messages or the
            // run ended (a side that failed never will).
            let over = AtomicBool::new(false);
            let watch = |progress: Progress| {
                let over = &over;
                async move {
                    let mut ended = Vec::new();
                    loop {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        let done = progress.done.load(Ordering::Relaxed);
                        ended.push((Instant::now(), done));
                        if done >= progress.messages || over.load(Ordering::Relaxed) {
                            return ended;
                        }
                    }
                }
            };
            let runs = async {
                let ended = futures_util::future::try_join(first, second).await;
                over.store(true, Ordering::Relaxed);
                ended
            };
            let (ended, watched) = tokio::join!(
                runs,
                futures_util::future::join(watch(sides[0].3.clone()), watch(sides[1].3.clone()))
            );
            let (end_0, end_1) = ended?;
            // The window in which both ran: from the later first commit (the connection,
            // and Kafka's join of its group, are not the per-message cost) to the earlier
            // end; each side's rate is what it committed within it.
            let firsts: Vec<Instant> = sides
                .iter()
                .map(|side| side.3.first.get().expect("a commit was counted").0)
                .collect();
            let (from, until) = (firsts[0].max(firsts[1]), end_0.min(end_1));
            for (k, (library_side, name, id, _)) in sides.iter().enumerate() {
                let effects: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM dedup_bench_consumer_effects WHERE message_id LIKE $1",
                )
                .bind(format!("{id}-%"))
                .fetch_one(pg)
                .await?;
                if effects != messages as i64 {
                    return Err(format!(
                        "{} {} {}: {effects} effects for {messages} messages",
                        broker.name(),
                        form.name(),
                        if *library_side { "library" } else { "by hand" }
                    )
                    .into());
                }
                clients.drop_destination(broker, name).await?;
                let seen = if k == 0 { &watched.0 } else { &watched.1 };
                // What this side had committed at `at` (sampled every millisecond).
                let done_at = |at: Instant| {
                    seen.iter()
                        .take_while(|(when, _)| *when <= at)
                        .last()
                        .map_or(0, |(_, done)| *done)
                };
                let (done_from, done_until) = (done_at(from), done_at(until));
                // (In the smoke run a side may finish in its first commit: the whole run.)
                let rate = if until > from && done_until > done_from {
                    (done_until - done_from) as f64 / (until - from).as_secs_f64()
                } else {
                    messages as f64 / (until.max(from) - started).as_secs_f64()
                };
                println!(
                    "consumers round {round}: {:<9} {:<7} {:<8} {rate:>8.0} messages/s",
                    broker.name(),
                    form.name(),
                    if *library_side { "library" } else { "by hand" }
                );
                samples
                    .entry((broker.name(), form.name(), *library_side))
                    .or_default()
                    .push(rate);
            }
        }
    }
    let median = |key: &Key| {
        samples
            .get(key)
            .map_or(f64::NAN, |values| crate::report::median(values.clone()))
    };
    let mut csv =
        String::from("broker,form,library_per_s,handwritten_per_s,ratio_vs_handwritten\n");
    println!(
        "\nconsumers (messages per second, median of {rounds} rounds; ratio: the median of \
         the rounds' ratios)"
    );
    println!(
        "{:<10} {:<8} {:>10} {:>10} {:>7}",
        "broker", "form", "library", "by hand", "ratio"
    );
    for broker in Broker::ALL
        .into_iter()
        .filter(|broker| chosen(broker.name()))
    {
        for form in [Form::Plain, Form::Batches]
            .into_iter()
            .filter(|form| chosen(form.name()))
        {
            let library = median(&(broker.name(), form.name(), true));
            let hand = median(&(broker.name(), form.name(), false));
            // The median of the rounds' ratios: the two sides of a round ran together.
            let paired = |side: bool| samples.get(&(broker.name(), form.name(), side));
            let ratio = match (paired(true), paired(false)) {
                (Some(library), Some(hand)) => {
                    crate::report::median(library.iter().zip(hand).map(|(l, h)| l / h).collect())
                }
                _ => f64::NAN,
            };
            println!(
                "{:<10} {:<8} {library:>10.0} {hand:>10.0} {ratio:>7.3}",
                broker.name(),
                form.name()
            );
            csv.push_str(&format!(
                "{},{},{library:.0},{hand:.0},{ratio:.3}\n",
                broker.name(),
                form.name()
            ));
        }
    }
    std::fs::write(dir.join("consumers.csv"), csv)?;
    Ok(())
}
