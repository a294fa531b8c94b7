//! PostgreSQL: a real `40001` from the server, raised in the body or by a deferred
//! constraint trigger at `COMMIT`; a failed statement aborts the transaction.

use sqlx::PgConnection;
use sqlx::postgres::PgPool;

pub const RECORD: &str = "INSERT INTO dedup_lease_results (message_id, attempt) VALUES ($1, $2)";

pub async fn lease_pool() -> Box<PgPool> {
    let pool = dedup_suite::postgres().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS dedup_lease_results (message_id text NOT NULL, attempt bigint NOT NULL)",
    )
    .await;
    Box::new(pool)
}

/// The lease ends now, on the server's clock.
pub async fn expire(pool: &PgPool, consumer: &str, id: &str) {
    sqlx::query(
        "UPDATE processed_messages SET expires_at = clock_timestamp() - interval '1 second' \
         WHERE consumer = $1 AND message_id = $2",
    )
    .bind(consumer)
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

pub async fn pool() -> Box<PgPool> {
    Box::new(dedup_suite::postgres().await)
}

pub const TRANSIENT_CODE: &str = "40001";

pub async fn raise_transient(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "DO $$ BEGIN RAISE EXCEPTION 'simulated serialization failure' \
         USING ERRCODE = '40001'; END $$",
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

pub type CommitDb = Box<PgPool>;
pub const COMMIT_CODE: &str = "40001";

/// The deferred trigger raises the setting's SQLSTATE at `COMMIT`, in the transaction
/// that set it.
pub async fn commit_fault_db() -> CommitDb {
    let pool = pool().await;
    dedup_suite::ddl(
        &*pool,
        "CREATE TABLE IF NOT EXISTS dedup_effects_deferred (message_id text NOT NULL); \
         CREATE OR REPLACE FUNCTION dedup_effects_at_commit() RETURNS trigger \
         LANGUAGE plpgsql AS $$ BEGIN \
             IF coalesce(current_setting('dedup_effects.commit_error', true), '') <> '' THEN \
                 RAISE EXCEPTION 'simulated serialization failure at commit' \
                 USING ERRCODE = current_setting('dedup_effects.commit_error'); \
             END IF; \
             RETURN NULL; \
         END $$; \
         DO $$ BEGIN \
             IF NOT EXISTS (SELECT 1 FROM pg_trigger \
                            WHERE tgname = 'dedup_effects_at_commit') THEN \
                 CREATE CONSTRAINT TRIGGER dedup_effects_at_commit \
                 AFTER INSERT ON dedup_effects_deferred \
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
                 EXECUTE FUNCTION dedup_effects_at_commit(); \
             END IF; \
         END $$",
    )
    .await;
    let _one_at_a_time = dedup_suite::ddl_lock().await;
    dedup_runtime::migrate_table(&*pool, super::COMMIT_TABLE)
        .await
        .unwrap();
    pool
}

#[derive(Debug)]
pub struct CommitFault;

impl CommitFault {
    pub async fn new(_: &CommitDb) -> Self {
        CommitFault
    }

    /// This transaction's `COMMIT` fails with `40001` (rolled back with it, so the
    /// next attempt commits).
    pub async fn arm(&self, tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_effects_deferred (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT set_config('dedup_effects.commit_error', '40001', true)")
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    pub async fn disarm(&self) {}
}

/// A statement that fails (division by zero) aborts the transaction.
#[derive(Debug)]
pub struct Swallow;

impl Swallow {
    pub async fn new(_: &PgPool) -> Self {
        Swallow
    }

    pub async fn in_body(&self, tx: &mut PgConnection) {
        let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
        assert!(failed.is_err(), "division by zero fails");
    }
}
