//! Durations as the database takes them, and the one margin every cutoff keeps. A
//! ground-floor file: it imports nothing of this crate.

use std::time::Duration;

/// A transaction that ran longer than this between its claim and its commit has its
/// dedup row's `processed_at` moved to the commit (one more statement, on slow
/// transactions only), so that the redelivery window counts from the commit; a faster
/// one keeps the claim's time, at most this much early. [`Prune`](crate::Prune) keeps
/// this margin in its cutoff. The same on MySQL and MariaDB, whose checked commit moves it.
pub const STAMP_AFTER: Duration = Duration::from_secs(1);

/// `duration` in whole microseconds, as the statements take ages and leases (saturated at
/// `i64::MAX`).
pub(crate) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}
