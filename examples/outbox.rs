//! The operator's command for an outbox: how it stands (`stats`, with the relay's last
//! sign of life), its dead messages with their last error (`dead`), putting dead ones
//! back (`requeue`) or recording them as sent without sending them (`discard`), and
//! deleting old sent rows (`prune`).
//!
//! ```text
//! cargo run --example outbox -- stats   --database-url postgres://postgres@127.0.0.1:5432/test
//! cargo run --example outbox -- dead    --database-url … [--limit 100]
//! cargo run --example outbox -- requeue --database-url … 0f8b… [1c2d… …]
//! cargo run --example outbox -- discard --database-url … 0f8b…
//! cargo run --example outbox -- prune   --database-url … --older-than-hours 168
//! ```
//!
//! `--database-url` (or `DATABASE_URL`) picks the backend by its scheme: `postgres://`,
//! `mysql://` / `mariadb://`, or `sqlite:` (an existing file). `--table` names an outbox
//! table other than `outbox_messages`. Ids are the outgoing ids, as `dead` lists them.
//!
//! Exit status: 0 when done, 1 when the database fails, 2 for bad arguments (an invalid id,
//! a table that does not exist).

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use dedup_runtime::Backend;
use dedup_runtime::outbox::{Outbox, OutboxError, OutgoingId};
use sqlx::Pool;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

const USAGE: &str = "\
usage: outbox stats   --database-url URL [--table NAME]
       outbox dead    --database-url URL [--table NAME] [--limit N]
       outbox requeue --database-url URL [--table NAME] ID...
       outbox discard --database-url URL [--table NAME] ID...
       outbox prune   --database-url URL [--table NAME] --older-than-hours H

stats:   unsent, claimed, sent and dead messages, the oldest unsent one's age, and when a
         relay last ran.
dead:    the dead messages, oldest first, with their attempts and last error.
requeue: each dead ID unsent again, due now, its attempts back to 0.
discard: each dead ID recorded as sent without sending it.
prune:   deletes the messages sent more than H hours ago.

  --database-url URL      postgres://…, mysql://… or sqlite:… (default: $DATABASE_URL)
  --table NAME            the outbox table (default: outbox_messages)
  --limit N               dead: how many to list (default: 100)
  --older-than-hours H    prune: the age of the sent rows to delete
  -h, --help              this text";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Stats,
    Dead,
    Requeue,
    Discard,
    Prune,
}

#[derive(Debug)]
struct Args {
    command: Command,
    database_url: String,
    table: Option<String>,
    limit: u32,
    older_than: Option<Duration>,
    ids: Vec<OutgoingId>,
}

/// Arguments, or the message to print before the usage.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut command, mut url, mut table, mut limit, mut older_than) =
        (None, None, None, 100, None);
    let mut ids = Vec::new();
    while let Some(arg) = args.next() {
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
            "--table" => table = Some(value()?),
            "--limit" => {
                let text = value()?;
                limit = u32::from_str(&text)
                    .map_err(|_| format!("`--limit` takes a whole number, not `{text}`"))?;
            }
            "--older-than-hours" => {
                let text = value()?;
                let hours = u64::from_str(&text).map_err(|_| {
                    format!("`--older-than-hours` takes a whole number, not `{text}`")
                })?;
                older_than = Some(Duration::from_secs(hours.saturating_mul(3_600)));
            }
            other if other.starts_with('-') => return Err(format!("unknown argument `{other}`")),
            _ if command.is_none() => {
                command = Some(match arg.as_str() {
                    "stats" => Command::Stats,
                    "dead" => Command::Dead,
                    "requeue" => Command::Requeue,
                    "discard" => Command::Discard,
                    "prune" => Command::Prune,
                    _ => {
                        return Err(format!(
                            "unknown command `{arg}`: expected `stats`, `dead`, `requeue`, \
                             `discard` or `prune`"
                        ));
                    }
                });
            }
            _ => {
                let id = uuid::Uuid::parse_str(&arg)
                    .map_err(|_| format!("`{arg}` is not an outgoing id (a UUID)"))?;
                ids.push(OutgoingId::from_uuid(id));
            }
        }
    }
    let command =
        command.ok_or("a command is required: `stats`, `dead`, `requeue`, `discard` or `prune`")?;
    let database_url = url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("`--database-url` (or DATABASE_URL) is required")?;
    match command {
        Command::Requeue | Command::Discard if ids.is_empty() => {
            return Err("no outgoing id given".to_owned());
        }
        Command::Prune if older_than.is_none() => {
            return Err("`prune` needs `--older-than-hours`".to_owned());
        }
        Command::Stats | Command::Dead | Command::Prune if !ids.is_empty() => {
            return Err(format!("`{}` takes no id", ids[0]));
        }
        _ => {}
    }
    Ok(Some(Args {
        command,
        database_url,
        table,
        limit,
        older_than,
        ids,
    }))
}

/// A duration for people: `3.2 s`, `4 min 10 s`, `2 h 5 min`.
fn age(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0..60 => format!("{:.1} s", duration.as_secs_f64()),
        60..3_600 => format!("{} min {} s", seconds / 60, seconds % 60),
        _ => format!("{} h {} min", seconds / 3_600, seconds / 60 % 60),
    }
}

async fn operate<DB: Backend>(pool: Pool<DB>, args: &Args) -> Result<(), Failure> {
    let outbox = match &args.table {
        Some(table) => Outbox::new()
            .in_table(table)
            .map_err(|error| Failure::Usage(error.to_string()))?,
        None => Outbox::new(),
    };
    let title = outbox.table().name().to_owned();
    match args.command {
        Command::Stats => {
            let stats = outbox.stats(&pool).await?;
            println!("{title}:");
            println!("  unsent   {:>10}", stats.unsent);
            println!("  claimed  {:>10}  (being sent)", stats.claimed);
            println!("  sent     {:>10}  (kept until pruned)", stats.sent);
            println!(
                "  dead     {:>10}  (see `dead`; `requeue` or `discard` them)",
                stats.dead
            );
            match stats.oldest_unsent {
                Some(oldest) => println!("  oldest unsent enqueued {} ago", age(oldest)),
                None => println!("  nothing unsent"),
            }
            match stats.relay_last_seen {
                Some(seen) => println!("  a relay last ran {} ago", age(seen)),
                None => println!("  no relay has ever run"),
            }
        }
        Command::Dead => {
            let dead = outbox.dead(&pool, args.limit).await?;
            println!(
                "{title}: {} dead message(s) listed (at most {})",
                dead.len(),
                args.limit
            );
            for message in dead {
                println!(
                    "  {}  to {}  after {} attempt(s): {}",
                    message.id,
                    message.destination,
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
                    outbox.requeue(&pool, *id).await?
                } else {
                    outbox.discard(&pool, *id).await?
                };
                let did = match (done, args.command) {
                    (false, _) => "not dead: left as it is",
                    (true, Command::Requeue) => "re-queued: the relay sends it",
                    (true, _) => "discarded: recorded as sent, not sent",
                };
                println!("  {id}  {did}");
            }
        }
        Command::Prune => {
            let older_than = args.older_than.expect("checked by parse_args");
            // A sent row keeps a handler that runs again for its cause from sending once
            // more; the operator's age is at least the broker's redelivery window.
            let done = dedup_runtime::Prune::new(older_than, older_than)
                .run_outbox(&outbox, &pool, |_| {})
                .await?;
            let deleted = done.deleted;
            println!(
                "{title}: {deleted} sent message(s) older than {} deleted",
                age(older_than)
            );
        }
    }
    Ok(())
}

/// How the command failed: bad arguments (2) or the database (1).
enum Failure {
    Usage(String),
    Database(String),
}

impl From<dedup_runtime::PruneError> for Failure {
    fn from(error: dedup_runtime::PruneError) -> Self {
        match error {
            dedup_runtime::PruneError::Database(_) => Failure::Database(error.to_string()),
            other => Failure::Usage(other.to_string()),
        }
    }
}

impl From<OutboxError> for Failure {
    fn from(error: OutboxError) -> Self {
        match error {
            OutboxError::Database(_) => Failure::Database(error.to_string()),
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
            eprintln!("outbox: {message}\n\n{USAGE}");
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
                eprintln!("outbox: {error}");
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
        eprintln!("outbox: `{url}` is not a postgres://, mysql:// or sqlite: URL");
        return ExitCode::from(2);
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            eprintln!("outbox: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Database(message)) => {
            eprintln!("outbox: the database failed: {message}");
            ExitCode::from(1)
        }
    }
}
