//! The harness's machinery: the lanes the tests run in, the plan of what to publish, and
//! the consumer processes' lives, kills and tally.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedup_suite::Shuffle;

/// Unique messages published, by default.
pub(crate) const DEFAULT_MESSAGES: usize = 5_000;
/// SIGKILLs per broker, by default.
pub(crate) const DEFAULT_KILLS: usize = 60;
/// Messages without an id: the handler refuses them (`InvalidMessageId`), so the consumer
/// dead-letters them.
pub(crate) const POISON: usize = 5;
/// Consumer tasks in each consumer process.
pub(crate) const CONSUMERS: &str = "4";
/// Messages each consumer task takes ahead of acknowledging.
pub(crate) const PREFETCH: &str = "16";
/// The pause the examples make between COMMIT and the acknowledgement, so that many kills
/// land there.
pub(crate) const CRASH_WINDOW_MS: &str = "10";
/// JetStream redelivers a killed consumer's unacknowledged messages after this long.
pub(crate) const NATS_ACK_WAIT: Duration = Duration::from_secs(2);

/// A lane the harnesses run in: one harness in it at a time.
pub(crate) type Lane = tokio::sync::Mutex<()>;

/// The lane of the harnesses that keep the CPU busy: RabbitMQ, NATS, Redis Streams and
/// MQTT, whose consumers, brokers and PostgreSQL are all at work at once. One at a time on
/// a small machine (two cores): two of them would starve each other's consumers, and
/// each measures its own duration.
pub(crate) static BUSY: Lane = Lane::const_new(());

/// The lane of the harnesses that mostly wait: the Kafka ones (`kafka_…`), which leave
/// the CPU about 90 % idle while their group rebalances after each kill. One runs beside
/// the busy lane's, so at most two harnesses run at once, one per lane. Nothing else is
/// shared between the two: each run names its own queues, streams, topics, groups,
/// message ids (under the run's prefix) and outbox tables, the effects tables are each
/// broker's own, and MQTT's Mosquitto is its own, on a free port. Each harness writes its
/// report with one `write_all` on a locked stderr, so two reports never mix.
pub(crate) static WAITING: Lane = Lane::const_new(());

// ---------------------------------------------------------------------------------------
// What to publish
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
pub(crate) struct Scale {
    pub(crate) messages: usize,
    pub(crate) duplicates: usize,
    pub(crate) kills: usize,
    pub(crate) seed: u64,
}

impl Scale {
    pub(crate) fn from_env() -> Scale {
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
pub(crate) struct Publish {
    pub(crate) id: Option<String>,
    pub(crate) body: String,
}

/// The messages of a run, in publication order: every unique message once, a tenth of
/// them a second time (half right behind the first copy, so that two consumers handle the
/// copies at the same moment; half anywhere), and the poison messages, shuffled.
pub(crate) fn plan(run: &str, scale: &Scale, random: &mut Shuffle) -> Vec<Publish> {
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

pub(crate) fn poison_bodies() -> HashSet<String> {
    (0..POISON).map(|k| format!("poison-{k}")).collect()
}

// ---------------------------------------------------------------------------------------
// The consumer processes
// ---------------------------------------------------------------------------------------

/// The example binaries, built once per test process with the test's own profile and the
/// feature that enables them, `brokers`.
pub(crate) fn example(name: &str) -> PathBuf {
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
pub(crate) enum Kill {
    /// This long after it started.
    AfterStart(Duration),
    /// As soon as it reports the n-th commit: the message is between COMMIT and ack.
    OnCommit(usize),
    /// This long after its n-th line of output.
    AfterLine(usize, Duration),
}

impl Kill {
    pub(crate) fn kind(self) -> usize {
        match self {
            Kill::AfterStart(_) => 0,
            Kill::OnCommit(_) => 1,
            Kill::AfterLine(..) => 2,
        }
    }
}

/// What the consumer processes reported, over all their lives.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) lives: usize,
    pub(crate) kills: usize,
    pub(crate) kills_by_kind: [usize; 3],
    /// Kills whose trigger never came (the queue had run dry): killed after a pause.
    pub(crate) kills_on_timeout: usize,
    /// Kills that caught at least one message committed but not yet acknowledged.
    pub(crate) kills_in_window: usize,
    /// The messages so caught.
    pub(crate) caught_in_window: HashSet<String>,
    pub(crate) deliveries: usize,
    pub(crate) redeliveries: usize,
    /// The records (`topic/partition/offset`, where a consumer's `delivered` lines say
    /// it: Kafka's) delivered so far, and how many deliveries were of one delivered to an
    /// earlier life or attempt already.
    pub(crate) records: HashSet<String>,
    pub(crate) reread: usize,
    pub(crate) committed: usize,
    pub(crate) committed_ids: HashSet<String>,
    pub(crate) duplicates: usize,
    pub(crate) duplicate_ids: HashSet<String>,
    pub(crate) acked: usize,
    pub(crate) retries: usize,
    pub(crate) dead: usize,
}

/// How one life of a child process ended.
pub(crate) struct Ended {
    pub(crate) killed: bool,
    /// Killed after a pause, its trigger never having come (the work had run out).
    pub(crate) timed_out: bool,
}

/// Runs one life of `program`: killed as `kill` says, or (`None`) left to run until it
/// exits by itself, within `patience`. `on_line` reads each line of its output and says
/// whether it is a trigger for [`Kill::OnCommit`] (a commit; a relay's send). Panics if
/// it fails or exits when it should not.
pub(crate) fn life(
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
pub(crate) fn live(
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
pub(crate) fn draw_kill(
    k: usize,
    remaining: usize,
    kills_left: usize,
    random: &mut Shuffle,
) -> Kill {
    // Spread the progress over the kills, so that the last ones still find work.
    draw_kill_within(k, remaining / (kills_left + 1), random)
}

/// A random moment to kill a life at, about `budget` messages into its work (a commit
/// up to twice that, or a line up to six times that).
pub(crate) fn draw_kill_within(k: usize, budget: usize, random: &mut Shuffle) -> Kill {
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
pub(crate) const PATIENCE: Duration = Duration::from_secs(3);

/// The lives of a crash loop that end in a SIGKILL: `scale.kills` of them.
pub(crate) fn kill_lives(program: &Path, env: &[(&str, String)], scale: &Scale, tally: &mut Tally) {
    let mut random = Shuffle::new(scale.seed ^ 0x6b11_1e55);
    for k in 0..scale.kills {
        let remaining = scale.messages.saturating_sub(done(tally));
        let kill = draw_kill(k, remaining, scale.kills - k, &mut random);
        live(program, env, Some(kill), PATIENCE, tally);
    }
}

/// The messages a consumer has done: a message reported as a duplicate was committed,
/// possibly by a process killed before it could say so.
pub(crate) fn done(tally: &Tally) -> usize {
    tally.committed_ids.union(&tally.duplicate_ids).count()
}

/// The lives of a consumer of a two-hop run (A, B) that end in a SIGKILL, drawn as
/// [`kill_lives`]'s with two bounds, for a consumer in a chain gets less done in a life
/// than one alone, and a trigger past what a life can reach only waits out the patience:
/// `fed`, for one fed as it goes (B, by the relay), says how many messages it has been
/// given so far, and its triggers are drawn over the backlog left to it, not over the
/// run's remaining work; and none is drawn past half the most commits one of its lives
/// has made so far. `tell` hears, after each life, how many messages it has done.
pub(crate) fn two_hop_kill_lives(
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
pub(crate) fn last_life(
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
pub(crate) fn crash_loop(
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

pub(crate) fn database_url() -> String {
    dedup_suite::postgres_url()
}
