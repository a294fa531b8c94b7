//! A RabbitMQ consumer with an inbox: each delivery is stored in the inbox (one
//! statement) and acknowledged at once; workers process the inbox, each message's effect
//! and its "processed" mark in one PostgreSQL transaction.
//!
//! The effect is one row in `rabbitmq_inbox_effects`, a table with no unique constraint:
//! only the inbox — its key at the receipt, its fenced claims at the workers — stands
//! between a redelivery (or a killed worker's half-done attempt) and a second row. Kill the
//! process whenever you like: RabbitMQ redelivers what was not acknowledged (a message
//! stored but not acknowledged comes back as a duplicate and is only acknowledged), and the
//! rows a killed worker had claimed are taken over once their lease ends.
//!
//! ```text
//! cargo run --features brokers --example rabbitmq -- publish 1000   # the same queue and messages
//! cargo run --features brokers --example rabbitmq_inbox             # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment: `AMQP_URL`, `DATABASE_URL`, `QUEUE`, `CONSUMERS`
//! (receiving channels, default 4), `PREFETCH` (default 16) as for `examples/rabbitmq.rs`
//! (the same topology, declared the same way), and `WORKERS` (inbox worker tasks, default
//! 2), `LEASE_MS` (a claim's lease, default 30000), `DEDUP_EXIT_WHEN_IDLE_MS` (exit after
//! this long without a delivery, once the inbox has nothing pending or claimed),
//! `DEDUP_CRASH_WINDOW_MS` (testing: a pause between the inbox's commit and the
//! acknowledgement).
//!
//! It reports each step on standard output for the crash harness in `tests/brokers/`:
//! `ready`, `delivered <count> <id>`, `committed <id>` (stored in the inbox), `duplicate
//! <id>` (the inbox had it), `acked <id>`, `retry <id>`, `dead <id> <body>` (refused: no
//! id), with `-` for an empty id.

use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxError, InboxHandler, InboxMessage, Incoming, Received};
use dedup_runtime::lapin::settle;
use dedup_runtime::{Ack, MAX_DELAY};
use dedup_suite::consumer::{self, Activity, Error, report};
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, Postgres};
use tokio::sync::watch;

/// The inbox's consumer name.
const CONSUMER: &str = "rabbitmq-inbox-example";

const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS rabbitmq_inbox_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// The worker's handler: one effect row per message, in the transaction that marks the
/// inbox row processed.
struct Apply;

impl InboxHandler<Postgres> for Apply {
    type Error = sqlx::Error;

    async fn handle(&self, tx: &mut PgConnection, msg: &InboxMessage) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO rabbitmq_inbox_effects (message_id, body) VALUES ($1, $2)")
            .bind(msg.id())
            .bind(String::from_utf8_lossy(msg.payload()).as_ref())
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

struct Config {
    amqp_url: String,
    database_url: String,
    queue: String,
    consumers: u16,
    prefetch: u16,
    workers: u16,
    lease: Duration,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        Ok(Config {
            amqp_url: consumer::var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            database_url: consumer::database_url(),
            queue: consumer::var("QUEUE", "dedup-example.payments"),
            consumers: consumer::consumers()?,
            prefetch: consumer::prefetch()?,
            workers: consumer::number("WORKERS", 2)?,
            lease: Duration::from_millis(consumer::number("LEASE_MS", 30_000)?),
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
        })
    }
}

/// One receiving channel: stores each delivery in the inbox, then settles it.
async fn receive(
    channel: Channel,
    tag: String,
    config: Arc<Config>,
    inbox: Inbox<Postgres>,
    activity: Arc<Activity>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            config.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    loop {
        let delivery = tokio::select! {
            delivery = deliveries.next() => delivery,
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let Some(delivery) = delivery else { break };
        let delivery = delivery?;
        activity.begin();
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default();
        let shown = report::shown(&id);
        let count = dedup_runtime::lapin::delivery_count(&delivery);
        report::delivered(count, &id);
        let ack = match inbox
            .receive(Incoming::new(id.as_str(), &delivery.data))
            .await
        {
            Ok(Received::Stored) => {
                report::committed(&id);
                consumer::crash_pause(config.crash_window).await;
                Ack::Ack
            }
            Ok(_) => {
                report::duplicate(&id);
                Ack::Ack
            }
            // Refused (no id, a payload over the limit): the same on every delivery.
            Err(InboxError::Refused(_)) => Ack::DeadLetter,
            // The database is away: nothing is known to be stored; redeliver.
            Err(error) => {
                eprintln!("message {shown:?}: {error}");
                Ack::Retry {
                    after: Duration::from_millis(100).min(MAX_DELAY),
                }
            }
        };
        settle(&delivery, ack).await?;
        report::settled(ack, &id, &String::from_utf8_lossy(&delivery.data));
        activity.end();
    }
    channel.close(200, "receiver done".into()).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let config = Arc::new(Config::from_env()?);
    let pool = PgPoolOptions::new()
        // Each worker: one connection for its transactions, one for its LISTEN.
        .max_connections(u32::from(config.consumers) + 2 * u32::from(config.workers) + 2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&config.database_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.database_url))?;
    dedup_runtime::inbox::migrate(&pool).await?;
    sqlx::query(CREATE_EFFECTS).execute(&pool).await?;

    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.amqp_url))?;
    dedup_suite::rabbitmq::declare(&connection.create_channel().await?, &config.queue, false).await;

    let activity = Arc::new(Activity::new());
    let mut tasks = tokio::task::JoinSet::new();
    // One inbox for every task: it owns a clone of the pool, and its clones share the
    // hint's timing. Idle workers are woken at once (PostgreSQL's NOTIFY, coalesced),
    // instead of at their next poll.
    let inbox = Inbox::new(&pool, CONSUMER)?.notify_workers(true);
    for n in 0..config.consumers {
        let channel = connection.create_channel().await?;
        let tag = format!("dedup-inbox-example-{}-{n}", std::process::id());
        tasks.spawn(receive(
            channel,
            tag,
            config.clone(),
            inbox.clone(),
            activity.clone(),
            activity.stopped(),
        ));
    }
    for _ in 0..config.workers {
        let worker = inbox
            .worker()
            .lease(config.lease)
            .poll_interval(Duration::from_millis(50));
        let mut stopped = activity.stopped();
        tasks.spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            worker.run(&Apply, shutdown).await?;
            Ok(())
        });
    }
    report::ready();

    if let Some(limit) = config.exit_when_idle {
        let (activity, inbox) = (activity.clone(), inbox.clone());
        tokio::spawn(async move {
            loop {
                activity.until_idle(limit).await;
                // Idle at the broker; done once the inbox has nothing left to process.
                if let Ok(stats) = inbox.stats().await
                    && stats.pending == 0
                    && stats.claimed == 0
                {
                    activity.stop();
                    break;
                }
            }
        });
    }

    // A task that fails ends the process: the broker redelivers what was not
    // acknowledged, and the inbox's claims are taken over after their lease.
    while let Some(finished) = tasks.join_next().await {
        finished??;
    }
    connection.close(200, "consumer done".into()).await?;
    pool.close().await;
    Ok(())
}
