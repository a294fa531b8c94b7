//! The SIGKILL harness of the hosted Redis Streams consumer: `examples/redis_consumer.rs`,
//! driven through its documented settings only (`REDIS_URL`, `DATABASE_URL`, `STREAM`,
//! `GROUP`, `MEMBER`, `EVENTS_STREAM`, `OUTBOX_TABLE`: the run's own, so that no other
//! service's relay on the same database takes its events), killed with SIGKILL at random moments while it
//! consumes, started again each time (the same member name: it reads what its previous
//! life left pending first), and finally stopped with SIGTERM once everything is in.
//! Nothing is read from the process: the proof is in the database and in Redis.
//!
//! Added: `DEDUP_CRASH_MESSAGES` ids (5,000), a tenth of them twice, and 5 entries
//! without an id (poison: dead-lettered), in a shuffled order. Checked: every order
//! applied once (effects = ids, each once), one dedup row per id, nothing pending in the
//! group, the 5 poison entries in the dead stream, an `accepted` event for every order in
//! the events stream (at least once: a relay killed between its `XADD` and its mark adds
//! it again, with the same `id` field), and the SIGTERM'd process out within its
//! deadline, with status 0.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use super::redis::{REDIS, connection, create_group, delete, entries, length, pending};

use super::common::Life;

const POISON: usize = 5;
const GROUP: &str = "orders";

fn start(program: &std::path::Path, stream: &str, outbox: &str) -> Life {
    Life(
        Command::new(program)
            .env("BROKER", "redis") // the batch form's binary: which service
            .env("BATCH", "4")
            .env("REDIS_URL", REDIS)
            .env("DATABASE_URL", dedup_suite::postgres_url())
            .env("STREAM", stream)
            .env("GROUP", GROUP)
            .env("MEMBER", "orders-0")
            .env("EVENTS_STREAM", format!("{stream}.events"))
            .env("OUTBOX_TABLE", outbox)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the example"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hosted_consumer_is_effectively_once_under_sigkill() {
    under_sigkill(dedup_suite::example_binary(
        "brokers",
        &["redis_consumer"],
        "redis_consumer",
    ))
    .await;
}

/// The same harness on the consumer's batch form: the example's service with
/// `run_batches` (`src/bin/batch_consumer.rs`, batches of up to 4: each life, killed
/// 0 to 40 ms after its first commit, must leave work for the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_batch_form_is_effectively_once_under_sigkill() {
    under_sigkill(super::common::batch_consumer()).await;
}

async fn under_sigkill(program: std::path::PathBuf) {
    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 5_000);
    let kills = dedup_suite::env_number("DEDUP_CRASH_KILLS", 50);
    let seed = dedup_suite::crash_seed();
    let mut random = Shuffle::new(seed);
    let pool = dedup_suite::postgres().await;
    let run = dedup_suite::unique("crash");
    let stream = format!("hosted-{run}");
    let outbox = dedup_suite::unique_table("outbox_redis");
    let (dead, events) = (format!("{stream}.dead"), format!("{stream}.events"));
    let mut redis = connection().await;
    // The group before the entries: the example's would start at the stream's end.
    create_group(&mut redis, &stream, GROUP).await;

    let ids: Vec<String> = (0..messages).map(|n| format!("{run}-{n}")).collect();
    let mut plan: Vec<Option<&str>> = ids.iter().map(|id| Some(id.as_str())).collect();
    plan.extend(ids.iter().step_by(10).map(|id| Some(id.as_str())));
    plan.extend((0..POISON).map(|_| None));
    random.shuffle(&mut plan);
    for chunk in plan.chunks(500) {
        let mut pipeline = redis::pipe();
        for id in chunk {
            pipeline.cmd("XADD").arg(&stream).arg("*");
            match id {
                Some(id) => pipeline.arg("id").arg(*id).arg("body").arg(*id),
                None => pipeline.arg("body").arg("poison"),
            };
            pipeline.ignore();
        }
        let () = pipeline.query_async(&mut redis).await.unwrap();
    }

    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let effects = format!("SELECT COUNT(*) FROM example_orders WHERE message_id LIKE '{run}-%'");
    // The example's table, as the example creates it: counted before its first life
    // (on a fresh database, before any example made it).
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS example_orders (message_id text, body bytea)",
    )
    .await;
    let started = Instant::now();
    let mut killed = 0;
    // Each life is killed once it has applied an order, 0 to 40 ms later: in the middle
    // of the work whatever the machine's speed (between a COMMIT and its `XACK`
    // included). Lives that finish the work end the killing.
    while killed < kills {
        let before = count(effects.clone()).await;
        if before == messages as i64 {
            break;
        }
        let mut child = start(&program, &stream, &outbox);
        let born = Instant::now();
        while count(effects.clone()).await == before {
            assert!(
                born.elapsed() < Duration::from_secs(30),
                "a life applied nothing"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(random.next_u64() % 40)).await;
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        killed += 1;
    }
    let applied_under_kills = count(effects.clone()).await;
    assert!(
        killed >= kills.min(50),
        "only {killed} kills landed before the work was done: publish more"
    );

    // The last life: everything in, then SIGTERM.
    let mut child = start(&program, &stream, &outbox);
    let patience = Duration::from_secs(120);
    let last = Instant::now();
    // Every event enqueued and marked sent by the relay.
    let sent =
        format!("SELECT COUNT(*) FROM {outbox} WHERE destination = '{events}' AND state = 2");
    loop {
        let done = count(effects.clone()).await == messages as i64
            && count(sent.clone()).await == messages as i64
            && pending(&mut redis, &stream, GROUP).await == 0
            && length(&mut redis, &dead).await == POISON as u64;
        if done {
            break;
        }
        assert!(
            last.elapsed() < patience,
            "not done within {patience:?} after the kills"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let stopping = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(15),
            "not out within its deadline"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "SIGTERM: a clean exit ({status})");

    let distinct = format!(
        "SELECT COUNT(DISTINCT message_id) FROM example_orders WHERE message_id LIKE '{run}-%'"
    );
    let dedup = format!(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'orders' AND message_id LIKE '{run}-%'"
    );
    let (applied, applied_once, rows) = (
        count(effects).await,
        count(distinct).await,
        count(dedup).await,
    );
    let letters = entries(&mut redis, &dead).await;
    let sent_events = entries(&mut redis, &events).await;
    let distinct_events: BTreeSet<&[u8]> = sent_events
        .iter()
        .filter_map(|fields| fields.get("id").map(Vec::as_slice))
        .collect();
    eprintln!(
        "hosted Redis Streams consumer under SIGKILL (seed {seed}): {killed} kills in {} \
         lives, {applied_under_kills} orders applied before the last life; effects \
         {applied} for {messages} ids ({applied_once} distinct); {rows} dedup rows; dead \
         letters {}; events {} ({} distinct); {:.1} s",
        killed + 1,
        letters.len(),
        sent_events.len(),
        distinct_events.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        (applied, applied_once, rows),
        (messages as i64, messages as i64, messages as i64)
    );
    assert_eq!(
        pending(&mut redis, &stream, GROUP).await,
        0,
        "nothing pending"
    );
    assert_eq!(letters.len(), POISON, "the poison entries, once each");
    for letter in &letters {
        assert_eq!(letter.get("body").map(Vec::as_slice), Some(&b"poison"[..]));
        assert!(!letter.contains_key("id"), "{letter:?}");
        assert_eq!(
            letter.get("dead-stream").map(Vec::as_slice),
            Some(stream.as_bytes())
        );
    }
    assert_eq!(distinct_events.len(), messages, "an event for every order");
    delete(&mut redis, &stream).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {outbox}")))
        .execute(&pool)
        .await
        .unwrap();
}
