//! Issue 39, item 4: a rolling upgrade. A send-first call claimed its row under a lease
//! with a handler of before `fingerprint = …` (no fingerprint in the row), and its owner
//! died; after the lease, a handler with `fingerprint = …` took the row over. A leased or
//! a batch handler's take-over wrote no fingerprint (only the plain handler's commit did),
//! so a later copy with another payload was `Replayed` / `Duplicate` — acknowledged —
//! instead of a `FingerprintMismatch`. Every take-over now writes the fingerprint as its
//! first claim would. The other way round, a row printed by its first claim and taken
//! over with another payload, stays a mismatch and the row stays as it was, on every
//! kind. Checked on every backend, with the dedup row read back.

use std::sync::Arc;

use dedup_runtime::batch::BatchItem;
use dedup_runtime::{FingerprintMismatch, Lease, StoredOutcome, fingerprint, idempotent};
use dedup_suite::{Gate, TestDatabase, unique};

const CONSUMER: &str = "regress-takeover-print";

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

/// The handler kinds that take a row over.
const KINDS: [&str; 3] = ["leased", "batch", "plain"];

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

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, effects = $effects:literal,
     record = $record:literal, select_fingerprint = $select_fingerprint:literal,
     expire = $expire:literal) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            /// The old version: send-first under a lease, no fingerprint. Its owner dies at
            /// the gate.
            #[idempotent(consumer = "regress-takeover-print", key = msg.id, effect = "send-first", lease = "30s")]
            async fn old_unprinted(_lease: &mut Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<(), sqlx::Error> {
                let _ = msg;
                gate.pass().await;
                Ok(())
            }

            /// The same with a fingerprint, written with its claim.
            #[idempotent(consumer = "regress-takeover-print", key = msg.id, effect = "send-first", lease = "30s", fingerprint = msg.payload)]
            async fn old_printed(_lease: &mut Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<(), sqlx::Error> {
                let _ = msg;
                gate.pass().await;
                Ok(())
            }

            /// The new version, leased: its result stored, so that a wrong duplicate would
            /// be `Replayed`.
            #[idempotent(consumer = "regress-takeover-print", key = msg.id, effect = "send-first", lease = "30s", result = "stored", fingerprint = msg.payload)]
            async fn leased(lease: &mut Lease<'_, Db>, msg: &Msg) -> Result<String, sqlx::Error> {
                let tx = lease.transaction().await?;
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(format!("{} bytes", msg.payload.len()))
            }

            #[idempotent(consumer = "regress-takeover-print", key = msg.id, result = "stored", fingerprint = msg.payload)]
            async fn plain(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                sqlx::query($record).bind(&msg.id).execute(&mut *tx).await?;
                Ok(format!("{} bytes", msg.payload.len()))
            }

            #[idempotent(consumer = "regress-takeover-print", batch = fresh, key = |msg| msg.id, fingerprint = |msg| msg.payload)]
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
                dedup_suite::rows(pool, "regress_takeover_print_effects", "message_id", id).await
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

            /// Leaves `msg`'s row claimed under a send-first lease (with its fingerprint when
            /// `printed`) by an owner that died in its call, and the lease over (on the
            /// database's clock).
            async fn dead_owner(pool: &Pool<Db>, msg: &Msg, printed: bool) {
                let gate = Gate::held();
                let task = {
                    let (pool, msg, gate) = (pool.clone(), msg.clone(), Arc::clone(&gate));
                    tokio::spawn(async move {
                        if printed {
                            old_printed(&pool, &msg, &gate).await.map(drop)
                        } else {
                            old_unprinted(&pool, &msg, &gate).await.map(drop)
                        }
                    })
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
                    "leased" => {
                        let outcome = leased(pool, msg).await?;
                        assert!(!matches!(outcome, StoredOutcome::InProgress(_)), "{outcome:?}");
                        Ok(outcome.is_processed())
                    }
                    "plain" => Ok(plain(pool, msg).await?.is_processed()),
                    _ => {
                        let outcome = batched(pool, std::slice::from_ref(msg)).await?;
                        match outcome.items().first() {
                            Some(BatchItem::Processed) => Ok(true),
                            Some(BatchItem::Duplicate(_)) => Ok(false),
                            Some(BatchItem::FingerprintMismatch(mismatch)) => Err(Box::new(mismatch.clone())),
                            other => panic!("{other:?}"),
                        }
                    }
                }
            }

            /// A row claimed without a fingerprint, taken over by `kind` with one: the row
            /// holds it, and another payload is the mismatch on every kind (it was
            /// `Replayed` or `Duplicate` after a leased or a batch take-over).
            async fn records_its_fingerprint(kind: &str) {
                let db = pool().await;
                let pool: &Pool<Db> = &db;
                let msg = Msg::new(&format!("takeover-{kind}"), b"one");
                dead_owner(pool, &msg, false).await;
                assert_eq!(stored(pool, &msg.id).await, None, "claimed without one");
                assert!(deliver(pool, kind, &msg).await.unwrap(), "taken over");
                assert_eq!(processed(pool, &msg.id).await, 1);
                assert_eq!(
                    stored(pool, &msg.id).await,
                    Some(fingerprint(b"one").to_vec()),
                    "the take-over wrote its fingerprint"
                );
                let reused = msg.with_payload(b"two");
                for later in KINDS {
                    let error = deliver(pool, later, &reused)
                        .await
                        .expect_err(&format!("{later}: a mismatch, not a duplicate"));
                    assert_mismatch(&*error, b"one", b"two");
                    assert!(!deliver(pool, later, &msg).await.unwrap(), "{later}: a duplicate");
                }
                assert_eq!(effects(pool, &msg.id).await, 1);
            }

            /// A row printed by its first claim, taken over by `kind` with another payload:
            /// the mismatch, and the row left as it was (in progress, its fingerprint), for
            /// the same payload to take over.
            async fn refuses_another_payload(kind: &str) {
                let db = pool().await;
                let pool: &Pool<Db> = &db;
                let msg = Msg::new(&format!("takeover-reused-{kind}"), b"one");
                dead_owner(pool, &msg, true).await;
                let reused = msg.with_payload(b"two");
                let error = deliver(pool, kind, &reused).await.expect_err("a mismatch");
                assert_mismatch(&*error, b"one", b"two");
                assert_eq!(processed(pool, &msg.id).await, 0, "not taken over");
                assert_eq!(stored(pool, &msg.id).await, Some(fingerprint(b"one").to_vec()));
                assert_eq!(effects(pool, &msg.id).await, 0);
                assert!(deliver(pool, kind, &msg).await.unwrap(), "the same payload takes over");
                assert_eq!(stored(pool, &msg.id).await, Some(fingerprint(b"one").to_vec()));
                assert_eq!(effects(pool, &msg.id).await, 1);
            }

            #[tokio::test]
            async fn a_leased_take_over_records_its_fingerprint() {
                records_its_fingerprint("leased").await;
            }

            #[tokio::test]
            async fn a_batch_take_over_records_its_fingerprint() {
                records_its_fingerprint("batch").await;
            }

            #[tokio::test]
            async fn a_plain_take_over_records_its_fingerprint() {
                records_its_fingerprint("plain").await;
            }

            #[tokio::test]
            async fn a_leased_take_over_with_another_payload_is_a_mismatch() {
                refuses_another_payload("leased").await;
            }

            #[tokio::test]
            async fn a_batch_take_over_with_another_payload_is_a_mismatch() {
                refuses_another_payload("batch").await;
            }

            #[tokio::test]
            async fn a_plain_take_over_with_another_payload_is_a_mismatch() {
                refuses_another_payload("plain").await;
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects =
        "CREATE TABLE IF NOT EXISTS regress_takeover_print_effects (message_id text NOT NULL)",
    record = "INSERT INTO regress_takeover_print_effects (message_id) VALUES ($1)",
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
    effects = "CREATE TABLE IF NOT EXISTS regress_takeover_print_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    record = "INSERT INTO regress_takeover_print_effects (message_id) VALUES (?)",
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
    effects =
        "CREATE TABLE IF NOT EXISTS regress_takeover_print_effects (message_id TEXT NOT NULL)",
    record = "INSERT INTO regress_takeover_print_effects (message_id) VALUES (?1)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = ?1 AND message_id = ?2",
    expire = "UPDATE processed_messages \
              SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND message_id = ?2"
);
