//! Counting allocations (a global allocator) and statements (a tracing subscriber that
//! counts sqlx's per-query events).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sqlx::Pool;
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Metadata, span};

use crate::Error;
use crate::config::{BackendName, Variant};
use crate::target::Target;
use crate::timing::random_ids;

// ---------------------------------------------------------------------------------------
// Counting allocations
// ---------------------------------------------------------------------------------------

pub(crate) static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting allocations (and reallocations).
struct Counting;

// SAFETY: forwards every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

// ---------------------------------------------------------------------------------------
// Counting statements
// ---------------------------------------------------------------------------------------

/// Whether [`StatementCounter`] listens; off during the timed runs.
static COUNTING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counts the `sqlx::query` events sqlx emits once per query it executes. Its transaction
/// manager sends `BEGIN` without one (on SQLite `COMMIT` and `ROLLBACK` too), the same
/// way for every variant; so on PostgreSQL a call's round trips are this count plus one. It
/// listens only while [`COUNTING`] is on; turned off (and the interest cache rebuilt),
/// it reports level `OFF`, so the timed runs cost what they cost with no subscriber.
pub(crate) struct StatementCounter;

impl tracing::Subscriber for StatementCounter {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if COUNTING.load(Ordering::SeqCst) && metadata.target() == "sqlx::query" {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(if COUNTING.load(Ordering::SeqCst) {
            LevelFilter::TRACE
        } else {
            LevelFilter::OFF
        })
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        COUNTING.load(Ordering::SeqCst) && metadata.target() == "sqlx::query"
    }

    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {
        STATEMENTS.fetch_add(1, Ordering::SeqCst);
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

pub(crate) fn counting(on: bool) {
    COUNTING.store(on, Ordering::SeqCst);
    tracing::callsite::rebuild_interest_cache();
}

/// Statements per call of each variant (after a first call has prepared them), counted
/// from sqlx's own per-statement events.
pub(crate) async fn statements_per_call<DB: Target>(
    pool: &Pool<DB>,
    smoke: bool,
    seed: &mut u64,
) -> Result<Vec<(BackendName, Variant, u64)>, Error> {
    let mut counts = Vec::new();
    for variant in Variant::ALL {
        if variant == Variant::Pgbench {
            continue;
        }
        let ids = random_ids(2, seed);
        if variant == Variant::Duplicate {
            DB::seen(pool, &ids).await?;
        }
        DB::call(pool, variant, smoke, &ids[0]).await?;
        counting(true);
        let before = STATEMENTS.load(Ordering::SeqCst);
        let result = DB::call(pool, variant, smoke, &ids[1]).await;
        let statements = STATEMENTS.load(Ordering::SeqCst) - before;
        counting(false);
        result?;
        counts.push((DB::BACKEND, variant, statements));
    }
    Ok(counts)
}
