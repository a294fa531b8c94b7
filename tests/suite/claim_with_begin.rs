//! Issue 28: on MySQL/MariaDB, through a pool, the claim goes out with `BEGIN`, one
//! multi-statement query, its id written in as a hex literal; PostgreSQL keeps `BEGIN`
//! and a bound claim (folding them measured slower there: the guide's "What it generates").
//! These cases hold both to what the issue asks:
//!
//! - no id can change a statement, whatever the session's string settings: ids with
//!   `'`, `\`, `$$`, multi-byte characters and the maximum length, each processed once,
//!   stored byte for byte, its copy a duplicate, with `standard_conforming_strings = off`
//!   (PostgreSQL) and `NO_BACKSLASH_ESCAPES` (MySQL) as well as the defaults, through a
//!   pool and through a lent connection;
//! - a call cancelled while its claim is in flight leaves no claim behind: on a lent
//!   connection the caller's own next transaction does not commit it; a pooled connection
//!   is closed (MySQL, where sqlx does not count the transaction of a claim sent with
//!   `BEGIN`) or rolled back.

use std::time::Duration;

use dedup_runtime::{MAX_MESSAGE_ID_LEN, idempotent};
use sqlx::{Connection, MySql, MySqlConnection, PgConnection, Pool, Postgres};

/// The ids that would change a statement they were pasted into, one per way.
fn hostile_ids(run: &str) -> Vec<String> {
    let mut ids: Vec<String> = [
        "'",
        "it's",
        "''); DROP TABLE processed_messages; --",
        "back\\slash",
        "\\'; SELECT 1; --",
        "ends with a backslash \\",
        "$$",
        "$tag$ dollar $tag$",
        "E'\\x41'",
        "\\x41",
        "多字节-ü-🦀",
        "tab\tnew\nline\rreturn",
    ]
    .iter()
    .map(|id| format!("{run}:{id}"))
    .collect();
    // The maximum length, in one-byte characters and in multi-byte ones (255 bytes: 85
    // three-byte characters), and a quote in the last byte.
    let pad = |fill: &str, last: &str| {
        let mut id = format!("{run}:");
        while id.len() + fill.len() + last.len() <= MAX_MESSAGE_ID_LEN {
            id.push_str(fill);
        }
        id.push_str(last);
        id
    };
    ids.push(pad("x", "'"));
    ids.push(pad("字", ""));
    ids.push(pad("\\", "'"));
    ids
}

#[idempotent(consumer = "begin-claim-pg", key = id)]
async fn pg_record(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO begin_claim_effects (message_id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[idempotent(consumer = "begin-claim-my", key = id)]
async fn my_record(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO begin_claim_effects (message_id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A pool of 4 on `url` whose every session first runs `settings`.
async fn pool_with<DB: sqlx::Database>(url: &str, settings: &str) -> Pool<DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let settings = settings.to_owned();
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(4)
        .after_connect(move |conn, _| {
            let settings = settings.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(settings))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect(url)
        .await
        .unwrap()
}

async fn pg_pool(settings: &str) -> Pool<Postgres> {
    drop(dedup_suite::postgres().await); // migrated
    let pool = pool_with(&dedup_suite::postgres_url(), settings).await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS begin_claim_effects (message_id text NOT NULL)",
    )
    .await;
    pool
}

async fn my_pool(settings: &str) -> Pool<MySql> {
    drop(dedup_suite::mysql().await); // migrated
    let pool = pool_with(&dedup_suite::mysql_url(), settings).await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS begin_claim_effects \
         (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB",
    )
    .await;
    pool
}

/// What the database holds for `id` under `consumer`: dedup rows whose id is `id` byte for
/// byte, and effects.
async fn pg_state(pool: &Pool<Postgres>, consumer: &str, id: &str) -> (i64, i64) {
    let claims: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM processed_messages \
         WHERE consumer = $1 AND convert_to(message_id, 'UTF8') = convert_to($2, 'UTF8')",
    )
    .bind(consumer)
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    (
        claims,
        dedup_suite::rows(pool, "begin_claim_effects", "message_id", id).await,
    )
}

async fn my_state(pool: &Pool<MySql>, consumer: &str, id: &str) -> (i64, i64) {
    let claims: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM processed_messages \
         WHERE consumer = ? AND message_id = CAST(? AS BINARY) AND LENGTH(message_id) = ?",
    )
    .bind(consumer)
    .bind(id)
    .bind(id.len() as i64)
    .fetch_one(pool)
    .await
    .unwrap();
    (
        claims,
        dedup_suite::rows(pool, "begin_claim_effects", "message_id", id).await,
    )
}

/// Every hostile id through a pool and through a lent connection: one effect, one dedup
/// row equal to the id byte for byte, the copy a duplicate.
macro_rules! hostile_ids_case {
    ($name:ident, $pool:ident, $settings:expr, $record:ident, $state:ident, $consumer:literal, $prefix:literal) => {
        #[tokio::test]
        async fn $name() {
            let pool = $pool($settings).await;
            let run = dedup_suite::unique($prefix);
            let ids = hostile_ids(&run);
            for id in &ids {
                assert!(id.len() <= MAX_MESSAGE_ID_LEN, "{id:?}");
                assert!($record(&pool, id).await.unwrap().is_processed(), "{id:?}");
                assert!($record(&pool, id).await.unwrap().is_duplicate(), "{id:?}");
                assert_eq!($state(&pool, $consumer, id).await, (1, 1), "{id:?}");
            }
            let mut conn = pool.acquire().await.unwrap();
            for id in &ids {
                assert!(
                    $record(&mut *conn, id).await.unwrap().is_duplicate(),
                    "{id:?}"
                );
            }
            let again: Vec<String> = ids.iter().map(|id| format!("lent-{id}")).collect();
            for id in again.iter().filter(|id| id.len() <= MAX_MESSAGE_ID_LEN) {
                assert!(
                    $record(&mut *conn, id).await.unwrap().is_processed(),
                    "{id:?}"
                );
                assert!(
                    $record(&mut *conn, id).await.unwrap().is_duplicate(),
                    "{id:?}"
                );
                assert_eq!($state(&pool, $consumer, id).await, (1, 1), "{id:?}");
            }
        }
    };
}

hostile_ids_case!(
    postgres_ids_that_would_break_a_quoted_literal_are_stored_whole,
    pg_pool,
    "SET standard_conforming_strings = on",
    pg_record,
    pg_state,
    "begin-claim-pg",
    "pg-on"
);
hostile_ids_case!(
    postgres_without_standard_conforming_strings_too,
    pg_pool,
    "SET standard_conforming_strings = off; SET escape_string_warning = off",
    pg_record,
    pg_state,
    "begin-claim-pg",
    "pg-off"
);
hostile_ids_case!(
    mysql_ids_that_would_break_a_quoted_literal_are_stored_whole,
    my_pool,
    "SET SESSION sql_mode = REPLACE(@@sql_mode, 'NO_BACKSLASH_ESCAPES', '')",
    my_record,
    my_state,
    "begin-claim-my",
    "my-esc"
);
hostile_ids_case!(
    mysql_with_no_backslash_escapes_too,
    my_pool,
    "SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')",
    my_record,
    my_state,
    "begin-claim-my",
    "my-nbe"
);

/// Holds `id`'s dedup row inserted and uncommitted in another session, so that a claim
/// of the same id waits for it; its rollback lets the waiting claim's insert through.
async fn pg_hold(
    pool: &Pool<Postgres>,
    consumer: &str,
    id: &str,
) -> sqlx::Transaction<'static, Postgres> {
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ($1, $2)")
        .bind(consumer)
        .bind(id)
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// A call cancelled while its claim waits, on a lent connection: the claim's insert
/// completes on the server after the cancellation. The caller's next transaction on that
/// connection commits its own work, not the claim (the call's transaction queued its
/// `ROLLBACK` as it was dropped); a redelivery processes the message.
#[tokio::test]
async fn postgres_lent_connection_cancelled_in_the_claim_keeps_no_claim() {
    let pool = pg_pool("SET standard_conforming_strings = on").await;
    let id = dedup_suite::unique("pg-cancel-lent");
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let holder = pg_hold(&pool, "begin-claim-pg", &id).await;
    let call = tokio::time::timeout(Duration::from_millis(300), pg_record(&mut conn, &id)).await;
    assert!(
        call.is_err(),
        "the claim waited for the held row, and was cancelled"
    );
    holder.rollback().await.unwrap(); // the waiting insert goes through now

    let mine = dedup_suite::unique("pg-callers-own");
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("INSERT INTO begin_claim_effects (message_id) VALUES ($1)")
        .bind(&mine)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        pg_state(&pool, "begin-claim-pg", &mine).await,
        (0, 1),
        "the caller's work"
    );
    assert_eq!(
        pg_state(&pool, "begin-claim-pg", &id).await,
        (0, 0),
        "the caller's COMMIT did not commit the cancelled call's claim"
    );
    assert!(!conn.is_in_transaction());

    // The connection goes on as the caller's: the message, redelivered, is processed.
    assert!(pg_record(&mut conn, &id).await.unwrap().is_processed());
    assert_eq!(pg_state(&pool, "begin-claim-pg", &id).await, (1, 1));
}

/// The same through a pool: the cancelled call's connection is not returned with a claim in
/// it; the redelivery (which waits for that session's claim to go) processes it.
#[tokio::test]
async fn postgres_pooled_connection_cancelled_in_the_claim_keeps_no_claim() {
    let pool = pg_pool("SET standard_conforming_strings = on").await;
    let id = dedup_suite::unique("pg-cancel-pool");
    let holder = pg_hold(&pool, "begin-claim-pg", &id).await;
    let call = tokio::time::timeout(Duration::from_millis(300), pg_record(&pool, &id)).await;
    assert!(
        call.is_err(),
        "the claim waited for the held row, and was cancelled"
    );
    holder.rollback().await.unwrap();

    let redelivered = tokio::time::timeout(Duration::from_secs(20), pg_record(&pool, &id))
        .await
        .expect("the cancelled call's session ends")
        .unwrap();
    assert!(redelivered.is_processed());
    assert_eq!(pg_state(&pool, "begin-claim-pg", &id).await, (1, 1));
    // Every connection the pool holds is outside a transaction.
    for _ in 0..4 {
        let mut conn = pool.acquire().await.unwrap();
        let open = sqlx::raw_sql("SAVEPOINT probe").execute(&mut *conn).await;
        assert!(
            open.is_err(),
            "no pooled connection is left inside a transaction"
        );
    }
}

/// MySQL, through a pool: the cancelled call's connection (out of autocommit mode, its
/// claim in flight) is closed; the redelivery processes the message.
#[tokio::test]
async fn mysql_pooled_connection_cancelled_in_the_claim_keeps_no_claim() {
    let pool = my_pool("SET SESSION innodb_lock_wait_timeout = 30").await;
    let id = dedup_suite::unique("my-cancel-pool");
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES (?, ?)")
        .bind("begin-claim-my")
        .bind(&id)
        .execute(&mut *holder)
        .await
        .unwrap();
    let call = tokio::time::timeout(Duration::from_millis(300), my_record(&pool, &id)).await;
    assert!(
        call.is_err(),
        "the claim waited for the held row, and was cancelled"
    );
    holder.rollback().await.unwrap();

    let redelivered = tokio::time::timeout(Duration::from_secs(20), my_record(&pool, &id))
        .await
        .expect("the cancelled call's session ends")
        .unwrap();
    assert!(redelivered.is_processed());
    assert_eq!(my_state(&pool, "begin-claim-my", &id).await, (1, 1));
}

/// A duplicate through a pool leaves the connection outside any transaction (MySQL: its
/// failed claim, then the `ROLLBACK` with its look at the row in one round trip, and
/// autocommit mode again).
#[tokio::test]
async fn a_duplicate_leaves_the_pooled_connection_clean() {
    let pg = pg_pool("SET standard_conforming_strings = on").await;
    let my =
        my_pool("SET SESSION sql_mode = REPLACE(@@sql_mode, 'NO_BACKSLASH_ESCAPES', '')").await;
    let pg_one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let my_one = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&dedup_suite::mysql_url())
        .await
        .unwrap();
    let id = dedup_suite::unique("dup-clean");
    assert!(pg_record(&pg_one, &id).await.unwrap().is_processed());
    assert!(pg_record(&pg_one, &id).await.unwrap().is_duplicate());
    assert_eq!(pg_state(&pg, "begin-claim-pg", &id).await, (1, 1));
    let mut conn = pg_one.acquire().await.unwrap();
    let open = sqlx::raw_sql("SAVEPOINT probe").execute(&mut *conn).await;
    assert!(open.is_err(), "no transaction is left open");
    drop(conn);

    assert!(my_record(&my_one, &id).await.unwrap().is_processed());
    assert!(my_record(&my_one, &id).await.unwrap().is_duplicate());
    assert_eq!(my_state(&my, "begin-claim-my", &id).await, (1, 1));
    let mut conn = my_one.acquire().await.unwrap();
    let (autocommit, open): (i64, i64) = sqlx::query_as(
        "SELECT @@autocommit, (SELECT COUNT(*) FROM information_schema.INNODB_TRX \
         WHERE trx_mysql_thread_id = CONNECTION_ID())",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!((autocommit, open), (1, 0), "autocommit, no transaction");
}

/// The guide's sentence: a body that releases a savepoint named `dedup_alive` fails its
/// own commit, as if InnoDB had rolled the transaction back — the typed error after the
/// call's attempts, nothing committed — and the message is processed by the next call.
#[tokio::test]
async fn a_body_that_releases_the_handlers_savepoint_commits_nothing() {
    #[idempotent(consumer = "begin-claim-my", key = id)]
    async fn releases(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO begin_claim_effects (message_id) VALUES (?)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql("RELEASE SAVEPOINT dedup_alive")
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    let pool = my_pool("SET SESSION sql_mode = DEFAULT").await;
    let id = dedup_suite::unique("releases");
    let error = releases(&pool, &id).await.unwrap_err();
    assert!(
        dedup_runtime::RolledBack::find(&error).is_some(),
        "the typed error: {error}"
    );
    assert_eq!(my_state(&pool, "begin-claim-my", &id).await, (0, 0));
    assert!(my_record(&pool, &id).await.unwrap().is_processed());
    assert_eq!(my_state(&pool, "begin-claim-my", &id).await, (1, 1));
}
