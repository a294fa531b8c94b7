//! An outgoing message's headers end to end: enqueued with `Outgoing::header`, sent by the
//! crate's publisher as the broker's own headers, given back by the crate's hosted
//! consumer to its handler — on RabbitMQ, NATS JetStream, Kafka, Redis Streams and MQTT 5
//! (user properties), each checked in what the handler saw (with the outgoing id as the
//! message's id). Where the broker's headers are text (NATS, MQTT), a value that is not
//! fails its row, which stays unsent with the reason as its last error.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::outbox::{Cause, Outbox, OutgoingId, Publisher};

use super::common::until;

/// What a handler saw: the message's id, and its headers but the publishers' own.
type Seen = Arc<Mutex<Vec<(String, Vec<(String, Vec<u8>)>)>>>;

/// The publishers' own headers, and the brokers' (NATS' `Nats-Msg-Id` is the id's copy).
fn own(name: &str) -> bool {
    [
        "id",
        "message-id",
        "nats-msg-id",
        "traceparent",
        "x-delivery-count",
    ]
    .iter()
    .any(|own| own.eq_ignore_ascii_case(name))
}

/// A handler that records what it is given.
fn recording(
    seen: &Seen,
) -> impl Fn(
    sqlx::SqlitePool,
    Arc<Message>,
) -> std::future::Ready<Result<dedup_runtime::Outcome<()>, sqlx::Error>>
+ Send
+ Sync
+ use<> {
    let seen = seen.clone();
    move |_, msg| {
        let headers = msg
            .headers()
            .filter(|(name, _)| !own(name))
            .map(|(name, value)| (name.to_owned(), value.to_vec()))
            .collect();
        seen.lock().unwrap().push((msg.id().to_owned(), headers));
        std::future::ready(Ok(dedup_runtime::Outcome::Processed(())))
    }
}

/// An outbox on SQLite holding one message to `destination` with `headers`; relayed
/// once through `publisher`. Its id, and the database (kept for the caller's checks).
async fn relayed(
    destination: &str,
    headers: &[(&str, &[u8])],
    publisher: &impl Publisher,
) -> (OutgoingId, dedup_suite::TempSqlite) {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("headers", dedup_suite::unique("evt")).unwrap();
    let mut message = cause.outgoing("event", destination, b"body").unwrap();
    for (name, value) in headers {
        message = message.header(name, value);
    }
    let mut tx = db.begin().await.unwrap();
    outbox.enqueue(&mut *tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    let _ = outbox.relay(&*db).relay_batch(publisher).await.unwrap();
    (message.id(), db)
}

fn pairs(headers: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(name, value)| ((*name).to_owned(), value.to_vec()))
        .collect()
}

/// Bytes as they are: a NUL, a 0xff, a line break.
const RAW: &[u8] = b"\x00\xff\nbytes";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_carries_the_headers_to_the_handler() {
    use dedup_runtime::lapin::{RabbitMqConsumer, RabbitMqPublisher};
    use lapin::ConnectionProperties;

    let channel = super::rabbitmq::channel().await;
    let queue = dedup_suite::unique("headers");
    dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
    let amqp = super::rabbitmq::AMQP;
    let publisher = RabbitMqPublisher::connect(amqp, ConnectionProperties::default(), "")
        .await
        .unwrap();
    let headers: [(&str, &[u8]); 2] = [("tenant", b"acme"), ("raw", RAW)];
    let (id, _db) = relayed(&queue, &headers, &publisher).await;

    let pool = dedup_suite::sqlite().await;
    let seen = Seen::default();
    let done = until(|| async { !seen.lock().unwrap().is_empty() });
    RabbitMqConsumer::new(amqp, ConnectionProperties::default(), &queue)
        .run(&*pool, recording(&seen), done)
        .await
        .unwrap();
    let mut got = seen.lock().unwrap().clone();
    // An AMQP table is sorted by name.
    got[0].1.sort();
    let mut expected = pairs(&headers);
    expected.sort();
    assert_eq!(got, [(id.to_string(), expected)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_carries_the_headers_to_the_handler_and_refuses_bytes_it_cannot() {
    use dedup_runtime::async_nats::{JetStreamConsumer, JetStreamPublisher};

    let js = super::nats::context().await;
    let (stream, subject) = super::nats::stream(&js, "headers", Duration::from_secs(5)).await;
    let publisher = JetStreamPublisher::new(js.clone());
    let headers: [(&str, &[u8]); 3] = [("tenant", b"acme"), ("tenant", b"again"), ("k", b"v")];
    let (id, _db) = relayed(&subject, &headers, &publisher).await;
    // Bytes NATS headers cannot hold: the row is not sent, and says why.
    let (refused, db) = relayed(&subject, &[("raw", RAW)], &publisher).await;
    let (state, error): (i64, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM outbox_messages WHERE id = ?1")
            .bind(&refused.as_uuid().as_bytes()[..])
            .fetch_one(&*db)
            .await
            .unwrap();
    assert_eq!(state, 0, "unsent, to be tried again");
    let error = error.unwrap_or_default();
    assert!(error.contains("not a NATS header value"), "{error}");

    let pool = dedup_suite::sqlite().await;
    let seen = Seen::default();
    let done = until(|| async { !seen.lock().unwrap().is_empty() });
    JetStreamConsumer::new(js.clone(), &stream, "worker")
        .run(&*pool, recording(&seen), done)
        .await
        .unwrap();
    let got = seen.lock().unwrap().clone();
    let mut expected = pairs(&headers);
    let mut received = got[0].1.clone();
    // A NATS header map keeps each name's values in order, names in its own order.
    received.sort();
    expected.sort();
    assert_eq!(got.len(), 1, "only the sendable one: {got:?}");
    assert_eq!((got[0].0.clone(), received), (id.to_string(), expected));
    let _ = js.delete_stream(&stream).await;
    let _ = js.delete_stream(format!("{stream}_DEAD")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_carries_the_headers_to_the_handler_in_order() {
    use dedup_runtime::rdkafka::{KafkaConsumer, KafkaPublisher};

    let topic = dedup_suite::unique("headers");
    super::kafka::topic(&topic, 1).await;
    let publisher = KafkaPublisher::new(super::kafka::client()).unwrap();
    let headers: [(&str, &[u8]); 3] = [("tenant", b"acme"), ("raw", RAW), ("tenant", b"again")];
    let (id, _db) = relayed(&topic, &headers, &publisher).await;

    let pool = dedup_suite::sqlite().await;
    let seen = Seen::default();
    let done = until(|| async { !seen.lock().unwrap().is_empty() });
    let group = dedup_suite::unique("group");
    KafkaConsumer::new(super::kafka::member(&group), &topic)
        .run(&*pool, recording(&seen), done)
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [(id.to_string(), pairs(&headers))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_carries_the_headers_to_the_handler_in_order() {
    use dedup_runtime::redis::{RedisStreamsConsumer, RedisStreamsPublisher};

    let stream = dedup_suite::unique("headers");
    let mut redis = super::redis::connection().await;
    super::redis::create_group(&mut redis, &stream, "g").await;
    let publisher = RedisStreamsPublisher::new(super::redis::client());
    let headers: [(&str, &[u8]); 3] = [("tenant", b"acme"), ("raw", RAW), ("tenant", b"again")];
    let (id, _db) = relayed(&stream, &headers, &publisher).await;

    let pool = dedup_suite::sqlite().await;
    let seen = Seen::default();
    let done = until(|| async { !seen.lock().unwrap().is_empty() });
    RedisStreamsConsumer::new(super::redis::client(), &stream, "g", "m")
        .run(&*pool, recording(&seen), done)
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [(id.to_string(), pairs(&headers))]);
    super::redis::delete(&mut redis, &stream).await;
}

/// The last error and state of the outbox row `id` in `db`.
async fn row(db: &sqlx::SqlitePool, id: OutgoingId) -> (i64, String) {
    let (state, error): (i64, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM outbox_messages WHERE id = ?1")
            .bind(&id.as_uuid().as_bytes()[..])
            .fetch_one(db)
            .await
            .unwrap();
    (state, error.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_carries_the_headers_as_user_properties_and_refuses_bytes_it_cannot() {
    use dedup_runtime::rumqttc::{MqttConsumer, MqttPublisher};
    use dedup_suite::mosquitto::Mosquitto;
    use rumqttc::v5::MqttOptions;

    let broker = Mosquitto::start(&dedup_suite::unique("headers-mqtt"), "");
    let topic = format!("headers/{}", dedup_suite::unique("topic"));
    let client_id = dedup_suite::unique("consumer");
    super::mqtt::session(broker.port(), &client_id, &topic).await;
    let options = MqttOptions::new(dedup_suite::unique("relay"), "127.0.0.1", broker.port());
    let publisher = MqttPublisher::new(options);
    let headers: [(&str, &[u8]); 3] = [("tenant", b"acme"), ("k", b"v"), ("tenant", b"again")];
    let (id, db) = relayed(&topic, &headers, &publisher).await;
    assert_eq!(row(&db, id).await.0, 2, "sent");
    // Bytes a user property cannot hold: the row is not sent, and says why.
    let (refused, db) = relayed(&topic, &[("raw", RAW)], &publisher).await;
    let (state, error) = row(&db, refused).await;
    assert_eq!(state, 0, "unsent, to be tried again");
    assert!(
        error.contains("not an MQTT user property's value"),
        "{error}"
    );

    let pool = dedup_suite::sqlite().await;
    let seen = Seen::default();
    let done = until(|| async { !seen.lock().unwrap().is_empty() });
    let options = MqttOptions::new(&client_id, "127.0.0.1", broker.port());
    MqttConsumer::new(options, &topic)
        .run(&*pool, recording(&seen), async {
            done.await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        })
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [(id.to_string(), pairs(&headers))]);
}
