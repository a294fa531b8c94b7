//! The report: medians over the rounds and their ratios, printed and in CSV files
//! (`results.csv`, `summary.csv`, `statements.csv`, `pairs.csv`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::config::{BackendName, Config, Sample, TASKS, Variant};
use crate::timing::{PAIRS, PairSample};

/// `10000000` → `10,000,000`.
pub(crate) fn thousands(n: i64) -> String {
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

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

type Key = (BackendName, usize, Variant);

pub(crate) struct Summary {
    pub(crate) rate: BTreeMap<Key, f64>,
    pub(crate) allocations: BTreeMap<Key, f64>,
    /// Per (backend, tasks, pair): the median over rounds of the call-by-call ratio.
    pub(crate) pair_ratio: BTreeMap<(BackendName, usize, usize), f64>,
}

impl Summary {
    pub(crate) fn new(samples: &[Sample], pair_samples: &[PairSample]) -> Summary {
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

pub(crate) fn write_csv(dir: &Path, samples: &[Sample], summary: &Summary) -> std::io::Result<()> {
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

/// `statements.csv`: the logged queries per call of each variant.
pub(crate) fn write_statements_csv(
    dir: &Path,
    statements: &[(BackendName, Variant, u64)],
) -> std::io::Result<()> {
    let mut table = String::from("backend,variant,logged_queries_per_call\n");
    for (backend, variant, count) in statements {
        let _ = writeln!(table, "{},{},{count}", backend.name(), variant.name());
    }
    std::fs::write(dir.join("statements.csv"), table)
}

/// `pairs.csv`: every call-by-call run.
pub(crate) fn write_pairs_csv(dir: &Path, pair_samples: &[PairSample]) -> std::io::Result<()> {
    let mut table = String::from(
        "backend,tasks,pair,round,calls_each,median_latency_a_us,median_latency_b_us,ratio\n",
    );
    for sample in pair_samples {
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
    std::fs::write(dir.join("pairs.csv"), table)
}

pub(crate) fn print_report(summary: &Summary, config: &Config, backends: &[BackendName]) {
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

/// The logged queries per call of each variant, one line per backend.
pub(crate) fn print_statements(
    statements: &[(BackendName, Variant, u64)],
    backends: &[BackendName],
) {
    println!(
        "\nqueries per call, as sqlx logs them (its transaction manager sends BEGIN unlogged, \
         and on SQLite COMMIT / ROLLBACK too: the same for every variant):"
    );
    for &backend in backends {
        let line: Vec<String> = statements
            .iter()
            .filter(|(b, ..)| *b == backend)
            .map(|(_, variant, count)| format!("{} {count}", variant.name()))
            .collect();
        println!("  {:<12}{}", backend.name(), line.join(", "));
    }
}
