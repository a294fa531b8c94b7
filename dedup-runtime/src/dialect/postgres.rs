//! PostgreSQL: the SQL every concern's PostgreSQL file shares.

use crate::table::Table;

/// A claim's condition that makes its own (autocommitted) transaction commit without
/// waiting for the WAL flush: `synchronous_commit = off` for that transaction alone, set
/// once (an InitPlan) before any row is claimed. What it risks is the claim itself, and
/// only if the server crashes within a WAL writer's cycle of it: the rows are pending
/// again, their attempt not counted — as a take-back that gives the attempt back. Nothing
/// durable can follow a lost claim: the processing transaction (or the relay's mark)
/// commits synchronously, and its flush writes the WAL up to its own commit, the claim's
/// included. A worker or relay killed after the claim loses nothing (the server has it),
/// so an attempt that kills its process is counted. Worth one WAL flush per claim: the
/// benchmark's batch-mode inbox workers did two commits per claim where a hand-written
/// transaction-holding worker does one.
pub(crate) const UNFLUSHED_CLAIM: &str =
    "(SELECT set_config('synchronous_commit', 'off', true)) = 'off'";

/// The name of a table's index `suffix` (the tables beside the dedup table: the inbox's,
/// the outbox's): in the table's schema, as PostgreSQL puts it.
pub(crate) fn index_name(table: &Table, suffix: &str) -> String {
    format!("{}_{suffix}", table.base())
}
