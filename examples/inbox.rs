//! The operator's command for one consumer's inbox: how it stands (`stats`), its dead
//! messages with their last error (`dead`), and putting dead ones back (`requeue`) or
//! recording them as done without running them (`discard`).
//!
//! ```text
//! cargo run --example inbox -- stats   --database-url postgres://postgres@127.0.0.1:5432/test --consumer billing
//! cargo run --example inbox -- dead    --database-url … --consumer billing [--limit 100]
//! cargo run --example inbox -- requeue --database-url … --consumer billing evt_91c2 [evt_91c3 …]
//! cargo run --example inbox -- discard --database-url … --consumer billing evt_91c2
//! ```
//!
//! `--database-url` (or `DATABASE_URL`) picks the backend by its scheme: `postgres://`,
//! `mysql://` / `mariadb://`, or `sqlite:` (an existing file). `--table` names an inbox
//! table other than `inbox_messages`.
//!
//! `requeue` makes a dead message pending again, due now, its attempts back to 0: a worker
//! processes it once. `discard` records it as processed without running it, its last
//! error kept, so that a redelivery of it is still a duplicate. Both act only on dead
//! messages, and say which ids were not dead.
//!
//! Exit status: 0 when done, 1 when the database fails, 2 for bad arguments (an invalid id
//! or consumer, a table that does not exist).

use std::process::ExitCode;
use std::str::FromStr;

use dedup_runtime::Backend;
use dedup_runtime::inbox::{Inbox, InboxError};
use sqlx::Pool;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

const USAGE: &str = "\
usage: inbox stats   --database-url URL --consumer NAME [--table NAME]
       inbox dead    --database-url URL --consumer NAME [--table NAME] [--limit N]
       inbox requeue --database-url URL --consumer NAME [--table NAME] ID...
       inbox discard --database-url URL --consumer NAME [--table NAME] ID...

stats:   pending, claimed, processed and dead messages, and the oldest pending one's age.
dead:    the dead messages, oldest first, with their attempts and last error.
requeue: each dead ID pending again, due now, its attempts back to 0.
discard: each dead ID recorded as processed without running it.

  --database-url URL   postgres://…, mysql://… or sqlite:… (default: $DATABASE_URL)
  --consumer NAME      the inbox's consumer
  --table NAME         the inbox table (default: inbox_messages)
  --limit N            dead: how many to list (default: 100)
  -h, --help           this text";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Stats,
    Dead,
    Requeue,
    Discard,
}

#[derive(Debug)]
struct Args {
    command: Command,
    database_url: String,
    consumer: String,
    table: Option<String>,
    limit: u32,
    ids: Vec<String>,
}

/// Arguments, or the message to print before the usage.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut command, mut url, mut consumer, mut table, mut limit) = (None, None, None, None, 100);
    let mut ids = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--" {
            ids.extend(args.by_ref());
            break;
        }
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
            "--limit" => {
                let text = value()?;
                limit = u32::from_str(&text)
                    .map_err(|_| format!("`--limit` takes a whole number, not `{text}`"))?;
            }
            other if other.starts_with('-') => return Err(format!("unknown argument `{other}`")),
            _ if command.is_none() => {
                command = Some(match arg.as_str() {
                    "stats" => Command::Stats,
                    "dead" => Command::Dead,
                    "requeue" => Command::Requeue,
                    "discard" => Command::Discard,
                    _ => {
                        return Err(format!(
                            "unknown command `{arg}`: expected `stats`, `dead`, `requeue` or \
                             `discard`"
                        ));
                    }
                });
            }
            _ => ids.push(arg),
        }
    }
    let command =
        command.ok_or("a command is required: `stats`, `dead`, `requeue` or `discard`")?;
    let database_url = url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("`--database-url` (or DATABASE_URL) is required")?;
    let consumer = consumer.ok_or("`--consumer` is required")?;
    match command {
        Command::Requeue | Command::Discard if ids.is_empty() => {
            return Err("no message id given".to_owned());
        }
        Command::Stats | Command::Dead if !ids.is_empty() => {
            return Err(format!("`{}` takes no message id", ids[0]));
        }
        _ => {}
    }
    Ok(Some(Args {
        command,
        database_url,
        consumer,
        table,
        limit,
        ids,
    }))
}

/// A duration for people: `3.2 s`, `4 min 10 s`, `2 h 5 min`.
fn age(duration: std::time::Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0..60 => format!("{:.1} s", duration.as_secs_f64()),
        60..3_600 => format!("{} min {} s", seconds / 60, seconds % 60),
        _ => format!("{} h {} min", seconds / 3_600, seconds / 60 % 60),
    }
}

async fn operate<DB: Backend>(pool: Pool<DB>, args: &Args) -> Result<(), Failure> {
    let inbox =
        Inbox::new(&pool, &args.consumer).map_err(|error| Failure::Usage(error.to_string()))?;
    let inbox = match &args.table {
        Some(table) => inbox
            .in_table(table)
            .map_err(|error| Failure::Usage(error.to_string()))?,
        None => inbox,
    };
    let title = format!("{}, consumer {}", inbox.table().name(), inbox.consumer());
    match args.command {
        Command::Stats => {
            let stats = inbox.stats().await?;
            println!("{title}:");
            println!("  pending    {:>10}", stats.pending);
            println!("  claimed    {:>10}  (in flight)", stats.claimed);
            println!(
                "  processed  {:>10}  (kept as the dedup record until pruned)",
                stats.processed
            );
            println!(
                "  dead       {:>10}  (see `dead`; `requeue` or `discard` them)",
                stats.dead
            );
            match stats.oldest_pending {
                Some(oldest) => println!("  oldest pending received {} ago", age(oldest)),
                None => println!("  nothing pending"),
            }
        }
        Command::Dead => {
            let dead = inbox.dead(args.limit).await?;
            println!(
                "{title}: {} dead message(s) listed (at most {})",
                dead.len(),
                args.limit
            );
            for message in dead {
                println!(
                    "  {}  after {} attempt(s): {}",
                    message.id,
                    message.attempts,
                    message
                        .last_error
                        .as_deref()
                        .unwrap_or("(no error recorded)")
                );
            }
        }
        Command::Requeue | Command::Discard => {
            println!("{title}:");
            for id in &args.ids {
                let done = if args.command == Command::Requeue {
                    inbox.requeue(id.as_str()).await?
                } else {
                    inbox.discard(id.as_str()).await?
                };
                let did = match (done, args.command) {
                    (false, _) => "not dead: left as it is",
                    (true, Command::Requeue) => "re-queued: a worker processes it once",
                    (true, _) => "discarded: recorded as processed, not run",
                };
                println!("  {id}  {did}");
            }
        }
    }
    Ok(())
}

/// How the command failed: bad arguments (2) or the database (1).
enum Failure {
    Usage(String),
    Database(String),
}

impl From<InboxError> for Failure {
    fn from(error: InboxError) -> Self {
        match error {
            InboxError::Database(_) => Failure::Database(error.to_string()),
            other => Failure::Usage(other.to_string()),
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("inbox: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let url = args.database_url.as_str();
    let result = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match PgPoolOptions::new().max_connections(1).connect(url).await {
            Ok(pool) => operate(pool, &args).await,
            Err(error) => Err(Failure::Database(error.to_string())),
        }
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let url = url.replacen("mariadb://", "mysql://", 1);
        match MySqlPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
        {
            Ok(pool) => operate(pool, &args).await,
            Err(error) => Err(Failure::Database(error.to_string())),
        }
    } else if url.starts_with("sqlite:") {
        let options = match SqliteConnectOptions::from_str(url) {
            Ok(options) => options.create_if_missing(false),
            Err(error) => {
                eprintln!("inbox: {error}");
                return ExitCode::from(2);
            }
        };
        match SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
        {
            Ok(pool) => operate(pool, &args).await,
            Err(error) => Err(Failure::Database(error.to_string())),
        }
    } else {
        eprintln!("inbox: `{url}` is not a postgres://, mysql:// or sqlite: URL");
        return ExitCode::from(2);
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            eprintln!("inbox: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Database(message)) => {
            eprintln!("inbox: the database failed: {message}");
            ExitCode::from(1)
        }
    }
}
