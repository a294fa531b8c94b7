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
//! - `effect = "mark-first"` is not in this version: the output says so.
//!
//! The summary is read back from the server's records and the dedup table.
//! `cargo run --example partner_api --features http` (no database server needed).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::{IdempotencyKey, Outcome, idempotent};
use dedup_suite::partner::{ChargeRequest, ChargeResponse, IDEMPOTENCY_KEY, Keys, Partner};
use sqlx::SqliteConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
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
}

const MESSAGES: usize = 24;

#[tokio::main]
async fn main() -> Result<(), Error> {
    println!("{MESSAGES} order messages, each delivered twice; every fourth crashes between");
    println!("its HTTP call and its COMMIT once, and is delivered again. Embedded SQLite.\n");

    let keyed = scenario(Keys::Honoured).await?;
    print("send-first, Idempotency-Key honoured by the server", &keyed);
    let once = keyed.charges == MESSAGES && keyed.orders_charged_once == MESSAGES;
    let verdict = if once && keyed.dedup_rows == MESSAGES as i64 {
        "yes"
    } else {
        "NO"
    };
    println!("  one charge and one dedup row per message: {verdict}\n");

    let unkeyed = scenario(Keys::Ignored).await?;
    print(
        "send-first, the server ignores the Idempotency-Key",
        &unkeyed,
    );
    let extra = unkeyed.charges as i64 - MESSAGES as i64;
    println!(
        "  duplicate charges:   {extra:>4}  (one per crash: the duplicate send-first allows)\n"
    );

    println!("mark-first: not available in this version (`effect = \"mark-first\"` is a");
    println!("  compile error). It would commit the mark before the call, so the same crash");
    println!("  would lose the charge instead of repeating it. Not run here.");

    for s in [&keyed, &unkeyed] {
        if s.requests != s.deliveries - s.duplicates {
            return Err("a duplicate called the server, or a delivery did not".into());
        }
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
async fn scenario(keys: Keys) -> Result<Summary, Error> {
    let partner = Partner::start(keys).await?;
    let path = std::env::temp_dir().join(format!("dedup-partner-{}.db", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePool::connect_with(options).await?;
    let result = deliver(&pool, &partner).await;
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let (deliveries, duplicates, crashes, dedup_rows) = result?;
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
    })
}

/// Delivers every message twice, in a shuffled order (a fixed seed), one delivery at a
/// time; the first delivery of every fourth message crashes after its call. Returns the
/// deliveries, duplicates and crashes, and the dedup rows it left.
async fn deliver(
    pool: &SqlitePool,
    partner: &Partner,
) -> Result<(usize, usize, usize, i64), Error> {
    dedup_runtime::migrate(pool).await?; // creates the dedup table, `processed_messages`
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
            async move { charge_order(&pool, &msg, &api).await }
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
        // Processed or a duplicate: acknowledge either way. An error: stop the example.
        if let Outcome::Duplicate(_) = task.await?? {
            duplicates += 1;
        }
    }
    let sql = "SELECT COUNT(*) FROM processed_messages WHERE consumer = 'billing'";
    let dedup_rows = sqlx::query_scalar(sql).fetch_one(pool).await?;
    Ok((deliveries, duplicates, crashes, dedup_rows))
}
