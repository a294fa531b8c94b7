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
//!
//! The code, one module per concern under `benches/dedup/`: `config.rs` (the variants, the
//! sizes of a run), `counting.rs` (allocations and statements), `target.rs` (the handlers
//! and statements, written once for both backends) with `postgres.rs` and `sqlite.rs`
//! (what differs: their SQL), `timing.rs` (the timed and the call-by-call runs),
//! `inbox_round.rs`, `outbox.rs` and `brokers.rs`, `batches.rs`, `prune.rs`,
//! `pgbench.rs`, `setup.rs`, `report.rs` (the tables and CSV files), `svg.rs`, `run.rs`
//! (the rounds); `inbox.rs` and `relay.rs` are the groups of their own.

use std::process::ExitCode;

#[path = "dedup/batches.rs"]
mod batches;
#[cfg(feature = "brokers")]
#[path = "dedup/brokers.rs"]
mod brokers;
#[path = "dedup/config.rs"]
mod config;
#[path = "dedup/counting.rs"]
mod counting;
#[path = "dedup/inbox.rs"]
mod inbox;
#[path = "dedup/inbox_round.rs"]
mod inbox_round;
#[path = "dedup/outbox.rs"]
mod outbox;
#[path = "dedup/pgbench.rs"]
mod pgbench;
#[path = "dedup/postgres.rs"]
mod postgres;
#[path = "dedup/prune.rs"]
mod prune;
#[path = "dedup/relay.rs"]
mod relay;
#[path = "dedup/report.rs"]
mod report;
#[path = "dedup/run.rs"]
mod run;
#[path = "dedup/setup.rs"]
mod setup;
#[path = "dedup/sqlite.rs"]
mod sqlite;
#[path = "dedup/svg.rs"]
mod svg;
#[path = "dedup/target.rs"]
mod target;
#[path = "dedup/timing.rs"]
mod timing;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `batch` runs the batch group alone.
    let batch_only = std::env::args().skip(1).any(|arg| arg == "batch");
    let relay_only = std::env::args().skip(1).any(|arg| arg == "relay");
    let inbox_only = std::env::args().skip(1).any(|arg| arg == "inbox");
    let config = config::Config::from_env();
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
    match runtime.block_on(run::run(config, batch_only, relay_only, inbox_only)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("dedup bench: {error}");
            ExitCode::FAILURE
        }
    }
}
