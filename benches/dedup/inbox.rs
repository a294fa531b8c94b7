//! The inbox workers' group: `cargo bench --bench dedup -- inbox` (and, tiny, in the smoke
//! run). 4 workers empty an inbox of `messages` stored messages (4,000; stored untimed
//! before each run, then the table vacuumed, as autovacuum keeps a live table), each
//! message's effect one `INSERT` into `dedup_bench_inbox_effects`; messages per second,
//! the median over the rounds. In every round, in an order that turns with the round, on
//! PostgreSQL:
//!
//! - `per-message`: the library's workers, `Worker::process_batch` in a loop (claims of
//!   16, one transaction per message: the handler, the owner-checked mark, the commit);
//! - `batched`: the library's workers in batch mode, `Worker::process_batched` (claims of
//!   10, one transaction per claim: the handler over the 10, one mark, one commit);
//! - `hand-1`: a hand-written per-message worker — `BEGIN; SELECT … LIMIT 1 FOR UPDATE
//!   SKIP LOCKED`, the effect, `UPDATE … SET state = 2`, `COMMIT`;
//! - `hand-10`: a hand-written worker of 10 per transaction — `BEGIN; SELECT … LIMIT 10
//!   FOR UPDATE SKIP LOCKED`, the 10 effects, one `UPDATE … = ANY($2)`, `COMMIT`.
//!
//! All on the library's own table and consumer, the same pool (8 connections).
//!
//! And the receiving side, at 1 and 4 tasks, five times `messages` fresh messages in
//! batches of 100 per run: `receive-batch` (`Inbox::receive_batch`) against `hand-insert`, the
//! multi-row insert a person writes — `INSERT … SELECT $1, * FROM unnest($2::text[],
//! $3::bytea[]) ON CONFLICT DO NOTHING RETURNING message_id` — into the same table.
//!
//! `target/dedup-bench/inbox.csv`: `backend,workers,mode,messages_per_s,
//! handwritten_per_s,ratio_vs_handwritten`, `per-message` against `hand-1`, `batched`
//! against `hand-10`, `receive-batch` against `hand-insert` (`workers`: the tasks).

use std::collections::BTreeMap;
use std::path::Path;

use dedup_runtime::batch::BatchHandler;
use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use sqlx::{AssertSqlSafe, PgConnection, Pool, Postgres};

use crate::Error;
use crate::inbox_round::store;
use crate::timing::spawn;

const TABLE: &str = "dedup_bench_inbox_w";
const CONSUMER: &str = "bench-inbox-workers";
const WORKERS: usize = 4;

async fn effect(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO dedup_bench_inbox_effects (message_id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The per-message handler.
struct One;

impl InboxHandler<Postgres> for One {
    type Error = sqlx::Error;

    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &InboxMessage,
    ) -> Result<(), sqlx::Error> {
        effect(tx, message.id()).await
    }
}

/// The batch handler: the same effect, message by message.
struct Many;

impl BatchHandler<Postgres, InboxMessage> for Many {
    type Error = sqlx::Error;

    async fn handle(
        &self,
        tx: &mut PgConnection,
        messages: &[&InboxMessage],
    ) -> Result<(), sqlx::Error> {
        for message in messages {
            effect(tx, message.id()).await?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    PerMessage,
    Batched,
    Hand1,
    Hand10,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::PerMessage, Mode::Batched, Mode::Hand1, Mode::Hand10];

    fn name(self) -> &'static str {
        match self {
            Mode::PerMessage => "per-message",
            Mode::Batched => "batched",
            Mode::Hand1 => "hand-1",
            Mode::Hand10 => "hand-10",
        }
    }

    /// The hand-written worker a mode is measured against.
    fn baseline(self) -> Option<Mode> {
        match self {
            Mode::PerMessage => Some(Mode::Hand1),
            Mode::Batched => Some(Mode::Hand10),
            _ => None,
        }
    }
}

/// Empties the tables, stores `messages` messages, vacuums.
async fn fill(pool: &Pool<Postgres>, messages: usize, round: usize) -> Result<(), Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "TRUNCATE {TABLE}, dedup_bench_inbox_effects"
    )))
    .execute(pool)
    .await?;
    let inbox = Inbox::new(pool, CONSUMER)?.in_table(TABLE)?;
    let ids: Vec<String> = (0..messages).map(|n| format!("r{round}-m{n:06}")).collect();
    store(&inbox, &ids).await?;
    for table in [TABLE, "dedup_bench_inbox_effects"] {
        sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// One worker of `mode` until nothing is left; messages it processed.
async fn worker(pool: Pool<Postgres>, mode: Mode) -> Result<usize, Error> {
    let mut processed = 0;
    match mode {
        Mode::PerMessage | Mode::Batched => {
            let inbox = Inbox::new(&pool, CONSUMER)?.in_table(TABLE)?;
            let worker = if mode == Mode::PerMessage {
                inbox.worker().batch(16)
            } else {
                inbox.worker().batch(10)
            };
            loop {
                let batch = if mode == Mode::PerMessage {
                    worker.process_batch(&One).await?
                } else {
                    worker.process_batched(&Many).await?
                };
                processed += batch.processed;
                if batch.claimed == 0 {
                    return Ok(processed);
                }
            }
        }
        Mode::Hand1 | Mode::Hand10 => {
            let limit: i64 = if mode == Mode::Hand1 { 1 } else { 10 };
            let select = format!(
                "SELECT message_id FROM {TABLE} WHERE consumer = $1 AND state = 0 \
                 AND next_attempt_at <= clock_timestamp() ORDER BY next_attempt_at, seq \
                 LIMIT $2 FOR UPDATE SKIP LOCKED"
            );
            let mark_one = format!(
                "UPDATE {TABLE} SET state = 2, processed_at = clock_timestamp() \
                 WHERE consumer = $1 AND message_id = $2"
            );
            let mark_many = format!(
                "UPDATE {TABLE} SET state = 2, processed_at = clock_timestamp() \
                 WHERE consumer = $1 AND message_id = ANY($2)"
            );
            loop {
                let mut tx = pool.begin().await?;
                let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(select.clone()))
                    .bind(CONSUMER)
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await?;
                if ids.is_empty() {
                    tx.commit().await?;
                    return Ok(processed);
                }
                for id in &ids {
                    effect(&mut tx, id).await?;
                }
                if let [id] = &ids[..] {
                    sqlx::query(AssertSqlSafe(mark_one.clone()))
                        .bind(CONSUMER)
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                } else {
                    sqlx::query(AssertSqlSafe(mark_many.clone()))
                        .bind(CONSUMER)
                        .bind(&ids)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                processed += ids.len();
            }
        }
    }
}

/// 4 workers of `mode` empty the inbox; messages per second, checked against the effects.
async fn measure(pool: &Pool<Postgres>, mode: Mode, messages: usize) -> Result<f64, Error> {
    let started = spawn(WORKERS, |_, start| {
        let pool = pool.clone();
        async move {
            start.wait().await;
            worker(pool, mode).await
        }
    });
    let (seconds, processed) = started.time().await?;
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dedup_bench_inbox_effects")
        .fetch_one(pool)
        .await?;
    if processed != messages || effects != messages as i64 {
        return Err(format!(
            "inbox {}: {processed} processed, {effects} effects, of {messages}",
            mode.name()
        )
        .into());
    }
    Ok(messages as f64 / seconds)
}

/// Messages per statement on the receiving side.
const RECEIVE_BATCH: usize = 100;

/// `messages` fresh messages received by `tasks` tasks in batches of
/// [`RECEIVE_BATCH`], by the library or by hand; messages per second, checked against
/// the table.
async fn receive(
    pool: &Pool<Postgres>,
    library: bool,
    tasks: usize,
    messages: usize,
    round: usize,
) -> Result<f64, Error> {
    sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE {TABLE}")))
        .execute(pool)
        .await?;
    let per_task = messages / tasks;
    let started = spawn(tasks, |task, start| {
        let pool = pool.clone();
        async move {
            let ids: Vec<String> = (0..per_task)
                .map(|n| format!("recv-r{round}-t{task}-m{n:06}"))
                .collect();
            let inbox = Inbox::new(&pool, CONSUMER)?.in_table(TABLE)?;
            let insert = format!(
                "INSERT INTO {TABLE} (consumer, message_id, payload) \
                 SELECT $1, * FROM unnest($2::text[], $3::bytea[]) \
                 ON CONFLICT DO NOTHING RETURNING message_id"
            );
            start.wait().await;
            let mut stored = 0;
            for chunk in ids.chunks(RECEIVE_BATCH) {
                if library {
                    let batch: Vec<Incoming<'_>> = chunk
                        .iter()
                        .map(|id| Incoming::new(id, b"payload"))
                        .collect();
                    let answers = inbox.receive_batch(&batch).await?;
                    stored += answers.iter().filter(|answer| answer.is_ok()).count();
                } else {
                    let payloads: Vec<&[u8]> = chunk.iter().map(|_| &b"payload"[..]).collect();
                    let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(insert.clone()))
                        .bind(CONSUMER)
                        .bind(chunk)
                        .bind(payloads)
                        .fetch_all(&pool)
                        .await?;
                    stored += rows.len();
                }
            }
            Ok::<usize, Error>(stored)
        }
    });
    let (seconds, stored) = started.time().await?;
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {TABLE} WHERE consumer = $1"
    )))
    .bind(CONSUMER)
    .fetch_one(pool)
    .await?;
    let expected = per_task * tasks;
    if stored != expected || rows != expected as i64 {
        return Err(format!("inbox receive: {stored} stored, {rows} rows, of {expected}").into());
    }
    Ok(expected as f64 / seconds)
}

/// Runs the group: `rounds` interleaved rounds; writes `inbox.csv`.
pub(crate) async fn run(
    pool: &Pool<Postgres>,
    dir: &Path,
    rounds: usize,
    messages: usize,
) -> Result<(), Error> {
    dedup_runtime::inbox::migrate_table(pool, TABLE).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS dedup_bench_inbox_effects (message_id text NOT NULL)",
    )
    .execute(pool)
    .await?;
    let mut samples: BTreeMap<Mode, Vec<f64>> = BTreeMap::new();
    // (tasks, library) → rates.
    let mut receiving: BTreeMap<(usize, bool), Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        let mut plan = vec![(1, true), (1, false), (4, true), (4, false)];
        plan.rotate_left(round % 4);
        for (tasks, library) in plan {
            // Five times the workers' messages: a run of 4,000 took 20 to 40 ms, too short
            // to time on a shared machine.
            let rate = receive(pool, library, tasks, messages * 5, round).await?;
            let mode = if library {
                "receive-batch"
            } else {
                "hand-insert"
            };
            println!(
                "inbox round {round}: postgres {tasks} task(s) {mode:<13} {rate:>8.0} messages/s"
            );
            receiving.entry((tasks, library)).or_default().push(rate);
        }
        let mut plan = Mode::ALL.to_vec();
        plan.rotate_left(round % Mode::ALL.len());
        for mode in plan {
            fill(pool, messages, round).await?;
            let rate = measure(pool, mode, messages).await?;
            println!(
                "inbox round {round}: postgres {WORKERS} workers {:<12} {rate:>8.0} messages/s",
                mode.name()
            );
            samples.entry(mode).or_default().push(rate);
        }
    }
    let median = |mode: Mode| {
        samples
            .get(&mode)
            .map(|values| crate::report::median(values.clone()))
    };
    let mut csv = String::from(
        "backend,workers,mode,messages_per_s,handwritten_per_s,ratio_vs_handwritten\n",
    );
    println!("\nthe inbox workers, medians of {rounds} rounds, {messages} messages per run:");
    for mode in Mode::ALL {
        let rate = median(mode).unwrap_or(0.0);
        let hand = mode.baseline().and_then(median);
        csv.push_str(&format!(
            "postgres,{WORKERS},{},{rate:.0},{},{}\n",
            mode.name(),
            hand.map_or(String::new(), |h| format!("{h:.0}")),
            hand.map_or(String::new(), |h| format!("{:.3}", rate / h)),
        ));
        println!(
            "  postgres {WORKERS} workers {:<12} {rate:>8.0} messages/s{}",
            mode.name(),
            hand.map_or(String::new(), |h| format!(
                "  {:.3} of {}",
                rate / h,
                mode.baseline().map_or("", Mode::name)
            )),
        );
    }
    for tasks in [1, 4] {
        let rate = |library| {
            receiving
                .get(&(tasks, library))
                .map_or(0.0, |values| crate::report::median(values.clone()))
        };
        let (library, hand) = (rate(true), rate(false));
        csv.push_str(&format!(
            "postgres,{tasks},receive-batch,{library:.0},{hand:.0},{:.3}\n",
            library / hand
        ));
        csv.push_str(&format!("postgres,{tasks},hand-insert,{hand:.0},,\n"));
        println!(
            "  postgres {tasks} task(s) receive-batch {library:>8.0} messages/s  {:.3} of \
             hand-insert ({hand:.0})",
            library / hand
        );
    }
    std::fs::write(dir.join("inbox.csv"), csv)?;
    Ok(())
}
