//! An effectively-once Kafka consumer: rdkafka (librdkafka), a consumer group, one worker
//! per partition, the offset committed after the database commit (`enable.auto.commit =
//! false`), a dead-letter topic, and an `#[idempotent]` handler writing to PostgreSQL.
//!
//! Each message's effect is one row in `kafka_example_effects`, a table with no unique
//! constraint: only the dedup record, committed in the same transaction as the row, stands
//! between a redelivery and a second row. Kill the consumer whenever you like (`kill -9`
//! included): the group's committed offset of each partition is where the next member
//! starts reading, so every record after the last committed offset is delivered again; a
//! record whose transaction had committed comes back as a duplicate, and only its offset is
//! committed.
//!
//! ```text
//! cargo run --features brokers --example kafka -- publish 1000   # 1,000 messages, sent twice
//! cargo run --features brokers --example kafka                   # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment:
//!
//! | variable | default | |
//! | --- | --- | --- |
//! | `KAFKA_BROKERS` | `127.0.0.1:19092` | `bootstrap.servers`: plain TCP, no credentials |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` | PostgreSQL |
//! | `TOPIC` | `dedup-example` | the topic; created with `PARTITIONS` partitions if missing (`TOPIC.dead` is the dead-letter topic) |
//! | `PARTITIONS` | `4` | partitions of a topic the example creates |
//! | `GROUP` | `dedup-example` | the consumer group (`group.id`): its committed offsets are the consumer's progress |
//! | `MESSAGE_ID` | `header:id` | where the message id is: `header:<name>`, `key`, or `offset` (see below) |
//! | `PREFETCH` | `16` | records a partition's worker holds before the partition is paused |
//! | `BATCH` | `1` | over 1: up to this many of a partition's records per transaction (`#[idempotent(batch = …)]`), their offset committed once for all (not with `FORWARD_TO`) |
//! | `SESSION_TIMEOUT_MS` | `10000` | `session.timeout.ms`: a killed member's partitions go to another after this long |
//! | `FORWARD_TO` | unset | service A of a two-hop chain: also send an event to this topic, through the outbox |
//! | `DEDUP_OUTBOX_TABLE` | `outbox_messages` | with `FORWARD_TO`: the outbox table |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit cleanly after this long without a record, counted from the first assignment |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause between COMMIT and the offset commit |
//!
//! **One worker per partition, in offset order.** A committed offset `n` says "every record
//! of this partition before `n` is done", so a partition's records must be finished in
//! order: its worker handles one record at a time and commits the offset after it (an
//! asynchronous `OffsetCommit`; `acked` is printed once it is queued). Partitions run side
//! by side. A worker holds at most `PREFETCH` records; when it is full its partition is
//! paused (librdkafka drops what it had fetched for it and fetches again from the next
//! record on resume) and resumed when the worker has caught up, so that one busy partition
//! does not hold the others back. Several processes with the same `GROUP` share the
//! partitions; a rebalance may hand a partition to another member while this one still
//! works on it, and then both may handle a record: the dedup record makes that a
//! duplicate, and a commit never covers a record that was not finished.
//!
//! **Batches** (`BATCH` over 1): a partition's worker takes the records it holds, up to
//! `BATCH`, and handles them in one transaction (one claim statement for their ids, one
//! multi-row insert of the effects of those not processed before, one commit). Once that
//! transaction has committed, and the batch's poison records are in the dead-letter topic,
//! it commits the offset after the batch's last record (the highest: a batch is one
//! partition's, in offset order), once for the whole batch. A crash between the two has
//! the whole batch delivered again, and every record of it that had committed comes back
//! as a duplicate. Records that failed transiently are retried in process, as a smaller
//! batch, before the offset moves past them.
//!
//! **The message id** comes from `MESSAGE_ID`:
//!
//! - `header:<name>` (the default, `header:id`): the value of the record header `<name>`,
//!   UTF-8 (the last one, if the header is there more than once). The producer sets it,
//!   and sets the same value when it sends a message again.
//! - `key`: the record key, UTF-8. Only where the producer makes the key a message id:
//!   keys usually name an entity (a customer, an order) for partitioning and compaction,
//!   and many messages share one; taking such a key for the id would drop every message
//!   but the first of each entity as a duplicate.
//! - `offset`: `topic/partition/offset`, which every record has. It is stable across
//!   redeliveries of one record (a restart, a rebalance, offsets reset to an earlier
//!   position: the same record, the same id), and only of one record: a producer that
//!   sends again after a lost acknowledgement writes a second record at a new offset,
//!   which this id cannot recognise (unless the producer is idempotent, which removes
//!   exactly those copies). It is not stable when the topic is deleted and created again,
//!   or truncated (`DeleteRecords`) and refilled: new records then take the offsets of old
//!   ones, which dedup would take for duplicates, dropping them; prune the dedup records
//!   of the old topic first (`dedup_runtime::Ledger::forget`, or a consumer name per
//!   topic incarnation). Nor across clusters: a mirrored topic has other offsets.
//!
//! A record without the id (no such header or key, or not UTF-8) is poison: the handler
//! refuses its empty id (`InvalidMessageId`, a permanent error) and it is dead-lettered.
//!
//! Dead letters are produced to `TOPIC.dead`, key, value and headers unchanged, plus the
//! headers `dedup-topic`, `dedup-partition` and `dedup-offset` saying where the record was;
//! once the broker has acknowledged that copy, the original's offset is committed. A crash
//! in between delivers the original again, and `TOPIC.dead` may then get it twice, never
//! zero times.
//!
//! What each outcome does to the record (the mapping is `dedup_runtime::AckPolicy`'s):
//!
//! | handler result | `AckPolicy` says | Kafka |
//! | --- | --- | --- |
//! | `Outcome::Processed` / `Outcome::Duplicate` | `Ack::Ack` | commit the record's offset + 1 |
//! | transient error (database contended or away) | `Ack::Retry { after }` | nothing yet: wait `after`, run the handler again in this process until it succeeds or fails for good |
//! | permanent error (bad or missing id, failing body) | `Ack::DeadLetter` | produce a copy to `TOPIC.dead` (its delivery awaited), then commit the offset + 1 |
//!
//! **Transient errors are retried in process, without a bound.** Kafka has no negative
//! acknowledgement and no redelivery of one record: the partition's committed offset is
//! the only thing a consumer can move, and it cannot pass a record that is not finished.
//! So the worker keeps the record and retries with the policy's backoff (1 s, doubling,
//! at most 60 s; the count of attempts in this process is what `decide` is given): the
//! partition stalls while the database is away and goes on when it is back, and the other
//! partitions go on meanwhile. Dead-lettering after a few tries would park good messages
//! during an outage.
//!
//! **There is no delivery count.** Kafka keeps none: a record read again after a restart
//! looks like the first read. The `delivered` line's count is the attempt in this process.
//! Nothing here bounds a record that kills the process every time (a panic with `panic =
//! "abort"`, an out-of-memory kill): the partition stalls on it, restart after restart.
//! Bound it in the supervisor, or put the inbox (`dedup_runtime::inbox`, which counts
//! attempts in the database) behind the consumer.
//!
//! **Kafka's exactly-once, and where it stops.** The idempotent producer
//! (`enable.idempotence`) makes the broker drop a producer's retried copies of one record,
//! within one producer session. Transactions (`transactional.id`, with
//! `send_offsets_to_transaction` and consumers at `isolation.level = read_committed`)
//! make a read-process-write cycle atomic *inside Kafka*: the records produced and the
//! consumer's offsets commit together or not at all. Neither reaches a database: the
//! consumer's database commit and Kafka's offset commit (or transaction) are two commits
//! in two systems, and a crash between them replays the record; and a producer that sends
//! a message again from a new session (after a restart, or from an outbox relay) makes a
//! new record that no Kafka mechanism recognises. The dedup record in the database
//! transaction is what makes the database effect happen once, so this example commits
//! offsets plainly, after the database commit.
//!
//! The consumer reports what it does on standard output, one line per step, which the
//! crash harness in `tests/brokers/` reads: `ready` (the first partitions assigned),
//! `delivered <attempt> <id> <topic>/<partition>/<offset>`, `committed <id>`, `duplicate
//! <id>`, `acked <id>`, `retry <id>`, `dead <id> <body>` (an empty id is written `-`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::batch::BatchItem;
use dedup_runtime::outbox::Cause;
use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use dedup_suite::consumer::{self, Activity, Error, Forward, report};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tokio::task::JoinSet;

/// One message: its id (the dedup key) and its body.
#[derive(Clone)]
struct Message {
    id: String,
    body: String,
}

/// The effect of one message. Not unique on purpose: a message applied twice would show
/// as two rows.
const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS kafka_example_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// Applies a message: one row, in the same transaction as the dedup record for
/// `(kafka-example, msg.id)`.
#[idempotent(consumer = "kafka-example", key = msg.id)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO kafka_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Service A of a two-hop chain: the effect row and an event for the next service, the
/// event written to the outbox in the same transaction (`examples/outbox_relay.rs`
/// publishes it, with `DEDUP_KAFKA_BROKERS`: the event's id in the record header `id`,
/// where this example's default `MESSAGE_ID` reads it). Its id is derived from this
/// message's, so a second run of the handler would enqueue the same event, never another.
#[idempotent(consumer = "kafka-example-forward", key = msg.id)]
async fn apply_and_forward(
    tx: &mut PgConnection,
    msg: &Message,
    forward: &Forward,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO kafka_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new("kafka-example-forward", msg.id.as_str())?;
    let event = cause.outgoing("event", &forward.to, msg.body.as_bytes())?;
    forward.outbox.enqueue(&mut *tx, &event).await?;
    Ok(())
}

/// `BATCH` > 1: the same effect for a whole batch, one multi-row insert over the messages
/// not processed before, in the transaction that claims their ids (consumer
/// `kafka-example`, as `apply`'s).
#[idempotent(consumer = "kafka-example", batch = fresh, key = |msg| msg.id.as_str())]
async fn apply_batch(tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = fresh.iter().map(|msg| msg.id.as_str()).collect();
    let bodies: Vec<&str> = fresh.iter().map(|msg| msg.body.as_str()).collect();
    sqlx::query(
        "INSERT INTO kafka_example_effects (message_id, body) \
         SELECT * FROM unnest($1::text[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The message id
// ---------------------------------------------------------------------------------------

/// Where a record's message id is (`MESSAGE_ID`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum IdSource {
    /// The value of this header (its last occurrence).
    Header(String),
    /// The record key.
    Key,
    /// `topic/partition/offset`.
    Offset,
}

impl IdSource {
    fn parse(text: &str) -> Result<IdSource, Error> {
        match text {
            "key" => Ok(IdSource::Key),
            "offset" => Ok(IdSource::Offset),
            _ => match text.strip_prefix("header:") {
                Some(name) if !name.is_empty() => Ok(IdSource::Header(name.to_owned())),
                _ => Err(format!(
                    "MESSAGE_ID: expected `header:<name>`, `key` or `offset`, got {text:?}"
                )
                .into()),
            },
        }
    }

    /// The record's id: empty when it has none (the handler refuses an empty id).
    fn id_of(&self, record: &OwnedMessage) -> String {
        let utf8 = |bytes: Option<&[u8]>| {
            bytes
                .and_then(|bytes| std::str::from_utf8(bytes).ok())
                .unwrap_or_default()
                .to_owned()
        };
        match self {
            IdSource::Header(name) => utf8(
                record
                    .headers()
                    .and_then(|headers| headers.iter().filter(|h| h.key == name).last())
                    .and_then(|header| header.value),
            ),
            IdSource::Key => utf8(record.key()),
            IdSource::Offset => format!(
                "{}/{}/{}",
                record.topic(),
                record.partition(),
                record.offset()
            ),
        }
    }
}

/// Where a record is: `topic/partition/offset`.
fn place_of(record: &OwnedMessage) -> String {
    format!(
        "{}/{}/{}",
        record.topic(),
        record.partition(),
        record.offset()
    )
}

/// The message of a record: its id, and its value as the body.
fn message_of(source: &IdSource, record: &OwnedMessage) -> Message {
    Message {
        id: source.id_of(record),
        body: String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// Configuration, topics, publishing
// ---------------------------------------------------------------------------------------

struct Config {
    brokers: String,
    database_url: String,
    topic: String,
    dead: String,
    partitions: i32,
    group: String,
    message_id: IdSource,
    prefetch: usize,
    batch: usize,
    session_timeout_ms: u64,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
    forward: Option<Forward>,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        let topic = consumer::var("TOPIC", "dedup-example");
        let batch = consumer::batch()?.max(1);
        Ok(Config {
            brokers: consumer::var("KAFKA_BROKERS", "127.0.0.1:19092"),
            database_url: consumer::database_url(),
            dead: format!("{topic}.dead"),
            topic,
            partitions: consumer::number::<i32>("PARTITIONS", 4)?.max(1),
            group: consumer::var("GROUP", "dedup-example"),
            message_id: IdSource::parse(&consumer::var("MESSAGE_ID", "header:id"))?,
            prefetch: consumer::prefetch::<usize>()?.max(1),
            batch,
            session_timeout_ms: consumer::number("SESSION_TIMEOUT_MS", 10_000)?,
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
            forward: Forward::from_env(batch)?,
        })
    }

    /// The client settings every client of this example starts from.
    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        config
    }

    /// A producer whose sends are acknowledged by the broker (`acks=all`) before they
    /// count: a dead letter is sent before its original's offset is committed.
    fn producer(&self) -> Result<FutureProducer, Error> {
        Ok(self
            .client()
            .set("acks", "all")
            .set("message.timeout.ms", "30000")
            .create()?)
    }

    /// The topic and its dead-letter topic, created if missing.
    async fn declare(&self) -> Result<(), Error> {
        let admin: AdminClient<DefaultClientContext> = self.client().create()?;
        let topics = [
            NewTopic::new(&self.topic, self.partitions, TopicReplication::Fixed(1)),
            NewTopic::new(&self.dead, 1, TopicReplication::Fixed(1)),
        ];
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for result in admin.create_topics(&topics, &options).await? {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((topic, code)) => {
                    return Err(format!("cannot create the topic {topic}: {code}").into());
                }
            }
        }
        Ok(())
    }
}

/// `publish N`: produces N messages, each twice (two records with the same `id` header:
/// the second is for dedup to catch), and exits.
async fn publish(config: &Config, count: usize) -> Result<(), Error> {
    config.declare().await?;
    let producer = config.producer()?;
    let batch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let messages: Vec<(String, String)> = (0..count)
        .map(|n| (format!("msg-{batch}-{n}"), format!("payment {n}")))
        .collect();
    let mut sends = Vec::with_capacity(2 * count);
    for (id, body) in &messages {
        for _copy in 0..2 {
            let headers = OwnedHeaders::new().insert(Header {
                key: "id",
                value: Some(id),
            });
            let record = FutureRecord::<(), _>::to(&config.topic)
                .payload(body)
                .headers(headers);
            sends.push(producer.send(record, Timeout::After(Duration::from_secs(30))));
        }
    }
    for sent in futures_util::future::join_all(sends).await {
        sent.map_err(|(error, _)| error)?;
    }
    println!("published {count} messages twice each to {}", config.topic);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The consumer
// ---------------------------------------------------------------------------------------

/// The consumer's context: says `ready` at the first assignment, and reports rebalances
/// and failed offset commits on standard error.
struct Context {
    ready: AtomicBool,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(partitions) => {
                eprintln!("assigned: {}", listed(partitions));
                if partitions.count() > 0 && !self.ready.swap(true, Ordering::SeqCst) {
                    report::ready();
                }
            }
            Rebalance::Revoke(partitions) => eprintln!("revoked: {}", listed(partitions)),
            Rebalance::Error(error) => eprintln!("rebalance failed: {error}"),
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        // A failed commit loses nothing: the records after the group's committed offset
        // are delivered again, and dedup recognises those already done.
        if let Err(error) = result {
            eprintln!("offset commit failed ({error}): {}", listed(offsets));
        }
    }
}

fn listed(partitions: &TopicPartitionList) -> String {
    partitions
        .elements()
        .iter()
        .map(|element| {
            format!(
                "{}/{}@{:?}",
                element.topic(),
                element.partition(),
                element.offset()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

type KafkaConsumer = StreamConsumer<Context>;

/// What the partition workers share.
struct Shared {
    config: Config,
    consumer: Arc<KafkaConsumer>,
    producer: FutureProducer,
    pool: PgPool,
    policy: AckPolicy<sqlx::Postgres>,
    activity: Activity,
    /// Per partition, the offset after the last record finished: what a final commit
    /// commits.
    finished: Mutex<HashMap<i32, i64>>,
}

impl Shared {
    /// Handles one record, then commits its offset + 1. Transient failures are retried
    /// here, in order: the records behind it in its partition wait.
    async fn handle(&self, record: &OwnedMessage) -> Result<(), Error> {
        let msg = message_of(&self.config.message_id, record);
        let shown = report::shown(&msg.id);
        let place = place_of(record);
        let mut attempt = 1;
        let ack = loop {
            report::delivered_at(attempt, &msg.id, &place);
            let result = match &self.config.forward {
                None => apply(&self.pool, &msg).await,
                Some(forward) => apply_and_forward(&self.pool, &msg, forward).await,
            };
            match &result {
                Ok(Outcome::Processed(())) => {
                    report::committed(&msg.id);
                    consumer::crash_pause(self.config.crash_window).await;
                }
                Ok(Outcome::Duplicate(_)) => report::duplicate(&msg.id),
                Err(error) => eprintln!("message {shown:?} at {place} failed: {error}"),
            }
            match self.policy.decide(&result, attempt) {
                Ack::Retry { after } => {
                    report::retry(&msg.id);
                    tokio::time::sleep(after).await;
                    attempt += 1;
                }
                ack => break ack,
            }
        };
        if matches!(ack, Ack::DeadLetter) {
            self.dead_letter(record).await?;
            report::dead(&msg.id, &msg.body);
        }
        self.commit(record);
        if matches!(ack, Ack::Ack) {
            report::acked(&msg.id);
        }
        Ok(())
    }

    /// `BATCH` > 1: handles `batch`, records of one partition in offset order, in one
    /// transaction (`apply_batch`), then commits the offset after its last record. Records
    /// that fail transiently are retried here, as a smaller batch, until they succeed or
    /// fail for good; poison ones are dead-lettered before the offset commit.
    async fn handle_batch(&self, batch: &[OwnedMessage]) -> Result<(), Error> {
        let messages: Vec<Message> = batch
            .iter()
            .map(|record| message_of(&self.config.message_id, record))
            .collect();
        let places: Vec<String> = batch.iter().map(place_of).collect();
        // Each record's settlement, once it has one: `Ack::Ack` or `Ack::DeadLetter`.
        let mut settled: Vec<Option<Ack>> = vec![None; batch.len()];
        let mut attempt = 1;
        loop {
            let open: Vec<usize> = (0..batch.len()).filter(|&n| settled[n].is_none()).collect();
            if open.is_empty() {
                break;
            }
            for &n in &open {
                report::delivered_at(attempt, &messages[n].id, &places[n]);
            }
            let todo: Vec<Message> = open.iter().map(|&n| messages[n].clone()).collect();
            let acks: Vec<Ack> = match apply_batch(&self.pool, &todo).await {
                Ok(outcome) => {
                    for (k, message) in todo.iter().enumerate() {
                        match &outcome.items()[k] {
                            BatchItem::Processed => report::committed(&message.id),
                            BatchItem::Duplicate(_) | BatchItem::SameAs { .. } => {
                                report::duplicate(&message.id);
                            }
                            _ => {}
                        }
                    }
                    if outcome.processed() > 0 {
                        consumer::crash_pause(self.config.crash_window).await;
                    }
                    (0..todo.len())
                        .map(|k| match outcome.settled(k) {
                            BatchItem::Processed | BatchItem::Duplicate(_) => Ack::Ack,
                            BatchItem::Failed(error) => self.policy.decide_error(error, attempt),
                            BatchItem::CommitFailed(error) => {
                                self.policy.decide_error(error, attempt)
                            }
                            _ => Ack::DeadLetter, // an invalid id
                        })
                        .collect()
                }
                Err(error) => {
                    eprintln!(
                        "batch of {} at {} failed: {error}",
                        todo.len(),
                        places[open[0]]
                    );
                    open.iter()
                        .map(|_| self.policy.decide_error(&error, attempt))
                        .collect()
                }
            };
            let mut wait = Duration::ZERO;
            for (&n, ack) in open.iter().zip(acks) {
                match ack {
                    Ack::Retry { after } => {
                        report::retry(&messages[n].id);
                        wait = wait.max(after);
                    }
                    ack => settled[n] = Some(ack),
                }
            }
            if wait > Duration::ZERO {
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
        }
        for (n, record) in batch.iter().enumerate() {
            if settled[n] == Some(Ack::DeadLetter) {
                self.dead_letter(record).await?;
                report::dead(&messages[n].id, &messages[n].body);
            }
        }
        // The records of a batch are in offset order: the last one's is the highest.
        self.commit(batch.last().expect("a batch has a record"));
        for (n, message) in messages.iter().enumerate() {
            if settled[n] == Some(Ack::Ack) {
                report::acked(&message.id);
            }
        }
        Ok(())
    }

    /// Produces a copy of `record` to the dead-letter topic and waits for the broker's
    /// acknowledgement.
    async fn dead_letter(&self, record: &OwnedMessage) -> Result<(), Error> {
        let partition = record.partition().to_string();
        let offset = record.offset().to_string();
        let mut headers = OwnedHeaders::new();
        if let Some(original) = record.headers() {
            for header in original.iter() {
                headers = headers.insert(header);
            }
        }
        let headers = headers
            .insert(Header {
                key: "dedup-topic",
                value: Some(record.topic()),
            })
            .insert(Header {
                key: "dedup-partition",
                value: Some(&partition),
            })
            .insert(Header {
                key: "dedup-offset",
                value: Some(&offset),
            });
        let mut copy = FutureRecord::<[u8], [u8]>::to(&self.config.dead).headers(headers);
        if let Some(key) = record.key() {
            copy = copy.key(key);
        }
        if let Some(value) = record.payload() {
            copy = copy.payload(value);
        }
        self.producer
            .send(copy, Timeout::After(Duration::from_secs(30)))
            .await
            .map_err(|(error, _)| format!("dead letter to {}: {error}", self.config.dead))?;
        Ok(())
    }

    /// Commits `record`'s offset + 1 for its partition, asynchronously: a commit that
    /// fails or is lost in a crash only has the records after the last committed offset
    /// delivered again.
    fn commit(&self, record: &OwnedMessage) {
        let next = record.offset() + 1;
        self.finished
            .lock()
            .expect("the finished offsets")
            .insert(record.partition(), next);
        let mut offsets = TopicPartitionList::new();
        let committed = offsets
            .add_partition_offset(record.topic(), record.partition(), Offset::Offset(next))
            .and_then(|()| self.consumer.commit(&offsets, CommitMode::Async));
        if let Err(error) = committed {
            eprintln!("offset commit not sent ({error}): {}", listed(&offsets));
        }
    }

    /// Commits every partition's finished offset, and waits for the answer: the last
    /// thing before a clean exit.
    fn commit_finished(&self) -> KafkaResult<()> {
        let mut offsets = TopicPartitionList::new();
        for (&partition, &next) in self.finished.lock().expect("the finished offsets").iter() {
            offsets.add_partition_offset(&self.config.topic, partition, Offset::Offset(next))?;
        }
        if offsets.count() == 0 {
            return Ok(());
        }
        self.consumer.commit(&offsets, CommitMode::Sync)
    }
}

/// A partition's worker: handles its records one at a time, in offset order, or (`BATCH`
/// over 1) in batches of those it holds.
async fn work(shared: Arc<Shared>, mut records: mpsc::Receiver<OwnedMessage>) -> Result<(), Error> {
    while let Some(record) = records.recv().await {
        shared.activity.begin();
        if shared.config.batch > 1 {
            // What the dispatcher has already handed over, up to `BATCH` records.
            let mut batch = vec![record];
            while batch.len() < shared.config.batch {
                match tokio::time::timeout(Duration::from_millis(5), records.recv()).await {
                    Ok(Some(record)) => batch.push(record),
                    Ok(None) | Err(_) => break,
                }
            }
            shared.handle_batch(&batch).await?;
        } else {
            shared.handle(&record).await?;
        }
        shared.activity.end();
    }
    Ok(())
}

/// The dispatcher's view of one partition.
struct Lane {
    records: mpsc::Sender<OwnedMessage>,
    /// The offset after the last record handed to the worker: a record before it (read
    /// again after a pause or a rebalance) is already the worker's.
    next: i64,
    paused: bool,
}

fn one_partition(topic: &str, partition: i32) -> TopicPartitionList {
    let mut list = TopicPartitionList::new();
    list.add_partition(topic, partition);
    list
}

/// Reads records and hands each to its partition's worker, until idle for
/// `DEDUP_EXIT_WHEN_IDLE_MS` (or forever).
async fn consume(shared: Arc<Shared>) -> Result<(), Error> {
    let consumer = shared.consumer.clone();
    let prefetch = shared.config.prefetch;
    let mut lanes: HashMap<i32, Lane> = HashMap::new();
    let mut workers: JoinSet<Result<(), Error>> = JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            received = consumer.recv() => {
                let record = match received {
                    Ok(record) => record.detach(),
                    // librdkafka reports broker and fetch trouble here and recovers by
                    // itself; nothing was consumed.
                    Err(error) => {
                        eprintln!("consumer: {error}");
                        continue;
                    }
                };
                shared.activity.touch();
                let partition = record.partition();
                let lane = lanes.entry(partition).or_insert_with(|| {
                    let (records, receive) = mpsc::channel(prefetch);
                    workers.spawn(work(shared.clone(), receive));
                    Lane { records, next: i64::MIN, paused: false }
                });
                if record.offset() < lane.next {
                    continue;
                }
                lane.next = record.offset() + 1;
                match lane.records.try_send(record) {
                    Ok(()) => {}
                    Err(TrySendError::Full(record)) => {
                        // librdkafka drops what it has fetched for the partition and, on
                        // resume, fetches from the record after this one.
                        let topic = record.topic().to_owned();
                        if let Err(error) = consumer.pause(&one_partition(&topic, partition)) {
                            eprintln!("pause {topic}/{partition}: {error}");
                        }
                        lane.paused = true;
                        lane.records.send(record).await.map_err(|_| "a partition worker stopped")?;
                    }
                    Err(TrySendError::Closed(_)) => return Err("a partition worker stopped".into()),
                }
            }
            _ = tick.tick() => {
                for (&partition, lane) in lanes.iter_mut().filter(|(_, lane)| lane.paused) {
                    if lane.records.capacity() * 2 >= prefetch {
                        let list = one_partition(&shared.config.topic, partition);
                        if let Err(error) = consumer.resume(&list) {
                            eprintln!("resume {}/{partition}: {error}", shared.config.topic);
                        }
                        lane.paused = false;
                    }
                }
                // Idle counts from the first assignment: joining the group takes a while.
                let ready = consumer.context().ready.load(Ordering::SeqCst);
                if !ready {
                    shared.activity.touch();
                }
                let idle = shared.activity.idle_for();
                let drained = lanes.values().all(|lane| lane.records.capacity() == prefetch);
                if let Some(limit) = shared.config.exit_when_idle
                    && ready
                    && drained
                    && idle.is_some_and(|idle| idle >= limit)
                {
                    break;
                }
            }
            Some(finished) = workers.join_next() => {
                finished??;
                return Err("a partition worker stopped".into());
            }
        }
    }
    // Idle: let the workers finish (their queues are empty), then commit for good.
    drop(lanes);
    while let Some(finished) = workers.join_next().await {
        finished??;
    }
    tokio::task::spawn_blocking(move || shared.commit_finished()).await??;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let config = Config::from_env()?;
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
        .max_connections(u32::try_from(config.partitions).unwrap_or(4).clamp(1, 16) + 1)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&config.database_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.database_url))?;
    dedup_runtime::migrate(&pool).await?;
    sqlx::query(CREATE_EFFECTS).execute(&pool).await?;
    if let Some(forward) = &config.forward {
        dedup_runtime::outbox::migrate_table(&pool, forward.outbox.table().name()).await?;
    }
    config.declare().await?;

    let consumer: KafkaConsumer = config
        .client()
        .set("group.id", &config.group)
        // The offset is committed by hand, after the database commit; never by a timer.
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // A group with no committed offset yet starts at the topic's first record.
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", config.session_timeout_ms.to_string())
        .set(
            "heartbeat.interval.ms",
            (config.session_timeout_ms / 3).max(1).to_string(),
        )
        .create_with_context(Context {
            ready: AtomicBool::new(false),
        })
        .map_err(|error: KafkaError| format!("cannot create the consumer: {error}"))?;
    consumer.subscribe(&[&config.topic])?;
    let producer = config.producer()?;

    let shared = Arc::new(Shared {
        consumer: Arc::new(consumer),
        producer,
        pool: pool.clone(),
        policy: AckPolicy::<sqlx::Postgres>::new(),
        activity: Activity::new(),
        finished: Mutex::new(HashMap::new()),
        config,
    });
    consume(shared).await?;
    pool.close().await;
    Ok(())
}
