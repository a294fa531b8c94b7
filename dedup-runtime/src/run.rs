//! One call of a generated handler: claim, commit or abort, retry. The generated code
//! drives the loop (the body must run inline, in the caller's generic context); every
//! decision is made here.

#![allow(missing_docs)]

use std::error::Error as StdError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sqlx::Connection;
use tracing::Span;

use crate::backend::{self, Backend, Handle, Source, Statements, Tx};
use crate::key::{MessageId, MessageKey};
use crate::outcome::{Duplicate, Outcome};
use crate::retry;
use crate::rolled_back::RolledBack;

/// The validated id of `key`, or the typed error for a bad one.
pub fn message_id<K: MessageKey + ?Sized>(key: &K) -> Result<MessageId<'_>, sqlx::Error> {
    let id = key.message_id();
    id.validate()?;
    Ok(id)
}

/// How a call ended, before the error of our own is converted into the handler's `E`
/// (in one place, so that a missing `From<sqlx::Error>` is reported once).
pub enum Exit<T, E> {
    Done(Outcome<T>),
    Body(E),
    Failed(sqlx::Error),
}

/// Result of [`Run::begin`].
pub enum Begin<'h, DB: Backend> {
    /// The dedup row is in; run the body on this transaction.
    Fresh(Tx<'h, DB>),
    Duplicate(Duplicate),
    /// A transient failure, already backed off: try again.
    Again,
    Failed(sqlx::Error),
}

/// Result of [`Run::abort`].
pub enum Abort {
    /// A unique constraint named in `unique = …` caught the business key.
    Duplicate(Duplicate),
    /// A transient failure, already backed off: try again.
    Again,
    /// Return the body's error.
    Failed,
}

/// Result of [`Run::commit`].
pub enum Commit {
    Done,
    Again,
    Failed(sqlx::Error),
}

/// A transaction that ran longer than this between its claim and its commit has its
/// dedup row's `processed_at` moved to the commit (one more statement, on slow
/// transactions only), so that the redelivery window counts from the commit; a faster
/// one keeps the claim's time, at most this much early. [`Prune`](crate::Prune) keeps
/// this margin in its cutoff. (MySQL and MariaDB always write the commit time.)
pub const STAMP_AFTER: Duration = Duration::from_secs(1);

/// The claimed dedup row, as the backend's commit needs it.
pub struct Claimed<'c> {
    pub statements: &'static Statements,
    pub consumer: &'static str,
    pub id: &'c str,
    /// Claimed more than [`STAMP_AFTER`] ago: its `processed_at` must be moved.
    pub slow: bool,
}

/// What a handler deduplicates on: the message id it claims (`key = …`) and the
/// unique constraints its body may violate (`unique = …`). At least one is present.
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
}

impl<'k> Run<'k> {
    pub fn new(
        handler: &'static str,
        claim: Option<Claim<'k>>,
        unique: &'static [&'static str],
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
            claim,
            unique,
            span,
            attempt: 0,
            owned: false,
            pooled: false,
            claimed_at: None,
        }
    }

    pub fn span(&self) -> Span {
        self.span.clone()
    }

    fn finish(&self, outcome: &'static str) {
        if !self.span.is_disabled() {
            self.span.record("outcome", outcome);
            self.span.record("attempts", self.attempt);
        }
    }

    /// Begins the transaction (or savepoint) and inserts the dedup row, if any.
    pub async fn begin<'h, DB: Backend>(
        &mut self,
        handle: &'h mut Handle<'_, DB>,
    ) -> Begin<'h, DB> {
        self.attempt += 1;
        self.claimed_at = None;
        let business_keys = !self.unique.is_empty();
        let Handle { source, unclean } = handle;
        let unclean: &'h AtomicBool = unclean;
        let begun = match source {
            Source::Pool(pool, slot) => {
                self.owned = true;
                self.pooled = true;
                // Each attempt on a connection of its own, as `pool.begin()` would; one
                // that an earlier attempt left with a changed session is closed.
                if let Some(mut previous) = slot.take()
                    && unclean.swap(false, Ordering::Relaxed)
                {
                    previous.close_on_drop();
                }
                match pool.acquire().await {
                    Ok(conn) => {
                        let conn = slot.insert(conn);
                        unclean.store(DB::CHANGES_SESSION, Ordering::Relaxed);
                        DB::begin_owned(conn, business_keys).await
                    }
                    Err(error) => Err(error),
                }
            }
            Source::Conn(conn) => {
                self.pooled = false;
                self.owned = !conn.is_in_transaction();
                if self.owned {
                    DB::begin_owned(conn, business_keys).await
                } else {
                    DB::begin_nested(conn, business_keys).await
                }
            }
        };
        let tx = match begun {
            Ok(tx) => tx,
            Err(error) => {
                return self
                    .failed::<DB>(error)
                    .await
                    .map_or(Begin::Again, Begin::Failed);
            }
        };
        let mut tx = Tx { tx, unclean };
        let Some(claim) = &self.claim else {
            return Begin::Fresh(tx);
        };
        let sql = DB::claim_sql(claim.statements);
        let sent = Instant::now();
        match DB::claim(&mut tx.tx, sql, claim.consumer, claim.id).await {
            Ok(true) => {
                self.claimed_at = Some(sent);
                Begin::Fresh(tx)
            }
            // Our own transaction wrote nothing. On a pooled connection its ROLLBACK may
            // be queued: sqlx sends it with the ping the pool sends as it takes the
            // connection back, off the caller's path, so the duplicate costs BEGIN and the
            // claim. On a caller's connection it is sent now, so that the session does not
            // sit idle in a transaction, holding the claim's lock, until its next use.
            Ok(false) if self.owned => {
                if let Err(error) = DB::rollback_owned(tx, self.pooled, false).await {
                    tracing::debug!(%error, "rollback after a duplicate failed");
                }
                self.finish("duplicate");
                Begin::Duplicate(Duplicate::AlreadyProcessed)
            }
            // A savepoint in the caller's transaction is released now, so that the
            // caller's next statement finds its transaction as it left it.
            Ok(false) => match tx.tx.rollback().await {
                Ok(()) => {
                    self.finish("duplicate");
                    Begin::Duplicate(Duplicate::AlreadyProcessed)
                }
                Err(error) => {
                    self.finish("failed");
                    Begin::Failed(error)
                }
            },
            Err(error) => {
                self.rollback(tx).await;
                self.failed::<DB>(error)
                    .await
                    .map_or(Begin::Again, Begin::Failed)
            }
        }
    }

    /// Commits the body's work together with the dedup row.
    pub async fn commit<DB: Backend>(&mut self, tx: Tx<'_, DB>) -> Commit {
        let claimed = self.claim.as_ref().map(|claim| Claimed {
            statements: claim.statements,
            consumer: claim.consumer,
            id: claim.id,
            slow: self
                .claimed_at
                .is_some_and(|sent| sent.elapsed() >= STAMP_AFTER),
        });
        let committed = if self.owned {
            DB::commit_owned(tx, claimed, self.pooled).await
        } else {
            commit_nested(tx, claimed).await
        };
        match committed {
            Ok(()) => {
                self.finish("processed");
                Commit::Done
            }
            Err(error) => self
                .failed::<DB>(error)
                .await
                .map_or(Commit::Again, Commit::Failed),
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
        let transient = cause.is_some_and(backend::is_transient::<DB>);
        let violation = match cause {
            Some(cause) if !self.unique.is_empty() => backend::unique_violation::<DB>(cause),
            _ => None,
        };
        async move {
            let business_key = match violation {
                Some(violation) => DB::matching(&mut tx.tx, violation, self.unique).await,
                None => None,
            };
            self.rollback(tx).await;
            if let Some(constraint) = business_key {
                self.finish("duplicate");
                return Abort::Duplicate(Duplicate::BusinessKey { constraint });
            }
            if transient && self.back_off().await {
                return Abort::Again;
            }
            self.finish("failed");
            Abort::Failed
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

    /// `None` after backing off from a transient `error` that may be retried; otherwise
    /// the error to return. A transaction the database rolled back by itself
    /// ([`RolledBack`]) is run again too: a swallowed deadlock succeeds the next time.
    async fn failed<DB: Backend>(&mut self, error: sqlx::Error) -> Option<sqlx::Error> {
        if backend::is_transient::<DB>(&error) || RolledBack::find(&error).is_some() {
            tracing::debug!(attempt = self.attempt, %error, "transient database error");
            if self.back_off().await {
                return None;
            }
        }
        self.finish("failed");
        Some(error)
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
        backend::rollback_logged(tx.tx).await;
        return Err(error);
    }
    tx.tx.commit().await
}
