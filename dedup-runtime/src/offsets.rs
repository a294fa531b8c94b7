//! Kafka offsets kept in the database (the hosted Kafka consumer's
//! [`offsets_in_database`](crate::rdkafka::KafkaConsumer::offsets_in_database) mode): one
//! row per consumer group, topic and partition in `dedup_kafka_offsets`, holding the
//! offset after the last record whose handler committed — written **in the handler's own
//! transaction**, just before its `COMMIT`, so that the position and the work commit
//! together or not at all. One file per backend.
//!
//! The consumer hands the row to write to the handler's transaction through a task-local
//! ([`Pending`]), set around the handler's call; the transaction the handler itself
//! begins for that record's id (not a nested one, not one for another id) writes it once.

use std::future::Future;

use sqlx::Database;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// One partition's position: the offset of the next record to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetRow {
    /// The consumer group (`group.id`).
    pub group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset after the last record processed.
    pub next: i64,
}

/// How one backend keeps Kafka offsets.
pub trait OffsetsBackend: Database {
    /// `CREATE TABLE IF NOT EXISTS dedup_kafka_offsets …`.
    #[doc(hidden)]
    fn offsets_migrate(
        pool: &sqlx::Pool<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Writes `row` (never moving a partition's offset back).
    #[doc(hidden)]
    fn offsets_store<'c>(
        conn: &'c mut Self::Connection,
        row: &'c OffsetRow,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Every partition's stored offset for `group` and `topic`.
    #[doc(hidden)]
    fn offsets_read<'c>(
        pool: &'c sqlx::Pool<Self>,
        group: &'c str,
        topic: &'c str,
    ) -> impl Future<Output = Result<Vec<(i32, i64)>, sqlx::Error>> + Send + 'c;
}

#[cfg(feature = "rdkafka")]
pub(crate) use pending::{PENDING, Pending, pending};

#[cfg(feature = "rdkafka")]
mod pending {
    use super::OffsetRow;

    /// The row a record's handler call writes, and for which id.
    pub(crate) struct Pending {
        pub(crate) id: String,
        pub(crate) row: OffsetRow,
    }

    tokio::task_local! {
        /// Set by the Kafka consumer around a handler's call in offsets-in-database mode.
        pub(crate) static PENDING: Option<Pending>;
    }

    /// The row to write in an owned transaction claiming `id`: `None` outside a
    /// consumer's call in offsets-in-database mode, or for another id. Each attempt's
    /// transaction writes it (a rerun after a transient failure too).
    pub(crate) fn pending(id: &str) -> Option<OffsetRow> {
        PENDING
            .try_with(|pending| {
                pending
                    .as_ref()
                    .filter(|pending| pending.id == id)
                    .map(|pending| pending.row.clone())
            })
            .ok()
            .flatten()
    }
}
