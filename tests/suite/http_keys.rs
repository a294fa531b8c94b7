//! HTTP idempotency keys (issue 43, feature `axum`), on PostgreSQL, MariaDB and SQLite: a
//! real axum server on loopback and a real HTTP client (reqwest). Each case checks the
//! answer and the database: the handler's effects and the dedup rows of the key.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::Response;
use dedup_runtime::http::{
    HttpError, IN_PROGRESS, IdempotencyLayer, IdempotentRequest, KEY_REUSED, MALFORMED_KEY,
    MISSING_KEY, REQUEST_TOO_LARGE, RESPONSE_TOO_LARGE, SERVER_ERROR, StoredResponse,
    UNIDENTIFIED_CALLER, message_id,
};
use dedup_runtime::{MAX_MESSAGE_ID_LEN, Prune};
use tokio::sync::Notify;

/// The consumer name of the suite's endpoint.
const CONSUMER: &str = "http-suite-payments";

/// The consumer of the leased route.
const LEASED: &str = "http-suite-charges";

/// The consumer of the route whose keys the expiry case prunes (no other case uses it).
const EXPIRING: &str = "http-suite-expiring";

/// What the handlers share: the pool, their effects table, and the knobs of the cases.
pub struct App<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    table: String,
    /// The next call fails with a server error, after writing its effect.
    fail_next: AtomicBool,
    /// A body `slow` waits here before it answers.
    gate: Notify,
    /// Numbers the responses: a replay shows the first one's number.
    served: AtomicU64,
    /// SQLite's temporary file, deleted with it.
    _file: Option<dedup_suite::TempSqlite>,
}

/// What the handler does for a body: the response it stores, or the error it fails with.
fn respond<DB: sqlx::Database>(
    app: &App<DB>,
    req: &IdempotentRequest,
) -> Result<StoredResponse, HttpError> {
    if app.fail_next.swap(false, Ordering::SeqCst) {
        return Err(HttpError::server("the suite's planned failure"));
    }
    let n = app.served.fetch_add(1, Ordering::SeqCst) + 1;
    let body = req.body();
    if body.as_ref() == b"502" {
        // A server error returned as `Ok` anyway: refused when it is stored.
        return Ok(StoredResponse::new(StatusCode::BAD_GATEWAY).body("upstream down"));
    }
    if body.as_ref() == b"invalid" {
        // A client error the handler keeps: stored and replayed.
        return Ok(StoredResponse::new(StatusCode::UNPROCESSABLE_ENTITY)
            .header(header::CONTENT_TYPE, "application/json")?
            .body(format!("{{\"error\":\"invalid amount\",\"n\":{n}}}")));
    }
    let echo = if body.as_ref() == b"big" {
        "x".repeat(5_000)
    } else {
        String::from_utf8_lossy(body).into_owned()
    };
    Ok(StoredResponse::new(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")?
        .header(header::LOCATION, format!("/payments/{n}"))?
        .body(format!("{{\"n\":{n},\"echo\":\"{echo}\"}}")))
}

/// Each case, against a server of its own (expanded in each backend's module).
macro_rules! cases {
    ($($case:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $case() {
            let (base, app) = serve().await;
            super::$case(&base, &app).await;
        }
    )*};
}

// rustfmt re-indents the attributes inside this macro at every run: kept as written.
#[rustfmt::skip]
macro_rules! backend {
    ($backend:ident, $db:ty, $conn:ty, $pool:expr, $insert:literal) => {
        mod $backend {
            use super::*;

            #[dedup_runtime::idempotent(
                consumer = CONSUMER,
                key = req.id(),
                fingerprint = req,
                result = "stored",
                max_result_len = 4096
            )]
            async fn pay(
                tx: &mut $conn,
                req: &IdempotentRequest,
                app: &App<$db>,
            ) -> Result<StoredResponse, HttpError> {
                work(tx, req, app).await
            }

            #[dedup_runtime::idempotent(
                consumer = EXPIRING,
                key = req.id(),
                fingerprint = req,
                result = "stored"
            )]
            async fn pay_expiring(
                tx: &mut $conn,
                req: &IdempotentRequest,
                app: &App<$db>,
            ) -> Result<StoredResponse, HttpError> {
                work(tx, req, app).await
            }

            /// An effect outside the database, under a lease: no transaction open during the
            /// call, and every other copy of the key, in any process, sees the lease.
            #[dedup_runtime::idempotent(
                consumer = LEASED,
                key = req.id(),
                fingerprint = req,
                result = "stored",
                effect = "send-first",
                lease = "30s"
            )]
            async fn charge(
                lease: &mut dedup_runtime::Lease<'_, $db>,
                req: &IdempotentRequest,
                app: &App<$db>,
            ) -> Result<StoredResponse, HttpError> {
                // The provider's call would carry the key derived from the HTTP key.
                let provider_key = dedup_runtime::IdempotencyKey::new("charge", req.id());
                assert!(!provider_key.as_str().is_empty());
                if req.body().as_ref() == b"slow" {
                    app.gate.notified().await;
                }
                let tx = lease.transaction().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!($insert, app.table)))
                    .bind(req.id())
                    .bind(req.body().to_vec())
                    .execute(&mut *tx)
                    .await?;
                respond(app, req)
            }

            async fn create_charge(
                State(app): State<Arc<App<$db>>>,
                req: IdempotentRequest,
            ) -> Response {
                req.answer(charge(&app.pool, &req, &app).await)
            }

            /// The handlers' body: the effect, then the response.
            async fn work(
                tx: &mut $conn,
                req: &IdempotentRequest,
                app: &App<$db>,
            ) -> Result<StoredResponse, HttpError> {
                sqlx::query(sqlx::AssertSqlSafe(format!($insert, app.table)))
                    .bind(req.id())
                    .bind(req.body().to_vec())
                    .execute(&mut *tx)
                    .await?;
                if req.body().as_ref() == b"slow" {
                    app.gate.notified().await;
                }
                respond(app, req)
            }

            async fn create(State(app): State<Arc<App<$db>>>, req: IdempotentRequest) -> Response {
                req.answer(pay(&app.pool, &req, &app).await)
            }

            async fn create_expiring(
                State(app): State<Arc<App<$db>>>,
                req: IdempotentRequest,
            ) -> Response {
                req.answer(pay_expiring(&app.pool, &req, &app).await)
            }

            async fn serve() -> (String, Arc<App<$db>>) {
                let (pool, file) = $pool;
                let table = dedup_suite::unique_table("http_payments");
                dedup_suite::ddl(
                    &pool,
                    &format!("CREATE TABLE {table} (message_id VARCHAR(300), body BLOB)")
                        .replace("BLOB", <$db as Blob>::BLOB),
                )
                .await;
                let app = Arc::new(App {
                    pool,
                    table,
                    fail_next: AtomicBool::new(false),
                    gate: Notify::new(),
                    served: AtomicU64::new(0),
                    _file: file,
                });
                let plain = IdempotencyLayer::new()
                    .replay_headers([header::LOCATION])
                    .max_request_len(64 * 1024);
                let scoped = IdempotencyLayer::new()
                    .scope(|request| {
                        let key = request.headers.get("x-api-key")?;
                        key.to_str().ok().map(str::to_owned)
                    })
                    .replay_headers([header::LOCATION]);
                // Retries wait for the first here (as in another process): the lease answers.
                let waiting = IdempotencyLayer::new().wait_for_first(true);
                let router = Router::new()
                    .route("/payments", axum::routing::post(create))
                    .route("/expiring", axum::routing::post(create_expiring))
                    .layer(plain)
                    .merge(
                        Router::new()
                            .route("/scoped", axum::routing::post(create))
                            .layer(scoped),
                    )
                    .merge(
                        Router::new()
                            .route("/charges", axum::routing::post(create_charge))
                            .layer(waiting),
                    )
                    .with_state(app.clone());
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let address = listener.local_addr().unwrap();
                tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
                (format!("http://{address}"), app)
            }

            cases!(
                first_request_replay_and_mismatch,
                missing_and_malformed_keys,
                a_concurrent_retry_gets_409_then_the_replay,
                a_server_error_keeps_nothing_and_the_retry_runs,
                scoped_keys_never_meet,
                a_leased_first_request_answers_every_copy_409,
                limits_kept_client_errors_and_expiry,
            );
        }
    };
}

/// Each backend's column type for bytes.
trait Blob {
    const BLOB: &'static str;
}
impl Blob for sqlx::Postgres {
    const BLOB: &'static str = "BYTEA";
}
impl Blob for sqlx::MySql {
    const BLOB: &'static str = "LONGBLOB";
}
impl Blob for sqlx::Sqlite {
    const BLOB: &'static str = "BLOB";
}

backend!(
    postgres,
    sqlx::Postgres,
    sqlx::PgConnection,
    (dedup_suite::postgres().await, None),
    "INSERT INTO {} (message_id, body) VALUES ($1, $2)"
);
backend!(
    mysql,
    sqlx::MySql,
    sqlx::MySqlConnection,
    (dedup_suite::mysql().await, None),
    "INSERT INTO {} (message_id, body) VALUES (?, ?)"
);
backend!(
    sqlite,
    sqlx::Sqlite,
    sqlx::SqliteConnection,
    {
        let file = dedup_suite::sqlite().await;
        (file.pool.clone(), Some(file))
    },
    "INSERT INTO {} (message_id, body) VALUES (?, ?)"
);

/// A structured-field string of `key`.
fn quoted(key: &str) -> String {
    format!("\"{key}\"")
}

async fn send(base: &str, path: &str, key: Option<&str>, body: &'static str) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .body(body);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.unwrap()
}

/// A response's parts that a replay must repeat.
async fn parts(
    response: reqwest::Response,
) -> (StatusCode, Option<String>, Option<String>, bool, Vec<u8>) {
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|value| value.to_str().unwrap().to_owned())
    };
    let location = header("location");
    let content_type = header("content-type");
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let body = response.bytes().await.unwrap().to_vec();
    (status, location, content_type, replayed, body)
}

/// A problem answer: its status, and its `type`, from an `application/problem+json` body.
async fn problem(response: reqwest::Response) -> (StatusCode, String, Option<String>) {
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "{status}"
    );
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned());
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["status"], status.as_u16(), "{body}");
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{body}"
    );
    (
        status,
        body["type"].as_str().unwrap().to_owned(),
        retry_after,
    )
}

async fn effects<DB: dedup_suite::TestDatabase>(app: &App<DB>, id: &str) -> i64 {
    dedup_suite::rows(&app.pool, &app.table, "message_id", id).await
}

async fn first_request_replay_and_mismatch<DB: dedup_suite::TestDatabase>(
    base: &str,
    app: &App<DB>,
) {
    let key = dedup_suite::unique("pay");
    let first = parts(send(base, "/payments", Some(&quoted(&key)), "10 EUR").await).await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(first.1.as_deref(), Some("/payments/1"));
    assert_eq!(first.2.as_deref(), Some("application/json"));
    assert!(!first.3, "a first answer is not a replay");
    assert_eq!(first.4, br#"{"n":1,"echo":"10 EUR"}"#);
    assert_eq!(effects(app, &key).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key).await, 1);

    for _ in 0..2 {
        let again = parts(send(base, "/payments", Some(&quoted(&key)), "10 EUR").await).await;
        assert!(again.3, "Idempotent-Replayed: true");
        assert_eq!(
            (again.0, &again.1, &again.2, &again.4),
            (first.0, &first.1, &first.2, &first.4),
            "the stored response, byte for byte"
        );
    }
    assert_eq!(effects(app, &key).await, 1, "the handler did not run again");
    assert_eq!(app.served.load(Ordering::SeqCst), 1);

    // The same key with another body, another path's query, or as another key's text.
    let other = problem(send(base, "/payments", Some(&quoted(&key)), "99 EUR").await).await;
    assert_eq!(
        (other.0, other.1.as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, KEY_REUSED)
    );
    let query = problem(send(base, "/payments?x=1", Some(&quoted(&key)), "10 EUR").await).await;
    assert_eq!(
        (query.0, query.1.as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, KEY_REUSED)
    );
    assert_eq!(effects(app, &key).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key).await, 1);
    // The identical retry after a mismatch is still a replay.
    let again = parts(send(base, "/payments", Some(&quoted(&key)), "10 EUR").await).await;
    assert!(again.3 && again.4 == first.4);
}

async fn missing_and_malformed_keys<DB: dedup_suite::TestDatabase>(base: &str, app: &App<DB>) {
    let missing = problem(send(base, "/payments", None, "1").await).await;
    assert_eq!(
        (missing.0, missing.1.as_str()),
        (StatusCode::BAD_REQUEST, MISSING_KEY)
    );
    for malformed in [
        "token-not-string",
        "\"unterminated",
        "\"a\";param=1",
        "\"\"",
        "\"bad \\n escape\"",
        "\"tab\tinside\"",
        "\"a\" \"b\"",
    ] {
        let answer = problem(send(base, "/payments", Some(malformed), "1").await).await;
        assert_eq!(
            (answer.0, answer.1.as_str()),
            (StatusCode::BAD_REQUEST, MALFORMED_KEY),
            "{malformed:?}"
        );
    }
    // Two fields.
    let twice = reqwest::Client::new()
        .post(format!("{base}/payments"))
        .header("idempotency-key", "\"a\"")
        .header("idempotency-key", "\"b\"")
        .body("1")
        .send()
        .await
        .unwrap();
    let twice = problem(twice).await;
    assert_eq!(
        (twice.0, twice.1.as_str()),
        (StatusCode::BAD_REQUEST, MALFORMED_KEY)
    );
    // The id limit: a key of 255 bytes (no scope) is accepted, 256 is not.
    let prefix = dedup_suite::unique("l");
    let at = format!("{prefix}{}", "k".repeat(MAX_MESSAGE_ID_LEN - prefix.len()));
    let ok = send(base, "/payments", Some(&quoted(&at)), "at the limit").await;
    assert_eq!(ok.status().as_u16(), 201);
    assert_eq!(effects(app, &at).await, 1);
    let over = format!("{at}k");
    let refused = problem(send(base, "/payments", Some(&quoted(&over)), "over").await).await;
    assert_eq!(
        (refused.0, refused.1.as_str()),
        (StatusCode::BAD_REQUEST, MALFORMED_KEY)
    );
    assert_eq!(effects(app, &over).await, 0);
    // Escapes are unescaped: `\"` is a quote of the key.
    let escaped = format!("{}\"q", dedup_suite::unique("e"));
    let sent = format!("\"{}\"", escaped.replace('"', "\\\""));
    let ok = send(base, "/payments", Some(&sent), "escaped").await;
    assert_eq!(ok.status().as_u16(), 201);
    assert_eq!(effects(app, &escaped).await, 1);
}

async fn a_concurrent_retry_gets_409_then_the_replay<DB: dedup_suite::TestDatabase>(
    base: &str,
    app: &App<DB>,
) {
    let key = dedup_suite::unique("slow");
    let first = {
        let (base, key) = (base.to_owned(), quoted(&key));
        tokio::spawn(async move { parts(send(&base, "/payments", Some(&key), "slow").await).await })
    };
    // The first one is in its handler (its effect written, not committed) when the
    // retries come.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..3 {
        let busy = problem(send(base, "/payments", Some(&quoted(&key)), "slow").await).await;
        assert_eq!(
            (busy.0, busy.1.as_str()),
            (StatusCode::CONFLICT, IN_PROGRESS)
        );
        assert_eq!(busy.2.as_deref(), Some("1"), "Retry-After");
    }
    app.gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::CREATED);
    let again = parts(send(base, "/payments", Some(&quoted(&key)), "slow").await).await;
    assert!(again.3 && again.4 == first.4);
    assert_eq!(effects(app, &key).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key).await, 1);
}

async fn a_server_error_keeps_nothing_and_the_retry_runs<DB: dedup_suite::TestDatabase>(
    base: &str,
    app: &App<DB>,
) {
    let key = dedup_suite::unique("fail");
    app.fail_next.store(true, Ordering::SeqCst);
    let failed = problem(send(base, "/payments", Some(&quoted(&key)), "5 EUR").await).await;
    assert_eq!(
        (failed.0, failed.1.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR)
    );
    assert_eq!(effects(app, &key).await, 0, "the effect rolled back");
    assert_eq!(
        dedup_suite::claims(&app.pool, CONSUMER, &key).await,
        0,
        "the key is free"
    );
    // A server error the handler returned as `Ok`: never stored, nothing committed.
    let key502 = dedup_suite::unique("ok502");
    let refused = problem(send(base, "/payments", Some(&quoted(&key502)), "502").await).await;
    assert_eq!(
        (refused.0, refused.1.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR)
    );
    assert_eq!(effects(app, &key502).await, 0);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key502).await, 0);

    let retried = parts(send(base, "/payments", Some(&quoted(&key)), "5 EUR").await).await;
    assert_eq!(retried.0, StatusCode::CREATED);
    assert!(!retried.3, "the retry ran the handler");
    assert_eq!(effects(app, &key).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key).await, 1);
}

async fn scoped_keys_never_meet<DB: dedup_suite::TestDatabase>(base: &str, app: &App<DB>) {
    let key = dedup_suite::unique("scoped");
    let client = reqwest::Client::new();
    let send = |caller: Option<&'static str>, body: &'static str| {
        let mut request = client
            .post(format!("{base}/scoped"))
            .header("idempotency-key", quoted(&key))
            .body(body);
        if let Some(caller) = caller {
            request = request.header("x-api-key", caller);
        }
        request.send()
    };
    let alice = parts(send(Some("alice"), "from alice").await.unwrap()).await;
    let bob = parts(send(Some("bob"), "from bob").await.unwrap()).await;
    assert_eq!((alice.0, bob.0), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(!alice.3 && !bob.3, "two callers' equal keys are two keys");
    let alice_id = message_id(Some("alice"), &key).unwrap();
    let bob_id = message_id(Some("bob"), &key).unwrap();
    assert_eq!(
        (effects(app, &alice_id).await, effects(app, &bob_id).await),
        (1, 1)
    );
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &alice_id).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &bob_id).await, 1);
    let again = parts(send(Some("bob"), "from bob").await.unwrap()).await;
    assert!(again.3 && again.4 == bob.4, "bob's replay is bob's");
    let nobody = problem(send(None, "from nobody").await.unwrap()).await;
    assert_eq!(
        (nobody.0, nobody.1.as_str()),
        (StatusCode::UNAUTHORIZED, UNIDENTIFIED_CALLER)
    );
    // The unscoped route's same key is a third key.
    assert_eq!(effects(app, &key).await, 0);
}

async fn limits_kept_client_errors_and_expiry<DB: dedup_suite::TestDatabase>(
    base: &str,
    app: &App<DB>,
) {
    // A response over the handler's `max_result_len`: nothing committed.
    let key = dedup_suite::unique("big");
    let big = problem(send(base, "/payments", Some(&quoted(&key)), "big").await).await;
    assert_eq!(
        (big.0, big.1.as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, RESPONSE_TOO_LARGE)
    );
    assert_eq!(effects(app, &key).await, 0);
    assert_eq!(dedup_suite::claims(&app.pool, CONSUMER, &key).await, 0);

    // A request body over the layer's limit (64 KiB here): 413, the handler not called.
    let huge: &'static str = Box::leak("h".repeat(64 * 1024 + 1).into_boxed_str());
    let key = dedup_suite::unique("huge");
    let refused = problem(send(base, "/payments", Some(&quoted(&key)), huge).await).await;
    assert_eq!(
        (refused.0, refused.1.as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, REQUEST_TOO_LARGE)
    );
    assert_eq!(effects(app, &key).await, 0);

    // A client error the handler keeps: stored, and replayed as it was.
    let key = dedup_suite::unique("invalid");
    let first = parts(send(base, "/payments", Some(&quoted(&key)), "invalid").await).await;
    assert_eq!(first.0, StatusCode::UNPROCESSABLE_ENTITY);
    let again = parts(send(base, "/payments", Some(&quoted(&key)), "invalid").await).await;
    assert!(again.3);
    assert_eq!((again.0, &again.4), (first.0, &first.4));
    assert_eq!(effects(app, &key).await, 1);

    // Expiry: pruned past its window, the key runs the handler again.
    let key = dedup_suite::unique("expire");
    assert_eq!(
        send(base, "/expiring", Some(&quoted(&key)), "1")
            .await
            .status()
            .as_u16(),
        201
    );
    // Past the cutoff's margin for a commit's time (`STAMP_AFTER`).
    tokio::time::sleep(dedup_runtime::STAMP_AFTER + Duration::from_millis(50)).await;
    let pruned = Prune::new(Duration::ZERO, Duration::ZERO)
        .consumer(EXPIRING)
        .run(&app.pool, |_| {})
        .await
        .unwrap();
    assert!(pruned.deleted >= 1);
    assert_eq!(dedup_suite::claims(&app.pool, EXPIRING, &key).await, 0);
    let again = parts(send(base, "/expiring", Some(&quoted(&key)), "1").await).await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert!(!again.3, "a pruned key is a new key");
    assert_eq!(effects(app, &key).await, 2);
}

/// Every public future of the HTTP module can be spawned on a multi-threaded runtime (a
/// compile-time check: the function is never called).
#[allow(dead_code)]
fn public_futures_are_spawnable(
    req: IdempotentRequest,
    response: axum::response::Response,
    layer: IdempotencyLayer,
) {
    use tower_layer::Layer as _;
    use tower_service::Service as _;
    drop(tokio::spawn(async move { req.capture(response).await }));
    drop(tokio::spawn(StoredResponse::capture(
        axum::response::Response::default(),
        1,
    )));
    let mut service = layer.layer(Router::<()>::new().into_service::<axum::body::Body>());
    drop(tokio::spawn(
        service.call(axum::http::Request::new(axum::body::Body::empty())),
    ));
}

async fn a_leased_first_request_answers_every_copy_409<DB: dedup_suite::TestDatabase>(
    base: &str,
    app: &App<DB>,
) {
    let key = dedup_suite::unique("charge");
    let first = {
        let (base, key) = (base.to_owned(), quoted(&key));
        tokio::spawn(async move { parts(send(&base, "/charges", Some(&key), "slow").await).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The lease is committed: a copy that waits for the first in this process, or one in
    // another, gets `409` with the lease's time left.
    let busy = problem(send(base, "/charges", Some(&quoted(&key)), "slow").await).await;
    assert_eq!(
        (busy.0, busy.1.as_str()),
        (StatusCode::CONFLICT, IN_PROGRESS)
    );
    let seconds: u64 = busy.2.expect("Retry-After").parse().unwrap();
    assert!((1..=30).contains(&seconds), "{seconds}");
    assert_eq!(effects(app, &key).await, 0, "the call has not completed");
    app.gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::CREATED);
    let again = parts(send(base, "/charges", Some(&quoted(&key)), "slow").await).await;
    assert!(
        again.3 && again.4 == first.4,
        "the stored response, replayed"
    );
    assert_eq!(effects(app, &key).await, 1);
    assert_eq!(dedup_suite::claims(&app.pool, LEASED, &key).await, 1);
}
