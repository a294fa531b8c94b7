//! The inbox (issue 12), on every backend, one submodule per concern:
//!
//! - `receiving`: what `receive` and `receive_batch` store, and what they refuse;
//! - `workers`: each message processed exactly once, through poison messages and stopped,
//!   paused and killed workers;
//! - `running`: a worker's `run` and the claims it holds: graceful shutdown and its
//!   deadline, the heartbeat, PostgreSQL's hints;
//! - `ordering`: the messages of an ordering key, one at a time and in order;
//! - `operator`: retention, the claim queries' plans, the operator's command.
//!
//! Each suite is instantiated once per backend by `inbox_backends!`, which holds what
//! differs between the backends; `common` has the handler and the helpers the suites share,
//! per backend. Every case reads the rows back (effects and marks).

use std::time::Duration;

use tokio::sync::Notify;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// Holds a handler: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Hold {
    entered: Notify,
    go: Notify,
}

impl Hold {
    async fn here(&self) {
        self.entered.notify_one();
        self.go.notified().await;
    }
}

/// This module's example program, built once: the worker the process-killing test starts.
async fn examples(name: &'static str) -> std::path::PathBuf {
    tokio::task::spawn_blocking(move || dedup_suite::example_binary("", &["inbox_worker"], name))
        .await
        .unwrap()
}

/// Instantiates `$suite!` once per backend, with what differs between the backends: the
/// types, the pool, the SQL the helpers and the tests run, a child process's database URL,
/// and the note of a case that runs on some backends only.
macro_rules! inbox_backends {
    ($suite:ident) => {
        $suite!(
            postgres,
            db = sqlx::Postgres,
            conn = sqlx::PgConnection,
            pool = Box::new(dedup_suite::postgres().await),
            row = "SELECT payload, headers, state::int8, attempts::int8 FROM inbox_messages \
                   WHERE consumer = $1 AND message_id = $2",
            count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = $1",
            effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects (message_id text NOT NULL)",
            effect = "INSERT INTO inbox_test_effects (message_id) VALUES ($1)",
            group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE $1 \
                     GROUP BY message_id",
            state = "SELECT state::int8, attempts::int8, last_error FROM inbox_messages \
                     WHERE consumer = $1 AND message_id = $2",
            expire = "UPDATE inbox_messages SET lease_until = clock_timestamp() - interval '1 second' \
                      WHERE consumer = $1 AND state = 1",
            age = "UPDATE inbox_messages SET processed_at = clock_timestamp() - interval '10 days' \
                   WHERE consumer = $1 AND message_id = $2",
            url = |db| dedup_suite::postgres_url(),
            takeover_mid_handler = "PostgreSQL: the handler's transaction holds no lock on the row.",
        );
        $suite!(
            mysql,
            db = sqlx::MySql,
            conn = sqlx::MySqlConnection,
            pool = Box::new(dedup_suite::mysql().await),
            row = "SELECT payload, headers, CAST(state AS SIGNED), CAST(attempts AS SIGNED) \
                   FROM inbox_messages WHERE consumer = ? AND message_id = ?",
            count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?",
            effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects \
                       (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
            effect = "INSERT INTO inbox_test_effects (message_id) VALUES (?)",
            group = "SELECT CAST(message_id AS CHAR), COUNT(*) FROM inbox_test_effects \
                     WHERE message_id LIKE ? GROUP BY message_id",
            state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error \
                     FROM inbox_messages WHERE consumer = ? AND message_id = ?",
            expire = "UPDATE inbox_messages SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
                      WHERE consumer = ? AND state = 1",
            age = "UPDATE inbox_messages SET processed_at = UTC_TIMESTAMP(6) - INTERVAL 10 DAY \
                   WHERE consumer = ? AND message_id = ?",
            url = |db| dedup_suite::mysql_url(),
            takeover_mid_handler = "MariaDB: the handler's transaction holds no lock on the row.",
        );
        $suite!(
            sqlite,
            db = sqlx::Sqlite,
            conn = sqlx::SqliteConnection,
            pool = dedup_suite::sqlite().await,
            row = "SELECT payload, headers, state, attempts FROM inbox_messages \
                   WHERE consumer = ?1 AND message_id = ?2",
            count = "SELECT COUNT(*) FROM inbox_messages WHERE consumer = ?1",
            effects = "CREATE TABLE IF NOT EXISTS inbox_test_effects (message_id TEXT NOT NULL)",
            effect = "INSERT INTO inbox_test_effects (message_id) VALUES (?1)",
            group = "SELECT message_id, COUNT(*) FROM inbox_test_effects WHERE message_id LIKE ?1 \
                     GROUP BY message_id",
            state = "SELECT state, attempts, last_error FROM inbox_messages \
                     WHERE consumer = ?1 AND message_id = ?2",
            expire = "UPDATE inbox_messages \
                      SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
                      WHERE consumer = ?1 AND state = 1",
            age = "UPDATE inbox_messages SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-10 days') \
                   WHERE consumer = ?1 AND message_id = ?2",
            url = |db| format!("sqlite:{}", db.path().display()),
        );
    };
}

// After the macro, which they use.
mod common;
pub(crate) mod operator;
mod ordering;
mod receiving;
mod running;
mod workers;
