//! What a batch handler's body is: [`BatchHandler`], and the errors it may fail with
//! ([`BatchError`]).

use std::error::Error as StdError;
use std::future::Future;

#[cfg(doc)]
use super::{Batch, BatchItem};
use crate::backend::Backend;

/// The body of a batch handler: runs once per transaction on the messages of the batch
/// not processed before (in input order, each id once), on that transaction's
/// connection. Its effects commit with their dedup rows, or not at all.
pub trait BatchHandler<DB: Backend, M>: Send + Sync {
    /// The handler's error. A transient database error inside it (seen through
    /// `source()`) retries the batch; any other splits it (see the [module](crate::batch)).
    type Error: BatchError;

    /// Processes `fresh` on `tx`.
    fn handle<'c>(
        &'c self,
        tx: &'c mut DB::Connection,
        fresh: &'c [&'c M],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'c;
}

/// What a batch handler's error implements: `std::error::Error + Send + 'static`, so that
/// the batch can look through its `source()` chain for a transient database error or a
/// business key, and hand it back in [`BatchItem::Failed`]. Implemented for every such
/// type; `anyhow::Error` is not one (it does not implement `std::error::Error`).
#[diagnostic::on_unimplemented(
    message = "the error type `{Self}` of a batch handler must implement \
               `std::error::Error + Send + 'static`",
    label = "`{Self}` does not implement `std::error::Error + Send + 'static`",
    note = "the batch looks through the error's `source()` chain for a transient database \
            error (the batch is retried) or a business key (a duplicate), and hands it back \
            in `BatchItem::Failed`: return `sqlx::Error`, or an error enum of your own \
            (thiserror's `#[from] sqlx::Error` keeps the chain); `anyhow::Error` does not \
            implement `std::error::Error`"
)]
pub trait BatchError: Send + 'static {
    /// The error, for a look through its `source()` chain.
    #[doc(hidden)]
    fn as_std_error(&self) -> &(dyn StdError + 'static);
}

#[diagnostic::do_not_recommend]
impl<E: StdError + Send + 'static> BatchError for E {
    fn as_std_error(&self) -> &(dyn StdError + 'static) {
        self
    }
}
