//! The operator's pruning command: deletes processed message ids that the broker can no
//! longer redeliver, with a progress bar, and shows per consumer what is kept.
//!
//! ```text
//! cargo run --example prune -- --database-url postgres://postgres@127.0.0.1:5432/test \
//!     --older-than 7d --redelivery-window 2d [--consumer billing] [--table processed_messages] \
//!     [--batch-size 2000] [--pause 10ms] [--dry-run]
//! ```
//!
//! `--database-url` (or `DATABASE_URL`) picks the backend by its scheme: `postgres://`,
//! `mysql://` / `mariadb://`, or `sqlite:` (an existing file). Durations are numbers
//! with a unit, `w`, `d`, `h`, `m`, `s` or `ms`, and may be combined (`1d12h`).
//!
//! It first shows, per consumer, how many ids the table holds, how old the oldest is, and
//! how many the prune deletes and keeps. With `--dry-run` it stops there. Otherwise it
//! prunes in batches, drawing a progress bar on stderr, then shows what was kept.
//!
//! An `--older-than` shorter than the `--redelivery-window` is refused: pruning ids the
//! broker may still redeliver turns a redelivery into a second effect. The guide's
//! "Operating it" chapter (`guide/src/operating.md`) says how to size the window for each broker. Exit status: 0 when
//! done, 1 when the database fails, 2 for bad arguments (a dedup table that does not
//! exist included: the message says how to create it) or a refused prune.

use std::error::Error;
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use dedup_runtime::{Backend, ConsumerStats, Prune, PruneError, PruneProgress};
use sqlx::Pool;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

const USAGE: &str = "\
usage: prune --database-url URL --older-than AGE --redelivery-window AGE [options]

Deletes processed message ids older than AGE from the dedup table, in short batches.

  --database-url URL         postgres://…, mysql://… or sqlite:… (default: $DATABASE_URL)
  --older-than AGE           delete ids processed more than AGE ago, e.g. 7d
  --redelivery-window AGE    how long after a first delivery the broker may still
                             redeliver (refused if longer than --older-than)
  --consumer NAME            only this consumer's ids (default: every consumer's)
  --table NAME               the dedup table (default: processed_messages)
  --batch-size N             ids per batch/transaction (default: 2000)
  --pause AGE                fixed pause between batches (default: rest as long as the
                             batch took; 0s prunes flat out)
  --dry-run                  show what would be deleted; delete nothing
  -h, --help                 this text

AGE is a number with a unit: w, d, h, m, s or ms; units combine (1d12h).";

#[derive(Debug)]
struct Args {
    database_url: String,
    older_than: Duration,
    redelivery_window: Duration,
    consumer: Option<String>,
    table: Option<String>,
    batch_size: Option<u32>,
    pause: Option<Duration>,
    dry_run: bool,
}

/// Arguments, or the message to print before the usage.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut url, mut older_than, mut window) = (None, None, None);
    let (mut consumer, mut table, mut batch_size, mut pause) = (None, None, None, None);
    let mut dry_run = false;
    while let Some(arg) = args.next() {
        // `--name=value` and `--name value` both work.
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name.to_owned(), Some(value)),
            _ => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .map(str::to_owned)
                .or_else(|| args.next())
                .ok_or_else(|| format!("`{name}` needs a value"))
        };
        match name.as_str() {
            "-h" | "--help" => return Ok(None),
            "--database-url" => url = Some(value()?),
            "--older-than" => older_than = Some(parse_duration(&value()?)?),
            "--redelivery-window" => window = Some(parse_duration(&value()?)?),
            "--consumer" => consumer = Some(value()?),
            "--table" => table = Some(value()?),
            "--batch-size" => {
                let text = value()?;
                let rows = u32::from_str(&text)
                    .map_err(|_| format!("`--batch-size` takes a number of rows, not `{text}`"))?;
                batch_size = Some(rows);
            }
            "--pause" => pause = Some(parse_duration(&value()?)?),
            "--dry-run" => dry_run = true,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    let database_url = url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("`--database-url` (or DATABASE_URL) is required")?;
    Ok(Some(Args {
        database_url,
        older_than: older_than.ok_or("`--older-than` is required")?,
        redelivery_window: window.ok_or(
            "`--redelivery-window` is required: how long the broker may redeliver a message",
        )?,
        consumer,
        table,
        batch_size,
        pause,
        dry_run,
    }))
}

/// `7d`, `36h`, `1d12h`, `90s`, `250ms`, `0s`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("`{text}` is not a duration such as 7d, 36h, 1d12h, 90s or 250ms");
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(invalid)?;
        let number: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        let unit_len = rest[digits..]
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len() - digits);
        let unit = match &rest[digits..digits + unit_len] {
            "w" => Duration::from_secs(7 * 24 * 3600),
            "d" => Duration::from_secs(24 * 3600),
            "h" => Duration::from_secs(3600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            _ => return Err(invalid()),
        };
        let part = unit
            .checked_mul(u32::try_from(number).map_err(|_| invalid())?)
            .ok_or_else(invalid)?;
        total = total.checked_add(part).ok_or_else(invalid)?;
        rest = &rest[digits + unit_len..];
    }
    Ok(total)
}

/// `3d 4h`, `7d`, `12m 5s`, `850ms`: the largest unit, and the next one unless it is 0.
fn human(duration: Duration) -> String {
    let seconds = duration.as_secs();
    if seconds == 0 {
        return format!("{}ms", duration.as_millis());
    }
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let Some(first) = units.iter().position(|(_, size)| seconds >= *size) else {
        return String::new();
    };
    let (name, size) = units[first];
    let mut out = format!("{}{name}", seconds / size);
    if let Some((next, next_size)) = units.get(first + 1) {
        let part = seconds % size / next_size;
        if part > 0 {
            let _ = write!(out, " {part}{next}");
        }
    }
    out
}

/// `1 id`, `2,000 ids`: a count and its noun, singular for 1.
fn count(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
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

fn print_stats(title: &str, stats: &[ConsumerStats], planned: bool) {
    println!("{title}");
    if stats.is_empty() {
        println!("  (no ids)");
        return;
    }
    if planned {
        println!(
            "  {:<24} {:>12} {:>12} {:>12} {:>12}  {:>12}",
            "consumer", "ids", "oldest", "to delete", "to keep", "oldest kept"
        );
    } else {
        println!("  {:<24} {:>12} {:>12}", "consumer", "ids kept", "oldest");
    }
    for consumer in stats {
        if planned {
            println!(
                "  {:<24} {:>12} {:>12} {:>12} {:>12}  {:>12}",
                consumer.consumer,
                thousands(consumer.ids),
                human(consumer.oldest),
                thousands(consumer.prunable),
                thousands(consumer.kept()),
                consumer.oldest_kept.map_or_else(|| "-".to_owned(), human),
            );
        } else {
            println!(
                "  {:<24} {:>12} {:>12}",
                consumer.consumer,
                thousands(consumer.ids),
                human(consumer.oldest)
            );
        }
    }
    // Rows whose outcome is not settled (in progress, or unknown) are never pruned: say so
    // when there are any, so that an operator sees what waits for them.
    for consumer in stats.iter().filter(|consumer| consumer.unresolved > 0) {
        let unresolved = consumer.unresolved;
        println!(
            "  {}: {} {} not processed (in progress or outcome unknown), kept at any age",
            consumer.consumer,
            thousands(unresolved),
            if unresolved == 1 { "id" } else { "ids" },
        );
    }
}

/// A one-line progress bar on stderr, redrawn at most ten times a second.
struct Bar {
    total: u64,
    drawn: Option<Instant>,
}

impl Bar {
    fn draw(&mut self, progress: &PruneProgress) {
        if !progress.done
            && self
                .drawn
                .is_some_and(|at| at.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        const WIDTH: u64 = 30;
        // The total comes from the stats taken just before the run: an estimate (ids
        // age past the cutoff meanwhile, another pruner may take some).
        let total = self.total.max(progress.deleted).max(1);
        let filled = (progress.deleted * WIDTH / total) as usize;
        let rate = progress.rate();
        let eta = if rate > 0.0 && !progress.done {
            let left = total.saturating_sub(progress.deleted) as f64 / rate;
            format!("  eta {}", human(Duration::from_secs_f64(left)))
        } else {
            String::new()
        };
        let mut stderr = std::io::stderr().lock();
        let _ = write!(
            stderr,
            "\r[{}{}] {:>3}%  {}/{}  {}/s  {}{eta}\x1b[K",
            "#".repeat(filled),
            "-".repeat(WIDTH as usize - filled),
            progress.deleted * 100 / total,
            thousands(progress.deleted),
            count(total, "id", "ids"),
            thousands(rate as u64),
            count(progress.batches, "batch", "batches"),
        );
        if progress.done {
            let _ = writeln!(stderr);
        }
        let _ = stderr.flush();
    }
}

fn build(args: &Args) -> Result<Prune, PruneError> {
    let mut prune = Prune::new(args.older_than, args.redelivery_window);
    if let Some(consumer) = &args.consumer {
        prune = prune.consumer(consumer.as_str());
    }
    if let Some(table) = &args.table {
        prune = prune.in_table(table.as_str())?;
    }
    if let Some(rows) = args.batch_size {
        prune = prune.batch_size(rows);
    }
    if let Some(pause) = args.pause {
        prune = prune.pause(pause);
    }
    Ok(prune)
}

async fn operate<DB: Backend>(pool: Pool<DB>, args: &Args) -> Result<(), PruneError> {
    let prune = build(args)?;
    let table = args
        .table
        .as_deref()
        .unwrap_or(dedup_runtime::DEFAULT_TABLE);
    let before = prune.stats(&pool).await?;
    print_stats(
        &format!(
            "{table}: ids processed more than {} ago are deleted (redelivery window {})",
            human(args.older_than),
            human(args.redelivery_window)
        ),
        &before,
        true,
    );
    let total: u64 = before.iter().map(|consumer| consumer.prunable).sum();
    if args.dry_run {
        println!(
            "dry run: {} would be deleted; nothing was.",
            count(total, "id", "ids")
        );
        return Ok(());
    }

    let mut bar = Bar { total, drawn: None };
    let done = prune.run(&pool, |progress| bar.draw(progress)).await?;
    println!(
        "deleted {} processed before {} in {} ({}/s, {})",
        count(done.deleted, "id", "ids"),
        done.cutoff,
        human(done.elapsed),
        thousands(done.rate() as u64),
        count(done.batches, "batch", "batches"),
    );
    let after = prune.stats(&pool).await?;
    print_stats("kept:", &after, false);
    Ok(())
}

async fn connect_and_operate(args: &Args) -> Result<(), Box<dyn Error>> {
    // Refused settings are reported before connecting.
    build(args)?.check()?;
    let url = args.database_url.as_str();
    let timeout = Duration::from_secs(10);
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(timeout)
            .connect(url)
            .await?;
        Ok(operate(pool, args).await?)
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let url = url.replacen("mariadb:", "mysql:", 1);
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(timeout)
            .connect(&url)
            .await?;
        Ok(operate(pool, args).await?)
    } else if url.starts_with("sqlite:") {
        // An existing file only: creating an empty database would hide a wrong path.
        let options = SqliteConnectOptions::from_str(url)?.busy_timeout(timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await?;
        Ok(operate(pool, args).await?)
    } else {
        Err(format!("`{url}`: expected a postgres://, mysql:// or sqlite: URL").into())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("prune: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match connect_and_operate(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            match error.downcast_ref::<PruneError>() {
                Some(PruneError::WindowTooShort {
                    older_than,
                    redelivery_window,
                }) => eprintln!(
                    "prune: refused: ids younger than the redelivery window ({}) would be \
                     deleted with --older-than {}; a redelivered message would be processed \
                     twice. Prune at {} or more.",
                    human(*redelivery_window),
                    human(*older_than),
                    human(*redelivery_window),
                ),
                _ => eprintln!("prune: {error}"),
            }
            let refused = error
                .downcast_ref::<PruneError>()
                .is_some_and(|error| !matches!(error, PruneError::Database(_)));
            ExitCode::from(if refused { 2 } else { 1 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("1d12h"), Ok(Duration::from_secs(36 * 3_600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "7", "d", "7x", "-1d", "1.5h", "99999999999w"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            human(Duration::from_secs(3 * 86_400 + 4 * 3_600 + 5)),
            "3d 4h"
        );
        assert_eq!(human(Duration::from_secs(65)), "1m 5s");
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human(Duration::from_secs(7 * 86_400)), "7d");
        assert_eq!(human(Duration::from_secs(3_600 + 7)), "1h");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(count(1, "id", "ids"), "1 id");
        assert_eq!(count(0, "id", "ids"), "0 ids");
        assert_eq!(count(2_000, "batch", "batches"), "2,000 batches");
    }
}
