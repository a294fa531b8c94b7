//! The reference client: the hand-written transaction through pgbench (PostgreSQL, when
//! `pgbench` is installed), with prepared statements (the full run's `pgbench` variant) or
//! in its simple query mode too (the per-message group).

use std::path::Path;

use crate::Error;

/// pgbench's query mode (`-M`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Mode {
    /// `-M simple`: each statement sent as text, its values in it, one round trip.
    Simple,
    /// `-M prepared`: each statement parsed once per connection, then bound and executed.
    Prepared,
}

impl Mode {
    fn flag(self) -> &'static str {
        match self {
            Mode::Simple => "simple",
            Mode::Prepared => "prepared",
        }
    }
}

/// The hand-written transaction through pgbench in `mode`; its own tps (connections
/// excluded).
pub(crate) fn pgbench(
    url: &str,
    script: &Path,
    mode: Mode,
    tasks: usize,
    ops: usize,
) -> Result<f64, Error> {
    let output = std::process::Command::new("pgbench")
        .args(["-n", "-M", mode.flag(), "-f"])
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

/// Whether `pgbench` is installed.
pub(crate) fn installed() -> bool {
    std::process::Command::new("pgbench")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The hand-written transaction as a pgbench script. pgbench cannot branch on the claim's
/// row count without changing the statement; every id is new, so every claim succeeds
/// and the script is the processing path as sent.
pub(crate) const PGBENCH_SCRIPT: &str = "\
\\set r random(1, 9223372036854775806)
BEGIN;
INSERT INTO dedup_bench (consumer, message_id) VALUES ('bench', md5(:client_id || '-' || :r)) ON CONFLICT DO NOTHING;
INSERT INTO dedup_bench_effects (message_id) VALUES (md5(:client_id || '-' || :r));
COMMIT;
";
