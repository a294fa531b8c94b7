//! HTTP → PostgreSQL + outbox → RabbitMQ, one key end to end: `POST /payments` is
//! idempotent per `Idempotency-Key` (the key claimed in the handler's transaction, the
//! response stored with it and replayed to every retry: `dedup_runtime::http`), and each
//! payment enqueues an `accepted` event whose id the outbox derives from the key — the
//! same id however often the request is retried — which the relay sends to a RabbitMQ
//! queue, where a consumer downstream dedups it (`src/bin/events_consumer.rs`). The
//! request's `traceparent`, if it has one, travels with the event.
//!
//! ```sh
//! cargo run --features http,brokers --example http_payments &
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: "k-1"' -d '10 EUR'
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: "k-1"' -d '10 EUR'  # replayed
//! ```
//!
//! Settings: `DATABASE_URL`, `AMQP_URL`, `EVENTS_QUEUE` (`payment-events`, declared),
//! `LISTEN` (`127.0.0.1:3000`), `TABLE` (`http_payments`, created if missing: one row per
//! payment, no unique constraint — the key's dedup row alone keeps it single), `PAUSE_MS`
//! (0: a pause after the commit, before the answer, where `tests/http_crash.rs` aims its
//! SIGKILLs). Prints `listening <address>` once it serves; SIGTERM or Ctrl-C stops it.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::{Router, routing::post};
use dedup_runtime::http::{HttpError, IdempotencyLayer, IdempotentRequest, StoredResponse};
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::{idempotent, lapin::RabbitMqPublisher};
use futures_util::FutureExt as _;
use lapin::{ConnectionProperties as Amqp, options::QueueDeclareOptions as Declare};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};

const CONSUMER: &str = "http-payments"; // the attribute's and the `Cause`'s
const OUTBOX: &str = "http_payments_outbox"; // the service's own outbox table

struct App {
    pool: PgPool,
    table: String,
    outbox: Outbox,
    queue: String,
    pause: Duration,
}

/// The payment, its event and the response, in one transaction with the key.
#[idempotent(consumer = CONSUMER, key = req.id(), fingerprint = req, result = "stored")]
async fn pay(
    tx: &mut PgConnection,
    req: &IdempotentRequest,
    app: &App,
    traceparent: Option<&str>,
) -> Result<StoredResponse, HttpError> {
    let insert = format!(
        "INSERT INTO {} (idempotency_key, body) VALUES ($1, $2) RETURNING id",
        app.table
    );
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(insert))
        .bind(req.id())
        .bind(req.body().as_ref())
        .fetch_one(&mut *tx)
        .await?;
    let body = format!(r#"{{"payment":{id}}}"#);
    let cause = Cause::new(CONSUMER, req.id())?;
    let mut event = cause.outgoing("accepted", &app.queue, body.as_bytes())?;
    if let Some(traceparent) = traceparent {
        event = event.traceparent(traceparent);
    }
    app.outbox.enqueue(&mut *tx, &event).await?;
    Ok(StoredResponse::new(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")?
        .header(header::LOCATION, format!("/payments/{id}"))?
        .body(body))
}

async fn create(
    State(app): State<Arc<App>>,
    headers: header::HeaderMap,
    req: IdempotentRequest,
) -> Response {
    let traceparent = headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok());
    let answer = req.answer(pay(&app.pool, &req, &app, traceparent).await);
    tokio::time::sleep(app.pause).await; // committed, not answered yet
    answer
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let setting = |name: &str, or: &str| std::env::var(name).unwrap_or_else(|_| or.to_owned());
    let pool = PgPool::connect(&setting(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ))
    .await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, OUTBOX).await?;
    let table = setting("TABLE", "http_payments");
    let payments = format!(
        "CREATE TABLE IF NOT EXISTS {table} \
         (id BIGSERIAL PRIMARY KEY, idempotency_key TEXT NOT NULL, body BYTEA NOT NULL)"
    );
    sqlx::raw_sql(AssertSqlSafe(payments))
        .execute(&pool)
        .await?;
    let mut term = signal(SignalKind::terminate())?; // SIGTERM or Ctrl-C: finish, then stop
    let ctrl_c = tokio::signal::ctrl_c();
    let stop = async move {
        tokio::select! { _ = term.recv() => {}, _ = ctrl_c => {} }
    };
    let stop = stop.boxed().shared();

    // The relay: events to their RabbitMQ queue (declared), through the default exchange.
    let amqp = setting("AMQP_URL", "amqp://127.0.0.1:5672");
    let queue = setting("EVENTS_QUEUE", "payment-events");
    let connection = lapin::Connection::connect(&amqp, Amqp::default()).await?;
    let declare = connection.create_channel().await?;
    declare
        .queue_declare(
            queue.as_str().into(),
            Declare::durable(),
            Default::default(),
        )
        .await?;
    let publisher = RabbitMqPublisher::connect(&amqp, Amqp::default(), "").await?;
    let outbox = Outbox::new().in_table(OUTBOX)?;
    let (relay, until) = (outbox.relay(&pool), stop.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let pause = Duration::from_millis(setting("PAUSE_MS", "0").parse()?);
    let app = Arc::new(App {
        pool,
        table,
        outbox,
        queue,
        pause,
    });
    let router = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new().replay_headers([header::LOCATION]))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(setting("LISTEN", "127.0.0.1:3000")).await?;
    println!("listening {}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await?;
    relaying.await??;
    Ok(())
}
