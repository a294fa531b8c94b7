//! The batch group: `dedup_runtime::batch` at batches of 1 to 1,000 against the
//! single-message generated handler, in every round or alone (`-- batch`); `batch.csv` and
//! `batch.svg`.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use sqlx::Pool;

use crate::Error;
use crate::config::{BackendName, Config, Variant};
use crate::report::median;
use crate::setup::reset;
use crate::svg::batch_svg;
use crate::target::{BatchBody, Target};
use crate::timing::{measure, random_ids, spawn};

/// The batch sizes of the batch group.
const BATCH_SIZES: [usize; 4] = [1, 10, 100, 1_000];

/// The task counts of the batch group.
pub(crate) const BATCH_TASKS: [usize; 2] = [1, 4];

/// One round of the batch group on one backend and task count.
pub(crate) struct BatchSample {
    backend: BackendName,
    tasks: usize,
    /// The single-message generated handler's rate, in this round.
    single: f64,
    /// Per batch size: messages per second, fresh.
    fresh: Vec<(usize, f64)>,
    /// Batches of 100, every message a duplicate: messages per second.
    duplicates: f64,
}

/// Runs `ids` through [`dedup_runtime::batch::Batch::run`] on `tasks` tasks, `batch`
/// messages per call; `fresh`: whether every message must be processed (else every one
/// must be a duplicate). Seconds from the moment all tasks are ready.
async fn measure_batch<DB: Target>(
    pool: &Pool<DB>,
    tasks: usize,
    batch: usize,
    ids: Arc<Vec<String>>,
    fresh: bool,
) -> Result<f64, Error> {
    let per_task = ids.len() / tasks;
    let started = spawn(tasks, |task, start| {
        let (pool, ids) = (pool.clone(), ids.clone());
        async move {
            let runner =
                dedup_runtime::batch::Batch::new("bench-batch")?.in_table("dedup_bench")?;
            let handler = BatchBody;
            start.wait().await;
            let mut processed = 0;
            for chunk in ids[task * per_task..(task + 1) * per_task].chunks(batch) {
                let outcome = runner.run(&pool, chunk, |id| id.as_str(), &handler).await?;
                processed += outcome.processed();
            }
            Ok::<usize, Error>(processed)
        }
    });
    let (seconds, processed) = started.time().await?;
    let expected = if fresh { per_task * tasks } else { 0 };
    if processed != expected {
        return Err(format!("batch of {batch}: {processed} processed, expected {expected}").into());
    }
    Ok(seconds)
}

/// One round of the batch group on one backend: for 1 and 4 tasks, the single-message
/// generated handler, then batches of each size (in an order that turns each round),
/// then batches of 100 that are all duplicates.
pub(crate) async fn measure_batches<DB: Target>(
    pool: &Pool<DB>,
    config: &Config,
    round: usize,
    seed: &mut u64,
) -> Result<Vec<BatchSample>, Error> {
    let backend = DB::BACKEND;
    let mut samples = Vec::new();
    for tasks in BATCH_TASKS {
        reset(pool).await?;
        let ids = Arc::new(random_ids(config.ops / tasks * tasks, seed));
        let (seconds, _) =
            measure(pool, Variant::Generated, tasks, config.smoke, ids.clone()).await?;
        let single = ids.len() as f64 / seconds;
        let mut sizes: Vec<usize> = BATCH_SIZES
            .into_iter()
            .filter(|&batch| !config.smoke || batch <= 100)
            .collect();
        let turn = round % sizes.len();
        sizes.rotate_left(turn);
        let mut fresh = Vec::new();
        let mut duplicates = 0.0;
        for batch in sizes {
            // Enough messages for every task to run several batches.
            let unit = batch * tasks;
            let count = config.ops.max(8 * unit).div_ceil(unit) * unit;
            let ids = Arc::new(random_ids(count, seed));
            let seconds = measure_batch(pool, tasks, batch, ids.clone(), true).await?;
            fresh.push((batch, count as f64 / seconds));
            if batch == 100 {
                let seconds = measure_batch(pool, tasks, batch, ids, false).await?;
                duplicates = count as f64 / seconds;
            }
        }
        fresh.sort_by_key(|(batch, _)| *batch);
        eprintln!(
            "           {:<10} batches, {tasks} task(s): single {single:.0}/s; {}; all duplicates (100) {duplicates:.0}/s",
            backend.name(),
            fresh
                .iter()
                .map(|(batch, rate)| format!("{batch}: {rate:.0}/s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        samples.push(BatchSample {
            backend,
            tasks,
            single,
            fresh,
            duplicates,
        });
    }
    Ok(samples)
}

/// The batch group's medians over the rounds, printed, and `batch.csv`:
/// `backend,tasks,batch,per_message_rate,ratio_vs_single` (the ratio taken within each
/// round, then its median). `pgbench`: pgbench's rate per task count, when it ran.
pub(crate) fn print_batches(
    samples: &[BatchSample],
    pgbench: &[(usize, f64)],
    dir: &Path,
    images: Option<&Path>,
) -> Result<(), Error> {
    let mut series: Vec<(String, Vec<f64>)> = Vec::new();
    println!(
        "\nbatches (dedup_runtime::batch, the body one multi-row statement): messages per \
         second, medians over the rounds, and the ratio to the single-message generated \
         handler at the same task count"
    );
    let mut csv = String::from("backend,tasks,batch,per_message_rate,ratio_vs_single\n");
    for backend in [BackendName::Postgres, BackendName::Sqlite] {
        for tasks in BATCH_TASKS {
            let mine: Vec<&BatchSample> = samples
                .iter()
                .filter(|s| s.backend == backend && s.tasks == tasks)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let single = median(mine.iter().map(|s| s.single).collect());
            let mut curve = vec![single];
            let mut line = format!(
                "{:<10} {tasks} task(s): single {single:.0}/s",
                backend.name()
            );
            for batch in BATCH_SIZES {
                let rates: Vec<(f64, f64)> = mine
                    .iter()
                    .filter_map(|s| {
                        s.fresh
                            .iter()
                            .find(|(b, _)| *b == batch)
                            .map(|(_, rate)| (*rate, rate / s.single))
                    })
                    .collect();
                if rates.is_empty() {
                    continue;
                }
                let rate = median(rates.iter().map(|r| r.0).collect());
                let ratio = median(rates.iter().map(|r| r.1).collect());
                curve.push(rate);
                let _ = write!(line, "; {batch}: {rate:.0}/s ({ratio:.1}x)");
                let _ = writeln!(
                    csv,
                    "{},{tasks},{batch},{rate:.1},{ratio:.3}",
                    backend.key()
                );
            }
            let duplicate_ratio = median(
                mine.iter()
                    .filter_map(|s| {
                        let fresh = s.fresh.iter().find(|(b, _)| *b == 100)?.1;
                        Some(s.duplicates / fresh)
                    })
                    .collect(),
            );
            let _ = write!(
                line,
                "; all duplicates / all fresh (100): {duplicate_ratio:.2}x"
            );
            if backend == BackendName::Postgres
                && let Some((_, pgbench)) = pgbench.iter().find(|(t, _)| *t == tasks)
            {
                let hundred = median(
                    mine.iter()
                        .filter_map(|s| s.fresh.iter().find(|(b, _)| *b == 100).map(|(_, r)| *r))
                        .collect(),
                );
                let _ = write!(line, "; batch 100 / pgbench: {:.1}x", hundred / pgbench);
            }
            println!("{line}");
            series.push((
                format!(
                    "{}, {tasks} task{}",
                    backend.name(),
                    if tasks == 1 { "" } else { "s" }
                ),
                curve,
            ));
        }
    }
    std::fs::write(dir.join("batch.csv"), csv)?;
    let plot = batch_svg(&series);
    std::fs::write(dir.join("batch.svg"), &plot)?;
    if let Some(images) = images {
        std::fs::write(images.join("batch.svg"), &plot)?;
    }
    Ok(())
}
