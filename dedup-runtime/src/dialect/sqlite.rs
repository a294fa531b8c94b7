//! SQLite: the SQL every concern's SQLite file shares.

use crate::table::Table;

/// Takes the write lock at `BEGIN`: a deferred transaction that reads first and writes
/// later can fail with `SQLITE_BUSY` without waiting, where this one waits.
pub(crate) const BEGIN: &str = "BEGIN IMMEDIATE";

/// The database's now, as every time column of the inbox and the outbox holds it (UTC,
/// `%Y-%m-%dT%H:%M:%fZ`): text that compares as the time it says.
pub(crate) const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

/// The time `parameter` (a statement's parameter, in microseconds) from now, in
/// [`NOW`]'s format.
pub(crate) fn later(parameter: &str) -> String {
    format!(
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('%+.6f seconds', {parameter} / 1000000.0))"
    )
}

/// The name of a table's index `suffix` (the tables beside the dedup table: the inbox's,
/// the outbox's), qualified by the table's schema as SQLite wants it.
pub(crate) fn index_name(table: &Table, suffix: &str) -> String {
    match table.schema() {
        Some(schema) => format!("{schema}.{}_{suffix}", table.base()),
        None => format!("{}_{suffix}", table.base()),
    }
}
