//! MariaDB under SIGKILL: the handler's own transaction on MySQL/MariaDB — `BEGIN`, its
//! savepoint and the claim in one query, the body, the checked commit (`RELEASE
//! SAVEPOINT`, `COMMIT`, autocommit back) — in a consumer process killed again and again.
//!
//! The consumer is this binary's ignored test [`consumer_process`], run as a child
//! process: four tasks on one pool, each working through its lane of the message
//! positions, every seventh message delivered twice in a row (a published duplicate), each
//! acknowledged on stdout (`ack <lane> <position>`) after its call returned. The harness
//! kills it (SIGKILL) at a random moment — after 0 to 89 acknowledgements and 0 to 3 ms
//! more: during its start-up, in the body's transaction (which sleeps a millisecond
//! between its two writes), between a commit and its acknowledgement, in a duplicate's
//! look — and starts it again from each lane's last acknowledged position, that
//! one included: a broker redelivers what was not acknowledged, and sometimes what was.
//! Asserted: every message's effect (two rows, one per write) exactly once, one dedup row
//! per message, nothing else under the run's ids.
//!
//! `DEDUP_MYSQL_CRASH_MESSAGES` and `DEDUP_MYSQL_CRASH_KILLS` scale it (defaults 3,000
//! and 60); `DEDUP_CRASH_SEED` fixes the random choices. It prints `== MariaDB: crash
//! harness`, `kills:` and `effects:`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use dedup_runtime::idempotent;
use dedup_suite::{Shuffle, crash_seed, env_number};
use sqlx::MySqlConnection;

/// The consumer's tasks, each with its lane of positions (`lane`, `lane + LANES`, …).
const LANES: usize = 4;
/// The consumer's instructions: `<run>;<messages>;<from lane 0>,<from lane 1>,…`.
const CHILD: &str = "DEDUP_MYSQL_CRASH_CHILD";
/// The effects table: no key, so that an effect applied twice shows.
const EFFECTS: &str = "CREATE TABLE IF NOT EXISTS mysql_crash_effects \
     (message_id VARBINARY(255) NOT NULL, part INT NOT NULL, KEY (message_id)) ENGINE = InnoDB";

/// Two writes, a millisecond apart: a kill between them leaves half an effect in an open
/// transaction, which the server rolls back with the connection.
#[idempotent(consumer = "mysql-crash", key = id)]
async fn consume(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO mysql_crash_effects (message_id, part) VALUES (?, 1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tokio::time::sleep(Duration::from_millis(1)).await;
    sqlx::query("INSERT INTO mysql_crash_effects (message_id, part) VALUES (?, 2)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The consumer process (run by [`mariadb_under_sigkill_processes_every_message_once`],
/// with `--ignored --exact --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the consumer process of mariadb_under_sigkill_processes_every_message_once"]
async fn consumer_process() {
    let spec = std::env::var(CHILD).expect("run by the harness, which sets the instructions");
    let mut parts = spec.split(';');
    let (run, messages, from) = (
        parts.next().expect("the run").to_owned(),
        parts
            .next()
            .expect("the messages")
            .parse::<usize>()
            .unwrap(),
        parts.next().expect("the lanes' starts").to_owned(),
    );
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(LANES as u32)
        .connect(&dedup_suite::mysql_url())
        .await
        .unwrap();
    let mut lanes = Vec::new();
    for (lane, start) in from.split(',').enumerate() {
        let start: usize = start.parse().unwrap();
        let (pool, run) = (pool.clone(), run.clone());
        lanes.push(tokio::spawn(async move {
            for position in (start..messages).step_by(LANES) {
                let id = format!("{run}/{position}");
                // Processed, or a duplicate when an earlier life committed it.
                let first = consume(&pool, &id).await.unwrap();
                if position % 7 == 0 {
                    let copy = consume(&pool, &id).await.unwrap();
                    assert!(
                        copy.is_duplicate(),
                        "{id}: the published copy is a duplicate"
                    );
                }
                let seen = if first.is_duplicate() {
                    "duplicate"
                } else {
                    "processed"
                };
                println!("ack {lane} {position} {seen}");
            }
        }));
    }
    for lane in lanes {
        lane.await.unwrap();
    }
    println!("done");
}

/// What a life of the consumer said on its output.
#[derive(Default)]
struct Tally {
    /// Each lane's last acknowledged position.
    acked: [Option<usize>; LANES],
    acks: usize,
    /// Deliveries found processed already.
    duplicates: usize,
    /// It finished every lane.
    done: bool,
}

impl Tally {
    fn note(&mut self, line: &str) {
        if line == "done" {
            self.done = true;
        } else if let Some(rest) = line.strip_prefix("ack ") {
            let mut words = rest.split(' ');
            let lane: usize = words.next().unwrap().parse().unwrap();
            let position: usize = words.next().unwrap().parse().unwrap();
            self.acked[lane] = Some(position);
            self.acks += 1;
            self.duplicates += usize::from(words.next() == Some("duplicate"));
        }
    }
}

/// When to kill a life of the consumer: once it has acknowledged `acks` messages (0: during
/// its start-up), `then` later — in whatever its tasks are doing at that moment.
struct Kill {
    acks: usize,
    then: Duration,
}

/// One life of the consumer: started with each lane's first position, killed as `kill`
/// says (or left to finish, `None`). Returns each lane's last acknowledged position,
/// whether it was killed, and how many deliveries it found processed already.
fn one_life(
    run: &str,
    messages: usize,
    next: &[usize; LANES],
    kill: Option<Kill>,
) -> ([Option<usize>; LANES], bool, usize) {
    let from: Vec<String> = next.iter().map(usize::to_string).collect();
    let mut child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--ignored",
            "--exact",
            "consumer_process",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, format!("{run};{messages};{}", from.join(",")))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the consumer process");
    let stdout = child.stdout.take().expect("piped");
    let (lines, received) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut tally = Tally::default();
    let mut killed = false;
    loop {
        if let Some(kill) = &kill
            && tally.acks >= kill.acks
        {
            std::thread::sleep(kill.then);
            child.kill().expect("SIGKILL the consumer");
            killed = true;
            break;
        }
        match received.recv_timeout(Duration::from_secs(300)) {
            Ok(line) => tally.note(&line),
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => panic!("the consumer said nothing for 300 s"),
        }
    }
    let status = child.wait().expect("the consumer's end");
    reader.join().expect("the reader thread");
    // What it printed before it died counts: it was acknowledged.
    while let Ok(line) = received.try_recv() {
        tally.note(&line);
    }
    assert!(
        killed || (status.success() && tally.done),
        "the consumer failed: {status}"
    );
    (tally.acked, killed && !tally.done, tally.duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_under_sigkill_processes_every_message_once() {
    let pool = dedup_suite::mysql().await;
    dedup_suite::ddl(&pool, EFFECTS).await;
    let messages = env_number("DEDUP_MYSQL_CRASH_MESSAGES", 3_000);
    let kills = env_number("DEDUP_MYSQL_CRASH_KILLS", 60);
    let seed = crash_seed();
    let run = dedup_suite::unique("mysql-crash");
    let started = Instant::now();

    let (lives, killed, duplicates) = {
        let run = run.clone();
        tokio::task::spawn_blocking(move || {
            let mut random = Shuffle::new(seed);
            // Each lane's next position to deliver; the last acknowledged one is delivered
            // again (a redelivery the consumer must find processed).
            let mut next: [usize; LANES] = std::array::from_fn(|lane| lane);
            let (mut lives, mut killed, mut duplicates) = (0, 0, 0);
            loop {
                // After 0 to 89 acknowledgements (45 on average: 60 kills take 2,700 of the
                // 3,000 messages, and the last life finishes), then 0 to 3 ms more.
                let kill = (killed < kills).then(|| Kill {
                    acks: (random.next_u64() % 90) as usize,
                    then: Duration::from_micros(random.next_u64() % 3_000),
                });
                let (acked, was_killed, found) = one_life(&run, messages, &next, kill);
                lives += 1;
                duplicates += found;
                for (lane, position) in acked.into_iter().enumerate() {
                    if let Some(position) = position {
                        next[lane] = position;
                    }
                }
                if !was_killed {
                    break;
                }
                killed += 1;
            }
            (lives, killed, duplicates)
        })
        .await
        .unwrap()
    };

    let pattern = format!("{run}/%");
    let (ids, rows, wrong): (i64, i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), CAST(COALESCE(SUM(n), 0) AS SIGNED), \
         CAST(COALESCE(SUM(n <> 2 OR parts <> 3), 0) AS SIGNED) FROM \
         (SELECT message_id, COUNT(*) AS n, SUM(part) AS parts FROM mysql_crash_effects \
          WHERE message_id LIKE ? GROUP BY message_id) per_id",
    )
    .bind(&pattern)
    .fetch_one(&pool)
    .await
    .unwrap();
    let claims: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM processed_messages \
         WHERE consumer = 'mysql-crash' AND message_id LIKE ? AND state IS NULL",
    )
    .bind(&pattern)
    .fetch_one(&pool)
    .await
    .unwrap();
    // Written past libtest's capture, so that a passing run shows its figures too.
    let report = format!(
        "== MariaDB: crash harness (seed {seed}) ==\n\
         kills:          {killed} SIGKILLs in {lives} lives of the consumer, {:.0?}; \
         {duplicates} redeliveries found processed\n\
         effects:        {rows} rows for {ids} ids of {messages}, {wrong} with anything but \
         its two writes once; {claims} dedup rows\n",
        started.elapsed(),
    );
    std::io::stderr()
        .lock()
        .write_all(report.as_bytes())
        .expect("stderr");
    assert_eq!(ids, messages as i64, "every message applied");
    assert_eq!(wrong, 0, "each message's two writes, exactly once");
    assert_eq!(rows, 2 * messages as i64);
    assert_eq!(
        claims, messages as i64,
        "one processed dedup row per message"
    );
}
