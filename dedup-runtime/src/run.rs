//! One call of a generated handler: begin and claim, run the body, commit or abort,
//! retry. The generated code drives the loop, because the body must run inline, in the
//! handler's own generic context; every decision is made here. Each step answers with
//! what comes next: [`Begin`], [`Commit`], [`Abort`] (`Retry` = back off and begin again,
//! `Error` = the call ends with an error of ours, `BodyError` = with the body's), and
//! the call's end is an [`Exit`].
//!
//! Why not one `Run::drive(handle, async |tx| body)` that owns the loop: a handler may
//! declare `tx: &mut sqlx::Transaction<'_, DB>`, whose lifetime is that of one attempt's
//! borrow of the handle, so the body's argument type is not one type but a family over
//! that lifetime, which a generic driver cannot name (`AsyncFnMut(&mut C) -> R` needs one
//! `C`); and the handler's error type is only known at the call site, where the error
//! probe (`probe!`, autoref specialisation) must run. Inline, both are inferred.
//!
//! The protocol, as the expansion of one handler (`dedup-macros/src/expand.rs` builds
//! it):
//!
//! ```rust,ignore
//! #[idempotent(consumer = "billing", key = msg.id, unique = "payments_order_key")]
//! async fn mark_paid(tx: &mut PgConnection, msg: &Paid) -> Result<(), sqlx::Error> { body }
//!
//! // expands to (paths shortened: `__private::` is `::dedup_runtime::__private::`; the
//! // `__dedup_` locals are mixed-site, invisible to the body):
//! async fn mark_paid(
//!     __dedup_db: impl __private::Db<'_, <PgConnection as __private::HandlerConnection<'static>>::Database>,
//!     msg: &Paid,
//! ) -> Result<::dedup_runtime::Outcome<()>, sqlx::Error> {
//!     trait __DedupRetryable<C, R> { /* see `retryable()` */ }
//!     static __DEDUP_METRICS: __private::HandlerMetrics = __private::HandlerMetrics::new();
//!     let __dedup_exit = match __private::message_id(&msg.id) {
//!         Err(__dedup_error) => {
//!             __private::Exit::Error(__private::refused(&__DEDUP_METRICS, "mark_paid", "billing", __dedup_error))
//!         }
//!         Ok(__dedup_id) => {
//!             let mut __dedup_run = __private::Run::new(
//!                 "mark_paid",
//!                 Some(__private::Claim::new(
//!                     __private::statements!("processed_messages"),
//!                     "billing",
//!                     &__dedup_id,
//!                 )),
//!                 &["payments_order_key"],
//!                 &__DEDUP_METRICS, // the handler's metric keys, built at its first call
//!             );
//!             let mut __dedup_handle = __private::Db::into_handle(__dedup_db);
//!             let __dedup_span = __dedup_run.span();
//!             __private::Instrument::instrument(async {
//!                 loop {
//!                     let mut __dedup_tx = match __dedup_run.begin(&mut __dedup_handle).await {
//!                         __private::Begin::Claimed(__dedup_tx) => __dedup_tx,
//!                         __private::Begin::Duplicate(__dedup_duplicate) => {
//!                             break __private::Exit::Outcome(Outcome::Duplicate(__dedup_duplicate));
//!                         }
//!                         __private::Begin::Retry => continue,
//!                         __private::Begin::Error(__dedup_error) => break __private::Exit::Error(__dedup_error),
//!                     };
//!                     let __dedup_result = {
//!                         let __dedup_conn: &mut PgConnection =
//!                             <PgConnection as __private::HandlerConnection<'_>>::from_transaction(&mut __dedup_tx);
//!                         let __dedup_body = async |tx: &mut PgConnection| {
//!                             if false { let __dedup_fake: Result<(), sqlx::Error> = loop {}; return __dedup_fake; }
//!                             body
//!                         };
//!                         __DedupRetryable::<_, _>::__dedup_retryable(__dedup_body)(__dedup_conn).await
//!                     };
//!                     match __dedup_result {
//!                         Ok(__dedup_value) => match __dedup_run.commit(__dedup_tx).await {
//!                             __private::Commit::Committed => {
//!                                 break __private::Exit::Outcome(Outcome::Processed(__dedup_value));
//!                             }
//!                             __private::Commit::Retry => continue,
//!                             __private::Commit::Error(__dedup_error) => break __private::Exit::Error(__dedup_error),
//!                         },
//!                         Err(__dedup_error) => match __dedup_run.abort(__dedup_tx, __private::probe!(&__dedup_error)).await {
//!                             __private::Abort::Duplicate(__dedup_duplicate) => {
//!                                 break __private::Exit::Outcome(Outcome::Duplicate(__dedup_duplicate));
//!                             }
//!                             __private::Abort::Retry => continue,
//!                             __private::Abort::BodyError => break __private::Exit::BodyError(__dedup_error),
//!                         },
//!                     }
//!                 }
//!             }, __dedup_span).await
//!         }
//!     };
//!     match __dedup_exit {
//!         __private::Exit::Outcome(__dedup_value) => Ok(__dedup_value),
//!         __private::Exit::BodyError(__dedup_error) => Err(__dedup_error),
//!         __private::Exit::Error(__dedup_error) => Err(__private::into_handler_error(__dedup_error)),
//!     }
//! }
//! ```
//!
//! With `effect = "send-first"` the expansion is the same but for one call,
//! `__private::Run::new(…).send_first()`: the body may make an external call, so after it
//! ran, `commit` answers `Commit::Error` (never `Commit::Retry`) and `abort` answers
//! `Abort::BodyError` (never `Abort::Retry`), and the loop cannot reach the body a second
//! time. `begin` still retries: its failures come before the body.

#![allow(missing_docs)]

use std::error::Error as StdError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Connection};
use tracing::Span;

use crate::backend::Backend;
use crate::claim::Found;
use crate::claim::{self, Claimed, Claiming, Statements, Tx};
use crate::classify;
use crate::input::{Handle, Source};
use crate::key::{MessageId, MessageKey};
use crate::metrics::{self, Class, End, HandlerMetrics};
use crate::outcome::InProgress;
use crate::outcome::{Duplicate, StoredOutcome};
use crate::retry;
use crate::rolled_back::RolledBack;
use crate::stored::{Codec, Fingerprint, Memory, Remembered, Stored};

/// The validated id of `key`, or the typed error for a bad one.
pub fn message_id<K: MessageKey + ?Sized>(key: &K) -> Result<MessageId<'_>, sqlx::Error> {
    let id = key.message_id();
    id.validate()?;
    Ok(id)
}

/// The call is over before it began: `key` gave an invalid id (`error`, from
/// [`message_id`]). Counted, and returned.
pub fn refused(
    metrics: &'static HandlerMetrics,
    handler: &'static str,
    consumer: &'static str,
    error: sqlx::Error,
) -> sqlx::Error {
    metrics::ended(
        metrics,
        handler,
        consumer,
        End::Failed(Class::InvalidId),
        metrics::Started::now(),
    );
    error
}

/// How a call ended, before an error of ours is converted into the handler's `E` (in one
/// place, so that a missing `From<sqlx::Error>` is reported once).
pub enum Exit<O, E> {
    /// Processed, or a duplicate (an [`Outcome`](crate::Outcome), or a leased call's `LeaseOutcome`).
    Outcome(O),
    /// The body returned this error, and it is not retried.
    BodyError(E),
    /// An error of ours: an invalid id, the claim, the commit, the connection.
    Error(sqlx::Error),
}

/// What [`Run::begin`] leads to.
pub enum Begin<'h, DB: Backend> {
    /// The transaction is open and the dedup row (if any) is in: run the body on it.
    Claimed(Tx<'h, DB>),
    /// The message was processed before: the call is over.
    Duplicate(Duplicate),
    /// A transient failure, already backed off: begin again.
    Retry,
    /// The call is over with this error.
    Error(sqlx::Error),
}

/// What [`Run::commit`] leads to.
pub enum Commit {
    /// Committed: the call is over, processed.
    Committed,
    /// A transient failure (or a transaction the database rolled back by itself), already
    /// backed off: begin again.
    Retry,
    /// The call is over with this error.
    Error(sqlx::Error),
}

/// What [`Run::abort`] leads to, after the body returned an error.
pub enum Abort {
    /// A unique constraint named in `unique = …` caught the business key: a duplicate.
    Duplicate(Duplicate),
    /// The body's error was transient, already backed off: begin again.
    Retry,
    /// The call is over with the body's error.
    BodyError,
}

/// After an error of ours: run the attempt again, or end the call with it.
enum Next {
    Retry,
    Error(sqlx::Error),
}

impl<DB: Backend> From<Next> for Begin<'_, DB> {
    fn from(next: Next) -> Self {
        match next {
            Next::Retry => Begin::Retry,
            Next::Error(error) => Begin::Error(error),
        }
    }
}

impl From<Next> for Commit {
    fn from(next: Next) -> Self {
        match next {
            Next::Retry => Commit::Retry,
            Next::Error(error) => Commit::Error(error),
        }
    }
}

/// The dedup row a handler with `key = …` claims: its table's statements, the consumer
/// and the validated message id. (A handler with `unique = …` alone claims none: its
/// constraints are [`Run::new`]'s `unique`.)
pub struct Claim<'k> {
    statements: &'static Statements,
    consumer: &'static str,
    id: &'k str,
}

impl<'k> Claim<'k> {
    pub fn new(
        statements: &'static Statements,
        consumer: &'static str,
        id: &'k MessageId<'_>,
    ) -> Self {
        Claim {
            statements,
            consumer,
            id: id.as_str(),
        }
    }
}

/// The state of one call across its attempts.
pub struct Run<'k> {
    handler: &'static str,
    claim: Option<Claim<'k>>,
    unique: &'static [&'static str],
    span: Span,
    attempt: u32,
    /// Whether the current attempt's transaction is ours (not a savepoint in the
    /// caller's): only then can a transient failure be retried.
    owned: bool,
    /// Whether the current attempt's connection came from a pool (and goes back to it).
    pooled: bool,
    /// When the current attempt's claim was sent.
    claimed_at: Option<Instant>,
    /// Whether a transient failure after the body ran may run it again: not for
    /// `effect = "send-first"`, whose body may have made an external call ([`Run::send_first`]).
    rerun_body: bool,
    started: metrics::Started,
    metrics: &'static HandlerMetrics,
    /// `result = "stored"`, `fingerprint = …`: what the row remembers.
    memory: Memory,
    /// The last begin's claim, sent with `BEGIN` (`ClaimBackend::begin_claim_sql`), found
    /// the row: its pooled connection still holds that transaction, which sqlx does not
    /// count. The next begin rolls it back there and looks at the row.
    found_with_begin: bool,
}

impl<'k> Run<'k> {
    pub fn new(
        handler: &'static str,
        claim: Option<Claim<'k>>,
        unique: &'static [&'static str],
        metrics: &'static HandlerMetrics,
    ) -> Self {
        let span = tracing::info_span!(
            "idempotent",
            handler,
            consumer = tracing::field::Empty,
            message_id = tracing::field::Empty,
            outcome = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        // Recording into a disabled span still costs a dispatch through `log`, which sqlx
        // turns on in `tracing`: skip it on the hot path when nobody listens.
        if let Some(claim) = &claim
            && !span.is_disabled()
        {
            span.record("consumer", claim.consumer);
            span.record("message_id", claim.id);
        }
        Run {
            handler,
            claim,
            unique,
            span,
            attempt: 0,
            owned: false,
            pooled: false,
            claimed_at: None,
            rerun_body: true,
            started: metrics::Started::now(),
            metrics,
            memory: Memory::default(),
            found_with_begin: false,
        }
    }

    /// `result = "stored"`: the body's result is stored with the dedup row, under
    /// `version`, at most `max_len` bytes encoded; a duplicate replays it.
    pub fn store_results(mut self, version: u32, max_len: usize) -> Self {
        self.memory.stored = Some(Stored { version, max_len });
        self
    }

    /// `fingerprint = …`: this delivery's payload fingerprint, stored with the dedup row
    /// and compared with the stored one by every claim that finds the row.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.memory.fingerprint = Some(fingerprint);
        self
    }

    /// The body's result, for the commit to store: encoded now, in the handler's generic
    /// context (`T` is only known there).
    pub fn keep_result<T>(&mut self, value: &T, codec: Codec<T>) {
        self.memory.keep(value, codec);
    }

    /// For a duplicate of a handler with `result = "stored"`: the stored result, as a
    /// replay, or the duplicate as it is when nothing was stored.
    pub fn replay<T, E>(
        &mut self,
        duplicate: Duplicate,
        codec: Codec<T>,
    ) -> Exit<StoredOutcome<T>, E> {
        // `found` left the call's end to be said here when there is a result to decode.
        let (answer, unsaid) = self.memory.answer(duplicate, codec);
        match answer {
            Ok(outcome) => {
                if unsaid {
                    self.finish(End::Duplicate(&duplicate));
                }
                Exit::Outcome(outcome)
            }
            Err(error) => {
                self.finish(End::Failed(Class::StoredResult));
                Exit::Error(error.error())
            }
        }
    }

    /// `effect = "send-first"`: the body may call something outside the database, so once
    /// it has run, nothing runs it again. A transient failure at `BEGIN` or at the claim
    /// (the body has not run) is still retried; one at `COMMIT`, a transient error from the
    /// body, or a transaction the database rolled back by itself ([`RolledBack`]) ends
    /// the call with the error: the caller sees it, instead of a silent second call.
    pub fn send_first(mut self) -> Self {
        self.rerun_body = false;
        self
    }

    pub fn span(&self) -> Span {
        self.span.clone()
    }

    fn consumer(&self) -> &'static str {
        self.claim.as_ref().map_or("", |claim| claim.consumer)
    }

    /// The call is over: its span and its metrics say how.
    fn finish(&self, end: End<'_>) {
        if !self.span.is_disabled() {
            self.span.record("outcome", end.outcome());
            self.span.record("attempts", self.attempt);
        }
        metrics::ended(
            self.metrics,
            self.handler,
            self.consumer(),
            end,
            self.started,
        );
    }

    /// Begins the transaction (or savepoint) and inserts the dedup row, if any. In a
    /// transaction of its own on a pooled MySQL connection, the insert goes out with
    /// `BEGIN`, in one round trip (`ClaimBackend::begin_claim_sql`);
    /// when it finds the row there, the next call begins again on the same connection
    /// to look at the row (`Begin::Retry`, no attempt spent, no back-off).
    pub async fn begin<'h, DB: Backend>(
        &mut self,
        handle: &'h mut Handle<'_, DB>,
    ) -> Begin<'h, DB> {
        self.attempt += 1;
        self.claimed_at = None;
        let business_keys = !self.unique.is_empty();
        let mut found = std::mem::take(&mut self.found_with_begin);
        let Handle { source, unclean } = handle;
        let unclean: &'h AtomicBool = unclean;
        let (conn, pooled) = match source {
            Source::Pool(pool, slot) => {
                self.owned = true;
                // Each attempt on a connection of its own, as `pool.begin()` would; one
                // that an earlier attempt left with a changed session is closed. After a
                // claim that found the row, the same one: its next statement rolls back.
                if !(found && slot.is_some()) {
                    found = false;
                    if let Some(mut previous) = slot.take()
                        && unclean.swap(false, Ordering::Relaxed)
                    {
                        previous.close_on_drop();
                    }
                    match pool.acquire().await {
                        Ok(conn) => *slot = Some(conn),
                        Err(error) => return self.after_error::<DB>(error, true).await.into(),
                    }
                }
                let Some(conn) = slot.as_deref_mut() else {
                    unreachable!("the slot was just filled")
                };
                (conn, true)
            }
            Source::Conn(conn) => {
                self.owned = !conn.is_in_transaction();
                (&mut **conn, false)
            }
        };
        self.pooled = pooled;
        // Only on a pooled connection, which is closed if the call ends while it holds a
        // transaction sqlx does not count: a lent one could not be cleaned up.
        let claim_sql = match &self.claim {
            Some(claim) if pooled && self.owned && !found => {
                DB::begin_claim_sql(claim.statements, claim.consumer, claim.id, business_keys)
            }
            _ => None,
        };
        let claiming = claim_sql.is_some();
        if pooled {
            unclean.store(DB::CHANGES_SESSION || claiming || found, Ordering::Relaxed);
        }
        let sent = Instant::now();
        let begun = if found {
            let claim = self.claim.as_ref().expect("found by a claim");
            // A duplicate's look at its row goes with the `ROLLBACK`, where the backend can
            // (not for a handler that compares or replays what the row remembers).
            let looked = if self.memory.recalls() {
                Ok(None)
            } else {
                DB::look_processed(conn, claim.statements, claim.consumer, claim.id).await
            };
            match looked {
                Ok(Some(true)) => {
                    // Rolled back, outside any transaction: the connection is clean.
                    unclean.store(false, Ordering::Relaxed);
                    let duplicate = Duplicate::AlreadyProcessed;
                    self.memory.recalled = None;
                    self.finish(End::Duplicate(&duplicate));
                    return Begin::Duplicate(duplicate);
                }
                // Rolled back; not a processed row: begin again and look as before.
                Ok(Some(false)) => DB::begin_owned(conn, business_keys).await,
                Ok(None) => DB::begin_again(conn, business_keys).await,
                // The connection is still unclean: closed at the next begin.
                Err(error) => return self.after_error::<DB>(error, true).await.into(),
            }
        } else if let Some(sql) = claim_sql {
            conn.begin_with(AssertSqlSafe(sql)).await
        } else if !self.owned {
            DB::begin_nested(conn, business_keys).await
        } else {
            DB::begin_owned(conn, business_keys).await
        };
        let tx = match begun {
            Ok(tx) => tx,
            Err(error) => {
                if claiming && DB::found_row(&error) {
                    self.found_with_begin = true;
                    self.attempt -= 1;
                    return Begin::Retry;
                }
                // A claim sent with `BEGIN` that failed otherwise left its connection
                // unclean: closed at the next begin.
                return self.after_error::<DB>(error, true).await.into();
            }
        };
        // sqlx counts the transaction now: its drop queues the `ROLLBACK`.
        if pooled {
            unclean.store(DB::CHANGES_SESSION, Ordering::Relaxed);
        }
        let mut tx = Tx { tx, unclean };
        if found {
            let sql = DB::claim_sql(self.claim.as_ref().expect("found by a claim").statements);
            return self.found::<DB>(tx, sql, None).await;
        }
        if claiming {
            self.claimed_at = Some(sent);
            return Begin::Claimed(tx);
        }
        let Some(claim) = &self.claim else {
            return Begin::Claimed(tx);
        };
        let sql = if self.owned {
            DB::claim_sql(claim.statements)
        } else {
            DB::nested_claim_sql(claim.statements)
        };
        let sent = Instant::now();
        match DB::claim(&mut tx.tx, claim.statements, sql, claim.consumer, claim.id).await {
            Ok(Claiming::Inserted) => {
                self.claimed_at = Some(sent);
                Begin::Claimed(tx)
            }
            Ok(Claiming::Found(found)) => self.found::<DB>(tx, sql, found).await,
            Err(error) => {
                self.rollback(tx).await;
                self.after_error::<DB>(error, true).await.into()
            }
        }
    }

    /// The claim found the dedup row there: processed (a duplicate), in progress under
    /// another delivery's lease (the typed [`InProgress`] error: retry after, never
    /// acknowledge), a mark-first call's unknown outcome (a duplicate, as for a leased
    /// handler), or an expired send-first lease, which this transaction takes over: its
    /// commit marks the row processed with the effect. A row that went away in between (its
    /// lease released) is claimed again. `found`: what the claim statement read of the
    /// row, if it did (PostgreSQL).
    async fn found<'h, DB: Backend>(
        &mut self,
        mut tx: Tx<'h, DB>,
        sql: &'static str,
        read: Option<Found>,
    ) -> Begin<'h, DB> {
        let claim = self.claim.as_ref().expect("only a claim finds a row");
        let (statements, consumer, id) = (claim.statements, claim.consumer, claim.id);
        let mut read = read;
        let mut looks = 0;
        let duplicate = loop {
            looks += 1;
            let found = match read.take() {
                Some(found) => Some(found),
                None => match DB::inspect(&mut tx.tx, statements, consumer, id).await {
                    Ok(found) => found,
                    Err(error) => {
                        self.rollback(tx).await;
                        return self.after_error::<DB>(error, true).await.into();
                    }
                },
            };
            let Some(found) = found else {
                if looks > retry::MAX_ATTEMPTS {
                    self.rollback(tx).await;
                    let error =
                        sqlx::Error::Protocol("the dedup row kept changing under the claim".into());
                    return self.after_error::<DB>(error, false).await.into();
                }
                let sent = Instant::now();
                match DB::claim(&mut tx.tx, statements, sql, consumer, id).await {
                    Ok(Claiming::Inserted) => {
                        self.claimed_at = Some(sent);
                        return Begin::Claimed(tx);
                    }
                    Ok(Claiming::Found(again)) => {
                        read = again;
                        continue;
                    }
                    Err(error) => {
                        self.rollback(tx).await;
                        return self.after_error::<DB>(error, true).await.into();
                    }
                }
            };
            if self.memory.recalls() {
                // What the row remembers: a fingerprint to compare on every path (a
                // processed row, one in progress, an unknown outcome), a result to replay.
                match DB::recall(&mut tx.tx, statements, consumer, id).await {
                    Ok(recalled) => {
                        if let Some(mismatch) =
                            self.memory.mismatch(consumer, id, recalled.as_ref())
                        {
                            self.rollback(tx).await;
                            self.finish(End::Failed(Class::Mismatch));
                            return Begin::Error(mismatch);
                        }
                        self.memory.recalled = recalled;
                    }
                    Err(error) => {
                        self.rollback(tx).await;
                        return self.after_error::<DB>(error, true).await.into();
                    }
                }
            }
            let remaining =
                Duration::from_micros(u64::try_from(found.remaining_us.unwrap_or(0)).unwrap_or(0));
            match found.state {
                None => break Duplicate::AlreadyProcessed,
                Some(_) if !remaining.is_zero() || looks > retry::MAX_ATTEMPTS => {
                    self.rollback(tx).await;
                    self.finish(End::InProgress);
                    return Begin::Error(InProgress::error(remaining));
                }
                Some(2) => {
                    tracing::warn!(
                        consumer,
                        message_id = id,
                        "outcome unknown: a mark-first delivery never completed its call; \
                         acknowledged without calling again (resolve it with \
                         `Ledger::resolve`)"
                    );
                    break Duplicate::OutcomeUnknown;
                }
                Some(_) => {
                    let sent = Instant::now();
                    // With a fingerprint, only over a row that has none or the same: the
                    // row may have changed since the recall (PostgreSQL reads lock nothing).
                    let printed = self.memory.fingerprint.as_ref().map(|print| &print[..]);
                    let taken =
                        DB::take_over(&mut tx.tx, statements, consumer, id, printed, self.owned);
                    match taken.await {
                        Ok(true) => {
                            tracing::warn!(
                                consumer,
                                message_id = id,
                                "took over an expired send-first lease: its owner may have \
                                 made the call already, and this handler's effect is applied \
                                 now"
                            );
                            self.claimed_at = Some(sent);
                            return Begin::Claimed(tx);
                        }
                        // Completed, released, taken over or printed with another
                        // fingerprint in between: look again (the recall reports that one).
                        Ok(false) => continue,
                        Err(error) => {
                            self.rollback(tx).await;
                            return self.after_error::<DB>(error, true).await.into();
                        }
                    }
                }
            }
        };
        if self.owned {
            // Our own transaction wrote nothing. On a pooled connection its ROLLBACK may
            // be queued: sqlx sends it with the ping the pool sends as it takes the
            // connection back, off the caller's path, so the duplicate costs BEGIN, the
            // claim and the look at the row. On a caller's connection it is sent now, so
            // that the session does not sit idle in a transaction, holding the claim's
            // lock, until its next use.
            if let Err(error) = DB::rollback_owned(tx, self.pooled, false).await {
                tracing::debug!(%error, "rollback after a duplicate failed");
            }
        } else if let Err(error) = tx.tx.rollback().await {
            // A savepoint in the caller's transaction is released now, so that the
            // caller's next statement finds its transaction as it left it.
            self.finish(End::Failed(Class::Database));
            return Begin::Error(error);
        }
        // A result to replay: the call ends in `replay`, which decodes it (and may fail).
        if !self.memory.replays(&duplicate) {
            self.memory.recalled = None;
            self.finish(End::Duplicate(&duplicate));
        }
        Begin::Duplicate(duplicate)
    }

    /// Commits the body's work together with the dedup row (and, for a handler with a
    /// stored result or a fingerprint, what the row remembers, written just before).
    pub async fn commit<DB: Backend>(&mut self, mut tx: Tx<'_, DB>) -> Commit {
        if let Some(claim) = &self.claim
            && (self.memory.encoded.is_some() || self.memory.fingerprint.is_some())
        {
            let result = match self.memory.encoded.take() {
                Some(Ok(bytes)) => Some(bytes),
                Some(Err(error)) => {
                    // Nothing commits: a result whose duplicates could not be answered.
                    self.rollback(tx).await;
                    self.finish(End::Failed(Class::StoredResult));
                    return Commit::Error(error.error());
                }
                None => None,
            };
            let version = self.memory.version() as i32;
            let remembered = Remembered {
                result: result.as_deref(),
                version: result.as_ref().map(|_| version),
                fingerprint: self
                    .memory
                    .fingerprint
                    .as_ref()
                    .map(|fingerprint| &fingerprint[..]),
            };
            let (statements, consumer, id) = (claim.statements, claim.consumer, claim.id);
            if let Err(error) = DB::store(&mut tx.tx, statements, consumer, id, remembered).await {
                self.rollback(tx).await;
                return self.after_error::<DB>(error, self.rerun_body).await.into();
            }
        }
        // The Kafka consumer's offsets-in-database mode: the record's partition position,
        // in the transaction the handler itself began for the record's id.
        #[cfg(feature = "rdkafka")]
        if self.owned
            && let Some(claim) = &self.claim
            && let Some(row) = crate::offsets::pending(claim.id)
            && let Err(error) = DB::offsets_store(&mut tx.tx, &row).await
        {
            self.rollback(tx).await;
            return self.after_error::<DB>(error, self.rerun_body).await.into();
        }
        let claimed = self.claim.as_ref().map(|claim| Claimed {
            statements: claim.statements,
            consumer: claim.consumer,
            id: claim.id,
            slow: self
                .claimed_at
                .is_some_and(|sent| sent.elapsed() >= crate::clock::STAMP_AFTER),
        });
        let committed = if self.owned {
            DB::commit_owned(tx, claimed, self.pooled).await
        } else {
            commit_nested(tx, claimed).await
        };
        match committed {
            Ok(()) => {
                self.finish(End::Processed);
                Commit::Committed
            }
            Err(error) => self.after_error::<DB>(error, self.rerun_body).await.into(),
        }
    }

    /// Rolls back after the body returned an error. `cause` is the error's `dyn Error`
    /// view, if its type has one: a violation of a constraint named in `unique = …`
    /// makes the call a duplicate, a transient failure runs it again.
    pub fn abort<'a, 't, DB: Backend>(
        &'a mut self,
        mut tx: Tx<'t, DB>,
        cause: Option<&(dyn StdError + 'static)>,
    ) -> impl Future<Output = Abort> + use<'a, 'k, 't, DB> {
        // Classify before the first await, so that the future holds no borrow of the
        // handler's error (which need not be `Sync`).
        let transient = cause.is_some_and(classify::is_transient::<DB>);
        let violation = match cause {
            Some(cause) if !self.unique.is_empty() => classify::unique_violation::<DB>(cause),
            _ => None,
        };
        async move {
            let business_key = match violation {
                Some(violation) => DB::matching(&mut tx.tx, violation, self.unique).await,
                None => None,
            };
            self.rollback(tx).await;
            if let Some(constraint) = business_key {
                let duplicate = Duplicate::BusinessKey { constraint };
                self.finish(End::Duplicate(&duplicate));
                return Abort::Duplicate(duplicate);
            }
            if transient && self.rerun_body && self.back_off().await {
                return Abort::Retry;
            }
            self.finish(End::Failed(if transient {
                Class::Transient
            } else {
                Class::Body
            }));
            Abort::BodyError
        }
    }

    /// Rolls back, keeping the error that made us roll back as the one that matters: a
    /// failed rollback means the connection is gone, and the transaction with it.
    async fn rollback<DB: Backend>(&self, tx: Tx<'_, DB>) {
        let rolled_back = if self.owned {
            DB::rollback_owned(tx, self.pooled, true).await
        } else {
            tx.tx.rollback().await
        };
        if let Err(error) = rolled_back {
            tracing::debug!(%error, "rollback failed; the transaction is discarded");
        }
    }

    /// After an error of ours: [`Next::Retry`] once backed off from a transient `error`
    /// with an attempt left, otherwise the error to end the call with. A transaction the
    /// database rolled back by itself ([`RolledBack`]) is run again too: a swallowed
    /// deadlock succeeds the next time. `retry`: whether running the attempt again is
    /// allowed at all (not after a send-first body ran).
    async fn after_error<DB: Backend>(&mut self, error: sqlx::Error, retry: bool) -> Next {
        let class = if classify::is_transient::<DB>(&error) {
            Class::Transient
        } else if RolledBack::find(&error).is_some() {
            Class::RolledBack
        } else {
            Class::Database
        };
        if class != Class::Database {
            tracing::debug!(attempt = self.attempt, %error, "transient database error");
            if !retry {
                tracing::debug!("not retried: the send-first body ran, and may have called out");
            } else if self.back_off().await {
                return Next::Retry;
            }
        }
        self.finish(End::Failed(class));
        Next::Error(error)
    }

    /// Sleeps before the next attempt; `false` when no attempt is left, or when the
    /// transaction was a savepoint in the caller's (whose locks and snapshot a retry
    /// inside it would not escape: the caller decides).
    async fn back_off(&mut self) -> bool {
        if !self.owned || self.attempt >= retry::MAX_ATTEMPTS {
            return false;
        }
        let delay = retry::backoff(self.attempt);
        tracing::debug!(
            attempt = self.attempt,
            ?delay,
            "retrying after a transient failure"
        );
        metrics::retried(self.metrics, self.handler, self.consumer());
        tokio::time::sleep(delay).await;
        true
    }
}

/// Releases a savepoint in the caller's transaction (its `RELEASE` fails if the database
/// rolled the transaction back meanwhile), after moving a slow claim's `processed_at` to
/// now. The caller's own commit comes later: see [`STAMP_AFTER`].
async fn commit_nested<DB: Backend>(
    mut tx: Tx<'_, DB>,
    claimed: Option<Claimed<'_>>,
) -> Result<(), sqlx::Error> {
    if let Some(claimed) = claimed.filter(|claimed| claimed.slow)
        && let Some(sql) = DB::stamp_sql(claimed.statements)
        && let Err(error) = DB::stamp(&mut tx.tx, sql, claimed.consumer, claimed.id).await
    {
        claim::rollback_logged(tx.tx).await;
        return Err(error);
    }
    tx.tx.commit().await
}
