//! What dedup costs, measured in one interleaved run on PostgreSQL and SQLite.
//!
//! ```text
//! cargo bench --bench dedup                      # the full run: about 9 minutes
//! cargo bench --bench dedup --features brokers    # the same, and the relay to the brokers
//! cargo bench --bench dedup -- batch              # the batch group alone (batch.csv)
//! cargo bench --bench dedup --features brokers -- relay  # the relay group alone (relay.csv;
//!                                                 # in the smoke run too, tiny: see dedup/relay.rs)
//! cargo bench --bench dedup -- inbox              # the inbox workers' group alone (inbox.csv;
//!                                                 # in the smoke run too, tiny: see dedup/inbox.rs)
//! DEDUP_BENCH_ROUNDS=5 cargo bench --bench dedup  # the same with 5 rounds instead of 15
//! DEDUP_BENCH_SMOKE=1 cargo test --all-features --bench dedup  # CI smoke run: tiny sizes
//! ```
//!
//! The batch group (in every round, or alone with `-- batch`): `dedup_runtime::batch` on
//! PostgreSQL and SQLite at 1 and 4 tasks, batches of 1, 10, 100 and 1,000 fresh
//! messages, the body one multi-row insert over them, against the single-message
//! generated handler at the same task count in the same round; and batches of 100 that are
//! all duplicates. `target/dedup-bench/batch.csv` has
//! `backend,tasks,batch,per_message_rate,ratio_vs_single` (medians over the rounds), and
//! the curve `batch.svg`, copied to `docs/batch.svg` by a run that is not the smoke run.
//!
//! Every round also times the inbox (receiving, and workers processing) and the outbox:
//! the handler with one `enqueue` against the same handler without it, call by call, and
//! one relay moving 1,500 rows through a publisher that drops them (its own claims and
//! marks); with the feature `brokers`, the same rows through the RabbitMQ publisher (the
//! local broker, `DEDUP_TEST_AMQP_URL`; publisher confirms) and the JetStream one
//! (`DEDUP_TEST_NATS_URL`; the stream's acknowledgement), reported as rows per second and
//! as a ratio to the relay without a broker. A broker that cannot be reached fails the run.
//!
//! For 1, 4 and 8 concurrent tasks it times these variants of one consumer transaction,
//! whose body inserts one row into `dedup_bench_effects`:
//!
//! - `generated`: the `#[idempotent]` handler, given the pool;
//! - `hand-written`: the same transaction written with sqlx — `BEGIN` (SQLite: `BEGIN
//!   IMMEDIATE`), the generated code's very `INSERT … ON CONFLICT DO NOTHING`, the same
//!   body, `COMMIT` — on the same pool and table;
//! - `bare`: the body alone in a transaction, without dedup;
//! - `duplicate`: the generated handler on ids it has processed before (the path every
//!   redelivery takes: `BEGIN`, claim, `ROLLBACK`);
//! - `10M rows`: the generated handler on a dedup table already holding 10 million ids
//!   (10,000 in the smoke run) of the same random form as the new ones;
//! - `pgbench` (PostgreSQL, when `pgbench` is installed): the hand-written transaction
//!   through pgbench, the reference client, with prepared statements.
//!
//! Message ids are random 32-digit hex strings, like the hashes or UUIDs brokers hand out.
//! Every round runs every (backend, tasks, variant) once, the variants in a different
//! order each round, so that drift (autovacuum, checkpoints, other load) spreads over all
//! of them; the report gives medians over rounds and their ratios. A global allocator
//! counts allocations per call (all threads of the process, so sqlx's included), and
//! before the timed runs a tracing subscriber counts the queries of one call of each
//! variant, as sqlx logs them; it stays installed at level `OFF` (a process has one global
//! subscriber), like an application's subscriber that filters dedup's spans out.
//!
//! The three ratios that matter are also timed call by call: each task alternates a
//! call of one variant with a call of the other, so that both meet the same load at the
//! same moment, and the ratio of their median latencies is taken (median over rounds).
//! On a shared machine this is the steadier measure; the runs above give throughput.
//!
//! Pruning is measured once per backend, after the rounds: 200,000 ids (2,000 in the smoke
//! run) aged 3 to 5 days are pruned at 2 days while 4 tasks run the generated handler on
//! fresh messages. The figures are the prune's rate (ids per second, wall time of the
//! whole run, its rests between batches included) and the consumers' calls per second
//! before and during it: what retention costs the consumers. Printed, never asserted
//! (tests/suite/prune.rs checks that such a prune is correct, not how fast it goes).
//!
//! Results in `target/dedup-bench/`: `results.csv` (every run), `summary.csv` (medians),
//! `statements.csv`, `prune.csv`, and the plot `bench.svg`, copied to `docs/bench.svg` by a
//! full run. The
//! 10-million-row tables are kept between runs (`dedup_bench_10m` in the PostgreSQL
//! database, `target/dedup-bench/sqlite.db`); filling them takes about two minutes, once.
//!
//! PostgreSQL: `DEDUP_TEST_POSTGRES_URL` or `postgres://postgres@127.0.0.1:5432/test`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[path = "dedup/inbox.rs"]
mod inbox;
#[path = "dedup/relay.rs"]
mod relay;

use dedup_runtime::Backend;
use dedup_runtime::inbox::{Inbox, InboxHandler, Incoming, Received};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, Pool};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Metadata, span};

// ---------------------------------------------------------------------------------------
// Counting allocations
// ---------------------------------------------------------------------------------------

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

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
struct StatementCounter;

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

fn counting(on: bool) {
    COUNTING.store(on, Ordering::SeqCst);
    tracing::callsite::rebuild_interest_cache();
}

// ---------------------------------------------------------------------------------------
// What is measured
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    Generated,
    Handwritten,
    Bare,
    Duplicate,
    Big,
    Pgbench,
}

impl Variant {
    const ALL: [Variant; 6] = [
        Variant::Generated,
        Variant::Handwritten,
        Variant::Bare,
        Variant::Duplicate,
        Variant::Big,
        Variant::Pgbench,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::Generated => "generated",
            Variant::Handwritten => "hand-written",
            Variant::Bare => "bare",
            Variant::Duplicate => "duplicate",
            Variant::Big => "10M rows",
            Variant::Pgbench => "pgbench",
        }
    }

    /// Whether a call of this variant processes its message (else it is a duplicate).
    fn processes(self) -> bool {
        self != Variant::Duplicate
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BackendName {
    Postgres,
    Sqlite,
}

impl BackendName {
    fn name(self) -> &'static str {
        match self {
            BackendName::Postgres => "PostgreSQL",
            BackendName::Sqlite => "SQLite",
        }
    }
}

const TASKS: [usize; 3] = [1, 4, 8];

struct Config {
    smoke: bool,
    rounds: usize,
    /// Calls per timed run, split between the tasks.
    ops: usize,
    /// Rows in the big dedup table.
    big_rows: i64,
    /// Old ids in the table the pruning figure prunes.
    prune_rows: i64,
    /// How long the consumers' rate before the prune is measured.
    prune_baseline: Duration,
}

impl Config {
    fn from_env() -> Config {
        if std::env::var_os("DEDUP_BENCH_SMOKE").is_some_and(|value| value != "0") {
            Config {
                smoke: true,
                rounds: 1,
                ops: 48,
                big_rows: 10_000,
                prune_rows: 2_000,
                prune_baseline: Duration::from_millis(100),
            }
        } else {
            Config {
                smoke: false,
                // `DEDUP_BENCH_ROUNDS=n`: fewer rounds, for a quicker (noisier) full run.
                rounds: std::env::var("DEDUP_BENCH_ROUNDS")
                    .ok()
                    .and_then(|rounds| rounds.parse().ok())
                    .filter(|&rounds| rounds > 0)
                    .unwrap_or(15),
                ops: 1_500,
                big_rows: 10_000_000,
                prune_rows: 200_000,
                prune_baseline: Duration::from_secs(2),
            }
        }
    }

    fn big_table(&self) -> &'static str {
        if self.smoke {
            "dedup_bench_10k"
        } else {
            "dedup_bench_10m"
        }
    }
}

/// One timed run.
struct Sample {
    backend: BackendName,
    tasks: usize,
    variant: Variant,
    round: usize,
    ops: usize,
    seconds: f64,
    /// Allocations per call; `None` for pgbench (another process).
    allocations: Option<f64>,
}

impl Sample {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A backend's handlers, behind one name per variant.
trait Target: Send + Sync + 'static {
    type Db: dedup_runtime::PruneBackend;

    /// Runs one call of `variant`; `true` when it processed the message.
    fn call<'a>(
        pool: &'a Pool<Self::Db>,
        variant: Variant,
        smoke: bool,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Runs one call of the generated handler on the pruned table (`dedup_bench_prune`);
    /// `true` when it processed the message.
    fn consume<'a>(
        pool: &'a Pool<Self::Db>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The inbox workers' handler: the same work as the handlers above.
    type Handler: InboxHandler<Self::Db> + Default + 'static;

    /// Empties the inbox table and the effects.
    fn inbox_reset(
        pool: &Pool<Self::Db>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// One call of the generated handler that also enqueues one outgoing message (its
    /// own consumer on the same dedup table); `true` when it processed the message.
    fn with_outbox<'a>(
        pool: &'a Pool<Self::Db>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Enqueues one outgoing message per id, 100 per transaction.
    fn enqueue_rows<'a>(
        pool: &'a Pool<Self::Db>,
        ids: &'a [String],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The batch handler: one multi-row statement inserting the fresh messages' effects.
    type Batcher: dedup_runtime::batch::BatchHandler<Self::Db, String> + Default + 'static;

    /// Empties the dedup table and the effects.
    fn reset(pool: &Pool<Self::Db>) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Empties the outbox table.
    fn outbox_reset(
        pool: &Pool<Self::Db>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;
}

/// The outbox table of the benchmark.
const OUTBOX_TABLE: &str = "dedup_bench_outbox";

/// The destination of its rows: a RabbitMQ queue and a JetStream subject when the relay
/// publishes to the brokers (feature `brokers`).
const DESTINATION: &str = "dedup-bench.events";

// ---------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------

mod pg {
    use dedup_runtime::idempotent;
    use sqlx::{PgConnection, PgPool};

    /// The batch handler's work: one `INSERT … SELECT unnest(…)` for all fresh messages.
    #[derive(Default)]
    pub struct BatchBody;

    impl dedup_runtime::batch::BatchHandler<sqlx::Postgres, String> for BatchBody {
        type Error = sqlx::Error;

        async fn handle(
            &self,
            tx: &mut PgConnection,
            fresh: &[&String],
        ) -> Result<(), sqlx::Error> {
            let ids: Vec<&str> = fresh.iter().map(|id| id.as_str()).collect();
            sqlx::query("INSERT INTO dedup_bench_effects (message_id) SELECT unnest($1::text[])")
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }
    }

    /// The handler's work, the same in every variant.
    async fn body(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_bench_effects (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench")]
    pub async fn generated(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10m")]
    pub async fn big(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10k")]
    pub async fn big_smoke(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench-prune", key = id, table = "dedup_bench_prune")]
    pub async fn consume(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    /// The generated handler's body and one outgoing message.
    #[idempotent(consumer = "bench-outbox", key = id, table = "dedup_bench")]
    pub async fn with_outbox(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await?;
        super::enqueue_one(tx, "bench-outbox", id).await
    }

    /// What the generated code sends, written by hand: the SQL of DESIGN.md.
    pub async fn handwritten(pool: &PgPool, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(
            "INSERT INTO dedup_bench (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind("bench")
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if !claimed {
            tx.rollback().await?;
            return Ok(false);
        }
        body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn bare(pool: &PgPool, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The inbox workers' handler: the same work.
    #[derive(Default)]
    pub struct InboxBody;

    impl dedup_runtime::inbox::InboxHandler<sqlx::Postgres> for InboxBody {
        type Error = sqlx::Error;

        async fn handle(
            &self,
            tx: &mut PgConnection,
            message: &dedup_runtime::inbox::InboxMessage,
        ) -> Result<(), sqlx::Error> {
            body(tx, message.id()).await
        }
    }
}

struct Postgres;

impl Target for Postgres {
    type Db = sqlx::Postgres;

    async fn call(
        pool: &Pool<sqlx::Postgres>,
        variant: Variant,
        smoke: bool,
        id: &str,
    ) -> Result<bool, sqlx::Error> {
        match variant {
            Variant::Generated | Variant::Duplicate => {
                Ok(pg::generated(pool, id).await?.is_processed())
            }
            Variant::Big if smoke => Ok(pg::big_smoke(pool, id).await?.is_processed()),
            Variant::Big => Ok(pg::big(pool, id).await?.is_processed()),
            Variant::Handwritten => pg::handwritten(pool, id).await,
            Variant::Bare | Variant::Pgbench => pg::bare(pool, id).await,
        }
    }

    async fn consume(pool: &Pool<sqlx::Postgres>, id: &str) -> Result<bool, sqlx::Error> {
        Ok(pg::consume(pool, id).await?.is_processed())
    }

    type Handler = pg::InboxBody;
    type Batcher = pg::BatchBody;

    async fn reset(pool: &Pool<sqlx::Postgres>) -> Result<(), sqlx::Error> {
        postgres_reset(pool).await
    }

    async fn inbox_reset(pool: &Pool<sqlx::Postgres>) -> Result<(), sqlx::Error> {
        execute(
            pool,
            &[&format!("TRUNCATE {INBOX_TABLE}, dedup_bench_effects")],
        )
        .await
    }

    async fn with_outbox(pool: &Pool<sqlx::Postgres>, id: &str) -> Result<bool, sqlx::Error> {
        Ok(pg::with_outbox(pool, id).await?.is_processed())
    }

    async fn enqueue_rows(pool: &Pool<sqlx::Postgres>, ids: &[String]) -> Result<(), sqlx::Error> {
        for chunk in ids.chunks(100) {
            let mut tx = pool.begin().await?;
            for id in chunk {
                enqueue_one(&mut *tx, "bench-relay", id).await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    async fn outbox_reset(pool: &Pool<sqlx::Postgres>) -> Result<(), sqlx::Error> {
        execute(pool, &[&format!("TRUNCATE {OUTBOX_TABLE}")]).await
    }
}

// ---------------------------------------------------------------------------------------
// SQLite
// ---------------------------------------------------------------------------------------

mod lite {
    use dedup_runtime::idempotent;
    use sqlx::{SqliteConnection, SqlitePool};

    /// The batch handler's work: one multi-row `INSERT` for all fresh messages.
    #[derive(Default)]
    pub struct BatchBody;

    impl dedup_runtime::batch::BatchHandler<sqlx::Sqlite, String> for BatchBody {
        type Error = sqlx::Error;

        async fn handle(
            &self,
            tx: &mut SqliteConnection,
            fresh: &[&String],
        ) -> Result<(), sqlx::Error> {
            let mut sql = String::from("INSERT INTO dedup_bench_effects (message_id) VALUES ");
            for n in 1..=fresh.len() {
                if n > 1 {
                    sql.push_str(", ");
                }
                sql.push_str(&format!("(?{n})"));
            }
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for id in fresh {
                query = query.bind(id.as_str());
            }
            query.execute(&mut *tx).await?;
            Ok(())
        }
    }

    /// The handler's work, the same in every variant.
    async fn body(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_bench_effects (message_id) VALUES (?1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench")]
    pub async fn generated(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10m")]
    pub async fn big(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench", key = id, table = "dedup_bench_10k")]
    pub async fn big_smoke(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    #[idempotent(consumer = "bench-prune", key = id, table = "dedup_bench_prune")]
    pub async fn consume(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await
    }

    /// The generated handler's body and one outgoing message.
    #[idempotent(consumer = "bench-outbox", key = id, table = "dedup_bench")]
    pub async fn with_outbox(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
        body(tx, id).await?;
        super::enqueue_one(tx, "bench-outbox", id).await
    }

    /// What the generated code sends, written by hand: `BEGIN IMMEDIATE`, so that
    /// concurrent writers wait for the lock, then the SQL of DESIGN.md.
    pub async fn handwritten(pool: &SqlitePool, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let claimed = sqlx::query(
            "INSERT INTO dedup_bench (consumer, message_id) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )
        .bind("bench")
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if !claimed {
            tx.rollback().await?;
            return Ok(false);
        }
        body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn bare(pool: &SqlitePool, id: &str) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        body(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The inbox workers' handler: the same work.
    #[derive(Default)]
    pub struct InboxBody;

    impl dedup_runtime::inbox::InboxHandler<sqlx::Sqlite> for InboxBody {
        type Error = sqlx::Error;

        async fn handle(
            &self,
            tx: &mut SqliteConnection,
            message: &dedup_runtime::inbox::InboxMessage,
        ) -> Result<(), sqlx::Error> {
            body(tx, message.id()).await
        }
    }
}

struct Sqlite;

impl Target for Sqlite {
    type Db = sqlx::Sqlite;

    async fn call(
        pool: &Pool<sqlx::Sqlite>,
        variant: Variant,
        smoke: bool,
        id: &str,
    ) -> Result<bool, sqlx::Error> {
        match variant {
            Variant::Generated | Variant::Duplicate => {
                Ok(lite::generated(pool, id).await?.is_processed())
            }
            Variant::Big if smoke => Ok(lite::big_smoke(pool, id).await?.is_processed()),
            Variant::Big => Ok(lite::big(pool, id).await?.is_processed()),
            Variant::Handwritten => lite::handwritten(pool, id).await,
            Variant::Bare | Variant::Pgbench => lite::bare(pool, id).await,
        }
    }

    async fn consume(pool: &Pool<sqlx::Sqlite>, id: &str) -> Result<bool, sqlx::Error> {
        Ok(lite::consume(pool, id).await?.is_processed())
    }

    type Handler = lite::InboxBody;
    type Batcher = lite::BatchBody;

    async fn reset(pool: &Pool<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
        sqlite_reset(pool).await
    }

    async fn inbox_reset(pool: &Pool<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
        execute(
            pool,
            &[
                &format!("DELETE FROM {INBOX_TABLE}"),
                "DELETE FROM dedup_bench_effects",
                "PRAGMA wal_checkpoint(TRUNCATE)",
            ],
        )
        .await
    }

    async fn with_outbox(pool: &Pool<sqlx::Sqlite>, id: &str) -> Result<bool, sqlx::Error> {
        Ok(lite::with_outbox(pool, id).await?.is_processed())
    }

    async fn enqueue_rows(pool: &Pool<sqlx::Sqlite>, ids: &[String]) -> Result<(), sqlx::Error> {
        for chunk in ids.chunks(100) {
            let mut tx = pool.begin().await?;
            for id in chunk {
                enqueue_one(&mut *tx, "bench-relay", id).await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    async fn outbox_reset(pool: &Pool<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
        execute(pool, &[&format!("DELETE FROM {OUTBOX_TABLE}")]).await
    }
}

// ---------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------

/// `count` random 32-digit hex ids (xorshift64*, seeded from the clock).
fn random_ids(count: usize, seed: &mut u64) -> Vec<String> {
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

/// Runs `ids` through `variant` on `tasks` tasks; the clock runs from the moment all tasks
/// are ready to the last call's return.
async fn measure<T: Target>(
    pool: &Pool<T::Db>,
    variant: Variant,
    tasks: usize,
    smoke: bool,
    ids: Arc<Vec<String>>,
) -> Result<(f64, f64), Error> {
    let per_task = ids.len() / tasks;
    let start = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (pool, ids, start) = (pool.clone(), ids.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let mut processed = 0;
                for id in &ids[task * per_task..(task + 1) * per_task] {
                    if T::call(&pool, variant, smoke, id).await? {
                        processed += 1;
                    }
                }
                Ok::<usize, sqlx::Error>(processed)
            })
        })
        .collect();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed);
    start.wait().await;
    let began = Instant::now();
    let mut processed = 0;
    for handle in handles {
        processed += handle.await??;
    }
    let seconds = began.elapsed().as_secs_f64();
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
const PAIRS: [(Variant, Variant, &str); 3] = [
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
struct PairSample {
    backend: BackendName,
    tasks: usize,
    round: usize,
    pair: usize,
    a: Vec<f64>,
    b: Vec<f64>,
}

impl PairSample {
    /// How many times faster `a` is than `b`: the ratio of their median latencies.
    fn ratio(&self) -> f64 {
        median(self.b.clone()) / median(self.a.clone())
    }
}

/// Each task alternates calls of `a` and `b` (`a b`, then `b a`, …), so that both meet
/// the same load at the same moments: drift and other processes cancel out of the ratio.
async fn measure_pair<T: Target>(
    pool: &Pool<T::Db>,
    (a, b): (Variant, Variant),
    tasks: usize,
    smoke: bool,
    ids: (Arc<Vec<String>>, Arc<Vec<String>>),
) -> Result<(Vec<f64>, Vec<f64>), Error> {
    let per_task = ids.0.len().min(ids.1.len()) / tasks;
    let start = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (pool, ids, start) = (pool.clone(), ids.clone(), start.clone());
            tokio::spawn(async move {
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
                        let processed = T::call(&pool, variant, smoke, id).await?;
                        latencies.push(began.elapsed().as_secs_f64() * 1e6);
                        if processed != variant.processes() {
                            return Err(format!("{}: unexpected outcome", variant.name()).into());
                        }
                    }
                }
                Ok::<_, Error>((lat_a, lat_b))
            })
        })
        .collect();
    start.wait().await;
    let (mut all_a, mut all_b) = (Vec::new(), Vec::new());
    for handle in handles {
        let (lat_a, lat_b) = handle.await??;
        all_a.extend(lat_a);
        all_b.extend(lat_b);
    }
    Ok((all_a, all_b))
}

// ---------------------------------------------------------------------------------------
// The inbox
// ---------------------------------------------------------------------------------------

/// The inbox table of the benchmark.
const INBOX_TABLE: &str = "dedup_bench_inbox";

/// Messages per `receive_batch` in the batched receive figure.
const INBOX_BATCH: usize = 100;

/// One round of inbox figures for one backend, in messages per second.
struct InboxSample {
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
    let start = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (pool, ids, start) = (pool.clone(), ids.clone(), start.clone());
            tokio::spawn(async move {
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
            })
        })
        .collect();
    start.wait().await;
    let began = Instant::now();
    let mut stored = 0;
    for handle in handles {
        stored += handle.await??;
    }
    let seconds = began.elapsed().as_secs_f64();
    if stored != per_task * tasks {
        return Err(format!("inbox: {stored} of {} messages stored", per_task * tasks).into());
    }
    Ok(stored as f64 / seconds)
}

/// Stores `ids` (untimed), then processes them with `workers` workers; messages per
/// second, checked against the effects.
async fn measure_workers<T: Target>(
    pool: &Pool<T::Db>,
    workers: usize,
    ids: &[String],
) -> Result<f64, Error> {
    let inbox = Inbox::new(pool, "bench-inbox")?.in_table(INBOX_TABLE)?;
    for chunk in ids.chunks(1_000) {
        let batch: Vec<Incoming<'_>> = chunk
            .iter()
            .map(|id| Incoming::new(id.as_str(), b"payload"))
            .collect();
        inbox.receive_batch(&batch).await?;
    }
    let start = Arc::new(tokio::sync::Barrier::new(workers + 1));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (pool, start) = (pool.clone(), start.clone());
            tokio::spawn(async move {
                let inbox = Inbox::new(&pool, "bench-inbox")?.in_table(INBOX_TABLE)?;
                let worker = inbox.worker().batch(16);
                let handler = T::Handler::default();
                start.wait().await;
                let mut processed = 0;
                loop {
                    let batch = worker.process_batch(&handler).await?;
                    processed += batch.processed;
                    if batch.claimed == 0 {
                        return Ok::<usize, Error>(processed);
                    }
                }
            })
        })
        .collect();
    start.wait().await;
    let began = Instant::now();
    let mut processed = 0;
    for handle in handles {
        processed += handle.await??;
    }
    let seconds = began.elapsed().as_secs_f64();
    if processed != ids.len() {
        return Err(format!("inbox: {processed} of {} messages processed", ids.len()).into());
    }
    Ok(processed as f64 / seconds)
}

/// One round of the inbox's figures on one backend, each run on an empty inbox.
async fn measure_inbox<T: Target>(
    backend: BackendName,
    pool: &Pool<T::Db>,
    config: &Config,
    seed: &mut u64,
) -> Result<InboxSample, Error> {
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
        T::inbox_reset(pool).await?;
        let ids = Arc::new(random_ids(ops, seed));
        let rate = measure_receive(pool, tasks, false, false, ids).await?;
        sample.receive[slot] = figure(rate, &format!("receive, {tasks} task(s)"), backend);
        T::inbox_reset(pool).await?;
        let ids = Arc::new(random_ids(10 * ops, seed));
        let rate = measure_receive(pool, tasks, true, false, ids).await?;
        sample.batched[slot] = figure(rate, &format!("receive x100, {tasks} task(s)"), backend);
    }
    for (slot, workers) in [1, 4].into_iter().enumerate() {
        T::inbox_reset(pool).await?;
        let ids = random_ids(ops, seed);
        let rate = measure_workers::<T>(pool, workers, &ids).await?;
        sample.workers[slot] = figure(rate, &format!("process, {workers} worker(s)"), backend);
    }
    if backend == BackendName::Postgres {
        let mut rates = [0.0; 2];
        for (slot, notify) in [false, true].into_iter().enumerate() {
            T::inbox_reset(pool).await?;
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
fn print_inbox(samples: &[InboxSample], summary: &Summary) {
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

// ---------------------------------------------------------------------------------------
// The outbox
// ---------------------------------------------------------------------------------------

/// The handler's one outgoing message: the same payload every time, the slot "event".
async fn enqueue_one<C: dedup_runtime::outbox::OutboxConnection>(
    tx: &mut C,
    consumer: &str,
    id: &str,
) -> Result<(), sqlx::Error> {
    let outbox = dedup_runtime::outbox::Outbox::new()
        .in_table(OUTBOX_TABLE)
        .map_err(|error| sqlx::Error::InvalidArgument(error.to_string()))?;
    let cause = dedup_runtime::outbox::Cause::new(consumer, id)?;
    let event = cause.outgoing("event", DESTINATION, br#"{"paid": true}"#)?;
    outbox.enqueue(tx, &event).await?;
    Ok(())
}

/// A publisher that drops every message at once: the relay's own cost, its claims and
/// marks, without a broker.
struct Discard;

impl dedup_runtime::outbox::Publisher for Discard {
    type Error = std::convert::Infallible;

    async fn publish(
        &self,
        _: &dedup_runtime::outbox::OutboxMessage,
    ) -> Result<(), std::convert::Infallible> {
        Ok(())
    }
}

/// One round of the outbox's figures on one backend.
struct OutboxSample {
    backend: BackendName,
    /// Call by call at 1 and 4 tasks: the rate of the handler with one enqueue over that
    /// of the same handler without it (the median latency without over that with).
    cost: [f64; 2],
    /// Rows per second one relay claims, hands to a publisher that drops them, and marks.
    relay: f64,
    /// The same with the RabbitMQ and the JetStream publisher (feature `brokers`).
    brokers: Option<[f64; 2]>,
}

async fn measure_outbox<T: Target>(
    backend: BackendName,
    pool: &Pool<T::Db>,
    config: &Config,
    seed: &mut u64,
    #[cfg(feature = "brokers")] brokers: &Brokers,
) -> Result<OutboxSample, Error> {
    let ops = config.ops;
    let mut cost = [0.0; 2];
    for (slot, tasks) in [1, 4].into_iter().enumerate() {
        let ids = (
            Arc::new(random_ids(ops, seed)),
            Arc::new(random_ids(ops, seed)),
        );
        let per_task = ops / tasks;
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                let (pool, ids) = (pool.clone(), ids.clone());
                tokio::spawn(async move {
                    let (mut without, mut with) = (Vec::new(), Vec::new());
                    for k in task * per_task..(task + 1) * per_task {
                        for first in [k % 2 == 0, k % 2 == 1] {
                            let began = Instant::now();
                            let processed = if first {
                                T::call(&pool, Variant::Generated, false, &ids.0[k]).await?
                            } else {
                                T::with_outbox(&pool, &ids.1[k]).await?
                            };
                            let micros = began.elapsed().as_secs_f64() * 1e6;
                            if !processed {
                                return Err::<_, Error>("outbox figure: a duplicate".into());
                            }
                            if first {
                                without.push(micros);
                            } else {
                                with.push(micros);
                            }
                        }
                    }
                    Ok((without, with))
                })
            })
            .collect();
        let (mut without, mut with) = (Vec::new(), Vec::new());
        for handle in handles {
            let (a, b) = handle.await??;
            without.extend(a);
            with.extend(b);
        }
        cost[slot] = median(without) / median(with);
    }
    // The relay: `ops` rows enqueued (100 per transaction, untimed), then one relay; the
    // same with each broker's publisher (feature `brokers`), in turn.
    let relay_rate = relayed_per_second::<T, _>(pool, ops, seed, &Discard).await?;
    #[cfg(feature = "brokers")]
    let broker_rates = Some([
        relayed_per_second::<T, _>(pool, ops, seed, &brokers.rabbitmq).await?,
        relayed_per_second::<T, _>(pool, ops, seed, &brokers.jetstream).await?,
    ]);
    #[cfg(feature = "brokers")]
    brokers.purge().await?;
    #[cfg(not(feature = "brokers"))]
    let broker_rates: Option<[f64; 2]> = None;
    T::outbox_reset(pool).await?;
    eprintln!(
        "           {:<10} outbox: with / without one enqueue {:.3} / {:.3} (1 / 4 tasks), relay {relay_rate:.0} rows/s{}",
        backend.name(),
        cost[0],
        cost[1],
        broker_rates.map_or(String::new(), |[rabbitmq, jetstream]| format!(
            "; to RabbitMQ {rabbitmq:.0}, to JetStream {jetstream:.0}"
        ))
    );
    Ok(OutboxSample {
        backend,
        cost,
        relay: relay_rate,
        brokers: broker_rates,
    })
}

/// Rows per second one relay moves through `publisher`: `ops` rows enqueued (100 per
/// transaction, untimed), then relayed in batches of 32 until none is left.
async fn relayed_per_second<T: Target, P: dedup_runtime::outbox::Publisher>(
    pool: &Pool<T::Db>,
    ops: usize,
    seed: &mut u64,
    publisher: &P,
) -> Result<f64, Error> {
    T::outbox_reset(pool).await?;
    T::enqueue_rows(pool, &random_ids(ops, seed)).await?;
    let outbox = dedup_runtime::outbox::Outbox::new().in_table(OUTBOX_TABLE)?;
    let relay = outbox.relay(pool).batch(32);
    let began = Instant::now();
    let mut sent = 0;
    loop {
        let relayed = relay.relay_batch(publisher).await?;
        sent += relayed.sent;
        if relayed.claimed == 0 {
            break;
        }
    }
    let rate = sent as f64 / began.elapsed().as_secs_f64();
    if sent != ops {
        return Err(format!("outbox figure: the relay sent {sent} of {ops}").into());
    }
    Ok(rate)
}

/// The brokers the relay publishes to (feature `brokers`): the local RabbitMQ
/// (`DEDUP_TEST_AMQP_URL`) and NATS JetStream (`DEDUP_TEST_NATS_URL`), a queue and a
/// stream for the rows' destination, emptied after each measure.
#[cfg(feature = "brokers")]
struct Brokers {
    rabbitmq: dedup_runtime::lapin::RabbitMqPublisher,
    channel: lapin::Channel,
    jetstream: dedup_runtime::async_nats::JetStreamPublisher,
    stream: async_nats::jetstream::stream::Stream,
    /// For the hand-written relays (`-- relay`): a channel in confirm mode, and the
    /// JetStream context.
    hand_channel: lapin::Channel,
    context: async_nats::jetstream::Context,
}

#[cfg(feature = "brokers")]
impl Brokers {
    async fn connect() -> Result<Brokers, Error> {
        let amqp = std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let nats = std::env::var("DEDUP_TEST_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let connection = lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default())
            .await
            .map_err(|error| format!("RabbitMQ at {amqp}: {error}"))?;
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                DESTINATION.into(),
                lapin::options::QueueDeclareOptions::durable(),
                lapin::types::FieldTable::default(),
            )
            .await?;
        let rabbitmq =
            dedup_runtime::lapin::RabbitMqPublisher::new(connection.create_channel().await?, "")
                .await?;
        let client = async_nats::connect(&nats)
            .await
            .map_err(|error| format!("NATS at {nats}: {error}"))?;
        let context = async_nats::jetstream::new(client);
        // Made afresh: a stream left by an earlier run may capture other subjects.
        let _ = context.delete_stream("DEDUP_BENCH_RELAY").await;
        let stream = context
            .create_stream(async_nats::jetstream::stream::Config {
                name: "DEDUP_BENCH_RELAY".to_owned(),
                subjects: vec![DESTINATION.to_owned()],
                ..Default::default()
            })
            .await?;
        let hand_channel = connection.create_channel().await?;
        hand_channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        let brokers = Brokers {
            rabbitmq,
            channel,
            jetstream: dedup_runtime::async_nats::JetStreamPublisher::new(context.clone()),
            stream,
            hand_channel,
            context,
        };
        brokers.purge().await?;
        Ok(brokers)
    }

    /// Empties the queue and the stream.
    async fn purge(&self) -> Result<(), Error> {
        self.channel
            .queue_purge(
                DESTINATION.into(),
                lapin::options::QueuePurgeOptions::default(),
            )
            .await?;
        self.stream.purge().await?;
        Ok(())
    }
}

/// The batch sizes of the batch group.
const BATCH_SIZES: [usize; 4] = [1, 10, 100, 1_000];

/// The task counts of the batch group.
const BATCH_TASKS: [usize; 2] = [1, 4];

/// One round of the batch group on one backend and task count.
struct BatchSample {
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
async fn measure_batch<T: Target>(
    pool: &Pool<T::Db>,
    tasks: usize,
    batch: usize,
    ids: Arc<Vec<String>>,
    fresh: bool,
) -> Result<f64, Error> {
    let per_task = ids.len() / tasks;
    let start = Arc::new(tokio::sync::Barrier::new(tasks + 1));
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (pool, ids, start) = (pool.clone(), ids.clone(), start.clone());
            tokio::spawn(async move {
                let runner =
                    dedup_runtime::batch::Batch::new("bench-batch")?.in_table("dedup_bench")?;
                let handler = T::Batcher::default();
                start.wait().await;
                let mut processed = 0;
                for chunk in ids[task * per_task..(task + 1) * per_task].chunks(batch) {
                    let outcome = runner.run(&pool, chunk, |id| id.as_str(), &handler).await?;
                    processed += outcome.processed();
                }
                Ok::<usize, Error>(processed)
            })
        })
        .collect();
    start.wait().await;
    let began = Instant::now();
    let mut processed = 0;
    for handle in handles {
        processed += handle.await??;
    }
    let seconds = began.elapsed().as_secs_f64();
    let expected = if fresh { per_task * tasks } else { 0 };
    if processed != expected {
        return Err(format!("batch of {batch}: {processed} processed, expected {expected}").into());
    }
    Ok(seconds)
}

/// One round of the batch group on `backend`: for 1 and 4 tasks, the single-message
/// generated handler, then batches of each size (in an order that turns each round),
/// then batches of 100 that are all duplicates.
async fn measure_batches<T: Target>(
    backend: BackendName,
    pool: &Pool<T::Db>,
    config: &Config,
    round: usize,
    seed: &mut u64,
) -> Result<Vec<BatchSample>, Error> {
    let mut samples = Vec::new();
    for tasks in BATCH_TASKS {
        T::reset(pool).await?;
        let ids = Arc::new(random_ids(config.ops / tasks * tasks, seed));
        let (seconds, _) =
            measure::<T>(pool, Variant::Generated, tasks, config.smoke, ids.clone()).await?;
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
            let seconds = measure_batch::<T>(pool, tasks, batch, ids.clone(), true).await?;
            fresh.push((batch, count as f64 / seconds));
            if batch == 100 {
                let seconds = measure_batch::<T>(pool, tasks, batch, ids, false).await?;
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
fn print_batches(
    samples: &[BatchSample],
    pgbench: &[(usize, f64)],
    dir: &Path,
    docs: Option<&Path>,
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
                    match backend {
                        BackendName::Postgres => "postgres",
                        BackendName::Sqlite => "sqlite",
                    }
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
    if let Some(docs) = docs {
        std::fs::write(docs.join("batch.svg"), &plot)?;
    }
    Ok(())
}

/// The batch curve: messages per second (log scale) against the batch size, one line per
/// backend and task count, the single-message generated handler first.
fn batch_svg(series: &[(String, Vec<f64>)]) -> String {
    const COLORS: [&str; 4] = ["#1f77b4", "#aec7e8", "#2ca02c", "#98df8a"];
    let labels = ["single", "1", "10", "100", "1,000"];
    let (left, top, width, height) = (70.0, 50.0, 560.0, 300.0);
    let values = series.iter().flat_map(|(_, rates)| rates.iter().copied());
    let (low, high) = values.fold((f64::MAX, 1.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (low, high) = (
        10f64.powf(low.max(1.0).log10().floor()),
        10f64.powf(high.log10().ceil()),
    );
    let x = |k: usize| left + width * k as f64 / (labels.len() - 1) as f64;
    let y =
        |v: f64| top + height - (v.log10() - low.log10()) / (high.log10() - low.log10()) * height;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">dedup batches: \
         messages per second by batch size (log scale; median of the rounds)</text>\n",
        w = left + width + 190.0,
        h = top + height + 50.0,
    );
    let mut decade = low;
    while decade <= high * 1.001 {
        let line_y = y(decade);
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{line_y:.1}\" y2=\"{line_y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">{}</text>",
            left + width,
            left - 4.0,
            line_y + 4.0,
            thousands(decade as i64)
        );
        decade *= 10.0;
    }
    for (k, label) in labels.iter().enumerate() {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
            x(k),
            top + height + 20.0
        );
    }
    for (n, (name, rates)) in series.iter().enumerate() {
        let color = COLORS[n % COLORS.len()];
        let points: Vec<String> = rates
            .iter()
            .enumerate()
            .map(|(k, rate)| format!("{:.1},{:.1}", x(k), y(*rate)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>",
            points.join(" ")
        );
        for (k, rate) in rates.iter().enumerate() {
            let _ = writeln!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{color}\"><title>{name}, {}: {rate:.0}/s</title></circle>",
                x(k),
                y(*rate),
                labels[k]
            );
        }
        let ly = top + 16.0 * n as f64;
        let _ = writeln!(
            out,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{name}</text>",
            left + width + 20.0,
            ly - 10.0,
            left + width + 36.0,
            ly
        );
    }
    out.push_str("</svg>\n");
    out
}

fn print_outbox(samples: &[OutboxSample]) {
    println!(
        "\nthe outbox: medians over the rounds (call by call: the rate of the handler with one \
         enqueue over that of the same handler without it)"
    );
    for backend in [BackendName::Postgres, BackendName::Sqlite] {
        let mine: Vec<&OutboxSample> = samples.iter().filter(|s| s.backend == backend).collect();
        if mine.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&OutboxSample) -> f64| median(mine.iter().map(|s| f(s)).collect());
        println!(
            "{:<10}  one enqueue, rate with / without: 1 task {:.3}, 4 tasks {:.3}; \
             one relay (no broker) {:.0} rows/s",
            backend.name(),
            med(&|s| s.cost[0]),
            med(&|s| s.cost[1]),
            med(&|s| s.relay)
        );
        if mine.iter().all(|s| s.brokers.is_some()) {
            let rate = |k: usize| med(&|s| s.brokers.map_or(0.0, |rates| rates[k]));
            let ratio = |k: usize| med(&|s| s.brokers.map_or(0.0, |rates| rates[k]) / s.relay);
            println!(
                "{:<10}  one relay publishing: to RabbitMQ {:.0} rows/s ({:.3} of no broker), \
                 to JetStream {:.0} rows/s ({:.3})",
                backend.name(),
                rate(0),
                ratio(0),
                rate(1),
                ratio(1)
            );
        }
    }
}

/// Statements per call of each variant (after a first call has prepared them), counted
/// from sqlx's own per-statement events.
async fn statements_per_call<T: Target>(
    pool: &Pool<T::Db>,
    smoke: bool,
    seed: &mut u64,
    seen: impl AsyncFn(&[String]) -> Result<(), sqlx::Error>,
) -> Result<Vec<(Variant, u64)>, Error> {
    let mut counts = Vec::new();
    for variant in Variant::ALL {
        if variant == Variant::Pgbench {
            continue;
        }
        let ids = random_ids(2, seed);
        if variant == Variant::Duplicate {
            seen(&ids).await?;
        }
        T::call(pool, variant, smoke, &ids[0]).await?;
        counting(true);
        let before = STATEMENTS.load(Ordering::SeqCst);
        let result = T::call(pool, variant, smoke, &ids[1]).await;
        let statements = STATEMENTS.load(Ordering::SeqCst) - before;
        counting(false);
        result?;
        counts.push((variant, statements));
    }
    Ok(counts)
}

/// The pruning figure of one backend.
struct PruneFigure {
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

/// Prunes the `config.prune_rows` old ids `fill` put into `dedup_bench_prune` while
/// [`PRUNE_CONSUMERS`] tasks run the generated handler on fresh ids; measures the
/// consumers for `config.prune_baseline` first.
async fn measure_prune<T: Target>(
    backend: BackendName,
    pool: &Pool<T::Db>,
    config: &Config,
    seed: &mut u64,
) -> Result<PruneFigure, Error> {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
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
                    if !T::consume(&pool, &format!("{run}-{task}-{n}")).await? {
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

/// The hand-written transaction through pgbench; its own tps (connections excluded).
fn pgbench(url: &str, script: &Path, tasks: usize, ops: usize) -> Result<f64, Error> {
    let output = std::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-f"])
        .arg(script)
        .args(["-c", &tasks.to_string(), "-j", &tasks.min(2).to_string()])
        .args(["-t", &(ops / tasks).to_string()])
        .arg(url)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "pgbench failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
        .ok_or_else(|| format!("no tps in pgbench's output: {stdout}").into())
}

/// The hand-written transaction as a pgbench script. pgbench cannot branch on the claim's
/// row count without changing the statement; every id is new, so every claim succeeds
/// and the script is the processing path as sent.
const PGBENCH_SCRIPT: &str = "\
\\set r random(1, 9223372036854775806)
BEGIN;
INSERT INTO dedup_bench (consumer, message_id) VALUES ('bench', md5(:client_id || '-' || :r)) ON CONFLICT DO NOTHING;
INSERT INTO dedup_bench_effects (message_id) VALUES (md5(:client_id || '-' || :r));
COMMIT;
";

// ---------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------

/// Runs `statements` one by one on one connection (PostgreSQL runs a multi-statement
/// string as one transaction, where `VACUUM` is not allowed).
async fn execute<DB: sqlx::Database>(
    pool: &Pool<DB>,
    statements: &[&str],
) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let mut conn = pool.acquire().await?;
    for statement in statements {
        sqlx::raw_sql(AssertSqlSafe(statement.to_string()))
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

async fn postgres_setup(pool: &Pool<sqlx::Postgres>, config: &Config) -> Result<(), Error> {
    dedup_runtime::migrate_table(pool, "dedup_bench").await?;
    execute(
        pool,
        &[
            "CREATE TABLE IF NOT EXISTS dedup_bench_effects (message_id text NOT NULL)",
            "CREATE TABLE IF NOT EXISTS dedup_bench_meta \
             (name text PRIMARY KEY, rows bigint NOT NULL)",
        ],
    )
    .await?;
    let big = config.big_table();
    let filled: Option<i64> =
        sqlx::query_scalar("SELECT rows FROM dedup_bench_meta WHERE name = $1")
            .bind(big)
            .fetch_optional(pool)
            .await?;
    if filled == Some(config.big_rows) {
        // The ids a previous run added are the ones newer than the fill's.
        let delete = format!("DELETE FROM {big} WHERE processed_at >= '2021-01-01'");
        let vacuum = format!("VACUUM ANALYZE {big}");
        execute(pool, &[&delete, &vacuum]).await?;
        return Ok(());
    }
    eprintln!(
        "PostgreSQL: filling {big} with {} rows (once)…",
        config.big_rows
    );
    let began = Instant::now();
    execute(pool, &[&format!("DROP TABLE IF EXISTS {big}")]).await?;
    dedup_runtime::migrate_table(pool, big).await?;
    // Bulk load, then build the indexes the migration made by sorting: an order of
    // magnitude faster than inserting into them row by row. Ends with the same schema.
    let rows = config.big_rows;
    let statements = [
        "SET maintenance_work_mem = '1GB'".to_owned(),
        format!("ALTER TABLE {big} DROP CONSTRAINT {big}_pkey"),
        format!("DROP INDEX {big}_processed_at_idx"),
        format!(
            "INSERT INTO {big} (consumer, message_id, processed_at) \
             SELECT 'bench', md5(i::text), \
                    timestamptz '2020-01-01 00:00:00+00' + (i % 604800) * interval '1 second' \
             FROM generate_series(1, {rows}) i"
        ),
        format!("ALTER TABLE {big} ADD PRIMARY KEY (consumer, message_id)"),
        format!("CREATE INDEX {big}_processed_at_idx ON {big} (processed_at)"),
        "RESET maintenance_work_mem".to_owned(),
        format!("VACUUM ANALYZE {big}"),
        format!(
            "INSERT INTO dedup_bench_meta (name, rows) VALUES ('{big}', {rows}) \
             ON CONFLICT (name) DO UPDATE SET rows = excluded.rows"
        ),
    ];
    let statements: Vec<&str> = statements.iter().map(String::as_str).collect();
    execute(pool, &statements).await?;
    eprintln!("PostgreSQL: filled {big} in {:.0?}", began.elapsed());
    Ok(())
}

async fn sqlite_setup(pool: &Pool<sqlx::Sqlite>, config: &Config) -> Result<(), Error> {
    dedup_runtime::migrate_table(pool, "dedup_bench").await?;
    execute(
        pool,
        &[
            "CREATE TABLE IF NOT EXISTS dedup_bench_effects (message_id TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS dedup_bench_meta \
             (name TEXT PRIMARY KEY, rows INTEGER NOT NULL)",
        ],
    )
    .await?;
    let big = config.big_table();
    let filled: Option<i64> =
        sqlx::query_scalar("SELECT rows FROM dedup_bench_meta WHERE name = ?1")
            .bind(big)
            .fetch_optional(pool)
            .await?;
    if filled == Some(config.big_rows) {
        let delete = format!("DELETE FROM {big} WHERE processed_at >= '2021-01-01'");
        execute(pool, &[&delete, "PRAGMA wal_checkpoint(TRUNCATE)"]).await?;
        return Ok(());
    }
    eprintln!(
        "SQLite: filling {big} with {} rows (once)…",
        config.big_rows
    );
    let began = Instant::now();
    execute(pool, &[&format!("DROP TABLE IF EXISTS {big}")]).await?;
    dedup_runtime::migrate_table(pool, big).await?;
    // Rows in key order into the table, then the processed_at index by sorting.
    let rows = config.big_rows;
    let statements = [
        "PRAGMA cache_size = -1000000".to_owned(),
        format!("DROP INDEX {big}_processed_at_idx"),
        "BEGIN IMMEDIATE".to_owned(),
        format!(
            "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {rows}) \
             INSERT INTO {big} (consumer, message_id, processed_at) \
             SELECT 'bench', id, at FROM ( \
               SELECT lower(hex(randomblob(16))) AS id, \
                      strftime('%Y-%m-%dT%H:%M:%fZ', '2020-01-01', \
                               '+' || (i % 604800) || ' seconds') AS at \
               FROM s) \
             ORDER BY id"
        ),
        format!("CREATE INDEX {big}_processed_at_idx ON {big} (processed_at)"),
        format!(
            "INSERT INTO dedup_bench_meta (name, rows) VALUES ('{big}', {rows}) \
             ON CONFLICT (name) DO UPDATE SET rows = excluded.rows"
        ),
        "COMMIT".to_owned(),
        "PRAGMA cache_size = -2000".to_owned(),
        "PRAGMA wal_checkpoint(TRUNCATE)".to_owned(),
    ];
    let statements: Vec<&str> = statements.iter().map(String::as_str).collect();
    execute(pool, &statements).await?;
    eprintln!("SQLite: filled {big} in {:.0?}", began.elapsed());
    Ok(())
}

/// A fresh `dedup_bench_prune` holding `rows` ids aged 3 days and up, one a second apart.
async fn postgres_prune_setup(pool: &Pool<sqlx::Postgres>, rows: i64) -> Result<(), Error> {
    execute(pool, &["DROP TABLE IF EXISTS dedup_bench_prune"]).await?;
    dedup_runtime::migrate_table(pool, "dedup_bench_prune").await?;
    let fill = format!(
        "INSERT INTO dedup_bench_prune (consumer, message_id, processed_at) \
         SELECT 'bench-prune', md5(i::text), now() - interval '3 days' - i * interval '1 second' \
         FROM generate_series(1, {rows}) i"
    );
    execute(pool, &[&fill, "VACUUM ANALYZE dedup_bench_prune"]).await?;
    Ok(())
}

async fn sqlite_prune_setup(pool: &Pool<sqlx::Sqlite>, rows: i64) -> Result<(), Error> {
    execute(pool, &["DROP TABLE IF EXISTS dedup_bench_prune"]).await?;
    dedup_runtime::migrate_table(pool, "dedup_bench_prune").await?;
    let fill = format!(
        "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {rows}) \
         INSERT INTO dedup_bench_prune (consumer, message_id, processed_at) \
         SELECT 'bench-prune', lower(hex(randomblob(16))), \
                strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (259200 + i) || ' seconds') \
         FROM s"
    );
    execute(pool, &[&fill, "PRAGMA wal_checkpoint(TRUNCATE)"]).await?;
    Ok(())
}

/// Empties the small tables, so that every (round, tasks) block starts alike.
async fn postgres_reset(pool: &Pool<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    execute(pool, &["TRUNCATE dedup_bench, dedup_bench_effects"]).await
}

async fn sqlite_reset(pool: &Pool<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
    execute(
        pool,
        &[
            "DELETE FROM dedup_bench",
            "DELETE FROM dedup_bench_effects",
            "PRAGMA wal_checkpoint(TRUNCATE)",
        ],
    )
    .await
}

/// Records `ids` as processed by the generated handler's consumer, untimed, so that the
/// duplicate run finds every one of them.
async fn postgres_seen(pool: &Pool<sqlx::Postgres>, ids: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO dedup_bench (consumer, message_id) SELECT 'bench', unnest($1::text[])",
    )
    .bind(ids)
    .execute(pool)
    .await?;
    Ok(())
}

async fn sqlite_seen(pool: &Pool<sqlx::Sqlite>, ids: &[String]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    for id in ids {
        sqlx::query("INSERT INTO dedup_bench (consumer, message_id) VALUES ('bench', ?1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

// ---------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------

/// `10000000` → `10,000,000`.
fn thousands(n: i64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

type Key = (BackendName, usize, Variant);

struct Summary {
    rate: BTreeMap<Key, f64>,
    allocations: BTreeMap<Key, f64>,
    /// Per (backend, tasks, pair): the median over rounds of the call-by-call ratio.
    pair_ratio: BTreeMap<(BackendName, usize, usize), f64>,
}

impl Summary {
    fn new(samples: &[Sample], pair_samples: &[PairSample]) -> Summary {
        let mut pair_ratios: BTreeMap<(BackendName, usize, usize), Vec<f64>> = BTreeMap::new();
        for sample in pair_samples {
            pair_ratios
                .entry((sample.backend, sample.tasks, sample.pair))
                .or_default()
                .push(sample.ratio());
        }
        let mut rates: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
        let mut allocations: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
        for sample in samples {
            let key = (sample.backend, sample.tasks, sample.variant);
            rates.entry(key).or_default().push(sample.rate());
            if let Some(per_call) = sample.allocations {
                allocations.entry(key).or_default().push(per_call);
            }
        }
        Summary {
            rate: rates.into_iter().map(|(k, v)| (k, median(v))).collect(),
            allocations: allocations
                .into_iter()
                .map(|(k, v)| (k, median(v)))
                .collect(),
            pair_ratio: pair_ratios
                .into_iter()
                .map(|(k, v)| (k, median(v)))
                .collect(),
        }
    }

    fn ratio(&self, backend: BackendName, tasks: usize, a: Variant, b: Variant) -> Option<f64> {
        Some(self.rate.get(&(backend, tasks, a))? / self.rate.get(&(backend, tasks, b))?)
    }
}

fn write_csv(dir: &Path, samples: &[Sample], summary: &Summary) -> std::io::Result<()> {
    let mut raw = String::from(
        "backend,tasks,variant,round,calls,seconds,calls_per_second,allocations_per_call\n",
    );
    for s in samples {
        let _ = writeln!(
            raw,
            "{},{},{},{},{},{:.6},{:.1},{}",
            s.backend.name(),
            s.tasks,
            s.variant.name(),
            s.round,
            s.ops,
            s.seconds,
            s.rate(),
            s.allocations
                .map_or_else(String::new, |a| format!("{a:.1}"))
        );
    }
    std::fs::write(dir.join("results.csv"), raw)?;
    let mut table = String::from(
        "backend,tasks,variant,median_calls_per_second,median_allocations_per_call,ratio_to_hand_written,ratio_to_generated\n",
    );
    for (&(backend, tasks, variant), rate) in &summary.rate {
        let ratio = |of| {
            summary
                .ratio(backend, tasks, variant, of)
                .map_or_else(String::new, |r| format!("{r:.3}"))
        };
        let _ = writeln!(
            table,
            "{},{tasks},{},{rate:.1},{},{},{}",
            backend.name(),
            variant.name(),
            summary
                .allocations
                .get(&(backend, tasks, variant))
                .map_or_else(String::new, |a| format!("{a:.1}")),
            ratio(Variant::Handwritten),
            ratio(Variant::Generated),
        );
    }
    std::fs::write(dir.join("summary.csv"), table)
}

/// The pruning figures: the prune's rate and what it left the consumers.
fn print_prune(prunes: &[PruneFigure]) {
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

fn print_report(summary: &Summary, config: &Config, backends: &[BackendName]) {
    println!(
        "\nmedians over {} round(s) of {} calls; calls per second (allocations per call)",
        config.rounds, config.ops
    );
    for &backend in backends {
        println!("\n{}", backend.name());
        print!("  {:<14}", "tasks");
        for tasks in TASKS {
            print!("{tasks:>22}");
        }
        println!();
        for variant in Variant::ALL {
            if !TASKS
                .iter()
                .any(|&tasks| summary.rate.contains_key(&(backend, tasks, variant)))
            {
                continue;
            }
            print!("  {:<14}", variant.name());
            for tasks in TASKS {
                let key = (backend, tasks, variant);
                let cell = match (summary.rate.get(&key), summary.allocations.get(&key)) {
                    (Some(rate), Some(allocs)) => format!("{rate:.0} ({allocs:.0})"),
                    (Some(rate), None) => format!("{rate:.0}"),
                    _ => "-".to_owned(),
                };
                print!("{cell:>22}");
            }
            println!();
        }
        let ratios = [
            (
                "generated / hand-written",
                Variant::Generated,
                Variant::Handwritten,
            ),
            (
                "duplicate / processing",
                Variant::Duplicate,
                Variant::Generated,
            ),
            ("10M rows / empty", Variant::Big, Variant::Generated),
            ("bare / generated", Variant::Bare, Variant::Generated),
            (
                "pgbench / hand-written",
                Variant::Pgbench,
                Variant::Handwritten,
            ),
        ];
        println!("  ratios of the runs' medians (calls per second), by tasks:");
        for (label, a, b) in ratios {
            if summary.ratio(backend, 1, a, b).is_none() {
                continue;
            }
            print!("    {label:<26}");
            for tasks in TASKS {
                match summary.ratio(backend, tasks, a, b) {
                    Some(r) => print!("{:>10}", format!("{tasks}: {r:.3}")),
                    None => print!("{:>10}", "-"),
                }
            }
            println!();
        }
        println!("  ratios call by call (median latency of b / of a; median over rounds):");
        for (pair, (_, _, label)) in PAIRS.iter().enumerate() {
            print!("    {label:<26}");
            for tasks in TASKS {
                match summary.pair_ratio.get(&(backend, tasks, pair)) {
                    Some(r) => print!("{:>10}", format!("{tasks}: {r:.3}")),
                    None => print!("{:>10}", "-"),
                }
            }
            println!();
        }
    }
}

/// Grouped bars, one panel per backend: calls per second by tasks and variant, with the
/// the three call-by-call ratios written under each group.
fn svg(summary: &Summary, config: &Config, backends: &[BackendName]) -> String {
    const PANEL_W: f64 = 560.0;
    const PANEL_H: f64 = 300.0;
    const LEFT: f64 = 70.0;
    const TOP: f64 = 70.0;
    const COLORS: [&str; 6] = [
        "#1f77b4", "#aec7e8", "#7f7f7f", "#2ca02c", "#ff7f0e", "#9467bd",
    ];
    let width = LEFT + PANEL_W * backends.len() as f64 + 20.0;
    let height = TOP + PANEL_H + 90.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">dedup: calls per second \
         (median of {} rounds of {} calls; higher is better)</text>\n\
         <text x=\"{LEFT}\" y=\"44\" fill=\"#555\">under each group, timed call by call: \
         generated / hand-written · duplicate / processing · 10M rows / empty \
         (10M rows: a dedup table of {} ids)</text>\n",
        config.rounds,
        config.ops,
        thousands(config.big_rows)
    );
    for (index, &backend) in backends.iter().enumerate() {
        let x0 = LEFT + PANEL_W * index as f64;
        let variants: Vec<Variant> = Variant::ALL
            .into_iter()
            .filter(|&v| {
                TASKS
                    .iter()
                    .any(|&t| summary.rate.contains_key(&(backend, t, v)))
            })
            .collect();
        let top = TASKS
            .iter()
            .flat_map(|&t| {
                variants
                    .iter()
                    .filter_map(move |&v| summary.rate.get(&(backend, t, v)))
            })
            .fold(1.0_f64, |a, &b| a.max(b));
        // A round axis maximum: 1, 2 or 5 times a power of ten.
        let magnitude = 10f64.powf(top.log10().floor());
        let axis_max = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
            .iter()
            .map(|m| m * magnitude)
            .find(|&m| m >= top)
            .unwrap_or(top);
        let plot_w = PANEL_W - 40.0;
        let y = |value: f64| TOP + PANEL_H - value / axis_max * PANEL_H;
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"14\" font-weight=\"bold\">{}</text>",
            x0,
            TOP - 8.0,
            backend.name()
        );
        for step in 0..=5 {
            let value = axis_max * f64::from(step) / 5.0;
            let (line_y, label_x) = (y(value), x0 - 4.0);
            let _ = writeln!(
                out,
                "<line x1=\"{x0:.1}\" x2=\"{x1:.1}\" y1=\"{line_y:.1}\" y2=\"{line_y:.1}\" \
                 stroke=\"#ddd\"/><text x=\"{label_x:.1}\" y=\"{label_y:.1}\" \
                 text-anchor=\"end\" fill=\"#555\">{label}</text>",
                x1 = x0 + plot_w,
                label_y = line_y + 4.0,
                label = value.round()
            );
        }
        let group_w = plot_w / TASKS.len() as f64;
        let bar_w = (group_w - 20.0) / variants.len().max(1) as f64;
        for (g, &tasks) in TASKS.iter().enumerate() {
            let gx = x0 + group_w * g as f64 + 10.0;
            for (b, &variant) in variants.iter().enumerate() {
                let Some(&rate) = summary.rate.get(&(backend, tasks, variant)) else {
                    continue;
                };
                let color = COLORS[Variant::ALL.iter().position(|&v| v == variant).unwrap_or(0)];
                let _ = writeln!(
                    out,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\">\
                     <title>{} {} tasks: {rate:.0}/s</title></rect>",
                    gx + bar_w * b as f64,
                    y(rate),
                    bar_w - 2.0,
                    TOP + PANEL_H - y(rate),
                    variant.name(),
                    tasks
                );
            }
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{tasks} task{}</text>",
                gx + (group_w - 20.0) / 2.0,
                TOP + PANEL_H + 18.0,
                if tasks == 1 { "" } else { "s" }
            );
            let ratios: Vec<String> = (0..PAIRS.len())
                .map(|pair| {
                    summary
                        .pair_ratio
                        .get(&(backend, tasks, pair))
                        // Three decimals where the question is "1.00 or not".
                        .map_or_else(
                            || "-".to_owned(),
                            |ratio| {
                                if pair == 0 {
                                    format!("{ratio:.3}×")
                                } else {
                                    format!("{ratio:.2}×")
                                }
                            },
                        )
                })
                .collect();
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#333\">{}</text>",
                gx + (group_w - 20.0) / 2.0,
                TOP + PANEL_H + 34.0,
                ratios.join(" · ")
            );
        }
    }
    // Legend.
    let mut lx = LEFT;
    let ly = TOP + PANEL_H + 60.0;
    for (variant, color) in Variant::ALL.iter().zip(COLORS) {
        let _ = writeln!(
            out,
            "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            ly - 10.0,
            lx + 16.0,
            ly,
            variant.name()
        );
        lx += 30.0 + 7.0 * variant.name().len() as f64;
    }
    out.push_str("</svg>\n");
    out
}

// ---------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------

async fn run(
    config: Config,
    batch_only: bool,
    relay_only: bool,
    inbox_only: bool,
) -> Result<(), Error> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = manifest.join("target/dedup-bench");
    std::fs::create_dir_all(&dir)?;
    let began = Instant::now();

    let pg_url = dedup_suite::postgres_url();
    let pg = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(60))
        .connect(&pg_url)
        .await
        .map_err(|error| format!("PostgreSQL at {pg_url}: {error}"))?;
    let sqlite_path: PathBuf = dir.join("sqlite.db");
    let lite = SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&sqlite_path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(60)),
        )
        .await?;
    // `cargo bench --bench dedup -- inbox`: the inbox workers' group alone (and, tiny, in
    // the smoke run).
    if inbox_only || config.smoke {
        let (rounds, messages) = if config.smoke {
            (1, 200)
        } else {
            (relay_rounds(), 4_000)
        };
        inbox::run(&pg, &dir, rounds, messages).await?;
        if inbox_only {
            return Ok(());
        }
    }
    // `cargo bench --bench dedup -- relay`: the relay group alone (and, tiny, in the
    // smoke run, below).
    if relay_only || config.smoke {
        let mysql_url = dedup_suite::mysql_url();
        let maria = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .connect(&mysql_url)
            .await
            .map_err(|error| format!("MariaDB at {mysql_url}: {error}"))?;
        let (rounds, rows) = if config.smoke {
            (1, 200)
        } else {
            (relay_rounds(), 5_000)
        };
        relay::run(&pg, &lite, &maria, &dir, rounds, rows).await?;
        if relay_only {
            return Ok(());
        }
    }

    postgres_setup(&pg, &config).await?;
    sqlite_setup(&lite, &config).await?;
    dedup_runtime::inbox::migrate_table(&pg, INBOX_TABLE).await?;
    dedup_runtime::inbox::migrate_table(&lite, INBOX_TABLE).await?;
    dedup_runtime::outbox::migrate_table(&pg, OUTBOX_TABLE).await?;
    dedup_runtime::outbox::migrate_table(&lite, OUTBOX_TABLE).await?;

    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |elapsed| elapsed.as_nanos() as u64)
        | 1;

    // `cargo bench --bench dedup -- batch`: the batch group alone.
    if batch_only {
        let mut samples = Vec::new();
        for round in 0..config.rounds {
            eprintln!("round {}/{} batches", round + 1, config.rounds);
            samples.extend(
                measure_batches::<Postgres>(BackendName::Postgres, &pg, &config, round, &mut seed)
                    .await?,
            );
            samples.extend(
                measure_batches::<Sqlite>(BackendName::Sqlite, &lite, &config, round, &mut seed)
                    .await?,
            );
        }
        let docs = manifest.join("docs");
        print_batches(
            &samples,
            &[],
            &dir,
            (!config.smoke).then_some(docs.as_path()),
        )?;
        println!("\nwritten: {}", dir.join("batch.csv").display());
        return Ok(());
    }

    // Statements (round trips) per call, counted once, untimed.
    let _ = tracing::subscriber::set_global_default(StatementCounter);
    counting(false);
    let mut statements = Vec::new();
    for (backend, counts) in [
        (
            BackendName::Postgres,
            statements_per_call::<Postgres>(&pg, config.smoke, &mut seed, async |ids| {
                postgres_seen(&pg, ids).await
            })
            .await?,
        ),
        (
            BackendName::Sqlite,
            statements_per_call::<Sqlite>(&lite, config.smoke, &mut seed, async |ids| {
                sqlite_seen(&lite, ids).await
            })
            .await?,
        ),
    ] {
        for (variant, count) in counts {
            statements.push((backend, variant, count));
        }
    }

    let script = dir.join("pgbench.sql");
    std::fs::write(&script, PGBENCH_SCRIPT)?;
    let have_pgbench = std::process::Command::new("pgbench")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if !have_pgbench {
        eprintln!("pgbench is not installed: no reference client run");
    }

    let mut samples = Vec::new();
    let mut pair_samples = Vec::new();
    let mut inbox_samples = Vec::new();
    let mut outbox_samples = Vec::new();
    let mut batch_samples = Vec::new();
    #[cfg(feature = "brokers")]
    let brokers = Brokers::connect().await?;
    for round in 0..config.rounds {
        for backend in [BackendName::Postgres, BackendName::Sqlite] {
            // The inbox's figures, interleaved with the handlers' in every round.
            eprintln!(
                "round {}/{} {:<10} the inbox",
                round + 1,
                config.rounds,
                backend.name()
            );
            inbox_samples.push(match backend {
                BackendName::Postgres => {
                    measure_inbox::<Postgres>(backend, &pg, &config, &mut seed).await?
                }
                BackendName::Sqlite => {
                    measure_inbox::<Sqlite>(backend, &lite, &config, &mut seed).await?
                }
            });
            outbox_samples.push(match backend {
                BackendName::Postgres => {
                    measure_outbox::<Postgres>(
                        backend,
                        &pg,
                        &config,
                        &mut seed,
                        #[cfg(feature = "brokers")]
                        &brokers,
                    )
                    .await?
                }
                BackendName::Sqlite => {
                    measure_outbox::<Sqlite>(
                        backend,
                        &lite,
                        &config,
                        &mut seed,
                        #[cfg(feature = "brokers")]
                        &brokers,
                    )
                    .await?
                }
            });
            batch_samples.extend(match backend {
                BackendName::Postgres => {
                    measure_batches::<Postgres>(backend, &pg, &config, round, &mut seed).await?
                }
                BackendName::Sqlite => {
                    measure_batches::<Sqlite>(backend, &lite, &config, round, &mut seed).await?
                }
            });
            for tasks in TASKS {
                match backend {
                    BackendName::Postgres => postgres_reset(&pg).await?,
                    BackendName::Sqlite => sqlite_reset(&lite).await?,
                }
                // Each round starts the rotation one variant further.
                let mut order: Vec<Variant> = Variant::ALL
                    .into_iter()
                    .filter(|&v| {
                        v != Variant::Pgbench || (backend == BackendName::Postgres && have_pgbench)
                    })
                    .collect();
                let shift = (round + tasks) % order.len();
                order.rotate_left(shift);
                for variant in order {
                    let ids = Arc::new(random_ids(config.ops, &mut seed));
                    if variant == Variant::Duplicate {
                        match backend {
                            BackendName::Postgres => postgres_seen(&pg, &ids).await?,
                            BackendName::Sqlite => sqlite_seen(&lite, &ids).await?,
                        }
                    }
                    let (seconds, allocations) = match (backend, variant) {
                        (BackendName::Postgres, Variant::Pgbench) => {
                            let (url, script, ops) = (pg_url.clone(), script.clone(), config.ops);
                            let tps = tokio::task::spawn_blocking(move || {
                                pgbench(&url, &script, tasks, ops)
                            })
                            .await??;
                            (config.ops as f64 / tps, None)
                        }
                        (BackendName::Postgres, _) => {
                            let (s, a) =
                                measure::<Postgres>(&pg, variant, tasks, config.smoke, ids).await?;
                            (s, Some(a))
                        }
                        (BackendName::Sqlite, _) => {
                            let (s, a) =
                                measure::<Sqlite>(&lite, variant, tasks, config.smoke, ids).await?;
                            (s, Some(a))
                        }
                    };
                    let sample = Sample {
                        backend,
                        tasks,
                        variant,
                        round,
                        ops: config.ops / tasks * tasks,
                        seconds,
                        allocations,
                    };
                    eprintln!(
                        "round {}/{} {:<10} {tasks} task(s) {:<12} {:>8.0} calls/s",
                        round + 1,
                        config.rounds,
                        backend.name(),
                        variant.name(),
                        sample.rate()
                    );
                    samples.push(sample);
                }
                let mut pairs: Vec<usize> = (0..PAIRS.len()).collect();
                pairs.rotate_left((round + tasks) % PAIRS.len());
                for pair in pairs {
                    let (a, b, label) = PAIRS[pair];
                    let ids_a = Arc::new(random_ids(config.ops / 2, &mut seed));
                    let ids_b = Arc::new(random_ids(config.ops / 2, &mut seed));
                    if a == Variant::Duplicate {
                        match backend {
                            BackendName::Postgres => postgres_seen(&pg, &ids_a).await?,
                            BackendName::Sqlite => sqlite_seen(&lite, &ids_a).await?,
                        }
                    }
                    let ids = (ids_a, ids_b);
                    let (lat_a, lat_b) = match backend {
                        BackendName::Postgres => {
                            measure_pair::<Postgres>(&pg, (a, b), tasks, config.smoke, ids).await?
                        }
                        BackendName::Sqlite => {
                            measure_pair::<Sqlite>(&lite, (a, b), tasks, config.smoke, ids).await?
                        }
                    };
                    let sample = PairSample {
                        backend,
                        tasks,
                        round,
                        pair,
                        a: lat_a,
                        b: lat_b,
                    };
                    eprintln!(
                        "round {}/{} {:<10} {tasks} task(s) {label:<26} {:>6.3} (call by call)",
                        round + 1,
                        config.rounds,
                        backend.name(),
                        sample.ratio()
                    );
                    pair_samples.push(sample);
                }
            }
        }
    }

    // Pruning, once per backend, after the rounds: it disturbs what runs beside it.
    let mut prunes = Vec::new();
    for backend in [BackendName::Postgres, BackendName::Sqlite] {
        let figure = match backend {
            BackendName::Postgres => {
                postgres_prune_setup(&pg, config.prune_rows).await?;
                measure_prune::<Postgres>(backend, &pg, &config, &mut seed).await?
            }
            BackendName::Sqlite => {
                sqlite_prune_setup(&lite, config.prune_rows).await?;
                measure_prune::<Sqlite>(backend, &lite, &config, &mut seed).await?
            }
        };
        eprintln!(
            "{:<10} pruned {} ids in {:.2?} while {PRUNE_CONSUMERS} tasks consumed",
            backend.name(),
            figure.done.deleted,
            figure.done.elapsed
        );
        prunes.push(figure);
    }

    let backends = [BackendName::Postgres, BackendName::Sqlite];
    let summary = Summary::new(&samples, &pair_samples);
    write_csv(&dir, &samples, &summary)?;
    let mut table = String::from("backend,variant,logged_queries_per_call\n");
    for (backend, variant, count) in &statements {
        let _ = writeln!(table, "{},{},{count}", backend.name(), variant.name());
    }
    std::fs::write(dir.join("statements.csv"), table)?;
    let mut table = String::from(
        "backend,tasks,pair,round,calls_each,median_latency_a_us,median_latency_b_us,ratio\n",
    );
    for sample in &pair_samples {
        let _ = writeln!(
            table,
            "{},{},{},{},{},{:.1},{:.1},{:.4}",
            sample.backend.name(),
            sample.tasks,
            PAIRS[sample.pair].2,
            sample.round,
            sample.a.len(),
            median(sample.a.clone()),
            median(sample.b.clone()),
            sample.ratio()
        );
    }
    std::fs::write(dir.join("pairs.csv"), table)?;
    let mut table = String::from(
        "backend,old_ids,deleted,batches,seconds,ids_per_second,\
         consumer_calls_per_second_before,consumer_calls_per_second_during\n",
    );
    for figure in &prunes {
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
    std::fs::write(dir.join("prune.csv"), table)?;
    let plot = svg(&summary, &config, &backends);
    std::fs::write(dir.join("bench.svg"), &plot)?;
    if !config.smoke {
        std::fs::create_dir_all(manifest.join("docs"))?;
        std::fs::write(manifest.join("docs/bench.svg"), &plot)?;
    }
    print_report(&summary, &config, &backends);
    print_inbox(&inbox_samples, &summary);
    print_outbox(&outbox_samples);
    let pgbench: Vec<(usize, f64)> = BATCH_TASKS
        .into_iter()
        .filter_map(|tasks| {
            let rate = summary
                .rate
                .get(&(BackendName::Postgres, tasks, Variant::Pgbench))?;
            Some((tasks, *rate))
        })
        .collect();
    let docs = manifest.join("docs");
    print_batches(
        &batch_samples,
        &pgbench,
        &dir,
        (!config.smoke).then_some(docs.as_path()),
    )?;
    print_prune(&prunes);
    println!(
        "\nqueries per call, as sqlx logs them (its transaction manager sends BEGIN unlogged, \
         and on SQLite COMMIT / ROLLBACK too: the same for every variant):"
    );
    for backend in backends {
        let line: Vec<String> = statements
            .iter()
            .filter(|(b, ..)| *b == backend)
            .map(|(_, variant, count)| format!("{} {count}", variant.name()))
            .collect();
        println!("  {:<12}{}", backend.name(), line.join(", "));
    }
    println!(
        "\nwrote {}/results.csv, summary.csv, prune.csv and bench.svg{} in {:.0?}",
        dir.display(),
        if config.smoke {
            ""
        } else {
            " (and docs/bench.svg)"
        },
        began.elapsed()
    );
    Ok(())
}

/// The relay group's rounds: `DEDUP_BENCH_ROUNDS`, 8 by default.
fn relay_rounds() -> usize {
    std::env::var("DEDUP_BENCH_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(8)
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `batch` runs the batch group alone.
    let batch_only = std::env::args().skip(1).any(|arg| arg == "batch");
    let relay_only = std::env::args().skip(1).any(|arg| arg == "relay");
    let inbox_only = std::env::args().skip(1).any(|arg| arg == "inbox");
    let config = Config::from_env();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("dedup bench: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, batch_only, relay_only, inbox_only)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("dedup bench: {error}");
            ExitCode::FAILURE
        }
    }
}
