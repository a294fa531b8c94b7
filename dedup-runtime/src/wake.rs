//! Wake-ups: the hint that rows arrived in an inbox or an outbox table, which idle
//! workers and relays listen for between polls (PostgreSQL's `LISTEN` / `NOTIFY`; the
//! other backends poll). A concern of its own, one file per backend, so that the inbox
//! and the outbox share it without one importing the other.

use std::future::Future;

use sqlx::{Database, Pool};

use crate::table::Table;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// How one backend sends and waits for wake-ups.
pub trait WakeBackend: Database {
    /// What a worker or a relay listens on between polls for a hint that rows arrived: PostgreSQL's
    /// `LISTEN`; nothing on the other backends (`()`: they poll).
    #[doc(hidden)]
    type Wakeup: Send;

    /// Starts listening for [`WakeBackend::wake_notify`]'s hints; `None` when the
    /// backend has none, or listening failed (the worker polls meanwhile).
    #[doc(hidden)]
    fn wake_listen<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Option<Self::Wakeup>> + Send + 'a;

    /// Waits for the next hint; `false` when the listening connection failed (it is
    /// listened on again at the next idle wait).
    #[doc(hidden)]
    fn wake_wait(wakeup: &mut Self::Wakeup) -> impl Future<Output = bool> + Send + '_;

    /// Sends the hint that rows arrived (PostgreSQL: `pg_notify`); nothing elsewhere.
    #[doc(hidden)]
    fn wake_notify<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}
