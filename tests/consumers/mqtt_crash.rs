//! The SIGKILL harness of the hosted MQTT consumer: `examples/mqtt_consumer.rs`, on a
//! Mosquitto of the test's own, driven through its documented settings only, killed with
//! SIGKILL while it applies orders, started again each time, and finally stopped with
//! SIGTERM once everything is in. The proof is in the database and the broker.
//!
//! Published (QoS 1, to the consumer's persistent session, created first): 5,000 ids by
//! default (`DEDUP_CRASH_MESSAGES`), a tenth of them twice, and 5 payloads without an id
//! (poison). Checked: every order applied once, one dedup row per id, nothing left in
//! the consumer's session, the 5 poison messages on the dead topic, an event for every
//! order on the events topic, and the SIGTERM'd process out within its deadline with
//! status 0.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;
use dedup_suite::mosquitto::Mosquitto;

use super::mqtt::{Wire, collect, property, publish, session, wire};

use super::common::Life;

const POISON: usize = 5;

fn start(program: &std::path::Path, port: u16, run: &str) -> Life {
    Life(
        Command::new(program)
            .env("BROKER", "mqtt") // the batch form's binary: which service
            .env("BATCH", "4")
            .env("MQTT_HOST", "127.0.0.1")
            .env("MQTT_PORT", port.to_string())
            .env("DATABASE_URL", dedup_suite::postgres_url())
            .env("TOPIC", format!("crash/{run}"))
            .env("EVENTS_TOPIC", format!("crash/{run}/events"))
            .env("CLIENT_ID", format!("{run}-consumer"))
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
        &["mqtt_consumer"],
        "mqtt_consumer",
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

/// One harness at a time: each runs a Mosquitto of its own, and the example's outbox
/// table is the same for both (`mqtt_orders_outbox`), so that side by side one
/// process's relay would send the other's events to its own broker, where nobody waits
/// for them.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn under_sigkill(program: std::path::PathBuf) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let messages = dedup_suite::env_number("DEDUP_CRASH_MESSAGES", 5_000);
    let kills = dedup_suite::env_number("DEDUP_CRASH_KILLS", 50);
    let seed = dedup_suite::crash_seed();
    let mut random = Shuffle::new(seed);
    let pool = dedup_suite::postgres().await;
    let run = dedup_suite::unique("mqtt-crash");
    let broker = Mosquitto::start(&run, "");
    let port = broker.port();
    let topic = format!("crash/{run}");
    session(port, &format!("{run}-consumer"), &topic).await;
    session(port, &format!("{run}-dead"), &format!("{topic}/dead")).await;
    session(port, &format!("{run}-events"), &format!("{topic}/events")).await;

    let ids: Vec<String> = (0..messages).map(|n| format!("{run}-{n}")).collect();
    let mut payloads: Vec<Wire> = ids.iter().map(|id| wire(Some(id), b"body")).collect();
    payloads.extend(ids.iter().step_by(10).map(|id| wire(Some(id), b"body")));
    payloads.extend((0..POISON).map(|n| wire(None, format!("poison {n}").as_bytes())));
    random.shuffle(&mut payloads);
    publish(port, &topic, &payloads).await;

    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let effects =
        format!("SELECT COUNT(*) FROM example_mqtt_orders WHERE message_id LIKE '{run}-%'");
    // The example's table, as the example creates it: counted before its first life.
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS example_mqtt_orders (message_id text, body bytea)",
    )
    .await;
    let started = Instant::now();
    let mut killed = 0;
    // Each life is killed once it has applied an order, 0 to 40 ms later.
    while killed < kills {
        let before = count(effects.clone()).await;
        if before == messages as i64 {
            break;
        }
        let mut child = start(&program, port, &run);
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
        "only {killed} kills landed before the work was done"
    );

    let mut child = start(&program, port, &run);
    let sent = format!(
        "SELECT COUNT(*) FROM mqtt_orders_outbox WHERE destination = '{topic}/events' AND state = 2"
    );
    let last = Instant::now();
    while count(effects.clone()).await != messages as i64
        || count(sent.clone()).await != messages as i64
    {
        if last.elapsed() > Duration::from_secs(120) {
            let (applied, sent) = (count(effects.clone()).await, count(sent.clone()).await);
            panic!("not done after the kills: {applied} orders applied, {sent} events sent");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The poison messages come last in no particular order: give them time to settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
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
        "SELECT COUNT(DISTINCT message_id) FROM example_mqtt_orders WHERE message_id LIKE '{run}-%'"
    );
    let dedup = format!(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'mqtt-orders' AND message_id LIKE '{run}-%'"
    );
    let (applied, applied_once, rows) = (
        count(effects).await,
        count(distinct).await,
        count(dedup).await,
    );
    let left = collect(port, &format!("{run}-consumer"), &topic).await;
    let dead: BTreeSet<Vec<u8>> = collect(port, &format!("{run}-dead"), &format!("{topic}/dead"))
        .await
        .into_iter()
        .map(|(_, payload)| payload)
        .collect();
    let events = collect(port, &format!("{run}-events"), &format!("{topic}/events")).await;
    let event_ids: BTreeSet<String> = events
        .iter()
        .filter_map(|event| property(event, "message-id").map(str::to_owned))
        .collect();
    eprintln!(
        "hosted MQTT consumer under SIGKILL (seed {seed}): {killed} kills in {} lives, \
         {applied_under_kills} orders applied before the last life; effects {applied} for \
         {messages} ids ({applied_once} distinct); {rows} dedup rows; left in the session {}; \
         dead letters {}; events {} ({} distinct); {:.1} s",
        killed + 1,
        left.len(),
        dead.len(),
        events.len(),
        event_ids.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        (applied, applied_once, rows),
        (messages as i64, messages as i64, messages as i64)
    );
    assert!(
        left.is_empty(),
        "nothing left unacknowledged in the session"
    );
    let poison: BTreeSet<Vec<u8>> = (0..POISON)
        .map(|n| format!("poison {n}").into_bytes())
        .collect();
    assert_eq!(dead, poison, "the poison messages on the dead topic");
    assert_eq!(event_ids.len(), messages, "an event for every order");
}
