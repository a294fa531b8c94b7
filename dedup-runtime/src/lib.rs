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
//! per handler through the `metrics` facade (the README lists their names).
//!
//! | | claim statement | concurrent copies | transient failures retried |
//! | --- | --- | --- | --- |
//! | PostgreSQL | `INSERT … ON CONFLICT DO NOTHING` | wait on the primary key | `40001`, `40P01`, `55P03` |
//! | SQLite | `INSERT … ON CONFLICT DO NOTHING` after `BEGIN IMMEDIATE` | wait for the write lock | `SQLITE_BUSY`, `SQLITE_LOCKED` |
//! | MySQL / MariaDB | `INSERT`; error 1062 on it is the duplicate | wait on the primary key | 1205, 1213 |
//!
//! # The dedup table
//!
//! `processed_messages(consumer, message_id, processed_at)`, primary key
//! `(consumer, message_id)`, an index on `processed_at` for pruning by age. [`migrate`]
//! creates it; [`schema_sql`] and the files under `migrations/` give the same SQL for your
//! own migration tool. Ids compare byte for byte on every backend.
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
//! `examples/rabbitmq.rs` and `examples/nats.rs` are complete consumers.
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
//! `cargo run --example prune -- --help` is the operator's command for the same, with a
//! dry run.

#![warn(missing_docs)]

// Where things are (a concern with SQL has one trait, and one file per backend under the
// directory of its name; `backend.rs` joins the concerns into `Backend`):
//
//   run.rs          one call of a generated handler: begin, claim, body, commit, retry
//   private.rs      what the generated code calls (`__private`), and nothing else
//   input.rs        what callers pass (`Db`: pool, connection, transaction) and what a
//                   handler declares as its connection (`HandlerConnection`)
//   claim/          begin, claim the message id, the checked commit, rollback, per backend
//   classify/       what an error means: transient, unique violation, database away
//   chain.rs        the one walk along an error's sources, for every classification
//   schema/         the dedup table: its name (`Table`) and each backend's DDL
//   migrate.rs      `migrate`, `migrate_table`, `schema_sql`
//   prune/          deleting old ids, never before the redelivery window ends
//   ack.rs          what to tell the broker (`AckPolicy`)
//   lapin.rs, async_nats.rs  the broker side of `Ack`: delivery counts and settling, on
//                   RabbitMQ and NATS JetStream (features `lapin`, `async-nats`)
//   metrics.rs      counters and a latency histogram (feature `metrics`)
//   key.rs          message ids (`MessageKey`) and the ids refused (`InvalidMessageId`)
//   outcome.rs, retry.rs, rolled_back.rs, probe.rs: outcomes, backoff, `RolledBack`,
//                   seeing the database error inside the handler's error type
//   dedup-limits    (a crate) the limits the attribute and the runtime share
mod ack;
#[cfg(feature = "async-nats")]
pub mod async_nats;
mod backend;
mod chain;
mod claim;
mod classify;
mod input;
mod key;
#[cfg(feature = "lapin")]
pub mod lapin;
mod metrics;
mod migrate;
mod outcome;
mod probe;
mod prune;
mod retry;
mod rolled_back;
mod run;
mod schema;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use ack::{Ack, AckPolicy, Failure, is_transient};
pub use backend::Backend;
pub use input::{Db, HandlerConnection};
pub use key::{InvalidMessageId, MAX_CONSUMER_LEN, MAX_MESSAGE_ID_LEN, MessageId, MessageKey};
pub use migrate::{migrate, migrate_table, schema_sql};
pub use outcome::{Duplicate, Outcome};
pub use prune::{
    ConsumerStats, DEFAULT_PRUNE_BATCH, MAX_PRUNE_AGE, MAX_PRUNE_BATCH, Prune, PruneBackend,
    PruneError, PruneProgress,
};
pub use retry::{BASE_DELAY, MAX_ATTEMPTS, MAX_DELAY};
pub use rolled_back::RolledBack;
pub use run::STAMP_AFTER;
pub use schema::{DEFAULT_TABLE, InvalidTableName, MAX_TABLE_NAME_LEN, Table};

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
/// per call with `handler`, `consumer`, `message_id`, `outcome` and `attempts`):
///
/// ```no_run
/// # use dedup_runtime::{Duplicate, Outcome};
/// # struct PaymentReceived { id: String, order_id: i64 }
/// async fn mark_paid(pool: &sqlx::PgPool, msg: &PaymentReceived)
///     -> Result<Outcome<()>, sqlx::Error>
/// {
///     // 1. The key is checked before anything is written: empty, over
///     //    MAX_MESSAGE_ID_LEN bytes or containing NUL → an `InvalidMessageId` error.
///     let id: &str = &msg.id;
///     let mut attempt = 1;
///     loop {
///         // 2. One transaction: BEGIN (SQLite: BEGIN IMMEDIATE), claim, body, COMMIT.
///         let mut tx = pool.begin().await?;
///         let claimed = sqlx::query(
///             "INSERT INTO processed_messages (consumer, message_id) VALUES ($1, $2) \
///              ON CONFLICT DO NOTHING",
///         )
///         .bind("billing")
///         .bind(id)
///         .execute(&mut *tx)
///         .await?
///         .rows_affected()
///             == 1;
///         if !claimed {
///             // 3. A copy that was processed before: nothing runs, acknowledge it.
///             //    Dropping the transaction queues its ROLLBACK, which sqlx sends before
///             //    the connection's next use (inside a caller's transaction, the
///             //    savepoint is rolled back at once instead).
///             drop(tx);
///             return Ok(Outcome::Duplicate(Duplicate::AlreadyProcessed));
///         }
///         // 4. The body, on the same transaction.
///         let result: Result<(), sqlx::Error> = async {
///             sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1")
///                 .bind(msg.order_id)
///                 .execute(&mut *tx)
///                 .await?;
///             Ok(())
///         }
///         .await;
///         // 5. COMMIT, checked in the same round trip: PostgreSQL sends
///         //    `SET LOCAL dedup.checked_commit = on; COMMIT AND CHAIN`, whose `SET`
///         //    fails with 25P02 when a statement of the body failed and the body
///         //    went on (PostgreSQL would answer a plain COMMIT with ROLLBACK and no
///         //    error); see `RolledBack`.
///         let error = match result {
///             Ok(value) => match tx.commit().await {
///                 Ok(()) => return Ok(Outcome::Processed(value)),
///                 Err(error) => error,
///             },
///             Err(error) => {
///                 tx.rollback().await.ok();
///                 error
///             }
///         };
///         // 6. A deadlock, serialization failure or lock timeout runs the whole
///         //    transaction again, body included, after a random pause that doubles
///         //    in bound each time; up to MAX_ATTEMPTS attempts.
///         # let transient = false;
///         if !transient || attempt == dedup_runtime::MAX_ATTEMPTS {
///             return Err(error);
///         }
///         attempt += 1;
///     }
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
/// - `crate = "path"` — where this crate is, when it is re-exported or renamed.
///
/// # The handler
///
/// - An `async fn`. Its first parameter (after `self`) is the connection the body works
///   on: `&mut PgConnection`, `&mut SqliteConnection`, `&mut MySqlConnection` or
///   `&mut sqlx::Transaction<'_, DB>`; the body must use it. Other parameters, generics
///   and where clauses pass through unchanged.
/// - It returns `Result<T, E>` (or an alias such as `anyhow::Result<T>`) with
///   `E: From<sqlx::Error>`; the generated function returns `Result<Outcome<T>, E>`.
///   Database failures and an invalid id reach the caller through `E`
///   ([`InvalidMessageId::find`] recognises the latter).
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
/// [`MAX_ATTEMPTS`] times with exponential backoff and full jitter. The body must
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
/// failure), and then returns [`RolledBack`]; nothing of it was committed. What it cannot
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
