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

    pub const RECORD: &str =
        "INSERT INTO dedup_lease_results (message_id, attempt) VALUES ($1, $2)";

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
}

/// MariaDB: a real error 1213 from the server, `SIGNAL`led in the body or by a trigger on
/// the dedup table, which the checked commit's `UPDATE` fires; a real deadlock, which
/// InnoDB answers by rolling the whole transaction back.
mod mysql_faults {
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

// ---- leases: mark-first, and send-first with a lease ------------------------------------

/// The row of `(consumer, id)`: its `state` (NULL processed, 1 a send-first lease, 2 a
/// mark-first mark) and its owner token, or `None` when there is none.
async fn lease_row<DB>(
    pool: &sqlx::Pool<DB>,
    consumer: &str,
    id: &str,
) -> Option<(Option<i64>, Option<Vec<u8>>)>
where
    DB: sqlx::Database,
    for<'e> &'e sqlx::Pool<DB>: sqlx::Executor<'e, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (Option<i64>, Option<Vec<u8>>): sqlx::FromRow<'r, DB::Row>,
{
    let sql = if DB::NAME == "PostgreSQL" {
        "SELECT state::int8, owner FROM processed_messages WHERE consumer = $1 AND message_id = $2"
    } else {
        "SELECT CAST(state AS SIGNED), owner FROM processed_messages WHERE consumer = ? AND message_id = ?"
    };
    let sql = if DB::NAME == "SQLite" {
        "SELECT state, owner FROM processed_messages WHERE consumer = ? AND message_id = ?"
    } else {
        sql
    };
    sqlx::query_as(sql)
        .bind(consumer)
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Holds a leased body at one point: `entered` once it got there, released by `go`.
#[derive(Debug, Default)]
struct Hold {
    entered: Notify,
    go: Notify,
}

impl Hold {
    async fn here(hold: Option<&Hold>) {
        if let Some(hold) = hold {
            hold.entered.notify_one();
            hold.go.notified().await;
        }
    }
}

macro_rules! leases_suite {
    ($backend:ident, db = $db:ty, faults = $faults:ident $(,)?) => {
        mod $backend {
            use super::*;
            use super::$faults as faults;
            use dedup_runtime::{Lease, LeaseLost, LeaseOutcome, Resolution, UnresolvedStatus};

            const SEND: &str = "leases-send-first";
            const MARK: &str = "leases-mark-first";

            /// The charge: one call with no transaction open; `before` holds it before the
            /// call, `after` between the call and the completion; the result is recorded
            /// in the completion's transaction.
            #[idempotent(consumer = "leases-send-first", key = id, effect = "send-first", lease = "30s")]
            async fn charge(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
                after: Option<&Hold>,
                fail: bool,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                Hold::here(after).await;
                if fail {
                    return Err(sqlx::Error::Protocol("the provider said no".into()));
                }
                let tx = lease.transaction().await?;
                sqlx::query(faults::RECORD).bind(id).bind(call as i64).execute(&mut *tx).await?;
                Ok(call)
            }

            /// The audit ping that must never repeat: marked first, then called.
            #[idempotent(consumer = "leases-mark-first", key = id, effect = "mark-first", lease = "30s")]
            async fn ping(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
                before: Option<&Hold>,
                fail: bool,
            ) -> Result<u32, sqlx::Error> {
                Hold::here(before).await;
                if fail {
                    return Err(sqlx::Error::Protocol("the audit service is down".into()));
                }
                Ok(provider.call().await)
            }

            /// A long call under a short lease, renewed every quarter of it.
            #[idempotent(consumer = "leases-renewed", key = id, effect = "send-first", lease = "1s")]
            async fn long_call(
                lease: &mut Lease<'_, $db>,
                id: &str,
                provider: &Provider,
            ) -> Result<u32, sqlx::Error> {
                let call = provider.call().await;
                for _ in 0..12 {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    lease.extend().await?;
                }
                Ok(call)
            }

            /// Starts `charge` (or, `marked`, `ping`) in a task of its own, and waits until
            /// its body reaches `hold`: after the call (`charge`), before it (`ping`).
            async fn held(
                marked: bool,
                pool: &sqlx::Pool<$db>,
                id: &str,
                provider: &Arc<Provider>,
                hold: &Arc<Hold>,
            ) -> tokio::task::JoinHandle<Result<LeaseOutcome<u32>, sqlx::Error>> {
                let task = tokio::spawn({
                    let (pool, id, provider, hold) = (pool.clone(), id.to_owned(), provider.clone(), hold.clone());
                    async move {
                        if marked {
                            ping(&pool, &id, &provider, Some(&hold), false).await
                        } else {
                            charge(&pool, &id, &provider, Some(&hold), false).await
                        }
                    }
                });
                timeout(PATIENCE, hold.entered.notified()).await.expect("the body reached its hold");
                task
            }

            async fn recorded(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_lease_results", "message_id", id).await
            }

            #[tokio::test]
            async fn send_first_with_a_lease_runs_once_and_records_in_the_completion() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-once");
                let provider = Provider::default();
                let first = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(first, LeaseOutcome::Processed(1));
                assert_eq!(lease_row(&*pool, SEND, &id).await.map(|row| row.0), Some(None));
                assert_eq!(recorded(&*pool, &id).await, 1);
                let again = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(again, LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 1);
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// No transaction and no connection are held while the call runs.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_call_runs_with_the_connection_back_in_the_pool() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-pool");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(false, &pool, &id, &provider, &hold).await;
                // A connection dropped goes back to the pool through a task of its own.
                timeout(PATIENCE, async {
                    while pool.num_idle() as u32 != pool.size() {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await
                .expect("every connection is back in the pool, idle, while the call runs");
                // The row is committed in progress: another connection sees it.
                assert_eq!(lease_row(&*pool, SEND, &id).await.map(|row| row.0), Some(Some(1)));
                hold.go.notify_one();
                let done = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
                assert_eq!(done, LeaseOutcome::Processed(1));
            }

            /// Two copies at once: one call; the other is told "in progress", with the
            /// time left, neither a duplicate nor an error.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_copy_is_in_progress_with_the_time_left() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-copies");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let first = held(false, &pool, &id, &provider, &hold).await;
                let second = charge(&*pool, &id, &provider, None, false).await.unwrap();
                let busy = second.in_progress().expect("in progress");
                assert!(busy.remaining() > Duration::from_secs(20) && busy.remaining() <= Duration::from_secs(30), "{busy:?}");
                let policy = dedup_runtime::AckPolicy::<$db>::new();
                assert_eq!(
                    policy.decide(&Ok::<_, sqlx::Error>(second), 1),
                    dedup_runtime::Ack::Retry { after: busy.remaining() }
                );
                hold.go.notify_one();
                assert_eq!(timeout(PATIENCE, first).await.unwrap().unwrap().unwrap(), LeaseOutcome::Processed(1));
                assert_eq!(provider.calls(), 1, "one call for two copies");
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// The documented send-first duplicate, with a lease: the owner dies after the
            /// call. Until the lease ends a redelivery is "in progress"; then it takes
            /// over with a new token and calls again. The expiry compares on the server:
            /// the test moves the row's `expires_at` into the past, the host clock stays.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crash_after_the_call_repeats_it_after_the_lease_with_a_new_owner() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-crash");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(false, &pool, &id, &provider, &hold).await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                let (state, dead_owner) = lease_row(&*pool, SEND, &id).await.expect("the lease stays");
                assert_eq!(state, Some(1));
                assert!(charge(&*pool, &id, &provider, None, false).await.unwrap().is_in_progress());
                assert_eq!(provider.calls(), 1);

                faults::expire(&*pool, SEND, &id).await;
                let redelivered = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(redelivered, LeaseOutcome::Processed(2), "the duplicate call send-first allows");
                let (state, owner) = lease_row(&*pool, SEND, &id).await.unwrap();
                assert_eq!(state, None);
                assert_ne!(owner, dead_owner, "taken over with a new token");
                assert_eq!(recorded(&*pool, &id).await, 1);
            }

            /// A stale owner (paused past its lease) resumes after another delivery took
            /// over and completed: its completion is refused, its writes rolled back.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_owner_is_refused_and_changes_nothing() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-stale");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let stale = held(false, &pool, &id, &provider, &hold).await;
                faults::expire(&*pool, SEND, &id).await;
                let taken = charge(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(taken, LeaseOutcome::Processed(2));
                let after_takeover = lease_row(&*pool, SEND, &id).await;

                hold.go.notify_one();
                let error = timeout(PATIENCE, stale).await.unwrap().unwrap().unwrap_err();
                let lost = LeaseLost::find(&error).expect("a typed LeaseLost");
                assert_eq!(lost.message_id(), id);
                assert_eq!(lease_row(&*pool, SEND, &id).await, after_takeover, "nothing changed");
                assert_eq!(recorded(&*pool, &id).await, 1, "the stale owner's write was rolled back");
                // Another delivery owns the message now: redeliver (a duplicate, then), never
                // dead-letter.
                assert!(matches!(
                    dedup_runtime::AckPolicy::<$db>::new().decide(&Err::<LeaseOutcome<u32>, _>(error), 1),
                    dedup_runtime::Ack::Retry { .. }
                ));
            }

            /// Renewal keeps a call three times as long as its lease owned.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal_keeps_a_call_longer_than_its_lease_owned() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-renewed");
                let provider = Arc::new(Provider::default());
                let owner = tokio::spawn({
                    let (pool, id, provider) = ((*pool).clone(), id.clone(), provider.clone());
                    async move { long_call(&pool, &id, &provider).await }
                });
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    let copy = long_call(&*pool, &id, &provider).await.unwrap();
                    assert!(copy.is_in_progress(), "{copy:?}");
                }
                let done = timeout(PATIENCE, owner).await.unwrap().unwrap().unwrap();
                assert_eq!(done, LeaseOutcome::Processed(1));
                assert_eq!(provider.calls(), 1);
            }

            /// A body error releases the row: the redelivery runs again at once.
            #[tokio::test]
            async fn a_body_error_releases_the_lease() {
                let pool = faults::lease_pool().await;
                let id = unique("lease-error");
                let provider = Provider::default();
                assert!(charge(&*pool, &id, &provider, None, true).await.is_err());
                assert_eq!(lease_row(&*pool, SEND, &id).await, None);
                assert_eq!(charge(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(2));
                let id = unique("mark-error");
                assert!(ping(&*pool, &id, &provider, None, true).await.is_err());
                assert_eq!(lease_row(&*pool, MARK, &id).await, None, "mark-first releases too");
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(3));
            }

            #[tokio::test]
            async fn mark_first_runs_once_then_duplicate() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-once");
                let provider = Provider::default();
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(1));
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(None));
                assert!(ping(&*pool, &id, &provider, None, false).await.unwrap().is_duplicate());
                assert_eq!(provider.calls(), 1);
            }

            /// The documented mark-first loss: the process dies after the mark committed
            /// and before the call. While the lease runs, a copy is in progress; after it,
            /// the outcome is unknown: acknowledged without a call, and the row stays.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mark_first_crash_before_the_call_is_lost_and_visible() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-crash");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(true, &pool, &id, &provider, &hold).await;
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(Some(2)), "the mark is committed");
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                assert!(ping(&*pool, &id, &provider, None, false).await.unwrap().is_in_progress());

                faults::expire(&*pool, MARK, &id).await;
                let redelivered = ping(&*pool, &id, &provider, None, false).await.unwrap();
                assert_eq!(redelivered, LeaseOutcome::Duplicate(Duplicate::OutcomeUnknown));
                assert_eq!(
                    dedup_runtime::AckPolicy::<$db>::new().decide(&Ok::<_, sqlx::Error>(redelivered), 1),
                    dedup_runtime::Ack::Ack,
                    "at most once: acknowledged"
                );
                assert_eq!(provider.calls(), 0, "the documented loss: never called");
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(Some(2)), "the row stays");

                // The operator's view: listed as unknown, and resolved.
                let ledger = dedup_runtime::Ledger::new(&*pool);
                let listed = ledger.unresolved(MARK, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert_eq!(row.status(), UnresolvedStatus::OutcomeUnknown);
                assert!(ledger.resolve(MARK, id.as_str(), Resolution::Done).await.unwrap());
                assert_eq!(lease_row(&*pool, MARK, &id).await.map(|row| row.0), Some(None), "processed");
                assert!(!ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap(), "nothing left to resolve");
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Duplicate(Duplicate::AlreadyProcessed));
                assert_eq!(provider.calls(), 0);
            }

            /// The operator leaves a running lease alone, and sees it in progress; a
            /// retry resolution of an unknown row runs the handler at the next delivery.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_operator_lists_and_resolves_only_ended_leases() {
                let pool = faults::lease_pool().await;
                let id = unique("mark-operator");
                let provider = Arc::new(Provider::default());
                let hold = Arc::new(Hold::default());
                let task = held(true, &pool, &id, &provider, &hold).await;
                let ledger = dedup_runtime::Ledger::new(&*pool);
                let listed = ledger.unresolved(MARK, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert!(matches!(row.status(), UnresolvedStatus::InProgress { remaining } if remaining > Duration::from_secs(20)), "{row:?}");
                assert!(!ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap(), "a running lease is left alone");
                task.abort();
                let _ = task.await;
                faults::expire(&*pool, MARK, &id).await;
                assert!(ledger.resolve(MARK, id.as_str(), Resolution::Retry).await.unwrap());
                assert_eq!(lease_row(&*pool, MARK, &id).await, None);
                assert_eq!(ping(&*pool, &id, &provider, None, false).await.unwrap(), LeaseOutcome::Processed(1), "replayed");

                // An abandoned send-first lease is listed as such.
                let id = unique("lease-operator");
                let task = held(false, &pool, &id, &provider, &hold).await;
                task.abort();
                let _ = task.await;
                faults::expire(&*pool, SEND, &id).await;
                let listed = ledger.unresolved(SEND, 10_000).await.unwrap();
                let row = listed.iter().find(|row| row.message_id() == id).expect("listed");
                assert_eq!(row.status(), UnresolvedStatus::LeaseExpired);
            }
        }
    };
}

/// PostgreSQL's own view while a leased call runs: no session of the handler's pool is in a
/// transaction (`pg_stat_activity`, read from another pool), and every connection of it is
/// idle in the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_shows_no_transaction_open_during_a_leased_call() {
    use dedup_runtime::{Lease, LeaseOutcome};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    /// Renews its lease (a statement on a connection of the pool, then back), then calls.
    #[idempotent(consumer = "leases-activity", key = id, effect = "send-first", lease = "30s")]
    async fn call_out(
        lease: &mut Lease<'_, sqlx::Postgres>,
        id: &str,
        hold: &Hold,
    ) -> Result<(), sqlx::Error> {
        lease.extend().await?;
        Hold::here(Some(hold)).await;
        Ok(())
    }

    let name = unique("dedup-lease-activity");
    let options: PgConnectOptions = dedup_suite::postgres_url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name))
        .await
        .unwrap();
    let observer = dedup_suite::postgres().await;
    let id = unique("lease-activity");
    let hold = Arc::new(Hold::default());
    let task = tokio::spawn({
        let (pool, id, hold) = (pool.clone(), id.clone(), hold.clone());
        async move { call_out(&pool, &id, &hold).await }
    });
    timeout(PATIENCE, hold.entered.notified())
        .await
        .expect("the call runs");
    let count = |sql: &'static str| {
        let (observer, name) = (observer.clone(), name.clone());
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(name)
                .fetch_one(&observer)
                .await
                .unwrap()
        }
    };
    let sessions = count("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1").await;
    assert!(sessions >= 1, "the handler's pool has its sessions open");
    let in_transaction = count(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 \
         AND (xact_start IS NOT NULL OR state LIKE 'idle in transaction%')",
    )
    .await;
    assert_eq!(
        in_transaction, 0,
        "no session of the handler is in a transaction during the call"
    );
    timeout(PATIENCE, async {
        while pool.num_idle() as u32 != pool.size() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the pool has every connection back during the call");
    hold.go.notify_one();
    let done = timeout(PATIENCE, task).await.unwrap().unwrap().unwrap();
    assert_eq!(done, LeaseOutcome::Processed(()));
    assert_eq!(claims(&pool, "leases-activity", &id).await, 1);
}

leases_suite!(
    postgres_leases,
    db = sqlx::Postgres,
    faults = postgres_faults
);
leases_suite!(mysql_leases, db = sqlx::MySql, faults = mysql_faults);
leases_suite!(sqlite_leases, db = sqlx::Sqlite, faults = sqlite_faults);

/// SQLite: `SQLITE_LOCKED` from a checkpoint asked for inside a transaction; at `COMMIT`,
/// `SQLITE_BUSY` while a reader holds its shared lock on a database with a rollback
/// journal (in WAL mode readers never block a commit); a trigger's `RAISE(ROLLBACK, …)`,
/// which ends the transaction inside SQLite.
mod sqlite_faults {
    use std::time::Duration;

    use dedup_suite::TempSqlite;
    use sqlx::sqlite::SqliteJournalMode;
    use sqlx::{SqliteConnection, SqlitePool};

    pub const RECORD: &str =
        "INSERT INTO dedup_lease_results (message_id, attempt) VALUES (?1, ?2)";

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
}
