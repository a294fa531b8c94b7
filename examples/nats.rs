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
//! | `BATCH` | `1` | over 1: up to this many pulled messages per transaction (`#[idempotent(batch = …)]`) |
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::{AckPolicy as JetStreamAckPolicy, PullConsumer};
use dedup_runtime::async_nats::{delivery_count, settle};
use dedup_runtime::batch::BatchItem;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use futures_util::StreamExt;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

type Error = Box<dyn std::error::Error + Send + Sync>;

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

/// Where service A of a two-hop chain sends its events (`FORWARD_TO`).
struct Forward {
    to: String,
    outbox: Outbox,
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
        Ok(Config {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("STREAM", "DEDUP_EXAMPLE"),
            subject: var("SUBJECT", "dedup-example.payments"),
            durable: var("DURABLE", "dedup-example"),
            ack_wait: Duration::from_millis(number("ACK_WAIT_MS", 30_000)?),
            max_deliver: number("MAX_DELIVER", 20)?,
            consumers: number("CONSUMERS", 4)?,
            prefetch: number("PREFETCH", 16)?,
            batch: number("BATCH", 1)?,
            exit_when_idle: std::env::var_os("DEDUP_EXIT_WHEN_IDLE_MS")
                .map(|_| number("DEDUP_EXIT_WHEN_IDLE_MS", 0).map(Duration::from_millis))
                .transpose()?,
            crash_window: Duration::from_millis(number("DEDUP_CRASH_WINDOW_MS", 0)?),
            forward: match std::env::var("FORWARD_TO") {
                Ok(to) => Some(Forward {
                    to,
                    outbox: Outbox::new().in_table(&var(
                        "DEDUP_OUTBOX_TABLE",
                        dedup_runtime::outbox::DEFAULT_TABLE,
                    ))?,
                }),
                Err(_) => None,
            },
        })
    }

    fn dead_subject(&self) -> String {
        format!("{}.dead", self.subject)
    }
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn number<N: std::str::FromStr>(name: &str, default: N) -> Result<N, Error> {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .map_err(|_| format!("{name}: expected a number, got {text:?}").into()),
        Err(_) => Ok(default),
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

/// Deliveries in progress and the time of the last one, for `DEDUP_EXIT_WHEN_IDLE_MS`.
struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::SeqCst);
    }

    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
        Some(self.start.elapsed().saturating_sub(last))
    }
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

/// The id as the output lines show it (`-` for none).
fn shown(message: &Message) -> &str {
    if message.id.is_empty() {
        "-"
    } else {
        &message.id
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
        println!("delivered {} {}", delivery_count(jet), shown(message));
    }
    let acks: Vec<Ack> = match apply_batch(pool, &messages).await {
        Ok(outcome) => {
            for (n, message) in messages.iter().enumerate() {
                match &outcome.items()[n] {
                    BatchItem::Processed => println!("committed {}", shown(message)),
                    BatchItem::Duplicate(_) | BatchItem::SameAs { .. } => {
                        println!("duplicate {}", shown(message));
                    }
                    _ => {}
                }
            }
            if outcome.processed() > 0 && !config.crash_window.is_zero() {
                tokio::time::sleep(config.crash_window).await;
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
        match ack {
            Ack::Ack => println!("acked {}", shown(message)),
            Ack::Retry { .. } => println!("retry {}", shown(message)),
            Ack::DeadLetter => println!("dead {} {}", shown(message), message.body),
        }
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
        activity.in_flight.fetch_add(1, Ordering::SeqCst);
        activity.touch();
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
            activity.touch();
            activity.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }

        let delivered = delivery_count(&message);
        let msg = message_of(&message);
        let shown = shown(&msg);
        println!("delivered {delivered} {shown}");

        let result = match &config.forward {
            None => apply(&pool, &msg).await,
            Some(forward) => apply_and_forward(&pool, &msg, forward).await,
        };
        match &result {
            Ok(Outcome::Processed(())) => {
                println!("committed {shown}");
                // Testing only: widen the window in which a crash leaves a committed
                // message unacknowledged.
                if !config.crash_window.is_zero() {
                    tokio::time::sleep(config.crash_window).await;
                }
            }
            Ok(Outcome::Duplicate(_)) => println!("duplicate {shown}"),
            Err(error) => eprintln!("message {shown:?} failed: {error}"),
        }
        let ack = policy.decide(&result, delivered);
        // A dead letter is copied to `SUBJECT.dead` (confirmed by its stream) before it is
        // terminated: a crash in between redelivers it, and the dead-letter stream may
        // then hold it twice, never zero times.
        settle(&message, ack, Some(&dead_subject)).await?;
        match ack {
            Ack::Ack => println!("acked {shown}"),
            Ack::Retry { .. } => println!("retry {shown}"),
            Ack::DeadLetter => println!("dead {shown} {}", msg.body),
        }

        activity.touch();
        activity.in_flight.fetch_sub(1, Ordering::SeqCst);
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

    let activity = Arc::new(Activity {
        start: Instant::now(),
        in_flight: AtomicUsize::new(0),
        last_ms: AtomicU64::new(0),
    });
    let (stop, stopped) = watch::channel(false);
    let mut consumers = tokio::task::JoinSet::new();
    for _ in 0..config.consumers {
        consumers.spawn(consume(
            consumer.clone(),
            config.clone(),
            pool.clone(),
            activity.clone(),
            stopped.clone(),
        ));
    }
    println!("ready");

    if let Some(limit) = config.exit_when_idle {
        let activity = activity.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if activity.idle_for().is_some_and(|idle| idle >= limit) {
                    stop.send_replace(true);
                    break;
                }
            }
        });
    }

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
