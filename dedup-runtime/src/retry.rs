//! Retries of transient failures: bounded, exponential backoff with full jitter.

use std::hash::{BuildHasher, Hasher, RandomState};
use std::time::Duration;

/// How many times a handler's transaction runs at most when every attempt fails with a
/// transient error (deadlock, serialization failure, lock timeout, `SQLITE_BUSY`).
pub const MAX_ATTEMPTS: u32 = 5;

/// The backoff before the second attempt is drawn from `0..=BASE_DELAY`; the bound doubles
/// with each attempt up to [`MAX_DELAY`].
pub const BASE_DELAY: Duration = Duration::from_millis(10);

/// The largest bound of a backoff.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// The pause after failed attempt `attempt` (1-based): uniformly random in
/// `0..=min(MAX_DELAY, BASE_DELAY * 2^(attempt - 1))` ("full jitter"), so that the
/// transactions that collided do not collide again in lockstep.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(16);
    let bound = BASE_DELAY.saturating_mul(1 << exponent).min(MAX_DELAY);
    let bound_micros = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(random() % (bound_micros + 1))
}

/// A random number from the standard library's randomly keyed hasher: jitter needs no
/// cryptographic quality, only independence between processes and tasks.
fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.subsec_nanos().into()),
    );
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_jittered() {
        for attempt in 1..=MAX_ATTEMPTS + 20 {
            let exponent = (attempt - 1).min(16);
            let bound = BASE_DELAY.saturating_mul(1 << exponent).min(MAX_DELAY);
            let delays: Vec<Duration> = (0..200).map(|_| backoff(attempt)).collect();
            assert!(
                delays.iter().all(|delay| *delay <= bound),
                "attempt {attempt}"
            );
            let distinct: std::collections::HashSet<_> = delays.iter().collect();
            assert!(
                distinct.len() > 100,
                "attempt {attempt}: too few distinct delays"
            );
        }
    }
}
