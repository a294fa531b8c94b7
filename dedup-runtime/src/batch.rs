//! Batches: N messages, their dedup rows claimed in one statement, one run of the body
//! over the fresh ones, one commit.
//!
//! One message per transaction costs at least one commit (a WAL flush) and a few round
//! trips, whatever the client. Brokers hand consumers batches (a JetStream fetch,
//! RabbitMQ's prefetch, a Kafka poll); [`Batch::run`] takes one, claims every id in one
//! statement in one transaction, runs the body once with the messages not processed
//! before, and commits once:
//!
//! ```
//! use dedup_runtime::batch::{Batch, BatchHandler};
//!
//! struct Paid { id: String, order: String }
//!
//! /// The body: one run for all the fresh messages of a batch, on its transaction.
//! struct RecordPayments;
//!
//! impl BatchHandler<sqlx::Sqlite, Paid> for RecordPayments {
//!     type Error = sqlx::Error;
//!
//!     async fn handle(
//!         &self,
//!         tx: &mut sqlx::SqliteConnection,
//!         fresh: &[&Paid],
//!     ) -> Result<(), sqlx::Error> {
//!         // One multi-row statement would do; one per message is fine too.
//!         for paid in fresh {
//!             sqlx::query("INSERT INTO payments (order_id) VALUES (?1)")
//!                 .bind(&paid.order)
//!                 .execute(&mut *tx)
//!                 .await?;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! dedup_runtime::migrate(&pool).await?;
//! # sqlx::raw_sql("CREATE TABLE payments (order_id TEXT NOT NULL)").execute(&pool).await?;
//! let batch = Batch::new("billing")?;
//! let delivered = [
//!     Paid { id: "evt_1".into(), order: "o-1".into() },
//!     Paid { id: "evt_2".into(), order: "o-2".into() },
//!     Paid { id: "evt_1".into(), order: "o-1".into() }, // the broker's redelivery
//! ];
//! let outcome = batch.run(&pool, &delivered, |paid| paid.id.as_str(), &RecordPayments).await?;
//! assert_eq!(outcome.processed(), 2); // evt_1 once, evt_2
//! assert!((0..3).all(|n| outcome.ack(n))); // all three deliveries: acknowledge
//!
//! // Delivered again: duplicates, and the handler does not run.
//! let again = batch.run(&pool, &delivered[..2], |paid| paid.id.as_str(), &RecordPayments).await?;
//! assert_eq!(again.duplicates(), 2);
//! # let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(&pool).await?;
//! # assert_eq!(payments, 2);
//! # Ok(()) }
//! ```
//!
//! The attribute writes that handler for you: `#[idempotent(consumer = "billing",
//! batch = fresh, key = |paid| paid.id)]` on `async fn record(tx: &mut SqliteConnection,
//! fresh: &[&Paid]) -> Result<(), sqlx::Error>` generates `record(&pool, &delivered)`,
//! the call above ([`idempotent`](crate::idempotent#batches) has the details). Write the
//! impl yourself when the body needs state: settings, a client.
//!
//! - **One claim statement per transaction**: PostgreSQL `INSERT … SELECT … FROM unnest(…)
//!   ON CONFLICT DO NOTHING RETURNING`; SQLite a multi-row `INSERT … ON CONFLICT DO NOTHING
//!   RETURNING`; MySQL and MariaDB a multi-row `INSERT … ON DUPLICATE KEY UPDATE` (a no-op
//!   for the rows already there) that writes a token of this transaction's into the new
//!   rows' `owner`, then a read of the ids holding it (MySQL has no `RETURNING`). The ids
//!   go in byte order, so that overlapping batches lock their rows in one order: the later
//!   waits for the earlier and finds its ids processed (or free, if it rolled back) instead
//!   of deadlocking with it; a deadlock the database reports all the same (InnoDB's gap
//!   locks) is transient, and retried.
//! - **In-batch copies collapse first**: the body sees each id once; a later copy's
//!   outcome is [`BatchItem::SameAs`] the first's (acknowledge both, or neither).
//! - **Poison isolation by splitting**: when the body fails, the transaction rolls back
//!   and the fresh messages run again in two halves, each in its own transaction, down to
//!   single messages: the good ones commit, and only a message that fails alone is
//!   [`BatchItem::Failed`] — at most about 2·log₂ N extra transactions per poison message,
//!   and a batch of N that all fail ends after 2N − 1. No savepoint per message (past 64
//!   in one transaction, PostgreSQL's subtransactions slow every session).
//! - **Failures at `COMMIT`** of one message (a deferred constraint; a statement error the
//!   body swallowed, which PostgreSQL answers by rolling the transaction back) split the
//!   batch like a failure of the body, once retries of a rolled-back transaction are
//!   spent: the good messages commit, and the one that fails alone is
//!   [`BatchItem::CommitFailed`].
//! - **Transient failures retry the same batch**: a deadlock, a serialization failure, a
//!   lock timeout (`SQLITE_BUSY`), or a transaction the database rolled back by itself,
//!   whether from the claim, the body or the commit, runs the transaction again, after a
//!   jittered backoff, up to [`MAX_ATTEMPTS`](crate::MAX_ATTEMPTS) times, without
//!   splitting; a body that still fails that way then splits like any other failure.
//! - **Business keys** ([`Batch::unique`]): a violation of a named unique constraint
//!   inside a batch of several cannot say which message caused it, so it splits the
//!   batch like a failure; the message that violates it alone is a duplicate
//!   ([`Duplicate::BusinessKey`]), as in the single form.
//! - **Bad ids** (empty, too long, with a NUL byte) are [`BatchItem::Invalid`], never
//!   claimed; the rest of the batch is processed.
//! - **Rows of leased handlers** of the same consumer (one more statement, only when the
//!   claim found rows there): a lease in progress is [`BatchItem::InProgress`] (retry,
//!   never acknowledge); an expired mark-first mark is
//!   [`Duplicate::OutcomeUnknown`]; an expired send-first lease is taken over and
//!   processed with the batch.
//!
//! - **Payload fingerprints** ([`Batch::fingerprint`]): each message's fingerprint is
//!   written with the row the claim inserts (the same one statement, one column more) or
//!   the expired send-first lease it takes over (claimed, perhaps, without one),
//!   and read with the rows it found (the same one statement); a message whose id has a
//!   row with another fingerprint, or an earlier copy in the batch with another payload,
//!   is [`BatchItem::FingerprintMismatch`] and is neither processed nor acknowledged.
//!   Without it, the statements are those of a batch before fingerprints.
//!
//! A database failure of ours that persists (the claim or the commit failing for good,
//! the database away) ends the call with the error: acknowledge nothing of the batch.
//! What committed before it in this call comes back as duplicates.

mod ends;
mod handler;
#[cfg(feature = "mysql")]
mod mysql;
mod outcome;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use handler::{BatchError, BatchHandler};
pub use outcome::{BatchItem, BatchOutcome};

use ends::{Ended, Ends, Failure, Stats, back_off, fails_at_commit, transient};

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use sqlx::{Connection, Database, Pool};

use crate::backend::Backend;
use crate::claim::Found;
use crate::claim::Tx;
use crate::classify;
use crate::guarded::Guarded;
use crate::input::{self, Handle};
use crate::key::{MessageId, MessageKey};
use crate::names::{InvalidConsumer, check_consumer};
use crate::outcome::Duplicate;
use crate::outcome::InProgress;
use crate::random::new_token;
use crate::rolled_back::RolledBack;
use crate::stored::{Fingerprint, FingerprintMismatch};
use crate::table::{DEFAULT_TABLE, InvalidTableName, Table};

/// How one backend claims and seals a batch's dedup rows.
#[doc(hidden)]
pub trait BatchBackend: Database {
    /// Inserts the dedup rows of `ids` (distinct, in byte order) that are not there yet,
    /// in one statement where the backend allows it; returns the ids inserted now.
    /// `token`: this transaction's own, for backends that read the new rows back by it.
    /// `prints`: the ids' payload fingerprints, in the same order, written into the new
    /// rows (`None`: the statement without the column, as before fingerprints).
    fn claim_many<'c>(
        conn: &'c mut Self::Connection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        prints: Option<&'c [&'c [u8]]>,
        token: &'c [u8; 16],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'c;

    /// The rows of `ids` that the claim found there, each with what it says (a lease in
    /// progress, a mark-first call's unknown outcome, processed), and with its stored
    /// fingerprint when `printed`; an id whose row is gone (a lease released in between)
    /// is missing from the answer.
    fn inspect_many<'c>(
        conn: &'c mut Self::Connection,
        table: &'c Table,
        consumer: &'c str,
        ids: &'c [&'c str],
        printed: bool,
    ) -> impl Future<Output = Result<Vec<Inspected>, sqlx::Error>> + Send + 'c;

    /// Takes over the expired send-first lease of `id` as this transaction's claim (MySQL:
    /// with `token` as its owner, as [`seal_many`](Self::seal_many) checks); `Ok(false)`
    /// when the row is not one (any more). `print`: the message's fingerprint, written as
    /// the claim writes it (the lease may have been claimed without one), and only over a
    /// row that has none or the same one; `None`: the statement without the column.
    fn take_over_one<'c>(
        conn: &'c mut Self::Connection,
        table: &'c Table,
        consumer: &'c str,
        id: &'c str,
        print: Option<&'c [u8]>,
        token: &'c [u8; 16],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// Before the commit, on the rows `fresh` this transaction claimed: their
    /// `processed_at` moved to now when the transaction was `slow` (PostgreSQL, SQLite;
    /// MySQL always); and where a body that swallowed an error could have gone on in a
    /// new transaction (MySQL: InnoDB ends one on a deadlock), a check that the rows are
    /// still this transaction's own, [`RolledBack`] otherwise.
    fn seal_many<'c>(
        conn: &'c mut Self::Connection,
        table: &'c Table,
        consumer: &'c str,
        fresh: &'c [&'c str],
        token: &'c [u8; 16],
        slow: bool,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;
}

/// A row [`BatchBackend::inspect_many`] found.
#[doc(hidden)]
pub struct Inspected {
    pub(crate) id: String,
    pub(crate) found: Found,
    /// The payload fingerprint stored with it (asked for, and there).
    pub(crate) fingerprint: Option<Vec<u8>>,
}

impl Inspected {
    /// A processed row of `id` with no fingerprint: what a table without migration `0005`'s columns holds.
    #[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
    pub(crate) fn processed(id: &str) -> Inspected {
        Inspected {
            id: id.to_owned(),
            found: Found::PROCESSED,
            fingerprint: None,
        }
    }
}

/// A batch handler's settings: its consumer, its dedup table, its business keys and
/// (`P`) how it fingerprints a message's payload, if it does.
/// Cheap to keep; [`run`](Self::run) it for each batch the broker hands over.
#[derive(Debug, Clone)]
pub struct Batch<P = Unprinted> {
    consumer: String,
    table: Table,
    unique: &'static [&'static str],
    print: P,
}

/// A [`Batch`] that does not fingerprint its messages (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unprinted;

/// A [`Batch`] that fingerprints each message with `F` ([`Batch::fingerprint`]).
#[derive(Clone, Copy)]
pub struct Fingerprinted<F>(F);

impl<F> std::fmt::Debug for Fingerprinted<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fingerprinted(..)")
    }
}

/// How a [`Batch`] fingerprints a message: [`Unprinted`] or [`Fingerprinted`].
#[doc(hidden)]
pub trait Printer<M>: Send + Sync {
    /// The fingerprint of `message`, if the batch takes them.
    fn print(&self, message: &M) -> Option<Fingerprint>;
}

impl<M> Printer<M> for Unprinted {
    fn print(&self, _: &M) -> Option<Fingerprint> {
        None
    }
}

impl<M, F: Fn(&M) -> Fingerprint + Send + Sync> Printer<M> for Fingerprinted<F> {
    fn print(&self, message: &M) -> Option<Fingerprint> {
        Some((self.0)(message))
    }
}

impl Batch {
    /// A batch handler for `consumer` (the name `#[idempotent(consumer = …)]` would take;
    /// the same rows as its single-message handlers), on `processed_messages`.
    pub fn new(consumer: &str) -> Result<Batch, InvalidConsumer> {
        check_consumer(consumer)?;
        Ok(Batch {
            consumer: consumer.to_owned(),
            table: Table::new(DEFAULT_TABLE).expect("the default table name is valid"),
            unique: &[],
            print: Unprinted,
        })
    }
}

impl<P> Batch<P> {
    /// Its dedup rows in `table` (as `#[idempotent(table = …)]`), checked here.
    ///
    /// ```
    /// use dedup_runtime::batch::Batch;
    ///
    /// let batch = Batch::new("billing")?.in_table("audit.processed_messages")?;
    /// # drop(batch);
    /// assert!(Batch::new("billing")?.in_table("t; DROP TABLE users").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn in_table(self, table: &str) -> Result<Batch<P>, InvalidTableName> {
        Ok(Batch {
            table: Table::new(table)?,
            ..self
        })
    }

    /// Business keys (as `#[idempotent(unique = …)]`): a message whose body violates one
    /// of these unique constraints on its own is a duplicate, [`Duplicate::BusinessKey`].
    pub fn unique(self, constraints: &'static [&'static str]) -> Batch<P> {
        Batch {
            unique: constraints,
            ..self
        }
    }

    /// Payload fingerprints (as `#[idempotent(fingerprint = …)]`): `print` gives each
    /// message's, usually [`fingerprint`](crate::fingerprint) of its payload or of the
    /// part that makes it what it is. It is stored with each dedup row the batch claims;
    /// a message whose id has a row with another fingerprint — processed, in progress,
    /// an unknown outcome, an expired send-first lease — is
    /// [`BatchItem::FingerprintMismatch`], and so is a copy within the batch whose payload
    /// differs from the first's. An identical redelivery stays a duplicate; a row stored
    /// without a fingerprint has nothing to compare, and counts as before.
    ///
    /// ```
    /// # use dedup_runtime::batch::Batch;
    /// struct Paid { id: String, body: Vec<u8> }
    /// let batch = Batch::new("billing")?
    ///     .fingerprint(|paid: &Paid| dedup_runtime::fingerprint(&paid.body));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fingerprint<M, F>(self, print: F) -> Batch<Fingerprinted<F>>
    where
        F: Fn(&M) -> Fingerprint + Send + Sync,
    {
        Batch {
            consumer: self.consumer,
            table: self.table,
            unique: self.unique,
            print: Fingerprinted(print),
        }
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Processes `messages`, keyed by `key`: claims their ids in one statement, runs
    /// `handler` once on the connection of that transaction with the messages not
    /// processed before (in input order, each id once), and commits; splits the fresh
    /// messages when the handler fails (see the [module](self)). The outcome has one item
    /// per message, in input order. `handler` is not called for a transaction with no
    /// fresh message.
    ///
    /// # Errors
    ///
    /// A failure of ours that retries did not cure: the pool, the claim, the commit.
    /// Nothing of the transaction in hand committed; sub-batches of this call that had
    /// committed before come back as duplicates.
    pub async fn run<DB, M, K, H>(
        &self,
        pool: &Pool<DB>,
        messages: &[M],
        key: impl Fn(&M) -> &K,
        handler: &H,
    ) -> Result<BatchOutcome<H::Error>, sqlx::Error>
    where
        DB: Backend,
        M: Sync,
        K: MessageKey + ?Sized,
        H: BatchHandler<DB, M>,
        P: Printer<M>,
    {
        let ids = ids_of(messages, key);
        self.run_from(Source::Pool(pool), messages, &ids, handler)
            .await
    }

    /// [`run`](Self::run) on a connection of the caller's.
    ///
    /// Outside a transaction, it runs as `run` does, on that connection. Inside one (pass
    /// `&mut *tx` of a `sqlx::Transaction`), each sub-batch is a savepoint in it, and what
    /// it processed commits or rolls back with the caller's transaction:
    ///
    /// - nothing is retried there: a transient failure of ours (the claim, the check
    ///   before the savepoint's release) ends the call with the error — the caller retries
    ///   its transaction — and one of the handler's splits the batch like any failure;
    /// - on MySQL and MariaDB a deadlock rolls the caller's whole transaction back (InnoDB
    ///   does): the call ends with [`RolledBack`], or the database's
    ///   error;
    /// - a failing handler's splits add a savepoint each; PostgreSQL keeps up to 64
    ///   subtransactions of a transaction in shared memory before every session slows
    ///   down, so keep the caller's transaction short when batches may split often.
    pub async fn run_on<DB, M, K, H>(
        &self,
        conn: &mut DB::Connection,
        messages: &[M],
        key: impl Fn(&M) -> &K,
        handler: &H,
    ) -> Result<BatchOutcome<H::Error>, sqlx::Error>
    where
        DB: Backend,
        M: Sync,
        K: MessageKey + ?Sized,
        H: BatchHandler<DB, M>,
        P: Printer<M>,
    {
        let ids = ids_of(messages, key);
        self.run_from(Source::Conn(conn), messages, &ids, handler)
            .await
    }

    /// The function `#[idempotent(batch = …)]` generates calls this, on what its caller
    /// passed.
    pub(crate) async fn run_handle<DB, M, H>(
        &self,
        handle: &mut Handle<'_, DB>,
        messages: &[M],
        key: fn(&M) -> MessageId<'static>,
        handler: &H,
    ) -> Result<BatchOutcome<H::Error>, sqlx::Error>
    where
        DB: Backend,
        M: Sync,
        H: BatchHandler<DB, M>,
        P: Printer<M>,
    {
        let ids: Vec<MessageId<'static>> = messages.iter().map(key).collect();
        let source = match &mut handle.source {
            input::Source::Pool(pool, _) => Source::Pool(pool),
            input::Source::Conn(conn) => Source::Conn(&mut **conn),
        };
        self.run_from(source, messages, &ids, handler).await
    }

    async fn run_from<DB, M, H>(
        &self,
        mut source: Source<'_, DB>,
        messages: &[M],
        keys: &[MessageId<'_>],
        handler: &H,
    ) -> Result<BatchOutcome<H::Error>, sqlx::Error>
    where
        DB: Backend,
        M: Sync,
        H: BatchHandler<DB, M>,
        P: Printer<M>,
    {
        let mut items: Vec<Option<BatchItem<H::Error>>> = Vec::with_capacity(messages.len());
        // Each message's fingerprint, when the batch takes them.
        let prints: Option<Vec<Fingerprint>> = messages
            .iter()
            .map(|message| self.print.print(message))
            .collect();
        let print = |index: usize| prints.as_ref().map(|prints| prints[index]);
        // The distinct valid ids, each with the index of its first message.
        let mut ids: Vec<(String, usize)> = Vec::new();
        let mut first: HashMap<String, usize> = HashMap::new();
        for (index, id) in keys.iter().enumerate() {
            match id.validate() {
                Err(invalid) => items.push(Some(BatchItem::Invalid(invalid))),
                Ok(id) => match first.get(id) {
                    // A copy with another payload than the first's: an id reused.
                    Some(&earlier) if print(index) != print(earlier) => {
                        items.push(Some(BatchItem::FingerprintMismatch(
                            FingerprintMismatch::new(
                                &self.consumer,
                                id,
                                print(earlier).unwrap_or_default(),
                                print(index).unwrap_or_default(),
                            ),
                        )));
                    }
                    Some(&earlier) => items.push(Some(BatchItem::SameAs { first: earlier })),
                    None => {
                        first.insert(id.to_owned(), index);
                        ids.push((id.to_owned(), index));
                        items.push(None);
                    }
                },
            }
        }
        // Byte order: overlapping batches lock their rows in one order.
        ids.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        // Sub-batches still to run, as ranges of `ids` in input order of their messages.
        // (None at all when no id is valid: no transaction for nothing.)
        let mut pending: Vec<Vec<usize>> = if ids.is_empty() {
            Vec::new()
        } else {
            vec![(0..ids.len()).collect()]
        };
        let mut stats = Stats::default();
        while let Some(part) = pending.pop() {
            let ended = self
                .transaction(
                    &mut source,
                    messages,
                    prints.as_deref(),
                    &ids,
                    &part,
                    handler,
                )
                .await?;
            stats.transactions += 1;
            match ended {
                Ended::Committed { fresh, duplicates } => {
                    for k in fresh {
                        items[ids[k].1] = Some(BatchItem::Processed);
                    }
                    for (k, seen) in duplicates {
                        items[ids[k].1] = Some(seen.item());
                    }
                }
                Ended::Failed {
                    fresh,
                    duplicates,
                    error,
                } => {
                    for (k, seen) in duplicates {
                        items[ids[k].1] = Some(seen.item());
                    }
                    match (fresh.len(), error) {
                        (1, Failure::BusinessKey(constraint)) => {
                            items[ids[fresh[0]].1] =
                                Some(BatchItem::Duplicate(Duplicate::BusinessKey { constraint }));
                        }
                        (1, Failure::Body(error)) => {
                            items[ids[fresh[0]].1] = Some(BatchItem::Failed(error));
                        }
                        (1, Failure::Commit(error)) => {
                            items[ids[fresh[0]].1] = Some(BatchItem::CommitFailed(error));
                        }
                        (_, _) => {
                            // Split: the halves run next, the first half first.
                            stats.splits += 1;
                            let (left, right) = fresh.split_at(fresh.len() / 2);
                            pending.push(right.to_vec());
                            pending.push(left.to_vec());
                        }
                    }
                }
            }
        }
        let outcome = BatchOutcome {
            items: items
                .into_iter()
                .map(|item| item.expect("every message has an outcome"))
                .collect(),
            splits: stats.splits,
        };
        crate::metrics::batch_ran(
            &self.consumer,
            messages.len(),
            [
                ("processed", outcome.processed()),
                ("duplicate", outcome.duplicates()),
                ("failed", outcome.failed()),
                ("in_progress", outcome.in_progress()),
                ("fingerprint_mismatch", outcome.mismatches()),
                (
                    "copy",
                    outcome.count(|i| matches!(i, BatchItem::SameAs { .. })),
                ),
                (
                    "invalid",
                    outcome.count(|i| matches!(i, BatchItem::Invalid(_))),
                ),
            ],
            stats.splits,
        );
        tracing::debug!(
            consumer = self.consumer,
            messages = messages.len(),
            transactions = stats.transactions,
            splits = stats.splits,
            "batch processed"
        );
        Ok(outcome)
    }

    /// One sub-batch, `part` (indices into `ids`), in its own transaction (or savepoint),
    /// retried while a failure is transient (not in a caller's transaction).
    async fn transaction<DB, M, H>(
        &self,
        source: &mut Source<'_, DB>,
        messages: &[M],
        prints: Option<&[Fingerprint]>,
        ids: &[(String, usize)],
        part: &[usize],
        handler: &H,
    ) -> Result<Ended<H::Error>, sqlx::Error>
    where
        DB: Backend,
        M: Sync,
        H: BatchHandler<DB, M>,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let last = attempt >= crate::retry::MAX_ATTEMPTS;
            let step = match source {
                Source::Pool(pool) => {
                    // Closed, not pooled, unless the transaction ends here as it should (a
                    // call cancelled mid-transaction, a MySQL session left out of
                    // autocommit).
                    let mut conn = Guarded::new(pool.acquire().await?);
                    let ends = Ends {
                        nested: false,
                        pooled: true,
                    };
                    let (step, clean) = self
                        .attempt(&mut *conn, ends, last, messages, prints, ids, part, handler)
                        .await;
                    if clean {
                        conn.set_clean();
                    }
                    step
                }
                Source::Conn(conn) => {
                    let ends = Ends {
                        nested: conn.is_in_transaction(),
                        pooled: false,
                    };
                    let last = last || ends.nested;
                    self.attempt(
                        &mut **conn,
                        ends,
                        last,
                        messages,
                        prints,
                        ids,
                        part,
                        handler,
                    )
                    .await
                    .0
                }
            };
            match step {
                Step::Ended(ended) => return Ok(ended),
                Step::Error(error) => return Err(error),
                Step::Retry => back_off(attempt).await,
            }
        }
    }

    /// One attempt of [`transaction`](Self::transaction) on `conn`; `last`: no retry
    /// after it. Also says whether the connection was left as it was found (a pooled one
    /// can go back to its pool).
    #[allow(clippy::too_many_arguments)]
    async fn attempt<DB, M, H>(
        &self,
        conn: &mut DB::Connection,
        ends: Ends,
        last: bool,
        messages: &[M],
        prints: Option<&[Fingerprint]>,
        ids: &[(String, usize)],
        part: &[usize],
        handler: &H,
    ) -> (Step<H::Error>, bool)
    where
        DB: Backend,
        M: Sync,
        H: BatchHandler<DB, M>,
    {
        let business_keys = !self.unique.is_empty();
        let retry = !last;
        let token = new_token();
        let unclean = AtomicBool::new(DB::CHANGES_SESSION && !ends.nested);
        let begun = if ends.nested {
            DB::begin_nested(conn, business_keys).await
        } else {
            DB::begin_owned(conn, business_keys).await
        };
        let tx = match begun {
            Ok(tx) => tx,
            Err(error) if retry && transient::<DB>(&error) => return (Step::Retry, false),
            Err(error) => return (Step::Error(error), false),
        };
        let mut tx = Tx {
            tx,
            unclean: &unclean,
        };
        let clean = |unclean: &AtomicBool| !unclean.load(std::sync::atomic::Ordering::Relaxed);
        let wanted: Vec<&str> = part.iter().map(|&k| ids[k].0.as_str()).collect();
        let wanted_prints = prints_of(prints, ids, part);
        let claimed_at = Instant::now();
        let claimed = DB::claim_many(
            &mut *tx.tx,
            &self.table,
            &self.consumer,
            &wanted,
            wanted_prints.as_deref(),
            &token,
        )
        .await;
        let claimed: HashSet<String> = match claimed {
            Ok(claimed) => claimed.into_iter().collect(),
            Err(error) => {
                ends.rollback(tx, true).await;
                if retry && transient::<DB>(&error) {
                    return (Step::Retry, false);
                }
                return (Step::Error(error), false);
            }
        };
        // The fresh ones in their messages' input order, for the handler.
        let (mut fresh, found): (Vec<usize>, Vec<usize>) = part
            .iter()
            .partition(|&&k| claimed.contains(ids[k].0.as_str()));
        let duplicates = if found.is_empty() {
            Vec::new()
        } else {
            match self
                .settle::<DB>(&mut *tx.tx, prints, ids, &found, &token, &mut fresh)
                .await
            {
                Ok(duplicates) => duplicates,
                Err(error) => {
                    ends.rollback(tx, true).await;
                    if retry && transient::<DB>(&error) {
                        return (Step::Retry, false);
                    }
                    return (Step::Error(error), false);
                }
            }
        };
        fresh.sort_unstable_by_key(|&k| ids[k].1);
        if fresh.is_empty() {
            ends.rollback(tx, false).await;
            return (
                Step::Ended(Ended::Committed { fresh, duplicates }),
                clean(&unclean),
            );
        }
        let batch: Vec<&M> = fresh.iter().map(|&k| &messages[ids[k].1]).collect();
        let ran = handler.handle(&mut *tx.tx, &batch).await;
        let ended = match ran {
            Ok(()) => {
                let sealed: Vec<&str> = fresh.iter().map(|&k| ids[k].0.as_str()).collect();
                let slow = claimed_at.elapsed() >= crate::clock::STAMP_AFTER;
                let committed = match DB::seal_many(
                    &mut *tx.tx,
                    &self.table,
                    &self.consumer,
                    &sealed,
                    &token,
                    slow,
                )
                .await
                {
                    Ok(()) => ends.commit(tx).await,
                    Err(error) => {
                        ends.rollback(tx, true).await;
                        Err(error)
                    }
                };
                match committed {
                    Ok(()) => Ended::Committed { fresh, duplicates },
                    Err(error)
                        if retry
                            && (transient::<DB>(&error) || RolledBack::find(&error).is_some()) =>
                    {
                        return (Step::Retry, false);
                    }
                    // A failure of a message's own that shows only at the commit (a
                    // deferred constraint; a statement error the body swallowed, which
                    // left the transaction rolled back however often it ran): split like
                    // a failure of the body. Not where the database is away (nothing to
                    // learn from splitting), nor in a caller's transaction that the
                    // database ended (every savepoint of it is gone).
                    Err(error) if fails_at_commit::<DB>(&error, ends) => Ended::Failed {
                        fresh,
                        duplicates,
                        error: Failure::Commit(error),
                    },
                    Err(error) => return (Step::Error(error), false),
                }
            }
            Err(error) => {
                let cause = error.as_std_error();
                let transient = classify::is_transient::<DB>(cause);
                let violation = if business_keys && fresh.len() == 1 {
                    classify::unique_violation::<DB>(cause)
                } else {
                    None
                };
                let business_key = match violation {
                    Some(violation) => DB::matching(&mut *tx.tx, violation, self.unique).await,
                    None => None,
                };
                ends.rollback(tx, true).await;
                if business_key.is_none() && transient && retry {
                    return (Step::Retry, false);
                }
                Ended::Failed {
                    fresh,
                    duplicates,
                    error: match business_key {
                        Some(constraint) => Failure::BusinessKey(constraint),
                        None => Failure::Body(error),
                    },
                }
            }
        };
        (Step::Ended(ended), clean(&unclean))
    }
}

impl<P> Batch<P> {
    /// The ids of `found` (indices into `ids`) that the claim found there: what each row
    /// says. Processed → a duplicate; in progress under another delivery's lease →
    /// [`BatchItem::InProgress`] (retry, never acknowledge); a mark-first call's unknown
    /// outcome → a duplicate, as for a leased handler; an expired send-first lease is
    /// taken over and joins `fresh`, and so does a row that went away in between (its
    /// lease released), claimed again. With `prints`, a row whose fingerprint differs
    /// from its message's is a mismatch, whatever its state.
    async fn settle<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        prints: Option<&[Fingerprint]>,
        ids: &[(String, usize)],
        found: &[usize],
        token: &[u8; 16],
        fresh: &mut Vec<usize>,
    ) -> Result<Vec<(usize, Seen)>, sqlx::Error> {
        let wanted: Vec<&str> = found.iter().map(|&k| ids[k].0.as_str()).collect();
        let rows: HashMap<String, Inspected> =
            DB::inspect_many(conn, &self.table, &self.consumer, &wanted, prints.is_some())
                .await?
                .into_iter()
                .map(|row| (row.id.clone(), row))
                .collect();
        let mut seen = Vec::with_capacity(found.len());
        let mut gone = Vec::new();
        for &k in found {
            let id = ids[k].0.as_str();
            let Some(Inspected {
                found: row,
                fingerprint,
                ..
            }) = rows.get(id)
            else {
                gone.push(k);
                continue;
            };
            if let (Some(prints), Some(stored)) = (prints, fingerprint.as_deref())
                && let Some(mismatch) =
                    FingerprintMismatch::between(&self.consumer, id, stored, prints[ids[k].1])
            {
                seen.push((k, Seen::Mismatch(mismatch)));
                continue;
            }
            let remaining =
                Duration::from_micros(u64::try_from(row.remaining_us.unwrap_or(0)).unwrap_or(0));
            match row.state {
                None => seen.push((k, Seen::Duplicate(Duplicate::AlreadyProcessed))),
                Some(_) if !remaining.is_zero() => {
                    seen.push((k, Seen::InProgress(InProgress::new(remaining))));
                }
                Some(2) => {
                    tracing::warn!(
                        consumer = self.consumer,
                        message_id = id,
                        "outcome unknown: a mark-first delivery never completed its call; \
                         acknowledged without calling again (resolve it with \
                         `Ledger::resolve`)"
                    );
                    seen.push((k, Seen::Duplicate(Duplicate::OutcomeUnknown)));
                }
                Some(_) => {
                    let print = prints.map(|prints| &prints[ids[k].1][..]);
                    if DB::take_over_one(conn, &self.table, &self.consumer, id, print, token)
                        .await?
                    {
                        tracing::warn!(
                            consumer = self.consumer,
                            message_id = id,
                            "took over an expired send-first lease: its owner may have made \
                             the call already, and the batch's effect is applied now"
                        );
                        fresh.push(k);
                    } else {
                        // Completed, released or taken over in between: the next delivery
                        // looks again.
                        seen.push((k, Seen::InProgress(InProgress::new(Duration::ZERO))));
                    }
                }
            }
        }
        if !gone.is_empty() {
            let again: Vec<&str> = gone.iter().map(|&k| ids[k].0.as_str()).collect();
            let again_prints = prints_of(prints, ids, &gone);
            let claimed: HashSet<String> = DB::claim_many(
                conn,
                &self.table,
                &self.consumer,
                &again,
                again_prints.as_deref(),
                token,
            )
            .await?
            .into_iter()
            .collect();
            for k in gone {
                if claimed.contains(ids[k].0.as_str()) {
                    fresh.push(k);
                } else {
                    seen.push((k, Seen::InProgress(InProgress::new(Duration::ZERO))));
                }
            }
        }
        Ok(seen)
    }
}

/// The fingerprints of `part` (indices into `ids`), in its order, as the claim binds
/// them.
fn prints_of<'p>(
    prints: Option<&'p [Fingerprint]>,
    ids: &[(String, usize)],
    part: &[usize],
) -> Option<Vec<&'p [u8]>> {
    prints.map(|prints| part.iter().map(|&k| &prints[ids[k].1][..]).collect())
}

/// What a claim that found a message's row there made of it.
enum Seen {
    Duplicate(Duplicate),
    InProgress(InProgress),
    Mismatch(FingerprintMismatch),
}

impl Seen {
    fn item<E>(self) -> BatchItem<E> {
        match self {
            Seen::Duplicate(duplicate) => BatchItem::Duplicate(duplicate),
            Seen::InProgress(busy) => BatchItem::InProgress(busy),
            Seen::Mismatch(mismatch) => BatchItem::FingerprintMismatch(mismatch),
        }
    }
}

/// The message id of each of `messages`, in order, as `key` finds it.
fn ids_of<'m, M, K: MessageKey + ?Sized + 'm>(
    messages: &'m [M],
    key: impl Fn(&'m M) -> &'m K,
) -> Vec<MessageId<'m>> {
    messages
        .iter()
        .map(|message| key(message).message_id())
        .collect()
}

/// What one attempt leads to.
enum Step<E> {
    Ended(Ended<E>),
    /// A transient failure: run the transaction again, after a backoff.
    Retry,
    Error(sqlx::Error),
}

/// Where a batch's transactions run.
enum Source<'s, DB: Database> {
    Pool(&'s Pool<DB>),
    Conn(&'s mut DB::Connection),
}
