//! The outbox's relay as a command: publishes the rows of an outbox table to RabbitMQ or
//! NATS JetStream, as long as it runs — start as many as you like, they share the work.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test DEDUP_AMQP_URL=amqp://127.0.0.1:5672/%2f \
//!     cargo run --features brokers --example outbox_relay
//! DATABASE_URL=sqlite:app.db DEDUP_NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --features brokers --example outbox_relay
//! ```
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | required | `postgres://…`, `mysql://…` / `mariadb://…` or `sqlite:…` |
//! | `DEDUP_AMQP_URL` | | publish to RabbitMQ (the row's destination is the routing key) |
//! | `DEDUP_AMQP_EXCHANGE` | `""` | the exchange (the default one: destination = queue name) |
//! | `DEDUP_NATS_URL` | | publish to JetStream instead (the destination is the subject) |
//! | `DEDUP_OUTBOX_TABLE` | `outbox_messages` | the outbox table |
//! | `DEDUP_RELAY_LEASE_MS` | `30000` | the lease on claimed rows: a relay that stops is taken over after it |
//! | `DEDUP_RELAY_MAX_ATTEMPTS` | `10` | attempts of a row before it is dead |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit after this long with nothing to send |
//! | `DEDUP_REPORT_SENDS` | unset | testing: print `sent <id>` once the broker has a message |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause after each send, before its row is marked |
//!
//! It prints one line per batch that did something — `relayed <claimed> sent <n> lost <n>
//! failed <n> dead <n>` — and `idle` when it exits (the crash harness of
//! `tests/brokers.rs` reads them, and the `sent` lines). Exit status: 0 when it stopped by
//! itself, 1 on a failure (the database or the broker unreachable, a bad setting), with
//! its message on standard error.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use dedup_runtime::Backend;
use dedup_runtime::async_nats::JetStreamPublisher;
use dedup_runtime::lapin::RabbitMqPublisher;
use dedup_runtime::outbox::{Outbox, OutboxMessage, Publisher};
use sqlx::Pool;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Testing: `publisher`, reporting each message the broker has (`sent <id>`), then
/// pausing — the window in which a crash leaves a sent row unmarked, to be sent again.
struct Reporting<P> {
    publisher: P,
    report: bool,
    pause: Duration,
}

impl<P: Publisher> Publisher for Reporting<P> {
    type Error = P::Error;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), P::Error> {
        self.publisher.publish(message).await?;
        if self.report {
            println!("sent {}", message.id());
        }
        if !self.pause.is_zero() {
            tokio::time::sleep(self.pause).await;
        }
        Ok(())
    }
}

/// Relays until idle for `exit_when_idle` (or forever).
async fn relay<DB: Backend, P: Publisher>(
    pool: &Pool<DB>,
    outbox: &Outbox,
    publisher: P,
    exit_when_idle: Option<Duration>,
) -> Result<(), Error> {
    let mut relay = outbox.relay(pool);
    if let Some(lease) = setting("DEDUP_RELAY_LEASE_MS")? {
        relay = relay.lease(Duration::from_millis(lease));
    }
    if let Some(attempts) = setting("DEDUP_RELAY_MAX_ATTEMPTS")? {
        relay = relay.max_attempts(u32::try_from(attempts)?);
    }
    let publisher = Reporting {
        publisher,
        report: std::env::var_os("DEDUP_REPORT_SENDS").is_some(),
        pause: Duration::from_millis(setting("DEDUP_CRASH_WINDOW_MS")?.unwrap_or(0)),
    };
    let mut idle_since = Instant::now();
    loop {
        let relayed = relay.relay_batch(&publisher).await?;
        if relayed.claimed > 0 || relayed.dead > 0 {
            println!(
                "relayed {} sent {} lost {} failed {} dead {}",
                relayed.claimed, relayed.sent, relayed.lost, relayed.failed, relayed.dead
            );
            idle_since = Instant::now();
            continue;
        }
        if exit_when_idle.is_some_and(|limit| idle_since.elapsed() >= limit) {
            println!("idle");
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The broker's publisher, then the relay.
async fn with_publisher<DB: Backend>(pool: Pool<DB>, outbox: Outbox) -> Result<(), Error> {
    let exit_when_idle = setting("DEDUP_EXIT_WHEN_IDLE_MS")?.map(Duration::from_millis);
    if let Ok(url) = std::env::var("DEDUP_AMQP_URL") {
        let connection =
            lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await?;
        let exchange = std::env::var("DEDUP_AMQP_EXCHANGE").unwrap_or_default();
        let publisher =
            RabbitMqPublisher::new(connection.create_channel().await?, &exchange).await?;
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else if let Ok(url) = std::env::var("DEDUP_NATS_URL") {
        let client = async_nats::connect(&url).await?;
        let publisher = JetStreamPublisher::new(async_nats::jetstream::new(client));
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else {
        Err("set DEDUP_AMQP_URL (RabbitMQ) or DEDUP_NATS_URL (JetStream)".into())
    }
}

/// A number from the environment, if set.
fn setting(name: &str) -> Result<Option<u64>, Error> {
    match std::env::var(name) {
        Ok(text) => {
            Ok(Some(text.parse().map_err(|_| {
                format!("{name}: expected a number, got {text:?}")
            })?))
        }
        Err(_) => Ok(None),
    }
}

async fn start() -> Result<(), Error> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is required")?;
    let table = std::env::var("DEDUP_OUTBOX_TABLE")
        .unwrap_or_else(|_| dedup_runtime::outbox::DEFAULT_TABLE.to_owned());
    let outbox = Outbox::with_table(&table)?;
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        with_publisher(sqlx::PgPool::connect(&url).await?, outbox).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let url = url.replacen("mariadb://", "mysql://", 1);
        with_publisher(sqlx::MySqlPool::connect(&url).await?, outbox).await
    } else if url.starts_with("sqlite:") {
        with_publisher(sqlx::SqlitePool::connect(&url).await?, outbox).await
    } else {
        Err(format!("`{url}` is not a postgres://, mysql:// or sqlite: URL").into())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match start().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("outbox_relay: {error}");
            ExitCode::FAILURE
        }
    }
}
