//! RabbitMQ: the plain, batch and inbox consumers, and two hops through the outbox relay.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::checks::*;
use crate::harness::*;
use crate::two_hop::*;

fn amqp_url() -> String {
    std::env::var("DEDUP_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Messages ready in `queue` and its consumers.
async fn depth(channel: &Channel, queue: &str) -> (u32, u32) {
    let queue = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable().passive(),
            FieldTable::default(),
        )
        .await
        .expect("inspect the queue");
    (queue.message_count(), queue.consumer_count())
}

async fn cleanup(connection: &Connection, queue: &str) {
    let Ok(channel) = connection.create_channel().await else {
        eprintln!("could not open a channel to delete {queue}");
        return;
    };
    for name in [queue.to_owned(), format!("{queue}.dead")] {
        if let Err(error) = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
        {
            eprintln!("could not delete the queue {name}: {error}");
        }
    }
    let dlx = format!("{queue}.dlx");
    if let Err(error) = channel
        .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
        .await
    {
        eprintln!("could not delete the exchange {dlx}: {error}");
    }
}

/// A consumer example the RabbitMQ harness runs.
struct Variant {
    /// `== <title>: crash harness`.
    title: &'static str,
    example: &'static str,
    effects_table: &'static str,
    create_effects: &'static str,
    /// Where its dedup rows are: `processed_messages`, or the inbox's table.
    dedup_table: &'static str,
    consumer: &'static str,
    /// More environment for the example.
    env: &'static [(&'static str, &'static str)],
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumer_is_effectively_once_under_sigkill() {
    harness(&Variant {
        title: "RabbitMQ",
        example: "rabbitmq",
        effects_table: "rabbitmq_example_effects",
        create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_example_effects (message_id \
                         text NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                         DEFAULT now())",
        dedup_table: "processed_messages",
        consumer: "rabbitmq-example",
        env: &[],
    })
    .await;
}

/// Batch mode: `examples/rabbitmq.rs` with `BATCH=16` takes up to 16 deliveries per
/// transaction (`dedup_runtime::batch`: one claim statement, one multi-row insert, one
/// commit) and acknowledges them with one multiple-ack; kills land between that
/// commit and the ack, with up to 16 messages in the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_batch_consumer_is_effectively_once_under_sigkill() {
    harness(&Variant {
        title: "RabbitMQ, batches of 16",
        example: "rabbitmq",
        effects_table: "rabbitmq_example_effects",
        create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_example_effects (message_id \
                         text NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                         DEFAULT now())",
        dedup_table: "processed_messages",
        consumer: "rabbitmq-example",
        env: &[("BATCH", "16")],
    })
    .await;
}

/// The inbox in front: `examples/rabbitmq_inbox.rs` stores each delivery and
/// acknowledges it at once, its workers process the inbox (2 workers, a 2 s lease);
/// kills land between the inbox's commit and the acknowledgement, and in workers'
/// transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_inbox_consumer_is_effectively_once_under_sigkill() {
    harness(&Variant {
        title: "inbox (RabbitMQ)",
        example: "rabbitmq_inbox",
        effects_table: "rabbitmq_inbox_effects",
        create_effects: "CREATE TABLE IF NOT EXISTS rabbitmq_inbox_effects (message_id text \
                         NOT NULL, body text NOT NULL, applied_at timestamptz NOT NULL \
                         DEFAULT now())",
        dedup_table: "inbox_messages",
        consumer: "rabbitmq-inbox-example",
        env: &[("WORKERS", "2"), ("LEASE_MS", "2000")],
    })
    .await;
}

/// Publishes `published` to `queue` with publisher confirms.
async fn publish_all(channel: &Channel, queue: &str, published: &[Publish]) {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("enable publisher confirms");
    for message in published {
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = &message.id {
            properties = properties.with_message_id(id.as_str().into());
        }
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                message.body.as_bytes(),
                properties,
            )
            .await
            .expect("publish");
    }
    let returned = channel
        .wait_for_confirms()
        .await
        .expect("publisher confirms");
    assert!(
        returned.is_empty(),
        "the broker returned {} messages",
        returned.len()
    );
    assert_eq!(
        depth(channel, queue).await,
        (published.len() as u32, 0),
        "queue depth after publishing"
    );
}

/// The bodies in `queue`'s dead-letter queue (read off it), and how many there were.
async fn dead_letters(channel: &Channel, queue: &str) -> (usize, HashSet<String>) {
    let dead = format!("{queue}.dead");
    let (count, _) = depth(channel, &dead).await;
    let mut bodies = HashSet::new();
    while let Some(message) = channel
        .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("read the dead-letter queue")
    {
        bodies.insert(String::from_utf8_lossy(&message.delivery.data).into_owned());
    }
    (count as usize, bodies)
}

/// Two hops over RabbitMQ: A (`examples/rabbitmq.rs` with `FORWARD_TO`) consumes the
/// input queue, writes its effect and enqueues an event in one `#[idempotent]`
/// transaction; the relay (`examples/outbox_relay.rs`) publishes the events to a
/// second queue; B (`examples/rabbitmq.rs`) consumes them. All three are killed at
/// random, side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_two_hop_is_effectively_once_under_sigkill() {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("two-hop");
    let (input, output) = (
        format!("dedup-crash.{run}.in"),
        format!("dedup-crash.{run}.out"),
    );
    let outbox_table = dedup_suite::unique_table("two_hop_outbox");
    let forwarder = forwarding_consumer("rabbitmq");
    let url = amqp_url();
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|error| {
            panic!(
                "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                 -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
            )
        });
    let pool = dedup_suite::postgres().await;
    let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
    let events = events(&published, &forwarder);
    let spec = TwoHop {
        run: &run,
        seed: scale.seed,
        published: &published,
        events: &events,
        effects_table: "rabbitmq_example_effects",
        forwarder: &forwarder,
        consumer: "rabbitmq-example",
        outbox_table: &outbox_table,
    };

    let body = async {
        let channel = connection.create_channel().await.expect("open a channel");
        dedup_suite::rabbitmq::declare(&channel, &input, false).await;
        dedup_suite::rabbitmq::declare(&channel, &output, false).await;
        two_hop_tables(&pool, &spec).await;
        publish_all(&channel, &input, &published).await;

        let programs =
            tokio::task::spawn_blocking(|| (example("rabbitmq"), example("outbox_relay")))
                .await
                .expect("build the examples");
        let consumer_env = |queue: &str| {
            vec![
                ("AMQP_URL", url.clone()),
                ("DATABASE_URL", database_url()),
                ("QUEUE", queue.to_owned()),
                ("CONSUMERS", CONSUMERS.to_owned()),
                ("PREFETCH", PREFETCH.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ]
        };
        let hops = hops(
            &spec,
            programs,
            (consumer_env(&input), consumer_env(&output)),
            ("DEDUP_AMQP_URL", url.clone()),
            &output,
            &scale,
            Duration::from_millis(1500),
        );
        let outcome = two_hop(&pool, &spec, hops).await;
        for queue in [&input, &output] {
            assert_eq!(
                depth(&channel, queue).await,
                (0, 0),
                "messages and consumers left on {queue}"
            );
        }
        assert_eq!(
            dead_letters(&channel, &input).await,
            (POISON, poison_bodies()),
            "A's dead-letter queue holds the poison messages, once each, and nothing else"
        );
        assert_eq!(
            dead_letters(&channel, &output).await,
            (0, HashSet::new()),
            "B dead-lettered no event"
        );
        report_two_hop(
            "RabbitMQ",
            &spec,
            &outcome,
            &format!(
                "both queues empty (0 ready, 0 unacknowledged, 0 consumers); dead letters: \
                 {POISON} on A's (the poison messages), 0 on B's"
            ),
            started.elapsed(),
        );
    };
    let cleanup = async {
        cleanup(&connection, &input).await;
        cleanup(&connection, &output).await;
    };
    with_cleanup(body, cleanup).await;
    forget_two_hop(&pool, &spec).await;
    connection.close(200, "done".into()).await.ok();
}

async fn harness(variant: &Variant) {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("rabbitmq");
    let queue = format!("dedup-crash.{run}");
    let url = amqp_url();
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|error| {
            panic!(
                "RabbitMQ is not reachable at {url}: {error}. Start it (`rabbitmq-server \
                 -detached`, or `bash .ci/run`) or set DEDUP_TEST_AMQP_URL"
            )
        });
    let pool = dedup_suite::postgres().await;

    let body = async {
        let channel = connection.create_channel().await.expect("open a channel");
        dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
        dedup_suite::ddl(&pool, variant.create_effects).await;

        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        publish_all(&channel, &queue, &published).await;

        let name = variant.example;
        let program = tokio::task::spawn_blocking(move || example(name))
            .await
            .expect("build the examples");
        let mut env = vec![
            ("AMQP_URL", url.clone()),
            ("DATABASE_URL", database_url()),
            ("QUEUE", queue.clone()),
            ("CONSUMERS", CONSUMERS.to_owned()),
            ("PREFETCH", PREFETCH.to_owned()),
            ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
        ];
        env.extend(
            variant
                .env
                .iter()
                .map(|(name, value)| (*name, (*value).to_owned())),
        );
        let tally = {
            let scale = scale.clone();
            tokio::task::spawn_blocking(move || {
                crash_loop(&program, &env, &scale, Duration::from_millis(1500))
            })
            .await
            .expect("the crash loop")
        };

        let stored = stored_in(
            &pool,
            variant.effects_table,
            variant.dedup_table,
            variant.consumer,
            &run,
        )
        .await;
        check(&published, &stored, &tally, &scale);
        // The last consumer closed its channels cleanly: anything it had not
        // acknowledged would be back in the queue.
        let (ready, consumers) = depth(&channel, &queue).await;
        assert_eq!(
            (ready, consumers),
            (0, 0),
            "messages and consumers left on the queue"
        );
        let (dead_count, dead_bodies) = dead_letters(&channel, &queue).await;
        assert_eq!(
            (dead_count, dead_bodies),
            (POISON, poison_bodies()),
            "the dead-letter queue holds the poison messages, once each, and nothing else"
        );
        report(
            variant.title,
            &published,
            &stored,
            &tally,
            &scale,
            POISON,
            "queue empty (0 ready, 0 unacknowledged, 0 consumers)",
            started.elapsed(),
        );
    };
    with_cleanup(body, cleanup(&connection, &queue)).await;
    forget_run_in(
        &pool,
        variant.effects_table,
        variant.dedup_table,
        variant.consumer,
        &run,
    )
    .await;
    connection.close(200, "done".into()).await.ok();
}
