//! NATS JetStream: the plain and batch consumers, and two hops through the outbox relay.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer};

use crate::checks::*;
use crate::harness::*;
use crate::two_hop::*;

fn nats_url() -> String {
    std::env::var("DEDUP_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

async fn cleanup(jetstream: &jetstream::Context, stream: &str) {
    for name in [stream.to_owned(), format!("{stream}_DEAD")] {
        if let Err(error) = jetstream.delete_stream(&name).await {
            eprintln!("could not delete the stream {name}: {error}");
        }
    }
}

/// The durable pull consumer `examples/nats.rs` would create, with a short ack wait so
/// that a killed consumer's messages come back within the test.
async fn durable_consumer(
    stream: &jetstream::stream::Stream,
    durable: &str,
) -> consumer::PullConsumer {
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(durable.to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: NATS_ACK_WAIT,
            max_deliver: 100,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .expect("create the durable consumer")
}

/// Publishes `published` to `subject`, each stored by the stream.
async fn publish_all(jetstream: &jetstream::Context, subject: &str, published: &[Publish]) {
    let mut acks = Vec::with_capacity(published.len());
    for message in published {
        let mut headers = HeaderMap::new();
        if let Some(id) = &message.id {
            headers.insert("Message-Id", id.as_str());
        }
        let ack = jetstream
            .publish_with_headers(subject.to_owned(), headers, message.body.clone().into())
            .await
            .expect("publish");
        acks.push(ack);
        if acks.len() == 500 {
            for ack in acks.drain(..) {
                ack.await.expect("the stream stored the message");
            }
        }
    }
    for ack in acks {
        ack.await.expect("the stream stored the message");
    }
}

/// Asserts that `consumer` has nothing pending, unacknowledged or to redeliver, and its
/// ack floor at the stream's last sequence; returns that sequence.
async fn settled(consumer: &mut consumer::PullConsumer, stream: &jetstream::stream::Stream) -> u64 {
    let info = consumer.info().await.expect("consumer info").clone();
    let last = stream
        .get_info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    assert_eq!(
        (info.num_pending, info.num_ack_pending, info.num_redelivered),
        (0, 0, 0),
        "messages left pending, unacknowledged, or waiting for redelivery"
    );
    assert_eq!(
        info.ack_floor.stream_sequence, last,
        "every message up to the stream's last is acknowledged (or terminated)"
    );
    last
}

/// The messages in `{stream}_DEAD`, and their bodies.
async fn dead_letters(jetstream: &jetstream::Context, stream: &str) -> (usize, HashSet<String>) {
    let dead_stream = jetstream
        .get_stream(format!("{stream}_DEAD"))
        .await
        .expect("the dead-letter stream");
    let dead_state = dead_stream
        .get_info()
        .await
        .expect("dead-letter stream info")
        .state;
    let mut bodies = HashSet::new();
    for sequence in dead_state.first_sequence..=dead_state.last_sequence {
        if dead_state.messages == 0 {
            break;
        }
        let message = dead_stream
            .get_raw_message(sequence)
            .await
            .expect("read a dead letter");
        bodies.insert(String::from_utf8_lossy(&message.payload).into_owned());
    }
    (dead_state.messages as usize, bodies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_consumer_is_effectively_once_under_sigkill() {
    harness("NATS JetStream", &[]).await;
}

/// Batch mode: `examples/nats.rs` with `BATCH=16` takes up to 16 pulled messages per
/// transaction (`dedup_runtime::batch`) and acknowledges each after the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_batch_consumer_is_effectively_once_under_sigkill() {
    harness("NATS JetStream, batches of 16", &[("BATCH", "16")]).await;
}

/// The JetStream crash harness, `title` in its report, `more` in the consumer's
/// environment.
async fn harness(title: &str, more: &[(&'static str, &str)]) {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("nats");
    // Stream and consumer names allow no dots; subjects use them as separators.
    let stream_name = format!("DEDUP_CRASH_{run}");
    let subject = format!("dedup-crash.{run}");
    let durable = "crash-harness";
    let url = nats_url();
    let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
        panic!(
            "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
             .ci/run) or set DEDUP_TEST_NATS_URL"
        )
    });
    let jetstream = jetstream::new(client);
    let pool = dedup_suite::postgres().await;

    let body = async {
        // What `examples/nats.rs` would create, with a short ack wait so that a killed
        // consumer's messages come back within the test.
        let (stream, _) =
            dedup_suite::jetstream::streams(&jetstream, &url, &stream_name, &subject).await;
        let mut consumer = durable_consumer(&stream, durable).await;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS nats_example_effects (message_id text NOT NULL, \
             body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .expect("create the effects table");

        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        publish_all(&jetstream, &subject, &published).await;
        let info = consumer.info().await.expect("consumer info");
        assert_eq!(
            info.num_pending,
            published.len() as u64,
            "messages pending for the consumer after publishing"
        );

        let mut env = vec![
            ("NATS_URL", url.clone()),
            ("DATABASE_URL", database_url()),
            ("STREAM", stream_name.clone()),
            ("SUBJECT", subject.clone()),
            ("DURABLE", durable.to_owned()),
            ("CONSUMERS", CONSUMERS.to_owned()),
            ("PREFETCH", PREFETCH.to_owned()),
            ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
        ];
        env.extend(
            more.iter()
                .map(|(name, value)| (*name, (*value).to_owned())),
        );
        // The last life must outlast the ack wait, to see the messages the kills
        // left unacknowledged come back.
        let idle = NATS_ACK_WAIT + Duration::from_millis(1500);
        let under_test = Subject {
            example: "nats",
            effects_table: "nats_example_effects",
            consumer: "nats-example",
        };
        let (tally, stored) =
            crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
        let last = settled(&mut consumer, &stream).await;
        let (dead_count, dead_bodies) = dead_letters(&jetstream, &stream_name).await;
        // A crash between the copy to the dead-letter subject and the `+TERM` copies a
        // poison message again on its redelivery: at least once each, nothing else.
        assert_eq!(
            dead_bodies,
            poison_bodies(),
            "the dead-letter stream holds the poison messages and nothing else"
        );
        report(
            title,
            &published,
            &stored,
            &tally,
            &scale,
            dead_count,
            &format!(
                "consumer: 0 pending, 0 unacknowledged, ack floor at the stream's last \
                 sequence ({last})"
            ),
            started.elapsed(),
        );
    };
    with_cleanup(body, cleanup(&jetstream, &stream_name)).await;
    forget_run(&pool, "nats_example_effects", "nats-example", &run).await;
}

/// Two hops over JetStream, as [the RabbitMQ one](super::rabbitmq): A and B are
/// `examples/nats.rs` (A with `FORWARD_TO`), the relay publishes with `Nats-Msg-Id`.
/// The events' stream keeps a 100 ms duplicate window (its least): JetStream's own dedup would
/// drop a re-send within its window (2 minutes by default), and this harness wants
/// every re-send to reach B, whose dedup must hold whatever comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_two_hop_is_effectively_once_under_sigkill() {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("two-hop");
    let (stream_in, stream_out) = (
        format!("DEDUP_CRASH_{run}_IN"),
        format!("DEDUP_CRASH_{run}_OUT"),
    );
    let (input, output) = (
        format!("dedup-crash.{run}.in"),
        format!("dedup-crash.{run}.out"),
    );
    let outbox_table = dedup_suite::unique_table("two_hop_outbox");
    let forwarder = forwarding_consumer("nats");
    let url = nats_url();
    let client = async_nats::connect(&url).await.unwrap_or_else(|error| {
        panic!(
            "NATS is not reachable at {url}: {error}. Start it with JetStream (see \
             .ci/run) or set DEDUP_TEST_NATS_URL"
        )
    });
    let jetstream = jetstream::new(client);
    let pool = dedup_suite::postgres().await;
    let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
    let events = events(&published, &forwarder);
    let spec = TwoHop {
        run: &run,
        seed: scale.seed,
        published: &published,
        events: &events,
        effects_table: "nats_example_effects",
        forwarder: &forwarder,
        consumer: "nats-example",
        outbox_table: &outbox_table,
    };

    let body = async {
        let (in_stream, _) =
            dedup_suite::jetstream::streams(&jetstream, &url, &stream_in, &input).await;
        let (out_stream, _) =
            dedup_suite::jetstream::streams(&jetstream, &url, &stream_out, &output).await;
        let mut config = out_stream.cached_info().config.clone();
        config.duplicate_window = Duration::from_millis(100);
        jetstream
            .update_stream(config)
            .await
            .expect("shorten the events' duplicate window");
        let mut consumer_a = durable_consumer(&in_stream, "two-hop-a").await;
        let mut consumer_b = durable_consumer(&out_stream, "two-hop-b").await;
        two_hop_tables(&pool, &spec).await;
        publish_all(&jetstream, &input, &published).await;

        let programs = tokio::task::spawn_blocking(|| (example("nats"), example("outbox_relay")))
            .await
            .expect("build the examples");
        let consumer_env = |stream: &str, subject: &str, durable: &str| {
            vec![
                ("NATS_URL", url.clone()),
                ("DATABASE_URL", database_url()),
                ("STREAM", stream.to_owned()),
                ("SUBJECT", subject.to_owned()),
                ("DURABLE", durable.to_owned()),
                ("CONSUMERS", CONSUMERS.to_owned()),
                ("PREFETCH", PREFETCH.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ]
        };
        // The consumers' last lives outlast the ack wait, to see the messages the
        // kills left unacknowledged come back.
        let hops = hops(
            &spec,
            programs,
            (
                consumer_env(&stream_in, &input, "two-hop-a"),
                consumer_env(&stream_out, &output, "two-hop-b"),
            ),
            ("DEDUP_NATS_URL", url.clone()),
            &output,
            &scale,
            NATS_ACK_WAIT + Duration::from_millis(1500),
        );
        let outcome = two_hop(&pool, &spec, hops).await;
        let last_in = settled(&mut consumer_a, &in_stream).await;
        let last_out = settled(&mut consumer_b, &out_stream).await;
        let (_, dead_in) = dead_letters(&jetstream, &stream_in).await;
        assert_eq!(
            dead_in,
            poison_bodies(),
            "A's dead-letter stream holds the poison messages and nothing else"
        );
        assert_eq!(
            dead_letters(&jetstream, &stream_out).await,
            (0, HashSet::new()),
            "B dead-lettered no event"
        );
        report_two_hop(
            "JetStream",
            &spec,
            &outcome,
            &format!(
                "both consumers: 0 pending, 0 unacknowledged, ack floors at their streams' \
                 last sequences ({last_in} in, {last_out} out: {} events + {} re-sends); \
                 dead letters: the {POISON} poison messages on A's, 0 on B's",
                events.len(),
                last_out.saturating_sub(events.len() as u64)
            ),
            started.elapsed(),
        );
    };
    let cleanup = async {
        cleanup(&jetstream, &stream_in).await;
        cleanup(&jetstream, &stream_out).await;
    };
    with_cleanup(body, cleanup).await;
    forget_two_hop(&pool, &spec).await;
}
