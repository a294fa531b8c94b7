//! The run: the pools, the groups that run alone (`-- inbox`, `-- relay`, `-- per_message`,
//! `-- batch`), the interleaved rounds on both backends, the pruning figures, and the
//! report.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::Pool;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

use crate::Error;
use crate::batches::{BATCH_TASKS, BatchSample, measure_batches, print_batches};
#[cfg(feature = "brokers")]
use crate::brokers::Brokers;
use crate::config::{BackendName, Config, Sample, TASKS, Variant};
use crate::counting::{StatementCounter, counting, statements_per_call};
use crate::inbox_round::{INBOX_TABLE, InboxSample, measure_inbox, print_inbox};
use crate::outbox::{OUTBOX_TABLE, OutboxSample, measure_outbox, print_outbox};
use crate::pgbench::{Mode as PgbenchMode, PGBENCH_SCRIPT, pgbench};
use crate::prune::{print_prune, prune, write_prune_csv};
use crate::report::{
    Summary, print_report, print_statements, write_csv, write_pairs_csv, write_statements_csv,
};
use crate::setup::{reset, setup};
use crate::svg::svg;
use crate::target::Target;
use crate::timing::{PAIRS, PairSample, measure, measure_pair, random_ids};

/// What every round needs besides its backend's pool.
struct Context<'a> {
    config: &'a Config,
    /// PostgreSQL's URL and the script, for pgbench.
    pg_url: &'a str,
    script: &'a Path,
    have_pgbench: bool,
    #[cfg(feature = "brokers")]
    brokers: &'a Brokers,
}

/// What the rounds measured.
#[derive(Default)]
struct Rounds {
    samples: Vec<Sample>,
    pair_samples: Vec<PairSample>,
    inbox_samples: Vec<InboxSample>,
    outbox_samples: Vec<OutboxSample>,
    batch_samples: Vec<BatchSample>,
}

/// The group a run is limited to (`cargo bench --bench dedup -- <group>`), if any.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Only {
    Batch,
    Relay,
    Inbox,
    PerMessage,
    Consumers,
    Http,
}

impl Only {
    /// The group named on the command line (`cargo bench` passes `--bench` too).
    pub(crate) fn from_args() -> Option<Only> {
        std::env::args().skip(1).find_map(|arg| match arg.as_str() {
            "batch" => Some(Only::Batch),
            "relay" => Some(Only::Relay),
            "inbox" => Some(Only::Inbox),
            "per_message" => Some(Only::PerMessage),
            "consumers" => Some(Only::Consumers),
            "http" => Some(Only::Http),
            _ => None,
        })
    }
}

pub(crate) async fn run(config: Config, only: Option<Only>) -> Result<(), Error> {
    let batch_only = only == Some(Only::Batch);
    let relay_only = only == Some(Only::Relay);
    let inbox_only = only == Some(Only::Inbox);
    let per_message_only = only == Some(Only::PerMessage);
    let consumers_only = only == Some(Only::Consumers);
    let http_only = only == Some(Only::Http);
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
        crate::inbox::run(&pg, &dir, rounds, messages).await?;
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
        crate::relay::run(&pg, &lite, &maria, &dir, rounds, rows).await?;
        if relay_only {
            return Ok(());
        }
    }

    // `cargo bench --bench dedup --features brokers -- consumers`: the hosted consumers
    // against hand-written ones (and, tiny, in the smoke run).
    #[cfg(feature = "brokers")]
    if consumers_only || config.smoke {
        let (rounds, messages) = if config.smoke {
            (1, 50)
        } else {
            (relay_rounds(), 2_000)
        };
        crate::consumers::run(&pg, &dir, rounds, messages).await?;
        if consumers_only {
            return Ok(());
        }
    }
    #[cfg(not(feature = "brokers"))]
    if consumers_only {
        return Err("the consumers group needs the brokers: --features brokers".into());
    }

    // `cargo bench --bench dedup --features http -- http`: the Idempotency-Key layer
    // against the same endpoint by hand (and, tiny, in the smoke run).
    #[cfg(feature = "http")]
    if http_only || config.smoke {
        let (rounds, requests) = if config.smoke {
            (1, 50)
        } else {
            (relay_rounds(), 2_000)
        };
        crate::http::run(&pg, &dir, rounds, requests).await?;
        if http_only {
            return Ok(());
        }
    }
    #[cfg(not(feature = "http"))]
    if http_only {
        return Err("the http group needs axum and reqwest: --features http".into());
    }

    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |elapsed| elapsed.as_nanos() as u64)
        | 1;
    let script = dir.join("pgbench.sql");
    std::fs::write(&script, PGBENCH_SCRIPT)?;
    let have_pgbench = crate::pgbench::installed();
    if !have_pgbench && !batch_only {
        eprintln!("pgbench is not installed: no reference client run");
    }

    // The per-message group: alone with `-- per_message`, before the rounds in the full
    // run, tiny in the smoke run.
    if !batch_only {
        let mysql_url = dedup_suite::mysql_url();
        let maria = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&mysql_url)
            .await
            .map_err(|error| format!("MariaDB at {mysql_url}: {error}"))?;
        let plan = crate::per_message::Plan {
            rounds: if config.smoke { 1 } else { relay_rounds() },
            ops: config.ops,
            smoke: config.smoke,
            pgbench: have_pgbench.then(|| crate::per_message::Pgbench {
                url: &pg_url,
                script: &script,
            }),
        };
        crate::per_message::run((&pg, &lite, &maria), &dir, &plan, &mut seed).await?;
        maria.close().await;
        if per_message_only {
            return Ok(());
        }
    }

    setup(&pg, &config).await?;
    setup(&lite, &config).await?;
    dedup_runtime::inbox::migrate_table(&pg, INBOX_TABLE).await?;
    dedup_runtime::inbox::migrate_table(&lite, INBOX_TABLE).await?;
    dedup_runtime::outbox::migrate_table(&pg, OUTBOX_TABLE).await?;
    dedup_runtime::outbox::migrate_table(&lite, OUTBOX_TABLE).await?;

    // `cargo bench --bench dedup -- batch`: the batch group alone.
    if batch_only {
        let mut samples = Vec::new();
        for round in 0..config.rounds {
            eprintln!("round {}/{} batches", round + 1, config.rounds);
            samples.extend(measure_batches(&pg, &config, round, &mut seed).await?);
            samples.extend(measure_batches(&lite, &config, round, &mut seed).await?);
        }
        let images = manifest.join("guide/src/images");
        print_batches(
            &samples,
            &[],
            &dir,
            (!config.smoke).then_some(images.as_path()),
        )?;
        println!("\nwritten: {}", dir.join("batch.csv").display());
        return Ok(());
    }

    // Statements (round trips) per call, counted once, untimed.
    let _ = tracing::subscriber::set_global_default(StatementCounter);
    counting(false);
    let mut statements = statements_per_call(&pg, config.smoke, &mut seed).await?;
    statements.extend(statements_per_call(&lite, config.smoke, &mut seed).await?);

    #[cfg(feature = "brokers")]
    let brokers = Brokers::connect().await?;
    let context = Context {
        config: &config,
        pg_url: &pg_url,
        script: &script,
        have_pgbench,
        #[cfg(feature = "brokers")]
        brokers: &brokers,
    };
    let mut rounds = Rounds::default();
    for round in 0..config.rounds {
        one_round(&pg, round, &context, &mut seed, &mut rounds).await?;
        one_round(&lite, round, &context, &mut seed, &mut rounds).await?;
    }

    // Pruning, once per backend, after the rounds: it disturbs what runs beside it.
    let prunes = vec![
        prune(&pg, &config, &mut seed).await?,
        prune(&lite, &config, &mut seed).await?,
    ];

    let backends = [BackendName::Postgres, BackendName::Sqlite];
    let summary = Summary::new(&rounds.samples, &rounds.pair_samples);
    write_csv(&dir, &rounds.samples, &summary)?;
    write_statements_csv(&dir, &statements)?;
    write_pairs_csv(&dir, &rounds.pair_samples)?;
    write_prune_csv(&dir, &prunes)?;
    let plot = svg(&summary, &config, &backends);
    std::fs::write(dir.join("bench.svg"), &plot)?;
    if !config.smoke {
        std::fs::create_dir_all(manifest.join("guide/src/images"))?;
        std::fs::write(manifest.join("guide/src/images/bench.svg"), &plot)?;
    }
    print_report(&summary, &config, &backends);
    print_inbox(&rounds.inbox_samples, &summary);
    print_outbox(&rounds.outbox_samples);
    let pgbench: Vec<(usize, f64)> = BATCH_TASKS
        .into_iter()
        .filter_map(|tasks| {
            let rate = summary
                .rate
                .get(&(BackendName::Postgres, tasks, Variant::Pgbench))?;
            Some((tasks, *rate))
        })
        .collect();
    let images = manifest.join("guide/src/images");
    print_batches(
        &rounds.batch_samples,
        &pgbench,
        &dir,
        (!config.smoke).then_some(images.as_path()),
    )?;
    print_prune(&prunes);
    print_statements(&statements, &backends);
    println!(
        "\nwrote {}/results.csv, summary.csv, prune.csv and bench.svg{} in {:.0?}",
        dir.display(),
        if config.smoke {
            ""
        } else {
            " (and guide/src/images/bench.svg)"
        },
        began.elapsed()
    );
    Ok(())
}

/// One round on one backend: the inbox's, the outbox's and the batches' figures, then for
/// each task count every variant (in an order that turns with the round and the task
/// count) and every pair call by call.
async fn one_round<DB: Target>(
    pool: &Pool<DB>,
    round: usize,
    context: &Context<'_>,
    seed: &mut u64,
    rounds: &mut Rounds,
) -> Result<(), Error> {
    let (config, backend) = (context.config, DB::BACKEND);
    // The inbox's figures, interleaved with the handlers' in every round.
    eprintln!(
        "round {}/{} {:<10} the inbox",
        round + 1,
        config.rounds,
        backend.name()
    );
    rounds
        .inbox_samples
        .push(measure_inbox(pool, config, seed).await?);
    rounds.outbox_samples.push(
        measure_outbox(
            pool,
            config,
            seed,
            #[cfg(feature = "brokers")]
            context.brokers,
        )
        .await?,
    );
    rounds
        .batch_samples
        .extend(measure_batches(pool, config, round, seed).await?);
    for tasks in TASKS {
        reset(pool).await?;
        // Each round starts the rotation one variant further.
        let mut order: Vec<Variant> = Variant::ALL
            .into_iter()
            .filter(|&v| {
                v != Variant::Pgbench || (backend == BackendName::Postgres && context.have_pgbench)
            })
            .collect();
        let shift = (round + tasks) % order.len();
        order.rotate_left(shift);
        for variant in order {
            let ids = Arc::new(random_ids(config.ops, seed));
            if variant == Variant::Duplicate {
                DB::seen(pool, &ids).await?;
            }
            let (seconds, allocations) = if variant == Variant::Pgbench {
                let (url, script, ops) = (
                    context.pg_url.to_owned(),
                    context.script.to_owned(),
                    config.ops,
                );
                let tps = tokio::task::spawn_blocking(move || {
                    pgbench(&url, &script, PgbenchMode::Prepared, tasks, ops)
                })
                .await??;
                (config.ops as f64 / tps, None)
            } else {
                let (s, a) = measure(pool, variant, tasks, config.smoke, ids).await?;
                (s, Some(a))
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
            rounds.samples.push(sample);
        }
        let mut pairs: Vec<usize> = (0..PAIRS.len()).collect();
        pairs.rotate_left((round + tasks) % PAIRS.len());
        for pair in pairs {
            let (a, b, label) = PAIRS[pair];
            let ids_a = Arc::new(random_ids(config.ops / 2, seed));
            let ids_b = Arc::new(random_ids(config.ops / 2, seed));
            if a == Variant::Duplicate {
                DB::seen(pool, &ids_a).await?;
            }
            let ids = (ids_a, ids_b);
            let (lat_a, lat_b) = measure_pair(pool, (a, b), tasks, config.smoke, ids).await?;
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
            rounds.pair_samples.push(sample);
        }
    }
    Ok(())
}

/// The rounds of the relay, inbox and per-message groups: `DEDUP_BENCH_ROUNDS`, 8 by
/// default.
fn relay_rounds() -> usize {
    std::env::var("DEDUP_BENCH_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(8)
}
