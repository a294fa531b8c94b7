//! Effects outside the database (an email, an HTTP call), on every backend, in two suites:
//! `send_first`, `effect = "send-first"` without a lease (issue 11, its first step), and
//! `leases`, mark-first and send-first with a lease. The external service is an in-process
//! counter, [`Provider`]; `tests/partner_api.rs` runs send-first against a real HTTP
//! server. What differs between the backends — how a `COMMIT` is made to fail
//! transiently, how the database is made to end a transaction by itself, how a lease is
//! made to end — is in `postgres_faults`, `mysql_faults` and `sqlite_faults`, which offer
//! the same items. Every case asserts the dedup rows and the number of calls, not only the
//! outcome.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// The dedup table of the handlers whose `COMMIT` is made to fail (MariaDB's fault is a
/// trigger on it; the other backends use it so that the handlers are the same).
const COMMIT_TABLE: &str = "dedup_effects_commit";

/// Stands in for the external service: counts the calls it receives.
#[derive(Debug, Default)]
struct Provider {
    calls: AtomicU32,
}

impl Provider {
    /// One call, as an HTTP request or an email would be; its 1-based number.
    async fn call(&self) -> u32 {
        tokio::task::yield_now().await;
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

mod leases;
mod mysql_faults;
mod postgres_faults;
mod send_first;
mod sqlite_faults;
