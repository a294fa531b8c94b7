//! [`Backend`]: a database `dedup` supports, as the sum of its concerns. Each concern is
//! a trait of its own with one file per backend:
//!
//! | concern | trait | files |
//! | --- | --- | --- |
//! | begin, claim, commit, roll back | `ClaimBackend` | `claim.rs`, `claim/<db>.rs` |
//! | a batch's claim and seal | `BatchBackend` | `batch.rs`, `batch/<db>.rs` |
//! | what an error means | `ClassifyBackend` | `classify.rs`, `classify/<db>.rs` |
//! | the dedup table's DDL | `SchemaBackend` | `schema.rs`, `schema/<db>.rs` |
//! | pruning old ids | `PruneSql` | `prune.rs`, `prune/<db>.rs` |
//! | the operator's lookup and forget | `LedgerBackend` | `ledger.rs`, `ledger/<db>.rs` |
//! | the inbox: receive, claim, process | [`InboxBackend`](crate::inbox::InboxBackend) | `inbox.rs`, `inbox/worker.rs`, `inbox/<db>.rs` |
//! | the inbox's operator calls | [`InboxOperatorBackend`](crate::inbox::InboxOperatorBackend) | `inbox.rs`, `inbox/<db>.rs` |
//! | leases: mark-first, send-first with a lease | [`LeaseBackend`](crate::lease::LeaseBackend) | `lease.rs`, `lease/<db>.rs` |
//! | wake-ups of idle workers and relays (`LISTEN`/`NOTIFY`) | `WakeBackend` | `wake.rs`, `wake/<db>.rs` |
//! | the operator's dead rows: list, requeue, discard | [`OperateBackend`](crate::operate::OperateBackend) | `operate.rs`, `operate/<db>.rs` |
//! | the outbox: enqueue | [`OutboxBackend`](crate::outbox::OutboxBackend) | `outbox.rs`, `outbox/<db>.rs` |
//! | Kafka offsets kept in the database | `OffsetsBackend` | `offsets.rs`, `offsets/<db>.rs` |
//!
//! A new backend implements each of them in a new file per concern, and gets one line
//! here; a new capability adds a concern (its trait, its files) and a supertrait.

use sqlx::Database;

use crate::batch::BatchBackend;
use crate::claim::ClaimBackend;
use crate::classify::ClassifyBackend;
use crate::inbox::{InboxBackend, InboxOperatorBackend};
use crate::lease::LeaseBackend;
use crate::ledger::LedgerBackend;
use crate::offsets::OffsetsBackend;
use crate::operate::OperateBackend;
use crate::outbox::OutboxBackend;
use crate::prune::PruneSql;
use crate::schema::SchemaBackend;
use crate::wake::WakeBackend;

/// A database `dedup` supports: `sqlx::Postgres` (feature `postgres`), `sqlx::Sqlite`
/// (feature `sqlite`) and `sqlx::MySql` (feature `mysql`, also for MariaDB).
///
/// Sealed: what it requires are the library's internals. Name it to write code generic
/// over the database:
///
/// ```
/// use dedup_runtime::Backend;
///
/// /// Creates the dedup table at start-up, whichever database the service runs on.
/// async fn start<DB: Backend>(pool: &sqlx::Pool<DB>) -> Result<(), sqlx::Error> {
///     dedup_runtime::migrate(pool).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// start(&pool).await?;
/// # Ok(()) }
/// ```
pub trait Backend:
    Database
    + ClaimBackend
    + BatchBackend
    + ClassifyBackend
    + SchemaBackend
    + LedgerBackend
    + LeaseBackend
    + InboxBackend
    + InboxOperatorBackend
    + OperateBackend
    + OutboxBackend
    + PruneSql
    + WakeBackend
    + OffsetsBackend
    + Sealed
{
}

/// Only the backends below are [`Backend`]s.
pub trait Sealed {}

macro_rules! backends {
    ($($feature:literal => $database:ty),* $(,)?) => {$(
        #[cfg(feature = $feature)]
        impl Sealed for $database {}
        #[cfg(feature = $feature)]
        impl Backend for $database {}
    )*};
}

backends! {
    "mysql" => sqlx::MySql,
    "postgres" => sqlx::Postgres,
    "sqlite" => sqlx::Sqlite,
}
