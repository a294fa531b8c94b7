//! Leases under SIGKILL: the consumer of `examples/partner_worker.rs`, run as a child
//! process against a real HTTP server (the partner, in this process on `127.0.0.1:0`) and
//! PostgreSQL, killed again and again exactly in each policy's crash window.
//!
//! - **send-first under a lease, with the key**: killed after the HTTP call returned and
//!   before the completion committed. The killed process's lease stays until it ends
//!   (copies meanwhile are told "in progress"), then the next delivery takes it over and
//!   calls again; the partner replays the first charge for the same key. Asserted: every
//!   order charged exactly once, every dedup row processed, every charge id recorded once
//!   in the completion's transaction, every message acknowledged.
//! - **mark-first, without a key** (a partner that ignores keys: nothing downstream
//!   helps): killed after the mark committed and before (or while) the call. Asserted: no
//!   order charged twice; every order either charged and processed, or listed as outcome
//!   unknown by `Ledger::unresolved` — a lost charge is never silent; every message
//!   acknowledged.
//!
//! Each prints its figures (`== <policy>: crash harness`, `kills:`, `in the window:`,
//! `effects:`, `partner:`). `DEDUP_LEASE_CRASH_MESSAGES` and `DEDUP_LEASE_CRASH_KILLS`
//! scale it (defaults 1,000 and 50); `DEDUP_CRASH_SEED` fixes the random choices.
//!
//! The two run side by side, on libtest's threads: each spends most of its time waiting
//! out the 1 s leases its kills leave behind, and they share nothing but the servers
//! (each has its own run, consumer, partner and worker processes).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use dedup_runtime::{Ledger, UnresolvedStatus};
use dedup_suite::partner::{Keys, Partner};
use dedup_suite::{Shuffle, crash_seed, env_number};
use sqlx::PgPool;

/// What the child processes reported over all their lives.
#[derive(Default, Debug)]
struct Tally {
    lives: usize,
    kills: usize,
    /// Kills at the crash point itself (`called` / `marked` just printed).
    kills_in_window: usize,
    /// Of those, the kills that landed before the worker finished the message: its row
    /// still in progress once the worker was dead. (The others came a moment too late:
    /// the worker had committed the completion between its line and the signal.)
    landed_in_window: usize,
    window_ids: HashSet<i64>,
    acked: usize,
    in_progress: usize,
}

/// When to kill a life.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// At its n-th crash-point line (`called` or `marked`).
    AtCrashPoint(usize),
    /// This long after it started.
    AfterStart(Duration),
}

/// Runs one life of the worker: killed as `kill` says, or (`None`) left to finish.
fn live(
    program: &Path,
    env: &[(&str, String)],
    kill: Option<Kill>,
    in_progress: &dyn Fn(i64) -> bool,
    tally: &mut Tally,
) {
    let mut child = Command::new(program)
        .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("start {}: {error}", program.display()));
    let started = Instant::now();
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (lines, receive) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    tally.lives += 1;
    // A life whose trigger never comes (the work ran out) is killed after this long; the
    // last one must finish within it.
    let patience = match kill {
        Some(Kill::AfterStart(after)) => after,
        Some(Kill::AtCrashPoint(_)) => Duration::from_secs(5),
        None => Duration::from_secs(120),
    };
    let (mut crash_points, mut killed, mut done) = (0, false, false);
    let mut killed_at = None;
    loop {
        let wait = (started + patience).saturating_duration_since(Instant::now());
        let line = match receive.recv_timeout(if killed {
            Duration::from_secs(30)
        } else {
            wait
        }) {
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) if !killed && kill.is_some() => {
                child.kill().expect("SIGKILL the worker");
                killed = true;
                continue;
            }
            Err(RecvTimeoutError::Timeout) => {
                child.kill().ok();
                panic!(
                    "the worker did not finish: its stderr:\n{}",
                    errors.join().unwrap_or_default()
                );
            }
        };
        let mut words = line.split(' ');
        let (event, n) = (
            words.next(),
            words.next().and_then(|n| n.parse::<i64>().ok()),
        );
        match (event, n) {
            (Some("called" | "marked"), Some(n)) => {
                crash_points += 1;
                if !killed && matches!(kill, Some(Kill::AtCrashPoint(at)) if at == crash_points) {
                    child.kill().expect("SIGKILL the worker");
                    killed = true;
                    tally.kills_in_window += 1;
                    tally.window_ids.insert(n);
                    killed_at = Some(n);
                }
            }
            (Some("acked"), Some(_)) => tally.acked += 1,
            (Some("in-progress"), Some(_)) => tally.in_progress += 1,
            (Some("done"), Some(_)) => done = true,
            _ => panic!("unexpected line from the worker: {line:?}"),
        }
    }
    let status = child.wait().expect("wait for the worker");
    reader.join().expect("stdout reader");
    let stderr = errors.join().unwrap_or_default();
    if let Some(n) = killed_at
        && in_progress(n)
    {
        tally.landed_in_window += 1;
    }
    if killed {
        tally.kills += 1;
    } else {
        assert!(
            status.success() && done,
            "the worker exited by itself ({status}); its stderr:\n{stderr}"
        );
    }
}

/// The worker binary, built once with the test's profile and the feature `http`.
fn worker() -> PathBuf {
    dedup_suite::example_binary("http", &["partner_worker"], "partner_worker")
}

struct Harness {
    pool: PgPool,
    partner: Partner,
    run: String,
    messages: usize,
    tally: Tally,
}

async fn harness(policy: &str, keys: Keys) -> Harness {
    let messages = env_number("DEDUP_LEASE_CRASH_MESSAGES", 1_000);
    let kills = env_number("DEDUP_LEASE_CRASH_KILLS", 50);
    let seed = crash_seed();
    println!("== lease, {policy}: crash harness (seed {seed})");
    let pool = dedup_suite::postgres().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS lease_crash_queue \
         (run text NOT NULL, n bigint NOT NULL, acked boolean NOT NULL DEFAULT false, \
          PRIMARY KEY (run, n)); \
         CREATE TABLE IF NOT EXISTS lease_crash_charges \
         (message_id text PRIMARY KEY, charge_id text NOT NULL)",
    )
    .await;
    let run = dedup_suite::unique("lease-crash");
    sqlx::query(
        "INSERT INTO lease_crash_queue (run, n) SELECT $1, g FROM generate_series(0, $2 - 1) AS g",
    )
    .bind(&run)
    .bind(messages as i64)
    .execute(&pool)
    .await
    .unwrap();
    let partner = Partner::start(keys).await.unwrap();
    let env = vec![
        ("DATABASE_URL", dedup_suite::postgres_url()),
        ("DEDUP_PARTNER_URL", partner.url()),
        ("DEDUP_WORKER_RUN", run.clone()),
        ("DEDUP_WORKER_POLICY", policy.to_owned()),
    ];
    let program = worker();
    let consumer = format!("lease-crash-{policy}");
    let (check_pool, check_run, runtime) =
        (pool.clone(), run.clone(), tokio::runtime::Handle::current());
    // Whether message `n`'s row is still in progress (a lease or a mark not completed).
    let in_progress = move |n: i64| -> bool {
        runtime.block_on(async {
            let state: Option<Option<i16>> = sqlx::query_scalar(
                "SELECT state FROM processed_messages WHERE consumer = $1 AND message_id = $2",
            )
            .bind(&consumer)
            .bind(format!("{check_run}/{n}"))
            .fetch_optional(&check_pool)
            .await
            .unwrap();
            matches!(state, Some(Some(_)))
        })
    };
    let tally = tokio::task::spawn_blocking(move || {
        let mut random = Shuffle::new(seed);
        let mut tally = Tally::default();
        for k in 0..kills {
            let kill = if k % 5 == 0 {
                Kill::AfterStart(Duration::from_millis(random.next_u64() % 300))
            } else {
                // Spread the kills over the work.
                let budget = (messages / kills).max(1) as u64;
                Kill::AtCrashPoint(1 + (random.next_u64() % (2 * budget)) as usize)
            };
            live(&program, &env, Some(kill), &in_progress, &mut tally);
        }
        live(&program, &env, None, &in_progress, &mut tally);
        tally
    })
    .await
    .unwrap();
    Harness {
        pool,
        partner,
        run,
        messages,
        tally,
    }
}

impl Harness {
    fn id(&self, n: usize) -> String {
        format!("{}/{n}", self.run)
    }

    async fn unacked(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM lease_crash_queue WHERE run = $1 AND NOT acked")
            .bind(&self.run)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// `state` per message id of the run (`None` processed).
    async fn states(&self, consumer: &str) -> HashMap<String, Option<i16>> {
        sqlx::query_as(
            "SELECT message_id, state FROM processed_messages \
             WHERE consumer = $1 AND message_id LIKE $2",
        )
        .bind(consumer)
        .bind(format!("{}/%", self.run))
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    fn report(&self) {
        let t = &self.tally;
        println!(
            "kills:          {} SIGKILLs over {} lives, {} of them at the crash point, {} landed in the crash window",
            t.kills, t.lives, t.kills_in_window, t.landed_in_window
        );
        println!(
            "deliveries:     {} acknowledged, {} told in progress",
            t.acked, t.in_progress
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_send_first_is_effectively_once_under_sigkill() {
    let h = harness("send-first", Keys::Honoured).await;
    h.report();
    let consumer = "lease-crash-send-first";
    let states = h.states(consumer).await;
    let mut charged_once = 0;
    for n in 0..h.messages {
        let id = h.id(n);
        assert_eq!(h.partner.charges_for(&id), 1, "{id}: charged once");
        assert_eq!(states.get(&id), Some(&None), "{id}: processed");
        charged_once += 1;
    }
    let recorded: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM lease_crash_charges WHERE message_id LIKE $1")
            .bind(format!("{}/%", h.run))
            .fetch_one(&h.pool)
            .await
            .unwrap();
    println!(
        "effects:        {charged_once} orders charged exactly once of {}, {recorded} charge ids recorded, {} dedup rows",
        h.messages,
        states.len()
    );
    println!(
        "partner:        {} requests, {} replayed for a repeated key, {} charges",
        h.partner.requests(),
        h.partner.replays(),
        h.partner.charges().len()
    );
    assert_eq!(
        recorded, h.messages as i64,
        "one recorded charge id per message"
    );
    assert_eq!(states.len(), h.messages);
    assert_eq!(h.partner.charges().len(), h.messages);
    assert!(
        h.partner.replays() >= h.tally.landed_in_window,
        "every kill after the call and before the completion was followed by a replayed call"
    );
    assert!(
        h.tally.landed_in_window >= 25,
        "the kills reached the window: {:?}",
        h.tally
    );
    assert_eq!(h.unacked().await, 0, "every message acknowledged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mark_first_is_at_most_once_and_never_silent_under_sigkill() {
    let h = harness("mark-first", Keys::Ignored).await;
    h.report();
    let consumer = "lease-crash-mark-first";
    let states = h.states(consumer).await;
    let unknown: HashSet<String> = Ledger::new(&h.pool)
        .unresolved(consumer, 1_000_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|row| row.status() == UnresolvedStatus::OutcomeUnknown)
        .map(|row| row.message_id().to_owned())
        .filter(|id| id.starts_with(&h.run))
        .collect();
    let (mut charged, mut lost, mut called_then_unknown) = (0, 0, 0);
    for n in 0..h.messages {
        let id = h.id(n);
        let charges = h.partner.charges_for(&id);
        assert!(
            charges <= 1,
            "{id}: charged {charges} times: mark-first is at most once"
        );
        match (charges, states.get(&id)) {
            (1, Some(None)) => charged += 1,
            (1, Some(Some(2))) => {
                assert!(unknown.contains(&id), "{id}: listed as unknown");
                called_then_unknown += 1;
            }
            (0, Some(Some(2))) => {
                assert!(unknown.contains(&id), "{id}: a lost charge is listed");
                lost += 1;
            }
            other => panic!("{id}: charged {} with dedup state {:?}", other.0, other.1),
        }
    }
    println!(
        "effects:        {charged} charged and processed, {lost} lost and listed unknown, \
         {called_then_unknown} charged but listed unknown (the kill came after the call), \
         none charged twice, of {}",
        h.messages
    );
    println!(
        "partner:        {} requests, {} charges (keys ignored)",
        h.partner.requests(),
        h.partner.charges().len()
    );
    assert_eq!(
        unknown.len(),
        lost + called_then_unknown,
        "only those are unknown"
    );
    assert!(lost > 0, "some kills landed before the call: {:?}", h.tally);
    assert!(
        h.tally.landed_in_window >= 25,
        "the kills reached the window: {:?}",
        h.tally
    );
    assert_eq!(h.unacked().await, 0, "every message acknowledged");
}
