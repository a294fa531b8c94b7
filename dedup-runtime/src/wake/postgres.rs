//! PostgreSQL: `LISTEN` on a channel per table, `pg_notify` to wake.

use sqlx::{Pool, Postgres};

use super::WakeBackend;
use crate::table::Table;

/// The channel of an inbox table's hints: `dedup_inbox_` and 16 hex digits of the
/// table name's SHA-256 (a channel name is at most 63 bytes; a table name may be longer).
fn channel(table: &Table) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(table.name().as_bytes());
    let mut name = String::from("dedup_inbox_");
    for byte in &digest[..8] {
        name.push_str(&format!("{byte:02x}"));
    }
    name
}

impl WakeBackend for Postgres {
    type Wakeup = sqlx::postgres::PgListener;

    /// The listener has a connection of its own, outside `pool`'s count (a pool of its
    /// own with one connection, to the same server with the same options): a `LISTEN`
    /// holds its connection for as long as the worker or relay runs, and on a pool of one
    /// it would leave nothing for the claims.
    async fn wake_listen<'a>(pool: &'a Pool<Self>, table: &'a Table) -> Option<Self::Wakeup> {
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        let mut listener = match sqlx::postgres::PgListener::connect_with(&own).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::debug!(%error, "inbox: LISTEN failed; the worker polls");
                return None;
            }
        };
        match listener.listen(&channel(table)).await {
            Ok(()) => Some(listener),
            Err(error) => {
                tracing::debug!(%error, "inbox: LISTEN failed; the worker polls");
                None
            }
        }
    }

    async fn wake_wait(wakeup: &mut Self::Wakeup) -> bool {
        // `try_recv` answers `None` when the connection was lost (it reconnects at the
        // next call): a hint that something may have been missed, so the worker looks.
        match wakeup.try_recv().await {
            Ok(_) => true,
            Err(error) => {
                tracing::debug!(%error, "inbox: the LISTEN connection failed; the worker polls");
                false
            }
        }
    }

    async fn wake_notify<'a>(pool: &'a Pool<Self>, table: &'a Table) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(channel(table))
            .execute(pool)
            .await
            .map(drop)
    }
}
