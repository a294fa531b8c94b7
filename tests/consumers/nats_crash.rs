//! The SIGKILL harness of the hosted NATS JetStream consumer: `examples/nats_consumer.rs`,
//! driven through its documented settings only (`NATS_URL`, `DATABASE_URL`, `STREAM`,
//! `SUBJECT`, `EVENTS_SUBJECT`, `ACK_WAIT_MS`), killed with SIGKILL at random moments
//! while it consumes, started again each time, and finally stopped with SIGTERM once
//! everything is in. Nothing is read from the process: the proof is in the database and
//! the server.
//!
//! Published: `DEDUP_CRASH_MESSAGES` ids (5,000), a tenth of them twice, and 5 messages
//! without an id (poison: dead-lettered; each with a `Nats-Msg-Id` of its own, which the
//! dead-letter copy keeps, so that the dead stream drops a second copy made by a life
//! killed between the copy and its `+TERM`), in a shuffled order. The durable consumer's
//! ack wait is 2 s, so that what a killed life held comes back soon. Checked: every order
//! applied once (effects = ids, each once), one dedup row per id, nothing pending or in
//! flight in the durable consumer, the 5 poison messages in the dead stream with their
//! provenance, an `accepted` event for every order in the events stream (at least once: a
//! relay killed between its send and its mark sends again, with the same id), and the
//! SIGTERM'd process out within its deadline, with status 0.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use dedup_runtime::async_nats::provenance;
use dedup_suite::Shuffle;

use super::nats::{NATS, context, messages, pending_in, stored};

use super::common::Life;

const POISON: usize = 5;

fn start(program: &std::path::Path, stream: &str) -> Life {
    Life(
        Command::new(program)
            .env("BROKER", "nats") // the batch form's binary: which service
            .env("BATCH", "4")
            .env("NATS_URL", NATS)
            .env("DATABASE_URL", dedup_suite::postgres_url())
            .env("STREAM", stream)
            .env("SUBJECT", format!("{stream}.orders"))
            .env("EVENTS_SUBJECT", format!("{stream}.events"))
            .env("ACK_WAIT_MS", "2000")
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
        &["nats_consumer"],
        "nats_consumer",
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
    let messages_n = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 5_000);
    let kills = dedup_suite::env_number("DEDUP_CRASH_KILLS", 50);
    let seed = dedup_suite::crash_seed();
    let mut random = Shuffle::new(seed);
    let pool = dedup_suite::postgres().await;
    let run = dedup_suite::unique("crash");
    let stream = format!("hosted-{run}");
    let subject = format!("{stream}.orders");
    let (dead_stream, events_stream) = (format!("{stream}_DEAD"), format!("{stream}_EVENTS"));
    let js = context().await;
    dedup_suite::jetstream::streams(&js, NATS, &stream, &subject).await;

    let ids: Vec<String> = (0..messages_n).map(|n| format!("{run}-{n}")).collect();
    let mut plan: Vec<Option<&str>> = ids.iter().map(|id| Some(id.as_str())).collect();
    plan.extend(ids.iter().step_by(10).map(|id| Some(id.as_str())));
    plan.extend((0..POISON).map(|_| None));
    random.shuffle(&mut plan);
    let mut acks = Vec::with_capacity(plan.len());
    let mut poison = 0;
    for id in &plan {
        let mut headers = HeaderMap::new();
        let body = match id {
            Some(id) => {
                headers.insert("Message-Id", *id);
                id.as_bytes().to_vec()
            }
            None => {
                poison += 1;
                headers.insert("Nats-Msg-Id", format!("{run}-poison-{poison}").as_str());
                b"poison".to_vec()
            }
        };
        let ack = js
            .publish_with_headers(subject.clone(), headers, body.into())
            .await
            .unwrap();
        acks.push(ack);
        // The context holds at most 5,000 unanswered publications, and waits for room.
        if acks.len() == 1_000 {
            for ack in acks.drain(..) {
                ack.await.unwrap();
            }
        }
    }
    for ack in acks {
        ack.await.unwrap();
    }
    assert_eq!(stored(&js, &stream).await, plan.len() as u64);

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
    // of the work whatever the machine's speed (between a COMMIT and its
    // acknowledgement included). Lives that finish the work end the killing.
    while killed < kills {
        let before = count(effects.clone()).await;
        if before == messages_n as i64 {
            break;
        }
        let mut child = start(&program, &stream);
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
    let mut child = start(&program, &stream);
    let patience = Duration::from_secs(120);
    let last = Instant::now();
    // Every event enqueued and marked sent by the relay (the events' stream may hold
    // copies of some before the others are in).
    let sent = format!(
        "SELECT COUNT(*) FROM nats_orders_outbox WHERE destination = '{stream}.events' AND state = 2"
    );
    loop {
        let done = count(effects.clone()).await == messages_n as i64
            && count(sent.clone()).await == messages_n as i64
            && pending_in(&js, &stream, "orders").await == (0, 0)
            && stored(&js, &dead_stream).await == POISON as u64;
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
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'nats-orders' AND message_id LIKE '{run}-%'"
    );
    let (applied, applied_once, rows) = (
        count(effects).await,
        count(distinct).await,
        count(dedup).await,
    );
    let dead = messages(&js, &dead_stream).await;
    let events = messages(&js, &events_stream).await;
    let event_ids: BTreeSet<&str> = events
        .iter()
        .filter_map(|event| event.headers.get("Message-Id").map(|id| id.as_str()))
        .collect();
    eprintln!(
        "hosted NATS JetStream consumer under SIGKILL (seed {seed}): {killed} kills in {} \
         lives, {applied_under_kills} orders applied before the last life; effects {applied} \
         for {messages_n} ids ({applied_once} distinct); {rows} dedup rows; dead letters {}; \
         events {} ({} distinct); {:.1} s",
        killed + 1,
        dead.len(),
        events.len(),
        event_ids.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        (applied, applied_once, rows),
        (messages_n as i64, messages_n as i64, messages_n as i64)
    );
    assert_eq!(
        pending_in(&js, &stream, "orders").await,
        (0, 0),
        "nothing pending, nothing in flight"
    );
    assert_eq!(dead.len(), POISON, "the poison messages, once each");
    let poison_ids: BTreeSet<&str> = dead
        .iter()
        .map(|copy| {
            assert_eq!(copy.payload.as_ref(), b"poison");
            assert!(copy.headers.get("Message-Id").is_none());
            let from = copy.headers.get(provenance::STREAM).map(|v| v.as_str());
            assert_eq!(from, Some(stream.as_str()));
            copy.headers.get("Nats-Msg-Id").unwrap().as_str()
        })
        .collect();
    assert_eq!(poison_ids.len(), POISON);
    assert_eq!(event_ids.len(), messages_n, "an event for every order");
    for name in [&stream, &dead_stream, &events_stream] {
        js.delete_stream(name).await.unwrap();
    }
}
