//! Real brokers, real crashes: the consumers of `examples/rabbitmq.rs`,
//! `examples/nats.rs`, `examples/kafka.rs`, `examples/redis_streams.rs` and
//! `examples/mqtt.rs`, run as child processes and killed with SIGKILL again and again,
//! still apply every message's effect exactly once.
//!
//! For each broker the harness publishes 5,000 messages, 500 of them a second time (a
//! separate broker message with the same message id: the broker cannot know, dedup must
//! catch it) and 5 poison messages without an id. It then starts the example consumer
//! (4 consumers, prefetch 16, 10 ms between COMMIT and the acknowledgement) and kills it
//! 60 times, each time at a moment drawn at random from three kinds:
//!
//! - **start-up**: 0–400 ms after the process started (it is ready after about 100 ms), so
//!   many die while connecting, migrating or declaring, the rest in their first messages;
//! - **commit**: the moment the consumer reports `committed <id>`, i.e. inside the window
//!   between the COMMIT and the acknowledgement, the crash that at-least-once brokers turn
//!   into a redelivery of a message whose effect is already applied;
//! - **anywhere**: a few milliseconds after a random line of output: in a transaction, in
//!   an acknowledgement, between deliveries.
//!
//! A life whose moment does not come within 3 s of its `ready` line (a Kafka member's
//! first assignment, a second or so after its start) is killed then.
//!
//! After each kill it restarts the consumer; after the last, it lets one run until the
//! queue has been idle for a while and the process exits by itself. Then it checks, against
//! PostgreSQL and the broker: one effect row for every published id and no other, dedup
//! rows equal unique ids, the queue empty with nothing unacknowledged, the poison
//! messages (and only they) dead-lettered. It prints what it saw: kills, the kills that
//! caught a message between COMMIT and acknowledgement, redeliveries, duplicates.
//!
//! **Batches** (`rabbitmq_batch_…`, `nats_batch_…`): the same harness with the examples in
//! batch mode (`BATCH=16`: up to 16 deliveries per transaction through
//! `dedup_runtime::batch`, one claim statement and one commit for all; on RabbitMQ one
//! multiple-ack), so that a kill between the commit and the acknowledgements catches up
//! to 16 messages at once.
//!
//! **Two hops** (`rabbitmq_two_hop_…`, `nats_two_hop_…`, `kafka_two_hop_…`): the same
//! input, consumed by service A (the example with `FORWARD_TO`: its `#[idempotent]`
//! transaction writes the effect and enqueues an event for B in the outbox, the event's id
//! derived from the input's); the relay (`examples/outbox_relay.rs`, a 1 s lease, each
//! claim sent at once through the publisher's `publish_batch`, a 5 ms pause after each
//! batch of sends) publishes the events to a second queue, stream or topic; service B (the
//! plain example) consumes them. A, the relay and B are killed side by side, 60 SIGKILLs
//! in all (24, 18, 18; the relay's on-commit kills land right after a `sent` line, i.e.
//! after its batch's sends and before their mark, so the whole claim is sent again; the
//! relay's and B's kills are drawn over the backlog left to them upstream, as they can get
//! no further, and A's and B's within what their lives have been seen to reach), then each
//! runs to the end in turn. The checks: every input's effect exactly once in A, every
//! event sent and its effect exactly once in B, no event lost or dead, the relay sent some
//! events twice and B took each re-send for a duplicate. (JetStream would drop a re-send
//! within its duplicate window by `Nats-Msg-Id`; the events' stream has the least, 100 ms,
//! so that every re-send reaches B. On Kafka the relay's producer is idempotent, which
//! drops only its own retries within one producer session: a re-send from a later life is
//! a new record.)
//!
//! The crate feature `brokers` builds it (and the examples it runs): `cargo test --features
//! brokers --test brokers`, or `--all-features` as CI does. Larger runs:
//! `DEDUP_CRASH_MESSAGES=50000 DEDUP_CRASH_KILLS=500 cargo test --features brokers --test brokers`.
//! `DEDUP_CRASH_SEED` fixes the random choices (the timing of a real crash is not
//! reproducible, the plan is). The services are the machine's: RabbitMQ on
//! 127.0.0.1:5672 (`DEDUP_TEST_AMQP_URL`), NATS with JetStream on 127.0.0.1:4222
//! (`DEDUP_TEST_NATS_URL`), a Kafka-protocol broker on 127.0.0.1:19092
//! (`DEDUP_TEST_KAFKA_BROKERS`; `.ci/run` starts tansu there), Redis on 127.0.0.1:6379
//! (`DEDUP_TEST_REDIS_URL`), PostgreSQL as for the other tests; the MQTT harness starts a
//! Mosquitto of its own. A broker that cannot be reached fails its test: nothing skips.
//!
//! The harnesses run two at a time, in two lanes (`BUSY` and `WAITING` below): one that
//! keeps the CPU busy (RabbitMQ, NATS, Redis, MQTT) beside one of the Kafka ones, which
//! mostly wait for their group's rebalances.
//!
//! **Kafka** (`kafka_…`): a topic of 4 partitions, the records spread round-robin over
//! them; one consumer-group member with a worker per partition, a 1 s session timeout
//! (a killed member's partitions go to the next life about a second later). Kafka keeps
//! no delivery count: the harness counts a record (`topic/partition/offset`) delivered
//! again after a kill itself. The checks: the group's committed offset of every
//! partition at its end (from the delivery reports: tansu's ListOffsets answers short
//! ends for multi-record batches), and the dead-letter topic holding the poison messages
//! and nothing else. In the two-hop run the relay's producer picks the events' partitions
//! (they have no ordering key), so the ends of the events' topic are read back after the
//! run, record by record (Fetch): B's group must have committed each, and B must have been
//! delivered every record of it; A's dead-letter topic holds the poison messages and
//! nothing else, B's nothing.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedup_suite::Shuffle;
use futures_util::FutureExt;
use sqlx::PgPool;

/// Unique messages published, by default.
const DEFAULT_MESSAGES: usize = 5_000;
/// SIGKILLs per broker, by default.
const DEFAULT_KILLS: usize = 60;
/// Messages without an id: the handler refuses them (`InvalidMessageId`), so the consumer
/// dead-letters them.
const POISON: usize = 5;
/// Consumer tasks in each consumer process.
const CONSUMERS: &str = "4";
/// Messages each consumer task takes ahead of acknowledging.
const PREFETCH: &str = "16";
/// The pause the examples make between COMMIT and the acknowledgement, so that many kills
/// land there.
const CRASH_WINDOW_MS: &str = "10";
/// JetStream redelivers a killed consumer's unacknowledged messages after this long.
const NATS_ACK_WAIT: Duration = Duration::from_secs(2);

/// A lane the harnesses run in: one harness in it at a time.
type Lane = tokio::sync::Mutex<()>;

/// The lane of the harnesses that keep the CPU busy: RabbitMQ, NATS, Redis Streams and
/// MQTT, whose consumers, brokers and PostgreSQL are all at work at once. One at a time on
/// a small machine (two cores): two of them would starve each other's consumers, and
/// each measures its own duration.
static BUSY: Lane = Lane::const_new(());

/// The lane of the harnesses that mostly wait: the Kafka ones (`kafka_…`), which leave
/// the CPU about 90 % idle while their group rebalances after each kill. One runs beside
/// the busy lane's, so at most two harnesses run at once, one per lane. Nothing else is
/// shared between the two: each run names its own queues, streams, topics, groups,
/// message ids (under the run's prefix) and outbox tables, the effects tables are each
/// broker's own, and MQTT's Mosquitto is its own, on a free port. Each harness writes its
/// report with one `write_all` on a locked stderr, so two reports never mix.
static WAITING: Lane = Lane::const_new(());

/// libtest runs as many tests at once as the machine has cores unless told otherwise,
/// taking them in name order, and a test waiting for its lane holds one of those slots:
/// on two cores the first two tests by name, both Kafka's, would take both slots, the
/// second waiting for the first's lane, and the busy lane would stay empty for the whole
/// of the first Kafka harness. So, before libtest reads it, this binary asks for more
/// test threads than it has tests (they wait in their lanes, costing a sleeping thread
/// each), unless `RUST_TEST_THREADS` is set; `--test-threads` still overrides it.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static TEST_THREADS: extern "C" fn() = {
    extern "C" fn enough_test_threads() {
        if std::env::var_os("RUST_TEST_THREADS").is_none() {
            // SAFETY: before `main`, no other thread reads or writes the environment.
            unsafe { std::env::set_var("RUST_TEST_THREADS", "16") };
        }
    }
    enough_test_threads
};

// ---------------------------------------------------------------------------------------
// What to publish
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
struct Scale {
    messages: usize,
    duplicates: usize,
    kills: usize,
    seed: u64,
}

impl Scale {
    fn from_env() -> Scale {
        let number = |name: &str, default: u64| -> u64 {
            std::env::var(name).map_or(default, |text| {
                text.parse()
                    .unwrap_or_else(|_| panic!("{name}: expected a number, got {text:?}"))
            })
        };
        let messages = usize::try_from(number("DEDUP_CRASH_MESSAGES", DEFAULT_MESSAGES as u64))
            .expect("DEDUP_CRASH_MESSAGES fits in usize");
        let kills = usize::try_from(number("DEDUP_CRASH_KILLS", DEFAULT_KILLS as u64))
            .expect("DEDUP_CRASH_KILLS fits in usize");
        let clock = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |elapsed| elapsed.as_nanos() as u64);
        Scale {
            messages: messages.max(1),
            duplicates: messages / 10,
            kills,
            seed: number("DEDUP_CRASH_SEED", clock),
        }
    }
}

/// One broker message: `id` `None` is a poison message (no message id at all).
#[derive(Clone)]
struct Publish {
    id: Option<String>,
    body: String,
}

/// The messages of a run, in publication order: every unique message once, a tenth of
/// them a second time (half right behind the first copy, so that two consumers handle the
/// copies at the same moment; half anywhere), and the poison messages, shuffled.
fn plan(run: &str, scale: &Scale, random: &mut Shuffle) -> Vec<Publish> {
    let mut groups: Vec<Vec<Publish>> = (0..scale.messages)
        .map(|n| {
            vec![Publish {
                id: Some(format!("{run}/{n}")),
                body: format!("payment-{n}"),
            }]
        })
        .collect();
    let mut doubled: Vec<usize> = (0..scale.messages).collect();
    random.shuffle(&mut doubled);
    for (k, &n) in doubled.iter().take(scale.duplicates).enumerate() {
        let copy = groups[n][0].clone();
        if k % 2 == 0 {
            groups[n].push(copy);
        } else {
            groups.push(vec![copy]);
        }
    }
    groups.extend((0..POISON).map(|k| {
        vec![Publish {
            id: None,
            body: format!("poison-{k}"),
        }]
    }));
    random.shuffle(&mut groups);
    groups.into_iter().flatten().collect()
}

fn poison_bodies() -> HashSet<String> {
    (0..POISON).map(|k| format!("poison-{k}")).collect()
}

// ---------------------------------------------------------------------------------------
// The consumer processes
// ---------------------------------------------------------------------------------------

/// The example binaries, built once per test process with the test's own profile and the
/// feature that enables them, `brokers`.
fn example(name: &str) -> PathBuf {
    dedup_suite::example_binary(
        "brokers",
        &[
            "rabbitmq",
            "rabbitmq_inbox",
            "nats",
            "outbox_relay",
            "redis_streams",
            "mqtt",
            "kafka",
        ],
        name,
    )
}

/// When to kill a consumer process.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// This long after it started.
    AfterStart(Duration),
    /// As soon as it reports the n-th commit: the message is between COMMIT and ack.
    OnCommit(usize),
    /// This long after its n-th line of output.
    AfterLine(usize, Duration),
}

impl Kill {
    fn kind(self) -> usize {
        match self {
            Kill::AfterStart(_) => 0,
            Kill::OnCommit(_) => 1,
            Kill::AfterLine(..) => 2,
        }
    }
}

/// What the consumer processes reported, over all their lives.
#[derive(Default)]
struct Tally {
    lives: usize,
    kills: usize,
    kills_by_kind: [usize; 3],
    /// Kills whose trigger never came (the queue had run dry): killed after a pause.
    kills_on_timeout: usize,
    /// Kills that caught at least one message committed but not yet acknowledged.
    kills_in_window: usize,
    /// The messages so caught.
    caught_in_window: HashSet<String>,
    deliveries: usize,
    redeliveries: usize,
    /// The records (`topic/partition/offset`, where a consumer's `delivered` lines say
    /// it: Kafka's) delivered so far, and how many deliveries were of one delivered to an
    /// earlier life or attempt already.
    records: HashSet<String>,
    reread: usize,
    committed: usize,
    committed_ids: HashSet<String>,
    duplicates: usize,
    duplicate_ids: HashSet<String>,
    acked: usize,
    retries: usize,
    dead: usize,
}

/// How one life of a child process ended.
struct Ended {
    killed: bool,
    /// Killed after a pause, its trigger never having come (the work had run out).
    timed_out: bool,
}

/// Runs one life of `program`: killed as `kill` says, or (`None`) left to run until it
/// exits by itself, within `patience`. `on_line` reads each line of its output and says
/// whether it is a trigger for [`Kill::OnCommit`] (a commit; a relay's send). Panics if
/// it fails or exits when it should not.
fn life(
    program: &Path,
    env: &[(&str, String)],
    kill: Option<Kill>,
    patience: Duration,
    mut on_line: impl FnMut(&str) -> bool,
) -> Ended {
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

    let mut deadline = match kill {
        Some(Kill::AfterStart(after)) => started + after,
        _ => started + patience,
    };
    // The deadline is the patience's, which restarts at a `ready` line (a Kafka member is
    // ready at its first assignment, a second or two after it started).
    let mut on_patience = matches!(kill, Some(Kill::OnCommit(_) | Kill::AfterLine(..)));
    let mut killed = false;
    let mut timed_out = false;
    let (mut triggers, mut lines_seen) = (0, 0);
    loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        let line = match receive.recv_timeout(wait) {
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                if killed {
                    // Dead; its output is still draining.
                    deadline = Instant::now() + Duration::from_secs(30);
                    continue;
                }
                match kill {
                    Some(_) => {
                        timed_out = on_patience;
                        child.kill().expect("SIGKILL the child");
                        killed = true;
                        continue;
                    }
                    None => {
                        child.kill().ok();
                        panic!(
                            "the last life of {} did not finish within {patience:?}; its \
                             stderr:\n{}",
                            program.display(),
                            errors.join().unwrap_or_default()
                        );
                    }
                }
            }
        };
        lines_seen += 1;
        let trigger = on_line(&line);
        triggers += usize::from(trigger);
        if killed {
            continue;
        }
        if on_patience && line == "ready" {
            deadline = Instant::now() + patience;
        }
        match kill {
            Some(Kill::OnCommit(n)) if trigger && triggers == n => {
                child.kill().expect("SIGKILL the child");
                killed = true;
            }
            Some(Kill::AfterLine(n, after)) if lines_seen == n => {
                deadline = Instant::now() + after;
                on_patience = false;
            }
            _ => {}
        }
    }
    let status = child.wait().expect("wait for the child");
    reader.join().expect("stdout reader");
    let stderr = errors.join().unwrap_or_default();
    if !killed {
        assert!(
            kill.is_none() && status.success(),
            "{} exited by itself ({status}) when it should have been killed or exited \
             cleanly; its stderr:\n{stderr}",
            program.display()
        );
    }
    Ended { killed, timed_out }
}

/// One life of the consumer `program` ([`life`]), its lines counted into `tally`.
fn live(
    program: &Path,
    env: &[(&str, String)],
    kill: Option<Kill>,
    patience: Duration,
    tally: &mut Tally,
) {
    tally.lives += 1;
    // Committed and not yet acknowledged, in this life.
    let mut open: HashSet<String> = HashSet::new();
    let ended = life(program, env, kill, patience, |line| {
        let mut words = line.splitn(3, ' ');
        let (event, first, rest) = (words.next(), words.next(), words.next());
        match (event, first, rest) {
            (Some("ready"), None, None) => {}
            (Some("delivered"), Some(count), Some(rest)) => {
                tally.deliveries += 1;
                if count.parse::<u64>().is_ok_and(|count| count > 1) {
                    tally.redeliveries += 1;
                }
                // `<id> <topic>/<partition>/<offset>`, from a consumer that says where.
                if let Some((_id, record)) = rest.split_once(' ')
                    && !tally.records.insert(record.to_owned())
                {
                    tally.reread += 1;
                }
            }
            (Some("committed"), Some(id), None) => {
                tally.committed += 1;
                tally.committed_ids.insert(id.to_owned());
                open.insert(id.to_owned());
                return true;
            }
            (Some("duplicate"), Some(id), None) => {
                tally.duplicates += 1;
                tally.duplicate_ids.insert(id.to_owned());
            }
            (Some("acked"), Some(id), None) => {
                tally.acked += 1;
                open.remove(id);
            }
            (Some("retry"), Some(_), None) => tally.retries += 1,
            (Some("dead"), Some(_), Some(_)) => tally.dead += 1,
            _ => panic!("unexpected line from the consumer: {line:?}"),
        }
        false
    });
    if ended.killed {
        tally.kills += 1;
        tally.kills_by_kind[kill.map_or(0, Kill::kind)] += 1;
        tally.kills_on_timeout += usize::from(ended.timed_out);
        if !open.is_empty() {
            tally.kills_in_window += 1;
            tally.caught_in_window.extend(open);
        }
    }
}

/// A random moment to kill a life at, given the work left for the kills left.
fn draw_kill(k: usize, remaining: usize, kills_left: usize, random: &mut Shuffle) -> Kill {
    // Spread the progress over the kills, so that the last ones still find work.
    draw_kill_within(k, remaining / (kills_left + 1), random)
}

/// A random moment to kill a life at, about `budget` messages into its work (a commit
/// up to twice that, or a line up to six times that).
fn draw_kill_within(k: usize, budget: usize, random: &mut Shuffle) -> Kill {
    let budget = budget.max(1) as u64;
    match (k % 5, random.next_u64() % 2) {
        (0, _) => Kill::AfterStart(Duration::from_millis(random.next_u64() % 400)),
        (_, 0) => Kill::OnCommit(1 + (random.next_u64() % (2 * budget)) as usize),
        _ => Kill::AfterLine(
            1 + (random.next_u64() % (6 * budget)) as usize,
            Duration::from_millis(random.next_u64() % 15),
        ),
    }
}

/// A life whose trigger does not come within this long (the work ran out first) is
/// killed anyway: counted from its `ready` line if it prints one, else from its start.
const PATIENCE: Duration = Duration::from_secs(3);

/// The lives of a crash loop that end in a SIGKILL: `scale.kills` of them.
fn kill_lives(program: &Path, env: &[(&str, String)], scale: &Scale, tally: &mut Tally) {
    let mut random = Shuffle::new(scale.seed ^ 0x6b11_1e55);
    for k in 0..scale.kills {
        let remaining = scale.messages.saturating_sub(done(tally));
        let kill = draw_kill(k, remaining, scale.kills - k, &mut random);
        live(program, env, Some(kill), PATIENCE, tally);
    }
}

/// The messages a consumer has done: a message reported as a duplicate was committed,
/// possibly by a process killed before it could say so.
fn done(tally: &Tally) -> usize {
    tally.committed_ids.union(&tally.duplicate_ids).count()
}

/// The lives of a consumer of a two-hop run (A, B) that end in a SIGKILL, drawn as
/// [`kill_lives`]'s with two bounds, for a consumer in a chain gets less done in a life
/// than one alone, and a trigger past what a life can reach only waits out the patience:
/// `fed`, for one fed as it goes (B, by the relay), says how many messages it has been
/// given so far, and its triggers are drawn over the backlog left to it, not over the
/// run's remaining work; and none is drawn past half the most commits one of its lives
/// has made so far. `tell` hears, after each life, how many messages it has done.
fn two_hop_kill_lives(
    program: &Path,
    env: &[(&str, String)],
    scale: &Scale,
    tally: &mut Tally,
    fed: Option<&AtomicUsize>,
    mut tell: impl FnMut(usize),
) {
    let mut random = Shuffle::new(scale.seed ^ 0x6b11_1e55);
    let mut reach = 0;
    for k in 0..scale.kills {
        let budget = match fed {
            None => scale.messages.saturating_sub(done(tally)) / (scale.kills - k + 1),
            Some(fed) => fed.load(Ordering::Relaxed).saturating_sub(done(tally)) / 2,
        };
        let budget = if reach > 0 {
            budget.min(reach / 4)
        } else {
            budget
        };
        let committed = tally.committed;
        let kill = draw_kill_within(k, budget, &mut random);
        live(program, env, Some(kill), PATIENCE, tally);
        reach = reach.max(tally.committed - committed);
        tell(done(tally));
    }
}

/// The last life of a crash loop: runs until it has been idle for `exit_when_idle`.
fn last_life(
    program: &Path,
    env: &[(&str, String)],
    scale: &Scale,
    exit_when_idle: Duration,
    tally: &mut Tally,
) {
    let mut last = env.to_vec();
    last.push((
        "DEDUP_EXIT_WHEN_IDLE_MS",
        exit_when_idle.as_millis().to_string(),
    ));
    let patience = Duration::from_secs(60) + Duration::from_millis(20 * scale.messages as u64);
    live(program, &last, None, patience, tally);
}

/// Kills the consumer `scale.kills` times at random moments, restarting it each time,
/// then runs it to the end. `exit_when_idle` tells the last life when the queue is done.
fn crash_loop(
    program: &Path,
    env: &[(&str, String)],
    scale: &Scale,
    exit_when_idle: Duration,
) -> Tally {
    let mut tally = Tally::default();
    kill_lives(program, env, scale, &mut tally);
    last_life(program, env, scale, exit_when_idle, &mut tally);
    tally
}

// ---------------------------------------------------------------------------------------
// Checks and the report
// ---------------------------------------------------------------------------------------

/// What the database holds for a run.
struct Stored {
    /// Effect rows per message id.
    effects: HashMap<String, i64>,
    dedup_rows: i64,
}

async fn stored(pool: &PgPool, effects_table: &str, consumer: &str, run: &str) -> Stored {
    stored_in(pool, effects_table, "processed_messages", consumer, run).await
}

/// [`stored`], the dedup rows read from `dedup_table` (the inbox's, for the inbox
/// consumer: its rows processed).
async fn stored_in(
    pool: &PgPool,
    effects_table: &str,
    dedup_table: &str,
    consumer: &str,
    run: &str,
) -> Stored {
    let pattern = format!("{run}/%");
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, COUNT(*) FROM {effects_table} WHERE message_id LIKE $1 \
         GROUP BY message_id"
    )))
    .bind(&pattern)
    .fetch_all(pool)
    .await
    .expect("read the effects");
    let processed = if dedup_table == "processed_messages" {
        ""
    } else {
        " AND state = 2"
    };
    let dedup_rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {dedup_table} WHERE consumer = $1 AND message_id LIKE $2{processed}"
    )))
    .bind(consumer)
    .bind(&pattern)
    .fetch_one(pool)
    .await
    .expect("count the dedup rows");
    Stored {
        effects: rows.into_iter().collect(),
        dedup_rows,
    }
}

/// Every published id has exactly one effect, there are no others, and one dedup row
/// each; the kills did land, including between COMMIT and acknowledgement.
fn check(published: &[Publish], stored: &Stored, tally: &Tally, scale: &Scale) {
    let unique: HashSet<&str> = published.iter().filter_map(|p| p.id.as_deref()).collect();
    let wrong: Vec<(&str, i64)> = unique
        .iter()
        .map(|id| (*id, stored.effects.get(*id).copied().unwrap_or(0)))
        .filter(|(_, rows)| *rows != 1)
        .take(10)
        .collect();
    assert!(
        wrong.is_empty(),
        "messages whose effect is not applied exactly once (id, rows), first 10: {wrong:?}"
    );
    let strangers: Vec<&String> = stored
        .effects
        .keys()
        .filter(|id| !unique.contains(id.as_str()))
        .take(10)
        .collect();
    assert!(
        strangers.is_empty(),
        "effects of unknown ids: {strangers:?}"
    );
    assert_eq!(
        stored.effects.len(),
        unique.len(),
        "ids with an effect vs unique ids published"
    );
    assert_eq!(
        stored.dedup_rows,
        unique.len() as i64,
        "dedup rows vs unique ids published"
    );
    assert_eq!(tally.kills, scale.kills, "kills made");
    if scale.kills >= 20 {
        assert!(
            tally.kills_in_window >= scale.kills / 5,
            "only {} of {} kills caught a message between COMMIT and acknowledgement",
            tally.kills_in_window,
            tally.kills
        );
        assert!(
            tally
                .caught_in_window
                .iter()
                .any(|id| tally.duplicate_ids.contains(id)),
            "no message caught between COMMIT and acknowledgement came back as a duplicate"
        );
    }
}

/// The figures of a run, written straight to the terminal: libtest captures `println!`,
/// and these figures are what the test is for.
#[allow(clippy::too_many_arguments)]
fn report(
    broker: &str,
    published: &[Publish],
    stored: &Stored,
    tally: &Tally,
    scale: &Scale,
    dead_lettered: usize,
    broker_state: &str,
    elapsed: Duration,
) {
    let unique = published.iter().filter(|p| p.id.is_some()).count();
    let unique_ids: HashSet<&str> = published.iter().filter_map(|p| p.id.as_deref()).collect();
    let duplicates_published = unique - unique_ids.len();
    let caught_then_duplicate = tally
        .caught_in_window
        .iter()
        .filter(|id| tally.duplicate_ids.contains(*id))
        .count();
    let effects: i64 = stored.effects.values().sum();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\n== {broker}: crash harness (seed {}) ==",
        scale.seed
    );
    let _ = writeln!(
        text,
        "published:      {} broker messages = {} unique ids + {} published duplicates + {} \
         poison (no id)",
        published.len(),
        unique_ids.len(),
        duplicates_published,
        POISON
    );
    let _ = writeln!(
        text,
        "kills:          {} SIGKILLs over {} consumer lives ({} at start-up, {} on a commit, \
         {} anywhere; {} after waiting for a trigger that did not come)",
        tally.kills,
        tally.lives,
        tally.kills_by_kind[0],
        tally.kills_by_kind[1],
        tally.kills_by_kind[2],
        tally.kills_on_timeout
    );
    let _ = writeln!(
        text,
        "commit→ack:     {} kills landed with a message committed but not acknowledged ({} \
         messages; {} of them redelivered and recognised as duplicates)",
        tally.kills_in_window,
        tally.caught_in_window.len(),
        caught_then_duplicate
    );
    let _ = writeln!(
        text,
        "                and {} commits whose process was killed before it could even report \
         them",
        usize::try_from(effects)
            .unwrap_or(0)
            .saturating_sub(tally.committed_ids.len())
    );
    let _ = writeln!(
        text,
        "deliveries:     {} ({} redeliveries flagged by the broker); {} committed, {} \
         duplicates recognised, {} acknowledged, {} retried, {} dead-lettered",
        tally.deliveries,
        tally.redeliveries,
        tally.committed,
        tally.duplicates,
        tally.acked,
        tally.retries,
        tally.dead
    );
    let _ = writeln!(
        text,
        "effects:        {effects} rows for {} ids, each exactly once; {} dedup rows",
        stored.effects.len(),
        stored.dedup_rows
    );
    let _ = writeln!(
        text,
        "broker:         {broker_state}; dead letters: {dead_lettered} (the {POISON} poison \
         messages)"
    );
    let _ = writeln!(text, "duration:       {:.1} s", elapsed.as_secs_f64());
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// An example consumer under the harness: its example's name, its effects table and its
/// dedup consumer name.
struct Subject {
    example: &'static str,
    effects_table: &'static str,
    consumer: &'static str,
}

/// The part of a consumer's crash harness after its broker holds `published`: builds the
/// example, kills it `scale.kills` times and runs it to the end with `env`
/// ([`crash_loop`], the last life exiting once idle for `idle`), then reads the run's
/// effect and dedup rows back and [`check`]s them.
async fn crash_and_check(
    pool: &PgPool,
    subject: &Subject,
    env: Vec<(&'static str, String)>,
    scale: &Scale,
    idle: Duration,
    run: &str,
    published: &[Publish],
) -> (Tally, Stored) {
    let name = subject.example;
    let program = tokio::task::spawn_blocking(move || example(name))
        .await
        .expect("build the examples");
    let tally = {
        let scale = scale.clone();
        tokio::task::spawn_blocking(move || crash_loop(&program, &env, &scale, idle))
            .await
            .expect("the crash loop")
    };
    let stored = stored(pool, subject.effects_table, subject.consumer, run).await;
    check(published, &stored, &tally, scale);
    (tally, stored)
}

/// Runs `body`, then `cleanup` whatever happened, then re-raises a panic of `body`.
async fn with_cleanup<T>(body: impl Future<Output = T>, cleanup: impl Future<Output = ()>) -> T {
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Deletes a passed run's effect and dedup rows, so that the tables do not grow with
/// every run. (A failed run keeps them, for a look.)
async fn forget_run(pool: &PgPool, effects_table: &str, consumer: &str, run: &str) {
    forget_run_in(pool, effects_table, "processed_messages", consumer, run).await;
}

/// [`forget_run`], the dedup rows in `dedup_table`.
async fn forget_run_in(
    pool: &PgPool,
    effects_table: &str,
    dedup_table: &str,
    consumer: &str,
    run: &str,
) {
    let pattern = format!("{run}/%");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {effects_table} WHERE message_id LIKE $1"
    )))
    .bind(&pattern)
    .execute(pool)
    .await
    .expect("delete this run's effects");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {dedup_table} WHERE consumer = $1 AND message_id LIKE $2"
    )))
    .bind(consumer)
    .bind(&pattern)
    .execute(pool)
    .await
    .expect("delete this run's dedup rows");
}

// ---------------------------------------------------------------------------------------
// Two hops: A consumes and enqueues an event in its transaction, a relay publishes the
// events, B consumes them
// ---------------------------------------------------------------------------------------

/// Service A's dedup consumer in `examples/rabbitmq.rs`, `examples/nats.rs` and
/// `examples/kafka.rs` with `FORWARD_TO` set, and the consumer its events' ids derive from.
fn forwarding_consumer(example: &str) -> String {
    format!("{example}-example-forward")
}

/// The event A enqueues for each unique input message: its derived id, the input's body.
fn events(published: &[Publish], forwarder: &str) -> Vec<Publish> {
    let mut seen = HashSet::new();
    published
        .iter()
        .filter_map(|message| {
            let id = message.id.as_deref()?;
            seen.insert(id).then(|| Publish {
                id: Some(
                    dedup_runtime::outbox::Cause::new(forwarder, id)
                        .expect("a valid cause")
                        .id("event")
                        .expect("a valid slot")
                        .to_string(),
                ),
                body: message.body.clone(),
            })
        })
        .collect()
}

/// What the relay processes reported, over all their lives.
#[derive(Default)]
struct RelayTally {
    lives: usize,
    kills: usize,
    kills_by_kind: [usize; 3],
    kills_on_timeout: usize,
    /// Kills that caught a batch sent and not reported relayed: the broker had its
    /// messages, their rows were (almost always) not marked yet.
    kills_after_send: usize,
    /// Sends the broker confirmed, per event id.
    sends: HashMap<String, usize>,
    /// Rows whose mark found them another relay's (its lease had ended).
    lost: usize,
    dead: usize,
}

impl RelayTally {
    /// Events sent more than once, and the extra sends.
    fn resent(&self) -> (HashSet<&str>, usize) {
        let resent = self
            .sends
            .iter()
            .filter(|(_, sends)| **sends > 1)
            .map(|(id, _)| id.as_str())
            .collect();
        let extra = self.sends.values().map(|sends| sends - 1).sum();
        (resent, extra)
    }
}

/// One life of the relay command, its lines counted into `tally`.
fn relay_live(
    program: &Path,
    env: &[(&str, String)],
    kill: Option<Kill>,
    patience: Duration,
    tally: &mut RelayTally,
) {
    tally.lives += 1;
    // `sent` lines since the last `relayed` line: a batch sent, its mark to come.
    let mut pending = 0usize;
    let ended = life(program, env, kill, patience, |line| {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["sent", id] => {
                pending += 1;
                *tally.sends.entry(id.to_owned()).or_default() += 1;
                return true;
            }
            [
                "relayed",
                _,
                "sent",
                _,
                "lost",
                lost,
                "failed",
                _,
                "dead",
                dead,
            ] => {
                pending = 0;
                tally.lost += lost.parse::<usize>().expect("a count");
                tally.dead += dead.parse::<usize>().expect("a count");
            }
            ["idle"] => {}
            _ => panic!("unexpected line from the relay: {line:?}"),
        }
        false
    });
    if ended.killed {
        tally.kills += 1;
        tally.kills_by_kind[kill.map_or(0, Kill::kind)] += 1;
        tally.kills_on_timeout += usize::from(ended.timed_out);
        tally.kills_after_send += usize::from(pending > 0);
    }
}

/// A process of a two-hop run: its program, environment, kills and idle time at the end.
struct Hop {
    program: PathBuf,
    env: Vec<(&'static str, String)>,
    scale: Scale,
    exit_when_idle: Duration,
}

/// The three crash loops of a two-hop run, side by side (each kills its own process, at
/// random moments, `scale.kills` times), then the last lives one after the other: A until
/// its queue is done, the relay until the outbox is, B until the events are.
fn two_hop_lives(a: &Hop, relay: &Hop, b: &Hop) -> (Tally, RelayTally, Tally) {
    // Inputs A has done (each enqueued its event), as of A's last life; events the relay
    // has sent, as of its last.
    let (a_done, relay_sent) = (&AtomicUsize::new(0), &AtomicUsize::new(0));
    let (mut tally_a, mut tally_relay, mut tally_b) = std::thread::scope(|scope| {
        let a = scope.spawn(move || {
            let mut tally = Tally::default();
            two_hop_kill_lives(&a.program, &a.env, &a.scale, &mut tally, None, |done| {
                a_done.store(done, Ordering::Relaxed);
            });
            tally
        });
        let relay = scope.spawn(move || {
            let mut tally = RelayTally::default();
            let mut random = Shuffle::new(relay.scale.seed ^ 0x5e4d_0a11);
            for k in 0..relay.scale.kills {
                // The relay sends what A has enqueued, no more: its triggers are drawn over
                // that backlog (a send kill lands mostly in a life's first batches, the
                // backlog the last kill left), not over the run's remaining work, which
                // would have most of them wait in vain for a send and die at the timeout.
                let backlog = a_done
                    .load(Ordering::Relaxed)
                    .saturating_sub(tally.sends.len());
                let kill = draw_kill_within(k, backlog / 2, &mut random);
                relay_live(&relay.program, &relay.env, Some(kill), PATIENCE, &mut tally);
                relay_sent.store(tally.sends.len(), Ordering::Relaxed);
            }
            tally
        });
        let b = scope.spawn(move || {
            let mut tally = Tally::default();
            let fed = Some(relay_sent);
            two_hop_kill_lives(&b.program, &b.env, &b.scale, &mut tally, fed, |_| {});
            tally
        });
        (
            a.join().expect("A's crash loop"),
            relay.join().expect("the relay's crash loop"),
            b.join().expect("B's crash loop"),
        )
    });
    last_life(&a.program, &a.env, &a.scale, a.exit_when_idle, &mut tally_a);
    let mut env = relay.env.clone();
    env.push((
        "DEDUP_EXIT_WHEN_IDLE_MS",
        relay.exit_when_idle.as_millis().to_string(),
    ));
    let patience =
        Duration::from_secs(60) + Duration::from_millis(20 * relay.scale.messages as u64);
    relay_live(&relay.program, &env, None, patience, &mut tally_relay);
    last_life(&b.program, &b.env, &b.scale, b.exit_when_idle, &mut tally_b);
    (tally_a, tally_relay, tally_b)
}

/// What the database holds for the ids `ids` (B's events): effect rows per id, and
/// `consumer`'s dedup rows among them.
async fn stored_ids(pool: &PgPool, effects_table: &str, consumer: &str, ids: &[String]) -> Stored {
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT message_id, COUNT(*) FROM {effects_table} WHERE message_id = ANY($1) \
         GROUP BY message_id"
    )))
    .bind(ids)
    .fetch_all(pool)
    .await
    .expect("read the effects");
    let dedup_rows: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = $1 AND message_id = ANY($2)",
    )
    .bind(consumer)
    .bind(ids)
    .fetch_one(pool)
    .await
    .expect("count the dedup rows");
    Stored {
        effects: rows.into_iter().collect(),
        dedup_rows,
    }
}

/// The outbox's rows by state: every event sent, once each (the ids are its key), none
/// left or dead.
async fn check_outbox(pool: &PgPool, table: &str, events: &[Publish]) -> String {
    let states: Vec<(i16, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state::int2, COUNT(*) FROM {table} GROUP BY state ORDER BY state"
    )))
    .fetch_all(pool)
    .await
    .expect("read the outbox");
    assert_eq!(
        states,
        [(2, events.len() as i64)],
        "outbox rows by state (2: sent): every event sent, none unsent or dead"
    );
    let attempts: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COALESCE(SUM(attempts), 0)::int8 FROM {table}"
    )))
    .fetch_one(pool)
    .await
    .expect("count the relay's attempts");
    format!(
        "{} rows, all sent, in {attempts} claims (a killed relay's claim is counted too)",
        events.len()
    )
}

/// The two-hop checks beyond each hop's own: the relay was killed between sends and
/// marks and sent some events again, and B took every re-send for the duplicate it is.
fn check_two_hop(relay: &RelayTally, b: &Tally, scale: &Scale) {
    assert_eq!(relay.kills, scale.kills, "relay kills made");
    assert_eq!(relay.dead, 0, "no event dead in the outbox");
    let (resent, _) = relay.resent();
    assert!(
        !resent.is_empty(),
        "no event was sent twice: the relay's kills ({} of them with a batch sent, not yet \
         reported relayed) never caught a sent row unmarked",
        relay.kills_after_send
    );
    let missed: Vec<&&str> = resent
        .iter()
        .filter(|id| !b.duplicate_ids.contains(**id))
        .take(10)
        .collect();
    assert!(
        missed.is_empty(),
        "events sent twice that B never recognised as a duplicate, first 10: {missed:?}"
    );
}

/// The figures of a two-hop run, in the form of [`report`].
fn report_two_hop(
    broker: &str,
    spec: &TwoHop<'_>,
    outcome: &TwoHopOutcome,
    broker_state: &str,
    elapsed: Duration,
) {
    let (published, seed, outbox) = (spec.published, spec.seed, &outcome.outbox);
    let ((tally_a, stored_a), relay, (tally_b, stored_b)) =
        (&outcome.a, &outcome.relay, &outcome.b);
    let unique_ids: HashSet<&str> = published.iter().filter_map(|p| p.id.as_deref()).collect();
    let with_id = published.iter().filter(|p| p.id.is_some()).count();
    let (resent, extra_sends) = relay.resent();
    let recognised = resent
        .iter()
        .filter(|id| tally_b.duplicate_ids.contains(**id))
        .count();
    let caught = |tally: &Tally| {
        tally
            .caught_in_window
            .iter()
            .filter(|id| tally.duplicate_ids.contains(*id))
            .count()
    };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\n== two-hop ({broker}): crash harness (seed {seed}) =="
    );
    let _ = writeln!(
        text,
        "published:      {} broker messages to A = {} unique ids + {} published duplicates + \
         {POISON} poison (no id)",
        published.len(),
        unique_ids.len(),
        with_id - unique_ids.len(),
    );
    let _ = writeln!(
        text,
        "kills:          {} SIGKILLs: A {} over {} lives, the relay {} over {} lives ({} with a \
         batch sent, before its mark), B {} over {} lives; {} after waiting for a trigger that \
         did not come (A {}, the relay {}, B {})",
        tally_a.kills + relay.kills + tally_b.kills,
        tally_a.kills,
        tally_a.lives,
        relay.kills,
        relay.lives,
        relay.kills_after_send,
        tally_b.kills,
        tally_b.lives,
        tally_a.kills_on_timeout + relay.kills_on_timeout + tally_b.kills_on_timeout,
        tally_a.kills_on_timeout,
        relay.kills_on_timeout,
        tally_b.kills_on_timeout,
    );
    let _ = writeln!(
        text,
        "commit→ack:     A: {} kills with a message committed, not acknowledged ({} messages, \
         {} back as duplicates); B: {} kills ({} messages, {} back as duplicates)",
        tally_a.kills_in_window,
        tally_a.caught_in_window.len(),
        caught(tally_a),
        tally_b.kills_in_window,
        tally_b.caught_in_window.len(),
        caught(tally_b),
    );
    let _ = writeln!(
        text,
        "re-sends:       {} events sent more than once ({extra_sends} extra sends); B \
         recognised {recognised} of the {} as duplicates; {} marks lost",
        resent.len(),
        resent.len(),
        relay.lost,
    );
    let _ = writeln!(
        text,
        "deliveries:     A: {} ({} committed, {} duplicates, {} dead-lettered); B: {} ({} \
         committed, {} duplicates, {} dead-lettered)",
        tally_a.deliveries,
        tally_a.committed,
        tally_a.duplicates,
        tally_a.dead,
        tally_b.deliveries,
        tally_b.committed,
        tally_b.duplicates,
        tally_b.dead,
    );
    let _ = writeln!(
        text,
        "effects:        A: {} rows for {} ids, each exactly once ({} dedup rows); B: {} rows \
         for {} events, each exactly once ({} dedup rows); outbox: {outbox}",
        stored_a.effects.values().sum::<i64>(),
        stored_a.effects.len(),
        stored_a.dedup_rows,
        stored_b.effects.values().sum::<i64>(),
        stored_b.effects.len(),
        stored_b.dedup_rows,
    );
    let _ = writeln!(text, "broker:         {broker_state}");
    let _ = writeln!(text, "duration:       {:.1} s", elapsed.as_secs_f64());
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Each process's share of a two-hop run's kills (A, the relay, B), and its seed.
fn two_hop_scales(scale: &Scale) -> [Scale; 3] {
    let relay = scale.kills * 3 / 10;
    let a = scale.kills - 2 * relay;
    [(a, 1), (relay, 2), (relay, 3)].map(|(kills, salt)| Scale {
        kills,
        seed: scale.seed ^ salt,
        ..scale.clone()
    })
}

/// The environment of a child process.
type Env = Vec<(&'static str, String)>;

/// The three processes of a two-hop run, each with its share of `scale`'s kills:
/// `consumer` as A (its environment `env_a` plus the forwarding to `output` through the
/// run's outbox) and as B (`env_b`), and `relay` with `broker` (the variable naming its
/// broker). The consumers' last lives end after `consumer_idle` without a delivery.
fn hops(
    spec: &TwoHop<'_>,
    (consumer, relay): (PathBuf, PathBuf),
    (mut env_a, env_b): (Env, Env),
    broker: (&'static str, String),
    output: &str,
    scale: &Scale,
    consumer_idle: Duration,
) -> [Hop; 3] {
    let [scale_a, scale_relay, scale_b] = two_hop_scales(scale);
    env_a.push(("FORWARD_TO", output.to_owned()));
    env_a.push(("DEDUP_OUTBOX_TABLE", spec.outbox_table.to_owned()));
    let mut env_relay = relay_env(database_url(), spec.outbox_table);
    env_relay.push(broker);
    [
        Hop {
            program: consumer.clone(),
            env: env_a,
            scale: scale_a,
            exit_when_idle: consumer_idle,
        },
        Hop {
            program: relay,
            env: env_relay,
            scale: scale_relay,
            exit_when_idle: Duration::from_millis(3000),
        },
        Hop {
            program: consumer,
            env: env_b,
            scale: scale_b,
            exit_when_idle: consumer_idle,
        },
    ]
}

/// The tables of a two-hop run, made before any service starts (as migrations run before
/// a deployment's services): the effects table, and the run's outbox, which the relay
/// needs from its first life.
async fn two_hop_tables(pool: &PgPool, spec: &TwoHop<'_>) {
    dedup_suite::ddl(
        pool,
        &format!(
            "CREATE TABLE IF NOT EXISTS {} (message_id text NOT NULL, body text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT now())",
            spec.effects_table
        ),
    )
    .await;
    dedup_runtime::outbox::migrate_table(pool, spec.outbox_table)
        .await
        .expect("create the run's outbox");
}

/// A two-hop run's database side: its input, the events A sends for it, where the
/// effects and the dedup rows go.
struct TwoHop<'a> {
    run: &'a str,
    seed: u64,
    published: &'a [Publish],
    events: &'a [Publish],
    effects_table: &'a str,
    /// A's dedup consumer, and the events' cause.
    forwarder: &'a str,
    /// B's dedup consumer.
    consumer: &'a str,
    outbox_table: &'a str,
}

/// What a two-hop run saw and stored.
struct TwoHopOutcome {
    a: (Tally, Stored),
    relay: RelayTally,
    b: (Tally, Stored),
    outbox: String,
}

/// Runs the three processes of a two-hop run (`hops`: A, the relay, B) and checks the
/// database: A's effects, the outbox, B's effects, the re-sends.
async fn two_hop(pool: &PgPool, spec: &TwoHop<'_>, hops: [Hop; 3]) -> TwoHopOutcome {
    let scales = [0, 1, 2].map(|k| hops[k].scale.clone());
    let (tally_a, relay, tally_b) =
        tokio::task::spawn_blocking(move || two_hop_lives(&hops[0], &hops[1], &hops[2]))
            .await
            .expect("the crash loops");
    let stored_a = stored(pool, spec.effects_table, spec.forwarder, spec.run).await;
    check(spec.published, &stored_a, &tally_a, &scales[0]);
    let outbox = check_outbox(pool, spec.outbox_table, spec.events).await;
    let ids: Vec<String> = spec.events.iter().filter_map(|e| e.id.clone()).collect();
    let stored_b = stored_ids(pool, spec.effects_table, spec.consumer, &ids).await;
    check(spec.events, &stored_b, &tally_b, &scales[2]);
    check_two_hop(&relay, &tally_b, &scales[1]);
    TwoHopOutcome {
        a: (tally_a, stored_a),
        relay,
        b: (tally_b, stored_b),
        outbox,
    }
}

/// The relay's environment in a two-hop run: reports its sends, pauses 5 ms after each
/// batch of sends (the kills on a `sent` line land before the batch's mark), and a 1 s
/// lease, so that a killed relay's rows are taken over within the run.
fn relay_env(database_url: String, outbox_table: &str) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", database_url),
        ("DEDUP_OUTBOX_TABLE", outbox_table.to_owned()),
        ("DEDUP_RELAY_LEASE_MS", "1000".to_owned()),
        ("DEDUP_RELAY_MAX_ATTEMPTS", "1000".to_owned()),
        ("DEDUP_REPORT_SENDS", "1".to_owned()),
        ("DEDUP_CRASH_WINDOW_MS", "5".to_owned()),
    ]
}

/// Deletes a passed two-hop run's rows: A's effects and dedup rows, B's, the outbox.
async fn forget_two_hop(pool: &PgPool, spec: &TwoHop<'_>) {
    let (effects_table, consumer, outbox_table) =
        (spec.effects_table, spec.consumer, spec.outbox_table);
    let events = spec.events;
    forget_run(pool, effects_table, spec.forwarder, spec.run).await;
    let ids: Vec<&str> = events.iter().filter_map(|e| e.id.as_deref()).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {effects_table} WHERE message_id = ANY($1)"
    )))
    .bind(&ids)
    .execute(pool)
    .await
    .expect("delete B's effects");
    sqlx::query("DELETE FROM processed_messages WHERE consumer = $1 AND message_id = ANY($2)")
        .bind(consumer)
        .bind(&ids)
        .execute(pool)
        .await
        .expect("delete B's dedup rows");
    for table in [outbox_table.to_owned(), format!("{outbox_table}_relay")] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await
            .expect("drop the run's outbox");
    }
}

fn database_url() -> String {
    dedup_suite::postgres_url()
}

// ---------------------------------------------------------------------------------------
// RabbitMQ
// ---------------------------------------------------------------------------------------

mod rabbitmq {
    use super::*;
    use lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    fn amqp_url() -> String {
        std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
    }

    /// Messages ready in `queue` and its consumers.
    async fn depth(channel: &Channel, queue: &str) -> (u32, u32) {
        let queue = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable().passive(),
                FieldTable::default(),
            )
            .await
            .expect("inspect the queue");
        (queue.message_count(), queue.consumer_count())
    }

    async fn cleanup(connection: &Connection, queue: &str) {
        let Ok(channel) = connection.create_channel().await else {
            eprintln!("could not open a channel to delete {queue}");
            return;
        };
        for name in [queue.to_owned(), format!("{queue}.dead")] {
            if let Err(error) = channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await
            {
                eprintln!("could not delete the queue {name}: {error}");
            }
        }
        let dlx = format!("{queue}.dlx");
        if let Err(error) = channel
            .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
            .await
        {
            eprintln!("could not delete the exchange {dlx}: {error}");
        }
    }

    /// A consumer example the RabbitMQ harness runs.
    struct Variant {
        /// `== <title>: crash harness`.
        title: &'static str,
        example: &'static str,
        effects_table: &'static str,
        create_effects: &'static str,
        /// Where its dedup rows are: `processed_messages`, or the inbox's table.
        dedup_table: &'static str,
        consumer: &'static str,
        /// More environment for the example.
        env: &'static [(&'static str, &'static str)],
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rabbitmq_consumer_is_effectively_once_under_sigkill() {
        harness(&Variant {
            title: "RabbitMQ",
            example: "rabbitmq",
            effects_table: "rabbitmq_example_effects",
            create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_example_effects (message_id \
                             text NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                             DEFAULT now())",
            dedup_table: "processed_messages",
            consumer: "rabbitmq-example",
            env: &[],
        })
        .await;
    }

    /// Batch mode: `examples/rabbitmq.rs` with `BATCH=16` takes up to 16 deliveries per
    /// transaction (`dedup_runtime::batch`: one claim statement, one multi-row insert, one
    /// commit) and acknowledges them with one multiple-ack; kills land between that
    /// commit and the ack, with up to 16 messages in the window.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rabbitmq_batch_consumer_is_effectively_once_under_sigkill() {
        harness(&Variant {
            title: "RabbitMQ, batches of 16",
            example: "rabbitmq",
            effects_table: "rabbitmq_example_effects",
            create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_example_effects (message_id \
                             text NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                             DEFAULT now())",
            dedup_table: "processed_messages",
            consumer: "rabbitmq-example",
            env: &[("BATCH", "16")],
        })
        .await;
    }

    /// The inbox in front: `examples/rabbitmq_inbox.rs` stores each delivery and
    /// acknowledges it at once, its workers process the inbox (2 workers, a 2 s lease);
    /// kills land between the inbox's commit and the acknowledgement, and in workers'
    /// transactions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rabbitmq_inbox_consumer_is_effectively_once_under_sigkill() {
        harness(&Variant {
            title: "inbox (RabbitMQ)",
            example: "rabbitmq_inbox",
            effects_table: "rabbitmq_inbox_effects",
            create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_inbox_effects (message_id text \
                             NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                             DEFAULT now())",
            dedup_table: "inbox_messages",
            consumer: "rabbitmq-inbox-example",
            env: &[("WORKERS", "2"), ("LEASE_MS", "2000")],
        })
        .await;
    }

    /// Publishes `published` to `queue` with publisher confirms.
    async fn publish_all(channel: &Channel, queue: &str, published: &[Publish]) {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("enable publisher confirms");
        for message in published {
            let mut properties = BasicProperties::default().with_delivery_mode(2);
            if let Some(id) = &message.id {
                properties = properties.with_message_id(id.as_str().into());
            }
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    message.body.as_bytes(),
                    properties,
                )
                .await
                .expect("publish");
        }
        let returned = channel
            .wait_for_confirms()
            .await
            .expect("publisher confirms");
        assert!(
            returned.is_empty(),
            "the broker returned {} messages",
            returned.len()
        );
        assert_eq!(
            depth(channel, queue).await,
            (published.len() as u32, 0),
            "queue depth after publishing"
        );
    }

    /// The bodies in `queue`'s dead-letter queue (read off it), and how many there were.
    async fn dead_letters(channel: &Channel, queue: &str) -> (usize, HashSet<String>) {
        let dead = format!("{queue}.dead");
        let (count, _) = depth(channel, &dead).await;
        let mut bodies = HashSet::new();
        while let Some(message) = channel
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .expect("read the dead-letter queue")
        {
            bodies.insert(String::from_utf8_lossy(&message.delivery.data).into_owned());
        }
        (count as usize, bodies)
    }

    /// Two hops over RabbitMQ: A (`examples/rabbitmq.rs` with `FORWARD_TO`) consumes the
    /// input queue, writes its effect and enqueues an event in one `#[idempotent]`
    /// transaction; the relay (`examples/outbox_relay.rs`) publishes the events to a
    /// second queue; B (`examples/rabbitmq.rs`) consumes them. All three are killed at
    /// random, side by side.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rabbitmq_two_hop_is_effectively_once_under_sigkill() {
        let _lane = BUSY.lock().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("two-hop");
        let (input, output) = (
            format!("dedup-crash.{run}.in"),
            format!("dedup-crash.{run}.out"),
        );
        let outbox_table = dedup_suite::unique_table("two_hop_outbox");
        let forwarder = forwarding_consumer("rabbitmq");
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                     -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
                )
            });
        let pool = dedup_suite::postgres().await;
        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        let events = events(&published, &forwarder);
        let spec = TwoHop {
            run: &run,
            seed: scale.seed,
            published: &published,
            events: &events,
            effects_table: "rabbitmq_example_effects",
            forwarder: &forwarder,
            consumer: "rabbitmq-example",
            outbox_table: &outbox_table,
        };

        let body = async {
            let channel = connection.create_channel().await.expect("open a channel");
            dedup_suite::rabbitmq::declare(&channel, &input, false).await;
            dedup_suite::rabbitmq::declare(&channel, &output, false).await;
            two_hop_tables(&pool, &spec).await;
            publish_all(&channel, &input, &published).await;

            let programs =
                tokio::task::spawn_blocking(|| (example("rabbitmq"), example("outbox_relay")))
                    .await
                    .expect("build the examples");
            let consumer_env = |queue: &str| {
                vec![
                    ("AMQP_URL", url.clone()),
                    ("DATABASE_URL", database_url()),
                    ("QUEUE", queue.to_owned()),
                    ("CONSUMERS", CONSUMERS.to_owned()),
                    ("PREFETCH", PREFETCH.to_owned()),
                    ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
                ]
            };
            let hops = hops(
                &spec,
                programs,
                (consumer_env(&input), consumer_env(&output)),
                ("DEDUP_AMQP_URL", url.clone()),
                &output,
                &scale,
                Duration::from_millis(1500),
            );
            let outcome = two_hop(&pool, &spec, hops).await;
            for queue in [&input, &output] {
                assert_eq!(
                    depth(&channel, queue).await,
                    (0, 0),
                    "messages and consumers left on {queue}"
                );
            }
            assert_eq!(
                dead_letters(&channel, &input).await,
                (POISON, poison_bodies()),
                "A's dead-letter queue holds the poison messages, once each, and nothing else"
            );
            assert_eq!(
                dead_letters(&channel, &output).await,
                (0, HashSet::new()),
                "B dead-lettered no event"
            );
            report_two_hop(
                "RabbitMQ",
                &spec,
                &outcome,
                &format!(
                    "both queues empty (0 ready, 0 unacknowledged, 0 consumers); dead letters: \
                     {POISON} on A's (the poison messages), 0 on B's"
                ),
                started.elapsed(),
            );
        };
        let cleanup = async {
            cleanup(&connection, &input).await;
            cleanup(&connection, &output).await;
        };
        with_cleanup(body, cleanup).await;
        forget_two_hop(&pool, &spec).await;
        connection.close(200, "done".into()).await.ok();
    }

    async fn harness(variant: &Variant) {
        let _lane = BUSY.lock().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("rabbitmq");
        let queue = format!("dedup-crash.{run}");
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                     -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
                )
            });
        let pool = dedup_suite::postgres().await;

        let body = async {
            let channel = connection.create_channel().await.expect("open a channel");
            dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
            dedup_suite::ddl(&pool, variant.create_effects).await;

            let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
            publish_all(&channel, &queue, &published).await;

            let name = variant.example;
            let program = tokio::task::spawn_blocking(move || example(name))
                .await
                .expect("build the examples");
            let mut env = vec![
                ("AMQP_URL", url.clone()),
                ("DATABASE_URL", database_url()),
                ("QUEUE", queue.clone()),
                ("CONSUMERS", CONSUMERS.to_owned()),
                ("PREFETCH", PREFETCH.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ];
            env.extend(
                variant
                    .env
                    .iter()
                    .map(|(name, value)| (*name, (*value).to_owned())),
            );
            let tally = {
                let scale = scale.clone();
                tokio::task::spawn_blocking(move || {
                    crash_loop(&program, &env, &scale, Duration::from_millis(1500))
                })
                .await
                .expect("the crash loop")
            };

            let stored = stored_in(
                &pool,
                variant.effects_table,
                variant.dedup_table,
                variant.consumer,
                &run,
            )
            .await;
            check(&published, &stored, &tally, &scale);
            // The last consumer closed its channels cleanly: anything it had not
            // acknowledged would be back in the queue.
            let (ready, consumers) = depth(&channel, &queue).await;
            assert_eq!(
                (ready, consumers),
                (0, 0),
                "messages and consumers left on the queue"
            );
            let (dead_count, dead_bodies) = dead_letters(&channel, &queue).await;
            assert_eq!(
                (dead_count, dead_bodies),
                (POISON, poison_bodies()),
                "the dead-letter queue holds the poison messages, once each, and nothing else"
            );
            report(
                variant.title,
                &published,
                &stored,
                &tally,
                &scale,
                POISON,
                "queue empty (0 ready, 0 unacknowledged, 0 consumers)",
                started.elapsed(),
            );
        };
        with_cleanup(body, cleanup(&connection, &queue)).await;
        forget_run_in(
            &pool,
            variant.effects_table,
            variant.dedup_table,
            variant.consumer,
            &run,
        )
        .await;
        connection.close(200, "done".into()).await.ok();
    }
}

// ---------------------------------------------------------------------------------------
// NATS JetStream
// ---------------------------------------------------------------------------------------

mod nats {
    use super::*;
    use async_nats::HeaderMap;
    use async_nats::jetstream::{self, consumer};

    fn nats_url() -> String {
        std::env::var("DEDUP_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
    }

    async fn cleanup(jetstream: &jetstream::Context, stream: &str) {
        for name in [stream.to_owned(), format!("{stream}_DEAD")] {
            if let Err(error) = jetstream.delete_stream(&name).await {
                eprintln!("could not delete the stream {name}: {error}");
            }
        }
    }

    /// The durable pull consumer `examples/nats.rs` would create, with a short ack wait so
    /// that a killed consumer's messages come back within the test.
    async fn durable_consumer(
        stream: &jetstream::stream::Stream,
        durable: &str,
    ) -> consumer::PullConsumer {
        stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(durable.to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: NATS_ACK_WAIT,
                max_deliver: 100,
                max_ack_pending: 10_000,
                ..Default::default()
            })
            .await
            .expect("create the durable consumer")
    }

    /// Publishes `published` to `subject`, each stored by the stream.
    async fn publish_all(jetstream: &jetstream::Context, subject: &str, published: &[Publish]) {
        let mut acks = Vec::with_capacity(published.len());
        for message in published {
            let mut headers = HeaderMap::new();
            if let Some(id) = &message.id {
                headers.insert("Message-Id", id.as_str());
            }
            let ack = jetstream
                .publish_with_headers(subject.to_owned(), headers, message.body.clone().into())
                .await
                .expect("publish");
            acks.push(ack);
            if acks.len() == 500 {
                for ack in acks.drain(..) {
                    ack.await.expect("the stream stored the message");
                }
            }
        }
        for ack in acks {
            ack.await.expect("the stream stored the message");
        }
    }

    /// Asserts that `consumer` has nothing pending, unacknowledged or to redeliver, and its
    /// ack floor at the stream's last sequence; returns that sequence.
    async fn settled(
        consumer: &mut consumer::PullConsumer,
        stream: &jetstream::stream::Stream,
    ) -> u64 {
        let info = consumer.info().await.expect("consumer info").clone();
        let last = stream
            .get_info()
            .await
            .expect("stream info")
            .state
            .last_sequence;
        assert_eq!(
            (info.num_pending, info.num_ack_pending, info.num_redelivered),
            (0, 0, 0),
            "messages left pending, unacknowledged, or waiting for redelivery"
        );
        assert_eq!(
            info.ack_floor.stream_sequence, last,
            "every message up to the stream's last is acknowledged (or terminated)"
        );
        last
    }

    /// The messages in `{stream}_DEAD`, and their bodies.
    async fn dead_letters(
        jetstream: &jetstream::Context,
        stream: &str,
    ) -> (usize, HashSet<String>) {
        let dead_stream = jetstream
            .get_stream(format!("{stream}_DEAD"))
            .await
            .expect("the dead-letter stream");
        let dead_state = dead_stream
            .get_info()
            .await
            .expect("dead-letter stream info")
            .state;
        let mut bodies = HashSet::new();
        for sequence in dead_state.first_sequence..=dead_state.last_sequence {
            if dead_state.messages == 0 {
                break;
            }
            let message = dead_stream
                .get_raw_message(sequence)
                .await
                .expect("read a dead letter");
            bodies.insert(String::from_utf8_lossy(&message.payload).into_owned());
        }
        (dead_state.messages as usize, bodies)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_consumer_is_effectively_once_under_sigkill() {
        harness("NATS JetStream", &[]).await;
    }

    /// Batch mode: `examples/nats.rs` with `BATCH=16` takes up to 16 pulled messages per
    /// transaction (`dedup_runtime::batch`) and acknowledges each after the commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_batch_consumer_is_effectively_once_under_sigkill() {
        harness("NATS JetStream, batches of 16", &[("BATCH", "16")]).await;
    }

    /// The JetStream crash harness, `title` in its report, `more` in the consumer's
    /// environment.
    async fn harness(title: &str, more: &[(&'static str, &str)]) {
        let _lane = BUSY.lock().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("nats");
        // Stream and consumer names allow no dots; subjects use them as separators.
        let stream_name = format!("DEDUP_CRASH_{run}");
        let subject = format!("dedup-crash.{run}");
        let durable = "crash-harness";
        let url = nats_url();
        let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
            panic!(
                "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
                 .ci/run) or set DEDUP_TEST_NATS_URL"
            )
        });
        let jetstream = jetstream::new(client);
        let pool = dedup_suite::postgres().await;

        let body = async {
            // What `examples/nats.rs` would create, with a short ack wait so that a killed
            // consumer's messages come back within the test.
            let (stream, _) =
                dedup_suite::jetstream::streams(&jetstream, &url, &stream_name, &subject).await;
            let mut consumer = durable_consumer(&stream, durable).await;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS nats_example_effects (message_id text NOT NULL, \
                 body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
            )
            .execute(&pool)
            .await
            .expect("create the effects table");

            let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
            publish_all(&jetstream, &subject, &published).await;
            let info = consumer.info().await.expect("consumer info");
            assert_eq!(
                info.num_pending,
                published.len() as u64,
                "messages pending for the consumer after publishing"
            );

            let mut env = vec![
                ("NATS_URL", url.clone()),
                ("DATABASE_URL", database_url()),
                ("STREAM", stream_name.clone()),
                ("SUBJECT", subject.clone()),
                ("DURABLE", durable.to_owned()),
                ("CONSUMERS", CONSUMERS.to_owned()),
                ("PREFETCH", PREFETCH.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ];
            env.extend(
                more.iter()
                    .map(|(name, value)| (*name, (*value).to_owned())),
            );
            // The last life must outlast the ack wait, to see the messages the kills
            // left unacknowledged come back.
            let idle = NATS_ACK_WAIT + Duration::from_millis(1500);
            let under_test = Subject {
                example: "nats",
                effects_table: "nats_example_effects",
                consumer: "nats-example",
            };
            let (tally, stored) =
                crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
            let last = settled(&mut consumer, &stream).await;
            let (dead_count, dead_bodies) = dead_letters(&jetstream, &stream_name).await;
            // A crash between the copy to the dead-letter subject and the `+TERM` copies a
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
                    "consumer: 0 pending, 0 unacknowledged, ack floor at the stream's last \
                     sequence ({last})"
                ),
                started.elapsed(),
            );
        };
        with_cleanup(body, cleanup(&jetstream, &stream_name)).await;
        forget_run(&pool, "nats_example_effects", "nats-example", &run).await;
    }

    /// Two hops over JetStream, as [the RabbitMQ one](super::rabbitmq): A and B are
    /// `examples/nats.rs` (A with `FORWARD_TO`), the relay publishes with `Nats-Msg-Id`.
    /// The events' stream keeps a 100 ms duplicate window (its least): JetStream's own dedup would
    /// drop a re-send within its window (2 minutes by default), and this harness wants
    /// every re-send to reach B, whose dedup must hold whatever comes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_two_hop_is_effectively_once_under_sigkill() {
        let _lane = BUSY.lock().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("two-hop");
        let (stream_in, stream_out) = (
            format!("DEDUP_CRASH_{run}_IN"),
            format!("DEDUP_CRASH_{run}_OUT"),
        );
        let (input, output) = (
            format!("dedup-crash.{run}.in"),
            format!("dedup-crash.{run}.out"),
        );
        let outbox_table = dedup_suite::unique_table("two_hop_outbox");
        let forwarder = forwarding_consumer("nats");
        let url = nats_url();
        let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
            panic!(
                "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
                 .ci/run) or set DEDUP_TEST_NATS_URL"
            )
        });
        let jetstream = jetstream::new(client);
        let pool = dedup_suite::postgres().await;
        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        let events = events(&published, &forwarder);
        let spec = TwoHop {
            run: &run,
            seed: scale.seed,
            published: &published,
            events: &events,
            effects_table: "nats_example_effects",
            forwarder: &forwarder,
            consumer: "nats-example",
            outbox_table: &outbox_table,
        };

        let body = async {
            let (in_stream, _) =
                dedup_suite::jetstream::streams(&jetstream, &url, &stream_in, &input).await;
            let (out_stream, _) =
                dedup_suite::jetstream::streams(&jetstream, &url, &stream_out, &output).await;
            let mut config = out_stream.cached_info().config.clone();
            config.duplicate_window = Duration::from_millis(100);
            jetstream
                .update_stream(config)
                .await
                .expect("shorten the events' duplicate window");
            let mut consumer_a = durable_consumer(&in_stream, "two-hop-a").await;
            let mut consumer_b = durable_consumer(&out_stream, "two-hop-b").await;
            two_hop_tables(&pool, &spec).await;
            publish_all(&jetstream, &input, &published).await;

            let programs =
                tokio::task::spawn_blocking(|| (example("nats"), example("outbox_relay")))
                    .await
                    .expect("build the examples");
            let consumer_env = |stream: &str, subject: &str, durable: &str| {
                vec![
                    ("NATS_URL", url.clone()),
                    ("DATABASE_URL", database_url()),
                    ("STREAM", stream.to_owned()),
                    ("SUBJECT", subject.to_owned()),
                    ("DURABLE", durable.to_owned()),
                    ("CONSUMERS", CONSUMERS.to_owned()),
                    ("PREFETCH", PREFETCH.to_owned()),
                    ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
                ]
            };
            // The consumers' last lives outlast the ack wait, to see the messages the
            // kills left unacknowledged come back.
            let hops = hops(
                &spec,
                programs,
                (
                    consumer_env(&stream_in, &input, "two-hop-a"),
                    consumer_env(&stream_out, &output, "two-hop-b"),
                ),
                ("DEDUP_NATS_URL", url.clone()),
                &output,
                &scale,
                NATS_ACK_WAIT + Duration::from_millis(1500),
            );
            let outcome = two_hop(&pool, &spec, hops).await;
            let last_in = settled(&mut consumer_a, &in_stream).await;
            let last_out = settled(&mut consumer_b, &out_stream).await;
            let (_, dead_in) = dead_letters(&jetstream, &stream_in).await;
            assert_eq!(
                dead_in,
                poison_bodies(),
                "A's dead-letter stream holds the poison messages and nothing else"
            );
            assert_eq!(
                dead_letters(&jetstream, &stream_out).await,
                (0, HashSet::new()),
                "B dead-lettered no event"
            );
            report_two_hop(
                "JetStream",
                &spec,
                &outcome,
                &format!(
                    "both consumers: 0 pending, 0 unacknowledged, ack floors at their streams' \
                     last sequences ({last_in} in, {last_out} out: {} events + {} re-sends); \
                     dead letters: the {POISON} poison messages on A's, 0 on B's",
                    events.len(),
                    last_out.saturating_sub(events.len() as u64)
                ),
                started.elapsed(),
            );
        };
        let cleanup = async {
            cleanup(&jetstream, &stream_in).await;
            cleanup(&jetstream, &stream_out).await;
        };
        with_cleanup(body, cleanup).await;
        forget_two_hop(&pool, &spec).await;
    }
}

// ---------------------------------------------------------------------------------------
// Redis Streams
// ---------------------------------------------------------------------------------------

mod redis {
    use super::*;
    use ::redis::Value;
    use ::redis::aio::MultiplexedConnection;

    /// A killed consumer's pending entries are taken over by `XAUTOCLAIM` after this long.
    const CLAIM_IDLE: Duration = Duration::from_secs(2);

    fn redis_url() -> String {
        std::env::var("DEDUP_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
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
    async fn dead_letters(
        redis: &mut MultiplexedConnection,
        stream: &str,
    ) -> (usize, HashSet<String>) {
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

            let env = vec![
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
                "Redis Streams",
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
}

// ---------------------------------------------------------------------------------------
// MQTT (Mosquitto)
// ---------------------------------------------------------------------------------------

mod mqtt {
    use super::*;
    use ::rumqttc::{
        AsyncClient, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS, SubscribeReasonCode,
    };
    use dedup_suite::mosquitto::Mosquitto;

    /// The broker's `max_inflight_messages`: QoS 1 messages it sends to a client ahead of
    /// the client's `PUBACK`s (Mosquitto's default is 20). The consumer handles them one at
    /// a time; a kill leaves up to this many to come back with the DUP flag.
    const MAX_INFLIGHT: usize = 16;
    /// The consumer's client id (its persistent session) and the dead-letter checker's.
    const CLIENT_ID: &str = "crash-harness";
    const DEAD_CLIENT_ID: &str = "crash-harness-dead";

    /// A connection under `client_id` (persistent session unless `clean`), connected: the
    /// event loop has returned the CONNACK, whose `session_present` comes back too.
    async fn connect(
        port: u16,
        client_id: &str,
        clean: bool,
        manual_acks: bool,
    ) -> (AsyncClient, EventLoop, bool) {
        let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
        options
            .set_clean_session(clean)
            .set_manual_acks(manual_acks)
            .set_keep_alive(Duration::from_secs(30))
            .set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(connack))) => {
                (client, eventloop, connack.session_present)
            }
            other => panic!("connect to Mosquitto on port {port} as {client_id}: {other:?}"),
        }
    }

    /// Polls until our DISCONNECT is out.
    async fn disconnect(client: &AsyncClient, eventloop: &mut EventLoop) {
        client.disconnect().await.expect("DISCONNECT");
        loop {
            match eventloop.poll().await {
                Ok(Event::Outgoing(Outgoing::Disconnect)) => return,
                Ok(_) => {}
                Err(error) => panic!("MQTT connection before DISCONNECT: {error}"),
            }
        }
    }

    /// Creates the persistent session `client_id` subscribed to `topic` at QoS 1, as the
    /// consumer would, so that the broker queues for it what is published from now on.
    async fn session(port: u16, client_id: &str, topic: &str) {
        let (client, mut eventloop, _) = connect(port, client_id, false, true).await;
        client
            .subscribe(topic, QoS::AtLeastOnce)
            .await
            .expect("SUBSCRIBE");
        loop {
            match eventloop.poll().await.expect("MQTT connection") {
                Event::Incoming(Packet::SubAck(suback)) => {
                    assert_eq!(
                        suback.return_codes,
                        [SubscribeReasonCode::Success(QoS::AtLeastOnce)],
                        "the subscription of {client_id} to {topic}"
                    );
                    break;
                }
                Event::Incoming(Packet::Publish(publish)) => {
                    panic!("{client_id}: a message before any was published: {publish:?}")
                }
                _ => {}
            }
        }
        disconnect(&client, &mut eventloop).await;
    }

    /// The payload `examples/mqtt.rs` reads: `<id>\n<body>`, or the body alone for a
    /// message without an id.
    fn payload(message: &Publish) -> Vec<u8> {
        match &message.id {
            Some(id) => format!("{id}\n{}", message.body).into_bytes(),
            None => message.body.clone().into_bytes(),
        }
    }

    /// Publishes `published` to `topic` at QoS 1, waiting for every PUBACK.
    async fn publish_all(port: u16, topic: &str, published: &[Publish]) {
        let (client, mut eventloop, _) =
            connect(port, "crash-harness-publisher", true, false).await;
        let sending = async {
            for message in published {
                client
                    .publish(topic, QoS::AtLeastOnce, false, payload(message))
                    .await
                    .expect("PUBLISH");
            }
        };
        let confirming = async {
            let mut confirmed = 0;
            while confirmed < published.len() {
                if let Event::Incoming(Packet::PubAck(_)) =
                    eventloop.poll().await.expect("MQTT connection")
                {
                    confirmed += 1;
                }
            }
        };
        tokio::join!(sending, confirming);
        disconnect(&client, &mut eventloop).await;
    }

    /// Reconnects to the persistent session `client_id` (which must exist) and collects
    /// the payloads that arrive until none has for `quiet`; acknowledges them if `ack`.
    async fn drain(port: u16, client_id: &str, ack: bool, quiet: Duration) -> Vec<Vec<u8>> {
        let (client, mut eventloop, session_present) = connect(port, client_id, false, !ack).await;
        assert!(
            session_present,
            "the broker has no session for {client_id}: checking it would prove nothing"
        );
        let mut payloads = Vec::new();
        loop {
            match tokio::time::timeout(quiet, eventloop.poll()).await {
                Err(_) => break,
                Ok(Ok(Event::Incoming(Packet::Publish(publish)))) => {
                    payloads.push(publish.payload.to_vec());
                }
                Ok(Ok(_)) => {}
                Ok(Err(error)) => panic!("MQTT connection of {client_id}: {error}"),
            }
        }
        disconnect(&client, &mut eventloop).await;
        payloads
    }

    /// The crash harness on MQTT: `examples/mqtt.rs`, one persistent session (QoS 1,
    /// manual acknowledgements, one message at a time), on a Mosquitto of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mqtt_consumer_is_effectively_once_under_sigkill() {
        let _lane = BUSY.lock().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("mqtt");
        let topic = format!("dedup-crash/{run}");
        let dead_topic = format!("{topic}/dead");
        // A Mosquitto of the test's own (`dedup_suite::mosquitto`): the machine's keeps at
        // most 1,000 queued messages per offline session and drops the rest, which would
        // lose messages of a 5,000-message run for the broker's reason, not the consumer's.
        let broker = Mosquitto::start(&run, &format!("max_inflight_messages {MAX_INFLIGHT}"));
        let port = broker.port();
        let pool = dedup_suite::postgres().await;

        // The sessions first, so that the broker queues every message for the consumer
        // and every dead letter for the checker.
        session(port, CLIENT_ID, &topic).await;
        session(port, DEAD_CLIENT_ID, &dead_topic).await;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS mqtt_example_effects (message_id text NOT NULL, \
             body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .expect("create the effects table");

        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        publish_all(port, &topic, &published).await;

        let env = vec![
            ("MQTT_URL", format!("mqtt://127.0.0.1:{port}")),
            ("DATABASE_URL", database_url()),
            ("TOPIC", topic.clone()),
            ("CLIENT_ID", CLIENT_ID.to_owned()),
            ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
        ];
        // Nothing to outlast: the broker sends a session's messages as soon as it
        // reconnects. 1.5 s also covers the first in-process retry's backoff (1 s).
        let idle = Duration::from_millis(1500);
        let under_test = Subject {
            example: "mqtt",
            effects_table: "mqtt_example_effects",
            consumer: "mqtt-example",
        };
        let (tally, stored) =
            crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
        // Nothing left for the consumer: no message queued or unacknowledged (which the
        // broker would send again on this reconnect, with the DUP flag). Not acknowledged
        // here, should there be any.
        let left = drain(port, CLIENT_ID, false, Duration::from_millis(1500)).await;
        assert!(
            left.is_empty(),
            "{} messages left for the consumer's session, first: {:?}",
            left.len(),
            left.first()
                .map(|payload| String::from_utf8_lossy(payload).into_owned())
        );
        let dead = drain(port, DEAD_CLIENT_ID, true, Duration::from_millis(1000)).await;
        let dead_bodies: HashSet<String> = dead
            .iter()
            .map(|payload| String::from_utf8_lossy(payload).into_owned())
            .collect();
        // A crash between the copy to the dead-letter topic and the PUBACK copies a poison
        // message again on its redelivery: at least once each, nothing else.
        assert_eq!(
            dead_bodies,
            poison_bodies(),
            "the dead-letter topic got the poison messages and nothing else"
        );
        report(
            "MQTT (Mosquitto)",
            &published,
            &stored,
            &tally,
            &scale,
            dead.len(),
            &format!(
                "session {CLIENT_ID}: nothing queued or unacknowledged on reconnect \
                 (max_inflight_messages {MAX_INFLIGHT}, max_queued_messages 0)"
            ),
            started.elapsed(),
        );
        drop(broker);
        forget_run(&pool, "mqtt_example_effects", "mqtt-example", &run).await;
    }
}

// ---------------------------------------------------------------------------------------
// Kafka (a Kafka-protocol broker: tansu in CI)
// ---------------------------------------------------------------------------------------

mod kafka {
    use super::*;
    use ::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use ::rdkafka::client::DefaultClientContext;
    use ::rdkafka::config::ClientConfig;
    use ::rdkafka::consumer::{BaseConsumer, Consumer};
    use ::rdkafka::message::{Header, Message as _, OwnedHeaders};
    use ::rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
    use ::rdkafka::util::Timeout;
    use ::rdkafka::{Offset, TopicPartitionList};
    use std::net::{TcpStream, ToSocketAddrs};

    /// Partitions of the harness's topic: one worker each in the consumer.
    const PARTITIONS: i32 = 4;
    /// The consumer's `session.timeout.ms`: a killed member's partitions are handed on
    /// after this long, so that the next life is assigned them within a second or two.
    const SESSION_TIMEOUT_MS: &str = "1000";
    /// Each worker's records ahead of its offset commits.
    const KAFKA_PREFETCH: &str = "16";

    fn brokers() -> String {
        std::env::var("DEDUP_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".to_owned())
    }

    fn client() -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers());
        config
    }

    /// Takes the waiting lane, after checking that something listens at the brokers'
    /// address: a Kafka client retries a refused connection for minutes, and the lane
    /// may be held by another Kafka harness for as long.
    async fn lane() -> tokio::sync::MutexGuard<'static, ()> {
        listening(&brokers());
        WAITING.lock().await
    }

    /// Panics at once, saying how to start one, when nothing accepts a TCP connection at
    /// any of `brokers` (comma-separated `host:port`s) within 3 s.
    fn listening(brokers: &str) {
        let mut failures = Vec::new();
        for broker in brokers.split(',').map(str::trim) {
            let addresses = match broker.to_socket_addrs() {
                Ok(addresses) => addresses,
                Err(error) => {
                    failures.push(format!("{broker}: {error}"));
                    continue;
                }
            };
            for address in addresses {
                match TcpStream::connect_timeout(&address, Duration::from_secs(3)) {
                    Ok(_) => return,
                    Err(error) => failures.push(format!("{address}: {error}")),
                }
            }
        }
        panic!(
            "no Kafka-protocol broker listens at {brokers} ({}). Start one (.ci/run starts \
             tansu on 127.0.0.1:19092) or set DEDUP_TEST_KAFKA_BROKERS to where one listens",
            failures.join("; ")
        );
    }

    /// Panics, saying how to start one, when no Kafka-protocol broker answers.
    fn reachable() {
        let probe: BaseConsumer = client().create().expect("a Kafka client");
        if let Err(error) = probe.fetch_metadata(None, Duration::from_secs(10)) {
            panic!(
                "no Kafka-protocol broker answers at {}: {error}. Start one (.ci/run starts \
                 tansu on 127.0.0.1:19092) or set DEDUP_TEST_KAFKA_BROKERS",
                brokers()
            );
        }
    }

    /// The topic (`PARTITIONS` partitions), its dead-letter topic, and the example's
    /// effects table.
    async fn prepare(pool: &PgPool, topic: &str, dead: &str) {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS kafka_example_effects (message_id text NOT NULL, \
             body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(pool)
        .await
        .expect("create the effects table");
        let admin: AdminClient<DefaultClientContext> = client().create().expect("admin client");
        let topics = [
            NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1)),
            NewTopic::new(dead, 1, TopicReplication::Fixed(1)),
        ];
        for result in admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .expect("CreateTopics")
        {
            result.unwrap_or_else(|(topic, code)| panic!("create the topic {topic}: {code}"));
        }
    }

    async fn delete_topics(topic: &str, dead: &str, groups: &[&str]) {
        let admin: AdminClient<DefaultClientContext> = client().create().expect("admin client");
        let options = AdminOptions::new();
        if let Err(error) = admin.delete_topics(&[topic, dead], &options).await {
            eprintln!("could not delete the topics {topic} and {dead}: {error}");
        }
        if let Err(error) = admin.delete_groups(groups, &options).await {
            eprintln!("could not delete the groups {groups:?}: {error}");
        }
    }

    /// Produces `published` round-robin over the partitions, a header `id` (when it has
    /// one), the body as the value. Returns each partition's end: the offset after its
    /// last record, from the delivery reports (tansu's ListOffsets answers short ends for
    /// batches of several records).
    async fn publish_all(topic: &str, published: &[Publish]) -> HashMap<i32, i64> {
        let producer: FutureProducer = client()
            .set("acks", "all")
            .set("linger.ms", "5")
            .create()
            .expect("a producer");
        let mut ends = HashMap::new();
        for (chunk_index, chunk) in published.chunks(500).enumerate() {
            let sends = chunk.iter().enumerate().map(|(k, message)| {
                let partition = ((chunk_index * 500 + k) % PARTITIONS as usize) as i32;
                let mut record = FutureRecord::<(), _>::to(topic)
                    .partition(partition)
                    .payload(&message.body);
                if let Some(id) = &message.id {
                    record = record.headers(OwnedHeaders::new().insert(Header {
                        key: "id",
                        value: Some(id),
                    }));
                }
                producer.send(record, Timeout::After(Duration::from_secs(30)))
            });
            for sent in futures_util::future::join_all(sends).await {
                let delivery = sent.unwrap_or_else(|(error, _)| panic!("produce: {error}"));
                let end = ends.entry(delivery.partition).or_insert(0);
                *end = (*end).max(delivery.offset + 1);
            }
        }
        producer
            .flush(Duration::from_secs(30))
            .expect("flush the producer");
        ends
    }

    /// The group's committed offset of each partition.
    fn committed(group: &str, topic: &str) -> HashMap<i32, Offset> {
        let consumer: BaseConsumer = client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut partitions = TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            partitions.add_partition(topic, partition);
        }
        consumer
            .committed_offsets(partitions, Duration::from_secs(10))
            .expect("OffsetFetch")
            .elements()
            .iter()
            .map(|element| (element.partition(), element.offset()))
            .collect()
    }

    /// The records of the dead-letter topic (one partition), read from its start until
    /// none has come for a while: their values.
    fn dead_letters(dead: &str) -> Vec<String> {
        let consumer: BaseConsumer = client()
            .set("group.id", format!("{dead}.check"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut partitions = TopicPartitionList::new();
        partitions
            .add_partition_offset(dead, 0, Offset::Beginning)
            .expect("the dead-letter partition");
        consumer.assign(&partitions).expect("assign");
        let mut values = Vec::new();
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < Duration::from_secs(3) {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(record)) => {
                    values.push(
                        String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned(),
                    );
                    quiet_since = Instant::now();
                }
                Some(Err(error)) => eprintln!("reading the dead letters: {error}"),
                None => {}
            }
        }
        values
    }

    /// The crash harness on Kafka: `examples/kafka.rs`, one consumer-group member with one
    /// worker per partition (4), the offset committed after the database commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_consumer_is_effectively_once_under_sigkill() {
        let _lane = lane().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("kafka");
        let topic = format!("dedup-crash-{run}");
        let dead = format!("{topic}.dead");
        let group = format!("crash-harness-{run}");
        tokio::task::spawn_blocking(reachable)
            .await
            .expect("the broker check");
        let pool = dedup_suite::postgres().await;

        let body = async {
            prepare(&pool, &topic, &dead).await;

            let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
            let ends = publish_all(&topic, &published).await;
            assert_eq!(
                ends.values().sum::<i64>(),
                published.len() as i64,
                "records in the topic after publishing (offsets start at 0 per partition)"
            );

            let env = vec![
                ("KAFKA_BROKERS", brokers()),
                ("DATABASE_URL", database_url()),
                ("TOPIC", topic.clone()),
                ("GROUP", group.clone()),
                ("PREFETCH", KAFKA_PREFETCH.to_owned()),
                ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ];
            // The idle clock starts at the assignment; 1.5 s also covers the first
            // in-process retry's backoff (1 s).
            let idle = Duration::from_millis(1500);
            let under_test = Subject {
                example: "kafka",
                effects_table: "kafka_example_effects",
                consumer: "kafka-example",
            };
            let (tally, stored) =
                crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
            let (group_name, topic_name) = (group.clone(), topic.clone());
            let committed =
                tokio::task::spawn_blocking(move || committed(&group_name, &topic_name))
                    .await
                    .expect("read the committed offsets");
            for (partition, end) in &ends {
                assert_eq!(
                    committed.get(partition),
                    Some(&Offset::Offset(*end)),
                    "partition {partition}: the group's committed offset is the partition's \
                     end, nothing left unacknowledged (all: {committed:?})"
                );
            }
            let dead_name = dead.clone();
            let dead_values = tokio::task::spawn_blocking(move || dead_letters(&dead_name))
                .await
                .expect("read the dead letters");
            let dead_bodies: HashSet<String> = dead_values.iter().cloned().collect();
            // A crash between the copy to the dead-letter topic and the offset commit
            // copies a poison message again on its redelivery: at least once each,
            // nothing else.
            assert_eq!(
                dead_bodies,
                poison_bodies(),
                "the dead-letter topic holds the poison messages and nothing else"
            );
            let ends_text = listed_ends(&ends);
            report(
                "Kafka (tansu)",
                &published,
                &stored,
                &tally,
                &scale,
                dead_values.len(),
                &format!(
                    "group {group}: committed offset at every partition's end ({ends_text}); \
                     {} deliveries of a record delivered before (Kafka keeps no delivery \
                     count: a record past the committed offset read again by the next \
                     life, or an in-process retry)",
                    tally.reread
                ),
                started.elapsed(),
            );
        };
        with_cleanup(body, delete_topics(&topic, &dead, &[&group])).await;
        forget_run(&pool, "kafka_example_effects", "kafka-example", &run).await;
    }

    /// `p0 <end>, p1 <end>, …`, in partition order.
    fn listed_ends(ends: &HashMap<i32, i64>) -> String {
        let mut listed: Vec<_> = ends.iter().collect();
        listed.sort();
        listed
            .iter()
            .map(|(partition, end)| format!("p{partition} {end}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The offsets of every record of `topic` (`PARTITIONS` partitions), per partition,
    /// read back with Fetch from each partition's start (assigned, no group) until at
    /// least `at_least` records have come and then none for 3 s. Read, not asked: tansu's
    /// ListOffsets answers short ends when records came in multi-record batches, as the
    /// relay's producer sends them.
    fn records_in(topic: &str, at_least: usize) -> HashMap<i32, BTreeSet<i64>> {
        let consumer: BaseConsumer = client()
            .set("group.id", format!("{topic}.check"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut partitions = TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            partitions
                .add_partition_offset(topic, partition, Offset::Beginning)
                .expect("a partition");
        }
        consumer.assign(&partitions).expect("assign");
        let mut offsets: HashMap<i32, BTreeSet<i64>> = HashMap::new();
        let (started, mut quiet_since) = (Instant::now(), Instant::now());
        loop {
            let count: usize = offsets.values().map(BTreeSet::len).sum();
            if count >= at_least && quiet_since.elapsed() >= Duration::from_secs(3) {
                return offsets;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "only {count} records of {topic} read back in 2 minutes, at least {at_least} \
                 expected"
            );
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(record)) => {
                    offsets
                        .entry(record.partition())
                        .or_default()
                        .insert(record.offset());
                    quiet_since = Instant::now();
                }
                Some(Err(error)) => eprintln!("reading {topic}: {error}"),
                None => {}
            }
        }
    }

    /// The offsets of `topic`'s records among `tally`'s deliveries (`topic/partition/offset`
    /// in its `delivered` lines), per partition.
    fn delivered_records(tally: &Tally, topic: &str) -> HashMap<i32, BTreeSet<i64>> {
        let mut offsets: HashMap<i32, BTreeSet<i64>> = HashMap::new();
        for record in &tally.records {
            let mut parts = record.rsplitn(3, '/');
            let (Some(offset), Some(partition), Some(name)) =
                (parts.next(), parts.next(), parts.next())
            else {
                panic!("a delivered record is `topic/partition/offset`, not {record:?}");
            };
            if name == topic {
                offsets
                    .entry(partition.parse().expect("a partition"))
                    .or_default()
                    .insert(offset.parse().expect("an offset"));
            }
        }
        offsets
    }

    /// Two hops over Kafka, as [the RabbitMQ one](super::rabbitmq): A and B are
    /// `examples/kafka.rs` (A with `FORWARD_TO`), each in its own group; the relay
    /// publishes with `KafkaPublisher` (the event's id in the header `id`, no record key:
    /// the producer picks the partition). The input topic and the events' topic have 4
    /// partitions each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_two_hop_is_effectively_once_under_sigkill() {
        let _lane = lane().await;
        let started = Instant::now();
        let scale = Scale::from_env();
        let run = dedup_suite::unique("two-hop");
        let (input, output) = (
            format!("dedup-crash-{run}-in"),
            format!("dedup-crash-{run}-out"),
        );
        let (dead_in, dead_out) = (format!("{input}.dead"), format!("{output}.dead"));
        let (group_a, group_b) = (format!("two-hop-a-{run}"), format!("two-hop-b-{run}"));
        let outbox_table = dedup_suite::unique_table("two_hop_outbox");
        let forwarder = forwarding_consumer("kafka");
        tokio::task::spawn_blocking(reachable)
            .await
            .expect("the broker check");
        let pool = dedup_suite::postgres().await;
        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        let events = events(&published, &forwarder);
        let spec = TwoHop {
            run: &run,
            seed: scale.seed,
            published: &published,
            events: &events,
            effects_table: "kafka_example_effects",
            forwarder: &forwarder,
            consumer: "kafka-example",
            outbox_table: &outbox_table,
        };

        let body = async {
            prepare(&pool, &input, &dead_in).await;
            prepare(&pool, &output, &dead_out).await;
            two_hop_tables(&pool, &spec).await;
            let input_ends = publish_all(&input, &published).await;
            assert_eq!(
                input_ends.values().sum::<i64>(),
                published.len() as i64,
                "records in the input topic after publishing (offsets start at 0 per partition)"
            );

            let programs =
                tokio::task::spawn_blocking(|| (example("kafka"), example("outbox_relay")))
                    .await
                    .expect("build the examples");
            let consumer_env = |topic: &str, group: &str| {
                vec![
                    ("KAFKA_BROKERS", brokers()),
                    ("DATABASE_URL", database_url()),
                    ("TOPIC", topic.to_owned()),
                    ("GROUP", group.to_owned()),
                    ("PREFETCH", KAFKA_PREFETCH.to_owned()),
                    ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
                    ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
                ]
            };
            // The idle clock starts at the assignment; 1.5 s also covers the first
            // in-process retry's backoff (1 s).
            let hops = hops(
                &spec,
                programs,
                (
                    consumer_env(&input, &group_a),
                    consumer_env(&output, &group_b),
                ),
                ("DEDUP_KAFKA_BROKERS", brokers()),
                &output,
                &scale,
                Duration::from_millis(1500),
            );
            let outcome = two_hop(&pool, &spec, hops).await;
            let tally_b = &outcome.b.0;

            // A: the group's committed offsets at the input's ends (from the delivery
            // reports of publish_all).
            let (group, topic) = (group_a.clone(), input.clone());
            let committed_a = tokio::task::spawn_blocking(move || committed(&group, &topic))
                .await
                .expect("read A's committed offsets");
            for (partition, end) in &input_ends {
                assert_eq!(
                    committed_a.get(partition),
                    Some(&Offset::Offset(*end)),
                    "input partition {partition}: A's committed offset is the partition's \
                     end (all: {committed_a:?})"
                );
            }

            // B: the events' topic read back record by record — every send the broker
            // confirmed is a record of it, so at least that many — its ends taken from the
            // records (ListOffsets is not trusted: tansu answers short ends for
            // multi-record batches, and the relay's producer batches).
            let confirmed: usize = outcome.relay.sends.values().sum();
            let topic = output.clone();
            let in_output = tokio::task::spawn_blocking(move || records_in(&topic, confirmed))
                .await
                .expect("read the events' topic back");
            assert_eq!(
                delivered_records(tally_b, &output),
                in_output,
                "B was delivered every record of the events' topic (over all its lives), \
                 and no other"
            );
            let output_ends: HashMap<i32, i64> = in_output
                .iter()
                .filter_map(|(partition, offsets)| Some((*partition, offsets.last()? + 1)))
                .collect();
            let (group, topic) = (group_b.clone(), output.clone());
            let committed_b = tokio::task::spawn_blocking(move || committed(&group, &topic))
                .await
                .expect("read B's committed offsets");
            for partition in 0..PARTITIONS {
                // A partition the producer never picked has no committed offset.
                let end = output_ends
                    .get(&partition)
                    .map_or(Offset::Invalid, |end| Offset::Offset(*end));
                assert_eq!(
                    committed_b.get(&partition),
                    Some(&end),
                    "events' partition {partition}: B's committed offset is the partition's \
                     end (all: {committed_b:?}; ends: {output_ends:?})"
                );
            }
            let records_out: usize = in_output.values().map(BTreeSet::len).sum();

            let (dead_a, dead_b) = (dead_in.clone(), dead_out.clone());
            let (dead_in_values, dead_out_values) =
                tokio::task::spawn_blocking(move || (dead_letters(&dead_a), dead_letters(&dead_b)))
                    .await
                    .expect("read the dead letters");
            // A crash between the copy to the dead-letter topic and the offset commit
            // copies a poison message again: at least once each, nothing else.
            assert_eq!(
                dead_in_values.iter().cloned().collect::<HashSet<String>>(),
                poison_bodies(),
                "A's dead-letter topic holds the poison messages and nothing else"
            );
            assert_eq!(
                dead_out_values,
                Vec::<String>::new(),
                "B dead-lettered no event"
            );
            report_two_hop(
                "Kafka",
                &spec,
                &outcome,
                &format!(
                    "A's group: committed offsets at the input's ends ({}); B's group: at the \
                     events' topic's ends ({}, read back: {records_out} records = {} events + \
                     {} re-sends, each delivered to B; the relay's confirmed sends: \
                     {confirmed}); records delivered again (no delivery count in Kafka): A {}, \
                     B {}; dead letters: {} on A's (the {POISON} poison messages), 0 on B's",
                    listed_ends(&input_ends),
                    listed_ends(&output_ends),
                    events.len(),
                    records_out.saturating_sub(events.len()),
                    outcome.a.0.reread,
                    tally_b.reread,
                    dead_in_values.len(),
                ),
                started.elapsed(),
            );
        };
        let cleanup = async {
            delete_topics(&input, &dead_in, &[&group_a]).await;
            delete_topics(&output, &dead_out, &[&group_b]).await;
        };
        with_cleanup(body, cleanup).await;
        forget_two_hop(&pool, &spec).await;
    }

    /// One life of the example, run to its end (idle for 1.5 s after its assignment).
    fn run_to_end(program: &Path, env: &[(&str, String)]) -> Tally {
        let mut env = env.to_vec();
        env.push(("DEDUP_EXIT_WHEN_IDLE_MS", "1500".to_owned()));
        let mut tally = Tally::default();
        live(program, &env, None, Duration::from_secs(60), &mut tally);
        tally
    }

    /// The other two `MESSAGE_ID`s of `examples/kafka.rs`. `offset`: a second group reading
    /// the topic from its start (as after an offset reset) finds every record's
    /// `topic/partition/offset` recorded, so all are duplicates. `key`: two records with
    /// one key are one message.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_message_ids_from_the_offset_and_the_key() {
        let _lane = lane().await;
        tokio::task::spawn_blocking(reachable)
            .await
            .expect("the broker check");
        // The topic is the run's name, so that `topic/partition/offset` ids fall under the
        // run's `run/` prefix like every other id of the harness.
        let run = dedup_suite::unique("kafka-ids");
        let dead = format!("{run}.dead");
        let pool = dedup_suite::postgres().await;
        let groups = [1, 2, 3].map(|n| format!("{run}-group-{n}"));
        let body = async {
            prepare(&pool, &run, &dead).await;
            // 20 records, no id header, 10 keys each on two records.
            let producer: FutureProducer = client().create().expect("a producer");
            let keys: Vec<String> = (0..20).map(|n| format!("{run}/key-{}", n % 10)).collect();
            let bodies: Vec<String> = (0..20).map(|n| format!("record-{n}")).collect();
            let sends = (0..20).map(|n| {
                let record = FutureRecord::to(&run)
                    .partition(n as i32 % PARTITIONS)
                    .key(&keys[n])
                    .payload(&bodies[n]);
                producer.send(record, Timeout::After(Duration::from_secs(30)))
            });
            for sent in futures_util::future::join_all(sends).await {
                sent.unwrap_or_else(|(error, _)| panic!("produce: {error}"));
            }

            let program = tokio::task::spawn_blocking(|| example("kafka"))
                .await
                .expect("build the examples");
            let env = |message_id: &str, group: &str| {
                vec![
                    ("KAFKA_BROKERS", brokers()),
                    ("DATABASE_URL", database_url()),
                    ("TOPIC", run.clone()),
                    ("GROUP", group.to_owned()),
                    ("MESSAGE_ID", message_id.to_owned()),
                    ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
                ]
            };
            let runs = [
                env("offset", &groups[0]),
                env("offset", &groups[1]),
                env("key", &groups[2]),
            ];
            let [by_offset, again, by_key] =
                tokio::task::spawn_blocking(move || runs.map(|env| run_to_end(&program, &env)))
                    .await
                    .expect("the consumer runs");
            assert_eq!(
                (by_offset.committed, by_offset.duplicates, by_offset.dead),
                (20, 0, 0),
                "MESSAGE_ID=offset: every record is its own message"
            );
            assert_eq!(
                (again.committed, again.duplicates),
                (0, 20),
                "a second group re-reading the topic: the same offsets, all duplicates"
            );
            assert_eq!(
                (by_key.committed, by_key.duplicates, by_key.dead),
                (10, 10, 0),
                "MESSAGE_ID=key: two records per key, one message"
            );

            let stored = stored(&pool, "kafka_example_effects", "kafka-example", &run).await;
            let offsets = stored
                .effects
                .keys()
                .filter(|id| !id.contains("/key-"))
                .count();
            assert_eq!(
                offsets, 20,
                "effects of 20 offset ids: {:?}",
                stored.effects
            );
            assert!(
                stored.effects.values().all(|rows| *rows == 1),
                "each id's effect once: {:?}",
                stored.effects
            );
            assert_eq!(
                (stored.effects.len(), stored.dedup_rows),
                (30, 30),
                "20 offset ids and 10 key ids, each with one effect and one dedup row"
            );
        };
        let group_names = groups.each_ref().map(String::as_str);
        with_cleanup(body, delete_topics(&run, &dead, &group_names)).await;
        forget_run(&pool, "kafka_example_effects", "kafka-example", &run).await;
    }
}
