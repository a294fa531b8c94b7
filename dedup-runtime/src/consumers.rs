//! One id space per consumer name: in debug builds, a warning when two handlers share one.
//!
//! A handler's ids are unique per `(consumer, message_id)` in its table. Two handlers
//! declaring the same `consumer` on the same table therefore share one id space: with ids
//! unique only per stream (a JetStream sequence, a Kafka offset), the second handler's
//! message is found processed and acknowledged, and its work never runs. Each handler
//! registers itself at its first call (debug builds only: the generated code compiles the
//! call out of release builds, and after the first call it is one atomic load); a second
//! handler on the same backend, table and consumer logs one `WARN` event (target
//! `dedup_runtime::consumers`) naming both.
//!
//! Sharing is right when both handlers consume one subscription whose ids are unique
//! across both (two message types of one queue, a handler and its replacement during a
//! rollout): then the warning is expected, and a `tracing` filter on the target silences
//! it.

use std::sync::{Mutex, Once};

use sqlx::Database;

use crate::input::Handle;

/// A handler that declared a consumer: backend, table, consumer, handler's path.
type Registration = (&'static str, &'static str, &'static str, &'static str);

static REGISTERED: Mutex<Vec<Registration>> = Mutex::new(Vec::new());

/// Registers `handler` (its module path and name) as a user of `consumer` in `table`,
/// once per handler (`once` is the handler's own), warning about every other handler
/// already registered for the same id space.
pub fn register<DB: Database>(
    once: &'static Once,
    handler: &'static str,
    consumer: &'static str,
    table: &'static str,
    _: &Handle<'_, DB>,
) {
    once.call_once(|| {
        let backend = DB::NAME;
        let mut registered = REGISTERED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for &(_, _, _, other) in registered
            .iter()
            .filter(|&&(b, t, c, h)| (b, t, c) == (backend, table, consumer) && h != handler)
        {
            tracing::warn!(
                target: "dedup_runtime::consumers",
                consumer,
                table,
                backend,
                first = other,
                second = handler,
                "handlers `{other}` and `{handler}` both declare consumer \"{consumer}\" on \
                 table {table} ({backend}): they share one id space, so an id one of them \
                 processed is a duplicate to the other, whose message is acknowledged \
                 without running. Give each subscription its own consumer name; if both \
                 consume one subscription whose ids are unique across both, this is \
                 expected (debug builds only)"
            );
        }
        registered.push((backend, table, consumer, handler));
    });
}
