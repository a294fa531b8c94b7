//! Issue 8, defect 1 — PostgreSQL: a body that swallows a database error got
//! `Outcome::Processed`, but nothing committed.
//!
//! The body's failed statement aborts the transaction; PostgreSQL answers `COMMIT` with
//! the command tag `ROLLBACK` and no error, and sqlx's `commit()` returned `Ok`: the
//! caller acked, and neither the effect nor the dedup row existed. The handler now sends a
//! statement that fails with `25P02` in front of `COMMIT`, in the same round trip, and
//! reports `RolledBack` (after running the call again, as for a transient failure).

use dedup_runtime::{MAX_ATTEMPTS, Outcome, RolledBack, idempotent};
use dedup_suite::Runs;
use sqlx::PgConnection;
use sqlx::postgres::PgPool;

async fn pool() -> PgPool {
    let pool = dedup_suite::postgres().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS regress_swallow_effects (message_id text NOT NULL); \
         CREATE TABLE IF NOT EXISTS regress_swallow_seen (key text PRIMARY KEY); \
         INSERT INTO regress_swallow_seen (key) VALUES ('taken') ON CONFLICT DO NOTHING",
    )
    .await;
    pool
}

/// (effect rows, dedup rows) of message `id` for `consumer`.
async fn counts(pool: &PgPool, consumer: &str, id: &str) -> (i64, i64) {
    (
        dedup_suite::rows(pool, "regress_swallow_effects", "message_id", id).await,
        dedup_suite::claims(pool, consumer, id).await,
    )
}

/// The "insert if new" idiom, its unique violation swallowed on the runs listed in
/// `swallow_until` (1-based, inclusive).
#[idempotent(consumer = "regress-pg-swallow", key = id)]
async fn insert_if_new(
    tx: &mut PgConnection,
    id: &str,
    runs: &Runs,
    swallow_until: u32,
) -> Result<(), sqlx::Error> {
    let run = runs.next();
    sqlx::query("INSERT INTO regress_swallow_effects (message_id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    if run <= swallow_until {
        let _ = sqlx::query("INSERT INTO regress_swallow_seen (key) VALUES ('taken')")
            .execute(&mut *tx)
            .await;
    }
    Ok(())
}

#[tokio::test]
async fn a_swallowed_error_is_never_processed() {
    let pool = pool().await;
    let id = dedup_suite::unique("swallow-always");
    let runs = Runs::new();
    let result = insert_if_new(&pool, &id, &runs, u32::MAX).await;
    let error = result.expect_err("an aborted transaction is not processed");
    let rolled_back = RolledBack::find(&error).expect("typed as RolledBack");
    assert_eq!(rolled_back.database(), "PostgreSQL");
    assert_eq!(
        runs.get(),
        MAX_ATTEMPTS,
        "run again like a transient failure"
    );
    assert_eq!(counts(&pool, "regress-pg-swallow", &id).await, (0, 0));
    assert!(matches!(
        dedup_runtime::AckPolicy::<sqlx::Postgres>::new().decide(&Err::<Outcome<()>, _>(error), 1),
        dedup_runtime::Ack::DeadLetter
    ));

    // The redelivery, once the body no longer swallows: processed, once.
    let runs = Runs::new();
    let outcome = insert_if_new(&pool, &id, &runs, 0).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(counts(&pool, "regress-pg-swallow", &id).await, (1, 1));
}

#[tokio::test]
async fn a_swallowed_error_once_is_run_again_and_commits() {
    let pool = pool().await;
    let id = dedup_suite::unique("swallow-once");
    let runs = Runs::new();
    let outcome = insert_if_new(&pool, &id, &runs, 1).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(runs.get(), 2);
    assert_eq!(counts(&pool, "regress-pg-swallow", &id).await, (1, 1));
}

/// On a connection the caller lends, too.
#[tokio::test]
async fn a_swallowed_error_on_a_lent_connection() {
    use sqlx::Connection;
    let pool = pool().await;
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let id = dedup_suite::unique("swallow-lent");
    let runs = Runs::new();
    let error = insert_if_new(&mut conn, &id, &runs, u32::MAX)
        .await
        .unwrap_err();
    assert!(RolledBack::find(&error).is_some(), "{error}");
    assert!(!conn.is_in_transaction());
    assert_eq!(counts(&pool, "regress-pg-swallow", &id).await, (0, 0));
    let runs = Runs::new();
    assert!(
        insert_if_new(&mut conn, &id, &runs, 0)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(counts(&pool, "regress-pg-swallow", &id).await, (1, 1));
}
