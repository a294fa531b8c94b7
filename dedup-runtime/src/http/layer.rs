//! The tower layer that reads the key, buffers the body and keeps concurrent retries
//! apart; the axum extractor that hands the handler what the layer read.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum_core::body::Body;
use axum_core::extract::FromRequestParts;
use axum_core::response::Response;
use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use http::{Request, StatusCode};
use sha2::{Digest as _, Sha256};
use tower_layer::Layer;
use tower_service::Service;

use super::key::{KeyError, message_id, parse_key};
use super::problem::{
    HttpError, MALFORMED_KEY, MISSING_KEY, NO_STORED_RESPONSE, REQUEST_TOO_LARGE,
    UNIDENTIFIED_CALLER, in_progress, problem,
};
use super::response::{CaptureError, StoredResponse};
use super::{DEFAULT_MAX_REQUEST_LEN, IDEMPOTENCY_KEY};
use crate::{FingerprintSource, StoredOutcome};

/// The caller's identity, from the request: the key's scope.
type Scope = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Requires an `Idempotency-Key` on every route it wraps, reads it, buffers the body and
/// hands both to the handler's [`IdempotentRequest`]; a retry of a request still running
/// in this process gets `409` before the handler is called. The module's documentation
/// has the whole table of answers.
///
/// Cheap to clone: every clone shares the settings and the requests in flight.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

struct Config {
    scope: Option<Arc<Scope>>,
    fingerprint_headers: Vec<HeaderName>,
    replay_headers: Vec<HeaderName>,
    max_request_len: usize,
    wait_for_first: bool,
    retry_after: Duration,
    in_flight: Mutex<HashSet<String>>,
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        IdempotencyLayer::new()
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("scoped", &self.config.scope.is_some())
            .field("fingerprint_headers", &self.config.fingerprint_headers)
            .field("replay_headers", &self.config.replay_headers)
            .field("max_request_len", &self.config.max_request_len)
            .field("wait_for_first", &self.config.wait_for_first)
            .finish()
    }
}

impl IdempotencyLayer {
    /// Keys unscoped (one key space for every caller: give a [`scope`](Self::scope) when
    /// callers are told apart), no header in the fingerprint, `Content-Type` alone
    /// replayed with the body, request bodies up to [`DEFAULT_MAX_REQUEST_LEN`], a
    /// concurrent retry answered `409` with `Retry-After: 1`.
    pub fn new() -> IdempotencyLayer {
        IdempotencyLayer {
            config: Arc::new(Config {
                scope: None,
                fingerprint_headers: Vec::new(),
                replay_headers: Vec::new(),
                max_request_len: DEFAULT_MAX_REQUEST_LEN,
                wait_for_first: false,
                retry_after: Duration::from_secs(1),
                in_flight: Mutex::new(HashSet::new()),
            }),
        }
    }

    fn with(self, change: impl FnOnce(&mut Config)) -> IdempotencyLayer {
        let mut config = Arc::try_unwrap(self.config).unwrap_or_else(|shared| Config {
            scope: shared.scope.clone(),
            fingerprint_headers: shared.fingerprint_headers.clone(),
            replay_headers: shared.replay_headers.clone(),
            max_request_len: shared.max_request_len,
            wait_for_first: shared.wait_for_first,
            retry_after: shared.retry_after,
            in_flight: Mutex::new(HashSet::new()),
        });
        change(&mut config);
        IdempotencyLayer {
            config: Arc::new(config),
        }
    }

    /// The caller's identity (the authenticated user, the API key), read from the request:
    /// each caller's keys are their own, and two callers' equal keys never meet. `None`
    /// (no identity) answers `401`. The scope and the key together fit a message id
    /// (`scope + 1 + key ≤ 255` bytes); a scope must not be empty or hold U+001F or NUL.
    pub fn scope<F>(self, scope: F) -> IdempotencyLayer
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|config| config.scope = Some(Arc::new(scope)))
    }

    /// Request headers that are part of what makes a request the same request (with the
    /// method, the path and query, and the body): the same key with another value of one
    /// of them is `422`.
    pub fn fingerprint_headers<I>(self, names: I) -> IdempotencyLayer
    where
        I: IntoIterator,
        I::Item: Into<HeaderName>,
    {
        let names = names.into_iter().map(Into::into).collect();
        self.with(|config| config.fingerprint_headers = names)
    }

    /// Response headers that [`IdempotentRequest::capture`] keeps with the body, besides
    /// `Content-Type`: what a retry gets again (say, `Location`).
    pub fn replay_headers<I>(self, names: I) -> IdempotencyLayer
    where
        I: IntoIterator,
        I::Item: Into<HeaderName>,
    {
        let names = names.into_iter().map(Into::into).collect();
        self.with(|config| config.replay_headers = names)
    }

    /// The largest request body buffered (the body is part of the fingerprint): a larger
    /// one is `413`. [`DEFAULT_MAX_REQUEST_LEN`] by default.
    pub fn max_request_len(self, len: usize) -> IdempotencyLayer {
        self.with(|config| config.max_request_len = len)
    }

    /// A retry that arrives while the first request with its key runs in this process
    /// waits for it (the database holds it on the first one's claim) and gets its stored
    /// response, instead of `409`.
    pub fn wait_for_first(self, wait: bool) -> IdempotencyLayer {
        self.with(|config| config.wait_for_first = wait)
    }

    /// The `Retry-After` of the `409` a concurrent retry gets: 1 s by default (rounded up
    /// to whole seconds, at least 1).
    pub fn retry_after(self, after: Duration) -> IdempotencyLayer {
        self.with(|config| config.retry_after = after)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service of an [`IdempotencyLayer`] around a route.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<S> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh one waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let context = match read(&config, &parts, body).await {
                Ok(context) => context,
                Err(answer) => return Ok(answer),
            };
            // A retry of a request still running here: `409` before the handler.
            let flight = format!("{} {}\n{}", parts.method, parts.uri.path(), context.id);
            let _flying = if config.wait_for_first {
                None
            } else {
                match Flight::enter(&config, flight) {
                    Some(flight) => Some(flight),
                    None => return Ok(in_progress(config.retry_after).into_response()),
                }
            };
            let body = Body::from(context.body.clone());
            parts.extensions.insert(Arc::new(context));
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}

/// A request with its key in flight in this process, until dropped.
struct Flight {
    config: Arc<Config>,
    key: String,
}

impl Flight {
    fn enter(config: &Arc<Config>, key: String) -> Option<Flight> {
        let mut flying = config
            .in_flight
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if !flying.insert(key.clone()) {
            return None;
        }
        Some(Flight {
            config: config.clone(),
            key,
        })
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut flying = self
            .config
            .in_flight
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        flying.remove(&self.key);
    }
}

/// What the layer read from a request, for its handler.
struct Read {
    key: String,
    scope: Option<String>,
    id: String,
    body: Bytes,
    /// The SHA-256 of the method, the path and query, the named headers and the body,
    /// each length-prefixed (hashed as they are read, the body not copied): what the
    /// handler's `fingerprint = req` stores (hashed once more).
    digest: [u8; 32],
    replay_headers: Vec<HeaderName>,
}

/// A problem the layer answers before the handler: counted, then sent.
fn refused(
    status: StatusCode,
    kind: &'static str,
    label: &'static str,
    title: &str,
    detail: &str,
) -> Response {
    crate::metrics::http_answered(label);
    problem(status, kind, title, detail, None)
}

async fn read(config: &Config, parts: &Parts, body: Body) -> Result<Read, Response> {
    let mut values = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Err(refused(
            StatusCode::BAD_REQUEST,
            MISSING_KEY,
            "missing_key",
            "An Idempotency-Key is required",
            &KeyError::Missing.to_string(),
        ));
    };
    let key = if values.next().is_some() {
        Err(KeyError::Repeated)
    } else {
        parse_key(value.as_bytes())
    };
    let malformed = |error: KeyError| {
        refused(
            StatusCode::BAD_REQUEST,
            MALFORMED_KEY,
            "malformed_key",
            "The Idempotency-Key is not accepted",
            &error.to_string(),
        )
    };
    let key = key.map_err(malformed)?;
    let scope = match &config.scope {
        None => None,
        Some(scope) => match scope(parts) {
            Some(scope) => Some(scope),
            None => {
                return Err(refused(
                    StatusCode::UNAUTHORIZED,
                    UNIDENTIFIED_CALLER,
                    "unidentified_caller",
                    "The caller is not identified",
                    "Idempotency-Keys are kept per caller, and this request names none.",
                ));
            }
        },
    };
    let id = match message_id(scope.as_deref(), &key) {
        Ok(id) => id,
        Err(error @ KeyError::InvalidScope) => {
            return Err(HttpError::server(error).into_response());
        }
        Err(error) => return Err(malformed(error)),
    };
    let limited = http_body_util::Limited::new(body, config.max_request_len);
    let body = match http_body_util::BodyExt::collect(limited).await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            return Err(refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                REQUEST_TOO_LARGE,
                "request_too_large",
                "The request body is too large",
                &format!(
                    "An idempotent request's body is kept whole to compare retries with it: \
                     at most {} bytes here.",
                    config.max_request_len
                ),
            ));
        }
        Err(error) => {
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "about:blank",
                "unreadable_request",
                "The request body could not be read",
                &error.to_string(),
            ));
        }
    };
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(parts.method.as_str().as_bytes());
    field(
        parts
            .uri
            .path_and_query()
            .map_or("/", |path| path.as_str())
            .as_bytes(),
    );
    for name in &config.fingerprint_headers {
        field(name.as_str().as_bytes());
        for value in parts.headers.get_all(name) {
            field(value.as_bytes());
        }
    }
    field(&body);
    Ok(Read {
        key,
        scope,
        id,
        body,
        digest: hasher.finalize().into(),
        replay_headers: config.replay_headers.clone(),
    })
}

/// What the [`IdempotencyLayer`] read from the request, for its handler: the key, its
/// scope and their message id, the body, and the request's fingerprint. An axum
/// extractor (`FromRequestParts`: other extractors, the body's included, still work).
///
/// In the `#[idempotent]` handler: `key = req.id()` claims the key, `fingerprint = req`
/// compares the request with the first one that used it (method, path and query, the
/// named headers, the body), `result = "stored"` with `Result<StoredResponse, HttpError>`
/// stores the response. [`answer`](Self::answer) turns what the handler returned into the
/// response.
///
/// On a route without the layer, extracting it answers `500` ([`SERVER_ERROR`](super::SERVER_ERROR)).
#[derive(Clone)]
pub struct IdempotentRequest {
    read: Arc<Read>,
}

impl fmt::Debug for IdempotentRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentRequest")
            .field("key", &self.read.key)
            .field("scope", &self.read.scope)
            .field("body_len", &self.read.body.len())
            .finish()
    }
}

impl IdempotentRequest {
    /// The key, as the client sent it (unescaped).
    pub fn key(&self) -> &str {
        &self.read.key
    }

    /// The caller's scope, when the layer has one.
    pub fn scope(&self) -> Option<&str> {
        self.read.scope.as_deref()
    }

    /// The message id the handler claims: [`message_id`](super::message_id) of the scope
    /// and the key.
    pub fn id(&self) -> &str {
        &self.read.id
    }

    /// The request body.
    pub fn body(&self) -> &Bytes {
        &self.read.body
    }

    /// An axum response captured for storing: its status, the body (at most
    /// [`MAX_RESULT_LEN`](crate::MAX_RESULT_LEN) bytes), `Content-Type` and the headers
    /// the layer's [`replay_headers`](IdempotencyLayer::replay_headers) names. A server
    /// error is refused: return it as `Err`.
    pub async fn capture(&self, response: Response) -> Result<StoredResponse, CaptureError> {
        let mut stored = StoredResponse::capture(response, crate::MAX_RESULT_LEN).await?;
        stored.keep_headers(&self.read.replay_headers);
        Ok(stored)
    }

    /// The response for what the handler returned: the stored response for a first
    /// request (`Processed`) and, marked `Idempotent-Replayed: true`, for a retry after it
    /// (`Replayed`); `409` with `Retry-After` while a leased first request runs
    /// (`InProgress`); `409` ([`NO_STORED_RESPONSE`]) for a key recorded without a
    /// response; the error's problem for an `Err`.
    pub fn answer<E: Into<HttpError>>(
        &self,
        result: Result<StoredOutcome<StoredResponse>, E>,
    ) -> Response {
        match result {
            Ok(StoredOutcome::Processed(response)) => {
                crate::metrics::http_answered("processed");
                response.into_response(false)
            }
            Ok(StoredOutcome::Replayed(response)) => {
                crate::metrics::http_answered("replayed");
                response.into_response(true)
            }
            Ok(StoredOutcome::InProgress(busy)) => in_progress(busy.remaining()).into_response(),
            Ok(StoredOutcome::Duplicate(_)) => refused(
                StatusCode::CONFLICT,
                NO_STORED_RESPONSE,
                "no_stored_response",
                "The request was completed before, without a stored response",
                "A request with this Idempotency-Key completed, and no response was kept \
                 for it: use a new key for a new request.",
            ),
            Err(error) => error.into().into_response(),
        }
    }
}

impl FingerprintSource for IdempotentRequest {
    fn fingerprint_bytes(&self) -> &[u8] {
        &self.read.digest
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotentRequest {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<Arc<Read>>() {
            Some(read) => Ok(IdempotentRequest { read: read.clone() }),
            None => Err(HttpError::server(
                "IdempotentRequest on a route without an IdempotencyLayer: add \
                 `.layer(IdempotencyLayer::new())` to the route",
            )
            .into_response()),
        }
    }
}
