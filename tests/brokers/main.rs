//! Real brokers, real crashes: the consumers of `examples/rabbitmq.rs`,
//! `examples/nats.rs`, `examples/kafka.rs`, `examples/redis_streams.rs` and
//! `examples/mqtt.rs`, run as child processes and killed with SIGKILL again and again,
//! still apply every message's effect exactly once.
//!
//! For each broker the harness publishes 5,000 messages, 500 of them a second time (a
//! separate broker message with the same message id: the broker cannot know, dedup must
//! catch it) and 5 poison messages without an id. It then starts the example consumer
//! (4 consumers, prefetch 16, 10 ms between COMMIT and the acknowledgement) and kills it
//! 60 times, each time at a moment drawn at random from three kinds:
//!
//! - **start-up**: 0–400 ms after the process started (it is ready after about 100 ms), so
//!   many die while connecting, migrating or declaring, the rest in their first messages;
//! - **commit**: the moment the consumer reports `committed <id>`, i.e. inside the window
//!   between the COMMIT and the acknowledgement, the crash that at-least-once brokers turn
//!   into a redelivery of a message whose effect is already applied;
//! - **anywhere**: a few milliseconds after a random line of output: in a transaction, in
//!   an acknowledgement, between deliveries.
//!
//! A life whose moment does not come within 3 s of its `ready` line (a Kafka member's
//! first assignment, a second or so after its start) is killed then.
//!
//! After each kill it restarts the consumer; after the last, it lets one run until the
//! queue has been idle for a while and the process exits by itself. Then it checks, against
//! PostgreSQL and the broker: one effect row for every published id and no other, dedup
//! rows equal unique ids, the queue empty with nothing unacknowledged, the poison
//! messages (and only they) dead-lettered. It prints what it saw: kills, the kills that
//! caught a message between COMMIT and acknowledgement, redeliveries, duplicates.
//!
//! **Batches** (`rabbitmq_batch_…`, `nats_batch_…`, `kafka_batch_…`,
//! `redis_streams_batch_…`): the same harness with the examples in batch mode (`BATCH=16`:
//! up to 16 deliveries per transaction through `dedup_runtime::batch`, one claim statement
//! and one commit for all; on RabbitMQ one multiple-ack, on Kafka one offset commit per
//! batch, the offset after its last record, on Redis one `XACK` for the batch's entries),
//! so that a kill between the commit and the acknowledgements catches up to 16 messages at
//! once. The checks are the single-message harness's for the same broker.
//!
//! **Two hops** (`rabbitmq_two_hop_…`, `nats_two_hop_…`, `kafka_two_hop_…`): the same
//! input, consumed by service A (the example with `FORWARD_TO`: its `#[idempotent]`
//! transaction writes the effect and enqueues an event for B in the outbox, the event's id
//! derived from the input's); the relay (`examples/outbox_relay.rs`, a 1 s lease, each
//! claim sent at once through the publisher's `publish_batch`, a 5 ms pause after each
//! batch of sends) publishes the events to a second queue, stream or topic; service B (the
//! plain example) consumes them. A, the relay and B are killed side by side, 60 SIGKILLs
//! in all (24, 18, 18; the relay's on-commit kills land right after a `sent` line, i.e.
//! after its batch's sends and before their mark, so the whole claim is sent again; the
//! relay's and B's kills are drawn over the backlog left to them upstream, as they can get
//! no further, and A's and B's within what their lives have been seen to reach), then each
//! runs to the end in turn. The checks: every input's effect exactly once in A, every
//! event sent and its effect exactly once in B, no event lost or dead, the relay sent some
//! events twice and B took each re-send for a duplicate. (JetStream would drop a re-send
//! within its duplicate window by `Nats-Msg-Id`; the events' stream has the least, 100 ms,
//! so that every re-send reaches B. On Kafka the relay's producer is idempotent, which
//! drops only its own retries within one producer session: a re-send from a later life is
//! a new record.)
//!
//! The crate feature `brokers` builds it (and the examples it runs): `cargo test --features
//! brokers --test brokers`, or `--all-features` as CI does. Larger runs:
//! `DEDUP_CRASH_MESSAGES=50000 DEDUP_CRASH_KILLS=500 cargo test --features brokers --test brokers`.
//! `DEDUP_CRASH_SEED` fixes the random choices (the timing of a real crash is not
//! reproducible, the plan is). The services are the machine's: RabbitMQ on
//! 127.0.0.1:5672 (`DEDUP_TEST_AMQP_URL`), NATS with JetStream on 127.0.0.1:4222
//! (`DEDUP_TEST_NATS_URL`), a Kafka-protocol broker on 127.0.0.1:19092
//! (`DEDUP_TEST_KAFKA_BROKERS`; `.ci/run` starts tansu there), Redis on 127.0.0.1:6379
//! (`DEDUP_TEST_REDIS_URL`), PostgreSQL as for the other tests; the MQTT harness starts a
//! Mosquitto of its own. A broker that cannot be reached fails its test: nothing skips.
//!
//! The harnesses run two at a time, in two lanes (`harness::BUSY` and
//! `harness::WAITING`): one that keeps the CPU busy (RabbitMQ, NATS, Redis, MQTT) beside
//! one of the Kafka ones, which mostly wait for their group's rebalances.
//!
//! **Kafka** (`kafka_…`): a topic of 4 partitions, the records spread round-robin over
//! them; one consumer-group member with a worker per partition, a 1 s session timeout
//! (a killed member's partitions go to the next life about a second later). Kafka keeps
//! no delivery count: the harness counts a record (`topic/partition/offset`) delivered
//! again after a kill itself. The checks: the group's committed offset of every
//! partition at its end (from the delivery reports: tansu's ListOffsets answers short
//! ends for multi-record batches), and the dead-letter topic holding the poison messages
//! and nothing else. In the two-hop run the relay's producer picks the events' partitions
//! (they have no ordering key), so the ends of the events' topic are read back after the
//! run, record by record (Fetch): B's group must have committed each, and B must have been
//! delivered every record of it; A's dead-letter topic holds the poison messages and
//! nothing else, B's nothing.

// The machinery every harness shares.
mod checks;
mod harness;
mod two_hop;

// One module per broker, its tests named `<broker>::<test>`.
mod kafka;
mod mqtt;
mod nats;
mod rabbitmq;
mod redis;

/// libtest runs as many tests at once as the machine has cores unless told otherwise,
/// taking them in name order, and a test waiting for its lane holds one of those slots:
/// on two cores the first two tests by name, both Kafka's, would take both slots, the
/// second waiting for the first's lane, and the busy lane would stay empty for the whole
/// of the first Kafka harness. So, before libtest reads it, this binary asks for more
/// test threads than it has tests (they wait in their lanes, costing a sleeping thread
/// each), unless `RUST_TEST_THREADS` is set; `--test-threads` still overrides it.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static TEST_THREADS: extern "C" fn() = {
    extern "C" fn enough_test_threads() {
        if std::env::var_os("RUST_TEST_THREADS").is_none() {
            // SAFETY: before `main`, no other thread reads or writes the environment.
            unsafe { std::env::set_var("RUST_TEST_THREADS", "16") };
        }
    }
    enough_test_threads
};
