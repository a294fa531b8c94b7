//! A payment consumer that charges a card through a partner's HTTP API, effectively once.
//!
//! The card is charged by a real HTTP server on loopback (`dedup_suite::partner`, a
//! stand-in for a provider such as Stripe), through a real HTTP client, from an
//! `#[idempotent(…, effect = "send-first")]` handler on SQLite. A broker (an in-memory
//! queue) delivers each order message twice, and on some messages the consumer "crashes"
//! between the HTTP call and its `COMMIT`: the handler's task is aborted after the call
//! returned, its transaction rolls back, and the broker delivers the message again.
//!
//! - With the key (`Idempotency-Key: charge:<message id>`, honoured by the server): the
//!   repeated call after a crash is answered with the first charge; one charge per message.
//! - Without a key (the same requests, to a server that ignores the key): each crash
//!   window becomes a second charge — the duplicate send-first allows, counted here.
//! - Send-first under a lease (`lease = "500ms"`), with the key: the HTTP call runs with
//!   no transaction open; the crashed delivery's lease is "in progress" for its copies
//!   until it ends, then the redelivery takes it over and calls again — the server answers
//!   with the first charge. One charge per message, recorded with its charge id.
//! - `effect = "mark-first"`, without a key: the mark commits before the call, and on some
//!   messages the consumer crashes between the two. The redelivery after the lease is
//!   acknowledged without a call: the charge is lost — the risk mark-first declares — and
//!   every lost one is listed as "outcome unknown" by `Ledger::unresolved`, for an
//!   operator to resolve.
//!
//! The summary is read back from the server's records and the dedup table.
//! `cargo run --example partner_api --features http` (no database server needed).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::{
    Duplicate, IdempotencyKey, Lease, LeaseOutcome, Ledger, Outcome, UnresolvedStatus, idempotent,
};
use dedup_suite::partner::{ChargeRequest, ChargeResponse, IDEMPOTENCY_KEY, Keys, Partner};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
use sqlx::{Sqlite, SqliteConnection};
use tokio::sync::Notify;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The message: "order `order_id` was placed; charge `amount_cents`".
#[derive(Debug, Clone)]
struct OrderPlaced {
    id: String,
    order_id: String,
    amount_cents: i64,
}

/// How the consumer reaches the partner.
struct Api {
    client: reqwest::Client,
    url: String,
    /// Set on a delivery that crashes: the "process dies" after the call.
    crash: Option<Arc<Notify>>,
}

/// Charges the order. `effect = "send-first"`: the body may leave `tx` unused; the call
/// happens before the processed mark commits, so a crash between the two repeats the call
/// on redelivery — the idempotency key is what makes the server drop that repeat.
#[idempotent(consumer = "billing", key = msg.id, effect = "send-first")]
async fn charge_order(
    tx: &mut SqliteConnection,
    msg: &OrderPlaced,
    api: &Api,
) -> Result<ChargeResponse, Error> {
    let key = IdempotencyKey::new("charge", &msg.id); // `charge:<message id>`
    let body = ChargeRequest {
        order_id: msg.order_id.clone(),
        amount_cents: msg.amount_cents,
    };
    let request = api
        .client
        .post(&api.url)
        .header(IDEMPOTENCY_KEY, key.as_str());
    let response = request.json(&body).send().await?.error_for_status()?;
    let charge: ChargeResponse = response.json().await?;
    if let Some(crash) = &api.crash {
        // The call returned; the process dies before `COMMIT`: the delivery loop aborts
        // this task while it waits here.
        crash.notify_one();
        std::future::pending::<()>().await;
    }
    Ok(charge)
}

/// Charges the order under a lease: the claim commits the row in progress, the HTTP call
/// runs with no transaction open and no connection held, and the charge id is recorded in
/// the transaction that marks the row processed. A crash after the call leaves the lease to
/// run out; the next delivery then takes it over and calls again, with the same key.
#[idempotent(consumer = "billing-leased", key = msg.id, effect = "send-first", lease = "500ms")]
async fn charge_order_leased(
    lease: &mut Lease<'_, Sqlite>,
    msg: &OrderPlaced,
    api: &Api,
) -> Result<ChargeResponse, Error> {
    let charge = post_charge(msg, api, true).await?;
    crash_point(api).await; // after the call, before the completion
    let tx = lease.transaction().await?;
    sqlx::query("INSERT INTO charges (message_id, charge_id) VALUES (?1, ?2)")
        .bind(&msg.id)
        .bind(&charge.id)
        .execute(&mut *tx)
        .await?;
    Ok(charge)
}

/// Charges the order marked first, without a key: the mark commits before the call. A
/// crash between the two loses the charge; its row says so (outcome unknown).
#[idempotent(consumer = "billing-mark-first", key = msg.id, effect = "mark-first", lease = "500ms")]
async fn charge_order_mark_first(
    lease: &mut Lease<'_, Sqlite>,
    msg: &OrderPlaced,
    api: &Api,
) -> Result<ChargeResponse, Error> {
    crash_point(api).await; // after the mark, before the call
    post_charge(msg, api, false).await
}

/// One charge request, with `Idempotency-Key: charge:<message id>` or without it.
async fn post_charge(msg: &OrderPlaced, api: &Api, keyed: bool) -> Result<ChargeResponse, Error> {
    let body = ChargeRequest {
        order_id: msg.order_id.clone(),
        amount_cents: msg.amount_cents,
    };
    let mut request = api.client.post(&api.url);
    if keyed {
        request = request.header(
            IDEMPOTENCY_KEY,
            IdempotencyKey::new("charge", &msg.id).as_str(),
        );
    }
    let response = request.json(&body).send().await?.error_for_status()?;
    Ok(response.json().await?)
}

/// On a delivery that crashes, "the process dies" here: the delivery loop aborts the task
/// while it waits.
async fn crash_point(api: &Api) {
    if let Some(crash) = &api.crash {
        crash.notify_one();
        std::future::pending::<()>().await;
    }
}

/// The three consumers the example runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    SendFirst,
    Leased,
    MarkFirst,
}

/// What one delivery's call answered.
#[derive(Debug)]
enum Answer {
    Ack {
        duplicate: bool,
        unknown: bool,
    },
    /// Another delivery's lease: redeliver after this long.
    Later(Duration),
}

async fn call(
    mode: Mode,
    pool: &SqlitePool,
    msg: &OrderPlaced,
    api: &Api,
) -> Result<Answer, Error> {
    let leased = |outcome: LeaseOutcome<ChargeResponse>| match outcome {
        LeaseOutcome::Processed(_) => Answer::Ack {
            duplicate: false,
            unknown: false,
        },
        LeaseOutcome::Duplicate(duplicate) => Answer::Ack {
            duplicate: true,
            unknown: duplicate == Duplicate::OutcomeUnknown,
        },
        LeaseOutcome::InProgress(busy) => Answer::Later(busy.remaining()),
    };
    Ok(match mode {
        Mode::SendFirst => {
            let outcome = charge_order(pool, msg, api).await?;
            Answer::Ack {
                duplicate: matches!(outcome, Outcome::Duplicate(_)),
                unknown: false,
            }
        }
        Mode::Leased => leased(charge_order_leased(pool, msg, api).await?),
        Mode::MarkFirst => leased(charge_order_mark_first(pool, msg, api).await?),
    })
}

impl Mode {
    fn consumer(self) -> &'static str {
        match self {
            Mode::SendFirst => "billing",
            Mode::Leased => "billing-leased",
            Mode::MarkFirst => "billing-mark-first",
        }
    }
}

/// What one scenario left behind, read from the server and the database.
struct Summary {
    deliveries: usize,
    duplicates: usize,
    crashes: usize,
    requests: usize,
    replays: usize,
    charges: usize,
    orders_charged_once: usize,
    dedup_rows: i64,
    /// Deliveries told "in progress" (another delivery's lease), redelivered later.
    in_progress: usize,
    /// Deliveries acknowledged as outcome unknown (mark-first), and the rows listed so.
    unknown_acked: usize,
    unknown_rows: usize,
    /// Charge ids recorded in the completion's transaction (the leased consumer).
    recorded: i64,
}

const MESSAGES: usize = 24;

#[tokio::main]
async fn main() -> Result<(), Error> {
    println!("{MESSAGES} order messages, each delivered twice; every fourth crashes once and is");
    println!("delivered again: send-first between its HTTP call and its COMMIT, mark-first");
    println!("between its mark and its HTTP call. Embedded SQLite.\n");

    let keyed = scenario(Mode::SendFirst, Keys::Honoured).await?;
    print("send-first, Idempotency-Key honoured by the server", &keyed);
    let once = keyed.charges == MESSAGES && keyed.orders_charged_once == MESSAGES;
    let verdict = if once && keyed.dedup_rows == MESSAGES as i64 {
        "yes"
    } else {
        "NO"
    };
    println!("  one charge and one dedup row per message: {verdict}\n");

    let unkeyed = scenario(Mode::SendFirst, Keys::Ignored).await?;
    print(
        "send-first, the server ignores the Idempotency-Key",
        &unkeyed,
    );
    let extra = unkeyed.charges as i64 - MESSAGES as i64;
    println!(
        "  duplicate charges:   {extra:>4}  (one per crash: the duplicate send-first allows)\n"
    );

    let leased = scenario(Mode::Leased, Keys::Honoured).await?;
    print(
        "send-first under a 500 ms lease, no transaction open during the call, with the key",
        &leased,
    );
    println!(
        "  told in progress:    {:>4}  (copies during a crashed delivery's lease, redelivered)",
        leased.in_progress
    );
    println!(
        "  charge ids recorded: {:>4}  (in the completion's transaction)",
        leased.recorded
    );
    let leased_once = leased.charges == MESSAGES
        && leased.orders_charged_once == MESSAGES
        && leased.dedup_rows == MESSAGES as i64
        && leased.recorded == MESSAGES as i64;
    println!(
        "  one charge and one dedup row per message: {}\n",
        if leased_once { "yes" } else { "NO" }
    );

    let marked = scenario(Mode::MarkFirst, Keys::Ignored).await?;
    print(
        "mark-first, no key, crashing after the mark and before the call",
        &marked,
    );
    let lost = MESSAGES - marked.charges;
    println!("  charges lost:        {lost:>4}  (one per crash: the loss mark-first allows)");
    println!(
        "  acked, outcome unknown: {:>2}  (redeliveries after the lease: no call)",
        marked.unknown_acked
    );
    println!(
        "  told in progress:    {:>4}  (copies during a crashed delivery's lease, redelivered)",
        marked.in_progress
    );
    println!(
        "  rows listed unknown: {:>4}  (Ledger::unresolved: every lost charge is visible)",
        marked.unknown_rows
    );

    // Every delivery that was not acknowledged as a duplicate, told in progress, or (mark-
    // first) crashed before its call, sent the server exactly one request.
    for (s, crashed_before_call) in [
        (&keyed, 0),
        (&unkeyed, 0),
        (&leased, 0),
        (&marked, marked.crashes),
    ] {
        if s.requests != s.deliveries - s.duplicates - s.in_progress - crashed_before_call {
            return Err("a duplicate called the server, or a delivery did not".into());
        }
    }
    if !leased_once {
        return Err("under a lease with the key, a message was charged other than once".into());
    }
    if lost != marked.crashes
        || marked.unknown_rows != marked.crashes
        || marked.orders_charged_once != MESSAGES - marked.crashes
    {
        return Err(
            "mark-first: the lost charges are not one per crash, each listed unknown".into(),
        );
    }
    if verdict != "yes" {
        return Err("with the key, a message was charged other than once".into());
    }
    let once = unkeyed.orders_charged_once + unkeyed.crashes == MESSAGES;
    if extra != unkeyed.crashes as i64 || !once || unkeyed.dedup_rows != MESSAGES as i64 {
        return Err("without a key, the duplicates are not one per crash".into());
    }
    Ok(())
}

fn print(title: &str, s: &Summary) {
    println!("{title}:");
    println!(
        "  deliveries:          {:>4}  ({} crashed, redelivered)",
        s.deliveries, s.crashes
    );
    println!("  duplicates acked:    {:>4}  (no HTTP call)", s.duplicates);
    println!(
        "  requests received:   {:>4}  ({} replayed)",
        s.requests, s.replays
    );
    println!(
        "  charges performed:   {:>4}  (server's records)",
        s.charges
    );
    println!("  orders charged once: {:>4}", s.orders_charged_once);
    println!("  dedup rows:          {:>4}", s.dedup_rows);
}

/// One run of the broker against a fresh partner and a fresh SQLite file.
async fn scenario(mode: Mode, keys: Keys) -> Result<Summary, Error> {
    let partner = Partner::start(keys).await?;
    let path = std::env::temp_dir().join(format!("dedup-partner-{}.db", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePool::connect_with(options).await?;
    let result = deliver(mode, &pool, &partner).await;
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let Delivered {
        deliveries,
        duplicates,
        crashes,
        dedup_rows,
        in_progress,
        unknown_acked,
        unknown_rows,
        recorded,
    } = result?;
    let once = |msg: usize| partner.charges_for(&format!("order-{msg}")) == 1;
    Ok(Summary {
        deliveries,
        duplicates,
        crashes,
        requests: partner.requests(),
        replays: partner.replays(),
        charges: partner.charges().len(),
        orders_charged_once: (0..MESSAGES).filter(|&msg| once(msg)).count(),
        dedup_rows,
        in_progress,
        unknown_acked,
        unknown_rows,
        recorded,
    })
}

/// What the broker loop counted, and what it read back from the database.
struct Delivered {
    deliveries: usize,
    duplicates: usize,
    crashes: usize,
    dedup_rows: i64,
    in_progress: usize,
    unknown_acked: usize,
    unknown_rows: usize,
    recorded: i64,
}

/// Delivers every message twice, in a shuffled order (a fixed seed), one delivery at a
/// time; the first delivery of every fourth message crashes after its call. Returns the
/// deliveries, duplicates and crashes, and the dedup rows it left.
async fn deliver(mode: Mode, pool: &SqlitePool, partner: &Partner) -> Result<Delivered, Error> {
    dedup_runtime::migrate(pool).await?; // creates the dedup table, `processed_messages`
    sqlx::raw_sql("CREATE TABLE charges (message_id TEXT PRIMARY KEY, charge_id TEXT NOT NULL)")
        .execute(pool)
        .await?;
    let client = reqwest::Client::builder()
        .no_proxy() // loopback: never through a proxy from the environment
        .timeout(Duration::from_secs(10))
        .build()?;
    let messages = (0..MESSAGES).map(|n| OrderPlaced {
        id: format!("evt_{n:03}"),
        order_id: format!("order-{n}"),
        amount_cents: 1_000 + 25 * n as i64,
    });
    let mut doomed: Vec<bool> = (0..MESSAGES).map(|n| n % 4 == 1).collect();
    let mut broker: Vec<(usize, OrderPlaced)> =
        messages.enumerate().flat_map(|m| [m.clone(), m]).collect();
    dedup_suite::Shuffle::new(0x0c4a_26e5).shuffle(&mut broker);
    let mut broker = VecDeque::from(broker);

    let (mut deliveries, mut duplicates, mut crashes) = (0, 0, 0);
    let (mut in_progress, mut unknown_acked) = (0, 0);
    while let Some((n, msg)) = broker.pop_front() {
        deliveries += 1;
        let crash = std::mem::take(&mut doomed[n]).then(|| Arc::new(Notify::new()));
        let api = Api {
            client: client.clone(),
            url: partner.url(),
            crash: crash.clone(),
        };
        let mut task = tokio::spawn({
            let (pool, msg) = (pool.clone(), msg.clone());
            async move { call(mode, &pool, &msg, &api).await }
        });
        if let Some(crash) = crash {
            tokio::select! {
                () = crash.notified() => {} // the call returned, the COMMIT has not run
                ended = &mut task => return Err(format!("no crash point: {ended:?}").into()),
            }
            task.abort(); // the process dies: the transaction rolls back, no mark
            assert!(task.await.is_err_and(|error| error.is_cancelled()));
            crashes += 1;
            broker.push_back((n, msg)); // never acknowledged: the broker delivers it again
            continue;
        }
        // Processed or a duplicate: acknowledge either way. In progress elsewhere: the
        // broker delivers it again after the time the lease has left. An error: stop.
        match task.await?? {
            Answer::Ack { duplicate, unknown } => {
                duplicates += usize::from(duplicate);
                unknown_acked += usize::from(unknown);
            }
            Answer::Later(after) => {
                in_progress += 1;
                tokio::time::sleep(after).await;
                broker.push_back((n, msg));
            }
        }
    }
    let sql = "SELECT COUNT(*) FROM processed_messages WHERE consumer = ?1 AND state IS NULL";
    let dedup_rows = sqlx::query_scalar(sql)
        .bind(mode.consumer())
        .fetch_one(pool)
        .await?;
    let unknown_rows = Ledger::new(pool)
        .unresolved(mode.consumer(), 1_000)
        .await?
        .iter()
        .filter(|row| row.status() == UnresolvedStatus::OutcomeUnknown)
        .count();
    let recorded = sqlx::query_scalar("SELECT COUNT(*) FROM charges")
        .fetch_one(pool)
        .await?;
    Ok(Delivered {
        deliveries,
        duplicates,
        crashes,
        dedup_rows,
        in_progress,
        unknown_acked,
        unknown_rows,
        recorded,
    })
}
