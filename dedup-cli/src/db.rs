//! The database the URL names, as one of three pools; `with_pool!` runs generic code on
//! whichever it is.

use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

use crate::Failure;

/// A pool on the backend the URL names.
#[derive(Clone, Debug)]
pub enum Pools {
    /// `postgres://`, `postgresql://`.
    Postgres(PgPool),
    /// `mysql://`, `mariadb://`.
    MySql(MySqlPool),
    /// `sqlite:` (an existing file).
    Sqlite(SqlitePool),
}

impl Pools {
    /// Connects to `url` with at most `connections` connections.
    pub async fn connect(url: &str, connections: u32) -> Result<Pools, Failure> {
        let timeout = Duration::from_secs(10);
        let failed = |error: sqlx::Error| Failure::database(format!("cannot connect: {error}"));
        if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let pool = PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(timeout)
                .connect(url)
                .await
                .map_err(failed)?;
            Ok(Pools::Postgres(pool))
        } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let pool = MySqlPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(timeout)
                .connect(&url)
                .await
                .map_err(failed)?;
            Ok(Pools::MySql(pool))
        } else if url.starts_with("sqlite:") {
            // An existing file only: creating an empty database would hide a wrong path.
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|error| Failure::usage(format!("`{url}`: {error}")))?
                .busy_timeout(timeout);
            let pool = SqlitePoolOptions::new()
                .max_connections(connections)
                .connect_with(options)
                .await
                .map_err(failed)?;
            Ok(Pools::Sqlite(pool))
        } else {
            Err(Failure::usage(format!(
                "`{url}`: expected a postgres://, mysql:// (mariadb://) or sqlite: URL"
            )))
        }
    }

    /// `PostgreSQL`, `MySQL` or `SQLite`.
    pub fn name(&self) -> &'static str {
        match self {
            Pools::Postgres(_) => "PostgreSQL",
            Pools::MySql(_) => "MySQL",
            Pools::Sqlite(_) => "SQLite",
        }
    }
}

/// `with_pool!(pools, |pool| body)`: `body` with `pool` the `&Pool<DB>` of whichever
/// backend `pools` holds (`body` is compiled once per backend).
macro_rules! with_pool {
    ($pools:expr, |$pool:ident| $body:expr) => {
        match $pools {
            $crate::db::Pools::Postgres($pool) => $body,
            $crate::db::Pools::MySql($pool) => $body,
            $crate::db::Pools::Sqlite($pool) => $body,
        }
    };
}
pub(crate) use with_pool;
