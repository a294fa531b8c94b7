//! `dedup_runtime::lapin` and `dedup_runtime::async_nats` against the real brokers: one
//! message at a time through `settle`, with the count `delivery_count` reads at each step.
//!
//! - RabbitMQ, on a classic and on a quorum queue: delivered (count 1), `Ack::Retry`
//!   (requeued after the delay), delivered again (count 2; on the quorum queue once more,
//!   count 3, which only its header can say), `Ack::DeadLetter` (on the dead-letter queue,
//!   gone from the queue); a second message `Ack::Ack`ed stays gone when the channel
//!   closes.
//! - NATS JetStream: delivered (count 1), `Ack::Retry` (a `-NAK` with the delay, so the
//!   redelivery comes long before the ack wait), delivered again (count 2),
//!   `Ack::DeadLetter` with a dead-letter subject (copied to its stream and terminated);
//!   an `Ack::Ack` and a `+TERM` without a copy; nothing pending or unacknowledged at the
//!   end. The message is published with `Nats-Expected-Stream`, which JetStream stores and
//!   delivers with it: a copy that kept the header would be refused by the dead-letter
//!   stream ("expected stream does not match", error 10060), so `settle` leaves it out.
//!
//! The crate feature `brokers` builds it: `cargo test --features brokers --test settle`
//! (`--all-features` in CI). RabbitMQ on 127.0.0.1:5672 (`DEDUP_TEST_AMQP_URL`), NATS
//! with JetStream on 127.0.0.1:4222 (`DEDUP_TEST_NATS_URL`); an unreachable broker fails
//! the test.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use dedup_runtime::Ack;
use futures_util::{FutureExt, Stream, StreamExt};

/// How long a step may wait for the broker.
const PATIENCE: Duration = Duration::from_secs(10);
/// The retry delay the tests ask for.
const RETRY: Duration = Duration::from_millis(10);

/// The next item of `stream`, within [`PATIENCE`].
async fn next<S: Stream + Unpin>(stream: &mut S, what: &str) -> S::Item {
    tokio::time::timeout(PATIENCE, stream.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {PATIENCE:?}"))
        .unwrap_or_else(|| panic!("{what}: the stream ended"))
}

/// Runs `body`, then `cleanup` whatever happened, then re-raises a panic of `body`.
async fn with_cleanup(body: impl Future<Output = ()>, cleanup: impl Future<Output = ()>) {
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    cleanup.await;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
}

mod rabbitmq {
    use super::*;
    use dedup_runtime::lapin::{delivery_count, settle};
    use lapin::message::Delivery;
    use lapin::options::{
        BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

    async fn connect() -> Connection {
        let url = std::env::var("DEDUP_TEST_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                     -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
                )
            })
    }

    async fn publish(channel: &Channel, queue: &str, id: &str) {
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2);
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                id.as_bytes(),
                properties,
            )
            .await
            .expect("publish");
        let returned = channel
            .wait_for_confirms()
            .await
            .expect("publisher confirms");
        assert!(returned.is_empty(), "the broker returned the message");
    }

    /// Messages ready in `queue` (not those delivered and unacknowledged).
    async fn ready(channel: &Channel, queue: &str) -> u32 {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable().passive(),
                FieldTable::default(),
            )
            .await
            .expect("inspect the queue")
            .message_count()
    }

    fn body(delivery: &Delivery) -> String {
        String::from_utf8_lossy(&delivery.data).into_owned()
    }

    async fn retry_then_dead_letter(quorum: bool) {
        let connection = connect().await;
        let queue = dedup_suite::unique(if quorum { "settle-quorum" } else { "settle" });
        let setup = connection.create_channel().await.expect("open a channel");
        let test = async {
            dedup_suite::rabbitmq::declare(&setup, &queue, quorum).await;
            setup
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("enable publisher confirms");
            publish(&setup, &queue, "poison").await;

            let channel = connection.create_channel().await.expect("open a channel");
            channel
                .basic_qos(1, BasicQosOptions::default())
                .await
                .expect("prefetch 1");
            let mut deliveries = channel
                .basic_consume(
                    queue.as_str().into(),
                    "settle-test".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume");

            let first = next(&mut deliveries, "the first delivery")
                .await
                .expect("a delivery");
            assert_eq!((body(&first), delivery_count(&first)), ("poison".into(), 1));

            let asked = Instant::now();
            settle(&first, Ack::Retry { after: RETRY })
                .await
                .expect("settle a retry");
            assert!(asked.elapsed() >= RETRY, "the retry did not wait its delay");
            let second = next(&mut deliveries, "the redelivery after a retry")
                .await
                .expect("a delivery");
            assert!(second.redelivered, "the second delivery is flagged");
            assert_eq!(
                (body(&second), delivery_count(&second)),
                ("poison".into(), 2)
            );

            let last = if quorum {
                // Only a quorum queue counts: a third delivery is 3, not "more than once".
                settle(&second, Ack::Retry { after: RETRY })
                    .await
                    .expect("settle a retry");
                let third = next(&mut deliveries, "the second redelivery")
                    .await
                    .expect("a delivery");
                assert_eq!(delivery_count(&third), 3, "headers: {:?}", third.properties);
                third
            } else {
                second
            };

            settle(&last, Ack::DeadLetter)
                .await
                .expect("settle a dead letter");
            let dead = format!("{queue}.dead");
            let deadline = Instant::now() + PATIENCE;
            let parked = loop {
                let got = setup
                    .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
                    .await
                    .expect("read the dead-letter queue");
                if let Some(message) = got {
                    break message;
                }
                assert!(Instant::now() < deadline, "nothing on {dead}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(body(&parked.delivery), "poison");

            publish(&setup, &queue, "fine").await;
            let fine = next(&mut deliveries, "the second message")
                .await
                .expect("a delivery");
            assert_eq!((body(&fine), delivery_count(&fine)), ("fine".into(), 1));
            settle(&fine, Ack::Ack).await.expect("settle an ack");
            // Closing the channel would requeue anything it had not acknowledged.
            channel
                .close(200, "done".into())
                .await
                .expect("close the channel");
            assert_eq!(ready(&setup, &queue).await, 0, "messages back on {queue}");
            assert_eq!(ready(&setup, &dead).await, 0, "more dead letters on {dead}");
        };
        let cleanup = async {
            for name in [queue.clone(), format!("{queue}.dead")] {
                if let Err(error) = setup
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await
                {
                    eprintln!("could not delete the queue {name}: {error}");
                }
            }
            let dlx = format!("{queue}.dlx");
            if let Err(error) = setup
                .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
                .await
            {
                eprintln!("could not delete the exchange {dlx}: {error}");
            }
        };
        with_cleanup(test, cleanup).await;
        connection.close(200, "done".into()).await.ok();
    }

    #[tokio::test]
    async fn classic_queue_retry_redelivers_then_dead_letters() {
        retry_then_dead_letter(false).await;
    }

    #[tokio::test]
    async fn quorum_queue_counts_deliveries_then_dead_letters() {
        retry_then_dead_letter(true).await;
    }
}

mod nats {
    use super::*;
    use async_nats::HeaderMap;
    use async_nats::jetstream::{self, consumer};
    use dedup_runtime::async_nats::{delivery_count, settle};

    #[tokio::test]
    async fn retry_redelivers_and_dead_letters_are_copied_then_terminated() {
        let url = std::env::var("DEDUP_TEST_NATS_URL")
            .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
            panic!(
                "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
                 .ci/run) or set DEDUP_TEST_NATS_URL"
            )
        });
        let jetstream = jetstream::new(client);
        let run = dedup_suite::unique("settle");
        let (stream_name, dead_stream_name) =
            (format!("SETTLE_{run}"), format!("SETTLE_{run}_DEAD"));
        let (subject, dead_subject) = (format!("settle.{run}"), format!("settle.{run}.dead"));

        let test = async {
            let (stream, dead_stream) =
                dedup_suite::jetstream::streams(&jetstream, &url, &stream_name, &subject).await;
            let mut consumer: consumer::PullConsumer = stream
                .create_consumer(consumer::pull::Config {
                    durable_name: Some("settle".to_owned()),
                    ack_policy: consumer::AckPolicy::Explicit,
                    // Far beyond the test: every redelivery here is a `-NAK`'s.
                    ack_wait: Duration::from_secs(60),
                    max_deliver: 10,
                    ..Default::default()
                })
                .await
                .expect("create the durable consumer");

            let publish = |id: &'static str| {
                let mut headers = HeaderMap::new();
                headers.insert("Message-Id", id);
                // A publication's condition, for the original stream only.
                headers.insert("Nats-Expected-Stream", stream_name.as_str());
                let jetstream = jetstream.clone();
                let subject = subject.clone();
                async move {
                    jetstream
                        .publish_with_headers(subject, headers, id.into())
                        .await
                        .expect("publish")
                        .await
                        .expect("the stream stored the message");
                }
            };
            publish("poison").await;
            let mut messages = consumer.messages().await.expect("pull messages");

            let first = next(&mut messages, "the first delivery")
                .await
                .expect("a message");
            assert_eq!(
                (&first.payload[..], delivery_count(&first)),
                (&b"poison"[..], 1)
            );
            settle(&first, Ack::Retry { after: RETRY }, Some(&dead_subject))
                .await
                .expect("settle a retry");
            let second = next(&mut messages, "the redelivery after a -NAK")
                .await
                .expect("a message");
            assert_eq!(
                (&second.payload[..], delivery_count(&second)),
                (&b"poison"[..], 2)
            );
            let info = second.info().expect("JetStream info");
            assert_eq!(info.stream_sequence, 1, "the same message");
            let delivered_headers = second.headers.clone().unwrap_or_default();

            settle(&second, Ack::DeadLetter, Some(&dead_subject))
                .await
                .expect("settle a dead letter");
            let copy = dead_stream
                .get_raw_message(1)
                .await
                .expect("the copy on the dead-letter stream");
            assert_eq!(&copy.payload[..], b"poison");
            assert_eq!(
                copy.headers.get("Message-Id").map(|id| id.as_str()),
                Some("poison"),
                "the copy keeps the message's headers"
            );
            assert!(
                copy.headers.get("Nats-Expected-Stream").is_none(),
                "the copy carries the original publication's condition (delivered with: {:?})",
                delivered_headers.get("Nats-Expected-Stream")
            );

            publish("fine").await;
            let fine = next(&mut messages, "the second message")
                .await
                .expect("a message");
            assert_eq!(
                (&fine.payload[..], delivery_count(&fine)),
                (&b"fine"[..], 1)
            );
            settle(&fine, Ack::Ack, Some(&dead_subject))
                .await
                .expect("settle an ack");

            publish("dropped").await;
            let dropped = next(&mut messages, "the third message")
                .await
                .expect("a message");
            settle(&dropped, Ack::DeadLetter, None)
                .await
                .expect("settle a dead letter without a copy");

            let info = consumer.info().await.expect("consumer info").clone();
            assert_eq!(
                (info.num_pending, info.num_ack_pending, info.num_redelivered),
                (0, 0, 0),
                "messages left pending, unacknowledged, or waiting for redelivery"
            );
            assert_eq!(info.ack_floor.stream_sequence, 3, "every message settled");
            let dead = dead_stream
                .get_info()
                .await
                .expect("dead-letter stream info");
            assert_eq!(dead.state.messages, 1, "one copy: the poison message's");
            println!(
                "JetStream delivered the publication's Nats-Expected-Stream header: {:?}",
                delivered_headers.get("Nats-Expected-Stream")
            );
        };
        let cleanup = async {
            for name in [&stream_name, &dead_stream_name] {
                if let Err(error) = jetstream.delete_stream(name).await {
                    eprintln!("could not delete the stream {name}: {error}");
                }
            }
        };
        with_cleanup(test, cleanup).await;
    }
}
