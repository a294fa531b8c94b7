//! What the inbox's workers and the outbox's relay share: a claim's heartbeat, the
//! shutdown signal and its deadline, the jittered backoff, retries of statements that
//! changed nothing when they failed.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use sqlx::Pool;

use crate::backend::Backend;
use crate::random::Owner;
use crate::table::Table;

/// Runs `work` with a heartbeat: every `interval`, `renew` (a statement that gives the
/// claim's unfinished rows a new lease), and `granted` marked when it succeeds. A renewal
/// in flight when `work` ends is finished, not dropped; a failed one is logged and tried
/// again at the next beat.
pub(crate) async fn with_heartbeat<DB: Backend, T, R: Future<Output = Result<u64, sqlx::Error>>>(
    interval: Duration,
    granted: &Granted,
    renew: impl Fn() -> R,
    work: impl Future<Output = T>,
) -> T {
    let mut work = std::pin::pin!(work);
    let mut beat = Box::pin(tokio::time::sleep(interval));
    let mut renewal = none_from(&renew);
    let done = std::future::poll_fn(|context| {
        if let Poll::Ready(done) = work.as_mut().poll(context) {
            return Poll::Ready(done);
        }
        loop {
            if let Some(pending) = renewal.as_mut() {
                match pending.as_mut().poll(context) {
                    Poll::Ready(result) => {
                        if result.is_ok() {
                            granted.mark();
                        }
                        log_renewal::<DB>(result);
                        renewal = None;
                        beat.as_mut().reset(tokio::time::Instant::now() + interval);
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            match beat.as_mut().poll(context) {
                Poll::Ready(()) => renewal = Some(Box::pin(renew())),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await;
    if let Some(pending) = renewal {
        log_renewal::<DB>(pending.await);
    }
    done
}

/// `heartbeat` when it is set and not shorter than `lease`: a claim would run out between
/// two renewals, so workers and relays refuse it before they claim anything.
pub(crate) fn heartbeat_not_under(
    heartbeat: Option<Duration>,
    lease: Duration,
) -> Option<Duration> {
    heartbeat.filter(|heartbeat| *heartbeat >= lease)
}

/// How often a claim's heartbeat renews its lease: `heartbeat` if set, else a third of
/// `lease`; at least 1 ms.
pub(crate) fn heartbeat_interval(heartbeat: Option<Duration>, lease: Duration) -> Duration {
    heartbeat.unwrap_or(lease / 3).max(Duration::from_millis(1))
}

/// The shutdown signal of a worker's `run`, and the deadline it gives the message in hand.
pub(crate) struct Shutdown<'a> {
    pub(crate) future: Pin<&'a mut (dyn Future<Output = ()> + Send)>,
    /// It has completed: never poll it again.
    pub(crate) done: bool,
    pub(crate) deadline: Duration,
    /// The deadline's timer, from when the signal was first seen complete.
    pub(crate) cutoff: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Rows of the claim released while the message in hand finished, not yet counted.
    pub(crate) released: usize,
}

impl<'a> Shutdown<'a> {
    /// The signal `future`, giving the message in hand `deadline` once it has completed.
    pub(crate) fn new(
        future: Pin<&'a mut (dyn Future<Output = ()> + Send)>,
        deadline: Duration,
    ) -> Self {
        Shutdown {
            future,
            done: false,
            deadline,
            cutoff: None,
            released: 0,
        }
    }

    /// Whether the signal has completed, without waiting (between messages).
    pub(crate) fn check(&mut self) -> bool {
        if !self.done {
            let mut context = Context::from_waker(std::task::Waker::noop());
            self.done = self.future.as_mut().poll(&mut context).is_ready();
        }
        self.done
    }

    /// Ready once the signal has completed and the deadline after it has passed.
    pub(crate) fn poll_deadline(&mut self, context: &mut Context<'_>) -> Poll<()> {
        if !self.done {
            if self.future.as_mut().poll(context).is_pending() {
                return Poll::Pending;
            }
            self.done = true;
        }
        let deadline = self.deadline;
        self.cutoff
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(deadline)))
            .as_mut()
            .poll(context)
    }
}

/// When a claim's lease was last granted (the claim, a heartbeat, a renewal in a
/// processing transaction), for the renewals SQLite makes in its transactions.
pub(crate) struct Granted {
    claimed: std::time::Instant,
    /// Microseconds from `claimed` to the last grant.
    last: std::sync::atomic::AtomicU64,
}

impl Granted {
    pub(crate) fn new() -> Self {
        Granted {
            claimed: std::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub(crate) fn mark(&self) {
        let now = u64::try_from(self.claimed.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.last.store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// Since the last grant.
    pub(crate) fn since(&self) -> Duration {
        let last = Duration::from_micros(self.last.load(std::sync::atomic::Ordering::Relaxed));
        self.claimed.elapsed().saturating_sub(last)
    }
}

/// `None`, typed as a boxed future of the closure's (a type without a name).
fn none_from<F: Future>(_: &impl Fn() -> F) -> Option<Pin<Box<F>>> {
    None
}

fn log_renewal<DB: Backend>(result: Result<u64, sqlx::Error>) {
    match result {
        Ok(renewed) => tracing::trace!(renewed, "inbox worker: lease renewed"),
        // SQLite's writer excludes the heartbeat while a handler's transaction runs (and
        // renews the claim's rows at each commit instead).
        Err(error) if crate::classify::is_transient::<DB>(&error) => {
            tracing::debug!(%error, "inbox worker: renewing the lease waited too long; trying again at the next heartbeat")
        }
        Err(error) => {
            tracing::warn!(%error, "inbox worker: renewing the lease failed; trying again at the next heartbeat")
        }
    }
}

/// A claimed row whose claim's lease ended (its worker or relay stopped: it crashed, was
/// killed, lost the database, or was paused past the lease), by its key `K`.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Expired<K> {
    pub(crate) owner: Owner,
    pub(crate) id: K,
    pub(crate) attempts: u32,
}

/// Takes back the stopped claims of `expired` (grouped by owner, each owner's rows in the
/// claim's order) through `take` (owner, first row, whether it is dead); how many rows it
/// buried.
///
/// A worker (a relay) works through its claim in the claim's order, one row at a time, and
/// every row of a claim had its attempt counted when it was claimed. So of a stopped
/// claim's rows, the first is the one in hand: its attempt was spent (a handler that kills
/// its process spends one per death), and if that was its last it is buried; otherwise it
/// is due again. The others never started: due again, their attempt given back.
pub(crate) async fn take_back<'e, K, F>(
    expired: &'e [Expired<K>],
    max_attempts: u32,
    mut take: impl FnMut(&'e Owner, &'e K, bool) -> F,
) -> Result<u64, sqlx::Error>
where
    F: Future<Output = Result<bool, sqlx::Error>>,
{
    let mut buried = 0;
    for claim in expired.chunk_by(|a, b| a.owner == b.owner) {
        let first = &claim[0];
        let dead = first.attempts >= max_attempts;
        if take(&first.owner, &first.id, dead).await? && dead {
            buried += 1;
        }
    }
    Ok(buried)
}

/// [`retry_transient`](crate::retry::retry_transient), and also after a lost connection (the reply of a statement that
/// may have run, a server going away), for the queue's own statements that a second run
/// makes no worse: claims (tried again under the same owner token, which finds the rows a
/// lost reply took), take-backs, marks and failures fenced by the owner token, releases.
/// Not after the pool's own time-out or closing: the pool already waited.
pub(crate) async fn retry_reachable<DB: Backend, T, F: Future<Output = Result<T, sqlx::Error>>>(
    mut operation: impl FnMut() -> F,
) -> Result<T, sqlx::Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match operation().await {
            Err(error) if attempt < crate::retry::MAX_ATTEMPTS && again::<DB>(&error) => {
                tracing::debug!(%error, attempt, "dedup queue: a statement failed on a transient fault; trying again");
                tokio::time::sleep(crate::retry::backoff(attempt)).await;
            }
            result => return result,
        }
    }
}

/// Whether [`retry_reachable`] runs a statement that failed with `error` again: a
/// transient failure, or a connection lost.
pub(crate) fn again<DB: Backend>(error: &sqlx::Error) -> bool {
    crate::classify::is_transient::<DB>(error)
        || (!matches!(error, sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)
            && crate::classify::is_unavailable::<DB>(error))
}

/// A claim's parts, as ranges of it in the claim's order: runs of rows on their first
/// attempt together, each row on a later attempt (`attempts`, in the claim's order) alone.
/// A worker or relay that stops while several rows are in hand leaves no trace of which
/// one stopped it, and the take-back charges the first of them; alone the next time, that
/// row is charged only for itself (the inbox's batch mode, the relay's pipelined sends).
pub(crate) fn parts(
    attempts: impl Iterator<Item = u32>,
) -> impl DoubleEndedIterator<Item = std::ops::Range<usize>> {
    // Each part, and whether it is a run of first attempts (which the next one joins).
    let mut parts: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
    for (index, attempt) in attempts.enumerate() {
        let first = attempt <= 1;
        match parts.last_mut() {
            Some((part, true)) if first => part.end = index + 1,
            _ => parts.push((index..index + 1, first)),
        }
    }
    parts.into_iter().map(|(part, _)| part)
}

/// The most of an error's text (in bytes) that a row's `last_error` keeps (inbox and
/// outbox): far under MySQL's `TEXT` (65,535 bytes) with the attempt prefix and the marker.
pub(crate) const MAX_ERROR_TEXT_LEN: usize = 4096;

/// An error's text as a row's `last_error` stores it: NUL bytes (which PostgreSQL's `text`
/// refuses) replaced by U+FFFD, and a text longer than [`MAX_ERROR_TEXT_LEN`] cut at a
/// character boundary, with a marker that says so and how long it was.
pub(crate) fn error_text(text: String) -> String {
    let mut text = if text.contains('\0') {
        text.replace('\0', "\u{FFFD}")
    } else {
        text
    };
    if text.len() > MAX_ERROR_TEXT_LEN {
        let full = text.len();
        let mut cut = MAX_ERROR_TEXT_LEN;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str(&format!(" [cut: {full} bytes in all]"));
    }
    text
}

/// The shortest time between two `NOTIFY` hints from one inbox or outbox (and its
/// clones): public as `inbox::HINT_GAP` and `outbox::HINT_GAP`.
pub(crate) const HINT_GAP: Duration = Duration::from_millis(20);

/// How a `run` loop waits when there was nothing to do: until a hint (PostgreSQL: a
/// `LISTEN` on the table's channel), the poll interval, or the shutdown. It polls at its
/// interval whatever happens to the listening connection; without hints the wait doubles
/// while nothing comes, up to `max_poll`.
pub(crate) struct Idle<'p, DB: Backend> {
    pool: &'p Pool<DB>,
    table: Table,
    wakeup: Option<DB::Wakeup>,
    streak: u32,
    poll: Duration,
    max_poll: Duration,
}

/// What ended an idle wait.
enum Woken {
    Shutdown,
    /// A hint (`true`), or the listening connection failed (`false`).
    Hint(bool),
    Poll,
}

impl<'p, DB: Backend> Idle<'p, DB> {
    /// Listens on `table`'s channel where the backend has hints.
    pub(crate) async fn new(
        pool: &'p Pool<DB>,
        table: &Table,
        poll: Duration,
        max_poll: Duration,
    ) -> Idle<'p, DB> {
        Idle {
            pool,
            table: table.clone(),
            wakeup: DB::wake_listen(pool, table).await,
            streak: 0,
            poll,
            max_poll,
        }
    }

    /// There was work: the next idle wait starts from the poll interval.
    pub(crate) fn busy(&mut self) {
        self.streak = 0;
    }

    /// Waits; `false` once the shutdown signal has completed.
    pub(crate) async fn wait(&mut self, shutdown: &mut Shutdown<'_>) -> bool {
        let wait = if self.wakeup.is_some() {
            self.poll
        } else {
            let factor = 1u32 << self.streak.min(8);
            self.poll
                .saturating_mul(factor)
                .min(self.max_poll.max(self.poll))
        };
        self.streak = self.streak.saturating_add(1);
        if self.wakeup.is_none() && self.streak.is_multiple_of(16) {
            // Listen again, now and then, after a failure.
            self.wakeup = DB::wake_listen(self.pool, &self.table).await;
        }
        let mut sleep = std::pin::pin!(tokio::time::sleep(wait));
        let woken = {
            let mut hinted = match self.wakeup.as_mut() {
                Some(wakeup) => Box::pin(async move { Some(DB::wake_wait(wakeup).await) })
                    as Pin<Box<dyn Future<Output = Option<bool>> + Send + '_>>,
                None => Box::pin(std::future::pending()),
            };
            std::future::poll_fn(|context| {
                if shutdown.future.as_mut().poll(context).is_ready() {
                    return Poll::Ready(Woken::Shutdown);
                }
                if let Poll::Ready(alive) = hinted.as_mut().poll(context) {
                    return Poll::Ready(Woken::Hint(alive.unwrap_or(false)));
                }
                sleep.as_mut().poll(context).map(|()| Woken::Poll)
            })
            .await
        };
        match woken {
            Woken::Shutdown => {
                shutdown.done = true;
                return false;
            }
            Woken::Hint(true) => self.streak = 0,
            Woken::Hint(false) => self.wakeup = None,
            Woken::Poll => {}
        }
        true
    }
}

/// The coalescing of hints to idle workers or relays: at most one per `gap`, shared by
/// clones.
#[derive(Debug)]
pub(crate) struct Hints {
    start: std::time::Instant,
    /// Milliseconds since `start` of the last hint sent, plus one (0: none yet).
    last_ms: std::sync::atomic::AtomicU64,
}

impl Hints {
    pub(crate) fn new() -> Hints {
        Hints {
            start: std::time::Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether a hint is due (at least `gap` since the last one), taking it if so: of
    /// several callers at once, one gets `true`.
    pub(crate) fn take(&self, gap: Duration) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX) + 1;
        let last = self.last_ms.load(Relaxed);
        let gap = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX);
        if last != 0 && now.saturating_sub(last) < gap {
            return false;
        }
        self.last_ms
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_ERROR_TEXT_LEN, error_text, parts};

    #[test]
    fn parts_group_first_attempts_and_keep_later_ones_alone() {
        let parts = |attempts: &[u32]| -> Vec<std::ops::Range<usize>> {
            parts(attempts.iter().copied()).collect()
        };
        assert!(parts(&[]).is_empty());
        assert_eq!(parts(&[1, 1, 1]), vec![0..3]);
        assert_eq!(
            parts(&[2, 1, 1, 3, 3, 1]),
            vec![0..1, 1..3, 3..4, 4..5, 5..6]
        );
        assert_eq!(parts(&[1, 2, 1]), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn error_text_replaces_nul_and_cuts_at_a_char_boundary() {
        assert_eq!(error_text("a\0b".into()), "a\u{FFFD}b");
        assert_eq!(error_text("short".into()), "short");
        let long = "é".repeat(MAX_ERROR_TEXT_LEN); // 2 bytes each
        let stored = error_text(long.clone());
        assert!(stored.len() < MAX_ERROR_TEXT_LEN + 64, "{}", stored.len());
        assert!(stored.ends_with(&format!(" [cut: {} bytes in all]", long.len())));
        let exact = "x".repeat(MAX_ERROR_TEXT_LEN);
        assert_eq!(error_text(exact.clone()), exact);
    }
}
