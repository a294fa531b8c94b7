//! An effectively-once Redis Streams consumer: the redis crate, a consumer group read with
//! `XREADGROUP`, `XACK` after the commit, `XAUTOCLAIM` for entries a dead consumer left
//! behind, a delivery limit, and an `#[idempotent]` handler writing to PostgreSQL.
//!
//! Each message's effect is one row in `redis_example_effects`, a table with no unique
//! constraint: only the dedup record, committed in the same transaction as the row, stands
//! between a redelivery and a second row. Kill the consumer whenever you like (`kill -9`
//! included): what it had read and not acknowledged stays in the group's pending entries
//! list; the restarted process reads its own pending entries first, other consumers take
//! over a dead one's after `CLAIM_IDLE_MS`, and a message whose transaction had committed
//! comes back as a duplicate and is only acknowledged.
//!
//! ```text
//! cargo run --features brokers --example redis_streams -- publish 1000   # 1,000 messages, sent twice
//! cargo run --features brokers --example redis_streams                   # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment:
//!
//! | variable | default | |
//! | --- | --- | --- |
//! | `REDIS_URL` | `redis://127.0.0.1:6379` | the server |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` | PostgreSQL |
//! | `STREAM` | `dedup-example` | the stream; created (empty) with the group if missing |
//! | `GROUP` | `dedup-example` | the consumer group; created if missing, reading from the stream's start |
//! | `CONSUMER_PREFIX` | `dedup-example` | consumer names are `<prefix>-0`, `<prefix>-1`, …: a restarted process takes its names, and their pending entries, back |
//! | `CONSUMERS` | `4` | tasks reading from the group, each its own consumer, one message at a time |
//! | `PREFETCH` | `16` | entries each task reads per `XREADGROUP` (`COUNT`) |
//! | `BATCH` | `1` | over 1: up to this many of the entries read at once per transaction (`#[idempotent(batch = …)]`), acknowledged with one `XACK` |
//! | `CLAIM_IDLE_MS` | `30000` | entries pending this long (with any consumer) are taken over by `XAUTOCLAIM` |
//! | `MAX_DELIVER` | `20` | deliveries after which a message is dead-lettered |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit cleanly after this long without a delivery |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause between COMMIT and the acknowledgement |
//!
//! Each process must have its own `CONSUMER_PREFIX` (the host name, say) when several run
//! at once: two live tasks with one consumer name would read each other's pending entries.
//!
//! **The message id is a field of the entry**, `id` (its body is the field `body`), not the
//! entry id Redis assigns (`1733094000000-0`): a producer that re-adds a message after a
//! failed or unconfirmed `XADD` creates a new entry with a new entry id, which dedup could
//! not recognise. The entry id would do as the key only for a producer that never re-adds.
//! An entry without an `id` field is poison: the handler refuses its empty id
//! (`InvalidMessageId`, a permanent error) and it is dead-lettered.
//!
//! **Batches** (`BATCH` over 1): a task handles the entries one read brought (new ones, its
//! own pending ones after a restart, or those it took over), up to `BATCH` at a time, in
//! one transaction (one claim statement for their ids, one multi-row insert of the effects
//! of those not processed before, one commit); once it has committed, one `XACK` for all
//! the entries that can be acknowledged. A crash between the two leaves the whole batch
//! pending, and every entry of it that had committed comes back as a duplicate. Entries
//! past `MAX_DELIVER` and poison ones are dead-lettered as one at a time; an entry that
//! failed transiently stays pending, as one at a time.
//!
//! Dead letters go to the stream `STREAM:dead`: a copy of the entry's fields (`XADD`), then
//! `XACK`. A crash in between redelivers the entry, and the dead-letter stream may then
//! hold it twice, never zero times.
//!
//! What each outcome does to the entry (the mapping is `dedup_runtime::AckPolicy`'s):
//!
//! | handler result | `AckPolicy` says | Redis |
//! | --- | --- | --- |
//! | `Outcome::Processed` / `Outcome::Duplicate` | `Ack::Ack` | `XACK` |
//! | transient error (database contended or away) | `Ack::Retry { after }` | nothing: the entry stays pending and `XAUTOCLAIM` delivers it again after `CLAIM_IDLE_MS` (Redis has no per-message delay: `after` is not used) |
//! | permanent error (bad or missing id, failing body) | `Ack::DeadLetter` | copy to `STREAM:dead`, then `XACK` |
//! | a delivery past `MAX_DELIVER` (the handler is not called), or a transient error on delivery `MAX_DELIVER` | — | copy to `STREAM:dead`, then `XACK` |
//!
//! The delivery count is Redis's own, the pending entry's `times_delivered`: 1 for an entry
//! read with `>`; for one read again from the consumer's pending entries (`XREADGROUP …
//! 0`) or taken over by `XAUTOCLAIM`, both of which count a delivery, `XPENDING` says it.
//!
//! The consumer reports what it does on standard output, one line per step, which the
//! crash harness in `tests/brokers/` reads: `ready`, `delivered <delivery count> <id>`,
//! `committed <id>`, `duplicate <id>`, `acked <id>`, `retry <id>`, `dead <id> <body>`
//! (an empty id is written `-`).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedup_runtime::batch::BatchItem;
use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use dedup_suite::consumer::{self, Activity, Error, report};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;

/// The entry field that carries the message id.
const ID_FIELD: &str = "id";
/// The entry field that carries the message body.
const BODY_FIELD: &str = "body";

/// One message: its id (the dedup key) and its body.
#[derive(Clone)]
struct Message {
    id: String,
    body: String,
}

/// The effect of one message. Not unique on purpose: a message applied twice would show
/// as two rows.
const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS redis_example_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// Applies a message: one row, in the same transaction as the dedup record for
/// `(redis-example, msg.id)`.
#[idempotent(consumer = "redis-example", key = msg.id)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO redis_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// `BATCH` > 1: the same effect for a whole batch, one multi-row insert over the messages
/// not processed before, in the transaction that claims their ids (consumer
/// `redis-example`, as `apply`'s).
#[idempotent(consumer = "redis-example", batch = fresh, key = |msg| msg.id.as_str())]
async fn apply_batch(tx: &mut PgConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = fresh.iter().map(|msg| msg.id.as_str()).collect();
    let bodies: Vec<&str> = fresh.iter().map(|msg| msg.body.as_str()).collect();
    sqlx::query(
        "INSERT INTO redis_example_effects (message_id, body) \
         SELECT * FROM unnest($1::text[], $2::text[])",
    )
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Redis: the commands and their replies
// ---------------------------------------------------------------------------------------

/// A reply of Redis that is not of the shape its command documents.
#[derive(Debug)]
struct UnexpectedReply {
    command: &'static str,
    what: &'static str,
    reply: String,
}

impl fmt::Display for UnexpectedReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unexpected {} reply: expected {}, got {}",
            self.command, self.what, self.reply
        )
    }
}

impl std::error::Error for UnexpectedReply {}

fn unexpected(command: &'static str, what: &'static str, reply: &Value) -> UnexpectedReply {
    let mut reply = format!("{reply:?}");
    if reply.len() > 200 {
        let mut end = 200;
        while !reply.is_char_boundary(end) {
            end -= 1;
        }
        reply.truncate(end);
        reply.push('…');
    }
    UnexpectedReply {
        command,
        what,
        reply,
    }
}

/// One stream entry as a group read returns it: its entry id and its fields in order
/// (`None`: the entry is still pending but was deleted from the stream).
struct Entry {
    id: String,
    fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

impl Entry {
    fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .as_ref()?
            .iter()
            .find(|(field, _)| field == name.as_bytes())
            .map(|(_, value)| value.as_slice())
    }

    /// The message: the `id` field (empty when missing or not UTF-8: the handler refuses
    /// it) and the `body` field.
    fn message(&self) -> Message {
        Message {
            id: self
                .field(ID_FIELD)
                .and_then(|id| std::str::from_utf8(id).ok())
                .unwrap_or_default()
                .to_owned(),
            body: self
                .field(BODY_FIELD)
                .map(|body| String::from_utf8_lossy(body).into_owned())
                .unwrap_or_default(),
        }
    }
}

fn text(command: &'static str, value: &Value) -> Result<String, UnexpectedReply> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone())
            .map_err(|_| unexpected(command, "a UTF-8 string", value)),
        Value::SimpleString(text) => Ok(text.clone()),
        _ => Err(unexpected(command, "a string", value)),
    }
}

fn bytes(command: &'static str, value: &Value) -> Result<Vec<u8>, UnexpectedReply> {
    match value {
        Value::BulkString(bytes) => Ok(bytes.clone()),
        Value::SimpleString(text) => Ok(text.clone().into_bytes()),
        _ => Err(unexpected(command, "a string", value)),
    }
}

fn integer(command: &'static str, value: &Value) -> Result<u64, UnexpectedReply> {
    match value {
        Value::Int(n) => u64::try_from(*n).map_err(|_| unexpected(command, "a count", value)),
        _ => Err(unexpected(command, "an integer", value)),
    }
}

fn array<'v>(
    command: &'static str,
    what: &'static str,
    value: &'v Value,
) -> Result<&'v [Value], UnexpectedReply> {
    match value {
        Value::Array(items) => Ok(items),
        _ => Err(unexpected(command, what, value)),
    }
}

/// `[[entry id, [field, value, …] or nil], …]`.
fn entries(command: &'static str, value: &Value) -> Result<Vec<Entry>, UnexpectedReply> {
    let mut out = Vec::new();
    for item in array(command, "an array of entries", value)? {
        let [id, fields] = array(command, "an entry: [id, fields]", item)? else {
            return Err(unexpected(command, "an entry: [id, fields]", item));
        };
        let fields = match fields {
            Value::Nil => None,
            fields => {
                let flat = array(command, "an entry's fields", fields)?;
                if flat.len() % 2 != 0 {
                    return Err(unexpected(command, "field-value pairs", fields));
                }
                let mut pairs = Vec::with_capacity(flat.len() / 2);
                for pair in flat.chunks_exact(2) {
                    pairs.push((bytes(command, &pair[0])?, bytes(command, &pair[1])?));
                }
                Some(pairs)
            }
        };
        out.push(Entry {
            id: text(command, id)?,
            fields,
        });
    }
    Ok(out)
}

/// `XREADGROUP`'s reply for one stream: nil (nothing within `BLOCK`) or
/// `[[stream, entries]]`.
fn read_reply(value: &Value) -> Result<Vec<Entry>, UnexpectedReply> {
    const COMMAND: &str = "XREADGROUP";
    match value {
        Value::Nil => Ok(Vec::new()),
        Value::Array(streams) => match streams.as_slice() {
            [] => Ok(Vec::new()),
            [stream] => match array(COMMAND, "[stream, entries]", stream)? {
                [_name, found] => entries(COMMAND, found),
                _ => Err(unexpected(COMMAND, "[stream, entries]", stream)),
            },
            _ => Err(unexpected(COMMAND, "one stream", value)),
        },
        _ => Err(unexpected(COMMAND, "nil or an array of streams", value)),
    }
}

/// The stream, the group and the connection settings every task shares.
struct Streams {
    client: redis::Client,
    stream: String,
    dead: String,
    group: String,
    /// `XREADGROUP`'s `BLOCK`, in milliseconds.
    block_ms: u64,
}

impl Streams {
    /// A connection of its own (a blocking read holds a connection: one per task).
    async fn connect(&self) -> Result<MultiplexedConnection, Error> {
        let config = AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_millis(self.block_ms + 10_000)));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|error| format!("cannot connect to Redis: {error}").into())
    }

    /// The group, created with the stream if missing, reading from the stream's start (an
    /// existing group is left as it is).
    async fn declare(&self, redis: &mut MultiplexedConnection) -> Result<(), Error> {
        let created: Result<Value, redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(redis)
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// `XREADGROUP GROUP <group> <consumer> COUNT <count> [BLOCK <ms>] STREAMS <stream>
    /// <after>`: with `after` `>`, new entries (waiting up to `block_ms`); otherwise the
    /// consumer's own pending entries after that entry id.
    async fn read(
        &self,
        redis: &mut MultiplexedConnection,
        consumer: &str,
        count: usize,
        after: &str,
    ) -> Result<Vec<Entry>, Error> {
        let mut command = redis::cmd("XREADGROUP");
        command
            .arg("GROUP")
            .arg(&self.group)
            .arg(consumer)
            .arg("COUNT")
            .arg(count);
        if after == ">" {
            command.arg("BLOCK").arg(self.block_ms.max(1));
        }
        command.arg("STREAMS").arg(&self.stream).arg(after);
        let reply: Value = command.query_async(redis).await?;
        Ok(read_reply(&reply)?)
    }

    /// `XAUTOCLAIM`: up to `count` entries pending at least `min_idle` with any consumer,
    /// from `cursor` on, now `consumer`'s. Returns them and the next cursor (`0-0`: the
    /// pending entries list has been gone through).
    async fn claim(
        &self,
        redis: &mut MultiplexedConnection,
        consumer: &str,
        min_idle: Duration,
        cursor: &str,
        count: usize,
    ) -> Result<(Vec<Entry>, String), Error> {
        const COMMAND: &str = "XAUTOCLAIM";
        let reply: Value = redis::cmd(COMMAND)
            .arg(&self.stream)
            .arg(&self.group)
            .arg(consumer)
            .arg(u64::try_from(min_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(redis)
            .await?;
        // Redis 7: [next cursor, entries, ids deleted from the stream (and from the
        // pending entries list)]; Redis 6.2: the first two.
        match array(COMMAND, "[cursor, entries, deleted]", &reply)? {
            [next, claimed, ..] => Ok((entries(COMMAND, claimed)?, text(COMMAND, next)?)),
            _ => Err(unexpected(COMMAND, "[cursor, entries, deleted]", &reply).into()),
        }
    }

    /// How often each of `entries`, pending with `consumer`, has been delivered
    /// (`XPENDING <stream> <group> <first> <last> <n> <consumer>`). An entry missing from
    /// the answer is no longer `consumer`'s: another took it over, or it was acknowledged.
    async fn delivery_counts(
        &self,
        redis: &mut MultiplexedConnection,
        consumer: &str,
        entries: &[Entry],
    ) -> Result<HashMap<String, u64>, Error> {
        const COMMAND: &str = "XPENDING";
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Ok(HashMap::new());
        };
        let reply: Value = redis::cmd(COMMAND)
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&first.id)
            .arg(&last.id)
            .arg(entries.len())
            .arg(consumer)
            .query_async(redis)
            .await?;
        let mut counts = HashMap::new();
        for item in array(COMMAND, "an array of pending entries", &reply)? {
            match array(COMMAND, "[id, consumer, idle, deliveries]", item)? {
                [id, _consumer, _idle, deliveries] => {
                    counts.insert(text(COMMAND, id)?, integer(COMMAND, deliveries)?);
                }
                _ => {
                    return Err(
                        unexpected(COMMAND, "[id, consumer, idle, deliveries]", item).into(),
                    );
                }
            }
        }
        Ok(counts)
    }

    /// `XACK`: the entry leaves the group's pending entries list.
    async fn ack(&self, redis: &mut MultiplexedConnection, id: &str) -> Result<(), Error> {
        self.ack_all(redis, &[id]).await
    }

    /// One `XACK` for all of `ids`: they leave the group's pending entries list.
    async fn ack_all(&self, redis: &mut MultiplexedConnection, ids: &[&str]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let _acknowledged: u64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(ids)
            .query_async(redis)
            .await?;
        Ok(())
    }

    /// A copy of the entry's fields added to `STREAM:dead`, then `XACK`.
    async fn dead_letter(
        &self,
        redis: &mut MultiplexedConnection,
        entry: &Entry,
    ) -> Result<(), Error> {
        if let Some(fields) = entry.fields.as_ref().filter(|fields| !fields.is_empty()) {
            let mut command = redis::cmd("XADD");
            command.arg(&self.dead).arg("*");
            for (field, value) in fields {
                command.arg(field.as_slice()).arg(value.as_slice());
            }
            let _id: Value = command.query_async(redis).await?;
        }
        self.ack(redis, &entry.id).await
    }
}

// ---------------------------------------------------------------------------------------
// Publishing, configuration
// ---------------------------------------------------------------------------------------

/// `publish N`: adds N messages, each twice (two stream entries with the same `id` field:
/// the second is for dedup to catch), and exits.
async fn publish(config: &Config, count: usize) -> Result<(), Error> {
    let streams = config.streams()?;
    let mut redis = streams.connect().await?;
    streams.declare(&mut redis).await?;
    let batch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let mut pipe = redis::pipe();
    for n in 0..count {
        let id = format!("msg-{batch}-{n}");
        let body = format!("payment {n}");
        for _copy in 0..2 {
            pipe.cmd("XADD")
                .arg(&streams.stream)
                .arg("*")
                .arg(ID_FIELD)
                .arg(&id)
                .arg(BODY_FIELD)
                .arg(&body)
                .ignore();
        }
        if n % 250 == 249 || n + 1 == count {
            let () = pipe.query_async(&mut redis).await?;
            pipe = redis::pipe();
        }
    }
    println!(
        "published {count} messages twice each to {}",
        streams.stream
    );
    Ok(())
}

struct Config {
    redis_url: String,
    database_url: String,
    stream: String,
    group: String,
    consumer_prefix: String,
    consumers: u16,
    prefetch: usize,
    batch: usize,
    claim_idle: Duration,
    max_deliver: u64,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        Ok(Config {
            redis_url: consumer::var("REDIS_URL", "redis://127.0.0.1:6379"),
            database_url: consumer::database_url(),
            stream: consumer::var("STREAM", "dedup-example"),
            group: consumer::var("GROUP", "dedup-example"),
            consumer_prefix: consumer::var("CONSUMER_PREFIX", "dedup-example"),
            consumers: consumer::consumers()?,
            prefetch: consumer::prefetch::<usize>()?.max(1),
            batch: consumer::batch()?.max(1),
            claim_idle: Duration::from_millis(consumer::number("CLAIM_IDLE_MS", 30_000)?),
            max_deliver: consumer::number("MAX_DELIVER", 20)?,
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
        })
    }

    /// How often each task looks for entries to take over: twice per `CLAIM_IDLE_MS`.
    fn claim_every(&self) -> Duration {
        (self.claim_idle / 2).max(Duration::from_millis(100))
    }

    fn streams(&self) -> Result<Streams, Error> {
        Ok(Streams {
            client: redis::Client::open(self.redis_url.as_str())
                .map_err(|error| format!("REDIS_URL {:?}: {error}", self.redis_url))?,
            stream: self.stream.clone(),
            dead: format!("{}:dead", self.stream),
            group: self.group.clone(),
            block_ms: u64::try_from(
                self.claim_every()
                    .min(Duration::from_millis(500))
                    .as_millis(),
            )
            .unwrap_or(500),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Consuming
// ---------------------------------------------------------------------------------------

/// One task: its consumer name, its connection, and what it shares with the others.
struct Task {
    consumer: String,
    redis: MultiplexedConnection,
    streams: Arc<Streams>,
    config: Arc<Config>,
    pool: PgPool,
    policy: AckPolicy<sqlx::Postgres>,
}

impl Task {
    /// Handles one delivery of `entry`, its `delivered`-th, and settles it.
    async fn handle(&mut self, entry: &Entry, delivered: u64) -> Result<(), Error> {
        if entry.fields.is_none() {
            // Deleted from the stream while pending: nothing left to process.
            eprintln!(
                "entry {} was deleted from the stream; acknowledged",
                entry.id
            );
            return self.streams.ack(&mut self.redis, &entry.id).await;
        }
        let msg = entry.message();
        let shown = report::shown(&msg.id);
        report::delivered(delivered, &msg.id);

        let ack = if delivered > self.config.max_deliver {
            // Delivered MAX_DELIVER times and never settled (a consumer that dies on it,
            // say): parked without another try.
            eprintln!("message {shown:?}: {delivered} deliveries, over MAX_DELIVER");
            Ack::DeadLetter
        } else {
            let result = apply(&self.pool, &msg).await;
            match &result {
                Ok(Outcome::Processed(())) => {
                    report::committed(&msg.id);
                    consumer::crash_pause(self.config.crash_window).await;
                }
                Ok(Outcome::Duplicate(_)) => report::duplicate(&msg.id),
                Err(error) => eprintln!("message {shown:?} failed: {error}"),
            }
            match self.policy.decide(&result, delivered) {
                // The last delivery allowed: no later one to retry on.
                Ack::Retry { .. } if delivered >= self.config.max_deliver => Ack::DeadLetter,
                ack => ack,
            }
        };
        match ack {
            Ack::Ack => {
                self.streams.ack(&mut self.redis, &entry.id).await?;
                report::acked(&msg.id);
            }
            // Left pending: `XAUTOCLAIM` delivers it again once it has been idle for
            // `CLAIM_IDLE_MS`.
            Ack::Retry { .. } => report::retry(&msg.id),
            Ack::DeadLetter => {
                self.streams.dead_letter(&mut self.redis, entry).await?;
                report::dead(&msg.id, &msg.body);
            }
        }
        Ok(())
    }

    /// `BATCH` > 1: handles `entries` (each with its delivery count) in one transaction
    /// (`apply_batch`), then acknowledges those done with one `XACK`; each of the others
    /// is dead-lettered or left pending for a retry, as [`handle`](Self::handle) would.
    async fn handle_batch(&mut self, entries: &[(&Entry, u64)]) -> Result<(), Error> {
        let mut batch: Vec<(&Entry, u64, Message)> = Vec::with_capacity(entries.len());
        for &(entry, delivered) in entries {
            if entry.fields.is_none() {
                // Deleted from the stream while pending: nothing left to process.
                eprintln!(
                    "entry {} was deleted from the stream; acknowledged",
                    entry.id
                );
                self.streams.ack(&mut self.redis, &entry.id).await?;
                continue;
            }
            let msg = entry.message();
            report::delivered(delivered, &msg.id);
            batch.push((entry, delivered, msg));
        }
        let max_deliver = self.config.max_deliver;
        // Delivered MAX_DELIVER times and never settled: parked without another try.
        let (over, under): (Vec<usize>, Vec<usize>) =
            (0..batch.len()).partition(|&n| batch[n].1 > max_deliver);
        let mut acks = vec![Ack::DeadLetter; batch.len()];
        for &n in &over {
            let (_, delivered, msg) = &batch[n];
            let shown = report::shown(&msg.id);
            eprintln!("message {shown:?}: {delivered} deliveries, over MAX_DELIVER");
        }
        if !under.is_empty() {
            let messages: Vec<Message> = under.iter().map(|&n| batch[n].2.clone()).collect();
            let decided: Vec<Ack> = match apply_batch(&self.pool, &messages).await {
                Ok(outcome) => {
                    for (k, message) in messages.iter().enumerate() {
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
                    under
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| match outcome.settled(k) {
                            BatchItem::Processed | BatchItem::Duplicate(_) => Ack::Ack,
                            BatchItem::Failed(error) => self.policy.decide_error(error, batch[n].1),
                            BatchItem::CommitFailed(error) => {
                                self.policy.decide_error(error, batch[n].1)
                            }
                            _ => Ack::DeadLetter, // an invalid id
                        })
                        .collect()
                }
                Err(error) => {
                    eprintln!("batch of {} failed: {error}", messages.len());
                    under
                        .iter()
                        .map(|&n| self.policy.decide_error(&error, batch[n].1))
                        .collect()
                }
            };
            for (&n, ack) in under.iter().zip(decided) {
                acks[n] = match ack {
                    // The last delivery allowed: no later one to retry on.
                    Ack::Retry { .. } if batch[n].1 >= max_deliver => Ack::DeadLetter,
                    ack => ack,
                };
            }
        }
        // After the commit: one `XACK` for every entry done.
        let done: Vec<&str> = (0..batch.len())
            .filter(|&n| acks[n] == Ack::Ack)
            .map(|n| batch[n].0.id.as_str())
            .collect();
        self.streams.ack_all(&mut self.redis, &done).await?;
        for (n, (entry, _, msg)) in batch.iter().enumerate() {
            match acks[n] {
                Ack::Ack => report::acked(&msg.id),
                // Left pending: `XAUTOCLAIM` delivers it again once it has been idle for
                // `CLAIM_IDLE_MS`.
                Ack::Retry { .. } => report::retry(&msg.id),
                Ack::DeadLetter => {
                    self.streams.dead_letter(&mut self.redis, entry).await?;
                    report::dead(&msg.id, &msg.body);
                }
            }
        }
        Ok(())
    }

    /// Handles `entries` (each with its delivery count): one at a time, or (`BATCH` over
    /// 1) in batches of up to `BATCH`.
    async fn handle_all(&mut self, entries: &[(&Entry, u64)]) -> Result<(), Error> {
        if self.config.batch > 1 {
            for batch in entries.chunks(self.config.batch) {
                self.handle_batch(batch).await?;
            }
        } else {
            for &(entry, delivered) in entries {
                self.handle(entry, delivered).await?;
            }
        }
        Ok(())
    }

    /// Entries read again from the consumer's own pending list or taken over: each
    /// handled with its delivery count from `XPENDING`, unless no longer this consumer's.
    async fn handle_pending(&mut self, entries: &[Entry]) -> Result<(), Error> {
        let counts = self
            .streams
            .delivery_counts(&mut self.redis, &self.consumer, entries)
            .await?;
        // Missing: another consumer has it now, or it was acknowledged.
        let ours: Vec<(&Entry, u64)> = entries
            .iter()
            .filter_map(|entry| Some((entry, *counts.get(&entry.id)?)))
            .collect();
        self.handle_all(&ours).await
    }

    /// The first thing after a (re)start: the entries this consumer had read and not
    /// acknowledged, oldest first.
    async fn drain_own_pending(&mut self, activity: &Activity) -> Result<(), Error> {
        let mut after = "0".to_owned();
        loop {
            let prefetch = self.config.prefetch;
            let entries = self
                .streams
                .read(&mut self.redis, &self.consumer, prefetch, &after)
                .await?;
            let Some(last) = entries.last() else {
                return Ok(());
            };
            after = last.id.clone();
            activity.begin();
            self.handle_pending(&entries).await?;
            activity.end();
        }
    }

    /// Takes over what has been pending longer than `CLAIM_IDLE_MS` (a dead consumer's
    /// entries, or entries left for a retry), going once through the pending entries list.
    async fn claim_stuck(&mut self, activity: &Activity) -> Result<(), Error> {
        let mut cursor = "0-0".to_owned();
        loop {
            let (entries, next) = self
                .streams
                .claim(
                    &mut self.redis,
                    &self.consumer,
                    self.config.claim_idle,
                    &cursor,
                    self.config.prefetch,
                )
                .await?;
            if !entries.is_empty() {
                activity.begin();
                self.handle_pending(&entries).await?;
                activity.end();
            }
            if next == "0-0" || next == cursor {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Reads and handles until `stop` turns true. Entries read are always handled, stop
    /// or not: a read entry is pending with this consumer until it is settled.
    async fn run(
        mut self,
        activity: Arc<Activity>,
        stop: watch::Receiver<bool>,
    ) -> Result<(), Error> {
        self.drain_own_pending(&activity).await?;
        let mut claimed_at: Option<Instant> = None;
        while !*stop.borrow() {
            if claimed_at.is_none_or(|at| at.elapsed() >= self.config.claim_every()) {
                self.claim_stuck(&activity).await?;
                claimed_at = Some(Instant::now());
            }
            let prefetch = self.config.prefetch;
            let entries = self
                .streams
                .read(&mut self.redis, &self.consumer, prefetch, ">")
                .await?;
            if entries.is_empty() {
                continue;
            }
            activity.begin();
            // Read with `>`: their first delivery.
            let first: Vec<(&Entry, u64)> = entries.iter().map(|entry| (entry, 1)).collect();
            self.handle_all(&first).await?;
            activity.end();
        }
        Ok(())
    }
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

    let streams = Arc::new(config.streams()?);
    let mut redis = streams.connect().await?;
    streams.declare(&mut redis).await?;
    drop(redis);

    let activity = Arc::new(Activity::new());
    let policy = AckPolicy::<sqlx::Postgres>::new();
    let mut consumers = tokio::task::JoinSet::new();
    for n in 0..config.consumers {
        let task = Task {
            consumer: format!("{}-{n}", config.consumer_prefix),
            redis: streams.connect().await?,
            streams: streams.clone(),
            config: config.clone(),
            pool: pool.clone(),
            policy: policy.clone(),
        };
        consumers.spawn(task.run(activity.clone(), activity.stopped()));
    }
    report::ready();
    activity.stop_when_idle(config.exit_when_idle);

    // A task that fails ends the process: whatever it had not acknowledged stays pending,
    // read again by the next process's task of the same name, or taken over by another
    // consumer after `CLAIM_IDLE_MS`.
    while let Some(finished) = consumers.join_next().await {
        finished??;
    }
    pool.close().await;
    Ok(())
}
