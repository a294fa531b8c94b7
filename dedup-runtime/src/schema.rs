//! The dedup table: each backend's DDL ([`SchemaBackend`], one file per backend); its
//! name is a [`Table`](crate::Table) (`table.rs`). `migrate.rs` runs it; `prune.rs` deletes from the table.

use std::future::Future;

use sqlx::{Database, Pool};

use crate::table::Table;

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

/// How one backend creates the dedup table, and upgrades one that an earlier version
/// created.
///
/// The table's columns, on every backend: `consumer`, `message_id`, `processed_at`
/// (migration `0001`), then `state`, `owner` and `expires_at` (`0002`, for claims that are not processed yet:
/// marks and leases). A plain handler's claim writes none of the three: `state` NULL means
/// processed. `1` is in progress (held by `owner`, a 16-byte fencing token, until
/// `expires_at` on the database's clock), `2` is outcome unknown (an operator resolves
/// it). The three are nullable and have no default, so that adding them to a `0001` table
/// changes no row.
pub trait SchemaBackend: Database {
    /// The statements that create `table` complete and current (its columns, its pruning
    /// index, its index of rows not processed), when it does not exist yet.
    #[doc(hidden)]
    fn ddl(table: &Table) -> Vec<String>;

    /// The statements that upgrade a `0001` table (`consumer`, `message_id`, `processed_at`)
    /// to the current columns and indexes: the `0002` files, for users' own migration
    /// tools. `create` does the same, checking the catalog first.
    #[doc(hidden)]
    fn upgrade_ddl(table: &Table) -> Vec<String>;

    /// Creates `table`, or upgrades it in place, so that concurrent migrations (and
    /// consumers writing to the table) do not trip over each other.
    #[doc(hidden)]
    fn create<'a>(
        pool: &'a Pool<Self>,
        table: &'a Table,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// The columns migration `0002` adds to a `0001` table, in the order they are added.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
const ADDED_COLUMNS: [&str; 6] = [
    "state",
    "owner",
    "expires_at",
    "result",
    "result_version",
    "fingerprint",
];
