//! The operator's concern trait: the few pieces of SQL in which the backends differ
//! ([`OperateBackend`]); `operate.rs` assembles the statements.

use std::future::Future;

use sqlx::Database;

use super::Queue;
use crate::table::Table;

/// A statement parameter.
#[doc(hidden)]
#[derive(Clone, Debug)]
pub enum Bind {
    /// A text parameter.
    Text(String),
    /// A 64-bit integer parameter.
    Int(i64),
}

/// A dead row as every backend reads it: `seq`, the id's bytes (the inbox's message id as
/// UTF-8, the outbox's UUID as its 16 bytes), consumer, destination, attempts, last error,
/// payload (perhaps cut), the payload's whole length, headers and the microseconds since
/// it came in.
#[doc(hidden)]
pub struct RawRow {
    pub seq: i64,
    pub id: Vec<u8>,
    pub consumer: String,
    pub destination: Option<String>,
    pub attempts: i64,
    pub last_error: Option<String>,
    pub payload: Option<Vec<u8>>,
    pub payload_len: Option<i64>,
    pub headers: Option<Vec<u8>>,
    pub age_us: i64,
}

/// What [`OperateBackend::operate_summary`] reads per consumer: the consumer, pending, in
/// flight, done, dead, and the microseconds since the oldest pending row came in.
#[doc(hidden)]
pub type SummaryRow = (String, i64, i64, i64, i64, Option<i64>);

/// The operator's calls on an inbox or outbox table, per backend.
pub trait OperateBackend: Database {
    /// Parameter `n` (from 1).
    #[doc(hidden)]
    fn operate_placeholder(n: usize) -> String;

    /// The microseconds since `column`, on the database's clock, as a 64-bit integer.
    #[doc(hidden)]
    fn operate_age_us(column: &str) -> String;

    /// `column` contains the text of parameter `parameter`, byte for byte.
    #[doc(hidden)]
    fn operate_contains(column: &str, parameter: &str) -> String;

    /// The value an id parameter is compared as: the inbox's message id as text, the
    /// outbox's UUID (given hyphenated) as the column stores it.
    #[doc(hidden)]
    fn operate_id_value(queue: Queue, parameter: &str) -> String;

    /// The columns of a [`RawRow`], in order, the payload cut at `cut` bytes if given.
    #[doc(hidden)]
    fn operate_columns(queue: Queue, cut: Option<usize>) -> String;

    /// The `SET` list of a requeue (`requeue`) or a discard.
    #[doc(hidden)]
    fn operate_set(queue: Queue, requeue: bool) -> &'static str;

    /// Runs a `SELECT` of [`operate_columns`](Self::operate_columns).
    #[doc(hidden)]
    fn operate_fetch(
        conn: &mut Self::Connection,
        sql: String,
        binds: Vec<Bind>,
    ) -> impl Future<Output = Result<Vec<RawRow>, sqlx::Error>> + Send + '_;

    /// Runs a `SELECT COUNT(*)`.
    #[doc(hidden)]
    fn operate_count(
        conn: &mut Self::Connection,
        sql: String,
        binds: Vec<Bind>,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + '_;

    /// Runs an `UPDATE`; the rows it changed.
    #[doc(hidden)]
    fn operate_execute(
        conn: &mut Self::Connection,
        sql: String,
        binds: Vec<Bind>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + '_;

    /// The rows by state per consumer, in consumer order.
    #[doc(hidden)]
    fn operate_summary<'a>(
        conn: &'a mut Self::Connection,
        queue: Queue,
        table: &'a Table,
    ) -> impl Future<Output = Result<Vec<SummaryRow>, sqlx::Error>> + Send + 'a;
}

/// The backend impl's shared body: binds `binds` to `$query` in order.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
macro_rules! bound {
    ($query:expr, $binds:expr) => {{
        let mut query = $query;
        for bind in $binds {
            query = match bind {
                $crate::operate::Bind::Text(text) => query.bind(text),
                $crate::operate::Bind::Int(n) => query.bind(n),
            };
        }
        query
    }};
}
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use bound;

/// A backend impl's `operate_fetch`, `operate_count` and `operate_execute` on its
/// connection type `$conn`: the same three bodies on every backend.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
macro_rules! runners {
    ($conn:ty) => {
        async fn operate_fetch(
            conn: &mut $conn,
            sql: String,
            binds: Vec<$crate::operate::Bind>,
        ) -> Result<Vec<$crate::operate::backend::RawRow>, sqlx::Error> {
            let query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
            let rows: Vec<$crate::operate::backend::RawTuple> =
                $crate::operate::backend::bound!(query, binds)
                    .fetch_all(conn)
                    .await?;
            Ok(rows
                .into_iter()
                .map($crate::operate::backend::raw)
                .collect())
        }

        async fn operate_count(
            conn: &mut $conn,
            sql: String,
            binds: Vec<$crate::operate::Bind>,
        ) -> Result<i64, sqlx::Error> {
            let query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql));
            $crate::operate::backend::bound!(query, binds)
                .fetch_one(conn)
                .await
        }

        async fn operate_execute(
            conn: &mut $conn,
            sql: String,
            binds: Vec<$crate::operate::Bind>,
        ) -> Result<u64, sqlx::Error> {
            let query = sqlx::query(sqlx::AssertSqlSafe(sql));
            let done = $crate::operate::backend::bound!(query, binds)
                .execute(conn)
                .await?;
            Ok(done.rows_affected())
        }
    };
}
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use runners;

/// `RawRow` from the tuple every backend's `operate_fetch` reads.
#[doc(hidden)]
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub type RawTuple = (
    i64,
    Vec<u8>,
    String,
    Option<String>,
    i64,
    Option<String>,
    Option<Vec<u8>>,
    Option<i64>,
    Option<Vec<u8>>,
    i64,
);

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) fn raw(row: RawTuple) -> RawRow {
    let (
        seq,
        id,
        consumer,
        destination,
        attempts,
        last_error,
        payload,
        payload_len,
        headers,
        age_us,
    ) = row;
    RawRow {
        seq,
        id,
        consumer,
        destination,
        attempts,
        last_error,
        payload,
        payload_len,
        headers,
        age_us,
    }
}
