//! The outbox's relay as a command: publishes the rows of an outbox table to RabbitMQ, NATS
//! JetStream, Kafka, Redis Streams or MQTT, as long as it runs — start as many as you like,
//! they share the work.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test DEDUP_AMQP_URL=amqp://127.0.0.1:5672/%2f \
//!     cargo run --features brokers --example outbox_relay
//! DATABASE_URL=sqlite:app.db DEDUP_NATS_URL=nats://127.0.0.1:4222 \
//!     cargo run --features brokers --example outbox_relay
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test DEDUP_KAFKA_BROKERS=127.0.0.1:19092 \
//!     cargo run --features brokers --example outbox_relay
//! ```
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `DATABASE_URL` | required | `postgres://…`, `mysql://…` / `mariadb://…` or `sqlite:…` |
//! | `DEDUP_AMQP_URL` | | publish to RabbitMQ (the row's destination is the routing key) |
//! | `DEDUP_AMQP_EXCHANGE` | `""` | the exchange (the default one: destination = queue name) |
//! | `DEDUP_NATS_URL` | | publish to JetStream instead (the destination is the subject) |
//! | `DEDUP_KAFKA_BROKERS` | | publish to Kafka instead (`bootstrap.servers`; the destination is the topic, the id in the record header `id`, the ordering key as the record key) |
//! | `DEDUP_REDIS_URL` | | publish to Redis Streams instead (the destination is the stream; fields `id` and `body`) |
//! | `DEDUP_MQTT_URL` | | publish to MQTT instead, `mqtt://host:port` (QoS 1; the destination is the topic; the payload `<id>\n<payload>`) |
//! | `DEDUP_MQTT_CLIENT_ID` | `dedup-outbox-relay` | with `DEDUP_MQTT_URL`: the relay's client id (one per process) |
//! | `DEDUP_OUTBOX_TABLE` | `outbox_messages` | the outbox table |
//! | `DEDUP_RELAY_LEASE_MS` | `30000` | the lease on claimed rows: a relay that stops is taken over after it |
//! | `DEDUP_RELAY_MAX_ATTEMPTS` | `10` | attempts of a row before it is dead |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit after this long with nothing to send |
//! | `DEDUP_REPORT_SENDS` | unset | testing: print `sent <id>` once the broker has a message |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause after each batch of sends, before its rows are marked |
//!
//! The variables naming a broker are tried in the order of the table; the first one set
//! picks it. Each claim goes to the broker's publisher at once
//! (`Publisher::publish_batch`: every message put out before any confirm is awaited).
//!
//! It prints one line per batch that did something — `relayed <claimed> sent <n> lost <n>
//! failed <n> dead <n>` — and `idle` when it exits (the crash harness of
//! `tests/brokers/` reads them, and the `sent` lines: with `DEDUP_REPORT_SENDS`, one per
//! message the broker has, once the claim's sends are all answered, before the batch's
//! mark and its `relayed` line). Exit status: 0 when it stopped by
//! itself, 1 on a failure (the database or the broker unreachable, a bad setting), with
//! its message on standard error.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use dedup_runtime::Backend;
use dedup_runtime::async_nats::JetStreamPublisher;
use dedup_runtime::lapin::RabbitMqPublisher;
use dedup_runtime::outbox::{Outbox, OutboxMessage, Publisher};
use dedup_runtime::rdkafka::KafkaPublisher;
use dedup_runtime::redis::RedisStreamsPublisher;
use dedup_runtime::rumqttc::MqttPublisher;
use dedup_suite::consumer::{self, Error, report};
use sqlx::Pool;

/// Testing: `publisher`, reporting each message the broker has (`sent <id>`), then
/// pausing — the window in which a crash leaves sent rows unmarked, to be sent again.
struct Reporting<P> {
    publisher: P,
    report: bool,
    pause: Duration,
}

impl<P: Publisher> Reporting<P> {
    /// The window between the sends and the relay's mark, once the broker has something.
    async fn pause(&self) {
        consumer::crash_pause(self.pause).await;
    }
}

impl<P: Publisher> Publisher for Reporting<P> {
    type Error = P::Error;
    const SYSTEM: &'static str = P::SYSTEM;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), P::Error> {
        self.publisher.publish(message).await?;
        if self.report {
            report::sent(message.id());
        }
        self.pause().await;
        Ok(())
    }

    /// The relay's path: the inner publisher's `publish_batch` (its pipelined sends), a
    /// `sent` line for each message the broker has, then one pause for the whole batch —
    /// after the sends, before the relay marks the rows.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), P::Error>> {
        let answers = self.publisher.publish_batch(messages).await;
        let mut any_sent = false;
        for (message, answer) in messages.iter().zip(&answers) {
            if answer.is_ok() {
                any_sent = true;
                if self.report {
                    report::sent(message.id());
                }
            }
        }
        if any_sent {
            self.pause().await;
        }
        answers
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
    if let Some(lease) = consumer::setting("DEDUP_RELAY_LEASE_MS")? {
        relay = relay.lease(Duration::from_millis(lease));
    }
    if let Some(attempts) = consumer::setting("DEDUP_RELAY_MAX_ATTEMPTS")? {
        relay = relay.max_attempts(attempts);
    }
    let publisher = Reporting {
        publisher,
        report: std::env::var_os("DEDUP_REPORT_SENDS").is_some(),
        pause: consumer::crash_window()?,
    };
    let mut idle_since = Instant::now();
    loop {
        let relayed = relay.relay_batch(&publisher).await?;
        if relayed.claimed > 0 || relayed.dead > 0 {
            report::relayed(&relayed);
            idle_since = Instant::now();
            continue;
        }
        if exit_when_idle.is_some_and(|limit| idle_since.elapsed() >= limit) {
            report::idle();
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The broker's publisher, then the relay.
async fn with_publisher<DB: Backend>(pool: Pool<DB>, outbox: Outbox) -> Result<(), Error> {
    let exit_when_idle = consumer::exit_when_idle()?;
    if let Ok(url) = std::env::var("DEDUP_AMQP_URL") {
        let exchange = std::env::var("DEDUP_AMQP_EXCHANGE").unwrap_or_default();
        let properties = lapin::ConnectionProperties::default();
        let publisher = RabbitMqPublisher::connect(&url, properties, &exchange).await?;
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else if let Ok(url) = std::env::var("DEDUP_NATS_URL") {
        let client = async_nats::connect(&url).await?;
        let publisher = JetStreamPublisher::new(async_nats::jetstream::new(client));
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else if let Ok(brokers) = std::env::var("DEDUP_KAFKA_BROKERS") {
        let publisher = KafkaPublisher::new(KafkaPublisher::producer_config(&brokers))?;
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else if let Ok(url) = std::env::var("DEDUP_REDIS_URL") {
        let publisher = RedisStreamsPublisher::new(redis::Client::open(url.as_str())?);
        relay(&pool, &outbox, publisher, exit_when_idle).await
    } else if let Ok(url) = std::env::var("DEDUP_MQTT_URL") {
        let address = url
            .strip_prefix("mqtt://")
            .ok_or("DEDUP_MQTT_URL: expected mqtt://host:port")?;
        let (host, port) = address
            .rsplit_once(':')
            .ok_or("DEDUP_MQTT_URL: expected mqtt://host:port")?;
        let client_id = std::env::var("DEDUP_MQTT_CLIENT_ID")
            .unwrap_or_else(|_| "dedup-outbox-relay".to_owned());
        let options = rumqttc::v5::MqttOptions::new(client_id, host, port.parse::<u16>()?);
        relay(&pool, &outbox, MqttPublisher::new(options), exit_when_idle).await
    } else {
        Err(
            "set DEDUP_AMQP_URL (RabbitMQ), DEDUP_NATS_URL (JetStream), DEDUP_KAFKA_BROKERS \
             (Kafka), DEDUP_REDIS_URL (Redis Streams) or DEDUP_MQTT_URL (MQTT)"
                .into(),
        )
    }
}

async fn start() -> Result<(), Error> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is required")?;
    let table = std::env::var("DEDUP_OUTBOX_TABLE")
        .unwrap_or_else(|_| dedup_runtime::outbox::DEFAULT_TABLE.to_owned());
    let outbox = Outbox::new().in_table(&table)?;
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
