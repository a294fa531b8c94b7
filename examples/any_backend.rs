//! The quickstart's consumer on any backend: PostgreSQL, MySQL/MariaDB or SQLite, chosen
//! by `DATABASE_URL`.
//!
//! `examples/quickstart.rs` is the introduction, written out for SQLite; this is the same
//! consumer, run wherever you point it. A broker (an in-memory queue) delivers 200 payment
//! messages at least once: some more than once, out of order, some as copies back to back
//! that two tasks handle at the same moment, and some again after the consumer committed
//! its work but "crashed" before acknowledging. Four consumer tasks handle the deliveries
//! with an `#[idempotent]` handler that inserts one row per payment into
//! `any_backend_payments`. At the end the example reads the rows and the dedup records
//! back and checks: one row and one record per message, and the amounts add up. The
//! handler's first parameter picks the backend, so a `macro_rules!` writes it once per
//! backend below; only the SQL placeholders differ.
//!
//! ```text
//! cargo run --example any_backend                    # a temporary SQLite file, no server
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example any_backend
//! DATABASE_URL=mysql://root@127.0.0.1:3306/test cargo run --example any_backend
//! ```
//!
//! On a server the tables outlive the run: message ids carry a per-run prefix, and only
//! this run's rows are counted. The program exits with an error if any payment was
//! booked twice or not at all.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::{Outcome, idempotent};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// Distinct messages the producer sends.
const MESSAGES: usize = 200;
/// Consumer tasks handling deliveries concurrently.
const WORKERS: u32 = 4;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The message: "`amount_cents` were paid for `order_id`". `id` is the message id the
/// producer assigned; it is the same on every copy, so it is the dedup key.
#[derive(Debug, Clone)]
struct Payment {
    id: String,
    order_id: String,
    amount_cents: i64,
}

/// The business table; this SQL is valid on all three backends. It has no unique
/// constraint (an order may be paid in several installments): only the dedup record
/// stands between a redelivery and a second payment row.
const CREATE_PAYMENTS: &str = "CREATE TABLE IF NOT EXISTS any_backend_payments (\
                               order_id VARCHAR(100) NOT NULL, \
                               amount_cents BIGINT NOT NULL)";

// ---------------------------------------------------------------------------------------
// The handler, once per backend
// ---------------------------------------------------------------------------------------

/// The handler's first parameter picks the database, so each backend gets its own copy of
/// the handler; this macro writes it, and the run that uses it, in a module per backend.
/// Only the SQL placeholders differ (`$1` on PostgreSQL, `?` on MySQL and SQLite).
macro_rules! backend {
    (
        $module:ident,
        connection = $connection:ty,
        database = $database:ty,
        insert_payment = $insert_payment:literal,
        this_runs_amounts = $this_runs_amounts:literal,
        this_runs_records = $this_runs_records:literal $(,)?
    ) => {
        mod $module {
            use super::*;

            /// Books one payment. `#[idempotent]` turns this into
            /// `async fn record_payment(db: impl Db<'_, Database>, msg: &Payment)
            ///     -> Result<Outcome<()>, sqlx::Error>`:
            /// given the pool, it begins a transaction, records `msg.id` for consumer
            /// "any-backend", runs this body on the same transaction and commits both, or
            /// returns `Outcome::Duplicate` without running the body if `msg.id` was
            /// recorded before.
            #[idempotent(consumer = "any-backend", key = msg.id)]
            async fn record_payment(
                tx: &mut $connection,
                msg: &Payment,
            ) -> Result<(), sqlx::Error> {
                sqlx::query($insert_payment)
                    .bind(&msg.order_id)
                    .bind(msg.amount_cents)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// Creates the tables, drains the broker with `WORKERS` tasks, and reads back
            /// what this run booked.
            pub async fn run(
                pool: &sqlx::Pool<$database>,
                broker: Arc<Broker>,
                run_id: &str,
            ) -> Result<Report, Error> {
                sqlx::query(CREATE_PAYMENTS).execute(pool).await?;
                dedup_runtime::migrate(pool).await?;

                let handler_pool = pool.clone();
                let tally = consume(broker, move |payment| {
                    let pool = handler_pool.clone();
                    async move { record_payment(&pool, &payment).await }
                })
                .await?;

                let amounts: Vec<i64> = sqlx::query_scalar($this_runs_amounts)
                    .bind(format!("{run_id}/%"))
                    .fetch_all(pool)
                    .await?;
                let records: i64 = sqlx::query_scalar($this_runs_records)
                    .bind(format!("{run_id}/%"))
                    .fetch_one(pool)
                    .await?;
                Ok(Report {
                    records,
                    tally,
                    rows: amounts.len(),
                    booked_cents: amounts.iter().sum(),
                })
            }
        }
    };
}

backend!(
    postgres,
    connection = sqlx::PgConnection,
    database = sqlx::Postgres,
    insert_payment = "INSERT INTO any_backend_payments (order_id, amount_cents) VALUES ($1, $2)",
    this_runs_amounts = "SELECT amount_cents FROM any_backend_payments WHERE order_id LIKE $1",
    this_runs_records = "SELECT COUNT(*) FROM processed_messages \
                         WHERE consumer = 'any-backend' AND message_id LIKE $1",
);

backend!(
    mysql,
    connection = sqlx::MySqlConnection,
    database = sqlx::MySql,
    insert_payment = "INSERT INTO any_backend_payments (order_id, amount_cents) VALUES (?, ?)",
    this_runs_amounts = "SELECT amount_cents FROM any_backend_payments WHERE order_id LIKE ?",
    this_runs_records = "SELECT COUNT(*) FROM processed_messages \
                         WHERE consumer = 'any-backend' AND message_id LIKE ?",
);

backend!(
    sqlite,
    connection = sqlx::SqliteConnection,
    database = sqlx::Sqlite,
    insert_payment = "INSERT INTO any_backend_payments (order_id, amount_cents) VALUES (?, ?)",
    this_runs_amounts = "SELECT amount_cents FROM any_backend_payments WHERE order_id LIKE ?",
    this_runs_records = "SELECT COUNT(*) FROM processed_messages \
                         WHERE consumer = 'any-backend' AND message_id LIKE ?",
);

// ---------------------------------------------------------------------------------------
// The broker and the consumer loop, the same for every backend
// ---------------------------------------------------------------------------------------

/// One delivery of a message. `crash_before_ack` scripts this consumer to die after the
/// handler returned (its transaction committed) but before it acknowledged the message.
struct Delivery {
    payment: Payment,
    crash_before_ack: bool,
}

/// An at-least-once broker: a queue of deliveries. A message that is not acknowledged is
/// delivered again.
struct Broker {
    queue: Mutex<VecDeque<Delivery>>,
}

impl Broker {
    fn receive(&self) -> Option<Delivery> {
        self.queue.lock().expect("broker lock").pop_front()
    }

    /// The message is done with. (This broker forgot it at `receive`; a real one would
    /// delete it now.)
    fn ack(&self, _delivery: Delivery) {}

    /// The consumer holding `payment` died without acknowledging it: deliver it again,
    /// after everything already queued.
    fn redeliver(&self, payment: Payment) {
        self.queue.lock().expect("broker lock").push_back(Delivery {
            payment,
            crash_before_ack: false,
        });
    }
}

/// What the consumer tasks saw.
#[derive(Debug, Default)]
struct Tally {
    deliveries: usize,
    processed: usize,
    duplicates: usize,
    crashes: usize,
}

/// Runs `WORKERS` consumer tasks until the broker is empty. `handle` is the idempotent
/// handler, bound to a pool.
async fn consume<H, F>(broker: Arc<Broker>, handle: H) -> Result<Tally, Error>
where
    H: Fn(Payment) -> F + Clone + Send + 'static,
    F: Future<Output = Result<Outcome<()>, sqlx::Error>> + Send,
{
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (broker, handle) = (broker.clone(), handle.clone());
            tokio::spawn(async move {
                let mut tally = Tally::default();
                while let Some(delivery) = broker.receive() {
                    tally.deliveries += 1;
                    // An error (say, the database is down) would mean: do not acknowledge,
                    // let the broker redeliver. Here it stops the example.
                    match handle(delivery.payment.clone()).await? {
                        Outcome::Processed(()) => tally.processed += 1,
                        // Processed before, by this or another task: the body did not run.
                        Outcome::Duplicate(_) => tally.duplicates += 1,
                    }
                    if delivery.crash_before_ack {
                        // Committed, but no ack reached the broker: it delivers again.
                        tally.crashes += 1;
                        broker.redeliver(delivery.payment);
                    } else {
                        // Both outcomes mean "acknowledge".
                        broker.ack(delivery);
                    }
                }
                Ok::<_, sqlx::Error>(tally)
            })
        })
        .collect();

    let mut total = Tally::default();
    for worker in workers {
        let tally = worker.await??;
        total.deliveries += tally.deliveries;
        total.processed += tally.processed;
        total.duplicates += tally.duplicates;
        total.crashes += tally.crashes;
    }
    Ok(total)
}

/// The messages of this run, and the broker loaded with their deliveries. Every message
/// is delivered one to three times, in shuffled order. A quarter of the repeated messages
/// come as a burst, their copies back to back, so that two tasks handle the same message
/// at the same moment (the later one waits for the earlier one's commit, then finds a
/// duplicate). About one delivery in twenty crashes before its acknowledgement. The plan
/// is the same on every run (fixed seed); only the ids are new.
fn plan(run_id: &str) -> (Vec<Payment>, Broker) {
    let mut random = dedup_suite::Shuffle::new(0x0051_c0de);
    let payments: Vec<Payment> = (0..MESSAGES)
        .map(|n| Payment {
            id: format!("{run_id}/payment-{n}"),
            order_id: format!("{run_id}/order-{}", n % 50),
            amount_cents: 100 + (random.next_u64() % 9_900) as i64,
        })
        .collect();

    let mut groups: Vec<Vec<Payment>> = Vec::new();
    for payment in &payments {
        let copies = match random.next_u64() % 10 {
            0..=3 => 1,
            4..=7 => 2,
            _ => 3,
        };
        if copies > 1 && random.next_u64().is_multiple_of(4) {
            groups.push(vec![payment.clone(); copies]);
        } else {
            groups.extend((0..copies).map(|_| vec![payment.clone()]));
        }
    }
    random.shuffle(&mut groups);
    let deliveries = groups
        .into_iter()
        .flatten()
        .map(|payment| Delivery {
            payment,
            crash_before_ack: random.next_u64().is_multiple_of(20),
        })
        .collect();
    let broker = Broker {
        queue: Mutex::new(deliveries),
    };
    (payments, broker)
}

// ---------------------------------------------------------------------------------------
// Main: pick the backend, run, check
// ---------------------------------------------------------------------------------------

/// What a run observed, and what the database holds for it.
struct Report {
    tally: Tally,
    /// Rows of `any_backend_payments` booked by this run.
    rows: usize,
    /// Their amounts, summed.
    booked_cents: i64,
    /// Dedup records of this run's messages in `processed_messages`.
    records: i64,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    // A prefix that no earlier run used, for message and order ids.
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let run_id = format!("run-{nanos:x}-{}", std::process::id());
    let (payments, broker) = plan(&run_id);
    let broker = Arc::new(broker);

    let url = std::env::var("DATABASE_URL").ok();
    let (backend, report) = match url.as_deref() {
        None => {
            let path = std::env::temp_dir().join(format!("dedup-any-backend-{run_id}.db"));
            // Declared before the pool, so dropped (the files removed) after it.
            let _remove_at_end = TempFile(path.clone());
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .max_connections(WORKERS)
                .connect_with(options)
                .await?;
            let report = sqlite::run(&pool, broker, &run_id).await;
            pool.close().await;
            ("SQLite (temporary file)", report?)
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let pool = PgPoolOptions::new()
                .max_connections(WORKERS)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(cannot_connect)?;
            ("PostgreSQL", postgres::run(&pool, broker, &run_id).await?)
        }
        Some(url) if url.starts_with("mysql://") || url.starts_with("mariadb://") => {
            let pool = MySqlPoolOptions::new()
                .max_connections(WORKERS)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(cannot_connect)?;
            ("MySQL / MariaDB", mysql::run(&pool, broker, &run_id).await?)
        }
        Some(_) => {
            let expected = "postgres://… or mysql://…, or unset for a temporary SQLite file";
            return Err(format!("DATABASE_URL: expected {expected}").into());
        }
    };

    let Report {
        tally,
        rows,
        booked_cents,
        records,
    } = report;
    let unique = payments.len();
    let sent_cents: i64 = payments.iter().map(|payment| payment.amount_cents).sum();
    let exact = rows == unique && booked_cents == sent_cents;

    println!("backend: {backend}");
    println!("deliveries:          {:>8}", tally.deliveries);
    println!("crashes before ack:  {:>8}  (redelivered)", tally.crashes);
    println!("processed:           {:>8}", tally.processed);
    println!("duplicates skipped:  {:>8}", tally.duplicates);
    println!("effects applied:     {rows:>8}  (rows in any_backend_payments)");
    println!("unique messages:     {unique:>8}");
    println!(
        "amount booked:       {:>8}  (sent: {})",
        cents(booked_cents),
        cents(sent_cents)
    );
    println!(
        "effects == unique messages: {}",
        if exact { "yes" } else { "NO" }
    );

    if !exact {
        return Err(format!(
            "{rows} payments booked for {unique} messages ({} booked, {} sent)",
            cents(booked_cents),
            cents(sent_cents)
        )
        .into());
    }
    if usize::try_from(records) != Ok(unique) {
        return Err(format!("{records} dedup records for {unique} messages").into());
    }
    if tally.processed != unique {
        return Err(format!(
            "{} deliveries reported Outcome::Processed for {unique} messages",
            tally.processed
        )
        .into());
    }
    Ok(())
}

fn cannot_connect(error: sqlx::Error) -> Error {
    format!("cannot connect to the database of DATABASE_URL: {error}").into()
}

fn cents(amount: i64) -> String {
    format!("{}.{:02}", amount / 100, amount % 100)
}

/// A SQLite database file, removed together with its `-wal` and `-shm` files on drop.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}
