//! HTTP idempotency keys (feature `axum`): a handler that writes to the database is
//! idempotent per `Idempotency-Key`, the key claimed **in the handler's own transaction**
//! and the first response stored with it.
//!
//! A client that timed out retries its `POST /payments`; the same duplicate a message
//! consumer meets, from the other side. The crates that store the key and the response in
//! a session store or Redis, apart from the handler's transaction, charge twice when the
//! process dies between the handler's commit and the key's write. Here the key is the
//! message id of an ordinary [`#[idempotent]`](crate::idempotent) handler, so the key, the
//! response and the handler's work commit together or not at all:
//!
//! ```no_run
//! use axum::{Router, extract::State, response::Response, routing::post};
//! use dedup_runtime::http::{HttpError, IdempotencyLayer, IdempotentRequest, StoredResponse};
//! use dedup_runtime::idempotent;
//! use http::StatusCode;
//! use sqlx::{PgConnection, PgPool};
//!
//! #[idempotent(consumer = "payments", key = req.id(), fingerprint = req, result = "stored")]
//! async fn pay(tx: &mut PgConnection, req: &IdempotentRequest) -> Result<StoredResponse, HttpError> {
//!     let row: (i64,) = sqlx::query_as("INSERT INTO payments (body) VALUES ($1) RETURNING id")
//!         .bind(req.body().as_ref())
//!         .fetch_one(&mut *tx)
//!         .await?;
//!     Ok(StoredResponse::new(StatusCode::CREATED)
//!         .header(http::header::LOCATION, format!("/payments/{}", row.0))?
//!         .body(format!("{{\"id\":{}}}", row.0)))
//! }
//!
//! async fn create_payment(State(pool): State<PgPool>, req: IdempotentRequest) -> Response {
//!     req.answer(pay(&pool, &req).await)
//! }
//!
//! # fn app(pool: PgPool) -> Router {
//! let keys = IdempotencyLayer::new()
//!     // Keys are the caller's: two API keys' `Idempotency-Key: "1"` never meet.
//!     .scope(|request| {
//!         let key = request.headers.get("x-api-key")?;
//!         key.to_str().ok().map(str::to_owned)
//!     })
//!     .replay_headers([http::header::LOCATION]);
//! Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(keys)
//!     .with_state(pool)
//! # }
//! ```
//!
//! # What each request gets
//!
//! | request | answer |
//! | --- | --- |
//! | no `Idempotency-Key` on a route under the layer | `400`, `type` [`MISSING_KEY`] |
//! | a key that is not a structured-field string (RFC 8941: `"…"`, printable ASCII, `\"` and `\\` the only escapes), two of them, an empty one, one too long | `400`, [`MALFORMED_KEY`] |
//! | no caller identity (the [`scope`](IdempotencyLayer::scope) closure returned `None`) | `401`, [`UNIDENTIFIED_CALLER`] |
//! | a body over [`max_request_len`](IdempotencyLayer::max_request_len) | `413`, [`REQUEST_TOO_LARGE`] |
//! | the first request with a key | the handler runs; its response, if it returned `Ok`, is stored with the key and sent |
//! | a retry after the first committed | the stored response, status, named headers and body byte for byte, with `Idempotent-Replayed: true`; the handler does not run |
//! | the same key with another request (method, path and query, body, the [named headers](IdempotencyLayer::fingerprint_headers)) | `422`, [`KEY_REUSED`]; nothing runs |
//! | a retry while the first is still running in this process | `409` with `Retry-After`, [`IN_PROGRESS`] (or, with [`wait_for_first`](IdempotencyLayer::wait_for_first), it waits and gets the replay) |
//! | a handler that returned `Err` | its problem ([`HttpError`]); nothing committed, the key is free for a retry |
//! | a response over the handler's `max_result_len` (encoded: status, headers, body and a few bytes; 4 MiB by default, at most 8 MiB) | `500`, [`RESPONSE_TOO_LARGE`]; nothing committed |
//!
//! Every error body is `application/problem+json` (RFC 9457) with a `type` per case (the
//! constants of this module), a `title`, the `status` and a `detail`.
//!
//! **Which responses are stored.** What the handler returns as `Ok(StoredResponse)` — a
//! success, or a client error it decides to keep (`422` for an invalid amount: a retry
//! with the same request would get the same answer) — is stored and replayed, as the
//! draft asks of a request that completed. What it returns as `Err(HttpError)` is not:
//! the transaction rolls back and a retry runs the handler again. A `StoredResponse` with
//! a server error status is refused (by [`StoredResponse::header`] and
//! [`StoredResponse::checked`], and, returned as `Ok` anyway, when it is stored: the
//! transaction rolls back and the client gets a `500` of [`SERVER_ERROR`]): a server error
//! is an `Err`, never stored, so that a retry after a failure gets another chance. That is the default because a
//! stored failure could only be undone by an operator, and a failure the client may
//! retry (the database away, a timeout) must not be frozen into the key.
//!
//! **Concurrent retries.** A retry that arrives while the first request runs in the same
//! process gets `409` at once, before any statement. In another process it meets the
//! first request's uncommitted claim in the database and waits for it (PostgreSQL,
//! MariaDB: its row lock; SQLite: the write lock), then replays what it stored: the
//! answer is right, only later. Handlers whose effect is outside the database use the
//! lease forms (`effect = "send-first"` / `"mark-first"` with `lease = …`): their claim
//! commits before the call, so every other copy, in any process, gets `409` with the
//! lease's remaining time as `Retry-After`.
//!
//! **The key and its scope are the message id**: `<scope>` U+001F `<key>`, or the key
//! alone without a scope ([`message_id`]), under the handler's `consumer`. They must fit
//! a message id together: `scope + 1 + key ≤ 255` bytes ([`MAX_MESSAGE_ID_LEN`]); a key
//! that does not fit is `400`. The operator's tools see them as any message id
//! ([`Ledger`](crate::Ledger), [`Prune`](crate::Prune)). Keys expire by pruning: keep
//! them at least as long as your clients retry (`Prune::new(older_than, retry_window)`).
//!
//! [`MAX_MESSAGE_ID_LEN`]: crate::MAX_MESSAGE_ID_LEN

mod key;
mod layer;
mod problem;
mod response;

pub use key::{KeyError, message_id, parse_key};
pub use layer::{IdempotencyLayer, IdempotencyService, IdempotentRequest};
pub use problem::{
    HttpError, IN_PROGRESS, KEY_REUSED, MALFORMED_KEY, MISSING_KEY, NO_STORED_RESPONSE,
    REQUEST_TOO_LARGE, RESPONSE_TOO_LARGE, SERVER_ERROR, UNIDENTIFIED_CALLER,
};
pub use response::{CaptureError, StoredResponse};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replay: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The largest request body a layer buffers unless [`IdempotencyLayer::max_request_len`]
/// says otherwise: 2 MiB, axum's own default body limit.
pub const DEFAULT_MAX_REQUEST_LEN: usize = 2 << 20;
