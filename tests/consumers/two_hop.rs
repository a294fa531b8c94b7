//! The two-hop SIGKILL harness, on the library's consumers at both hops: an example's
//! service (hop 1: orders in, each applied with an `accepted` event in the outbox, the
//! relay sending the events on) and the service downstream (hop 2,
//! `src/bin/events_consumer.rs`: each event applied once, keyed on the outbox's derived
//! id), both killed with SIGKILL at random moments and started again, then stopped with
//! SIGTERM once everything is in — on RabbitMQ (hop 1 and 2 on queues), NATS JetStream
//! (streams) and Kafka (hop 1 from a topic, its events on RabbitMQ). Checked: every order
//! applied once, every event applied once downstream (one row each, however many times a
//! killed relay sent it), the dedup rows of both hops, both processes out with status 0.
//!
//! `DEDUP_CRASH_MESSAGES` ids (1,000), a tenth of them twice; `DEDUP_CRASH_KILLS` lives
//! (20), each killing both processes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use super::common::Life;

/// What differs per broker: how hop 1 is started, hop 2's settings, the orders' table
/// and consumer name.
struct Hops {
    name: &'static str,
    hop1: Command,
    hop2: Command,
    orders: &'static str,
    consumer: &'static str,
}

fn spawn(command: &mut Command) -> Life {
    Life(
        command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a hop"),
    )
}

fn hop2(broker: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_events_consumer"));
    command
        .env("BROKER", broker)
        .env("DATABASE_URL", dedup_suite::postgres_url());
    command
}

/// Runs both hops through `kills` lives and a last one; checks both hops' work.
async fn two_hops(mut hops: Hops, run: &str, messages: usize, seed: u64) {
    let mut random = Shuffle::new(seed);
    let pool = dedup_suite::postgres().await;
    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let orders = hops.orders;
    dedup_suite::ddl(
        &pool,
        &format!("CREATE TABLE IF NOT EXISTS {orders} (message_id text, body bytea)"),
    )
    .await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS example_events (message_id text, body bytea)",
    )
    .await;
    let applied = format!("SELECT COUNT(*) FROM {orders} WHERE message_id LIKE '{run}-%'");
    let events = format!(
        "SELECT COUNT(*) FROM example_events WHERE convert_from(body, 'UTF8') LIKE '{run}-%'"
    );
    let kills = dedup_suite::env_number("DEDUP_CRASH_KILLS", 20);
    let started = Instant::now();
    let mut killed = 0;
    while killed < kills {
        let before = count(applied.clone()).await;
        if before == messages as i64 {
            break;
        }
        let (mut first, mut second) = (spawn(&mut hops.hop1), spawn(&mut hops.hop2));
        let born = Instant::now();
        while count(applied.clone()).await == before {
            assert!(
                born.elapsed() < Duration::from_secs(30),
                "a life applied nothing"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Each hop killed at a moment of its own.
        tokio::time::sleep(Duration::from_millis(random.next_u64() % 40)).await;
        first.0.kill().expect("SIGKILL");
        tokio::time::sleep(Duration::from_millis(random.next_u64() % 40)).await;
        second.0.kill().expect("SIGKILL");
        first.0.wait().expect("reaped");
        second.0.wait().expect("reaped");
        killed += 1;
    }
    assert!(
        killed >= kills.min(10),
        "only {killed} lives before the work was done"
    );

    let (mut first, mut second) = (spawn(&mut hops.hop1), spawn(&mut hops.hop2));
    let last = Instant::now();
    while count(applied.clone()).await != messages as i64
        || count(events.clone()).await != messages as i64
    {
        assert!(
            last.elapsed() < Duration::from_secs(120),
            "not done within 120 s after the kills: {} orders, {} events of {messages}",
            count(applied.clone()).await,
            count(events.clone()).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything still coming (a relay's second copy of an event) comes before the stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for life in [&mut first, &mut second] {
        let term = Command::new("kill")
            .args(["-TERM", &life.0.id().to_string()])
            .status()
            .unwrap();
        assert!(term.success());
    }
    for life in [&mut first, &mut second] {
        let stopping = Instant::now();
        let status = loop {
            if let Some(status) = life.0.try_wait().unwrap() {
                break status;
            }
            assert!(
                stopping.elapsed() < Duration::from_secs(15),
                "not out in time"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(status.success(), "SIGTERM: a clean exit ({status})");
    }

    let consumer = hops.consumer;
    let figures = (
        count(applied.clone()).await,
        count(format!(
            "SELECT COUNT(DISTINCT message_id) FROM {orders} WHERE message_id LIKE '{run}-%'"
        ))
        .await,
        count(format!(
            "SELECT COUNT(*) FROM processed_messages WHERE consumer = '{consumer}' \
             AND message_id LIKE '{run}-%'"
        ))
        .await,
        count(events.clone()).await,
        count(format!(
            "SELECT COUNT(DISTINCT message_id) FROM example_events \
             WHERE convert_from(body, 'UTF8') LIKE '{run}-%'"
        ))
        .await,
        count(format!(
            "SELECT COUNT(*) FROM processed_messages p JOIN example_events e \
             ON p.message_id = e.message_id WHERE p.consumer = 'order-events' \
             AND convert_from(e.body, 'UTF8') LIKE '{run}-%'"
        ))
        .await,
    );
    println!(
        "two hops under SIGKILL ({}; seed {seed}): {killed} kills of both hops; orders \
         {}, {} distinct, {} dedup rows; events applied downstream {}, {} distinct, {} dedup \
         rows; {:.1} s",
        hops.name,
        figures.0,
        figures.1,
        figures.2,
        figures.3,
        figures.4,
        figures.5,
        started.elapsed().as_secs_f64()
    );
    let n = messages as i64;
    assert_eq!(
        figures,
        (n, n, n, n, n, n),
        "each order and each event applied once"
    );
}

/// The events' queue, as the examples declare it, there before hop 2 first looks.
async fn events_queue(queue: &str) {
    let channel = super::rabbitmq::channel().await;
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions::durable(),
            Default::default(),
        )
        .await
        .unwrap();
}

/// Ids, a tenth twice, shuffled.
fn plan(run: &str, messages: usize, seed: u64) -> Vec<String> {
    let ids: Vec<String> = (0..messages).map(|n| format!("{run}-{n}")).collect();
    let mut plan = ids.clone();
    plan.extend(ids.iter().step_by(10).cloned());
    Shuffle::new(seed ^ 0x5eed).shuffle(&mut plan);
    plan
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_two_hops_are_effectively_once_under_sigkill() {
    use lapin::BasicProperties;
    use lapin::options::BasicPublishOptions;

    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 1_000);
    let seed = dedup_suite::crash_seed();
    let run = dedup_suite::unique("hop");
    let queue = format!("hops-{run}");
    let channel = super::rabbitmq::channel().await;
    dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
    let mut confirms = Vec::new();
    for id in plan(&run, messages, seed) {
        let properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                properties,
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for confirm in confirms {
        confirm.await.unwrap();
    }
    let events = format!("{queue}.events");
    events_queue(&events).await;
    let mut hop1 = Command::new(dedup_suite::example_binary(
        "brokers",
        &["rabbitmq_consumer"],
        "rabbitmq_consumer",
    ));
    hop1.env("AMQP_URL", super::rabbitmq::AMQP)
        .env("DATABASE_URL", dedup_suite::postgres_url())
        .env("QUEUE", &queue)
        .env("EVENTS_QUEUE", &events);
    let mut hop2 = hop2("rabbitmq");
    hop2.env("AMQP_URL", super::rabbitmq::AMQP)
        .env("EVENTS_QUEUE", &events);
    let hops = Hops {
        name: "RabbitMQ → PostgreSQL + outbox → RabbitMQ → PostgreSQL",
        hop1,
        hop2,
        orders: "example_orders",
        consumer: "orders",
    };
    two_hops(hops, &run, messages, seed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_two_hops_are_effectively_once_under_sigkill() {
    use async_nats::HeaderMap;

    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 1_000);
    let seed = dedup_suite::crash_seed();
    let run = dedup_suite::unique("hop");
    let stream = format!("hops-{run}");
    let subject = format!("{stream}.orders");
    let js = super::nats::context().await;
    dedup_suite::jetstream::streams(&js, super::nats::NATS, &stream, &subject).await;
    // The events' stream, as the example makes it, there before hop 2 first looks.
    let mut config =
        async_nats::jetstream::stream::Config::from(format!("{stream}_EVENTS").as_str());
    config.subjects = vec![format!("{stream}.events")];
    js.get_or_create_stream(config).await.unwrap();
    let mut acks = Vec::new();
    for id in plan(&run, messages, seed) {
        let mut headers = HeaderMap::new();
        headers.insert("Message-Id", id.as_str());
        let ack = js
            .publish_with_headers(subject.clone(), headers, id.into_bytes().into())
            .await
            .unwrap();
        acks.push(ack);
    }
    for ack in acks {
        ack.await.unwrap();
    }
    let mut hop1 = Command::new(dedup_suite::example_binary(
        "brokers",
        &["nats_consumer"],
        "nats_consumer",
    ));
    hop1.env("NATS_URL", super::nats::NATS)
        .env("DATABASE_URL", dedup_suite::postgres_url())
        .env("STREAM", &stream)
        .env("SUBJECT", &subject)
        .env("EVENTS_SUBJECT", format!("{stream}.events"))
        .env("ACK_WAIT_MS", "2000");
    let mut hop2 = hop2("nats");
    hop2.env("NATS_URL", super::nats::NATS)
        .env("EVENTS_STREAM", format!("{stream}_EVENTS"));
    let hops = Hops {
        name: "JetStream → PostgreSQL + outbox → JetStream → PostgreSQL",
        hop1,
        hop2,
        orders: "example_orders",
        consumer: "nats-orders",
    };
    two_hops(hops, &run, messages, seed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_two_hops_are_effectively_once_under_sigkill() {
    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 1_000);
    let seed = dedup_suite::crash_seed();
    let run = dedup_suite::unique("hop");
    let name = format!("hops-{run}");
    super::kafka::topic(&name, 2).await;
    let plan = plan(&run, messages, seed);
    let records: Vec<super::kafka::Record<'_>> = plan
        .iter()
        .enumerate()
        .map(|(n, id)| ((n % 2) as i32, Some(id.as_str()), id.as_bytes()))
        .collect();
    super::kafka::publish(&name, &records).await;
    let events = format!("{name}.events");
    events_queue(&events).await;
    let mut hop1 = Command::new(dedup_suite::example_binary(
        "brokers",
        &["kafka_consumer"],
        "kafka_consumer",
    ));
    hop1.env("KAFKA_BOOTSTRAP_SERVERS", super::kafka::brokers())
        .env("KAFKA_GROUP_ID", &name)
        .env("KAFKA_SESSION_TIMEOUT_MS", "1500")
        .env("KAFKA_HEARTBEAT_INTERVAL_MS", "300")
        .env("KAFKA_MAX_POLL_INTERVAL_MS", "10000")
        .env("DATABASE_URL", dedup_suite::postgres_url())
        .env("TOPIC", &name)
        .env("AMQP_URL", super::rabbitmq::AMQP)
        .env("EVENTS_QUEUE", &events);
    let mut hop2 = hop2("rabbitmq");
    hop2.env("AMQP_URL", super::rabbitmq::AMQP)
        .env("EVENTS_QUEUE", &events);
    let hops = Hops {
        name: "Kafka → PostgreSQL + outbox → RabbitMQ → PostgreSQL",
        hop1,
        hop2,
        orders: "kafka_orders",
        consumer: "kafka-orders",
    };
    two_hops(hops, &run, messages, seed).await;
}
