//! Workers: claim pending rows, run the handler on each with its "processed" mark in the
//! same transaction, persist failures as a backoff and an error on the row, and bury rows
//! whose attempts are used up. The backend-neutral part; each backend's statements are in
//! `inbox/<db>.rs`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicBool;
use std::task::Poll;
use std::time::Duration;

use tracing::Instrument as _;

use crate::backend::Backend;
use crate::claim::Tx;
use crate::clock::micros;
use crate::guarded::Guarded;
use crate::queue::{
    Granted, Idle, Shutdown, again, heartbeat_interval, heartbeat_not_under, retry_reachable,
    with_heartbeat,
};
use crate::random::{Owner, new_token};
use sqlx::pool::PoolConnection;

use super::{Inbox, InboxError};

mod batched;
mod message;

pub use message::InboxMessage;

/// What a worker runs for each message: its database effects go on `tx`, the transaction
/// in which the message's row is marked processed — they commit together, or neither
/// does. An error (its text is kept on the row as `last_error`) rolls both back and
/// schedules the next attempt; after the last one the row is dead.
///
/// ```
/// use dedup_runtime::inbox::{InboxHandler, InboxMessage};
///
/// struct Billing;
///
/// impl InboxHandler<sqlx::Sqlite> for Billing {
///     type Error = sqlx::Error;
///
///     async fn handle(
///         &self,
///         tx: &mut sqlx::SqliteConnection,
///         message: &InboxMessage,
///     ) -> Result<(), sqlx::Error> {
///         sqlx::query("INSERT INTO invoices (message_id, body) VALUES (?1, ?2)")
///             .bind(message.id())
///             .bind(message.payload())
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait InboxHandler<DB: Backend>: Send + Sync {
    /// The handler's error; its `Display` is kept on the row.
    type Error: fmt::Display + Send;

    /// Processes one message on `tx`.
    fn handle<'c>(
        &'c self,
        tx: &'c mut DB::Connection,
        message: &'c InboxMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'c;
}

/// What one [`Worker::process_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Processed and committed, with their mark.
    pub processed: usize,
    /// Failed; scheduled for another attempt.
    pub failed: usize,
    /// Failed on their last attempt, or found claimed by a worker that stopped during its
    /// last attempt: dead, kept for an operator.
    pub dead: usize,
    /// Claims this worker had lost (its lease ended and another worker took the row):
    /// skipped, nothing of them committed.
    pub lost: usize,
    /// Claimed rows released at shutdown, their attempt not counted: those not started,
    /// and the one in hand if its handler was still running at the shutdown deadline
    /// ([`Worker::shutdown_deadline`]).
    pub released: usize,
}

/// Claims and processes an inbox's pending rows. Build it with [`Inbox::worker`]; run
/// [`process_batch`](Self::process_batch) in your own loop or [`run`](Self::run) until a
/// shutdown signal.
pub struct Worker<DB: Backend> {
    inbox: Inbox<DB>,
    lease: Duration,
    /// `None`: a third of the lease.
    heartbeat: Option<Duration>,
    shutdown_deadline: Duration,
    max_attempts: u32,
    batch: u32,
    base_delay: Duration,
    max_delay: Duration,
    poll: Duration,
    max_poll: Duration,
}

/// The row a worker statement is about: the inbox's table and consumer, an id, an owner.
#[doc(hidden)]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub struct Claimed<'a> {
    pub(crate) table: &'a crate::table::Table,
    pub(crate) consumer: &'a str,
    pub(crate) id: &'a str,
    pub(crate) owner: &'a Owner,
    /// The mark drops the payload and headers ([`Inbox::drop_payloads`]).
    pub(crate) drop_payload: bool,
    /// A lease (µs) to renew the claim's other rows with, in the processing transaction,
    /// on a backend whose heartbeat cannot write meanwhile (SQLite); `None` when the last
    /// renewal is recent.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) renew: Option<i64>,
}

/// The rows of a batch processed in one transaction ([`Worker::process_batched`]): the
/// inbox's table and consumer, the ids, their owner.
#[doc(hidden)]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub struct ClaimedMany<'a> {
    pub(crate) table: &'a crate::table::Table,
    pub(crate) consumer: &'a str,
    pub(crate) ids: &'a [&'a str],
    pub(crate) owner: &'a Owner,
    /// The mark drops the payloads and headers ([`Inbox::drop_payloads`]).
    pub(crate) drop_payload: bool,
    /// As [`Claimed`]'s: SQLite renews the claim's other rows in the transaction.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) renew: Option<i64>,
}

impl<DB: Backend> Inbox<DB> {
    /// A worker for this inbox: a 30 s lease renewed every 10 s, 5 attempts, 16 rows per
    /// claim, a backoff from 1 s doubling to 5 min with full jitter, a 1 s poll when idle,
    /// and 30 s at shutdown for the message in hand.
    pub fn worker(&self) -> Worker<DB> {
        Worker {
            inbox: self.clone(),
            lease: Duration::from_secs(30),
            heartbeat: None,
            shutdown_deadline: Duration::from_secs(30),
            max_attempts: 5,
            batch: 16,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            poll: Duration::from_secs(1),
            max_poll: Duration::from_secs(4),
        }
    }
}

impl<DB: Backend> Worker<DB> {
    /// How long a claim holds its rows past the last heartbeat before another worker may
    /// take them (at least 1 ms). While [`process_batch`](Self::process_batch) or
    /// [`run`](Self::run) works through a claim, a heartbeat renews the lease of the rows
    /// not finished yet ([`heartbeat`](Self::heartbeat)): a handler may run for longer
    /// than the lease, and liveness counts from the last heartbeat, never from the claim.
    /// A worker that stops (a crash, a pause) stops renewing: its rows are taken over
    /// within the lease and a poll interval of its last heartbeat. All on the database's
    /// clock.
    pub fn lease(self, lease: Duration) -> Self {
        Worker {
            lease: lease.max(Duration::from_millis(1)),
            ..self
        }
    }

    /// How often the heartbeat renews the lease of the claimed rows (a third of the lease
    /// by default; at least 1 ms). Keep it well under the lease: a renewal is a statement
    /// on a connection of its own, and may wait behind a busy database. One not shorter
    /// than the lease would let every claim run out between two renewals:
    /// [`process_batch`](Self::process_batch) and [`run`](Self::run) refuse it with
    /// [`InboxError::HeartbeatNotUnderLease`] before they claim anything.
    pub fn heartbeat(self, interval: Duration) -> Self {
        Worker {
            heartbeat: Some(interval.max(Duration::from_millis(1))),
            ..self
        }
    }

    /// How long [`run`](Self::run), once its shutdown signal has completed, lets the
    /// handler of the message in hand finish (30 s by default). Past it, the handler is
    /// cancelled, its transaction rolled back, and its row released with the others for
    /// another worker to take at once.
    pub fn shutdown_deadline(self, deadline: Duration) -> Self {
        Worker {
            shutdown_deadline: deadline,
            ..self
        }
    }

    fn heartbeat_interval(&self) -> Duration {
        heartbeat_interval(self.heartbeat, self.lease)
    }

    /// Refuses a heartbeat that is not shorter than the lease.
    fn check(&self) -> Result<(), InboxError> {
        match heartbeat_not_under(self.heartbeat, self.lease) {
            Some(heartbeat) => Err(InboxError::HeartbeatNotUnderLease {
                heartbeat,
                lease: self.lease,
            }),
            None => Ok(()),
        }
    }

    /// Attempts per message before its row is dead (at least 1).
    pub fn max_attempts(self, attempts: u32) -> Self {
        Worker {
            max_attempts: attempts.max(1),
            ..self
        }
    }

    /// Rows claimed at once (1 to 1,000).
    pub fn batch(self, rows: u32) -> Self {
        Worker {
            batch: rows.clamp(1, 1_000),
            ..self
        }
    }

    /// The backoff after a failure: `base` doubled per attempt, at most `max`, full jitter.
    pub fn backoff(self, base: Duration, max: Duration) -> Self {
        Worker {
            base_delay: base,
            max_delay: max.max(base),
            ..self
        }
    }

    /// How long [`run`](Self::run) waits when there was nothing to claim (1 s by default).
    /// On PostgreSQL it listens for the receivers' hints meanwhile
    /// ([`Inbox::notify_workers`]) and polls at this interval whatever happens to its
    /// listening connection; elsewhere the wait doubles while nothing comes, up to
    /// [`max_poll_interval`](Self::max_poll_interval).
    pub fn poll_interval(self, poll: Duration) -> Self {
        Worker {
            poll,
            max_poll: poll.saturating_mul(4),
            ..self
        }
    }

    /// The longest idle wait on backends without hints (4 × the poll interval by
    /// default).
    pub fn max_poll_interval(self, max: Duration) -> Self {
        Worker {
            max_poll: max,
            ..self
        }
    }

    /// The delay before attempt `attempt + 1`, after attempt `attempt` failed.
    fn delay(&self, attempt: u32) -> Duration {
        crate::retry::jitter(self.base_delay, self.max_delay, attempt)
    }

    fn classify(&self, error: sqlx::Error) -> InboxError {
        self.inbox.classify(error)
    }

    /// Claims up to [`batch`](Self::batch) rows and processes them one after the other,
    /// each in its own transaction. First takes back, in bulk, the claims of workers that
    /// stopped (their lease ended): the row each had in hand keeps its attempt, and is
    /// dead if that was its last; the rows that never started get theirs back. Returns
    /// what it did; `claimed == 0` when nothing was due.
    ///
    /// A connection lost under the worker's own statements (its begin, mark or commit)
    /// is not the message's failure: the transaction runs again within the claim, and if
    /// the database stays away the batch ends with the error and its rows are released,
    /// their attempt given back (or, if the database does not answer the release either,
    /// taken back after the lease).
    ///
    /// While it works through the claim, a heartbeat renews the lease of the rows not
    /// finished yet ([`heartbeat`](Self::heartbeat)); a heartbeat not shorter than the
    /// lease is refused ([`InboxError::HeartbeatNotUnderLease`]) before anything is
    /// claimed.
    pub async fn process_batch<H: InboxHandler<DB>>(
        &self,
        handler: &H,
    ) -> Result<BatchReport, InboxError> {
        self.process_until(handler, None).await
    }

    /// [`process_batch`](Self::process_batch), watching `stop`: once its signal has
    /// completed, the rows not started yet are released at once (their attempt not
    /// counted), for another worker to take without waiting for the lease; the message in
    /// hand is given the shutdown deadline to finish, then cancelled and released too.
    async fn process_until<H: InboxHandler<DB>>(
        &self,
        handler: &H,
        mut stop: Option<&mut Shutdown<'_>>,
    ) -> Result<BatchReport, InboxError> {
        self.check()?;
        let claims = self.claim().await?;
        let mut batch = BatchReport {
            claimed: claims.messages.len(),
            dead: claims.buried,
            ..BatchReport::default()
        };
        // What was processed before an error ended the batch is counted all the same.
        let mut ended = Ok(());
        if !claims.messages.is_empty() {
            let granted = Granted::new();
            let work = async {
                for message in &claims.messages {
                    if stop.as_mut().is_some_and(|stop| stop.check()) {
                        batch.released += self.release(&claims).await?;
                        break;
                    }
                    let span = self.span(1, Some(message));
                    let outcome = self
                        .process_one(
                            handler,
                            &claims.owner,
                            message,
                            stop.as_deref_mut(),
                            Some(&granted),
                        )
                        .instrument(span.clone())
                        .await?;
                    if !span.is_disabled() {
                        span.record("outcome", outcome.map_or("released", Processed::name));
                    }
                    match outcome {
                        Some(Processed::Processed) => batch.processed += 1,
                        Some(Processed::Failed) => batch.failed += 1,
                        Some(Processed::Dead) => batch.dead += 1,
                        Some(Processed::Lost) => batch.lost += 1,
                        None => {
                            // Cancelled at the shutdown deadline: this row and the rest.
                            batch.released += self.release(&claims).await?;
                            break;
                        }
                    }
                }
                Ok::<(), InboxError>(())
            };
            ended = self.renewing(&claims.owner, &granted, work).await;
            if let Err(error) = &ended {
                batch.released += self.release_after(&claims, error).await;
            }
        }
        if let Some(stop) = stop.as_mut() {
            batch.released += std::mem::take(&mut stop.released);
        }
        self.count(&batch);
        ended?;
        Ok(batch)
    }

    /// The span of one processing transaction (OpenTelemetry's messaging names): the
    /// consumer (group), the inbox table (the destination the messages were received
    /// into), the message's id and attempt when it is one, the count; `outcome` once done.
    fn span(&self, count: usize, message: Option<&InboxMessage>) -> tracing::Span {
        let span = tracing::info_span!(
            "process",
            messaging.operation.type = "process",
            messaging.consumer.group.name = self.inbox.consumer.as_str(),
            messaging.destination.name = self.inbox.table.name(),
            messaging.batch.message_count = count,
            messaging.message.id = tracing::field::Empty,
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        if let Some(message) = message
            && !span.is_disabled()
        {
            span.record("messaging.message.id", message.id.as_str());
            span.record("attempt", message.attempt);
        }
        span
    }

    /// `dedup_inbox_processed_total` of one batch.
    fn count(&self, batch: &BatchReport) {
        let consumer = &self.inbox.consumer;
        for (outcome, count) in [
            ("processed", batch.processed),
            ("failed", batch.failed),
            ("dead", batch.dead),
            ("lost", batch.lost),
            ("released", batch.released),
        ] {
            crate::metrics::consumer_count(
                "dedup_inbox_processed_total",
                consumer,
                ("outcome", outcome),
                count as u64,
            );
        }
    }

    /// The first half of [`process_batch`](Self::process_batch), for a loop of your own:
    /// takes back the rows of workers that stopped (their lease ended), then claims up to
    /// [`batch`](Self::batch) due rows under one new owner token, counting their attempt.
    /// Process each with [`process`](Self::process), one at a time in the claim's order
    /// (the take-back of a claim whose worker stopped counts the attempt of its first
    /// unfinished row only, the one in hand), keeping the claim with
    /// [`renew`](Self::renew) more often than the lease runs out;
    /// [`release`](Self::release) what you will not process.
    ///
    /// A deadlock or a lost connection is tried again, a few times, under the same owner
    /// token: a claim whose reply was lost finds the rows it took, their attempt counted
    /// once.
    pub async fn claim(&self) -> Result<Claims, InboxError> {
        Ok(self.claim_keeping().await?.0)
    }

    /// [`claim`](Self::claim), and the connection the claim was made on, kept for the
    /// claim's first transaction (one acquire, and the pool's ping, fewer per claim):
    /// `None` when the claim was tried again or a take-back came between.
    pub(super) async fn claim_keeping(
        &self,
    ) -> Result<(Claims, Option<PoolConnection<DB>>), InboxError> {
        let inbox = &self.inbox;
        let (pool, table, consumer) = (&inbox.pool, &inbox.table, inbox.consumer.as_str());
        let owner = new_token();
        // The claim also says whether some claim's lease had ended (in the same statement
        // on PostgreSQL): only then the take-back, and a second claim for the room left,
        // the rows then read back in the claim's order.
        let (mut messages, expired, mut kept) = self.claim_rows(&owner, self.batch).await?;
        let mut buried = 0;
        if expired {
            kept = None;
            buried = retry_reachable::<DB, _, _>(|| {
                super::reclaim::<DB>(pool, table, consumer, self.max_attempts)
            })
            .await
            .map_err(|error| self.classify(error))?;
            let room = self.batch.saturating_sub(messages.len() as u32);
            if room > 0 {
                self.claim_rows(&owner, room).await?;
                messages =
                    retry_reachable::<DB, _, _>(|| DB::inbox_held(pool, table, consumer, &owner))
                        .await
                        .map_err(|error| self.classify(error))?;
            }
        }
        let claims = Claims {
            owner,
            messages,
            buried: buried as usize,
        };
        Ok((claims, kept))
    }

    /// One claim of up to `limit` rows for `owner`, tried again after a deadlock or a lost
    /// connection: a retry first reads what `owner` holds (a claim whose reply was lost
    /// took its rows). Whether a lease had ended, as the claim saw it (`false` after such
    /// a retry: the next claim looks).
    async fn claim_rows(
        &self,
        owner: &Owner,
        limit: u32,
    ) -> Result<(Vec<InboxMessage>, bool, Option<PoolConnection<DB>>), InboxError> {
        let inbox = &self.inbox;
        let (pool, table, consumer) = (&inbox.pool, &inbox.table, inbox.consumer.as_str());
        let tried = AtomicBool::new(false);
        retry_reachable::<DB, _, _>(|| {
            let again = tried.swap(true, std::sync::atomic::Ordering::Relaxed);
            async move {
                if again {
                    let held = DB::inbox_held(pool, table, consumer, owner).await?;
                    if !held.is_empty() {
                        return Ok((held, false, None));
                    }
                }
                let mut conn = pool.acquire().await?;
                let lease = micros(self.lease);
                let (messages, expired) =
                    DB::inbox_claim(&mut conn, table, consumer, owner, lease, limit).await?;
                Ok((messages, expired, (!again).then_some(conn)))
            }
        })
        .await
        .map_err(|error| self.classify(error))
    }

    /// Runs `handler` on one claimed message, its row marked processed in the same
    /// transaction by a mark that requires the row to be still `claims`' own: a claim
    /// lost (its lease ended, another worker took the row) is [`Processed::Lost`], the
    /// handler's effects rolled back. (On SQLite the mark comes first, and the handler of
    /// a claim lost before it does not run.)
    pub async fn process<H: InboxHandler<DB>>(
        &self,
        claims: &Claims,
        message: &InboxMessage,
        handler: &H,
    ) -> Result<Processed, InboxError> {
        let processed = self
            .process_one(handler, &claims.owner, message, None, None)
            .await?;
        Ok(processed.expect("only a shutdown deadline cancels"))
    }

    /// Renews the lease of `claims`' rows not finished yet, from now on the database's
    /// clock; how many. The heartbeat of a loop of your own
    /// ([`claim`](Self::claim), [`process`](Self::process)): call it more often than the
    /// lease runs out, from another task while a handler runs. (`process_batch` and `run`
    /// renew by themselves.)
    pub async fn renew(&self, claims: &Claims) -> Result<usize, InboxError> {
        let inbox = &self.inbox;
        let renewed = DB::inbox_renew(
            &inbox.pool,
            &inbox.table,
            &inbox.consumer,
            &claims.owner,
            micros(self.lease),
        )
        .await
        .map_err(|error| self.classify(error))?;
        Ok(renewed as usize)
    }

    /// Runs `work` with the heartbeat: every heartbeat interval, `owner`'s rows not
    /// finished get a new lease.
    async fn renewing<T>(
        &self,
        owner: &Owner,
        granted: &Granted,
        work: impl Future<Output = T>,
    ) -> T {
        let inbox = &self.inbox;
        let lease = micros(self.lease);
        let renew = || DB::inbox_renew(&inbox.pool, &inbox.table, &inbox.consumer, owner, lease);
        with_heartbeat::<DB, _, _>(self.heartbeat_interval(), granted, renew, work).await
    }

    /// Releases the claimed rows of `claims` not processed yet: pending again at once,
    /// their attempt not counted; how many.
    pub async fn release(&self, claims: &Claims) -> Result<usize, InboxError> {
        let inbox = &self.inbox;
        let released = retry_reachable::<DB, _, _>(|| {
            DB::inbox_release(
                &inbox.pool,
                &inbox.table,
                &inbox.consumer,
                &claims.owner,
                "",
            )
        })
        .await
        .map_err(|error| self.classify(error))?;
        Ok(released as usize)
    }

    /// The row of one claimed message, as the per-message statements take it.
    fn claimed<'a>(
        &'a self,
        owner: &'a Owner,
        message: &'a InboxMessage,
        renew: Option<i64>,
    ) -> Claimed<'a> {
        Claimed {
            table: &self.inbox.table,
            consumer: &self.inbox.consumer,
            id: &message.id,
            owner,
            drop_payload: self.inbox.drop_payloads,
            renew,
        }
    }

    /// The lease a processing transaction renews the claim's other rows with (SQLite,
    /// whose heartbeat cannot write meanwhile): `None` when `granted` says the last
    /// renewal is less than a heartbeat old; always without `granted` (a claim processed
    /// in a loop of the caller's, [`process`](Self::process)).
    fn renewal(&self, granted: Option<&Granted>) -> Option<i64> {
        match granted {
            Some(granted) if granted.since() < self.heartbeat_interval() => None,
            Some(granted) => {
                granted.mark();
                Some(micros(self.lease))
            }
            None => Some(micros(self.lease)),
        }
    }

    /// After a database failure ended a batch: the rows not finished, the one in hand
    /// included (its failure was the database's, not its handler's), go back at once with
    /// their attempt given back, if the database answers; how many.
    async fn release_after(&self, claims: &Claims, error: &InboxError) -> usize {
        match self.release(claims).await {
            Ok(released) => released,
            Err(release) => {
                tracing::debug!(
                    %error, %release,
                    "inbox worker: releasing the claim after a failure failed; its rows are taken back after the lease"
                );
                0
            }
        }
    }

    /// One message; `None` when `stop`'s deadline cancelled its handler (the row is still
    /// claimed: the caller releases it).
    async fn process_one<H: InboxHandler<DB>>(
        &self,
        handler: &H,
        owner: &Owner,
        message: &InboxMessage,
        mut stop: Option<&mut Shutdown<'_>>,
        granted: Option<&Granted>,
    ) -> Result<Option<Processed>, InboxError> {
        let inbox = &self.inbox;
        let row = self.claimed(owner, message, self.renewal(granted));
        // A deadlock, serialization failure or lock timeout of our own statements (the
        // mark, the check, the commit) rolled everything back: run the transaction again,
        // a few times, within the same claim. The handler's own errors are its failures.
        let mut attempt = 0;
        let outcome = loop {
            attempt += 1;
            let transaction = self.transaction(handler, &row, message);
            let ended = match stop.as_deref_mut() {
                None => transaction.await,
                Some(stop) => {
                    let mut transaction = std::pin::pin!(transaction);
                    // Once the signal has come, the claim's other rows are released at
                    // once, while the message in hand finishes (it keeps its row).
                    let release = || {
                        DB::inbox_release(
                            &inbox.pool,
                            &inbox.table,
                            &inbox.consumer,
                            owner,
                            &message.id,
                        )
                    };
                    let (mut releasing, mut released) = (None, false);
                    let ended = std::future::poll_fn(|context| {
                        if let Poll::Ready(ended) = transaction.as_mut().poll(context) {
                            return Poll::Ready(Some(ended));
                        }
                        let deadline = stop.poll_deadline(context);
                        if stop.done && !released {
                            let pending = releasing.get_or_insert_with(|| Box::pin(release()));
                            if let Poll::Ready(result) = pending.as_mut().poll(context) {
                                released = true;
                                match result {
                                    Ok(count) => stop.released += count as usize,
                                    // The release after the message in hand does it.
                                    Err(error) => tracing::debug!(
                                        %error,
                                        "inbox worker: releasing the claim's other rows at the \
                                         shutdown failed; released after the message in hand"
                                    ),
                                }
                            }
                        }
                        deadline.map(|()| None)
                    })
                    .await;
                    match ended {
                        Some(ended) => ended,
                        None => {
                            // Dropped: its connection is closed, not pooled, and the
                            // database rolls its transaction back.
                            tracing::warn!(
                                consumer = inbox.consumer,
                                message_id = message.id,
                                "inbox handler cancelled at the shutdown deadline; its row is released"
                            );
                            return Ok(None);
                        }
                    }
                }
            };
            match ended {
                Attempt::Transient(error)
                    if attempt < crate::retry::MAX_ATTEMPTS && again::<DB>(&error) =>
                {
                    tracing::debug!(%error, attempt, "inbox: transient failure; running the transaction again");
                    tokio::time::sleep(crate::retry::backoff(attempt)).await;
                }
                // The database went away under our own statements (the begin, the mark,
                // the commit): not the message's failure. The batch ends; its rows are
                // released if the database answers, or taken back after the lease.
                Attempt::Transient(error) if again::<DB>(&error) => {
                    return Err(self.classify(error));
                }
                Attempt::Transient(error) => {
                    break Err(crate::queue::error_text(error.to_string()));
                }
                Attempt::Lost => {
                    tracing::warn!(
                        consumer = inbox.consumer,
                        message_id = message.id,
                        "the claim was lost (its lease ended and another worker took the row): \
                         nothing of this attempt committed"
                    );
                    return Ok(Some(Processed::Lost));
                }
                Attempt::Error(error) => return Err(self.classify(error)),
                Attempt::Committed => break Ok(()),
                Attempt::Failed(text) => break Err(text),
            }
        };
        match outcome {
            Ok(()) => Ok(Some(Processed::Processed)),
            Err(text) => self.fail_one(&row, message, &text).await.map(Some),
        }
    }

    /// After a failed attempt of `message` (claimed as `row`): the row pending again after
    /// the backoff, or dead after its last attempt, with `text` as its last error.
    async fn fail_one(
        &self,
        row: &Claimed<'_>,
        message: &InboxMessage,
        text: &str,
    ) -> Result<Processed, InboxError> {
        let inbox = &self.inbox;
        let dead = message.attempt >= self.max_attempts;
        let delay = micros(self.delay(message.attempt));
        let failed = retry_reachable::<DB, _, _>(move || {
            DB::inbox_fail(&inbox.pool, row, text, delay, dead)
        })
        .await
        .map_err(|error| self.classify(error))?;
        if !failed {
            return Ok(Processed::Lost);
        }
        if dead {
            tracing::warn!(
                consumer = inbox.consumer,
                message_id = message.id,
                attempts = message.attempt,
                error = text,
                "inbox message dead after its last attempt"
            );
            Ok(Processed::Dead)
        } else {
            tracing::debug!(
                consumer = inbox.consumer,
                message_id = message.id,
                attempt = message.attempt,
                error = text,
                "inbox message failed; retried later"
            );
            Ok(Processed::Failed)
        }
    }

    /// Processes batches until `shutdown` completes, waiting the poll interval whenever
    /// nothing was due. Graceful: once `shutdown` has completed, it claims nothing more,
    /// releases the claimed rows not started yet at once for other workers, gives the
    /// message in hand up to the [`shutdown_deadline`](Self::shutdown_deadline) to finish
    /// (then cancels its handler, rolls it back and releases its row too), and returns
    /// `Ok(())`. A database failure is logged and retried after the poll interval, so that
    /// a worker outlives an outage: the only `Err` is a configuration refused at the start,
    /// before anything is claimed (a [`heartbeat`](Self::heartbeat) not shorter than the
    /// [`lease`](Self::lease): [`InboxError::HeartbeatNotUnderLease`]).
    ///
    /// On PostgreSQL it listens for hints on a connection of its own, outside the pool's
    /// count: a pool of one connection is enough.
    pub async fn run<H: InboxHandler<DB>>(
        &self,
        handler: &H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), InboxError> {
        self.run_with(shutdown, &PerMessage(handler)).await
    }

    /// [`run`](Self::run)'s loop, each batch processed by `step`.
    async fn run_with(
        &self,
        shutdown: impl Future<Output = ()> + Send,
        step: &impl Step<DB>,
    ) -> Result<(), InboxError> {
        self.check()?;
        let signal = std::pin::pin!(shutdown);
        let mut shutdown = Shutdown::new(signal, self.shutdown_deadline);
        // PostgreSQL: a LISTEN connection for the receivers' hints (`notify_workers`).
        let mut idle = Idle::new(
            &self.inbox.pool,
            &self.inbox.table,
            self.poll,
            self.max_poll,
        )
        .await;
        loop {
            if shutdown.check() {
                return Ok(());
            }
            let nothing = match step.step(self, &mut shutdown).await {
                Ok(batch) => batch.claimed == 0,
                Err(error) => {
                    tracing::warn!(%error, "inbox worker: claiming or marking failed; trying again");
                    true
                }
            };
            if !nothing {
                idle.busy();
                continue;
            }
            if shutdown.done || !idle.wait(&mut shutdown).await {
                return Ok(());
            }
        }
    }
}

/// How [`Worker::run`]'s loop processes one batch: per message, or in batch mode.
trait Step<DB: Backend>: Sync {
    fn step<'s>(
        &'s self,
        worker: &'s Worker<DB>,
        stop: &'s mut Shutdown<'_>,
    ) -> impl Future<Output = Result<BatchReport, InboxError>> + Send + 's;
}

/// One transaction per message.
struct PerMessage<'h, H>(&'h H);

impl<DB: Backend, H: InboxHandler<DB>> Step<DB> for PerMessage<'_, H> {
    fn step<'s>(
        &'s self,
        worker: &'s Worker<DB>,
        stop: &'s mut Shutdown<'_>,
    ) -> impl Future<Output = Result<BatchReport, InboxError>> + Send + 's {
        worker.process_until(self.0, Some(stop))
    }
}

impl<DB: Backend> Worker<DB> {
    /// One transaction for `message`: the owner-checked mark, the handler, the check and
    /// the commit.
    async fn transaction<H: InboxHandler<DB>>(
        &self,
        handler: &H,
        row: &Claimed<'_>,
        message: &InboxMessage,
    ) -> Attempt {
        // Closed, not pooled, unless the transaction ends here as it should: a call
        // cancelled mid-transaction (or a MySQL session left out of autocommit) must not
        // reach another user of the pool.
        let mut conn = match self.inbox.pool.acquire().await {
            Ok(conn) => Guarded::new(conn),
            Err(error) => return Attempt::Error(error),
        };
        let unclean = AtomicBool::new(DB::CHANGES_SESSION);
        let attempt = {
            // No check of the claim and no lock on the row before the handler (SQLite, whose
            // writer excludes every other, marks it here): a worker that pauses mid-handler
            // past its lease loses the row to another. The mark after the handler is
            // owner-checked, and requires the transaction this began.
            let (mut tx, ours) = match DB::inbox_begin(&mut conn, row).await {
                Ok(begun) => begun,
                Err(error) => return Attempt::Transient(error),
            };
            let wrote = ours;
            let ended = if ours {
                match handler.handle(&mut *tx, message).await {
                    Ok(()) => match DB::inbox_finish(&mut *tx, row).await {
                        Ok(true) => None,
                        Ok(false) => Some(Attempt::Lost),
                        Err(error) => Some(Attempt::Transient(error)),
                    },
                    Err(error) => {
                        Some(Attempt::Failed(crate::queue::error_text(error.to_string())))
                    }
                }
            } else {
                Some(Attempt::Lost)
            };
            let tx = Tx {
                tx,
                unclean: &unclean,
            };
            match ended {
                None => match DB::commit_owned(tx, None, true).await {
                    Ok(()) => Attempt::Committed,
                    Err(error) => Attempt::Transient(error),
                },
                Some(ended) => {
                    let _ = DB::rollback_owned(tx, true, wrote).await;
                    ended
                }
            }
        };
        if !unclean.load(std::sync::atomic::Ordering::Relaxed) {
            conn.set_clean();
        }
        attempt
    }
}

/// How one transaction of [`Worker::transaction`] ended.
enum Attempt {
    Committed,
    /// The handler failed, with this text.
    Failed(String),
    /// The claim was lost: nothing of the attempt committed.
    Lost,
    /// A failure of ours inside the transaction: retried when transient.
    Transient(sqlx::Error),
    /// No connection: the batch ends with it.
    Error(sqlx::Error),
}

/// How [`Worker::process`] ended for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Processed {
    /// The handler's effects and the row's mark committed.
    Processed,
    /// The handler failed: rolled back, the next attempt scheduled (its error kept).
    Failed,
    /// The handler failed on the last attempt: rolled back, the row dead.
    Dead,
    /// The claim was lost (its lease ended and another worker took the row): the mark
    /// found the row another's, and the handler's effects were rolled back. Nothing of
    /// this attempt committed.
    Lost,
}

impl Processed {
    /// Its name in a span's `outcome`.
    fn name(self) -> &'static str {
        match self {
            Processed::Processed => "processed",
            Processed::Failed => "failed",
            Processed::Dead => "dead",
            Processed::Lost => "lost",
        }
    }
}

/// Rows one [`Worker::claim`] took, under one owner token.
#[derive(Debug)]
pub struct Claims {
    owner: Owner,
    messages: Vec<InboxMessage>,
    buried: usize,
}

impl Claims {
    /// The claimed messages.
    pub fn messages(&self) -> &[InboxMessage] {
        &self.messages
    }

    /// Rows the claim found dead first (their worker stopped during their last attempt).
    pub fn buried(&self) -> usize {
        self.buried
    }
}
