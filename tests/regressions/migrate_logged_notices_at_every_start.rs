//! Issue 42: every `migrate` after the first logged "relation … already exists,
//! skipping" at INFO on PostgreSQL, once per table — the server's notice for a `CREATE
//! TABLE IF NOT EXISTS` that finds the table, which sqlx logs at INFO (target
//! `sqlx::postgres::notice`). A service calls `migrate` at every start: four INFO lines
//! (the dedup table, the inbox, the outbox and its relays' table) that said nothing.
//! Now a `migrate` with nothing to do logs nothing at INFO or above, on every backend.

use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Every event at INFO or above, as `LEVEL target: fields`.
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<String>>>);

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

impl Subscriber for Logged {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let metadata = event.metadata();
        if *metadata.level() <= Level::INFO {
            let mut text = Text(format!("{} {}:", metadata.level(), metadata.target()));
            event.record(&mut text);
            self.0.lock().unwrap().push(text.0);
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The dedup table, the inbox and the outbox (with its relays' table).
async fn migrate_everything<DB: dedup_runtime::Backend>(pool: &sqlx::Pool<DB>) {
    dedup_runtime::migrate(pool).await.unwrap();
    dedup_runtime::inbox::migrate(pool).await.unwrap();
    dedup_runtime::outbox::migrate(pool).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn migrate_with_nothing_to_do_logs_nothing() {
    let postgres = dedup_suite::postgres().await;
    let mysql = dedup_suite::mysql().await;
    let sqlite = dedup_suite::sqlite().await;
    // The first call creates what is missing (another test may have done it already).
    migrate_everything(&postgres).await;
    migrate_everything(&mysql).await;
    migrate_everything(&*sqlite).await;

    let logged = Logged::default();
    let _default = tracing::subscriber::set_default(logged.clone());
    for _ in 0..2 {
        migrate_everything(&postgres).await;
        migrate_everything(&mysql).await;
        migrate_everything(&*sqlite).await;
    }
    // The subscriber saw the migrations: an INFO event of this thread reaches it.
    tracing::info!(target: "dedup_regression", "migrated");
    let logged = logged.0.lock().unwrap();
    assert_eq!(
        *logged,
        ["INFO dedup_regression: message=migrated"],
        "a migrate with nothing to do logged"
    );
}
