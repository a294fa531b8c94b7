//! HTTP idempotency keys under SIGKILL, one key end to end: `examples/http_payments.rs`
//! run as a child process against PostgreSQL and RabbitMQ, killed again and again while
//! clients retry each of their requests, with its `Idempotency-Key`, until it is
//! answered; each payment's `accepted` event (its id derived from the key by the outbox)
//! relayed to a queue that `src/bin/events_consumer.rs` consumes downstream with dedup.
//!
//! The server pauses a few milliseconds after each commit and before its answer, so that
//! kills land there too: the client never hears of a payment that committed, retries,
//! and must get the stored answer, not a second payment. Asserted: every key's payment
//! exactly once (the payments table has no unique constraint: the dedup row alone keeps
//! it single), one dedup row per key, and every client's final answer equal to what was
//! stored — the payment id of its key's one row; downstream, every payment's event applied
//! exactly once, under the id the outbox derived from its key.
//!
//! Prints its figures (`== http: crash harness`, `kills:`, `retries:`, `replayed:`).
//! `DEDUP_HTTP_CRASH_REQUESTS` and `DEDUP_HTTP_CRASH_KILLS` scale it (defaults 5,000 and
//! 50); `DEDUP_CRASH_SEED` fixes the random choices.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dedup_runtime::outbox::Cause;
use dedup_suite::{Shuffle, crash_seed, env_number};

/// Clients sending at once.
const CLIENTS: usize = 8;

/// The consumer name `examples/http_payments.rs` claims its keys under.
const CONSUMER: &str = "http-payments";

/// What each client saw for its requests.
#[derive(Default)]
struct Seen {
    /// Key → the final answer's body, and whether it was a replay.
    answers: HashMap<String, (String, bool)>,
    /// Sends that got no final answer: a refused connection, a cut one, a `409`, a `5xx`.
    retries: u64,
    conflicts: u64,
}

/// Starts a life of the server; returns once it listens.
fn start(program: &std::path::Path, env: &[(&str, String)]) -> Child {
    let mut child = Command::new(program)
        .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| panic!("start {}: {error}", program.display()));
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    match lines.next() {
        Some(Ok(line)) if line.starts_with("listening ") => {}
        other => panic!("the server did not start: {other:?}"),
    }
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_key_pays_once_and_every_client_gets_the_stored_answer() {
    let requests = env_number("DEDUP_HTTP_CRASH_REQUESTS", 5_000);
    let kills = env_number("DEDUP_HTTP_CRASH_KILLS", 50);
    let seed = crash_seed();
    println!("== http: crash harness (seed {seed})");
    let pool = dedup_suite::postgres().await;
    let table = dedup_suite::unique_table("http_crash_payments");
    let run = dedup_suite::unique("http-crash");
    let listen = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().to_string()
    };
    let program = dedup_suite::example_binary("http", &["http_payments"], "http_payments");
    let amqp = std::env::var("DEDUP_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let queue = dedup_suite::unique("http-crash-events");
    let env = [
        ("DATABASE_URL", dedup_suite::postgres_url()),
        ("LISTEN", listen.clone()),
        ("TABLE", table.clone()),
        ("PAUSE_MS", "3".to_owned()),
        ("AMQP_URL", amqp.clone()),
        ("EVENTS_QUEUE", queue.clone()),
    ];

    let answered = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut server = start(&program, &env);
    // Downstream, once the queue is declared: the events, each applied once.
    let mut downstream = Command::new(env!("CARGO_BIN_EXE_events_consumer"))
        .envs([
            ("DATABASE_URL", dedup_suite::postgres_url()),
            ("BROKER", "rabbitmq".to_owned()),
            ("AMQP_URL", amqp.clone()),
            ("EVENTS_QUEUE", queue.clone()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the downstream consumer");

    // The clients: each takes every CLIENTS-th request and retries it until answered.
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (run, listen, answered) = (run.clone(), listen.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            let mut seen = Seen::default();
            for n in (client..requests).step_by(CLIENTS) {
                let key = format!("{run}-{n}");
                loop {
                    let sent = http
                        .post(format!("http://{listen}/payments"))
                        .header("idempotency-key", format!("\"{key}\""))
                        .body(format!("{n} EUR"))
                        .send()
                        .await;
                    let response = match sent {
                        Ok(response) => response,
                        Err(_) => {
                            seen.retries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    };
                    let status = response.status().as_u16();
                    let replayed = response.headers().get("idempotent-replayed").is_some();
                    let body = match response.text().await {
                        Ok(body) => body,
                        Err(_) => {
                            seen.retries += 1;
                            continue;
                        }
                    };
                    match status {
                        201 => {
                            seen.answers.insert(key, (body, replayed));
                            answered.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        409 => {
                            seen.conflicts += 1;
                            seen.retries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        500..=599 => {
                            seen.retries += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        other => panic!("request {n}: unexpected {other}: {body}"),
                    }
                }
            }
            seen
        }));
    }

    // The killer: each life dies after a random share of the requests, spread so that
    // `kills` kills fall while the clients work; then the last life finishes the run.
    let killer = {
        let (program, done, answered) = (program.clone(), done.clone(), answered.clone());
        let env = env.clone();
        tokio::task::spawn_blocking(move || {
            let mut shuffle = Shuffle::new(seed);
            let mut killed = 0;
            while killed < kills && !done.load(Ordering::Relaxed) {
                let from = answered.load(Ordering::Relaxed);
                // Up to what is left per kill left (half of it on average), and before the
                // last request: the kills all fall while the clients work.
                let left = (requests as u64).saturating_sub(from);
                let share = (left / (kills - killed) as u64).max(1);
                let until = (from + shuffle.next_u64() % share).min(requests as u64 - 1);
                let life = Instant::now();
                while answered.load(Ordering::Relaxed) < until
                    && !done.load(Ordering::Relaxed)
                    && life.elapsed() < Duration::from_secs(5)
                {
                    std::thread::sleep(Duration::from_micros(200));
                }
                // A moment more, at random: a kill between a commit and its answer.
                std::thread::sleep(Duration::from_micros(shuffle.next_u64() % 3_000));
                if done.load(Ordering::Relaxed) {
                    break;
                }
                server.kill().unwrap();
                server.wait().unwrap();
                killed += 1;
                server = start(&program, &env);
            }
            (server, killed)
        })
    };

    let mut seen = Seen::default();
    for client in clients {
        let client = client.await.unwrap();
        seen.retries += client.retries;
        seen.conflicts += client.conflicts;
        seen.answers.extend(client.answers);
    }
    done.store(true, Ordering::Relaxed);
    let (mut server, killed) = killer.await.unwrap();

    // Every event downstream: the relay sends what the kills left in the outbox.
    let event_ids: Vec<String> = (0..requests)
        .map(|n| {
            let cause = Cause::new(CONSUMER, format!("{run}-{n}")).unwrap();
            cause.id("accepted").unwrap().to_string()
        })
        .collect();
    let count_events = || {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT count(*), count(DISTINCT message_id) FROM example_events \
             WHERE message_id = ANY($1)",
        )
        .bind(&event_ids)
        .fetch_one(&pool)
    };
    let waited = Instant::now();
    let mut events = count_events().await.unwrap();
    while events.1 < requests as i64 && waited.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        events = count_events().await.unwrap();
    }
    server.kill().unwrap();
    server.wait().unwrap();
    // SIGTERM: it finishes what it holds and stops.
    let _ = Command::new("kill")
        .args(["-TERM", &downstream.id().to_string()])
        .status();
    let stopped = downstream.wait().unwrap();
    let elapsed = started.elapsed();

    // The database: one payment per key, and nothing else.
    let payments: Vec<(String, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT idempotency_key, count(*), min(id) FROM {table} GROUP BY idempotency_key"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let doubled: Vec<_> = payments
        .iter()
        .filter(|(_, count, _)| *count != 1)
        .collect();
    let dedup_rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM processed_messages WHERE consumer = $1 AND message_id LIKE $2",
    )
    .bind(CONSUMER)
    .bind(format!("{run}-%"))
    .fetch_one(&pool)
    .await
    .unwrap();
    let replayed = seen
        .answers
        .values()
        .filter(|(_, replayed)| *replayed)
        .count();
    println!("  kills:              {killed} in {} lives", killed + 1);
    println!(
        "  requests:           {requests}, answered {}",
        seen.answers.len()
    );
    println!(
        "  retries:            {} ({} of them 409)",
        seen.retries, seen.conflicts
    );
    println!("  replayed:           {replayed}  (final answers from the stored response)");
    println!(
        "  payments:           {} keys, {} doubled",
        payments.len(),
        doubled.len()
    );
    println!("  dedup rows:         {dedup_rows}");
    println!("  events downstream:  {} for {} ids", events.0, events.1);
    println!("  in {elapsed:.1?}");

    assert!(killed >= kills.min(requests), "only {killed} kills");
    assert_eq!(seen.answers.len(), requests, "every request answered");
    assert!(doubled.is_empty(), "keys paid more than once: {doubled:?}");
    assert_eq!(payments.len(), requests, "one payment per key, no other");
    assert_eq!(dedup_rows, requests as i64, "one dedup row per key");
    assert_eq!(
        events,
        (requests as i64, requests as i64),
        "every payment's event applied once downstream"
    );
    assert!(
        stopped.success(),
        "the downstream consumer stopped: {stopped}"
    );
    let ids: HashMap<&str, i64> = payments
        .iter()
        .map(|(key, _, id)| (key.as_str(), *id))
        .collect();
    for (key, (body, _)) in &seen.answers {
        let id = ids
            .get(key.as_str())
            .unwrap_or_else(|| panic!("{key}: no payment"));
        assert_eq!(
            body,
            &format!(r#"{{"payment":{id}}}"#),
            "{key}: the stored answer"
        );
    }
}
