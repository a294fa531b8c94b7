//! The per-message group: `cargo bench --bench dedup -- per_message` (in the full run too,
//! and, tiny, in the smoke run). One consumer transaction per message, its body one
//! `INSERT` into `dedup_bench_effects`, every id new, at 1 and 4 tasks, on PostgreSQL,
//! SQLite and MariaDB; in every round, on each backend and task count, in an order that
//! turns with the round and the task count:
//!
//! - `generated`: the `#[idempotent]` handler, given the pool;
//! - `hand-written`: the same transaction written with sqlx by hand — `BEGIN` (SQLite:
//!   `BEGIN IMMEDIATE`), the claim's insert (MariaDB: `INSERT IGNORE`, see `mysql.rs`),
//!   the same body, `COMMIT` — on the same pool and table;
//! - on PostgreSQL, when `pgbench` is installed, the hand-written transaction through
//!   pgbench, the reference client, in its simple query mode (`-M simple`) and with
//!   prepared statements (`-M prepared`), as many clients as tasks.
//!
//! `target/dedup-bench/per_message.csv`: `backend,tasks,generated_per_s,
//! handwritten_per_s,pgbench_per_s,ratio_vs_handwritten,ratio_vs_pgbench`, the rates the
//! medians over the rounds (calls, or pgbench's transactions, per second), the ratios
//! those of the medians; `pgbench_per_s` the better of pgbench's two modes, empty (and its
//! ratio) where pgbench does not run. The printed table gives both modes and the ratio of
//! the generated handler to each.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use sqlx::{MySql, Pool, Postgres, Sqlite};

use crate::Error;
use crate::config::{BackendName, Variant};
use crate::pgbench::{Mode as PgbenchMode, pgbench};
use crate::report::median;
use crate::setup::{reset, tables};
use crate::target::Target;
use crate::timing::{measure, random_ids};

/// The task counts of the group (and pgbench's clients).
const TASKS: [usize; 2] = [1, 4];

/// The backends, in the order of the report.
const BACKENDS: [BackendName; 3] = [
    BackendName::Postgres,
    BackendName::Sqlite,
    BackendName::Mariadb,
];

/// Who runs the transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Client {
    Generated,
    Handwritten,
    Pgbench(PgbenchMode),
}

impl Client {
    fn name(self) -> &'static str {
        match self {
            Client::Generated => "generated",
            Client::Handwritten => "hand-written",
            Client::Pgbench(PgbenchMode::Simple) => "pgbench simple",
            Client::Pgbench(PgbenchMode::Prepared) => "pgbench prepared",
        }
    }
}

/// pgbench's connection: PostgreSQL's URL and the script file.
pub(crate) struct Pgbench<'a> {
    pub(crate) url: &'a str,
    pub(crate) script: &'a Path,
}

/// The group's sizes, and pgbench when it is installed.
pub(crate) struct Plan<'a> {
    pub(crate) rounds: usize,
    /// Calls per timed run, split between the tasks.
    pub(crate) ops: usize,
    pub(crate) smoke: bool,
    pub(crate) pgbench: Option<Pgbench<'a>>,
}

/// Per (backend, tasks, client): the rate of each round.
type Rates = BTreeMap<(BackendName, usize, Client), Vec<f64>>;

/// One round on one backend: for each task count, every client once.
async fn one_round<DB: Target>(
    pool: &Pool<DB>,
    plan: &Plan<'_>,
    round: usize,
    seed: &mut u64,
    rates: &mut Rates,
) -> Result<(), Error> {
    let backend = DB::BACKEND;
    for tasks in TASKS {
        reset(pool).await?;
        let mut clients = vec![Client::Generated, Client::Handwritten];
        if backend == BackendName::Postgres && plan.pgbench.is_some() {
            clients.push(Client::Pgbench(PgbenchMode::Simple));
            clients.push(Client::Pgbench(PgbenchMode::Prepared));
        }
        let turn = (round + tasks) % clients.len();
        clients.rotate_left(turn);
        for client in clients {
            let calls = plan.ops / tasks * tasks;
            let rate = match (client, &plan.pgbench) {
                (Client::Pgbench(mode), Some(reference)) => {
                    let (url, script) = (reference.url.to_owned(), reference.script.to_owned());
                    let ops = plan.ops;
                    tokio::task::spawn_blocking(move || pgbench(&url, &script, mode, tasks, ops))
                        .await??
                }
                _ => {
                    let variant = if client == Client::Generated {
                        Variant::Generated
                    } else {
                        Variant::Handwritten
                    };
                    let ids = Arc::new(random_ids(calls, seed));
                    let (seconds, _) = measure(pool, variant, tasks, plan.smoke, ids).await?;
                    calls as f64 / seconds
                }
            };
            eprintln!(
                "round {}/{} per message {:<10} {tasks} task(s) {:<16} {rate:>8.0}/s",
                round + 1,
                plan.rounds,
                backend.name(),
                client.name()
            );
            rates
                .entry((backend, tasks, client))
                .or_default()
                .push(rate);
        }
    }
    Ok(())
}

/// Runs the group: `plan.rounds` interleaved rounds on the three backends; prints the
/// medians and their ratios, writes `per_message.csv`.
pub(crate) async fn run(
    (pg, lite, maria): (&Pool<Postgres>, &Pool<Sqlite>, &Pool<MySql>),
    dir: &Path,
    plan: &Plan<'_>,
    seed: &mut u64,
) -> Result<(), Error> {
    tables(pg).await?;
    tables(lite).await?;
    tables(maria).await?;
    let mut rates = Rates::new();
    for round in 0..plan.rounds {
        one_round(pg, plan, round, seed, &mut rates).await?;
        one_round(lite, plan, round, seed, &mut rates).await?;
        one_round(maria, plan, round, seed, &mut rates).await?;
    }
    report(&rates, plan, dir)
}

/// The medians and ratios, printed and in `per_message.csv`.
fn report(rates: &Rates, plan: &Plan<'_>, dir: &Path) -> Result<(), Error> {
    let rate = |backend, tasks, client| {
        rates
            .get(&(backend, tasks, client))
            .map(|rates| median(rates.clone()))
    };
    let cell = |value: Option<f64>, digits: usize| {
        value.map_or_else(String::new, |value| format!("{value:.digits$}"))
    };
    let mut csv = String::from(
        "backend,tasks,generated_per_s,handwritten_per_s,pgbench_per_s,\
         ratio_vs_handwritten,ratio_vs_pgbench\n",
    );
    println!(
        "\nper message (one-statement body, every id new): calls per second (pgbench: \
         transactions), medians over {} round(s) of {} calls, and the generated handler's \
         ratio to each",
        plan.rounds, plan.ops
    );
    println!(
        "  {:<10} {:>5} {:>10} {:>13} {:>15} {:>17}   {:>10} {:>10} {:>12}",
        "backend",
        "tasks",
        "generated",
        "hand-written",
        "pgbench simple",
        "pgbench prepared",
        "/ hand",
        "/ simple",
        "/ prepared"
    );
    for backend in BACKENDS {
        for tasks in TASKS {
            let Some(generated) = rate(backend, tasks, Client::Generated) else {
                continue;
            };
            let handwritten = rate(backend, tasks, Client::Handwritten);
            let simple = rate(backend, tasks, Client::Pgbench(PgbenchMode::Simple));
            let prepared = rate(backend, tasks, Client::Pgbench(PgbenchMode::Prepared));
            let best = match (simple, prepared) {
                (Some(simple), Some(prepared)) => Some(simple.max(prepared)),
                (one, other) => one.or(other),
            };
            let ratio = |of: Option<f64>| of.map(|of| generated / of);
            let _ = writeln!(
                csv,
                "{},{tasks},{generated:.1},{},{},{},{}",
                backend.key(),
                cell(handwritten, 1),
                cell(best, 1),
                cell(ratio(handwritten), 3),
                cell(ratio(best), 3),
            );
            let shown = |value: Option<f64>, digits| {
                let text = cell(value, digits);
                if text.is_empty() {
                    "-".to_owned()
                } else {
                    text
                }
            };
            println!(
                "  {:<10} {tasks:>5} {generated:>10.0} {:>13} {:>15} {:>17}   {:>10} {:>10} {:>12}",
                backend.name(),
                shown(handwritten, 0),
                shown(simple, 0),
                shown(prepared, 0),
                shown(ratio(handwritten), 3),
                shown(ratio(simple), 3),
                shown(ratio(prepared), 3),
            );
        }
    }
    std::fs::write(dir.join("per_message.csv"), csv)?;
    println!("written: {}", dir.join("per_message.csv").display());
    Ok(())
}
