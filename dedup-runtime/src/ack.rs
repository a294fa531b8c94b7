//! What to tell the broker after a handler call: acknowledge, redeliver later, or
//! dead-letter. Broker-agnostic: the broker's own call is the caller's one-line `match`.
//!
//! The rule is the same for every broker:
//!
//! - `Ok(Outcome::Processed(_))` and `Ok(Outcome::Duplicate(_))` → [`Ack::Ack`]. The
//!   work and the dedup record are committed (now or by an earlier delivery).
//! - A **transient** failure → [`Ack::Retry`]: nothing of the transaction stayed, so a
//!   redelivery is safe and may succeed. Transient means the database was busy or away,
//!   not that the message is bad (see [`Failure::of`]).
//! - Anything else, an invalid message id first of all → [`Ack::DeadLetter`]: the same
//!   message would fail the same way on every delivery, so it is parked where an operator
//!   can look at it instead of looping.

use std::error::Error as StdError;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::classify;
use crate::key::InvalidMessageId;
use crate::lease::LeaseLost;
use crate::outcome::InProgress;
use crate::outcome::{LeaseOutcome, Outcome, StoredOutcome};

/// A handler call's answer, as [`AckPolicy::decide`] maps it: [`Outcome`] (always
/// [`Ack::Ack`]) and [`LeaseOutcome`] (`Ack::Ack`, or for
/// [`InProgress`](LeaseOutcome::InProgress) `Ack::Retry` after the time the other
/// delivery's lease has left — never `Ack::Ack`, never `Ack::DeadLetter`).
pub trait AckOutcome: sealed::Sealed {
    /// What to tell the broker.
    fn ack(&self) -> Ack;
}

mod sealed {
    pub trait Sealed {}
    impl<T> Sealed for super::Outcome<T> {}
    impl<T> Sealed for super::LeaseOutcome<T> {}
    impl<T> Sealed for super::StoredOutcome<T> {}
}

impl<T> AckOutcome for Outcome<T> {
    fn ack(&self) -> Ack {
        Ack::Ack
    }
}

impl<T> AckOutcome for StoredOutcome<T> {
    fn ack(&self) -> Ack {
        match self {
            StoredOutcome::InProgress(busy) => LeaseOutcome::<()>::InProgress(*busy).ack(),
            _ => Ack::Ack,
        }
    }
}

impl<T> AckOutcome for LeaseOutcome<T> {
    fn ack(&self) -> Ack {
        match self {
            LeaseOutcome::Processed(_) | LeaseOutcome::Duplicate(_) => Ack::Ack,
            // At least a few milliseconds: a lease that ends this instant is taken over
            // (or found unknown) by the redelivery, not polled in a tight loop.
            LeaseOutcome::InProgress(busy) => Ack::Retry {
                after: busy.remaining().max(Duration::from_millis(10)),
            },
        }
    }
}

/// What to tell the broker about one delivery.
///
/// Produced by [`AckPolicy::decide`]. The broker calls it maps to:
///
/// | | RabbitMQ (lapin) | NATS JetStream (async-nats) |
/// | --- | --- | --- |
/// | `Ack` | `basic_ack` | `AckKind::Ack` |
/// | `Retry { after }` | wait `after`, then `basic_nack` with `requeue: true` | `AckKind::Nak(Some(after))` |
/// | `DeadLetter` | `basic_reject` with `requeue: false` (the queue's dead-letter exchange takes it) | publish a copy to a dead-letter subject, then `AckKind::Term` |
///
/// ```
/// use dedup_runtime::{Ack, AckPolicy, Outcome};
///
/// /// What a RabbitMQ consumer does for each `Ack` (lapin's calls, in words).
/// fn rabbitmq(ack: Ack) -> String {
///     match ack {
///         Ack::Ack => "basic_ack".to_owned(),
///         Ack::Retry { after } => format!("wait {after:?}, then basic_nack with requeue"),
///         Ack::DeadLetter => "basic_reject without requeue".to_owned(),
///     }
/// }
///
/// let policy = AckPolicy::<sqlx::Sqlite>::new();
/// let away: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::PoolTimedOut);
/// // The second delivery of a message whose database was away: twice the first delay.
/// assert_eq!(rabbitmq(policy.decide(&away, 2)), "wait 2s, then basic_nack with requeue");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ack {
    /// Acknowledge: the message was processed, now or by an earlier delivery.
    Ack,
    /// Do not acknowledge; have the message delivered again after `after`. Nothing of its
    /// transaction stayed (or, when a `COMMIT` was lost in flight and did commit, all of
    /// it did, and the redelivery is a duplicate).
    Retry {
        /// How long to wait before the redelivery.
        after: Duration,
    },
    /// Stop delivering the message and park it for an operator: it failed in a way
    /// another delivery would repeat. Nothing of its transaction was committed.
    DeadLetter,
}

/// How a handler failed: worth another delivery, or not.
///
/// ```
/// use dedup_runtime::{AckPolicy, Failure};
///
/// let policy = AckPolicy::<sqlx::Sqlite>::new();
/// assert_eq!(policy.failure(&sqlx::Error::PoolClosed), Failure::Transient);
/// assert_eq!(policy.failure(&sqlx::Error::RowNotFound), Failure::Permanent);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The database was contended or unavailable; a later delivery may succeed.
    Transient,
    /// The message itself cannot be processed; another delivery would fail the same way.
    Permanent,
}

impl Failure {
    /// The default classification of a handler's error, looking through its whole chain
    /// of [`source`](StdError::source)s:
    ///
    /// - an [`InvalidMessageId`] → `Permanent`: the id will not change on redelivery;
    /// - a [`LeaseLost`] → `Transient`: another delivery took the lease over, and the
    ///   redelivery finds the message processed (a duplicate) or still in progress;
    /// - an [`InProgress`] → `Transient`: a handler without a lease found the message in
    ///   progress under another delivery's lease;
    /// - what `#[idempotent]` retries itself ([`is_transient`]: deadlock, serialization
    ///   failure, lock timeout, `SQLITE_BUSY`) → `Transient`; it reaches the caller only
    ///   when [`MAX_ATTEMPTS`](crate::MAX_ATTEMPTS) did not suffice, or inside a caller's
    ///   transaction;
    /// - the database unreachable or going away → `Transient`: `sqlx::Error::Io`, `Tls`,
    ///   `PoolTimedOut`, `PoolClosed`, `WorkerCrashed`, an `std::io::Error`, and on
    ///   PostgreSQL and MySQL/MariaDB the SQLSTATE classes `08` (connection exception),
    ///   `53` (insufficient resources: too many connections, disk full, out of memory) and
    ///   `57` (operator intervention: shutdown, query cancelled, statement timeout), and
    ///   PostgreSQL's `25P03` and `25P04` (the server ended the session because it sat idle
    ///   in its transaction longer than `idle_in_transaction_session_timeout`, or its
    ///   transaction outlived `transaction_timeout`: FATAL, the transaction rolled back).
    ///   Such a failure is the infrastructure's, not the message's, and a redelivery cannot
    ///   apply the effect twice: the dedup record sees to that, even when a `COMMIT` was
    ///   lost in flight and did commit;
    /// - anything else → `Permanent`: constraint violations and data errors raised by the
    ///   body, decoding errors, the handler's own errors.
    ///
    /// Codes, never message text, decide. To put your own error classes first, see
    /// [`AckPolicy::classify_with`].
    ///
    /// ```
    /// use dedup_runtime::{Failure, InvalidMessageId};
    ///
    /// let timeout = sqlx::Error::PoolTimedOut;
    /// assert_eq!(Failure::of::<sqlx::Sqlite>(&timeout), Failure::Transient);
    ///
    /// let bad_id: sqlx::Error = InvalidMessageId::Empty.into();
    /// assert_eq!(Failure::of::<sqlx::Sqlite>(&bad_id), Failure::Permanent);
    ///
    /// let missing = sqlx::Error::RowNotFound;
    /// assert_eq!(Failure::of::<sqlx::Sqlite>(&missing), Failure::Permanent);
    /// ```
    pub fn of<DB: Backend>(error: &(dyn StdError + 'static)) -> Failure {
        if InvalidMessageId::find(error).is_some() {
            Failure::Permanent
        } else if LeaseLost::find(error).is_some() || InProgress::find(error).is_some() {
            // Another delivery owns the message now: its redelivery is a duplicate, or in
            // progress; never a dead letter of a message that is being processed.
            Failure::Transient
        } else if is_transient::<DB>(error) || classify::is_unavailable::<DB>(error) {
            Failure::Transient
        } else {
            Failure::Permanent
        }
    }
}

/// Whether `error`, or an error in its chain of sources, is a failure `#[idempotent]`
/// retries itself on `DB` when it owns the transaction: on PostgreSQL SQLSTATE `40001`,
/// `40P01`, `55P03`; on MySQL/MariaDB 1205, 1213; on SQLite `SQLITE_BUSY`,
/// `SQLITE_LOCKED`. Classified by code, never by message text.
///
/// ```
/// let error = sqlx::Error::RowNotFound;
/// assert!(!dedup_runtime::is_transient::<sqlx::Sqlite>(&error));
/// ```
pub fn is_transient<DB: Backend>(error: &(dyn StdError + 'static)) -> bool {
    classify::is_transient::<DB>(error)
}

/// Your own classification, consulted before the default one.
type Classifier = dyn Fn(&(dyn StdError + 'static)) -> Option<Failure> + Send + Sync;

/// Maps a handler's result to the broker's action ([`Ack`]) for handlers on `DB`.
///
/// Processed or duplicate → [`Ack::Ack`]; a [`Failure::Transient`] error →
/// [`Ack::Retry`] after a delay that doubles with each delivery of the message (1 s, 2 s,
/// 4 s … up to 60 s by default); a [`Failure::Permanent`] one → [`Ack::DeadLetter`].
/// Cheap to clone; build it once and share it between consumer tasks.
///
/// ```
/// use std::time::Duration;
/// use dedup_runtime::{Ack, AckPolicy, Duplicate, Failure, InvalidMessageId, Outcome};
///
/// let policy = AckPolicy::<sqlx::Sqlite>::new();
///
/// let processed: Result<Outcome<()>, sqlx::Error> = Ok(Outcome::Processed(()));
/// let duplicate: Result<Outcome<()>, sqlx::Error> =
///     Ok(Outcome::Duplicate(Duplicate::AlreadyProcessed));
/// assert_eq!(policy.decide(&processed, 1), Ack::Ack);
/// assert_eq!(policy.decide(&duplicate, 7), Ack::Ack);
///
/// // The database is away: try again later, and later still on each redelivery.
/// let away: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::PoolTimedOut);
/// assert_eq!(policy.decide(&away, 1), Ack::Retry { after: Duration::from_secs(1) });
/// assert_eq!(policy.decide(&away, 3), Ack::Retry { after: Duration::from_secs(4) });
///
/// // The message cannot be processed, however often it comes.
/// let bad_id: Result<Outcome<()>, sqlx::Error> = Err(InvalidMessageId::Empty.into());
/// assert_eq!(policy.decide(&bad_id, 1), Ack::DeadLetter);
/// ```
///
/// Your own error classes go first with [`classify_with`](Self::classify_with):
///
/// ```
/// use dedup_runtime::{Ack, AckPolicy, Failure, Outcome};
///
/// #[derive(Debug)]
/// enum PaymentError {
///     ProviderDown,
///     Database(sqlx::Error),
/// }
/// # impl std::fmt::Display for PaymentError {
/// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
/// #         f.write_str("payment failed")
/// #     }
/// # }
/// # impl std::error::Error for PaymentError {
/// #     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
/// #         match self {
/// #             PaymentError::Database(error) => Some(error),
/// #             PaymentError::ProviderDown => None,
/// #         }
/// #     }
/// # }
///
/// let policy = AckPolicy::<sqlx::Sqlite>::new().classify_with(|error| {
///     match error.downcast_ref::<PaymentError>() {
///         Some(PaymentError::ProviderDown) => Some(Failure::Transient),
///         _ => None, // the default rules decide
///     }
/// });
/// let down: Result<Outcome<()>, PaymentError> = Err(PaymentError::ProviderDown);
/// assert!(matches!(policy.decide(&down, 1), Ack::Retry { .. }));
/// ```
pub struct AckPolicy<DB> {
    retry_after: Duration,
    max_retry_after: Duration,
    classify: Option<Arc<Classifier>>,
    database: PhantomData<fn() -> DB>,
}

impl<DB: Backend> AckPolicy<DB> {
    /// The first retry's delay, by default.
    pub const RETRY_AFTER: Duration = Duration::from_secs(1);
    /// The longest retry delay, by default.
    pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

    /// The default policy: retries after 1 s, doubling per delivery up to 60 s; errors
    /// classified by [`Failure::of`].
    pub fn new() -> Self {
        AckPolicy {
            retry_after: Self::RETRY_AFTER,
            max_retry_after: Self::MAX_RETRY_AFTER,
            classify: None,
            database: PhantomData,
        }
    }

    /// Retries after `first` on the first delivery, doubling with each later delivery, up
    /// to `max`. Equal values give a constant delay.
    pub fn retry_after(mut self, first: Duration, max: Duration) -> Self {
        self.retry_after = first;
        self.max_retry_after = max.max(first);
        self
    }

    /// Consults `classify` before the default rules: `Some(failure)` decides, `None`
    /// leaves the error to [`Failure::of`]. It sees the handler's error (for
    /// `anyhow::Error`, the error it wraps); walk `source()` yourself to look deeper.
    pub fn classify_with(
        mut self,
        classify: impl Fn(&(dyn StdError + 'static)) -> Option<Failure> + Send + Sync + 'static,
    ) -> Self {
        self.classify = Some(Arc::new(classify));
        self
    }

    /// The action for a handler's result whose error type is an [`Error`](StdError)
    /// (`sqlx::Error`, a `thiserror` enum); for `anyhow::Result` handlers, see
    /// [`decide_dyn`](Self::decide_dyn). `delivery` is the 1-based count of this
    /// delivery: 1 the first time. JetStream's `info.delivered` is that count (an `i64`);
    /// RabbitMQ's `x-delivery-count` header (quorum queues) counts the *earlier*
    /// deliveries and is absent on the first, so pass it plus one, and with only the
    /// `redelivered` flag (classic queues) pass 2 when it is set. Pass 1 when the broker
    /// does not say; 0 counts as 1.
    pub fn decide<O, E>(&self, result: &Result<O, E>, delivery: u64) -> Ack
    where
        O: AckOutcome,
        E: DecideError,
    {
        match result {
            Ok(outcome) => outcome.ack(),
            Err(error) => self.decide_error(error.as_error(), delivery),
        }
    }

    /// [`decide`](Self::decide) for error types that are not themselves an
    /// [`Error`](StdError) but hold one: `anyhow::Error`,
    /// `Box<dyn Error + Send + Sync>`.
    ///
    /// ```
    /// # use dedup_runtime::{Ack, AckPolicy, Outcome};
    /// // The result of an `#[idempotent]` handler that returns `anyhow::Result<()>`:
    /// let result: anyhow::Result<Outcome<()>> = Err(anyhow::anyhow!("bad payload"));
    /// let policy = AckPolicy::<sqlx::Sqlite>::new();
    /// assert_eq!(policy.decide_dyn(&result, 1), Ack::DeadLetter);
    /// ```
    pub fn decide_dyn<O, E>(&self, result: &Result<O, E>, delivery: u64) -> Ack
    where
        O: AckOutcome,
        E: AsRef<dyn StdError + Send + Sync>,
    {
        match result {
            Ok(outcome) => outcome.ack(),
            Err(error) => self.decide_error(error.as_ref(), delivery),
        }
    }

    /// The action for a handler call that failed with `error`.
    ///
    /// An [`InProgress`] (a handler without a lease found the message in progress under
    /// another delivery's lease) is `Ack::Retry` after the time that lease has left (at
    /// least 10 ms), before any classifier: never acknowledged, never dead-lettered.
    pub fn decide_error(&self, error: &(dyn StdError + 'static), delivery: u64) -> Ack {
        if let Some(busy) = InProgress::find(error) {
            return LeaseOutcome::<()>::InProgress(*busy).ack();
        }
        match self.failure(error) {
            Failure::Transient => Ack::Retry {
                after: self.delay(delivery),
            },
            Failure::Permanent => Ack::DeadLetter,
        }
    }

    /// How `error` is classified: by your classifier first, then by [`Failure::of`].
    pub fn failure(&self, error: &(dyn StdError + 'static)) -> Failure {
        self.classify
            .as_ref()
            .and_then(|classify| classify(error))
            .unwrap_or_else(|| Failure::of::<DB>(error))
    }

    /// `retry_after * 2^(delivery - 1)`, at most `max_retry_after`.
    fn delay(&self, delivery: u64) -> Duration {
        let doublings = u32::try_from(delivery.saturating_sub(1).min(31)).unwrap_or(31);
        self.retry_after
            .saturating_mul(1 << doublings)
            .min(self.max_retry_after)
    }
}

/// The error types [`AckPolicy::decide`] takes: every [`Error`](StdError) (`sqlx::Error`,
/// a `thiserror` enum). `anyhow::Error` and `Box<dyn Error + Send + Sync>` are not
/// errors themselves, but hold one: [`AckPolicy::decide_dyn`] takes those, and the
/// compiler says so (`dedup-ui/tests/ui/decide_anyhow.rs` shows the message).
#[diagnostic::on_unimplemented(
    message = "`AckPolicy::decide` takes a result whose error type is an `std::error::Error`, \
               and `{Self}` is not one",
    label = "`{Self}` does not implement `std::error::Error`",
    note = "for `anyhow::Error` or `Box<dyn Error + Send + Sync>`, which hold an error, call \
            `decide_dyn`: `policy.decide_dyn(&result, delivery)`"
)]
pub trait DecideError {
    /// The error, as the classifier sees it.
    fn as_error(&self) -> &(dyn StdError + 'static);
}

#[diagnostic::do_not_recommend]
impl<E: StdError + 'static> DecideError for E {
    fn as_error(&self) -> &(dyn StdError + 'static) {
        self
    }
}

impl<DB: Backend> Default for AckPolicy<DB> {
    fn default() -> Self {
        Self::new()
    }
}

impl<DB> Clone for AckPolicy<DB> {
    fn clone(&self) -> Self {
        AckPolicy {
            retry_after: self.retry_after,
            max_retry_after: self.max_retry_after,
            classify: self.classify.clone(),
            database: PhantomData,
        }
    }
}

impl<DB: Backend> fmt::Debug for AckPolicy<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AckPolicy")
            .field("database", &DB::NAME)
            .field("retry_after", &self.retry_after)
            .field("max_retry_after", &self.max_retry_after)
            .field("classify", &self.classify.as_ref().map(|_| "custom"))
            .finish()
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::Duplicate;

    type Policy = AckPolicy<sqlx::Sqlite>;

    #[derive(Debug)]
    struct Wrapper(sqlx::Error);

    impl fmt::Display for Wrapper {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("handler failed")
        }
    }

    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn outcomes_are_acknowledged() {
        let policy = Policy::new();
        let processed: Result<Outcome<u8>, sqlx::Error> = Ok(Outcome::Processed(1));
        let duplicate: Result<Outcome<u8>, sqlx::Error> =
            Ok(Outcome::Duplicate(Duplicate::AlreadyProcessed));
        assert_eq!(policy.decide(&processed, 1), Ack::Ack);
        assert_eq!(policy.decide(&duplicate, 9), Ack::Ack);
    }

    #[test]
    fn unavailability_is_retried_through_wrappers() {
        let policy = Policy::new();
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        for error in [
            sqlx::Error::Io(refused),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ] {
            let wrapped: Result<Outcome<()>, Wrapper> = Err(Wrapper(error));
            assert!(
                matches!(policy.decide(&wrapped, 1), Ack::Retry { .. }),
                "{wrapped:?}"
            );
        }
        let boxed: Result<Outcome<()>, Box<dyn StdError + Send + Sync>> =
            Err(Box::new(sqlx::Error::PoolTimedOut));
        assert!(matches!(policy.decide_dyn(&boxed, 1), Ack::Retry { .. }));
    }

    #[test]
    fn invalid_ids_and_other_errors_are_dead_lettered() {
        let policy = Policy::new();
        let too_long: Result<Outcome<()>, Wrapper> = Err(Wrapper(
            InvalidMessageId::TooLong { len: 300, max: 255 }.into(),
        ));
        assert_eq!(policy.decide(&too_long, 1), Ack::DeadLetter);
        let decode: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::ColumnNotFound("x".into()));
        assert_eq!(policy.decide(&decode, 1), Ack::DeadLetter);
    }

    #[test]
    fn retry_delay_doubles_per_delivery_and_is_capped() {
        let policy = Policy::new().retry_after(Duration::from_millis(100), Duration::from_secs(1));
        let away: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::PoolTimedOut);
        let delays: Vec<Duration> = [0, 1, 2, 3, 4, 5, u64::MAX]
            .into_iter()
            .map(|delivery| match policy.decide(&away, delivery) {
                Ack::Retry { after } => after,
                other => panic!("expected a retry, got {other:?}"),
            })
            .collect();
        let ms = Duration::from_millis;
        assert_eq!(
            delays,
            [
                ms(100),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1000),
                ms(1000)
            ]
        );
    }

    #[test]
    fn own_classification_comes_first() {
        let policy = Policy::new().classify_with(|error| {
            error.downcast_ref::<sqlx::Error>().and_then(|error| {
                matches!(error, sqlx::Error::RowNotFound).then_some(Failure::Transient)
            })
        });
        let missing: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::RowNotFound);
        assert!(matches!(policy.decide(&missing, 1), Ack::Retry { .. }));
        // Left to the default rules.
        let timeout: Result<Outcome<()>, sqlx::Error> = Err(sqlx::Error::PoolTimedOut);
        assert!(matches!(policy.decide(&timeout, 1), Ack::Retry { .. }));
        let bad_id: Result<Outcome<()>, sqlx::Error> = Err(InvalidMessageId::Empty.into());
        assert_eq!(policy.decide(&bad_id, 1), Ack::DeadLetter);
    }
}
