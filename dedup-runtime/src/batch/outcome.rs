//! What a batch call did, message by message: [`BatchOutcome`], [`BatchItem`].

use crate::key::InvalidMessageId;
use crate::outcome::{Duplicate, InProgress};
use crate::stored::FingerprintMismatch;
#[cfg(doc)]
use {super::Batch, crate::RolledBack};

/// One message's outcome in a [`BatchOutcome`].
#[derive(Debug)]
#[non_exhaustive]
pub enum BatchItem<E> {
    /// Its effects and its dedup row committed in this call: acknowledge.
    Processed,
    /// Processed before (or, with [`Batch::unique`], its business key was): acknowledge.
    Duplicate(Duplicate),
    /// The body failed on this message alone, with this error: rolled back, nothing of it
    /// committed. Retry or dead-letter it as the single form's errors
    /// ([`AckPolicy`](crate::AckPolicy) decides on the error).
    Failed(E),
    /// The body succeeded, but the transaction of this message alone failed at its
    /// `COMMIT` (or the check before it) with this error: a deferred constraint
    /// (PostgreSQL `23503` at `COMMIT`, SQLite `787`), or a statement error the body
    /// swallowed (PostgreSQL then rolls the transaction back: [`RolledBack`]). Nothing of
    /// it committed. A batch whose commit fails that way splits down to the message, as
    /// for a failure of the body. Retry or dead-letter it as
    /// [`AckPolicy`](crate::AckPolicy) decides on the error (the handler's error type
    /// cannot hold the database's, hence a variant of its own).
    CommitFailed(sqlx::Error),
    /// The same id as the message at index `first`, earlier in this batch (a broker's
    /// redelivery within one fetch): that message's outcome is this one's too.
    SameAs {
        /// The index of the first message with the id.
        first: usize,
    },
    /// Its id is refused (empty, too long, a NUL byte): never claimed, never processed.
    Invalid(InvalidMessageId),
    /// Another delivery holds the message in progress under a lease (a leased handler of
    /// the same consumer is running it): **retry** after
    /// [`InProgress::remaining`], never acknowledge — the owner may still fail and
    /// release it. Nothing of it was processed here.
    InProgress(InProgress),
    /// With [`Batch::fingerprint`]: its id was claimed with another payload (a row of it
    /// processed, in progress or of unknown outcome; or an earlier copy in this batch) —
    /// an id reused upstream. Nothing of it was processed; dead-letter it with the reason
    /// (`AckPolicy::decide_error(&mismatch, delivery)` answers `Ack::DeadLetter`), never
    /// acknowledge it as a duplicate.
    FingerprintMismatch(FingerprintMismatch),
}

/// The outcome of [`Batch::run`]: one [`BatchItem`] per message, in input order.
#[derive(Debug)]
pub struct BatchOutcome<E> {
    pub(super) items: Vec<BatchItem<E>>,
    pub(super) splits: usize,
}

impl<E> BatchOutcome<E> {
    /// The items, in input order.
    pub fn items(&self) -> &[BatchItem<E>] {
        &self.items
    }

    /// The items, in input order, by value.
    pub fn into_items(self) -> Vec<BatchItem<E>> {
        self.items
    }

    /// The item of message `index`, with a [`BatchItem::SameAs`] followed to the
    /// message it refers to.
    pub fn settled(&self, index: usize) -> &BatchItem<E> {
        match &self.items[index] {
            BatchItem::SameAs { first } => &self.items[*first],
            item => item,
        }
    }

    /// Whether message `index` can be acknowledged: processed or a duplicate (for a copy,
    /// its first's outcome).
    pub fn ack(&self, index: usize) -> bool {
        matches!(
            self.settled(index),
            BatchItem::Processed | BatchItem::Duplicate(_)
        )
    }

    /// Messages processed in this call (copies not counted).
    pub fn processed(&self) -> usize {
        self.count(|item| matches!(item, BatchItem::Processed))
    }

    /// Messages found processed before, or their business key (copies not counted).
    pub fn duplicates(&self) -> usize {
        self.count(|item| matches!(item, BatchItem::Duplicate(_)))
    }

    /// Messages found in progress under another delivery's lease
    /// ([`BatchItem::InProgress`]; copies not counted).
    pub fn in_progress(&self) -> usize {
        self.count(|item| matches!(item, BatchItem::InProgress(_)))
    }

    /// Messages whose id came with another payload than its row's (or its first copy's
    /// in the batch): [`BatchItem::FingerprintMismatch`].
    pub fn mismatches(&self) -> usize {
        self.count(|item| matches!(item, BatchItem::FingerprintMismatch(_)))
    }

    /// Messages that failed alone: in the body ([`BatchItem::Failed`]) or at the commit
    /// ([`BatchItem::CommitFailed`]).
    pub fn failed(&self) -> usize {
        self.count(|item| matches!(item, BatchItem::Failed(_) | BatchItem::CommitFailed(_)))
    }

    /// How many times a failing transaction was split in two.
    pub fn splits(&self) -> usize {
        self.splits
    }

    pub(super) fn count(&self, what: impl Fn(&BatchItem<E>) -> bool) -> usize {
        self.items.iter().filter(|item| what(item)).count()
    }
}
