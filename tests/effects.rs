//! `effect = "send-first"` on every backend (issue 11, its first step): a body whose
//! effect is outside the database (an email, an HTTP call) may leave its connection
//! unused; the call happens before the processed mark commits; a crash between the two
//! repeats the call on redelivery (the documented duplicate); a concurrent copy waits on
//! the claim; and nothing re-runs a body after it ran — a transient failure at `COMMIT` or
//! from the body, or a transaction the database rolled back by itself, is the caller's
//! error, where a handler without `effect` runs the whole transaction again.
//!
//! The external service is an in-process counter, [`Provider`]; `tests/partner_api.rs`
//! runs send-first against a real HTTP server. `effects_suite!` instantiates the cases once per
//! backend. What differs between the backends — how a `COMMIT` is made to fail
//! transiently, how the database is made to end a transaction by itself — is in
//! `postgres_faults`, `mysql_faults` and `sqlite_faults`, which offer the same items.
//! Every case asserts the dedup rows and the number of calls, not only the outcome.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_runtime::{Duplicate, MAX_ATTEMPTS, Outcome, RolledBack, idempotent};
use dedup_suite::{claims, claims_in, error_code, unique};
use tokio::sync::Notify;
use tokio::time::timeout;

/// How long any single wait may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// The dedup table of the handlers whose `COMMIT` is made to fail (MariaDB's fault is a
/// trigger on it; the other backends use it so that the handlers are the same).
const COMMIT_TABLE: &str = "dedup_effects_commit";

/// Stands in for the external service: counts the calls it receives.
#[derive(Debug, Default)]
struct Provider {
    calls: AtomicU32,
}

impl Provider {
    /// One call, as an HTTP request or an email would be; its 1-based number.
    async fn call(&self) -> u32 {
        tokio::task::yield_now().await;
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// Holds a body after its call: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Gate {
    entered: Notify,
    go: Notify,
}

macro_rules! effects_suite {
    ($backend:ident, conn = $conn:ty, faults = $faults:ident $(,)?) => {
        mod $backend {
            use super::*;
            use super::$faults as faults;

            const CONSUMER: &str = "effects-send-first";

            /// The receipt email: one call, the connection never touched. With a gate it
            /// stops after the call until the gate opens.
            #[idempotent(consumer = "effects-send-first", key = id, effect = "send-first")]
            async fn send(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                gate: Option<&Gate>,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if let Some(gate) = gate {
                    gate.entered.notify_one();
                    gate.go.notified().await;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn runs_once_without_the_connection_then_duplicate() {
                let pool = faults::pool().await;
                let id = unique("send-first");
                let provider = Provider::default();
                assert_eq!(send(&*pool, &id, &provider, None).await.unwrap(), Outcome::Processed(1));
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                let again = send(&*pool, &id, &provider, None).await.unwrap();
                assert_eq!(again, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1, "a duplicate calls nobody");
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
            }

            /// The documented duplicate: the call was made, then the call of the handler
            /// ends (the process dies) before its `COMMIT`.
            #[tokio::test]
            async fn crash_between_the_call_and_the_commit_repeats_the_call() {
                let pool = faults::pool().await;
                let id = unique("send-first-crash");
                let provider = Arc::new(Provider::default());
                let gate = Arc::new(Gate::default());
                let task = tokio::spawn({
                    let (pool, id) = ((*pool).clone(), id.clone());
                    let (provider, gate) = (provider.clone(), gate.clone());
                    async move { send(&pool, &id, &provider, Some(&gate)).await }
                });
                timeout(PATIENCE, gate.entered.notified())
                    .await
                    .expect("the body made its call");
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                assert_eq!(provider.calls(), 1);
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 0, "no mark without the COMMIT");

                // The redelivery calls again — the duplicate send-first allows — and marks.
                let redelivered = timeout(PATIENCE, send(&*pool, &id, &provider, None))
                    .await
                    .expect("the redelivery is not blocked by the dead call's transaction");
                assert_eq!(redelivered.unwrap(), Outcome::Processed(2));
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
                assert!(send(&*pool, &id, &provider, None).await.unwrap().is_duplicate());
                assert_eq!(provider.calls(), 2);
            }

            /// While the first copy's call runs, the second waits on its claim; once the
            /// first commits, the second is a duplicate and calls nobody.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_copy_waits_on_the_claim_then_is_a_duplicate() {
                let pool = faults::pool().await;
                let id = unique("send-first-copies");
                let provider = Arc::new(Provider::default());
                let gate = Arc::new(Gate::default());
                // Both copies get the gate: a second copy that ran its body would stop there.
                let copy = || {
                    let (pool, id) = ((*pool).clone(), id.clone());
                    let (provider, gate) = (provider.clone(), gate.clone());
                    tokio::spawn(async move { send(&pool, &id, &provider, Some(&gate)).await })
                };
                let first = copy();
                timeout(PATIENCE, gate.entered.notified())
                    .await
                    .expect("the first copy made its call");
                let second = copy();
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert!(!second.is_finished(), "the second copy waits on the first one's claim");
                assert_eq!(provider.calls(), 1);

                gate.go.notify_one();
                let first = timeout(PATIENCE, first).await.expect("the first copy ends");
                assert_eq!(first.unwrap().unwrap(), Outcome::Processed(1));
                let second = timeout(PATIENCE, second).await.expect("the second copy ends");
                let second = second.unwrap().unwrap();
                assert_eq!(second, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1, "one call for two copies");
                assert_eq!(claims(&*pool, CONSUMER, &id).await, 1);
            }

            // ---- no retry once the body ran ---------------------------------------------

            /// Calls, then on its first `failures` calls the database raises a transient
            /// error (a serialization failure, a deadlock, `SQLITE_LOCKED`).
            #[idempotent(consumer = "effects-body-transient", key = id, effect = "send-first")]
            async fn send_then_fail(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                failures: u32,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call <= failures {
                    faults::raise_transient(tx).await?;
                }
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-body-transient-plain", key = id)]
            async fn plain_then_fail(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                failures: u32,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call <= failures {
                    faults::raise_transient(tx).await?;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn a_transient_error_after_the_call_is_returned_not_retried() {
                let pool = faults::pool().await;
                let id = unique("send-first-transient");
                let provider = Provider::default();
                let error = send_then_fail(&*pool, &id, &provider, 1).await.unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(faults::TRANSIENT_CODE), "{error:?}");
                assert_eq!(provider.calls(), 1, "no second call behind the caller's back");
                assert_eq!(claims(&*pool, "effects-body-transient", &id).await, 0);
                // The caller's redelivery calls again, visibly, and commits.
                let redelivered = send_then_fail(&*pool, &id, &provider, 1).await.unwrap();
                assert_eq!(redelivered, Outcome::Processed(2));
                assert_eq!(claims(&*pool, "effects-body-transient", &id).await, 1);

                // Without `effect` the same failure runs the body again inside the call.
                let id = unique("plain-transient");
                let provider = Provider::default();
                let outcome = plain_then_fail(&*pool, &id, &provider, 1).await.unwrap();
                assert_eq!(outcome, Outcome::Processed(2));
                assert_eq!(provider.calls(), 2, "retried: the body ran twice");
                assert_eq!(claims(&*pool, "effects-body-transient-plain", &id).await, 1);
            }

            /// Calls; on its first call makes this transaction's `COMMIT` fail with a
            /// transient error, on later ones lets commits through again.
            #[idempotent(
                consumer = "effects-commit",
                key = id,
                table = "dedup_effects_commit",
                effect = "send-first"
            )]
            async fn send_then_commit(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                fault: &faults::CommitFault,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call == 1 {
                    fault.arm(tx, id).await?;
                } else {
                    fault.disarm().await;
                }
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-commit-plain", key = id, table = "dedup_effects_commit")]
            async fn plain_then_commit(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                fault: &faults::CommitFault,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                if call == 1 {
                    fault.arm(tx, id).await?;
                } else {
                    fault.disarm().await;
                }
                Ok(call)
            }

            #[tokio::test]
            async fn a_transient_failure_at_commit_is_returned_not_retried() {
                let db = faults::commit_fault_db().await;
                let fault = faults::CommitFault::new(&db).await;
                let id = unique("send-first-commit");
                let provider = Provider::default();
                let error = timeout(PATIENCE, send_then_commit(&*db, &id, &provider, &fault))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(faults::COMMIT_CODE), "{error:?}");
                assert_eq!(provider.calls(), 1, "the COMMIT failed after the call: no second call");
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit", &id).await, 0);
                fault.disarm().await;
                let redelivered = send_then_commit(&*db, &id, &provider, &fault).await.unwrap();
                assert_eq!(redelivered, Outcome::Processed(2));
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit", &id).await, 1);

                // Without `effect` the failed COMMIT runs the whole transaction again.
                let id = unique("plain-commit");
                let provider = Provider::default();
                let outcome = timeout(PATIENCE, plain_then_commit(&*db, &id, &provider, &fault))
                    .await
                    .expect("the call returns")
                    .unwrap();
                assert_eq!(outcome, Outcome::Processed(2));
                assert_eq!(provider.calls(), 2, "retried: the body ran twice");
                assert_eq!(claims_in(&*db, COMMIT_TABLE, "effects-commit-plain", &id).await, 1);
            }

            /// Calls, then swallows a database error after which the database has ended
            /// the transaction by itself (issue 8's checked commit finds it).
            #[idempotent(consumer = "effects-swallow", key = id, effect = "send-first")]
            async fn send_then_swallow(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                swallow: &faults::Swallow,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                swallow.in_body(tx).await;
                Ok(call)
            }

            /// The same body without `effect`.
            #[idempotent(consumer = "effects-swallow-plain", key = id)]
            async fn plain_then_swallow(
                tx: &mut $conn,
                id: &str,
                provider: &Provider,
                swallow: &faults::Swallow,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                swallow.in_body(tx).await;
                Ok(call)
            }

            #[tokio::test]
            async fn a_swallowed_error_is_rolled_back_after_one_run() {
                let pool = faults::pool().await;
                let swallow = faults::Swallow::new(&pool).await;
                let id = unique("send-first-swallow");
                let provider = Provider::default();
                let error = timeout(PATIENCE, send_then_swallow(&*pool, &id, &provider, &swallow))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert!(RolledBack::find(&error).is_some(), "{error:?}");
                assert_eq!(provider.calls(), 1, "RolledBack at once, without a second run");
                assert_eq!(claims(&*pool, "effects-swallow", &id).await, 0);

                // Without `effect` the call is run again first (issue 8), then RolledBack.
                let id = unique("plain-swallow");
                let provider = Provider::default();
                let error = timeout(PATIENCE, plain_then_swallow(&*pool, &id, &provider, &swallow))
                    .await
                    .expect("the call returns")
                    .unwrap_err();
                assert!(RolledBack::find(&error).is_some(), "{error:?}");
                assert_eq!(provider.calls(), MAX_ATTEMPTS);
                assert_eq!(claims(&*pool, "effects-swallow-plain", &id).await, 0);
            }
        }
    };
}

effects_suite!(
    postgres,
    conn = sqlx::PgConnection,
    faults = postgres_faults
);
effects_suite!(mysql, conn = sqlx::MySqlConnection, faults = mysql_faults);
effects_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    faults = sqlite_faults
);

/// PostgreSQL: a real `40001` from the server, raised in the body or by a deferred
/// constraint trigger at `COMMIT`; a failed statement aborts the transaction.
mod postgres_faults {
    use sqlx::PgConnection;
    use sqlx::postgres::PgPool;

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
}

/// MariaDB: a real error 1213 from the server, `SIGNAL`led in the body or by a trigger on
/// the dedup table, which the checked commit's `UPDATE` fires; a real deadlock, which
/// InnoDB answers by rolling the whole transaction back.
mod mysql_faults {
    use sqlx::MySqlConnection;
    use sqlx::mysql::MySqlPool;
    use tokio::sync::Barrier;

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
        /// trigger is rolled back with it, so the next attempt commits).
        pub async fn arm(&self, tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
            sqlx::query("INSERT INTO dedup_effects_fail_commit (message_id) VALUES (?)")
                .bind(id)
                .execute(&mut *tx)
                .await?;
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
}

/// SQLite: `SQLITE_LOCKED` from a checkpoint asked for inside a transaction; at `COMMIT`,
/// `SQLITE_BUSY` while a reader holds its shared lock on a database with a rollback
/// journal (in WAL mode readers never block a commit); a trigger's `RAISE(ROLLBACK, …)`,
/// which ends the transaction inside SQLite.
mod sqlite_faults {
    use std::time::Duration;

    use dedup_suite::TempSqlite;
    use sqlx::sqlite::SqliteJournalMode;
    use sqlx::{SqliteConnection, SqlitePool};

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
}
