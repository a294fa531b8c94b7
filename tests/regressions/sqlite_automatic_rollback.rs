//! Issue 8, defect 2 — SQLite: an automatic rollback poisoned the pooled connection.
//!
//! A trigger's `RAISE(ROLLBACK, …)` (like `SQLITE_FULL`, an I/O error or `ON CONFLICT
//! ROLLBACK`) ends the transaction inside SQLite. The handler's `ROLLBACK` (or `COMMIT`,
//! when the body swallowed the error) then failed, sqlx kept counting the transaction
//! open, and every later call on that connection failed with `InvalidSavePointStatement`
//! — with `max_connections(1)`, the whole consumer. The handler now repairs the
//! bookkeeping, and reports `RolledBack` when the body had swallowed the error.

use std::time::Duration;

use dedup_runtime::{Outcome, RolledBack, idempotent};
use dedup_suite::{Runs, TempSqlite};
use sqlx::{SqliteConnection, SqlitePool};

const CONSUMER: &str = "regress-sqlite-rollback";

/// One connection: the one an automatic rollback would poison.
async fn pool() -> TempSqlite {
    let db = dedup_suite::sqlite_with(1, Duration::from_secs(10)).await;
    dedup_suite::ddl(
        &*db,
        "CREATE TABLE effects (message_id TEXT NOT NULL); \
         CREATE TABLE guarded (v TEXT NOT NULL); \
         CREATE TRIGGER guarded_boom BEFORE INSERT ON guarded WHEN NEW.v = 'boom' \
         BEGIN SELECT RAISE(ROLLBACK, 'boom'); END",
    )
    .await;
    db
}

/// (effect rows, dedup rows) of message `id`.
async fn counts(pool: &SqlitePool, id: &str) -> (i64, i64) {
    (
        dedup_suite::rows(pool, "effects", "message_id", id).await,
        dedup_suite::claims(pool, CONSUMER, id).await,
    )
}

/// Writes its effect, then a row the trigger answers with `RAISE(ROLLBACK, …)` on the
/// runs up to `boom_until`; `swallow` drops that error instead of returning it.
#[idempotent(consumer = "regress-sqlite-rollback", key = id)]
async fn guarded(
    tx: &mut SqliteConnection,
    id: &str,
    runs: &Runs,
    boom_until: u32,
    swallow: bool,
) -> Result<(), sqlx::Error> {
    let run = runs.next();
    sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let v = if run <= boom_until { "boom" } else { "fine" };
    let inserted = sqlx::query("INSERT INTO guarded (v) VALUES (?)")
        .bind(v)
        .execute(&mut *tx)
        .await;
    match inserted {
        Err(_) if swallow => Ok(()),
        other => other.map(drop),
    }
}

#[tokio::test]
async fn a_body_error_after_an_automatic_rollback_leaves_the_connection_usable() {
    let pool = pool().await;
    let id = dedup_suite::unique("rb-error");
    let runs = Runs::new();
    let error = guarded(&*pool, &id, &runs, u32::MAX, false)
        .await
        .unwrap_err();
    assert!(
        error.as_database_error().is_some(),
        "the body's own error: {error}"
    );
    assert_eq!(counts(&pool, &id).await, (0, 0));

    // The redelivery, on the one pooled connection.
    let runs = Runs::new();
    let outcome = guarded(&*pool, &id, &runs, 0, false).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(counts(&pool, &id).await, (1, 1));
    let other = dedup_suite::unique("rb-other");
    assert!(
        guarded(&*pool, &other, &Runs::new(), 0, false)
            .await
            .unwrap()
            .is_processed()
    );
}

#[tokio::test]
async fn a_swallowed_automatic_rollback_is_not_processed() {
    let pool = pool().await;
    let id = dedup_suite::unique("rb-swallowed");
    let runs = Runs::new();
    let error = guarded(&*pool, &id, &runs, u32::MAX, true)
        .await
        .unwrap_err();
    let rolled_back = RolledBack::find(&error).expect("typed as RolledBack");
    assert_eq!(rolled_back.database(), "SQLite");
    assert_eq!(counts(&pool, &id).await, (0, 0));

    // Once: run again within the call, and committed.
    let once = dedup_suite::unique("rb-once");
    let runs = Runs::new();
    assert_eq!(
        guarded(&*pool, &once, &runs, 1, true).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(runs.get(), 2);
    assert_eq!(counts(&pool, &once).await, (1, 1));
}

/// On a connection the caller lends, the bookkeeping is repaired too.
#[tokio::test]
async fn a_lent_connection_is_repaired() {
    use sqlx::Connection;
    let pool = pool().await;
    let mut conn = pool.acquire().await.unwrap();
    let id = dedup_suite::unique("rb-lent");
    guarded(&mut *conn, &id, &Runs::new(), u32::MAX, false)
        .await
        .unwrap_err();
    assert!(!conn.is_in_transaction());
    assert!(
        guarded(&mut *conn, &id, &Runs::new(), 0, false)
            .await
            .unwrap()
            .is_processed()
    );
    drop(conn);
    assert_eq!(counts(&pool, &id).await, (1, 1));
}
