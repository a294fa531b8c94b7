//! Effectively-once message consumers for sqlx.
//!
//! Brokers deliver at least once, so a consumer sees some messages twice. The cure is to
//! record each processed message id **in the same database transaction as the work**: the
//! record and the effect commit together or not at all, and a second copy finds the record
//! and does nothing. [`idempotent`] turns a handler into exactly that.
//!
//! ```no_run
//! use dedup_runtime::{Outcome, idempotent};
//! use sqlx::PgConnection;
//!
//! struct PaymentReceived {
//!     id: String,
//!     order_id: i64,
//! }
//!
//! #[idempotent(consumer = "billing", key = msg.id)]
//! async fn mark_paid(tx: &mut PgConnection, msg: &PaymentReceived) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
//!         .bind(msg.order_id)
//!         .execute(&mut *tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn run(pool: sqlx::PgPool, msg: PaymentReceived) -> Result<(), sqlx::Error> {
//! dedup_runtime::migrate(&pool).await?;
//! match mark_paid(&pool, &msg).await? {
//!     Outcome::Processed(()) => println!("paid"),
//!     Outcome::Duplicate(_) => println!("seen before"),
//! }
//! // Either way: acknowledge the message.
//! # Ok(()) }
//! ```
//!
//! # Map of the crate
//!
//! | where | what for |
//! | --- | --- |
//! | [`idempotent`], [`Outcome`], [`migrate`] | the attribute, what a call returns, the dedup table |
//! | [`MessageKey`], [`InvalidMessageId`] | message ids: what a `key = …` may be, and what is refused |
//! | [`Lease`], [`LeaseOutcome`], [`IdempotencyKey`] | effects outside the database: send-first, mark-first, leases, keys for the provider |
//! | [`StoredOutcome`] | stored results and fingerprints (`result = "stored"`, `fingerprint = …`) |
//! | [`batch`] | batch handlers (`#[idempotent(batch = …)]`): many messages, one transaction |
//! | [`AckPolicy`], [`Ack`] | what to tell the broker after a call |
//! | [`consume`] | what every hosted consumer shares: [`consume::Message`], the shutdown, the errors |
//! | [`lapin`], [`async_nats`], [`rdkafka`], [`redis`], [`rumqttc`] | one module per broker client: its hosted consumer and the outbox's publisher |
//! | [`http`] | HTTP idempotency keys: an `Idempotency-Key` layer for axum, the key claimed in the handler's transaction |
//! | [`inbox`] | store incoming messages, acknowledge at once, process them with workers |
//! | [`outbox`] | messages written in the handler's transaction, published after the commit by a relay |
//! | [`Prune`], [`Ledger`] | the operator's tools: prune old ids, look one up, forget it, resolve unknown outcomes |
//! | [`operate`] | the operator's dead inbox and outbox rows: list, requeue or discard a selection or everything a filter matches (the `dedup` command and console run on it) |
//!
//! The guide, in the repository under [`guide/`][guide], has a chapter per concern.
//!
//! # Features
//!
//! | feature | brings |
//! | --- | --- |
//! | `postgres`, `sqlite`, `mysql` | the backends (MySQL and MariaDB are `mysql`); the handler's first parameter picks one |
//! | `uuid` | [`MessageKey`] for `uuid::Uuid` |
//! | `serde` | stored results (`result = "stored"`), encoded with postcard |
//! | `metrics` | counters and latency histograms through the `metrics` facade (the [guide][metrics] lists their names and labels) |
//! | `lapin` | RabbitMQ: [`lapin::RabbitMqConsumer`], the outbox's publisher, `delivery_count` and `settle` |
//! | `async-nats` | NATS JetStream: [`async_nats::JetStreamConsumer`], the outbox's publisher, `delivery_count` and `settle` |
//! | `rdkafka` | Kafka: [`rdkafka::KafkaConsumer`] and the outbox's publisher (builds librdkafka with the C compiler) |
//! | `redis` | Redis Streams: [`redis::RedisStreamsConsumer`] and the outbox's publisher |
//! | `rumqttc` | MQTT 5: [`rumqttc::MqttConsumer`] and the outbox's publisher |
//! | `axum` | HTTP idempotency keys: [`http::IdempotencyLayer`] and [`http::IdempotentRequest`] (brings `serde`) |
//!
//! # Backends
//!
//! | | claim statement | concurrent copies | transient failures retried |
//! | --- | --- | --- | --- |
//! | PostgreSQL | `INSERT … ON CONFLICT DO NOTHING` | wait on the primary key | `40001`, `40P01`, `55P03` |
//! | SQLite | `INSERT … ON CONFLICT DO NOTHING` after `BEGIN IMMEDIATE` | wait for the write lock | `SQLITE_BUSY`, `SQLITE_LOCKED` |
//! | MySQL / MariaDB | `INSERT`; error 1062 on it is the duplicate | wait on the primary key | 1205, 1213 |
//!
//! # The dedup table
//!
//! `processed_messages(consumer, message_id, processed_at, state, owner, expires_at)`,
//! primary key `(consumer, message_id)`, an index on `processed_at` for pruning by age.
//! `state`, `owner` and `expires_at` are NULL for a processed id (every plain handler's
//! claim); they describe a claim not processed yet (in progress until `expires_at`, or
//! outcome unknown), which pruning keeps and the ledger does not report as processed.
//! [`migrate`] creates the table, or upgrades one an earlier migration created in place; [`schema_sql`],
//! [`upgrade_sql`] and the files under [`migrations/`][migrations] (in this crate's
//! package too) give the same SQL for your own migration tool. Ids compare byte for byte
//! on every backend.
//!
//! # Acknowledging to a broker
//!
//! Both outcomes mean *acknowledge*; an error means the transaction left nothing behind,
//! and [`AckPolicy`] says whether a redelivery is worth it: a transient failure (the
//! database contended or unreachable) → [`Ack::Retry`] after a growing delay, anything
//! else (an invalid id first of all) → [`Ack::DeadLetter`]. The broker call is yours:
//!
//! ```no_run
//! # use dedup_runtime::{Ack, AckPolicy, Outcome};
//! # async fn handle(_: &sqlx::PgPool, _: &str) -> Result<Outcome<()>, sqlx::Error> { todo!() }
//! # async fn run(pool: sqlx::PgPool, id: String, delivered: u64) {
//! let policy = AckPolicy::<sqlx::Postgres>::new();
//! let result = handle(&pool, &id).await;
//! match policy.decide(&result, delivered) {
//!     Ack::Ack => { /* basic_ack, AckKind::Ack … */ }
//!     Ack::Retry { after } => { /* nack for redelivery after `after` */ }
//!     Ack::DeadLetter => { /* reject without requeue, AckKind::Term … */ }
//! }
//! # }
//! ```
//!
//! The repository's [`examples/rabbitmq.rs`][rabbitmq] (lapin) and
//! [`examples/nats.rs`][nats] (async-nats, JetStream) are complete consumers, with manual
//! acknowledgements and dead-lettering. With the feature `lapin` or `async-nats`, the
//! modules `lapin` and `async_nats` give the 1-based delivery count `decide` takes and a
//! `settle` that makes the broker call.
//!
//! # Effects outside the database
//!
//! An email or a partner's API is never atomic with the transaction. Derive the
//! provider's idempotency key from the message id with [`IdempotencyKey`]
//! (`IdempotencyKey::new("receipt", &msg.id)` is `receipt:<id>` on every delivery), and
//! declare the risk the handler takes: `effect = "send-first"` lets the body leave its
//! connection unused, and a crash between the call and the `COMMIT` repeats the call on
//! redelivery, which the key makes the provider drop; `effect = "mark-first"` commits the
//! mark first, and a crash before the call completes loses the call — visibly: the row
//! stays "outcome unknown", listed by [`Ledger::unresolved`]. With `lease = "30s"`
//! (always with mark-first) the call runs with no transaction open, under a [`Lease`]
//! fenced by an owner token on the database's clock. The [`idempotent`] docs give each
//! crash window.
//!
//! # The operator's tools
//!
//! [`Ledger`] answers "was this id processed, and when?" and forgets one id on purpose,
//! so that its next delivery runs the handler again (a replay after a fix):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dedup_runtime::LedgerError> {
//! # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
//! #     .connect("sqlite::memory:").await?;
//! # dedup_runtime::migrate(&pool).await?;
//! let ledger = dedup_runtime::Ledger::new(&pool);
//! assert_eq!(ledger.processed_at("billing", "evt_91c2").await?, None);
//! assert!(!ledger.forget("billing", "evt_91c2").await?);
//! # Ok(()) }
//! ```
//!
//! # Pruning
//!
//! A processed id must be kept as long as the broker can redeliver its message: deleted
//! earlier, a redelivery becomes a second effect. [`Prune`] deletes ids older than an age
//! in short batches while consumers keep running, and refuses
//! ([`PruneError::WindowTooShort`]) an age shorter than the redelivery window you declare:
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), dedup_runtime::PruneError> {
//! use std::time::Duration;
//!
//! const DAY: Duration = Duration::from_secs(24 * 60 * 60);
//! // The broker may redeliver for up to 2 days; keep a week.
//! let done = dedup_runtime::Prune::new(7 * DAY, 2 * DAY)
//!     .run(&pool, |progress| eprintln!("{} deleted, {:.0}/s", progress.deleted, progress.rate()))
//!     .await?;
//! println!("{} ids older than {} deleted", done.deleted, done.cutoff);
//! # Ok(()) }
//! ```
//!
//! The same `Prune` prunes an inbox's processed rows ([`Prune::run_inbox`]) and an
//! outbox's sent ones ([`Prune::run_outbox`]), with the same refusals, batches and rests.
//! The `dedup` command (the workspace's crate [`dedup-cli`][cli], `cargo install --path
//! dedup-cli` in a clone) is an operator's tool for the same — `dedup prune` with
//! per-consumer counts, a dry run and a progress bar, `dedup inbox prune`, `dedup outbox
//! prune` — and for the dead rows ([`operate`]) behind its web console, `dedup console`.
//!
//! # The shape of this crate's types
//!
//! Every type follows the same few rules, so that what you learn on one holds on all:
//!
//! - **Values own what they need.** [`Ledger`], [`inbox::Inbox`], [`inbox::Worker`] and
//!   [`outbox::Relay`] keep a clone of the pool you give them (`&pool`; a sqlx `Pool` is a
//!   handle, cheap to clone): build one at start-up and clone it, or move it, into as many
//!   tasks as you like.
//! - **`new` takes what is required** and checks it: `Inbox::new(&pool, consumer)?`,
//!   `Batch::new(consumer)?` return the typed error of what they check
//!   ([`InvalidConsumer`]); `Outbox::new()`, `Ledger::new(&pool)` and
//!   `Prune::new(older_than, redelivery_window)` check nothing, and cannot fail.
//! - **Settings are methods named after what they set**, taking and returning the value,
//!   so that they chain: `.max_payload_len(n)`, `.lease(d)`, `.batch_size(n)`. They cannot
//!   fail, with one exception, the same on every type: **another table is
//!   `.in_table(name)?`**, checked where you write it ([`InvalidTableName`]).
//! - **Getters are the bare noun**: `.table()`, `.consumer()`.
//! - **Out-of-range values**: a setting that could cost a message is refused with a typed
//!   error before anything runs — [`Prune`] checks its age against the redelivery window,
//!   and its batch size at [`check`](Prune::check) / [`run`](Prune::run); the
//!   tuning knobs of the long-running [`inbox::Worker`] and [`outbox::Relay`] (lease,
//!   batch, poll interval…) are clamped into their documented range instead, so that a
//!   configuration typo never stops a consumer.
//! - **Errors** are an enum per concern ([`LedgerError`], [`PruneError`],
//!   [`inbox::InboxError`], [`outbox::OutboxError`]), `#[non_exhaustive]`; each names the
//!   table as a [`Table`], and the database's own error is its `source()`. What a
//!   message was refused for before anything was written is `Refused` in the concern's
//!   module ([`inbox::Refused`], [`outbox::Refused`]).
//!
//! `docs/public-api.txt` in the repository lists
//! the whole public API; a test keeps it exact, so every change to it shows in review.
//!
//! [metrics]: https://github.com/dedup-rs/dedup/blob/main/guide/src/operating.md#metrics
//! [guide]: https://github.com/dedup-rs/dedup/tree/main/guide/src
//! [migrations]: https://github.com/dedup-rs/dedup/tree/main/dedup-runtime/migrations
//! [rabbitmq]: https://github.com/dedup-rs/dedup/blob/main/examples/rabbitmq.rs
//! [nats]: https://github.com/dedup-rs/dedup/blob/main/examples/nats.rs
//! [cli]: https://github.com/dedup-rs/dedup/tree/main/dedup-cli

#![deny(missing_docs)]
// On docs.rs (nightly, `--cfg docsrs`): a badge naming the feature each feature-gated item
// needs. `doc_cfg` derives them from the items' `#[cfg]`s (it absorbed `doc_auto_cfg`).
#![cfg_attr(docsrs, feature(doc_cfg))]

// Where things are (a concern with SQL has one trait, and one file per backend under the
// directory of its name; `backend.rs` joins the concerns into `Backend`):
//
//   backend.rs      `Backend`: a supported database as the sum of its concerns' traits
//   run.rs          one call of a generated handler: begin, claim, body, commit, retry
//   lease/          leased calls (`effect = "mark-first"`, send-first with `lease`): the
//                   fenced claim, renewal and completion outside a transaction (`Lease`)
//   inbox/          technique 3: store incoming messages, acknowledge at once, process
//                   later with workers (`Inbox`, `Worker`)
//   outbox/         outgoing messages written in the handler's transaction, published
//                   after the commit by a relay (`Outbox`, `Relay`, the publishers)
//   queue.rs        what the inbox's workers and the outbox's relay share: heartbeat,
//                   shutdown, backoff, retries of statements that changed nothing
//   consumers.rs    the debug-build warning for two handlers sharing one consumer name
//   features.rs     one clear error for a handler on a backend whose feature is off
//   private.rs      what the generated code calls (`__private`), and nothing else
//   input.rs        what callers pass (`Db`: pool, connection, transaction) and what a
//                   handler declares as its connection (`HandlerConnection`)
//   claim/          begin, claim the message id, the checked commit, rollback, per backend
//   batch/          N messages: their ids claimed in one statement, one body, one commit,
//                   poison isolated by splitting (`Batch`)
//   classify/       what an error means: transient, unique violation, database away
//   chain.rs        the one walk along an error's sources, for every classification
//   schema/         the dedup table: its name (`Table`), each backend's DDL and its upgrade
//   migrate.rs      `migrate`, `migrate_table`, `schema_sql`, `upgrade_sql`
//   prune/          deleting old processed ids, never before the redelivery window ends
//   ledger/         the operator's lookup and forget of one id (`Ledger`)
//   ack.rs          what to tell the broker (`AckPolicy`)
//   lapin.rs, async_nats.rs  the broker side of `Ack`: delivery counts and settling, on
//                   RabbitMQ and NATS JetStream (features `lapin`, `async-nats`), their
//                   outbox publishers and hosted consumers (`lapin/`, `async_nats/`)
//   rdkafka.rs      the outbox's Kafka publisher (feature `rdkafka`)
//   redis.rs, redis/  Redis Streams (feature `redis`): the outbox's publisher, and the
//                   hosted consumer (`redis/consumer.rs`)
//   rumqttc.rs, rumqttc/  MQTT (feature `rumqttc`): the outbox's publisher, and the hosted
//                   consumer (`rumqttc/consumer.rs`)
//   metrics.rs      counters and a latency histogram (feature `metrics`)
//   idempotency.rs  keys for effects outside the database (`IdempotencyKey`)
//   key.rs          message ids (`MessageKey`) and the ids refused (`InvalidMessageId`)
//   stored.rs       stored results and payload fingerprints (`result = "stored"`,
//                   `fingerprint = …`; the codec behind feature `serde`)
//   outcome.rs, retry.rs, rolled_back.rs, probe.rs: outcomes, backoff, `RolledBack`,
//                   seeing the database error inside the handler's error type
//   dedup-limits    (a crate) the limits the attribute and the runtime share
mod ack;
#[cfg(feature = "async-nats")]
pub mod async_nats;
mod backend;
pub mod batch;
mod chain;
mod claim;
mod classify;
mod clock;
pub mod consume;
mod consumers;
mod dialect;
mod features;
mod guarded;
#[cfg(feature = "axum")]
pub mod http;
mod idempotency;
pub mod inbox;
mod input;
mod key;
#[cfg(feature = "lapin")]
pub mod lapin;
mod lease;
mod ledger;
mod metrics;
mod migrate;
mod names;
mod offsets;
pub mod operate;
pub mod outbox;
mod outcome;
mod probe;
mod prune;
mod queue;
mod random;
#[cfg(feature = "rdkafka")]
pub mod rdkafka;
#[cfg(feature = "redis")]
pub mod redis;
mod retry;
mod rolled_back;
#[cfg(feature = "rumqttc")]
pub mod rumqttc;
mod run;
mod schema;
mod stored;
mod table;
mod wake;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

/// This crate's README (the page crates.io shows), compiled as a doctest.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use ack::{Ack, AckOutcome, AckPolicy, DecideError, Failure, is_transient};
pub use backend::Backend;
pub use clock::STAMP_AFTER;
pub use idempotency::{IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
pub use input::{Db, HandlerConnection};
pub use key::{InvalidMessageId, MAX_CONSUMER_LEN, MAX_MESSAGE_ID_LEN, MessageId, MessageKey};
pub use lease::{DEFAULT_MARK_LEASE, Lease, LeaseLost, MAX_LEASE, MIN_LEASE};
pub use ledger::{Ledger, LedgerError, Resolution, Unresolved, UnresolvedStatus};
pub use migrate::{migrate, migrate_table, schema_sql, upgrade_sql};
pub use names::InvalidConsumer;
pub use outcome::{Duplicate, InProgress, LeaseOutcome, Outcome, StoredOutcome};
pub use prune::{
    ConsumerStats, DEFAULT_PRUNE_BATCH, MAX_PRUNE_AGE, MAX_PRUNE_BATCH, Prune, PruneError,
    PruneProgress,
};
pub use retry::{BASE_DELAY, MAX_ATTEMPTS, MAX_DELAY};
pub use rolled_back::RolledBack;
pub use stored::{
    DEFAULT_MAX_RESULT_LEN, Fingerprint, FingerprintMismatch, FingerprintSource, MAX_RESULT_LEN,
    MAX_RESULT_VERSION, StoredResultError, fingerprint,
};
pub use table::{DEFAULT_TABLE, InvalidTableName, MAX_TABLE_NAME_LEN, Table};

// The attribute's manual: `docs/idempotent.md`, a page of its own (its examples are
// doctests, its links resolve here as if written above this line).
#[doc = include_str!("../docs/idempotent.md")]
pub use dedup_macros::idempotent;
