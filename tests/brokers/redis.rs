//! Redis Streams: a consumer group, `XAUTOCLAIM` after a kill.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use ::redis::Value;
use ::redis::aio::MultiplexedConnection;

use crate::checks::*;
use crate::harness::*;

/// A killed consumer's pending entries are taken over by `XAUTOCLAIM` after this long.
const CLAIM_IDLE: Duration = Duration::from_secs(2);

fn redis_url() -> String {
    std::env::var("DEDUP_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

async fn cleanup(redis: &mut MultiplexedConnection, stream: &str) {
    let deleted: Result<i64, _> = ::redis::cmd("DEL")
        .arg(stream)
        .arg(format!("{stream}:dead"))
        .query_async(redis)
        .await;
    if let Err(error) = deleted {
        eprintln!("could not delete the streams {stream} and {stream}:dead: {error}");
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(text) => text.clone(),
        Value::Int(n) => n.to_string(),
        Value::Nil => String::new(),
        other => panic!("expected a string, got {other:?}"),
    }
}

fn items(value: &Value) -> &[Value] {
    match value {
        Value::Array(items) => items,
        other => panic!("expected an array, got {other:?}"),
    }
}

/// Adds `published` to `stream`, a field `id` (when it has one) and a field `body`.
async fn publish_all(redis: &mut MultiplexedConnection, stream: &str, published: &[Publish]) {
    for chunk in published.chunks(500) {
        let mut pipe = ::redis::pipe();
        for message in chunk {
            let add = pipe.cmd("XADD").arg(stream).arg("*");
            if let Some(id) = &message.id {
                add.arg("id").arg(id);
            }
            add.arg("body").arg(&message.body).ignore();
        }
        let () = pipe.query_async(redis).await.expect("XADD the messages");
    }
}

/// Asserts that `group` has no pending entry and has read up to the stream's last
/// entry; returns that entry's id.
async fn settled(redis: &mut MultiplexedConnection, stream: &str, group: &str) -> String {
    let summary: Value = ::redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(redis)
        .await
        .expect("XPENDING");
    let pending = items(&summary).first().map(text).unwrap_or_default();
    assert_eq!(
        pending, "0",
        "entries left pending (read and not acknowledged): {summary:?}"
    );
    let last: Value = ::redis::cmd("XREVRANGE")
        .arg(stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(redis)
        .await
        .expect("XREVRANGE");
    let last = items(&last)
        .first()
        .map(|entry| text(&items(entry)[0]))
        .expect("the stream's last entry");
    let groups: Value = ::redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(redis)
        .await
        .expect("XINFO GROUPS");
    let info: HashMap<String, String> = items(&groups)
        .iter()
        .map(items)
        .find(|fields| {
            fields
                .chunks_exact(2)
                .any(|pair| text(&pair[0]) == "name" && text(&pair[1]) == group)
        })
        .expect("the consumer group")
        .chunks_exact(2)
        .map(|pair| (text(&pair[0]), text(&pair[1])))
        .collect();
    assert_eq!(
        info.get("last-delivered-id"),
        Some(&last),
        "the group has read every entry up to the stream's last: {info:?}"
    );
    assert_eq!(
        info.get("pending").map(String::as_str),
        Some("0"),
        "the group's pending entries: {info:?}"
    );
    last
}

/// The entries of `{stream}:dead`, and their bodies.
async fn dead_letters(redis: &mut MultiplexedConnection, stream: &str) -> (usize, HashSet<String>) {
    let entries: Value = ::redis::cmd("XRANGE")
        .arg(format!("{stream}:dead"))
        .arg("-")
        .arg("+")
        .query_async(redis)
        .await
        .expect("XRANGE the dead letters");
    let entries = items(&entries);
    let bodies = entries
        .iter()
        .map(|entry| {
            let fields = items(&items(entry)[1]);
            fields
                .chunks_exact(2)
                .find(|pair| text(&pair[0]) == "body")
                .map(|pair| text(&pair[1]))
                .unwrap_or_default()
        })
        .collect();
    (entries.len(), bodies)
}

/// The crash harness on Redis Streams: `examples/redis_streams.rs`, 4 consumers of one
/// group (names reused across restarts), `XAUTOCLAIM` after 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_consumer_is_effectively_once_under_sigkill() {
    harness("Redis Streams", &[]).await;
}

/// Batch mode: `examples/redis_streams.rs` with `BATCH=16` takes the entries of one read
/// (up to 16) in one transaction (`dedup_runtime::batch`) and acknowledges them with one
/// `XACK` after the commit; kills land between the two, with up to 16 entries in the
/// window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_batch_consumer_is_effectively_once_under_sigkill() {
    harness("Redis Streams, batches of 16", &[("BATCH", "16")]).await;
}

/// The Redis Streams crash harness, `title` in its report, `more` in the consumer's
/// environment.
async fn harness(title: &str, more: &[(&'static str, &str)]) {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("redis");
    let stream = format!("dedup-crash:{run}");
    let group = "crash-harness";
    let url = redis_url();
    let client = ::redis::Client::open(url.as_str())
        .unwrap_or_else(|error| panic!("DEDUP_TEST_REDIS_URL {url:?}: {error}"));
    let mut redis = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|error| {
            panic!(
                "Redis is not reachable at {url}: {error}. Start it (see .ci/run) or set \
                 DEDUP_TEST_REDIS_URL"
            )
        });
    let pool = dedup_suite::postgres().await;

    let mut cleanup_redis = redis.clone();
    let body = async {
        // The group first, reading from the stream's start, as the example would
        // create it.
        let () = ::redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut redis)
            .await
            .expect("create the consumer group");
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS redis_example_effects (message_id text NOT \
             NULL, body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .expect("create the effects table");

        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        publish_all(&mut redis, &stream, &published).await;
        let length: usize = ::redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut redis)
            .await
            .expect("XLEN");
        assert_eq!(
            length,
            published.len(),
            "entries in the stream after publishing"
        );

        let mut env = vec![
            ("REDIS_URL", url.clone()),
            ("DATABASE_URL", database_url()),
            ("STREAM", stream.clone()),
            ("GROUP", group.to_owned()),
            ("CONSUMER_PREFIX", "crash-harness".to_owned()),
            ("CONSUMERS", CONSUMERS.to_owned()),
            ("PREFETCH", PREFETCH.to_owned()),
            ("CLAIM_IDLE_MS", CLAIM_IDLE.as_millis().to_string()),
            // Restarts count deliveries too (a re-read of the pending entries is
            // one): a bound the kills cannot reach, as on JetStream.
            ("MAX_DELIVER", "100".to_owned()),
            ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
        ];
        env.extend(
            more.iter()
                .map(|(name, value)| (*name, (*value).to_owned())),
        );
        // The last life must outlast the claim idle time, to see entries left
        // pending (for a retry, or with a consumer no process runs) taken over.
        let idle = CLAIM_IDLE + Duration::from_millis(1500);
        let under_test = Subject {
            example: "redis_streams",
            effects_table: "redis_example_effects",
            consumer: "redis-example",
        };
        let (tally, stored) =
            crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
        let last = settled(&mut redis, &stream, group).await;
        let (dead_count, dead_bodies) = dead_letters(&mut redis, &stream).await;
        // A crash between the copy to the dead-letter stream and the `XACK` copies a
        // poison message again on its redelivery: at least once each, nothing else.
        assert_eq!(
            dead_bodies,
            poison_bodies(),
            "the dead-letter stream holds the poison messages and nothing else"
        );
        report(
            title,
            &published,
            &stored,
            &tally,
            &scale,
            dead_count,
            &format!(
                "group: 0 pending entries, last delivered id the stream's last entry \
                 ({last}, {length} entries)"
            ),
            started.elapsed(),
        );
    };
    with_cleanup(body, cleanup(&mut cleanup_redis, &stream)).await;
    forget_run(&pool, "redis_example_effects", "redis-example", &run).await;
}
