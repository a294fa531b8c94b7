//! The console's JSON API, and the reads and actions the pages share with it.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use dedup_runtime::operate::{DeadLetters, OperateError, RowHeaders};
use dedup_runtime::{Backend, Ledger, UnresolvedStatus};
use serde::{Deserialize, Serialize};
use sqlx::Pool;

use super::{Console, problem};
use crate::actions::{
    Act, Action, ActionError, ActionKind, Done, FilterSpec, ResolveAction, new_request_id,
};
use crate::db::with_pool;
use crate::text::{Preview, parse_duration};
use crate::{Failure, ResolveAs};

/// The payload bytes a row's preview shows.
pub(crate) const PREVIEW_BYTES: usize = 4096;

/// The most dead rows one page or API call lists.
pub(crate) const MAX_PAGE: u32 = 500;

/// `GET /api/overview`.
#[derive(Debug, Serialize)]
pub struct Overview {
    /// PostgreSQL, MySQL or SQLite.
    pub backend: &'static str,
    /// Whether actions are refused.
    pub read_only: bool,
    /// The redelivery window a requeue keeps to, in seconds.
    pub redelivery_window_s: u64,
    /// Every inbox and outbox table shown.
    pub queues: Vec<QueueView>,
    /// The dedup table.
    pub dedup: DedupView,
}

/// One inbox or outbox table.
#[derive(Debug, Serialize)]
pub struct QueueView {
    /// `inbox` or `outbox`.
    pub queue: &'static str,
    /// The table.
    pub table: String,
    /// Why it could not be read (a missing table).
    pub error: Option<String>,
    /// Its consumers.
    pub consumers: Vec<ConsumerView>,
}

/// One consumer's rows by state.
#[derive(Debug, Serialize)]
pub struct ConsumerView {
    /// The consumer.
    pub consumer: String,
    /// Pending.
    pub pending: u64,
    /// In flight.
    pub in_flight: u64,
    /// Processed or sent.
    pub done: u64,
    /// Dead.
    pub dead: u64,
    /// The oldest pending row's age, in seconds.
    pub oldest_pending_s: Option<f64>,
}

/// The dedup table's ids per consumer.
#[derive(Debug, Serialize)]
pub struct DedupView {
    /// The table.
    pub table: String,
    /// Why it could not be read.
    pub error: Option<String>,
    /// Per consumer.
    pub consumers: Vec<DedupConsumer>,
}

/// One consumer's ids.
#[derive(Debug, Serialize)]
pub struct DedupConsumer {
    /// The consumer.
    pub consumer: String,
    /// Its ids.
    pub ids: u64,
    /// The oldest id's age, in seconds.
    pub oldest_s: f64,
    /// Ids older than the redelivery window: what a prune at that age deletes.
    pub past_window: u64,
    /// Ids not processed: in progress or outcome unknown (never pruned).
    pub unresolved: u64,
}

/// `GET /api/{queue}/{table}/dead`.
#[derive(Debug, Serialize)]
pub struct DeadPage {
    /// `inbox` or `outbox`.
    pub queue: String,
    /// The table.
    pub table: String,
    /// Dead rows the filter matches, all pages.
    pub total: u64,
    /// This page.
    pub rows: Vec<RowView>,
    /// The `after` of the next page, if there may be one.
    pub next_after: Option<i64>,
}

/// One dead row.
#[derive(Debug, Serialize)]
pub struct RowView {
    /// Its number: what a selection names.
    pub row: i64,
    /// Its message or outgoing id.
    pub id: String,
    /// Its consumer.
    pub consumer: String,
    /// An outbox row's destination.
    pub destination: Option<String>,
    /// Attempts used.
    pub attempts: u32,
    /// The last error text.
    pub last_error: Option<String>,
    /// Its age, in seconds.
    pub age_s: f64,
    /// The payload's length.
    pub payload_len: u64,
    /// `json`, `text` or `hex`.
    pub payload_kind: &'static str,
    /// The preview of its first [`PREVIEW_BYTES`] bytes.
    pub payload_preview: String,
    /// Whether the preview is cut.
    pub payload_cut: bool,
    /// An outbox row's headers (values as text, lossy).
    pub headers: Vec<(String, String)>,
    /// An inbox row's headers: their length (opaque bytes).
    pub opaque_headers_len: Option<usize>,
}

/// The dead rows' filter as a query string gives it.
#[derive(Debug, Default, Deserialize)]
pub struct DeadQuery {
    /// Only this consumer's rows.
    pub consumer: Option<String>,
    /// Only rows whose last error contains this.
    pub error_contains: Option<String>,
    /// Only rows at least this old: a duration (`1h`, `7d`).
    pub older_than: Option<String>,
    /// Only rows at least this many seconds old.
    pub older_than_s: Option<u64>,
    /// The page after this row.
    pub after: Option<i64>,
    /// Rows per page (at most 500).
    pub limit: Option<u32>,
}

impl DeadQuery {
    /// As an action's filter (empty texts are no filter).
    pub(crate) fn spec(&self) -> Result<FilterSpec, String> {
        let some = |text: &Option<String>| text.as_ref().filter(|t| !t.is_empty()).cloned();
        let older_than_s = match (some(&self.older_than), self.older_than_s) {
            (Some(text), _) => Some(parse_duration(&text)?.as_secs()),
            (None, seconds) => seconds,
        };
        Ok(FilterSpec {
            consumer: some(&self.consumer),
            error_contains: some(&self.error_contains),
            older_than_s,
            rows: None,
            ids: None,
        })
    }
}

/// An action's answer.
#[derive(Debug, Serialize)]
pub struct ActAnswer {
    /// The request id it ran under.
    pub request_id: String,
    /// What it did.
    #[serde(flatten)]
    pub done: Done,
}

/// `POST /api/{queue}/{table}/{requeue|discard}`.
#[derive(Debug, Default, Deserialize)]
pub struct ActBody {
    /// The request id (or the `Idempotency-Key` header): a retry with it acts once.
    pub request_id: Option<String>,
    /// Which rows.
    #[serde(default)]
    pub filter: FilterSpec,
    /// Every dead row of the table, when the filter names nothing.
    #[serde(default)]
    pub all: bool,
}

/// `POST /api/unknown/resolve`.
#[derive(Debug, Deserialize)]
pub struct ResolveBody {
    /// The request id (or the `Idempotency-Key` header): a retry with it acts once.
    #[serde(default)]
    pub request_id: Option<String>,
    /// The consumer.
    pub consumer: String,
    /// The message ids.
    pub ids: Vec<String>,
    /// `done` or `retry`.
    #[serde(rename = "as")]
    pub resolution: ResolveAs,
}

/// What a resolve answers.
#[derive(Debug, Serialize)]
pub struct ResolveAnswer {
    /// The request id it ran under.
    pub request_id: String,
    /// A retry: nothing was done now; this is what the first request did.
    pub replayed: bool,
    /// Per id.
    pub ids: Vec<Resolved>,
}

/// One row the resolve answered for.
#[derive(Debug, Serialize)]
pub struct Resolved {
    /// The message id.
    pub id: String,
    /// Whether a row was resolved (`false`: none to resolve).
    pub resolved: bool,
}

/// `GET /api/unknown`.
#[derive(Debug, Serialize)]
pub struct UnknownView {
    /// The dedup table.
    pub table: String,
    /// Why it could not be read.
    pub error: Option<String>,
    /// The unresolved rows.
    pub rows: Vec<UnknownRow>,
}

/// One unresolved row.
#[derive(Debug, Serialize)]
pub struct UnknownRow {
    /// The consumer.
    pub consumer: String,
    /// The message id.
    pub message_id: String,
    /// `outcome unknown`, `lease expired` or `in progress`.
    pub status: String,
}

pub(crate) async fn read_overview(console: &Console) -> Overview {
    let mut queues = Vec::new();
    for (queue, tables) in [
        ("inbox", &console.inbox_tables),
        ("outbox", &console.outbox_tables),
    ] {
        for table in tables {
            let (consumers, error) = match summary(console, queue, table).await {
                Ok(consumers) => (consumers, None),
                Err(error) => (Vec::new(), Some(error)),
            };
            queues.push(QueueView {
                queue,
                table: table.clone(),
                error,
                consumers,
            });
        }
    }
    let (consumers, error) =
        match with_pool!(&console.pools, |pool| dedup_stats(pool, console).await) {
            Ok(consumers) => (consumers, None),
            Err(failure) => (Vec::new(), Some(failure.message)),
        };
    Overview {
        backend: console.pools.name(),
        read_only: console.read_only,
        redelivery_window_s: console.window.as_secs(),
        queues,
        dedup: DedupView {
            table: console.dedup_table.clone(),
            error,
            consumers,
        },
    }
}

fn letters(queue: &str, table: &str) -> Result<DeadLetters, String> {
    // One byte past the preview: enough to know that it is cut.
    crate::actions::dead_letters(queue, table)
        .map(|letters| letters.payload_preview(PREVIEW_BYTES + 1))
}

fn shown(error: OperateError) -> String {
    error.to_string()
}

async fn summary_on<DB: Backend>(
    pool: &Pool<DB>,
    letters: &DeadLetters,
) -> Result<Vec<dedup_runtime::operate::ConsumerRows>, String> {
    let mut conn = pool.acquire().await.map_err(|error| error.to_string())?;
    letters.summary::<DB>(&mut conn).await.map_err(shown)
}

async fn dead_on<DB: Backend>(
    pool: &Pool<DB>,
    letters: &DeadLetters,
    filter: &dedup_runtime::operate::Filter,
    after: Option<i64>,
    limit: u32,
) -> Result<(u64, Vec<dedup_runtime::operate::DeadRow>), (StatusCode, String)> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|error| (StatusCode::SERVICE_UNAVAILABLE, error.to_string()))?;
    let failed = |error: OperateError| match error {
        OperateError::Database(_) => (StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
        other => (StatusCode::BAD_REQUEST, other.to_string()),
    };
    let total = letters
        .count::<DB>(&mut conn, filter)
        .await
        .map_err(failed)?;
    let rows = letters
        .list::<DB>(&mut conn, filter, after, limit)
        .await
        .map_err(failed)?;
    Ok((total, rows))
}

async fn summary(console: &Console, queue: &str, table: &str) -> Result<Vec<ConsumerView>, String> {
    let letters = letters(queue, table)?;
    let rows = with_pool!(&console.pools, |pool| summary_on(pool, &letters).await)?;
    Ok(rows
        .into_iter()
        .map(|c| ConsumerView {
            consumer: c.consumer,
            pending: c.pending,
            in_flight: c.in_flight,
            done: c.done,
            dead: c.dead,
            oldest_pending_s: c.oldest_pending.map(|age| age.as_secs_f64()),
        })
        .collect())
}

async fn dedup_stats<DB: Backend>(
    pool: &Pool<DB>,
    console: &Console,
) -> Result<Vec<DedupConsumer>, Failure> {
    // What a prune at a consumer's window would delete: one read at the console's window
    // answers every consumer without a window of its own.
    let at = |window: Duration| {
        dedup_runtime::Prune::new(window, window)
            .in_table(&console.dedup_table)
            .map_err(|error| Failure::usage(error.to_string()))
    };
    let stats = at(console.window)?
        .stats(pool)
        .await
        .map_err(|error| Failure::database(error.to_string()))?;
    let mut consumers = Vec::with_capacity(stats.len());
    for consumer in stats {
        let past_window = match console
            .windows
            .iter()
            .find(|(name, _)| *name == consumer.consumer)
        {
            None => consumer.prunable,
            Some((_, window)) => at(*window)?
                .consumer(consumer.consumer.as_str())
                .stats(pool)
                .await
                .map_err(|error| Failure::database(error.to_string()))?
                .first()
                .map_or(0, |c| c.prunable),
        };
        consumers.push(DedupConsumer {
            past_window,
            consumer: consumer.consumer,
            ids: consumer.ids,
            oldest_s: consumer.oldest.as_secs_f64(),
            unresolved: consumer.unresolved,
        });
    }
    Ok(consumers)
}

pub(crate) async fn read_dead(
    console: &Console,
    queue: &str,
    table: &str,
    query: &DeadQuery,
) -> Result<DeadPage, (StatusCode, String)> {
    let bad = |text: String| (StatusCode::BAD_REQUEST, text);
    if !console.knows(queue, table) {
        return Err((
            StatusCode::NOT_FOUND,
            format!("the console shows no {queue} table `{table}`"),
        ));
    }
    let letters = letters(queue, table).map_err(bad)?;
    let filter = query.spec().map_err(bad)?.filter();
    let limit = query.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    let (total, rows) = with_pool!(&console.pools, |pool| {
        dead_on(pool, &letters, &filter, query.after, limit).await
    })?;
    let next_after = (rows.len() as u32 == limit)
        .then(|| rows.last().map(|r| r.row))
        .flatten();
    let rows = rows
        .into_iter()
        .map(|row| {
            let (preview, cut) = Preview::of(&row.payload, PREVIEW_BYTES);
            let (headers, opaque_headers_len) = match &row.headers {
                RowHeaders::Pairs(pairs) => (
                    pairs
                        .iter()
                        .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                        .collect(),
                    None,
                ),
                RowHeaders::Opaque(bytes) => (Vec::new(), Some(bytes.len())),
                RowHeaders::None => (Vec::new(), None),
            };
            RowView {
                row: row.row,
                id: row.id,
                consumer: row.consumer,
                destination: row.destination,
                attempts: row.attempts,
                last_error: row.last_error,
                age_s: row.age.as_secs_f64(),
                payload_len: row.payload_len,
                payload_kind: preview.kind(),
                payload_preview: preview.text().to_owned(),
                payload_cut: cut,
                headers,
                opaque_headers_len,
            }
        })
        .collect();
    Ok(DeadPage {
        queue: queue.to_owned(),
        table: table.to_owned(),
        total,
        rows,
        next_after,
    })
}

/// Runs an action for the pages and the API: refused in read-only mode, for an unknown
/// table, or with no rows named and no `all`.
pub(crate) async fn run_action(
    console: &Console,
    queue: &str,
    table: &str,
    kind: ActionKind,
    filter: FilterSpec,
    all: bool,
    request_id: &str,
) -> Result<Done, (StatusCode, &'static str, String)> {
    may_act(console, request_id).await?;
    if !console.knows(queue, table) {
        return Err((
            StatusCode::NOT_FOUND,
            "unknown-table",
            format!("the console shows no {queue} table `{table}`"),
        ));
    }
    if filter.is_everything() && !all {
        return Err((
            StatusCode::BAD_REQUEST,
            "no-rows",
            "no rows named: select rows, give a filter, or say all".to_owned(),
        ));
    }
    if filter.rows.as_ref().is_some_and(Vec::is_empty)
        || filter.ids.as_ref().is_some_and(Vec::is_empty)
    {
        return Err((
            StatusCode::BAD_REQUEST,
            "no-rows",
            "no rows selected".to_owned(),
        ));
    }
    let action = Action {
        queue: queue.to_owned(),
        table: table.to_owned(),
        kind,
        filter,
        window_s: console.window.as_secs(),
        windows_s: console
            .windows
            .iter()
            .map(|(c, w)| (c.clone(), w.as_secs()))
            .collect(),
    };
    let done = with_pool!(&console.pools, |pool| act_on(pool, request_id, &action)
        .await);
    done.map_err(refused)
}

/// What every action checks first: the console not read-only, a request id the dedup table
/// can hold; then the actions' table, created by the first action of this console.
async fn may_act(
    console: &Console,
    request_id: &str,
) -> Result<(), (StatusCode, &'static str, String)> {
    if console.read_only {
        return Err((
            StatusCode::FORBIDDEN,
            "read-only",
            "the console is read-only".to_owned(),
        ));
    }
    crate::actions::check_request_id(request_id)
        .map_err(|why| (StatusCode::UNPROCESSABLE_ENTITY, "refused", why))?;
    console
        .actions_table
        .get_or_try_init(|| async {
            with_pool!(&console.pools, |pool| {
                dedup_runtime::migrate_table(pool, crate::actions::ACTIONS_TABLE).await
            })
        })
        .await
        .map(drop)
        .map_err(|error| refused(ActionError::from(error)))
}

/// An action's failure as the API answers it.
fn refused(error: ActionError) -> (StatusCode, &'static str, String) {
    match error {
        ActionError::Database(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "database",
            error.to_string(),
        ),
        ActionError::MissingTable(why) => (StatusCode::NOT_FOUND, "missing-table", why),
        ActionError::Refused(why) => (StatusCode::UNPROCESSABLE_ENTITY, "refused", why),
    }
}

/// The request id a body names, else the `Idempotency-Key` header's, else a new one.
fn request_id(named: Option<String>, headers: &HeaderMap) -> String {
    named
        .or_else(|| {
            headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim_matches('"').to_owned())
        })
        .unwrap_or_else(new_request_id)
}

async fn act_on<DB: Act>(
    pool: &Pool<DB>,
    request_id: &str,
    action: &Action,
) -> Result<Done, ActionError> {
    DB::act(pool, request_id, action).await
}

pub(crate) async fn read_unknown(console: &Console) -> UnknownView {
    let rows = with_pool!(&console.pools, |pool| unknown_rows(pool, console).await);
    let (rows, error) = match rows {
        Ok(rows) => (rows, None),
        Err(failure) => (Vec::new(), Some(failure.message)),
    };
    UnknownView {
        table: console.dedup_table.clone(),
        error,
        rows,
    }
}

async fn unknown_rows<DB: Backend>(
    pool: &Pool<DB>,
    console: &Console,
) -> Result<Vec<UnknownRow>, Failure> {
    let ledger = Ledger::new(pool)
        .in_table(&console.dedup_table)
        .map_err(|error| Failure::usage(error.to_string()))?;
    let mut rows = Vec::new();
    for consumer in crate::commands::unresolved_consumers(pool, &console.dedup_table).await? {
        if consumer.unresolved == 0 {
            continue;
        }
        let stuck = ledger
            .unresolved(&consumer.consumer, 1_000)
            .await
            .map_err(|error| Failure::database(error.to_string()))?;
        for row in stuck {
            let status = match row.status() {
                UnresolvedStatus::OutcomeUnknown => "outcome unknown".to_owned(),
                UnresolvedStatus::LeaseExpired => "lease expired".to_owned(),
                UnresolvedStatus::InProgress { remaining } => {
                    format!("in progress ({}s of lease left)", remaining.as_secs())
                }
                _ => "unresolved".to_owned(),
            };
            rows.push(UnknownRow {
                consumer: consumer.consumer.clone(),
                message_id: row.message_id().to_owned(),
                status,
            });
        }
    }
    Ok(rows)
}

/// Resolves `ids` of `consumer` once for `request_id`: a retry answers what the first did.
pub(crate) async fn run_resolve(
    console: &Console,
    body: &ResolveBody,
    request_id: &str,
) -> Result<ResolveAnswer, (StatusCode, &'static str, String)> {
    may_act(console, request_id).await?;
    if body.ids.is_empty() {
        return Err((
            StatusCode::BAD_REQUEST,
            "no-rows",
            "no message id given".to_owned(),
        ));
    }
    let action = ResolveAction {
        table: console.dedup_table.clone(),
        consumer: body.consumer.clone(),
        ids: body.ids.clone(),
        resolution: body.resolution,
    };
    let done = with_pool!(&console.pools, |pool| resolve_on(pool, request_id, &action)
        .await);
    let done = done.map_err(refused)?;
    Ok(ResolveAnswer {
        request_id: request_id.to_owned(),
        replayed: done.replayed,
        ids: body
            .ids
            .iter()
            .zip(done.resolved)
            .map(|(id, resolved)| Resolved {
                id: id.clone(),
                resolved,
            })
            .collect(),
    })
}

async fn resolve_on<DB: Act>(
    pool: &Pool<DB>,
    request_id: &str,
    action: &ResolveAction,
) -> Result<crate::actions::ResolveDone, ActionError> {
    DB::resolve_unknown(pool, request_id, action).await
}

pub(crate) async fn overview(State(console): State<Arc<Console>>) -> Json<Overview> {
    Json(read_overview(&console).await)
}

pub(crate) async fn dead(
    State(console): State<Arc<Console>>,
    Path((queue, table)): Path<(String, String)>,
    Query(query): Query<DeadQuery>,
) -> Response {
    match read_dead(&console, &queue, &table, &query).await {
        Ok(page) => Json(page).into_response(),
        Err((status, detail)) => problem(status, "dead", "Cannot list the dead rows", &detail),
    }
}

pub(crate) async fn act(
    State(console): State<Arc<Console>>,
    Path((queue, table, action)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let kind = match action.as_str() {
        "requeue" => ActionKind::Requeue,
        "discard" => ActionKind::Discard,
        _ => {
            return problem(
                StatusCode::NOT_FOUND,
                "action",
                "No such action",
                "requeue or discard",
            );
        }
    };
    let body: ActBody = match json_body(&headers, &body) {
        Ok(body) => body,
        Err(response) => return response,
    };
    let request_id = request_id(body.request_id.clone(), &headers);
    match run_action(
        &console,
        &queue,
        &table,
        kind,
        body.filter,
        body.all,
        &request_id,
    )
    .await
    {
        Ok(done) => Json(ActAnswer { request_id, done }).into_response(),
        Err((status, kind, detail)) => problem(status, kind, "Action refused", &detail),
    }
}

pub(crate) async fn unknown(State(console): State<Arc<Console>>) -> Json<UnknownView> {
    Json(read_unknown(&console).await)
}

pub(crate) async fn resolve(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: ResolveBody = match json_body(&headers, &body) {
        Ok(body) => body,
        Err(response) => return response,
    };
    let request_id = request_id(body.request_id.clone(), &headers);
    match run_resolve(&console, &body, &request_id).await {
        Ok(answer) => Json(answer).into_response(),
        Err((status, kind, detail)) => problem(status, kind, "Resolve refused", &detail),
    }
}

/// A JSON body, only as `application/json`: a type no HTML form can send across sites.
#[allow(clippy::result_large_err)] // the answer, built once per refused request
fn json_body<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, Response> {
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !json {
        return Err(problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type",
            "JSON expected",
            "send Content-Type: application/json",
        ));
    }
    serde_json::from_slice(body).map_err(|error| {
        problem(
            StatusCode::BAD_REQUEST,
            "body",
            "Malformed body",
            &error.to_string(),
        )
    })
}
