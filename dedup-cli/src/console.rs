//! `dedup console`: server-rendered pages (no JavaScript) and the JSON API under them.
//!
//! - `GET /`: per inbox and outbox table, each consumer's pending, in-flight, done and
//!   dead rows and its oldest pending row's age; the dedup table's ids per consumer (the
//!   oldest, how many are past the redelivery window, how many are unresolved).
//! - `GET /{inbox|outbox}/{table}`: the dead rows matching a filter (consumer, error text,
//!   age), each with its error text, attempts, payload preview (JSON pretty-printed, text,
//!   or hex) and headers; requeue or discard the rows selected, or **every row the filter
//!   matches**.
//! - `GET /unknown`: effects whose outcome is unknown, each with its resolve buttons.
//! - `/api/…`: the same as JSON (`GET /api/overview`, `GET /api/{queue}/{table}/dead`,
//!   `POST /api/{queue}/{table}/requeue` and `…/discard`, `GET /api/unknown`,
//!   `POST /api/unknown/resolve`); errors are `application/problem+json`.
//!
//! Every action carries a request id (a form's hidden field, made when the page was
//! rendered; the API's `request_id` or `Idempotency-Key`): a double click or a POST sent
//! again acts once and answers what the first did. A requeue leaves dead the rows older
//! than their consumer's redelivery window and says so. `--read-only` answers every action
//! with 403 and shows no buttons. With a token (`--token` or `DEDUP_CONSOLE_TOKEN`) the
//! API wants `Authorization: Bearer <token>` and the pages a login; every form carries the
//! console's form token (CSRF), and cross-site POSTs are refused. Every stored text —
//! payloads, headers, error texts, ids, consumer names — is HTML-escaped.

mod api;
mod pages;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;

use crate::db::Pools;
use crate::{ConsoleArgs, Failure};

/// The cookie a login sets.
const SESSION_COOKIE: &str = "dedup_console";

/// What every request handler sees.
pub struct Console {
    pub(crate) pools: Pools,
    pub(crate) read_only: bool,
    pub(crate) inbox_tables: Vec<String>,
    pub(crate) outbox_tables: Vec<String>,
    pub(crate) dedup_table: String,
    pub(crate) window: Duration,
    pub(crate) windows: Vec<(String, Duration)>,
    token: Option<String>,
    /// The login cookie's value: random, made at start (never the token itself).
    session: String,
    /// The forms' CSRF token: random, made at start.
    pub(crate) form_token: String,
    /// Set once the actions' dedup table is migrated (by the first action: a read-only
    /// console creates nothing).
    pub(crate) actions_table: tokio::sync::OnceCell<()>,
}

impl Console {
    /// The console for `args` on `pools`.
    pub fn new(pools: Pools, args: ConsoleArgs) -> Arc<Console> {
        let or_default = |tables: Vec<String>, default: &str| {
            if tables.is_empty() {
                vec![default.to_owned()]
            } else {
                tables
            }
        };
        Arc::new(Console {
            pools,
            read_only: args.read_only,
            inbox_tables: or_default(args.inbox_tables, dedup_runtime::inbox::DEFAULT_TABLE),
            outbox_tables: or_default(args.outbox_tables, dedup_runtime::outbox::DEFAULT_TABLE),
            dedup_table: args.table,
            window: args.redelivery_window,
            windows: args.windows,
            token: args.token.filter(|token| !token.is_empty()),
            session: crate::actions::new_request_id(),
            form_token: crate::actions::new_request_id(),
            actions_table: tokio::sync::OnceCell::new(),
        })
    }

    /// Whether `queue`/`table` is one the console shows.
    pub(crate) fn knows(&self, queue: &str, table: &str) -> bool {
        match queue {
            "inbox" => self.inbox_tables.iter().any(|t| t == table),
            "outbox" => self.outbox_tables.iter().any(|t| t == table),
            _ => false,
        }
    }
}

/// The console's routes.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/login", get(pages::login_form).post(login))
        .route("/unknown", get(pages::unknown))
        .route("/unknown/resolve", post(pages::resolve))
        .route("/{queue}/{table}", get(pages::dead))
        .route("/{queue}/{table}/act", post(pages::act))
        .route("/api/overview", get(api::overview))
        .route("/api/unknown", get(api::unknown))
        .route("/api/unknown/resolve", post(api::resolve))
        .route("/api/{queue}/{table}/dead", get(api::dead))
        .route("/api/{queue}/{table}/{action}", post(api::act))
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console)
}

/// Serves the console until Ctrl-C.
pub(crate) async fn serve(
    pools: Pools,
    args: ConsoleArgs,
    out: &mut dyn Write,
) -> Result<(), Failure> {
    let listen = args.listen.clone();
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|error| Failure::usage(format!("cannot listen on {listen}: {error}")))?;
    let address = listener
        .local_addr()
        .map_err(|error| Failure::usage(error.to_string()))?;
    let read_only = if args.read_only { ", read-only" } else { "" };
    let backend = pools.name();
    let console = Console::new(pools, args);
    let _ = writeln!(
        out,
        "dedup console on http://{address}/ ({backend}{read_only}); Ctrl-C stops it"
    );
    let _ = out.flush();
    axum::serve(listener, router(console))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|error| Failure::database(format!("the console stopped: {error}")))
}

/// Authentication and cross-site refusal, before every route.
async fn guard(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let api = path.starts_with("/api/");
    // A browser says where a request comes from: a POST from another site is refused
    // whatever it carries (the form token is the other half of the CSRF defence).
    if request.method() == axum::http::Method::POST
        && let Some(site) = request.headers().get("sec-fetch-site")
        && !matches!(site.as_bytes(), b"same-origin" | b"none")
    {
        return problem(
            StatusCode::FORBIDDEN,
            "cross-site",
            "Cross-site request refused",
            "the console accepts actions only from its own pages",
        );
    }
    let Some(token) = &console.token else {
        return next.run(request).await;
    };
    if path == "/login" {
        return next.run(request).await;
    }
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|given| same(given.as_bytes(), token.as_bytes()));
    let cookie = cookie(headers, SESSION_COOKIE)
        .is_some_and(|given| same(given.as_bytes(), console.session.as_bytes()));
    if bearer || cookie {
        return next.run(request).await;
    }
    if api {
        let mut response = problem(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            "send the console's token: Authorization: Bearer <token>",
        );
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        response
    } else {
        (StatusCode::SEE_OTHER, [(header::LOCATION, "/login")]).into_response()
    }
}

/// `POST /login`: the token from the form; a session cookie when it matches.
async fn login(State(console): State<Arc<Console>>, body: Bytes) -> Response {
    let fields = form(&body);
    let given = fields
        .get("token")
        .and_then(|v| v.first())
        .cloned()
        .unwrap_or_default();
    match &console.token {
        Some(token) if same(given.as_bytes(), token.as_bytes()) => {
            let cookie = format!(
                "{SESSION_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
                console.session
            );
            (
                StatusCode::SEE_OTHER,
                [
                    (header::LOCATION, "/".to_owned()),
                    (header::SET_COOKIE, cookie),
                ],
            )
                .into_response()
        }
        Some(_) => pages::page(
            StatusCode::UNAUTHORIZED,
            "Login",
            &console,
            "<p class=\"error\">That is not the console's token.</p><p><a href=\"/login\">Try again</a></p>",
        ),
        None => (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response(),
    }
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// An `application/x-www-form-urlencoded` body: every name with its values, in order.
pub(crate) fn form(body: &[u8]) -> BTreeMap<String, Vec<String>> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_bytes(body).unwrap_or_default();
    let mut fields: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in pairs {
        fields.entry(name).or_default().push(value);
    }
    fields
}

/// An RFC 9457 problem.
#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

/// An `application/problem+json` answer; `kind` names the case (`…#kind`).
pub(crate) fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    let body = Problem {
        kind: format!(
            "https://github.com/dedup-rs/dedup/blob/main/guide/src/operating.md#console-{kind}"
        ),
        title,
        status: status.as_u16(),
        detail,
    };
    let json = serde_json::to_vec(&body).unwrap_or_default();
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        json,
    )
        .into_response()
}
