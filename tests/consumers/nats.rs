//! `dedup_runtime::async_nats::JetStreamConsumer` against the real NATS JetStream, on
//! PostgreSQL, MariaDB and SQLite.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy as JetStreamAckPolicy, pull};
use async_nats::jetstream::{self, Context};
use dedup_runtime::AckPolicy;
use dedup_runtime::async_nats::{JetStreamConsumer, provenance};
use dedup_runtime::consume::{Consumed, Message};
use dedup_suite::outage::Outage;

use super::common::{count, fails_first_time, fails_permanently, until};

pub(crate) const NATS: &str = "nats://127.0.0.1:4222";

/// A JetStream context on a connection of the test's own.
pub(crate) async fn context() -> Context {
    let client = async_nats::connect(NATS)
        .await
        .unwrap_or_else(|error| panic!("NATS is not reachable at {NATS}: {error}"));
    jetstream::new(client)
}

/// A fresh stream on a subject of its own, its dead stream (`<STREAM>_DEAD` on
/// `<subject>.dead`) and a durable pull consumer `worker` with explicit acknowledgements,
/// `ack_wait` and 20 deliveries at most: (stream, subject).
pub(crate) async fn stream(js: &Context, prefix: &str, ack_wait: Duration) -> (String, String) {
    let name = dedup_suite::unique(prefix);
    let subject = format!("{name}.in");
    let (stream, _dead) = dedup_suite::jetstream::streams(js, NATS, &name, &subject).await;
    stream
        .create_consumer(pull::Config {
            durable_name: Some("worker".to_owned()),
            ack_policy: JetStreamAckPolicy::Explicit,
            ack_wait,
            max_deliver: 20,
            ..Default::default()
        })
        .await
        .expect("create the durable consumer");
    (name, subject)
}

/// Publishes `body` to `subject` with `id` as its `Message-Id` (none when `None`) and a
/// header `trace-id`, stored.
async fn publish(js: &Context, subject: &str, id: Option<&str>, body: &[u8]) {
    let mut headers = HeaderMap::new();
    headers.insert("trace-id", "t-1");
    if let Some(id) = id {
        headers.insert("Message-Id", id);
    }
    js.publish_with_headers(subject.to_owned(), headers, body.to_vec().into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// The durable consumer's (pending, ack pending): messages not yet delivered, and
/// delivered and not yet settled.
async fn pending(js: &Context, stream: &str) -> (u64, usize) {
    pending_in(js, stream, "worker").await
}

/// [`pending`] of the durable consumer `durable`.
pub(crate) async fn pending_in(js: &Context, stream: &str, durable: &str) -> (u64, usize) {
    let info = js
        .get_stream(stream)
        .await
        .unwrap()
        .consumer_info(durable)
        .await
        .unwrap();
    (info.num_pending, info.num_ack_pending)
}

/// Messages stored in `stream`.
pub(crate) async fn stored(js: &Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .unwrap()
        .cached_info()
        .state
        .messages
}

/// The messages of `stream`, in order.
pub(crate) async fn messages(
    js: &Context,
    stream: &str,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let stream = js.get_stream(stream).await.unwrap();
    let last = stream.cached_info().state.last_sequence;
    let mut all = Vec::new();
    for sequence in 1..=last {
        if let Ok(message) = stream.get_raw_message(sequence).await {
            all.push(message);
        }
    }
    all
}

async fn delete(js: &Context, stream: &str) {
    for name in [stream.to_owned(), format!("{stream}_DEAD")] {
        js.delete_stream(&name).await.unwrap();
    }
}

fn header<'m>(headers: &'m HeaderMap, name: &str) -> Option<&'m str> {
    headers.get(name).map(|value| value.as_str())
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     effects = $effects:literal, insert = $insert:literal,
     count = $count:literal, distinct = $distinct:literal) => {
        mod $backend {
            use super::*;

            const CONSUMER: &str = "nats-hosted";
            const BATCHES: &str = "nats-batches";

            /// The effect: one row per message, no unique constraint (a message applied
            /// twice would show as two rows), in the dedup record's transaction.
            #[dedup_runtime::idempotent(consumer = "nats-hosted", key = msg.id())]
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
            #[dedup_runtime::idempotent(consumer = "nats-batches", batch = fresh, key = |msg| msg.id())]
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
            /// found duplicates, a transient failure retried through a NAK delay, a
            /// poison message and one without an id dead-lettered with their payloads,
            /// headers and provenance, then terminated: the effects and dedup rows in
            /// the database, nothing pending in the consumer, the dead stream holding
            /// the two.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn settles_after_commit_retries_and_dead_letters() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted", Duration::from_secs(2)).await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&js, &subject, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    publish(&js, &subject, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                publish(&js, &subject, Some(&flaky), b"flaky").await;
                let poison = format!("{run}-poison");
                publish(&js, &subject, Some(&poison), b"poison").await;
                publish(&js, &subject, None, b"no id").await;

                let consumer = JetStreamConsumer::new(js.clone(), &stream, "worker").concurrency(2);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let dead_stream = format!("{stream}_DEAD");
                let done = until(|| async {
                    count(db, $count, &run).await == 31
                        && stored(&js, &dead_stream).await == 2
                        && pending(&js, &stream).await == (0, 0)
                });
                let consumed = consumer
                    .run_with(db, &policy, |pool, msg| call(run.as_str().into(), pool, msg), done)
                    .await
                    .unwrap();

                assert_eq!(count(db, $count, &run).await, 31, "30 ids and the flaky one");
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(
                    dedup_suite::claims(db, CONSUMER, &poison).await,
                    0,
                    "a failed message leaves no dedup row"
                );
                let dead = messages(&js, &dead_stream).await;
                assert_eq!(dead.len(), 2);
                let mut bodies: Vec<&[u8]> = dead.iter().map(|m| m.payload.as_ref()).collect();
                bodies.sort();
                assert_eq!(bodies, [b"no id".as_slice(), b"poison".as_slice()]);
                for copy in &dead {
                    let headers = &copy.headers;
                    assert_eq!(copy.subject.as_str(), format!("{subject}.dead"));
                    assert_eq!(header(headers, "trace-id"), Some("t-1"), "the original's headers");
                    assert_eq!(header(headers, provenance::STREAM), Some(stream.as_str()));
                    assert_eq!(header(headers, provenance::SUBJECT), Some(subject.as_str()));
                    assert_eq!(header(headers, provenance::CONSUMER), Some("worker"));
                    assert_eq!(header(headers, provenance::DELIVERY_COUNT), Some("1"));
                    let sequence: u64 = header(headers, provenance::SEQUENCE).unwrap().parse().unwrap();
                    let original = js.get_stream(&stream).await.unwrap()
                        .get_raw_message(sequence).await.unwrap();
                    assert_eq!(original.payload, copy.payload, "the sequence names the original");
                    let error = header(headers, provenance::ERROR).expect("the error");
                    if copy.payload.as_ref() == b"poison" {
                        assert_eq!(header(headers, "Message-Id"), Some(poison.as_str()));
                        assert!(error.contains("a poison message"), "{error}");
                    } else {
                        assert!(!error.is_empty());
                    }
                }
                assert_eq!(pending(&js, &stream).await, (0, 0), "nothing pending, nothing in flight");
                assert_eq!(
                    (consumed.acknowledged, consumed.retried, consumed.dead_lettered, consumed.dropped),
                    (41, 1, 2, 0),
                    "{consumed:?}"
                );
                delete(&js, &stream).await;
            }

            /// The batch form (`run_batches`, up to 8 messages a call): the same
            /// messages as above, each settled as its item says — processed or copies
            /// acknowledged, the flaky one retried, the poison one and the one without
            /// an id dead-lettered — with the same effects, dedup rows and dead letters.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_settle_each_message_as_its_item_says() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted", Duration::from_secs(2)).await;
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&js, &subject, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    publish(&js, &subject, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                publish(&js, &subject, Some(&flaky), b"flaky").await;
                let poison = format!("{run}-poison");
                publish(&js, &subject, Some(&poison), b"poison").await;
                publish(&js, &subject, None, b"no id").await;

                let consumer = JetStreamConsumer::new(js.clone(), &stream, "worker").concurrency(2);
                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let dead_stream = format!("{stream}_DEAD");
                let done = until(|| async {
                    count(db, $count, &run).await == 31
                        && stored(&js, &dead_stream).await == 2
                        && pending(&js, &stream).await == (0, 0)
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
                assert_eq!(count(db, $count, &run).await, 31, "30 ids and the flaky one");
                assert_eq!(count(db, $distinct, &run).await, 31, "each once");
                for id in ids.iter().chain([&flaky]) {
                    assert_eq!(dedup_suite::claims(db, BATCHES, id).await, 1, "{id}");
                }
                assert_eq!(
                    dedup_suite::claims(db, BATCHES, &poison).await,
                    0,
                    "a failed message leaves no dedup row"
                );
                let dead = messages(&js, &dead_stream).await;
                assert_eq!(dead.len(), 2);
                let mut bodies: Vec<&[u8]> = dead.iter().map(|m| m.payload.as_ref()).collect();
                bodies.sort();
                assert_eq!(bodies, [b"no id".as_slice(), b"poison".as_slice()]);
                for copy in &dead {
                    let headers = &copy.headers;
                    assert_eq!(copy.subject.as_str(), format!("{subject}.dead"));
                    assert_eq!(header(headers, "trace-id"), Some("t-1"), "the original's headers");
                    assert_eq!(header(headers, provenance::STREAM), Some(stream.as_str()));
                    assert_eq!(header(headers, provenance::SUBJECT), Some(subject.as_str()));
                    assert_eq!(header(headers, provenance::CONSUMER), Some("worker"));
                    assert_eq!(header(headers, provenance::DELIVERY_COUNT), Some("1"));
                    let sequence: u64 = header(headers, provenance::SEQUENCE).unwrap().parse().unwrap();
                    let original = js.get_stream(&stream).await.unwrap()
                        .get_raw_message(sequence).await.unwrap();
                    assert_eq!(original.payload, copy.payload, "the sequence names the original");
                    let error = header(headers, provenance::ERROR).expect("the error");
                    if copy.payload.as_ref() == b"poison" {
                        assert_eq!(header(headers, "Message-Id"), Some(poison.as_str()));
                        assert!(error.contains("a poison message"), "{error}");
                    } else {
                        assert!(!error.is_empty());
                    }
                }
                assert_eq!(pending(&js, &stream).await, (0, 0), "nothing pending, nothing in flight");
                assert_eq!(
                    (consumed.acknowledged, consumed.retried, consumed.dead_lettered, consumed.dropped),
                    (41, 1, 2, 0),
                    "{consumed:?}"
                );
                delete(&js, &stream).await;
            }

            /// A handler that outlasts the ack wait three times over: `+WPI` keeps the
            /// message from redelivery, it is delivered once and acknowledged.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_long_handler_keeps_its_message() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted-long", Duration::from_secs(1)).await;
                let id = format!("{run}-long");
                publish(&js, &subject, Some(&id), b"body").await;
                let consumer = JetStreamConsumer::new(js.clone(), &stream, "worker");
                let db: &sqlx::Pool<$db> = &pool;
                let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
                let slow = |pool, msg: Arc<Message>| {
                    calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let call = call(run.as_str().into(), pool, msg);
                    async move {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        call.await
                    }
                };
                let done = until(|| async {
                    count(db, $count, &run).await == 1 && pending(&js, &stream).await == (0, 0)
                });
                let consumed = consumer.run(db, slow, done).await.unwrap();
                assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1, "delivered once");
                assert_eq!((consumed.acknowledged, consumed.dropped), (1, 0), "{consumed:?}");
                let info = js.get_stream(&stream).await.unwrap().consumer_info("worker").await.unwrap();
                assert_eq!(info.num_redelivered, 0);
                assert_eq!(info.delivered.stream_sequence, 1);
                assert_eq!(dedup_suite::claims(db, CONSUMER, &id).await, 1);
                delete(&js, &stream).await;
            }

            /// Shutdown in the middle of a run: the message in hand finishes and is
            /// acknowledged, the ones pulled and not started are handed back at once
            /// (a NAK, not the 30 s ack wait), and none is lost: effects = acknowledged,
            /// and a second run processes the rest well within the ack wait.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_finishes_the_message_in_hand_and_hands_back_the_rest() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted-stop", Duration::from_secs(30)).await;
                for n in 0..20 {
                    publish(&js, &subject, Some(&format!("{run}-{n}")), b"body").await;
                }
                let consumer = JetStreamConsumer::new(js.clone(), &stream, "worker").batch(20);
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
                assert_eq!(
                    effects + consumed.requeued as i64,
                    20,
                    "pulled ahead and handed back: {consumed:?}"
                );
                assert!(consumed.requeued > 0, "{consumed:?}");
                assert_eq!(consumed.dropped, 0);

                let second = Instant::now();
                let rest = until(|| async {
                    count(db, $count, &run).await == 20 && pending(&js, &stream).await == (0, 0)
                });
                let tokio_timeout = tokio::time::timeout(
                    Duration::from_secs(15),
                    consumer.run(db, |pool, msg| call(run.as_str().into(), pool, msg), rest),
                );
                let again = tokio_timeout.await.expect("handed back at once, not after the ack wait").unwrap();
                assert!(second.elapsed() < Duration::from_secs(15));
                assert_eq!(again.acknowledged as i64, 20 - effects, "{again:?}");
                assert_eq!(count(db, $distinct, &run).await, 20, "each once");
                assert_eq!(pending(&js, &stream).await, (0, 0));
                assert_eq!(stored(&js, &format!("{stream}_DEAD")).await, 0, "none dead");
                delete(&js, &stream).await;
            }

            /// A message not finished within the shutdown deadline: its call is dropped
            /// (its transaction rolled back, no effect, no dedup row) and it is handed
            /// back at once: the next run has it long before the 30 s ack wait.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_past_the_shutdown_deadline_rolls_back_and_goes_back() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted-deadline", Duration::from_secs(30)).await;
                let id = format!("{run}-slow");
                publish(&js, &subject, Some(&id), b"body").await;
                let consumer = JetStreamConsumer::new(js.clone(), &stream, "worker")
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
                assert_eq!(count(db, $count, &run).await, 0);

                let deliveries = Arc::new(std::sync::Mutex::new(Vec::new()));
                let seen = deliveries.clone();
                let name: Arc<str> = run.as_str().into();
                let record = move |pool, msg: Arc<Message>| {
                    seen.lock().unwrap().push(msg.delivery_count());
                    call(name.clone(), pool, msg)
                };
                let done = until(|| async {
                    count(db, $count, &run).await == 1 && pending(&js, &stream).await == (0, 0)
                });
                let again = tokio::time::timeout(Duration::from_secs(15), consumer.run(db, record, done))
                    .await
                    .expect("back at once, not after the ack wait")
                    .unwrap();
                assert_eq!(again.acknowledged, 1);
                assert_eq!(deliveries.lock().unwrap().len(), 1, "delivered once more");
                assert_eq!(dedup_suite::claims(db, CONSUMER, &id).await, 1);
                delete(&js, &stream).await;
            }

            /// The server taken away in the middle of a run (a proxy closes every
            /// connection and refuses new ones for a second): the client connects again,
            /// the consumer pulls again, what it held unsettled comes back after the ack
            /// wait, and every message is processed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lost_connection_is_made_again_and_nothing_is_lost_or_doubled() {
                let (pool, run) = setup().await;
                let js = context().await;
                let (stream, subject) = stream(&js, "hosted-outage", Duration::from_secs(2)).await;
                let ids: Vec<String> = (0..100).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    publish(&js, &subject, Some(id), b"body").await;
                }
                let proxy = Outage::start("127.0.0.1:4222").await;
                let proxied = async_nats::connect(format!("nats://127.0.0.1:{}", proxy.port()))
                    .await
                    .unwrap();
                let consumer = JetStreamConsumer::new(jetstream::new(proxied), &stream, "worker")
                    .batch(10);
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
                    until(|| async {
                        count(db, $count, &run).await == 100 && pending(&js, &stream).await == (0, 0)
                    })
                    .await;
                };
                let consumed: Consumed = consumer.run(db, slow, outage).await.unwrap();
                assert!(consumed.reconnects >= 1, "{consumed:?}");
                assert_eq!(count(db, $count, &run).await, 100, "{consumed:?}");
                assert_eq!(count(db, $distinct, &run).await, 100, "each once");
                for id in &ids {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(pending(&js, &stream).await, (0, 0));
                assert_eq!(stored(&js, &format!("{stream}_DEAD")).await, 0, "none dead");
                println!("{consumed:?}");
                delete(&js, &stream).await;
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
