//! The outbox's publishers against the real brokers: the relay sends each row to
//! RabbitMQ (publisher confirms, the outgoing id as the AMQP `message-id`) and to NATS
//! JetStream (the id as `Message-Id` and `Nats-Msg-Id`), to Kafka (tansu; the id in the
//! header `id`, the ordering key as the record key), to Redis Streams (the fields `id`
//! and `body`) and to MQTT 5 (a Mosquitto of the test's own; QoS 1, the id as the user property
//! `message-id`), and the broker has each message byte for byte (and the first one's trace
//! context as its `traceparent` header, or field),
//! once; an unroutable message is a failed send, retried, never a silent loss; a re-send
//! of a row JetStream already has is dropped by JetStream's duplicate window. The relay
//! runs on SQLite here (its backends are tested in `tests/suite/outbox/`).

use std::time::{Duration, Instant};

use dedup_runtime::outbox::{Cause, Outbox, OutgoingId};

const PATIENCE: Duration = Duration::from_secs(15);

/// The trace context of the first message [`outbox_with`] enqueues (the others have none):
/// each publisher sends it as the broker's `traceparent` header (Redis: a field).
const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A fresh SQLite outbox holding one message per payload to `destination`.
async fn outbox_with(
    destination: &str,
    payloads: &[&[u8]],
) -> (dedup_suite::TempSqlite, Outbox, Vec<OutgoingId>) {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("outbox-brokers", dedup_suite::unique("evt")).unwrap();
    let mut tx = db.begin().await.unwrap();
    let mut ids = Vec::new();
    for (index, payload) in payloads.iter().enumerate() {
        let mut message = cause.nth_outgoing(index as u32, destination, payload);
        if index == 0 {
            message = message.traceparent(TRACE);
        }
        outbox.enqueue(&mut *tx, &message).await.unwrap();
        ids.push(message.id());
    }
    tx.commit().await.unwrap();
    (db, outbox, ids)
}

/// The row's state and last error.
async fn state(db: &sqlx::SqlitePool, id: OutgoingId) -> (i64, Option<String>) {
    sqlx::query_as("SELECT state, last_error FROM outbox_messages WHERE id = ?1")
        .bind(&id.as_uuid().as_bytes()[..])
        .fetch_one(db)
        .await
        .unwrap()
}

mod rabbitmq {
    use super::*;
    use dedup_runtime::lapin::RabbitMqPublisher;
    use lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
    use lapin::{Connection, ConnectionProperties};

    fn amqp_url() -> String {
        std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
    }

    async fn connect() -> Connection {
        let url = amqp_url();
        Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                     -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
                )
            })
    }

    #[tokio::test]
    async fn the_relay_publishes_with_confirms_and_the_id_as_message_id() {
        let connection = connect().await;
        let setup = connection.create_channel().await.unwrap();
        let queue = dedup_suite::unique("outbox-relay");
        dedup_suite::rabbitmq::declare(&setup, &queue, false).await;
        let payloads: [&[u8]; 3] = [b"first", b"\x00\xff binary", br#"{"json": true}"#];
        let (db, outbox, ids) = outbox_with(&queue, &payloads).await;
        let publisher =
            RabbitMqPublisher::connect(&amqp_url(), ConnectionProperties::default(), "")
                .await
                .unwrap();
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (3, 3), "{relayed:?}");

        let mut received = Vec::new();
        let deadline = Instant::now() + PATIENCE;
        while received.len() < 3 {
            let got = setup
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            match got {
                Some(message) => received.push((
                    message
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string()),
                    message.delivery.data.clone(),
                    message
                        .delivery
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|headers| headers.inner().get("traceparent").cloned())
                        .and_then(|value| match value {
                            lapin::types::AMQPValue::LongString(text) => Some(text.to_string()),
                            _ => None,
                        }),
                )),
                None => {
                    assert!(Instant::now() < deadline, "only {received:?} on {queue}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let expected: Vec<_> = ids
            .iter()
            .zip(payloads)
            .enumerate()
            .map(|(n, (id, payload))| {
                let trace = (n == 0).then(|| TRACE.to_owned());
                (Some(id.to_string()), payload.to_vec(), trace)
            })
            .collect();
        assert_eq!(
            received, expected,
            "each once, in order, byte for byte, the first with its traceparent header"
        );
        for id in &ids {
            assert_eq!(state(&db, *id).await, (2, None), "marked sent");
        }
        for doomed in [queue.clone(), format!("{queue}.dead")] {
            setup
                .queue_delete(doomed.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        setup
            .exchange_delete(
                format!("{queue}.dlx").as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .unwrap();
    }

    /// The relay as a command (`examples/outbox_relay.rs`), a process of its own on the
    /// outbox's database file: it sends the rows, then exits once idle.
    #[tokio::test]
    async fn the_relay_command_publishes_the_rows_and_exits_when_idle() {
        let connection = connect().await;
        let setup = connection.create_channel().await.unwrap();
        let queue = dedup_suite::unique("outbox-command");
        dedup_suite::rabbitmq::declare(&setup, &queue, false).await;
        let (db, _outbox, ids) = outbox_with(&queue, &[b"a", b"b"]).await;
        let program = tokio::task::spawn_blocking(|| {
            dedup_suite::example_binary("brokers", &["outbox_relay"], "outbox_relay")
        })
        .await
        .unwrap();
        let output = tokio::process::Command::new(program)
            .env("DATABASE_URL", format!("sqlite:{}", db.path().display()))
            .env(
                "DEDUP_AMQP_URL",
                std::env::var("DEDUP_TEST_AMQP_URL")
                    .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()),
            )
            .env_remove("DEDUP_NATS_URL")
            .env("DEDUP_EXIT_WHEN_IDLE_MS", "300")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            stdout.contains("relayed 2 sent 2 lost 0 failed 0 dead 0"),
            "{stdout}"
        );
        assert!(stdout.trim_end().ends_with("idle"), "{stdout}");
        let mut received = Vec::new();
        let deadline = Instant::now() + PATIENCE;
        while received.len() < 2 {
            match setup
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                Some(message) => received.push(
                    message
                        .delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string()),
                ),
                None => {
                    assert!(Instant::now() < deadline, "only {received:?} on {queue}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let expected: Vec<_> = ids.iter().map(|id| Some(id.to_string())).collect();
        assert_eq!(received, expected);
        for doomed in [queue.clone(), format!("{queue}.dead")] {
            setup
                .queue_delete(doomed.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        setup
            .exchange_delete(
                format!("{queue}.dlx").as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await
            .unwrap();
    }

    /// The relay sends a claim together: every message out, then the confirms. A queue
    /// that refuses what is over its length (`x-overflow = reject-publish`) nacks the
    /// third of three: that row fails alone (unsent, its error kept), the two the broker
    /// has are marked sent.
    #[tokio::test]
    async fn a_nack_in_a_batch_fails_that_row_only() {
        use lapin::options::QueueDeclareOptions;
        use lapin::types::{AMQPValue, FieldTable};

        let connection = connect().await;
        let setup = connection.create_channel().await.unwrap();
        let queue = dedup_suite::unique("outbox-full");
        let mut arguments = FieldTable::default();
        arguments.insert("x-max-length".into(), AMQPValue::LongInt(2));
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        setup
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await
            .unwrap();
        let (db, outbox, ids) = outbox_with(&queue, &[b"one", b"two", b"three"]).await;
        let publisher =
            RabbitMqPublisher::connect(&amqp_url(), ConnectionProperties::default(), "")
                .await
                .unwrap();
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!(
            (relayed.claimed, relayed.sent, relayed.failed),
            (3, 2, 1),
            "{relayed:?}"
        );
        assert_eq!(state(&db, ids[0]).await, (2, None));
        assert_eq!(state(&db, ids[1]).await, (2, None));
        let (row_state, last_error) = state(&db, ids[2]).await;
        assert_eq!(row_state, 0, "unsent, for another attempt");
        assert!(
            last_error.unwrap().contains("nack"),
            "the broker's answer kept"
        );
        setup
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }

    /// A message nothing routes (no such queue) comes back to the publisher: a failed
    /// send, kept and retried, never marked sent.
    #[tokio::test]
    async fn an_unroutable_message_is_a_failed_send_not_a_loss() {
        let missing = dedup_suite::unique("outbox-nowhere");
        let (db, outbox, ids) = outbox_with(&missing, &[b"lost?"]).await;
        let publisher =
            RabbitMqPublisher::connect(&amqp_url(), ConnectionProperties::default(), "")
                .await
                .unwrap();
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.sent, relayed.failed), (0, 1), "{relayed:?}");
        let (row_state, last_error) = state(&db, ids[0]).await;
        assert_eq!(row_state, 0, "unsent, for another attempt");
        assert!(
            last_error.unwrap().contains("nothing routed it"),
            "the broker's answer kept"
        );
    }
}

mod jetstream {
    use super::*;
    use async_nats::jetstream;
    use dedup_runtime::async_nats::JetStreamPublisher;

    #[tokio::test]
    async fn the_relay_publishes_with_the_id_in_message_id_and_nats_msg_id_and_jetstream_drops_a_resend()
     {
        let url = std::env::var("DEDUP_TEST_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
            panic!(
                "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
                 .ci/run) or set DEDUP_TEST_NATS_URL"
            )
        });
        let context = jetstream::new(client);
        let run = dedup_suite::unique("outbox").replace('-', "_");
        let (name, subject) = (format!("OUTBOX_{run}"), format!("outbox.{run}"));
        let (stream, _dead) =
            dedup_suite::jetstream::streams(&context, &url, &name, &subject).await;
        let payloads: [&[u8]; 2] = [b"one", b"\x00two"];
        let (db, outbox, ids) = outbox_with(&subject, &payloads).await;
        let publisher = JetStreamPublisher::new(context.clone());
        let relay = outbox.relay(&*db);
        let relayed = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (2, 2), "{relayed:?}");
        for (sequence, (id, payload)) in (1..).zip(ids.iter().zip(payloads)) {
            let message = stream.get_raw_message(sequence).await.unwrap();
            assert_eq!(&message.payload[..], payload);
            for header in ["Message-Id", "Nats-Msg-Id"] {
                assert_eq!(
                    message.headers.get(header).map(|id| id.as_str()),
                    Some(id.to_string().as_str()),
                    "{header}"
                );
            }
            assert_eq!(
                message
                    .headers
                    .get("traceparent")
                    .map(|value| value.as_str()),
                (sequence == 1).then_some(TRACE),
                "the first message's trace context, and no other's"
            );
        }

        // A relay that stopped after its send and before its mark: the row is sent again,
        // with the same id, and JetStream's duplicate window drops the copy.
        sqlx::query("UPDATE outbox_messages SET state = 0 WHERE id = ?1")
            .bind(&ids[0].as_uuid().as_bytes()[..])
            .execute(&*db)
            .await
            .unwrap();
        let again = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!(again.sent, 1, "sent again");
        let mut stream = stream;
        let info = stream.info().await.unwrap();
        assert_eq!(info.state.messages, 2, "the stream kept one copy of each");
        context.delete_stream(&name).await.unwrap();
        context.delete_stream(format!("{name}_DEAD")).await.unwrap();
    }
}

mod kafka {
    use super::*;
    use dedup_runtime::rdkafka::KafkaPublisher;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};

    fn brokers() -> String {
        std::env::var("DEDUP_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".to_owned())
    }

    /// The relay publishes a claim to Kafka through the idempotent producer of
    /// `KafkaPublisher::producer_config`: each record once, the outgoing id in the header
    /// `id`, the ordering key as the record key, the rows marked sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relay_publishes_with_the_id_in_the_id_header() {
        let topic = dedup_suite::unique("outbox-kafka");
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .unwrap();
        admin
            .create_topics(
                &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "the Kafka-protocol broker is not reachable at {}: {error}. Start it \
                     (`bash .ci/run` starts tansu on 127.0.0.1:19092) or set \
                     DEDUP_TEST_KAFKA_BROKERS",
                    brokers()
                )
            });
        let db = dedup_suite::sqlite().await;
        dedup_runtime::outbox::migrate(&*db).await.unwrap();
        let outbox = Outbox::new();
        let cause = Cause::new("outbox-kafka", dedup_suite::unique("evt")).unwrap();
        let mut tx = db.begin().await.unwrap();
        let mut ids = Vec::new();
        for (slot, payload) in [&b"first"[..], b"\x00\xff", b"third"].iter().enumerate() {
            let mut message = cause.nth_outgoing(slot as u32, &topic, payload);
            if slot == 1 {
                message = message.ordering_key("order-7").traceparent(TRACE);
            }
            outbox.enqueue(&mut *tx, &message).await.unwrap();
            ids.push(message.id());
        }
        tx.commit().await.unwrap();
        let publisher = KafkaPublisher::new(KafkaPublisher::producer_config(&brokers())).unwrap();
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (3, 3), "{relayed:?}");
        for id in &ids {
            assert_eq!(state(&db, *id).await, (2, None), "marked sent");
        }

        let consumer: StreamConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", dedup_suite::unique("outbox-kafka-check"))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        // The partition itself from its start: no group rebalance to wait for.
        let mut partitions = rdkafka::TopicPartitionList::new();
        partitions
            .add_partition_offset(&topic, 0, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&partitions).unwrap();
        let mut received = Vec::new();
        while received.len() < 3 {
            let message = tokio::time::timeout(PATIENCE, consumer.recv())
                .await
                .unwrap_or_else(|_| panic!("only {received:?} on {topic}"))
                .unwrap();
            let header = |name: &str| {
                message
                    .headers()
                    .and_then(|headers| headers.iter().find(|header| header.key == name))
                    .and_then(|header| header.value)
                    .map(|value| String::from_utf8(value.to_vec()).unwrap())
            };
            received.push((
                header("id"),
                message.key().map(<[u8]>::to_vec),
                message.payload().unwrap_or_default().to_vec(),
                header("traceparent"),
            ));
        }
        let expected = vec![
            (Some(ids[0].to_string()), None, b"first".to_vec(), None),
            (
                Some(ids[1].to_string()),
                Some(b"order-7".to_vec()),
                b"\x00\xff".to_vec(),
                Some(TRACE.to_owned()),
            ),
            (Some(ids[2].to_string()), None, b"third".to_vec(), None),
        ];
        assert_eq!(received, expected, "each once, in order, byte for byte");
    }
}

mod redis_streams {
    use super::*;
    use dedup_runtime::redis::RedisStreamsPublisher;
    use redis::Value;

    /// An entry's fields, name and bytes, in order.
    type Fields = Vec<(String, Vec<u8>)>;

    /// The relay publishes a claim to a Redis stream in one pipeline: each row one entry,
    /// the outgoing id in the field `id`, the payload in `body`, in order; the rows marked
    /// sent.
    #[tokio::test]
    async fn the_relay_adds_one_entry_per_row_with_the_id_field() {
        let url = std::env::var("DEDUP_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut connection = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "Redis is not reachable at {url}: {error}. Start it or set DEDUP_TEST_REDIS_URL"
                )
            });
        let stream = dedup_suite::unique("outbox-redis");
        let payloads: [&[u8]; 3] = [b"first", b"\x00\xff binary", b"third"];
        let (db, outbox, ids) = outbox_with(&stream, &payloads).await;
        let publisher = RedisStreamsPublisher::new(client.clone());
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (3, 3), "{relayed:?}");
        for id in &ids {
            assert_eq!(state(&db, *id).await, (2, None), "marked sent");
        }
        let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async::<Vec<(String, Vec<(String, Value)>)>>(&mut connection)
            .await
            .unwrap()
            .into_iter()
            .map(|(entry, fields)| {
                let fields = fields
                    .into_iter()
                    .map(|(name, value)| match value {
                        Value::BulkString(bytes) => (name, bytes),
                        other => panic!("field {name}: {other:?}"),
                    })
                    .collect();
                (entry, fields)
            })
            .collect();
        let got: Vec<Fields> = entries.into_iter().map(|(_, f)| f).collect();
        let expected: Vec<Fields> = ids
            .iter()
            .zip(payloads)
            .enumerate()
            .map(|(n, (id, payload))| {
                let mut fields = vec![
                    ("id".to_owned(), id.to_string().into_bytes()),
                    ("body".to_owned(), payload.to_vec()),
                ];
                if n == 0 {
                    fields.push(("traceparent".to_owned(), TRACE.as_bytes().to_vec()));
                }
                fields
            })
            .collect();
        assert_eq!(got, expected, "each once, in order, byte for byte");
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}

mod mqtt {
    use super::*;
    use dedup_runtime::rumqttc::MqttPublisher;
    use dedup_suite::mosquitto::Mosquitto;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};
    use tokio::sync::mpsc;

    /// A message as received: its user properties and its payload.
    type Wire = (Vec<(String, String)>, Vec<u8>);

    /// A clean-start subscriber of `topic` at QoS 1, subscribed (its `SUBACK` is back):
    /// the messages it receives, in order.
    async fn subscriber(port: u16, topic: &str) -> mpsc::UnboundedReceiver<Wire> {
        let options = MqttOptions::new(dedup_suite::unique("sub"), "127.0.0.1", port);
        let (client, mut events) = AsyncClient::new(options, 64);
        client
            .subscribe(topic, QoS::AtLeastOnce)
            .await
            .expect("subscribe");
        loop {
            match tokio::time::timeout(PATIENCE, events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
                Ok(Ok(_)) => {}
                Ok(Err(error)) => panic!("the subscriber's connection: {error}"),
                Err(_) => panic!("no SUBACK within {PATIENCE:?}"),
            }
        }
        let (tell, payloads) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _client = client;
            while let Ok(event) = events.poll().await {
                if let Event::Incoming(Packet::Publish(publish)) = event
                    && tell
                        .send((
                            publish.properties.unwrap_or_default().user_properties,
                            publish.payload.to_vec(),
                        ))
                        .is_err()
                {
                    return;
                }
            }
        });
        payloads
    }

    /// The next `count` payloads, then nothing more for a while.
    async fn receive(payloads: &mut mpsc::UnboundedReceiver<Wire>, count: usize) -> Vec<Wire> {
        let mut got = Vec::new();
        while got.len() < count {
            match tokio::time::timeout(PATIENCE, payloads.recv()).await {
                Ok(Some(payload)) => got.push(payload),
                _ => panic!("{} of {count} payloads within {PATIENCE:?}", got.len()),
            }
        }
        got
    }

    /// What the publisher sends for a row without headers or trace context: its payload,
    /// its id as the user property `message-id`.
    fn wire(id: OutgoingId, payload: &[u8]) -> Wire {
        (
            vec![("message-id".to_owned(), id.to_string())],
            payload.to_vec(),
        )
    }

    fn publisher(broker: &Mosquitto) -> MqttPublisher {
        MqttPublisher::new(MqttOptions::new(
            dedup_suite::unique("relay"),
            "127.0.0.1",
            broker.port(),
        ))
    }

    /// The relay publishes a claim at QoS 1: each row once, in order, its payload byte
    /// for byte (one with line feeds, an empty one, a binary one), its id as the user
    /// property `message-id` (and the first one's trace context as `traceparent`), the
    /// rows marked sent once the `PUBACK`s are back.
    #[tokio::test]
    async fn the_relay_publishes_at_qos_1_with_the_id_as_a_user_property() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/orders");
        let mut payloads = subscriber(broker.port(), &topic).await;
        let sent: [&[u8]; 4] = [b"first", b"two\nlines\n", b"", b"\x00\xff binary"];
        let (db, outbox, ids) = outbox_with(&topic, &sent).await;
        let publisher = publisher(&broker);
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (4, 4), "{relayed:?}");
        for id in &ids {
            assert_eq!(state(&db, *id).await, (2, None), "marked sent");
        }
        let mut expected: Vec<Wire> = ids.iter().zip(sent).map(|(id, p)| wire(*id, p)).collect();
        expected[0]
            .0
            .push(("traceparent".to_owned(), TRACE.to_owned()));
        assert_eq!(
            receive(&mut payloads, 4).await,
            expected,
            "each once, in order"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(payloads.try_recv().is_err(), "nothing more");
    }

    /// A row whose packet is over the publisher's `max_packet_size`, or whose destination
    /// is not a topic to publish to (a wildcard), fails by itself with its reason; the
    /// rows around it are sent.
    #[tokio::test]
    async fn an_oversized_row_or_a_wildcard_topic_fails_alone() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/sized");
        let mut payloads = subscriber(broker.port(), &topic).await;
        let big = vec![b'x'; 1_000];
        let db = dedup_suite::sqlite().await;
        dedup_runtime::outbox::migrate(&*db).await.unwrap();
        let outbox = Outbox::new();
        let cause = Cause::new("outbox-brokers", dedup_suite::unique("evt")).unwrap();
        let rows: [(&str, &[u8]); 4] = [
            (&topic, b"small"),
            (&topic, &big),
            ("outbox-mqtt/+/wildcard", b"nowhere"),
            (&topic, b"after"),
        ];
        let mut tx = db.begin().await.unwrap();
        let mut ids = Vec::new();
        for (index, (destination, payload)) in rows.iter().enumerate() {
            let message = cause.nth_outgoing(index as u32, destination, payload);
            outbox.enqueue(&mut *tx, &message).await.unwrap();
            ids.push(message.id());
        }
        tx.commit().await.unwrap();
        // `small`'s packet: 1 + 1 + (2 + topic + 2 + 1 + 52 + 5) bytes (52: the id's user
        // property); the limit lets it and `after` through, not 1,000 bytes of payload.
        let publisher = publisher(&broker).max_packet_size(300);
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!(
            (relayed.claimed, relayed.sent, relayed.failed),
            (4, 2, 2),
            "{relayed:?}"
        );
        assert_eq!(state(&db, ids[0]).await, (2, None));
        assert_eq!(state(&db, ids[3]).await, (2, None));
        let (state_big, error_big) = state(&db, ids[1]).await;
        let error_big = error_big.expect("the oversized row's error");
        assert!(
            state_big != 2 && error_big.contains("over the publisher's limit of 300"),
            "{state_big} {error_big}"
        );
        let (state_wild, error_wild) = state(&db, ids[2]).await;
        let error_wild = error_wild.expect("the wildcard row's error");
        assert!(
            state_wild != 2 && error_wild.contains("is not an MQTT topic to publish to"),
            "{state_wild} {error_wild}"
        );
        assert_eq!(
            receive(&mut payloads, 2).await,
            vec![wire(ids[0], b"small"), wire(ids[3], b"after")]
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(payloads.try_recv().is_err(), "nothing more");
    }

    /// `max_packet_size` at a row's exact packet size sends it; the row one payload byte
    /// larger fails by itself, its error giving its size, one over the limit. The size
    /// counted as MQTT 5.0 §3.3 lays the packet out: a fixed header of 1 + 2 bytes (the
    /// remaining length is over 127), the topic (2 + its bytes), the packet id (2), the
    /// properties' length (1) and the id's user property (1 + 2 + 10 + 2 + the id's
    /// bytes), the payload.
    #[tokio::test]
    async fn a_row_at_the_packet_limit_is_sent_and_one_byte_over_is_not() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/limit");
        let mut payloads = subscriber(broker.port(), &topic).await;
        let db = dedup_suite::sqlite().await;
        dedup_runtime::outbox::migrate(&*db).await.unwrap();
        let outbox = Outbox::new();
        let cause = Cause::new("outbox-brokers", dedup_suite::unique("evt")).unwrap();
        let at = vec![b'a'; 200];
        let over = vec![b'o'; 201];
        let mut tx = db.begin().await.unwrap();
        let mut ids = Vec::new();
        for (index, payload) in [&at, &over].into_iter().enumerate() {
            let message = cause.nth_outgoing(index as u32, &topic, payload);
            outbox.enqueue(&mut *tx, &message).await.unwrap();
            ids.push(message.id());
        }
        tx.commit().await.unwrap();
        let id_len = ids[0].to_string().len();
        let limit = 1 + 2 + (2 + topic.len() + 2 + 1 + (1 + 2 + 10 + 2 + id_len) + at.len());
        let publisher = publisher(&broker).max_packet_size(limit);
        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!(
            (relayed.claimed, relayed.sent, relayed.failed),
            (2, 1, 1),
            "{relayed:?}"
        );
        assert_eq!(state(&db, ids[0]).await, (2, None));
        let (state_over, error_over) = state(&db, ids[1]).await;
        let error_over = error_over.expect("the row over the limit has its error");
        assert!(
            state_over != 2
                && error_over.contains(&(limit + 1).to_string())
                && error_over.contains(&format!("limit of {limit}")),
            "{state_over} {error_over}"
        );
        assert_eq!(receive(&mut payloads, 1).await, vec![wire(ids[0], &at)]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(payloads.try_recv().is_err(), "nothing more");
    }

    /// The broker paused (`SIGSTOP`: the connection up, no `PUBACK`): the claim's rows
    /// fail with the confirm timeout, none marked sent. Resumed, the next claim (a new
    /// connection) sends them again, with the same id; the subscriber has each at
    /// least once (the paused broker may still deliver the first copies) and nothing else.
    #[tokio::test]
    async fn a_puback_not_back_in_time_fails_the_claim_and_the_rows_are_sent_again() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/paused");
        let mut payloads = subscriber(broker.port(), &topic).await;
        let sent: [&[u8]; 3] = [b"one", b"two", b"three"];
        let (db, outbox, ids) = outbox_with(&topic, &sent).await;
        let publisher = publisher(&broker).confirm_timeout(Duration::from_millis(500));
        let relay = outbox
            .relay(&*db)
            .backoff(Duration::from_millis(1), Duration::from_millis(1));
        let signal = |name: &str| {
            let status = std::process::Command::new("kill")
                .arg(format!("-{name}"))
                .arg(broker.pid().to_string())
                .status()
                .expect("run kill");
            assert!(status.success(), "kill -{name}");
        };
        signal("STOP");
        let started = Instant::now();
        let relayed = relay.relay_batch(&publisher).await;
        let waited = started.elapsed();
        signal("CONT");
        let relayed = relayed.unwrap();
        assert_eq!((relayed.claimed, relayed.failed), (3, 3), "{relayed:?}");
        assert!(waited >= Duration::from_millis(500), "waited {waited:?}");
        for id in &ids {
            let (row_state, error) = state(&db, *id).await;
            assert!(
                row_state != 2 && error.as_deref().is_some_and(|e| e.contains("in time")),
                "{row_state} {error:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let relayed = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (3, 3), "{relayed:?}");
        for id in &ids {
            // The last error stays with the row: what happened before it was sent.
            assert_eq!(state(&db, *id).await.0, 2, "marked sent");
        }
        let mut got = receive(&mut payloads, 3).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        while let Ok(more) = payloads.try_recv() {
            got.push(more);
        }
        let mut expected: Vec<Wire> = ids.iter().zip(sent).map(|(id, p)| wire(*id, p)).collect();
        expected[0]
            .0
            .push(("traceparent".to_owned(), TRACE.to_owned()));
        for payload in &expected {
            assert!(got.contains(payload), "{payload:?} missing from {got:?}");
        }
        assert!(
            got.iter().all(|payload| expected.contains(payload)) && got.len() <= 6,
            "only the rows, at most twice each: {got:?}"
        );
    }

    /// The relay as a command (`examples/outbox_relay.rs` with `DEDUP_MQTT_URL`): it sends
    /// the rows at QoS 1, then exits once idle.
    #[tokio::test]
    async fn the_relay_command_publishes_to_mqtt() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/command");
        let mut payloads = subscriber(broker.port(), &topic).await;
        let (db, _outbox, ids) = outbox_with(&topic, &[b"a", b"b"]).await;
        let program = tokio::task::spawn_blocking(|| {
            dedup_suite::example_binary("brokers", &["outbox_relay"], "outbox_relay")
        })
        .await
        .unwrap();
        let output = tokio::process::Command::new(program)
            .env("DATABASE_URL", format!("sqlite:{}", db.path().display()))
            .env(
                "DEDUP_MQTT_URL",
                format!("mqtt://127.0.0.1:{}", broker.port()),
            )
            .env("DEDUP_MQTT_CLIENT_ID", dedup_suite::unique("relay-command"))
            .env_remove("DEDUP_AMQP_URL")
            .env_remove("DEDUP_NATS_URL")
            .env_remove("DEDUP_KAFKA_BROKERS")
            .env_remove("DEDUP_REDIS_URL")
            .env("DEDUP_EXIT_WHEN_IDLE_MS", "300")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            stdout.contains("relayed 2 sent 2 lost 0 failed 0 dead 0"),
            "{stdout}"
        );
        let mut expected = vec![wire(ids[0], b"a"), wire(ids[1], b"b")];
        expected[0]
            .0
            .push(("traceparent".to_owned(), TRACE.to_owned()));
        assert_eq!(receive(&mut payloads, 2).await, expected);
    }

    /// A row to a topic no session is subscribed to: the broker's `PUBACK` says *no
    /// matching subscribers*, the message went nowhere, and the row is not marked sent
    /// (its error says why); with `allow_no_subscribers(true)` it is.
    #[tokio::test]
    async fn a_row_nobody_is_subscribed_to_is_not_marked_sent() {
        let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/nobody");
        let (db, outbox, ids) = outbox_with(&topic, &[b"lost?"]).await;
        let relay = outbox
            .relay(&*db)
            .backoff(Duration::from_millis(1), Duration::from_millis(1));
        let relayed = relay.relay_batch(&publisher(&broker)).await.unwrap();
        assert_eq!((relayed.claimed, relayed.failed), (1, 1), "{relayed:?}");
        let (row_state, error) = state(&db, ids[0]).await;
        let error = error.expect("the row's error");
        assert!(
            row_state != 2 && error.contains("no subscriber"),
            "{row_state} {error}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let allowing = publisher(&broker).allow_no_subscribers(true);
        let relayed = relay.relay_batch(&allowing).await.unwrap();
        assert_eq!((relayed.claimed, relayed.sent), (1, 1), "{relayed:?}");
        assert_eq!(state(&db, ids[0]).await.0, 2, "marked sent when allowed");
    }

    /// The confirm timeout with the relay on PostgreSQL and MariaDB too (the test above
    /// runs it on SQLite): the broker paused, the claim's rows fail with the timeout, none
    /// marked; resumed, the next claim sends them and marks them.
    macro_rules! confirm_timeout_on {
        ($name:ident, $pool:expr, $state:literal) => {
            #[tokio::test]
            async fn $name() {
                let broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
                let topic = dedup_suite::unique("outbox-mqtt/paused-db");
                let _payloads = subscriber(broker.port(), &topic).await;
                let pool = $pool;
                let table = dedup_suite::unique_table("outbox_mqtt");
                dedup_runtime::outbox::migrate_table(&pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("outbox-brokers", dedup_suite::unique("evt")).unwrap();
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for index in 0..3 {
                    let message = cause.nth_outgoing(index, &topic, b"p");
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id().to_string());
                }
                tx.commit().await.unwrap();
                let state = async |id: &str| -> (i64, Option<String>) {
                    sqlx::query_as(sqlx::AssertSqlSafe(format!($state, table)))
                        .bind(id)
                        .fetch_one(&pool)
                        .await
                        .unwrap()
                };
                let publisher = publisher(&broker).confirm_timeout(Duration::from_millis(400));
                let relay = outbox
                    .relay(&pool)
                    .backoff(Duration::from_millis(1), Duration::from_millis(1));
                let signal = |name: &str| {
                    let status = std::process::Command::new("kill")
                        .arg(format!("-{name}"))
                        .arg(broker.pid().to_string())
                        .status()
                        .expect("run kill");
                    assert!(status.success(), "kill -{name}");
                };
                signal("STOP");
                let relayed = relay.relay_batch(&publisher).await;
                signal("CONT");
                let relayed = relayed.unwrap();
                assert_eq!((relayed.claimed, relayed.failed, relayed.sent), (3, 3, 0));
                for id in &ids {
                    let (row_state, error) = state(id).await;
                    assert!(
                        row_state != 2 && error.as_deref().is_some_and(|e| e.contains("in time")),
                        "{row_state} {error:?}"
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                let relayed = relay.relay_batch(&publisher).await.unwrap();
                assert_eq!((relayed.claimed, relayed.sent), (3, 3), "{relayed:?}");
                for id in &ids {
                    assert_eq!(state(id).await.0, 2, "marked sent");
                }
            }
        };
    }

    confirm_timeout_on!(
        a_confirm_timeout_on_postgres,
        dedup_suite::postgres().await,
        "SELECT state::int8, last_error FROM {} WHERE id = $1::uuid"
    );
    confirm_timeout_on!(
        a_confirm_timeout_on_mariadb,
        dedup_suite::mysql().await,
        "SELECT CAST(state AS SIGNED), last_error FROM {} WHERE id = UNHEX(REPLACE(?, '-', ''))"
    );

    /// The broker restarted between two claims (the publisher's connection cut while it
    /// idled): the next claim connects again and is sent.
    #[tokio::test]
    async fn the_publisher_connects_again_after_the_broker_restarted() {
        let mut broker = Mosquitto::start(&dedup_suite::unique("outbox-mqtt"), "");
        let topic = dedup_suite::unique("outbox-mqtt/restart");
        let (db, outbox, ids) = outbox_with(&topic, &[b"before", b"after"]).await;
        let publisher = publisher(&broker);
        let relay = outbox
            .relay(&*db)
            .batch(1)
            .backoff(Duration::from_millis(1), Duration::from_millis(1));
        let mut payloads = subscriber(broker.port(), &topic).await;
        let relayed = relay.relay_batch(&publisher).await.unwrap();
        assert_eq!(relayed.sent, 1, "{relayed:?}");
        let mut before = wire(ids[0], b"before");
        before.0.push(("traceparent".to_owned(), TRACE.to_owned()));
        assert_eq!(receive(&mut payloads, 1).await, vec![before]);
        broker.restart();
        let mut payloads = subscriber(broker.port(), &topic).await;
        // The cut may be seen at once or only by the next claim's writes (which then
        // fail, and are sent again by the claim after).
        let mut tries = 0;
        while state(&db, ids[1]).await.0 != 2 {
            tries += 1;
            assert!(
                tries <= 3,
                "not sent after 3 claims: {:?}",
                state(&db, ids[1]).await
            );
            relay.relay_batch(&publisher).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            receive(&mut payloads, 1).await,
            vec![wire(ids[1], b"after")]
        );
    }
}
