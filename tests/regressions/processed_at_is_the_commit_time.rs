//! Issue 8, defect 8 — `processed_at` was the claim time, not the commit time.
//!
//! The redelivery window runs from the first successful processing (the commit); a slow
//! transaction's id was recorded up to its length earlier (inside a caller's transaction
//! on PostgreSQL, at the caller's `BEGIN`: `now()` is the transaction's start), so pruning
//! at age = window deleted it early. The claim now records its own time, a transaction
//! slower than `STAMP_AFTER` moves it to its end (MySQL/MariaDB: in the checked commit;
//! since issue 28 only then, as elsewhere), and pruning keeps `STAMP_AFTER` as a margin.

use std::time::Duration;

use dedup_runtime::{STAMP_AFTER, idempotent};
use sqlx::{Connection, MySqlConnection, PgConnection, SqliteConnection};

/// Long enough past `STAMP_AFTER` that the claim time and the commit time cannot be
/// mistaken for each other.
const SLOW: Duration = Duration::from_millis(2_500);

#[idempotent(consumer = "regress-commit-time", key = id)]
async fn pg_slow(tx: &mut PgConnection, id: &str, pause: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tokio::time::sleep(pause).await;
    Ok(())
}

#[idempotent(consumer = "regress-commit-time", key = id)]
async fn my_slow(tx: &mut MySqlConnection, id: &str, pause: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tokio::time::sleep(pause).await;
    Ok(())
}

#[idempotent(consumer = "regress-commit-time", key = id)]
async fn sqlite_slow(
    tx: &mut SqliteConnection,
    id: &str,
    pause: Duration,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tokio::time::sleep(pause).await;
    Ok(())
}

#[test]
fn the_margin_is_short() {
    assert!(STAMP_AFTER < SLOW);
}

#[tokio::test]
async fn postgres() {
    let pool = dedup_suite::postgres().await;
    let age = |id: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT extract(epoch FROM clock_timestamp() - processed_at)::float8 \
                 FROM processed_messages WHERE consumer = 'regress-commit-time' AND message_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let id = dedup_suite::unique("ct-pg");
    assert!(pg_slow(&pool, &id, SLOW).await.unwrap().is_processed());
    let seconds = age(id).await;
    assert!(seconds < 1.0, "recorded at the commit, {seconds} s ago");

    // Inside a caller's transaction that began long before the handler's claim.
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tokio::time::sleep(SLOW).await;
    let id = dedup_suite::unique("ct-pg-nested");
    assert!(
        pg_slow(&mut tx, &id, Duration::ZERO)
            .await
            .unwrap()
            .is_processed()
    );
    tx.commit().await.unwrap();
    let seconds = age(id).await;
    assert!(
        seconds < 1.0,
        "recorded at the claim, not the caller's BEGIN: {seconds} s ago"
    );
}

#[tokio::test]
async fn mariadb() {
    let pool = dedup_suite::mysql().await;
    let id = dedup_suite::unique("ct-my");
    assert!(my_slow(&pool, &id, SLOW).await.unwrap().is_processed());
    let micros: i64 = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(MICROSECOND, processed_at, UTC_TIMESTAMP(6)) \
         FROM processed_messages WHERE consumer = 'regress-commit-time' AND message_id = ?",
    )
    .bind(&id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        micros < 1_000_000,
        "recorded at the commit, {micros} µs ago"
    );
}

#[tokio::test]
async fn sqlite() {
    let db = dedup_suite::sqlite().await;
    let id = dedup_suite::unique("ct-sqlite");
    assert!(
        sqlite_slow(&db.pool, &id, SLOW)
            .await
            .unwrap()
            .is_processed()
    );
    let seconds: f64 = sqlx::query_scalar(
        "SELECT (julianday('now') - julianday(processed_at)) * 86400.0 \
         FROM processed_messages WHERE message_id = ?",
    )
    .bind(&id)
    .fetch_one(&*db)
    .await
    .unwrap();
    assert!(seconds < 1.0, "recorded at the commit, {seconds} s ago");
}

/// Pruning keeps `STAMP_AFTER` past the age: an id half of it past the age may belong to
/// a transaction that committed within the age, and stays; one twice past it goes.
#[tokio::test]
async fn pruning_keeps_the_margin() {
    let db = dedup_suite::sqlite().await;
    let age = Duration::from_secs(3600);
    let past = |by: Duration| format!("-{:.3} seconds", (age + by).as_secs_f64());
    for (id, by) in [("within", STAMP_AFTER / 2), ("beyond", STAMP_AFTER * 2)] {
        sqlx::query(
            "INSERT INTO processed_messages (consumer, message_id, processed_at) \
             VALUES ('regress-margin', ?1, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?2))",
        )
        .bind(id)
        .bind(past(by))
        .execute(&*db)
        .await
        .unwrap();
    }
    let done = dedup_runtime::Prune::new(age, age)
        .consumer("regress-margin")
        .run(&*db, |_| {})
        .await
        .unwrap();
    assert_eq!(done.deleted, 1);
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM processed_messages WHERE consumer = 'regress-margin'",
    )
    .fetch_all(&*db)
    .await
    .unwrap();
    assert_eq!(left, ["within"]);
}
