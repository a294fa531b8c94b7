//! Leases: the claim of a handler whose effect is outside the database and whose call runs
//! with no transaction open — `effect = "mark-first"`, and `effect = "send-first"` with
//! `lease = "…"`.
//!
//! The claim commits the dedup row **in progress** at once, on its own: `state` set, an
//! `owner` token (16 random bytes) and `expires_at` on the database's clock. The body then
//! runs with the connection back in the pool, holding a [`Lease`]: it may renew the lease
//! ([`Lease::extend`]) and write the effect's result ([`Lease::transaction`]). Its end
//! marks the row processed, in a transaction that first checks the token (fencing): an
//! owner whose lease was taken over changes nothing, and gets [`LeaseLost`]. A body
//! error releases the row (deleted, owner-checked), so that a redelivery runs again.
//!
//! | `state` | written by | until `expires_at` | after it |
//! | --- | --- | --- | --- |
//! | `1` | `send-first` with a lease | another copy: [`LeaseOutcome::InProgress`] | the next delivery takes over (a new token) and calls again: the send-first duplicate |
//! | `2` | `mark-first` | another copy: [`LeaseOutcome::InProgress`] | **outcome unknown**: the next delivery is acknowledged without a call ([`Duplicate::OutcomeUnknown`]); listed by [`Ledger::unresolved`](crate::Ledger::unresolved) |
//!
//! One file per backend, `lease/<db>.rs`; the SQL of a table is fixed at compile time
//! ([`LeaseStatements`]).

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::{Database, Pool};
use tracing::Span;

use crate::backend::Backend;
use crate::claim::Found;
use crate::classify;
use crate::clock::micros;
use crate::guarded::Guarded;
use crate::key::MessageId;
use crate::metrics::{self, Class, End, HandlerMetrics};
use crate::outcome::StoredOutcome;
use crate::outcome::{Duplicate, InProgress, LeaseOutcome};
use crate::random::{Owner, new_token};
use crate::retry;
use crate::stored::{Codec, Fingerprint, Memory, Recalled, Stored, StoredResultError};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod statements;

pub use statements::{LeaseSql, LeaseStatements};

/// The shortest lease `lease = "…"` accepts.
pub const MIN_LEASE: Duration = Duration::from_millis(1);
/// The longest lease `lease = "…"` accepts: a day. A call that needs longer renews its
/// lease ([`Lease::extend`]); a lease longer than that is a row stuck in progress, not a
/// lease.
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
/// The lease of `effect = "mark-first"` without `lease = "…"`: a minute.
pub const DEFAULT_MARK_LEASE: Duration = Duration::from_secs(60);

/// How one backend runs a lease. Every statement runs on its own (autocommit) but the
/// completion, which runs in the transaction [`LeaseBackend::begin`] opens.
pub trait LeaseBackend: Database {
    #[doc(hidden)]
    fn lease_sql(statements: &LeaseStatements) -> &LeaseSql;

    /// Inserts the row in progress (with the payload's `fingerprint`, if given: then
    /// through [`LeaseSql::claim_printed`]); `Ok(false)` when a row was there.
    #[doc(hidden)]
    fn lease_claim<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// What the row remembers ([`LeaseSql::recall`]), `None` when there is no row.
    #[doc(hidden)]
    fn lease_recall<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> impl Future<Output = Result<Option<Recalled>, sqlx::Error>> + Send + 'c;

    /// Writes the result and its version ([`LeaseSql::remember`]), owner-checked; the
    /// number of rows it matched.
    #[doc(hidden)]
    fn lease_remember<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        result: &'c [u8],
        version: i32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;

    /// Takes over an expired send-first lease, writing the payload's `fingerprint` as the
    /// claim does (then through [`LeaseSql::take_over_printed`], which leaves alone a row
    /// printed with another one); `Ok(false)` when there was none.
    #[doc(hidden)]
    fn lease_take_over<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
        state: i16,
        lease_us: i64,
        fingerprint: Option<&'c [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// The row's state, `None` when there is no row.
    #[doc(hidden)]
    fn lease_inspect<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> impl Future<Output = Result<Option<Found>, sqlx::Error>> + Send + 'c;

    /// Runs an owner-checked statement (`extend` with `lease_us`, `release`, `complete`,
    /// `check`); the number of rows it matched.
    #[doc(hidden)]
    fn lease_owned<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static str,
        key: LeaseKey<'c>,
        lease_us: Option<i64>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;

    /// Opens the completion transaction (plain SQL: the lease, not sqlx, keeps track of it).
    #[doc(hidden)]
    fn lease_begin(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Commits the completion transaction whose first statement marked the row processed,
    /// only if the database has not rolled it back by itself meanwhile.
    #[doc(hidden)]
    fn lease_commit<'c>(
        conn: &'c mut Self::Connection,
        sql: &'static LeaseSql,
        key: LeaseKey<'c>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Rolls the completion transaction back.
    #[doc(hidden)]
    fn lease_rollback(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;
}

/// Runs `sql` with numbered parameters in the order every lease statement of PostgreSQL
/// and SQLite names them — consumer, id, `state` (if given), owner, lease (if given) —
/// The one place they are bound for those backends.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) async fn execute_numbered<'c, DB>(
    conn: &'c mut DB::Connection,
    sql: &'static str,
    key: LeaseKey<'c>,
    state: Option<i16>,
    lease_us: Option<i64>,
) -> Result<DB::QueryResult, sqlx::Error>
where
    DB: Database,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i16: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let mut query = sqlx::query(sql).bind(key.consumer).bind(key.id);
    if let Some(state) = state {
        query = query.bind(state);
    }
    query = query.bind(&key.owner[..]);
    if let Some(lease_us) = lease_us {
        query = query.bind(lease_us);
    }
    query.execute(conn).await
}

/// The row a lease statement is about, and its owner.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct LeaseKey<'a> {
    pub(crate) consumer: &'static str,
    pub(crate) id: &'a str,
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) owner: &'a Owner,
}

/// What a lease's body was declared to risk: its row's `state`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// `effect = "send-first"` with `lease = "…"`: after expiry, the next delivery takes
    /// over and calls again.
    SendFirst,
    /// `effect = "mark-first"`: after expiry, the outcome is unknown and nothing calls again.
    MarkFirst,
}

impl Policy {
    fn state(self) -> i16 {
        match self {
            Policy::SendFirst => 1,
            Policy::MarkFirst => 2,
        }
    }
}

/// The lease a leased handler claims (the generated code builds it).
#[doc(hidden)]
pub struct LeaseClaim<'k> {
    statements: &'static LeaseStatements,
    consumer: &'static str,
    id: &'k str,
    policy: Policy,
    lease: Duration,
}

impl<'k> LeaseClaim<'k> {
    pub fn new(
        statements: &'static LeaseStatements,
        consumer: &'static str,
        id: &'k MessageId<'_>,
        policy: Policy,
        lease_ms: u64,
    ) -> Self {
        LeaseClaim {
            statements,
            consumer,
            id: id.as_str(),
            policy,
            lease: Duration::from_millis(lease_ms).clamp(MIN_LEASE, MAX_LEASE),
        }
    }
}

/// The lease of this call was lost: its owner token is no longer the row's (the lease
/// expired and another delivery took it over, or an operator resolved the row). Whatever
/// the body wrote in [`Lease::transaction`] was rolled back, and the row is as the new
/// owner left it. Reaches the caller through the handler's `From<sqlx::Error>`, inside
/// [`sqlx::Error::AnyDriverError`]; [`AckPolicy`](crate::AckPolicy) answers
/// `Ack::Retry`: the redelivery finds the row processed (a duplicate) or still in
/// progress.
///
/// ```
/// use dedup_runtime::LeaseLost;
///
/// fn explain(error: &sqlx::Error) -> &'static str {
///     if LeaseLost::find(error).is_some() {
///         "another delivery owns the message now"
///     } else {
///         "another failure"
///     }
/// }
/// # assert_eq!(explain(&sqlx::Error::RowNotFound), "another failure");
/// ```
#[derive(Debug)]
pub struct LeaseLost {
    consumer: &'static str,
    id: String,
}

impl LeaseLost {
    fn error(key: LeaseKey<'_>) -> sqlx::Error {
        sqlx::Error::AnyDriverError(Box::new(LeaseLost {
            consumer: key.consumer,
            id: key.id.to_owned(),
        }))
    }

    /// The consumer of the lost lease.
    pub fn consumer(&self) -> &'static str {
        self.consumer
    }

    /// The message id of the lost lease.
    pub fn message_id(&self) -> &str {
        &self.id
    }

    /// Finds a `LeaseLost` in `error` or its chain of [`source`](StdError::source)s.
    pub fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a LeaseLost> {
        let mut link = Some(error);
        while let Some(error) = link {
            if let Some(found) = error.downcast_ref::<LeaseLost>() {
                return Some(found);
            }
            link = error.source();
        }
        None
    }
}

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the lease on message {:?} of consumer `{}` was lost: another delivery took it \
             over, and nothing of this one's completion was committed",
            self.id, self.consumer
        )
    }
}

impl StdError for LeaseLost {}

/// The lease a leased handler's body holds while its call runs: the body's first
/// parameter, `lease: &mut Lease<'_, sqlx::Postgres>` (or `Sqlite`, `MySql`).
///
/// No transaction is open and no connection is held while the body runs, unless it asks
/// for one with [`transaction`](Self::transaction). The row is marked processed when the
/// body returns `Ok`, in that transaction if it opened one — after checking that the lease
/// is still this call's own.
pub struct Lease<'a, DB: Backend> {
    pool: &'a Pool<DB>,
    sql: &'static LeaseSql,
    consumer: &'static str,
    id: &'a str,
    owner: Owner,
    lease: Duration,
    policy: Policy,
    /// The completion transaction's connection, once the body asked for it; closed if the
    /// call ends without the transaction's end.
    conn: Option<Guarded<DB>>,
}

impl<DB: Backend> Lease<'_, DB> {
    fn key(&self) -> LeaseKey<'_> {
        LeaseKey {
            consumer: self.consumer,
            id: self.id,
            owner: &self.owner,
        }
    }

    /// The consumer the lease is for.
    pub fn consumer(&self) -> &'static str {
        self.consumer
    }

    /// The message id the lease is for.
    pub fn message_id(&self) -> &str {
        self.id
    }

    /// The lease's length, as declared with `lease = "…"`.
    pub fn duration(&self) -> Duration {
        self.lease
    }

    /// Renews the lease: it now ends [`duration`](Self::duration) from now, on the
    /// database's clock. For calls longer than the lease: renew well before it ends (every
    /// third of it, say). Fails with [`LeaseLost`] if the lease is no longer this call's
    /// (another delivery took it over after it expired): stop, the other owner calls.
    ///
    /// Once [`transaction`](Self::transaction) has opened the completion transaction, the
    /// row is marked processed in it and locked until its commit: nobody can take the
    /// lease over any more, so there is nothing to renew, and `extend` returns `Ok(())`
    /// without a statement.
    pub async fn extend(&mut self) -> Result<(), sqlx::Error> {
        if self.conn.is_some() {
            return Ok(());
        }
        let lease_us = micros(self.lease);
        let sql = self.sql.extend;
        let owner = self.owner;
        let key = LeaseKey {
            consumer: self.consumer,
            id: self.id,
            owner: &owner,
        };
        let mut conn = self.pool.acquire().await?;
        let matched = DB::lease_owned(&mut conn, sql, key, Some(lease_us)).await?;
        if matched == 1 {
            Ok(())
        } else {
            Err(LeaseLost::error(key))
        }
    }

    /// The transaction the row is marked processed in, for the body's own writes that
    /// record the effect's result (a charge id, a sent flag): they commit together with
    /// the mark, or not at all. Opened at the first call, after the external call has
    /// been made — it marks the row processed first, owner-checked, so that it fails
    /// with [`LeaseLost`] at once, and holds the row's lock until the commit: from then on
    /// nobody can take the lease over.
    ///
    /// ```no_run
    /// # use dedup_runtime::{Lease, idempotent};
    /// # struct Payment { id: String }
    /// # async fn charge_card(_msg: &Payment) -> Result<String, std::io::Error> { Ok("ch_1".into()) }
    /// #[idempotent(consumer = "payments", key = msg.id, effect = "send-first", lease = "30s")]
    /// async fn charge(lease: &mut Lease<'_, sqlx::Sqlite>, msg: &Payment)
    ///     -> Result<(), Box<dyn std::error::Error + Send + Sync>>
    /// {
    ///     let charge_id = charge_card(msg).await?; // no transaction open
    ///     let tx = lease.transaction().await?;
    ///     sqlx::query("INSERT INTO charges (message_id, charge_id) VALUES (?1, ?2)")
    ///         .bind(&msg.id)
    ///         .bind(&charge_id)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     Ok(())
    /// }
    /// ```
    pub async fn transaction(&mut self) -> Result<&mut DB::Connection, sqlx::Error> {
        if self.conn.is_none() {
            // From here on the connection may be in a transaction sqlx does not know of:
            // dropped before its end, it is closed, not pooled.
            let mut conn = Guarded::new(self.pool.acquire().await?);
            DB::lease_begin(&mut conn).await?;
            let key = LeaseKey {
                consumer: self.consumer,
                id: self.id,
                owner: &self.owner,
            };
            match DB::lease_owned(&mut conn, self.sql.complete, key, None).await {
                Ok(1) => {}
                Ok(_) => {
                    rollback_logged::<DB>(&mut conn).await;
                    return Err(LeaseLost::error(key));
                }
                Err(error) => {
                    rollback_logged::<DB>(&mut conn).await;
                    return Err(error);
                }
            }
            self.conn = Some(conn);
        }
        Ok(self.conn.as_deref_mut().expect("opened above"))
    }
}

/// The database a leased handler's `Lease<'_, DB>` parameter names, for the generated
/// signature (`&Pool<DB>`).
#[doc(hidden)]
pub trait LeaseParam {
    type Database: Backend;
}

impl<DB: Backend> LeaseParam for Lease<'_, DB> {
    type Database = DB;
}

/// Rolls the completion transaction back, logging a failure.
async fn rollback_logged<DB: Backend>(conn: &mut DB::Connection) {
    if let Err(error) = DB::lease_rollback(conn).await {
        tracing::debug!(%error, "rollback failed; the connection is discarded");
    }
}

/// What [`LeaseRun::begin`] leads to.
#[doc(hidden)]
pub enum LeaseBegin<'a, DB: Backend> {
    /// The lease is this call's: run the body with it.
    Owned(Lease<'a, DB>),
    /// The call is over without running the body.
    Outcome(LeaseOutcome<std::convert::Infallible>),
    /// The call is over with this error.
    Error(sqlx::Error),
}

/// The state of one leased call (the generated code drives it).
#[doc(hidden)]
pub struct LeaseRun<'k> {
    handler: &'static str,
    claim: LeaseClaim<'k>,
    span: Span,
    attempt: u32,
    started: metrics::Started,
    metrics: &'static HandlerMetrics,
    /// `result = "stored"`, `fingerprint = …` (written with the claim): what the row
    /// remembers.
    memory: Memory,
}

impl<'k> LeaseRun<'k> {
    pub fn new(
        handler: &'static str,
        claim: LeaseClaim<'k>,
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
        if !span.is_disabled() {
            span.record("consumer", claim.consumer);
            span.record("message_id", claim.id);
        }
        LeaseRun {
            handler,
            claim,
            span,
            attempt: 0,
            started: metrics::Started::now(),
            metrics,
            memory: Memory::default(),
        }
    }

    /// `result = "stored"`: the body's result is stored in the fenced completion.
    pub fn store_results(mut self, version: u32, max_len: usize) -> Self {
        self.memory.stored = Some(Stored { version, max_len });
        self
    }

    /// `fingerprint = …`: written with the claim (and by a take-over of an expired
    /// send-first lease), compared by every claim that finds the row (in progress,
    /// processed, outcome unknown).
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.memory.fingerprint = Some(fingerprint);
        self
    }

    /// The body's result, for the completion to store.
    pub fn keep_result<T>(&mut self, value: &T, codec: Codec<T>) {
        self.memory.keep(value, codec);
    }

    /// A leased call that did not run its body, with `result = "stored"`: a duplicate
    /// whose row holds a result is its replay.
    pub fn replay<T, E>(
        &mut self,
        outcome: LeaseOutcome<std::convert::Infallible>,
        codec: Codec<T>,
    ) -> crate::run::Exit<StoredOutcome<T>, E> {
        use crate::run::Exit;
        let duplicate = match outcome {
            LeaseOutcome::Processed(never) => match never {},
            LeaseOutcome::InProgress(busy) => {
                return Exit::Outcome(StoredOutcome::InProgress(busy));
            }
            LeaseOutcome::Duplicate(duplicate) => duplicate,
        };
        // `try_begin` left the call's end to be said here when there is a result.
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

    pub fn span(&self) -> Span {
        self.span.clone()
    }

    fn finish(&self, end: End<'_>) {
        if !self.span.is_disabled() {
            self.span.record("outcome", end.outcome());
            self.span.record("attempts", self.attempt);
        }
        metrics::ended(
            self.metrics,
            self.handler,
            self.claim.consumer,
            end,
            self.started,
        );
    }

    /// Claims the lease: inserts the row in progress, takes over an expired send-first
    /// lease, or reports what the row says. Transient failures are retried (the body has
    /// not run).
    pub async fn begin<'a, DB: Backend>(&mut self, pool: &'a Pool<DB>) -> LeaseBegin<'a, DB>
    where
        'k: 'a,
    {
        loop {
            self.attempt += 1;
            match self.try_begin(pool).await {
                Ok(Some(begin)) => return begin,
                // The row went away between the claim and the look at it (its owner
                // released it): claim again, at once.
                Ok(None) if self.attempt < retry::MAX_ATTEMPTS => continue,
                Ok(None) => {
                    let error = sqlx::Error::Protocol(
                        "the dedup row kept changing under the lease's claim".into(),
                    );
                    self.finish(End::Failed(Class::Database));
                    return LeaseBegin::Error(error);
                }
                Err(error) => {
                    let transient = classify::is_transient::<DB>(&error);
                    if transient && self.attempt < retry::MAX_ATTEMPTS {
                        metrics::retried(self.metrics, self.handler, self.claim.consumer);
                        tokio::time::sleep(retry::backoff(self.attempt)).await;
                        continue;
                    }
                    self.finish(End::Failed(if transient {
                        Class::Transient
                    } else {
                        Class::Database
                    }));
                    return LeaseBegin::Error(error);
                }
            }
        }
    }

    async fn try_begin<'a, DB: Backend>(
        &mut self,
        pool: &'a Pool<DB>,
    ) -> Result<Option<LeaseBegin<'a, DB>>, sqlx::Error>
    where
        'k: 'a,
    {
        let claim = &self.claim;
        let sql = DB::lease_sql(claim.statements);
        let owner = new_token();
        let key = LeaseKey {
            consumer: claim.consumer,
            id: claim.id,
            owner: &owner,
        };
        let state = claim.policy.state();
        let lease_us = micros(claim.lease);
        let mut conn = pool.acquire().await?;
        // Written by the claim and by a take-over alike.
        let fingerprint = self.memory.fingerprint;
        let printed = fingerprint.as_ref().map(|fingerprint| &fingerprint[..]);
        let mut owned = DB::lease_claim(&mut conn, sql, key, state, lease_us, printed).await?;
        if !owned {
            if self.memory.recalls() {
                // What the row remembers, first: another payload under this id is refused
                // before anything (a take-over included) changes the row.
                let recalled = DB::lease_recall(&mut conn, sql, key).await?;
                let mismatch =
                    self.memory
                        .mismatch(self.claim.consumer, self.claim.id, recalled.as_ref());
                if let Some(mismatch) = mismatch {
                    self.finish(End::Failed(Class::Mismatch));
                    return Ok(Some(LeaseBegin::Error(mismatch)));
                }
                self.memory.recalled = recalled;
            }
            let claim = &self.claim;
            owned = DB::lease_take_over(&mut conn, sql, key, state, lease_us, printed)
                .await
                .inspect(|taken| {
                    if *taken {
                        tracing::warn!(
                            consumer = claim.consumer,
                            message_id = claim.id,
                            "took over an expired send-first lease: its owner may have made \
                             the call already, and it is made again"
                        );
                    }
                })?;
        }
        let claim = &self.claim;
        if owned {
            drop(conn);
            return Ok(Some(LeaseBegin::Owned(Lease {
                pool,
                sql,
                consumer: claim.consumer,
                id: claim.id,
                owner,
                lease: claim.lease,
                policy: claim.policy,
                conn: None,
            })));
        }
        let Some(found) = DB::lease_inspect(&mut conn, sql, key).await? else {
            return Ok(None);
        };
        if found.state.is_none()
            && self.memory.stored.is_some()
            && !self.memory.replays(&Duplicate::AlreadyProcessed)
        {
            // Completed since the recall: its result is there now.
            self.memory.recalled = DB::lease_recall(&mut conn, sql, key).await?;
        }
        drop(conn);
        let remaining =
            Duration::from_micros(u64::try_from(found.remaining_us.unwrap_or(0)).unwrap_or(0));
        let outcome = match found.state {
            None => LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed),
            Some(_) if !remaining.is_zero() => LeaseOutcome::InProgress(InProgress::new(remaining)),
            // A mark-first mark whose owner never completed it: the effect may or may not
            // have happened, and it is never attempted again.
            Some(2) => LeaseOutcome::Duplicate(Duplicate::OutcomeUnknown),
            // An expired send-first lease that another copy took over in between.
            Some(_) => LeaseOutcome::InProgress(InProgress::new(remaining)),
        };
        match &outcome {
            LeaseOutcome::Duplicate(duplicate) => {
                if *duplicate == Duplicate::OutcomeUnknown {
                    tracing::warn!(
                        consumer = claim.consumer,
                        message_id = claim.id,
                        "outcome unknown: a mark-first delivery never completed its call; \
                         acknowledged without calling again (resolve it with \
                         `Ledger::resolve`)"
                    );
                }
                // A result to replay: the call ends in `replay`, which decodes it.
                if !self.memory.replays(duplicate) {
                    self.finish(End::Duplicate(duplicate));
                }
            }
            LeaseOutcome::InProgress(_) => self.finish(End::InProgress),
            LeaseOutcome::Processed(never) => match *never {},
        }
        Ok(Some(LeaseBegin::Outcome(outcome)))
    }

    /// Marks the row processed (in the body's transaction, if it opened one), owner-checked.
    /// Never retried: the body ran.
    pub async fn complete<DB: Backend>(
        &mut self,
        mut lease: Lease<'_, DB>,
    ) -> Result<(), sqlx::Error> {
        let owner = lease.owner;
        let key = LeaseKey {
            consumer: lease.consumer,
            id: lease.id,
            owner: &owner,
        };
        // `result = "stored"`: the result goes into the completion transaction, after its
        // owner-checked mark.
        let stored = match self.memory.encoded.take() {
            None => Ok(()),
            Some(Err(error)) => Err(error.error()),
            Some(Ok(bytes)) => {
                let version = self.memory.version() as i32;
                let sql = lease.sql;
                match lease.transaction().await {
                    Ok(conn) => match DB::lease_remember(conn, sql, key, &bytes, version).await {
                        Ok(1) => Ok(()),
                        Ok(_) => Err(LeaseLost::error(key)),
                        Err(error) => Err(error),
                    },
                    Err(error) => Err(error),
                }
            }
        };
        let result = match stored {
            Err(error) => {
                if let Some(mut conn) = lease.conn.take() {
                    rollback_logged::<DB>(&mut conn).await;
                }
                Err(error)
            }
            Ok(()) => match lease.conn.take() {
                // Whatever it did, a connection whose commit failed is not reused (the guard
                // closes it).
                Some(mut conn) => DB::lease_commit(&mut conn, lease.sql, key)
                    .await
                    .inspect(|()| conn.set_clean()),
                None => match lease.pool.acquire().await {
                    Ok(mut conn) => {
                        match DB::lease_owned(&mut conn, lease.sql.complete, key, None).await {
                            Ok(1) => Ok(()),
                            Ok(_) => Err(LeaseLost::error(key)),
                            Err(error) => Err(error),
                        }
                    }
                    Err(error) => Err(error),
                },
            },
        };
        match &result {
            Ok(()) => self.finish(End::Processed),
            Err(error) => {
                let class = if LeaseLost::find(error).is_some() {
                    Class::LeaseLost
                } else if StoredResultError::find(error).is_some() {
                    Class::StoredResult
                } else if classify::is_transient::<DB>(error) {
                    Class::Transient
                } else {
                    Class::Database
                };
                if class == Class::LeaseLost {
                    tracing::warn!(
                        consumer = lease.consumer,
                        message_id = lease.id,
                        "the lease was taken over before the call completed: its completion is refused"
                    );
                } else if lease.policy == Policy::SendFirst {
                    // Not committed, or committed with the answer lost: the release
                    // deletes only a row still in progress, so that the redelivery calls
                    // again at once (the send-first duplicate) or finds it processed.
                    release::<DB>(&lease).await;
                } else {
                    tracing::warn!(
                        consumer = lease.consumer,
                        message_id = lease.id,
                        %error,
                        "a mark-first call completed but its mark could not be committed: \
                         the row stays in progress, and its outcome becomes unknown when \
                         the lease ends"
                    );
                }
                self.finish(End::Failed(class));
            }
        }
        result
    }

    /// After a body error: rolls back what the body wrote and releases the row, so that a
    /// redelivery runs the body again.
    pub async fn release<DB: Backend>(&mut self, mut lease: Lease<'_, DB>) {
        if let Some(mut conn) = lease.conn.take()
            && DB::lease_rollback(&mut conn).await.is_ok()
        {
            conn.set_clean();
        }
        release::<DB>(&lease).await;
        self.finish(End::Failed(Class::Body));
    }
}

/// Deletes the lease's row while it is in progress and still the lease's own.
async fn release<DB: Backend>(lease: &Lease<'_, DB>) {
    let released = match lease.pool.acquire().await {
        Ok(mut conn) => DB::lease_owned(&mut conn, lease.sql.release, lease.key(), None).await,
        Err(error) => Err(error),
    };
    match released {
        Ok(_) => {}
        Err(error) => tracing::warn!(
            consumer = lease.consumer,
            message_id = lease.id,
            %error,
            "releasing the lease failed: the row stays in progress until it expires"
        ),
    }
}
