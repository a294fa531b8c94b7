//! An effectively-once NATS JetStream consumer: async-nats, a durable pull consumer with
//! explicit acknowledgements, an ack wait and a delivery limit, and an `#[idempotent]`
//! handler writing to PostgreSQL.
//!
//! Each message's effect is one row in `nats_example_effects`, a table with no unique
//! constraint: only the dedup record, committed in the same transaction as the row, stands
//! between a redelivery and a second row. Kill the consumer whenever you like (`kill -9`
//! included): JetStream redelivers what was not acknowledged once the ack wait has passed,
//! and a message whose transaction had committed comes back as a duplicate and is only
//! acknowledged.
//!
//! ```text
//! cargo run --features brokers --example nats -- publish 1000   # 1,000 messages, sent twice
//! cargo run --features brokers --example nats                   # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment:
//!
//! | variable | default | |
//! | --- | --- | --- |
//! | `NATS_URL` | `nats://127.0.0.1:4222` | the server, with JetStream enabled |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` | PostgreSQL |
//! | `STREAM` | `DEDUP_EXAMPLE` | the stream; created if missing |
//! | `SUBJECT` | `dedup-example.payments` | the subject the stream captures |
//! | `DURABLE` | `dedup-example` | the durable pull consumer; created if missing |
//! | `ACK_WAIT_MS` | `30000` | for a new consumer: redelivery after this long unacknowledged |
//! | `MAX_DELIVER` | `20` | for a new consumer: deliveries before JetStream gives up |
//! | `CONSUMERS` | `4` | tasks pulling from the durable consumer, one message at a time each |
//! | `PREFETCH` | `16` | messages each task pulls per batch |
//! | `BATCH` | `1` | over 1: up to this many pulled messages per transaction (`#[idempotent(batch = …)]`; not with `FORWARD_TO`) |
//! | `FORWARD_TO` | unset | service A of a two-hop chain: also send an event to this subject, through the outbox |
//! | `DEDUP_OUTBOX_TABLE` | `outbox_messages` | with `FORWARD_TO`: the outbox table |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit cleanly after this long without a delivery |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause between COMMIT and the acknowledgement |
//!
//! Dead letters go to `SUBJECT.dead`, captured by the stream `STREAM_DEAD` (created if
//! missing). A message's id is its `Message-Id` header (deliberately not `Nats-Msg-Id`:
//! that one JetStream deduplicates at publication, within its duplicate window only; the
//! consumer's dedup must hold whatever reaches it). Its payload is stored with the effect.
//!
//! What each outcome does to the message (the mapping is `dedup_runtime::AckPolicy`'s;
//! `dedup_runtime::async_nats::settle` sends the acknowledgement, and
//! `dedup_runtime::async_nats::delivery_count` reads the count `AckPolicy` takes):
//!
//! | handler result | `AckPolicy` says | JetStream acknowledgement |
//! | --- | --- | --- |
//! | `Outcome::Processed` / `Outcome::Duplicate` | `Ack::Ack` | `+ACK`, confirmed by the server |
//! | transient error (database contended or away) | `Ack::Retry { after }` | `-NAK` with delay `after` (until `MAX_DELIVER`) |
//! | permanent error (bad or missing id, failing body) | `Ack::DeadLetter` | copy to `SUBJECT.dead`, then `+TERM` |
//!
//! The consumer reports what it does on standard output, one line per step, which the
//! crash harness in `tests/brokers/` reads: `ready`, `delivered <delivery count> <id>`,
//! `committed <id>`, `duplicate <id>`, `acked <id>`, `retry <id>`, `dead <id> <body>`
//! (an empty id is written `-`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::{AckPolicy as JetStreamAckPolicy, PullConsumer};
use dedup_runtime::async_nats::{delivery_count, settle};
use dedup_runtime::batch::BatchItem;
use dedup_runtime::outbox::Cause;
use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use dedup_suite::consumer::{self, Activity, Error, Forward, report};
use futures_util::StreamExt;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

/// The header that carries the message id.
const MESSAGE_ID: &str = "Message-Id";

/// One message: its id (the dedup key) and its body.
struct Message {
    id: String,
    body: String,
}

/// The effect of one message. Not unique on purpose: a message applied twice would show
/// as two rows.
const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS nats_example_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// Applies a message: one row, in the same transaction as the dedup record for
/// `(nats-example, msg.id)`.
#[idempotent(consumer = "nats-example", key = msg.id)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO nats_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Service A of a two-hop chain: the effect row and an event for the next service, the
/// event written to the outbox in the same transaction (`examples/outbox_relay.rs`
/// publishes it). Its id is derived from this message's, so a second run of the handler
/// would enqueue the same event, never another.
#[idempotent(consumer = "nats-example-forward", key = msg.id)]
async fn apply_and_forward(
    tx: &mut PgConnection,
    msg: &Message,
    forward: &Forward,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO nats_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new("nats-example-forward", msg.id.as_str())?;
    let event = cause.outgoing("event", &forward.to, msg.body.as_bytes())?;
    forward.outbox.enqueue(&mut *tx, &event).await?;
    Ok(())
}

/// `publish N`: sends N messages, each twice (two stream messages with the same id: the
/// second is for dedup to catch), and exits.
async fn publish(config: &Config, count: usize) -> Result<(), Error> {
    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.nats_url))?;
    let jetstream = jetstream::new(client);
    declare(&jetstream, config).await?;
    let batch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let mut stored = Vec::with_capacity(2 * count);
    for n in 0..count {
        let id = format!("msg-{batch}-{n}");
        for _copy in 0..2 {
            let mut headers = HeaderMap::new();
            headers.insert(MESSAGE_ID, id.as_str());
            let payload = format!("payment {n}").into();
            stored.push(
                jetstream
                    .publish_with_headers(config.subject.clone(), headers, payload)
                    .await?,
            );
        }
    }
    for ack in stored {
        ack.await?;
    }
    println!(
        "published {count} messages twice each to {}",
        config.subject
    );
    Ok(())
}

struct Config {
    nats_url: String,
    database_url: String,
    stream: String,
    subject: String,
    durable: String,
    ack_wait: Duration,
    max_deliver: i64,
    consumers: u16,
    prefetch: usize,
    batch: usize,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
    forward: Option<Forward>,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        let batch = consumer::batch()?;
        Ok(Config {
            nats_url: consumer::var("NATS_URL", "nats://127.0.0.1:4222"),
            database_url: consumer::database_url(),
            stream: consumer::var("STREAM", "DEDUP_EXAMPLE"),
            subject: consumer::var("SUBJECT", "dedup-example.payments"),
            durable: consumer::var("DURABLE", "dedup-example"),
            ack_wait: Duration::from_millis(consumer::number("ACK_WAIT_MS", 30_000)?),
            max_deliver: consumer::number("MAX_DELIVER", 20)?,
            consumers: consumer::consumers()?,
            prefetch: consumer::prefetch()?,
            batch,
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
            forward: Forward::from_env(batch)?,
        })
    }

    fn dead_subject(&self) -> String {
        format!("{}.dead", self.subject)
    }
}

/// The stream, its dead-letter stream and the durable consumer, created if missing (an
/// existing consumer keeps its configuration).
async fn declare(jetstream: &jetstream::Context, config: &Config) -> Result<PullConsumer, Error> {
    jetstream
        .get_or_create_stream(jetstream::stream::Config {
            name: format!("{}_DEAD", config.stream),
            subjects: vec![config.dead_subject()],
            ..Default::default()
        })
        .await?;
    let stream = jetstream
        .get_or_create_stream(jetstream::stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.subject.clone()],
            ..Default::default()
        })
        .await?;
    let consumer = stream
        .get_or_create_consumer(
            &config.durable,
            pull::Config {
                durable_name: Some(config.durable.clone()),
                ack_policy: JetStreamAckPolicy::Explicit,
                ack_wait: config.ack_wait,
                max_deliver: config.max_deliver,
                ..Default::default()
            },
        )
        .await?;
    Ok(consumer)
}

/// `BATCH` > 1: the same effect for a whole batch, one multi-row insert over the messages
/// not processed before, in the transaction that claims their ids (consumer
/// `nats-example`, as `apply`'s).
#[idempotent(consumer = "nats-example", batch = fresh, key = |msg| msg.id.as_str())]
async fn apply_batch(tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = fresh.iter().map(|msg| msg.id.as_str()).collect();
    let bodies: Vec<&str> = fresh.iter().map(|msg| msg.body.as_str()).collect();
    sqlx::query(
        "INSERT INTO nats_example_effects (message_id, body) \
         SELECT * FROM unnest($1::text[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A JetStream message's id (its `Message-Id` header; empty if it has none) and body.
fn message_of(message: &jetstream::Message) -> Message {
    Message {
        id: message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(MESSAGE_ID))
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default(),
        body: String::from_utf8_lossy(&message.payload).into_owned(),
    }
}

/// `BATCH` > 1: one transaction for the whole batch (`apply_batch`, the attribute's batch form), then each
/// message settled as its outcome says, after the commit. A database failure retries the
/// whole batch.
async fn process_batch(
    batch: &[jetstream::Message],
    config: &Config,
    pool: &PgPool,
    policy: &AckPolicy<sqlx::Postgres>,
) -> Result<(), Error> {
    let messages: Vec<Message> = batch.iter().map(message_of).collect();
    for (jet, message) in batch.iter().zip(&messages) {
        report::delivered(delivery_count(jet), &message.id);
    }
    let acks: Vec<Ack> = match apply_batch(pool, &messages).await {
        Ok(outcome) => {
            for (n, message) in messages.iter().enumerate() {
                match &outcome.items()[n] {
                    BatchItem::Processed => report::committed(&message.id),
                    BatchItem::Duplicate(_) | BatchItem::SameAs { .. } => {
                        report::duplicate(&message.id);
                    }
                    _ => {}
                }
            }
            if outcome.processed() > 0 {
                consumer::crash_pause(config.crash_window).await;
            }
            (0..messages.len())
                .map(|n| match outcome.settled(n) {
                    BatchItem::Processed | BatchItem::Duplicate(_) => Ack::Ack,
                    BatchItem::Failed(error) => {
                        policy.decide_error(error, delivery_count(&batch[n]))
                    }
                    _ => Ack::DeadLetter, // an invalid id
                })
                .collect()
        }
        Err(error) => {
            eprintln!("batch of {} failed: {error}", messages.len());
            batch
                .iter()
                .map(|jet| policy.decide_error(&error, delivery_count(jet)))
                .collect()
        }
    };
    let dead_subject = config.dead_subject();
    for ((jet, message), ack) in batch.iter().zip(&messages).zip(&acks) {
        settle(jet, *ack, Some(&dead_subject)).await?;
        report::settled(*ack, &message.id, &message.body);
    }
    Ok(())
}

/// One task pulling from the durable consumer: handles its messages one at a time until
/// `stop` turns true.
async fn consume(
    consumer: PullConsumer,
    config: Arc<Config>,
    pool: PgPool,
    activity: Arc<Activity>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(config.prefetch)
        .messages()
        .await?;
    let policy = AckPolicy::<sqlx::Postgres>::new();
    let dead_subject = config.dead_subject();
    loop {
        let message = tokio::select! {
            message = messages.next() => message,
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let Some(message) = message else { break };
        let message = match message {
            Ok(message) => message,
            // A missed heartbeat or a failed pull: the stream pulls again.
            Err(error)
                if matches!(
                    error.kind(),
                    MessagesErrorKind::MissingHeartbeat | MessagesErrorKind::Pull
                ) =>
            {
                eprintln!("pulling: {error}");
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        activity.begin();
        if config.batch > 1 {
            // What the pull has already brought, up to `BATCH` messages.
            let mut batch = vec![message];
            while batch.len() < config.batch {
                match tokio::time::timeout(Duration::from_millis(5), messages.next()).await {
                    Ok(Some(Ok(message))) => batch.push(message),
                    Ok(Some(Err(error))) => eprintln!("pulling: {error}"),
                    Ok(None) | Err(_) => break,
                }
            }
            process_batch(&batch, &config, &pool, &policy).await?;
            activity.end();
            continue;
        }

        let delivered = delivery_count(&message);
        let msg = message_of(&message);
        report::delivered(delivered, &msg.id);

        let result = match &config.forward {
            None => apply(&pool, &msg).await,
            Some(forward) => apply_and_forward(&pool, &msg, forward).await,
        };
        match &result {
            Ok(Outcome::Processed(())) => {
                report::committed(&msg.id);
                consumer::crash_pause(config.crash_window).await;
            }
            Ok(Outcome::Duplicate(_)) => report::duplicate(&msg.id),
            Err(error) => eprintln!("message {:?} failed: {error}", report::shown(&msg.id)),
        }
        let ack = policy.decide(&result, delivered);
        // A dead letter is copied to `SUBJECT.dead` (confirmed by its stream) before it is
        // terminated: a crash in between redelivers it, and the dead-letter stream may
        // then hold it twice, never zero times.
        settle(&message, ack, Some(&dead_subject)).await?;
        report::settled(ack, &msg.id, &msg.body);

        activity.end();
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let config = Arc::new(Config::from_env()?);
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        None => {}
        Some("publish") => {
            let count = args.next().map_or(Ok(100), |n| n.parse())?;
            return publish(&config, count).await;
        }
        Some(other) => {
            return Err(
                format!("unknown command {other:?}; expected none or `publish [N]`").into(),
            );
        }
    }

    let pool = PgPoolOptions::new()
        .max_connections(u32::from(config.consumers) + 1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&config.database_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.database_url))?;
    dedup_runtime::migrate(&pool).await?;
    sqlx::query(CREATE_EFFECTS).execute(&pool).await?;
    if let Some(forward) = &config.forward {
        dedup_runtime::outbox::migrate_table(&pool, forward.outbox.table().name()).await?;
    }

    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.nats_url))?;
    let jetstream = jetstream::new(client.clone());
    let consumer = declare(&jetstream, &config).await?;

    let activity = Arc::new(Activity::new());
    let mut consumers = tokio::task::JoinSet::new();
    for _ in 0..config.consumers {
        consumers.spawn(consume(
            consumer.clone(),
            config.clone(),
            pool.clone(),
            activity.clone(),
            activity.stopped(),
        ));
    }
    report::ready();
    activity.stop_when_idle(config.exit_when_idle);

    // A task that fails ends the process: whatever it had not acknowledged is delivered
    // again once the ack wait has passed.
    while let Some(finished) = consumers.join_next().await {
        finished??;
    }
    // Messages pulled but not handled stay unacknowledged: JetStream redelivers them
    // after the ack wait.
    client.flush().await?;
    pool.close().await;
    Ok(())
}
