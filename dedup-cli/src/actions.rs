//! The operator's actions that change rows — requeue, discard, resolve — each run in an
//! `#[idempotent]` handler keyed by the action's request id, in the table
//! [`ACTIONS_TABLE`]: the first request acts and stores what it did; a retry of it (a
//! double click, a POST sent again) acts on nothing and answers the stored result. The
//! same request id with another action is refused (its fingerprint differs).

use std::future::Future;
use std::time::Duration;

use dedup_runtime::operate::{Acted, DeadLetters, Filter, OperateError, RedeliveryWindow};
use dedup_runtime::{
    Backend, FingerprintMismatch, Ledger, LedgerError, Resolution, StoredOutcome, StoredResultError,
};
use serde::{Deserialize, Serialize};
use sqlx::Pool;

/// The dedup table of the operator's actions (created on the first action).
pub const ACTIONS_TABLE: &str = "dedup_operator_actions";

/// The consumer name the actions are recorded under.
pub const ACTIONS_CONSUMER: &str = "dedup-operator";

/// Requeue or discard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActionKind {
    /// Back to pending, within the redelivery window.
    Requeue,
    /// Recorded done without running or sending.
    Discard,
}

/// Which dead rows, as an action names them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterSpec {
    /// Only this consumer's rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// Only rows whose last error contains this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_contains: Option<String>,
    /// Only rows that came in at least this many seconds ago.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub older_than_s: Option<u64>,
    /// Only these rows (their numbers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<i64>>,
    /// Only the rows with these ids (message ids, or the outbox's outgoing ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ids: Option<Vec<String>>,
}

impl FilterSpec {
    /// Whether it names nothing: every dead row.
    pub fn is_everything(&self) -> bool {
        self.consumer.is_none()
            && self.error_contains.is_none()
            && self.older_than_s.is_none()
            && self.rows.is_none()
            && self.ids.is_none()
    }

    /// As the library's filter.
    pub fn filter(&self) -> Filter {
        let mut filter = Filter::new();
        if let Some(consumer) = &self.consumer {
            filter = filter.consumer(consumer.clone());
        }
        if let Some(text) = &self.error_contains {
            filter = filter.error_contains(text.clone());
        }
        if let Some(age) = self.older_than_s {
            filter = filter.older_than(Duration::from_secs(age));
        }
        if let Some(rows) = &self.rows {
            filter = filter.rows(rows.iter().copied());
        }
        if let Some(ids) = &self.ids {
            filter = filter.ids(ids.iter().cloned());
        }
        filter
    }
}

/// One action on one table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// `inbox` or `outbox`.
    pub queue: String,
    /// The table.
    pub table: String,
    /// Requeue or discard.
    pub kind: ActionKind,
    /// Which rows.
    pub filter: FilterSpec,
    /// Requeue: the redelivery window in seconds, and per consumer.
    pub window_s: u64,
    /// Requeue: per-consumer windows in seconds.
    #[serde(default)]
    pub windows_s: Vec<(String, u64)>,
}

impl Action {
    fn dead_letters(&self) -> Result<DeadLetters, ActionError> {
        dead_letters(&self.queue, &self.table).map_err(ActionError::Refused)
    }

    fn window(&self) -> RedeliveryWindow {
        let mut window = RedeliveryWindow::new(Duration::from_secs(self.window_s));
        for (consumer, seconds) in &self.windows_s {
            window = window.consumer(consumer.clone(), Duration::from_secs(*seconds));
        }
        window
    }
}

/// Unknown outcomes resolved, as an action names them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveAction {
    /// The dedup table.
    pub table: String,
    /// The consumer.
    pub consumer: String,
    /// The message ids.
    pub ids: Vec<String>,
    /// Done or retry.
    pub resolution: crate::ResolveAs,
}

/// What a resolve did: per id, in order, whether a row was resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolveDone {
    /// Per id: whether a row was resolved (`false`: none to resolve).
    pub resolved: Vec<bool>,
    /// A retry: nothing was done now; this is what the first request did.
    pub replayed: bool,
}

/// What an action did; `replayed` when it was a retry answered with the first's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// Dead rows matched.
    pub matched: u64,
    /// Rows re-queued or discarded.
    pub done: u64,
    /// Rows a requeue left dead: older than their consumer's redelivery window.
    pub refused: u64,
    /// A retry: nothing was done now; this is what the first request did.
    #[serde(default)]
    pub replayed: bool,
}

/// Why an action failed.
#[derive(Debug)]
pub enum ActionError {
    /// Refused before anything was written (a bad table, too many rows, a request id
    /// reused for another action).
    Refused(String),
    /// The table does not exist.
    MissingTable(String),
    /// The database failed.
    Database(sqlx::Error),
}

impl std::fmt::Display for ActionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActionError::Refused(why) | ActionError::MissingTable(why) => f.write_str(why),
            ActionError::Database(error) => write!(f, "the database failed: {error}"),
        }
    }
}

impl std::error::Error for ActionError {}

impl From<sqlx::Error> for ActionError {
    fn from(error: sqlx::Error) -> Self {
        // The handler's claim reports a reused request id inside a database error.
        if FingerprintMismatch::find(&error).is_some() {
            return ActionError::from(FingerprintMismatch::find(&error).cloned().expect("found"));
        }
        ActionError::Database(error)
    }
}

impl From<OperateError> for ActionError {
    fn from(error: OperateError) -> Self {
        match error {
            OperateError::Database(error) => ActionError::Database(error),
            OperateError::MissingTable { .. } => ActionError::MissingTable(error.to_string()),
            other => ActionError::Refused(other.to_string()),
        }
    }
}

impl From<LedgerError> for ActionError {
    fn from(error: LedgerError) -> Self {
        match error {
            LedgerError::Database(error) => ActionError::from(error),
            LedgerError::MissingTable { .. } => ActionError::MissingTable(error.to_string()),
            other => ActionError::Refused(other.to_string()),
        }
    }
}

impl From<FingerprintMismatch> for ActionError {
    fn from(_: FingerprintMismatch) -> Self {
        ActionError::Refused(
            "this request id was used for another action: send a new request id".to_owned(),
        )
    }
}

impl From<StoredResultError> for ActionError {
    fn from(error: StoredResultError) -> Self {
        ActionError::Refused(format!("the stored result of this request id: {error}"))
    }
}

/// The stored result: what the first request did.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Stored {
    matched: u64,
    done: u64,
    refused: u64,
}

impl From<Acted> for Stored {
    fn from(acted: Acted) -> Self {
        Stored {
            matched: acted.matched,
            done: acted.done,
            refused: acted.refused,
        }
    }
}

/// The result a request stored: `true` when it is a retry's replay.
fn stored<T>(outcome: StoredOutcome<T>) -> Result<(T, bool), ActionError> {
    match outcome {
        StoredOutcome::Processed(stored) => Ok((stored, false)),
        StoredOutcome::Replayed(stored) => Ok((stored, true)),
        StoredOutcome::Duplicate(_) | StoredOutcome::InProgress(_) => Err(ActionError::Refused(
            "this request id was acted on, its result is not kept: send a new request id"
                .to_owned(),
        )),
    }
}

fn done(outcome: StoredOutcome<Stored>) -> Result<Done, ActionError> {
    let (stored, replayed) = stored(outcome)?;
    Ok(Done {
        matched: stored.matched,
        done: stored.done,
        refused: stored.refused,
        replayed,
    })
}

/// The backends the actions run on. Each runs in the table [`ACTIONS_TABLE`], which its
/// caller migrates first (once per process).
pub trait Act: Backend {
    /// Runs `action` once for `request_id`.
    fn act<'a>(
        pool: &'a Pool<Self>,
        request_id: &'a str,
        action: &'a Action,
    ) -> impl Future<Output = Result<Done, ActionError>> + Send + 'a;

    /// Resolves `action`'s ids once for `request_id`.
    fn resolve_unknown<'a>(
        pool: &'a Pool<Self>,
        request_id: &'a str,
        action: &'a ResolveAction,
    ) -> impl Future<Output = Result<ResolveDone, ActionError>> + Send + 'a;
}

async fn resolve_all<DB: Backend>(
    conn: &mut DB::Connection,
    ledger: &Ledger<DB>,
    action: &ResolveAction,
) -> Result<Vec<bool>, ActionError> {
    let resolution = match action.resolution {
        crate::ResolveAs::Done => Resolution::Done,
        crate::ResolveAs::Retry => Resolution::Retry,
    };
    let mut resolved = Vec::with_capacity(action.ids.len());
    for id in &action.ids {
        resolved.push(
            ledger
                .resolve_on(&mut *conn, &action.consumer, id.as_str(), resolution)
                .await?,
        );
    }
    Ok(resolved)
}

async fn work<DB: Backend>(
    conn: &mut DB::Connection,
    action: &Action,
) -> Result<Stored, ActionError> {
    let table = action.dead_letters()?;
    let filter = action.filter.filter();
    let acted = match action.kind {
        ActionKind::Requeue => table.requeue::<DB>(conn, &filter, &action.window()).await?,
        ActionKind::Discard => table.discard::<DB>(conn, &filter).await?,
    };
    Ok(acted.into())
}

macro_rules! act_impls {
    ($($module:ident => $db:ty, $conn:ty;)*) => {$(
        mod $module {
            use super::*;

            #[dedup_runtime::idempotent(
                consumer = ACTIONS_CONSUMER,
                table = "dedup_operator_actions",
                key = request_id,
                fingerprint = fingerprint,
                result = "stored"
            )]
            async fn act(
                tx: &mut $conn,
                request_id: &str,
                fingerprint: &[u8],
                action: &Action,
            ) -> Result<Stored, ActionError> {
                work::<$db>(tx, action).await
            }

            #[dedup_runtime::idempotent(
                consumer = ACTIONS_CONSUMER,
                table = "dedup_operator_actions",
                key = request_id,
                fingerprint = fingerprint,
                result = "stored"
            )]
            async fn resolve(
                tx: &mut $conn,
                request_id: &str,
                fingerprint: &[u8],
                ledger: &Ledger<$db>,
                action: &ResolveAction,
            ) -> Result<Vec<bool>, ActionError> {
                resolve_all::<$db>(tx, ledger, action).await
            }

            impl Act for $db {
                async fn act<'a>(
                    pool: &'a Pool<Self>,
                    request_id: &'a str,
                    action: &'a Action,
                ) -> Result<Done, ActionError> {
                    let fingerprint = serde_json::to_vec(action).expect("an action serializes");
                    done(act(pool, request_id, &fingerprint, action).await?)
                }

                async fn resolve_unknown<'a>(
                    pool: &'a Pool<Self>,
                    request_id: &'a str,
                    action: &'a ResolveAction,
                ) -> Result<ResolveDone, ActionError> {
                    let ledger = Ledger::new(pool)
                        .in_table(&action.table)
                        .map_err(|error| ActionError::Refused(error.to_string()))?;
                    let fingerprint = serde_json::to_vec(action).expect("an action serializes");
                    let outcome = resolve(pool, request_id, &fingerprint, &ledger, action).await?;
                    let (resolved, replayed) = stored(outcome)?;
                    Ok(ResolveDone { resolved, replayed })
                }
            }
        }
    )*};
}

act_impls! {
    postgres => sqlx::Postgres, sqlx::PgConnection;
    mysql => sqlx::MySql, sqlx::MySqlConnection;
    sqlite => sqlx::Sqlite, sqlx::SqliteConnection;
}

/// The `queue` (`inbox` or `outbox`) table `table`, as the command, the console and the
/// actions all name it.
pub(crate) fn dead_letters(queue: &str, table: &str) -> Result<DeadLetters, String> {
    let made = match queue {
        "inbox" => DeadLetters::inbox(table),
        "outbox" => DeadLetters::outbox(table),
        other => return Err(format!("`{other}`: not inbox or outbox")),
    };
    made.map_err(|error| error.to_string())
}

/// `request_id` as the dedup table holds it, or why it cannot be one (empty, over 255
/// bytes, a NUL): checked before any action runs.
pub(crate) fn check_request_id(request_id: &str) -> Result<(), String> {
    dedup_runtime::MessageId::borrowed(request_id)
        .validate()
        .map(drop)
        .map_err(|error| format!("the request id: {error}"))
}

/// A new request id.
pub fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
