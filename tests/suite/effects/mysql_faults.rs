//! MariaDB: a real error 1213 from the server, `SIGNAL`led in the body or by a trigger on
//! the dedup table, which the checked commit's `UPDATE` fires (the commit of a
//! transaction slower than `STAMP_AFTER`, which moves the row's `processed_at`); a real
//! deadlock, which InnoDB answers by rolling the whole transaction back.

use sqlx::MySqlConnection;
use sqlx::mysql::MySqlPool;
use tokio::sync::Barrier;

pub const RECORD: &str = "INSERT INTO dedup_lease_results (message_id, attempt) VALUES (?, ?)";

pub async fn lease_pool() -> Box<MySqlPool> {
    let pool = dedup_suite::mysql().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS dedup_lease_results \
         (message_id VARBINARY(255) NOT NULL, attempt BIGINT NOT NULL) ENGINE = InnoDB",
    )
    .await;
    Box::new(pool)
}

/// The lease ends now, on the server's clock.
pub async fn expire(pool: &MySqlPool, consumer: &str, id: &str) {
    sqlx::query(
        "UPDATE processed_messages SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
         WHERE consumer = ? AND message_id = ?",
    )
    .bind(consumer)
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn pool() -> Box<MySqlPool> {
    let pool = dedup_suite::mysql().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS dedup_effects_locks \
         (name VARBINARY(255) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB; \
         CREATE TABLE IF NOT EXISTS dedup_effects_ballast \
         (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    )
    .await;
    Box::new(pool)
}

pub const TRANSIENT_CODE: &str = "1213";

pub async fn raise_transient(tx: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'simulated deadlock'",
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

pub type CommitDb = Box<MySqlPool>;
pub const COMMIT_CODE: &str = "1213";

/// The trigger fails the checked commit's `UPDATE` of a dedup row whose id the same
/// transaction wrote into `dedup_effects_fail_commit`.
pub async fn commit_fault_db() -> CommitDb {
    let pool = pool().await;
    {
        let _one_at_a_time = dedup_suite::ddl_lock().await;
        dedup_runtime::migrate_table(&*pool, super::COMMIT_TABLE)
            .await
            .unwrap();
    }
    dedup_suite::ddl(
        &*pool,
        "CREATE TABLE IF NOT EXISTS dedup_effects_fail_commit \
         (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB; \
         CREATE TRIGGER IF NOT EXISTS dedup_effects_commit_fault \
         BEFORE UPDATE ON dedup_effects_commit FOR EACH ROW \
         BEGIN \
             IF EXISTS (SELECT 1 FROM dedup_effects_fail_commit \
                        WHERE message_id = NEW.message_id) THEN \
                 SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, \
                 MESSAGE_TEXT = 'simulated deadlock at commit'; \
             END IF; \
         END",
    )
    .await;
    pool
}

#[derive(Debug)]
pub struct CommitFault;

impl CommitFault {
    pub async fn new(_: &CommitDb) -> Self {
        CommitFault
    }

    /// This transaction's checked commit fails with 1213 (the row that arms the
    /// trigger is rolled back with it, so the next attempt commits). The transaction
    /// then outlasts `STAMP_AFTER`, so that its commit is the one with an `UPDATE` for
    /// the trigger to fail (a faster one's commit only reads the row).
    pub async fn arm(&self, tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_effects_fail_commit (message_id) VALUES (?)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tokio::time::sleep(dedup_runtime::STAMP_AFTER + std::time::Duration::from_millis(100))
            .await;
        Ok(())
    }

    pub async fn disarm(&self) {}
}

/// A deadlock with another session that has done more work, so that InnoDB rolls back
/// the handler's transaction: its lock rows, and a pool for the other session.
#[derive(Debug)]
pub struct Swallow {
    pool: MySqlPool,
    rows: (String, String),
}

impl Swallow {
    pub async fn new(pool: &MySqlPool) -> Self {
        let rows = (
            dedup_suite::unique("effects-lock-a"),
            dedup_suite::unique("effects-lock-b"),
        );
        for name in [&rows.0, &rows.1] {
            sqlx::query("INSERT INTO dedup_effects_locks (name, n) VALUES (?, 0)")
                .bind(name)
                .execute(pool)
                .await
                .unwrap();
        }
        Swallow {
            pool: pool.clone(),
            rows,
        }
    }

    pub async fn in_body(&self, tx: &mut MySqlConnection) {
        const LOCK: &str = "UPDATE dedup_effects_locks SET n = n + 1 WHERE name = ?";
        let (a, b) = (&self.rows.0, &self.rows.1);
        let barrier = Barrier::new(2);
        let ours = async {
            sqlx::query(LOCK).bind(a).execute(&mut *tx).await.unwrap();
            barrier.wait().await;
            // The mistake under test: the deadlock error is dropped.
            sqlx::query(LOCK).bind(b).execute(&mut *tx).await.is_err()
        };
        let other = async {
            let mut other = self.pool.begin().await.unwrap();
            for _ in 0..30 {
                sqlx::query("INSERT INTO dedup_effects_ballast (message_id) VALUES ('x')")
                    .execute(&mut *other)
                    .await
                    .unwrap();
            }
            sqlx::query(LOCK)
                .bind(b)
                .execute(&mut *other)
                .await
                .unwrap();
            barrier.wait().await;
            sqlx::query(LOCK)
                .bind(a)
                .execute(&mut *other)
                .await
                .unwrap();
            other.commit().await.unwrap();
        };
        let (deadlocked, ()) = tokio::join!(ours, other);
        assert!(
            deadlocked,
            "InnoDB chose the handler's transaction as the victim"
        );
    }
}
