//! What a call emits: one `tracing` span with the handler, consumer, message id, outcome
//! and attempts (and the inbox workers' and the relay's spans, with OpenTelemetry's
//! messaging names); and exactly the statements claim, body, COMMIT after the BEGIN (the
//! claim alone for a duplicate; no probing queries), as sqlx's own statement log shows
//! them. sqlx sends BEGIN, and a queued ROLLBACK, without logging them. On PostgreSQL,
//! whose driver logs COMMIT (SQLite's runs it on its worker without logging it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dedup_runtime::idempotent;
use sqlx::{Connection, PgConnection};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One test at a time: each installs its own subscriber, and `tracing` caches each
/// callsite's interest across threads (a test without one running beside another could
/// switch the other's statement log off).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A span's name and fields.
type SpanRecord = (String, BTreeMap<String, String>);

/// Records every span's fields and every statement sqlx logs.
#[derive(Default)]
struct Recorder {
    next: AtomicU64,
    spans: Mutex<BTreeMap<u64, SpanRecord>>,
    statements: Mutex<Vec<String>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

/// The subscriber handed to `tracing`, sharing the recorder with the test.
struct Shared(Arc<Recorder>);

impl Subscriber for Shared {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.0.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        let _ = self
            .0
            .spans
            .lock()
            .unwrap()
            .insert(id, (span.metadata().name().to_owned(), fields));
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((_, fields)) = self.0.spans.lock().unwrap().get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        if event.metadata().target() == "sqlx::query" {
            let mut fields = BTreeMap::new();
            event.record(&mut Fields(&mut fields));
            if let Some(statement) = fields.get("summary") {
                self.0.statements.lock().unwrap().push(statement.clone());
            }
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[idempotent(consumer = "observed", key = id)]
async fn observed(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE processed_messages SET processed_at = processed_at WHERE 1 = 0")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn one_span_and_no_extra_statement_per_call() {
    let _alone = ONE_AT_A_TIME.lock().await;
    drop(dedup_suite::postgres().await); // migrated
    // The hot path: a pool (of one connection, so that the queued rollback is seen to be
    // flushed before the next use).
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let id = dedup_suite::unique("observed");
    let recorder = Arc::new(Recorder::default());
    let _default = tracing::subscriber::set_default(Shared(recorder.clone()));

    assert!(observed(&pool, &id).await.unwrap().is_processed());
    let statements = std::mem::take(&mut *recorder.statements.lock().unwrap());
    let statements: Vec<String> = statements.iter().map(|s| s.to_lowercase()).collect();
    // BEGIN (unlogged), the claim, the body, and the checked COMMIT in one round trip.
    assert_eq!(statements.len(), 3, "{statements:#?}");
    assert!(
        statements[0].starts_with("insert into processed_messages"),
        "{statements:#?}"
    );
    assert!(
        statements[1].starts_with("update processed_messages"),
        "{statements:#?}"
    );
    assert!(
        statements[2].starts_with("set local dedup.checked_commit"),
        "{statements:#?}"
    );

    assert!(observed(&pool, &id).await.unwrap().is_duplicate());
    let statements = std::mem::take(&mut *recorder.statements.lock().unwrap());
    let statements: Vec<String> = statements.iter().map(|s| s.to_lowercase()).collect();
    // A duplicate is BEGIN, the claim (no row affected) and the look at the row it found
    // (its state); its ROLLBACK is queued, unlogged, and sent before the connection's
    // next use, off the caller's path.
    assert_eq!(
        statements.len(),
        2,
        "a duplicate is BEGIN, the claim and the look: {statements:#?}"
    );
    assert!(
        statements[0].starts_with("insert into processed_messages"),
        "{statements:#?}"
    );
    assert!(
        statements[1].starts_with("select p.state"),
        "{statements:#?}"
    );
    let mut conn = pool.acquire().await.unwrap();
    assert!(!conn.is_in_transaction());
    // `SAVEPOINT` fails outside a transaction block (25P01).
    let open = sqlx::raw_sql("SAVEPOINT probe").execute(&mut *conn).await;
    assert!(
        open.is_err(),
        "no transaction is left open on the pooled connection"
    );
    drop(conn);

    let spans = recorder.spans.lock().unwrap();
    let calls: Vec<&BTreeMap<String, String>> = spans
        .values()
        .filter(|(name, _)| name == "idempotent")
        .map(|(_, fields)| fields)
        .collect();
    assert_eq!(calls.len(), 2, "one span per call: {spans:#?}");
    drop(pool);
    for (fields, outcome) in calls.iter().zip(["processed", "duplicate"]) {
        assert_eq!(fields["handler"], "observed");
        assert_eq!(fields["consumer"], "observed");
        assert_eq!(fields["message_id"], id);
        assert_eq!(fields["outcome"], outcome);
        assert_eq!(fields["attempts"], "1");
    }
}

/// The spans of one claim of the inbox's workers: per message (`process_batch`), one
/// `process` span each with the consumer group, the inbox table, the message's id and
/// attempt and the outcome; in batch mode (`process_batched`) one for the transaction,
/// with the count.
#[tokio::test(flavor = "current_thread")]
async fn inbox_workers_span_each_transaction_with_the_messaging_names() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use dedup_runtime::batch::BatchHandler;
    use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};

    struct Nothing;
    impl InboxHandler<sqlx::Sqlite> for Nothing {
        type Error = sqlx::Error;
        async fn handle(
            &self,
            _: &mut sqlx::SqliteConnection,
            _: &InboxMessage,
        ) -> Result<(), sqlx::Error> {
            Ok(())
        }
    }
    impl BatchHandler<sqlx::Sqlite, InboxMessage> for Nothing {
        type Error = sqlx::Error;
        async fn handle(
            &self,
            _: &mut sqlx::SqliteConnection,
            _: &[&InboxMessage],
        ) -> Result<(), sqlx::Error> {
            Ok(())
        }
    }

    let db = dedup_suite::sqlite().await;
    dedup_runtime::inbox::migrate(&*db).await.unwrap();
    let inbox = Inbox::new(&*db, "observed-inbox").unwrap();
    for id in ["a", "b", "c", "d"] {
        inbox.receive(Incoming::new(id, b"p")).await.unwrap();
    }
    let recorder = Arc::new(Recorder::default());
    let _default = tracing::subscriber::set_default(Shared(recorder.clone()));
    let worker = inbox.worker().batch(2);
    assert_eq!(worker.process_batch(&Nothing).await.unwrap().processed, 2);
    assert_eq!(worker.process_batched(&Nothing).await.unwrap().processed, 2);

    let spans = recorder.spans.lock().unwrap();
    let process: Vec<&BTreeMap<String, String>> = spans
        .values()
        .filter(|(name, _)| name == "process")
        .map(|(_, fields)| fields)
        .collect();
    assert_eq!(
        process.len(),
        3,
        "two messages alone, then one batch: {spans:#?}"
    );
    for (fields, id) in process[..2].iter().zip(["a", "b"]) {
        assert_eq!(fields["messaging.operation.type"], "process");
        assert_eq!(fields["messaging.consumer.group.name"], "observed-inbox");
        assert_eq!(fields["messaging.destination.name"], "inbox_messages");
        assert_eq!(fields["messaging.message.id"], id);
        assert_eq!(fields["messaging.batch.message_count"], "1");
        assert_eq!(fields["attempt"], "1");
        assert_eq!(fields["outcome"], "processed");
    }
    let batch = process[2];
    assert_eq!(batch["messaging.batch.message_count"], "2");
    assert!(!batch.contains_key("messaging.message.id"), "{batch:?}");
    assert_eq!(batch["outcome"], "processed");
}

/// The relay's span of one claim's sends: the publisher's `messaging.system`, the
/// destination, the count, and how many the broker took and refused.
#[tokio::test(flavor = "current_thread")]
async fn the_relay_spans_each_claim_with_the_messaging_names() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};

    /// Refuses the message whose payload is `no`.
    struct Picky;
    impl Publisher for Picky {
        type Error = String;
        const SYSTEM: &'static str = "test-broker";
        async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
            if message.payload() == b"no" {
                Err("refused".to_owned())
            } else {
                Ok(())
            }
        }
    }

    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("observed-relay", "in-1").unwrap();
    let mut tx = db.begin().await.unwrap();
    for (index, payload) in [&b"yes"[..], b"no", b"yes"].into_iter().enumerate() {
        let message = cause.nth_outgoing(index as u32, "orders", payload);
        outbox.enqueue(&mut *tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let recorder = Arc::new(Recorder::default());
    let _default = tracing::subscriber::set_default(Shared(recorder.clone()));
    let relayed = outbox.relay(&*db).relay_batch(&Picky).await.unwrap();
    assert_eq!((relayed.sent, relayed.failed), (2, 1));

    let spans = recorder.spans.lock().unwrap();
    let sends: Vec<&BTreeMap<String, String>> = spans
        .values()
        .filter(|(name, _)| name == "send")
        .map(|(_, fields)| fields)
        .collect();
    assert_eq!(sends.len(), 1, "one span per claim: {spans:#?}");
    let send = sends[0];
    assert_eq!(send["messaging.system"], "test-broker");
    assert_eq!(send["messaging.operation.type"], "send");
    assert_eq!(send["messaging.destination.name"], "orders");
    assert_eq!(send["messaging.batch.message_count"], "3");
    assert_eq!((send["sent"].as_str(), send["failed"].as_str()), ("2", "1"));
    assert!(
        !send.contains_key("traceparent"),
        "no message carried a trace context: {send:#?}"
    );
}

/// The relay's span carries the trace context its messages were enqueued under when they
/// share one, and none when they differ (one span per claim cannot have two parents).
#[tokio::test(flavor = "current_thread")]
async fn the_relay_span_carries_the_shared_trace_context() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};

    struct Taker;
    impl Publisher for Taker {
        type Error = String;
        async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
            Ok(())
        }
    }

    const ONE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const OTHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let recorder = Arc::new(Recorder::default());
    // Two claims: two messages of one handler's trace, then two of two traces.
    for (round, parents) in [[ONE, ONE], [ONE, OTHER]].into_iter().enumerate() {
        let cause = Cause::new("traced-relay", format!("in-{round}")).unwrap();
        let mut tx = db.begin().await.unwrap();
        for (index, parent) in parents.into_iter().enumerate() {
            let message = cause
                .nth_outgoing(index as u32, "orders", b"x")
                .traceparent(parent);
            outbox.enqueue(&mut *tx, &message).await.unwrap();
        }
        tx.commit().await.unwrap();
        let _default = tracing::subscriber::set_default(Shared(recorder.clone()));
        let relayed = outbox.relay(&*db).relay_batch(&Taker).await.unwrap();
        assert_eq!(relayed.sent, 2);
    }
    let spans = recorder.spans.lock().unwrap();
    let mut sends: Vec<(u64, Option<&str>)> = spans
        .iter()
        .filter(|(_, (name, _))| name == "send")
        .map(|(id, (_, fields))| (*id, fields.get("traceparent").map(String::as_str)))
        .collect();
    sends.sort();
    assert_eq!(
        sends.iter().map(|(_, parent)| *parent).collect::<Vec<_>>(),
        [Some(ONE), None],
        "{spans:#?}"
    );
}
