//! The HTTP group: `cargo bench --bench dedup --features http -- http` (and, tiny, in the
//! smoke run). One `POST /payments` endpoint on PostgreSQL, served by axum on loopback and
//! driven by a reqwest client, every request with a fresh `Idempotency-Key`, at 1 and 4
//! concurrent clients; in every round, in an order that turns with the round:
//!
//! - `layer`: `IdempotencyLayer` and an `#[idempotent(key = req.id(), fingerprint = req,
//!   result = "stored")]` handler: the claim, the effect, the stored response and the
//!   fingerprint, one transaction (its dedup table one of its own, emptied before the group
//!   as the hand-written key table is);
//! - `hand-written`: the same endpoint as a person writes it with sqlx — the key read from
//!   the header, the body's SHA-256, `BEGIN`, `INSERT INTO keys … ON CONFLICT DO NOTHING`
//!   (a key table with a primary key), the effect, `UPDATE keys SET status, body` (the
//!   stored response), `COMMIT` — on the same pool, the same effect table.
//!
//! Requests per second, the median over the rounds; `target/dedup-bench/http.csv`:
//! `clients,layer_per_s,handwritten_per_s,ratio_vs_handwritten`.

use std::path::Path;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use dedup_runtime::http::{HttpError, IdempotencyLayer, IdempotentRequest, StoredResponse};
use dedup_runtime::idempotent;
use sqlx::{PgConnection, Pool, Postgres};

use crate::Error;
use crate::report::median;

const CLIENTS: [usize; 2] = [1, 4];

#[idempotent(
    consumer = "bench-http",
    table = "dedup_bench_http_processed",
    key = req.id(),
    fingerprint = req,
    result = "stored"
)]
async fn pay(tx: &mut PgConnection, req: &IdempotentRequest) -> Result<StoredResponse, HttpError> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO dedup_bench_http_effects (idempotency_key, body) VALUES ($1, $2) RETURNING id",
    )
    .bind(req.id())
    .bind(req.body().as_ref())
    .fetch_one(&mut *tx)
    .await?;
    Ok(StoredResponse::new(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")?
        .body(format!(r#"{{"payment":{id}}}"#)))
}

async fn layered(State(pool): State<Pool<Postgres>>, req: IdempotentRequest) -> Response {
    req.answer(pay(&pool, &req).await)
}

/// The endpoint written by hand.
async fn by_hand(State(pool): State<Pool<Postgres>>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix('"')?.strip_suffix('"'))
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let fingerprint = dedup_runtime::fingerprint(&body[..]);
    let answer = async {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(
            "INSERT INTO dedup_bench_http_keys (key, fingerprint, created_at) \
             VALUES ($1, $2, now()) ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .bind(&fingerprint[..])
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if claimed == 0 {
            let (stored, status, response): (Vec<u8>, Option<i32>, Option<Vec<u8>>) =
                sqlx::query_as(
                    "SELECT fingerprint, status, body FROM dedup_bench_http_keys WHERE key = $1",
                )
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
            if stored != fingerprint {
                return Ok::<Response, sqlx::Error>(
                    StatusCode::UNPROCESSABLE_ENTITY.into_response(),
                );
            }
            let status =
                StatusCode::from_u16(status.unwrap_or(409) as u16).unwrap_or(StatusCode::CONFLICT);
            return Ok((
                status,
                [("idempotent-replayed", "true")],
                response.unwrap_or_default(),
            )
                .into_response());
        }
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO dedup_bench_http_effects (idempotency_key, body) VALUES ($1, $2) \
             RETURNING id",
        )
        .bind(key)
        .bind(&body[..])
        .fetch_one(&mut *tx)
        .await?;
        let response = format!(r#"{{"payment":{id}}}"#);
        sqlx::query("UPDATE dedup_bench_http_keys SET status = 201, body = $2 WHERE key = $1")
            .bind(key)
            .bind(response.as_bytes())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            response,
        )
            .into_response())
    };
    answer
        .await
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Serves `router` on loopback; its address.
async fn serve(router: Router) -> Result<String, Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(format!("http://{address}/payments"))
}

/// `requests` fresh requests to `url` from `clients` clients; requests per second.
async fn drive(url: &str, clients: usize, requests: usize, run: &str) -> Result<f64, Error> {
    let http = reqwest::Client::new();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (http, url, run) = (http.clone(), url.to_owned(), run.to_owned());
        tasks.push(tokio::spawn(async move {
            for n in (client..requests).step_by(clients) {
                let response = http
                    .post(&url)
                    .header("idempotency-key", format!("\"{run}-{n}\""))
                    .body(format!("{n} EUR"))
                    .send()
                    .await?;
                if response.status() != reqwest::StatusCode::CREATED {
                    return Err(format!("request {n}: {}", response.status()).into());
                }
                response.bytes().await?;
            }
            Ok::<(), Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(requests as f64 / started.elapsed().as_secs_f64())
}

pub(crate) async fn run(
    pg: &Pool<Postgres>,
    dir: &Path,
    rounds: usize,
    requests: usize,
) -> Result<(), Error> {
    // Both key tables start empty (and are emptied after): the same size on both sides.
    dedup_runtime::migrate_table(pg, "dedup_bench_http_processed").await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS dedup_bench_http_effects \
         (id BIGSERIAL PRIMARY KEY, idempotency_key TEXT NOT NULL, body BYTEA NOT NULL); \
         CREATE TABLE IF NOT EXISTS dedup_bench_http_keys (key TEXT PRIMARY KEY, \
         fingerprint BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL, status INT, body BYTEA); \
         CREATE INDEX IF NOT EXISTS dedup_bench_http_keys_created_at \
         ON dedup_bench_http_keys (created_at); \
         TRUNCATE dedup_bench_http_effects, dedup_bench_http_keys, dedup_bench_http_processed",
    )
    .execute(pg)
    .await?;
    let layer_url = serve(
        Router::new()
            .route("/payments", post(layered))
            .layer(IdempotencyLayer::new())
            .with_state(pg.clone()),
    )
    .await?;
    let hand_url = serve(
        Router::new()
            .route("/payments", post(by_hand))
            .with_state(pg.clone()),
    )
    .await?;
    println!(
        "\n== http: the Idempotency-Key layer against the endpoint by hand ({rounds} rounds of {requests} requests)"
    );
    let mut rows = String::from("clients,layer_per_s,handwritten_per_s,ratio_vs_handwritten\n");
    for clients in CLIENTS {
        let (mut layer, mut hand) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let run = dedup_suite::unique("bench-http");
            // The order turns with the round and the clients.
            if (round + clients) % 2 == 0 {
                layer.push(drive(&layer_url, clients, requests, &format!("{run}-l")).await?);
                hand.push(drive(&hand_url, clients, requests, &format!("{run}-h")).await?);
            } else {
                hand.push(drive(&hand_url, clients, requests, &format!("{run}-h")).await?);
                layer.push(drive(&layer_url, clients, requests, &format!("{run}-l")).await?);
            }
        }
        let (layer, hand) = (median(layer), median(hand));
        println!(
            "  {clients} client(s): layer {layer:>7.0}/s, by hand {hand:>7.0}/s, ratio {:.3}",
            layer / hand
        );
        rows.push_str(&format!(
            "{clients},{layer:.0},{hand:.0},{:.3}\n",
            layer / hand
        ));
    }
    std::fs::write(dir.join("http.csv"), rows)?;
    // Leave the tables small for the next run.
    sqlx::raw_sql(
        "TRUNCATE dedup_bench_http_effects, dedup_bench_http_keys, dedup_bench_http_processed",
    )
    .execute(pg)
    .await?;
    Ok(())
}
