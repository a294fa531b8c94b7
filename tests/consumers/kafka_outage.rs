//! The Kafka consumer while its broker is taken away twice in the middle of a run: a
//! tansu of the test's own behind a proxy (`Outage`) that closes every connection and
//! refuses new ones for two seconds. librdkafka reconnects by itself; the consumer must
//! lose nothing, apply nothing twice, spend no record an attempt (no retry, no dead
//! letter) and, once the broker is back, commit every offset.

use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::rdkafka::KafkaConsumer;
use dedup_suite::outage::{Outage, free_port};
use dedup_suite::tansu::Tansu;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::common::{count, until};

const RECORDS: usize = 300;
const PARTITIONS: i32 = 3;

#[dedup_runtime::idempotent(consumer = "kafka-outage", key = msg.id())]
async fn apply(tx: &mut sqlx::PgConnection, msg: &Message, run: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO kafka_outage_effects (run, message_id) VALUES ($1, $2)")
        .bind(run)
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn committed(brokers: &str, group: &str, topic: &str) -> Vec<i64> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        list.add_partition(topic, partition);
    }
    match reader.committed_offsets(list, Duration::from_secs(5)) {
        Ok(list) => list
            .elements()
            .iter()
            .map(|element| match element.offset() {
                Offset::Offset(offset) => offset,
                _ => -1,
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_gone_twice_loses_nothing_and_doubles_nothing() {
    let (port, advertised) = (free_port(), free_port());
    let _broker = Tansu::start(port, advertised);
    let proxy = Outage::start_on(advertised, &format!("127.0.0.1:{port}")).await;
    let brokers = format!("127.0.0.1:{advertised}");
    let pool = dedup_suite::postgres().await;
    dedup_runtime::migrate(&pool).await.unwrap();
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS kafka_outage_effects (run text NOT NULL, message_id text NOT NULL)",
    )
    .await;
    let run = dedup_suite::unique("run");
    let topic = dedup_suite::unique("kafka-outage");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    admin
        .create_topics(
            [&NewTopic::new(
                &topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    let mut ends = vec![0; PARTITIONS as usize];
    for n in 0..RECORDS {
        let id = format!("{run}-{n}");
        let partition = (n as i32) % PARTITIONS;
        let headers = OwnedHeaders::new().insert(Header {
            key: "id",
            value: Some(&id),
        });
        let delivery = producer
            .send(
                FutureRecord::<str, str>::to(&topic)
                    .partition(partition)
                    .payload("body")
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        ends[partition as usize] = delivery.offset + 1;
    }

    let group = dedup_suite::unique("group");
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("session.timeout.ms", "10000")
        .set("reconnect.backoff.ms", "50")
        .set("reconnect.backoff.max.ms", "500");
    let consumer = KafkaConsumer::new(config, &topic).commit_interval(Duration::from_millis(200));
    let sql = "SELECT COUNT(*) FROM kafka_outage_effects WHERE run = $1";
    let db: &sqlx::PgPool = &pool;
    let slow = |pool: sqlx::PgPool, msg: Arc<Message>| {
        let run = run.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            apply(&pool, &msg, &run).await
        }
    };
    let outages = async {
        for at in [60, 180] {
            until(|| async { count(db, sql, &run).await >= at }).await;
            proxy.cut();
            tokio::time::sleep(Duration::from_secs(2)).await;
            proxy.restore();
        }
        until(|| async {
            count(db, sql, &run).await == RECORDS as i64
                && committed(&brokers, &group, &topic) == ends
        })
        .await;
    };
    let consumed = consumer.run(db, slow, outages).await.unwrap();
    println!("{consumed:?}");
    assert_eq!(count(db, sql, &run).await, RECORDS as i64);
    let distinct = "SELECT COUNT(DISTINCT message_id) FROM kafka_outage_effects WHERE run = $1";
    assert_eq!(count(db, distinct, &run).await, RECORDS as i64, "each once");
    for n in (0..RECORDS).step_by(7) {
        let id = format!("{run}-{n}");
        assert_eq!(
            dedup_suite::claims(db, "kafka-outage", &id).await,
            1,
            "{id}"
        );
    }
    assert_eq!(
        committed(&brokers, &group, &topic),
        ends,
        "every offset committed"
    );
    assert_eq!(
        (consumed.retried, consumed.dead_lettered),
        (0, 0),
        "no attempt spent: {consumed:?}"
    );
    assert!(consumed.acknowledged >= RECORDS as u64, "{consumed:?}");
}
