//! `dedup_runtime::redis::RedisStreamsConsumer` against the real Redis, on PostgreSQL,
//! MariaDB and SQLite.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dedup_runtime::AckPolicy;
use dedup_runtime::consume::{Consumed, Message};
use dedup_runtime::redis::RedisStreamsConsumer;
use dedup_suite::outage::Outage;
use redis::Value;
use redis::aio::MultiplexedConnection;

use super::common::{count, fails_first_time, fails_permanently, until};

pub(crate) const REDIS: &str = "redis://127.0.0.1:6379";
const GROUP: &str = "hosted";

pub(crate) fn client() -> redis::Client {
    redis::Client::open(REDIS).unwrap()
}

/// A connection of the test's own.
pub(crate) async fn connection() -> MultiplexedConnection {
    client()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|error| panic!("Redis is not reachable at {REDIS}: {error}"))
}

/// Adds an entry to `stream`: the field `id` (none when `None`), `body` and `trace-id`.
pub(crate) async fn add(
    redis: &mut MultiplexedConnection,
    stream: &str,
    id: Option<&str>,
    body: &[u8],
) {
    let mut command = redis::cmd("XADD");
    command.arg(stream).arg("*");
    if let Some(id) = id {
        command.arg("id").arg(id);
    }
    command.arg("body").arg(body).arg("trace-id").arg("t-1");
    let _: String = command.query_async(redis).await.unwrap();
}

/// `XGROUP CREATE <stream> <group> 0 MKSTREAM`.
pub(crate) async fn create_group(redis: &mut MultiplexedConnection, stream: &str, group: &str) {
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(redis)
        .await
        .unwrap();
}

/// The group's pending entries (`XPENDING <stream> <group>`'s count); `u64::MAX` while
/// the group does not exist.
pub(crate) async fn pending(redis: &mut MultiplexedConnection, stream: &str, group: &str) -> u64 {
    let summary: redis::RedisResult<Value> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(redis)
        .await;
    match summary {
        Ok(Value::Array(items)) => match items.first() {
            Some(Value::Int(n)) => u64::try_from(*n).unwrap(),
            other => panic!("XPENDING: {other:?}"),
        },
        Ok(other) => panic!("XPENDING: {other:?}"),
        Err(_) => u64::MAX,
    }
}

/// `XLEN`.
pub(crate) async fn length(redis: &mut MultiplexedConnection, stream: &str) -> u64 {
    redis::cmd("XLEN")
        .arg(stream)
        .query_async(redis)
        .await
        .unwrap()
}

/// The entries of `stream`, each its fields by name.
pub(crate) async fn entries(
    redis: &mut MultiplexedConnection,
    stream: &str,
) -> Vec<HashMap<String, Vec<u8>>> {
    let found: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(redis)
        .await
        .unwrap();
    found.into_iter().map(|(_, fields)| fields).collect()
}

pub(crate) async fn delete(redis: &mut MultiplexedConnection, stream: &str) {
    let _: u64 = redis::cmd("DEL")
        .arg(stream)
        .arg(format!("{stream}.dead"))
        .arg(format!("{stream}.events"))
        .query_async(redis)
        .await
        .unwrap();
}

fn text(fields: &HashMap<String, Vec<u8>>, name: &str) -> String {
    String::from_utf8(fields.get(name).cloned().unwrap_or_default()).unwrap()
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr,
     effects = $effects:literal, insert = $insert:literal,
     count = $count:literal, distinct = $distinct:literal) => {
        mod $backend {
            use super::*;

            const CONSUMER: &str = "redis-hosted";
            const BATCHES: &str = "redis-batches";

            /// The effect: one row per message, no unique constraint (a message applied
            /// twice would show as two rows), in the dedup record's transaction.
            #[dedup_runtime::idempotent(consumer = "redis-hosted", key = msg.id())]
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
            #[dedup_runtime::idempotent(consumer = "redis-batches", batch = fresh, key = |msg| msg.id())]
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

            fn consumer(stream: &str, member: &str) -> RedisStreamsConsumer {
                RedisStreamsConsumer::new(client(), stream, GROUP, member)
                    .group_from_start(true)
                    .block(Duration::from_millis(200))
            }

            /// Each entry processed once and acknowledged after its commit, copies found
            /// duplicates, a transient failure retried in process, a poison entry and one
            /// without an id dead-lettered with their fields and provenance: the effects
            /// and dedup rows in the database, nothing pending, the dead stream holding
            /// the two.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn settles_after_commit_retries_and_dead_letters() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted");
                let dead = format!("{stream}.dead");
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    add(&mut redis, &stream, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    add(&mut redis, &stream, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                let poison = format!("{run}-poison");
                add(&mut redis, &stream, Some(&flaky), b"flaky").await;
                add(&mut redis, &stream, Some(&poison), b"poison").await;
                add(&mut redis, &stream, None, b"no id").await;

                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = async {
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, dead, run) = (&stream, &dead, &run);
                        async move {
                            count(db, $count, run).await == 31
                                && length(&mut redis, dead).await == 2
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
                    })
                    .await;
                };
                let consumed = consumer(&stream, "member-1")
                    .batch(8)
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
                let mut letters = entries(&mut redis, &dead).await;
                letters.sort_by_key(|fields| text(fields, "body"));
                assert_eq!(letters.len(), 2);
                let (no_id, poisoned) = (&letters[0], &letters[1]);
                assert_eq!(text(no_id, "body"), "no id");
                assert!(!no_id.contains_key("id"));
                assert_eq!(text(poisoned, "body"), "poison");
                assert_eq!(text(poisoned, "id"), poison);
                for letter in [no_id, poisoned] {
                    assert_eq!(text(letter, "trace-id"), "t-1");
                    assert_eq!(text(letter, "dead-stream"), stream);
                    assert_eq!(text(letter, "dead-group"), GROUP);
                    assert_eq!(text(letter, "dead-consumer"), "member-1");
                    assert_eq!(text(letter, "dead-deliveries"), "1");
                    assert!(text(letter, "dead-entry").contains('-'), "{letter:?}");
                    assert!(!text(letter, "dead-error").is_empty(), "{letter:?}");
                }
                assert!(text(poisoned, "dead-error").contains("poison"), "{poisoned:?}");
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 0, "all acknowledged");
                assert_eq!(length(&mut redis, &stream).await, 43, "the stream untouched");
                assert_eq!(
                    (consumed.acknowledged, consumed.retried, consumed.dead_lettered),
                    (41, 1, 2),
                    "{consumed:?}"
                );
                delete(&mut redis, &stream).await;
            }

            /// The batch form (`run_batches`, up to 8 messages a call): the same
            /// messages as above, each settled as its item says — processed or copies
            /// acknowledged, the flaky one retried, the poison one and the one without
            /// an id dead-lettered — with the same effects, dedup rows and dead letters.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_settle_each_message_as_its_item_says() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted");
                let dead = format!("{stream}.dead");
                let ids: Vec<String> = (0..30).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    add(&mut redis, &stream, Some(id), b"body").await;
                }
                for id in ids.iter().step_by(3) {
                    add(&mut redis, &stream, Some(id), b"body").await; // a copy
                }
                let flaky = format!("{run}-flaky");
                let poison = format!("{run}-poison");
                add(&mut redis, &stream, Some(&flaky), b"flaky").await;
                add(&mut redis, &stream, Some(&poison), b"poison").await;
                add(&mut redis, &stream, None, b"no id").await;

                let policy = AckPolicy::new()
                    .retry_after(Duration::from_millis(10), Duration::from_millis(10));
                let db: &sqlx::Pool<$db> = &pool;
                let done = async {
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, dead, run) = (&stream, &dead, &run);
                        async move {
                            count(db, $count, run).await == 31
                                && length(&mut redis, dead).await == 2
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
                    })
                    .await;
                };
                let largest = std::sync::atomic::AtomicUsize::new(0);
                let consumed = consumer(&stream, "member-1")
                    .batch(8)
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
                let mut letters = entries(&mut redis, &dead).await;
                letters.sort_by_key(|fields| text(fields, "body"));
                assert_eq!(letters.len(), 2);
                let (no_id, poisoned) = (&letters[0], &letters[1]);
                assert_eq!(text(no_id, "body"), "no id");
                assert!(!no_id.contains_key("id"));
                assert_eq!(text(poisoned, "body"), "poison");
                assert_eq!(text(poisoned, "id"), poison);
                for letter in [no_id, poisoned] {
                    assert_eq!(text(letter, "trace-id"), "t-1");
                    assert_eq!(text(letter, "dead-stream"), stream);
                    assert_eq!(text(letter, "dead-group"), GROUP);
                    assert_eq!(text(letter, "dead-consumer"), "member-1");
                    assert_eq!(text(letter, "dead-deliveries"), "1");
                    assert!(text(letter, "dead-entry").contains('-'), "{letter:?}");
                    assert!(!text(letter, "dead-error").is_empty(), "{letter:?}");
                }
                assert!(text(poisoned, "dead-error").contains("poison"), "{poisoned:?}");
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 0, "all acknowledged");
                assert_eq!(length(&mut redis, &stream).await, 43, "the stream untouched");
                assert_eq!(
                    (consumed.acknowledged, consumed.retried, consumed.dead_lettered),
                    (41, 1, 2),
                    "{consumed:?}"
                );
                delete(&mut redis, &stream).await;
            }

            /// An entry delivered more often than `max_deliveries` (a poison that kills
            /// the process each time) is dead-lettered without calling the handler; the
            /// others go on.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_entry_over_max_deliveries_is_dead_lettered_unprocessed() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted-max");
                let dead = format!("{stream}.dead");
                create_group(&mut redis, &stream, GROUP).await;
                let (killer, fine) = (format!("{run}-killer"), format!("{run}-fine"));
                add(&mut redis, &stream, Some(&killer), b"body").await;
                add(&mut redis, &stream, Some(&fine), b"body").await;
                // Delivered to a member that died with them, the first 20 times over.
                let _: Value = redis::cmd("XREADGROUP")
                    .arg("GROUP").arg(GROUP).arg("crashed").arg("COUNT").arg(2)
                    .arg("STREAMS").arg(&stream).arg(">")
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                let first: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
                    .arg(&stream).arg("-").arg("+").arg("COUNT").arg(1)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                let _: Value = redis::cmd("XCLAIM")
                    .arg(&stream).arg(GROUP).arg("crashed").arg(0).arg(&first[0].0)
                    .arg("RETRYCOUNT").arg(20)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(150)).await;

                let calls = Arc::new(AtomicU64::new(0));
                let counted = {
                    let calls = calls.clone();
                    let run: Arc<str> = run.as_str().into();
                    move |pool, msg: Arc<Message>| {
                        calls.fetch_add(1, Ordering::Relaxed);
                        call(run.clone(), pool, msg)
                    }
                };
                let db: &sqlx::Pool<$db> = &pool;
                let done = async {
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, dead, run) = (&stream, &dead, &run);
                        async move {
                            count(db, $count, run).await == 1
                                && length(&mut redis, dead).await == 1
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
                    })
                    .await;
                };
                let consumed = consumer(&stream, "member-2")
                    .claim_idle(Duration::from_millis(100))
                    .max_deliveries(5)
                    .run(db, counted, done)
                    .await
                    .unwrap();
                assert_eq!(calls.load(Ordering::Relaxed), 1, "the handler for `fine` only");
                assert_eq!(dedup_suite::claims(db, CONSUMER, &fine).await, 1);
                assert_eq!(dedup_suite::claims(db, CONSUMER, &killer).await, 0);
                let letters = entries(&mut redis, &dead).await;
                assert_eq!(text(&letters[0], "id"), killer);
                assert_eq!(text(&letters[0], "dead-deliveries"), "21");
                assert_eq!(text(&letters[0], "dead-consumer"), "member-2");
                assert!(text(&letters[0], "dead-error").contains("max_deliveries"));
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 0);
                assert_eq!(
                    (consumed.acknowledged, consumed.dead_lettered),
                    (1, 1),
                    "{consumed:?}"
                );
                delete(&mut redis, &stream).await;
            }

            /// A member that read entries and died without acknowledging them: another
            /// member takes them over with `XAUTOCLAIM` once idle for `claim_idle`, and
            /// every entry is processed once; one deleted from the stream meanwhile (which
            /// Redis 7 reports apart) leaves nothing pending.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crashed_members_pending_entries_are_claimed() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted-claim");
                create_group(&mut redis, &stream, GROUP).await;
                let ids: Vec<String> = (0..20).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    add(&mut redis, &stream, Some(id), b"body").await;
                }
                let _: Value = redis::cmd("XREADGROUP")
                    .arg("GROUP").arg(GROUP).arg("crashed").arg("COUNT").arg(10)
                    .arg("STREAMS").arg(&stream).arg(">")
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 10);
                let first: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
                    .arg(&stream).arg("-").arg("+").arg("COUNT").arg(1)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                let _: u64 = redis::cmd("XDEL")
                    .arg(&stream).arg(&first[0].0)
                    .query_async(&mut redis)
                    .await
                    .unwrap();

                let db: &sqlx::Pool<$db> = &pool;
                let done = async {
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, run) = (&stream, &run);
                        async move {
                            count(db, $count, run).await == 19
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
                    })
                    .await;
                };
                let consumed = consumer(&stream, "member-3")
                    .claim_idle(Duration::from_millis(300))
                    .run(db, |pool, msg| call(run.as_str().into(), pool, msg), done)
                    .await
                    .unwrap();
                assert_eq!(count(db, $count, &run).await, 19);
                assert_eq!(count(db, $distinct, &run).await, 19, "each once");
                assert_eq!(dedup_suite::claims(db, CONSUMER, &ids[0]).await, 0, "deleted");
                for id in &ids[1..] {
                    assert_eq!(dedup_suite::claims(db, CONSUMER, id).await, 1, "{id}");
                }
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 0, "the deleted one too");
                assert_eq!(consumed.acknowledged, 19, "{consumed:?}");
                delete(&mut redis, &stream).await;
            }

            /// Shutdown in the middle of a run: the entry in hand finishes and is
            /// acknowledged, the ones read and not started stay pending with the member,
            /// and its next start processes them: effects each once in the end.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_finishes_the_entry_in_hand_and_leaves_the_rest_pending() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted-stop");
                for n in 0..20 {
                    add(&mut redis, &stream, Some(&format!("{run}-{n}")), b"body").await;
                }
                let db: &sqlx::Pool<$db> = &pool;
                let slow = |pool, msg| {
                    let call = call(run.as_str().into(), pool, msg);
                    async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        call.await
                    }
                };
                let stop = until(|| async { count(db, $count, &run).await >= 3 });
                let consumed = consumer(&stream, "member-4").run(db, slow, stop).await.unwrap();
                let effects = count(db, $count, &run).await;
                assert_eq!(effects, consumed.acknowledged as i64, "{consumed:?}");
                assert!(consumed.requeued > 0, "read and left pending: {consumed:?}");
                assert_eq!(consumed.dropped, 0);
                assert_eq!(
                    pending(&mut redis, &stream, GROUP).await,
                    consumed.requeued,
                    "the rest pending with the member"
                );

                // The next start: its own pending entries first, then the new ones.
                let done = async {
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, run) = (&stream, &run);
                        async move {
                            count(db, $count, run).await == 20
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
                    })
                    .await;
                };
                let again = consumer(&stream, "member-4")
                    .run(db, |pool, msg| call(run.as_str().into(), pool, msg), done)
                    .await
                    .unwrap();
                assert_eq!(again.acknowledged as i64, 20 - effects, "{again:?}");
                assert_eq!(count(db, $distinct, &run).await, 20, "each once");
                assert_eq!(count(db, $count, &run).await, 20);
                delete(&mut redis, &stream).await;
            }

            /// An entry not finished within the shutdown deadline: its call is dropped
            /// (its transaction rolled back, no effect, no dedup row) and it stays
            /// pending.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_entry_past_the_shutdown_deadline_rolls_back_and_stays_pending() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted-deadline");
                let id = format!("{run}-slow");
                add(&mut redis, &stream, Some(&id), b"body").await;
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
                let consumed = consumer(&stream, "member-5")
                    .shutdown_deadline(Duration::from_millis(100))
                    .run(db, stuck, async { started.notified().await })
                    .await
                    .unwrap();
                assert!(begun.elapsed() < Duration::from_secs(20), "out within its deadline");
                assert_eq!((consumed.acknowledged, consumed.requeued), (0, 1), "{consumed:?}");
                assert_eq!(dedup_suite::claims(db, CONSUMER, &id).await, 0);
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 1, "still pending");
                delete(&mut redis, &stream).await;
            }

            /// Redis taken away in the middle of a run (a proxy closes every connection
            /// and refuses new ones for a second): the consumer connects again, reads
            /// its own pending entries again, and every entry is processed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lost_connection_is_made_again_and_nothing_is_lost_or_doubled() {
                let (pool, run) = setup().await;
                let mut redis = connection().await;
                let stream = dedup_suite::unique("hosted-outage");
                let ids: Vec<String> = (0..100).map(|n| format!("{run}-{n}")).collect();
                for id in &ids {
                    add(&mut redis, &stream, Some(id), b"body").await;
                }
                let proxy = Outage::start("127.0.0.1:6379").await;
                let through = redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port()))
                    .unwrap();
                let consumer = RedisStreamsConsumer::new(through, &stream, GROUP, "member-6")
                    .group_from_start(true)
                    .block(Duration::from_millis(200))
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
                    let redis = connection().await;
                    until(|| {
                        let mut redis = redis.clone();
                        let (stream, run) = (&stream, &run);
                        async move {
                            count(db, $count, run).await == 100
                                && pending(&mut redis, stream, GROUP).await == 0
                        }
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
                assert_eq!(pending(&mut redis, &stream, GROUP).await, 0);
                assert_eq!(length(&mut redis, &format!("{stream}.dead")).await, 0, "none dead");
                println!("{consumed:?}");
                delete(&mut redis, &stream).await;
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
