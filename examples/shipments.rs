//! Business-key dedup: one shipment per order, however many messages ask for it.
//!
//! Two upstream services both publish "create the shipment for order N" — with their
//! own message ids, so the processed-message table alone cannot tell the copies apart.
//! The order id is the business key: a unique index on `shipments.order_id` makes the
//! second insert fail, and `unique = "shipments_order_id_key"` turns exactly that
//! failure into a duplicate outcome (rolling back everything the body did), while any
//! other failure stays an error. The handler also records its message id (`key`), so a
//! plain redelivery is caught before the body runs.
//!
//! ```text
//! cargo run --example shipments
//! ```
//!
//! Runs on an embedded SQLite file in the temporary directory, removed at the end. Only
//! there: the handler's first parameter, `&mut SqliteConnection`, picks the backend at
//! compile time, so `DATABASE_URL` is not used (the example says so when it is set).
//! `examples/any_backend.rs` is a consumer written once per backend and run on the
//! database `DATABASE_URL` names; on PostgreSQL and MariaDB, business keys work the same,
//! with the constraint identified as the guide's "Business keys" chapter describes.

use std::time::Duration;

use dedup_runtime::{Duplicate, Outcome, idempotent};
use sqlx::SqliteConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// "Create the shipment for this order", as published by one of two services.
#[derive(Debug, Clone)]
struct ShipOrder {
    /// The publishing service's message id: different for each publisher.
    id: String,
    order_id: i64,
    publisher: &'static str,
}

#[idempotent(consumer = "shipping", key = msg.id, unique = "shipments_order_id_key")]
async fn create_shipment(tx: &mut SqliteConnection, msg: &ShipOrder) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO shipments (order_id, requested_by) VALUES (?, ?)")
        .bind(msg.order_id)
        .bind(msg.publisher)
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE orders SET status = 'shipping' WHERE id = ?")
        .bind(msg.order_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Not echoed: a URL may hold a password.
    if std::env::var_os("DATABASE_URL").is_some() {
        eprintln!(
            "note: DATABASE_URL is set and not used: this example runs on an embedded SQLite \
             file (its handler takes `&mut SqliteConnection`). `cargo run --example \
             any_backend` runs a consumer on the database it names."
        );
    }
    let path = std::env::temp_dir().join(format!("dedup-shipments-{}.db", std::process::id()));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await?;
    let result = run(&pool).await;
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    result
}

async fn run(pool: &sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    dedup_runtime::migrate(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
         CREATE TABLE shipments (order_id INTEGER NOT NULL, requested_by TEXT NOT NULL);
         -- The business key. A named index: SQLite reports the violated columns, and
         -- dedup resolves this name to them.
         CREATE UNIQUE INDEX shipments_order_id_key ON shipments (order_id);",
    )
    .execute(pool)
    .await?;

    const ORDERS: i64 = 50;
    for id in 1..=ORDERS {
        sqlx::query("INSERT INTO orders (id, status) VALUES (?, 'paid')")
            .bind(id)
            .execute(pool)
            .await?;
    }

    // Both services ask for every order; the billing service's messages are also
    // redelivered once by the broker (same message id).
    let mut deliveries = Vec::new();
    for order_id in 1..=ORDERS {
        let billing = ShipOrder {
            id: format!("billing-{order_id}"),
            order_id,
            publisher: "billing",
        };
        let checkout = ShipOrder {
            id: format!("checkout-{order_id}"),
            order_id,
            publisher: "checkout",
        };
        deliveries.extend([billing.clone(), checkout, billing]);
    }

    let (mut processed, mut by_id, mut by_business_key) = (0, 0, 0);
    for msg in &deliveries {
        match create_shipment(pool, msg).await? {
            Outcome::Processed(()) => processed += 1,
            Outcome::Duplicate(Duplicate::AlreadyProcessed) => by_id += 1,
            Outcome::Duplicate(Duplicate::BusinessKey { .. }) => by_business_key += 1,
            Outcome::Duplicate(other) => return Err(format!("unexpected: {other}").into()),
        }
        // Either way, the message would now be acknowledged.
    }

    let shipments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM shipments")
        .fetch_one(pool)
        .await?;
    let distinct: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT order_id) FROM shipments")
        .fetch_one(pool)
        .await?;
    let shipping: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE status = 'shipping'")
        .fetch_one(pool)
        .await?;

    println!("orders:                          {ORDERS}");
    println!("deliveries:                      {}", deliveries.len());
    println!("shipments created:               {processed}");
    println!("duplicates by message id:        {by_id}");
    println!("duplicates by business key:      {by_business_key}");
    println!("shipment rows in the database:   {shipments} ({distinct} distinct orders)");
    let ok = shipments == ORDERS && distinct == ORDERS && shipping == ORDERS;
    println!(
        "one shipment per order:          {}",
        if ok { "yes" } else { "NO" }
    );
    if ok {
        Ok(())
    } else {
        Err("an order was shipped twice or not at all".into())
    }
}
