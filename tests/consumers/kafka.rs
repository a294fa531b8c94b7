//! `dedup_runtime::rdkafka::KafkaConsumer` against a real Kafka-protocol broker (tansu in
//! CI, at `DEDUP_TEST_KAFKA_BROKERS`, 127.0.0.1:19092 by default), on PostgreSQL, MariaDB
//! and SQLite: what it commits, what it dead-letters and in what order it applies.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_runtime::AckPolicy;
use dedup_runtime::consume::{Consumed, Message};
use dedup_runtime::rdkafka::{ConsumeError, KafkaConsumer, MessageIdFrom, provenance};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::common::{count, fails_first_time, fails_permanently, until};

pub(crate) fn brokers() -> String {
    std::env::var("DEDUP_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".to_owned())
}

/// A client configuration for the test's broker.
pub(crate) fn client() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers());
    config
}

/// The configuration a consumer of `group` is given: short session and poll intervals,
/// so that a rebalance is over in seconds.
pub(crate) fn member(group: &str) -> ClientConfig {
    let mut config = client();
    config
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("max.poll.interval.ms", "15000");
    config
}

/// Creates `topic` with `partitions` partitions.
pub(crate) async fn topic(topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = client().create().expect("admin client");
    let created = admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap_or_else(|error| {
            panic!(
                "no Kafka-protocol broker answers at {} ({error}); .ci/run starts tansu",
                brokers()
            )
        });
    for result in created {
        result.unwrap_or_else(|(topic, code)| panic!("create {topic}: {code}"));
    }
}

/// One record to publish: partition, id header (none when `None`), payload.
pub(crate) type Record<'a> = (i32, Option<&'a str>, &'a [u8]);

/// Publishes `records` in order, each with its id in the header `id` and a header
/// `trace-id: t-1`, acknowledged by the broker; returns each partition's end (the offset
/// after its last record).
pub(crate) async fn publish(topic: &str, records: &[Record<'_>]) -> BTreeMap<i32, i64> {
    let producer: FutureProducer = client().set("acks", "all").create().expect("a producer");
    let mut ends = BTreeMap::new();
    for &(partition, id, payload) in records {
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "trace-id",
            value: Some("t-1"),
        });
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: "id",
                value: Some(id),
            });
        }
        let record = FutureRecord::<str, [u8]>::to(topic)
            .partition(partition)
            .key(id.unwrap_or("no-id"))
            .payload(payload)
            .headers(headers);
        let (partition, offset) = producer
            .send(record, Duration::from_secs(10))
            .await
            .map(|delivery| (delivery.partition, delivery.offset))
            .unwrap_or_else(|(error, _)| panic!("produce to {topic}: {error}"));
        let end = ends.entry(partition).or_insert(0);
        *end = (*end).max(offset + 1);
    }
    ends
}

/// `group`'s committed offsets of `topic`'s `partitions` (`-1`: none).
pub(crate) fn committed(group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, i64> {
    let reader: BaseConsumer = client().set("group.id", group).create().unwrap();
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition(topic, partition);
    }
    let committed = reader
        .committed_offsets(list, Duration::from_secs(10))
        .expect("committed offsets");
    committed
        .elements()
        .iter()
        .map(|element| {
            let offset = match element.offset() {
                Offset::Offset(offset) => offset,
                _ => -1,
            };
            (element.partition(), offset)
        })
        .collect()
}

/// A record of the dead topic: partition, key, payload, headers.
pub(crate) type Dead = (i32, Vec<u8>, Vec<u8>, HashMap<String, Vec<u8>>);

/// Every record of `topic`'s `partitions`, read from the start.
pub(crate) fn read_all(topic: &str, partitions: i32, expected: usize) -> Vec<Dead> {
    let reader: BaseConsumer = client()
        .set("group.id", dedup_suite::unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap();
    }
    reader.assign(&list).unwrap();
    let mut found = Vec::new();
    let started = std::time::Instant::now();
    // Until `expected` came, then half a second more: anything more would be a copy
    // too many.
    let mut complete: Option<std::time::Instant> = None;
    while complete.is_none_or(|at| at.elapsed() < Duration::from_millis(500))
        && started.elapsed() < Duration::from_secs(20)
    {
        if let Some(Ok(record)) = reader.poll(Duration::from_millis(100)) {
            let headers = record
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                        .collect()
                })
                .unwrap_or_default();
            found.push((
                record.partition(),
                record.key().unwrap_or_default().to_vec(),
                record.payload().unwrap_or_default().to_vec(),
                headers,
            ));
        }
        if complete.is_none() && found.len() >= expected {
            complete = Some(std::time::Instant::now());
        }
    }
    found
}

fn never() -> impl Fn(
    sqlx::SqlitePool,
    Arc<Message>,
) -> std::future::Ready<Result<dedup_runtime::Outcome<()>, sqlx::Error>> {
    |_, _| panic!("no record is handled")
}

/// No `group.id`, no topic, a dead topic narrower than the topic: each refused at start,
/// with its own error, and nothing consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_without_a_group_a_topic_or_a_wide_enough_dead_topic() {
    let pool = dedup_suite::sqlite().await;
    let name = dedup_suite::unique("kafka-refuse");
    topic(&name, 3).await;
    topic(&format!("{name}.narrow"), 2).await;

    let error = KafkaConsumer::new(client(), &name)
        .run(&*pool, never(), std::future::pending())
        .await
        .expect_err("no group");
    assert!(matches!(error, ConsumeError::NoGroup), "{error}");
    assert!(error.to_string().contains("group.id"), "{error}");

    let error = KafkaConsumer::new(member("g"), &format!("{name}.missing"))
        .run(&*pool, never(), std::future::pending())
        .await
        .expect_err("no topic");
    assert!(matches!(error, ConsumeError::NoTopic(_)), "{error}");

    let error = KafkaConsumer::new(member("g"), &name)
        .with_dead_topic(&format!("{name}.narrow"))
        .run(&*pool, never(), std::future::pending())
        .await
        .expect_err("a narrow dead topic");
    assert!(
        matches!(
            error,
            ConsumeError::DeadTopic {
                partitions: 2,
                needed: 3,
                ..
            }
        ),
        "{error}"
    );

    // Offsets in the database with the batch form: refused, and no table made for it.
    let never_batch = |pool: sqlx::SqlitePool, batch: Arc<[Message]>| async move {
        never_applied(&pool, &batch).await
    };
    let error = KafkaConsumer::new(member("g"), &name)
        .offsets_in_database(true)
        .run_batches(&*pool, 10, never_batch, std::future::pending())
        .await
        .expect_err("offsets in the database, in batches");
    assert!(matches!(error, ConsumeError::OffsetsInBatches), "{error}");
    assert!(error.to_string().contains("run_batches"), "{error}");
}

/// The refusal test's batch handler: never called.
#[dedup_runtime::idempotent(consumer = "never", batch = fresh, key = |msg| msg.id())]
async fn never_applied(
    tx: &mut sqlx::SqliteConnection,
    fresh: &[&Message],
) -> Result<(), sqlx::Error> {
    let _ = (tx, fresh);
    unreachable!("no batch is handled")
}

/// Ids from the key (`MessageIdFrom::Key`) and, by default, from the last header `id`
/// of a record that has two; the handler sees every header, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_id_comes_from_where_it_is_told() {
    let pool = dedup_suite::sqlite().await;
    let name = dedup_suite::unique("kafka-ids");
    topic(&name, 1).await;
    let producer: FutureProducer = client().create().unwrap();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "id",
            value: Some("first"),
        })
        .insert(Header {
            key: "id",
            value: Some("last"),
        });
    producer
        .send(
            FutureRecord::<str, str>::to(&name)
                .key("the-key")
                .payload("body")
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    for (from, expected) in [
        (MessageIdFrom::Header("id".to_owned()), "last"),
        (MessageIdFrom::Key, "the-key"),
    ] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = {
            let seen = seen.clone();
            move |_: sqlx::SqlitePool, msg: Arc<Message>| {
                let headers: Vec<(String, Vec<u8>)> = msg
                    .headers()
                    .map(|(name, value)| (name.to_owned(), value.to_vec()))
                    .collect();
                seen.lock().unwrap().push((msg.id().to_owned(), headers));
                async { Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(())) }
            }
        };
        let consumer =
            KafkaConsumer::new(member(&dedup_suite::unique("ids")), &name).message_id(from);
        let done = until(|| async { !seen.lock().unwrap().is_empty() });
        consumer.run(&*pool, record, done).await.unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0].0, expected);
        assert_eq!(
            seen[0].1,
            [
                ("id".to_owned(), b"first".to_vec()),
                ("id".to_owned(), b"last".to_vec())
            ]
        );
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     effects = $effects:literal, insert = $insert:literal,
     count = $count:literal, distinct = $distinct:literal) => {
        mod $backend {
            use super::*;

            const CONSUMER: &str = "kafka-hosted";

            /// The effect: one row per record, no unique constraint (a record applied
            /// twice would show as two rows), in the dedup record's transaction.
            #[dedup_runtime::idempotent(consumer = "kafka-hosted", key = msg.id())]
            async fn apply(tx: &mut $conn, msg: &Message, run: &str) -> Result<(), sqlx::Error> {
                if fails_permanently(msg) {
                    return Err(sqlx::Error::Protocol("a poison\nmessage".into()));
                }
                if fails_first_time(msg) {
                    return Err(sqlx::Error::PoolTimedOut);
                }
                sqlx::query($insert)
                    .bind(run)
                    .bind(msg.id())
                    .bind(msg.header("trace-id").unwrap_or_default())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// The batch form of `apply`: the run is the id's prefix (a batch handler
            /// takes its connection and its messages, nothing else).
            #[dedup_runtime::idempotent(consumer = "kafka-batches", batch = fresh, key = |msg| msg.id())]
            async fn apply_batch(tx: &mut $conn, fresh: &[&Message]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    if fails_permanently(msg) {
                        return Err(sqlx::Error::Protocol("a poison message".into()));
                    }
                    if fails_first_time(msg) {
                        return Err(sqlx::Error::PoolTimedOut);
                    }
                    let run = msg.id().rsplit_once('-').map_or("", |(run, _)| run);
                    sqlx::query($insert)
                        .bind(run)
                        .bind(msg.id())
                        .bind(msg.header("trace-id").unwrap_or_default())
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            }

            async fn setup() -> (impl std::ops::Deref<Target = sqlx::Pool<$db>>, String) {
                let pool = $pool;
                dedup_runtime::migrate(&*pool).await.unwrap();
                dedup_suite::ddl(&*pool, $effects).await;
                (pool, dedup_suite::unique("run"))
            }

            /// Three partitions: each record processed once and its offset committed
            /// after its commit, copies found duplicates, a transient failure retried
            /// in place with the records after it in its partition waiting, a poison
            /// record and one without an id dead-lettered to the same partition of the
            /// dead topic with key, payload, headers and provenance; the group's offsets
            /// at every partition's end.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn settles_after_commit_retries_in_order_and_dead_letters() {
                let (pool, run) = setup().await;
                let name = dedup_suite::unique("kafka-hosted");
                let group = dedup_suite::unique("group");
                topic(&name, 3).await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                let (flaky, poison) = (format!("{run}-flaky"), format!("{run}-poison"));
                let mut records: Vec<Record<'_>> = Vec::new();
                for (n, id) in ids.iter().enumerate() {
                    records.push(((n % 3) as i32, Some(id), b"body"));
                    if n == 4 {
                        // In partition 1, before ids 7, 10, …: they wait for its retry.
                        records.push((1, Some(&flaky), b"flaky"));
                    }
                }
                for (n, id) in ids.iter().enumerate().step_by(3) {
                    records.push(((n % 3) as i32, Some(id), b"body")); // a copy
                }
                records.push((2, Some(&poison), b"poison"));
                records.push((0, None, b"no id"));
                let ends = publish(&name, &records).await;

                let order = Arc::new(Mutex::new(Vec::new()));
                let consumer = KafkaConsumer::new(member(&group), &name);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let handler = {
                    let (run, order) = (run.clone(), order.clone());
                    move |pool: sqlx::Pool<$db>, msg: Arc<Message>| {
                        let (run, order) = (run.clone(), order.clone());
                        async move {
                            let result = apply(&pool, &msg, &run).await;
                            if result.is_ok() {
                                order.lock().unwrap().push(msg.id().to_owned());
                            }
                            result
                        }
                    }
                };
                let done = until(|| async {
                    count(db, $count, &run).await == 31 && committed(&group, &name, 3) == ends
                });
                let consumed: Consumed =
                    consumer.run_with(db, &policy, handler, done).await.unwrap();

                assert_eq!(
                    count(db, $count, &run).await,
                    31,
                    "30 ids and the flaky one"
                );
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(dedup_suite::claims(db, CONSUMER, &poison).await, 0);
                assert_eq!(committed(&group, &name, 3), ends, "every offset committed");
                // Partition 1's records after the flaky one were applied after it.
                let order = order.lock().unwrap();
                let at = |id: &str| order.iter().position(|seen| seen == id).unwrap();
                for n in (7..30).step_by(3) {
                    assert!(at(&flaky) < at(&ids[n]), "{} before the flaky one", ids[n]);
                }
                let mut dead = read_all(&format!("{name}.dead"), 3, 2);
                dead.sort_by(|a, b| a.0.cmp(&b.0));
                assert_eq!(dead.len(), 2, "two dead letters, once each");
                let (partition, key, payload, headers) = &dead[0];
                assert_eq!(
                    (*partition, &key[..], &payload[..]),
                    (0, &b"no-id"[..], &b"no id"[..])
                );
                assert_eq!(
                    headers.get("trace-id").map(Vec::as_slice),
                    Some(&b"t-1"[..])
                );
                assert!(
                    headers.contains_key(provenance::ERROR),
                    "an empty id: refused"
                );
                let (partition, key, payload, headers) = &dead[1];
                assert_eq!(
                    (*partition, &key[..], &payload[..]),
                    (2, poison.as_bytes(), &b"poison"[..])
                );
                let header = |name: &str| String::from_utf8(headers[name].clone()).unwrap();
                assert_eq!(header(provenance::TOPIC), name);
                assert_eq!(header(provenance::PARTITION), "2");
                assert_eq!(header(provenance::OFFSET), (ends[&2] - 1).to_string());
                assert_eq!(header(provenance::GROUP), group);
                assert_eq!(header(provenance::ATTEMPTS), "1");
                assert_eq!(
                    header(provenance::ERROR),
                    "encountered unexpected or invalid data: a poison message",
                    "its line break made a space"
                );
                assert!(header(provenance::ERROR_CLASS).contains("Error"));
                assert!(header(provenance::TIMESTAMP).parse::<i64>().unwrap() > 0);
                assert_eq!(header("id"), poison);
                assert_eq!(
                    (
                        consumed.acknowledged,
                        consumed.retried,
                        consumed.dead_lettered
                    ),
                    (41, 1, 2),
                    "{consumed:?}"
                );
            }

            /// Offsets in the database: each partition's row written in the handlers'
            /// transactions (the poison record, rolled back, does not move it); then,
            /// with the group's Kafka offsets reset to 0, a second run starts each
            /// partition at its stored offset, and reads only what was not committed.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn offsets_in_the_database_are_written_with_the_work() {
                let (pool, run) = setup().await;
                let name = dedup_suite::unique("kafka-offsets");
                let group = dedup_suite::unique("group");
                topic(&name, 2).await;
                let ids: Vec<String> = (0..10).map(|n| format!("{run}-{n}")).collect();
                let mut records: Vec<Record<'_>> = ids
                    .iter()
                    .enumerate()
                    .map(|(n, id)| ((n % 2) as i32, Some(id.as_str()), &b"body"[..]))
                    .collect();
                let poison = format!("{run}-poison");
                records.push((1, Some(&poison), b"poison"));
                let ends = publish(&name, &records).await;
                let db: &sqlx::Pool<$db> = &pool;
                let calls = Arc::new(Mutex::new(Vec::new()));
                let handler = {
                    let (run, calls) = (run.clone(), calls.clone());
                    move |pool: sqlx::Pool<$db>, msg: Arc<Message>| {
                        calls.lock().unwrap().push(msg.id().to_owned());
                        let run = run.clone();
                        async move { apply(&pool, &msg, &run).await }
                    }
                };
                let consumer = KafkaConsumer::new(member(&group), &name).offsets_in_database(true);
                let done = until(|| async {
                    count(db, $count, &run).await == 10 && committed(&group, &name, 2) == ends
                });
                let first = consumer.run(db, handler.clone(), done).await.unwrap();
                assert_eq!((first.acknowledged, first.dead_lettered), (10, 1), "{first:?}");
                let stored = |partition: i32| {
                    let sql = format!(
                        "SELECT COALESCE(MAX(next_offset), -1) FROM dedup_kafka_offsets \
                         WHERE consumer_group = '{group}' AND topic = '{name}' \
                         AND partition_id = {partition}"
                    );
                    dedup_suite::TestDatabase::count(db, sql, Vec::new())
                };
                assert_eq!(stored(0).await, ends[&0], "partition 0: after its last record");
                assert_eq!(
                    stored(1).await,
                    ends[&1] - 1,
                    "partition 1: after its last committed record, not after the poison one"
                );

                // The group's Kafka offsets lost: reset to 0.
                let reset: rdkafka::consumer::BaseConsumer =
                    client().set("group.id", &group).create().unwrap();
                let mut zero = TopicPartitionList::new();
                for partition in 0..2 {
                    zero.add_partition_offset(&name, partition, Offset::Offset(0)).unwrap();
                }
                reset
                    .commit(&zero, rdkafka::consumer::CommitMode::Sync)
                    .expect("offsets reset");
                assert_eq!(committed(&group, &name, 2), BTreeMap::from([(0, 0), (1, 0)]));
                calls.lock().unwrap().clear();
                let done = until(|| async { committed(&group, &name, 2) == ends });
                let second = consumer.run(db, handler, done).await.unwrap();
                assert_eq!(
                    *calls.lock().unwrap(),
                    std::slice::from_ref(&poison),
                    "only the record after the stored offsets: {second:?}"
                );
                assert_eq!(count(db, $count, &run).await, 10, "nothing applied twice");
            }

            /// The batch form (`run_batches`, up to 8 records a call): the same records
            /// as above, each settled as its item says — processed or copies
            /// acknowledged, the flaky one retried, the poison one and the one without
            /// an id dead-lettered — and every offset committed.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_settle_each_record_as_its_item_says() {
                let (pool, run) = setup().await;
                let name = dedup_suite::unique("kafka-batches");
                let group = dedup_suite::unique("group");
                topic(&name, 3).await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                let (flaky, poison) = (format!("{run}-flaky"), format!("{run}-poison"));
                let mut records: Vec<Record<'_>> = Vec::new();
                for (n, id) in ids.iter().enumerate() {
                    records.push(((n % 3) as i32, Some(id), b"body"));
                    if n == 4 {
                        records.push((1, Some(&flaky), b"flaky"));
                        records.push((1, Some(&poison), b"poison"));
                    }
                }
                for (n, id) in ids.iter().enumerate().step_by(3) {
                    records.push(((n % 3) as i32, Some(id), b"body")); // a copy
                }
                records.push((0, None, b"no id"));
                let ends = publish(&name, &records).await;

                let consumer = KafkaConsumer::new(member(&group), &name);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let handler = |pool: sqlx::Pool<$db>, batch: Arc<[Message]>| async move {
                    apply_batch(&pool, &batch).await
                };
                let done = until(|| async {
                    count(db, $count, &run).await == 31 && committed(&group, &name, 3) == ends
                });
                let consumed = consumer
                    .run_batches_with(db, 8, &policy, handler, done)
                    .await
                    .unwrap();

                assert_eq!(count(db, $count, &run).await, 31, "30 ids and the flaky one");
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, "kafka-batches", id).await, 1, "{id}");
                }
                assert_eq!(dedup_suite::claims(db, "kafka-batches", &poison).await, 0);
                assert_eq!(committed(&group, &name, 3), ends, "every offset committed");
                let mut dead = read_all(&format!("{name}.dead"), 3, 2);
                dead.sort_by(|a, b| a.0.cmp(&b.0));
                let dead: Vec<(i32, Vec<u8>)> = dead
                    .into_iter()
                    .map(|(partition, _, payload, _)| (partition, payload))
                    .collect();
                assert_eq!(dead, [(0, b"no id".to_vec()), (1, b"poison".to_vec())]);
                assert_eq!(
                    (consumed.acknowledged, consumed.dead_lettered),
                    (41, 2),
                    "{consumed:?}"
                );
                assert!(consumed.retried >= 1, "{consumed:?}");
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS consumer_effects \
               (run text NOT NULL, message_id text NOT NULL, trace bytea NOT NULL)",
    insert = "INSERT INTO consumer_effects (run, message_id, trace) VALUES ($1, $2, $3)",
    count = "SELECT COUNT(*) FROM consumer_effects WHERE run = $1 AND trace = 't-1'",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM consumer_effects WHERE run = $1"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS consumer_effects (run VARCHAR(255) NOT NULL, \
               message_id VARBINARY(255) NOT NULL, trace BLOB NOT NULL) ENGINE = InnoDB",
    insert = "INSERT INTO consumer_effects (run, message_id, trace) VALUES (?, ?, ?)",
    count = "SELECT COUNT(*) FROM consumer_effects WHERE run = ? AND trace = 't-1'",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM consumer_effects WHERE run = ?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS consumer_effects \
               (run TEXT NOT NULL, message_id TEXT NOT NULL, trace BLOB NOT NULL)",
    insert = "INSERT INTO consumer_effects (run, message_id, trace) VALUES (?1, ?2, ?3)",
    count = "SELECT COUNT(*) FROM consumer_effects WHERE run = ?1 AND CAST(trace AS TEXT) = 't-1'",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM consumer_effects WHERE run = ?1"
);

/// A SQLite pool with the effects table, and a run's name.
async fn sqlite_setup() -> (impl std::ops::Deref<Target = sqlx::SqlitePool>, String) {
    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    dedup_suite::ddl(
        &*pool,
        "CREATE TABLE IF NOT EXISTS kafka_effects (run TEXT NOT NULL, message_id TEXT NOT NULL)",
    )
    .await;
    (pool, dedup_suite::unique("run"))
}

#[dedup_runtime::idempotent(consumer = "kafka-lanes", key = msg.id())]
async fn record_effect(
    tx: &mut sqlx::SqliteConnection,
    msg: &Message,
    run: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO kafka_effects (run, message_id) VALUES (?1, ?2)")
        .bind(run)
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

const EFFECTS: &str = "SELECT COUNT(*) FROM kafka_effects WHERE run = ?1";
const DISTINCT: &str = "SELECT COUNT(DISTINCT message_id) FROM kafka_effects WHERE run = ?1";

/// `count` ids of `run` spread round-robin over `partitions`.
async fn publish_ids(name: &str, run: &str, count: usize, partitions: i32) -> BTreeMap<i32, i64> {
    let ids: Vec<String> = (0..count).map(|n| format!("{run}-{n}")).collect();
    let records: Vec<Record<'_>> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| ((n as i32) % partitions, Some(id.as_str()), &b"body"[..]))
        .collect();
    publish(name, &records).await
}

/// Shutdown in the middle of a run: the records in hand finish, the final commit covers
/// exactly what finished — each partition's committed offset is the count of its records
/// applied — and nothing more is applied after `run` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_commits_what_finished_before_it_returns() {
    let (pool, run) = sqlite_setup().await;
    let name = dedup_suite::unique("kafka-stop");
    let group = dedup_suite::unique("group");
    topic(&name, 2).await;
    publish_ids(&name, &run, 60, 2).await;
    let applied = Arc::new(Mutex::new(Vec::new()));
    let slow = {
        let (run, applied) = (run.clone(), applied.clone());
        move |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let (run, applied) = (run.clone(), applied.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                let result = record_effect(&pool, &msg, &run).await;
                applied.lock().unwrap().push(msg.id().to_owned());
                result
            }
        }
    };
    let db: &sqlx::SqlitePool = &pool;
    let stop = until(|| async { count(db, EFFECTS, &run).await >= 6 });
    let consumed = KafkaConsumer::new(member(&group), &name)
        .commit_interval(Duration::from_secs(60)) // only the final commit
        .run(db, slow, stop)
        .await
        .unwrap();
    let effects = count(db, EFFECTS, &run).await;
    assert_eq!(effects, consumed.acknowledged as i64, "{consumed:?}");
    assert!(effects < 60, "stopped in the middle: {effects}");
    let committed = committed(&group, &name, 2);
    let mut per_partition = BTreeMap::new();
    for id in applied.lock().unwrap().iter() {
        let n: i32 = id.rsplit('-').next().unwrap().parse().unwrap();
        *per_partition.entry(n % 2).or_insert(0) += 1;
    }
    for partition in 0..2 {
        assert_eq!(
            committed[&partition],
            per_partition.get(&partition).copied().unwrap_or(-1),
            "partition {partition}: committed {committed:?}, applied {per_partition:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        count(db, EFFECTS, &run).await,
        effects,
        "nothing after the return"
    );
}

/// A record not finished within the shutdown deadline: its call is dropped (its
/// transaction rolled back: no effect, no dedup row) and its offset is not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_past_the_shutdown_deadline_rolls_back_and_stays_uncommitted() {
    let (pool, run) = sqlite_setup().await;
    let name = dedup_suite::unique("kafka-deadline");
    let group = dedup_suite::unique("group");
    topic(&name, 1).await;
    publish_ids(&name, &run, 1, 1).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let stuck = {
        let started = started.clone();
        move |_: sqlx::SqlitePool, _: Arc<Message>| {
            let started = started.clone();
            async move {
                started.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(()))
            }
        }
    };
    let begun = std::time::Instant::now();
    let consumed = KafkaConsumer::new(member(&group), &name)
        .shutdown_deadline(Duration::from_millis(100))
        .run(&*pool, stuck, async { started.notified().await })
        .await
        .unwrap();
    assert!(
        begun.elapsed() < Duration::from_secs(20),
        "out within its deadline"
    );
    assert_eq!(
        (consumed.acknowledged, consumed.requeued),
        (0, 1),
        "{consumed:?}"
    );
    assert_eq!(
        dedup_suite::claims(&*pool, "kafka-lanes", &format!("{run}-0")).await,
        0
    );
    assert_eq!(committed(&group, &name, 1)[&0], -1, "nothing committed");
}

/// Two members of one group, the second joining in the middle of the first's work
/// (`strategy`: eager `range` or `cooperative-sticky`): the first's partitions revoked
/// and committed in the callback, then shared. Every record applied once, every offset
/// committed at its end, and the second member took records of its own.
async fn two_members_apply_each_record_once(strategy: &str) {
    let (pool, run) = sqlite_setup().await;
    let name = dedup_suite::unique("kafka-rebalance");
    let group = dedup_suite::unique("group");
    const RECORDS: usize = 400;
    topic(&name, 4).await;
    let ends = publish_ids(&name, &run, RECORDS, 4).await;
    let second_took = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = |second: bool| {
        let (run, second_took) = (run.clone(), second_took.clone());
        move |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let (run, second_took) = (run.clone(), second_took.clone());
            async move {
                use std::sync::atomic::Ordering;
                if second {
                    second_took.fetch_add(1, Ordering::SeqCst);
                } else if second_took.load(Ordering::SeqCst) == 0 {
                    // The first member is slow until the second has joined: work is
                    // left for it whatever the join's duration.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                record_effect(&pool, &msg, &run).await
            }
        }
    };
    let config = || {
        let mut config = member(&group);
        config.set("partition.assignment.strategy", strategy);
        config
    };
    let db: &sqlx::SqlitePool = &pool;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let stopped = |mut stopping: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    let first_member = KafkaConsumer::new(config(), &name);
    let first = first_member.run(db, handler(false), stopped(stopping.clone()));
    let second = async {
        until(|| async { count(db, EFFECTS, &run).await >= 20 }).await;
        KafkaConsumer::new(config(), &name)
            .run(db, handler(true), stopped(stopping.clone()))
            .await
    };
    let watch = async {
        until(|| async {
            count(db, EFFECTS, &run).await == RECORDS as i64 && committed(&group, &name, 4) == ends
        })
        .await;
        let _ = stop.send(true);
    };
    let (first, second, ()) = tokio::join!(first, second, watch);
    let (first, second) = (first.unwrap(), second.unwrap());
    assert_eq!(count(db, EFFECTS, &run).await, RECORDS as i64);
    assert_eq!(count(db, DISTINCT, &run).await, RECORDS as i64, "each once");
    assert_eq!(committed(&group, &name, 4), ends, "every offset committed");
    assert!(
        second.acknowledged > 0,
        "the second member took partitions: {first:?} {second:?}"
    );
    // The revoke callback committed what the first member finished before its
    // partitions moved: the second started after it, and read no record twice.
    assert_eq!(
        first.acknowledged + second.acknowledged,
        RECORDS as u64,
        "{first:?} {second:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_rebalancing_eagerly_apply_each_record_once() {
    two_members_apply_each_record_once("range").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_rebalancing_cooperatively_apply_each_record_once() {
    two_members_apply_each_record_once("cooperative-sticky").await;
}
