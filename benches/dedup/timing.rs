//! Timing: the random ids, tasks started together behind a barrier, the timed runs of a
//! variant, and the call-by-call runs of a pair of variants.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use sqlx::Pool;
use tokio::sync::Barrier;
use tokio::task::JoinHandle;

use crate::Error;
use crate::config::{BackendName, Variant};
use crate::counting::ALLOCATIONS;
use crate::report::median;
use crate::target::Target;

/// `count` random 32-digit hex ids (xorshift64*, seeded from the clock).
pub(crate) fn random_ids(count: usize, seed: &mut u64) -> Vec<String> {
    let mut next = || {
        let mut x = *seed;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        *seed = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    (0..count)
        .map(|_| format!("{:016x}{:016x}", next(), next()))
        .collect()
}

/// Tasks spawned to start together: each does what it needs first, then waits on the
/// barrier until [`Started::time`] or [`Started::join`] opens it.
pub(crate) struct Started<T, E> {
    start: Arc<Barrier>,
    handles: Vec<JoinHandle<Result<T, E>>>,
}

/// Spawns `tasks` tasks, `work(task, start)` each; each waits on `start` when it is ready.
pub(crate) fn spawn<T, E, F>(tasks: usize, work: impl Fn(usize, Arc<Barrier>) -> F) -> Started<T, E>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    let start = Arc::new(Barrier::new(tasks + 1));
    let handles = (0..tasks)
        .map(|task| tokio::spawn(work(task, start.clone())))
        .collect();
    Started { start, handles }
}

impl<T, E: Into<Error>> Started<T, E> {
    /// Opens the barrier; what each task returned, in order.
    pub(crate) async fn join(self) -> Result<Vec<T>, Error> {
        self.start.wait().await;
        let mut results = Vec::with_capacity(self.handles.len());
        for handle in self.handles {
            results.push(handle.await?.map_err(Into::into)?);
        }
        Ok(results)
    }
}

impl<E: Into<Error>> Started<usize, E> {
    /// Opens the barrier: the seconds from then to the last task's return, and the sum of
    /// what the tasks counted.
    pub(crate) async fn time(self) -> Result<(f64, usize), Error> {
        self.start.wait().await;
        let began = Instant::now();
        let mut counted = 0;
        for handle in self.handles {
            counted += handle.await?.map_err(Into::into)?;
        }
        Ok((began.elapsed().as_secs_f64(), counted))
    }
}

/// Runs `ids` through `variant` on `tasks` tasks; the clock runs from the moment all tasks
/// are ready to the last call's return.
pub(crate) async fn measure<DB: Target>(
    pool: &Pool<DB>,
    variant: Variant,
    tasks: usize,
    smoke: bool,
    ids: Arc<Vec<String>>,
) -> Result<(f64, f64), Error> {
    let per_task = ids.len() / tasks;
    let started = spawn(tasks, |task, start| {
        let (pool, ids) = (pool.clone(), ids.clone());
        async move {
            start.wait().await;
            let mut processed = 0;
            for id in &ids[task * per_task..(task + 1) * per_task] {
                if DB::call(&pool, variant, smoke, id).await? {
                    processed += 1;
                }
            }
            Ok::<usize, sqlx::Error>(processed)
        }
    });
    let allocations = ALLOCATIONS.load(Ordering::Relaxed);
    let (seconds, processed) = started.time().await?;
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations;
    let calls = per_task * tasks;
    let expected = if variant.processes() { calls } else { 0 };
    if processed != expected {
        return Err(format!(
            "{}: {processed} of {calls} calls processed their message, expected {expected}",
            variant.name()
        )
        .into());
    }
    Ok((seconds, allocations as f64 / calls as f64))
}

/// The variants timed call by call against each other: `(a, b)`, reported as how much
/// faster `a` is than `b`.
pub(crate) const PAIRS: [(Variant, Variant, &str); 3] = [
    (
        Variant::Generated,
        Variant::Handwritten,
        "generated / hand-written",
    ),
    (
        Variant::Duplicate,
        Variant::Generated,
        "duplicate / processing",
    ),
    (Variant::Big, Variant::Generated, "10M rows / empty"),
];

/// One call-by-call run of a pair: per-call latencies in microseconds.
pub(crate) struct PairSample {
    pub(crate) backend: BackendName,
    pub(crate) tasks: usize,
    pub(crate) round: usize,
    pub(crate) pair: usize,
    pub(crate) a: Vec<f64>,
    pub(crate) b: Vec<f64>,
}

impl PairSample {
    /// How many times faster `a` is than `b`: the ratio of their median latencies.
    pub(crate) fn ratio(&self) -> f64 {
        median(self.b.clone()) / median(self.a.clone())
    }
}

/// Each task alternates calls of `a` and `b` (`a b`, then `b a`, …), so that both meet
/// the same load at the same moments: drift and other processes cancel out of the ratio.
pub(crate) async fn measure_pair<DB: Target>(
    pool: &Pool<DB>,
    (a, b): (Variant, Variant),
    tasks: usize,
    smoke: bool,
    ids: (Arc<Vec<String>>, Arc<Vec<String>>),
) -> Result<(Vec<f64>, Vec<f64>), Error> {
    let per_task = ids.0.len().min(ids.1.len()) / tasks;
    let started = spawn(tasks, |task, start| {
        let (pool, ids) = (pool.clone(), ids.clone());
        async move {
            let (mut lat_a, mut lat_b) =
                (Vec::with_capacity(per_task), Vec::with_capacity(per_task));
            start.wait().await;
            for k in task * per_task..(task + 1) * per_task {
                let order = if k % 2 == 0 { [a, b] } else { [b, a] };
                for variant in order {
                    let (id, latencies) = if variant == a {
                        (&ids.0[k], &mut lat_a)
                    } else {
                        (&ids.1[k], &mut lat_b)
                    };
                    let began = Instant::now();
                    let processed = DB::call(&pool, variant, smoke, id).await?;
                    latencies.push(began.elapsed().as_secs_f64() * 1e6);
                    if processed != variant.processes() {
                        return Err(format!("{}: unexpected outcome", variant.name()).into());
                    }
                }
            }
            Ok::<_, Error>((lat_a, lat_b))
        }
    });
    let (mut all_a, mut all_b) = (Vec::new(), Vec::new());
    for (lat_a, lat_b) in started.join().await? {
        all_a.extend(lat_a);
        all_b.extend(lat_b);
    }
    Ok((all_a, all_b))
}
