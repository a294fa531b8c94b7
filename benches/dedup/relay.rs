//! The relay group: `cargo bench --bench dedup --features brokers -- relay` (and, tiny, in
//! the smoke run). One relay moves `rows` pending rows (5,000; enqueued untimed before each
//! run, 500 per transaction) to a broker, timed until none is left; rows per second, the
//! median over the rounds. In every round, in an order that changes with the round:
//!
//! - the library's relay (`Relay::relay_batch` in a loop) at claims of 32, 100 and 500,
//!   to no broker (a publisher that drops each message), RabbitMQ (publisher confirms),
//!   JetStream (the stream's acknowledgements) and Kafka (tansu; the idempotent producer,
//!   `acks=all`), on PostgreSQL, SQLite and MariaDB;
//! - on PostgreSQL, three relays written by hand with sqlx and the broker clients:
//!   - `before`: the relay as it was before issue 25 — claim 32 rows under a lease and
//!     commit, then per row publish, await its confirm, one autocommitted `UPDATE`;
//!   - `lease`: the library's protocol by hand — claim 500 under a lease and commit
//!     (`UPDATE … RETURNING`), publish all without waiting, await all confirms, one
//!     owner-checked `UPDATE` of the ids (joined with `unnest($1)`: `id = ANY($1)` can be
//!     planned as a test of every claimed row against the whole array);
//!   - `transaction` (the ceiling): one transaction across the send — `SELECT … LIMIT 500
//!     FOR UPDATE SKIP LOCKED`, publish all, await all, one `UPDATE`, `COMMIT`.
//!
//! PostgreSQL's table is vacuumed after each fill (untimed), as autovacuum keeps a live
//! table; without it every run would meet the dead rows of all the runs before.
//!
//! `target/dedup-bench/relay.csv`:
//! `backend,broker,batch,rows_per_s,handwritten_rows_per_s,ratio_vs_handwritten,ratio_vs_before`,
//! the hand-written figures (the `lease` relay, and `before`) only on PostgreSQL; the
//! baselines' own rows have `batch` `lease-500`, `transaction-500` and `before-32`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use dedup_runtime::outbox::{Cause, Outbox};
use sqlx::{AssertSqlSafe, Pool, Postgres};

use crate::Error;

/// The claim sizes the library's relay is measured at.
const BATCHES: [u32; 3] = [32, 100, 500];

/// The hand-written relays' claim (the `before` relay's is 32, as the library's was).
const HAND_BATCH: i64 = 500;

/// One broker the rows go to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Broker {
    None,
    #[cfg(feature = "brokers")]
    RabbitMq,
    #[cfg(feature = "brokers")]
    JetStream,
    #[cfg(feature = "brokers")]
    Kafka,
}

impl Broker {
    fn all() -> Vec<Broker> {
        vec![
            Broker::None,
            #[cfg(feature = "brokers")]
            Broker::RabbitMq,
            #[cfg(feature = "brokers")]
            Broker::JetStream,
            #[cfg(feature = "brokers")]
            Broker::Kafka,
        ]
    }

    fn name(self) -> &'static str {
        match self {
            Broker::None => "none",
            #[cfg(feature = "brokers")]
            Broker::RabbitMq => "rabbitmq",
            #[cfg(feature = "brokers")]
            Broker::JetStream => "jetstream",
            #[cfg(feature = "brokers")]
            Broker::Kafka => "kafka",
        }
    }
}

/// The brokers' clients, for the library's publishers and the hand-written relays.
struct Clients {
    #[cfg(feature = "brokers")]
    brokers: crate::brokers::Brokers,
    /// Kafka (tansu in CI): the library's publisher, and a producer of the same settings
    /// for the hand-written relays.
    #[cfg(feature = "brokers")]
    kafka: dedup_runtime::rdkafka::KafkaPublisher,
    #[cfg(feature = "brokers")]
    kafka_producer: rdkafka::producer::FutureProducer,
}

impl Clients {
    /// Sends `rows` (id, destination, payload) to `broker` the way an expert would: all
    /// out, then all confirms; whether each got there.
    async fn send_all(&self, broker: Broker, rows: &[(String, String, Vec<u8>)]) -> Vec<bool> {
        match broker {
            Broker::None => vec![true; rows.len()],
            #[cfg(feature = "brokers")]
            Broker::RabbitMq => {
                let channel = &self.brokers.hand_channel;
                let mut confirms = Vec::with_capacity(rows.len());
                for (id, destination, payload) in rows {
                    let properties = lapin::BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_delivery_mode(2);
                    confirms.push(
                        channel
                            .basic_publish(
                                "".into(),
                                destination.as_str().into(),
                                lapin::options::BasicPublishOptions {
                                    mandatory: true,
                                    ..Default::default()
                                },
                                payload,
                                properties,
                            )
                            .await,
                    );
                }
                let mut answers = Vec::with_capacity(rows.len());
                for confirm in confirms {
                    answers.push(match confirm {
                        Ok(confirm) => {
                            matches!(confirm.await, Ok(lapin::Confirmation::Ack(None)))
                        }
                        Err(_) => false,
                    });
                }
                answers
            }
            #[cfg(feature = "brokers")]
            Broker::JetStream => {
                let context = &self.brokers.context;
                let mut acks = Vec::with_capacity(rows.len());
                for (id, destination, payload) in rows {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Message-Id", id.as_str());
                    headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
                    acks.push(
                        context
                            .publish_with_headers(
                                destination.clone(),
                                headers,
                                payload.clone().into(),
                            )
                            .await,
                    );
                }
                let mut answers = Vec::with_capacity(rows.len());
                for ack in acks {
                    answers.push(match ack {
                        Ok(ack) => ack.await.is_ok(),
                        Err(_) => false,
                    });
                }
                answers
            }
            #[cfg(feature = "brokers")]
            Broker::Kafka => {
                use rdkafka::message::{Header, OwnedHeaders};
                let mut deliveries = Vec::with_capacity(rows.len());
                for (id, destination, payload) in rows {
                    let headers = OwnedHeaders::new().insert(Header {
                        key: "id",
                        value: Some(id.as_str()),
                    });
                    let record = rdkafka::producer::FutureRecord::<str, [u8]>::to(destination)
                        .payload(payload)
                        .headers(headers);
                    deliveries.push(self.kafka_producer.send_result(record).ok());
                }
                let mut answers = Vec::with_capacity(rows.len());
                for delivery in deliveries {
                    answers.push(match delivery {
                        Some(delivery) => matches!(delivery.await, Ok(Ok(_))),
                        None => false,
                    });
                }
                answers
            }
        }
    }

    #[cfg(feature = "brokers")]
    async fn connect() -> Result<Clients, Error> {
        let servers = std::env::var("DEDUP_TEST_KAFKA_BROKERS")
            .unwrap_or_else(|_| "127.0.0.1:19092".to_owned());
        let config = dedup_runtime::rdkafka::KafkaPublisher::producer_config(&servers);
        let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
            config.create()?;
        let topic = rdkafka::admin::NewTopic::new(
            crate::outbox::DESTINATION,
            1,
            rdkafka::admin::TopicReplication::Fixed(1),
        );
        // Already there from an earlier run is fine.
        let _ = admin
            .create_topics(&[topic], &rdkafka::admin::AdminOptions::new())
            .await
            .map_err(|error| format!("Kafka at {servers}: {error}"))?;
        Ok(Clients {
            brokers: crate::brokers::Brokers::connect().await?,
            kafka: dedup_runtime::rdkafka::KafkaPublisher::new(config.clone())?,
            kafka_producer: config.create()?,
        })
    }

    #[cfg(not(feature = "brokers"))]
    async fn connect() -> Result<Clients, Error> {
        Ok(Clients {})
    }

    async fn purge(&self) -> Result<(), Error> {
        #[cfg(feature = "brokers")]
        self.brokers.purge().await?;
        Ok(())
    }
}

/// Enqueues `rows` messages into a fresh outbox table of its own; the outbox.
async fn fill<DB: dedup_runtime::Backend>(
    pool: &Pool<DB>,
    table: &str,
    rows: usize,
) -> Result<Outbox, Error>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Connection: dedup_runtime::outbox::OutboxConnection,
{
    dedup_runtime::outbox::migrate_table(pool, table).await?;
    let outbox = Outbox::new().in_table(table)?;
    crate::setup::execute(pool, &[&format!("DELETE FROM {table}")]).await?;
    let cause = Cause::new("bench-relay", format!("{:?}", Instant::now()))?;
    let mut slot = 0u32;
    while (slot as usize) < rows {
        let mut tx = pool.begin().await?;
        for _ in 0..500.min(rows - slot as usize) {
            let message =
                cause.nth_outgoing(slot, crate::outbox::DESTINATION, br#"{"paid": true}"#);
            outbox.enqueue(&mut *tx, &message).await?;
            slot += 1;
        }
        tx.commit().await?;
    }
    Ok(outbox)
}

/// [`fill`] on PostgreSQL, then `VACUUM ANALYZE` (untimed): the table in the state
/// autovacuum keeps it in, whatever the runs before left (a refilled table would otherwise
/// carry every earlier run's dead rows and index entries).
async fn fill_pg(pool: &Pool<Postgres>, table: &str, rows: usize) -> Result<Outbox, Error> {
    let outbox = fill(pool, table, rows).await?;
    crate::setup::execute(pool, &[&format!("VACUUM ANALYZE {table}")]).await?;
    Ok(outbox)
}

/// Rows per second the library's relay moves at claims of `batch`.
async fn library<DB: dedup_runtime::Backend>(
    pool: &Pool<DB>,
    outbox: &Outbox,
    batch: u32,
    broker: Broker,
    clients: &Clients,
    rows: usize,
) -> Result<f64, Error> {
    let relay = outbox.relay(pool).batch(batch);
    let began = Instant::now();
    let mut sent = 0;
    loop {
        let relayed = match broker {
            Broker::None => relay.relay_batch(&crate::outbox::Discard).await?,
            #[cfg(feature = "brokers")]
            Broker::RabbitMq => relay.relay_batch(&clients.brokers.rabbitmq).await?,
            #[cfg(feature = "brokers")]
            Broker::JetStream => relay.relay_batch(&clients.brokers.jetstream).await?,
            #[cfg(feature = "brokers")]
            Broker::Kafka => relay.relay_batch(&clients.kafka).await?,
        };
        sent += relayed.sent;
        if relayed.claimed == 0 {
            break;
        }
    }
    let _ = clients;
    rate(sent, rows, began)
}

fn rate(sent: usize, rows: usize, began: Instant) -> Result<f64, Error> {
    if sent != rows {
        return Err(format!("relay figure: sent {sent} of {rows}").into());
    }
    Ok(rows as f64 / began.elapsed().as_secs_f64())
}

/// The hand-written relays (PostgreSQL).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Hand {
    Before,
    Lease,
    Transaction,
}

impl Hand {
    fn label(self) -> &'static str {
        match self {
            Hand::Before => "before-32",
            Hand::Lease => "lease-500",
            Hand::Transaction => "transaction-500",
        }
    }
}

/// Rows per second a hand-written relay moves.
async fn by_hand(
    pool: &Pool<Postgres>,
    table: &str,
    hand: Hand,
    broker: Broker,
    clients: &Clients,
    rows: usize,
) -> Result<f64, Error> {
    let claim = format!(
        "UPDATE {table} SET state = 1, owner = $1, attempts = attempts + 1, \
         lease_until = clock_timestamp() + interval '30 seconds' \
         WHERE id IN (SELECT id FROM {table} WHERE state = 0 AND next_attempt_at <= clock_timestamp() \
         ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED) \
         RETURNING id::text, destination, payload"
    );
    // Joined with the ids rather than `id = ANY($1)`, which the planner may test row by
    // row against the whole array (quadratic in the claim).
    let mark_many = format!(
        "UPDATE {table} AS t SET state = 2, sent_at = clock_timestamp(), owner = NULL, \
         lease_until = NULL FROM unnest($1::text[]::uuid[]) AS s (id) \
         WHERE t.id = s.id AND t.owner = $2 AND t.state = 1"
    );
    let mark_one = format!(
        "UPDATE {table} SET state = 2, sent_at = clock_timestamp(), owner = NULL, \
         lease_until = NULL WHERE id = $1::uuid AND owner = $2 AND state = 1"
    );
    let select = format!(
        "SELECT id::text, destination, payload FROM {table} WHERE state = 0 \
         ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let mark_locked = format!(
        "UPDATE {table} SET state = 2, sent_at = clock_timestamp() WHERE id = ANY($1::text[]::uuid[])"
    );
    let owner = format!(
        "{:016x}",
        Instant::now().elapsed().as_nanos() as u64 ^ 0x5eed
    )
    .into_bytes();
    let began = Instant::now();
    let mut sent = 0;
    loop {
        let batch: Vec<(String, String, Vec<u8>)> = match hand {
            Hand::Before | Hand::Lease => {
                let limit = if hand == Hand::Before { 32 } else { HAND_BATCH };
                sqlx::query_as(AssertSqlSafe(claim.clone()))
                    .bind(&owner)
                    .bind(limit)
                    .fetch_all(pool)
                    .await?
            }
            Hand::Transaction => {
                let mut tx = pool.begin().await?;
                let batch: Vec<(String, String, Vec<u8>)> =
                    sqlx::query_as(AssertSqlSafe(select.clone()))
                        .bind(HAND_BATCH)
                        .fetch_all(&mut *tx)
                        .await?;
                if batch.is_empty() {
                    tx.commit().await?;
                    break;
                }
                let answers = clients.send_all(broker, &batch).await;
                let ids: Vec<String> = ok_ids(&batch, &answers);
                sent += ids.len();
                sqlx::query(AssertSqlSafe(mark_locked.clone()))
                    .bind(ids)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                continue;
            }
        };
        if batch.is_empty() {
            break;
        }
        if hand == Hand::Before {
            for row in &batch {
                if clients.send_all(broker, std::slice::from_ref(row)).await[0] {
                    sent += sqlx::query(AssertSqlSafe(mark_one.clone()))
                        .bind(&row.0)
                        .bind(&owner)
                        .execute(pool)
                        .await?
                        .rows_affected() as usize;
                }
            }
        } else {
            let answers = clients.send_all(broker, &batch).await;
            let ids = ok_ids(&batch, &answers);
            sent += sqlx::query(AssertSqlSafe(mark_many.clone()))
                .bind(ids)
                .bind(&owner)
                .execute(pool)
                .await?
                .rows_affected() as usize;
        }
    }
    rate(sent, rows, began)
}

fn ok_ids(batch: &[(String, String, Vec<u8>)], answers: &[bool]) -> Vec<String> {
    batch
        .iter()
        .zip(answers)
        .filter(|(_, ok)| **ok)
        .map(|(row, _)| row.0.clone())
        .collect()
}

/// One measured relay: (backend, broker, label).
type Key = (&'static str, &'static str, String);

/// Runs the group: `rounds` interleaved rounds of `rows` rows each; writes `relay.csv`.
pub(crate) async fn run(
    pg: &Pool<Postgres>,
    lite: &Pool<sqlx::Sqlite>,
    maria: &Pool<sqlx::MySql>,
    dir: &Path,
    rounds: usize,
    rows: usize,
) -> Result<(), Error> {
    let clients = Clients::connect().await?;
    let table = "dedup_bench_relay";
    let mut samples: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        // Every measure of the round, in an order that turns with the round.
        let mut plan: Vec<(usize, Broker, u32, Option<Hand>)> = Vec::new();
        for broker in Broker::all() {
            for backend in 0..3 {
                for batch in BATCHES {
                    plan.push((backend, broker, batch, None));
                }
            }
            for hand in [Hand::Before, Hand::Lease, Hand::Transaction] {
                plan.push((0, broker, 0, Some(hand)));
            }
        }
        let turn = round % plan.len().max(1);
        plan.rotate_left(turn);
        for (backend, broker, batch, hand) in plan {
            clients.purge().await?;
            let (name, figure, label) = match (backend, hand) {
                (0, Some(hand)) => {
                    fill_pg(pg, table, rows).await?;
                    let figure = by_hand(pg, table, hand, broker, &clients, rows).await?;
                    ("postgres", figure, hand.label().to_owned())
                }
                (0, None) => {
                    let outbox = fill_pg(pg, table, rows).await?;
                    let figure = library(pg, &outbox, batch, broker, &clients, rows).await?;
                    ("postgres", figure, batch.to_string())
                }
                (1, _) => {
                    let outbox = fill(lite, table, rows).await?;
                    let figure = library(lite, &outbox, batch, broker, &clients, rows).await?;
                    ("sqlite", figure, batch.to_string())
                }
                _ => {
                    let outbox = fill(maria, table, rows).await?;
                    let figure = library(maria, &outbox, batch, broker, &clients, rows).await?;
                    ("mariadb", figure, batch.to_string())
                }
            };
            println!(
                "relay round {round}: {name:<8} {:<9} {label:<15} {figure:>8.0} rows/s",
                broker.name()
            );
            samples
                .entry((name, broker.name(), label))
                .or_default()
                .push(figure);
        }
    }
    let median = |key: &Key| {
        samples
            .get(key)
            .map(|values| crate::report::median(values.clone()))
    };
    let mut csv = String::from(
        "backend,broker,batch,rows_per_s,handwritten_rows_per_s,ratio_vs_handwritten,ratio_vs_before\n",
    );
    println!("\nthe relay, medians of {rounds} rounds, {rows} rows per run:");
    for (key, _) in samples.iter() {
        let (backend, broker, label) = key;
        let rate = median(key).unwrap_or(0.0);
        let (hand, before) = if *backend == "postgres" {
            (
                median(&("postgres", *broker, Hand::Lease.label().to_owned())),
                median(&("postgres", *broker, Hand::Before.label().to_owned())),
            )
        } else {
            (None, None)
        };
        let cell = |value: Option<f64>| value.map_or(String::new(), |v| format!("{v:.3}"));
        let hand_rate = hand.map_or(String::new(), |v| format!("{v:.0}"));
        csv.push_str(&format!(
            "{backend},{broker},{label},{rate:.0},{hand_rate},{},{}\n",
            cell(hand.map(|h| rate / h)),
            cell(before.map(|b| rate / b)),
        ));
        println!(
            "  {backend:<8} {broker:<9} {label:<15} {rate:>8.0} rows/s{}{}",
            hand.map_or(String::new(), |h| format!(
                "  {:.3} of the lease relay by hand",
                rate / h
            )),
            before.map_or(String::new(), |b| format!(
                "  {:.2}x the relay before",
                rate / b
            )),
        );
    }
    std::fs::write(dir.join("relay.csv"), csv)?;
    Ok(())
}
