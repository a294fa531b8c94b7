//! More crash cases of the hosted Kafka consumer, through `examples/kafka_consumer.rs` and
//! its documented settings only: three members of one group killed and restarted at
//! random while they work (rebalances under load, eager `range` and `cooperative-sticky`
//! assignment), and SIGTERM in the middle of a run (the final commit made, the process out
//! within its deadline). The proof is in the database and the brokers.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use super::common::Life;
use super::kafka::{Record, brokers, committed, publish, topic};
use super::rabbitmq::{AMQP, channel};

/// A member of group `name` consuming topic `name`, assigning partitions by `strategy`.
fn member(program: &std::path::Path, name: &str, strategy: &str) -> Life {
    Life(
        Command::new(program)
            .env("KAFKA_BOOTSTRAP_SERVERS", brokers())
            .env("KAFKA_GROUP_ID", name)
            .env("KAFKA_PARTITION_ASSIGNMENT_STRATEGY", strategy)
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

/// The state a case checks: effects, distinct effects, dedup rows of `run`.
struct Tally {
    pool: sqlx::PgPool,
    run: String,
}

impl Tally {
    async fn new(run: &str) -> Tally {
        let pool = dedup_suite::postgres().await;
        dedup_runtime::migrate(&pool).await.unwrap();
        // The example's table, as the example creates it: counted before its first life.
        dedup_suite::ddl(
            &pool,
            "CREATE TABLE IF NOT EXISTS kafka_orders (message_id text, body bytea)",
        )
        .await;
        Tally {
            pool,
            run: run.to_owned(),
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        let sql = sql.replace("{run}", &self.run);
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn effects(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM kafka_orders WHERE message_id LIKE '{run}-%'")
            .await
    }

    /// Effects, distinct effects, dedup rows, events marked sent.
    async fn all(&self, name: &str) -> (i64, i64, i64, i64) {
        (
            self.effects().await,
            self.count("SELECT COUNT(DISTINCT message_id) FROM kafka_orders WHERE message_id LIKE '{run}-%'")
                .await,
            self.count(
                "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'kafka-orders' \
                 AND message_id LIKE '{run}-%'",
            )
            .await,
            self.count(&format!(
                "SELECT COUNT(*) FROM kafka_orders_outbox WHERE destination = '{name}.events' \
                 AND state = 2"
            ))
            .await,
        )
    }
}

/// `count` ids of `run` over `partitions`, round-robin; each partition's end.
async fn publish_ids(
    name: &str,
    run: &str,
    count: usize,
    partitions: i32,
) -> std::collections::BTreeMap<i32, i64> {
    let ids: Vec<String> = (0..count).map(|n| format!("{run}-{n}")).collect();
    let records: Vec<Record<'_>> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| ((n as i32) % partitions, Some(id.as_str()), id.as_bytes()))
        .collect();
    publish(name, &records).await
}

/// SIGTERM to `child`; its exit status, once out (within 15 s).
async fn terminate(child: &mut Life) -> std::process::ExitStatus {
    let term = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let stopping = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(15),
            "not out within its deadline"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Distinct message ids in `queue`, taken out.
async fn event_ids(channel: &lapin::Channel, queue: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let options = lapin::options::BasicGetOptions { no_ack: true };
    while let Some(message) = channel.basic_get(queue.into(), options).await.unwrap() {
        if let Some(id) = message.properties.message_id().as_ref() {
            ids.insert(id.to_string());
        }
    }
    let options = lapin::options::QueueDeleteOptions::default();
    channel.queue_delete(queue.into(), options).await.unwrap();
    ids
}

async fn members_killed_at_random(strategy: &str) {
    const PARTITIONS: i32 = 6;
    let messages = dedup_suite::env_number("DEDUP_MEMBERS_MESSAGES", 5_000);
    let kills = dedup_suite::env_number("DEDUP_MEMBERS_KILLS", 8);
    let seed = dedup_suite::crash_seed();
    let mut random = Shuffle::new(seed);
    let run = dedup_suite::unique("members");
    let name = format!("members-{run}");
    let tally = Tally::new(&run).await;
    topic(&name, PARTITIONS).await;
    let channel = channel().await;
    let ends = publish_ids(&name, &run, messages, PARTITIONS).await;
    let program = dedup_suite::example_binary("brokers", &["kafka_consumer"], "kafka_consumer");
    let started = Instant::now();
    let mut members: Vec<Life> = (0..3).map(|_| member(&program, &name, strategy)).collect();
    let patience = Duration::from_secs(120);
    while tally.effects().await == 0 {
        assert!(started.elapsed() < patience, "no member applied anything");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Kill a member at random every 0.5 to 2.5 s, and start another in its place, while
    // the work lasts.
    let mut killed = 0;
    while killed < kills && tally.effects().await < messages as i64 {
        tokio::time::sleep(Duration::from_millis(500 + random.next_u64() % 2_000)).await;
        let victim = (random.next_u64() % 3) as usize;
        members[victim].0.kill().expect("SIGKILL");
        members[victim].0.wait().expect("reaped");
        members[victim] = member(&program, &name, strategy);
        killed += 1;
    }
    let applied_under_kills = tally.effects().await;
    let last = Instant::now();
    while !(tally.all(&name).await.3 == messages as i64
        && committed(&name, &name, PARTITIONS) == ends)
    {
        assert!(
            last.elapsed() < Duration::from_secs(180),
            "not done within 180 s after the kills: effects, distinct, dedup rows, events \
             {:?}; committed {:?}, ends {ends:?}",
            tally.all(&name).await,
            committed(&name, &name, PARTITIONS)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for member in &mut members {
        let status = terminate(member).await;
        assert!(status.success(), "SIGTERM: a clean exit ({status})");
    }
    let all = tally.all(&name).await;
    let events = event_ids(&channel, &format!("{name}.events")).await;
    eprintln!(
        "three Kafka members ({strategy}) killed at random (seed {seed}): {killed} kills, \
         {applied_under_kills} of {messages} applied while killing; effects, distinct, dedup \
         rows, events sent: {all:?}; {} distinct events; {:.1} s",
        events.len(),
        started.elapsed().as_secs_f64()
    );
    let messages = messages as i64;
    assert!(
        killed >= kills.min(4),
        "only {killed} kills landed before the work was done: publish more"
    );
    assert_eq!(all, (messages, messages, messages, messages));
    assert_eq!(
        committed(&name, &name, PARTITIONS),
        ends,
        "every offset committed"
    );
    assert_eq!(events.len() as i64, messages, "an event for every order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_killed_at_random_rebalancing_eagerly() {
    members_killed_at_random("range").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_killed_at_random_rebalancing_cooperatively() {
    members_killed_at_random("cooperative-sticky").await;
}

/// SIGTERM while the member works: out within its deadline with status 0, having
/// committed exactly what it applied (each partition's committed offset = its records
/// applied: the final commit was made), applying nothing after; the next life finishes
/// the rest, each record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_in_the_middle_commits_what_it_applied_and_exits() {
    const PARTITIONS: i32 = 4;
    const MESSAGES: usize = 3_000;
    let run = dedup_suite::unique("sigterm");
    let name = format!("sigterm-{run}");
    let tally = Tally::new(&run).await;
    topic(&name, PARTITIONS).await;
    let channel = channel().await;
    let ends = publish_ids(&name, &run, MESSAGES, PARTITIONS).await;
    let program = dedup_suite::example_binary("brokers", &["kafka_consumer"], "kafka_consumer");
    let mut first = member(&program, &name, "range");
    let started = Instant::now();
    while tally.effects().await < 100 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "it applied too little"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let status = terminate(&mut first).await;
    assert!(status.success(), "SIGTERM: a clean exit ({status})");
    let applied = tally.effects().await;
    assert!(
        applied < MESSAGES as i64,
        "stopped in the middle: {applied}"
    );
    let committed_then: i64 = committed(&name, &name, PARTITIONS)
        .values()
        .map(|&offset| offset.max(0))
        .sum();
    assert_eq!(
        committed_then, applied,
        "the final commit covers what was applied"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        tally.effects().await,
        applied,
        "nothing applied after the exit"
    );

    let mut second = member(&program, &name, "range");
    let last = Instant::now();
    while !(tally.all(&name).await.3 == MESSAGES as i64
        && committed(&name, &name, PARTITIONS) == ends)
    {
        assert!(
            last.elapsed() < Duration::from_secs(120),
            "the rest not done"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = terminate(&mut second).await;
    assert!(status.success(), "SIGTERM: a clean exit ({status})");
    let messages = MESSAGES as i64;
    assert_eq!(
        tally.all(&name).await,
        (messages, messages, messages, messages)
    );
    let events = event_ids(&channel, &format!("{name}.events")).await;
    assert_eq!(events.len() as i64, messages, "an event for every order");
}
