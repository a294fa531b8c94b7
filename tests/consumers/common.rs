//! What the consumers' tests share.

use std::process::Child;
use std::time::{Duration, Instant};

use dedup_runtime::consume::Message;
use dedup_suite::TestDatabase;

/// How long a test waits for what it waits for.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// A consumer process of a crash harness, killed when dropped: a failing harness leaves
/// none behind (a stray one would go on consuming, and relaying, beside the next run).
pub(crate) struct Life(pub(crate) Child);

impl std::ops::Deref for Life {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Life {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Life {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The crash harnesses' batch-form service (`src/bin/batch_consumer.rs`), built by cargo
/// with the tests.
pub(crate) fn batch_consumer() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_batch_consumer"))
}

/// Completes once `done` says so (polled every 20 ms), or panics after [`PATIENCE`].
pub(crate) async fn until<F: Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < PATIENCE, "not done within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Counts rows of `sql` (a `COUNT(*)` with the run's name bound once).
pub(crate) async fn count<DB: TestDatabase>(pool: &sqlx::Pool<DB>, sql: &str, run: &str) -> i64 {
    DB::count(pool, sql.to_owned(), vec![run.to_owned()]).await
}

/// The handlers' poison: a permanent failure.
pub(crate) fn fails_permanently(message: &Message) -> bool {
    message.payload() == b"poison"
}

/// The handlers' flaky message: a transient failure on its first delivery.
pub(crate) fn fails_first_time(message: &Message) -> bool {
    message.payload() == b"flaky" && message.delivery_count() == 1
}
