//! `dedup`: the operator's command for the tables [dedup-runtime] keeps — the dedup table,
//! the inbox, the outbox — on PostgreSQL, MySQL/MariaDB or SQLite, picked by the URL.
//!
//! ```text
//! cargo install --path dedup-cli          # from a clone: installs `dedup`
//! export DATABASE_URL=postgres://postgres@127.0.0.1:5432/test
//!
//! dedup prune --older-than 7d --redelivery-window 2d [--dry-run]
//! dedup ids lookup --consumer billing evt_91c2
//! dedup ids forget --consumer billing evt_91c2          # a deliberate replay
//! dedup inbox stats                                      # per consumer: pending, in flight, dead, oldest
//! dedup inbox dead --consumer billing --error-contains timeout
//! dedup inbox requeue --consumer billing --error-contains timeout --redelivery-window 7d
//! dedup inbox discard --consumer billing --id evt_91c2
//! dedup outbox discard --row 42 --row 43
//! dedup outbox prune --older-than 14d                    # sent rows, in batches
//! dedup unknown list
//! dedup unknown resolve --consumer payments --as done evt_7
//! dedup console --listen 127.0.0.1:8080 [--read-only]   # the web console and its JSON API
//! ```
//!
//! Exit status: 0 when done, 1 when the database fails, 2 for bad arguments or a refused
//! action (a missing table included: the message says how to create it).
//!
//! Requeues, discards and resolves each act once per request id (below). Requeues and
//! discards act on **every dead row the filter matches** (`--consumer`,
//! `--error-contains`, `--older-than`) or on the rows named with `--row`; with neither they
//! are refused unless `--all` says so; `--id` and `--row` name rows one by one. Each runs in one transaction with a request id
//! recorded beside it in the table `dedup_operator_actions` (the same dedup record that
//! makes message handlers effectively-once): pass `--request-id` to make a scripted retry
//! act once. A requeue leaves dead every row older than its consumer's redelivery window
//! (`--redelivery-window`, default 7d; `--window consumer=AGE` per consumer): downstream
//! consumers no longer recognise ids they have pruned, so a replay would be a second
//! effect there.
//!
//! [dedup-runtime]: https://docs.rs/dedup-runtime

#![deny(missing_docs)]

mod actions;
mod commands;
pub mod console;
mod db;
pub mod text;

use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use actions::{Action, ActionError, ActionKind, Done, FilterSpec};
pub use db::Pools;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "dedup",
    version,
    about = "Operate dedup's tables: prune, look up, requeue, discard, resolve; a web console."
)]
pub struct Cli {
    /// postgres://…, mysql://… (mariadb://…) or sqlite:… (an existing file).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Deletes processed message ids the broker can no longer redeliver, in short batches.
    Prune(PruneArgs),
    /// Single message ids: whether processed and when (`lookup`), a deliberate replay (`forget`).
    Ids(IdsArgs),
    /// An inbox table: stats, dead rows, requeue, discard, prune.
    Inbox(QueueArgs),
    /// An outbox table: stats, dead rows, requeue, discard, prune.
    Outbox(QueueArgs),
    /// Effects whose outcome is unknown (mark-first rows whose call never completed): list, resolve.
    Unknown(UnknownArgs),
    /// The web console and its JSON API.
    Console(ConsoleArgs),
}

/// `dedup prune`.
#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete ids processed more than AGE ago (7d, 36h, 1d12h, 90s, 250ms).
    #[arg(long, value_parser = text::parse_duration)]
    pub older_than: Duration,
    /// How long after a first delivery the broker may still redeliver (refused if longer than --older-than).
    #[arg(long, value_parser = text::parse_duration)]
    pub redelivery_window: Duration,
    /// Only this consumer's ids.
    #[arg(long)]
    pub consumer: Option<String>,
    /// The dedup table.
    #[arg(long, default_value = dedup_runtime::DEFAULT_TABLE)]
    pub table: String,
    /// Ids per batch (one transaction each).
    #[arg(long)]
    pub batch_size: Option<u32>,
    /// A fixed pause between batches (default: rest as long as the batch took).
    #[arg(long, value_parser = text::parse_duration)]
    pub pause: Option<Duration>,
    /// Show what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `dedup ids`.
#[derive(Debug, Args)]
pub struct IdsArgs {
    /// lookup or forget.
    #[arg(value_enum)]
    pub action: IdsAction,
    /// The handler's `consumer = "…"`.
    #[arg(long)]
    pub consumer: String,
    /// The dedup table.
    #[arg(long, default_value = dedup_runtime::DEFAULT_TABLE)]
    pub table: String,
    /// Ids as the handler records them, byte for byte (`--` before one that starts with `-`).
    #[arg(required = true)]
    pub ids: Vec<String>,
}

/// What `dedup ids` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum IdsAction {
    /// Whether the consumer processed each id, and when.
    Lookup,
    /// Deletes each id's record: its next delivery runs the handler again (a replay).
    Forget,
}

/// `dedup inbox` and `dedup outbox`.
#[derive(Debug, Args)]
pub struct QueueArgs {
    /// stats, dead, requeue, discard or prune.
    #[arg(value_enum)]
    pub action: QueueAction,
    /// The table (default: inbox_messages or outbox_messages).
    #[arg(long)]
    pub table: Option<String>,
    /// Which dead rows.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// dead: rows per page.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// dead: the page after this row number.
    #[arg(long)]
    pub after: Option<i64>,
    /// requeue, discard: act on every dead row of the table (no filter, no --row).
    #[arg(long)]
    pub all: bool,
    /// requeue: how long consumers downstream remember ids, older rows stay dead; prune:
    /// how long the broker may redeliver.
    #[arg(long, value_parser = text::parse_duration, default_value = "7d", value_name = "AGE")]
    pub redelivery_window: Duration,
    /// requeue: a window for one consumer's rows, `consumer=AGE` (repeatable).
    #[arg(long = "window", value_parser = parse_consumer_window, value_name = "CONSUMER=AGE")]
    pub windows: Vec<(String, Duration)>,
    /// requeue, discard: the request id that makes a retry act once (default: a new one).
    #[arg(long)]
    pub request_id: Option<String>,
}

/// Which dead rows: every part given must hold.
#[derive(Debug, Args, Clone, Default)]
pub struct FilterArgs {
    /// Only this consumer's rows.
    #[arg(long, value_name = "NAME")]
    pub consumer: Option<String>,
    /// Only rows whose last error contains TEXT (case-sensitive).
    #[arg(long, value_name = "TEXT")]
    pub error_contains: Option<String>,
    /// Only rows that came in at least AGE ago (prune: processed or sent AGE ago).
    #[arg(long, value_parser = text::parse_duration, value_name = "AGE")]
    pub older_than: Option<Duration>,
    /// Only this row (its number in `dead`'s first column; repeatable).
    #[arg(long = "row", value_name = "ROW")]
    pub rows: Vec<i64>,
    /// Only the row with this id: the inbox's message id, the outbox's outgoing id (repeatable).
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<String>,
}

/// What `dedup inbox` and `dedup outbox` do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QueueAction {
    /// Rows by state per consumer, the oldest pending row's age.
    Stats,
    /// The dead rows, with attempts, last error, payload and headers.
    Dead,
    /// Dead rows back to pending, due now, attempts 0 (within the redelivery window).
    Requeue,
    /// Dead rows recorded as done without running or sending them.
    Discard,
    /// Deletes rows processed (inbox) or sent (outbox) more than --older-than ago, in
    /// batches; refused below --redelivery-window.
    Prune,
}

/// `dedup unknown`.
#[derive(Debug, Args)]
pub struct UnknownArgs {
    /// list or resolve.
    #[arg(value_enum)]
    pub action: UnknownAction,
    /// list: only this consumer's; resolve: the consumer (required).
    #[arg(long)]
    pub consumer: Option<String>,
    /// The dedup table.
    #[arg(long, default_value = dedup_runtime::DEFAULT_TABLE)]
    pub table: String,
    /// resolve: `done` (the effect happened) or `retry` (it did not: the next delivery runs it).
    #[arg(long = "as", value_enum)]
    pub resolution: Option<ResolveAs>,
    /// list: at most this many per consumer.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    /// resolve: the request id that makes a retry act once (default: a new one).
    #[arg(long)]
    pub request_id: Option<String>,
    /// resolve: the message ids.
    pub ids: Vec<String>,
}

/// What `dedup unknown` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum UnknownAction {
    /// The rows whose outcome is unknown, or whose lease ended, per consumer.
    List,
    /// Resolves rows the way the operator decided.
    Resolve,
}

/// How an unknown outcome is resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResolveAs {
    /// The effect happened: recorded as processed.
    Done,
    /// It did not: the row is deleted, the next delivery runs the handler.
    Retry,
}

/// `dedup console`.
#[derive(Debug, Args, Clone)]
pub struct ConsoleArgs {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Show, never change: no action, no table created.
    #[arg(long)]
    pub read_only: bool,
    /// Inbox tables to show (repeatable; default: inbox_messages).
    #[arg(long = "inbox-table")]
    pub inbox_tables: Vec<String>,
    /// Outbox tables to show (repeatable; default: outbox_messages).
    #[arg(long = "outbox-table")]
    pub outbox_tables: Vec<String>,
    /// The dedup table (ids per consumer, unknown outcomes).
    #[arg(long, default_value = dedup_runtime::DEFAULT_TABLE)]
    pub table: String,
    /// How long consumers downstream remember ids: requeues of older rows are refused.
    #[arg(long, value_parser = text::parse_duration, default_value = "7d")]
    pub redelivery_window: Duration,
    /// A window for one consumer's rows, `consumer=AGE` (repeatable).
    #[arg(long = "window", value_parser = parse_consumer_window)]
    pub windows: Vec<(String, Duration)>,
    /// The bearer token the console requires (pages: a login form; API: `Authorization: Bearer`).
    #[arg(long, env = "DEDUP_CONSOLE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

fn parse_consumer_window(text: &str) -> Result<(String, Duration), String> {
    let (consumer, age) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}`: expected consumer=AGE, e.g. billing=14d"))?;
    Ok((consumer.to_owned(), text::parse_duration(age)?))
}

/// Runs the command line `args` (the program's name first), writing to `out` and `err`;
/// the exit status: 0 done, 1 the database failed, 2 bad arguments or refused.
pub async fn run(
    args: impl IntoIterator<Item = impl Into<OsString> + Clone>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> u8 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() { 2 } else { 0 };
            let text = error.render().to_string();
            let _ = if code == 0 {
                write!(out, "{text}")
            } else {
                write!(err, "{text}")
            };
            return code;
        }
    };
    match commands::dispatch(cli, out).await {
        Ok(()) => 0,
        Err(failure) => {
            let _ = writeln!(err, "dedup: {}", failure.message);
            failure.code
        }
    }
}

/// Why a command failed, and its exit status.
#[derive(Debug)]
pub struct Failure {
    /// 1: the database failed; 2: bad arguments or refused.
    pub code: u8,
    /// What to tell the operator.
    pub message: String,
}

impl Failure {
    pub(crate) fn usage(message: impl Into<String>) -> Failure {
        Failure {
            code: 2,
            message: message.into(),
        }
    }

    pub(crate) fn database(message: impl std::fmt::Display) -> Failure {
        Failure {
            code: 1,
            message: message.to_string(),
        }
    }
}
