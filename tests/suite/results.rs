//! Stored results (`result = "stored"`, issue 26) on PostgreSQL, MariaDB and SQLite: the
//! first delivery's result is stored with its dedup row in the same transaction, and every
//! duplicate gets it back as a replay (`StoredOutcome::Replayed`), told apart from a fresh
//! result. Every value round-trips, falsy ones included; a result that cannot be stored
//! (too large, refused by its `Serialize`, not readable back) rolls the whole transaction
//! back — the effect does not commit; a replay under another `result_version` is a typed
//! error. The database's state is asserted each time: effects, dedup rows, stored results.

use std::collections::BTreeMap;

use dedup_runtime::{
    AckPolicy, DEFAULT_MAX_RESULT_LEN, Duplicate, Ledger, StoredOutcome, StoredResultError,
    idempotent,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A delivery.
#[derive(Debug, Clone)]
pub struct Msg {
    pub id: String,
}

impl Msg {
    fn new(prefix: &str) -> Self {
        Msg {
            id: dedup_suite::unique(prefix),
        }
    }
}

/// A reply with a bit of everything: what a request/reply consumer sends back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub charge: String,
    pub amount: u64,
    pub fee: f64,
    pub note: Option<String>,
    pub tags: Vec<String>,
    pub lines: BTreeMap<String, i32>,
}

/// A value whose `Serialize` refuses: the commit must not happen.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Refuses;

impl Serialize for Refuses {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this value refuses to be serialized",
        ))
    }
}

/// At `MAX_RESULT_LEN` exactly (a `Vec<u8>` of n bytes is a 4-byte length and the n
/// bytes) and one over, through `largest` (each backend's handler).
async fn at_the_highest_limit<'p, DB, F, Fut>(pool: &'p sqlx::Pool<DB>, largest: F)
where
    DB: dedup_suite::TestDatabase,
    F: Fn(&'p sqlx::Pool<DB>, &'p Msg, &'p [u8]) -> Fut,
    Fut: std::future::Future<Output = Result<StoredOutcome<Vec<u8>>, sqlx::Error>>,
{
    use dedup_runtime::MAX_RESULT_LEN;
    let at: &'p Vec<u8> = Box::leak(Box::new(
        (0..MAX_RESULT_LEN - 4).map(|i| (i % 251) as u8).collect(),
    ));
    let msg: &'p Msg = Box::leak(Box::new(Msg::new("largest")));
    assert!(largest(pool, msg, at).await.unwrap().is_processed());
    let again = largest(pool, msg, at).await.unwrap();
    assert!(again.is_replayed());
    assert!(
        again.into_value().as_deref() == Some(&at[..]),
        "stored whole, byte for byte"
    );

    let over: &'p Vec<u8> = Box::leak(Box::new(vec![1u8; MAX_RESULT_LEN - 3]));
    let msg: &'p Msg = Box::leak(Box::new(Msg::new("largest-over")));
    let error = largest(pool, msg, over).await.unwrap_err();
    assert_eq!(
        StoredResultError::find(&error),
        Some(&StoredResultError::TooLarge {
            len: MAX_RESULT_LEN + 1,
            max: MAX_RESULT_LEN
        })
    );
    assert_eq!(
        dedup_suite::claims(pool, "results-largest", &msg.id).await,
        0
    );
}

/// MariaDB with `sql_mode = ''` cuts a value too long for its column instead of refusing
/// it: the highest limit must still be stored whole there.
#[tokio::test]
async fn mariadb_without_strict_mode_stores_the_largest_result_whole() {
    dedup_suite::mysql().await; // migrated
    let lenient = dedup_suite::mysql_lenient().await;
    dedup_suite::ddl(
        &lenient,
        "CREATE TABLE IF NOT EXISTS dedup_result_effects \
         (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB",
    )
    .await;
    at_the_highest_limit(&lenient, mysql::largest).await;
}

use dedup_suite::Gate;

macro_rules! backend_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        effects_ddl = $effects_ddl:literal,
        insert_effect = $insert_effect:literal,
        backdate = $backdate:literal,
        orders_ddl = $orders_ddl:literal,
        order_placeholder = $order_placeholder:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $effects_ddl).await;
                pool
            }

            async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_result_effects", "message_id", id).await
            }

            /// Dedup rows of the id with a result stored.
            async fn stored(pool: &Pool<Db>, consumer: &str, id: &str) -> i64 {
                use dedup_suite::TestDatabase as _;
                let [first, second] = <Db as dedup_suite::TestDatabase>::PLACEHOLDERS;
                let sql = format!(
                    "SELECT COUNT(*) FROM processed_messages WHERE consumer = {first} \
                     AND message_id = {second} AND result IS NOT NULL"
                );
                Db::count(pool, sql, vec![consumer.to_owned(), id.to_owned()]).await
            }

            async fn effect(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect)
                    .bind(&msg.id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            #[idempotent(consumer = "results-values", key = msg.id, result = "stored")]
            async fn remember<T>(tx: &mut $conn, msg: &Msg, value: &T) -> Result<T, sqlx::Error>
            where
                T: Clone + Serialize + DeserializeOwned + Send + Sync,
            {
                effect(tx, msg).await?;
                Ok(value.clone())
            }

            /// The same consumer, no stored result: its rows have nothing to replay.
            #[idempotent(consumer = "results-values", key = msg.id)]
            async fn plain(tx: &mut $conn, msg: &Msg) -> Result<u32, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(1)
            }

            #[idempotent(consumer = "results-small", key = msg.id, result = "stored", max_result_len = 16)]
            async fn small(tx: &mut $conn, msg: &Msg, text: &str) -> Result<String, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(text.to_owned())
            }

            #[idempotent(consumer = "results-largest", key = msg.id, result = "stored", max_result_len = 8_388_608)]
            pub(super) async fn largest(tx: &mut $conn, msg: &Msg, bytes: &[u8]) -> Result<Vec<u8>, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(bytes.to_vec())
            }

            #[idempotent(consumer = "results-versioned", key = msg.id, result = "stored")]
            async fn version_1(tx: &mut $conn, msg: &Msg) -> Result<u64, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(7)
            }

            #[idempotent(consumer = "results-versioned", key = msg.id, result = "stored", result_version = 2)]
            async fn version_2(tx: &mut $conn, msg: &Msg) -> Result<(u64, String), sqlx::Error> {
                effect(tx, msg).await?;
                Ok((7, "seven".to_owned()))
            }

            /// Version 1 as well, another shape: what a changed type without a new
            /// version looks like.
            #[idempotent(consumer = "results-versioned", key = msg.id, result = "stored")]
            async fn reshaped(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                effect(tx, msg).await?;
                Ok("seven".to_owned())
            }

            #[tokio::test]
            async fn every_value_round_trips_through_a_duplicate() {
                                    let pool = pool().await;
                    async fn check<T>(pool: &Pool<Db>, value: T)
                    where
                        T: Clone + std::fmt::Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync,
                    {
                        let msg = Msg::new("value");
                        let first = remember(pool, &msg, &value).await.unwrap();
                        assert_eq!(first, StoredOutcome::Processed(value.clone()));
                        for _ in 0..2 {
                            let again = remember(pool, &msg, &value).await.unwrap();
                            assert!(again.is_replayed() && again.is_duplicate() && !again.is_processed());
                            assert_eq!(again.duplicate(), Some(Duplicate::AlreadyProcessed));
                            assert_eq!(again.into_value(), Some(value.clone()), "{value:?}");
                        }
                        assert_eq!(effects(pool, &msg.id).await, 1, "{value:?}: one effect");
                        assert_eq!(dedup_suite::claims(pool, "results-values", &msg.id).await, 1);
                        assert_eq!(stored(pool, "results-values", &msg.id).await, 1);
                    }
                    // The falsy ones first: each is stored, none taken for "nothing".
                    check(&pool, 0u32).await;
                    check(&pool, false).await;
                    check(&pool, String::new()).await;
                    check(&pool, Vec::<u8>::new()).await;
                    check(&pool, Vec::<String>::new()).await;
                    check(&pool, ()).await;
                    check(&pool, None::<u32>).await;
                    check(&pool, Some(None::<u8>)).await;
                    check(&pool, Some(())).await;
                    check(&pool, (0i64, String::new(), false)).await;
                    check(&pool, -0.0f64).await;
                    check(&pool, f64::MIN_POSITIVE).await;
                    check(&pool, u128::MAX).await;
                    check(&pool, "NUL \0 and \u{1F980}".to_owned()).await;
                    check(&pool, Reply {
                        charge: "ch_1".to_owned(),
                        amount: 1999,
                        fee: 0.1 + 0.2,
                        note: None,
                        tags: vec![String::new(), "vip".to_owned()],
                        lines: BTreeMap::from([("a".to_owned(), -1), ("b".to_owned(), 0)]),
                    })
                    .await;
                    // A 1 MB value, and 1 MiB of bytes.
                    check(&pool, "x".repeat(1_000_000)).await;
                    check(&pool, vec![0xA5u8; 1 << 20]).await;
            }

            /// The default limit, at exactly its bytes and one over: a `Vec<u8>` of n bytes
            /// is stored as a 4-byte length and the n bytes.
            #[tokio::test]
            async fn the_default_limit_holds_at_the_limit_and_refuses_one_over() {
                                    let pool = pool().await;
                    let at = vec![7u8; DEFAULT_MAX_RESULT_LEN - 4];
                    let msg = Msg::new("at-limit");
                    assert!(remember(&*pool, &msg, &at).await.unwrap().is_processed());
                    let again = remember(&*pool, &msg, &at).await.unwrap();
                    assert_eq!(again.into_replayed().map(|v| v.len()), Some(at.len()));

                    let over = vec![7u8; DEFAULT_MAX_RESULT_LEN - 3];
                    let msg = Msg::new("over-limit");
                    let error = remember(&*pool, &msg, &over).await.unwrap_err();
                    assert_eq!(
                        StoredResultError::find(&error),
                        Some(&StoredResultError::TooLarge {
                            len: DEFAULT_MAX_RESULT_LEN + 1,
                            max: DEFAULT_MAX_RESULT_LEN
                        }),
                        "{error}"
                    );
                    assert_eq!(effects(&pool, &msg.id).await, 0, "the effect rolled back");
                    assert_eq!(dedup_suite::claims(&*pool, "results-values", &msg.id).await, 0);
            }

            /// The highest limit a handler may declare, `MAX_RESULT_LEN` (8 MiB): stored
            /// whole and replayed at exactly the limit, refused one byte over.
            #[tokio::test]
            async fn the_highest_limit_fits_every_backends_column() {
                let pool = pool().await;
                at_the_highest_limit(&pool, largest).await;
            }

            /// A mark-first call stores its result in the fenced completion, with the
            /// effect it writes there; a copy that arrives while the lease runs is in
            /// progress (never a stale or empty result), and every copy after it replays.
            #[idempotent(consumer = "results-leased", key = msg.id, effect = "mark-first", lease = "30s", result = "stored")]
            async fn mark_first(lease: &mut dedup_runtime::Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<String, sqlx::Error> {
                gate.pass().await;
                let tx = lease.transaction().await?;
                effect(tx, msg).await?;
                Ok(format!("charged {}", msg.id))
            }

            /// Send-first under a lease, no transaction of its own: the completion opens
            /// one for the result.
            #[idempotent(consumer = "results-leased", key = msg.id, effect = "send-first", lease = "30s", result = "stored", max_result_len = 8)]
            async fn send_first(lease: &mut dedup_runtime::Lease<'_, Db>, msg: &Msg, reply: &str) -> Result<String, sqlx::Error> {
                Ok(reply.to_owned())
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_leased_call_stores_its_result_in_the_completion() {
                let pool = std::sync::Arc::new(pool().await);
                let msg = Msg::new("leased");
                let gate = Gate::held();
                let first = {
                    let (pool, msg, gate) = (pool.clone(), msg.clone(), gate.clone());
                    tokio::spawn(async move { mark_first(&**pool, &msg, &gate).await })
                };
                gate.entered.notified().await;
                let open = Gate::default();
                let copy = mark_first(&**pool, &msg, &open).await.unwrap();
                assert!(copy.is_in_progress(), "in progress while the lease runs: {copy:?}");
                assert_eq!(stored(&pool, "results-leased", &msg.id).await, 0);
                gate.go.notify_one();
                let reply = format!("charged {}", msg.id);
                assert_eq!(first.await.unwrap().unwrap(), StoredOutcome::Processed(reply.clone()));
                assert_eq!(mark_first(&**pool, &msg, &open).await.unwrap(), StoredOutcome::Replayed(reply));
                assert_eq!(effects(&pool, &msg.id).await, 1);
                assert_eq!(stored(&pool, "results-leased", &msg.id).await, 1);

                let msg = Msg::new("send-first");
                assert_eq!(send_first(&**pool, &msg, "ok").await.unwrap(), StoredOutcome::Processed("ok".to_owned()));
                assert_eq!(send_first(&**pool, &msg, "no").await.unwrap(), StoredOutcome::Replayed("ok".to_owned()));
                assert_eq!(stored(&pool, "results-leased", &msg.id).await, 1);
            }

            /// A send-first result over its limit: the completion does not commit, the
            /// row is released, and the next delivery runs (and may call) again.
            #[tokio::test]
            async fn a_leased_result_over_the_limit_releases_the_row() {
                let pool = pool().await;
                let msg = Msg::new("send-first-over");
                let error = send_first(&*pool, &msg, "123456789").await.unwrap_err();
                assert_eq!(
                    StoredResultError::find(&error),
                    Some(&StoredResultError::TooLarge { len: 10, max: 8 })
                );
                assert_eq!(dedup_suite::claims(&*pool, "results-leased", &msg.id).await, 0, "released");
                assert_eq!(send_first(&*pool, &msg, "1234567").await.unwrap(), StoredOutcome::Processed("1234567".to_owned()));
            }

            /// Business keys with a stored result and a fingerprint: a new id that hits the
            /// business key is `Duplicate(BusinessKey)` (another message: nothing to
            /// replay, nothing to compare), the same id replays, the same id with another
            /// payload is the mismatch.
            #[idempotent(consumer = "results-keyed", key = msg.id, unique = "dedup_result_orders_order_key", result = "stored", fingerprint = order)]
            async fn keyed(tx: &mut $conn, msg: &Msg, order: &str) -> Result<String, sqlx::Error> {
                let _ = msg;
                sqlx::query(concat!("INSERT INTO dedup_result_orders (order_key) VALUES (", $order_placeholder, ")"))
                    .bind(order)
                    .execute(&mut *tx)
                    .await?;
                Ok(format!("shipped {order}"))
            }

            /// Pruning deletes the row, its result and fingerprint with it: no orphans, and
            /// a redelivery after the window is processed afresh.
            #[idempotent(consumer = "results-pruned", key = msg.id, result = "stored", fingerprint = msg.id, table = "dedup_results_prune")]
            async fn pruned(tx: &mut $conn, msg: &Msg) -> Result<u32, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(7)
            }

            #[tokio::test]
            async fn pruning_removes_results_with_their_rows() {
                use dedup_runtime::Prune;
                let pool = pool().await;
                dedup_runtime::migrate_table(&*pool, "dedup_results_prune").await.unwrap();
                let (old, young) = (Msg::new("pruned-old"), Msg::new("pruned-young"));
                for msg in [&old, &young] {
                    assert!(pruned(&*pool, msg).await.unwrap().is_processed());
                }
                sqlx::query($backdate).bind(&old.id).execute(&*pool).await.unwrap();
                let day = std::time::Duration::from_secs(86_400);
                let done = Prune::new(2 * day, day)
                    .in_table("dedup_results_prune")
                    .unwrap()
                    .consumer("results-pruned")
                    .run(&*pool, |_| {})
                    .await
                    .unwrap();
                assert!(done.deleted >= 1, "{done:?}");
                let left = |id: String| {
                    let pool = &pool;
                    async move {
                        use dedup_suite::TestDatabase as _;
                        let [first, second] = <Db as dedup_suite::TestDatabase>::PLACEHOLDERS;
                        let sql = format!(
                            "SELECT COUNT(*) FROM dedup_results_prune WHERE consumer = {first} \
                             AND message_id = {second} AND (result IS NOT NULL OR fingerprint IS NOT NULL)"
                        );
                        Db::count(pool, sql, vec!["results-pruned".to_owned(), id]).await
                    }
                };
                assert_eq!(left(old.id.clone()).await, 0, "the old row's result and fingerprint went with it");
                assert_eq!(left(young.id.clone()).await, 1);
                assert_eq!(pruned(&*pool, &old).await.unwrap(), StoredOutcome::Processed(7), "afresh");
                assert_eq!(pruned(&*pool, &young).await.unwrap(), StoredOutcome::Replayed(7));
            }

            #[tokio::test]
            async fn a_business_key_duplicate_is_not_a_replay() {
                let pool = pool().await;
                dedup_suite::ddl(&*pool, $orders_ddl).await;
                let order = dedup_suite::unique("order");
                let first = Msg::new("keyed");
                assert_eq!(keyed(&*pool, &first, &order).await.unwrap(), StoredOutcome::Processed(format!("shipped {order}")));
                let other = Msg::new("keyed-other");
                assert_eq!(
                    keyed(&*pool, &other, &order).await.unwrap(),
                    StoredOutcome::Duplicate(Duplicate::BusinessKey { constraint: "dedup_result_orders_order_key" })
                );
                assert_eq!(keyed(&*pool, &first, &order).await.unwrap(), StoredOutcome::Replayed(format!("shipped {order}")));
                let error = keyed(&*pool, &first, "another order").await.unwrap_err();
                assert!(dedup_runtime::FingerprintMismatch::find(&error).is_some(), "{error:?}");
                assert_eq!(dedup_suite::claims(&*pool, "results-keyed", &other.id).await, 0);
            }

            /// `effect = "send-first"` without a lease: the body runs in the claim's
            /// transaction, and its result is stored there as for a plain handler.
            #[idempotent(consumer = "results-send-first", key = msg.id, effect = "send-first", result = "stored")]
            async fn sent(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                effect(tx, msg).await?;
                Ok("receipt".to_owned())
            }

            #[tokio::test]
            async fn a_send_first_result_is_stored_with_its_claim() {
                let pool = pool().await;
                let msg = Msg::new("sent");
                assert_eq!(sent(&*pool, &msg).await.unwrap(), StoredOutcome::Processed("receipt".to_owned()));
                let again = sent(&*pool, &msg).await;
                // The broker's action for each answer: a replay is acknowledged.
                assert_eq!(AckPolicy::<Db>::new().decide(&again, 2), dedup_runtime::Ack::Ack);
                assert_eq!(again.unwrap(), StoredOutcome::Replayed("receipt".to_owned()));
                assert_eq!(effects(&pool, &msg.id).await, 1);
                assert_eq!(stored(&pool, "results-send-first", &msg.id).await, 1);
                // And an in-progress answer is retried, never acknowledged.
                let busy: Result<StoredOutcome<String>, sqlx::Error> = Ok(StoredOutcome::InProgress(
                    dedup_runtime::InProgress::new(std::time::Duration::from_secs(3)),
                ));
                assert!(matches!(AckPolicy::<Db>::new().decide(&busy, 1), dedup_runtime::Ack::Retry { .. }));
            }

            /// `max_result_len = 16`: a 15-byte text is 16 bytes stored, one more is refused,
            /// and the redelivery of the refused one is processed again (nothing committed).
            #[tokio::test]
            async fn a_declared_limit_is_a_typed_error_one_byte_over() {
                                    let pool = pool().await;
                    let msg = Msg::new("small");
                    let text = "a".repeat(15);
                    assert!(small(&*pool, &msg, &text).await.unwrap().is_processed());
                    assert_eq!(
                        small(&*pool, &msg, "other").await.unwrap(),
                        StoredOutcome::Replayed(text)
                    );

                    let msg = Msg::new("small-over");
                    let error = small(&*pool, &msg, &"a".repeat(16)).await.unwrap_err();
                    assert_eq!(
                        StoredResultError::find(&error),
                        Some(&StoredResultError::TooLarge { len: 17, max: 16 })
                    );
                    assert!(error.to_string().contains("over its `max_result_len` of 16 bytes"), "{error}");
                    assert_eq!(effects(&pool, &msg.id).await, 0);
                    assert_eq!(dedup_suite::claims(&*pool, "results-small", &msg.id).await, 0);
                    // Nothing was committed: the next delivery runs the body.
                    let again = small(&*pool, &msg, "fits").await.unwrap();
                    assert_eq!(again, StoredOutcome::Processed("fits".to_owned()));
                    assert_eq!(effects(&pool, &msg.id).await, 1);
                    // A policy dead-letters the refusal (the same value would fail again).
                    let failed: Result<StoredOutcome<()>, sqlx::Error> = Err(error);
                    assert_eq!(AckPolicy::<Db>::new().decide(&failed, 1), dedup_runtime::Ack::DeadLetter);
            }

            /// A result that cannot be serialized, or not read back as its type, is found
            /// before the commit: the effect and the dedup row roll back.
            #[tokio::test]
            async fn a_result_that_cannot_be_stored_commits_nothing() {
                                    let pool = pool().await;
                    let msg = Msg::new("refuses");
                    let error = remember(&*pool, &msg, &Refuses).await.unwrap_err();
                    let Some(StoredResultError::Unencodable(why)) = StoredResultError::find(&error) else {
                        panic!("not Unencodable: {error:?}");
                    };
                    assert!(why.contains("`Serialize` implementation returned an error"), "{why}");
                    assert_eq!(effects(&pool, &msg.id).await, 0);
                    assert_eq!(dedup_suite::claims(&*pool, "results-values", &msg.id).await, 0);

                    // Serializes, but postcard cannot read it back (`deserialize_any`).
                    let msg = Msg::new("json");
                    let value = serde_json::json!({"charge": "ch_1", "amount": 5});
                    let error = remember(&*pool, &msg, &value).await.unwrap_err();
                    let Some(StoredResultError::Unencodable(why)) = StoredResultError::find(&error) else {
                        panic!("not Unencodable: {error:?}");
                    };
                    assert!(why.contains("does not decode back"), "{why}");
                    assert_eq!(effects(&pool, &msg.id).await, 0);
                    assert_eq!(dedup_suite::claims(&*pool, "results-values", &msg.id).await, 0);
            }

            /// A row with nothing stored (processed by a handler without the option) is a
            /// plain duplicate for a handler with it, not an empty replay.
            #[tokio::test]
            async fn a_row_without_a_result_is_a_duplicate_not_a_replay() {
                                    let pool = pool().await;
                    let msg = Msg::new("plain-first");
                    assert!(plain(&*pool, &msg).await.unwrap().is_processed());
                    let again = remember(&*pool, &msg, &5u32).await.unwrap();
                    assert_eq!(again, StoredOutcome::Duplicate(Duplicate::AlreadyProcessed));
                    assert!(!again.is_replayed() && again.is_duplicate());
                    assert_eq!(effects(&pool, &msg.id).await, 1);
                    assert_eq!(stored(&pool, "results-values", &msg.id).await, 0);
                    // And the other way: a plain handler meets a row with a result.
                    let msg = Msg::new("stored-first");
                    assert!(remember(&*pool, &msg, &5u32).await.unwrap().is_processed());
                    assert!(plain(&*pool, &msg).await.unwrap().is_duplicate());
                    assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// A replay under another `result_version` is a typed error, never the old
            /// bytes read as the new type; a changed type under the same version that
            /// cannot read the bytes is a typed error too.
            #[tokio::test]
            async fn a_replay_under_another_version_is_a_typed_error() {
                                    let pool = pool().await;
                    let msg = Msg::new("versioned");
                    assert_eq!(version_1(&*pool, &msg).await.unwrap(), StoredOutcome::Processed(7));
                    assert_eq!(version_1(&*pool, &msg).await.unwrap(), StoredOutcome::Replayed(7));
                    let error = version_2(&*pool, &msg).await.unwrap_err();
                    assert_eq!(
                        StoredResultError::find(&error),
                        Some(&StoredResultError::VersionMismatch { stored: 1, expected: 2 }),
                        "{error}"
                    );
                    let error = reshaped(&*pool, &msg).await.unwrap_err();
                    assert!(
                        matches!(StoredResultError::find(&error), Some(StoredResultError::Undecodable(_))),
                        "{error:?}"
                    );
                    assert_eq!(effects(&pool, &msg.id).await, 1, "no body ran again");
                    assert_eq!(dedup_suite::claims(&*pool, "results-versioned", &msg.id).await, 1);
            }

            /// Inside the caller's transaction (a savepoint): stored with the caller's
            /// commit, replayed after it; rolled back with the caller's rollback.
            #[tokio::test]
            async fn in_the_callers_transaction_the_result_commits_with_it() {
                                    let pool = pool().await;
                    let msg = Msg::new("caller");
                    let mut tx = pool.begin().await.unwrap();
                    let first = remember(&mut *tx, &msg, &"reply".to_owned()).await.unwrap();
                    assert!(first.is_processed());
                    tx.rollback().await.unwrap();
                    assert_eq!(dedup_suite::claims(&*pool, "results-values", &msg.id).await, 0);

                    let mut tx = pool.begin().await.unwrap();
                    let first = remember(&mut *tx, &msg, &"reply".to_owned()).await.unwrap();
                    assert!(first.is_processed());
                    let inside = remember(&mut *tx, &msg, &"other".to_owned()).await.unwrap();
                    assert_eq!(inside, StoredOutcome::Replayed("reply".to_owned()));
                    tx.commit().await.unwrap();
                    let after = remember(&*pool, &msg, &"other".to_owned()).await.unwrap();
                    assert_eq!(after, StoredOutcome::Replayed("reply".to_owned()));
                    assert_eq!(effects(&pool, &msg.id).await, 1);
                    assert_eq!(stored(&pool, "results-values", &msg.id).await, 1);
            }

            /// The result lives in the dedup row: forgetting the id removes it with the
            /// row, and the next delivery is processed and stores its own.
            #[tokio::test]
            async fn forgetting_the_id_removes_its_result() {
                                    let pool = pool().await;
                    let msg = Msg::new("forget");
                    assert!(remember(&*pool, &msg, &1u8).await.unwrap().is_processed());
                    assert!(Ledger::new(&*pool).forget("results-values", msg.id.as_str()).await.unwrap());
                    assert_eq!(stored(&pool, "results-values", &msg.id).await, 0);
                    assert_eq!(remember(&*pool, &msg, &2u8).await.unwrap(), StoredOutcome::Processed(2));
                    assert_eq!(remember(&*pool, &msg, &3u8).await.unwrap(), StoredOutcome::Replayed(2));
                    assert_eq!(effects(&pool, &msg.id).await, 2);
            }
        }
    };
}

backend_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_effects (message_id text NOT NULL)",
    insert_effect = "INSERT INTO dedup_result_effects (message_id) VALUES ($1)",
    backdate = "UPDATE dedup_results_prune SET processed_at = processed_at - interval '3 days' \
                WHERE message_id = $1",
    orders_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_orders (order_key text NOT NULL, \
                  CONSTRAINT dedup_result_orders_order_key UNIQUE (order_key))",
    order_placeholder = "$1",
);

backend_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_effects \
                   (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB",
    insert_effect = "INSERT INTO dedup_result_effects (message_id) VALUES (?)",
    backdate = "UPDATE dedup_results_prune SET processed_at = processed_at - INTERVAL 3 DAY \
                WHERE message_id = ?",
    orders_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_orders (order_key VARBINARY(255) NOT NULL, \
                  UNIQUE KEY dedup_result_orders_order_key (order_key)) ENGINE = InnoDB",
    order_placeholder = "?",
);

backend_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_effects (message_id TEXT NOT NULL)",
    insert_effect = "INSERT INTO dedup_result_effects (message_id) VALUES (?)",
    backdate = "UPDATE dedup_results_prune \
                SET processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 days') \
                WHERE message_id = ?1",
    orders_ddl = "CREATE TABLE IF NOT EXISTS dedup_result_orders (order_key TEXT NOT NULL); \
                  CREATE UNIQUE INDEX IF NOT EXISTS dedup_result_orders_order_key \
                  ON dedup_result_orders (order_key)",
    order_placeholder = "?",
);
