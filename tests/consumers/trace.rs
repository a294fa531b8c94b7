//! One OpenTelemetry trace from a producer through a hosted consumer's handler, its
//! outbox event, the relay and the next hosted consumer: the consumers' `trace_parent`
//! hook parents each `process` span on the `traceparent` the message carries, and the
//! outbox's `trace_context` hook gives the event the handler's own. Spans exported to
//! memory (opentelemetry_sdk's in-memory exporter, through tracing-opentelemetry); Kafka
//! for both hops, SQLite for the handler's database.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::rdkafka::{KafkaConsumer, KafkaPublisher};
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

use super::common::{count, until};
use super::kafka::{brokers, client, member, topic};

/// The consumers' hook: the span's parent from the message's `traceparent`.
fn parent(span: &tracing::Span, msg: &Message) {
    let carrier: HashMap<String, String> = msg
        .headers()
        .filter_map(|(name, value)| {
            Some((name.to_lowercase(), String::from_utf8(value.to_vec()).ok()?))
        })
        .collect();
    let _ = span.set_parent(TraceContextPropagator::new().extract(&carrier));
}

/// The outbox's hook: the current span's context as a `traceparent`.
fn current_traceparent() -> Option<String> {
    let mut carrier = HashMap::new();
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    carrier.remove("traceparent")
}

#[dedup_runtime::idempotent(consumer = "trace-first", key = msg.id())]
async fn forward(
    tx: &mut sqlx::SqliteConnection,
    msg: &Message,
    to: &(Outbox, String),
) -> Result<(), sqlx::Error> {
    let cause = Cause::new("trace-first", msg.id())?;
    to.0.enqueue(&mut *tx, &cause.outgoing("event", &to.1, msg.payload())?)
        .await?;
    Ok(())
}

#[dedup_runtime::idempotent(consumer = "trace-second", key = msg.id())]
async fn record(tx: &mut sqlx::SqliteConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO trace_effects (message_id) VALUES (?1)")
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// Spans of this thread exported to memory: the exporter, its provider, and the guard
/// that keeps the subscriber installed.
fn spans_to_memory() -> (
    InMemorySpanExporter,
    SdkTracerProvider,
    tracing::subscriber::DefaultGuard,
) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("dedup-test")));
    let installed = tracing::subscriber::set_default(subscriber);
    (exporter, provider, installed)
}

/// Completes once the last handler recorded its message.
async fn recorded(db: &sqlx::SqlitePool) {
    until(|| async {
        count(
            db,
            "SELECT COUNT(*) FROM trace_effects WHERE message_id <> ?1",
            "",
        )
        .await
            >= 1
    })
    .await;
}

/// The exported span `name` whose attribute `key` is `value`.
fn find(spans: &[SpanData], name: &str, key: &str, value: &str) -> SpanData {
    spans
        .iter()
        .find(|span| span.name == name && attribute(span, key).as_deref() == Some(value))
        .cloned()
        .unwrap_or_else(|| panic!("no span {name} with {key} = {value}"))
}

#[tokio::test]
async fn one_trace_runs_from_the_producer_through_the_outbox_to_the_next_consumer() {
    let (exporter, provider, _installed) = spans_to_memory();

    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    dedup_runtime::outbox::migrate_table(&*pool, "trace_outbox")
        .await
        .unwrap();
    dedup_suite::ddl(
        &*pool,
        "CREATE TABLE IF NOT EXISTS trace_effects (message_id TEXT NOT NULL)",
    )
    .await;
    let (first, second) = (
        dedup_suite::unique("trace-first"),
        dedup_suite::unique("trace-second"),
    );
    topic(&first, 1).await;
    topic(&second, 1).await;

    // The producer's context: a trace of its own.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let producer_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{producer_span}-01");
    let id = dedup_suite::unique("order");
    let producer: FutureProducer = client().create().unwrap();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "id",
            value: Some(&id),
        })
        .insert(Header {
            key: "traceparent",
            value: Some(&traceparent),
        });
    producer
        .send(
            FutureRecord::<str, str>::to(&first)
                .payload("body")
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .unwrap();

    let outbox = Outbox::new()
        .in_table("trace_outbox")
        .unwrap()
        .trace_context(current_traceparent);
    let to = Arc::new((outbox.clone(), second.clone()));
    let publisher = KafkaPublisher::new(KafkaPublisher::producer_config(&brokers())).unwrap();
    let db: &sqlx::SqlitePool = &pool;
    let done = || recorded(db);
    let first_consumer =
        KafkaConsumer::new(member(&dedup_suite::unique("g1")), &first).trace_parent(parent);
    let second_consumer =
        KafkaConsumer::new(member(&dedup_suite::unique("g2")), &second).trace_parent(parent);
    let relay = outbox.relay(db);
    let (a, b, r) = tokio::join!(
        first_consumer.run(
            db,
            move |pool, msg| {
                let to = to.clone();
                async move { forward(&pool, &msg, &to).await }
            },
            done()
        ),
        second_consumer.run(
            db,
            |pool, msg| async move { record(&pool, &msg).await },
            done()
        ),
        relay.run(&publisher, done()),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    r.unwrap();
    assert_eq!((a.acknowledged, b.acknowledged), (1, 1), "{a:?} {b:?}");

    // Each handler's span (`idempotent`) and the relay's (`send`), as exported.
    let spans = exporter.get_finished_spans().unwrap();
    let span = |name: &str, key: &str, value: &str| find(&spans, name, key, value);
    let forwarded = span("idempotent", "handler", "forward");
    let sent = span("send", "messaging.destination.name", &second);
    let recorded = span("idempotent", "handler", "record");
    assert_eq!(
        forwarded.span_context.trace_id().to_string(),
        trace_id,
        "the first handler: in the producer's trace (its consumer span parented by it)"
    );
    assert_ne!(
        forwarded.parent_span_id.to_string(),
        producer_span,
        "under its consumer's span, not directly under the producer's"
    );
    let relayed = attribute(&sent, "traceparent").expect("the relay sent a traceparent");
    assert!(
        relayed.starts_with(&format!("00-{trace_id}-")),
        "the event carries the handler's trace: {relayed}"
    );
    assert_eq!(
        recorded.span_context.trace_id().to_string(),
        trace_id,
        "the next handler: still the producer's trace, through the outbox and the relay"
    );
    let _ = provider.shutdown();
}

/// HTTP idempotency keys, one trace end to end: a request with a `traceparent` and an
/// `Idempotency-Key`, its handler's span parented on the request's context (the
/// application's code, below), the outbox event whose id derives from the key, the
/// relay, and the consumer downstream — all in the request's trace.
#[cfg(feature = "http")]
mod http {
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::Response;
    use dedup_runtime::http::{HttpError, IdempotencyLayer, IdempotentRequest, StoredResponse};
    use tracing::Instrument as _;

    use super::*;

    type To = Arc<(sqlx::SqlitePool, Outbox, String)>;

    #[dedup_runtime::idempotent(
        consumer = "trace-http",
        key = req.id(),
        fingerprint = req,
        result = "stored"
    )]
    async fn accept(
        tx: &mut sqlx::SqliteConnection,
        req: &IdempotentRequest,
        to: &To,
    ) -> Result<StoredResponse, HttpError> {
        let cause = Cause::new("trace-http", req.id())?;
        to.1.enqueue(&mut *tx, &cause.outgoing("event", &to.2, req.body())?)
            .await?;
        Ok(StoredResponse::new(StatusCode::ACCEPTED))
    }

    /// The application's handler: its request span parented on the request's
    /// `traceparent`, the idempotent handler under it.
    async fn endpoint(
        State(to): State<To>,
        headers: HeaderMap,
        req: IdempotentRequest,
    ) -> Response {
        let carrier: HashMap<String, String> = headers
            .iter()
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect();
        let span = tracing::info_span!("http.request");
        let _ = span.set_parent(TraceContextPropagator::new().extract(&carrier));
        req.answer(accept(&to.0, &req, &to).instrument(span).await)
    }

    #[tokio::test]
    async fn one_trace_runs_from_the_request_through_the_outbox_to_the_consumer() {
        let (exporter, provider, _installed) = spans_to_memory();

        let pool = dedup_suite::sqlite().await;
        dedup_runtime::outbox::migrate_table(&*pool, "trace_http_outbox")
            .await
            .unwrap();
        dedup_suite::ddl(
            &*pool,
            "CREATE TABLE IF NOT EXISTS trace_effects (message_id TEXT NOT NULL)",
        )
        .await;
        let events = dedup_suite::unique("trace-http-events");
        topic(&events, 1).await;
        let outbox = Outbox::new()
            .in_table("trace_http_outbox")
            .unwrap()
            .trace_context(current_traceparent);
        let to: To = Arc::new((pool.pool.clone(), outbox.clone(), events.clone()));
        let router = axum::Router::new()
            .route("/payments", axum::routing::post(endpoint))
            .layer(IdempotencyLayer::new())
            .with_state(to);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });

        // The client's context: a trace of its own.
        let trace_id = "0af7651916cd43dd8448eb211c80319c";
        let client_span = "b7ad6b7169203331";
        let key = dedup_suite::unique("pay");
        let answer = reqwest::Client::new()
            .post(format!("http://{address}/payments"))
            .header("idempotency-key", format!("\"{key}\""))
            .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
            .body("10 EUR")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), 202);

        let publisher = KafkaPublisher::new(KafkaPublisher::producer_config(&brokers())).unwrap();
        let db: &sqlx::SqlitePool = &pool;
        let done = || recorded(db);
        let consumer =
            KafkaConsumer::new(member(&dedup_suite::unique("g3")), &events).trace_parent(parent);
        let relay = outbox.relay(db);
        let (consumed, relayed) = tokio::join!(
            consumer.run(
                db,
                |pool, msg| async move { record(&pool, &msg).await },
                done()
            ),
            relay.run(&publisher, done()),
        );
        relayed.unwrap();
        assert_eq!(consumed.unwrap().acknowledged, 1);
        let event_id = Cause::new("trace-http", key.as_str())
            .unwrap()
            .id("event")
            .unwrap()
            .to_string();
        assert_eq!(
            count(
                db,
                "SELECT COUNT(*) FROM trace_effects WHERE message_id = ?1",
                &event_id
            )
            .await,
            1
        );

        let spans = exporter.get_finished_spans().unwrap();
        let span = |name: &str, key: &str, value: &str| find(&spans, name, key, value);
        let accepted = span("idempotent", "handler", "accept");
        let sent = span("send", "messaging.destination.name", &events);
        let recorded = span("idempotent", "handler", "record");
        assert_eq!(
            accepted.span_context.trace_id().to_string(),
            trace_id,
            "the HTTP handler: in the client's trace"
        );
        let relayed = attribute(&sent, "traceparent").expect("the relay sent a traceparent");
        assert!(
            relayed.starts_with(&format!("00-{trace_id}-")),
            "the event carries the request's trace: {relayed}"
        );
        assert_eq!(
            recorded.span_context.trace_id().to_string(),
            trace_id,
            "the consumer downstream: still the client's trace"
        );
        let _ = provider.shutdown();
    }
}
