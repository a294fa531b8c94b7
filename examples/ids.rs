//! The operator's command for single message ids: was this id processed, and when
//! (`lookup`), and the deliberate replay of one (`forget`).
//!
//! ```text
//! cargo run --example ids -- lookup --database-url postgres://postgres@127.0.0.1:5432/test \
//!     --consumer billing [--table processed_messages] evt_91c2 [evt_91c3 …]
//! cargo run --example ids -- forget --database-url … --consumer billing evt_91c2
//! ```
//!
//! `--database-url` (or `DATABASE_URL`) picks the backend by its scheme: `postgres://`,
//! `mysql://` / `mariadb://`, or `sqlite:` (an existing file). Ids are written as the
//! handler records them, compared byte for byte: an integer key is its decimal digits, a
//! `uuid::Uuid` its lowercase hyphenated form.
//!
//! `lookup` prints, for each id, when the consumer processed it (the database's clock,
//! in UTC), or that the table holds no record of it (never processed, pruned, forgotten,
//! or still in a transaction that has not committed).
//!
//! `forget` deletes the record of each id for that consumer, so that **the next delivery
//! of the id runs the handler again** — its effects happen a second time. It is for
//! replaying a message on purpose (after fixing what its first run did wrong), never for
//! a handler. Every id is checked before anything is deleted. To forget all of a
//! consumer's ids, prune them: `cargo run --example prune -- --consumer NAME …`.
//!
//! Exit status: 0 when done (whether or not the ids had records), 1 when the database
//! fails, 2 for bad arguments (an invalid id or consumer, a table that does not exist).

use std::error::Error;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::{Backend, Ledger, LedgerError, MessageId};
use sqlx::Pool;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

const USAGE: &str = "\
usage: ids lookup --database-url URL --consumer NAME [--table NAME] ID...
       ids forget --database-url URL --consumer NAME [--table NAME] ID...

lookup: whether the consumer processed each ID, and when.
forget: deletes the record of each ID, so that its next delivery runs the handler
        again (a replay: its effects happen a second time).

  --database-url URL   postgres://…, mysql://… or sqlite:… (default: $DATABASE_URL)
  --consumer NAME      the `consumer = \"…\"` of the handler
  --table NAME         the dedup table (default: processed_messages)
  -h, --help           this text

IDs as the handler records them, byte for byte: integers in decimal, UUIDs lowercase
and hyphenated. `--` before an ID that starts with `-`.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Lookup,
    Forget,
}

#[derive(Debug)]
struct Args {
    command: Command,
    database_url: String,
    consumer: String,
    table: Option<String>,
    ids: Vec<String>,
}

/// Arguments, or the message to print before the usage.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut command, mut url, mut consumer, mut table) = (None, None, None, None);
    let mut ids = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--" {
            ids.extend(args.by_ref());
            break;
        }
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
            "--consumer" => consumer = Some(value()?),
            "--table" => table = Some(value()?),
            other if other.starts_with('-') => {
                return Err(format!("unknown argument `{other}`"));
            }
            "lookup" if command.is_none() => command = Some(Command::Lookup),
            "forget" if command.is_none() => command = Some(Command::Forget),
            _ if command.is_none() => {
                return Err(format!(
                    "unknown command `{arg}`: expected `lookup` or `forget`"
                ));
            }
            _ => ids.push(arg),
        }
    }
    let command = command.ok_or("a command is required: `lookup` or `forget`")?;
    let database_url = url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("`--database-url` (or DATABASE_URL) is required")?;
    let consumer =
        consumer.ok_or("`--consumer` is required: the `consumer = \"…\"` of the handler")?;
    if ids.is_empty() {
        return Err("no message id given".to_owned());
    }
    Ok(Some(Args {
        command,
        database_url,
        consumer,
        table,
        ids,
    }))
}

/// `2026-11-12T07:35:19.681609Z`: a time in UTC, to the microsecond.
fn utc(time: SystemTime) -> String {
    let (sign, since) = match time.duration_since(UNIX_EPOCH) {
        Ok(since) => (1, since),
        Err(before) => (-1, before.duration()),
    };
    let micros = sign * i128::try_from(since.as_micros()).unwrap_or(i128::MAX);
    let (days, micros_of_day) = (
        micros.div_euclid(86_400_000_000),
        micros.rem_euclid(86_400_000_000),
    );
    let (year, month, day) = civil_from_days(i64::try_from(days).unwrap_or(0));
    let seconds = micros_of_day / 1_000_000;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        micros_of_day % 1_000_000
    )
}

/// The proleptic Gregorian date of a day number counted from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = u32::try_from(day_of_year - (153 * shifted_month + 2) / 5 + 1).unwrap_or(1);
    let month = u32::try_from(if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    })
    .unwrap_or(1);
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The ids, padded to the longest (within reason) for the columns.
fn width(ids: &[String]) -> usize {
    ids.iter()
        .map(|id| id.chars().count())
        .max()
        .unwrap_or(0)
        .min(40)
}

async fn operate<DB: Backend>(pool: Pool<DB>, args: &Args) -> Result<(), LedgerError> {
    let ledger = match &args.table {
        Some(table) => Ledger::new(&pool).in_table(table)?,
        None => Ledger::new(&pool),
    };
    let table = ledger.table().name();
    let consumer = args.consumer.as_str();
    let width = width(&args.ids);
    match args.command {
        Command::Lookup => {
            for (n, id) in args.ids.iter().enumerate() {
                let at = ledger.processed_at(consumer, id.as_str()).await?;
                // After the first answer: a missing table or a bad consumer has no header.
                if n == 0 {
                    println!("{table}, consumer {consumer}:");
                }
                match at {
                    Some(at) => println!("  {id:<width$}  processed {}", utc(at)),
                    None => {
                        println!("  {id:<width$}  no record (never processed, pruned or forgotten)")
                    }
                }
            }
        }
        Command::Forget => {
            let mut forgotten = 0;
            for (n, id) in args.ids.iter().enumerate() {
                let at = ledger.processed_at(consumer, id.as_str()).await?;
                if n == 0 {
                    println!("{table}, consumer {consumer}:");
                }
                if ledger.forget(consumer, id.as_str()).await? {
                    forgotten += 1;
                    let when =
                        at.map_or_else(String::new, |at| format!(" (processed {})", utc(at)));
                    println!("  {id:<width$}  forgotten{when}");
                } else {
                    println!("  {id:<width$}  no record; nothing forgotten");
                }
            }
            println!(
                "{forgotten} of {} ids forgotten: their next delivery runs the handler again.",
                args.ids.len()
            );
        }
    }
    Ok(())
}

async fn connect_and_operate(args: &Args) -> Result<(), Box<dyn Error>> {
    // Every id is checked before connecting, so that none is forgotten when one is bad.
    for id in &args.ids {
        MessageId::borrowed(id)
            .validate()
            .map_err(LedgerError::from)?;
    }
    let url = args.database_url.as_str();
    let timeout = Duration::from_secs(10);
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(timeout)
            .connect(url)
            .await?;
        Ok(operate(pool, args).await?)
    } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        let url = url.replacen("mariadb:", "mysql:", 1);
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(timeout)
            .connect(&url)
            .await?;
        Ok(operate(pool, args).await?)
    } else if url.starts_with("sqlite:") {
        // An existing file only: creating an empty database would hide a wrong path.
        let options = SqliteConnectOptions::from_str(url)?.busy_timeout(timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
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
            eprintln!("ids: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match connect_and_operate(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ids: {error}");
            let refused = error
                .downcast_ref::<LedgerError>()
                .is_some_and(|error| !matches!(error, LedgerError::Database(_)));
            ExitCode::from(if refused { 2 } else { 1 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Args>, String> {
        parse_args(args.iter().map(|arg| (*arg).to_owned()))
    }

    #[test]
    fn arguments() {
        let args = parse(&[
            "lookup",
            "--database-url=sqlite:x.db",
            "--consumer",
            "billing",
            "a",
            "b",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(args.command, Command::Lookup);
        assert_eq!((args.consumer.as_str(), args.ids.len()), ("billing", 2));
        let args = parse(&[
            "forget",
            "--database-url",
            "sqlite:x.db",
            "--consumer",
            "c",
            "--",
            "-1",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (args.command, args.ids[0].as_str()),
            (Command::Forget, "-1")
        );
        assert!(parse(&["--help"]).unwrap().is_none());
        for bad in [
            &["drop", "--consumer", "c", "a"][..],
            &["lookup", "--database-url", "sqlite:x", "a"],
            &["lookup", "--database-url", "sqlite:x", "--consumer", "c"],
            &[
                "lookup",
                "--database-url",
                "sqlite:x",
                "--consumer",
                "c",
                "--force",
                "a",
            ],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn times_in_utc() {
        assert_eq!(utc(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let at = UNIX_EPOCH + Duration::from_micros(1_000_000_000_123_456);
        assert_eq!(utc(at), "2001-09-09T01:46:40.123456Z");
        let before = UNIX_EPOCH - Duration::from_micros(14_182_939_500_000);
        assert_eq!(utc(before), "1969-07-20T20:17:40.500000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(utc(leap), "2000-02-29T00:00:00.000000Z");
    }
}
