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
//! # Backends
//!
//! Each behind a feature: `postgres` (PostgreSQL), `sqlite` (SQLite), `mysql` (MySQL and
//! MariaDB). The handler's first parameter picks the backend. `uuid` adds
//! [`MessageKey`] for `uuid::Uuid`; `metrics` records counters and a latency histogram
//! per handler through the `metrics` facade (the [README][metrics] lists their names and
//! labels).
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
//! [`migrate`] creates the table, or upgrades a 0.1 table in place; [`schema_sql`],
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
//! The repository's [`examples/prune.rs`][prune] is an operator's command for the same
//! (`cargo run --example prune -- --help` in a clone): per-consumer counts, a dry run, a
//! progress bar.
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
//!   its batch size and its table at [`check`](Prune::check) / [`run`](Prune::run); the
//!   tuning knobs of the long-running [`inbox::Worker`] and [`outbox::Relay`] (lease,
//!   batch, poll interval…) are clamped into their documented range instead, so that a
//!   configuration typo never stops a consumer.
//! - **Errors** are an enum per concern ([`LedgerError`], [`PruneError`],
//!   [`inbox::InboxError`], [`outbox::OutboxError`]), `#[non_exhaustive]`; each names the
//!   table as a [`Table`], and the database's own error is its `source()`. What a
//!   message was refused for before anything was written is `Refused` in the concern's
//!   module ([`inbox::Refused`], [`outbox::Refused`]).
//!
//! The older spellings of 0.1's first drafts (`with_table`, `Prune::table`,
//! `Batch::table`, `Outbox::prune`, `inbox::Batch`) still compile, deprecated, with a
//! note that says what to write instead. `docs/public-api.txt` in the repository lists
//! the whole public API; a test keeps it exact, so every change to it shows in review.
//!
//! [metrics]: https://github.com/dedup-rs/dedup#metrics
//! [migrations]: https://github.com/dedup-rs/dedup/tree/main/dedup-runtime/migrations
//! [rabbitmq]: https://github.com/dedup-rs/dedup/blob/main/examples/rabbitmq.rs
//! [nats]: https://github.com/dedup-rs/dedup/blob/main/examples/nats.rs
//! [prune]: https://github.com/dedup-rs/dedup/blob/main/examples/prune.rs

#![warn(missing_docs)]
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
//                   RabbitMQ and NATS JetStream (features `lapin`, `async-nats`), and
//                   their outbox publishers
//   rdkafka.rs, redis.rs, rumqttc.rs  the outbox's Kafka, Redis Streams and MQTT publishers
//                   (features `rdkafka`, `redis`, `rumqttc`)
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
mod consumers;
mod dialect;
mod features;
mod guarded;
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
    ConsumerStats, DEFAULT_PRUNE_BATCH, MAX_PRUNE_AGE, MAX_PRUNE_BATCH, Prune, PruneBackend,
    PruneError, PruneProgress,
};
pub use retry::{BASE_DELAY, MAX_ATTEMPTS, MAX_DELAY};
pub use rolled_back::RolledBack;
pub use stored::{
    DEFAULT_MAX_RESULT_LEN, Fingerprint, FingerprintMismatch, FingerprintSource, MAX_RESULT_LEN,
    MAX_RESULT_VERSION, StoredResultError, fingerprint,
};
pub use table::{DEFAULT_TABLE, InvalidTableName, MAX_TABLE_NAME_LEN, Table};

/// Makes an `async fn` message handler effectively-once.
///
/// ```no_run
/// # use dedup_runtime::idempotent;
/// # use sqlx::PgConnection;
/// # struct PaymentReceived { id: String, order_id: i64 }
/// #[idempotent(consumer = "billing", key = msg.id)]
/// async fn mark_paid(tx: &mut PgConnection, msg: &PaymentReceived) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
///         .bind(msg.order_id)
///         .execute(&mut *tx)
///         .await?;
///     Ok(())
/// }
/// ```
///
/// becomes, conceptually,
///
/// ```text
/// async fn mark_paid(db: impl Db<'_, Postgres>, msg: &PaymentReceived)
///     -> Result<Outcome<()>, sqlx::Error>
/// ```
///
/// where `db` is `&PgPool`, or `&mut` a `PgConnection`, `PoolConnection<Postgres>` or
/// `Transaction<'_, Postgres>` of the caller's.
///
/// # What it does, written by hand
///
/// With a pool, the generated function does what this code does (plus a `tracing` span
/// per call with `handler`, `consumer`, `message_id`, `outcome` and `attempts`, and the
/// metrics of the `metrics` feature). On SQLite it begins with `BEGIN IMMEDIATE`, on MySQL
/// and MariaDB it claims and commits differently; the README's ["What it
/// generates"][generates] says how.
///
/// [generates]: https://github.com/dedup-rs/dedup#what-it-generates
///
/// ```no_run
/// use std::hash::{BuildHasher, RandomState};
/// use std::time::{Duration, Instant};
///
/// use dedup_runtime::{BASE_DELAY, Duplicate, MAX_ATTEMPTS, MAX_DELAY, MessageKey, Outcome};
/// use sqlx::{PgPool, Postgres};
/// # struct PaymentReceived { id: String, order_id: i64 }
///
/// async fn mark_paid(pool: &PgPool, msg: &PaymentReceived) -> Result<Outcome<()>, sqlx::Error> {
///     // 1. The key is checked before anything is written: empty, over MAX_MESSAGE_ID_LEN
///     //    bytes or containing NUL, it is an `InvalidMessageId` (nothing runs, no retry).
///     let key = msg.id.message_id();
///     let id = key.validate().map_err(sqlx::Error::from)?;
///     let mut attempt = 0;
///     loop {
///         attempt += 1;
///         // 2. One transaction, and in it the claim: one statement that inserts nothing
///         //    for a message processed before.
///         let mut tx = match pool.begin().await {
///             Ok(tx) => tx,
///             Err(error) => { back_off(attempt, transient(&error), error).await?; continue; }
///         };
///         let claim = sqlx::query(
///             "INSERT INTO processed_messages (consumer, message_id, processed_at) \
///              VALUES ($1, $2, clock_timestamp()) ON CONFLICT DO NOTHING",
///         )
///         .bind("billing")
///         .bind(id)
///         .execute(&mut *tx)
///         .await;
///         match claim {
///             // 3. A copy: nothing runs. Dropping `tx` queues its ROLLBACK, which sqlx
///             //    sends as the pool takes the connection back, off the caller's path.
///             Ok(done) if done.rows_affected() == 0 => {
///                 return Ok(Outcome::Duplicate(Duplicate::AlreadyProcessed));
///             }
///             Ok(_) => {}
///             Err(error) => {
///                 tx.rollback().await.ok();
///                 back_off(attempt, transient(&error), error).await?;
///                 continue;
///             }
///         }
///         let claimed_at = Instant::now();
///         // 4. The body, on the same transaction. Its error is the call's, unless transient.
///         let body: Result<(), sqlx::Error> = async {
///             sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
///                 .bind(msg.order_id)
///                 .execute(&mut *tx)
///                 .await?;
///             Ok(())
///         }
///         .await;
///         if let Err(error) = body {
///             tx.rollback().await.ok();
///             back_off(attempt, transient(&error), error).await?;
///             continue;
///         }
///         // 5. The checked COMMIT, in one round trip: its `SET LOCAL` fails with 25P02 in
///         //    a transaction that a failed statement of the body aborted, where a plain
///         //    COMMIT would answer ROLLBACK and no error. A slow transaction first moves
///         //    `processed_at` to now (see `STAMP_AFTER`).
///         let committed = async {
///             if claimed_at.elapsed() >= dedup_runtime::STAMP_AFTER {
///                 sqlx::query(
///                     "UPDATE processed_messages SET processed_at = clock_timestamp() \
///                      WHERE consumer = $1 AND message_id = $2",
///                 )
///                 .bind("billing")
///                 .bind(id)
///                 .execute(&mut *tx)
///                 .await?;
///             }
///             sqlx::raw_sql("SET LOCAL dedup.checked_commit = on; COMMIT AND CHAIN")
///                 .execute(&mut *tx)
///                 .await
///         }
///         .await;
///         match committed {
///             // Committed. `AND CHAIN` left an empty transaction open for sqlx's
///             // bookkeeping: dropping `tx` queues its ROLLBACK, as in 3.
///             Ok(_) => return Ok(Outcome::Processed(())),
///             Err(error) => {
///                 // 25P02 comes back as `RolledBack` (holding this error), and is retried.
///                 let code = error.as_database_error().and_then(|error| error.code());
///                 let rolled_back = code.as_deref() == Some("25P02");
///                 tx.rollback().await.ok();
///                 back_off(attempt, rolled_back || transient(&error), error).await?;
///             }
///         }
///     }
/// }
///
/// /// A deadlock, serialization failure or lock timeout (`40P01`, `40001`, `55P03`).
/// fn transient(error: &sqlx::Error) -> bool {
///     dedup_runtime::is_transient::<Postgres>(error)
/// }
///
/// /// 6. Retries run the whole transaction again, body included, up to MAX_ATTEMPTS times,
/// ///    after a random pause ("full jitter") whose bound doubles from BASE_DELAY to
/// ///    MAX_DELAY; anything else, or the last attempt's error, ends the call.
/// async fn back_off(attempt: u32, retry: bool, error: sqlx::Error) -> Result<(), sqlx::Error> {
///     if !retry || attempt == MAX_ATTEMPTS {
///         return Err(error);
///     }
///     let bound = BASE_DELAY.saturating_mul(1 << (attempt - 1)).min(MAX_DELAY);
///     let micros = RandomState::new().hash_one(attempt) % (bound.as_micros() as u64 + 1);
///     tokio::time::sleep(Duration::from_micros(micros)).await;
///     Ok(())
/// }
/// ```
///
/// # Arguments
///
/// - `key = <expr>` — the message id, an expression over the parameters whose type
///   implements [`MessageKey`] (strings, integers, `uuid::Uuid`, references to them).
///   It is evaluated once, before the transaction begins. Needed unless `unique = …`
///   alone decides what a duplicate is.
/// - `consumer = "name"` — the service processing the message; needed with `key`, and
///   only with it. Two consumers see the same message id independently. A non-empty
///   string literal, at most [`MAX_CONSUMER_LEN`] bytes.
/// - `unique = "constraint"` or `unique = ["a", "b"]` — business-key dedup: the message
///   carries a natural key ("create the shipment for order 42") that a unique constraint
///   protects. When the body violates one of the named constraints, the whole transaction
///   rolls back (the dedup record included) and the call returns
///   [`Duplicate::BusinessKey`] naming the constraint; a violation of any other
///   constraint stays an error. Usable with `key` (both rules apply) or alone (then
///   `consumer` is not needed, and nothing is recorded in the dedup table). See
///   [Business keys](#business-keys).
/// - `table = "processed_messages"` — the dedup table, a plain SQL identifier, optionally
///   schema-qualified (`audit.processed_messages`); create it with [`migrate_table`].
/// - `effect = "send-first"` — the body's effect is outside the database (an email, an
///   HTTP call): the body may leave its connection unused, and once it has run nothing runs
///   it again. Needs `key`. See [Effects outside the database](#effects-outside-the-database).
/// - `effect = "mark-first"` — the message is marked (in progress) and committed before
///   the body's call: a crash before the call completes loses it, and the row says so
///   (outcome unknown). The body takes a [`Lease`] instead of a connection. Needs `key`.
///   See [Mark-first and leases](#mark-first-and-leases).
/// - `lease = "30s"` — with `effect = "send-first"`: the call runs under a lease, with no
///   transaction open (the body takes a [`Lease`]); with `effect = "mark-first"`: how long
///   the mark is held before its outcome counts as unknown (default a minute,
///   [`DEFAULT_MARK_LEASE`]). A whole number and a unit, `ms`, `s`, `m` or `h`, from 1 ms
///   to `24h`. Not with `unique`.
/// - `batch = orders` — a batch handler: `orders` is its parameter holding the messages
///   (`orders: &[&Order]`), and `key` a closure over one of them, `key = |order| order.id`.
///   Not with `effect` or `lease`. See [Batches](#batches).
/// - `result = "stored"` — the body's `T` is stored with the dedup row, in the same
///   transaction, and every duplicate gets it back: the generated function returns
///   [`StoredOutcome<T>`](StoredOutcome), `Replayed(T)` for a duplicate. `T: Serialize +
///   DeserializeOwned` (feature `serde`). On a leased call (`effect = "mark-first"`,
///   `lease = …`) it is stored in the fenced completion, and a copy that arrives while
///   the lease runs is `StoredOutcome::InProgress`. Needs `key`; not with `batch`, whose
///   body returns one `()` for many messages. See
///   [Replies and reused ids](#replies-and-reused-ids).
/// - `result_version = 2` — with `result`: the version of `T`'s shape, stored with each
///   result (default 1). Bump it when `T` changes shape: a replay of a result stored under
///   another version is [`StoredResultError::VersionMismatch`], never old bytes read as
///   the new type. 1 to [`MAX_RESULT_VERSION`].
/// - `max_result_len = 65_536` — with `result`: the largest result stored, in bytes of
///   its encoding (default [`DEFAULT_MAX_RESULT_LEN`], 4 MiB; at most [`MAX_RESULT_LEN`],
///   8 MiB). A larger one is [`StoredResultError::TooLarge`] and the transaction rolls
///   back: never truncated.
/// - `fingerprint = msg.payload` — the payload, or the part of it that makes the message
///   what it is (`fingerprint = msg.amount.to_be_bytes()`): bytes or text
///   ([`FingerprintSource`]). Its SHA-256 is stored with the dedup row and compared by
///   every claim that finds the row: the same id with another payload is a
///   [`FingerprintMismatch`] error, nothing written. On a leased call it is written with
///   the claim, so that a copy is compared while the lease runs and after its outcome
///   became unknown. Needs `key`. With `batch`, a closure over one message, as `key` is:
///   `fingerprint = |order| order.body`; a mismatch is that message's
///   `BatchItem::FingerprintMismatch` (see [Batches](#batches)).
/// - `crate = "path"` — where this crate is, when it is re-exported or renamed.
///
/// # Replies and reused ids
///
/// A request/reply consumer must answer a redelivered request with the reply it sent the
/// first time, and a payment flow must not take a reused id for a duplicate:
///
/// ```
/// use dedup_runtime::{FingerprintMismatch, StoredOutcome, idempotent};
/// use sqlx::SqliteConnection;
///
/// #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
/// struct Receipt {
///     charge: String,
///     cents: i64,
/// }
///
/// struct Charge {
///     id: String,
///     body: Vec<u8>,
///     cents: i64,
/// }
///
/// #[idempotent(consumer = "payments", key = msg.id, result = "stored", fingerprint = msg.body)]
/// async fn charge(tx: &mut SqliteConnection, msg: &Charge) -> Result<Receipt, sqlx::Error> {
///     let charge = format!("ch_{}", msg.id);
///     sqlx::query("INSERT INTO charges (id, cents) VALUES (?, ?)")
///         .bind(&charge)
///         .bind(msg.cents)
///         .execute(&mut *tx)
///         .await?;
///     Ok(Receipt { charge, cents: msg.cents })
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
/// # sqlx::raw_sql("CREATE TABLE charges (id TEXT PRIMARY KEY, cents INTEGER)").execute(&pool).await?;
/// dedup_runtime::migrate(&pool).await?;
/// let msg = Charge { id: "req_1".into(), body: b"{\"cents\":500}".to_vec(), cents: 500 };
/// let first = charge(&pool, &msg).await?;
/// let again = charge(&pool, &msg).await?; // a redelivery
/// assert!(first.is_processed() && again.is_replayed());
/// assert_eq!(first.into_value(), again.into_value()); // the same reply, byte for byte
///
/// let reused = Charge { body: b"{\"cents\":900}".to_vec(), cents: 900, ..msg };
/// let error = charge(&pool, &reused).await.unwrap_err();
/// assert!(FingerprintMismatch::find(&error).is_some()); // refused, nothing written
/// # Ok(()) }
/// ```
///
/// - **Leased calls** (`effect = "mark-first"`, `lease = …`) store the result in the
///   fenced completion, after its owner-checked mark (opening the completion transaction
///   if the body did not): a completion refused ([`LeaseLost`]) stores nothing. A result
///   that cannot be stored is the completion's failure: send-first releases the row (the
///   next delivery calls again), mark-first leaves it in progress (its outcome becomes
///   unknown). The fingerprint is written with the claim.
/// - **What is stored.** The result, encoded with postcard 1 (a specified, stable wire
///   format; exact for every serde type, `0`, `false`, `""`, `[]`, `()`, `None` and
///   `Some(None)` included), as bytes in the row's `result` column with
///   `result_version`; the fingerprint, 32 bytes, in `fingerprint`. One statement more
///   per processed message, just before the commit; on a duplicate, one read of the row.
///   A handler without the options sends the statements it always sent.
/// - **A result that cannot be stored** — its `Serialize` fails, it is over
///   `max_result_len`, or it would not decode back as `T` (postcard is not
///   self-describing: `serde_json::Value`, untagged enums and `flatten` cannot be read
///   back) — is a [`StoredResultError`] before the commit: the effect does not commit,
///   and the next delivery runs the body again.
/// - **A duplicate with nothing to replay** is `StoredOutcome::Duplicate`: a row
///   processed before the option was on (or by a handler of the same consumer without
///   it), a business key (`unique = …`: another message id).
/// - **Fingerprints** are compared wherever a claim meets the row: processed (with or
///   without a stored result), in progress under another delivery's lease, outcome
///   unknown, inside a caller's transaction. A row stored without one (before the option)
///   has nothing to compare: a duplicate. An identical redelivery is a duplicate, never a
///   mismatch. [`AckPolicy`] dead-letters a mismatch and a [`StoredResultError`].
/// - **Pruning** deletes the row, its result and fingerprint with it. The columns come
///   with [`migrate`] (an upgrade of an older table adds them; the SQL is
///   `migrations/<backend>/0005_processed_messages_results.sql`).
///
/// # The handler
///
/// - An `async fn`. Its first parameter (after `self`) is the connection the body works
///   on: `&mut PgConnection`, `&mut SqliteConnection`, `&mut MySqlConnection` or
///   `&mut sqlx::Transaction<'_, DB>`; the body must use it, unless `effect = …` declares
///   that its effect is outside the database. A leased handler (`effect = "mark-first"`,
///   or `lease = …`) takes `&mut Lease<'_, DB>` instead, and the generated function a
///   `&Pool<DB>` and returns [`LeaseOutcome`]. Other parameters, generics and where
///   clauses pass through unchanged.
/// - It returns `Result<T, E>` (or an alias such as `anyhow::Result<T>`) with
///   `E: From<sqlx::Error>`; the generated function returns `Result<Outcome<T>, E>`
///   (`Result<StoredOutcome<T>, E>` with `result = "stored"`).
///   Database failures and an invalid id reach the caller through `E`
///   ([`InvalidMessageId::find`] recognises the latter).
///
/// # Mistakes it refuses, and the one it cannot see
///
/// The dedup row commits with whatever the body did on its connection, so everything the
/// body means to do must run on that connection, and run to the end:
///
/// - **A forgotten `.await`** (`query.execute(&mut *tx);`) is a future that never runs:
///   the message would be marked processed and its work lost. In a handler's body it is a
///   compile error (`unused_must_use` is denied there; a body may `#[allow]` it where it
///   means it), and so is `let _ = query.execute(&mut *tx);` or `_ = …;` of any future:
///   write `….await`. What the macro cannot see: a future stored in a variable and
///   never awaited (`let pending = query.execute(&mut *tx);`), or passed to a function
///   that drops it — rustc warns about the unused variable, not about the work lost —
///   and `let _: SomeType = …;`, whose type you wrote out.
/// - **Never give a handler a pool.** What a body runs on a pool commits on its own,
///   outside the handler's transaction: a redelivery applies it again, a failure does not
///   undo it, and a body that touches `tx` only for show is not atomic at all. A
///   parameter of a sqlx pool type (`&PgPool`, `&SqlitePool`, `&MySqlPool`, `&AnyPool`,
///   `&Pool<DB>`, also in an `Arc`) is a compile error; a pool hidden in a struct of yours
///   is not seen. Run every statement on the connection parameter (`&mut *tx`).
/// - **One consumer name per subscription, ids unique within it.** The dedup row is
///   `(consumer, message_id)`: two handlers declaring the same `consumer` on the same
///   table share one id space, and with ids unique only per stream (a JetStream
///   sequence, a Kafka offset) the second handler's message is found processed and
///   acknowledged without running. Give each subscription (queue, durable consumer,
///   consumer group) its own name, and make ids unique across all it receives
///   (`stream/sequence`, `topic/partition/offset`). In debug builds the first call of a
///   second handler on a name logs a `WARN` naming both (target
///   `dedup_runtime::consumers`); sharing is right only when both handlers consume one
///   subscription whose ids are unique across both.
///
/// # Business keys
///
/// ```no_run
/// # use dedup_runtime::idempotent;
/// # struct ShipOrder { id: String, order_id: i64 }
/// // CREATE TABLE shipments (order_id bigint CONSTRAINT shipments_order_id_key UNIQUE, …)
/// #[idempotent(unique = "shipments_order_id_key")]
/// async fn ship(tx: &mut sqlx::PgConnection, msg: &ShipOrder) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
///         .bind(msg.order_id)
///         .execute(&mut *tx)
///         .await?;
///     Ok(())
/// }
/// ```
///
/// How each backend tells which constraint was violated, without matching translated
/// message text:
///
/// - **PostgreSQL**: SQLSTATE `23505` and the constraint name the server reports in its
///   own field. Name the constraint (`CONSTRAINT name UNIQUE (…)`) or use the name
///   PostgreSQL gave it (`shipments_order_id_key`).
/// - **MySQL / MariaDB**: error 1062 reports the key name only inside its message, which
///   the server translates (`lc_messages`). A handler with `unique` therefore sets its
///   session's `lc_messages` to `en_US`, in the same round trip as its `BEGIN` (inside a
///   caller's transaction, as one extra statement before its savepoint), and reads the key
///   name from that one known format. The setting stays on the pooled connection: later
///   error messages on it are in English. Key names are unique only per table (`UNIQUE
///   (order_id)` is named `order_id` on every table that has one), and MariaDB's message
///   does not say which table: a name in `unique` matches only when exactly one table of
///   the connection's current database has a unique key of that name (looked up in
///   `information_schema` when a violation happens). `unique = "table.key"` names the
///   table too: MySQL 8, whose message says `table.key`, matches it as it is; on MariaDB
///   that table must still be the only one with a key of that name. So give the keys the
///   body may violate names unique in the database (`shipments_order_id_key`), not
///   `order_id` or `PRIMARY` (every table has one): when several tables have a key of the
///   violated name, the violation is returned as an error, never taken for a duplicate.
/// - **SQLite**: extended codes 2067 / 1555 report the table and columns
///   (`UNIQUE constraint failed: shipments.order_id`), never translated. A name in
///   `unique` is resolved to its index's table and columns and compared; write the name of
///   a `CREATE UNIQUE INDEX` (an inline `UNIQUE` gets an automatic name), or
///   `table.column` for a single-column unique index.
///
/// The violation is found inside the body's error the way transient failures are (see
/// below): through `sqlx::Error`, `source()` chains, `anyhow::Error` or `Box<dyn Error>`.
/// An error type that hides it (a stringified error) cannot be classified: the
/// violation is then returned as an error, never guessed to be a duplicate.
///
/// # Failures and retries
///
/// An error returned by the body, a panic in it, a cancelled call, a failed commit or a
/// lost connection leave nothing behind: the dedup row goes with the rest of the
/// transaction, the error reaches the caller, and a redelivery processes the message.
/// One case has an unknown outcome: the connection lost while `COMMIT` is in flight. The
/// caller gets the error; if the server did commit, the dedup row committed with the
/// work, and the redelivery reports a duplicate. Either way the effect happens once.
///
/// When the handler owns the transaction (it was given a pool, or a connection that is
/// not inside a transaction), a transient failure — deadlock, serialization failure,
/// lock timeout, `SQLITE_BUSY` — runs the whole transaction again, body included, up to
/// [`MAX_ATTEMPTS`] times with exponential backoff and full jitter (a send-first handler
/// only until its body has run: see [Effects outside the database](#effects-outside-the-database)). The body must
/// therefore be able to run again: parameters it takes by value it must not consume.
/// A transient error raised *inside the body* is recognised when `E` is `sqlx::Error`, an
/// error type whose `source()` chain reaches it (`thiserror`'s `#[from]`), or
/// `anyhow::Error` / `Box<dyn Error>`; an `E` that hides it (a string, a generic `E`)
/// is returned to the caller instead of retried. Inside a caller's transaction the
/// handler runs in a savepoint and never retries: the caller owns the transaction.
///
/// # Never swallow a database error in a body
///
/// A body that catches a database error and goes on (`let _ = query.execute(&mut *tx)
/// .await;`, `.ok()`) works on a transaction the database may already have ended:
/// PostgreSQL aborts it at the failed statement, InnoDB rolls it back on a deadlock,
/// SQLite on `SQLITE_FULL`, an I/O error, `RAISE(ROLLBACK, …)` or `ON CONFLICT
/// ROLLBACK`. The handler never reports such a call as processed: it commits only a
/// transaction that still holds its dedup row, runs the call again (like a transient
/// failure; a send-first handler does not), and then returns [`RolledBack`]; nothing of it
/// was committed. What it cannot
/// undo: on SQLite the statements a body runs *after* an automatic rollback run in
/// autocommit mode, each committed on its own. To try a statement that may fail, run it in
/// a savepoint (`let mut sp = tx.begin().await?;` … `sp.commit()`), whose rollback
/// leaves the handler's transaction intact.
///
/// On MySQL and MariaDB the handler's own transaction runs with `autocommit = 0` (set
/// with its `BEGIN`, restored with its `COMMIT` or `ROLLBACK`, in the same round trips),
/// so that statements after an InnoDB rollback are not committed one by one; a pooled
/// connection whose call is cancelled or panics before that is closed instead of going
/// back to the pool. DDL in a body (`TRUNCATE`, `CREATE`, `ALTER`…) commits implicitly on
/// MySQL: it commits the dedup row and the work so far, and a later error can no longer
/// roll them back. Keep DDL out of handlers.
///
/// # Effects outside the database
///
/// An email, a partner's HTTP API, a message to another broker: no such call is atomic
/// with the transaction, so a handler that makes one declares which risk it takes, and its
/// body may then leave its connection unused. `effect = "send-first"` takes the risk of a
/// duplicate call:
///
/// ```no_run
/// # use dedup_runtime::{IdempotencyKey, idempotent};
/// # struct Order { id: String, email: String }
/// # struct Mailer;
/// # impl Mailer {
/// #     async fn send(&self, _to: &str, _idempotency_key: &str) -> Result<(), std::io::Error> { Ok(()) }
/// # }
/// type Error = Box<dyn std::error::Error + Send + Sync>;
///
/// #[idempotent(consumer = "receipts", key = msg.id, effect = "send-first")]
/// async fn send_receipt(tx: &mut sqlx::PgConnection, msg: &Order, mailer: &Mailer)
///     -> Result<(), Error>
/// {
///     // A provider that honours idempotency keys drops a second request with this one:
///     // `receipt:<message id>`, the same on every delivery of the message.
///     let key = IdempotencyKey::new("receipt", &msg.id);
///     mailer.send(&msg.email, key.as_str()).await?;
///     Ok(())
/// }
/// ```
///
/// The call runs as any body does: `BEGIN`, the claim of the message id, the body (the
/// call, and whatever it writes on `tx`, such as the provider's receipt id, which commits
/// with the mark), then `COMMIT`, which marks the message processed. So the effect
/// happens *before* the processed mark commits:
///
/// - **The duplicate it allows.** The process dies, the connection is lost or the call's
///   future is dropped *after the external call returned (or was sent) and before
///   `COMMIT` completed*: the transaction rolls back, no mark is left, and the
///   redelivery makes the call again. The same when `COMMIT` itself fails, and when it is
///   lost in flight (the server may have committed, and the redelivery is a duplicate,
///   or not, and it calls again: the caller cannot tell). Pass the provider an
///   idempotency key derived from the message id ([`IdempotencyKey`]), so that it drops
///   the repeat; for a
///   receipt email a rare duplicate is acceptable, for a payment the key is what makes it
///   once. Inside a caller's transaction the mark commits with the caller's `COMMIT`: the
///   window lasts until then.
/// - **No retry after the body ran.** A handler without `effect` runs the whole
///   transaction again on a transient failure; here that would call the external service
///   a second time without the caller ever seeing it. A transient failure at `BEGIN` or at
///   the claim is still retried (the body has not run); once it has, a deadlock,
///   serialization failure or lock timeout at `COMMIT`, a transient error the body
///   returns, and a transaction the database rolled back by itself ([`RolledBack`]) end
///   the call with that error. Nothing is committed; the caller decides.
///   [`AckPolicy`] answers [`Ack::Retry`] to the transient ones: the redelivery calls
///   again (the same duplicate as a crash, but a visible one).
/// - **A concurrent copy waits on the claim** (the row lock of the uncommitted dedup row;
///   on SQLite, the write lock) for as long as the call takes, then sees a duplicate
///   (or, if the first copy rolled back, processes: it calls). The transaction, and on
///   SQLite the database's write lock, stays open during the call: keep calls short, with
///   a timeout well below the broker's ack deadline and the database's idle-in-transaction
///   limits. For longer calls, a lease: below.
///
/// # Mark-first and leases
///
/// A leased call holds no transaction and no connection while its body runs. The claim
/// commits the dedup row **in progress** on its own — `state` set, a 16-byte `owner` token
/// that is this call's alone, and `expires_at` = now + the lease, on the database's clock
/// (the host's clock plays no part) — and the body runs with the connection back in the
/// pool, holding a [`Lease`]. When it returns `Ok`, the row is marked processed in a
/// second transaction whose first statement checks the token (fencing); the body can put
/// its own writes in that transaction ([`Lease::transaction`]: the provider's charge id,
/// say), and they commit with the mark or not at all. A body error releases the row
/// (deleted, owner-checked): the redelivery runs again.
///
/// ```no_run
/// use dedup_runtime::{IdempotencyKey, Lease, LeaseOutcome, idempotent};
/// # struct Payment { id: String, cents: i64 }
/// # struct Provider;
/// # impl Provider {
/// #     async fn charge(&self, _cents: i64, _idempotency_key: &str) -> Result<String, std::io::Error> { Ok("ch_1".into()) }
/// # }
/// type Error = Box<dyn std::error::Error + Send + Sync>;
///
/// /// A payment: the provider's key makes the repeat after a crash harmless, and the
/// /// call may take long — no transaction is open while it runs.
/// #[idempotent(consumer = "payments", key = msg.id, effect = "send-first", lease = "30s")]
/// async fn charge(lease: &mut Lease<'_, sqlx::Postgres>, msg: &Payment, provider: &Provider)
///     -> Result<String, Error>
/// {
///     let key = IdempotencyKey::new("charge", &msg.id);
///     let charge_id = provider.charge(msg.cents, key.as_str()).await?;
///     // The result, recorded in the transaction that marks the message processed.
///     let tx = lease.transaction().await?;
///     sqlx::query("INSERT INTO charges (message_id, charge_id) VALUES ($1, $2)")
///         .bind(&msg.id)
///         .bind(&charge_id)
///         .execute(&mut *tx)
///         .await?;
///     Ok(charge_id)
/// }
///
/// /// An audit ping that must never repeat: at most once.
/// #[idempotent(consumer = "audit", key = msg.id, effect = "mark-first", lease = "10s")]
/// async fn audit(lease: &mut Lease<'_, sqlx::Postgres>, msg: &Payment) -> Result<(), Error> {
///     Ok(()) // the ping
/// }
///
/// # async fn consume(pool: &sqlx::PgPool, msg: &Payment, provider: &Provider) -> Result<(), Error> {
/// match charge(pool, msg, provider).await? {
///     LeaseOutcome::Processed(_) | LeaseOutcome::Duplicate(_) => { /* ack */ }
///     // Another delivery's lease is running: neither ack nor dead-letter.
///     LeaseOutcome::InProgress(busy) => { /* redeliver after busy.remaining() */ }
/// }
/// # Ok(()) }
/// ```
///
/// What each policy does at each point:
///
/// | | `send-first` with `lease` | `mark-first` |
/// | --- | --- | --- |
/// | row while the body runs | `state = 1` | `state = 2` |
/// | a copy while the lease runs | [`LeaseOutcome::InProgress`] with the time left: [`AckPolicy`] answers `Ack::Retry { after }`, never ack, never dead-letter | the same |
/// | **the crash point** | the process dies *after the call and before the completion commits*: the row stays in progress until its lease ends; the next delivery then **takes it over** with a new token and **calls again** (the duplicate; pass a key) | the process dies *after the mark committed and before the call completed*: the row stays; after its lease the next delivery is **acknowledged without a call** ([`Duplicate::OutcomeUnknown`], logged at WARN): **the effect is lost**, and the row stays as the evidence, listed by [`Ledger::unresolved`] until an operator resolves it ([`Ledger::resolve`]) |
/// | body error | the row is released: the redelivery calls again | the same (only a crash, or a failed release, loses the call): so return an error only when the call certainly did not happen; after a timeout that may have sent it, return `Ok` (at most once) |
/// | completion fails (database away) | the row is released if still in progress: the redelivery calls again or finds it processed | the row is kept: after the lease, outcome unknown (the call did happen) |
/// | a stale owner (paused past its lease, taken over) completes | refused with [`LeaseLost`]; its writes in [`Lease::transaction`] roll back; nothing changes | the same |
///
/// A panic in the body, or a dropped future, is a crash: the row stays until its lease
/// ends. A call longer than the lease renews it with [`Lease::extend`] (every third of
/// the lease, say), fenced the same way. Choose the lease against the broker's timers: a
/// lease shorter than the broker's ack deadline (JetStream's `AckWait`, 30 s by default;
/// RabbitMQ's `consumer_timeout`, 30 min) lets a crashed owner's message be taken over at
/// its first redelivery; a longer one, or a call that outlives the deadline without
/// renewal, means a redelivery arrives while the owner still works — it is told "in
/// progress" and comes back after the time left, never runs the call a second time while
/// the lease holds. Pruning never deletes a row whose `state` is set.
///
/// A handler without a lease on the same consumer (a plain one, or a batch) reads the
/// row its claim meets: a lease in progress ends a plain call with the error
/// [`InProgress`] (inside `sqlx::Error::AnyDriverError`; [`AckPolicy`] answers
/// `Ack::Retry { after }` with the lease's time left) and is
/// [`BatchItem::InProgress`](crate::batch::BatchItem::InProgress) in a batch, never a
/// duplicate to acknowledge; an expired mark-first mark is [`Duplicate::OutcomeUnknown`];
/// an expired send-first lease is taken over in the handler's transaction, whose commit
/// marks it processed (its old owner's completion then fails with [`LeaseLost`]).
///
/// # Batches
///
/// With `batch = …` the handler takes many messages (a JetStream fetch, RabbitMQ's
/// prefetch, a Kafka poll), claims all their ids in **one statement**, runs its body
/// **once** with the messages not processed before, and commits once:
///
/// ```
/// use dedup_runtime::batch::BatchItem;
/// use dedup_runtime::idempotent;
/// use sqlx::SqliteConnection;
///
/// struct Paid { id: String, order: String }
///
/// #[idempotent(consumer = "payments", batch = fresh, key = |paid| paid.id)]
/// async fn record(tx: &mut SqliteConnection, fresh: &[&Paid]) -> Result<(), sqlx::Error> {
///     // The fresh messages only, each id once, in delivery order.
///     for paid in fresh {
///         sqlx::query("INSERT INTO payments (order_id) VALUES (?1)")
///             .bind(&paid.order)
///             .execute(&mut *tx)
///             .await?;
///     }
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
/// # dedup_runtime::migrate(&pool).await?;
/// # sqlx::raw_sql("CREATE TABLE payments (order_id TEXT NOT NULL)").execute(&pool).await?;
/// let delivered = [
///     Paid { id: "evt_1".into(), order: "o-1".into() },
///     Paid { id: "evt_2".into(), order: "o-2".into() },
///     Paid { id: "evt_1".into(), order: "o-1".into() }, // redelivered within the fetch
/// ];
/// // The generated function: `record(db, &[Paid]) -> Result<BatchOutcome<sqlx::Error>, sqlx::Error>`.
/// let outcome = record(&pool, &delivered).await?;
/// assert_eq!(outcome.processed(), 2);
/// assert!(matches!(outcome.items()[2], BatchItem::SameAs { first: 0 }));
/// assert!((0..3).all(|n| outcome.ack(n))); // one answer per delivery, in order
/// // Delivered again: duplicates, and the body does not run.
/// assert_eq!(record(&pool, &delivered[1..]).await?.duplicates(), 2);
/// # let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(&pool).await?;
/// # assert_eq!(rows, 2);
/// # Ok(()) }
/// ```
///
/// - **The handler**: `async fn h(tx: &mut PgConnection, orders: &[&Order]) -> Result<(), E>`
///   — its connection and its messages, nothing else; no `self`, no generics; `E` implements
///   `std::error::Error + Send + 'static` ([`batch::BatchError`]: the batch looks through its
///   `source()` chain; `anyhow::Error` is not one); the body's future is `Send`. For state
///   (settings, a client), implement [`batch::BatchHandler`] on a struct that holds it and
///   call [`batch::Batch::run`]: the attribute is that, written for you.
/// - **The generated function** takes `db` as the single form does (`&Pool`, or `&mut` a
///   connection or transaction of yours, in which each sub-batch is a savepoint) and
///   `orders: &[Order]`, and returns `Result<`[`batch::BatchOutcome`]`<E>, sqlx::Error>`: one
///   [`batch::BatchItem`] per message, in input order — processed, duplicate (a business key
///   too), failed with the body's error, the same id as an earlier message, an invalid
///   id, in progress under a lease, or a fingerprint mismatch. `Err` is a failure of ours
///   that retries did not cure: acknowledge nothing.
/// - **`key = |order| <expr>`** is evaluated once per message before the transaction
///   begins; `<expr>` is borrowed as the single form's key is (`order.id`, `order.seq`,
///   `order.id.as_str()` all work), and a bad id is that message's `BatchItem::Invalid`.
/// - **`fingerprint = |order| <expr>`** (optional; bytes or text, borrowed the same way):
///   each message's payload fingerprint, stored with the rows the batch claims and
///   compared with every row the claim finds — processed, in progress, unknown, an
///   expired send-first lease — and with an earlier copy of the id in the same batch. A
///   message whose id came with another payload is `BatchItem::FingerprintMismatch`
///   (never acknowledged, never processed); an identical redelivery stays a duplicate.
///   `result = "stored"` is for handlers of one message: a batch's body returns one `()`.
/// - **Failures**: a transient one retries the batch; any other splits it in halves down
///   to single messages, so the good ones commit and only a message that fails alone is
///   `Failed`. `unique = …` works per message: the one that violates the constraint alone
///   is a duplicate. The [`batch`] module says how each backend claims and splits.
///
/// # The caller's connection
///
/// Given `&mut` a connection that is not in a transaction, the handler begins and ends
/// its own transaction on it, and ends it before it returns (a duplicate's rollback is
/// not left queued, where the session would sit idle in a transaction holding locks until
/// its next use; this costs one round trip more than with a pool, whose connections are
/// flushed as they go back). If the call is *cancelled* (its future dropped) or panics,
/// the rollback is queued on the connection and sent with its next statement; on MySQL the
/// session may also be left with `autocommit = 0`. Do not keep such a connection: drop or
/// close it (a `PoolConnection` goes back to its pool, which flushes it), or run
/// `ROLLBACK` on it (and on MySQL `SET autocommit = 1`) before using it again.
///
/// # When an id counts as processed
///
/// `processed_at` is the time the redelivery window of [`Prune`] counts from. The claim
/// writes its own statement's time (on PostgreSQL `clock_timestamp()`, not the
/// transaction's start); a transaction that runs longer than [`STAMP_AFTER`] between its
/// claim and its commit moves it to its end with one more statement, and MySQL/MariaDB
/// always write the commit time, in UTC. Pruning keeps `STAMP_AFTER` as a margin. Inside a
/// caller's transaction the handler's part ends at its savepoint's release: the time the
/// caller's transaction goes on after that counts as if it were part of the redelivery
/// window; keep it short, or prune that much later.
///
/// On MySQL and MariaDB, a deadlock or lock wait timeout inside a caller's transaction
/// rolls back the **whole** transaction, not only the handler's savepoint (InnoDB does
/// so; the savepoint is gone with it). The handler returns the error (1213 / 1205); treat
/// it as the end of your transaction and run it again from the start.
pub use dedup_macros::idempotent;
