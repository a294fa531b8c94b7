//! The SIGKILL harness of the hosted RabbitMQ consumer: `examples/rabbitmq_consumer.rs`,
//! driven through its documented settings only (`AMQP_URL`, `DATABASE_URL`, `QUEUE`,
//! `EVENTS_QUEUE`), killed with SIGKILL at random moments while it consumes, started
//! again each time, and finally stopped with SIGTERM once everything is in. Nothing is
//! read from the process: the proof is in the database and the broker.
//!
//! Published: `DEDUP_CRASH_MESSAGES` ids (5,000), a tenth of them twice, and 5 messages
//! without an id (poison: dead-lettered), in a shuffled order. Checked: every order
//! applied once (effects = ids, each once), one dedup row per id, the queue empty with no
//! consumer, the 5 poison messages in the dead queue, an `accepted` event for every
//! order in the events queue (at least once: a relay killed between its send and its
//! mark sends again, with the same id), and the SIGTERM'd process out within its
//! deadline, with status 0.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Channel};

use super::rabbitmq::{AMQP, channel, depth};

use super::common::Life;

const POISON: usize = 5;

fn start(program: &std::path::Path, queue: &str) -> Life {
    Life(
        Command::new(program)
            .env("BROKER", "rabbitmq") // the batch form's binary: which service
            .env("BATCH", "4")
            .env("AMQP_URL", AMQP)
            .env("DATABASE_URL", dedup_suite::postgres_url())
            .env("QUEUE", queue)
            .env("EVENTS_QUEUE", format!("{queue}.events"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the example"),
    )
}

/// Message ids in `queue`, taken out.
async fn ids_in(channel: &Channel, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        ids.push(
            message
                .properties
                .message_id()
                .as_ref()
                .map_or_else(String::new, ToString::to_string),
        );
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hosted_consumer_is_effectively_once_under_sigkill() {
    under_sigkill(dedup_suite::example_binary(
        "brokers",
        &["rabbitmq_consumer"],
        "rabbitmq_consumer",
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
    let queue = format!("hosted-{run}");
    let channel = channel().await;
    dedup_suite::rabbitmq::declare(&channel, &queue, false).await;

    let ids: Vec<String> = (0..messages).map(|n| format!("{run}-{n}")).collect();
    let mut plan: Vec<Option<&str>> = ids.iter().map(|id| Some(id.as_str())).collect();
    plan.extend(ids.iter().step_by(10).map(|id| Some(id.as_str())));
    plan.extend((0..POISON).map(|_| None));
    random.shuffle(&mut plan);
    let mut confirms = Vec::with_capacity(plan.len());
    for id in &plan {
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = id {
            properties = properties.with_message_id((*id).into());
        }
        let body = id.map_or_else(|| b"poison".to_vec(), |id| id.as_bytes().to_vec());
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                properties,
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for confirm in confirms {
        confirm.await.unwrap();
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
    // The example's table, as the example creates it: counted before its first life.
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
        if before == messages as i64 {
            break;
        }
        let mut child = start(&program, &queue);
        let born = Instant::now();
        while count(effects.clone()).await == before {
            assert!(
                born.elapsed() < Duration::from_secs(30),
                "a life applied nothing"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(random.next_u64() % 40)).await;
        child.0.kill().expect("SIGKILL");
        child.0.wait().expect("reaped");
        killed += 1;
    }
    let applied_under_kills = count(effects.clone()).await;
    assert!(
        killed >= kills.min(50),
        "only {killed} kills landed before the work was done: publish more"
    );

    // The last life: everything in, then SIGTERM.
    let mut child = start(&program, &queue);
    let patience = Duration::from_secs(120);
    let last = Instant::now();
    // Every event enqueued and marked sent by the relay (the events' queue may hold
    // copies of some before the others are in).
    let sent = format!(
        "SELECT COUNT(*) FROM orders_outbox WHERE destination = '{queue}.events' AND state = 2"
    );
    loop {
        let done = count(effects.clone()).await == messages as i64
            && count(sent.clone()).await == messages as i64
            && depth(&channel, &queue).await.0 == 0
            && depth(&channel, &format!("{queue}.dead")).await.0 == POISON as u32;
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
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let stopping = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
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
    let dead = ids_in(&channel, &format!("{queue}.dead")).await;
    let events = ids_in(&channel, &format!("{queue}.events")).await;
    let distinct_events: BTreeSet<&String> = events.iter().collect();
    eprintln!(
        "hosted RabbitMQ consumer under SIGKILL (seed {seed}): {killed} kills in {} lives, \
         {applied_under_kills} orders applied before the last life; effects {applied} for \
         {messages} ids ({applied_once} distinct); {rows} dedup rows; dead letters {}; \
         events {} ({} distinct); {:.1} s",
        killed + 1,
        dead.len(),
        events.len(),
        distinct_events.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        (applied, applied_once, rows),
        (messages as i64, messages as i64, messages as i64)
    );
    assert_eq!(
        depth(&channel, &queue).await,
        (0, 0),
        "nothing left, no consumer"
    );
    assert_eq!(
        dead,
        vec![String::new(); POISON],
        "the poison messages, once each"
    );
    assert_eq!(distinct_events.len(), messages, "an event for every order");
    for name in [
        queue.clone(),
        format!("{queue}.dead"),
        format!("{queue}.events"),
    ] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
}
