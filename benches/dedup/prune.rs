//! The pruning figure, once per backend after the rounds: a prune of old ids while
//! consumers run beside it; printed and in `prune.csv`.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::Pool;

use crate::Error;
use crate::config::{BackendName, Config};
use crate::report::thousands;
use crate::setup::prune_setup;
use crate::target::Target;
use crate::timing::random_ids;

/// The pruning figure of one backend.
pub(crate) struct PruneFigure {
    backend: BackendName,
    /// Old ids in the table, all older than the age.
    rows: i64,
    /// The prune's own report: ids deleted, batches, wall time.
    done: dedup_runtime::PruneProgress,
    /// The consumers' calls per second before the prune and during it.
    before: f64,
    during: f64,
}

/// How many consumer tasks run while the table is pruned.
const PRUNE_CONSUMERS: usize = 4;

/// A fresh pruned table ([`prune_setup`]), then [`measure_prune`].
pub(crate) async fn prune<DB: Target>(
    pool: &Pool<DB>,
    config: &Config,
    seed: &mut u64,
) -> Result<PruneFigure, Error> {
    prune_setup(pool, config.prune_rows).await?;
    let figure = measure_prune(pool, config, seed).await?;
    eprintln!(
        "{:<10} pruned {} ids in {:.2?} while {PRUNE_CONSUMERS} tasks consumed",
        figure.backend.name(),
        figure.done.deleted,
        figure.done.elapsed
    );
    Ok(figure)
}

/// Prunes the `config.prune_rows` old ids `fill` put into `dedup_bench_prune` while
/// [`PRUNE_CONSUMERS`] tasks run the generated handler on fresh ids; measures the
/// consumers for `config.prune_baseline` first.
async fn measure_prune<DB: Target>(
    pool: &Pool<DB>,
    config: &Config,
    seed: &mut u64,
) -> Result<PruneFigure, Error> {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    let backend = DB::BACKEND;
    let run = random_ids(1, seed).remove(0);
    let calls = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..PRUNE_CONSUMERS)
        .map(|task| {
            let (pool, run) = (pool.clone(), run.clone());
            let (calls, stop) = (calls.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0_u64;
                while !stop.load(Ordering::SeqCst) {
                    if !DB::consume(&pool, &format!("{run}-{task}-{n}")).await? {
                        return Err(
                            format!("{}: a fresh id was a duplicate", backend.name()).into()
                        );
                    }
                    n += 1;
                    calls.fetch_add(1, Ordering::SeqCst);
                }
                Ok::<(), Error>(())
            })
        })
        .collect();
    let baseline_from = calls.load(Ordering::SeqCst);
    let began = Instant::now();
    tokio::time::sleep(config.prune_baseline).await;
    let before =
        (calls.load(Ordering::SeqCst) - baseline_from) as f64 / began.elapsed().as_secs_f64();
    let prune_from = calls.load(Ordering::SeqCst);
    let done = dedup_runtime::Prune::new(2 * DAY, DAY)
        .in_table("dedup_bench_prune")?
        .run(pool, |_| {})
        .await?;
    let during = (calls.load(Ordering::SeqCst) - prune_from) as f64 / done.elapsed.as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await??;
    }
    if done.deleted != config.prune_rows as u64 {
        return Err(format!(
            "{}: pruned {} of {} old ids",
            backend.name(),
            done.deleted,
            config.prune_rows
        )
        .into());
    }
    Ok(PruneFigure {
        backend,
        rows: config.prune_rows,
        done,
        before,
        during,
    })
}

/// `prune.csv`: one line per backend.
pub(crate) fn write_prune_csv(dir: &Path, prunes: &[PruneFigure]) -> std::io::Result<()> {
    let mut table = String::from(
        "backend,old_ids,deleted,batches,seconds,ids_per_second,\
         consumer_calls_per_second_before,consumer_calls_per_second_during\n",
    );
    for figure in prunes {
        let _ = writeln!(
            table,
            "{},{},{},{},{:.3},{:.0},{:.1},{:.1}",
            figure.backend.name(),
            figure.rows,
            figure.done.deleted,
            figure.done.batches,
            figure.done.elapsed.as_secs_f64(),
            figure.done.rate(),
            figure.before,
            figure.during
        );
    }
    std::fs::write(dir.join("prune.csv"), table)
}

/// The pruning figures: the prune's rate and what it left the consumers.
pub(crate) fn print_prune(prunes: &[PruneFigure]) {
    let Some(first) = prunes.first() else {
        return;
    };
    println!(
        "\npruning {} ids aged 3 days and more (age 2 days, batches of {}) while {PRUNE_CONSUMERS} \
         tasks run the generated handler:",
        thousands(first.rows),
        thousands(i64::from(dedup_runtime::DEFAULT_PRUNE_BATCH))
    );
    for figure in prunes {
        println!(
            "  {:<12}{:>9.0} ids/s ({} batches in {:.2?}); consumers {:.0} calls/s before, \
             {:.0} during ({:.2}×)",
            figure.backend.name(),
            figure.done.rate(),
            figure.done.batches,
            figure.done.elapsed,
            figure.before,
            figure.during,
            figure.during / figure.before
        );
    }
}
