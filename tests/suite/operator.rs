//! The operator's tools on every backend: `Ledger::processed_at` ("was this id processed,
//! and when?") and `Ledger::forget` (the deliberate replay of one id).
//!
//! Each case runs on PostgreSQL and MariaDB (the machine's servers) and on a temporary
//! SQLite file, instantiated once per backend by `operator_suite!`. Handlers record into
//! the shared `processed_messages` (or one fixed custom table per backend) under the
//! consumer `operator`, with ids from `dedup_suite::unique`, and write one row per run of
//! their body into an effects table without a unique constraint: a count of 2 is a body
//! that ran twice. Every assertion on a return value is paired with one on the tables.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dedup_runtime::{
    InvalidConsumer, InvalidMessageId, Ledger, LedgerError, MAX_CONSUMER_LEN, MAX_MESSAGE_ID_LEN,
    Outcome, idempotent,
};
use dedup_suite::{claims, claims_in, rows, unique};

/// The `consumer = "…"` of every handler here.
const CONSUMER: &str = "operator";

/// Microseconds since the Unix epoch, as `SystemTime`.
fn at_micros(micros: i64) -> SystemTime {
    if micros >= 0 {
        UNIX_EPOCH + Duration::from_micros(micros.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_micros(micros.unsigned_abs())
    }
}

/// How far `a` lies from `b`, either way.
fn distance(a: SystemTime, b: SystemTime) -> Duration {
    a.duration_since(b)
        .or_else(|_| b.duration_since(a))
        .unwrap_or_default()
}

macro_rules! operator_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        // The effects table: no unique constraint, one row per run of a body.
        effects = $effects:literal,
        effects_ddl = $effects_ddl:literal,
        insert_effect = $insert_effect:literal,
        // A custom dedup table, a literal for the handler's `table = …`.
        custom_table = $custom_table:literal,
        // The schema (database) that unqualified names resolve to.
        current_schema = $current_schema:literal,
        // The database's clock, now, in microseconds since the Unix epoch.
        now_micros = $now_micros:literal,
        // A dedup row with a given `processed_at` (text). Binds: consumer, id, time.
        insert_at = $insert_at:literal,
        // A dedup row with the column's default `processed_at`. Binds: consumer, id.
        insert_now = $insert_now:literal,
        // Stored times and the instants they are, in microseconds since the epoch.
        instants = [$(($instant_text:literal, $instant_micros:expr)),* $(,)?],
        // How a writer begins a transaction on this backend (SQLite: the write lock).
        begin = $begin:literal,
        // Whether `forget` waits for a transaction holding an uncommitted claim.
        forget_waits = $forget_waits:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::{AssertSqlSafe, Pool};

            type Db = $db;

            #[idempotent(consumer = "operator", key = id)]
            async fn apply(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect).bind(id).execute(&mut *tx).await?;
                Ok(())
            }

            #[idempotent(consumer = "operator", key = id, table = $custom_table)]
            async fn apply_custom(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect).bind(id).execute(&mut *tx).await?;
                Ok(())
            }

            async fn effects_table(pool: &Pool<Db>) {
                dedup_suite::ddl(pool, $effects_ddl).await;
            }

            /// Runs of the body for `id`: rows of the effects table.
            async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                rows(pool, $effects, "message_id", id).await
            }

            async fn db_now(pool: &Pool<Db>) -> SystemTime {
                let micros: i64 = sqlx::query_scalar($now_micros).fetch_one(pool).await.unwrap();
                at_micros(micros)
            }

            async fn insert_at(pool: &Pool<Db>, table: &str, consumer: &str, id: &str, at: &str) {
                let done = sqlx::query(AssertSqlSafe(format!($insert_at, t = table)))
                    .bind(consumer)
                    .bind(id)
                    .bind(at)
                    .execute(pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1);
            }

            async fn insert_now(pool: &Pool<Db>, consumer: &str, id: &str) {
                let sql = format!($insert_now, t = dedup_runtime::DEFAULT_TABLE);
                let done = sqlx::query(AssertSqlSafe(sql))
                    .bind(consumer)
                    .bind(id)
                    .execute(pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1);
            }

            /// Dedup rows of each `(consumer, id)`.
            async fn claim_counts(pool: &Pool<Db>, keys: &[(&str, &str)]) -> Vec<i64> {
                let mut counts = Vec::new();
                for (consumer, id) in keys {
                    counts.push(claims(pool, consumer, id).await);
                }
                counts
            }

            /// `processed_at` is within a few seconds of the database's clock, read after it.
            async fn assert_recent(pool: &Pool<Db>, at: SystemTime) {
                let now = db_now(pool).await;
                // SQLite's clock has milliseconds: allow one of rounding either way.
                assert!(
                    at <= now + Duration::from_millis(1),
                    "processed at {at:?}, after the database's now {now:?}"
                );
                assert!(
                    distance(now, at) < Duration::from_secs(5),
                    "processed at {at:?}, database now {now:?}"
                );
            }

            #[tokio::test]
            async fn lookup_before_and_after_processing() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let id = unique("lookup");

                assert_eq!(ledger.processed_at(CONSUMER, id.as_str()).await.unwrap(), None);
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 0);

                assert!(matches!(apply(&*pool, &id).await.unwrap(), Outcome::Processed(())));
                let at = ledger
                    .processed_at(CONSUMER, id.as_str())
                    .await
                    .unwrap()
                    .expect("processed");
                assert_recent(&pool, at).await;
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                assert_eq!(effects(&pool, &id).await, 1);

                // A duplicate changes nothing, the time included.
                assert!(apply(&*pool, &id).await.unwrap().is_duplicate());
                assert_eq!(ledger.processed_at(CONSUMER, &id).await.unwrap(), Some(at));
                assert_eq!(effects(&pool, &id).await, 1);
                // Another consumer never processed it.
                assert_eq!(ledger.processed_at("operator-other", &id).await.unwrap(), None);
            }

            /// Stored times come back as the instants they are, exactly (SQLite stores
            /// milliseconds), before the epoch too.
            #[tokio::test]
            async fn the_time_is_the_stored_instant() {
                let pool = $pool;
                let ledger = Ledger::new(&*pool);
                for (text, micros) in [$(($instant_text, $instant_micros)),*] {
                    let id = unique("instant");
                    insert_at(&pool, dedup_runtime::DEFAULT_TABLE, CONSUMER, &id, text).await;
                    assert_eq!(
                        ledger.processed_at(CONSUMER, &id).await.unwrap(),
                        Some(at_micros(micros)),
                        "{text}"
                    );
                }
            }

            #[tokio::test]
            async fn forget_makes_the_next_delivery_run_the_handler_again() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let id = unique("replay");

                assert!(apply(&*pool, &id).await.unwrap().is_processed());
                assert!(apply(&*pool, &id).await.unwrap().is_duplicate());
                assert_eq!(effects(&pool, &id).await, 1);
                let first = ledger.processed_at(CONSUMER, &id).await.unwrap().unwrap();

                assert!(ledger.forget(CONSUMER, &id).await.unwrap());
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 0);
                assert_eq!(ledger.processed_at(CONSUMER, &id).await.unwrap(), None);
                // Forgetting again finds nothing.
                assert!(!ledger.forget(CONSUMER, &id).await.unwrap());

                // The next delivery runs the body again, and is recorded again.
                assert!(apply(&*pool, &id).await.unwrap().is_processed());
                assert_eq!(effects(&pool, &id).await, 2);
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                let second = ledger.processed_at(CONSUMER, &id).await.unwrap().unwrap();
                assert!(second >= first, "{second:?} < {first:?}");
                assert_recent(&pool, second).await;
                // And the one after that is a duplicate again.
                assert!(apply(&*pool, &id).await.unwrap().is_duplicate());
                assert_eq!(effects(&pool, &id).await, 2);
            }

            #[tokio::test]
            async fn forget_deletes_only_that_consumers_row_of_that_id() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let id = unique("only");
                let other_id = unique("only-other");
                assert!(apply(&*pool, &id).await.unwrap().is_processed());
                assert!(apply(&*pool, &other_id).await.unwrap().is_processed());
                insert_now(&pool, "operator-other", &id).await;
                let everything = [
                    (CONSUMER, id.as_str()),
                    (CONSUMER, other_id.as_str()),
                    ("operator-other", id.as_str()),
                ];
                // An unknown id, and a known id under a consumer that never had it.
                assert!(!ledger.forget(CONSUMER, unique("unknown")).await.unwrap());
                assert!(!ledger.forget("operator-third", &id).await.unwrap());
                assert_eq!(claim_counts(&pool, &everything).await, [1, 1, 1]);

                assert!(ledger.forget(CONSUMER, &id).await.unwrap());
                assert_eq!(claim_counts(&pool, &everything).await, [0, 1, 1]);
                assert!(ledger.processed_at("operator-other", &id).await.unwrap().is_some());
                assert!(ledger.processed_at(CONSUMER, &other_id).await.unwrap().is_some());
            }

            /// `A` ≠ `a`, `a` ≠ `a `, composed `é` ≠ decomposed: as the claim compares them.
            #[tokio::test]
            async fn ids_differing_in_case_or_trailing_space_are_distinct() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let suffix = unique("");
                let id = format!("Case-\u{e9}{suffix}");
                assert!(apply(&*pool, &id).await.unwrap().is_processed());
                let variants = [
                    format!("case-\u{e9}{suffix}"),
                    format!("CASE-\u{c9}{suffix}"),
                    format!("Case-\u{e9}{suffix} "),
                    format!(" Case-\u{e9}{suffix}"),
                    format!("Case-e\u{301}{suffix}"),
                ];
                for variant in &variants {
                    assert_eq!(
                        ledger.processed_at(CONSUMER, variant).await.unwrap(),
                        None,
                        "{variant:?}"
                    );
                    assert!(!ledger.forget(CONSUMER, variant).await.unwrap(), "{variant:?}");
                }
                // The consumer compares byte for byte too.
                assert_eq!(ledger.processed_at("Operator", &id).await.unwrap(), None);
                assert!(!ledger.forget("operator ", &id).await.unwrap());
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                assert!(ledger.processed_at(CONSUMER, &id).await.unwrap().is_some());

                assert!(ledger.forget(CONSUMER, &id).await.unwrap());
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 0);
            }

            /// Integer and UUID keys are the text a handler records for them.
            #[tokio::test]
            async fn integer_and_uuid_keys() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
                let number = u64::try_from(nanos % u128::from(u64::MAX)).unwrap();
                let uuid = uuid::Uuid::from_u128(nanos ^ (u128::from(std::process::id()) << 64));

                assert_eq!(ledger.processed_at(CONSUMER, number).await.unwrap(), None);
                assert!(apply(&*pool, &number.to_string()).await.unwrap().is_processed());
                assert!(apply(&*pool, &uuid.to_string()).await.unwrap().is_processed());
                assert!(ledger.processed_at(CONSUMER, number).await.unwrap().is_some());
                assert!(ledger.processed_at(CONSUMER, &number).await.unwrap().is_some());
                assert!(ledger.processed_at(CONSUMER, uuid).await.unwrap().is_some());

                assert!(ledger.forget(CONSUMER, number).await.unwrap());
                assert!(ledger.forget(CONSUMER, uuid).await.unwrap());
                assert_eq!(claims(&*pool, CONSUMER, &number.to_string()).await, 0);
                assert_eq!(claims(&*pool, CONSUMER, &uuid.to_string()).await, 0);
            }

            #[tokio::test]
            async fn invalid_ids_and_consumers_are_refused_with_nothing_deleted() {
                let pool = $pool;
                effects_table(&pool).await;
                let ledger = Ledger::new(&*pool);
                let id = unique("kept");
                assert!(apply(&*pool, &id).await.unwrap().is_processed());

                let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
                let ids = [
                    ("", InvalidMessageId::Empty),
                    (
                        long.as_str(),
                        InvalidMessageId::TooLong { len: MAX_MESSAGE_ID_LEN + 1, max: MAX_MESSAGE_ID_LEN },
                    ),
                    ("a\0b", InvalidMessageId::ContainsNul { position: 1 }),
                ];
                for (bad, expected) in &ids {
                    for error in [
                        ledger.processed_at(CONSUMER, *bad).await.unwrap_err(),
                        ledger.forget(CONSUMER, *bad).await.unwrap_err(),
                    ] {
                        match &error {
                            LedgerError::InvalidMessageId(found) => assert_eq!(found, expected),
                            other => panic!("{bad:?}: {other:?}"),
                        }
                        // Recognisable through the chain, like a handler's.
                        assert_eq!(InvalidMessageId::find(&error), Some(expected.clone()));
                    }
                }
                // The longest id is an id: not processed, nothing to forget.
                let longest = "y".repeat(MAX_MESSAGE_ID_LEN);
                assert_eq!(ledger.processed_at(CONSUMER, longest.as_str()).await.unwrap(), None);
                assert!(!ledger.forget(CONSUMER, longest.as_str()).await.unwrap());

                let long = "c".repeat(MAX_CONSUMER_LEN + 1);
                let consumers = [
                    ("", InvalidConsumer::Empty),
                    (
                        long.as_str(),
                        InvalidConsumer::TooLong { len: MAX_CONSUMER_LEN + 1, max: MAX_CONSUMER_LEN },
                    ),
                    ("oper\0ator", InvalidConsumer::ContainsNul { position: 4 }),
                ];
                for (bad, expected) in &consumers {
                    for error in [
                        ledger.processed_at(bad, &id).await.unwrap_err(),
                        ledger.forget(bad, &id).await.unwrap_err(),
                    ] {
                        match &error {
                            LedgerError::InvalidConsumer(found) => assert_eq!(found, expected),
                            other => panic!("{bad:?}: {other:?}"),
                        }
                    }
                }
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                assert_eq!(effects(&pool, &id).await, 1);
            }

            #[tokio::test]
            async fn a_custom_table() {
                let pool = $pool;
                effects_table(&pool).await;
                {
                    let _one_at_a_time = dedup_suite::ddl_lock().await;
                    dedup_runtime::migrate_table(&*pool, $custom_table).await.unwrap();
                }
                let schema: String =
                    sqlx::query_scalar($current_schema).fetch_one(&*pool).await.unwrap();
                let plain = Ledger::new(&*pool).in_table($custom_table).unwrap();
                let qualified_name = format!("{schema}.{}", $custom_table);
                let qualified = Ledger::new(&*pool).in_table(&qualified_name).unwrap();
                assert_eq!(qualified.table().name(), qualified_name);
                let default = Ledger::new(&*pool);
                let id = unique("custom");

                assert!(apply_custom(&*pool, &id).await.unwrap().is_processed());
                let at = plain.processed_at(CONSUMER, &id).await.unwrap().expect("processed");
                assert_recent(&pool, at).await;
                assert_eq!(qualified.processed_at(CONSUMER, &id).await.unwrap(), Some(at));
                // The default table knows nothing of it, and forgetting there deletes nothing.
                assert_eq!(default.processed_at(CONSUMER, &id).await.unwrap(), None);
                assert!(!default.forget(CONSUMER, &id).await.unwrap());
                assert_eq!(claims_in(&*pool, $custom_table, CONSUMER, &id).await, 1);

                assert!(qualified.forget(CONSUMER, &id).await.unwrap());
                assert_eq!(claims_in(&*pool, $custom_table, CONSUMER, &id).await, 0);
                assert_eq!(plain.processed_at(CONSUMER, &id).await.unwrap(), None);
                assert!(apply_custom(&*pool, &id).await.unwrap().is_processed());
                assert_eq!(effects(&pool, &id).await, 2);
                assert_eq!(claims_in(&*pool, $custom_table, CONSUMER, &id).await, 1);
            }

            #[tokio::test]
            async fn a_missing_table_is_a_clear_error() {
                let pool = $pool;
                let missing = dedup_suite::unique_table("operator_missing");
                let elsewhere = format!("{}.processed_messages", dedup_suite::unique_table("nowhere"));
                for name in [missing.as_str(), elsewhere.as_str()] {
                    let ledger = Ledger::new(&*pool).in_table(name).unwrap();
                    for error in [
                        ledger.processed_at(CONSUMER, "id").await.unwrap_err(),
                        ledger.forget(CONSUMER, "id").await.unwrap_err(),
                    ] {
                        match &error {
                            LedgerError::MissingTable { table, .. } => assert_eq!(table.name(), name),
                            other => panic!("{name}: {other:?}"),
                        }
                        let message = error.to_string();
                        assert!(
                            message.contains(&format!("`{name}` does not exist"))
                                && message.contains("migrate_table"),
                            "{message}"
                        );
                        assert!(std::error::Error::source(&error).is_some());
                    }
                }
                let invalid = Ledger::new(&*pool).in_table("processed_messages; DROP TABLE x");
                assert!(invalid.is_err());
                // Through `?` into a `LedgerError`.
                let converted: LedgerError = invalid.unwrap_err().into();
                assert!(matches!(converted, LedgerError::InvalidTable(_)), "{converted:?}");
            }

            /// A lookup sees committed rows only, and never waits; `forget` waits for a
            /// transaction holding the id on MySQL and SQLite, not on PostgreSQL.
            ///
            /// On a table of its own: with a transaction held open on the shared table, a
            /// concurrent test's `migrate` queues for a table lock (PostgreSQL's `CREATE
            /// INDEX IF NOT EXISTS`, MySQL's `ALTER TABLE`) behind it, and every later
            /// statement on that table — the `forget` under test — queues behind that.
            #[tokio::test]
            async fn a_claim_in_flight() {
                let pool = $pool;
                let table = dedup_suite::unique_table("operator_in_flight");
                {
                    let _one_at_a_time = dedup_suite::ddl_lock().await;
                    dedup_runtime::migrate_table(&*pool, &table).await.unwrap();
                }
                let ledger = Ledger::new(&*pool).in_table(&table).unwrap();
                let id = unique("in-flight");
                let timeout = Duration::from_secs(10);

                let mut tx = pool.begin_with($begin).await.unwrap();
                sqlx::query(AssertSqlSafe(format!($insert_now, t = table)))
                    .bind(CONSUMER)
                    .bind(id.as_str())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let seen = tokio::time::timeout(timeout, ledger.processed_at(CONSUMER, &id))
                    .await
                    .expect("a lookup does not wait for the transaction");
                assert_eq!(seen.unwrap(), None, "an uncommitted claim is not seen");

                if $forget_waits {
                    let hold = Duration::from_millis(500);
                    let started = std::time::Instant::now();
                    let forget = async {
                        let forgotten = ledger.forget(CONSUMER, &id).await;
                        (forgotten, started.elapsed())
                    };
                    let ((forgotten, took), ()) = tokio::join!(forget, async {
                        tokio::time::sleep(hold).await;
                        tx.commit().await.unwrap();
                    });
                    assert!(forgotten.unwrap(), "waited for the commit, then deleted the row");
                    assert!(took >= hold, "returned after {took:?}, before the commit");
                    assert_eq!(claims_in(&*pool, &table, CONSUMER, &id).await, 0);
                } else {
                    let forgotten = tokio::time::timeout(timeout, ledger.forget(CONSUMER, &id))
                        .await
                        .expect("forget does not wait for the transaction");
                    assert!(!forgotten.unwrap(), "the uncommitted row is not seen");
                    tx.commit().await.unwrap();
                    assert_eq!(claims_in(&*pool, &table, CONSUMER, &id).await, 1);
                    assert!(ledger.processed_at(CONSUMER, &id).await.unwrap().is_some());
                }
                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
                    .execute(&*pool)
                    .await
                    .unwrap();
            }
        }
    };
}

operator_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "operator_effects_postgres",
    effects_ddl = "CREATE TABLE IF NOT EXISTS operator_effects_postgres (message_id text NOT NULL)",
    insert_effect = "INSERT INTO operator_effects_postgres (message_id) VALUES ($1)",
    custom_table = "operator_custom_postgres",
    current_schema = "SELECT current_schema()::text",
    now_micros = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8",
    insert_at = "INSERT INTO {t} (consumer, message_id, processed_at) \
                 VALUES ($1, $2, $3::timestamptz)",
    insert_now = "INSERT INTO {t} (consumer, message_id) VALUES ($1, $2)",
    instants = [
        ("2001-09-09T01:46:40.123456Z", 1_000_000_000_123_456),
        ("2001-09-09 03:46:40.123456+02", 1_000_000_000_123_456),
        ("1969-07-20T20:17:40.5Z", -14_182_939_500_000),
        ("1970-01-01T00:00:00Z", 0),
    ],
    begin = "BEGIN",
    forget_waits = false,
);

operator_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "operator_effects_mysql",
    effects_ddl = "CREATE TABLE IF NOT EXISTS operator_effects_mysql \
                   (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    insert_effect = "INSERT INTO operator_effects_mysql (message_id) VALUES (?)",
    custom_table = "operator_custom_mysql",
    current_schema = "SELECT DATABASE()",
    now_micros = "SELECT TIMESTAMPDIFF(MICROSECOND, CAST('1970-01-01' AS DATETIME(6)), \
                  UTC_TIMESTAMP(6))",
    // `processed_at` holds UTC.
    insert_at = "INSERT INTO {t} (consumer, message_id, processed_at) \
                 VALUES (?, ?, CAST(? AS DATETIME(6)))",
    insert_now = "INSERT INTO {t} (consumer, message_id) VALUES (?, ?)",
    instants = [
        ("2001-09-09 01:46:40.123456", 1_000_000_000_123_456),
        ("1969-07-20 20:17:40.5", -14_182_939_500_000),
        ("1970-01-01 00:00:00", 0),
    ],
    begin = "BEGIN",
    forget_waits = true,
);

operator_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    effects = "operator_effects_sqlite",
    effects_ddl = "CREATE TABLE IF NOT EXISTS operator_effects_sqlite (message_id TEXT NOT NULL)",
    insert_effect = "INSERT INTO operator_effects_sqlite (message_id) VALUES (?)",
    custom_table = "operator_custom_sqlite",
    current_schema = "SELECT 'main'",
    now_micros = "SELECT CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) \
                  * 1000",
    insert_at = "INSERT INTO {t} (consumer, message_id, processed_at) VALUES (?1, ?2, ?3)",
    insert_now = "INSERT INTO {t} (consumer, message_id) VALUES (?1, ?2)",
    // The column's own format, milliseconds; and SQLite's other time formats.
    instants = [
        ("2001-09-09T01:46:40.123Z", 1_000_000_000_123_000),
        ("2001-09-09 01:46:40.123", 1_000_000_000_123_000),
        ("1969-07-20T20:17:40.500Z", -14_182_939_500_000),
        ("1970-01-01T00:00:00.000Z", 0),
        ("9999-12-31T23:59:59.999Z", 253_402_300_799_999_000),
    ],
    begin = "BEGIN IMMEDIATE",
    forget_waits = true,
);

/// A `processed_at` that SQLite cannot read as a time (a row written by hand) is an
/// error, not a made-up time.
#[tokio::test]
async fn sqlite_text_that_is_not_a_time_is_an_error() {
    let pool = dedup_suite::sqlite().await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         VALUES ('operator', 'garbled', 'yesterday')",
    )
    .execute(&*pool)
    .await
    .unwrap();
    let error = Ledger::new(&*pool)
        .processed_at(CONSUMER, "garbled")
        .await
        .unwrap_err();
    assert!(
        matches!(&error, LedgerError::Database(sqlx::Error::Decode(_))),
        "{error:?}"
    );
    assert!(error.to_string().contains("is not a time"), "{error}");
}

/// The instant is the same whatever the session's time zone: PostgreSQL's `timestamptz`
/// is read with `extract(epoch …)`, MySQL's UTC `DATETIME(6)` with `TIMESTAMPDIFF`, and
/// neither depends on `TimeZone` / `time_zone` (`UNIX_TIMESTAMP` would).
mod session_time_zone {
    use super::*;
    use sqlx::pool::PoolOptions;

    async fn zoned<DB: dedup_runtime::Backend>(url: &str, zone: &'static str) -> sqlx::Pool<DB>
    where
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    {
        PoolOptions::<DB>::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql(zone).execute(conn).await?;
                    Ok(())
                })
            })
            .connect(url)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn postgres() {
        let pool = dedup_suite::postgres().await;
        let id = unique("zone");
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, processed_at) \
             VALUES ($1, $2, '2001-09-09T01:46:40.123456Z')",
        )
        .bind(CONSUMER)
        .bind(&id)
        .execute(&pool)
        .await
        .unwrap();
        let expected = Some(at_micros(1_000_000_000_123_456));
        for zone in [
            "SET TIME ZONE 'Asia/Kolkata'",
            "SET TIME ZONE 'America/St_Johns'",
        ] {
            let zoned = zoned::<sqlx::Postgres>(&dedup_suite::postgres_url(), zone).await;
            let ledger = Ledger::new(&zoned);
            assert_eq!(
                ledger.processed_at(CONSUMER, &id).await.unwrap(),
                expected,
                "{zone}"
            );
        }
        assert!(Ledger::new(&pool).forget(CONSUMER, &id).await.unwrap());
    }

    #[tokio::test]
    async fn mysql() {
        let pool = dedup_suite::mysql().await;
        let id = unique("zone");
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, processed_at) \
             VALUES (?, ?, '2001-09-09 01:46:40.123456')",
        )
        .bind(CONSUMER)
        .bind(&id)
        .execute(&pool)
        .await
        .unwrap();
        let expected = Some(at_micros(1_000_000_000_123_456));
        for zone in ["SET time_zone = '+05:30'", "SET time_zone = '-03:30'"] {
            let zoned = zoned::<sqlx::MySql>(&dedup_suite::mysql_url(), zone).await;
            let ledger = Ledger::new(&zoned);
            assert_eq!(
                ledger.processed_at(CONSUMER, &id).await.unwrap(),
                expected,
                "{zone}"
            );
        }
        assert!(Ledger::new(&pool).forget(CONSUMER, &id).await.unwrap());
    }
}
