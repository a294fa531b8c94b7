//! The consumers' metrics (feature `metrics`), read back with `metrics-util`'s debugging
//! recorder, installed for the test's thread only (`with_local_recorder` around a
//! current-thread runtime): the counts by outcome match what the broker was told and
//! what the run returned, one duration sample per handler call, the lag: Kafka's per
//! partition, RabbitMQ's ready messages, Redis Streams' undelivered entries.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::consume::{Consumed, Message};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use super::common::{count, until};

/// Runs `test` with a recorder of its own; returns its output and what it recorded.
fn recorded<T>(test: impl Future<Output = T>) -> (T, Metrics) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let output = metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    (output, Metrics::of(&snapshotter))
}

type Labels = Vec<(String, String)>;

struct Metrics(Vec<(String, Labels, DebugValue)>);

impl Metrics {
    fn of(snapshotter: &Snapshotter) -> Self {
        Metrics(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| {
                    let mut labels: Labels = key
                        .key()
                        .labels()
                        .map(|label| (label.key().to_owned(), label.value().to_owned()))
                        .collect();
                    labels.sort();
                    (key.key().name().to_owned(), labels, value)
                })
                .collect(),
        )
    }

    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut wanted: Labels = labels
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .collect();
        wanted.sort();
        self.0
            .iter()
            .find(|(found, labels, _)| found == name && *labels == wanted)
            .map(|(_, _, value)| value)
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(name, labels) {
            Some(DebugValue::Counter(value)) => *value,
            Some(other) => panic!("{name} is not a counter: {other:?}"),
            None => 0,
        }
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        match self.find(name, labels) {
            Some(DebugValue::Histogram(values)) => values.len(),
            Some(other) => panic!("{name} is not a histogram: {other:?}"),
            None => 0,
        }
    }

    /// Each outcome's count, in `Consumed`'s order.
    fn outcomes(&self, labels: &[(&str, &str)]) -> [u64; 5] {
        [
            "acknowledged",
            "retried",
            "dead_lettered",
            "requeued",
            "dropped",
        ]
        .map(|outcome| {
            let mut labels = labels.to_vec();
            labels.push(("outcome", outcome));
            self.counter("dedup_consumer_messages_total", &labels)
        })
    }
}

fn as_outcomes(consumed: &Consumed) -> [u64; 5] {
    [
        consumed.acknowledged,
        consumed.retried,
        consumed.dead_lettered,
        consumed.requeued,
        consumed.dropped,
    ]
}

#[dedup_runtime::idempotent(consumer = "metrics-hosted", key = msg.id())]
async fn apply(
    tx: &mut sqlx::SqliteConnection,
    msg: &Message,
    run: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO metrics_effects (run, message_id) VALUES (?1, ?2)")
        .bind(run)
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn setup() -> (impl std::ops::Deref<Target = sqlx::SqlitePool>, String) {
    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    dedup_suite::ddl(
        &*pool,
        "CREATE TABLE IF NOT EXISTS metrics_effects (run TEXT NOT NULL, message_id TEXT NOT NULL)",
    )
    .await;
    (pool, dedup_suite::unique("run"))
}

const EFFECTS: &str = "SELECT COUNT(*) FROM metrics_effects WHERE run = ?1";

/// Kafka: 10 records and one without an id over two partitions: 10 acknowledged, one
/// dead-lettered, 11 handler calls timed, a lag gauge per partition.
#[test]
fn the_kafka_consumer_counts_what_it_settled() {
    use super::kafka::{Record, member, publish, topic};
    use dedup_runtime::rdkafka::KafkaConsumer;

    let name = dedup_suite::unique("kafka-metrics");
    let group = dedup_suite::unique("group");
    let (consumed, metrics) = recorded(async {
        let (pool, run) = setup().await;
        topic(&name, 2).await;
        let ids: Vec<String> = (0..10).map(|n| format!("{run}-{n}")).collect();
        let mut records: Vec<Record<'_>> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| ((n % 2) as i32, Some(id.as_str()), &b"body"[..]))
            .collect();
        records.push((1, None, b"no id"));
        publish(&name, &records).await;
        let mut config = member(&group);
        config.set("statistics.interval.ms", "100");
        let handler = |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let run = run.clone();
            async move { apply(&pool, &msg, &run).await }
        };
        let db: &sqlx::SqlitePool = &pool;
        let done = async {
            until(|| async { count(db, EFFECTS, &run).await == 10 }).await;
            // Statistics come every 100 ms: a few of them.
            tokio::time::sleep(Duration::from_millis(600)).await;
        };
        KafkaConsumer::new(config, &name)
            .run(db, handler, done)
            .await
            .unwrap()
    });
    let labels = [
        ("system", "kafka"),
        ("destination", name.as_str()),
        ("group", group.as_str()),
    ];
    assert_eq!(metrics.outcomes(&labels), as_outcomes(&consumed));
    assert_eq!(
        (consumed.acknowledged, consumed.dead_lettered),
        (10, 1),
        "{consumed:?}"
    );
    assert_eq!(
        metrics.samples("dedup_consumer_process_duration_seconds", &labels),
        11
    );
    for partition in ["0", "1"] {
        let mut labels = labels.to_vec();
        labels.push(("partition", partition));
        assert!(
            matches!(
                metrics.find("dedup_consumer_lag", &labels),
                Some(DebugValue::Gauge(_))
            ),
            "a lag gauge for partition {partition}"
        );
    }
}

/// RabbitMQ: 5 messages and one without an id: 5 acknowledged, one dead-lettered, 6
/// handler calls timed.
#[test]
fn the_rabbitmq_consumer_counts_what_it_settled() {
    use super::rabbitmq::{AMQP, channel, depth};
    use dedup_runtime::lapin::RabbitMqConsumer;
    use lapin::BasicProperties;
    use lapin::options::BasicPublishOptions;

    let queue = dedup_suite::unique("rabbitmq-metrics");
    let (consumed, metrics) = recorded(async {
        let (pool, run) = setup().await;
        let channel = channel().await;
        dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
        for n in 0..6 {
            let mut properties = BasicProperties::default();
            if n < 5 {
                properties = properties.with_message_id(format!("{run}-{n}").into());
            }
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    b"body",
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
        let handler = |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let run = run.clone();
            async move { apply(&pool, &msg, &run).await }
        };
        let db: &sqlx::SqlitePool = &pool;
        let done = until(|| async {
            count(db, EFFECTS, &run).await == 5
                && depth(&channel, &format!("{queue}.dead")).await.0 == 1
        });
        let consumed = RabbitMqConsumer::new(AMQP, lapin::ConnectionProperties::default(), &queue)
            .prefetch(1)
            .run(db, handler, done)
            .await
            .unwrap();
        for name in [queue.clone(), format!("{queue}.dead")] {
            let options = lapin::options::QueueDeleteOptions::default();
            channel
                .queue_delete(name.as_str().into(), options)
                .await
                .unwrap();
        }
        consumed
    });
    let labels = [
        ("system", "rabbitmq"),
        ("destination", queue.as_str()),
        ("group", ""),
    ];
    assert_eq!(metrics.outcomes(&labels), as_outcomes(&consumed));
    assert_eq!(
        (consumed.acknowledged, consumed.dead_lettered),
        (5, 1),
        "{consumed:?}"
    );
    assert_eq!(
        metrics.samples("dedup_consumer_process_duration_seconds", &labels),
        6
    );
    // Asked once, after the first message (prefetch 1): the 4 or 5 still ready.
    assert!(
        (4.0..=5.0).contains(&gauge(&metrics, &labels)),
        "{:?}",
        metrics.find("dedup_consumer_lag", &labels)
    );
}

/// The lag gauge's value.
fn gauge(metrics: &Metrics, labels: &[(&str, &str)]) -> f64 {
    match metrics.find("dedup_consumer_lag", labels) {
        Some(DebugValue::Gauge(lag)) => lag.into_inner(),
        other => panic!("no lag gauge: {other:?}"),
    }
}

/// Redis Streams: 6 entries read one at a time, 5 acknowledged and one without an id
/// dead-lettered, 6 calls timed, and the lag `XINFO GROUPS` gave at the first read: the
/// 5 entries not yet delivered to the group.
#[test]
fn the_redis_consumer_counts_what_it_settled_and_its_lag() {
    use super::redis::{add, client, connection, create_group, delete};
    use dedup_runtime::redis::RedisStreamsConsumer;

    let stream = dedup_suite::unique("redis-metrics");
    let (consumed, metrics) = recorded(async {
        let (pool, run) = setup().await;
        let mut redis = connection().await;
        create_group(&mut redis, &stream, "metrics").await;
        for n in 0..6 {
            let id = format!("{run}-{n}");
            add(&mut redis, &stream, (n < 5).then_some(id.as_str()), b"body").await;
        }
        let handler = |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let run = run.clone();
            async move { apply(&pool, &msg, &run).await }
        };
        let db: &sqlx::SqlitePool = &pool;
        let done = until(|| async { count(db, EFFECTS, &run).await == 5 });
        let consumed = RedisStreamsConsumer::new(client(), &stream, "metrics", "m-0")
            .batch(1)
            .run(db, handler, async {
                done.await;
                tokio::time::sleep(Duration::from_millis(200)).await; // the dead one too
            })
            .await
            .unwrap();
        delete(&mut redis, &stream).await;
        consumed
    });
    let labels = [
        ("system", "redis"),
        ("destination", stream.as_str()),
        ("group", "metrics"),
    ];
    assert_eq!(metrics.outcomes(&labels), as_outcomes(&consumed));
    assert_eq!(
        (consumed.acknowledged, consumed.dead_lettered),
        (5, 1),
        "{consumed:?}"
    );
    assert_eq!(
        metrics.samples("dedup_consumer_process_duration_seconds", &labels),
        6
    );
    assert_eq!(gauge(&metrics, &labels), 5.0);
}
