//! Failures against the real servers: a connection killed mid-transaction, transient
//! errors (serialization failures, deadlocks, `SQLITE_BUSY`) retried and bounded, no retry
//! inside a caller's transaction, and transient errors seen through user error types.
//!
//! PostgreSQL and MariaDB are the machine's servers; SQLite runs on temporary files with
//! a short busy timeout. Message ids are unique per run (`dedup_suite::unique`), because
//! the servers keep the dedup table between runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use dedup_runtime::{MAX_ATTEMPTS, Outcome, idempotent};
use tokio::sync::{Barrier, Notify, mpsc};
use tokio::time::timeout;

/// How long any single wait in these tests may take before the test fails instead of
/// hanging.
const PATIENCE: Duration = Duration::from_secs(15);

fn runs(counter: &AtomicU32) -> u32 {
    counter.load(Ordering::SeqCst)
}

/// Counts a body run; returns its 1-based number.
fn next_run(counter: &AtomicU32) -> u32 {
    counter.fetch_add(1, Ordering::SeqCst) + 1
}

mod postgres {
    use super::*;
    use sqlx::PgConnection;
    use sqlx::postgres::PgPool;

    /// A real server error with SQLSTATE 40001 (serialization_failure).
    const RAISE_40001: &str = "DO $$ BEGIN RAISE EXCEPTION 'simulated serialization failure' \
                               USING ERRCODE = '40001'; END $$";

    async fn pool() -> PgPool {
        // Concurrent `CREATE TABLE IF NOT EXISTS` races on PostgreSQL's catalog.
        static DDL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let pool = dedup_suite::postgres().await;
        let _one_at_a_time = DDL.lock().await;
        // `dedup_failure_deferred` has a deferred constraint trigger that fails the COMMIT
        // with the SQLSTATE in the transaction's `dedup.commit_error` setting, if any.
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS dedup_failure_effects (message_id text NOT NULL); \
             CREATE TABLE IF NOT EXISTS dedup_failure_locks \
             (name text PRIMARY KEY, n integer NOT NULL); \
             CREATE TABLE IF NOT EXISTS dedup_failure_deferred (message_id text NOT NULL); \
             CREATE OR REPLACE FUNCTION dedup_failure_at_commit() RETURNS trigger \
             LANGUAGE plpgsql AS $$ BEGIN \
                 IF coalesce(current_setting('dedup.commit_error', true), '') <> '' THEN \
                     RAISE EXCEPTION 'simulated commit failure' \
                     USING ERRCODE = current_setting('dedup.commit_error'); \
                 END IF; \
                 RETURN NULL; \
             END $$; \
             DO $$ BEGIN \
                 IF NOT EXISTS (SELECT 1 FROM pg_trigger \
                                WHERE tgname = 'dedup_failure_at_commit') THEN \
                     CREATE CONSTRAINT TRIGGER dedup_failure_at_commit \
                     AFTER INSERT ON dedup_failure_deferred \
                     DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
                     EXECUTE FUNCTION dedup_failure_at_commit(); \
                 END IF; \
             END $$",
        )
        .execute(&pool)
        .await
        .expect("create the effect and lock tables");
        pool
    }

    async fn effects(pool: &PgPool, id: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn claims(pool: &PgPool, consumer: &str, id: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM processed_messages WHERE consumer = $1 AND message_id = $2",
        )
        .bind(consumer)
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    async fn insert_effect(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_failure_effects (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    fn sqlstate(error: &sqlx::Error) -> Option<String> {
        error
            .as_database_error()
            .and_then(|error| error.code())
            .map(|code| code.into_owned())
    }

    // ---- connection killed mid-transaction -------------------------------------------

    #[idempotent(consumer = "failures-pg-kill", key = id)]
    async fn record(tx: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
        insert_effect(tx, id).await
    }

    /// Inserts its effect, reports its backend pid, waits for `go`, then queries again.
    #[idempotent(consumer = "failures-pg-kill", key = id)]
    async fn stalls_after_effect(
        tx: &mut PgConnection,
        id: &str,
        runs: &AtomicU32,
        pid: &mpsc::UnboundedSender<i32>,
        go: &Notify,
    ) -> Result<(), sqlx::Error> {
        next_run(runs);
        insert_effect(tx, id).await?;
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await?;
        pid.send(backend).expect("the test listens");
        go.notified().await;
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        Ok(())
    }

    #[tokio::test]
    async fn connection_killed_mid_transaction_commits_nothing() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-killed");
        let counter = Arc::new(AtomicU32::new(0));
        let go = Arc::new(Notify::new());
        let (pid_tx, mut pid_rx) = mpsc::unbounded_channel();

        let task = tokio::spawn({
            let (pool, id, counter, go) = (pool.clone(), id.clone(), counter.clone(), go.clone());
            async move { stalls_after_effect(&pool, &id, &counter, &pid_tx, &go).await }
        });
        let pid = timeout(PATIENCE, pid_rx.recv())
            .await
            .expect("the body reports its pid")
            .expect("the body reports its pid");
        // With a timeout, pg_terminate_backend waits until the backend is gone.
        let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
            .bind(pid)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(terminated, "backend {pid} terminated");
        go.notify_one();

        let result = timeout(PATIENCE, task)
            .await
            .expect("the call returns")
            .expect("the call does not panic");
        let error = result.expect_err("a call whose connection was killed fails");
        assert!(
            !matches!(
                sqlstate(&error).as_deref(),
                Some("40001" | "40P01" | "55P03")
            ),
            "{error:?}"
        );
        assert_eq!(runs(&counter), 1, "a lost connection is not retried");
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-pg-kill", &id).await, 0);

        // The redelivery processes the message, once.
        assert_eq!(record(&pool, &id).await.unwrap(), Outcome::Processed(()));
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-kill", &id).await, 1);
        assert!(record(&pool, &id).await.unwrap().is_duplicate());
    }

    // ---- transient failures: retried, bounded, not inside a caller's transaction -----

    /// Inserts its effect; on its first `failures` runs then raises 40001.
    #[idempotent(consumer = "failures-pg-flaky", key = id)]
    async fn flaky(
        tx: &mut PgConnection,
        id: &str,
        failures: u32,
        runs: &AtomicU32,
    ) -> Result<u32, sqlx::Error> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run <= failures {
            sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await?;
        }
        Ok(run)
    }

    #[tokio::test]
    async fn serialization_failure_is_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-40001");
        let counter = AtomicU32::new(0);
        assert_eq!(
            flaky(&pool, &id, 1, &counter).await.unwrap(),
            Outcome::Processed(2),
            "the second run's value"
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-flaky", &id).await, 1);
        assert!(flaky(&pool, &id, 0, &counter).await.unwrap().is_duplicate());
        assert_eq!(runs(&counter), 2);
    }

    #[tokio::test]
    async fn retried_on_a_lent_connection_outside_a_transaction() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-40001-conn");
        let counter = AtomicU32::new(0);
        let mut conn = pool.acquire().await.unwrap();
        assert_eq!(
            flaky(&mut conn, &id, 1, &counter).await.unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-flaky", &id).await, 1);
    }

    #[tokio::test]
    async fn retries_are_bounded() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-40001-always");
        let counter = AtomicU32::new(0);
        let error = flaky(&pool, &id, u32::MAX, &counter).await.unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("40001"), "{error:?}");
        assert_eq!(runs(&counter), MAX_ATTEMPTS);
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-pg-flaky", &id).await, 0);
    }

    #[tokio::test]
    async fn no_retry_inside_a_callers_transaction() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-40001-caller");
        let caller_row = format!("{id}-caller");
        let counter = AtomicU32::new(0);

        let mut tx = pool.begin().await.unwrap();
        insert_effect(&mut tx, &caller_row).await.unwrap();
        let error = flaky(&mut tx, &id, u32::MAX, &counter).await.unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("40001"), "{error:?}");
        assert_eq!(
            runs(&counter),
            1,
            "the caller owns the transaction: no retry"
        );

        // The handler's savepoint was rolled back: the caller's transaction is usable, its
        // own work is there, the handler's is not.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx)
            .await
            .expect("the caller's transaction is still usable");
        assert_eq!(one, 1);
        let visible: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id IN ($1, $2)",
        )
        .bind(&id)
        .bind(&caller_row)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert_eq!(visible, 1, "only the caller's own row");
        tx.rollback().await.unwrap();

        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(effects(&pool, &caller_row).await, 0);
        assert_eq!(claims(&pool, "failures-pg-flaky", &id).await, 0);
    }

    /// Locks `first`, then (after the barrier on its first run) `second`.
    #[idempotent(consumer = "failures-pg-deadlock", key = id)]
    async fn lock_two_rows(
        tx: &mut PgConnection,
        id: &str,
        first: &str,
        second: &str,
        barrier: &Barrier,
        runs: &AtomicU32,
    ) -> Result<(), sqlx::Error> {
        let run = next_run(runs);
        // Detect the deadlock after 50 ms instead of the default second (superuser only).
        sqlx::query("SET LOCAL deadlock_timeout = '50ms'")
            .execute(&mut *tx)
            .await?;
        insert_effect(tx, id).await?;
        for (step, name) in [first, second].into_iter().enumerate() {
            if step == 1 && run == 1 {
                // Both transactions hold their first row: the second locks close a cycle.
                barrier.wait().await;
            }
            sqlx::query("UPDATE dedup_failure_locks SET n = n + 1 WHERE name = $1")
                .bind(name)
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn deadlock_is_retried() {
        let pool = pool().await;
        let (a, b) = (
            dedup_suite::unique("pg-row-a"),
            dedup_suite::unique("pg-row-b"),
        );
        sqlx::query("INSERT INTO dedup_failure_locks (name, n) VALUES ($1, 0), ($2, 0)")
            .bind(&a)
            .bind(&b)
            .execute(&pool)
            .await
            .unwrap();
        let (id_1, id_2) = (
            dedup_suite::unique("pg-deadlock"),
            dedup_suite::unique("pg-deadlock"),
        );
        let barrier = Barrier::new(2);
        let (runs_1, runs_2) = (AtomicU32::new(0), AtomicU32::new(0));

        let (first, second) = timeout(PATIENCE, async {
            tokio::join!(
                lock_two_rows(&pool, &id_1, &a, &b, &barrier, &runs_1),
                lock_two_rows(&pool, &id_2, &b, &a, &barrier, &runs_2),
            )
        })
        .await
        .expect("the deadlock is broken");
        assert_eq!(first.unwrap(), Outcome::Processed(()));
        assert_eq!(second.unwrap(), Outcome::Processed(()));
        let mut counts = [runs(&runs_1), runs(&runs_2)];
        counts.sort_unstable();
        assert_eq!(counts, [1, 2], "one victim, run again once");

        for id in [&id_1, &id_2] {
            assert_eq!(effects(&pool, id).await, 1);
            assert_eq!(claims(&pool, "failures-pg-deadlock", id).await, 1);
        }
        for name in [&a, &b] {
            let n: i32 = sqlx::query_scalar("SELECT n FROM dedup_failure_locks WHERE name = $1")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(n, 2, "each handler's update counted once");
        }
    }

    /// Inserts its effect and a row whose deferred trigger fails the COMMIT with
    /// `sqlstate` on the first `failures` runs.
    #[idempotent(consumer = "failures-pg-commit", key = id)]
    async fn fails_at_commit(
        tx: &mut PgConnection,
        id: &str,
        sqlstate: &str,
        failures: u32,
        runs: &AtomicU32,
    ) -> Result<u32, sqlx::Error> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        sqlx::query("INSERT INTO dedup_failure_deferred (message_id) VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if run <= failures {
            sqlx::query("SELECT set_config('dedup.commit_error', $1, true)")
                .bind(sqlstate)
                .execute(&mut *tx)
                .await?;
        }
        Ok(run)
    }

    #[tokio::test]
    async fn transient_failure_at_commit_is_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-commit-40001");
        let counter = AtomicU32::new(0);
        assert_eq!(
            fails_at_commit(&pool, &id, "40001", 1, &counter)
                .await
                .unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-commit", &id).await, 1);
    }

    #[tokio::test]
    async fn other_failure_at_commit_is_returned() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-commit-23514");
        let counter = AtomicU32::new(0);
        let error = fails_at_commit(&pool, &id, "23514", 1, &counter)
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("23514"), "{error:?}");
        assert_eq!(runs(&counter), 1);
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-pg-commit", &id).await, 0);

        // The connection the failed COMMIT ran on is fine for the redelivery.
        assert_eq!(
            fails_at_commit(&pool, &id, "", 0, &counter).await.unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(effects(&pool, &id).await, 1);
    }

    /// Updates the row `name` with a 200 ms lock timeout; reports each run's number.
    #[idempotent(consumer = "failures-pg-lock-timeout", key = id)]
    async fn update_locked_row(
        tx: &mut PgConnection,
        id: &str,
        name: &str,
        started: &mpsc::UnboundedSender<u32>,
        runs: &AtomicU32,
    ) -> Result<(), sqlx::Error> {
        started.send(next_run(runs)).expect("the test listens");
        sqlx::query("SET LOCAL lock_timeout = '200ms'")
            .execute(&mut *tx)
            .await?;
        insert_effect(tx, id).await?;
        sqlx::query("UPDATE dedup_failure_locks SET n = n + 1 WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[tokio::test]
    async fn lock_timeout_is_retried() {
        let pool = pool().await;
        let row = dedup_suite::unique("pg-row");
        sqlx::query("INSERT INTO dedup_failure_locks (name, n) VALUES ($1, 0)")
            .bind(&row)
            .execute(&pool)
            .await
            .unwrap();
        let id = dedup_suite::unique("pg-55P03");
        let counter = AtomicU32::new(0);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();

        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT n FROM dedup_failure_locks WHERE name = $1 FOR UPDATE")
            .bind(&row)
            .execute(&mut *holder)
            .await
            .unwrap();
        let (outcome, ()) = timeout(PATIENCE, async {
            tokio::join!(
                update_locked_row(&pool, &id, &row, &started_tx, &counter),
                async {
                    // Hold the lock until the second run has begun: the first timed out.
                    while started_rx.recv().await.expect("the body runs") < 2 {}
                    holder.rollback().await.unwrap();
                },
            )
        })
        .await
        .expect("the call returns");
        assert_eq!(outcome.unwrap(), Outcome::Processed(()));
        assert!(
            (2..=MAX_ATTEMPTS).contains(&runs(&counter)),
            "{}",
            runs(&counter)
        );
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-lock-timeout", &id).await, 1);
    }

    // ---- transient failures seen through the handler's own error type ----------------

    #[idempotent(consumer = "failures-pg-anyhow", key = id)]
    async fn via_anyhow(
        tx: &mut PgConnection,
        id: &str,
        with_context: bool,
        runs: &AtomicU32,
    ) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run == 1 {
            let raised = sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await;
            if with_context {
                raised.context("the body's statement")?;
            } else {
                raised?;
            }
        }
        Ok(())
    }

    #[tokio::test]
    async fn anyhow_errors_are_retried() {
        let pool = pool().await;
        for with_context in [false, true] {
            let id = dedup_suite::unique("pg-anyhow");
            let counter = AtomicU32::new(0);
            let outcome = via_anyhow(&pool, &id, with_context, &counter).await;
            assert_eq!(
                outcome.unwrap(),
                Outcome::Processed(()),
                "context: {with_context}"
            );
            assert_eq!(runs(&counter), 2, "context: {with_context}");
            assert_eq!(effects(&pool, &id).await, 1);
            assert_eq!(claims(&pool, "failures-pg-anyhow", &id).await, 1);
        }
    }

    #[derive(Debug, thiserror::Error)]
    enum AppError {
        #[error("database error")]
        Database(#[from] sqlx::Error),
        #[allow(dead_code)]
        #[error("invalid input")]
        Invalid,
    }

    #[idempotent(consumer = "failures-pg-thiserror", key = id)]
    async fn via_thiserror(
        tx: &mut PgConnection,
        id: &str,
        runs: &AtomicU32,
    ) -> Result<(), AppError> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run == 1 {
            sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn thiserror_from_errors_are_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-thiserror");
        let counter = AtomicU32::new(0);
        assert_eq!(
            via_thiserror(&pool, &id, &counter).await.unwrap(),
            Outcome::Processed(())
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-pg-thiserror", &id).await, 1);
    }

    /// The most common `thiserror` spelling: `#[error(transparent)]` forwards `source()`
    /// to the `sqlx::Error`'s own source, the `Box<dyn DatabaseError>`, so the chain never
    /// shows the `sqlx::Error` itself. (Fails as of this writing: the classification does
    /// not look inside a `Box<dyn DatabaseError>` link, so the 40001 is not retried.)
    #[derive(Debug, thiserror::Error)]
    enum TransparentError {
        #[error(transparent)]
        Database(#[from] sqlx::Error),
    }

    #[idempotent(consumer = "failures-pg-transparent", key = id)]
    async fn via_transparent(
        tx: &mut PgConnection,
        id: &str,
        runs: &AtomicU32,
    ) -> Result<(), TransparentError> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run == 1 {
            sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn thiserror_transparent_errors_are_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-transparent");
        let counter = AtomicU32::new(0);
        let outcome = via_transparent(&pool, &id, &counter).await;
        assert!(
            matches!(outcome, Ok(Outcome::Processed(()))),
            "a 40001 behind `#[error(transparent)] #[from] sqlx::Error` is retried: {outcome:?}"
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
    }

    #[idempotent(consumer = "failures-pg-boxed", key = id)]
    async fn via_box(
        tx: &mut PgConnection,
        id: &str,
        runs: &AtomicU32,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run == 1 {
            sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn boxed_errors_are_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-boxed");
        let counter = AtomicU32::new(0);
        assert_eq!(
            via_box(&pool, &id, &counter).await.unwrap(),
            Outcome::Processed(())
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
    }

    /// An error type that keeps only the text: the database error is gone.
    #[derive(Debug)]
    struct Opaque(String);

    impl From<sqlx::Error> for Opaque {
        fn from(error: sqlx::Error) -> Self {
            Opaque(error.to_string())
        }
    }

    #[idempotent(consumer = "failures-pg-opaque", key = id)]
    async fn via_opaque(tx: &mut PgConnection, id: &str, runs: &AtomicU32) -> Result<(), Opaque> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run == 1 {
            sqlx::raw_sql(RAISE_40001).execute(&mut *tx).await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn opaque_errors_are_not_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("pg-opaque");
        let counter = AtomicU32::new(0);
        let Opaque(text) = via_opaque(&pool, &id, &counter).await.unwrap_err();
        assert!(text.contains("simulated serialization failure"), "{text}");
        assert_eq!(runs(&counter), 1, "the transient error is hidden: no retry");
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-pg-opaque", &id).await, 0);

        // A redelivery runs the body again (its second run succeeds).
        assert_eq!(
            via_opaque(&pool, &id, &counter).await.unwrap(),
            Outcome::Processed(())
        );
        assert_eq!(effects(&pool, &id).await, 1);
    }
}

mod mysql {
    use super::*;
    use sqlx::MySqlConnection;
    use sqlx::mysql::{MySqlDatabaseError, MySqlPool};

    /// A real server error 1213 (ER_LOCK_DEADLOCK, SQLSTATE 40001). MariaDB allows
    /// `SIGNAL` outside stored programs; it cannot be prepared, hence `raw_sql`.
    const SIGNAL_1213: &str = "SIGNAL SQLSTATE '40001' \
                               SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'simulated deadlock'";

    async fn pool() -> MySqlPool {
        static DDL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let pool = dedup_suite::mysql().await;
        let _one_at_a_time = DDL.lock().await;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS dedup_failure_effects \
             (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS dedup_failure_locks \
             (name VARBINARY(255) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
        ] {
            sqlx::raw_sql(ddl)
                .execute(&pool)
                .await
                .expect("create the effect and lock tables");
        }
        pool
    }

    async fn effects(pool: &MySqlPool, id: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id = ?")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn claims(pool: &MySqlPool, consumer: &str, id: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM processed_messages WHERE consumer = ? AND message_id = ?",
        )
        .bind(consumer)
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    async fn insert_effect(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_failure_effects (message_id) VALUES (?)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    fn error_number(error: &sqlx::Error) -> Option<u16> {
        error
            .as_database_error()
            .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
            .map(MySqlDatabaseError::number)
    }

    // ---- connection killed mid-transaction -------------------------------------------

    #[idempotent(consumer = "failures-my-kill", key = id)]
    async fn record(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
        insert_effect(tx, id).await
    }

    #[idempotent(consumer = "failures-my-kill", key = id)]
    async fn stalls_after_effect(
        tx: &mut MySqlConnection,
        id: &str,
        runs: &AtomicU32,
        connection: &mpsc::UnboundedSender<u64>,
        go: &Notify,
    ) -> Result<(), sqlx::Error> {
        next_run(runs);
        insert_effect(tx, id).await?;
        let me: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *tx)
            .await?;
        connection.send(me).expect("the test listens");
        go.notified().await;
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        Ok(())
    }

    #[tokio::test]
    async fn connection_killed_mid_transaction_commits_nothing() {
        let pool = pool().await;
        let id = dedup_suite::unique("my-killed");
        let counter = Arc::new(AtomicU32::new(0));
        let go = Arc::new(Notify::new());
        let (connection_tx, mut connection_rx) = mpsc::unbounded_channel();

        let task = tokio::spawn({
            let (pool, id, counter, go) = (pool.clone(), id.clone(), counter.clone(), go.clone());
            async move { stalls_after_effect(&pool, &id, &counter, &connection_tx, &go).await }
        });
        let connection = timeout(PATIENCE, connection_rx.recv())
            .await
            .expect("the body reports its connection id")
            .expect("the body reports its connection id");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {connection}")))
            .execute(&pool)
            .await
            .unwrap();
        go.notify_one();

        let result = timeout(PATIENCE, task)
            .await
            .expect("the call returns")
            .expect("the call does not panic");
        let error = result.expect_err("a call whose connection was killed fails");
        assert!(
            !matches!(error_number(&error), Some(1205 | 1213)),
            "{error:?}"
        );
        assert_eq!(runs(&counter), 1, "a lost connection is not retried");
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-my-kill", &id).await, 0);

        assert_eq!(record(&pool, &id).await.unwrap(), Outcome::Processed(()));
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-my-kill", &id).await, 1);
        assert!(record(&pool, &id).await.unwrap().is_duplicate());
    }

    // ---- transient failures -----------------------------------------------------------

    /// Inserts its effect; on its first `failures` runs then raises error 1213.
    #[idempotent(consumer = "failures-my-flaky", key = id)]
    async fn flaky(
        tx: &mut MySqlConnection,
        id: &str,
        failures: u32,
        runs: &AtomicU32,
    ) -> Result<u32, sqlx::Error> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        if run <= failures {
            sqlx::raw_sql(SIGNAL_1213).execute(&mut *tx).await?;
        }
        Ok(run)
    }

    #[tokio::test]
    async fn signalled_deadlock_is_retried() {
        let pool = pool().await;
        let id = dedup_suite::unique("my-1213");
        let counter = AtomicU32::new(0);
        assert_eq!(
            flaky(&pool, &id, 1, &counter).await.unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(runs(&counter), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&pool, "failures-my-flaky", &id).await, 1);
    }

    #[tokio::test]
    async fn retries_are_bounded() {
        let pool = pool().await;
        let id = dedup_suite::unique("my-1213-always");
        let counter = AtomicU32::new(0);
        let error = flaky(&pool, &id, u32::MAX, &counter).await.unwrap_err();
        assert_eq!(error_number(&error), Some(1213), "{error:?}");
        assert_eq!(runs(&counter), MAX_ATTEMPTS);
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-my-flaky", &id).await, 0);
    }

    #[tokio::test]
    async fn no_retry_inside_a_callers_transaction() {
        let pool = pool().await;
        let id = dedup_suite::unique("my-1213-caller");
        let caller_row = format!("{id}-caller");
        let counter = AtomicU32::new(0);

        let mut tx = pool.begin().await.unwrap();
        insert_effect(&mut tx, &caller_row).await.unwrap();
        let error = flaky(&mut tx, &id, u32::MAX, &counter).await.unwrap_err();
        assert_eq!(error_number(&error), Some(1213), "{error:?}");
        assert_eq!(
            runs(&counter),
            1,
            "the caller owns the transaction: no retry"
        );
        let visible: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id IN (?, ?)",
        )
        .bind(&id)
        .bind(&caller_row)
        .fetch_one(&mut *tx)
        .await
        .expect("the caller's transaction is still usable");
        assert_eq!(visible, 1, "only the caller's own row");
        tx.rollback().await.unwrap();
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(effects(&pool, &caller_row).await, 0);
        assert_eq!(claims(&pool, "failures-my-flaky", &id).await, 0);
    }

    /// Locks `first`, then (after the barrier on its first run) `second`.
    #[idempotent(consumer = "failures-my-deadlock", key = id)]
    async fn lock_two_rows(
        tx: &mut MySqlConnection,
        id: &str,
        first: &str,
        second: &str,
        barrier: &Barrier,
        runs: &AtomicU32,
    ) -> Result<(), sqlx::Error> {
        let run = next_run(runs);
        insert_effect(tx, id).await?;
        for (step, name) in [first, second].into_iter().enumerate() {
            if step == 1 && run == 1 {
                barrier.wait().await;
            }
            sqlx::query("UPDATE dedup_failure_locks SET n = n + 1 WHERE name = ?")
                .bind(name)
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }

    #[tokio::test]
    async fn deadlock_is_retried() {
        let pool = pool().await;
        let (a, b) = (
            dedup_suite::unique("my-row-a"),
            dedup_suite::unique("my-row-b"),
        );
        sqlx::query("INSERT INTO dedup_failure_locks (name, n) VALUES (?, 0), (?, 0)")
            .bind(&a)
            .bind(&b)
            .execute(&pool)
            .await
            .unwrap();
        let (id_1, id_2) = (
            dedup_suite::unique("my-deadlock"),
            dedup_suite::unique("my-deadlock"),
        );
        let barrier = Barrier::new(2);
        let (runs_1, runs_2) = (AtomicU32::new(0), AtomicU32::new(0));

        let (first, second) = timeout(PATIENCE, async {
            tokio::join!(
                lock_two_rows(&pool, &id_1, &a, &b, &barrier, &runs_1),
                lock_two_rows(&pool, &id_2, &b, &a, &barrier, &runs_2),
            )
        })
        .await
        .expect("the deadlock is broken");
        assert_eq!(first.unwrap(), Outcome::Processed(()));
        assert_eq!(second.unwrap(), Outcome::Processed(()));
        let mut counts = [runs(&runs_1), runs(&runs_2)];
        counts.sort_unstable();
        assert_eq!(counts, [1, 2], "one victim, run again once");

        for id in [&id_1, &id_2] {
            assert_eq!(effects(&pool, id).await, 1);
            assert_eq!(claims(&pool, "failures-my-deadlock", id).await, 1);
        }
        for name in [&a, &b] {
            let n: i32 = sqlx::query_scalar("SELECT n FROM dedup_failure_locks WHERE name = ?")
                .bind(name)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(n, 2, "each handler's update counted once");
        }
    }

    /// Updates the row `name` with a 1 s lock wait timeout (the minimum); reports each
    /// run's number.
    #[idempotent(consumer = "failures-my-lock-timeout", key = id)]
    async fn update_locked_row(
        tx: &mut MySqlConnection,
        id: &str,
        name: &str,
        started: &mpsc::UnboundedSender<u32>,
        runs: &AtomicU32,
    ) -> Result<(), sqlx::Error> {
        started.send(next_run(runs)).expect("the test listens");
        sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
            .execute(&mut *tx)
            .await?;
        insert_effect(tx, id).await?;
        sqlx::query("UPDATE dedup_failure_locks SET n = n + 1 WHERE name = ?")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// Error 1205 rolls back only the statement (`innodb_rollback_on_timeout` is off): the
    /// handler rolls back the rest and runs the transaction again.
    #[tokio::test]
    async fn lock_wait_timeout_is_retried() {
        let pool = pool().await;
        let row = dedup_suite::unique("my-row");
        sqlx::query("INSERT INTO dedup_failure_locks (name, n) VALUES (?, 0)")
            .bind(&row)
            .execute(&pool)
            .await
            .unwrap();
        let id = dedup_suite::unique("my-1205");
        let counter = AtomicU32::new(0);
        let (started_tx, mut started_rx) = mpsc::unbounded_channel();

        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT n FROM dedup_failure_locks WHERE name = ? FOR UPDATE")
            .bind(&row)
            .execute(&mut *holder)
            .await
            .unwrap();
        let (outcome, ()) = timeout(PATIENCE, async {
            tokio::join!(
                update_locked_row(&pool, &id, &row, &started_tx, &counter),
                async {
                    while started_rx.recv().await.expect("the body runs") < 2 {}
                    holder.rollback().await.unwrap();
                },
            )
        })
        .await
        .expect("the call returns");
        assert_eq!(outcome.unwrap(), Outcome::Processed(()));
        assert!(
            (2..=MAX_ATTEMPTS).contains(&runs(&counter)),
            "{}",
            runs(&counter)
        );
        assert_eq!(
            effects(&pool, &id).await,
            1,
            "the first run's insert rolled back"
        );
        assert_eq!(claims(&pool, "failures-my-lock-timeout", &id).await, 1);
        let n: i32 = sqlx::query_scalar("SELECT n FROM dedup_failure_locks WHERE name = ?")
            .bind(&row)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(n, 1);
    }

    /// On MariaDB a deadlock rolls back the whole transaction, not only the statement or
    /// the handler's savepoint: inside a caller's transaction the handler reports 1213
    /// without retrying, nothing of the handler's is committed, and the caller's own
    /// earlier work is gone too (unlike PostgreSQL, where the caller's transaction
    /// survives the handler's rolled-back savepoint).
    #[tokio::test]
    async fn deadlock_inside_a_callers_transaction_ends_it() {
        let pool = pool().await;
        let (a, b) = (
            dedup_suite::unique("my-row-a"),
            dedup_suite::unique("my-row-b"),
        );
        sqlx::query("INSERT INTO dedup_failure_locks (name, n) VALUES (?, 0), (?, 0)")
            .bind(&a)
            .bind(&b)
            .execute(&pool)
            .await
            .unwrap();
        let id = dedup_suite::unique("my-deadlock-caller");
        let (caller_row, other_row) = (format!("{id}-caller"), format!("{id}-other"));
        let barrier = Barrier::new(2);
        let counter = AtomicU32::new(0);

        let caller = async {
            let mut tx = pool.begin().await.unwrap();
            insert_effect(&mut tx, &caller_row).await.unwrap();
            let result = lock_two_rows(&mut tx, &id, &a, &b, &barrier, &counter).await;
            (tx, result)
        };
        // The other transaction has done more work, so InnoDB picks the caller's as the
        // deadlock victim.
        let other = async {
            let mut tx = pool.begin().await.unwrap();
            for _ in 0..30 {
                insert_effect(&mut tx, &other_row).await.unwrap();
            }
            for (step, name) in [&b, &a].into_iter().enumerate() {
                if step == 1 {
                    barrier.wait().await;
                }
                sqlx::query("UPDATE dedup_failure_locks SET n = n + 1 WHERE name = ?")
                    .bind(name)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
        };
        let ((tx, result), ()) = timeout(PATIENCE, async { tokio::join!(caller, other) })
            .await
            .expect("the deadlock is broken");
        let error = result.unwrap_err();
        assert_eq!(error_number(&error), Some(1213), "{error:?}");
        assert_eq!(
            runs(&counter),
            1,
            "the caller owns the transaction: no retry"
        );

        // The handler's `ROLLBACK TO SAVEPOINT` failed (1305, the savepoint went with the
        // transaction), so sqlx queued it again on drop; its error reaches the caller's
        // next statement, whatever that is. After that the connection is in autocommit.
        let mut tx = tx;
        let _ = sqlx::query("DO 0").execute(&mut *tx).await;
        let in_transaction: u64 = sqlx::query_scalar("SELECT @@in_transaction")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(in_transaction, 0, "MariaDB ended the caller's transaction");
        let own: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id = ?")
                .bind(&caller_row)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        assert_eq!(own, 0, "the caller's own earlier insert is gone");
        drop(tx);

        assert_eq!(
            effects(&pool, &other_row).await,
            30,
            "the other one committed"
        );
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&pool, "failures-my-deadlock", &id).await, 0);
        assert_eq!(
            effects(&pool, &caller_row).await,
            0,
            "MariaDB rolled back the caller's whole transaction"
        );
    }
}

mod sqlite {
    use super::*;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
    use sqlx::{Connection, SqliteConnection};

    /// The handler pool's busy timeout: much shorter than the lock is held.
    const BUSY_TIMEOUT: Duration = Duration::from_millis(50);

    /// A SQLite file in the temporary directory, removed on drop, with a handler pool
    /// (short busy timeout) and a separate connection that can hold the write lock.
    struct Db {
        pool: SqlitePool,
        options: SqliteConnectOptions,
        path: std::path::PathBuf,
    }

    impl Drop for Db {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.path.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    impl Db {
        async fn new() -> Db {
            let path = std::env::temp_dir()
                .join(format!("dedup-failures-{}.db", dedup_suite::unique("db")));
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(BUSY_TIMEOUT);
            let pool = SqlitePoolOptions::new()
                .max_connections(2)
                .connect_with(options.clone())
                .await
                .expect("open a SQLite file in the temporary directory");
            dedup_runtime::migrate(&pool).await.expect("migrate SQLite");
            sqlx::raw_sql("CREATE TABLE dedup_failure_effects (message_id TEXT NOT NULL)")
                .execute(&pool)
                .await
                .unwrap();
            Db {
                pool,
                options,
                path,
            }
        }

        /// Another connection to the same file, holding the write lock.
        async fn hold_write_lock(&self) -> SqliteConnection {
            let mut holder = SqliteConnection::connect_with(&self.options).await.unwrap();
            sqlx::raw_sql("BEGIN IMMEDIATE")
                .execute(&mut holder)
                .await
                .unwrap();
            holder
        }

        async fn effects(&self, id: &str) -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM dedup_failure_effects WHERE message_id = ?")
                .bind(id)
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }

        async fn claims(&self, id: &str) -> i64 {
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM processed_messages WHERE consumer = ? AND message_id = ?",
            )
            .bind("failures-sqlite")
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
        }
    }

    #[idempotent(consumer = "failures-sqlite", key = id)]
    async fn record(
        tx: &mut SqliteConnection,
        id: &str,
        runs: &AtomicU32,
    ) -> Result<(), sqlx::Error> {
        next_run(runs);
        sqlx::query("INSERT INTO dedup_failure_effects (message_id) VALUES (?)")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[tokio::test]
    async fn busy_is_retried_until_the_lock_is_released() {
        const HELD: Duration = Duration::from_millis(150);
        let db = Db::new().await;
        let id = dedup_suite::unique("sqlite-busy");
        let counter = AtomicU32::new(0);
        let mut holder = db.hold_write_lock().await;

        let started = Instant::now();
        let (outcome, ()) = timeout(PATIENCE, async {
            tokio::join!(record(&db.pool, &id, &counter), async {
                tokio::time::sleep(HELD).await;
                sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
            })
        })
        .await
        .expect("the call returns");
        let elapsed = started.elapsed();

        assert_eq!(outcome.unwrap(), Outcome::Processed(()));
        assert!(
            elapsed >= HELD,
            "the call waited for the lock to be released: {elapsed:?}"
        );
        assert_eq!(runs(&counter), 1, "BEGIN IMMEDIATE failed, not the body");
        assert_eq!(db.effects(&id).await, 1);
        assert_eq!(db.claims(&id).await, 1);
        holder.close().await.unwrap();
    }

    #[tokio::test]
    async fn busy_retries_are_bounded() {
        let db = Db::new().await;
        let id = dedup_suite::unique("sqlite-busy-always");
        let counter = AtomicU32::new(0);
        let holder = db.hold_write_lock().await;

        let started = Instant::now();
        let error = timeout(PATIENCE, record(&db.pool, &id, &counter))
            .await
            .expect("the call returns")
            .unwrap_err();
        let elapsed = started.elapsed();

        let code = error
            .as_database_error()
            .and_then(|error| error.code())
            .map(|code| code.into_owned());
        assert_eq!(code.as_deref(), Some("5"), "SQLITE_BUSY: {error:?}");
        // Each attempt waits out the busy timeout before it fails.
        assert!(
            elapsed >= BUSY_TIMEOUT * MAX_ATTEMPTS,
            "{MAX_ATTEMPTS} attempts of {BUSY_TIMEOUT:?}: {elapsed:?}"
        );
        assert_eq!(runs(&counter), 0, "the body never ran");
        holder.close().await.unwrap();
        assert_eq!(db.effects(&id).await, 0);
        assert_eq!(db.claims(&id).await, 0);
    }
}
