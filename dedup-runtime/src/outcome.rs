//! What a handler call did: processed the message, or recognised a duplicate.

/// The result of an `#[idempotent]` handler call that did not fail.
///
/// Both variants mean "acknowledge the message": a duplicate has been processed before
/// (by this consumer), so there is nothing left to do.
///
/// ```
/// use dedup_runtime::{Duplicate, Outcome};
///
/// let first: Outcome<u32> = Outcome::Processed(7);
/// let again: Outcome<u32> = Outcome::Duplicate(Duplicate::AlreadyProcessed);
/// assert!(first.is_processed() && again.is_duplicate());
/// assert_eq!(first.into_processed(), Some(7));
/// assert_eq!(again.into_processed(), None);
/// ```
#[must_use = "an `Outcome` tells whether the message was processed or was a duplicate"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// The body ran and its transaction committed, together with the dedup record;
    /// `T` is what the body returned.
    Processed(T),
    /// The message had been processed before; the body did not run (or its effects were
    /// rolled back). Acknowledge it.
    Duplicate(Duplicate),
}

impl<T> Outcome<T> {
    /// `true` when the body ran and committed.
    pub fn is_processed(&self) -> bool {
        matches!(self, Outcome::Processed(_))
    }

    /// `true` when the message had been processed before.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate(_))
    }

    /// The body's value, or `None` for a duplicate.
    pub fn into_processed(self) -> Option<T> {
        match self {
            Outcome::Processed(value) => Some(value),
            Outcome::Duplicate(_) => None,
        }
    }

    /// Which rule recognised the duplicate, or `None` when the message was processed.
    ///
    /// ```
    /// use dedup_runtime::{Duplicate, Outcome};
    ///
    /// let again: Outcome<()> = Outcome::Duplicate(Duplicate::AlreadyProcessed);
    /// assert_eq!(again.duplicate(), Some(Duplicate::AlreadyProcessed));
    /// assert_eq!(Outcome::Processed(()).duplicate(), None);
    /// ```
    pub fn duplicate(&self) -> Option<Duplicate> {
        match self {
            Outcome::Processed(_) => None,
            Outcome::Duplicate(duplicate) => Some(*duplicate),
        }
    }

    /// Maps the processed value, keeping a duplicate as it is.
    ///
    /// ```
    /// use dedup_runtime::{Duplicate, Outcome};
    ///
    /// let rows: Outcome<u64> = Outcome::Processed(3);
    /// assert_eq!(rows.map(|rows| rows > 0), Outcome::Processed(true));
    /// let again: Outcome<u64> = Outcome::Duplicate(Duplicate::AlreadyProcessed);
    /// assert_eq!(again.map(|rows| rows > 0), Outcome::Duplicate(Duplicate::AlreadyProcessed));
    /// ```
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Processed(value) => Outcome::Processed(f(value)),
            Outcome::Duplicate(duplicate) => Outcome::Duplicate(duplicate),
        }
    }
}

/// Which rule recognised a message as a duplicate.
///
/// ```
/// use dedup_runtime::{Duplicate, Outcome};
///
/// fn log_line(outcome: &Outcome<()>) -> String {
///     match outcome.duplicate() {
///         None => "processed".to_owned(),
///         Some(Duplicate::BusinessKey { constraint }) => format!("order already shipped ({constraint})"),
///         Some(other) => other.to_string(), // "message already processed"
///     }
/// }
///
/// let again = Outcome::Duplicate(Duplicate::AlreadyProcessed);
/// assert_eq!(log_line(&again), "message already processed");
/// let shipped = Outcome::Duplicate(Duplicate::BusinessKey { constraint: "shipments_order_id_key" });
/// assert_eq!(log_line(&shipped), "order already shipped (shipments_order_id_key)");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Duplicate {
    /// The processed-message table already held `(consumer, message id)`.
    AlreadyProcessed,
    /// The body violated one of the unique constraints named in `unique = …`: the
    /// business key was processed before (under another message id, perhaps). The whole
    /// transaction was rolled back, dedup record included.
    BusinessKey {
        /// The constraint, as written in `unique = …`.
        constraint: &'static str,
    },
    /// `effect = "mark-first"`: an earlier delivery marked the message and never completed
    /// its call (it crashed, or could not commit the end of its mark) before its lease
    /// ended. The effect may or may not have happened; as declared, it is not attempted
    /// again — acknowledge. The row stays, listed by
    /// [`Ledger::unresolved`](crate::Ledger::unresolved), until an operator resolves it.
    OutcomeUnknown,
}

impl std::fmt::Display for Duplicate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Duplicate::AlreadyProcessed => f.write_str("message already processed"),
            Duplicate::OutcomeUnknown => f.write_str(
                "outcome unknown: an earlier mark-first delivery never completed its call",
            ),
            Duplicate::BusinessKey { constraint } => {
                write!(
                    f,
                    "business key already processed (unique constraint `{constraint}`)"
                )
            }
        }
    }
}

/// The result of a leased handler call that did not fail: `effect = "mark-first"`, or
/// `effect = "send-first"` with `lease = "…"`.
///
/// It has one answer more than [`Outcome`]: [`InProgress`](LeaseOutcome::InProgress),
/// another delivery's lease on the message has not ended — **retry later**, never
/// acknowledge (the other owner may fail and release it) and never dead-letter.
/// [`AckPolicy::decide`](crate::AckPolicy::decide) maps it to
/// [`Ack::Retry`](crate::Ack::Retry) after the time left.
///
/// ```
/// use std::time::Duration;
/// use dedup_runtime::{Duplicate, InProgress, LeaseOutcome};
///
/// fn broker_action(outcome: &LeaseOutcome<String>) -> String {
///     match outcome {
///         LeaseOutcome::Processed(charge) => format!("ack (charged: {charge})"),
///         LeaseOutcome::Duplicate(duplicate) => format!("ack ({duplicate})"),
///         LeaseOutcome::InProgress(busy) => format!("retry in {:?}", busy.remaining()),
///     }
/// }
///
/// let busy = LeaseOutcome::InProgress(InProgress::new(Duration::from_secs(5)));
/// assert_eq!(broker_action(&busy), "retry in 5s");
/// let again = LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed);
/// assert_eq!(broker_action(&again), "ack (message already processed)");
/// ```
#[must_use = "a `LeaseOutcome` tells whether the message was processed, a duplicate, or in progress elsewhere"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseOutcome<T> {
    /// The body ran, and the row is marked processed; `T` is what the body returned.
    Processed(T),
    /// Processed before, or (mark-first) outcome unknown: the body did not run.
    /// Acknowledge.
    Duplicate(Duplicate),
    /// Another delivery holds an unexpired lease on the message: the body did not run.
    /// Retry after [`InProgress::remaining`](crate::InProgress::remaining).
    InProgress(InProgress),
}

impl<T> LeaseOutcome<T> {
    /// `true` when the body ran and its completion committed.
    pub fn is_processed(&self) -> bool {
        matches!(self, LeaseOutcome::Processed(_))
    }

    /// `true` when the message was processed before (or its outcome is unknown).
    pub fn is_duplicate(&self) -> bool {
        matches!(self, LeaseOutcome::Duplicate(_))
    }

    /// `true` when another delivery's lease had not ended.
    pub fn is_in_progress(&self) -> bool {
        matches!(self, LeaseOutcome::InProgress(_))
    }

    /// The body's value, or `None`.
    pub fn into_processed(self) -> Option<T> {
        match self {
            LeaseOutcome::Processed(value) => Some(value),
            _ => None,
        }
    }

    /// Which rule recognised the duplicate, or `None`.
    pub fn duplicate(&self) -> Option<Duplicate> {
        match self {
            LeaseOutcome::Duplicate(duplicate) => Some(*duplicate),
            _ => None,
        }
    }

    /// The other delivery's lease, or `None`.
    pub fn in_progress(&self) -> Option<InProgress> {
        match self {
            LeaseOutcome::InProgress(busy) => Some(*busy),
            _ => None,
        }
    }

    /// Maps the processed value.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> LeaseOutcome<U> {
        match self {
            LeaseOutcome::Processed(value) => LeaseOutcome::Processed(f(value)),
            LeaseOutcome::Duplicate(duplicate) => LeaseOutcome::Duplicate(duplicate),
            LeaseOutcome::InProgress(busy) => LeaseOutcome::InProgress(busy),
        }
    }
}

impl LeaseOutcome<std::convert::Infallible> {
    /// The same answer, for a call whose body would have returned `T`.
    #[doc(hidden)]
    pub fn widen<T>(self) -> LeaseOutcome<T> {
        match self {
            LeaseOutcome::Processed(never) => match never {},
            LeaseOutcome::Duplicate(duplicate) => LeaseOutcome::Duplicate(duplicate),
            LeaseOutcome::InProgress(busy) => LeaseOutcome::InProgress(busy),
        }
    }
}

/// The result of a call of a handler with `result = "stored"` that did not fail: its
/// first delivery's result, fresh or replayed.
///
/// A duplicate whose row holds a stored result is [`Replayed`](StoredOutcome::Replayed)
/// with that result, byte for byte the value the first delivery returned — so the reply a
/// consumer sends for a redelivery is the first one — and tells itself apart from a fresh
/// one. A duplicate with nothing to replay is [`Duplicate`](StoredOutcome::Duplicate): a
/// business key (another message id), a mark-first call's unknown outcome, or a row
/// processed before the handler stored results. [`InProgress`](StoredOutcome::InProgress)
/// comes from leased handlers only (`lease = …`, `effect = "mark-first"`): retry later.
///
/// ```
/// use dedup_runtime::{Duplicate, StoredOutcome};
///
/// fn reply(outcome: StoredOutcome<String>) -> Option<String> {
///     match outcome {
///         StoredOutcome::Processed(charge) | StoredOutcome::Replayed(charge) => Some(charge),
///         StoredOutcome::Duplicate(_) | StoredOutcome::InProgress(_) => None,
///     }
/// }
///
/// let again = StoredOutcome::Replayed("ch_1".to_owned());
/// assert!(again.is_duplicate() && again.is_replayed() && !again.is_processed());
/// assert_eq!(reply(again), Some("ch_1".to_owned()));
/// let shipped: StoredOutcome<String> =
///     StoredOutcome::Duplicate(Duplicate::BusinessKey { constraint: "charges_order_key" });
/// assert_eq!(shipped.into_value(), None);
/// ```
#[must_use = "a `StoredOutcome` tells whether the message was processed now, replayed, a duplicate, or in progress"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredOutcome<T> {
    /// The body ran and its transaction committed, its result stored with the dedup row;
    /// `T` is what the body returned.
    Processed(T),
    /// The message had been processed before: the body did not run, and `T` is the result
    /// the first delivery stored. Acknowledge (and reply with it).
    Replayed(T),
    /// The message had been processed before, with no result to replay (a business key,
    /// an unknown outcome, a row from before the handler stored results). Acknowledge.
    Duplicate(Duplicate),
    /// Leased handlers only: another delivery holds an unexpired lease on the message.
    /// Retry after [`InProgress::remaining`](crate::InProgress::remaining).
    InProgress(InProgress),
}

impl<T> StoredOutcome<T> {
    /// `true` when the body ran and committed now.
    pub fn is_processed(&self) -> bool {
        matches!(self, StoredOutcome::Processed(_))
    }

    /// `true` when the message had been processed before: replayed, or a duplicate.
    pub fn is_duplicate(&self) -> bool {
        matches!(
            self,
            StoredOutcome::Replayed(_) | StoredOutcome::Duplicate(_)
        )
    }

    /// `true` for a duplicate answered with the first delivery's stored result.
    pub fn is_replayed(&self) -> bool {
        matches!(self, StoredOutcome::Replayed(_))
    }

    /// `true` when another delivery's lease had not ended (leased handlers).
    pub fn is_in_progress(&self) -> bool {
        matches!(self, StoredOutcome::InProgress(_))
    }

    /// The result, fresh or replayed; `None` for a duplicate with nothing stored, or in
    /// progress.
    pub fn into_value(self) -> Option<T> {
        match self {
            StoredOutcome::Processed(value) | StoredOutcome::Replayed(value) => Some(value),
            StoredOutcome::Duplicate(_) | StoredOutcome::InProgress(_) => None,
        }
    }

    /// The result when the body ran now, `None` otherwise (a replay included).
    pub fn into_processed(self) -> Option<T> {
        match self {
            StoredOutcome::Processed(value) => Some(value),
            _ => None,
        }
    }

    /// The replayed result, `None` otherwise.
    pub fn into_replayed(self) -> Option<T> {
        match self {
            StoredOutcome::Replayed(value) => Some(value),
            _ => None,
        }
    }

    /// Which rule recognised a duplicate: [`Duplicate::AlreadyProcessed`] for a replay;
    /// `None` when processed now, or in progress.
    pub fn duplicate(&self) -> Option<Duplicate> {
        match self {
            StoredOutcome::Replayed(_) => Some(Duplicate::AlreadyProcessed),
            StoredOutcome::Duplicate(duplicate) => Some(*duplicate),
            _ => None,
        }
    }

    /// The other delivery's lease, or `None`.
    pub fn in_progress(&self) -> Option<InProgress> {
        match self {
            StoredOutcome::InProgress(busy) => Some(*busy),
            _ => None,
        }
    }

    /// Maps the result, fresh or replayed.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> StoredOutcome<U> {
        match self {
            StoredOutcome::Processed(value) => StoredOutcome::Processed(f(value)),
            StoredOutcome::Replayed(value) => StoredOutcome::Replayed(f(value)),
            StoredOutcome::Duplicate(duplicate) => StoredOutcome::Duplicate(duplicate),
            StoredOutcome::InProgress(busy) => StoredOutcome::InProgress(busy),
        }
    }
}

/// A copy of the message is being processed elsewhere, under a lease that has not
/// expired: **retry later** — neither acknowledge it (the owner may still fail and
/// release it) nor dead-letter it. [`AckPolicy`](crate::AckPolicy) answers
/// `Ack::Retry { after: remaining }`.
///
/// ```
/// use std::time::Duration;
/// use dedup_runtime::{Ack, AckPolicy, InProgress, LeaseOutcome};
///
/// let busy: Result<LeaseOutcome<()>, sqlx::Error> =
///     Ok(LeaseOutcome::InProgress(InProgress::new(Duration::from_secs(20))));
/// let policy = AckPolicy::<sqlx::Sqlite>::new();
/// assert_eq!(policy.decide(&busy, 1), Ack::Retry { after: Duration::from_secs(20) });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InProgress {
    remaining: std::time::Duration,
}

impl InProgress {
    /// A lease with `remaining` left.
    pub fn new(remaining: std::time::Duration) -> Self {
        InProgress { remaining }
    }

    /// How long the lease had left when the copy looked, on the database's clock: after
    /// that, the next delivery takes over (send-first) or finds the outcome unknown
    /// (mark-first), unless the owner finished or renewed it.
    pub fn remaining(&self) -> std::time::Duration {
        self.remaining
    }
}

impl InProgress {
    /// The error a handler without a lease (a plain `#[idempotent]` handler) ends with
    /// when its claim finds the row in progress under another delivery's lease: inside
    /// [`sqlx::Error::AnyDriverError`], so that it reaches the caller through the
    /// handler's `From<sqlx::Error>`.
    pub(crate) fn error(remaining: std::time::Duration) -> sqlx::Error {
        sqlx::Error::AnyDriverError(Box::new(InProgress { remaining }))
    }

    /// Finds an `InProgress` in `error` or its chain of [`source`](std::error::Error::source)s: the
    /// error of a handler without a lease whose claim found the message in progress under
    /// another delivery's lease. Retry it after [`remaining`](Self::remaining) (what
    /// [`AckPolicy`](crate::AckPolicy) answers); never acknowledge it, the owner may still
    /// fail and release the message.
    ///
    /// ```
    /// use dedup_runtime::InProgress;
    ///
    /// fn explain(error: &sqlx::Error) -> String {
    ///     match InProgress::find(error) {
    ///         Some(busy) => format!("another delivery holds it; retry in {:?}", busy.remaining()),
    ///         None => "another failure".to_owned(),
    ///     }
    /// }
    /// # assert_eq!(explain(&sqlx::Error::RowNotFound), "another failure");
    /// ```
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a InProgress> {
        let mut link = Some(error);
        while let Some(error) = link {
            if let Some(found) = error.downcast_ref::<InProgress>() {
                return Some(found);
            }
            link = error.source();
        }
        None
    }
}

impl std::error::Error for InProgress {}

impl std::fmt::Display for InProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "in progress under another delivery's lease, {:.3} s left",
            self.remaining.as_secs_f64()
        )
    }
}
