//! Two hops: A consumes and enqueues an event in its transaction, a relay publishes the
//! events, B consumes them; all three killed side by side.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dedup_suite::Shuffle;
use sqlx::PgPool;

use crate::checks::*;
use crate::harness::*;

/// Service A's dedup consumer in `examples/rabbitmq.rs`, `examples/nats.rs` and
/// `examples/kafka.rs` with `FORWARD_TO` set, and the consumer its events' ids derive from.
pub(crate) fn forwarding_consumer(example: &str) -> String {
    format!("{example}-example-forward")
}

/// The event A enqueues for each unique input message: its derived id, the input's body.
pub(crate) fn events(published: &[Publish], forwarder: &str) -> Vec<Publish> {
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
pub(crate) struct RelayTally {
    pub(crate) lives: usize,
    pub(crate) kills: usize,
    pub(crate) kills_by_kind: [usize; 3],
    pub(crate) kills_on_timeout: usize,
    /// Kills that caught a batch sent and not reported relayed: the broker had its
    /// messages, their rows were (almost always) not marked yet.
    pub(crate) kills_after_send: usize,
    /// Sends the broker confirmed, per event id.
    pub(crate) sends: HashMap<String, usize>,
    /// Rows whose mark found them another relay's (its lease had ended).
    pub(crate) lost: usize,
    pub(crate) dead: usize,
}

impl RelayTally {
    /// Events sent more than once, and the extra sends.
    pub(crate) fn resent(&self) -> (HashSet<&str>, usize) {
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
pub(crate) fn relay_live(
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
pub(crate) struct Hop {
    pub(crate) program: PathBuf,
    pub(crate) env: Vec<(&'static str, String)>,
    pub(crate) scale: Scale,
    pub(crate) exit_when_idle: Duration,
}

/// The three crash loops of a two-hop run, side by side (each kills its own process, at
/// random moments, `scale.kills` times), then the last lives one after the other: A until
/// its queue is done, the relay until the outbox is, B until the events are.
pub(crate) fn two_hop_lives(a: &Hop, relay: &Hop, b: &Hop) -> (Tally, RelayTally, Tally) {
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
pub(crate) async fn stored_ids(
    pool: &PgPool,
    effects_table: &str,
    consumer: &str,
    ids: &[String],
) -> Stored {
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
pub(crate) async fn check_outbox(pool: &PgPool, table: &str, events: &[Publish]) -> String {
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
pub(crate) fn check_two_hop(relay: &RelayTally, b: &Tally, scale: &Scale) {
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
pub(crate) fn report_two_hop(
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
pub(crate) fn two_hop_scales(scale: &Scale) -> [Scale; 3] {
    let relay = scale.kills * 3 / 10;
    let a = scale.kills - 2 * relay;
    [(a, 1), (relay, 2), (relay, 3)].map(|(kills, salt)| Scale {
        kills,
        seed: scale.seed ^ salt,
        ..scale.clone()
    })
}

/// The environment of a child process.
pub(crate) type Env = Vec<(&'static str, String)>;

/// The three processes of a two-hop run, each with its share of `scale`'s kills:
/// `consumer` as A (its environment `env_a` plus the forwarding to `output` through the
/// run's outbox) and as B (`env_b`), and `relay` with `broker` (the variable naming its
/// broker). The consumers' last lives end after `consumer_idle` without a delivery.
pub(crate) fn hops(
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
pub(crate) async fn two_hop_tables(pool: &PgPool, spec: &TwoHop<'_>) {
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
pub(crate) struct TwoHop<'a> {
    pub(crate) run: &'a str,
    pub(crate) seed: u64,
    pub(crate) published: &'a [Publish],
    pub(crate) events: &'a [Publish],
    pub(crate) effects_table: &'a str,
    /// A's dedup consumer, and the events' cause.
    pub(crate) forwarder: &'a str,
    /// B's dedup consumer.
    pub(crate) consumer: &'a str,
    pub(crate) outbox_table: &'a str,
}

/// What a two-hop run saw and stored.
pub(crate) struct TwoHopOutcome {
    pub(crate) a: (Tally, Stored),
    pub(crate) relay: RelayTally,
    pub(crate) b: (Tally, Stored),
    pub(crate) outbox: String,
}

/// Runs the three processes of a two-hop run (`hops`: A, the relay, B) and checks the
/// database: A's effects, the outbox, B's effects, the re-sends.
pub(crate) async fn two_hop(pool: &PgPool, spec: &TwoHop<'_>, hops: [Hop; 3]) -> TwoHopOutcome {
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
pub(crate) fn relay_env(database_url: String, outbox_table: &str) -> Vec<(&'static str, String)> {
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
pub(crate) async fn forget_two_hop(pool: &PgPool, spec: &TwoHop<'_>) {
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
