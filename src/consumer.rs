//! What the broker examples share: their settings from the environment, the activity that
//! tells when a consumer has gone idle, and the lines they report on standard output.
//!
//! The examples (`examples/rabbitmq.rs`, `nats.rs`, `kafka.rs`, `redis_streams.rs`,
//! `mqtt.rs`, `rabbitmq_inbox.rs` and `outbox_relay.rs`) keep their broker code; what is
//! the same in all of them is here, once:
//!
//! - **settings**: [`var`] and [`number`] read a variable with a default, and the
//!   variables several examples take have a function each ([`database_url`],
//!   [`consumers`], [`prefetch`], [`batch`], [`exit_when_idle`], [`crash_window`],
//!   [`Forward::from_env`]), so that their names and defaults are written once;
//! - **activity**: [`Activity`] counts the deliveries in progress and the time of the
//!   last one, for `DEDUP_EXIT_WHEN_IDLE_MS`, and says stop once idle that long;
//! - **the report**: [`report`] writes the lines the crash harness (`tests/brokers/`)
//!   reads, one per step of a delivery, one `println!` each (a whole line per write).
//!
//! No broker client is needed here: the module builds without the feature `brokers`.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dedup_runtime::outbox::Outbox;
use tokio::sync::watch;

/// The error of an example's `main`: whatever went wrong, said once on exit.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------

/// The variable `name`, or `default` when it is unset (or not UTF-8).
pub fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The number in the variable `name`, or `default` when it is unset.
///
/// # Errors
/// When it is set to something that does not parse as an `N`.
pub fn number<N: FromStr>(name: &str, default: N) -> Result<N, Error> {
    Ok(setting(name)?.unwrap_or(default))
}

/// The number in the variable `name`, if it is set.
///
/// # Errors
/// When it is set to something that does not parse as an `N`.
pub fn setting<N: FromStr>(name: &str) -> Result<Option<N>, Error> {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .map(Some)
            .map_err(|_| format!("{name}: expected a number, got {text:?}").into()),
        Err(_) => Ok(None),
    }
}

/// `DATABASE_URL`: PostgreSQL, `postgres://postgres@127.0.0.1:5432/test` by default.
pub fn database_url() -> String {
    var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
}

/// `CONSUMERS`: the consumer tasks (channels, pulls, group members) of one process, 4 by
/// default.
///
/// # Errors
/// When it is not a number.
pub fn consumers() -> Result<u16, Error> {
    number("CONSUMERS", 4)
}

/// `PREFETCH`: messages the broker sends a consumer task ahead of its acknowledgements (or
/// that it reads at once), 16 by default.
///
/// # Errors
/// When it is not a number of the type the broker's client takes.
pub fn prefetch<N: FromStr + From<u8>>() -> Result<N, Error> {
    number("PREFETCH", N::from(16))
}

/// `BATCH`: over 1, up to this many deliveries per transaction; 1 (one at a time) by
/// default.
///
/// # Errors
/// When it is not a number.
pub fn batch() -> Result<usize, Error> {
    number("BATCH", 1)
}

/// `DEDUP_EXIT_WHEN_IDLE_MS`: exit cleanly after this long without a delivery; unset, run
/// forever.
///
/// # Errors
/// When it is set and not a number.
pub fn exit_when_idle() -> Result<Option<Duration>, Error> {
    Ok(setting("DEDUP_EXIT_WHEN_IDLE_MS")?.map(Duration::from_millis))
}

/// `DEDUP_CRASH_WINDOW_MS`, for testing: the pause between the COMMIT and the
/// acknowledgement ([`crash_pause`]), so that a kill lands there often. 0 by default.
///
/// # Errors
/// When it is not a number.
pub fn crash_window() -> Result<Duration, Error> {
    Ok(Duration::from_millis(number("DEDUP_CRASH_WINDOW_MS", 0)?))
}

/// Sleeps for the crash window, if there is one: testing only, it widens the window in
/// which a crash leaves a committed message unacknowledged.
pub async fn crash_pause(window: Duration) {
    if !window.is_zero() {
        tokio::time::sleep(window).await;
    }
}

/// Where service A of a two-hop chain sends its events: `FORWARD_TO` (a queue, subject or
/// topic), through the outbox in `DEDUP_OUTBOX_TABLE` (`outbox_messages` by default).
#[derive(Debug)]
pub struct Forward {
    /// The destination of the events.
    pub to: String,
    /// The outbox the events are enqueued in, in the handler's transaction.
    pub outbox: Outbox,
}

impl Forward {
    /// The forwarding `FORWARD_TO` asks for; `None` when it is unset. `batch`: the
    /// consumer's `BATCH`; a batch handler does not forward, so `FORWARD_TO` with a batch
    /// over 1 is refused rather than ignored.
    ///
    /// # Errors
    /// When `DEDUP_OUTBOX_TABLE` is not a valid table name, or `FORWARD_TO` comes with a
    /// batch over 1.
    pub fn from_env(batch: usize) -> Result<Option<Forward>, Error> {
        let Ok(to) = std::env::var("FORWARD_TO") else {
            return Ok(None);
        };
        if batch > 1 {
            return Err("BATCH over 1 does not forward: unset FORWARD_TO, or BATCH".into());
        }
        let table = var("DEDUP_OUTBOX_TABLE", dedup_runtime::outbox::DEFAULT_TABLE);
        Ok(Some(Forward {
            to,
            outbox: Outbox::new().in_table(&table)?,
        }))
    }
}

// ---------------------------------------------------------------------------------------
// Activity
// ---------------------------------------------------------------------------------------

/// Deliveries in progress and the time of the last one, for `DEDUP_EXIT_WHEN_IDLE_MS`:
/// the consumer is idle when none is in progress, for as long as the last one was. It
/// also holds the consumer's stop signal ([`stopped`](Self::stopped)), which
/// [`stop_when_idle`](Self::stop_when_idle) sends.
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    last_ms: AtomicU64,
    stop: watch::Sender<bool>,
}

impl Default for Activity {
    fn default() -> Self {
        Self::new()
    }
}

impl Activity {
    /// No delivery yet: idle since now, not stopped.
    pub fn new() -> Activity {
        Activity {
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            stop: watch::Sender::new(false),
        }
    }

    /// Something happened now (a delivery came, one was settled).
    pub fn touch(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::SeqCst);
    }

    /// A delivery (or a batch of them) is in progress from now until [`end`](Self::end).
    pub fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
    }

    /// The delivery that [`begin`](Self::begin) announced is done.
    pub fn end(&self) {
        self.touch();
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// How long since the last activity; `None` while a delivery is in progress.
    pub fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
        Some(self.start.elapsed().saturating_sub(last))
    }

    /// Returns once idle for at least `limit`, looking every 50 ms.
    pub async fn until_idle(&self, limit: Duration) {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if self.idle_for().is_some_and(|idle| idle >= limit) {
                return;
            }
        }
    }

    /// The stop signal: turns `true` once the consumer should stop taking deliveries.
    /// (Never closed while the `Activity` lives, so waiting on it never ends early.)
    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Says stop to every [`stopped`](Self::stopped) receiver.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    /// With a limit (`DEDUP_EXIT_WHEN_IDLE_MS`), a task of its own says [`stop`](Self::stop)
    /// once idle that long; without one, nothing.
    pub fn stop_when_idle(self: &Arc<Self>, limit: Option<Duration>) {
        if let Some(limit) = limit {
            let activity = self.clone();
            tokio::spawn(async move {
                activity.until_idle(limit).await;
                activity.stop();
            });
        }
    }
}

// ---------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------

/// The lines a consumer writes on standard output, one per step, which the crash harness
/// reads (`tests/brokers/`): `ready`, `delivered <count> <id>` (Kafka's followed by
/// `<topic>/<partition>/<offset>`), `committed <id>`, `duplicate <id>`, `acked <id>`,
/// `retry <id>`, `dead <id> <body>`; and the relay's `sent <id>`, `relayed <claimed>
/// sent <sent> lost <lost> failed <failed> dead <dead>` and `idle`. An empty id (a
/// message without one: poison) is written `-`.
///
/// Their bytes are the protocol: the harness parses them, so a change here is a change
/// there.
pub mod report {
    use std::fmt::Display;

    use dedup_runtime::Ack;
    use dedup_runtime::outbox::Relayed;

    /// The id as the lines show it: `-` for none.
    pub fn shown(id: &str) -> &str {
        if id.is_empty() { "-" } else { id }
    }

    /// `ready`: connected and subscribed (a Kafka member: its first partitions assigned).
    pub fn ready() {
        println!("ready");
    }

    /// `delivered <count> <id>`: the broker's delivery count (or the attempt in this
    /// process, where the broker keeps none).
    pub fn delivered(count: impl Display, id: &str) {
        println!("delivered {count} {}", shown(id));
    }

    /// `delivered <count> <id> <place>`: [`delivered`], with where the record is
    /// (Kafka's `topic/partition/offset`).
    pub fn delivered_at(count: impl Display, id: &str, place: &str) {
        println!("delivered {count} {} {place}", shown(id));
    }

    /// `committed <id>`: its transaction committed, the acknowledgement still to come.
    pub fn committed(id: &str) {
        println!("committed {}", shown(id));
    }

    /// `duplicate <id>`: processed before; only acknowledged.
    pub fn duplicate(id: &str) {
        println!("duplicate {}", shown(id));
    }

    /// `acked <id>`: acknowledged (or its offset committed).
    pub fn acked(id: &str) {
        println!("acked {}", shown(id));
    }

    /// `retry <id>`: a transient failure; delivered again (or retried in process).
    pub fn retry(id: &str) {
        println!("retry {}", shown(id));
    }

    /// `dead <id> <body>`: dead-lettered.
    pub fn dead(id: &str, body: &str) {
        println!("dead {} {body}", shown(id));
    }

    /// The line of a message settled as `ack` says: [`acked`], [`retry`] or [`dead`].
    pub fn settled(ack: Ack, id: &str, body: &str) {
        match ack {
            Ack::Ack => acked(id),
            Ack::Retry { .. } => retry(id),
            Ack::DeadLetter => dead(id, body),
        }
    }

    /// The relay's `sent <id>`: the broker has the message.
    pub fn sent(id: impl Display) {
        println!("sent {id}");
    }

    /// The relay's `relayed <claimed> sent <sent> lost <lost> failed <failed> dead
    /// <dead>`: what one batch did.
    pub fn relayed(batch: &Relayed) {
        println!(
            "relayed {} sent {} lost {} failed {} dead {}",
            batch.claimed, batch.sent, batch.lost, batch.failed, batch.dead
        );
    }

    /// The relay's `idle`: nothing to send for `DEDUP_EXIT_WHEN_IDLE_MS`; it exits.
    pub fn idle() {
        println!("idle");
    }
}
