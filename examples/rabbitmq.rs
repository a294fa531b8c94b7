//! An effectively-once RabbitMQ consumer: lapin, manual acknowledgements, prefetch, a
//! dead-letter exchange, and an `#[idempotent]` handler writing to PostgreSQL.
//!
//! Each message's effect is one row in `rabbitmq_example_effects`, a table with no unique
//! constraint: only the dedup record, committed in the same transaction as the row, stands
//! between a redelivery and a second row. Kill the consumer whenever you like (`kill -9`
//! included): RabbitMQ requeues what was not acknowledged, and a message whose transaction
//! had committed comes back as a duplicate and is only acknowledged.
//!
//! ```text
//! cargo run --features brokers --example rabbitmq -- publish 1000   # 1,000 messages, sent twice
//! cargo run --features brokers --example rabbitmq                   # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment:
//!
//! | variable | default | |
//! | --- | --- | --- |
//! | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` | the broker |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` | PostgreSQL |
//! | `QUEUE` | `dedup-example.payments` | the queue to consume |
//! | `CONSUMERS` | `4` | channels, each consuming one message at a time |
//! | `PREFETCH` | `16` | unacknowledged messages the broker sends each channel ahead |
//! | `BATCH` | `1` | over 1: up to this many deliveries per transaction (`#[idempotent(batch = …)]`), acknowledged with one multiple-ack (not with `FORWARD_TO`) |
//! | `FORWARD_TO` | unset | service A of a two-hop chain: also send an event to this queue, through the outbox |
//! | `DEDUP_OUTBOX_TABLE` | `outbox_messages` | with `FORWARD_TO`: the outbox table |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit cleanly after this long without a delivery |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause between COMMIT and the acknowledgement |
//!
//! Topology, declared at start-up (idempotent; `tests/brokers/rabbitmq.rs` declares the
//! same): the durable queue `QUEUE` with `x-dead-letter-exchange = QUEUE.dlx`, the fanout
//! exchange `QUEUE.dlx`, and the durable queue `QUEUE.dead` bound to it. A message's id is
//! its AMQP `message_id` property; its body is the payload stored with the effect.
//!
//! What each outcome does to the message (the mapping is `dedup_runtime::AckPolicy`'s;
//! `dedup_runtime::lapin::settle` makes the lapin call, and
//! `dedup_runtime::lapin::delivery_count` reads the count `AckPolicy` takes):
//!
//! | handler result | `AckPolicy` says | lapin call |
//! | --- | --- | --- |
//! | `Outcome::Processed` / `Outcome::Duplicate` | `Ack::Ack` | `basic_ack` |
//! | transient error (database contended or away) | `Ack::Retry { after }` | wait `after`, `basic_nack(requeue)` |
//! | permanent error (bad or missing id, failing body) | `Ack::DeadLetter` | `basic_reject(no requeue)` → `QUEUE.dead` |
//!
//! The consumer reports what it does on standard output, one line per step, which the
//! crash harness in `tests/brokers/` reads: `ready`, `delivered <count> <id>` (a classic
//! queue only flags redeliveries: 2 stands for "more than once"),
//! `committed <id>`, `duplicate <id>`, `acked <id>`, `retry <id>`, `dead <id> <body>`
//! (an empty id is written `-`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::batch::BatchItem;
use dedup_runtime::lapin::{delivery_count, settle};
use dedup_runtime::outbox::Cause;
use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use dedup_suite::consumer::{self, Activity, Error, Forward, report};
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

/// One message: its id (the dedup key) and its body.
struct Message {
    id: String,
    body: String,
}

/// The effect of one message. Not unique on purpose: a message applied twice would show
/// as two rows.
const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS rabbitmq_example_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// Applies a message: one row, in the same transaction as the dedup record for
/// `(rabbitmq-example, msg.id)`.
#[idempotent(consumer = "rabbitmq-example", key = msg.id)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO rabbitmq_example_effects (message_id, body) VALUES ($1, $2)")
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
#[idempotent(consumer = "rabbitmq-example-forward", key = msg.id)]
async fn apply_and_forward(
    tx: &mut PgConnection,
    msg: &Message,
    forward: &Forward,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO rabbitmq_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new("rabbitmq-example-forward", msg.id.as_str())?;
    let event = cause.outgoing("event", &forward.to, msg.body.as_bytes())?;
    forward.outbox.enqueue(&mut *tx, &event).await?;
    Ok(())
}

/// `BATCH` > 1: the same effect for a whole batch, one multi-row insert over the messages
/// not processed before, in the transaction that claims their ids (consumer
/// `rabbitmq-example`, as `apply`'s).
#[idempotent(consumer = "rabbitmq-example", batch = fresh, key = |msg| msg.id.as_str())]
async fn apply_batch(tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = fresh.iter().map(|msg| msg.id.as_str()).collect();
    let bodies: Vec<&str> = fresh.iter().map(|msg| msg.body.as_str()).collect();
    sqlx::query(
        "INSERT INTO rabbitmq_example_effects (message_id, body) \
         SELECT * FROM unnest($1::text[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Declares the queue, its dead-letter exchange and dead-letter queue.
async fn declare(channel: &Channel, queue: &str) -> Result<(), lapin::Error> {
    let dlx = format!("{queue}.dlx");
    let dead = format!("{queue}.dead");
    channel
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            dead.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await?;
    Ok(())
}

/// `publish N`: sends N messages, each twice (two broker messages with the same id: the
/// second is for dedup to catch), and exits.
async fn publish(config: &Config, count: usize) -> Result<(), Error> {
    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.amqp_url))?;
    let channel = connection.create_channel().await?;
    declare(&channel, &config.queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let batch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    for n in 0..count {
        let id = format!("msg-{batch}-{n}");
        for _copy in 0..2 {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2); // persistent
            channel
                .basic_publish(
                    "".into(),
                    config.queue.as_str().into(),
                    BasicPublishOptions::default(),
                    format!("payment {n}").as_bytes(),
                    properties,
                )
                .await?;
        }
    }
    channel.wait_for_confirms().await?;
    println!("published {count} messages twice each to {}", config.queue);
    connection.close(200, "published".into()).await?;
    Ok(())
}

struct Config {
    amqp_url: String,
    database_url: String,
    queue: String,
    consumers: u16,
    prefetch: u16,
    batch: usize,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
    forward: Option<Forward>,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        let batch = consumer::batch()?;
        Ok(Config {
            amqp_url: consumer::var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            database_url: consumer::database_url(),
            queue: consumer::var("QUEUE", "dedup-example.payments"),
            consumers: consumer::consumers()?,
            prefetch: consumer::prefetch()?,
            batch,
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
            forward: Forward::from_env(batch)?,
        })
    }
}

/// A delivery's id (its AMQP `message_id`; empty if it has none) and body.
fn message_of(delivery: &Delivery) -> Message {
    Message {
        id: delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default(),
        body: String::from_utf8_lossy(&delivery.data).into_owned(),
    }
}

/// `BATCH` > 1: one transaction for the whole batch (`apply_batch`, the attribute's batch form), then one
/// multiple-ack up to its last delivery when every message can be acknowledged, or each
/// settled as its own outcome says. A database failure retries the whole batch.
async fn process_batch(
    batch: &[Delivery],
    config: &Config,
    pool: &PgPool,
    policy: &AckPolicy<sqlx::Postgres>,
) -> Result<(), Error> {
    let messages: Vec<Message> = batch.iter().map(message_of).collect();
    for (delivery, message) in batch.iter().zip(&messages) {
        report::delivered(delivery_count(delivery), &message.id);
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
                .map(|delivery| policy.decide_error(&error, delivery_count(delivery)))
                .collect()
        }
    };
    if acks.iter().all(|ack| *ack == Ack::Ack) {
        let last = batch.last().expect("a batch has a delivery");
        last.acker.ack(BasicAckOptions { multiple: true }).await?;
    } else {
        for (delivery, ack) in batch.iter().zip(&acks) {
            settle(delivery, *ack).await?;
        }
    }
    for (message, ack) in messages.iter().zip(&acks) {
        report::settled(*ack, &message.id, &message.body);
    }
    Ok(())
}

/// One channel's consumer: handles its deliveries one at a time until `stop` turns true.
async fn consume(
    channel: Channel,
    tag: String,
    config: Arc<Config>,
    pool: PgPool,
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
            BasicConsumeOptions::default(), // manual acknowledgements
            FieldTable::default(),
        )
        .await?;
    let policy = AckPolicy::<sqlx::Postgres>::new();
    loop {
        let delivery = tokio::select! {
            delivery = deliveries.next() => delivery,
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let Some(delivery) = delivery else { break };
        let delivery = delivery?;
        activity.begin();
        if config.batch > 1 {
            // What the prefetch has already brought, up to `BATCH` deliveries.
            let mut batch = vec![delivery];
            while batch.len() < config.batch {
                match tokio::time::timeout(Duration::from_millis(5), deliveries.next()).await {
                    Ok(Some(delivery)) => batch.push(delivery?),
                    Ok(None) | Err(_) => break,
                }
            }
            process_batch(&batch, &config, &pool, &policy).await?;
            activity.end();
            continue;
        }

        let message = message_of(&delivery);
        let delivered = delivery_count(&delivery);
        report::delivered(delivered, &message.id);

        let result = match &config.forward {
            None => apply(&pool, &message).await,
            Some(forward) => apply_and_forward(&pool, &message, forward).await,
        };
        match &result {
            Ok(Outcome::Processed(())) => {
                report::committed(&message.id);
                consumer::crash_pause(config.crash_window).await;
            }
            Ok(Outcome::Duplicate(_)) => report::duplicate(&message.id),
            Err(error) => eprintln!("message {:?} failed: {error}", report::shown(&message.id)),
        }
        let ack = policy.decide(&result, delivered);
        settle(&delivery, ack).await?;
        report::settled(ack, &message.id, &message.body);

        activity.end();
    }
    channel.close(200, "consumer done".into()).await?;
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

    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default())
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.amqp_url))?;
    declare(&connection.create_channel().await?, &config.queue).await?;

    let activity = Arc::new(Activity::new());
    let mut consumers = tokio::task::JoinSet::new();
    for n in 0..config.consumers {
        let channel = connection.create_channel().await?;
        let tag = format!("dedup-example-{}-{n}", std::process::id());
        consumers.spawn(consume(
            channel,
            tag,
            config.clone(),
            pool.clone(),
            activity.clone(),
            activity.stopped(),
        ));
    }
    report::ready();
    activity.stop_when_idle(config.exit_when_idle);

    // A consumer that fails (its channel or the connection closed) ends the process:
    // whatever it had not acknowledged is delivered again, to the next consumer.
    while let Some(finished) = consumers.join_next().await {
        finished??;
    }
    connection.close(200, "consumer done".into()).await?;
    pool.close().await;
    Ok(())
}
