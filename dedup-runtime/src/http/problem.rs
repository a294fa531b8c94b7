//! `application/problem+json` (RFC 9457) answers, and [`HttpError`], what an idempotent
//! HTTP handler fails with.

use std::fmt;
use std::time::Duration;

use axum_core::body::Body;
use axum_core::response::Response;
use http::{HeaderValue, StatusCode, header};

use crate::{FingerprintMismatch, InProgress, InvalidMessageId, StoredResultError};

macro_rules! problem_types {
    ($($(#[$doc:meta])* $name:ident = $slug:literal;)*) => {
        $(
            $(#[$doc])*
            pub const $name: &str = concat!(
                "https://github.com/dedup-rs/dedup/blob/main/guide/src/http.md#",
                $slug
            );
        )*
    };
}

problem_types! {
    /// `400`: the request has no `Idempotency-Key` on a route that requires one.
    MISSING_KEY = "missing-key";
    /// `400`: the `Idempotency-Key` is not one structured-field string, is empty, or does
    /// not fit a message id with the caller's scope.
    MALFORMED_KEY = "malformed-key";
    /// `401`: the application's scope closure found no caller identity.
    UNIDENTIFIED_CALLER = "unidentified-caller";
    /// `413`: the request body is over the layer's `max_request_len`.
    REQUEST_TOO_LARGE = "request-too-large";
    /// `422`: the key was used before with another request.
    KEY_REUSED = "key-reused";
    /// `409`, with `Retry-After`: the first request with this key is still running.
    IN_PROGRESS = "in-progress";
    /// `409`: the key's request completed before, and no response is stored for it (its
    /// outcome is unknown, or it was recorded without one).
    NO_STORED_RESPONSE = "no-stored-response";
    /// `500`: the response was too large to store; nothing was committed.
    RESPONSE_TOO_LARGE = "response-too-large";
    /// `500`: the handler failed; nothing was committed, and a retry with the same key
    /// runs it again.
    SERVER_ERROR = "server-error";
}

/// A problem answer: `status`, `type`, `title`, `detail`, as `application/problem+json`.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response {
    let mut json = String::with_capacity(96 + kind.len() + title.len() + detail.len());
    json.push_str("{\"type\":");
    push_json_string(&mut json, kind);
    json.push_str(",\"title\":");
    push_json_string(&mut json, title);
    json.push_str(",\"status\":");
    json.push_str(&status.as_u16().to_string());
    json.push_str(",\"detail\":");
    push_json_string(&mut json, detail);
    json.push('}');
    let mut response = Response::new(Body::from(json));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if let Some(after) = retry_after {
        // Whole seconds, at least 1: `Retry-After: 0` would invite a busy loop.
        let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    }
    response
}

/// `text` as a JSON string, escaped (quotes, backslashes, control characters).
fn push_json_string(json: &mut String, text: &str) {
    json.push('"');
    for c in text.chars() {
        match c {
            '"' => json.push_str("\\\""),
            '\\' => json.push_str("\\\\"),
            '\n' => json.push_str("\\n"),
            '\r' => json.push_str("\\r"),
            '\t' => json.push_str("\\t"),
            c if u32::from(c) < 0x20 || c == '\u{2028}' || c == '\u{2029}' => {
                json.push_str(&format!("\\u{:04x}", u32::from(c)));
            }
            c => json.push(c),
        }
    }
    json.push('"');
}

/// What an idempotent HTTP handler fails with: its transaction rolls back, nothing of it
/// stays, and the key is free for a retry. [`IdempotentRequest::answer`] turns it into a
/// problem response.
///
/// A database error (`?` on a query: `From<sqlx::Error>`) is a `500` whose detail says
/// nothing of the database; a fingerprint mismatch the claim found is the `422` of
/// [`KEY_REUSED`]; [`HttpError::problem`] is a client error of yours that should not be
/// stored (a retry may succeed: a rate limit, a state that may change). A client error
/// that a retry must get again is not an error: return it as `Ok(StoredResponse)`.
///
/// [`IdempotentRequest::answer`]: super::IdempotentRequest::answer
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    kind: String,
    title: String,
    detail: String,
    retry_after: Option<Duration>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl HttpError {
    /// A problem of the application's: its status (a client error, or a server error),
    /// its `type` URI (`about:blank` when it has none of its own), title and detail.
    pub fn problem(
        status: StatusCode,
        kind: impl Into<String>,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> HttpError {
        HttpError {
            status,
            kind: kind.into(),
            title: title.into(),
            detail: detail.into(),
            retry_after: None,
            source: None,
        }
    }

    /// A server error from any error of the handler's: `500`, [`SERVER_ERROR`], the
    /// error kept as the source (logged, never sent to the client).
    pub fn server(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> HttpError {
        HttpError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: SERVER_ERROR.to_owned(),
            title: "The request failed".to_owned(),
            detail: "The request failed and nothing of it was kept: retry it with the same \
                     Idempotency-Key."
                .to_owned(),
            retry_after: None,
            source: Some(error.into()),
        }
    }

    /// The status it answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Its problem `type`.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Its answer's label in `dedup_http_answers_total`: the slug of one of this module's
    /// problem types, or `application_error`.
    pub(crate) fn answer_label(&self) -> &'static str {
        [
            (MISSING_KEY, "missing_key"),
            (MALFORMED_KEY, "malformed_key"),
            (UNIDENTIFIED_CALLER, "unidentified_caller"),
            (REQUEST_TOO_LARGE, "request_too_large"),
            (KEY_REUSED, "key_reused"),
            (IN_PROGRESS, "in_progress"),
            (NO_STORED_RESPONSE, "no_stored_response"),
            (RESPONSE_TOO_LARGE, "response_too_large"),
            (SERVER_ERROR, "server_error"),
        ]
        .into_iter()
        .find_map(|(kind, label)| (kind == self.kind).then_some(label))
        .unwrap_or("application_error")
    }

    /// The problem response.
    pub fn into_response(self) -> Response {
        crate::metrics::http_answered(self.answer_label());
        if let Some(source) = &self.source {
            tracing::warn!(
                target: "dedup_runtime::http",
                status = self.status.as_u16(),
                error = %source,
                "an idempotent request failed"
            );
        }
        problem(
            self.status,
            &self.kind,
            &self.title,
            &self.detail,
            self.retry_after,
        )
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{} ({}): {source}", self.title, self.status),
            None => write!(f, "{} ({}): {}", self.title, self.status, self.detail),
        }
    }
}

impl std::error::Error for HttpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static))
    }
}

impl From<sqlx::Error> for HttpError {
    fn from(error: sqlx::Error) -> Self {
        let error: &(dyn std::error::Error + 'static) = &error;
        if let Some(mismatch) = FingerprintMismatch::find(error) {
            return HttpError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                kind: KEY_REUSED.to_owned(),
                title: "The Idempotency-Key was used with another request".to_owned(),
                detail: "This Idempotency-Key was first used with another method, path, body \
                         or headers: use a new key for a new request."
                    .to_owned(),
                retry_after: None,
                source: Some(Box::new(mismatch.clone())),
            };
        }
        if let Some(stored @ StoredResultError::TooLarge { .. }) = StoredResultError::find(error) {
            return HttpError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: RESPONSE_TOO_LARGE.to_owned(),
                title: "The response could not be stored".to_owned(),
                detail: "The response was too large to store with its Idempotency-Key, and \
                         nothing of the request was kept."
                    .to_owned(),
                retry_after: None,
                source: Some(stored.to_string().into()),
            };
        }
        if let Some(invalid) = InvalidMessageId::find(error) {
            return HttpError {
                status: StatusCode::BAD_REQUEST,
                kind: MALFORMED_KEY.to_owned(),
                title: "The Idempotency-Key is not accepted".to_owned(),
                detail: invalid.to_string(),
                retry_after: None,
                source: None,
            };
        }
        if let Some(busy) = InProgress::find(error) {
            return in_progress(busy.remaining());
        }
        HttpError::server(error.to_string())
    }
}

impl From<crate::outbox::OutboxError> for HttpError {
    /// An outbox event the handler could not enqueue: as the database error it holds.
    fn from(error: crate::outbox::OutboxError) -> Self {
        HttpError::from(sqlx::Error::from(error))
    }
}

impl From<crate::outbox::InvalidCause> for HttpError {
    /// An outbox cause refused (the handler's consumer name, or the key): a server error.
    fn from(error: crate::outbox::InvalidCause) -> Self {
        HttpError::from(sqlx::Error::from(error))
    }
}

/// `409` with `Retry-After`: the first request with the key is still running.
pub(crate) fn in_progress(retry_after: Duration) -> HttpError {
    HttpError {
        status: StatusCode::CONFLICT,
        kind: IN_PROGRESS.to_owned(),
        title: "A request with this Idempotency-Key is still running".to_owned(),
        detail: "The first request with this Idempotency-Key has not finished: retry after \
                 the time Retry-After says, and get its response."
            .to_owned(),
        retry_after: Some(retry_after),
        source: None,
    }
}
