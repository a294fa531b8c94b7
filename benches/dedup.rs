//! What dedup costs, measured in one interleaved run on PostgreSQL and SQLite (and, in
//! the per-message group, MariaDB).
//!
//! ```text
//! cargo bench --bench dedup                      # the full run: about 12 minutes
//! cargo bench --bench dedup --features brokers    # the same, and the relay to the brokers
//! cargo bench --bench dedup -- batch              # the batch group alone (batch.csv)
//! cargo bench --bench dedup --features brokers -- relay  # the relay group alone (relay.csv;
//!                                                 # in the smoke run too, tiny: see dedup/relay.rs)
//! cargo bench --bench dedup -- inbox              # the inbox workers' group alone (inbox.csv;
//!                                                 # in the smoke run too, tiny: see dedup/inbox.rs)
//! cargo bench --bench dedup --features brokers -- consumers  # the hosted consumers against
//!                                                 # hand-written ones (consumers.csv; in the
//!                                                 # smoke run too, tiny: see dedup/consumers.rs)
//! cargo bench --bench dedup --features http -- http  # the Idempotency-Key layer against the
//!                                                 # endpoint by hand (http.csv; in the smoke
//!                                                 # run too, tiny: see dedup/http.rs)
//! cargo bench --bench dedup -- per_message        # the per-message group alone (per_message.csv;
//!                                                 # in the full and the smoke run too)
//! DEDUP_BENCH_ROUNDS=5 cargo bench --bench dedup  # the same with 5 rounds instead of 15
//!                                                 # (the groups of their own: instead of 8)
//! DEDUP_BENCH_SMOKE=1 cargo test --all-features --bench dedup  # CI smoke run: tiny sizes
//! ```
//!
//! The per-message group (alone with `-- per_message`; in the full run before the rounds,
//! 8 rounds of its own; in the smoke run at its tiny sizes): one consumer transaction per
//! message, the body one `INSERT`, every id new, at 1 and 4 tasks on PostgreSQL, SQLite
//! and MariaDB, interleaved in each round: the generated handler, the hand-written
//! transaction (the same statements with sqlx by hand; MariaDB's claim `INSERT IGNORE`),
//! and on PostgreSQL, when `pgbench` is installed, pgbench running the hand-written
//! transaction in its simple query mode (`-M simple`) and with prepared statements (`-M
//! prepared`). It prints each rate and the generated handler's ratio to the hand-written
//! transaction and to each pgbench mode; `target/dedup-bench/per_message.csv` has
//! `backend,tasks,generated_per_s,handwritten_per_s,pgbench_per_s,ratio_vs_handwritten,
//! ratio_vs_pgbench` (medians over the rounds and the ratios of those; `pgbench_per_s`
//! the better of the two modes, empty with its ratio where pgbench does not run). It
//! needs MariaDB: `DEDUP_TEST_MYSQL_URL` or `mysql://root@127.0.0.1:3306/test`, the
//! suite's; a server that cannot be reached fails the run.
//!
//! The batch group (in every round, or alone with `-- batch`): `dedup_runtime::batch` on
//! PostgreSQL and SQLite at 1 and 4 tasks, batches of 1, 10, 100 and 1,000 fresh
//! messages, the body one multi-row insert over them, against the single-message
//! generated handler at the same task count in the same round; and batches of 100 that are
//! all duplicates. `target/dedup-bench/batch.csv` has
//! `backend,tasks,batch,per_message_rate,ratio_vs_single` (medians over the rounds), and
//! the curve `batch.svg`, copied to `guide/src/images/batch.svg` (the guide's plot) by a
//! run that is not the smoke run.
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
//!   IMMEDIATE`), the claim a person writes, `INSERT … ON CONFLICT DO NOTHING` (MariaDB:
//!   `INSERT IGNORE`), the same body, `COMMIT` — on the same pool and table (on
//!   PostgreSQL the generated claim also stamps the claim's time, `clock_timestamp()`);
//! - `bare`: the body alone in a transaction, without dedup;
//! - `duplicate`: the generated handler on ids it has processed before (the path every
//!   redelivery takes: `BEGIN`, claim, on PostgreSQL the look at the row it found,
//!   `ROLLBACK`);
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
//! `statements.csv`, `prune.csv`, `per_message.csv`, and the plot `bench.svg`, copied to
//! `guide/src/images/bench.svg` (the guide's plot) by a full run. The
//! 10-million-row tables are kept between runs (`dedup_bench_10m` in the PostgreSQL
//! database, `target/dedup-bench/sqlite.db`); filling them takes about two minutes, once.
//!
//! PostgreSQL: `DEDUP_TEST_POSTGRES_URL` or `postgres://postgres@127.0.0.1:5432/test`;
//! MariaDB (the per-message and relay groups): `DEDUP_TEST_MYSQL_URL` or
//! `mysql://root@127.0.0.1:3306/test`.
//!
//! The code, one module per concern under `benches/dedup/`: `config.rs` (the variants, the
//! sizes of a run), `counting.rs` (allocations and statements), `target.rs` (the handlers
//! and statements, written once for every backend) with `postgres.rs`, `sqlite.rs` and
//! `mysql.rs` (what differs: their SQL), `timing.rs` (the timed and the call-by-call
//! runs), `inbox_round.rs`, `outbox.rs` and `brokers.rs`, `batches.rs`, `prune.rs`,
//! `consumers.rs` (the hosted consumers' group),
//! `pgbench.rs` (both query modes), `setup.rs`, `report.rs` (the tables and CSV files),
//! `svg.rs`, `run.rs` (the rounds); `inbox.rs`, `relay.rs` and `per_message.rs` are the
//! groups of their own.

use std::process::ExitCode;

#[path = "dedup/batches.rs"]
mod batches;
#[cfg(feature = "brokers")]
#[path = "dedup/brokers.rs"]
mod brokers;
#[path = "dedup/config.rs"]
mod config;
#[cfg(feature = "brokers")]
#[path = "dedup/consumers.rs"]
mod consumers;
#[path = "dedup/counting.rs"]
mod counting;
#[cfg(feature = "http")]
#[path = "dedup/http.rs"]
mod http;
#[path = "dedup/inbox.rs"]
mod inbox;
#[path = "dedup/inbox_round.rs"]
mod inbox_round;
#[path = "dedup/mysql.rs"]
mod mysql;
#[path = "dedup/outbox.rs"]
mod outbox;
#[path = "dedup/per_message.rs"]
mod per_message;
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
    // `batch`, `relay`, `inbox`, `per_message`, `consumers` or `http` runs that group alone.
    let only = run::Only::from_args();
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
    match runtime.block_on(run::run(config, only)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("dedup bench: {error}");
            ExitCode::FAILURE
        }
    }
}
