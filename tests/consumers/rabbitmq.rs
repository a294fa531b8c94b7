//! `dedup_runtime::lapin::RabbitMqConsumer` against the real RabbitMQ, on PostgreSQL,
//! MariaDB and SQLite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_runtime::AckPolicy;
use dedup_runtime::consume::{Consumed, Message};
use dedup_runtime::lapin::RabbitMqConsumer;
use dedup_suite::outage::Outage;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ConnectionProperties};

use super::common::{count, fails_first_time, fails_permanently, until};

pub(crate) use dedup_suite::rabbitmq::{AMQP, channel, depth};

/// A fresh queue with its dead-letter exchange and dead queue.
async fn queue(channel: &Channel, prefix: &str) -> String {
    let queue = dedup_suite::unique(prefix);
    dedup_suite::rabbitmq::declare(channel, &queue, false).await;
    queue
}

/// Publishes `body` to `queue` with `id` as its `message-id` (none when `None`) and a
/// header `trace-id`, confirmed.
async fn publish(channel: &Channel, queue: &str, id: Option<&str>, body: &[u8]) {
    let mut headers = FieldTable::default();
    headers.insert("trace-id".into(), AMQPValue::LongString("t-1".into()));
    let mut properties = BasicProperties::default().with_headers(headers);
    if let Some(id) = id {
        properties = properties.with_message_id(id.into());
    }
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// The bodies in `queue`, taken out.
async fn drain(channel: &Channel, queue: &str) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        bodies.push(message.data.clone());
    }
    bodies
}

async fn delete(channel: &Channel, queue: &str) {
    for name in [queue.to_owned(), format!("{queue}.dead")] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
}

/// `declare(true)` on a queue that exists without the dead-letter exchange: RabbitMQ
/// refuses the declaration, and the run fails at start, consuming nothing.
#[tokio::test]
async fn declaring_over_a_queue_without_its_dead_letter_exchange_fails_at_start() {
    let channel = channel().await;
    let queue = dedup_suite::unique("hosted-nodlx");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&channel, &queue, Some("m1"), b"body").await;
    let pool = dedup_suite::sqlite().await;
    let consumer =
        RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue).declare(true);
    let never = |_: sqlx::SqlitePool, _: Arc<Message>| async {
        panic!("no message is handled");
        #[allow(unreachable_code)]
        Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(()))
    };
    let error = consumer
        .run(&*pool, never, std::future::pending())
        .await
        .expect_err("refused at start");
    assert!(
        matches!(error, dedup_runtime::lapin::ConsumeError::Start(_)),
        "{error}"
    );
    assert!(error.to_string().contains("PRECONDITION"), "{error}");
    assert_eq!(depth(&channel, &queue).await, (1, 0), "nothing consumed");
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = channel
        .exchange_delete(format!("{queue}.dlx").as_str().into(), Default::default())
        .await;
    let _ = channel
        .queue_delete(
            format!("{queue}.dead").as_str().into(),
            QueueDeleteOptions::default(),
        )
        .await;
}

/// A quorum queue whose arguments set a delivery limit and no dead-letter exchange
/// (RabbitMQ would drop a message at the limit, and every retry spends a delivery):
/// refused at start, nothing consumed; the same queue with `dead_letters_by_policy`, and
/// a quorum queue with a dead-letter exchange, consume.
#[tokio::test]
async fn a_quorum_queue_that_would_drop_at_its_delivery_limit_is_refused() {
    use dedup_runtime::lapin::ConsumeError;

    let channel = channel().await;
    let quorum = |dead_letters: Option<&str>| {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        arguments.insert("x-delivery-limit".into(), AMQPValue::LongInt(3));
        if let Some(exchange) = dead_letters {
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(exchange.into()),
            );
        }
        arguments
    };
    let (drops, kept) = (
        dedup_suite::unique("quorum-drops"),
        dedup_suite::unique("quorum-kept"),
    );
    for (queue, arguments) in [(&drops, quorum(None)), (&kept, quorum(Some("elsewhere")))] {
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                arguments,
            )
            .await
            .unwrap();
        publish(&channel, queue, Some("m1"), b"body").await;
    }
    let pool = dedup_suite::sqlite().await;
    let record = |seen: &Arc<std::sync::Mutex<Vec<String>>>| {
        let seen = seen.clone();
        move |_: sqlx::SqlitePool, msg: Arc<Message>| {
            seen.lock().unwrap().push(msg.id().to_owned());
            async { Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(())) }
        }
    };

    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let error = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &drops)
        .run(&*pool, record(&seen), std::future::pending())
        .await
        .expect_err("refused at start");
    assert!(
        matches!(&error, ConsumeError::NoDeadLetterExchange { queue, delivery_limit: 3 } if *queue == drops),
        "{error}"
    );
    assert!(
        error.to_string().contains("dead_letters_by_policy"),
        "{error}"
    );
    assert!(seen.lock().unwrap().is_empty());
    assert_eq!(depth(&channel, &drops).await, (1, 0), "nothing consumed");

    for (queue, by_policy) in [(&drops, true), (&kept, false)] {
        let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let done = until(|| async {
            depth(&channel, queue).await.0 == 0 && !seen.lock().unwrap().is_empty()
        });
        RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), queue)
            .dead_letters_by_policy(by_policy)
            .run(&*pool, record(&seen), done)
            .await
            .unwrap_or_else(|error| panic!("{queue}: {error}"));
        assert_eq!(*seen.lock().unwrap(), ["m1"], "{queue}");
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
}

/// Ids from a header (`MessageIdFrom::Header`): the header's value is the message's id,
/// and the handler sees every header.
#[tokio::test]
async fn ids_can_come_from_a_header() {
    let channel = channel().await;
    let queue = queue(&channel, "hosted-header").await;
    publish(&channel, &queue, None, b"body").await; // `trace-id: t-1`, no message-id
    let pool = dedup_suite::sqlite().await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let consumer = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue).message_id(
        dedup_runtime::lapin::MessageIdFrom::Header("trace-id".to_owned()),
    );
    let record = {
        let seen = seen.clone();
        move |_: sqlx::SqlitePool, msg: Arc<Message>| {
            seen.lock()
                .unwrap()
                .push((msg.id().to_owned(), msg.delivery_count()));
            async { Ok::<_, sqlx::Error>(dedup_runtime::Outcome::Processed(())) }
        }
    };
    let done = until(|| async {
        depth(&channel, &queue).await.0 == 0 && !seen.lock().unwrap().is_empty()
    });
    let consumed = consumer.run(&*pool, record, done).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), [("t-1".to_owned(), 1)]);
    assert_eq!(consumed.acknowledged, 1);
    assert_eq!(depth(&channel, &queue).await, (0, 0));
    delete(&channel, &queue).await;
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     effects = $effects:literal, insert = $insert:literal,
     count = $count:literal, distinct = $distinct:literal) => {
        mod $backend {
            use super::*;

            const CONSUMER: &str = "rabbitmq-hosted";
            const BATCHES: &str = "rabbitmq-batches";

            /// The effect: one row per message, no unique constraint (a message applied
            /// twice would show as two rows), in the dedup record's transaction.
            #[dedup_runtime::idempotent(consumer = "rabbitmq-hosted", key = msg.id())]
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
                    .bind(msg.header("trace-id").unwrap_or_default())
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// The batch form of `apply`: the run is the id's prefix (a batch handler
            /// takes its connection and its messages, nothing else).
            #[dedup_runtime::idempotent(consumer = "rabbitmq-batches", batch = fresh, key = |msg| msg.id())]
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
                        .bind(msg.header("trace-id").unwrap_or_default())
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(())
            }

            /// One call of the handler, owning what it needs: what the consumer's closure
            /// returns.
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

            /// Each message processed once and acknowledged after its commit, copies
            /// found duplicates, a transient failure retried, a poison message and one
            /// without an id dead-lettered with their payloads: the effects and dedup
            /// rows in the database, the queue empty, the dead queue holding the two.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn settles_after_commit_retries_and_dead_letters() {
                let (pool, run) = setup().await;
                let channel = channel().await;
                let queue = queue(&channel, "hosted").await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&channel, &queue, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    publish(&channel, &queue, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                publish(&channel, &queue, Some(&flaky), b"flaky").await;
                publish(&channel, &queue, Some(&format!("{run}-poison")), b"poison").await;
                publish(&channel, &queue, None, b"no id").await;

                let consumer = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue)
                    .concurrency(2);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = until(|| async {
                    count(db, $count, &run).await == 31
                        && depth(&channel, &format!("{queue}.dead")).await.0 == 2
                        && depth(&channel, &queue).await.0 == 0
                });
                let consumed = consumer
                    .run_with(db, &policy, |pool, msg| call(run.as_str().into(), pool, msg), done)
                    .await
                    .unwrap();

                assert_eq!(
                    count(db, $count, &run).await,
                    31,
                    "30 ids and the flaky one"
                );
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(
                    dedup_suite::claims(db, CONSUMER, &format!("{run}-poison")).await,
                    0,
                    "a failed message leaves no dedup row"
                );
                let mut dead = drain(&channel, &format!("{queue}.dead")).await;
                dead.sort();
                assert_eq!(dead, [b"no id".to_vec(), b"poison".to_vec()]);
                assert_eq!(
                    depth(&channel, &queue).await,
                    (0, 0),
                    "nothing left, no consumer"
                );
                assert_eq!(
                    (
                        consumed.acknowledged,
                        consumed.retried,
                        consumed.dead_lettered
                    ),
                    (41, 1, 2),
                    "{consumed:?}"
                );
                delete(&channel, &queue).await;
            }

            /// The batch form (`run_batches`, up to 8 messages a call): the same
            /// messages as above, each settled as its item says — processed or copies
            /// acknowledged, the flaky one retried, the poison one and the one without
            /// an id dead-lettered — with the same effects, dedup rows and dead letters.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_settle_each_message_as_its_item_says() {
                let (pool, run) = setup().await;
                let channel = channel().await;
                let queue = queue(&channel, "hosted").await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&channel, &queue, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    publish(&channel, &queue, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                publish(&channel, &queue, Some(&flaky), b"flaky").await;
                publish(&channel, &queue, Some(&format!("{run}-poison")), b"poison").await;
                publish(&channel, &queue, None, b"no id").await;

                let consumer = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue)
                    .concurrency(2);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = until(|| async {
                    count(db, $count, &run).await == 31
                        && depth(&channel, &format!("{queue}.dead")).await.0 == 2
                        && depth(&channel, &queue).await.0 == 0
                });
                let largest = std::sync::atomic::AtomicUsize::new(0);
                let consumed = consumer
                    .run_batches_with(db, 8, &policy, |pool, batch: Arc<[Message]>| {
                        largest.fetch_max(batch.len(), std::sync::atomic::Ordering::Relaxed);
                        async move { apply_batch(&pool, &batch).await }
                    }, done)
                    .await
                    .unwrap();
                let largest = largest.into_inner();
                assert!((2..=8).contains(&largest), "batches of more than one, at most 8: {largest}");

                assert_eq!(
                    count(db, $count, &run).await,
                    31,
                    "30 ids and the flaky one"
                );
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, BATCHES, id).await, 1, "{id}");
                }
                assert_eq!(
                    dedup_suite::claims(db, BATCHES, &format!("{run}-poison")).await,
                    0,
                    "a failed message leaves no dedup row"
                );
                let mut dead = drain(&channel, &format!("{queue}.dead")).await;
                dead.sort();
                assert_eq!(dead, [b"no id".to_vec(), b"poison".to_vec()]);
                assert_eq!(
                    depth(&channel, &queue).await,
                    (0, 0),
                    "nothing left, no consumer"
                );
                assert_eq!(
                    (
                        consumed.acknowledged,
                        consumed.retried,
                        consumed.dead_lettered
                    ),
                    (41, 1, 2),
                    "{consumed:?}"
                );
                delete(&channel, &queue).await;
            }

            /// Shutdown in the middle of a run: the message in hand finishes and is
            /// acknowledged, the ones fetched and not started go back to the queue, and
            /// none is lost: effects = acknowledged, the queue holds the rest.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_finishes_the_message_in_hand_and_hands_back_the_rest() {
                let (pool, run) = setup().await;
                let channel = channel().await;
                let queue = queue(&channel, "hosted-stop").await;
                for n in 0..20 {
                    publish(&channel, &queue, Some(&format!("{run}-{n}")), b"body").await;
                }
                let consumer = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue)
                    .prefetch(20);
                let db: &sqlx::Pool<$db> = &pool;
                let slow = |pool, msg| {
                    let call = call(run.as_str().into(), pool, msg);
                    async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        call.await
                    }
                };
                let stop = until(|| async { count(db, $count, &run).await >= 3 });
                let consumed = consumer.run(db, slow, stop).await.unwrap();
                let effects = count(db, $count, &run).await;
                assert_eq!(effects, consumed.acknowledged as i64, "{consumed:?}");
                assert!(
                    consumed.requeued > 0,
                    "fetched ahead and handed back: {consumed:?}"
                );
                assert_eq!(consumed.dropped, 0);
                let (ready, consumers) = depth(&channel, &queue).await;
                assert_eq!(
                    (i64::from(ready), consumers),
                    (20 - effects, 0),
                    "the rest back in the queue, ready"
                );
                delete(&channel, &queue).await;
            }

            /// A message not finished within the shutdown deadline: its call is dropped
            /// (its transaction rolled back, no effect, no dedup row) and it goes back
            /// to the queue.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_past_the_shutdown_deadline_rolls_back_and_goes_back() {
                let (pool, run) = setup().await;
                let channel = channel().await;
                let queue = queue(&channel, "hosted-deadline").await;
                let id = format!("{run}-slow");
                publish(&channel, &queue, Some(&id), b"body").await;
                let consumer = RabbitMqConsumer::new(AMQP, ConnectionProperties::default(), &queue)
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
                assert!(
                    begun.elapsed() < Duration::from_secs(20),
                    "out within its deadline"
                );
                assert_eq!(
                    (consumed.acknowledged, consumed.requeued),
                    (0, 1),
                    "{consumed:?}"
                );
                assert_eq!(dedup_suite::claims(db, CONSUMER, &id).await, 0);
                assert_eq!(depth(&channel, &queue).await, (1, 0), "back in the queue");
                delete(&channel, &queue).await;
            }

            /// The broker taken away in the middle of a run (a proxy closes every
            /// connection and refuses new ones for a second): the consumer connects
            /// again, drops what it held unsettled, and every message is processed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lost_connection_is_made_again_and_nothing_is_lost_or_doubled() {
                let (pool, run) = setup().await;
                let channel = channel().await;
                let queue = queue(&channel, "hosted-outage").await;
                let ids: Vec<String> = (0..100).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&channel, &queue, Some(id), b"body").await;
                }
                let proxy = Outage::start("127.0.0.1:5672").await;
                let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
                let consumer = RabbitMqConsumer::new(&uri, ConnectionProperties::default(), &queue)
                    .prefetch(10);
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
                    until(|| async { depth(&channel, &queue).await.0 == 0 }).await;
                };
                let consumed: Consumed = consumer.run(db, slow, outage).await.unwrap();
                assert!(consumed.reconnects >= 1, "{consumed:?}");
                assert_eq!(count(db, $count, &run).await, 100, "{consumed:?}");
                assert_eq!(count(db, $distinct, &run).await, 100, "each once");
                for id in &ids {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(depth(&channel, &queue).await, (0, 0));
                assert!(
                    drain(&channel, &format!("{queue}.dead")).await.is_empty(),
                    "none dead"
                );
                println!("{consumed:?}");
                delete(&channel, &queue).await;
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
