//! Kafka (a Kafka-protocol broker: tansu in CI): a consumer group, two hops, and the
//! other message ids.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;
use sqlx::PgPool;

use ::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use ::rdkafka::client::DefaultClientContext;
use ::rdkafka::config::ClientConfig;
use ::rdkafka::consumer::{BaseConsumer, Consumer};
use ::rdkafka::message::{Header, Message as _, OwnedHeaders};
use ::rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use ::rdkafka::util::Timeout;
use ::rdkafka::{Offset, TopicPartitionList};

use crate::checks::*;
use crate::harness::*;
use crate::two_hop::*;

/// Partitions of the harness's topic: one worker each in the consumer.
const PARTITIONS: i32 = 4;
/// The consumer's `session.timeout.ms`: a killed member's partitions are handed on
/// after this long, so that the next life is assigned them within a second or two.
const SESSION_TIMEOUT_MS: &str = "1000";
/// Each worker's records ahead of its offset commits.
const KAFKA_PREFETCH: &str = "16";

fn brokers() -> String {
    std::env::var("DEDUP_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".to_owned())
}

fn client() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers());
    config
}

/// Takes the waiting lane, after checking that something listens at the brokers'
/// address: a Kafka client retries a refused connection for minutes, and the lane
/// may be held by another Kafka harness for as long.
async fn lane() -> tokio::sync::MutexGuard<'static, ()> {
    listening(&brokers());
    WAITING.lock().await
}

/// Panics at once, saying how to start one, when nothing accepts a TCP connection at
/// any of `brokers` (comma-separated `host:port`s) within 3 s.
fn listening(brokers: &str) {
    let mut failures = Vec::new();
    for broker in brokers.split(',').map(str::trim) {
        let addresses = match broker.to_socket_addrs() {
            Ok(addresses) => addresses,
            Err(error) => {
                failures.push(format!("{broker}: {error}"));
                continue;
            }
        };
        for address in addresses {
            match TcpStream::connect_timeout(&address, Duration::from_secs(3)) {
                Ok(_) => return,
                Err(error) => failures.push(format!("{address}: {error}")),
            }
        }
    }
    panic!(
        "no Kafka-protocol broker listens at {brokers} ({}). Start one (.ci/run starts \
         tansu on 127.0.0.1:19092) or set DEDUP_TEST_KAFKA_BROKERS to where one listens",
        failures.join("; ")
    );
}

/// Panics, saying how to start one, when no Kafka-protocol broker answers.
fn reachable() {
    let probe: BaseConsumer = client().create().expect("a Kafka client");
    if let Err(error) = probe.fetch_metadata(None, Duration::from_secs(10)) {
        panic!(
            "no Kafka-protocol broker answers at {}: {error}. Start one (.ci/run starts \
             tansu on 127.0.0.1:19092) or set DEDUP_TEST_KAFKA_BROKERS",
            brokers()
        );
    }
}

/// The topic (`PARTITIONS` partitions), its dead-letter topic, and the example's
/// effects table.
async fn prepare(pool: &PgPool, topic: &str, dead: &str) {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS kafka_example_effects (message_id text NOT NULL, \
         body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .expect("create the effects table");
    let admin: AdminClient<DefaultClientContext> = client().create().expect("admin client");
    let topics = [
        NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1)),
        NewTopic::new(dead, 1, TopicReplication::Fixed(1)),
    ];
    for result in admin
        .create_topics(&topics, &AdminOptions::new())
        .await
        .expect("CreateTopics")
    {
        result.unwrap_or_else(|(topic, code)| panic!("create the topic {topic}: {code}"));
    }
}

async fn delete_topics(topic: &str, dead: &str, groups: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = client().create().expect("admin client");
    let options = AdminOptions::new();
    if let Err(error) = admin.delete_topics(&[topic, dead], &options).await {
        eprintln!("could not delete the topics {topic} and {dead}: {error}");
    }
    if let Err(error) = admin.delete_groups(groups, &options).await {
        eprintln!("could not delete the groups {groups:?}: {error}");
    }
}

/// Produces `published` round-robin over the partitions, a header `id` (when it has
/// one), the body as the value. Returns each partition's end: the offset after its
/// last record, from the delivery reports (tansu's ListOffsets answers short ends for
/// batches of several records).
async fn publish_all(topic: &str, published: &[Publish]) -> HashMap<i32, i64> {
    let producer: FutureProducer = client()
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .expect("a producer");
    let mut ends = HashMap::new();
    for (chunk_index, chunk) in published.chunks(500).enumerate() {
        let sends = chunk.iter().enumerate().map(|(k, message)| {
            let partition = ((chunk_index * 500 + k) % PARTITIONS as usize) as i32;
            let mut record = FutureRecord::<(), _>::to(topic)
                .partition(partition)
                .payload(&message.body);
            if let Some(id) = &message.id {
                record = record.headers(OwnedHeaders::new().insert(Header {
                    key: "id",
                    value: Some(id),
                }));
            }
            producer.send(record, Timeout::After(Duration::from_secs(30)))
        });
        for sent in futures_util::future::join_all(sends).await {
            let delivery = sent.unwrap_or_else(|(error, _)| panic!("produce: {error}"));
            let end = ends.entry(delivery.partition).or_insert(0);
            *end = (*end).max(delivery.offset + 1);
        }
    }
    producer
        .flush(Duration::from_secs(30))
        .expect("flush the producer");
    ends
}

/// The group's committed offset of each partition.
fn committed(group: &str, topic: &str) -> HashMap<i32, Offset> {
    let consumer: BaseConsumer = client()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut partitions = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        partitions.add_partition(topic, partition);
    }
    consumer
        .committed_offsets(partitions, Duration::from_secs(10))
        .expect("OffsetFetch")
        .elements()
        .iter()
        .map(|element| (element.partition(), element.offset()))
        .collect()
}

/// The records of the dead-letter topic (one partition), read from its start until
/// none has come for a while: their values.
fn dead_letters(dead: &str) -> Vec<String> {
    let consumer: BaseConsumer = client()
        .set("group.id", format!("{dead}.check"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut partitions = TopicPartitionList::new();
    partitions
        .add_partition_offset(dead, 0, Offset::Beginning)
        .expect("the dead-letter partition");
    consumer.assign(&partitions).expect("assign");
    let mut values = Vec::new();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(3) {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(record)) => {
                values.push(
                    String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned(),
                );
                quiet_since = Instant::now();
            }
            Some(Err(error)) => eprintln!("reading the dead letters: {error}"),
            None => {}
        }
    }
    values
}

/// The crash harness on Kafka: `examples/kafka.rs`, one consumer-group member with one
/// worker per partition (4), the offset committed after the database commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_is_effectively_once_under_sigkill() {
    harness("Kafka (tansu)", &[]).await;
}

/// Batch mode: `examples/kafka.rs` with `BATCH=16` takes up to 16 of a partition's records
/// per transaction (`dedup_runtime::batch`) and commits the offset after the batch's last
/// record once the transaction has committed; kills land between the two, with up to 16
/// records in the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_batch_consumer_is_effectively_once_under_sigkill() {
    harness("Kafka (tansu), batches of 16", &[("BATCH", "16")]).await;
}

/// The Kafka crash harness, `title` in its report, `more` in the consumer's environment.
async fn harness(title: &str, more: &[(&'static str, &str)]) {
    let _lane = lane().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("kafka");
    let topic = format!("dedup-crash-{run}");
    let dead = format!("{topic}.dead");
    let group = format!("crash-harness-{run}");
    tokio::task::spawn_blocking(reachable)
        .await
        .expect("the broker check");
    let pool = dedup_suite::postgres().await;

    let body = async {
        prepare(&pool, &topic, &dead).await;

        let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
        let ends = publish_all(&topic, &published).await;
        assert_eq!(
            ends.values().sum::<i64>(),
            published.len() as i64,
            "records in the topic after publishing (offsets start at 0 per partition)"
        );

        let mut env = vec![
            ("KAFKA_BROKERS", brokers()),
            ("DATABASE_URL", database_url()),
            ("TOPIC", topic.clone()),
            ("GROUP", group.clone()),
            ("PREFETCH", KAFKA_PREFETCH.to_owned()),
            ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
            ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
        ];
        env.extend(
            more.iter()
                .map(|(name, value)| (*name, (*value).to_owned())),
        );
        // The idle clock starts at the assignment; 1.5 s also covers the first
        // in-process retry's backoff (1 s).
        let idle = Duration::from_millis(1500);
        let under_test = Subject {
            example: "kafka",
            effects_table: "kafka_example_effects",
            consumer: "kafka-example",
        };
        let (tally, stored) =
            crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
        let (group_name, topic_name) = (group.clone(), topic.clone());
        let committed = tokio::task::spawn_blocking(move || committed(&group_name, &topic_name))
            .await
            .expect("read the committed offsets");
        for (partition, end) in &ends {
            assert_eq!(
                committed.get(partition),
                Some(&Offset::Offset(*end)),
                "partition {partition}: the group's committed offset is the partition's \
                 end, nothing left unacknowledged (all: {committed:?})"
            );
        }
        let dead_name = dead.clone();
        let dead_values = tokio::task::spawn_blocking(move || dead_letters(&dead_name))
            .await
            .expect("read the dead letters");
        let dead_bodies: HashSet<String> = dead_values.iter().cloned().collect();
        // A crash between the copy to the dead-letter topic and the offset commit
        // copies a poison message again on its redelivery: at least once each,
        // nothing else.
        assert_eq!(
            dead_bodies,
            poison_bodies(),
            "the dead-letter topic holds the poison messages and nothing else"
        );
        let ends_text = listed_ends(&ends);
        report(
            title,
            &published,
            &stored,
            &tally,
            &scale,
            dead_values.len(),
            &format!(
                "group {group}: committed offset at every partition's end ({ends_text}); \
                 {} deliveries of a record delivered before (Kafka keeps no delivery \
                 count: a record past the committed offset read again by the next \
                 life, or an in-process retry)",
                tally.reread
            ),
            started.elapsed(),
        );
    };
    with_cleanup(body, delete_topics(&topic, &dead, &[&group])).await;
    forget_run(&pool, "kafka_example_effects", "kafka-example", &run).await;
}

/// `p0 <end>, p1 <end>, …`, in partition order.
fn listed_ends(ends: &HashMap<i32, i64>) -> String {
    let mut listed: Vec<_> = ends.iter().collect();
    listed.sort();
    listed
        .iter()
        .map(|(partition, end)| format!("p{partition} {end}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The offsets of every record of `topic` (`PARTITIONS` partitions), per partition,
/// read back with Fetch from each partition's start (assigned, no group) until at
/// least `at_least` records have come and then none for 3 s. Read, not asked: tansu's
/// ListOffsets answers short ends when records came in multi-record batches, as the
/// relay's producer sends them.
fn records_in(topic: &str, at_least: usize) -> HashMap<i32, BTreeSet<i64>> {
    let consumer: BaseConsumer = client()
        .set("group.id", format!("{topic}.check"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut partitions = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        partitions
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("a partition");
    }
    consumer.assign(&partitions).expect("assign");
    let mut offsets: HashMap<i32, BTreeSet<i64>> = HashMap::new();
    let (started, mut quiet_since) = (Instant::now(), Instant::now());
    loop {
        let count: usize = offsets.values().map(BTreeSet::len).sum();
        if count >= at_least && quiet_since.elapsed() >= Duration::from_secs(3) {
            return offsets;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "only {count} records of {topic} read back in 2 minutes, at least {at_least} \
             expected"
        );
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(record)) => {
                offsets
                    .entry(record.partition())
                    .or_default()
                    .insert(record.offset());
                quiet_since = Instant::now();
            }
            Some(Err(error)) => eprintln!("reading {topic}: {error}"),
            None => {}
        }
    }
}

/// The offsets of `topic`'s records among `tally`'s deliveries (`topic/partition/offset`
/// in its `delivered` lines), per partition.
fn delivered_records(tally: &Tally, topic: &str) -> HashMap<i32, BTreeSet<i64>> {
    let mut offsets: HashMap<i32, BTreeSet<i64>> = HashMap::new();
    for record in &tally.records {
        let mut parts = record.rsplitn(3, '/');
        let (Some(offset), Some(partition), Some(name)) =
            (parts.next(), parts.next(), parts.next())
        else {
            panic!("a delivered record is `topic/partition/offset`, not {record:?}");
        };
        if name == topic {
            offsets
                .entry(partition.parse().expect("a partition"))
                .or_default()
                .insert(offset.parse().expect("an offset"));
        }
    }
    offsets
}

/// Two hops over Kafka, as [the RabbitMQ one](super::rabbitmq): A and B are
/// `examples/kafka.rs` (A with `FORWARD_TO`), each in its own group; the relay
/// publishes with `KafkaPublisher` (the event's id in the header `id`, no record key:
/// the producer picks the partition). The input topic and the events' topic have 4
/// partitions each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_two_hop_is_effectively_once_under_sigkill() {
    let _lane = lane().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("two-hop");
    let (input, output) = (
        format!("dedup-crash-{run}-in"),
        format!("dedup-crash-{run}-out"),
    );
    let (dead_in, dead_out) = (format!("{input}.dead"), format!("{output}.dead"));
    let (group_a, group_b) = (format!("two-hop-a-{run}"), format!("two-hop-b-{run}"));
    let outbox_table = dedup_suite::unique_table("two_hop_outbox");
    let forwarder = forwarding_consumer("kafka");
    tokio::task::spawn_blocking(reachable)
        .await
        .expect("the broker check");
    let pool = dedup_suite::postgres().await;
    let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
    let events = events(&published, &forwarder);
    let spec = TwoHop {
        run: &run,
        seed: scale.seed,
        published: &published,
        events: &events,
        effects_table: "kafka_example_effects",
        forwarder: &forwarder,
        consumer: "kafka-example",
        outbox_table: &outbox_table,
    };

    let body = async {
        prepare(&pool, &input, &dead_in).await;
        prepare(&pool, &output, &dead_out).await;
        two_hop_tables(&pool, &spec).await;
        let input_ends = publish_all(&input, &published).await;
        assert_eq!(
            input_ends.values().sum::<i64>(),
            published.len() as i64,
            "records in the input topic after publishing (offsets start at 0 per partition)"
        );

        let programs = tokio::task::spawn_blocking(|| (example("kafka"), example("outbox_relay")))
            .await
            .expect("build the examples");
        let consumer_env = |topic: &str, group: &str| {
            vec![
                ("KAFKA_BROKERS", brokers()),
                ("DATABASE_URL", database_url()),
                ("TOPIC", topic.to_owned()),
                ("GROUP", group.to_owned()),
                ("PREFETCH", KAFKA_PREFETCH.to_owned()),
                ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
                ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
            ]
        };
        // The idle clock starts at the assignment; 1.5 s also covers the first
        // in-process retry's backoff (1 s).
        let hops = hops(
            &spec,
            programs,
            (
                consumer_env(&input, &group_a),
                consumer_env(&output, &group_b),
            ),
            ("DEDUP_KAFKA_BROKERS", brokers()),
            &output,
            &scale,
            Duration::from_millis(1500),
        );
        let outcome = two_hop(&pool, &spec, hops).await;
        let tally_b = &outcome.b.0;

        // A: the group's committed offsets at the input's ends (from the delivery
        // reports of publish_all).
        let (group, topic) = (group_a.clone(), input.clone());
        let committed_a = tokio::task::spawn_blocking(move || committed(&group, &topic))
            .await
            .expect("read A's committed offsets");
        for (partition, end) in &input_ends {
            assert_eq!(
                committed_a.get(partition),
                Some(&Offset::Offset(*end)),
                "input partition {partition}: A's committed offset is the partition's \
                 end (all: {committed_a:?})"
            );
        }

        // B: the events' topic read back record by record — every send the broker
        // confirmed is a record of it, so at least that many — its ends taken from the
        // records (ListOffsets is not trusted: tansu answers short ends for
        // multi-record batches, and the relay's producer batches).
        let confirmed: usize = outcome.relay.sends.values().sum();
        let topic = output.clone();
        let in_output = tokio::task::spawn_blocking(move || records_in(&topic, confirmed))
            .await
            .expect("read the events' topic back");
        assert_eq!(
            delivered_records(tally_b, &output),
            in_output,
            "B was delivered every record of the events' topic (over all its lives), \
             and no other"
        );
        let output_ends: HashMap<i32, i64> = in_output
            .iter()
            .filter_map(|(partition, offsets)| Some((*partition, offsets.last()? + 1)))
            .collect();
        let (group, topic) = (group_b.clone(), output.clone());
        let committed_b = tokio::task::spawn_blocking(move || committed(&group, &topic))
            .await
            .expect("read B's committed offsets");
        for partition in 0..PARTITIONS {
            // A partition the producer never picked has no committed offset.
            let end = output_ends
                .get(&partition)
                .map_or(Offset::Invalid, |end| Offset::Offset(*end));
            assert_eq!(
                committed_b.get(&partition),
                Some(&end),
                "events' partition {partition}: B's committed offset is the partition's \
                 end (all: {committed_b:?}; ends: {output_ends:?})"
            );
        }
        let records_out: usize = in_output.values().map(BTreeSet::len).sum();

        let (dead_a, dead_b) = (dead_in.clone(), dead_out.clone());
        let (dead_in_values, dead_out_values) =
            tokio::task::spawn_blocking(move || (dead_letters(&dead_a), dead_letters(&dead_b)))
                .await
                .expect("read the dead letters");
        // A crash between the copy to the dead-letter topic and the offset commit
        // copies a poison message again: at least once each, nothing else.
        assert_eq!(
            dead_in_values.iter().cloned().collect::<HashSet<String>>(),
            poison_bodies(),
            "A's dead-letter topic holds the poison messages and nothing else"
        );
        assert_eq!(
            dead_out_values,
            Vec::<String>::new(),
            "B dead-lettered no event"
        );
        report_two_hop(
            "Kafka",
            &spec,
            &outcome,
            &format!(
                "A's group: committed offsets at the input's ends ({}); B's group: at the \
                 events' topic's ends ({}, read back: {records_out} records = {} events + \
                 {} re-sends, each delivered to B; the relay's confirmed sends: \
                 {confirmed}); records delivered again (no delivery count in Kafka): A {}, \
                 B {}; dead letters: {} on A's (the {POISON} poison messages), 0 on B's",
                listed_ends(&input_ends),
                listed_ends(&output_ends),
                events.len(),
                records_out.saturating_sub(events.len()),
                outcome.a.0.reread,
                tally_b.reread,
                dead_in_values.len(),
            ),
            started.elapsed(),
        );
    };
    let cleanup = async {
        delete_topics(&input, &dead_in, &[&group_a]).await;
        delete_topics(&output, &dead_out, &[&group_b]).await;
    };
    with_cleanup(body, cleanup).await;
    forget_two_hop(&pool, &spec).await;
}

/// One life of the example, run to its end (idle for 1.5 s after its assignment).
fn run_to_end(program: &Path, env: &[(&str, String)]) -> Tally {
    let mut env = env.to_vec();
    env.push(("DEDUP_EXIT_WHEN_IDLE_MS", "1500".to_owned()));
    let mut tally = Tally::default();
    live(program, &env, None, Duration::from_secs(60), &mut tally);
    tally
}

/// The other two `MESSAGE_ID`s of `examples/kafka.rs`. `offset`: a second group reading
/// the topic from its start (as after an offset reset) finds every record's
/// `topic/partition/offset` recorded, so all are duplicates. `key`: two records with
/// one key are one message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_message_ids_from_the_offset_and_the_key() {
    let _lane = lane().await;
    tokio::task::spawn_blocking(reachable)
        .await
        .expect("the broker check");
    // The topic is the run's name, so that `topic/partition/offset` ids fall under the
    // run's `run/` prefix like every other id of the harness.
    let run = dedup_suite::unique("kafka-ids");
    let dead = format!("{run}.dead");
    let pool = dedup_suite::postgres().await;
    let groups = [1, 2, 3].map(|n| format!("{run}-group-{n}"));
    let body = async {
        prepare(&pool, &run, &dead).await;
        // 20 records, no id header, 10 keys each on two records.
        let producer: FutureProducer = client().create().expect("a producer");
        let keys: Vec<String> = (0..20).map(|n| format!("{run}/key-{}", n % 10)).collect();
        let bodies: Vec<String> = (0..20).map(|n| format!("record-{n}")).collect();
        let sends = (0..20).map(|n| {
            let record = FutureRecord::to(&run)
                .partition(n as i32 % PARTITIONS)
                .key(&keys[n])
                .payload(&bodies[n]);
            producer.send(record, Timeout::After(Duration::from_secs(30)))
        });
        for sent in futures_util::future::join_all(sends).await {
            sent.unwrap_or_else(|(error, _)| panic!("produce: {error}"));
        }

        let program = tokio::task::spawn_blocking(|| example("kafka"))
            .await
            .expect("build the examples");
        let env = |message_id: &str, group: &str| {
            vec![
                ("KAFKA_BROKERS", brokers()),
                ("DATABASE_URL", database_url()),
                ("TOPIC", run.clone()),
                ("GROUP", group.to_owned()),
                ("MESSAGE_ID", message_id.to_owned()),
                ("SESSION_TIMEOUT_MS", SESSION_TIMEOUT_MS.to_owned()),
            ]
        };
        let runs = [
            env("offset", &groups[0]),
            env("offset", &groups[1]),
            env("key", &groups[2]),
        ];
        let [by_offset, again, by_key] =
            tokio::task::spawn_blocking(move || runs.map(|env| run_to_end(&program, &env)))
                .await
                .expect("the consumer runs");
        assert_eq!(
            (by_offset.committed, by_offset.duplicates, by_offset.dead),
            (20, 0, 0),
            "MESSAGE_ID=offset: every record is its own message"
        );
        assert_eq!(
            (again.committed, again.duplicates),
            (0, 20),
            "a second group re-reading the topic: the same offsets, all duplicates"
        );
        assert_eq!(
            (by_key.committed, by_key.duplicates, by_key.dead),
            (10, 10, 0),
            "MESSAGE_ID=key: two records per key, one message"
        );

        let stored = stored(&pool, "kafka_example_effects", "kafka-example", &run).await;
        let offsets = stored
            .effects
            .keys()
            .filter(|id| !id.contains("/key-"))
            .count();
        assert_eq!(
            offsets, 20,
            "effects of 20 offset ids: {:?}",
            stored.effects
        );
        assert!(
            stored.effects.values().all(|rows| *rows == 1),
            "each id's effect once: {:?}",
            stored.effects
        );
        assert_eq!(
            (stored.effects.len(), stored.dedup_rows),
            (30, 30),
            "20 offset ids and 10 key ids, each with one effect and one dedup row"
        );
    };
    let group_names = groups.each_ref().map(String::as_str);
    with_cleanup(body, delete_topics(&run, &dead, &group_names)).await;
    forget_run(&pool, "kafka_example_effects", "kafka-example", &run).await;
}
