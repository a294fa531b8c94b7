//! Issue 39, item 2: after a broker restart or a cut connection the RabbitMQ publisher
//! ("invalid channel state") and the Redis Streams publisher ("broken pipe") failed every
//! later claim: `Relay::run` went on, and every outgoing row was buried dead after its
//! attempts although nothing was wrong with any message. Now every publisher connects
//! again, and a failure for the broker's absence (`Publisher::unreachable`) costs no
//! attempt: the claim goes back, `run` waits, and claims again.
//!
//! Each test runs a relay (`Relay::run`, claims of 10, 3 attempts, a 1 ms backoff: a row
//! charged for the outage would be dead within milliseconds) over 200 rows, takes the
//! broker away in the middle of the run for 1.5 s — a proxy between the publisher and the
//! broker closes every connection and refuses new ones, as a restart does — and gives it
//! back. Then every row is sent, none dead, each sent at its first attempt, and the
//! broker holds every id. The figures are printed (`--nocapture`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use dedup_runtime::outbox::{Cause, Outbox, Publisher};
use dedup_suite::outage::Outage;

const ROWS: u32 = 200;
const OUTAGE: Duration = Duration::from_millis(1500);
const PATIENCE: Duration = Duration::from_secs(60);

/// What the run did, printed for the note.
#[derive(Debug)]
#[allow(dead_code)]
struct Figures {
    /// Rows sent when the broker was taken away.
    sent_before: i64,
    /// Rows sent when it came back.
    sent_during: i64,
    sent: i64,
    dead: i64,
    /// The most attempts any row took.
    max_attempts: i64,
}

/// The rows' state counts in `db`.
async fn counts(db: &sqlx::SqlitePool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT COALESCE(SUM(state = 2), 0), COALESCE(SUM(state = 3), 0), \
         COALESCE(MAX(attempts), 0) FROM outbox_messages",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

/// Enqueues [`ROWS`] rows to `destination`, runs a relay through `publisher`, takes the
/// broker away behind `proxy` once the first rows are sent, gives it back, and waits
/// until every row is sent (or one is dead). The ids, and the figures.
async fn through_an_outage<P: Publisher + 'static>(
    publisher: P,
    proxy: &Outage,
    destination: &str,
) -> (BTreeSet<String>, Figures) {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("regress-outage", dedup_suite::unique("evt")).unwrap();
    let mut ids = BTreeSet::new();
    let mut tx = db.begin().await.unwrap();
    for slot in 0..ROWS {
        let payload = format!("row {slot}");
        let message = cause.nth_outgoing(slot, destination, payload.as_bytes());
        outbox.enqueue(&mut *tx, &message).await.unwrap();
        ids.insert(message.id().to_string());
    }
    tx.commit().await.unwrap();

    let relay = outbox
        .relay(&*db)
        .batch(10)
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .poll_interval(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(&publisher, async {
                let _ = stopped.await;
            })
            .await
    });
    let started = Instant::now();
    let sent_before = loop {
        let (sent, _, _) = counts(&db).await;
        if sent >= 20 {
            break sent;
        }
        assert!(started.elapsed() < PATIENCE, "the relay sent nothing");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    proxy.cut();
    tokio::time::sleep(OUTAGE).await;
    let (sent_during, _, _) = counts(&db).await;
    proxy.restore();
    let back = Instant::now();
    let (sent, dead, max_attempts) = loop {
        let (sent, dead, attempts) = counts(&db).await;
        if sent + dead == i64::from(ROWS) || back.elapsed() > PATIENCE {
            break (sent, dead, attempts);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    let figures = Figures {
        sent_before,
        sent_during,
        sent,
        dead,
        max_attempts,
    };
    println!("{destination}: {figures:?}");
    assert!(
        sent_during < i64::from(ROWS),
        "the outage came in the middle of the run: {figures:?}"
    );
    let errors: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT last_error FROM outbox_messages WHERE last_error IS NOT NULL",
    )
    .fetch_all(&*db)
    .await
    .unwrap();
    assert_eq!(
        (sent, dead, max_attempts),
        (i64::from(ROWS), 0, 1),
        "every row sent once the broker was back, none dead, each at its first attempt \
         (errors kept: {errors:?})"
    );
    (ids, figures)
}

mod rabbitmq {
    use super::*;
    use dedup_runtime::lapin::RabbitMqPublisher;
    use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publisher_connects_again_and_the_outage_costs_no_attempt() {
        let proxy = Outage::start("127.0.0.1:5672").await;
        let direct = Connection::connect(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            ConnectionProperties::default(),
        )
        .await
        .expect("RabbitMQ on 127.0.0.1:5672");
        let setup = direct.create_channel().await.unwrap();
        let queue = dedup_suite::unique("regress-outage");
        setup
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
        let publisher = RabbitMqPublisher::connect(&url, ConnectionProperties::default(), "")
            .await
            .unwrap();
        let (ids, _) = through_an_outage(publisher, &proxy, &queue).await;
        let mut received = BTreeSet::new();
        while let Some(message) = setup
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            received.insert(message.properties.message_id().clone().unwrap().to_string());
        }
        assert_eq!(received, ids, "the queue holds every row");
        setup
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
}

mod redis_streams {
    use super::*;
    use dedup_runtime::redis::RedisStreamsPublisher;

    /// An entry's fields, name and bytes.
    type Fields = Vec<(String, Vec<u8>)>;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publisher_connects_again_and_the_outage_costs_no_attempt() {
        let proxy = Outage::start("127.0.0.1:6379").await;
        let stream = dedup_suite::unique("regress-outage");
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port())).unwrap();
        let publisher = RedisStreamsPublisher::new(client);
        let (ids, _) = through_an_outage(publisher, &proxy, &stream).await;
        let direct = redis::Client::open("redis://127.0.0.1:6379").unwrap();
        let mut connection = direct.get_multiplexed_async_connection().await.unwrap();
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut connection)
            .await
            .unwrap();
        let received: BTreeSet<String> = entries
            .iter()
            .flat_map(|(_, fields)| fields.iter().filter(|(name, _)| name == "id"))
            .map(|(_, id)| String::from_utf8(id.clone()).unwrap())
            .collect();
        assert_eq!(received, ids, "the stream holds every row");
        let _: i64 = redis::cmd("DEL")
            .arg(&stream)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}

mod jetstream {
    use super::*;
    use async_nats::jetstream::{self, stream};
    use dedup_runtime::async_nats::JetStreamPublisher;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publisher_connects_again_and_the_outage_costs_no_attempt() {
        let proxy = Outage::start("127.0.0.1:4222").await;
        let direct = jetstream::new(
            async_nats::connect("nats://127.0.0.1:4222")
                .await
                .expect("NATS on 127.0.0.1:4222"),
        );
        let run = dedup_suite::unique("outage").replace('-', "_");
        let (name, subject) = (format!("REGRESS_{run}"), format!("regress.{run}"));
        let mut stream = direct
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        let client = async_nats::connect(format!("nats://127.0.0.1:{}", proxy.port()))
            .await
            .unwrap();
        let publisher =
            JetStreamPublisher::new(jetstream::new(client)).ack_timeout(Duration::from_secs(1));
        let (ids, _) = through_an_outage(publisher, &proxy, &subject).await;
        let last = stream.info().await.unwrap().state.last_sequence;
        let mut received = BTreeSet::new();
        for sequence in 1..=last {
            let message = stream.get_raw_message(sequence).await.unwrap();
            received.insert(message.headers.get("Message-Id").unwrap().to_string());
        }
        assert_eq!(received, ids, "the stream holds every row");
        direct.delete_stream(&name).await.unwrap();
    }
}

mod mqtt {
    use super::*;
    use dedup_runtime::rumqttc::MqttPublisher;
    use dedup_suite::mosquitto::Mosquitto;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publisher_connects_again_and_the_outage_costs_no_attempt() {
        let broker = Mosquitto::start(&dedup_suite::unique("regress-outage"), "");
        let proxy = Outage::start(&format!("127.0.0.1:{}", broker.port())).await;
        let topic = dedup_suite::unique("regress-outage/mqtt");
        // A subscriber straight to the broker, not through the proxy: it sees what the
        // broker received.
        let options = MqttOptions::new(dedup_suite::unique("sub"), "127.0.0.1", broker.port());
        let (client, mut events) = AsyncClient::new(options, 64);
        client.subscribe(&topic, QoS::AtLeastOnce).await.unwrap();
        loop {
            let event = tokio::time::timeout(PATIENCE, events.poll()).await;
            if let Ok(Ok(Event::Incoming(Packet::SubAck(_)))) = event {
                break;
            }
            assert!(event.is_ok_and(|event| event.is_ok()), "the subscriber");
        }
        let received = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
        let receiving = tokio::spawn({
            let received = received.clone();
            async move {
                let _client = client;
                while let Ok(event) = events.poll().await {
                    if let Event::Incoming(Packet::Publish(publish)) = event {
                        let properties = publish.properties.unwrap_or_default();
                        let (_, id) = properties
                            .user_properties
                            .into_iter()
                            .find(|(name, _)| name == "message-id")
                            .expect("the id's user property");
                        received.lock().unwrap().insert(id);
                    }
                }
            }
        });
        let options = MqttOptions::new(dedup_suite::unique("relay"), "127.0.0.1", proxy.port());
        let publisher = MqttPublisher::new(options);
        let (ids, _) = through_an_outage(publisher, &proxy, &topic).await;
        let arrived = Instant::now();
        while *received.lock().unwrap() != ids {
            assert!(arrived.elapsed() < PATIENCE, "the subscriber got every row");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        receiving.abort();
    }
}

mod kafka {
    use super::*;
    use dedup_runtime::rdkafka::KafkaPublisher;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};

    use dedup_suite::tansu::Tansu;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_publisher_connects_again_and_the_outage_costs_no_attempt() {
        let (port, advertised) = (
            dedup_suite::outage::free_port(),
            dedup_suite::outage::free_port(),
        );
        let _broker = Tansu::start(port, advertised);
        let proxy = Outage::start_on(advertised, &format!("127.0.0.1:{port}")).await;
        let brokers = format!("127.0.0.1:{advertised}");
        let topic = dedup_suite::unique("regress-outage");
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .unwrap();
        admin
            .create_topics(
                &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .unwrap();
        let mut config = KafkaPublisher::producer_config(&brokers);
        config
            .set("message.timeout.ms", "1000")
            .set("batch.num.messages", "1")
            .set("linger.ms", "0");
        let publisher = KafkaPublisher::new(config).unwrap();
        let (ids, _) = through_an_outage(publisher, &proxy, &topic).await;
        let consumer: StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", dedup_suite::unique("regress-outage"))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut partitions = rdkafka::TopicPartitionList::new();
        partitions
            .add_partition_offset(&topic, 0, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&partitions).unwrap();
        let mut received = BTreeSet::new();
        while received != ids {
            let message = tokio::time::timeout(PATIENCE, consumer.recv())
                .await
                .unwrap_or_else(|_| panic!("{} of {} ids on {topic}", received.len(), ids.len()))
                .unwrap();
            let id = message
                .headers()
                .and_then(|headers| headers.iter().find(|header| header.key == "id"))
                .and_then(|header| header.value)
                .map(|value| String::from_utf8(value.to_vec()).unwrap())
                .unwrap();
            received.insert(id);
        }
    }
}
