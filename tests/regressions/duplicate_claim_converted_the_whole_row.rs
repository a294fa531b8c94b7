//! Issue 26: on PostgreSQL a claim that found its row read the row's `state` and
//! `expires_at` through `to_jsonb(p)`, the whole row converted to JSON — so that a table
//! of 0.1, which has neither column, is claimed before `migrate` upgrades it. Once rows
//! hold a stored result, every duplicate of such a row converted the result too, hex
//! encoded, twice: 9 ms for a 1 MB result where the columns by name take 0.5 ms (measured
//! with psql on this machine). Claims of a table known to have the columns (`migrate` in
//! this process, or the catalog, looked at once per table) now read them by name; the
//! statement log of a duplicate shows it.

use std::sync::{Arc, Mutex};

use dedup_runtime::idempotent;
use sqlx::PgConnection;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Keeps the full text of every statement sqlx logs.
#[derive(Clone, Default)]
struct Statements(Arc<Mutex<Vec<String>>>);

struct Text<'a>(&'a mut Option<String>);

impl Visit for Text<'_> {
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "db.statement" {
            *self.0 = Some(value.to_owned());
        }
    }
}

impl Subscriber for Statements {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == "sqlx::query"
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        if event.metadata().target() == "sqlx::query" {
            let mut text = None;
            event.record(&mut Text(&mut text));
            if let Some(text) = text {
                // Not `unwrap`: a failed assertion holding the lock must not make every
                // other test of this binary panic in its statements' events.
                self.0
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(text);
            }
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The process's subscriber, installed once: a scoped one (`set_default`) missed sqlx's
/// events whenever other tests of this binary ran queries on other threads at the time
/// (their callsites' interest, cached without it).
fn statements() -> &'static Statements {
    static STATEMENTS: std::sync::OnceLock<Statements> = std::sync::OnceLock::new();
    STATEMENTS.get_or_init(|| {
        let statements = Statements::default();
        tracing::subscriber::set_global_default(statements.clone())
            .expect("no other test of this binary installs a subscriber");
        tracing::callsite::rebuild_interest_cache();
        statements
    })
}

#[idempotent(consumer = "regr-whole-row", key = id, result = "stored", table = "regr_whole_row")]
async fn remember(tx: &mut PgConnection, id: &str) -> Result<Vec<u8>, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(vec![7; 1 << 20])
}

#[tokio::test(flavor = "current_thread")]
async fn a_duplicates_claim_reads_two_columns_not_the_row() {
    let pool = dedup_suite::postgres().await;
    // Migrated in this process; a table of its own, so that the claims found are this
    // test's.
    dedup_runtime::migrate_table(&pool, "regr_whole_row")
        .await
        .unwrap();
    let id = dedup_suite::unique("whole-row");
    assert!(remember(&pool, &id).await.unwrap().is_processed());
    let statements = statements();
    statements.0.lock().unwrap().clear();
    let again = remember(&pool, &id).await.unwrap();
    assert!(again.is_replayed());
    let logged = statements.0.lock().unwrap().clone();
    // The claim is the insert alone (issue 41); the duplicate's look at its row follows.
    let look = logged
        .iter()
        .find(|text| {
            let text = text.trim().to_lowercase();
            text.starts_with("select p.state") && text.contains("from regr_whole_row")
        })
        .unwrap_or_else(|| panic!("the look at the row: {logged:#?}"));
    assert!(
        !look.contains("to_jsonb"),
        "the look at an upgraded table's row reads the columns by name: {look}"
    );
}
