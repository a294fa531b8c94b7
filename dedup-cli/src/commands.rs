//! The subcommands other than the console: each parses nothing (clap did), connects, runs
//! generic code on the backend, and prints.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::operate::{DeadLetters, DeadRow, RowHeaders};
use dedup_runtime::{
    Backend, Ledger, LedgerError, MessageId, Prune, PruneError, Resolution, UnresolvedStatus,
};
use sqlx::Pool;

use crate::actions::{
    Act, Action, ActionError, ActionKind, FilterSpec, ResolveAction, new_request_id,
};
use crate::db::{Pools, with_pool};
use crate::text::{Bar, Preview, count, human, table, terminal_safe, thousands};
use crate::{
    Cli, Command, Failure, IdsAction, IdsArgs, PruneArgs, QueueAction, QueueArgs, ResolveAs,
    UnknownAction, UnknownArgs,
};

type Out<'a> = &'a mut dyn Write;

fn io(error: std::io::Error) -> Failure {
    Failure::database(format!("cannot write: {error}"))
}

pub(crate) async fn dispatch(cli: Cli, out: Out<'_>) -> Result<(), Failure> {
    let url = cli
        .database_url
        .ok_or_else(|| Failure::usage("`--database-url` (or DATABASE_URL) is required"))?;
    match cli.command {
        Command::Prune(args) => {
            // Refused settings are reported before connecting.
            build_prune(&args)?.check().map_err(prune_failure)?;
            let pools = Pools::connect(&url, 2).await?;
            with_pool!(&pools, |pool| prune(pool, &args, out).await)
        }
        Command::Ids(args) => {
            // Every id is checked before connecting, so that none is forgotten when one is bad.
            for id in &args.ids {
                MessageId::borrowed(id)
                    .validate()
                    .map_err(|error| Failure::usage(format!("`{id}`: {error}")))?;
            }
            let pools = Pools::connect(&url, 1).await?;
            with_pool!(&pools, |pool| ids(pool, &args, out).await)
        }
        Command::Inbox(args) => {
            let pools = Pools::connect(&url, 2).await?;
            with_pool!(&pools, |pool| queue(pool, "inbox", &args, out).await)
        }
        Command::Outbox(args) => {
            let pools = Pools::connect(&url, 2).await?;
            with_pool!(&pools, |pool| queue(pool, "outbox", &args, out).await)
        }
        Command::Unknown(args) => {
            let pools = Pools::connect(&url, 2).await?;
            with_pool!(&pools, |pool| unknown(pool, &args, out).await)
        }
        Command::Console(args) => {
            let pools = Pools::connect(&url, 5).await?;
            crate::console::serve(pools, args, out).await
        }
    }
}

fn build_prune(args: &PruneArgs) -> Result<Prune, Failure> {
    let mut prune = Prune::new(args.older_than, args.redelivery_window)
        .in_table(&args.table)
        .map_err(|error| Failure::usage(error.to_string()))?;
    if let Some(consumer) = &args.consumer {
        prune = prune.consumer(consumer.as_str());
    }
    if let Some(rows) = args.batch_size {
        prune = prune.batch_size(rows);
    }
    if let Some(pause) = args.pause {
        prune = prune.pause(pause);
    }
    Ok(prune)
}

fn prune_failure(error: PruneError) -> Failure {
    match error {
        PruneError::WindowTooShort {
            older_than,
            redelivery_window,
        } => Failure::usage(format!(
            "refused: ids younger than the redelivery window ({}) would be deleted with \
             --older-than {}; a redelivered message would be processed twice. Prune at {} or more.",
            human(redelivery_window),
            human(older_than),
            human(redelivery_window),
        )),
        PruneError::Database(error) => Failure::database(error),
        other => Failure::usage(other.to_string()),
    }
}

fn print_prune_stats(
    out: Out<'_>,
    title: &str,
    stats: &[dedup_runtime::ConsumerStats],
    planned: bool,
) -> std::io::Result<()> {
    writeln!(out, "{title}")?;
    if stats.is_empty() {
        return writeln!(out, "  (no ids)");
    }
    if planned {
        let rows: Vec<Vec<String>> = stats
            .iter()
            .map(|c| {
                vec![
                    c.consumer.clone(),
                    thousands(c.ids),
                    human(c.oldest),
                    thousands(c.prunable),
                    thousands(c.kept()),
                    c.oldest_kept.map_or_else(|| "-".to_owned(), human),
                ]
            })
            .collect();
        let head = [
            "consumer",
            "ids",
            "oldest",
            "to delete",
            "to keep",
            "oldest kept",
        ];
        table(out, &head, &rows)?;
    } else {
        let rows: Vec<Vec<String>> = stats
            .iter()
            .map(|c| vec![c.consumer.clone(), thousands(c.ids), human(c.oldest)])
            .collect();
        table(out, &["consumer", "ids kept", "oldest"], &rows)?;
    }
    // Rows whose outcome is not settled are never pruned: say so, so that an operator
    // sees what waits for them.
    for consumer in stats.iter().filter(|c| c.unresolved > 0) {
        writeln!(
            out,
            "  {}: {} not processed (in progress or outcome unknown), kept at any age \
             (`dedup unknown list`)",
            terminal_safe(&consumer.consumer),
            count(consumer.unresolved, "id", "ids"),
        )?;
    }
    Ok(())
}

async fn prune<DB: Backend>(
    pool: &Pool<DB>,
    args: &PruneArgs,
    out: Out<'_>,
) -> Result<(), Failure> {
    let prune = build_prune(args)?;
    let before = prune.stats(pool).await.map_err(prune_failure)?;
    let title = format!(
        "{}: ids processed more than {} ago are deleted (redelivery window {})",
        args.table,
        human(args.older_than),
        human(args.redelivery_window)
    );
    print_prune_stats(out, &title, &before, true).map_err(io)?;
    let total: u64 = before.iter().map(|c| c.prunable).sum();
    if args.dry_run {
        writeln!(
            out,
            "dry run: {} would be deleted; nothing was.",
            count(total, "id", "ids")
        )
        .map_err(io)?;
        return Ok(());
    }
    let mut stderr = std::io::stderr();
    let mut bar = Bar::new(total, ("id", "ids"), &mut stderr);
    let done = prune
        .run(pool, |progress| {
            bar.draw(progress.deleted, progress.batches, progress.done)
        })
        .await
        .map_err(prune_failure)?;
    writeln!(
        out,
        "deleted {} processed before {} in {} ({}/s, {})",
        count(done.deleted, "id", "ids"),
        done.cutoff,
        human(done.elapsed),
        thousands(done.rate() as u64),
        count(done.batches, "batch", "batches"),
    )
    .map_err(io)?;
    let after = prune.stats(pool).await.map_err(prune_failure)?;
    print_prune_stats(out, "kept:", &after, false).map_err(io)
}

fn ledger_failure(error: LedgerError) -> Failure {
    match error {
        LedgerError::Database(error) => Failure::database(error),
        other => Failure::usage(other.to_string()),
    }
}

fn ledger<DB: Backend>(pool: &Pool<DB>, table: &str) -> Result<Ledger<DB>, Failure> {
    Ledger::new(pool)
        .in_table(table)
        .map_err(|error| Failure::usage(error.to_string()))
}

async fn ids<DB: Backend>(pool: &Pool<DB>, args: &IdsArgs, out: Out<'_>) -> Result<(), Failure> {
    let ledger = ledger(pool, &args.table)?;
    let consumer = args.consumer.as_str();
    let width = args
        .ids
        .iter()
        .map(|id| id.chars().count())
        .max()
        .unwrap_or(0)
        .min(40);
    let mut forgotten = 0;
    for (n, id) in args.ids.iter().enumerate() {
        let at = ledger
            .processed_at(consumer, id.as_str())
            .await
            .map_err(ledger_failure)?;
        // After the first answer: a missing table or a bad consumer has no header.
        if n == 0 {
            writeln!(out, "{}, consumer {}:", args.table, terminal_safe(consumer)).map_err(io)?;
        }
        let shown = terminal_safe(id);
        match args.action {
            IdsAction::Lookup => match at {
                Some(at) => writeln!(out, "  {shown:<width$}  processed {}", utc(at)),
                None => writeln!(
                    out,
                    "  {shown:<width$}  no record (never processed, pruned or forgotten)"
                ),
            }
            .map_err(io)?,
            IdsAction::Forget => {
                if ledger
                    .forget(consumer, id.as_str())
                    .await
                    .map_err(ledger_failure)?
                {
                    forgotten += 1;
                    let when =
                        at.map_or_else(String::new, |at| format!(" (processed {})", utc(at)));
                    writeln!(out, "  {shown:<width$}  forgotten{when}").map_err(io)?;
                } else {
                    writeln!(out, "  {shown:<width$}  no record; nothing forgotten").map_err(io)?;
                }
            }
        }
    }
    if args.action == IdsAction::Forget {
        writeln!(
            out,
            "{forgotten} of {} ids forgotten: their next delivery runs the handler again.",
            args.ids.len()
        )
        .map_err(io)?;
    }
    Ok(())
}

/// `2026-11-12T07:35:19.681609Z`: a time in UTC, to the microsecond.
pub(crate) fn utc(time: SystemTime) -> String {
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

fn dead_letters(queue: &str, table: Option<&str>) -> Result<DeadLetters, Failure> {
    let table = table.unwrap_or(if queue == "inbox" {
        dedup_runtime::inbox::DEFAULT_TABLE
    } else {
        dedup_runtime::outbox::DEFAULT_TABLE
    });
    // One byte past the preview: enough to know that it is cut.
    crate::actions::dead_letters(queue, table)
        .map(|letters| letters.payload_preview(PREVIEW + 1))
        .map_err(Failure::usage)
}

/// The payload bytes `dedup … dead` shows of each row.
const PREVIEW: usize = 512;

pub(crate) fn operate_failure(error: dedup_runtime::operate::OperateError) -> Failure {
    match error {
        dedup_runtime::operate::OperateError::Database(error) => Failure::database(error),
        other => Failure::usage(other.to_string()),
    }
}

pub(crate) fn action_failure(error: ActionError) -> Failure {
    match error {
        ActionError::Database(error) => Failure::database(error),
        other => Failure::usage(other.to_string()),
    }
}

async fn queue<DB: Act>(
    pool: &Pool<DB>,
    queue: &str,
    args: &QueueArgs,
    out: Out<'_>,
) -> Result<(), Failure> {
    let letters = dead_letters(queue, args.table.as_deref())?;
    let name = letters.table().name().to_owned();
    let spec = FilterSpec {
        consumer: args.filter.consumer.clone(),
        error_contains: args.filter.error_contains.clone(),
        older_than_s: args.filter.older_than.map(|age| age.as_secs()),
        rows: (!args.filter.rows.is_empty()).then(|| args.filter.rows.clone()),
        ids: (!args.filter.ids.is_empty()).then(|| args.filter.ids.clone()),
    };
    let mut conn = pool.acquire().await.map_err(Failure::database)?;
    match args.action {
        QueueAction::Stats => {
            let summary = letters
                .summary::<DB>(&mut conn)
                .await
                .map_err(operate_failure)?;
            writeln!(out, "{queue} {name}:").map_err(io)?;
            if summary.is_empty() {
                writeln!(out, "  (no rows)").map_err(io)?;
            }
            let rows: Vec<Vec<String>> = summary
                .iter()
                .map(|c| {
                    vec![
                        c.consumer.clone(),
                        thousands(c.pending),
                        thousands(c.in_flight),
                        thousands(c.done),
                        thousands(c.dead),
                        c.oldest_pending.map_or_else(|| "-".to_owned(), human),
                    ]
                })
                .collect();
            let done = if queue == "inbox" {
                "processed"
            } else {
                "sent"
            };
            table(
                out,
                &[
                    "consumer",
                    "pending",
                    "in flight",
                    done,
                    "dead",
                    "oldest pending",
                ],
                &rows,
            )
            .map_err(io)?;
            if queue == "outbox" {
                let outbox = dedup_runtime::outbox::Outbox::new()
                    .in_table(&name)
                    .map_err(|error| Failure::usage(error.to_string()))?;
                let stats = outbox.stats(pool).await.map_err(Failure::database)?;
                match stats.relay_last_seen {
                    Some(ago) => writeln!(out, "a relay last ran {} ago", human(ago)),
                    None => writeln!(out, "no relay has ever run on this table"),
                }
                .map_err(io)?;
            }
            Ok(())
        }
        QueueAction::Dead => {
            let filter = spec.filter();
            let total = letters
                .count::<DB>(&mut conn, &filter)
                .await
                .map_err(operate_failure)?;
            let rows = letters
                .list::<DB>(&mut conn, &filter, args.after, args.limit)
                .await
                .map_err(operate_failure)?;
            writeln!(
                out,
                "{queue} {name}: {} matching",
                count(total, "dead row", "dead rows")
            )
            .map_err(io)?;
            for row in &rows {
                print_dead(out, row).map_err(io)?;
            }
            if let Some(last) = rows.last()
                && rows.len() as u64 == u64::from(args.limit)
            {
                writeln!(out, "more: --after {}", last.row).map_err(io)?;
            }
            Ok(())
        }
        QueueAction::Prune => {
            drop(conn);
            let older_than = args.filter.older_than.ok_or_else(|| {
                Failure::usage(
                    "`--older-than` is required: prune rows processed or sent that long ago",
                )
            })?;
            let prune = Prune::new(older_than, args.redelivery_window);
            prune.check().map_err(prune_failure)?;
            let mut deleted = 0;
            if queue == "outbox" {
                let outbox = dedup_runtime::outbox::Outbox::new()
                    .in_table(&name)
                    .map_err(|error| Failure::usage(error.to_string()))?;
                let mut stderr = std::io::stderr();
                let mut bar = Bar::new(0, ("row", "rows"), &mut stderr);
                let done = prune
                    .run_outbox(&outbox, pool, |p| bar.draw(p.deleted, p.batches, p.done))
                    .await
                    .map_err(prune_failure)?;
                deleted += done.deleted;
            } else {
                let consumers = match &args.filter.consumer {
                    Some(consumer) => vec![consumer.clone()],
                    None => {
                        let mut conn = pool.acquire().await.map_err(Failure::database)?;
                        let summary = letters
                            .summary::<DB>(&mut conn)
                            .await
                            .map_err(operate_failure)?;
                        summary.into_iter().map(|c| c.consumer).collect()
                    }
                };
                for consumer in consumers {
                    let inbox = dedup_runtime::inbox::Inbox::new(pool, &consumer)
                        .map_err(|error| Failure::usage(error.to_string()))?
                        .in_table(&name)
                        .map_err(|error| Failure::usage(error.to_string()))?;
                    let mut stderr = std::io::stderr();
                    let mut bar = Bar::new(0, ("row", "rows"), &mut stderr);
                    let done = prune
                        .run_inbox(&inbox, |p| bar.draw(p.deleted, p.batches, p.done))
                        .await
                        .map_err(prune_failure)?;
                    deleted += done.deleted;
                }
            }
            let what = if queue == "inbox" {
                "processed"
            } else {
                "sent"
            };
            writeln!(
                out,
                "{queue} {name}: {} {what} more than {} ago deleted",
                count(deleted, "row", "rows"),
                human(older_than)
            )
            .map_err(io)
        }
        QueueAction::Requeue | QueueAction::Discard => {
            if spec.is_everything() && !args.all {
                return Err(Failure::usage(
                    "no rows named: pass --id or --row, a filter (--consumer, --error-contains, \
                     --older-than), or --all for every dead row",
                ));
            }
            let kind = if args.action == QueueAction::Requeue {
                ActionKind::Requeue
            } else {
                ActionKind::Discard
            };
            let action = Action {
                queue: queue.to_owned(),
                table: name.clone(),
                kind,
                filter: spec,
                window_s: args.redelivery_window.as_secs(),
                windows_s: args
                    .windows
                    .iter()
                    .map(|(c, w)| (c.clone(), w.as_secs()))
                    .collect(),
            };
            drop(conn);
            let request = args.request_id.clone().unwrap_or_else(new_request_id);
            crate::actions::check_request_id(&request).map_err(Failure::usage)?;
            dedup_runtime::migrate_table(pool, crate::actions::ACTIONS_TABLE)
                .await
                .map_err(Failure::database)?;
            let done = DB::act(pool, &request, &action)
                .await
                .map_err(action_failure)?;
            let verb = if kind == ActionKind::Requeue {
                "re-queued"
            } else {
                "discarded"
            };
            let again = if done.replayed {
                " (request already done: nothing more was changed)"
            } else {
                ""
            };
            writeln!(
                out,
                "{queue} {name}: {} of {} matching dead rows {verb}{again}",
                thousands(done.done),
                thousands(done.matched),
            )
            .map_err(io)?;
            if done.refused > 0 {
                writeln!(
                    out,
                    "{} left dead: older than the redelivery window ({}); consumers downstream \
                     may have pruned their ids and would process a replay as new. Discard them, \
                     or pass a longer --redelivery-window if downstream keeps ids longer.",
                    count(done.refused, "row", "rows"),
                    human(args.redelivery_window),
                )
                .map_err(io)?;
            }
            writeln!(out, "request id {request}").map_err(io)
        }
    }
}

fn print_dead(out: Out<'_>, row: &DeadRow) -> std::io::Result<()> {
    let to = row
        .destination
        .as_ref()
        .map_or_else(String::new, |d| format!("  to {}", terminal_safe(d)));
    writeln!(
        out,
        "row {}  {}  consumer {}{to}  {} ago  after {}: {}",
        row.row,
        terminal_safe(&row.id),
        terminal_safe(&row.consumer),
        human(row.age),
        count(u64::from(row.attempts), "attempt", "attempts"),
        terminal_safe(row.last_error.as_deref().unwrap_or("(no error text)")),
    )?;
    match &row.headers {
        RowHeaders::None => {}
        RowHeaders::Pairs(pairs) => {
            for (name, value) in pairs {
                writeln!(
                    out,
                    "    header {}: {}",
                    terminal_safe(name),
                    terminal_safe(&String::from_utf8_lossy(value))
                )?;
            }
        }
        RowHeaders::Opaque(bytes) => {
            writeln!(out, "    headers: {} bytes", bytes.len())?;
        }
    }
    let (preview, cut) = Preview::of(&row.payload, PREVIEW);
    let more = if cut { " (first 512 bytes)" } else { "" };
    writeln!(
        out,
        "    payload, {} bytes, {}{more}:",
        row.payload_len,
        preview.kind()
    )?;
    for line in preview.text().lines() {
        writeln!(out, "      {}", terminal_safe(line))?;
    }
    Ok(())
}

/// The consumers of the dedup table with rows whose outcome is not settled.
pub(crate) async fn unresolved_consumers<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
) -> Result<Vec<dedup_runtime::ConsumerStats>, Failure> {
    let day = Duration::from_secs(86_400);
    let prune = Prune::new(day, day)
        .in_table(table)
        .map_err(|error| Failure::usage(error.to_string()))?;
    prune.stats(pool).await.map_err(prune_failure)
}

async fn unknown<DB: Act>(
    pool: &Pool<DB>,
    args: &UnknownArgs,
    out: Out<'_>,
) -> Result<(), Failure> {
    let ledger = ledger(pool, &args.table)?;
    match args.action {
        UnknownAction::List => {
            let consumers = match &args.consumer {
                Some(consumer) => vec![consumer.clone()],
                None => unresolved_consumers(pool, &args.table)
                    .await?
                    .into_iter()
                    .filter(|c| c.unresolved > 0)
                    .map(|c| c.consumer)
                    .collect(),
            };
            let mut rows = Vec::new();
            for consumer in consumers {
                for stuck in ledger
                    .unresolved(&consumer, args.limit)
                    .await
                    .map_err(ledger_failure)?
                {
                    let status = match stuck.status() {
                        UnresolvedStatus::OutcomeUnknown => "outcome unknown".to_owned(),
                        UnresolvedStatus::LeaseExpired => "lease expired".to_owned(),
                        UnresolvedStatus::InProgress { remaining } => {
                            format!("in progress, lease {} left", human(remaining))
                        }
                        _ => "unresolved".to_owned(),
                    };
                    rows.push(vec![
                        consumer.clone(),
                        stuck.message_id().to_owned(),
                        status,
                    ]);
                }
            }
            if rows.is_empty() {
                return writeln!(out, "{}: no unresolved ids", args.table).map_err(io);
            }
            table(out, &["consumer", "message id", "status"], &rows).map_err(io)
        }
        UnknownAction::Resolve => {
            let consumer = args
                .consumer
                .as_deref()
                .ok_or_else(|| Failure::usage("`--consumer` is required to resolve"))?;
            let resolution = match args.resolution {
                Some(ResolveAs::Done) => Resolution::Done,
                Some(ResolveAs::Retry) => Resolution::Retry,
                None => {
                    return Err(Failure::usage(
                        "`--as done` (the effect happened) or `--as retry` (it did not) is required",
                    ));
                }
            };
            if args.ids.is_empty() {
                return Err(Failure::usage("no message id given"));
            }
            for id in &args.ids {
                MessageId::borrowed(id)
                    .validate()
                    .map_err(|error| Failure::usage(format!("`{id}`: {error}")))?;
            }
            let request = args.request_id.clone().unwrap_or_else(new_request_id);
            crate::actions::check_request_id(&request).map_err(Failure::usage)?;
            let action = ResolveAction {
                table: args.table.clone(),
                consumer: consumer.to_owned(),
                ids: args.ids.clone(),
                resolution: args.resolution.expect("checked above"),
            };
            dedup_runtime::migrate_table(pool, crate::actions::ACTIONS_TABLE)
                .await
                .map_err(Failure::database)?;
            let done = DB::resolve_unknown(pool, &request, &action)
                .await
                .map_err(action_failure)?;
            for (id, resolved) in args.ids.iter().zip(done.resolved) {
                let what = match (resolved, resolution) {
                    (true, Resolution::Done) => "resolved: recorded as processed",
                    (true, _) => "resolved: deleted, its next delivery runs the handler",
                    (false, _) => "nothing to resolve (no row, processed, or its lease still runs)",
                };
                writeln!(out, "  {}  {what}", terminal_safe(id)).map_err(io)?;
            }
            if done.replayed {
                writeln!(out, "(request already done: nothing more was changed)").map_err(io)?;
            }
            writeln!(out, "request id {request}").map_err(io)?;
            Ok(())
        }
    }
}
