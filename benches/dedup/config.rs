//! What is measured: the variants, the backends, the sizes of a run, one timed run.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Variant {
    Generated,
    Handwritten,
    Bare,
    Duplicate,
    Big,
    Pgbench,
}

impl Variant {
    pub(crate) const ALL: [Variant; 6] = [
        Variant::Generated,
        Variant::Handwritten,
        Variant::Bare,
        Variant::Duplicate,
        Variant::Big,
        Variant::Pgbench,
    ];

    pub(crate) fn name(self) -> &'static str {
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
    pub(crate) fn processes(self) -> bool {
        self != Variant::Duplicate
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum BackendName {
    Postgres,
    Sqlite,
    /// MariaDB (or MySQL): in the per-message group only.
    Mariadb,
}

impl BackendName {
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackendName::Postgres => "PostgreSQL",
            BackendName::Sqlite => "SQLite",
            BackendName::Mariadb => "MariaDB",
        }
    }

    /// Its name in the groups' CSV files.
    pub(crate) fn key(self) -> &'static str {
        match self {
            BackendName::Postgres => "postgres",
            BackendName::Sqlite => "sqlite",
            BackendName::Mariadb => "mariadb",
        }
    }
}

pub(crate) const TASKS: [usize; 3] = [1, 4, 8];

pub(crate) struct Config {
    pub(crate) smoke: bool,
    pub(crate) rounds: usize,
    /// Calls per timed run, split between the tasks.
    pub(crate) ops: usize,
    /// Rows in the big dedup table.
    pub(crate) big_rows: i64,
    /// Old ids in the table the pruning figure prunes.
    pub(crate) prune_rows: i64,
    /// How long the consumers' rate before the prune is measured.
    pub(crate) prune_baseline: Duration,
}

impl Config {
    pub(crate) fn from_env() -> Config {
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

    pub(crate) fn big_table(&self) -> &'static str {
        if self.smoke {
            "dedup_bench_10k"
        } else {
            "dedup_bench_10m"
        }
    }
}

/// One timed run.
pub(crate) struct Sample {
    pub(crate) backend: BackendName,
    pub(crate) tasks: usize,
    pub(crate) variant: Variant,
    pub(crate) round: usize,
    pub(crate) ops: usize,
    pub(crate) seconds: f64,
    /// Allocations per call; `None` for pgbench (another process).
    pub(crate) allocations: Option<f64>,
}

impl Sample {
    pub(crate) fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds
    }
}
