//! The SIGKILL harness of the hosted Kafka consumer: `examples/kafka_consumer.rs` (Kafka →
//! PostgreSQL + outbox → RabbitMQ), driven through its documented settings only
//! (`KAFKA_<NAME>`, `TOPIC`, `DATABASE_URL`, `AMQP_URL`, `EVENTS_QUEUE`), killed with SIGKILL at random moments while it
//! consumes, started again each time, and finally stopped with SIGTERM once everything is
//! in. Nothing is read from the process: the proof is in the database and the broker.
//!
//! Published: `DEDUP_CRASH_MESSAGES` ids (2,000) over 4 partitions, a tenth of them twice,
//! and 5 records without an id (poison: dead-lettered), in a shuffled order. Checked:
//! every order applied once (effects = ids, each once), one dedup row per id, the group's
//! offsets at every partition's end, the 5 poison records in the dead topic (each at least
//! once: a dead letter is produced before its offset commits), an
//! `accepted` event for every order in the events queue (at least once: a relay killed
//! between its send and its mark sends again, with the same id), and the SIGTERM'd
//! process out within its deadline, with status 0.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_runtime::rdkafka::provenance;
use dedup_suite::Shuffle;

use super::common::Life;
use super::kafka::{Record, brokers, committed, publish, read_all, topic};
use super::rabbitmq::{AMQP, channel};

const POISON: usize = 5;
const PARTITIONS: i32 = 4;

fn start(program: &std::path::Path, name: &str, offsets: &str) -> Life {
    Life(
        Command::new(program)
            .env("BROKER", "kafka") // the batch form's binary: which service
            .env("BATCH", "4")
            .env("OFFSETS", offsets)
            .env("KAFKA_BOOTSTRAP_SERVERS", brokers())
            .env("KAFKA_GROUP_ID", name)
            // A killed member's partitions move on within a second or two.
            .env("KAFKA_SESSION_TIMEOUT_MS", "1500")
            .env("KAFKA_HEARTBEAT_INTERVAL_MS", "300")
            .env("KAFKA_MAX_POLL_INTERVAL_MS", "10000")
            .env("DATABASE_URL", dedup_suite::postgres_url())
            .env("TOPIC", name)
            .env("AMQP_URL", AMQP)
            .env("EVENTS_QUEUE", format!("{name}.events"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the example"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hosted_consumer_is_effectively_once_under_sigkill() {
    under_sigkill(example(), "kafka").await;
}

/// The same harness on the consumer's batch form: the example's service with
/// `run_batches` (`src/bin/batch_consumer.rs`, batches of up to 4: each life, killed
/// 0 to 40 ms after its first commit, must leave work for the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_batch_form_is_effectively_once_under_sigkill() {
    under_sigkill(super::common::batch_consumer(), "kafka").await;
}

fn example() -> std::path::PathBuf {
    dedup_suite::example_binary("brokers", &["kafka_consumer"], "kafka_consumer")
}

/// The same with the offsets kept in the database too (`OFFSETS=database`): also, each
/// partition's stored offset is past its last record that only its handler could have
/// committed (an id published once), and not past its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_in_the_database_are_effectively_once_under_sigkill() {
    under_sigkill(example(), "database").await;
}

async fn under_sigkill(program: std::path::PathBuf, offsets: &str) {
    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 2_000);
    let kills = dedup_suite::env_number("DEDUP_CRASH_KILLS", 20);
    let seed = dedup_suite::crash_seed();
    let mut random = Shuffle::new(seed);
    let pool = dedup_suite::postgres().await;
    let run = dedup_suite::unique("crash");
    let name = format!("hosted-{run}");
    topic(&name, PARTITIONS).await;
    let channel = channel().await;

    let ids: Vec<String> = (0..messages).map(|n| format!("{run}-{n}")).collect();
    let mut plan: Vec<Option<&str>> = ids.iter().map(|id| Some(id.as_str())).collect();
    plan.extend(ids.iter().step_by(10).map(|id| Some(id.as_str())));
    plan.extend((0..POISON).map(|_| None));
    random.shuffle(&mut plan);
    let records: Vec<Record<'_>> = plan
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let body: &[u8] = id.map_or(b"poison", str::as_bytes);
            ((n as i32) % PARTITIONS, *id, body)
        })
        .collect();
    let ends = publish(&name, &records).await;

    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let effects = format!("SELECT COUNT(*) FROM kafka_orders WHERE message_id LIKE '{run}-%'");
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS kafka_orders (message_id text, body bytea)",
    )
    .await;
    let started = Instant::now();
    let mut killed = 0;
    // Each life is killed once it has applied an order, 0 to 40 ms later: in the middle
    // of the work (between a COMMIT and its offset's commit included).
    while killed < kills {
        let before = count(effects.clone()).await;
        if before == messages as i64 {
            break;
        }
        let mut child = start(&program, &name, offsets);
        let born = Instant::now();
        while count(effects.clone()).await == before {
            assert!(
                born.elapsed() < Duration::from_secs(60),
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
        killed >= kills.min(20),
        "only {killed} kills landed before the work was done: publish more"
    );

    // The last life: everything in, then SIGTERM.
    let mut child = start(&program, &name, offsets);
    let patience = Duration::from_secs(120);
    let last = Instant::now();
    let sent = format!(
        "SELECT COUNT(*) FROM kafka_orders_outbox WHERE destination = '{name}.events' AND state = 2"
    );
    loop {
        let done = count(effects.clone()).await == messages as i64
            && count(sent.clone()).await == messages as i64
            && committed(&name, &name, PARTITIONS) == ends;
        if done {
            break;
        }
        assert!(
            last.elapsed() < patience,
            "not done within {patience:?} after the kills"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
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
        "SELECT COUNT(DISTINCT message_id) FROM kafka_orders WHERE message_id LIKE '{run}-%'"
    );
    let dedup = format!(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'kafka-orders' \
         AND message_id LIKE '{run}-%'"
    );
    let (applied, applied_once, rows) = (
        count(effects).await,
        count(distinct).await,
        count(dedup).await,
    );
    let dead = read_all(&format!("{name}.dead"), PARTITIONS, POISON);
    let events = ids_in(&channel, &format!("{name}.events")).await;
    let distinct_events: BTreeSet<&String> = events.iter().collect();
    eprintln!(
        "hosted Kafka consumer under SIGKILL, offsets in {offsets} (seed {seed}): {killed} kills in {} lives, \
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
        committed(&name, &name, PARTITIONS),
        ends,
        "every offset committed"
    );
    // A dead letter is produced before its offset is committed: a life killed between
    // the two produces it again (at least once, like the relay's events). Each poison
    // record is there, by its source position, and nothing else.
    assert!(
        dead.iter().all(|(_, _, payload, _)| payload == b"poison"),
        "only poison records dead-lettered"
    );
    let positions: BTreeSet<(Vec<u8>, Vec<u8>)> = dead
        .iter()
        .map(|(_, _, _, headers)| {
            (
                headers[provenance::PARTITION].clone(),
                headers[provenance::OFFSET].clone(),
            )
        })
        .collect();
    assert_eq!(positions.len(), POISON, "each poison record dead-lettered");
    assert_eq!(distinct_events.len(), messages, "an event for every order");
    if offsets == "database" {
        // Offsets in each partition from 0, in publish order. A record committed by its
        // handler moves its partition's stored offset past it; a duplicate (the second
        // copy of an id, in whichever partition it was read last) and a poison record
        // commit nothing and move nothing. So each partition's stored offset is at least
        // the one after its last record whose id was published once, and at most its end.
        let mut copies = std::collections::HashMap::new();
        for (_, id, _) in &records {
            if let Some(id) = id {
                *copies.entry(*id).or_insert(0) += 1;
            }
        }
        let mut next = [0_i64; PARTITIONS as usize];
        let mut at_least = [0_i64; PARTITIONS as usize];
        for (partition, id, _) in &records {
            let partition = *partition as usize;
            next[partition] += 1;
            if id.is_some_and(|id| copies[id] == 1) {
                at_least[partition] = next[partition];
            }
        }
        for (partition, at_least) in at_least.iter().enumerate() {
            let stored = count(format!(
                "SELECT COALESCE(MAX(next_offset), -1) FROM dedup_kafka_offsets \
                 WHERE consumer_group = '{name}' AND topic = '{name}' AND partition_id = {partition}"
            ))
            .await;
            let end = ends[&(partition as i32)];
            assert!(
                (*at_least..=end).contains(&stored),
                "partition {partition}'s stored offset {stored}: not in {at_least}..={end}"
            );
        }
    }
    channel
        .queue_delete(
            format!("{name}.events").as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
}

/// Message ids in `queue`, taken out.
async fn ids_in(channel: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let options = lapin::options::BasicGetOptions { no_ack: true };
    while let Some(message) = channel.basic_get(queue.into(), options).await.unwrap() {
        let id = message.properties.message_id().as_ref();
        ids.push(id.map_or_else(String::new, ToString::to_string));
    }
    ids
}
