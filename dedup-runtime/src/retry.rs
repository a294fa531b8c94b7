//! Retries of transient failures: bounded, exponential backoff with full jitter.

use std::future::Future;
use std::time::Duration;

use crate::classify::ClassifyBackend;

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
    jitter(BASE_DELAY, MAX_DELAY, attempt)
}

/// The crate's one backoff: after failed attempt `attempt` (1-based), uniformly random in
/// `0..=min(max, base * 2^(attempt - 1))` — full jitter. Handlers use it with
/// [`BASE_DELAY`] and [`MAX_DELAY`]; the inbox's workers and the outbox's relays with
/// their own base and maximum. Jitter needs no cryptographic quality, only independence
/// between processes and tasks.
pub(crate) fn jitter(base: Duration, max: Duration, attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(30);
    let bound = base.saturating_mul(1 << exponent).min(max);
    let bound_micros = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(crate::random::random_u64() % (bound_micros + 1))
}

/// Runs `operation` again after a jittered pause while it fails with a transient error
/// (a deadlock, a serialization failure, a lock timeout), up to
/// [`MAX_ATTEMPTS`](crate::MAX_ATTEMPTS) times: for statements that changed nothing when
/// they failed.
pub(crate) async fn retry_transient<
    DB: ClassifyBackend,
    T,
    F: Future<Output = Result<T, sqlx::Error>>,
>(
    mut operation: impl FnMut() -> F,
) -> Result<T, sqlx::Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match operation().await {
            Err(error) if attempt < MAX_ATTEMPTS && crate::classify::is_transient::<DB>(&error) => {
                tracing::debug!(attempt, %error, "a statement failed transiently; retrying");
                tokio::time::sleep(backoff(attempt)).await;
            }
            result => return result,
        }
    }
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
