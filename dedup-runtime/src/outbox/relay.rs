//! The relay: claims unsent rows under a lease and commits the claim, sends them all
//! through a [`Publisher`] with no transaction open (out together, their confirms awaited
//! together), then marks the ones the broker has sent in one statement, by their exact ids
//! and the claim's owner token, and schedules the next attempt of the others. The backend-neutral part; each
//! backend's statements are in `outbox/<db>.rs`.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use sqlx::Pool;

use crate::backend::Backend;
use crate::clock::micros;
use crate::queue::{
    Granted, Idle, Shutdown, heartbeat_interval, heartbeat_not_under, retry_reachable,
    with_heartbeat,
};
use crate::random::{Owner, new_token};

use tracing::Instrument as _;

use super::{Outbox, OutboxError, OutgoingId};

/// A message the relay claimed, as a [`Publisher`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    pub(crate) id: OutgoingId,
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) traceparent: Option<String>,
    pub(crate) attempt: u32,
    pub(crate) seq: i64,
}

impl OutboxMessage {
    /// Its id: send it as the broker's message id (AMQP `message-id`, JetStream
    /// `Nats-Msg-Id`), the key the consumer downstream dedups on.
    pub fn id(&self) -> OutgoingId {
        self.id
    }

    /// Where to send it, as the handler named it.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The payload, byte for byte as enqueued.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Its headers ([`Outgoing::header`](super::Outgoing::header)): name → value pairs,
    /// in the order they were added. Send them as the broker's own headers.
    pub fn headers(&self) -> super::Headers<'_> {
        super::Headers::new(self.headers.as_deref().unwrap_or_default())
    }

    /// Its ordering key, if any.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Its trace context, a W3C `traceparent`, if it was enqueued with one
    /// ([`Outgoing::traceparent`](super::Outgoing::traceparent)): send it as the broker's
    /// `traceparent` header.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// Which attempt this is, from 1: counted when the row was claimed (a stopped relay's
    /// rows not sent yet get theirs back).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// Sends outgoing messages to a broker. `Ok` means the broker has the message (a
/// publisher confirm, a JetStream ack): the relay marks it sent only then. An error (its
/// text is kept on the row as `last_error`) schedules another attempt.
///
/// ```
/// use dedup_runtime::outbox::{OutboxMessage, Publisher};
///
/// /// Publishes to a broker client of yours.
/// struct MyBroker;
///
/// impl Publisher for MyBroker {
///     type Error = std::io::Error;
///
///     async fn publish(&self, message: &OutboxMessage) -> Result<(), std::io::Error> {
///         // client.send(message.destination(), message.id().to_string(), message.payload())
///         let _ = message;
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync {
    /// The publisher's error; its `Display` is kept on the row.
    type Error: fmt::Display + Send;

    /// The broker, as OpenTelemetry's `messaging.system` names it (`rabbitmq`, `kafka`,
    /// …): the relay's `send` span carries it. `"unknown"` unless a publisher says.
    const SYSTEM: &'static str = "unknown";

    /// Whether `error` says the broker could not be reached — no connection could be
    /// made, or the one in use was lost or closed by the broker — rather than anything
    /// about the message: such a failure costs the row no attempt. The relay gives the
    /// claim's unsent rows back at once, their attempts not counted
    /// ([`Relayed::unreachable`]), and [`Relay::run`] waits before it claims again, so
    /// that a broker down for an hour buries nothing. `false` by default: every failure
    /// counts. The publishers of this crate say `true` for their clients' connection
    /// errors, and `false` for a refusal (a nack, a return, an error reply) and for a
    /// confirm not back in time (a stalled broker, or a message it will never confirm:
    /// counted, so that such a message ends dead rather than holding its claim for ever).
    fn unreachable(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Sends one message; `Ok` once the broker has it.
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;

    /// Sends a claim's messages: one answer per message, in their order (`Ok` once the
    /// broker has it; a message without an answer fails). The relay calls this once per
    /// claim — a message on its second attempt or later in a call of its own, in its
    /// place in the claim's order — and marks the messages of each call answered `Ok`
    /// sent in one statement.
    ///
    /// The default sends them one after the other through [`publish`](Self::publish).
    /// Override it to send them all before awaiting any confirm — as the RabbitMQ and
    /// JetStream publishers of this crate do — so that a claim costs one wait for the
    /// broker, not one per message. The claim holds at most one message per ordering key,
    /// so sending its messages together keeps the order per key.
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutboxMessage],
    ) -> impl Future<Output = Vec<Result<(), Self::Error>>> + Send + 'a {
        async move {
            let mut answers = Vec::with_capacity(messages.len());
            for message in messages {
                answers.push(self.publish(message).await);
            }
            answers
        }
    }
}

/// The span of one claim's sends (OpenTelemetry's messaging names): the broker, the
/// destination when the claim has one, the message count; `sent` and `failed` once the
/// broker answered. `traceparent`: the trace context the claim's messages were enqueued
/// under, when they share one (a claim of one message, or of one handler's), for a
/// subscriber of yours to link the send to the handler's trace (with
/// `tracing-opentelemetry`: as the span's parent or a link).
fn send_span<P: Publisher>(messages: &[OutboxMessage]) -> tracing::Span {
    let span = tracing::info_span!(
        "send",
        messaging.system = P::SYSTEM,
        messaging.operation.type = "send",
        messaging.destination.name = tracing::field::Empty,
        messaging.batch.message_count = messages.len(),
        messaging.message.id = tracing::field::Empty,
        traceparent = tracing::field::Empty,
        sent = tracing::field::Empty,
        failed = tracing::field::Empty,
    );
    if !span.is_disabled()
        && let Some(first) = messages.first()
    {
        if messages.iter().all(|m| m.destination == first.destination) {
            span.record("messaging.destination.name", first.destination.as_str());
        }
        if messages.len() == 1 {
            span.record("messaging.message.id", first.id.to_string());
        }
        if let Some(traceparent) = first.traceparent()
            && messages
                .iter()
                .all(|m| m.traceparent() == Some(traceparent))
        {
            span.record("traceparent", traceparent);
        }
    }
    span
}

/// The error kept on a row its publisher's [`Publisher::publish_batch`] gave no answer for.
const NO_ANSWER: &str = "the publisher gave no answer for this message (publish_batch returned \
                         fewer answers than messages)";

/// What one [`Relay::relay_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Relayed {
    /// Rows claimed.
    pub claimed: usize,
    /// Sent and marked sent.
    pub sent: usize,
    /// Sent, but the row was another relay's by the time of the mark (this relay's lease
    /// had ended): a duplicate send, which the consumer downstream dedups by the id.
    pub lost: usize,
    /// Failed; scheduled for another attempt.
    pub failed: usize,
    /// Failed on their last attempt, or found claimed by a relay that stopped during its
    /// last attempt: dead, kept for an operator.
    pub dead: usize,
    /// Claimed rows released unsent at shutdown, or after the broker could not be
    /// reached (the rest of the claim), their attempt not counted.
    pub released: usize,
    /// Not sent because the broker could not be reached ([`Publisher::unreachable`]):
    /// given back unsent with their attempt not counted, for a later claim.
    pub unreachable: usize,
}

/// Publishes an outbox's rows. Build it with [`Outbox::relay`]; run
/// [`relay_batch`](Self::relay_batch) in a loop of your own or [`run`](Self::run) until a
/// shutdown signal, in as many processes as you like: claims never give one row to two
/// relays while both hold a live lease.
///
/// At least once to the broker: a relay that stops after a send and before its mark
/// (a crash, a lease that ended during a broker stall) leaves the row to be sent again —
/// a duplicate send, never a loss, with the same id.
pub struct Relay<DB: Backend> {
    pool: Pool<DB>,
    outbox: Outbox,
    lease: Duration,
    heartbeat: Option<Duration>,
    max_attempts: u32,
    batch: u32,
    base_delay: Duration,
    max_delay: Duration,
    poll: Duration,
    max_poll: Duration,
    /// When this relay last recorded its sign of life ([`SEEN_EVERY`]).
    seen: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How often a relay records its sign of life for [`Outbox::health`] at most: once a
/// second, whatever its batch rate — the relays of an outbox share that one row.
const SEEN_EVERY: Duration = Duration::from_secs(1);

impl Outbox {
    /// A relay for this outbox on `pool` (a clone of it: the relay owns its handle, and can
    /// move into a task): a 30 s lease renewed every 10 s, 10 attempts, 500
    /// rows per claim, a backoff from 1 s doubling to 5 min with full jitter, a 1 s poll
    /// when idle (doubling up to 4 s while nothing comes).
    pub fn relay<DB: Backend>(&self, pool: &Pool<DB>) -> Relay<DB> {
        Relay {
            pool: pool.clone(),
            outbox: self.clone(),
            lease: Duration::from_secs(30),
            heartbeat: None,
            max_attempts: 10,
            batch: 500,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            poll: Duration::from_secs(1),
            max_poll: Duration::from_secs(4),
            seen: std::sync::Mutex::new(None),
        }
    }
}

impl<DB: Backend> Relay<DB> {
    /// How long a claim holds its rows past the last heartbeat before another relay may
    /// take them (at least 1 ms); a heartbeat renews it while the relay sends
    /// ([`heartbeat`](Self::heartbeat)). All on the database's clock.
    pub fn lease(self, lease: Duration) -> Self {
        Relay {
            lease: lease.max(Duration::from_millis(1)),
            ..self
        }
    }

    /// How often the heartbeat renews the lease of the claimed rows (a third of the lease
    /// by default; at least 1 ms). One not shorter than the lease would let every claim
    /// run out between two renewals: [`relay_batch`](Self::relay_batch) and
    /// [`run`](Self::run) refuse it with [`OutboxError::HeartbeatNotUnderLease`] before
    /// they claim anything.
    pub fn heartbeat(self, interval: Duration) -> Self {
        Relay {
            heartbeat: Some(interval.max(Duration::from_millis(1))),
            ..self
        }
    }

    /// Attempts per message before its row is dead (at least 1).
    pub fn max_attempts(self, attempts: u32) -> Self {
        Relay {
            max_attempts: attempts.max(1),
            ..self
        }
    }

    /// Rows claimed at once (1 to 1,000; 500 by default). A claim goes to the publisher
    /// together and is marked in one statement, so larger claims cost fewer round trips
    /// per row: on PostgreSQL the relay benchmark (`relay.csv`) moves the most rows per
    /// second at 500 to RabbitMQ, JetStream, Kafka and no broker alike (32, the old
    /// default, gives a quarter to two fifths of that). A claim holds its rows' payloads in memory at once:
    /// lower it for large payloads.
    pub fn batch(self, rows: u32) -> Self {
        Relay {
            batch: rows.clamp(1, 1_000),
            ..self
        }
    }

    /// The backoff after a failed send: `base` doubled per attempt, at most `max`, full
    /// jitter.
    pub fn backoff(self, base: Duration, max: Duration) -> Self {
        Relay {
            base_delay: base,
            max_delay: max.max(base),
            ..self
        }
    }

    /// How long [`run`](Self::run) waits when there was nothing to send (1 s by default).
    /// On PostgreSQL it listens for the handlers' hints meanwhile ([`Outbox::hint`]) and
    /// polls at this interval whatever happens to its listening connection; elsewhere the
    /// wait doubles while nothing comes, up to 4 × this.
    pub fn poll_interval(self, poll: Duration) -> Self {
        Relay {
            poll,
            max_poll: poll.saturating_mul(4),
            ..self
        }
    }

    fn heartbeat_interval(&self) -> Duration {
        heartbeat_interval(self.heartbeat, self.lease)
    }

    /// Refuses a heartbeat that is not shorter than the lease.
    fn check(&self) -> Result<(), OutboxError> {
        match heartbeat_not_under(self.heartbeat, self.lease) {
            Some(heartbeat) => Err(OutboxError::HeartbeatNotUnderLease {
                heartbeat,
                lease: self.lease,
            }),
            None => Ok(()),
        }
    }

    fn classify(&self, error: sqlx::Error) -> OutboxError {
        self.outbox.classify::<DB>(error)
    }

    /// Claims up to [`batch`](Self::batch) rows and sends them: first records that a
    /// relay ran ([`Outbox::health`]; at most once a second), takes back in bulk the
    /// claims of relays that stopped (their lease ended: the first row of each claim, in
    /// `seq` order, keeps its attempt, and is dead if that was its last; the others get
    /// theirs back), then claims unsent rows that are due, the head of each ordering key
    /// only, and **commits the claim before it sends**. A claim whose reply was lost is
    /// tried again under the same owner token and finds the rows it took.
    ///
    /// The claim goes to the publisher at once ([`Publisher::publish_batch`]: the
    /// publishers of this crate put every message out before they await a confirm), and
    /// the rows the broker has are marked sent in **one** statement, by their ids and this
    /// claim's owner token; a row whose send failed (a nack, a confirm not back in time)
    /// fails alone: its next attempt after its backoff, or dead after its last. A send
    /// that failed because the broker could not be reached ([`Publisher::unreachable`])
    /// costs no attempt: the claim's rows not sent go back at once
    /// ([`Relayed::unreachable`], [`Relayed::released`]). A batch that ends on a
    /// database failure releases its rows not marked, their attempt given back. Returns
    /// what it did; `claimed == 0` when nothing was due.
    pub async fn relay_batch<P: Publisher>(&self, publisher: &P) -> Result<Relayed, OutboxError> {
        self.relay_until(publisher, None).await
    }

    async fn relay_until<P: Publisher>(
        &self,
        publisher: &P,
        mut stop: Option<&mut Shutdown<'_>>,
    ) -> Result<Relayed, OutboxError> {
        self.check()?;
        let (pool, table) = (&self.pool, &self.outbox.table);
        let lease = micros(self.lease);
        let (batch, max_attempts) = (self.batch, self.max_attempts);
        let last_seen = *self.seen.lock().expect("not poisoned");
        let record = last_seen.is_none_or(|seen| seen.elapsed() >= SEEN_EVERY);
        if record {
            retry_reachable::<DB, _, _>(|| DB::outbox_seen(pool, table))
                .await
                .map_err(|error| self.classify(error))?;
        }
        let buried =
            retry_reachable::<DB, _, _>(|| super::reclaim::<DB>(pool, table, max_attempts))
                .await
                .map_err(|error| self.classify(error))?;
        // Tried again after a deadlock or a lost connection under the same owner token: a
        // claim whose reply was lost finds the rows it took, their attempt counted once.
        let owner = new_token();
        let tried = std::sync::atomic::AtomicBool::new(false);
        let messages = retry_reachable::<DB, _, _>(|| {
            let again = tried.swap(true, std::sync::atomic::Ordering::Relaxed);
            let owner = &owner;
            async move {
                if again {
                    let held = DB::outbox_held(pool, table, owner).await?;
                    if !held.is_empty() {
                        return Ok(held);
                    }
                }
                DB::outbox_claim(pool, table, owner, lease, batch).await
            }
        })
        .await
        .map_err(|error| self.classify(error))?;
        if record {
            *self.seen.lock().expect("not poisoned") = Some(std::time::Instant::now());
        }
        let mut relayed = Relayed {
            claimed: messages.len(),
            dead: buried as usize,
            ..Relayed::default()
        };
        if messages.is_empty() {
            return Ok(relayed);
        }
        let granted = Granted::new();
        let work = async {
            if stop.as_mut().is_some_and(|stop| stop.check()) {
                let released =
                    retry_reachable::<DB, _, _>(|| DB::outbox_release(pool, table, &owner))
                        .await
                        .map_err(|error| self.classify(error))?;
                relayed.released += released as usize;
                return Ok(());
            }
            // Every row out at once, the confirms awaited together (the claim holds at most
            // one row per ordering key, so the order per key holds), then one mark for all
            // the rows the broker has — except that a row on a later attempt goes alone,
            // in its place in the claim's order: a relay that stopped while its rows were
            // all in flight leaves no trace of which one stopped it, and the take-back
            // charges the first; alone, the next time, that row is charged only for
            // itself (and a row that stops its relay every time is dead after its
            // attempts, the others losing at most one each).
            let attempts = messages.iter().map(|message| message.attempt);
            for part in crate::queue::parts(attempts).map(|part| &messages[part]) {
                let span = send_span::<P>(part);
                let mut answers = publisher
                    .publish_batch(part)
                    .instrument(span.clone())
                    .await
                    .into_iter();
                let mut sent = Vec::with_capacity(part.len());
                let mut failed = Vec::new();
                let mut unreachable = None;
                let mut unreachable_rows = 0;
                for message in part {
                    match answers.next() {
                        Some(Ok(())) => sent.push(message.id),
                        Some(Err(error)) if P::unreachable(&error) => {
                            unreachable_rows += 1;
                            unreachable.get_or_insert_with(|| error.to_string());
                        }
                        Some(Err(error)) => {
                            failed.push((message, crate::queue::error_text(error.to_string())));
                        }
                        None => failed.push((message, NO_ANSWER.to_owned())),
                    }
                }
                if !span.is_disabled() {
                    span.record("sent", sent.len());
                    span.record("failed", failed.len());
                }
                if !sent.is_empty() {
                    // Tried again after a lost connection: a try whose reply was lost may
                    // have marked the rows, so the retry counts every row of `sent` marked
                    // under this claim's owner token, not only what it marked itself.
                    let tried = std::sync::atomic::AtomicBool::new(false);
                    let marked = retry_reachable::<DB, _, _>(|| {
                        let again = tried.swap(true, std::sync::atomic::Ordering::Relaxed);
                        let (sent, owner) = (&sent, &owner);
                        async move {
                            let marked = DB::outbox_sent(pool, table, sent, owner).await?;
                            if again {
                                DB::outbox_sent_count(pool, table, sent, owner).await
                            } else {
                                Ok(marked)
                            }
                        }
                    })
                    .await
                    .map_err(|error| self.classify(error))?
                        as usize;
                    relayed.sent += marked;
                    if marked < sent.len() {
                        relayed.lost += sent.len() - marked;
                        tracing::warn!(
                            lost = sent.len() - marked,
                            "outbox: sent, but rows were another relay's by then (this relay's \
                             lease had ended): duplicate sends, which the consumer dedups by the id"
                        );
                    }
                }
                for (message, text) in failed {
                    match self.fail(&owner, message, &text).await? {
                        Delivery::Lost => relayed.lost += 1,
                        Delivery::Failed => relayed.failed += 1,
                        Delivery::Dead => relayed.dead += 1,
                    }
                }
                if let Some(error) = unreachable {
                    // Nothing was wrong with the messages: the rows not sent, this part's
                    // and the later parts', go back with their attempt not counted, and
                    // `run` waits before it claims again.
                    let released =
                        retry_reachable::<DB, _, _>(|| DB::outbox_release(pool, table, &owner))
                            .await
                            .map_err(|error| self.classify(error))?
                            as usize;
                    relayed.unreachable += unreachable_rows;
                    relayed.released += released.saturating_sub(unreachable_rows);
                    tracing::warn!(
                        rows = released,
                        %error,
                        "outbox relay: the broker could not be reached; the claim is given \
                         back, its attempts not counted"
                    );
                    break;
                }
            }
            Ok::<(), OutboxError>(())
        };
        let renew = || DB::outbox_renew(pool, table, &owner, lease);
        // What was sent before an error ended the batch is counted all the same.
        let ended =
            with_heartbeat::<DB, _, _>(self.heartbeat_interval(), &granted, renew, work).await;
        if let Err(error) = &ended {
            // The batch ended on a database failure: the rows not marked, the one in hand
            // included (sent or not, its mark failed for the database, not the broker), go
            // back at once with their attempt given back, if the database answers; a send
            // repeated later is deduplicated downstream by its id.
            match DB::outbox_release(pool, table, &owner).await {
                Ok(released) => relayed.released += released as usize,
                Err(release) => tracing::debug!(
                    %error, %release,
                    "outbox relay: releasing the claim after a failure failed; its rows are taken back after the lease"
                ),
            }
        }
        for (outcome, count) in [
            ("sent", relayed.sent),
            ("lost", relayed.lost),
            ("failed", relayed.failed),
            ("dead", relayed.dead),
            ("released", relayed.released),
            ("unreachable", relayed.unreachable),
        ] {
            crate::metrics::outbox_count(table.name(), outcome, count as u64);
        }
        ended?;
        Ok(relayed)
    }

    /// After a failed send: the row's next attempt (or dead), its error kept, if the row
    /// is still this claim's.
    async fn fail(
        &self,
        owner: &Owner,
        message: &OutboxMessage,
        text: &str,
    ) -> Result<Delivery, OutboxError> {
        let (pool, table) = (&self.pool, &self.outbox.table);
        let dead = message.attempt >= self.max_attempts;
        let delay = micros(crate::retry::jitter(
            self.base_delay,
            self.max_delay,
            message.attempt,
        ));
        let failed = retry_reachable::<DB, _, _>(|| {
            DB::outbox_fail(pool, table, message.id, owner, text, delay, dead)
        })
        .await
        .map_err(|error| self.classify(error))?;
        if !failed {
            return Ok(Delivery::Lost);
        }
        if dead {
            tracing::warn!(
                id = %message.id,
                attempts = message.attempt,
                error = text,
                "outbox message dead after its last attempt"
            );
            Ok(Delivery::Dead)
        } else {
            tracing::debug!(
                id = %message.id,
                attempt = message.attempt,
                error = text,
                "outbox message failed to send; retried later"
            );
            Ok(Delivery::Failed)
        }
    }

    /// Relays batches until `shutdown` completes, waiting the poll interval whenever
    /// nothing was due. Graceful: once `shutdown` has completed, it claims nothing more; a
    /// claim whose sends had begun is finished (its confirms awaited, its rows marked), a
    /// claim whose sends had not begun is released at once for another relay, and `run`
    /// returns `Ok(())`. A database failure is logged and retried after the
    /// poll interval, so that a relay outlives an outage; so is a broker that cannot be
    /// reached ([`Publisher::unreachable`]): the claim goes back with its attempts not
    /// counted, and the next claim waits the poll interval, doubled for each claim in a
    /// row that found the broker away, up to 4 × it. The only `Err` is a
    /// configuration refused at the start, before anything is claimed (a
    /// [`heartbeat`](Self::heartbeat) not shorter than the [`lease`](Self::lease):
    /// [`OutboxError::HeartbeatNotUnderLease`]).
    ///
    /// On PostgreSQL it listens for hints on a connection of its own, outside the pool's
    /// count: a pool of one connection is enough.
    pub async fn run<P: Publisher>(
        &self,
        publisher: &P,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), OutboxError> {
        self.check()?;
        let signal = std::pin::pin!(shutdown);
        let mut shutdown = Shutdown::new(signal, Duration::MAX);
        // PostgreSQL: a LISTEN connection for the handlers' hints (`Outbox::hint`).
        let mut idle = Idle::new(&self.pool, &self.outbox.table, self.poll, self.max_poll).await;
        // Claims in a row the broker could not be reached for: the wait before the next.
        let mut away = 0u32;
        loop {
            if shutdown.check() {
                return Ok(());
            }
            let nothing = match self.relay_until(publisher, Some(&mut shutdown)).await {
                Ok(relayed) if relayed.unreachable > 0 => {
                    let wait = self
                        .poll
                        .saturating_mul(1 << away.min(8))
                        .min(self.max_poll.max(self.poll));
                    away = away.saturating_add(1);
                    if !pause(&mut shutdown, wait).await {
                        return Ok(());
                    }
                    continue;
                }
                Ok(relayed) => {
                    away = 0;
                    relayed.claimed == 0
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox relay: claiming or marking failed; trying again");
                    true
                }
            };
            if !nothing {
                idle.busy();
                continue;
            }
            if shutdown.done || !idle.wait(&mut shutdown).await {
                return Ok(());
            }
        }
    }
}

/// Waits `wait`; `false` once the shutdown signal has completed.
async fn pause(shutdown: &mut Shutdown<'_>, wait: Duration) -> bool {
    let mut sleep = std::pin::pin!(tokio::time::sleep(wait));
    let stopped = std::future::poll_fn(|context| {
        if shutdown.future.as_mut().poll(context).is_ready() {
            return std::task::Poll::Ready(true);
        }
        sleep.as_mut().poll(context).map(|()| false)
    })
    .await;
    shutdown.done |= stopped;
    !stopped
}

/// How one send ended.
enum Delivery {
    Lost,
    Failed,
    Dead,
}
