//! Two handlers declaring one consumer name share one id space: a debug build says so, once,
//! naming both (`dedup-runtime/src/consumers.rs`). Handlers on other consumer names, on
//! other tables or on other backends stay quiet, and so does a handler called again.

use std::sync::{Arc, Mutex};

use dedup_runtime::idempotent;
use sqlx::SqliteConnection;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Keeps the message of every event of target `dedup_runtime::consumers`.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<(tracing::Level, String)>>>);

struct Message<'a>(&'a mut String);

impl Visit for Message<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == "dedup_runtime::consumers"
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = String::new();
        event.record(&mut Message(&mut message));
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), message));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

async fn effect(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[idempotent(consumer = "consumers-orders", key = id)]
async fn paid(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    effect(tx, id).await
}

#[idempotent(consumer = "consumers-orders", key = id)]
async fn shipped(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    effect(tx, id).await
}

#[idempotent(consumer = "consumers-invoices", key = id)]
async fn invoiced(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    effect(tx, id).await
}

#[idempotent(consumer = "consumers-orders", key = id, table = "consumers_other")]
async fn audited(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    effect(tx, id).await
}

#[tokio::test(flavor = "current_thread")]
async fn a_shared_consumer_name_is_reported_once_naming_both_handlers() {
    let warnings = Warnings::default();
    let _guard = tracing::subscriber::set_default(warnings.clone());
    let pool = dedup_suite::sqlite().await;
    sqlx::raw_sql("CREATE TABLE effects (id TEXT NOT NULL)")
        .execute(&*pool)
        .await
        .unwrap();
    dedup_runtime::migrate_table(&pool, "consumers_other")
        .await
        .unwrap();
    let count = || warnings.0.lock().unwrap().len();

    assert!(paid(&*pool, "1").await.unwrap().is_processed());
    assert!(paid(&*pool, "2").await.unwrap().is_processed());
    assert!(invoiced(&*pool, "1").await.unwrap().is_processed());
    assert!(audited(&*pool, "1").await.unwrap().is_processed());
    assert_eq!(count(), 0, "{:?}", warnings.0.lock().unwrap());

    // The id space really is shared: `shipped` finds `paid`'s id 1 processed, and runs
    // nothing. That is what the warning is about.
    assert!(shipped(&*pool, "1").await.unwrap().is_duplicate());
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert_eq!(effects, 4);
    {
        let seen = warnings.0.lock().unwrap();
        assert_eq!(seen.len(), 1, "{seen:?}");
        let (level, message) = &seen[0];
        assert_eq!(*level, tracing::Level::WARN);
        assert!(message.contains("`suite::consumers::paid`"), "{message}");
        assert!(message.contains("`suite::consumers::shipped`"), "{message}");
        assert!(message.contains("\"consumers-orders\""), "{message}");
        assert!(message.contains("processed_messages"), "{message}");
    }
    // Said once: later calls of either handler add nothing.
    assert!(shipped(&*pool, "3").await.unwrap().is_processed());
    assert!(paid(&*pool, "4").await.unwrap().is_processed());
    assert_eq!(count(), 1);
}
