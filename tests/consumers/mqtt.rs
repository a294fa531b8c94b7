//! `dedup_runtime::rumqttc::MqttConsumer` against a Mosquitto of the test's own, on
//! PostgreSQL, MariaDB and SQLite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_runtime::AckPolicy;
use dedup_runtime::consume::Message;
use dedup_runtime::rumqttc::MqttConsumer;
use dedup_suite::mosquitto::Mosquitto;
pub(crate) use dedup_suite::mosquitto::{Wire, collect, property, publish, session, wire};
use dedup_suite::outage::Outage;
use rumqttc::v5::MqttOptions;

use super::common::{count, fails_first_time, fails_permanently, until};

/// Checks the dead letters `dead` (in any order): the message without an id and the
/// poison one of `run`, each with its payload, its original properties first, and the
/// provenance of `client_id`'s consumer of `topic`.
fn check_dead_letters(dead: &mut [Wire], run: &str, client_id: &str, topic: &str) {
    use dedup_runtime::rumqttc::provenance;
    dead.sort_by(|a, b| a.1.cmp(&b.1));
    let payloads: Vec<&[u8]> = dead.iter().map(|(_, payload)| payload.as_slice()).collect();
    assert_eq!(payloads, [b"no id".as_slice(), b"poison"], "{dead:?}");
    let poison = format!("{run}-poison");
    assert_eq!(
        dead[0].0[0].0,
        provenance::TOPIC,
        "no original property: {:?}",
        dead[0]
    );
    assert_eq!(
        dead[1].0[0],
        ("message-id".to_owned(), poison),
        "the original's first"
    );
    for letter in dead.iter() {
        assert_eq!(
            property(letter, provenance::TOPIC),
            Some(topic),
            "{letter:?}"
        );
        assert_eq!(
            property(letter, provenance::CLIENT),
            Some(client_id),
            "{letter:?}"
        );
        assert_eq!(
            property(letter, provenance::ATTEMPTS),
            Some("1"),
            "{letter:?}"
        );
    }
    let error = property(&dead[1], provenance::ERROR).expect("the error");
    assert!(error.contains("a poison message"), "{error}");
    let class = property(&dead[1], provenance::ERROR_CLASS).expect("the error's type");
    assert!(class.contains("Error"), "{class}");
    assert!(
        property(&dead[0], provenance::ERROR).is_some(),
        "an empty id: refused"
    );
}

/// The messages both settle tests publish for `run`: 20 ids, every fourth of them again,
/// a flaky one, a poison one and one without an id; the 20 ids and the messages.
fn settled_messages(run: &str) -> (Vec<String>, Vec<Wire>) {
    let ids: Vec<String> = (0..20).map(|n| format!("{run}-{n}")).collect();
    let mut payloads: Vec<Wire> = ids.iter().map(|id| wire(Some(id), b"body")).collect();
    payloads.extend(ids.iter().step_by(4).map(|id| wire(Some(id), b"body")));
    payloads.push(wire(Some(&format!("{run}-flaky")), b"flaky"));
    payloads.push(wire(Some(&format!("{run}-poison")), b"poison"));
    payloads.push(wire(None, b"no id"));
    (ids, payloads)
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     effects = $effects:literal, insert = $insert:literal,
     count = $count:literal, distinct = $distinct:literal) => {
        mod $backend {
            use super::*;

            const CONSUMER: &str = "mqtt-hosted";
            const BATCHES: &str = "mqtt-batches";

            #[dedup_runtime::idempotent(consumer = "mqtt-hosted", key = msg.id())]
            async fn apply(tx: &mut $conn, msg: &Message, run: &str) -> Result<(), sqlx::Error> {
                if fails_permanently(msg) {
                    return Err(sqlx::Error::Protocol("a poison message".into()));
                }
                if fails_first_time(msg) {
                    return Err(sqlx::Error::PoolTimedOut);
                }
                sqlx::query($insert)
                    .bind(run)
                    .bind(msg.id())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// The batch form of `apply`: the run is the id's prefix (a batch handler
            /// takes its connection and its messages, nothing else).
            #[dedup_runtime::idempotent(consumer = "mqtt-batches", batch = fresh, key = |msg| msg.id())]
            async fn apply_batch(tx: &mut $conn, fresh: &[&Message]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    let run = msg.id().rsplit_once('-').map_or("", |(run, _)| run);
                    if fails_permanently(msg) {
                        return Err(sqlx::Error::Protocol("a poison message".into()));
                    }
                    if fails_first_time(msg) {
                        return Err(sqlx::Error::PoolTimedOut);
                    }
                    sqlx::query($insert)
                        .bind(run)
                        .bind(msg.id())
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            }

            fn call(
                run: Arc<str>,
                pool: sqlx::Pool<$db>,
                msg: Arc<Message>,
            ) -> impl Future<Output = Result<dedup_runtime::Outcome<()>, sqlx::Error>> + Send + 'static
            {
                async move { apply(&pool, &msg, &run).await }
            }

            async fn setup() -> (impl std::ops::Deref<Target = sqlx::Pool<$db>>, String) {
                let pool = $pool;
                dedup_runtime::migrate(&*pool).await.unwrap();
                dedup_suite::ddl(&*pool, $effects).await;
                (pool, dedup_suite::unique("run"))
            }

            /// Each message processed once and acknowledged after its commit (copies
            /// found duplicates), a transient failure retried in process, a poison message
            /// and one without an id dead-lettered with their payloads; nothing left in
            /// the session afterwards.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn settles_after_commit_retries_and_dead_letters() {
                let (pool, run) = setup().await;
                let broker = Mosquitto::start(&dedup_suite::unique("hosted-mqtt"), "");
                let topic = format!("hosted/{run}");
                let (client_id, dead_id) = (format!("{run}-consumer"), format!("{run}-dead"));
                session(broker.port(), &client_id, &topic).await;
                session(broker.port(), &dead_id, &format!("{topic}/dead")).await;
                let (ids, payloads) = settled_messages(&run);
                publish(broker.port(), &topic, &payloads).await;

                let consumer = MqttConsumer::new(
                    MqttOptions::new(&client_id, "127.0.0.1", broker.port()),
                    &topic,
                );
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = until(|| async { count(db, $count, &run).await == 21 });
                let result = consumer
                    .run_with(db, &policy, |pool, msg| call(run.as_str().into(), pool, msg), async {
                        done.await;
                        // Let the last messages (the poison ones, after the flaky one)
                        // settle before stopping.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    })
                    .await
                    .unwrap();
                assert_eq!(count(db, $count, &run).await, 21, "20 ids and the flaky one");
                assert_eq!(count(db, $distinct, &run).await, 21, "each once");
                for id in &ids {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(
                    (result.acknowledged, result.retried, result.dead_lettered),
                    (26, 1, 2),
                    "{result:?}"
                );
                let mut dead = collect(broker.port(), &dead_id, &format!("{topic}/dead")).await;
                check_dead_letters(&mut dead, &run, &client_id, &topic);
                assert!(
                    collect(broker.port(), &client_id, &topic).await.is_empty(),
                    "every message acknowledged: nothing left in the session"
                );
            }

            /// The batch form (`run_batches`, up to 8 messages a call): the same
            /// messages as above, each settled as its item says — processed or copies
            /// acknowledged, the flaky one retried, the poison one and the one without
            /// an id dead-lettered — with the same effects, dedup rows and dead letters.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_settle_each_message_as_its_item_says() {
                let (pool, run) = setup().await;
                let broker = Mosquitto::start(&dedup_suite::unique("hosted-mqtt"), "");
                let topic = format!("hosted/{run}");
                let (client_id, dead_id) = (format!("{run}-consumer"), format!("{run}-dead"));
                session(broker.port(), &client_id, &topic).await;
                session(broker.port(), &dead_id, &format!("{topic}/dead")).await;
                let (ids, payloads) = settled_messages(&run);
                publish(broker.port(), &topic, &payloads).await;

                let consumer = MqttConsumer::new(
                    MqttOptions::new(&client_id, "127.0.0.1", broker.port()),
                    &topic,
                );
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = until(|| async { count(db, $count, &run).await == 21 });
                let largest = std::sync::atomic::AtomicUsize::new(0);
                let result = consumer
                    .run_batches_with(db, 8, &policy, |pool, batch: Arc<[Message]>| {
                        largest.fetch_max(batch.len(), std::sync::atomic::Ordering::Relaxed);
                        async move { apply_batch(&pool, &batch).await }
                    }, async {
                        done.await;
                        // Let the last messages (the poison ones, after the flaky one)
                        // settle before stopping.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    })
                    .await
                    .unwrap();
                let largest = largest.into_inner();
                assert!((2..=8).contains(&largest), "batches of more than one, at most 8: {largest}");
                assert_eq!(count(db, $count, &run).await, 21, "20 ids and the flaky one");
                assert_eq!(count(db, $distinct, &run).await, 21, "each once");
                for id in &ids {
                    assert_eq!(dedup_suite::claims(db, BATCHES, id).await, 1, "{id}");
                }
                assert_eq!(
                    (result.acknowledged, result.retried, result.dead_lettered),
                    (26, 1, 2),
                    "{result:?}"
                );
                let mut dead = collect(broker.port(), &dead_id, &format!("{topic}/dead")).await;
                check_dead_letters(&mut dead, &run, &client_id, &topic);
                assert!(
                    collect(broker.port(), &client_id, &topic).await.is_empty(),
                    "every message acknowledged: nothing left in the session"
                );
            }

            /// The broker taken away in the middle of a run (a proxy closes every
            /// connection and refuses new ones for a second): the consumer connects
            /// again, the session gives back what was not acknowledged, and every
            /// message is processed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lost_connection_is_made_again_and_nothing_is_lost_or_doubled() {
                let (pool, run) = setup().await;
                let broker = Mosquitto::start(&dedup_suite::unique("hosted-mqtt"), "");
                let proxy = Outage::start(&format!("127.0.0.1:{}", broker.port())).await;
                let topic = format!("hosted/{run}");
                let client_id = format!("{run}-consumer");
                session(broker.port(), &client_id, &topic).await;
                let ids: Vec<String> = (0..100).map(|n| format!("{run}-{n}")).collect();
                let payloads: Vec<Wire> = ids.iter().map(|id| wire(Some(id), b"body")).collect();
                publish(broker.port(), &topic, &payloads).await;
                let consumer = MqttConsumer::new(
                    MqttOptions::new(&client_id, "127.0.0.1", proxy.port()),
                    &topic,
                );
                let db: &sqlx::Pool<$db> = &pool;
                let slow = |pool, msg| {
                    let call = call(run.as_str().into(), pool, msg);
                    async move {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        call.await
                    }
                };
                let outage = async {
                    until(|| async { count(db, $count, &run).await >= 20 }).await;
                    proxy.cut();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    proxy.restore();
                    until(|| async { count(db, $count, &run).await == 100 }).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                };
                let consumed = consumer.run(db, slow, outage).await.unwrap();
                assert!(consumed.reconnects >= 1, "{consumed:?}");
                assert_eq!(count(db, $distinct, &run).await, 100, "each once");
                assert_eq!(count(db, $count, &run).await, 100, "{consumed:?}");
                for id in &ids {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                drop(proxy);
                assert!(
                    collect(broker.port(), &client_id, &topic).await.is_empty(),
                    "nothing left unacknowledged in the session"
                );
            }

            /// Shutdown with a message in hand past the deadline: its call is dropped
            /// (rolled back: no effect, no dedup row), it is not acknowledged, and the
            /// session gives it back on the next connection.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_past_the_shutdown_deadline_stays_with_the_session() {
                let (pool, run) = setup().await;
                let broker = Mosquitto::start(&dedup_suite::unique("hosted-mqtt"), "");
                let topic = format!("hosted/{run}");
                let client_id = format!("{run}-consumer");
                session(broker.port(), &client_id, &topic).await;
                let id = format!("{run}-slow");
                publish(broker.port(), &topic, &[wire(Some(&id), b"body")]).await;
                let consumer = MqttConsumer::new(
                    MqttOptions::new(&client_id, "127.0.0.1", broker.port()),
                    &topic,
                )
                .shutdown_deadline(Duration::from_millis(100));
                let db: &sqlx::Pool<$db> = &pool;
                let started = Arc::new(tokio::sync::Notify::new());
                let stuck = {
                    let started = started.clone();
                    move |_: sqlx::Pool<$db>, _: Arc<Message>| {
                        let started = started.clone();
                        async move {
                            started.notify_one();
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(()))
                        }
                    }
                };
                let begun = Instant::now();
                let consumed = consumer
                    .run(db, stuck, async { started.notified().await })
                    .await
                    .unwrap();
                assert!(begun.elapsed() < Duration::from_secs(20), "out within its deadline");
                assert_eq!((consumed.acknowledged, consumed.requeued), (0, 1), "{consumed:?}");
                assert_eq!(dedup_suite::claims(db, CONSUMER, &id).await, 0);
                assert_eq!(
                    collect(broker.port(), &client_id, &topic).await,
                    [wire(Some(&id), b"body")],
                    "given back by the session"
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS mqtt_consumer_effects \
               (run text NOT NULL, message_id text NOT NULL)",
    insert = "INSERT INTO mqtt_consumer_effects (run, message_id) VALUES ($1, $2)",
    count = "SELECT COUNT(*) FROM mqtt_consumer_effects WHERE run = $1",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM mqtt_consumer_effects WHERE run = $1"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS mqtt_consumer_effects (run VARCHAR(255) NOT NULL, \
               message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    insert = "INSERT INTO mqtt_consumer_effects (run, message_id) VALUES (?, ?)",
    count = "SELECT COUNT(*) FROM mqtt_consumer_effects WHERE run = ?",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM mqtt_consumer_effects WHERE run = ?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS mqtt_consumer_effects \
               (run TEXT NOT NULL, message_id TEXT NOT NULL)",
    insert = "INSERT INTO mqtt_consumer_effects (run, message_id) VALUES (?1, ?2)",
    count = "SELECT COUNT(*) FROM mqtt_consumer_effects WHERE run = ?1",
    distinct = "SELECT COUNT(DISTINCT message_id) FROM mqtt_consumer_effects WHERE run = ?1"
);
