//! Handlers `#[idempotent]` must accept, compiled under strict lints and run on a temporary database file.
//!
//! The lints make generated code that the user cannot silence a compile error here:
//! `cargo clippy --all-targets -- -D warnings` checks this file with `clippy::pedantic`.

#![deny(
    clippy::pedantic,
    unused_qualifications,
    unused_results,
    missing_debug_implementations
)]
#![forbid(unsafe_code)]

use dedup_runtime::{Outcome, idempotent};
use sqlx::SqliteConnection;

async fn pool() -> dedup_suite::TempSqlite {
    let pool = dedup_suite::sqlite().await;
    let _ = sqlx::raw_sql("CREATE TABLE effects (id TEXT NOT NULL)")
        .execute(&*pool)
        .await
        .unwrap();
    pool
}

async fn effects(pool: &sqlx::SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn insert(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    let _ = sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(id)
        .execute(tx)
        .await?;
    Ok(())
}

/// A method with `&self`: the receiver stays first, the connection becomes the database.
#[derive(Debug)]
struct Billing {
    fee: i64,
}

impl Billing {
    #[idempotent(consumer = "accepted-method", key = id)]
    async fn charge(&self, tx: &mut SqliteConnection, id: &str) -> Result<i64, sqlx::Error> {
        insert(tx, id).await?;
        Ok(self.fee)
    }
}

#[tokio::test]
async fn method_with_self() {
    let pool = pool().await;
    let billing = Billing { fee: 3 };
    assert_eq!(
        billing.charge(&*pool, "m-1").await.unwrap(),
        Outcome::Processed(3)
    );
    assert!(billing.charge(&*pool, "m-1").await.unwrap().is_duplicate());
    assert_eq!(effects(&pool).await, 1);
}

/// Generics, a where clause and a key that is a method call on a generic parameter.
trait Message: Sync {
    fn id(&self) -> String;
}

#[derive(Debug)]
struct Event(u32);

impl Message for Event {
    fn id(&self) -> String {
        format!("evt-{}", self.0)
    }
}

#[idempotent(consumer = "accepted-generic", key = msg.id())]
async fn generic<M>(tx: &mut SqliteConnection, msg: &M) -> Result<(), sqlx::Error>
where
    M: Message + ?Sized,
{
    insert(tx, &msg.id()).await
}

#[tokio::test]
async fn generic_handler() {
    let pool = pool().await;
    assert!(generic(&*pool, &Event(1)).await.unwrap().is_processed());
    assert!(generic(&*pool, &Event(1)).await.unwrap().is_duplicate());
    assert!(
        generic::<dyn Message>(&*pool, &Event(2))
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(effects(&pool).await, 2);
}

/// A body whose own `use` items and locals shadow names the generated code uses, beside
/// local modules named `core` and `sqlx`.
mod shadowing {
    #![allow(clippy::module_name_repetitions)]

    #[allow(dead_code)]
    mod core {}
    #[allow(dead_code)]
    mod sqlx {}
    #[allow(dead_code)]
    mod dedup_runtime {}

    use ::dedup_runtime::idempotent;

    #[idempotent(consumer = "accepted-shadowing", key = id)]
    pub async fn handler(tx: &mut ::sqlx::SqliteConnection, id: &str) -> Result<u8, ::sqlx::Error> {
        #![allow(clippy::items_after_statements)]
        use ::std::result::Result as Outcome;
        let __dedup_tx = 5_u8;
        let result: Outcome<(), ::sqlx::Error> = super::insert(tx, id).await;
        result?;
        if id.is_empty() {
            return Ok(0);
        }
        Ok(__dedup_tx)
    }
}

#[tokio::test]
async fn body_names_do_not_clash() {
    let pool = pool().await;
    assert_eq!(
        shadowing::handler(&*pool, "s-1").await.unwrap(),
        Outcome::Processed(5)
    );
    assert!(
        shadowing::handler(&*pool, "s-1")
            .await
            .unwrap()
            .is_duplicate()
    );
}

/// `impl Trait` in the `Ok` type, an `anyhow::Result` alias, integer and UUID keys.
#[idempotent(consumer = "accepted-impl-trait", key = n)]
async fn displayed(
    tx: &mut SqliteConnection,
    n: u64,
) -> Result<impl std::fmt::Display, sqlx::Error> {
    insert(tx, &n.to_string()).await?;
    Ok(n * 2)
}

#[idempotent(consumer = "accepted-anyhow", key = id)]
async fn with_anyhow(tx: &mut SqliteConnection, id: uuid::Uuid) -> anyhow::Result<String> {
    insert(tx, &id.to_string()).await?;
    anyhow::ensure!(!id.is_nil(), "nil ids are refused by the body");
    Ok(id.to_string())
}

#[tokio::test]
async fn impl_trait_alias_and_keys() {
    let pool = pool().await;
    let shown = displayed(&*pool, 21)
        .await
        .unwrap()
        .into_processed()
        .unwrap();
    assert_eq!(shown.to_string(), "42");
    assert!(displayed(&*pool, 21).await.unwrap().is_duplicate());

    let id = uuid::Uuid::from_u128(0x67e5_5044_10b1_426f_9247_bb68_0e5f_e0c8);
    let outcome = with_anyhow(&*pool, id).await.unwrap();
    assert_eq!(
        outcome.into_processed().as_deref(),
        Some("67e55044-10b1-426f-9247-bb680e5fe0c8")
    );
    let claimed: String = sqlx::query_scalar(
        "SELECT message_id FROM processed_messages WHERE consumer = 'accepted-anyhow'",
    )
    .fetch_one(&*pool)
    .await
    .unwrap();
    assert_eq!(claimed, "67e55044-10b1-426f-9247-bb680e5fe0c8");
    assert!(with_anyhow(&*pool, uuid::Uuid::nil()).await.is_err());
    assert_eq!(
        effects(&pool).await,
        2,
        "the failed body's effect was rolled back"
    );
}

/// A transaction as the declared connection type, a custom table, and `crate = "…"`
/// through a re-export.
mod reexport {
    pub use dedup_runtime as dedup;
}

#[idempotent(
    consumer = "accepted-custom",
    key = id,
    table = "custom_processed",
    crate = "crate::accepted::reexport::dedup"
)]
async fn in_custom_table(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    id: &str,
) -> Result<(), sqlx::Error> {
    insert(tx, id).await
}

#[tokio::test]
async fn transaction_type_custom_table_and_crate_path() {
    let pool = pool().await;
    dedup_runtime::migrate_table(&*pool, "custom_processed")
        .await
        .unwrap();
    assert!(in_custom_table(&*pool, "c-1").await.unwrap().is_processed());
    assert!(in_custom_table(&*pool, "c-1").await.unwrap().is_duplicate());
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM custom_processed")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    let default_rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM processed_messages")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert_eq!(default_rows, 0);

    let error = dedup_runtime::migrate_table(&*pool, "bad name")
        .await
        .unwrap_err();
    assert!(matches!(error, sqlx::Error::Configuration(_)), "{error:?}");
}

/// The generated future is `Send` when the body is, so it can be spawned; a body that
/// holds an `Rc` across an await still compiles and runs where `Send` is not needed.
#[idempotent(consumer = "accepted-local", key = id)]
async fn not_send(tx: &mut SqliteConnection, id: &str) -> Result<usize, sqlx::Error> {
    let local = std::rc::Rc::new(id.len());
    insert(tx, id).await?;
    Ok(*local)
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

#[tokio::test]
async fn send_when_the_body_is() {
    let pool = pool().await;
    let spawned = tokio::spawn(assert_send(async move {
        let billing = Billing { fee: 1 };
        let event = Event(9);
        (
            billing
                .charge(&pool.pool, "send-1")
                .await
                .unwrap()
                .is_processed(),
            generic(&pool.pool, &event).await.unwrap().is_processed(),
            pool,
        )
    }));
    let (charged, generic_done, pool) = spawned.await.unwrap();
    assert!(charged && generic_done);
    assert_eq!(
        not_send(&*pool, "local").await.unwrap(),
        Outcome::Processed(5)
    );
}

/// The `let _ =` forms a body may write: an awaited result (the swallow is the body's
/// choice), a value that is not a future, a place (neither moved nor dropped: still usable
/// after), `_ =` of an awaited result, and a future under an explicit `allow`.
#[idempotent(consumer = "accepted-let-underscore", key = id)]
async fn let_underscore(tx: &mut SqliteConnection, id: &str) -> Result<usize, sqlx::Error> {
    let _ = sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await;
    let _ = id.len();
    let kept = String::from(id);
    let _ = kept;
    _ = sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let _: Result<u8, _> = "7".parse();
    #[allow(unused_must_use)]
    {
        std::future::ready(());
    }
    Ok(kept.len())
}

#[tokio::test]
async fn let_underscore_forms() {
    let pool = pool().await;
    assert_eq!(
        let_underscore(&*pool, "let-1").await.unwrap(),
        Outcome::Processed(5)
    );
    // Both awaited inserts ran, once each; the second delivery runs nothing.
    assert_eq!(effects(&pool).await, 2);
    assert!(
        let_underscore(&*pool, "let-1")
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(effects(&pool).await, 2);
}

/// `effect = "send-first"`: a body that never touches its connection (an email, an HTTP
/// call) compiles under these lints, with no warning about the unused `tx`.
#[idempotent(consumer = "accepted-send-first", key = id, effect = "send-first")]
async fn send_first(
    tx: &mut SqliteConnection,
    id: &str,
    calls: &std::sync::atomic::AtomicU32,
) -> Result<u32, sqlx::Error> {
    Ok(calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1)
}

#[tokio::test]
async fn send_first_without_the_connection() {
    let pool = pool().await;
    let calls = std::sync::atomic::AtomicU32::new(0);
    assert_eq!(
        send_first(&*pool, "send-1", &calls).await.unwrap(),
        Outcome::Processed(1)
    );
    assert!(
        send_first(&*pool, "send-1", &calls)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// The batch form (`batch = …`): a public handler with docs, an integer key by value, an
/// alias return type, a custom table and `crate = "…"`, a body whose `use` shadows a name;
/// the generated future is `Send`, so it can be spawned.
mod batches {
    use sqlx::SqliteConnection;

    /// One delivery.
    #[derive(Debug)]
    pub struct Delivery {
        pub seq: u64,
    }

    /// Records each fresh delivery.
    #[::dedup_runtime::idempotent(consumer = "accepted-batch", batch = deliveries, key = |d| d.seq)]
    pub async fn record(tx: &mut SqliteConnection, deliveries: &[&Delivery]) -> sqlx::Result<()> {
        use ::std::result::Result as Outcome;
        for delivery in deliveries {
            let inserted: Outcome<(), sqlx::Error> =
                super::insert(tx, &delivery.seq.to_string()).await;
            inserted?;
        }
        Ok(())
    }

    #[::dedup_runtime::idempotent(
        consumer = "accepted-batch-custom",
        batch = deliveries,
        key = |delivery: &Delivery| delivery.seq.to_string(),
        table = "custom_batch_processed",
        crate = "crate::accepted::reexport::dedup",
    )]
    pub async fn record_custom(
        tx: &mut SqliteConnection,
        deliveries: &[&Delivery],
    ) -> Result<(), sqlx::Error> {
        for delivery in deliveries {
            super::insert(tx, &delivery.seq.to_string()).await?;
        }
        Ok(())
    }
}

#[tokio::test]
async fn batch_form() {
    let pool = pool().await;
    let deliveries: Vec<batches::Delivery> = [1, 2, 1]
        .into_iter()
        .map(|seq| batches::Delivery { seq })
        .collect();
    let spawned = {
        let pool = (*pool).clone();
        tokio::spawn(async move { batches::record(&pool, &deliveries).await })
    };
    let outcome = spawned.await.unwrap().unwrap();
    assert_eq!(outcome.processed(), 2);
    assert!((0..3).all(|n| outcome.ack(n)));
    assert_eq!(effects(&pool).await, 2);

    dedup_runtime::migrate_table(&*pool, "custom_batch_processed")
        .await
        .unwrap();
    let again = [batches::Delivery { seq: 2 }, batches::Delivery { seq: 3 }];
    let outcome = batches::record_custom(&*pool, &again).await.unwrap();
    assert_eq!(outcome.processed(), 2, "another consumer, another table");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM custom_batch_processed")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);
    assert_eq!(effects(&pool).await, 4);
}

/// A stored result and a fingerprint, on a method whose `T` is a reply struct: the
/// generated code adds no lint the user cannot silence.
mod replies {
    use dedup_runtime::{StoredOutcome, idempotent};
    use sqlx::SqliteConnection;

    #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct Receipt {
        pub charge: String,
        pub cents: u64,
    }

    #[derive(Debug)]
    pub struct Payment {
        pub id: String,
        pub body: Vec<u8>,
    }

    #[derive(Debug)]
    pub struct Payments;

    impl Payments {
        #[idempotent(consumer = "accepted-replies", key = msg.id, result = "stored", result_version = 3, max_result_len = 1024, fingerprint = msg.body)]
        pub async fn charge(
            &self,
            tx: &mut SqliteConnection,
            msg: &Payment,
        ) -> Result<Receipt, sqlx::Error> {
            super::insert(tx, &msg.id).await?;
            Ok(Receipt {
                charge: format!("ch-{}", msg.id),
                cents: 250,
            })
        }
    }

    #[tokio::test]
    async fn stored_result_and_fingerprint() {
        let pool = super::pool().await;
        let msg = Payment {
            id: "p-1".to_owned(),
            body: b"{}".to_vec(),
        };
        let receipt = Receipt {
            charge: "ch-p-1".to_owned(),
            cents: 250,
        };
        let first = Payments.charge(&*pool, &msg).await.unwrap();
        assert_eq!(first, StoredOutcome::Processed(receipt.clone()));
        let again = Payments.charge(&*pool, &msg).await.unwrap();
        assert_eq!(again, StoredOutcome::Replayed(receipt));
        assert_eq!(super::effects(&pool).await, 1);
    }
}
