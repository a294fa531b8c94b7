//! BatchReport mode: a claim's messages processed in one transaction through a
//! [`BatchHandler`], split in halves down to the message when the handler fails.

use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::task::Poll;

use super::{BatchReport, ClaimedMany, Claims, InboxMessage, Processed, Step, Worker};
use tracing::Instrument as _;

use crate::backend::Backend;
use crate::batch::{BatchError, BatchHandler};
use crate::claim::Tx;
use crate::guarded::Guarded;
use crate::inbox::InboxError;
use crate::queue::{Granted, Shutdown, again, retry_reachable};
use sqlx::pool::PoolConnection;

/// How one transaction over a part of a claim ended.
enum Ended {
    /// Committed: the handler's effects and the marks of these many messages; `lost`:
    /// messages of the part found another worker's first (SQLite), left out.
    Committed { processed: usize, lost: usize },
    /// The handler failed (its error's text): rolled back.
    Failed(String),
    /// The mark found fewer rows the worker's own than the part has: a claim was lost
    /// (its lease ended, another worker took the row). Rolled back.
    Short,
    /// Every message of the part was found another worker's: nothing ran.
    AllLost,
    /// A failure of ours inside the transaction: run again when transient.
    Transient(sqlx::Error),
    /// A transient database error inside the handler (its text): run again, a few times,
    /// before the part splits.
    Busy(String),
    /// No connection.
    Error(sqlx::Error),
}

impl<DB: Backend> Worker<DB> {
    /// [`process_batch`](Self::process_batch) in **batch mode**: claims up to
    /// [`batch`](Self::batch) rows, and processes them in **one transaction**: `handler`
    /// runs once over all of them (in the claim's order), then one statement marks them
    /// processed, and one commit ends it — the throughput of a hand-written worker that
    /// takes N messages per transaction, where [`process_batch`](Self::process_batch)
    /// commits once per message.
    ///
    /// A message's failure is still its own: when the handler fails, the transaction
    /// rolls back and the messages run again in two halves, each in its own transaction,
    /// down to single messages, as [`batch`](crate::batch) does — the good ones commit,
    /// and only a message that fails alone gets the failure (its backoff, its error
    /// kept, dead after its last attempt). At most about 2·log₂ N more transactions per
    /// failing message. A transient database error inside the handler (a deadlock, seen
    /// through `source()`) runs the same transaction again instead, a few times, before
    /// it splits. A message on its second attempt or later (it failed before, or was in
    /// hand when a worker stopped) runs in a transaction of its own, in its place in the
    /// claim's order.
    ///
    /// Counted attempts: a worker that stops during a transaction of several messages
    /// leaves no trace of which one stopped it, so the take-back charges the first of
    /// them (in the claim's order) and gives the others their attempt back, as for a
    /// claim processed message by message; that first one then runs alone. A message
    /// that kills its process every time is dead after its attempts; each message it
    /// takes down with it loses at most one attempt — keep
    /// [`max_attempts`](Self::max_attempts) at 2 or more with batch mode.
    ///
    /// Claims lost meanwhile (a worker paused past its lease, its rows taken by another)
    /// are found by the mark: the transaction rolls back and runs again without them,
    /// counted [`lost`](BatchReport::lost). Everything else is as
    /// [`process_batch`](Self::process_batch): the take-back of stopped claims first, the
    /// heartbeat, a lost connection of ours that ends the batch and releases its rows.
    ///
    /// ```
    /// use dedup_runtime::batch::BatchHandler;
    /// use dedup_runtime::inbox::{Inbox, InboxMessage};
    ///
    /// /// One multi-row insert for a whole claim.
    /// struct Invoices;
    ///
    /// impl BatchHandler<sqlx::Sqlite, InboxMessage> for Invoices {
    ///     type Error = sqlx::Error;
    ///
    ///     async fn handle(
    ///         &self,
    ///         tx: &mut sqlx::SqliteConnection,
    ///         messages: &[&InboxMessage],
    ///     ) -> Result<(), sqlx::Error> {
    ///         let mut insert = sqlx::QueryBuilder::new("INSERT INTO invoices (message_id, body) ");
    ///         insert.push_values(messages, |mut row, message| {
    ///             row.push_bind(message.id()).push_bind(message.payload());
    ///         });
    ///         insert.build().execute(&mut *tx).await?;
    ///         Ok(())
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect("sqlite::memory:").await?;
    /// # sqlx::raw_sql("CREATE TABLE invoices (message_id TEXT NOT NULL, body BLOB NOT NULL)").execute(&pool).await?;
    /// dedup_runtime::inbox::migrate(&pool).await?;
    /// let inbox = Inbox::new(&pool, "billing")?;
    /// for n in 0..10 {
    ///     inbox.receive(dedup_runtime::inbox::Incoming::new(&format!("evt_{n}"), b"{}")).await?;
    /// }
    /// let done = inbox.worker().batch(10).process_batched(&Invoices).await?;
    /// assert_eq!(done.processed, 10); // one transaction, one commit
    /// # Ok(()) }
    /// ```
    pub async fn process_batched<H: BatchHandler<DB, InboxMessage>>(
        &self,
        handler: &H,
    ) -> Result<BatchReport, InboxError> {
        self.batched_until(handler, None).await
    }

    /// [`run`](Self::run) in batch mode: [`process_batched`](Self::process_batched) until
    /// `shutdown` completes. Graceful as [`run`](Self::run) is: once `shutdown` has
    /// completed, no new transaction starts, the claim's rows not committed are released
    /// at once, and the transaction in hand is given the
    /// [`shutdown_deadline`](Self::shutdown_deadline) to finish (then cancelled, rolled
    /// back, and its rows released too).
    pub async fn run_batched<H: BatchHandler<DB, InboxMessage>>(
        &self,
        handler: &H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), InboxError> {
        self.run_with(shutdown, &Batched(handler)).await
    }

    async fn batched_until<H: BatchHandler<DB, InboxMessage>>(
        &self,
        handler: &H,
        mut stop: Option<&mut Shutdown<'_>>,
    ) -> Result<BatchReport, InboxError> {
        self.check()?;
        let (claims, mut kept) = self.claim_keeping().await?;
        let mut batch = BatchReport {
            claimed: claims.messages.len(),
            dead: claims.buried,
            ..BatchReport::default()
        };
        let mut ended = Ok(());
        if !claims.messages.is_empty() {
            let granted = Granted::new();
            let work = async {
                // Parts of the claim still to run (indices), a stack: the claim's order
                // from the top, the first half of a split first.
                let attempts = claims.messages.iter().map(|message| message.attempt);
                let mut parts: Vec<Vec<usize>> = crate::queue::parts(attempts)
                    .rev()
                    .map(Vec::from_iter)
                    .collect();
                while let Some(part) = parts.pop() {
                    if stop.as_mut().is_some_and(|stop| stop.check()) {
                        batch.released += self.release(&claims).await?;
                        break;
                    }
                    let messages: Vec<&InboxMessage> =
                        part.iter().map(|&k| &claims.messages[k]).collect();
                    let single = (messages.len() == 1).then(|| messages[0]);
                    let span = self.span(messages.len(), single);
                    let ended = self
                        .part(
                            handler,
                            &claims,
                            &messages,
                            stop.as_deref_mut(),
                            &granted,
                            kept.take(),
                        )
                        .instrument(span.clone())
                        .await?;
                    if !span.is_disabled() {
                        span.record("outcome", ended.as_ref().map_or("released", PartEnd::name));
                    }
                    let Some(ended) = ended else {
                        // Cancelled at the shutdown deadline: this part and the rest.
                        batch.released += self.release(&claims).await?;
                        break;
                    };
                    match ended {
                        PartEnd::Committed { processed, lost } => {
                            batch.processed += processed;
                            batch.lost += lost;
                        }
                        PartEnd::Lost { kept } => {
                            batch.lost += part.len() - kept.len();
                            let kept: HashSet<&str> = kept.iter().map(String::as_str).collect();
                            let rest: Vec<usize> = part
                                .iter()
                                .copied()
                                .filter(|&k| kept.contains(claims.messages[k].id.as_str()))
                                .collect();
                            if !rest.is_empty() {
                                parts.push(rest);
                            }
                        }
                        PartEnd::Failed(text) if part.len() == 1 => {
                            let message = &claims.messages[part[0]];
                            let row = self.claimed(&claims.owner, message, None);
                            match self.fail_one(&row, message, &text).await? {
                                Processed::Dead => batch.dead += 1,
                                Processed::Lost => batch.lost += 1,
                                _ => batch.failed += 1,
                            }
                        }
                        PartEnd::Failed(_) => {
                            let (left, right) = part.split_at(part.len() / 2);
                            parts.push(right.to_vec());
                            parts.push(left.to_vec());
                        }
                    }
                }
                Ok::<(), InboxError>(())
            };
            ended = self.renewing(&claims.owner, &granted, work).await;
            if let Err(error) = &ended {
                batch.released += self.release_after(&claims, error).await;
            }
        }
        if let Some(stop) = stop.as_mut() {
            batch.released += std::mem::take(&mut stop.released);
        }
        self.count(&batch);
        ended?;
        Ok(batch)
    }

    /// One part of a claim in one transaction, run again while a failure of ours (or a
    /// transient one inside the handler) is transient; `None` when the shutdown deadline
    /// cancelled it.
    async fn part<H: BatchHandler<DB, InboxMessage>>(
        &self,
        handler: &H,
        claims: &Claims,
        messages: &[&InboxMessage],
        mut stop: Option<&mut Shutdown<'_>>,
        granted: &Granted,
        mut kept: Option<PoolConnection<DB>>,
    ) -> Result<Option<PartEnd>, InboxError> {
        let inbox = &self.inbox;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let renew = self.renewal(Some(granted));
            let transaction = self.part_once(handler, &claims.owner, messages, renew, kept.take());
            let ended = match stop.as_deref_mut() {
                None => transaction.await,
                Some(stop) => {
                    let mut transaction = std::pin::pin!(transaction);
                    let ended = std::future::poll_fn(|context| {
                        if let Poll::Ready(ended) = transaction.as_mut().poll(context) {
                            return Poll::Ready(Some(ended));
                        }
                        stop.poll_deadline(context).map(|()| None)
                    })
                    .await;
                    match ended {
                        Some(ended) => ended,
                        None => {
                            tracing::warn!(
                                consumer = inbox.consumer,
                                messages = messages.len(),
                                "inbox batch handler cancelled at the shutdown deadline; its rows are released"
                            );
                            return Ok(None);
                        }
                    }
                }
            };
            let retry = attempt < crate::retry::MAX_ATTEMPTS;
            match ended {
                Ended::Transient(error) if retry && again::<DB>(&error) => {
                    tracing::debug!(%error, attempt, "inbox batch: transient failure; running the transaction again");
                    tokio::time::sleep(crate::retry::backoff(attempt)).await;
                }
                // The database went away under our own statements: not the messages'
                // failure. The batch ends; its rows are released.
                Ended::Transient(error) if again::<DB>(&error) => {
                    return Err(self.classify(error));
                }
                Ended::Transient(error) => {
                    return Ok(Some(PartEnd::Failed(crate::queue::error_text(
                        error.to_string(),
                    ))));
                }
                Ended::Busy(text) if retry => {
                    tracing::debug!(
                        error = text,
                        attempt,
                        "inbox batch: transient failure in the handler; running the transaction again"
                    );
                    tokio::time::sleep(crate::retry::backoff(attempt)).await;
                }
                Ended::Busy(text) => return Ok(Some(PartEnd::Failed(text))),
                Ended::Error(error) => return Err(self.classify(error)),
                Ended::Committed { processed, lost } => {
                    return Ok(Some(PartEnd::Committed { processed, lost }));
                }
                Ended::Failed(text) => return Ok(Some(PartEnd::Failed(text))),
                Ended::AllLost => return Ok(Some(PartEnd::Lost { kept: Vec::new() })),
                Ended::Short => {
                    // Which of the part are still ours: the rest were taken.
                    let (pool, table, consumer) = (&inbox.pool, &inbox.table, &*inbox.consumer);
                    let held = retry_reachable::<DB, _, _>(|| {
                        DB::inbox_held(pool, table, consumer, &claims.owner)
                    })
                    .await
                    .map_err(|error| self.classify(error))?;
                    tracing::warn!(
                        consumer = inbox.consumer,
                        "claims of the batch were lost (their lease ended and another worker took the rows): \
                         the transaction runs again without them"
                    );
                    let part: HashSet<&str> = messages.iter().map(|m| m.id.as_str()).collect();
                    let kept = held
                        .into_iter()
                        .map(|message| message.id)
                        .filter(|id| part.contains(id.as_str()))
                        .collect();
                    return Ok(Some(PartEnd::Lost { kept }));
                }
            }
        }
    }

    /// One transaction over `messages`: the begin (SQLite: the marks), the handler, the
    /// owner-checked marks (PostgreSQL, MySQL), the commit.
    async fn part_once<H: BatchHandler<DB, InboxMessage>>(
        &self,
        handler: &H,
        owner: &crate::random::Owner,
        messages: &[&InboxMessage],
        renew: Option<i64>,
        kept: Option<PoolConnection<DB>>,
    ) -> Ended {
        let inbox = &self.inbox;
        // The claim's connection, or one from the pool; closed, not pooled, unless the
        // transaction ends here as it should.
        let conn = match kept {
            Some(conn) => Ok(conn),
            None => inbox.pool.acquire().await,
        };
        let mut conn = match conn {
            Ok(conn) => Guarded::new(conn),
            Err(error) => return Ended::Error(error),
        };
        let unclean = AtomicBool::new(DB::CHANGES_SESSION);
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        let rows = ClaimedMany {
            table: &inbox.table,
            consumer: &inbox.consumer,
            ids: &ids,
            owner,
            drop_payload: inbox.drop_payloads,
            renew,
        };
        let ended = {
            let (mut tx, ours) = match DB::inbox_begin_many(&mut conn, &rows).await {
                Ok(begun) => begun,
                Err(error) => return Ended::Transient(error),
            };
            // The messages the handler runs on: all (PostgreSQL, MySQL: the mark checks
            // after it), or those SQLite marked ours at the begin.
            let run: Vec<&InboxMessage> = match &ours {
                None => messages.to_vec(),
                Some(ours) => {
                    let ours: HashSet<&str> = ours.iter().map(String::as_str).collect();
                    messages
                        .iter()
                        .copied()
                        .filter(|m| ours.contains(m.id.as_str()))
                        .collect()
                }
            };
            let wrote = !run.is_empty();
            let ended = if run.is_empty() {
                Some(Ended::AllLost)
            } else {
                match handler.handle(&mut *tx, &run).await {
                    Ok(()) => {
                        let ran: Vec<&str> = run.iter().map(|m| m.id.as_str()).collect();
                        let rows = ClaimedMany { ids: &ran, ..rows };
                        match DB::inbox_finish_many(&mut *tx, &rows).await {
                            Ok(marked) if marked as usize == run.len() => None,
                            Ok(_) => Some(Ended::Short),
                            Err(error) => Some(Ended::Transient(error)),
                        }
                    }
                    Err(error) => {
                        let transient = crate::classify::is_transient::<DB>(error.as_std_error());
                        let text = crate::queue::error_text(error.as_std_error().to_string());
                        Some(if transient {
                            Ended::Busy(text)
                        } else {
                            Ended::Failed(text)
                        })
                    }
                }
            };
            let tx = Tx {
                tx,
                unclean: &unclean,
            };
            match ended {
                None => match DB::commit_owned(tx, None, true).await {
                    Ok(()) => Ended::Committed {
                        processed: run.len(),
                        lost: messages.len() - run.len(),
                    },
                    Err(error) => Ended::Transient(error),
                },
                Some(ended) => {
                    let _ = DB::rollback_owned(tx, true, wrote).await;
                    ended
                }
            }
        };
        if !unclean.load(std::sync::atomic::Ordering::Relaxed) {
            conn.set_clean();
        }
        ended
    }
}

/// One transaction per claim (split when the handler fails).
struct Batched<'h, H>(&'h H);

impl<DB: Backend, H: BatchHandler<DB, InboxMessage>> Step<DB> for Batched<'_, H> {
    fn step<'s>(
        &'s self,
        worker: &'s Worker<DB>,
        stop: &'s mut Shutdown<'_>,
    ) -> impl Future<Output = Result<BatchReport, InboxError>> + Send + 's {
        worker.batched_until(self.0, Some(stop))
    }
}

/// How [`Worker::part`] ended.
enum PartEnd {
    Committed {
        processed: usize,
        lost: usize,
    },
    Failed(String),
    /// Claims of the part were lost: `kept`, the ids still the worker's, run again.
    Lost {
        kept: Vec<String>,
    },
}

impl PartEnd {
    /// Its name in a span's `outcome`.
    fn name(&self) -> &'static str {
        match self {
            PartEnd::Committed { .. } => "processed",
            PartEnd::Failed(_) => "failed",
            PartEnd::Lost { .. } => "lost",
        }
    }
}
