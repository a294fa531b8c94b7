//! The outbox on PostgreSQL, MariaDB and SQLite (a temporary file), one submodule per
//! concern:
//!
//! - `ids`: outgoing ids derived from the cause, pinned by a table of values; bad causes
//!   and slots refused;
//! - `enqueue`: an enqueue commits with its transaction or rolls back with it; the same
//!   message twice is one row; the same id with another payload is a typed error that
//!   leaves the caller's transaction usable; bad input is refused before anything is
//!   written; inside an `#[idempotent]` body;
//! - `relay`: the relay, message by message: each row sent once, in order, and marked; a
//!   poison row dead; ordering keys; relays side by side, a stale one's mark refused; `run`
//!   until shutdown; PostgreSQL's hints;
//! - `batches`: the relay handing each claim to `publish_batch`;
//! - `operator`: stats, health, pruning, the operator's calls and its command.
//!
//! Each suite is instantiated once per backend by `outbox_backends!`, which holds what
//! differs between the backends; `common` has the helpers the relay's suites share, per
//! backend, and this module the publishers they send to. Every case reads the rows back.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use dedup_runtime::outbox::{OutboxMessage, OutgoingId, Publisher};
use tokio::sync::Notify;

/// A publisher for the relay's tests, in the process: what a broker received, in order;
/// fails every send of a `poison` payload; holds the send of a `hold` payload until
/// released (`held` tells it got there). It also checks that no message is ever in two
/// sends at once.
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<(OutgoingId, String, Vec<u8>)>>,
    attempts: Mutex<HashMap<OutgoingId, u32>>,
    in_flight: Mutex<HashSet<OutgoingId>>,
    overlaps: std::sync::atomic::AtomicU32,
    held: Notify,
    release: Notify,
}

impl Publisher for Recorder {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        if !self.in_flight.lock().unwrap().insert(message.id()) {
            self.overlaps
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        *self
            .attempts
            .lock()
            .unwrap()
            .entry(message.id())
            .or_default() += 1;
        if message.payload() == b"hold" {
            self.held.notify_one();
            self.release.notified().await;
        }
        tokio::task::yield_now().await;
        self.in_flight.lock().unwrap().remove(&message.id());
        if message.payload() == b"poison" {
            return Err(format!("the broker refused {}", message.id()));
        }
        self.sent.lock().unwrap().push((
            message.id(),
            message.destination().to_owned(),
            message.payload().to_vec(),
        ));
        Ok(())
    }
}

impl Recorder {
    fn sent_ids(&self) -> Vec<OutgoingId> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _, _)| *id)
            .collect()
    }
}

/// A publisher that records the ids it sent, and never waits.
struct Quick(Mutex<Vec<OutgoingId>>);

impl Publisher for Quick {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push(message.id());
        Ok(())
    }
}

/// Instantiates `$suite!` once per backend, with what differs between the backends: the
/// types, the pool, the SQL the helpers and the tests run, and the note of a case that runs
/// on some backends only.
macro_rules! outbox_backends {
    ($suite:ident) => {
        $suite!(
            postgres,
            db = sqlx::Postgres,
            conn = sqlx::PgConnection,
            pool = Box::new(dedup_suite::postgres().await),
            row = "SELECT destination, payload, headers, ordering_key, consumer, cause_id, slot, \
                   state::int8, attempts::int8 FROM outbox_messages WHERE id = $1::uuid",
            count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = $1",
            effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects (message_id text NOT NULL)",
            effect = "INSERT INTO outbox_test_effects (message_id) VALUES ($1)",
            effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = $1",
            begin_writing = "BEGIN",
            state = "SELECT state::int8, attempts::int8, last_error FROM {} WHERE id = $1::uuid",
            expire = "UPDATE {} SET lease_until = clock_timestamp() - interval '1 second' WHERE state = 1",
            late_commits = "PostgreSQL allocates `seq` at the insert, and commits in any order.",
        );
        $suite!(
            mysql,
            db = sqlx::MySql,
            conn = sqlx::MySqlConnection,
            pool = Box::new(dedup_suite::mysql().await),
            row = "SELECT CAST(destination AS CHAR), payload, headers, CAST(ordering_key AS CHAR), \
                   CAST(consumer AS CHAR), CAST(cause_id AS CHAR), CAST(slot AS CHAR), \
                   CAST(state AS SIGNED), CAST(attempts AS SIGNED) FROM outbox_messages \
                   WHERE id = UNHEX(REPLACE(?, '-', ''))",
            count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = ?",
            effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects \
                       (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
            effect = "INSERT INTO outbox_test_effects (message_id) VALUES (?)",
            effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = ?",
            begin_writing = "BEGIN",
            state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error FROM {} \
                     WHERE id = UNHEX(REPLACE(?, '-', ''))",
            expire = "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE state = 1",
            late_commits =
                "MariaDB allocates `seq` (AUTO_INCREMENT) at the insert, and commits in any order.",
        );
        $suite!(
            sqlite,
            db = sqlx::Sqlite,
            conn = sqlx::SqliteConnection,
            pool = dedup_suite::sqlite().await,
            row = "SELECT destination, payload, headers, ordering_key, consumer, cause_id, slot, \
                   state, attempts FROM outbox_messages WHERE id = unhex(replace(?1, '-', ''))",
            count = "SELECT COUNT(*) FROM outbox_messages WHERE consumer = ?1",
            effects = "CREATE TABLE IF NOT EXISTS outbox_test_effects (message_id TEXT NOT NULL)",
            effect = "INSERT INTO outbox_test_effects (message_id) VALUES (?1)",
            effect_count = "SELECT COUNT(*) FROM outbox_test_effects WHERE message_id = ?1",
            begin_writing = "BEGIN IMMEDIATE",
            state = "SELECT state, attempts, last_error FROM {} WHERE id = unhex(replace(?1, '-', ''))",
            expire = "UPDATE {} SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
                      WHERE state = 1",
        );
    };
}

// After the macro, which they use.
mod batches;
mod common;
mod enqueue;
mod ids;
mod operator;
mod relay;
