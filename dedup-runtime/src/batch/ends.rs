//! How a sub-batch's transaction ends, and what the split makes of a failure.

use super::Seen;
use crate::backend::Backend;
use crate::claim::Tx;
use crate::classify;
use crate::rolled_back::RolledBack;

/// How a sub-batch's transaction ends: a savepoint in the caller's transaction
/// (`nested`), or a transaction of ours on a pooled connection or the caller's.
#[derive(Clone, Copy)]
pub(super) struct Ends {
    pub(super) nested: bool,
    pub(super) pooled: bool,
}

impl Ends {
    pub(super) async fn commit<DB: Backend>(self, tx: Tx<'_, DB>) -> Result<(), sqlx::Error> {
        if self.nested {
            tx.tx.commit().await
        } else {
            DB::commit_owned(tx, None, self.pooled).await
        }
    }

    /// Rolls back, the error that made us roll back being the one that matters.
    pub(super) async fn rollback<DB: Backend>(self, tx: Tx<'_, DB>, wrote: bool) {
        let rolled_back = if self.nested {
            tx.tx.rollback().await
        } else {
            DB::rollback_owned(tx, self.pooled, wrote).await
        };
        if let Err(error) = rolled_back {
            tracing::debug!(%error, "batch: rollback failed; the transaction is discarded");
        }
    }
}

/// Whether a failed commit (or the seal before it) is the messages' own failure, to be
/// split down to the message: not transient (that is retried), not the database away or
/// out of resources, and not a caller's transaction the database rolled back.
pub(super) fn fails_at_commit<DB: Backend>(error: &sqlx::Error, ends: Ends) -> bool {
    if classify::is_unavailable::<DB>(error) || transient::<DB>(error) {
        return false;
    }
    if RolledBack::find(error).is_some() {
        return !ends.nested;
    }
    matches!(error, sqlx::Error::Database(_))
}

pub(super) fn transient<DB: Backend>(error: &sqlx::Error) -> bool {
    classify::is_transient::<DB>(error)
}

pub(super) async fn back_off(attempt: u32) {
    tokio::time::sleep(crate::retry::backoff(attempt)).await;
}

#[derive(Default)]
pub(super) struct Stats {
    pub(super) transactions: usize,
    pub(super) splits: usize,
}

/// How one sub-batch's transaction ended.
pub(super) enum Ended<E> {
    /// Committed (or nothing was fresh): `fresh` processed, `duplicates` were there
    /// (processed, or in progress elsewhere).
    Committed {
        fresh: Vec<usize>,
        duplicates: Vec<(usize, Seen)>,
    },
    /// The body failed on `fresh`, rolled back; `duplicates` were there before.
    Failed {
        fresh: Vec<usize>,
        duplicates: Vec<(usize, Seen)>,
        error: Failure<E>,
    },
}

pub(super) enum Failure<E> {
    Body(E),
    BusinessKey(&'static str),
    /// The commit failed (see [`fails_at_commit`]).
    Commit(sqlx::Error),
}
