//! The outbox's figures in every round: what one `enqueue` adds to a handler, call by call,
//! and the rows per second one relay moves, without a broker and (feature `brokers`) to
//! RabbitMQ and JetStream.

use std::sync::Arc;
use std::time::Instant;

use sqlx::Pool;

use crate::Error;
#[cfg(feature = "brokers")]
use crate::brokers::Brokers;
use crate::config::{BackendName, Config, Variant};
use crate::report::median;
use crate::setup::outbox_reset;
use crate::target::Target;
use crate::timing::random_ids;

/// The outbox table of the benchmark.
pub(crate) const OUTBOX_TABLE: &str = "dedup_bench_outbox";

/// The destination of its rows: a RabbitMQ queue and a JetStream subject when the relay
/// publishes to the brokers (feature `brokers`).
pub(crate) const DESTINATION: &str = "dedup-bench.events";

/// The handler's one outgoing message: the same payload every time, the slot "event".
pub(crate) async fn enqueue_one<C: dedup_runtime::outbox::OutboxConnection>(
    tx: &mut C,
    consumer: &str,
    id: &str,
) -> Result<(), sqlx::Error> {
    let outbox = dedup_runtime::outbox::Outbox::new()
        .in_table(OUTBOX_TABLE)
        .map_err(|error| sqlx::Error::InvalidArgument(error.to_string()))?;
    let cause = dedup_runtime::outbox::Cause::new(consumer, id)?;
    let event = cause.outgoing("event", DESTINATION, br#"{"paid": true}"#)?;
    outbox.enqueue(tx, &event).await?;
    Ok(())
}

/// A publisher that drops every message at once: the relay's own cost, its claims and
/// marks, without a broker.
pub(crate) struct Discard;

impl dedup_runtime::outbox::Publisher for Discard {
    type Error = std::convert::Infallible;

    async fn publish(
        &self,
        _: &dedup_runtime::outbox::OutboxMessage,
    ) -> Result<(), std::convert::Infallible> {
        Ok(())
    }
}

/// One round of the outbox's figures on one backend.
pub(crate) struct OutboxSample {
    backend: BackendName,
    /// Call by call at 1 and 4 tasks: the rate of the handler with one enqueue over that
    /// of the same handler without it (the median latency without over that with).
    cost: [f64; 2],
    /// Rows per second one relay claims, hands to a publisher that drops them, and marks.
    relay: f64,
    /// The same with the RabbitMQ and the JetStream publisher (feature `brokers`).
    brokers: Option<[f64; 2]>,
}

pub(crate) async fn measure_outbox<DB: Target>(
    pool: &Pool<DB>,
    config: &Config,
    seed: &mut u64,
    #[cfg(feature = "brokers")] brokers: &Brokers,
) -> Result<OutboxSample, Error> {
    let backend = DB::BACKEND;
    let ops = config.ops;
    let mut cost = [0.0; 2];
    for (slot, tasks) in [1, 4].into_iter().enumerate() {
        let ids = (
            Arc::new(random_ids(ops, seed)),
            Arc::new(random_ids(ops, seed)),
        );
        let per_task = ops / tasks;
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                let (pool, ids) = (pool.clone(), ids.clone());
                tokio::spawn(async move {
                    let (mut without, mut with) = (Vec::new(), Vec::new());
                    for k in task * per_task..(task + 1) * per_task {
                        for first in [k % 2 == 0, k % 2 == 1] {
                            let began = Instant::now();
                            let processed = if first {
                                DB::call(&pool, Variant::Generated, false, &ids.0[k]).await?
                            } else {
                                DB::with_outbox(&pool, &ids.1[k]).await?
                            };
                            let micros = began.elapsed().as_secs_f64() * 1e6;
                            if !processed {
                                return Err::<_, Error>("outbox figure: a duplicate".into());
                            }
                            if first {
                                without.push(micros);
                            } else {
                                with.push(micros);
                            }
                        }
                    }
                    Ok((without, with))
                })
            })
            .collect();
        let (mut without, mut with) = (Vec::new(), Vec::new());
        for handle in handles {
            let (a, b) = handle.await??;
            without.extend(a);
            with.extend(b);
        }
        cost[slot] = median(without) / median(with);
    }
    // The relay: `ops` rows enqueued (100 per transaction, untimed), then one relay; the
    // same with each broker's publisher (feature `brokers`), in turn.
    let relay_rate = relayed_per_second(pool, ops, seed, &Discard).await?;
    #[cfg(feature = "brokers")]
    let broker_rates = Some([
        relayed_per_second(pool, ops, seed, &brokers.rabbitmq).await?,
        relayed_per_second(pool, ops, seed, &brokers.jetstream).await?,
    ]);
    #[cfg(feature = "brokers")]
    brokers.purge().await?;
    #[cfg(not(feature = "brokers"))]
    let broker_rates: Option<[f64; 2]> = None;
    outbox_reset(pool).await?;
    eprintln!(
        "           {:<10} outbox: with / without one enqueue {:.3} / {:.3} (1 / 4 tasks), relay {relay_rate:.0} rows/s{}",
        backend.name(),
        cost[0],
        cost[1],
        broker_rates.map_or(String::new(), |[rabbitmq, jetstream]| format!(
            "; to RabbitMQ {rabbitmq:.0}, to JetStream {jetstream:.0}"
        ))
    );
    Ok(OutboxSample {
        backend,
        cost,
        relay: relay_rate,
        brokers: broker_rates,
    })
}

/// Rows per second one relay moves through `publisher`: `ops` rows enqueued (100 per
/// transaction, untimed), then relayed in batches of 32 until none is left.
async fn relayed_per_second<DB: Target, P: dedup_runtime::outbox::Publisher>(
    pool: &Pool<DB>,
    ops: usize,
    seed: &mut u64,
    publisher: &P,
) -> Result<f64, Error> {
    outbox_reset(pool).await?;
    DB::enqueue_rows(pool, &random_ids(ops, seed)).await?;
    let outbox = dedup_runtime::outbox::Outbox::new().in_table(OUTBOX_TABLE)?;
    let relay = outbox.relay(pool).batch(32);
    let began = Instant::now();
    let mut sent = 0;
    loop {
        let relayed = relay.relay_batch(publisher).await?;
        sent += relayed.sent;
        if relayed.claimed == 0 {
            break;
        }
    }
    let rate = sent as f64 / began.elapsed().as_secs_f64();
    if sent != ops {
        return Err(format!("outbox figure: the relay sent {sent} of {ops}").into());
    }
    Ok(rate)
}

pub(crate) fn print_outbox(samples: &[OutboxSample]) {
    println!(
        "\nthe outbox: medians over the rounds (call by call: the rate of the handler with one \
         enqueue over that of the same handler without it)"
    );
    for backend in [BackendName::Postgres, BackendName::Sqlite] {
        let mine: Vec<&OutboxSample> = samples.iter().filter(|s| s.backend == backend).collect();
        if mine.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&OutboxSample) -> f64| median(mine.iter().map(|s| f(s)).collect());
        println!(
            "{:<10}  one enqueue, rate with / without: 1 task {:.3}, 4 tasks {:.3}; \
             one relay (no broker) {:.0} rows/s",
            backend.name(),
            med(&|s| s.cost[0]),
            med(&|s| s.cost[1]),
            med(&|s| s.relay)
        );
        if mine.iter().all(|s| s.brokers.is_some()) {
            let rate = |k: usize| med(&|s| s.brokers.map_or(0.0, |rates| rates[k]));
            let ratio = |k: usize| med(&|s| s.brokers.map_or(0.0, |rates| rates[k]) / s.relay);
            println!(
                "{:<10}  one relay publishing: to RabbitMQ {:.0} rows/s ({:.3} of no broker), \
                 to JetStream {:.0} rows/s ({:.3})",
                backend.name(),
                rate(0),
                ratio(0),
                rate(1),
                ratio(1)
            );
        }
    }
}
