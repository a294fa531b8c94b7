//! The consumer process of the leases' SIGKILL harness (`tests/lease_crash.rs`): it charges
//! orders through the partner's HTTP API from a leased handler on PostgreSQL, and is
//! killed again and again at the moment that matters.
//!
//! Its "broker" is a table the harness fills, `lease_crash_queue(run, n, acked)`: each of
//! two tasks walks the messages not acknowledged yet (one from the first, one from the
//! last, so that they meet and race on the same messages), calls the handler, and
//! acknowledges (`acked = true`) only after it returned processed or a duplicate — at least
//! once, as a broker is: a process killed between the handler's commit and the
//! acknowledgement gets the message again at its next start. A copy told "in progress"
//! (the other task's lease, or a killed process's) waits the time left and tries again.
//!
//! - `DEDUP_WORKER_POLICY=send-first`: `effect = "send-first", lease = "1s"` with the
//!   idempotency key; the body prints `called <n>` between the HTTP call and the
//!   completion, where the harness kills it.
//! - `DEDUP_WORKER_POLICY=mark-first`: `effect = "mark-first", lease = "1s"` without a key;
//!   the body prints `marked <n>` between the committed mark and the HTTP call.
//!
//! Environment: `DATABASE_URL`, `DEDUP_PARTNER_URL`, `DEDUP_WORKER_RUN` (the run's prefix
//! of message ids). It prints `acked <n>` for each acknowledgement, `in-progress <n>` for
//! each copy told to wait, and `done` when every message is acknowledged.

use std::io::Write;
use std::time::Duration;

use dedup_runtime::{IdempotencyKey, Lease, LeaseOutcome, idempotent};
use dedup_suite::partner::{ChargeRequest, ChargeResponse, IDEMPOTENCY_KEY};
use sqlx::{PgPool, Postgres};

type Error = Box<dyn std::error::Error + Send + Sync>;

struct Order {
    /// The message id: `<run>/<n>`.
    id: String,
    n: i64,
}

struct Api {
    client: reqwest::Client,
    url: String,
}

impl Api {
    async fn charge(&self, order: &Order, keyed: bool) -> Result<ChargeResponse, Error> {
        let mut request = self.client.post(&self.url).json(&ChargeRequest {
            order_id: order.id.clone(),
            amount_cents: 100 + order.n,
        });
        if keyed {
            let key = IdempotencyKey::new("charge", &order.id);
            request = request.header(IDEMPOTENCY_KEY, key.as_str());
        }
        Ok(request.send().await?.error_for_status()?.json().await?)
    }
}

/// One line of the protocol the harness reads, flushed at once.
fn say(what: &str, n: i64) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{what} {n}");
    let _ = out.flush();
}

#[idempotent(consumer = "lease-crash-send-first", key = order.id, effect = "send-first", lease = "1s")]
async fn charge_send_first(
    lease: &mut Lease<'_, Postgres>,
    order: &Order,
    api: &Api,
) -> Result<String, Error> {
    let charge = api.charge(order, true).await?;
    say("called", order.n); // the harness kills here: after the call, before the completion
    let tx = lease.transaction().await?;
    sqlx::query("INSERT INTO lease_crash_charges (message_id, charge_id) VALUES ($1, $2)")
        .bind(&order.id)
        .bind(&charge.id)
        .execute(&mut *tx)
        .await?;
    Ok(charge.id)
}

#[idempotent(consumer = "lease-crash-mark-first", key = order.id, effect = "mark-first", lease = "1s")]
async fn charge_mark_first(
    lease: &mut Lease<'_, Postgres>,
    order: &Order,
    api: &Api,
) -> Result<String, Error> {
    say("marked", order.n); // the harness kills here: after the mark, before the call
    Ok(api.charge(order, false).await?.id)
}

async fn handle(
    mark_first: bool,
    pool: &PgPool,
    order: &Order,
    api: &Api,
) -> Result<LeaseOutcome<String>, Error> {
    if mark_first {
        charge_mark_first(pool, order, api).await
    } else {
        charge_send_first(pool, order, api).await
    }
}

/// Walks the messages not acknowledged yet, from the first (`backwards` false) or the
/// last, until none is left.
async fn worker(
    mark_first: bool,
    pool: PgPool,
    api: std::sync::Arc<Api>,
    run: String,
    backwards: bool,
) -> Result<(), Error> {
    let order_by = if backwards { "n DESC" } else { "n" };
    let sql = format!(
        "SELECT n FROM lease_crash_queue WHERE run = $1 AND NOT acked ORDER BY {order_by} LIMIT 1"
    );
    loop {
        let next: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(&run)
            .fetch_optional(&pool)
            .await?;
        let Some(n) = next else { return Ok(()) };
        let order = Order {
            id: format!("{run}/{n}"),
            n,
        };
        match handle(mark_first, &pool, &order, &api).await? {
            LeaseOutcome::Processed(_) | LeaseOutcome::Duplicate(_) => {
                sqlx::query("UPDATE lease_crash_queue SET acked = true WHERE run = $1 AND n = $2")
                    .bind(&run)
                    .bind(n)
                    .execute(&pool)
                    .await?;
                say("acked", n);
            }
            LeaseOutcome::InProgress(busy) => {
                say("in-progress", n);
                tokio::time::sleep(busy.remaining()).await;
            }
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let mark_first = match var("DEDUP_WORKER_POLICY")?.as_str() {
        "send-first" => false,
        "mark-first" => true,
        other => return Err(format!("unknown DEDUP_WORKER_POLICY {other:?}").into()),
    };
    let pool = PgPool::connect(&var("DATABASE_URL")?).await?;
    let api = std::sync::Arc::new(Api {
        client: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()?,
        url: var("DEDUP_PARTNER_URL")?,
    });
    let run = var("DEDUP_WORKER_RUN")?;
    let workers = [false, true].map(|backwards| {
        tokio::spawn(worker(
            mark_first,
            pool.clone(),
            api.clone(),
            run.clone(),
            backwards,
        ))
    });
    for worker in workers {
        worker.await??;
    }
    say("done", 0);
    Ok(())
}
