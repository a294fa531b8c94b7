//! `effect = "send-first"` against a real partner API (issue 11, "A real partner API"), on
//! every backend: an HTTP server on `127.0.0.1:0` (`dedup_suite::partner`, a stand-in for a
//! payment provider) charged through a real HTTP client from the handler's body.
//!
//! Each run delivers every message twice, one delivery at a time, and "crashes" the first
//! delivery of some messages between the call and the `COMMIT`: the body signals once the
//! HTTP response is in and then waits, and the delivery loop aborts its task — the future
//! is dropped with its transaction uncommitted. The message is then delivered again.
//! What is asserted is read from the server's records and the dedup table:
//!
//! - with the key honoured: one charge per message, one dedup row per message;
//! - without it (a server that ignores the key, or no header sent): exactly one extra
//!   charge per injected crash, for the crashed messages only;
//! - every delivery acknowledged as `Outcome::Duplicate` sent the server no request.
//!
//! `partner_suite!` instantiates the cases once per backend; `leased_partner_suite!` runs the
//! leased policies the same way: send-first under a lease with the key (one charge per
//! message, the crashed delivery's copies "in progress" until its lease ends, then taken
//! over), and mark-first without a key, crashing between the mark and the call (each
//! crashed message's charge lost, its redeliveries acknowledged as outcome unknown without
//! a call, and its row listed by `Ledger::unresolved`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::{Duplicate, IdempotencyKey, Outcome, idempotent};
use dedup_suite::partner::{
    ChargeRequest, ChargeResponse, IDEMPOTENCY_KEY, Keys, Partner, REPLAYED,
};
use dedup_suite::{claims, unique};
use tokio::sync::Notify;
use tokio::time::timeout;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// The handlers' consumer name (the attribute takes it as a literal).
const CONSUMER: &str = "partner-api";

/// Messages per run; those with `n % 3 == 1` crash on their first delivery.
const MESSAGES: usize = 9;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone)]
struct OrderPlaced {
    id: String,
    order_id: String,
    amount_cents: i64,
}

/// How a handler reaches the partner, for one delivery.
struct Api {
    client: reqwest::Client,
    url: String,
    /// Whether the request carries `Idempotency-Key: charge:<message id>`.
    send_key: bool,
    /// Set on a delivery that crashes: signalled once the call returned.
    crash: Option<Arc<Notify>>,
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(PATIENCE)
        .build()
        .expect("an HTTP client")
}

/// A run's messages (ids no other run uses), whether each crashes on its first delivery,
/// and the deliveries: every message twice, shuffled with a fixed seed.
fn plan() -> (Vec<OrderPlaced>, Vec<bool>, VecDeque<usize>) {
    let run = unique("partner");
    let messages = (0..MESSAGES)
        .map(|n| OrderPlaced {
            id: format!("{run}/{n}"),
            order_id: format!("{run}/order-{n}"),
            amount_cents: 500 + n as i64,
        })
        .collect();
    let doomed = (0..MESSAGES).map(|n| n % 3 == 1).collect();
    let mut deliveries: Vec<usize> = (0..MESSAGES).flat_map(|n| [n, n]).collect();
    dedup_suite::Shuffle::new(0x9a27_11e4).shuffle(&mut deliveries);
    (messages, doomed, deliveries.into())
}

/// What a run did, as the consumer saw it.
#[derive(Debug, Default)]
struct Run {
    messages: Vec<OrderPlaced>,
    crashed: Vec<bool>,
    processed: usize,
    duplicates: usize,
    crashes: usize,
}

macro_rules! partner_suite {
    ($backend:ident, conn = $conn:ty, db = $db:ident $(,)?) => {
        mod $backend {
            use super::*;

            #[idempotent(consumer = "partner-api", key = msg.id, effect = "send-first")]
            async fn charge(
                tx: &mut $conn,
                msg: &OrderPlaced,
                api: &Api,
            ) -> Result<ChargeResponse, Error> {
                let mut request = api.client.post(&api.url).json(&ChargeRequest {
                    order_id: msg.order_id.clone(),
                    amount_cents: msg.amount_cents,
                });
                if api.send_key {
                    let key = IdempotencyKey::new("charge", &msg.id);
                    request = request.header(IDEMPOTENCY_KEY, key.as_str());
                }
                let response = request.send().await?.error_for_status()?;
                let charge: ChargeResponse = response.json().await?;
                if let Some(crash) = &api.crash {
                    crash.notify_one();
                    std::future::pending::<()>().await;
                }
                Ok(charge)
            }

            /// Delivers a [`plan`] to `partner`, one delivery at a time, and checks each
            /// delivery's requests and dedup row as it goes.
            async fn run(partner: &Partner, send_key: bool) -> Run {
                let pool = super::$db::pool().await;
                let client = client();
                let (messages, mut doomed, mut deliveries) = plan();
                let mut run = Run {
                    crashed: vec![false; MESSAGES],
                    ..Run::default()
                };
                while let Some(n) = deliveries.pop_front() {
                    let msg = messages[n].clone();
                    let before = partner.requests();
                    let crash = std::mem::take(&mut doomed[n]).then(|| Arc::new(Notify::new()));
                    let api = Api {
                        client: client.clone(),
                        url: partner.url(),
                        send_key,
                        crash: crash.clone(),
                    };
                    let mut task = tokio::spawn({
                        let (pool, msg) = ((*pool).clone(), msg.clone());
                        async move { charge(&pool, &msg, &api).await }
                    });
                    if let Some(crash) = crash {
                        tokio::select! {
                            called = timeout(PATIENCE, crash.notified()) => {
                                called.expect("the body made its call");
                            }
                            ended = &mut task => panic!("the crashing delivery ended: {ended:?}"),
                        }
                        assert_eq!(partner.requests(), before + 1, "the call was made");
                        task.abort();
                        assert!(task.await.unwrap_err().is_cancelled());
                        assert_eq!(
                            claims(&*pool, CONSUMER, &msg.id).await,
                            0,
                            "no COMMIT, no mark"
                        );
                        run.crashes += 1;
                        run.crashed[n] = true;
                        deliveries.push_back(n); // never acknowledged: delivered again
                        continue;
                    }
                    let outcome = timeout(PATIENCE, task)
                        .await
                        .expect("the delivery ends")
                        .expect("the handler does not panic")
                        .expect("the handler succeeds");
                    match outcome {
                        Outcome::Processed(charge) => {
                            run.processed += 1;
                            assert_eq!(partner.requests(), before + 1, "one request");
                            assert_eq!(charge.order_id, msg.order_id);
                        }
                        Outcome::Duplicate(duplicate) => {
                            run.duplicates += 1;
                            assert_eq!(duplicate, Duplicate::AlreadyProcessed);
                            assert_eq!(partner.requests(), before, "a duplicate calls nobody");
                        }
                    }
                    assert_eq!(claims(&*pool, CONSUMER, &msg.id).await, 1);
                }
                for msg in &messages {
                    assert_eq!(claims(&*pool, CONSUMER, &msg.id).await, 1, "{}", msg.id);
                }
                assert_eq!(run.processed, MESSAGES);
                assert_eq!(run.duplicates, MESSAGES, "every second copy");
                assert_eq!(run.crashes, MESSAGES / 3);
                run.messages = messages;
                run
            }

            /// Without the key's protection, each crash is one extra charge of its own
            /// message, and nothing else is charged twice.
            fn assert_one_extra_charge_per_crash(partner: &Partner, run: &Run) {
                for (msg, &crashed) in run.messages.iter().zip(&run.crashed) {
                    let expected = 1 + usize::from(crashed);
                    assert_eq!(partner.charges_for(&msg.order_id), expected, "{}", msg.id);
                }
                assert_eq!(partner.charges().len(), MESSAGES + run.crashes);
                assert_eq!(partner.replays(), 0);
            }

            #[tokio::test]
            async fn with_the_key_one_charge_per_message() {
                let partner = Partner::start(Keys::Honoured).await.unwrap();
                let run = run(&partner, true).await;
                for msg in &run.messages {
                    assert_eq!(partner.charges_for(&msg.order_id), 1, "{}", msg.id);
                }
                assert_eq!(partner.charges().len(), MESSAGES);
                assert_eq!(
                    partner.replays(),
                    run.crashes,
                    "each crash's repeat was replayed"
                );
                assert_eq!(partner.requests(), MESSAGES + run.crashes);
                for record in partner.charges() {
                    let msg = run
                        .messages
                        .iter()
                        .find(|m| m.order_id == record.charge.order_id);
                    let key = IdempotencyKey::new("charge", &msg.unwrap().id);
                    assert_eq!(record.idempotency_key.as_deref(), Some(key.as_str()));
                }
            }

            #[tokio::test]
            async fn a_server_that_ignores_the_key_charges_again_after_each_crash() {
                let partner = Partner::start(Keys::Ignored).await.unwrap();
                let run = run(&partner, true).await;
                assert_one_extra_charge_per_crash(&partner, &run);
            }

            #[tokio::test]
            async fn without_the_header_each_crash_charges_again() {
                let partner = Partner::start(Keys::Honoured).await.unwrap();
                let run = run(&partner, false).await;
                assert_one_extra_charge_per_crash(&partner, &run);
            }
        }
    };
}

partner_suite!(postgres, conn = sqlx::PgConnection, db = postgres_db);
partner_suite!(mysql, conn = sqlx::MySqlConnection, db = mysql_db);
partner_suite!(sqlite, conn = sqlx::SqliteConnection, db = sqlite_db);

/// The leased policies against the same partner: `effect = "send-first"` under a lease
/// (the call with no transaction open; the crashed delivery's copies are told "in
/// progress" until its lease ends, then the next one takes over and calls again), and
/// `effect = "mark-first"` (the crash comes after the mark and before the call: the charge
/// is lost, the redelivery acknowledged without a call, the row listed as outcome unknown).
macro_rules! leased_partner_suite {
    ($backend:ident, database = $database:ty, db = $db:ident $(,)?) => {
        mod $backend {
            use super::*;
            use dedup_runtime::{Lease, LeaseOutcome, Ledger, UnresolvedStatus};

            const LEASED: &str = "partner-api-leased";
            const MARKED: &str = "partner-api-mark-first";

            async fn post(msg: &OrderPlaced, api: &Api) -> Result<ChargeResponse, Error> {
                let mut request = api.client.post(&api.url).json(&ChargeRequest {
                    order_id: msg.order_id.clone(),
                    amount_cents: msg.amount_cents,
                });
                if api.send_key {
                    let key = IdempotencyKey::new("charge", &msg.id);
                    request = request.header(IDEMPOTENCY_KEY, key.as_str());
                }
                Ok(request.send().await?.error_for_status()?.json().await?)
            }

            async fn crash_point(api: &Api) {
                if let Some(crash) = &api.crash {
                    crash.notify_one();
                    std::future::pending::<()>().await;
                }
            }

            #[idempotent(consumer = "partner-api-leased", key = msg.id, effect = "send-first", lease = "300ms")]
            async fn charge_leased(
                lease: &mut Lease<'_, $database>,
                msg: &OrderPlaced,
                api: &Api,
            ) -> Result<ChargeResponse, Error> {
                let charge = post(msg, api).await?;
                crash_point(api).await;
                Ok(charge)
            }

            #[idempotent(consumer = "partner-api-mark-first", key = msg.id, effect = "mark-first", lease = "300ms")]
            async fn charge_marked(
                lease: &mut Lease<'_, $database>,
                msg: &OrderPlaced,
                api: &Api,
            ) -> Result<ChargeResponse, Error> {
                crash_point(api).await;
                post(msg, api).await
            }

            /// Delivers a [`plan`] one delivery at a time; a delivery told "in progress"
            /// is delivered again after the time its lease has left.
            async fn run(partner: &Partner, mark_first: bool) -> (Run, impl std::ops::Deref<Target = sqlx::Pool<$database>>) {
                let pool = super::$db::pool().await;
                let client = client();
                let (messages, mut doomed, mut deliveries) = plan();
                let mut run = Run {
                    crashed: vec![false; MESSAGES],
                    ..Run::default()
                };
                while let Some(n) = deliveries.pop_front() {
                    let msg = messages[n].clone();
                    let before = partner.requests();
                    let crash = std::mem::take(&mut doomed[n]).then(|| Arc::new(Notify::new()));
                    let api = Api {
                        client: client.clone(),
                        url: partner.url(),
                        send_key: !mark_first,
                        crash: crash.clone(),
                    };
                    let mut task = tokio::spawn({
                        let (pool, msg) = ((*pool).clone(), msg.clone());
                        async move {
                            if mark_first {
                                charge_marked(&pool, &msg, &api).await
                            } else {
                                charge_leased(&pool, &msg, &api).await
                            }
                        }
                    });
                    if let Some(crash) = crash {
                        tokio::select! {
                            reached = timeout(PATIENCE, crash.notified()) => {
                                reached.expect("the crash point was reached");
                            }
                            ended = &mut task => panic!("the crashing delivery ended: {ended:?}"),
                        }
                        let expected = if mark_first { before } else { before + 1 };
                        assert_eq!(partner.requests(), expected, "mark-first crashes before the call");
                        task.abort();
                        assert!(task.await.unwrap_err().is_cancelled());
                        assert_eq!(claims(&*pool, if mark_first { MARKED } else { LEASED }, &msg.id).await, 1, "the row stays in progress");
                        run.crashes += 1;
                        run.crashed[n] = true;
                        deliveries.push_back(n);
                        continue;
                    }
                    let outcome = timeout(PATIENCE, task)
                        .await
                        .expect("the delivery ends")
                        .expect("the handler does not panic")
                        .expect("the handler succeeds");
                    match outcome {
                        LeaseOutcome::Processed(charge) => {
                            run.processed += 1;
                            assert_eq!(partner.requests(), before + 1, "one request");
                            assert_eq!(charge.order_id, msg.order_id);
                        }
                        LeaseOutcome::Duplicate(duplicate) => {
                            run.duplicates += 1;
                            let unknown = run.crashed[n] && mark_first;
                            let expected = if unknown { Duplicate::OutcomeUnknown } else { Duplicate::AlreadyProcessed };
                            assert_eq!(duplicate, expected, "{}", msg.id);
                            assert_eq!(partner.requests(), before, "a duplicate calls nobody");
                        }
                        LeaseOutcome::InProgress(busy) => {
                            assert!(run.crashed[n], "only a crashed delivery's lease is left to run out");
                            assert_eq!(partner.requests(), before, "in progress calls nobody");
                            tokio::time::sleep(busy.remaining()).await;
                            deliveries.push_back(n);
                        }
                    }
                }
                run.messages = messages;
                (run, pool)
            }

            #[tokio::test]
            async fn under_a_lease_with_the_key_one_charge_per_message() {
                let partner = Partner::start(Keys::Honoured).await.unwrap();
                let (run, pool) = run(&partner, false).await;
                for msg in &run.messages {
                    assert_eq!(partner.charges_for(&msg.order_id), 1, "{}", msg.id);
                    assert_eq!(claims(&*pool, LEASED, &msg.id).await, 1);
                    assert!(Ledger::new(&*pool).processed_at(LEASED, msg.id.as_str()).await.unwrap().is_some());
                }
                assert_eq!(run.processed, MESSAGES);
                assert_eq!(run.crashes, MESSAGES / 3);
                assert_eq!(partner.charges().len(), MESSAGES);
                assert_eq!(partner.replays(), run.crashes, "each taken-over call was replayed");
            }

            #[tokio::test]
            async fn mark_first_loses_the_crashed_charges_and_lists_each() {
                let partner = Partner::start(Keys::Ignored).await.unwrap();
                let (run, pool) = run(&partner, true).await;
                let ledger = Ledger::new(&*pool);
                let unresolved = ledger.unresolved(MARKED, 10_000).await.unwrap();
                for (msg, &crashed) in run.messages.iter().zip(&run.crashed) {
                    assert_eq!(partner.charges_for(&msg.order_id), usize::from(!crashed), "{}", msg.id);
                    let listed = unresolved.iter().find(|row| row.message_id() == msg.id);
                    assert_eq!(listed.map(|row| row.status()), crashed.then_some(UnresolvedStatus::OutcomeUnknown), "{}", msg.id);
                    assert_eq!(ledger.processed_at(MARKED, msg.id.as_str()).await.unwrap().is_some(), !crashed);
                }
                assert_eq!(run.processed, MESSAGES - run.crashes);
                assert_eq!(partner.charges().len(), MESSAGES - run.crashes, "the documented loss");
            }
        }
    };
}

leased_partner_suite!(postgres_leased, database = sqlx::Postgres, db = postgres_db);
leased_partner_suite!(mysql_leased, database = sqlx::MySql, db = mysql_db);
leased_partner_suite!(sqlite_leased, database = sqlx::Sqlite, db = sqlite_db);

mod postgres_db {
    pub async fn pool() -> Box<sqlx::PgPool> {
        Box::new(dedup_suite::postgres().await)
    }
}

mod mysql_db {
    pub async fn pool() -> Box<sqlx::MySqlPool> {
        Box::new(dedup_suite::mysql().await)
    }
}

mod sqlite_db {
    pub async fn pool() -> dedup_suite::TempSqlite {
        dedup_suite::sqlite().await
    }
}

/// The stand-in itself, as the cases above rely on it: with keys honoured, a repeat gets
/// the first response and charges nothing, and a key reused with other parameters is
/// refused; with keys ignored, every request charges.
#[tokio::test]
async fn the_partner_replays_a_keyed_request_and_refuses_a_reused_key() {
    let client = client();
    let body = |amount_cents| ChargeRequest {
        order_id: "order-1".to_owned(),
        amount_cents,
    };
    let post = |url: String, key: Option<&'static str>, amount_cents| {
        let mut request = client.post(url).json(&body(amount_cents));
        if let Some(key) = key {
            request = request.header(IDEMPOTENCY_KEY, key);
        }
        request.send()
    };

    let partner = Partner::start(Keys::Honoured).await.unwrap();
    let first = post(partner.url(), Some("charge:evt_1"), 700)
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert!(first.headers().get(REPLAYED).is_none());
    let first: ChargeResponse = first.json().await.unwrap();
    let repeat = post(partner.url(), Some("charge:evt_1"), 700)
        .await
        .unwrap();
    assert_eq!(repeat.status(), 200);
    assert_eq!(repeat.headers()[REPLAYED], "true");
    assert_eq!(repeat.json::<ChargeResponse>().await.unwrap(), first);
    let reused = post(partner.url(), Some("charge:evt_1"), 701)
        .await
        .unwrap();
    assert_eq!(reused.status(), 400);
    let unkeyed = post(partner.url(), None, 700).await.unwrap();
    assert_ne!(unkeyed.json::<ChargeResponse>().await.unwrap().id, first.id);
    assert_eq!(partner.charges().len(), 2);
    assert_eq!((partner.requests(), partner.replays()), (4, 1));

    let ignoring = Partner::start(Keys::Ignored).await.unwrap();
    for _ in 0..2 {
        let response = post(ignoring.url(), Some("charge:evt_1"), 700)
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    assert_eq!(ignoring.charges_for("order-1"), 2);
    assert_eq!(ignoring.replays(), 0);
}
