//! Issue 8, defect 4 — a lent connection kept the transaction open until its next use.
//!
//! Given the caller's own connection (not a pool), a duplicate only *queued* its
//! `ROLLBACK`: on a quiet queue the session sat `idle in transaction` (PostgreSQL: a DBA's
//! `idle_in_transaction_session_timeout` then killed it; MariaDB: the failed claim kept a
//! lock on the dedup row; SQLite: `BEGIN IMMEDIATE` kept the database's write lock). On a
//! lent connection the handler now rolls back before it returns.

use std::time::Duration;

use dedup_runtime::idempotent;
use sqlx::{Connection, MySqlConnection, PgConnection, SqliteConnection};

#[idempotent(consumer = "regress-lent-pg", key = id)]
async fn pg_handler(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[idempotent(consumer = "regress-lent-my", key = id)]
async fn my_handler(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[idempotent(consumer = "regress-lent-sqlite", key = id)]
async fn sqlite_handler(tx: &mut SqliteConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    Ok(())
}

#[tokio::test]
async fn postgres_session_is_idle_after_each_outcome() {
    let pool = dedup_suite::postgres().await;
    let mut conn = PgConnection::connect(&dedup_suite::postgres_url())
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let state = || async {
        sqlx::query_scalar::<_, String>("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let id = dedup_suite::unique("lent-pg");
    assert!(pg_handler(&mut conn, &id).await.unwrap().is_processed());
    assert_eq!(state().await, "idle", "after processing");
    assert!(pg_handler(&mut conn, &id).await.unwrap().is_duplicate());
    assert_eq!(state().await, "idle", "after a duplicate");
}

#[tokio::test]
async fn mariadb_session_holds_no_transaction_after_a_duplicate() {
    let pool = dedup_suite::mysql().await;
    let mut conn = MySqlConnection::connect(&dedup_suite::mysql_url())
        .await
        .unwrap();
    let thread: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let open = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = ?",
        )
        .bind(thread)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let id = dedup_suite::unique("lent-my");
    assert!(my_handler(&mut conn, &id).await.unwrap().is_processed());
    assert_eq!(open().await, 0, "after processing");
    assert!(my_handler(&mut conn, &id).await.unwrap().is_duplicate());
    assert_eq!(
        open().await,
        0,
        "after a duplicate: no lock left on the dedup row"
    );
    // The pruner's DELETE of that very row does not wait.
    let deleted = tokio::time::timeout(
        Duration::from_secs(5),
        sqlx::query(
            "DELETE FROM processed_messages WHERE consumer = 'regress-lent-my' AND message_id = ?",
        )
        .bind(&id)
        .execute(&pool),
    )
    .await
    .expect("no lock is held")
    .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
}

#[tokio::test]
async fn sqlite_write_lock_is_released_after_a_duplicate() {
    let db = dedup_suite::sqlite().await;
    let mut conn = db.acquire().await.unwrap();
    let id = dedup_suite::unique("lent-sqlite");
    assert!(
        sqlite_handler(&mut *conn, &id)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        sqlite_handler(&mut *conn, &id)
            .await
            .unwrap()
            .is_duplicate()
    );
    // Another connection takes the write lock at once (no busy wait).
    let mut other = db.acquire().await.unwrap();
    sqlx::raw_sql("PRAGMA busy_timeout = 0")
        .execute(&mut *other)
        .await
        .unwrap();
    let mut tx = other
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("the write lock is free");
    sqlx::query("DELETE FROM processed_messages WHERE message_id = ?")
        .bind(&id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(conn);
}
