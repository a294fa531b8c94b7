//! A Redis Streams → PostgreSQL service with an outbox event, on the consumer dedup hosts:
//! each order applied once, whatever Redis delivers again and whenever the process dies
//! (`kill -9` included), and one `accepted` event per order, sent on by the relay.
//!
//! ```text
//! cargo run --features brokers --example redis_consumer   # SIGTERM or Ctrl-C stops it
//! ```
//!
//! Settings: `REDIS_URL`, `DATABASE_URL`, `STREAM` (`orders`; dead letters to
//! `orders.dead`), `GROUP` (`orders`), `MEMBER` (`orders-0`: the group member's name,
//! stable across restarts — a pod's or host's name — so that a restarted process reads
//! what its previous life left pending), `EVENTS_STREAM` (`order-events`) and
//! `OUTBOX_TABLE` (`outbox_messages`; a table per service: its relay sends only its own
//! events, whatever other services share the database). An order's
//! id is its entry's field `id`, its payload the field `body`; one without an id is
//! dead-lettered.

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::idempotent;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::redis::{RedisStreamsConsumer, RedisStreamsPublisher};
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

const CONSUMER: &str = "orders"; // the attribute's and the `Cause`'s

/// Applies an order and enqueues its event, in one transaction with the dedup record.
#[idempotent(consumer = CONSUMER, key = msg.id())]
async fn apply(
    tx: &mut PgConnection,
    msg: &Message,
    (outbox, events): &(Outbox, String),
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO example_orders (message_id, body) VALUES ($1, $2)")
        .bind(msg.id())
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    let cause = Cause::new(CONSUMER, msg.id())?;
    let event = cause.outgoing("accepted", events, msg.payload())?;
    outbox.enqueue(&mut *tx, &event).await?;
    Ok(())
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Completes once `stopping` says so.
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = redis::Client::open(setting("REDIS_URL", "redis://127.0.0.1:6379"))?;
    let (stream, group, member) = (
        setting("STREAM", "orders"),
        setting("GROUP", "orders"),
        setting("MEMBER", "orders-0"),
    );
    let events = setting("EVENTS_STREAM", "order-events");
    let table = setting("OUTBOX_TABLE", "outbox_messages");
    let database = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let pool = PgPool::connect(&database).await?;
    dedup_runtime::migrate(&pool).await?;
    dedup_runtime::outbox::migrate_table(&pool, &table).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_orders (message_id text, body bytea)")
        .execute(&pool)
        .await?;

    // SIGTERM or Ctrl-C: the consumer and the relay finish what they hold, then stop.
    let (stop, stopping) = watch::channel(false);
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        let _ = stop.send(true);
    });

    // The relay adds the events to their stream (`XADD`, fields `id` and `body`).
    let publisher = RedisStreamsPublisher::new(client.clone());
    let outbox = Outbox::new().in_table(&table)?;
    let relay = outbox.relay(&pool);
    let until = stopped(stopping.clone());
    let relaying = tokio::spawn(async move { relay.run(&publisher, until).await });

    let to = Arc::new((outbox, events));
    let handler = move |pool: PgPool, msg: Arc<Message>| {
        let to = to.clone();
        async move { apply(&pool, &msg, &to).await }
    };
    let consumer = RedisStreamsConsumer::new(client, &stream, &group, &member);
    let consumed = consumer.run(&pool, handler, stopped(stopping)).await?;
    relaying.await??;
    println!("stopped: {consumed:?}");
    Ok(())
}
