//! Issue 39, item 4, the downgrade direction: a send-first call claimed its row under a
//! lease with `fingerprint = …` (written with the claim), and its owner died; after the
//! lease, a handler of the same consumer without a fingerprint (a rolling downgrade, or
//! upgrade, running both side by side) took the row over. A plain handler with
//! `result = "stored"` writes what the row remembers just before its commit, and that
//! statement set `fingerprint` to its own, NULL — in its own transaction or inside a
//! caller's: the first claim's fingerprint was erased, and a later copy through the
//! printing handler with another payload was a duplicate (acknowledged) instead of a
//! `FingerprintMismatch`. The store now keeps a fingerprint the row has. The other kinds
//! without a fingerprint (plain without options, leased, batch) never wrote the column;
//! they are checked beside it. A handler without a fingerprint compares nothing, as
//! documented: another payload is a duplicate for it. Checked on every backend, with the
//! dedup row read back.

use std::sync::Arc;

use dedup_runtime::batch::BatchItem;
use dedup_runtime::{
    FingerprintMismatch, Lease, LeaseOutcome, StoredOutcome, fingerprint, idempotent,
};
use dedup_suite::{Gate, TestDatabase, unique};

const CONSUMER: &str = "regress-print-erased";

/// A delivery: its id and its payload.
#[derive(Debug, Clone)]
struct Msg {
    id: String,
    payload: Vec<u8>,
}

impl Msg {
    fn new(prefix: &str, payload: &[u8]) -> Self {
        Msg {
            id: unique(prefix),
            payload: payload.to_vec(),
        }
    }

    fn with_payload(&self, payload: &[u8]) -> Self {
        Msg {
            payload: payload.to_vec(),
            ..self.clone()
        }
    }
}

/// The handler kinds with `fingerprint = …`, for the copies after the take-over.
const PRINTING: [&str; 3] = ["leased-printed", "plain-printed", "batch-printed"];

/// The mismatch in `error`, of `received` against the row's `stored` payload.
fn assert_mismatch(error: &(dyn std::error::Error + 'static), stored: &[u8], received: &[u8]) {
    let found =
        FingerprintMismatch::find(error).unwrap_or_else(|| panic!("not a mismatch: {error:?}"));
    assert_eq!(found.stored(), fingerprint(stored));
    assert_eq!(found.received(), fingerprint(received));
}

/// Rows of `id` that are processed (`state` NULL).
async fn processed<DB: TestDatabase>(pool: &sqlx::Pool<DB>, id: &str) -> i64 {
    let [first, second] = DB::PLACEHOLDERS;
    let sql = format!(
        "SELECT COUNT(*) FROM processed_messages WHERE consumer = {first} \
         AND message_id = {second} AND state IS NULL"
    );
    DB::count(pool, sql, vec![CONSUMER.to_owned(), id.to_owned()]).await
}

/// The batch's item as `deliver` answers it.
fn item<E: std::fmt::Debug>(
    item: Option<&BatchItem<E>>,
) -> Result<bool, Box<dyn std::error::Error>> {
    match item {
        Some(BatchItem::Processed) => Ok(true),
        Some(BatchItem::Duplicate(_)) => Ok(false),
        Some(BatchItem::FingerprintMismatch(mismatch)) => Err(Box::new(mismatch.clone())),
        other => panic!("{other:?}"),
    }
}

/// The leased outcome as `deliver` answers it.
fn leased<T: std::fmt::Debug>(outcome: LeaseOutcome<T>) -> bool {
    assert!(
        !matches!(outcome, LeaseOutcome::InProgress(_)),
        "{outcome:?}"
    );
    outcome.is_processed()
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, effects = $effects:literal,
     record = $record:literal, select_fingerprint = $select_fingerprint:literal,
     expire = $expire:literal) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            /// The first claim: send-first under a lease, its fingerprint written with the
            /// claim. Its owner dies at a held gate; an open one lets later copies through.
            #[idempotent(consumer = "regress-print-erased", key = msg.id, effect = "send-first", lease = "30s", fingerprint = msg.payload)]
            async fn printed(_lease: &mut Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<(), sqlx::Error> {
                let _ = msg;
                gate.pass().await;
                Ok(())
            }

            #[idempotent(consumer = "regress-print-erased", key = msg.id, result = "stored", fingerprint = msg.payload)]
            async fn plain_printed(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(format!("{} bytes", msg.payload.len()))
            }

            #[idempotent(consumer = "regress-print-erased", batch = fresh, key = |msg| msg.id, fingerprint = |msg| msg.payload)]
            async fn batch_printed(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                }
                Ok(())
            }

            /// The other version, without a fingerprint: its result stored, so that its
            /// commit writes what the row remembers (the statement that erased it).
            #[idempotent(consumer = "regress-print-erased", key = msg.id, result = "stored")]
            async fn plain_stored(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(format!("{} bytes", msg.payload.len()))
            }

            #[idempotent(consumer = "regress-print-erased", key = msg.id)]
            async fn plain(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "regress-print-erased", key = msg.id, effect = "send-first", lease = "30s", result = "stored")]
            async fn leased_stored(lease: &mut Lease<'_, Db>, msg: &Msg) -> Result<String, sqlx::Error> {
                let tx = lease.transaction().await?;
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(format!("{} bytes", msg.payload.len()))
            }

            #[idempotent(consumer = "regress-print-erased", batch = fresh, key = |msg| msg.id)]
            async fn batched(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                }
                Ok(())
            }

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $effects).await;
                pool
            }

            async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "regress_print_erased_effects", "message_id", id).await
            }

            /// The fingerprint in the dedup row of `id`.
            async fn stored(pool: &Pool<Db>, id: &str) -> Option<Vec<u8>> {
                sqlx::query_scalar::<_, Option<Vec<u8>>>($select_fingerprint)
                    .bind(CONSUMER)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// Leaves `msg`'s row claimed under a send-first lease with its fingerprint by
            /// an owner that died in its call, and the lease over (on the database's clock).
            async fn dead_owner(pool: &Pool<Db>, msg: &Msg) {
                let gate = Gate::held();
                let task = {
                    let (pool, msg, gate) = (pool.clone(), msg.clone(), Arc::clone(&gate));
                    tokio::spawn(async move { printed(&pool, &msg, &gate).await.map(drop) })
                };
                gate.entered.notified().await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                sqlx::query($expire).bind(CONSUMER).bind(&msg.id).execute(pool).await.unwrap();
            }

            /// `msg` through the handler of `kind`: `Ok(true)` processed, `Ok(false)` a
            /// duplicate (replayed or not), the mismatch (or any failure) as the error.
            async fn deliver(pool: &Pool<Db>, kind: &str, msg: &Msg) -> Result<bool, Box<dyn std::error::Error>> {
                match kind {
                    "leased-printed" => Ok(leased(printed(pool, msg, &Gate::default()).await?)),
                    "plain-printed" => Ok(plain_printed(pool, msg).await?.is_processed()),
                    "batch-printed" => {
                        let outcome = batch_printed(pool, std::slice::from_ref(msg)).await?;
                        item(outcome.items().first())
                    }
                    "plain-stored" => Ok(plain_stored(pool, msg).await?.is_processed()),
                    "nested-stored" => {
                        let mut tx = pool.begin().await?;
                        let outcome = plain_stored(&mut *tx, msg).await?;
                        tx.commit().await?;
                        Ok(outcome.is_processed())
                    }
                    "plain" => Ok(plain(pool, msg).await?.is_processed()),
                    "leased-stored" => {
                        let outcome = leased_stored(pool, msg).await?;
                        assert!(!matches!(outcome, StoredOutcome::InProgress(_)), "{outcome:?}");
                        Ok(outcome.is_processed())
                    }
                    "batch" => {
                        let outcome = batched(pool, std::slice::from_ref(msg)).await?;
                        item(outcome.items().first())
                    }
                    other => unreachable!("{other}"),
                }
            }

            /// A row printed by its first claim, taken over by `kind`, a handler without a
            /// fingerprint: the row keeps the first claim's, another payload stays the
            /// mismatch for every handler with one (it was a duplicate after the plain
            /// `result = "stored"` take-over), and stays a duplicate for `kind`, which
            /// compares nothing.
            async fn keeps_the_fingerprint(kind: &str) {
                let db = pool().await;
                let pool: &Pool<Db> = &db;
                let msg = Msg::new(&format!("erased-{kind}"), b"one");
                dead_owner(pool, &msg).await;
                assert_eq!(stored(pool, &msg.id).await, Some(fingerprint(b"one").to_vec()));
                assert!(deliver(pool, kind, &msg).await.unwrap(), "taken over");
                assert_eq!(processed(pool, &msg.id).await, 1);
                assert_eq!(
                    stored(pool, &msg.id).await,
                    Some(fingerprint(b"one").to_vec()),
                    "the first claim's fingerprint kept"
                );
                let reused = msg.with_payload(b"two");
                for later in PRINTING {
                    let error = deliver(pool, later, &reused)
                        .await
                        .expect_err(&format!("{later}: a mismatch, not a duplicate"));
                    assert_mismatch(&*error, b"one", b"two");
                    assert!(!deliver(pool, later, &msg).await.unwrap(), "{later}: a duplicate");
                }
                assert!(!deliver(pool, kind, &reused).await.unwrap(), "{kind}: compares nothing");
                assert_eq!(stored(pool, &msg.id).await, Some(fingerprint(b"one").to_vec()));
                assert_eq!(effects(pool, &msg.id).await, 1);
            }

            #[tokio::test]
            async fn a_plain_stored_take_over_keeps_the_fingerprint() {
                keeps_the_fingerprint("plain-stored").await;
            }

            #[tokio::test]
            async fn a_plain_stored_take_over_in_a_callers_transaction_keeps_the_fingerprint() {
                keeps_the_fingerprint("nested-stored").await;
            }

            #[tokio::test]
            async fn a_plain_take_over_keeps_the_fingerprint() {
                keeps_the_fingerprint("plain").await;
            }

            #[tokio::test]
            async fn a_leased_take_over_keeps_the_fingerprint() {
                keeps_the_fingerprint("leased-stored").await;
            }

            #[tokio::test]
            async fn a_batch_take_over_keeps_the_fingerprint() {
                keeps_the_fingerprint("batch").await;
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_print_erased_effects (message_id text NOT NULL)",
    record = "INSERT INTO regress_print_erased_effects (message_id) VALUES ($1)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    expire = "UPDATE processed_messages SET expires_at = clock_timestamp() - interval '1 second' \
              WHERE consumer = $1 AND message_id = $2"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_print_erased_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    record = "INSERT INTO regress_print_erased_effects (message_id) VALUES (?)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = ? AND message_id = ?",
    expire = "UPDATE processed_messages SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
              WHERE consumer = ? AND message_id = ?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS regress_print_erased_effects (message_id TEXT NOT NULL)",
    record = "INSERT INTO regress_print_erased_effects (message_id) VALUES (?1)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = ?1 AND message_id = ?2",
    expire = "UPDATE processed_messages \
              SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND message_id = ?2"
);
