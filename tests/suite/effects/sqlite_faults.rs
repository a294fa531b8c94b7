//! SQLite: `SQLITE_LOCKED` from a checkpoint asked for inside a transaction; at `COMMIT`,
//! `SQLITE_BUSY` while a reader holds its shared lock on a database with a rollback
//! journal (in WAL mode readers never block a commit); a trigger's `RAISE(ROLLBACK, …)`,
//! which ends the transaction inside SQLite.

use std::time::Duration;

use dedup_suite::TempSqlite;
use sqlx::sqlite::SqliteJournalMode;
use sqlx::{SqliteConnection, SqlitePool};

pub const RECORD: &str = "INSERT INTO dedup_lease_results (message_id, attempt) VALUES (?1, ?2)";

pub async fn lease_pool() -> TempSqlite {
    let db = dedup_suite::sqlite().await;
    dedup_suite::ddl(
        &*db,
        "CREATE TABLE IF NOT EXISTS dedup_lease_results (message_id TEXT NOT NULL, attempt INTEGER NOT NULL)",
    )
    .await;
    db
}

/// The lease ends now, on the database's clock.
pub async fn expire(pool: &SqlitePool, consumer: &str, id: &str) {
    sqlx::query(
        "UPDATE processed_messages \
         SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
         WHERE consumer = ?1 AND message_id = ?2",
    )
    .bind(consumer)
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn pool() -> TempSqlite {
    let db = dedup_suite::sqlite().await;
    dedup_suite::ddl(
        &*db,
        "CREATE TABLE dedup_effects_guarded (v TEXT NOT NULL); \
         CREATE TRIGGER dedup_effects_boom BEFORE INSERT ON dedup_effects_guarded \
         BEGIN SELECT RAISE(ROLLBACK, 'boom'); END",
    )
    .await;
    db
}

pub const TRANSIENT_CODE: &str = "6";

pub async fn raise_transient(tx: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("PRAGMA wal_checkpoint(PASSIVE)")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

pub type CommitDb = TempSqlite;
/// SQLITE_BUSY.
pub const COMMIT_CODE: &str = "5";

/// How long a `COMMIT` waits for the reader before it fails.
const BUSY_TIMEOUT: Duration = Duration::from_millis(200);

pub async fn commit_fault_db() -> CommitDb {
    let db = dedup_suite::sqlite_journal(4, BUSY_TIMEOUT, SqliteJournalMode::Delete).await;
    dedup_runtime::migrate_table(&*db, super::COMMIT_TABLE)
        .await
        .unwrap();
    db
}

/// A connection of its own that, armed, is inside a read transaction.
#[derive(Debug)]
pub struct CommitFault {
    reader: tokio::sync::Mutex<(SqliteConnection, bool)>,
}

impl CommitFault {
    pub async fn new(db: &CommitDb) -> Self {
        CommitFault {
            reader: tokio::sync::Mutex::new((db.connect().await, false)),
        }
    }

    /// The reader takes its shared lock: the `COMMIT` of the handler's transaction
    /// (whose write lock admits readers until then) waits for it, then fails with
    /// `SQLITE_BUSY`.
    pub async fn arm(&self, _tx: &mut SqliteConnection, _id: &str) -> Result<(), sqlx::Error> {
        let mut reader = self.reader.lock().await;
        let (conn, armed) = &mut *reader;
        if !*armed {
            sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
            let _: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM dedup_effects_commit")
                .fetch_one(&mut *conn)
                .await?;
            *armed = true;
        }
        Ok(())
    }

    /// The reader ends its transaction.
    pub async fn disarm(&self) {
        let mut reader = self.reader.lock().await;
        let (conn, armed) = &mut *reader;
        if *armed {
            sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
            *armed = false;
        }
    }
}

#[derive(Debug)]
pub struct Swallow;

impl Swallow {
    pub async fn new(_: &SqlitePool) -> Self {
        Swallow
    }

    pub async fn in_body(&self, tx: &mut SqliteConnection) {
        let failed = sqlx::query("INSERT INTO dedup_effects_guarded (v) VALUES ('boom')")
            .execute(&mut *tx)
            .await;
        assert!(failed.is_err(), "the trigger rolls the transaction back");
    }
}
