//! An HTTP service whose `POST /payments` is idempotent per `Idempotency-Key`: the key
//! claimed in the handler's transaction on PostgreSQL, the response stored with it and
//! replayed to every retry (`dedup_runtime::http`, feature `axum`).
//!
//! ```sh
//! cargo run --features http --example http_payments &
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: "k-1"' -d '10 EUR'
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: "k-1"' -d '10 EUR'  # replayed
//! ```
//!
//! Settings (environment): `DATABASE_URL` (`postgres://postgres@127.0.0.1:5432/test`),
//! `LISTEN` (`127.0.0.1:3000`), `TABLE` (`http_payments`, created if missing: one row per
//! payment, no unique constraint — the key's dedup row alone keeps it single), and
//! `PAUSE_MS` (0: a pause after the commit, before the answer, where the crash harness
//! `tests/http_crash.rs` aims its SIGKILLs). It prints `listening <address>` once it
//! serves, and stops on SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::{Router, routing::post};
use dedup_runtime::http::{HttpError, IdempotencyLayer, IdempotentRequest, StoredResponse};
use dedup_runtime::idempotent;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

struct App {
    pool: PgPool,
    table: String,
    pause: Duration,
}

#[idempotent(consumer = "http-payments", key = req.id(), fingerprint = req, result = "stored")]
async fn pay(
    tx: &mut PgConnection,
    req: &IdempotentRequest,
    table: &str,
) -> Result<StoredResponse, HttpError> {
    let insert =
        format!("INSERT INTO {table} (idempotency_key, body) VALUES ($1, $2) RETURNING id");
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(insert))
        .bind(req.id())
        .bind(req.body().as_ref())
        .fetch_one(&mut *tx)
        .await?;
    Ok(StoredResponse::new(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")?
        .header(header::LOCATION, format!("/payments/{id}"))?
        .body(format!(r#"{{"payment":{id}}}"#)))
}

async fn create(State(app): State<Arc<App>>, req: IdempotentRequest) -> Response {
    let answer = req.answer(pay(&app.pool, &req, &app.table).await);
    tokio::time::sleep(app.pause).await; // committed, not answered yet
    answer
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    let table = setting("TABLE", "http_payments");
    let create_table = format!(
        "CREATE TABLE IF NOT EXISTS {table} \
         (id BIGSERIAL PRIMARY KEY, idempotency_key TEXT NOT NULL, body BYTEA NOT NULL)"
    );
    sqlx::raw_sql(AssertSqlSafe(create_table))
        .execute(&pool)
        .await?;
    let pause = Duration::from_millis(setting("PAUSE_MS", "0").parse()?);
    let app = Arc::new(App { pool, table, pause });

    let router = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new().replay_headers([header::LOCATION]))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(setting("LISTEN", "127.0.0.1:3000")).await?;
    println!("listening {}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("a SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await?;
    Ok(())
}
