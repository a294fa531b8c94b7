//! Quickstart: an effectively-once payment consumer on top of an at-least-once broker.
//!
//! A broker (here an in-memory queue) delivers 200 payment messages the way real brokers
//! do: some more than once, out of order, some to two consumers at the same moment, and
//! some again after the consumer committed its work but "crashed" before acknowledging.
//! The `#[idempotent]` handler below books each payment; the payment row and the message
//! id commit in one transaction, so however often a message arrives, it is booked once.
//! At the end the program reads the database back and checks that.
//!
//! `cargo run --example quickstart`: embedded SQLite in a temporary file, removed at the
//! end, no server needed. `examples/any_backend.rs` runs it on PostgreSQL or MySQL too.

use std::collections::VecDeque;
use std::time::Duration;

use dedup_runtime::{Outcome, idempotent};
use futures_util::future::try_join_all;
use sqlx::SqliteConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};

/// The message: "`amount_cents` were paid for `order_id`". The producer gave it an `id`;
/// every copy carries the same one, so it is the dedup key.
#[derive(Debug, Clone)]
struct Payment {
    id: String,
    order_id: String,
    amount_cents: i64,
}

/// Books one payment. `#[idempotent]` rewrites it into (conceptually)
/// `async fn record_payment(db: &SqlitePool, msg: &Payment) -> Result<Outcome<()>, sqlx::Error>`
/// (your own connection or transaction works too): it begins a transaction, records `msg.id`
/// for consumer "quickstart", runs this body in the same transaction and commits both. If
/// `msg.id` was recorded before, the body does not run and the outcome is a duplicate.
#[idempotent(consumer = "quickstart", key = msg.id)]
async fn record_payment(tx: &mut SqliteConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO quickstart_payments (order_id, amount_cents) VALUES (?, ?)")
        .bind(&msg.order_id)
        .bind(msg.amount_cents)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("dedup-quickstart-{}.db", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePool::connect_with(options).await?;
    let result = run(&pool).await;
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    result
}

async fn run(pool: &SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    dedup_runtime::migrate(pool).await?; // creates the dedup table, `processed_messages`
    // No unique constraint (an order may be paid in installments): only the dedup record
    // stands between a redelivery and a second payment row.
    let payments_table = "CREATE TABLE quickstart_payments (order_id TEXT, amount_cents INTEGER)";
    sqlx::query(payments_table).execute(pool).await?;

    let (payments, mut broker) = plan();
    let (mut delivered, mut processed, mut duplicates, mut crashes) = (0, 0, 0, 0);
    while let Some(copies) = broker.pop_front() {
        // Usually one copy; several are a message handed to several consumers at the same
        // moment. They run concurrently: the later ones wait for the first one's commit.
        let handled = copies.iter().map(|(msg, _)| record_payment(pool, msg));
        // An error (say, the database is down) would mean: do not acknowledge, let the
        // broker redeliver. Here it stops the example.
        let outcomes = try_join_all(handled).await?;
        for ((msg, crash_before_ack), outcome) in copies.into_iter().zip(outcomes) {
            delivered += 1;
            match outcome {
                Outcome::Processed(()) => processed += 1,
                // Processed before, by this or another consumer: the body did not run.
                Outcome::Duplicate(_) => duplicates += 1,
            }
            if crash_before_ack {
                // Committed, but no ack reached the broker: it delivers the message again.
                crashes += 1;
                broker.push_back(vec![(msg, false)]);
            } // else acknowledge: a processed message and a duplicate alike.
        }
    }

    // The effects, read back from the database.
    let (rows, booked_cents): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COALESCE(SUM(amount_cents), 0) FROM quickstart_payments")
            .fetch_one(pool)
            .await?;
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM processed_messages WHERE consumer = 'quickstart'")
            .fetch_one(pool)
            .await?;
    let unique = payments.len() as i64;
    let sent_cents: i64 = payments.iter().map(|payment| payment.amount_cents).sum();
    let exact = rows == unique && booked_cents == sent_cents;
    let (booked, sent) = (cents(booked_cents), cents(sent_cents));
    let verdict = if exact { "yes" } else { "NO" };

    println!("backend: SQLite (temporary file)");
    println!("deliveries:          {delivered:>8}");
    println!("crashes before ack:  {crashes:>8}  (redelivered)");
    println!("processed:           {processed:>8}");
    println!("duplicates skipped:  {duplicates:>8}");
    println!("effects applied:     {rows:>8}  (rows in quickstart_payments)");
    println!("unique messages:     {unique:>8}");
    println!("amount booked:       {booked:>8}  (sent: {sent})");
    println!("effects == unique messages: {verdict}");

    if !exact || records != unique || processed != unique {
        let found = format!("{rows} payments, {records} dedup records, {processed} processed");
        return Err(format!("{unique} messages, but {found}").into());
    }
    Ok(())
}

/// The 200 messages, and the broker loaded with their deliveries: each message one to
/// three times, in shuffled order, a quarter of the repeated ones as simultaneous copies;
/// one delivery in twenty crashes before its ack. A fixed seed: the same on every run.
fn plan() -> (Vec<Payment>, VecDeque<Vec<(Payment, bool)>>) {
    let mut random = dedup_suite::Shuffle::new(0x0051_c0de);
    let payments: Vec<Payment> = (0..200)
        .map(|n| Payment {
            id: format!("payment-{n}"),
            order_id: format!("order-{}", n % 50),
            amount_cents: 100 + (random.next_u64() % 9_900) as i64,
        })
        .collect();
    let mut groups: Vec<Vec<Payment>> = Vec::new();
    for payment in &payments {
        let copies = 1 + (random.next_u64() % 10 / 4) as usize; // 1, 2, 3 at 40%, 40%, 20%
        if copies > 1 && random.next_u64().is_multiple_of(4) {
            groups.push(vec![payment.clone(); copies]);
        } else {
            groups.extend((0..copies).map(|_| vec![payment.clone()]));
        }
    }
    random.shuffle(&mut groups);
    let mut crash = || random.next_u64().is_multiple_of(20);
    let mut broker = VecDeque::new();
    for copies in groups {
        broker.push_back(copies.into_iter().map(|msg| (msg, crash())).collect());
    }
    (payments, broker)
}

fn cents(amount: i64) -> String {
    format!("{}.{:02}", amount / 100, amount % 100)
}
