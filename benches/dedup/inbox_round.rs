//! The inbox's figures in every round: receiving (one message per statement, and 100),
//! and workers processing, on each backend.

use std::sync::Arc;

use dedup_runtime::Backend;
use dedup_runtime::inbox::{Inbox, Incoming, Received};
use sqlx::Pool;

use crate::Error;
use crate::config::{BackendName, Config, Variant};
use crate::report::{Summary, median};
use crate::setup::inbox_reset;
use crate::target::{InboxBody, Target};
use crate::timing::{random_ids, spawn};

/// The inbox table of the benchmark.
pub(crate) const INBOX_TABLE: &str = "dedup_bench_inbox";

/// Messages per `receive_batch` in the batched receive figure.
const INBOX_BATCH: usize = 100;

/// One round of inbox figures for one backend, in messages per second.
pub(crate) struct InboxSample {
    backend: BackendName,
    /// Single receives, at 1 and 4 tasks.
    receive: [f64; 2],
    /// Batched receives (100 per statement), at 1 and 4 tasks.
    batched: [f64; 2],
    /// Processing by 1 and 4 workers.
    workers: [f64; 2],
    /// PostgreSQL: 8 receivers without and with `notify_workers`.
    notify: Option<[f64; 2]>,
}

/// Receives `ids` on `tasks` tasks, one by one or in batches; messages per second.
async fn measure_receive<DB: Backend>(
    pool: &Pool<DB>,
    tasks: usize,
    batched: bool,
    notify: bool,
    ids: Arc<Vec<String>>,
) -> Result<f64, Error> {
    let per_task = ids.len() / tasks;
    let started = spawn(tasks, |task, start| {
        let (pool, ids) = (pool.clone(), ids.clone());
        async move {
            let inbox = Inbox::new(&pool, "bench-inbox")?
                .in_table(INBOX_TABLE)?
                .notify_workers(notify);
            let mine = &ids[task * per_task..(task + 1) * per_task];
            start.wait().await;
            let mut stored = 0;
            if batched {
                for chunk in mine.chunks(INBOX_BATCH) {
                    let batch: Vec<Incoming<'_>> = chunk
                        .iter()
                        .map(|id| Incoming::new(id.as_str(), b"payload"))
                        .collect();
                    let answers = inbox.receive_batch(&batch).await?;
                    stored += answers
                        .iter()
                        .filter(|a| **a == Ok(Received::Stored))
                        .count();
                }
            } else {
                for id in mine {
                    if inbox
                        .receive(Incoming::new(id.as_str(), b"payload"))
                        .await?
                        == Received::Stored
                    {
                        stored += 1;
                    }
                }
            }
            Ok::<usize, Error>(stored)
        }
    });
    let (seconds, stored) = started.time().await?;
    if stored != per_task * tasks {
        return Err(format!("inbox: {stored} of {} messages stored", per_task * tasks).into());
    }
    Ok(stored as f64 / seconds)
}

/// Stores `ids` in `inbox`, untimed: 1,000 per statement, each with the same payload.
pub(crate) async fn store<DB: Backend>(inbox: &Inbox<DB>, ids: &[String]) -> Result<(), Error> {
    for chunk in ids.chunks(1_000) {
        let batch: Vec<Incoming<'_>> = chunk
            .iter()
            .map(|id| Incoming::new(id.as_str(), b"payload"))
            .collect();
        inbox.receive_batch(&batch).await?;
    }
    Ok(())
}

/// Stores `ids` (untimed), then processes them with `workers` workers; messages per
/// second, checked against the effects.
async fn measure_workers<DB: Target>(
    pool: &Pool<DB>,
    workers: usize,
    ids: &[String],
) -> Result<f64, Error> {
    let inbox = Inbox::new(pool, "bench-inbox")?.in_table(INBOX_TABLE)?;
    store(&inbox, ids).await?;
    let started = spawn(workers, |_, start| {
        let pool = pool.clone();
        async move {
            let inbox = Inbox::new(&pool, "bench-inbox")?.in_table(INBOX_TABLE)?;
            let worker = inbox.worker().batch(16);
            let handler = InboxBody;
            start.wait().await;
            let mut processed = 0;
            loop {
                let batch = worker.process_batch(&handler).await?;
                processed += batch.processed;
                if batch.claimed == 0 {
                    return Ok::<usize, Error>(processed);
                }
            }
        }
    });
    let (seconds, processed) = started.time().await?;
    if processed != ids.len() {
        return Err(format!("inbox: {processed} of {} messages processed", ids.len()).into());
    }
    Ok(processed as f64 / seconds)
}

/// One round of the inbox's figures on one backend, each run on an empty inbox.
pub(crate) async fn measure_inbox<DB: Target>(
    pool: &Pool<DB>,
    config: &Config,
    seed: &mut u64,
) -> Result<InboxSample, Error> {
    let backend = DB::BACKEND;
    let ops = config.ops;
    let figure = |rate: f64, what: &str, backend: BackendName| {
        eprintln!(
            "           {:<10} inbox {what:<28} {rate:>8.0} messages/s",
            backend.name()
        );
        rate
    };
    let mut sample = InboxSample {
        backend,
        receive: [0.0; 2],
        batched: [0.0; 2],
        workers: [0.0; 2],
        notify: None,
    };
    for (slot, tasks) in [1, 4].into_iter().enumerate() {
        inbox_reset(pool).await?;
        let ids = Arc::new(random_ids(ops, seed));
        let rate = measure_receive(pool, tasks, false, false, ids).await?;
        sample.receive[slot] = figure(rate, &format!("receive, {tasks} task(s)"), backend);
        inbox_reset(pool).await?;
        let ids = Arc::new(random_ids(10 * ops, seed));
        let rate = measure_receive(pool, tasks, true, false, ids).await?;
        sample.batched[slot] = figure(rate, &format!("receive x100, {tasks} task(s)"), backend);
    }
    for (slot, workers) in [1, 4].into_iter().enumerate() {
        inbox_reset(pool).await?;
        let ids = random_ids(ops, seed);
        let rate = measure_workers(pool, workers, &ids).await?;
        sample.workers[slot] = figure(rate, &format!("process, {workers} worker(s)"), backend);
    }
    if backend == BackendName::Postgres {
        let mut rates = [0.0; 2];
        for (slot, notify) in [false, true].into_iter().enumerate() {
            inbox_reset(pool).await?;
            let ids = Arc::new(random_ids(ops, seed));
            rates[slot] = measure_receive(pool, 8, false, notify, ids).await?;
            let what = if notify {
                "receive, 8 tasks, NOTIFY"
            } else {
                "receive, 8 tasks"
            };
            figure(rates[slot], what, backend);
        }
        sample.notify = Some(rates);
    }
    Ok(sample)
}

/// The inbox's figures: medians over the rounds, and the ratios the issue asks for.
pub(crate) fn print_inbox(samples: &[InboxSample], summary: &Summary) {
    println!(
        "\nthe inbox: medians over the rounds, messages per second (the same body as the handlers)"
    );
    for backend in [BackendName::Postgres, BackendName::Sqlite] {
        let mine: Vec<&InboxSample> = samples.iter().filter(|s| s.backend == backend).collect();
        if mine.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&InboxSample) -> f64| median(mine.iter().map(|s| f(s)).collect());
        let receive = [med(&|s| s.receive[0]), med(&|s| s.receive[1])];
        let batched = [med(&|s| s.batched[0]), med(&|s| s.batched[1])];
        let workers = [med(&|s| s.workers[0]), med(&|s| s.workers[1])];
        println!("{}", backend.name());
        println!(
            "  receive, one statement per message   1 task: {:>8.0}   4 tasks: {:>8.0}",
            receive[0], receive[1]
        );
        println!(
            "  receive, 100 per statement           1 task: {:>8.0}   4 tasks: {:>8.0}",
            batched[0], batched[1]
        );
        println!(
            "  process                            1 worker: {:>8.0} 4 workers: {:>8.0}",
            workers[0], workers[1]
        );
        println!(
            "  ratios: batched / single {:.1} / {:.1} (1 / 4 tasks); 4 workers / 1 worker {:.2}",
            batched[0] / receive[0],
            batched[1] / receive[1],
            workers[1] / workers[0]
        );
        if let Some(direct) = summary.rate.get(&(backend, 4, Variant::Generated)) {
            println!(
                "          4 workers / the direct #[idempotent] handler at 4 tasks: {:.2}",
                workers[1] / direct
            );
        }
        for tasks in [1, 4] {
            if let Some(pgbench) = summary.rate.get(&(backend, tasks, Variant::Pgbench)) {
                let slot = usize::from(tasks == 4);
                println!(
                    "          single receive / pgbench ({tasks} task(s)): {:.2}",
                    receive[slot] / pgbench
                );
            }
        }
        if mine.iter().all(|s| s.notify.is_some()) {
            let off = med(&|s| s.notify.map_or(0.0, |n| n[0]));
            let on = med(&|s| s.notify.map_or(0.0, |n| n[1]));
            println!(
                "          8 receivers, NOTIFY on / off: {on:.0} / {off:.0} = {:.2}",
                on / off
            );
        }
    }
}
