//! What an operator does with the inbox and the outbox: see what is stuck, and settle it —
//! one row, a selection, or **everything matching a filter**, in one statement.
//!
//! [`DeadLetters`] is one inbox or outbox table seen from the operator's side. Its
//! [`summary`](DeadLetters::summary) counts the rows by state per consumer (pending, in
//! flight, done, dead, and how long the oldest pending row has waited);
//! [`list`](DeadLetters::list) pages through the dead rows that match a [`Filter`] with
//! everything they hold (payload, headers, attempts, last error, age);
//! [`requeue`](DeadLetters::requeue) and [`discard`](DeadLetters::discard) act on every
//! dead row the filter matches — not one page — in one statement on the connection you
//! pass, so that they commit with the rest of your transaction (the `dedup` command and
//! its console run each action in an `#[idempotent]` handler keyed by the action's request
//! id: a retried request acts once).
//!
//! A requeue sends a message again under the id it was first given (the outbox) or runs
//! its handler under it (the inbox). Downstream consumers recognise that id only as long
//! as they keep it: once their dedup record is pruned, a replay is a new message to them.
//! So a requeue takes a [`RedeliveryWindow`] — how long the consumers downstream remember
//! ids, per consumer if they differ — and leaves every matching row older than its
//! consumer's window dead, counting it in [`Acted::refused`]. Discard those instead, or
//! widen the window if downstream keeps ids longer.
//!
//! ```
//! use std::time::Duration;
//! use dedup_runtime::inbox::{Inbox, Incoming};
//! use dedup_runtime::operate::{DeadLetters, Filter, RedeliveryWindow};
//! use sqlx::Sqlite;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
//! # dedup_runtime::inbox::migrate(&pool).await?;
//! # let inbox = Inbox::new(&pool, "billing")?;
//! # inbox.receive(Incoming::new("evt_1", b"{\"amount\": 5}")).await?;
//! # sqlx::query("UPDATE inbox_messages SET state = 3, attempts = 5, last_error = 'timeout'").execute(&pool).await?;
//! let dead = DeadLetters::inbox("inbox_messages")?;
//! let mut conn = pool.acquire().await?;
//! let timeouts = Filter::new().consumer("billing").error_contains("timeout");
//! // Each call names its database (`Postgres`, `MySql`, `Sqlite`): a connection alone
//! // does not say which.
//! assert_eq!(dead.count::<Sqlite>(&mut conn, &timeouts).await?, 1);
//! let rows = dead.list::<Sqlite>(&mut conn, &timeouts, None, 50).await?;
//! assert_eq!((rows[0].id.as_str(), rows[0].attempts), ("evt_1", 5));
//!
//! let week = RedeliveryWindow::new(Duration::from_secs(7 * 86_400));
//! let acted = dead.requeue::<Sqlite>(&mut conn, &timeouts, &week).await?;
//! assert_eq!((acted.done, acted.refused), (1, 0));
//! # Ok(()) }
//! ```

pub(crate) mod backend;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::fmt;
use std::time::Duration;

use crate::backend::Backend;
use crate::table::{InvalidTableName, Table};

pub(crate) use backend::Bind;
pub use backend::OperateBackend;

/// The most rows a [`Filter::rows`] selection may name: a bigger set is a filter's job.
pub const MAX_SELECTED_ROWS: usize = 1_000;

/// Which kind of table a [`DeadLetters`] looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Queue {
    /// An inbox table ([`crate::inbox`]): rows received, processed by workers.
    Inbox,
    /// An outbox table ([`crate::outbox`]): rows enqueued, sent by a relay.
    Outbox,
}

impl Queue {
    /// `"inbox"` or `"outbox"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Queue::Inbox => "inbox",
            Queue::Outbox => "outbox",
        }
    }

    /// The column that says when a row came in: `received_at` or `created_at`.
    pub(crate) fn since(self) -> &'static str {
        match self {
            Queue::Inbox => "received_at",
            Queue::Outbox => "created_at",
        }
    }
}

impl fmt::Display for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which dead rows an action or a listing takes. Every part given must hold; an empty
/// filter takes every dead row of the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    consumer: Option<String>,
    error_contains: Option<String>,
    older_than: Option<Duration>,
    rows: Option<Vec<i64>>,
    ids: Option<Vec<String>>,
}

impl Filter {
    /// Every dead row.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Only the rows of this consumer (the inbox's consumer, or the outbox row's cause's).
    pub fn consumer(mut self, consumer: impl Into<String>) -> Filter {
        self.consumer = Some(consumer.into());
        self
    }

    /// Only the rows whose last error contains `text` (case-sensitive, byte for byte; no
    /// wildcards).
    pub fn error_contains(mut self, text: impl Into<String>) -> Filter {
        self.error_contains = Some(text.into());
        self
    }

    /// Only the rows that came in (received, enqueued) at least `age` ago, on the
    /// database's clock.
    pub fn older_than(mut self, age: Duration) -> Filter {
        self.older_than = Some(age);
        self
    }

    /// Only these rows, by their [`DeadRow::row`] number (at most [`MAX_SELECTED_ROWS`];
    /// more is refused with [`OperateError::TooManyRows`]).
    pub fn rows(mut self, rows: impl IntoIterator<Item = i64>) -> Filter {
        self.rows = Some(rows.into_iter().collect());
        self
    }

    /// Only the rows with these ids: the inbox's message ids, or the outbox's outgoing ids
    /// (UUIDs; anything else is refused with [`OperateError::InvalidId`]). At most
    /// [`MAX_SELECTED_ROWS`].
    pub fn ids<I: Into<String>>(mut self, ids: impl IntoIterator<Item = I>) -> Filter {
        self.ids = Some(ids.into_iter().map(Into::into).collect());
        self
    }

    /// The selected ids, if a selection by id.
    pub fn selected_ids(&self) -> Option<&[String]> {
        self.ids.as_deref()
    }

    /// The consumer it takes, if one.
    pub fn consumer_name(&self) -> Option<&str> {
        self.consumer.as_deref()
    }

    /// The error text it looks for, if any.
    pub fn error_text(&self) -> Option<&str> {
        self.error_contains.as_deref()
    }

    /// The least age it takes, if one.
    pub fn min_age(&self) -> Option<Duration> {
        self.older_than
    }

    /// The selected rows, if a selection.
    pub fn selected(&self) -> Option<&[i64]> {
        self.rows.as_deref()
    }
}

/// How long the consumers downstream remember a message id (their dedup table's prune
/// age): a requeue leaves dead every row older than its consumer's window (see the
/// [module](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedeliveryWindow {
    default: Duration,
    consumers: Vec<(String, Duration)>,
}

impl RedeliveryWindow {
    /// `window` for every consumer.
    pub fn new(window: Duration) -> RedeliveryWindow {
        RedeliveryWindow {
            default: window,
            consumers: Vec::new(),
        }
    }

    /// `window` for `consumer`'s rows instead.
    pub fn consumer(mut self, consumer: impl Into<String>, window: Duration) -> RedeliveryWindow {
        let consumer = consumer.into();
        self.consumers.retain(|(name, _)| *name != consumer);
        self.consumers.push((consumer, window));
        self
    }

    /// The window of `consumer`'s rows.
    pub fn of(&self, consumer: &str) -> Duration {
        self.consumers
            .iter()
            .find(|(name, _)| name == consumer)
            .map_or(self.default, |(_, window)| *window)
    }
}

/// What a [`requeue`](DeadLetters::requeue) or [`discard`](DeadLetters::discard) did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Acted {
    /// Dead rows the filter matched.
    pub matched: u64,
    /// Rows re-queued or discarded.
    pub done: u64,
    /// Rows a requeue left dead: older than their consumer's [`RedeliveryWindow`].
    pub refused: u64,
}

/// The headers a dead row holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowHeaders {
    /// None.
    None,
    /// An outbox row's: name → bytes pairs, in order.
    Pairs(Vec<(String, Vec<u8>)>),
    /// An inbox row's: the bytes the receiver gave, as they were given.
    Opaque(Vec<u8>),
}

/// One dead row, with what an operator needs to decide about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadRow {
    /// The row's number in its table (`seq`): what [`Filter::rows`] selects by.
    pub row: i64,
    /// Its message id (the inbox's) or outgoing id (the outbox's UUID).
    pub id: String,
    /// The inbox's consumer, or the consumer whose handler enqueued the outbox row.
    pub consumer: String,
    /// The outbox row's destination; `None` for an inbox row.
    pub destination: Option<String>,
    /// The attempts it used up.
    pub attempts: u32,
    /// The last attempt's error text, as the worker or relay stored it.
    pub last_error: Option<String>,
    /// Its payload (an inbox row whose payload was dropped: empty); only its first bytes
    /// under [`DeadLetters::payload_preview`].
    pub payload: Vec<u8>,
    /// The whole payload's length in bytes.
    pub payload_len: u64,
    /// Its headers.
    pub headers: RowHeaders,
    /// How long ago it came in (received, enqueued), on the database's clock.
    pub age: Duration,
}

/// One consumer's rows in an inbox or outbox table, by state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsumerRows {
    /// The consumer.
    pub consumer: String,
    /// Waiting for a worker or relay.
    pub pending: u64,
    /// Taken by one, in flight.
    pub in_flight: u64,
    /// Processed or sent (kept until pruned).
    pub done: u64,
    /// Dead: attempts used up, waiting for an operator.
    pub dead: u64,
    /// How long the oldest pending row has waited.
    pub oldest_pending: Option<Duration>,
}

/// What an operator call refused or failed with.
#[derive(Debug)]
#[non_exhaustive]
pub enum OperateError {
    /// The table does not exist: its `migrate` creates it.
    MissingTable {
        /// The table.
        table: Table,
        /// The database's error.
        error: sqlx::Error,
    },
    /// An outbox id in [`Filter::ids`] that is not a UUID.
    InvalidId {
        /// The id as given.
        id: String,
    },
    /// A [`Filter::rows`] or [`Filter::ids`] selection of more than [`MAX_SELECTED_ROWS`].
    TooManyRows {
        /// How many it named.
        selected: usize,
    },
    /// The database failed.
    Database(sqlx::Error),
}

impl fmt::Display for OperateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OperateError::MissingTable { table, .. } => write!(
                f,
                "the table {} does not exist (run the inbox's or outbox's migrate first)",
                table.name()
            ),
            OperateError::InvalidId { id } => {
                write!(
                    f,
                    "`{id}` is not an outgoing id (a UUID such as 0f8b41c2-…)"
                )
            }
            OperateError::TooManyRows { selected } => write!(
                f,
                "a selection of {selected} rows: at most {MAX_SELECTED_ROWS}; act on a filter instead"
            ),
            OperateError::Database(error) => write!(f, "the database failed: {error}"),
        }
    }
}

impl std::error::Error for OperateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OperateError::MissingTable { error, .. } | OperateError::Database(error) => Some(error),
            OperateError::TooManyRows { .. } | OperateError::InvalidId { .. } => None,
        }
    }
}

/// One inbox or outbox table, seen from the operator's side (see the [module](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetters {
    queue: Queue,
    table: Table,
    payload_cut: Option<usize>,
}

impl DeadLetters {
    /// The inbox table `table` (the default: [`crate::inbox::DEFAULT_TABLE`]).
    pub fn inbox(table: &str) -> Result<DeadLetters, InvalidTableName> {
        Ok(DeadLetters {
            queue: Queue::Inbox,
            table: Table::new(table)?,
            payload_cut: None,
        })
    }

    /// The outbox table `table` (the default: [`crate::outbox::DEFAULT_TABLE`]).
    pub fn outbox(table: &str) -> Result<DeadLetters, InvalidTableName> {
        Ok(DeadLetters {
            queue: Queue::Outbox,
            table: Table::new(table)?,
            payload_cut: None,
        })
    }

    /// [`list`](Self::list) reads at most `bytes` of each payload ([`DeadRow::payload`]),
    /// cut by the database, and [`DeadRow::payload_len`] says how long the whole is: a
    /// page of previews without reading every payload whole (a payload may be megabytes).
    /// By default payloads are read whole.
    pub fn payload_preview(mut self, bytes: usize) -> DeadLetters {
        self.payload_cut = Some(bytes);
        self
    }

    /// Which kind of table.
    pub fn queue(&self) -> Queue {
        self.queue
    }

    /// The table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// The rows by state, per consumer, in consumer order.
    pub async fn summary<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
    ) -> Result<Vec<ConsumerRows>, OperateError> {
        let rows = DB::operate_summary(conn, self.queue, &self.table)
            .await
            .map_err(|error| self.classify::<DB>(error))?;
        let count = |n: i64| n.max(0) as u64;
        Ok(rows
            .into_iter()
            .map(
                |(consumer, pending, in_flight, done, dead, oldest)| ConsumerRows {
                    consumer,
                    pending: count(pending),
                    in_flight: count(in_flight),
                    done: count(done),
                    dead: count(dead),
                    oldest_pending: oldest.map(|us| Duration::from_micros(count(us))),
                },
            )
            .collect())
    }

    /// Up to `limit` dead rows that `filter` matches, in row order, after row `after` (the
    /// last [`DeadRow::row`] of the page before; `None`: from the first).
    pub async fn list<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        filter: &Filter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeadRow>, OperateError> {
        let mut sql = Sql::<DB>::new();
        let columns = DB::operate_columns(self.queue, self.payload_cut);
        let condition = sql.condition(self.queue, filter)?;
        let after = match after {
            Some(after) => format!(" AND seq > {}", sql.bind(Bind::Int(after))),
            None => String::new(),
        };
        let limit = sql.bind(Bind::Int(i64::from(limit)));
        let text = format!(
            "SELECT {columns} FROM {} WHERE {condition}{after} ORDER BY seq LIMIT {limit}",
            self.table.name()
        );
        let rows = DB::operate_fetch(conn, text, sql.binds)
            .await
            .map_err(|error| self.classify::<DB>(error))?;
        rows.into_iter().map(|row| self.decode(row)).collect()
    }

    /// How many dead rows `filter` matches.
    pub async fn count<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        filter: &Filter,
    ) -> Result<u64, OperateError> {
        let mut sql = Sql::<DB>::new();
        let condition = sql.condition(self.queue, filter)?;
        let text = format!(
            "SELECT COUNT(*) FROM {} WHERE {condition}",
            self.table.name()
        );
        let n = DB::operate_count(conn, text, sql.binds)
            .await
            .map_err(|error| self.classify::<DB>(error))?;
        Ok(n.max(0) as u64)
    }

    /// Every dead row `filter` matches that came in within its consumer's `window`: back
    /// to pending, due now, its attempts back to 0, for a worker or relay to take (an
    /// inbox row is processed once; an outbox row is sent under its id). Older ones stay
    /// dead, counted in [`Acted::refused`]. Two statements on `conn` (the count of the
    /// refused, the update), inside its transaction if it is in one.
    pub async fn requeue<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        filter: &Filter,
        window: &RedeliveryWindow,
    ) -> Result<Acted, OperateError> {
        let mut sql = Sql::<DB>::new();
        let condition = sql.condition(self.queue, filter)?;
        let window = sql.window(window);
        let age = DB::operate_age_us(self.queue.since());
        let table = self.table.name();
        let refused = DB::operate_count(
            &mut *conn,
            format!("SELECT COUNT(*) FROM {table} WHERE {condition} AND {age} > {window}"),
            sql.binds.clone(),
        )
        .await
        .map_err(|error| self.classify::<DB>(error))?;
        let set = DB::operate_set(self.queue, true);
        let done = DB::operate_execute(
            conn,
            format!("UPDATE {table} SET {set} WHERE {condition} AND {age} <= {window}"),
            sql.binds,
        )
        .await
        .map_err(|error| self.classify::<DB>(error))?;
        let refused = refused.max(0) as u64;
        let acted = Acted {
            matched: done + refused,
            done,
            refused,
        };
        self.log("re-queued", filter, acted);
        Ok(acted)
    }

    /// Every dead row `filter` matches recorded as done without running (inbox: processed,
    /// so that a redelivery is still a duplicate; outbox: sent, so that a handler that runs
    /// again for its cause finds it and does not send it either), its last error kept;
    /// pruned with the done rows. One statement on `conn`.
    pub async fn discard<DB: Backend>(
        &self,
        conn: &mut DB::Connection,
        filter: &Filter,
    ) -> Result<Acted, OperateError> {
        let mut sql = Sql::<DB>::new();
        let condition = sql.condition(self.queue, filter)?;
        let set = DB::operate_set(self.queue, false);
        let done = DB::operate_execute(
            conn,
            format!("UPDATE {} SET {set} WHERE {condition}", self.table.name()),
            sql.binds,
        )
        .await
        .map_err(|error| self.classify::<DB>(error))?;
        let acted = Acted {
            matched: done,
            done,
            refused: 0,
        };
        self.log("discarded", filter, acted);
        Ok(acted)
    }

    fn log(&self, what: &str, filter: &Filter, acted: Acted) {
        tracing::info!(
            table = self.table.name(),
            queue = self.queue.as_str(),
            consumer = filter.consumer.as_deref(),
            error_contains = filter.error_contains.as_deref(),
            older_than_s = filter.older_than.map(|age| age.as_secs()),
            selected = filter.rows.as_ref().map(Vec::len),
            selected_ids = filter.ids.as_ref().map(Vec::len),
            done = acted.done,
            refused = acted.refused,
            "dead {} rows {what}",
            self.queue
        );
    }

    fn decode(&self, row: backend::RawRow) -> Result<DeadRow, OperateError> {
        let backend::RawRow {
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
        } = row;
        let id = match self.queue {
            Queue::Inbox => String::from_utf8_lossy(&id).into_owned(),
            Queue::Outbox => uuid::Uuid::from_slice(&id)
                .map_err(|error| OperateError::Database(sqlx::Error::Decode(error.into())))?
                .to_string(),
        };
        let headers = match (self.queue, headers) {
            (_, None) => RowHeaders::None,
            (Queue::Inbox, Some(bytes)) => RowHeaders::Opaque(bytes),
            (Queue::Outbox, Some(bytes)) => RowHeaders::Pairs(
                crate::outbox::Headers::new(&bytes)
                    .map(|(name, value)| (name.to_owned(), value.to_vec()))
                    .collect(),
            ),
        };
        Ok(DeadRow {
            row: seq,
            id,
            consumer,
            destination,
            attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
            last_error,
            payload: payload.unwrap_or_default(),
            payload_len: payload_len.unwrap_or(0).max(0) as u64,
            headers,
            age: Duration::from_micros(age_us.max(0) as u64),
        })
    }

    fn classify<DB: Backend>(&self, error: sqlx::Error) -> OperateError {
        if DB::is_missing_table(&error, &self.table) {
            OperateError::MissingTable {
                table: self.table.clone(),
                error,
            }
        } else {
            OperateError::Database(error)
        }
    }
}

/// A statement's condition and its parameters, numbered as the backend numbers them.
struct Sql<DB> {
    binds: Vec<Bind>,
    backend: std::marker::PhantomData<DB>,
}

impl<DB: Backend> Sql<DB> {
    fn new() -> Self {
        Sql {
            binds: Vec::new(),
            backend: std::marker::PhantomData,
        }
    }

    /// Adds a parameter; its placeholder.
    fn bind(&mut self, value: Bind) -> String {
        self.binds.push(value);
        DB::operate_placeholder(self.binds.len())
    }

    /// `state = 3` and the filter's parts.
    fn condition(&mut self, queue: Queue, filter: &Filter) -> Result<String, OperateError> {
        let mut parts = vec!["state = 3".to_owned()];
        if let Some(consumer) = &filter.consumer {
            parts.push(format!(
                "consumer = {}",
                self.bind(Bind::Text(consumer.clone()))
            ));
        }
        if let Some(text) = &filter.error_contains {
            let p = self.bind(Bind::Text(text.clone()));
            parts.push(DB::operate_contains("last_error", &p));
        }
        if let Some(age) = filter.older_than {
            let p = self.bind(Bind::Int(micros(age)));
            parts.push(format!("{} >= {p}", DB::operate_age_us(queue.since())));
        }
        if let Some(ids) = &filter.ids {
            if ids.len() > MAX_SELECTED_ROWS {
                return Err(OperateError::TooManyRows {
                    selected: ids.len(),
                });
            }
            if ids.is_empty() {
                parts.push("1 = 0".to_owned());
            } else {
                let mut values = Vec::with_capacity(ids.len());
                for id in ids {
                    let id = match queue {
                        Queue::Inbox => id.clone(),
                        Queue::Outbox => uuid::Uuid::parse_str(id)
                            .map_err(|_| OperateError::InvalidId { id: id.clone() })?
                            .hyphenated()
                            .to_string(),
                    };
                    let p = self.bind(Bind::Text(id));
                    values.push(DB::operate_id_value(queue, &p));
                }
                let column = match queue {
                    Queue::Inbox => "message_id",
                    Queue::Outbox => "id",
                };
                parts.push(format!("{column} IN ({})", values.join(", ")));
            }
        }
        if let Some(rows) = &filter.rows {
            if rows.len() > MAX_SELECTED_ROWS {
                return Err(OperateError::TooManyRows {
                    selected: rows.len(),
                });
            }
            if rows.is_empty() {
                parts.push("1 = 0".to_owned());
            } else {
                let list: Vec<String> = rows.iter().map(|&row| self.bind(Bind::Int(row))).collect();
                parts.push(format!("seq IN ({})", list.join(", ")));
            }
        }
        Ok(parts.join(" AND "))
    }

    /// The row's consumer's window, in microseconds.
    fn window(&mut self, window: &RedeliveryWindow) -> String {
        if window.consumers.is_empty() {
            return self.bind(Bind::Int(micros(window.default)));
        }
        let mut case = String::from("CASE");
        for (consumer, age) in &window.consumers {
            let name = self.bind(Bind::Text(consumer.clone()));
            let age = self.bind(Bind::Int(micros(*age)));
            case.push_str(&format!(" WHEN consumer = {name} THEN {age}"));
        }
        let default = self.bind(Bind::Int(micros(window.default)));
        case.push_str(&format!(" ELSE {default} END"));
        case
    }
}

fn micros(age: Duration) -> i64 {
    i64::try_from(age.as_micros()).unwrap_or(i64::MAX)
}
