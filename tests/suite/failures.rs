//! Failures against the real servers: transient errors (serialization failures,
//! deadlocks, lock timeouts, `SQLITE_BUSY`/`SQLITE_LOCKED`) retried and bounded, no retry
//! inside a caller's transaction, transient errors seen through the handler's own error
//! type (or not: an opaque one), and a connection killed mid-transaction.
//!
//! `failure_suite!` instantiates the same cases once per backend: PostgreSQL and MariaDB
//! (the machine's servers) and a temporary SQLite file. The transient error is a real
//! one the database raises: `RAISE … USING ERRCODE = '40001'` on PostgreSQL, `SIGNAL` of
//! error 1213 on MariaDB, and on SQLite `SQLITE_LOCKED` (a WAL checkpoint asked for inside
//! a transaction). Cases that need a server session (killing it, row locks, deadlocks)
//! run on PostgreSQL and MariaDB. What only one backend can do stays in its own module,
//! `postgres_only`, `mysql_only`, `sqlite_only`, which says why. Every case asserts the
//! database state (effect rows and dedup rows), not only the outcome. Message ids are
//! unique per run (`dedup_suite::unique`), because the servers keep tables between runs.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use dedup_runtime::{MAX_ATTEMPTS, Outcome, idempotent};
use dedup_suite::{Runs, claims, error_code, unique};
use tokio::sync::{Barrier, Notify, mpsc};
use tokio::time::timeout;

/// How long any single wait in these tests may take before the test fails instead of
/// hanging.
const PATIENCE: Duration = Duration::from_secs(15);

/// The effect table every backend's handlers write to.
const EFFECTS: &str = "dedup_failure_effects";

/// The SQL that differs between the backends, for the cases every backend runs.
struct Sql {
    /// Creates the effect table and whatever else the backend's tests use, idempotently.
    ddl: &'static str,
    /// Inserts one effect row; binds the message id.
    insert_effect: &'static str,
    /// A statement the database answers with an error `#[idempotent]` retries.
    raise_transient: &'static str,
    /// That error's code, as `dedup_suite::error_code` reports it.
    transient_code: &'static str,
    /// Part of that error's message: what an opaque error type keeps of it.
    transient_text: &'static str,
}

/// The SQL of the cases that need a server: sessions to kill, rows to lock.
struct ServerSql {
    /// The current session's id, as a signed 64-bit integer.
    session_id: &'static str,
    /// Ends the session whose id replaces `{session}`.
    kill: &'static str,
    /// Counts the sessions whose id replaces `{session}`.
    sessions: &'static str,
    /// The codes of the errors `#[idempotent]` retries: a lost connection is none of them.
    transient_codes: &'static [&'static str],
    /// Inserts the lock row named by the bound value, with `n = 0`.
    insert_lock: &'static str,
    /// Adds 1 to the `n` of the lock row named by the bound value.
    update_lock: &'static str,
    /// The `n` of the lock row named by the bound value.
    lock_count: &'static str,
    /// Locks the row named by the bound value until the transaction ends.
    lock_row: &'static str,
    /// Run first by the deadlocking handler (PostgreSQL: detect the deadlock sooner).
    deadlock_setup: Option<&'static str>,
    /// Run first by the handler that waits on a locked row: a short lock wait.
    lock_timeout_setup: &'static str,
}

/// The handler error types, and whether a transient failure inside the body is seen
/// through them.
#[derive(Debug, Clone, Copy)]
enum ErrorType {
    Sqlx,
    Anyhow,
    /// `anyhow::Error` with `.context(…)` around the database error.
    AnyhowContext,
    /// A thiserror enum with a `#[from] sqlx::Error` variant that has its own message.
    ThiserrorFrom,
    /// A thiserror enum whose variant is `#[error(transparent)]`: `source()` skips the
    /// `sqlx::Error` and yields its boxed `DatabaseError` (see tests/regressions/
    /// thiserror_transparent_source_chain.rs).
    ThiserrorTransparent,
    BoxDynError,
    /// A type that keeps only the error's text.
    Opaque,
}

/// What a transient failure inside the body comes to, by the handler's error type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// The database error is found in the error's chain: the call is run again.
    Retried,
    /// Nothing leads back to the database error: the error reaches the caller at once
    /// (the guide: such a type should say which of its errors are transient).
    Hidden,
}

const ERROR_TYPES: [(ErrorType, Seen); 7] = [
    (ErrorType::Sqlx, Seen::Retried),
    (ErrorType::Anyhow, Seen::Retried),
    (ErrorType::AnyhowContext, Seen::Retried),
    (ErrorType::ThiserrorFrom, Seen::Retried),
    (ErrorType::ThiserrorTransparent, Seen::Retried),
    (ErrorType::BoxDynError, Seen::Retried),
    (ErrorType::Opaque, Seen::Hidden),
];

#[derive(Debug, thiserror::Error)]
enum FromError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[allow(dead_code)]
    #[error("invalid input")]
    Invalid,
}

#[derive(Debug, thiserror::Error)]
enum TransparentError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// An error type that keeps only the text: the database error is gone.
#[derive(Debug)]
struct Opaque(String);

impl From<sqlx::Error> for Opaque {
    fn from(error: sqlx::Error) -> Self {
        Opaque(error.to_string())
    }
}

/// The consumer of every handler of the error-type table.
const ERROR_TYPES_CONSUMER: &str = "failures-error-types";

/// One handler per error type: its effect, then on its first run the backend's transient
/// error, turned into the handler's error type by `?` (after `.context(…)` if given).
macro_rules! error_type_handlers {
    ($conn:ty; $($name:ident -> $error:ty $(, context $context:literal)?;)*) => {$(
        #[idempotent(consumer = "failures-error-types", key = id)]
        async fn $name(tx: &mut $conn, id: &str, runs: &Runs) -> Result<(), $error> {
            let run = runs.next();
            insert_effect(tx, id).await?;
            if run == 1 {
                raise_transient(tx).await $(.context($context))? ?;
            }
            Ok(())
        }
    )*};
}

macro_rules! failure_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        pool = $pool:expr,
        sql = $sql:expr
        $(, server = $server:expr)? $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::{AssertSqlSafe, Pool};

            pub(super) type Db = <$conn as sqlx::Connection>::Database;
            const SQL: Sql = $sql;

            /// A pool with the effect table.
            pub(super) async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, SQL.ddl).await;
                pool
            }

            pub(super) async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                dedup_suite::rows(pool, EFFECTS, "message_id", id).await
            }

            pub(super) async fn insert_effect(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query(SQL.insert_effect).bind(id).execute(&mut *tx).await?;
                Ok(())
            }

            async fn raise_transient(tx: &mut $conn) -> Result<(), sqlx::Error> {
                sqlx::raw_sql(SQL.raise_transient).execute(&mut *tx).await?;
                Ok(())
            }

            // ---- transient failures: retried, bounded, not inside a caller's transaction

            /// Inserts its effect; on its first `failures` runs then fails transiently.
            #[idempotent(consumer = "failures-flaky", key = id)]
            async fn flaky(
                tx: &mut $conn,
                id: &str,
                failures: u32,
                runs: &Runs,
            ) -> Result<u32, sqlx::Error> {
                let run = runs.next();
                insert_effect(tx, id).await?;
                if run <= failures {
                    raise_transient(tx).await?;
                }
                Ok(run)
            }

            #[tokio::test]
            async fn transient_error_is_retried() {
                let pool = pool().await;
                let id = unique("transient");
                let runs = Runs::new();
                assert_eq!(
                    flaky(&*pool, &id, 1, &runs).await.unwrap(),
                    Outcome::Processed(2),
                    "the second run's value"
                );
                assert_eq!(runs.get(), 2);
                assert_eq!(effects(&pool, &id).await, 1, "the first run's effect rolled back");
                assert_eq!(claims(&*pool, "failures-flaky", &id).await, 1);
                assert!(flaky(&*pool, &id, 0, &runs).await.unwrap().is_duplicate());
                assert_eq!(runs.get(), 2, "a duplicate runs no body");
            }

            #[tokio::test]
            async fn retried_on_a_lent_connection_outside_a_transaction() {
                let pool = pool().await;
                let id = unique("transient-lent");
                let runs = Runs::new();
                let mut conn = pool.acquire().await.unwrap();
                assert_eq!(flaky(&mut conn, &id, 1, &runs).await.unwrap(), Outcome::Processed(2));
                assert_eq!(runs.get(), 2);
                assert!(flaky(&mut *conn, &id, 0, &runs).await.unwrap().is_duplicate());
                drop(conn);
                assert_eq!(effects(&pool, &id).await, 1);
                assert_eq!(claims(&*pool, "failures-flaky", &id).await, 1);
            }

            #[tokio::test]
            async fn retries_are_bounded() {
                let pool = pool().await;
                let id = unique("transient-always");
                let runs = Runs::new();
                let error = flaky(&*pool, &id, u32::MAX, &runs).await.unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(SQL.transient_code), "{error:?}");
                assert_eq!(runs.get(), MAX_ATTEMPTS);
                assert_eq!(effects(&pool, &id).await, 0);
                assert_eq!(claims(&*pool, "failures-flaky", &id).await, 0);
            }

            #[tokio::test]
            async fn no_retry_inside_a_callers_transaction() {
                let pool = pool().await;
                let id = unique("transient-caller");
                let caller_row = format!("{id}-caller");
                let runs = Runs::new();

                let mut tx = pool.begin().await.unwrap();
                insert_effect(&mut tx, &caller_row).await.unwrap();
                let error = flaky(&mut tx, &id, u32::MAX, &runs).await.unwrap_err();
                assert_eq!(error_code(&error).as_deref(), Some(SQL.transient_code), "{error:?}");
                assert_eq!(runs.get(), 1, "the caller owns the transaction: no retry");

                // The handler's savepoint was rolled back: the caller's transaction is
                // usable, its own work is there, the handler's is not.
                let [first, second] = <Db as dedup_suite::TestDatabase>::PLACEHOLDERS;
                let visible: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {EFFECTS} WHERE message_id IN ({first}, {second})"
                )))
                .bind(&id)
                .bind(&caller_row)
                .fetch_one(&mut *tx)
                .await
                .expect("the caller's transaction is still usable");
                assert_eq!(visible, 1, "only the caller's own row");
                tx.rollback().await.unwrap();

                assert_eq!(effects(&pool, &id).await, 0);
                assert_eq!(effects(&pool, &caller_row).await, 0);
                assert_eq!(claims(&*pool, "failures-flaky", &id).await, 0);
            }

            // ---- transient failures seen through the handler's own error type ----------

            error_type_handlers! { $conn;
                via_sqlx -> sqlx::Error;
                via_anyhow -> anyhow::Error;
                via_anyhow_context -> anyhow::Error, context "the body's statement";
                via_thiserror_from -> FromError;
                via_thiserror_transparent -> TransparentError;
                via_box_dyn_error -> Box<dyn std::error::Error + Send + Sync>;
                via_opaque -> Opaque;
            }

            /// Calls the handler of `error_type`; its error as text, all an opaque type
            /// keeps.
            async fn via(
                error_type: ErrorType,
                pool: &Pool<Db>,
                id: &str,
                runs: &Runs,
            ) -> Result<Outcome<()>, String> {
                match error_type {
                    ErrorType::Sqlx => via_sqlx(pool, id, runs).await.map_err(|e| e.to_string()),
                    ErrorType::Anyhow => {
                        via_anyhow(pool, id, runs).await.map_err(|e| format!("{e:#}"))
                    }
                    ErrorType::AnyhowContext => {
                        via_anyhow_context(pool, id, runs).await.map_err(|e| format!("{e:#}"))
                    }
                    ErrorType::ThiserrorFrom => {
                        via_thiserror_from(pool, id, runs).await.map_err(|e| e.to_string())
                    }
                    ErrorType::ThiserrorTransparent => {
                        via_thiserror_transparent(pool, id, runs).await.map_err(|e| e.to_string())
                    }
                    ErrorType::BoxDynError => {
                        via_box_dyn_error(pool, id, runs).await.map_err(|e| e.to_string())
                    }
                    ErrorType::Opaque => {
                        via_opaque(pool, id, runs).await.map_err(|Opaque(text)| text)
                    }
                }
            }

            /// Each row of `ERROR_TYPES`: a transient error raised by the body, seen
            /// through the handler's error type and retried, or hidden and returned.
            #[tokio::test]
            async fn transient_errors_through_each_error_type() {
                let pool = pool().await;
                for (error_type, seen) in ERROR_TYPES {
                    let id = unique("error-type");
                    let runs = Runs::new();
                    let result = via(error_type, &pool, &id, &runs).await;
                    match seen {
                        Seen::Retried => {
                            assert_eq!(result, Ok(Outcome::Processed(())), "{error_type:?}");
                            assert_eq!(runs.get(), 2, "{error_type:?}: run again, once");
                        }
                        Seen::Hidden => {
                            let text = result.expect_err("the error reaches the caller");
                            assert!(text.contains(SQL.transient_text), "{error_type:?}: {text}");
                            assert_eq!(runs.get(), 1, "{error_type:?}: hidden, so no retry");
                            assert_eq!(effects(&pool, &id).await, 0, "{error_type:?}");
                            assert_eq!(
                                claims(&*pool, ERROR_TYPES_CONSUMER, &id).await,
                                0,
                                "{error_type:?}"
                            );
                            // A redelivery runs the body again (its second run succeeds).
                            let again = via(error_type, &pool, &id, &runs).await;
                            assert_eq!(again, Ok(Outcome::Processed(())), "{error_type:?}");
                        }
                    }
                    assert_eq!(effects(&pool, &id).await, 1, "{error_type:?}");
                    let claimed = claims(&*pool, ERROR_TYPES_CONSUMER, &id).await;
                    assert_eq!(claimed, 1, "{error_type:?}");
                    let again = via(error_type, &pool, &id, &runs).await;
                    let duplicate = again.map(|outcome| outcome.is_duplicate());
                    assert_eq!(duplicate, Ok(true), "{error_type:?}");
                    assert_eq!(runs.get(), 2, "{error_type:?}: a duplicate runs no body");
                }
            }

            $(
            // ---- cases that need a server session -------------------------------------

            const SERVER: ServerSql = $server;

            #[idempotent(consumer = "failures-kill", key = id)]
            async fn record(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                insert_effect(tx, id).await
            }

            /// Inserts its effect, reports its session id, waits for `go`, then queries
            /// again.
            #[idempotent(consumer = "failures-kill", key = id)]
            async fn stalls_after_effect(
                tx: &mut $conn,
                id: &str,
                runs: &Runs,
                session: &mpsc::UnboundedSender<i64>,
                go: &Notify,
            ) -> Result<(), sqlx::Error> {
                runs.next();
                insert_effect(tx, id).await?;
                let me: i64 = sqlx::query_scalar(SERVER.session_id).fetch_one(&mut *tx).await?;
                session.send(me).expect("the test listens");
                go.notified().await;
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
                Ok(())
            }

            #[tokio::test]
            async fn connection_killed_mid_transaction_commits_nothing() {
                let pool = pool().await;
                let id = unique("killed");
                let runs = Arc::new(Runs::new());
                let go = Arc::new(Notify::new());
                let (session_tx, mut session_rx) = mpsc::unbounded_channel();

                let task = tokio::spawn({
                    let (pool, id) = ((*pool).clone(), id.clone());
                    let (runs, go) = (runs.clone(), go.clone());
                    async move { stalls_after_effect(&pool, &id, &runs, &session_tx, &go).await }
                });
                let session = timeout(PATIENCE, session_rx.recv())
                    .await
                    .expect("the body reports its session")
                    .expect("the body reports its session");
                let with_session =
                    |sql: &str| AssertSqlSafe(sql.replace("{session}", &session.to_string()));
                sqlx::raw_sql(with_session(SERVER.kill)).execute(&*pool).await.unwrap();
                timeout(PATIENCE, async {
                    while sqlx::query_scalar::<_, i64>(with_session(SERVER.sessions))
                        .fetch_one(&*pool)
                        .await
                        .unwrap()
                        > 0
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .expect("the session ends");
                go.notify_one();

                let result = timeout(PATIENCE, task)
                    .await
                    .expect("the call returns")
                    .expect("the call does not panic");
                let error = result.expect_err("a call whose connection was killed fails");
                let code = error_code(&error);
                assert!(
                    !code.as_deref().is_some_and(|code| SERVER.transient_codes.contains(&code)),
                    "{error:?}"
                );
                assert_eq!(runs.get(), 1, "a lost connection is not retried");
                assert_eq!(effects(&pool, &id).await, 0);
                assert_eq!(claims(&*pool, "failures-kill", &id).await, 0);

                // The redelivery processes the message, once.
                assert_eq!(record(&*pool, &id).await.unwrap(), Outcome::Processed(()));
                assert_eq!(effects(&pool, &id).await, 1);
                assert_eq!(claims(&*pool, "failures-kill", &id).await, 1);
                assert!(record(&*pool, &id).await.unwrap().is_duplicate());
            }

            /// Two fresh lock rows, `n = 0`.
            pub(super) async fn lock_rows(pool: &Pool<Db>) -> (String, String) {
                let rows = (unique("row-a"), unique("row-b"));
                for name in [&rows.0, &rows.1] {
                    sqlx::query(SERVER.insert_lock).bind(name).execute(pool).await.unwrap();
                }
                rows
            }

            pub(super) async fn lock_count(pool: &Pool<Db>, name: &str) -> i32 {
                sqlx::query_scalar(SERVER.lock_count).bind(name).fetch_one(pool).await.unwrap()
            }

            /// Locks `first`, then (after the barrier on its first run) `second`.
            #[idempotent(consumer = "failures-deadlock", key = id)]
            pub(super) async fn lock_two_rows(
                tx: &mut $conn,
                id: &str,
                first: &str,
                second: &str,
                barrier: &Barrier,
                runs: &Runs,
            ) -> Result<(), sqlx::Error> {
                let run = runs.next();
                if let Some(setup) = SERVER.deadlock_setup {
                    sqlx::query(setup).execute(&mut *tx).await?;
                }
                insert_effect(tx, id).await?;
                for (step, name) in [first, second].into_iter().enumerate() {
                    if step == 1 && run == 1 {
                        // Both transactions hold their first row: the second locks close a
                        // cycle.
                        barrier.wait().await;
                    }
                    sqlx::query(SERVER.update_lock).bind(name).execute(&mut *tx).await?;
                }
                Ok(())
            }

            #[tokio::test]
            async fn deadlock_is_retried() {
                let pool = pool().await;
                let (a, b) = lock_rows(&pool).await;
                let (id_1, id_2) = (unique("deadlock"), unique("deadlock"));
                let barrier = Barrier::new(2);
                let (runs_1, runs_2) = (Runs::new(), Runs::new());

                let (first, second) = timeout(PATIENCE, async {
                    tokio::join!(
                        lock_two_rows(&*pool, &id_1, &a, &b, &barrier, &runs_1),
                        lock_two_rows(&*pool, &id_2, &b, &a, &barrier, &runs_2),
                    )
                })
                .await
                .expect("the deadlock is broken");
                assert_eq!(first.unwrap(), Outcome::Processed(()));
                assert_eq!(second.unwrap(), Outcome::Processed(()));
                let mut counts = [runs_1.get(), runs_2.get()];
                counts.sort_unstable();
                assert_eq!(counts, [1, 2], "one victim, run again once");

                for id in [&id_1, &id_2] {
                    assert_eq!(effects(&pool, id).await, 1);
                    assert_eq!(claims(&*pool, "failures-deadlock", id).await, 1);
                }
                for name in [&a, &b] {
                    let n = lock_count(&pool, name).await;
                    assert_eq!(n, 2, "each handler's update counted once");
                }
            }

            /// Updates the row `name` with a short lock wait; reports each run's number.
            #[idempotent(consumer = "failures-lock-timeout", key = id)]
            async fn update_locked_row(
                tx: &mut $conn,
                id: &str,
                name: &str,
                started: &mpsc::UnboundedSender<u32>,
                runs: &Runs,
            ) -> Result<(), sqlx::Error> {
                started.send(runs.next()).expect("the test listens");
                sqlx::query(SERVER.lock_timeout_setup).execute(&mut *tx).await?;
                insert_effect(tx, id).await?;
                sqlx::query(SERVER.update_lock).bind(name).execute(&mut *tx).await?;
                Ok(())
            }

            /// The lock wait times out (PostgreSQL 55P03; MariaDB 1205, which rolls back
            /// only the statement: the handler rolls back the rest) and the call runs again
            /// until the lock is free.
            #[tokio::test]
            async fn lock_timeout_is_retried() {
                let pool = pool().await;
                let (row, _) = lock_rows(&pool).await;
                let id = unique("lock-timeout");
                let runs = Runs::new();
                let (started_tx, mut started_rx) = mpsc::unbounded_channel();

                let mut holder = pool.begin().await.unwrap();
                sqlx::query(SERVER.lock_row).bind(&row).execute(&mut *holder).await.unwrap();
                let (outcome, ()) = timeout(PATIENCE, async {
                    tokio::join!(
                        update_locked_row(&*pool, &id, &row, &started_tx, &runs),
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
                assert!((2..=MAX_ATTEMPTS).contains(&runs.get()), "{}", runs.get());
                assert_eq!(effects(&pool, &id).await, 1, "the timed-out run's insert rolled back");
                assert_eq!(claims(&*pool, "failures-lock-timeout", &id).await, 1);
                assert_eq!(lock_count(&pool, &row).await, 1);
            }
            )?
        }
    };
}

failure_suite!(
    postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    sql = Sql {
        // `dedup_failure_deferred` has a deferred constraint trigger that fails the COMMIT
        // with the SQLSTATE in the transaction's `dedup.commit_error` setting, if any
        // (`postgres_only`).
        ddl: "CREATE TABLE IF NOT EXISTS dedup_failure_effects (message_id text NOT NULL); \
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
        insert_effect: "INSERT INTO dedup_failure_effects (message_id) VALUES ($1)",
        // A real server error with SQLSTATE 40001 (serialization_failure).
        raise_transient: "DO $$ BEGIN RAISE EXCEPTION 'simulated serialization failure' \
                          USING ERRCODE = '40001'; END $$",
        transient_code: "40001",
        transient_text: "simulated serialization failure",
    },
    server = ServerSql {
        session_id: "SELECT pg_backend_pid()::int8",
        // With a timeout, pg_terminate_backend waits until the backend is gone.
        kill: "SELECT pg_terminate_backend({session}, 5000)",
        sessions: "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = {session}",
        transient_codes: &["40001", "40P01", "55P03"],
        insert_lock: "INSERT INTO dedup_failure_locks (name, n) VALUES ($1, 0)",
        update_lock: "UPDATE dedup_failure_locks SET n = n + 1 WHERE name = $1",
        lock_count: "SELECT n FROM dedup_failure_locks WHERE name = $1",
        lock_row: "SELECT n FROM dedup_failure_locks WHERE name = $1 FOR UPDATE",
        // Detect the deadlock after 50 ms instead of the default second (superuser only).
        deadlock_setup: Some("SET LOCAL deadlock_timeout = '50ms'"),
        lock_timeout_setup: "SET LOCAL lock_timeout = '200ms'",
    },
);

failure_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    sql = Sql {
        ddl: "CREATE TABLE IF NOT EXISTS dedup_failure_effects \
              (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB; \
              CREATE TABLE IF NOT EXISTS dedup_failure_locks \
              (name VARBINARY(255) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
        insert_effect: "INSERT INTO dedup_failure_effects (message_id) VALUES (?)",
        // A real server error 1213 (ER_LOCK_DEADLOCK, SQLSTATE 40001). MariaDB allows
        // `SIGNAL` outside stored programs; it cannot be prepared, hence `raw_sql`.
        raise_transient: "SIGNAL SQLSTATE '40001' \
                          SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'simulated deadlock'",
        transient_code: "1213",
        transient_text: "simulated deadlock",
    },
    server = ServerSql {
        session_id: "SELECT CAST(CONNECTION_ID() AS SIGNED)",
        kill: "KILL {session}",
        sessions: "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {session}",
        transient_codes: &["1205", "1213"],
        insert_lock: "INSERT INTO dedup_failure_locks (name, n) VALUES (?, 0)",
        update_lock: "UPDATE dedup_failure_locks SET n = n + 1 WHERE name = ?",
        lock_count: "SELECT n FROM dedup_failure_locks WHERE name = ?",
        lock_row: "SELECT n FROM dedup_failure_locks WHERE name = ? FOR UPDATE",
        deadlock_setup: None,
        // 1 s, the minimum. `SESSION`: InnoDB reads it when the wait begins.
        lock_timeout_setup: "SET SESSION innodb_lock_wait_timeout = 1",
    },
);

// No `server`: SQLite has no session to kill from outside (the database is a file in this
// process), and writers take the one write lock up front (`BEGIN IMMEDIATE`), so there
// are no row locks, lock timeouts or deadlocks; its lock contention, `SQLITE_BUSY`, is
// `sqlite_only`'s.
failure_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    sql = Sql {
        ddl: "CREATE TABLE IF NOT EXISTS dedup_failure_effects (message_id TEXT NOT NULL)",
        insert_effect: "INSERT INTO dedup_failure_effects (message_id) VALUES (?)",
        // A checkpoint cannot run while the connection is in a transaction: SQLite
        // answers SQLITE_LOCKED (6), "database table is locked", which is transient.
        raise_transient: "PRAGMA wal_checkpoint(PASSIVE)",
        transient_code: "6",
        transient_text: "database table is locked",
    },
);

/// What only PostgreSQL can do: a constraint trigger deferred to the COMMIT (MariaDB has
/// no deferred constraints; SQLite's deferred foreign keys fail with a fixed,
/// non-transient code).
mod postgres_only {
    use super::postgres::{effects, insert_effect, pool};
    use super::*;
    use sqlx::PgConnection;

    /// Inserts its effect and a row whose deferred trigger fails the COMMIT with
    /// `sqlstate` on the first `failures` runs.
    #[idempotent(consumer = "failures-commit", key = id)]
    async fn fails_at_commit(
        tx: &mut PgConnection,
        id: &str,
        sqlstate: &str,
        failures: u32,
        runs: &Runs,
    ) -> Result<u32, sqlx::Error> {
        let run = runs.next();
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
        let id = unique("commit-40001");
        let runs = Runs::new();
        assert_eq!(
            fails_at_commit(&*pool, &id, "40001", 1, &runs)
                .await
                .unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(runs.get(), 2);
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&*pool, "failures-commit", &id).await, 1);
    }

    #[tokio::test]
    async fn other_failure_at_commit_is_returned() {
        let pool = pool().await;
        let id = unique("commit-23514");
        let runs = Runs::new();
        let error = fails_at_commit(&*pool, &id, "23514", 1, &runs)
            .await
            .unwrap_err();
        assert_eq!(error_code(&error).as_deref(), Some("23514"), "{error:?}");
        assert_eq!(runs.get(), 1);
        assert_eq!(effects(&pool, &id).await, 0);
        assert_eq!(claims(&*pool, "failures-commit", &id).await, 0);

        // The connection the failed COMMIT ran on is fine for the redelivery.
        assert_eq!(
            fails_at_commit(&*pool, &id, "", 0, &runs).await.unwrap(),
            Outcome::Processed(2)
        );
        assert_eq!(effects(&pool, &id).await, 1);
        assert_eq!(claims(&*pool, "failures-commit", &id).await, 1);
    }
}

/// What only MariaDB does: a deadlock rolls back the whole transaction, not only the
/// statement or the handler's savepoint (on PostgreSQL the caller's transaction survives
/// the handler's rolled-back savepoint, as `no_retry_inside_a_callers_transaction` shows).
mod mysql_only {
    use super::mysql::{effects, insert_effect, lock_rows, lock_two_rows, pool};
    use super::*;

    /// Inside a caller's transaction the handler reports 1213 without retrying, nothing
    /// of the handler's is committed, and the caller's own earlier work is gone too.
    #[tokio::test]
    async fn deadlock_inside_a_callers_transaction_ends_it() {
        let pool = pool().await;
        let (a, b) = lock_rows(&pool).await;
        let id = unique("deadlock-caller");
        let (caller_row, other_row) = (format!("{id}-caller"), format!("{id}-other"));
        let barrier = Barrier::new(2);
        let runs = Runs::new();

        let caller = async {
            let mut tx = pool.begin().await.unwrap();
            insert_effect(&mut tx, &caller_row).await.unwrap();
            let result = lock_two_rows(&mut tx, &id, &a, &b, &barrier, &runs).await;
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
        assert_eq!(error_code(&error).as_deref(), Some("1213"), "{error:?}");
        assert_eq!(runs.get(), 1, "the caller owns the transaction: no retry");

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
        assert_eq!(claims(&*pool, "failures-deadlock", &id).await, 0);
        assert_eq!(
            effects(&pool, &caller_row).await,
            0,
            "MariaDB rolled back the caller's whole transaction"
        );
    }
}

/// What only SQLite has: `SQLITE_BUSY` at `BEGIN IMMEDIATE`, while another connection
/// holds the database's one write lock (the servers lock rows, and wait on them: see the
/// lock-timeout and deadlock cases).
mod sqlite_only {
    use super::sqlite::{effects, insert_effect};
    use super::*;
    use sqlx::{Connection as _, SqliteConnection};
    use std::time::Instant;

    /// The handler pool's busy timeout: much shorter than the lock is held.
    const BUSY_TIMEOUT: Duration = Duration::from_millis(50);

    /// A temporary database with a short busy timeout and the effect table.
    async fn db() -> dedup_suite::TempSqlite {
        let db = dedup_suite::sqlite_with(2, BUSY_TIMEOUT).await;
        dedup_suite::ddl(
            &*db,
            "CREATE TABLE dedup_failure_effects (message_id TEXT NOT NULL)",
        )
        .await;
        db
    }

    /// Another connection to the same file, holding the write lock.
    async fn hold_write_lock(db: &dedup_suite::TempSqlite) -> SqliteConnection {
        let mut holder = db.connect().await;
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut holder)
            .await
            .unwrap();
        holder
    }

    #[idempotent(consumer = "failures-sqlite-busy", key = id)]
    async fn record(tx: &mut SqliteConnection, id: &str, runs: &Runs) -> Result<(), sqlx::Error> {
        runs.next();
        insert_effect(tx, id).await
    }

    #[tokio::test]
    async fn busy_is_retried_until_the_lock_is_released() {
        const HELD: Duration = Duration::from_millis(150);
        let db = db().await;
        let id = unique("sqlite-busy");
        let runs = Runs::new();
        let mut holder = hold_write_lock(&db).await;

        let started = Instant::now();
        let (outcome, ()) = timeout(PATIENCE, async {
            tokio::join!(record(&db.pool, &id, &runs), async {
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
        assert_eq!(runs.get(), 1, "BEGIN IMMEDIATE failed, not the body");
        assert_eq!(effects(&db, &id).await, 1);
        assert_eq!(claims(&*db, "failures-sqlite-busy", &id).await, 1);
        holder.close().await.unwrap();
    }

    #[tokio::test]
    async fn busy_retries_are_bounded() {
        let db = db().await;
        let id = unique("sqlite-busy-always");
        let runs = Runs::new();
        let holder = hold_write_lock(&db).await;

        let started = Instant::now();
        let error = timeout(PATIENCE, record(&db.pool, &id, &runs))
            .await
            .expect("the call returns")
            .unwrap_err();
        let elapsed = started.elapsed();

        assert_eq!(
            error_code(&error).as_deref(),
            Some("5"),
            "SQLITE_BUSY: {error:?}"
        );
        // Each attempt waits out the busy timeout before it fails.
        assert!(
            elapsed >= BUSY_TIMEOUT * MAX_ATTEMPTS,
            "{MAX_ATTEMPTS} attempts of {BUSY_TIMEOUT:?}: {elapsed:?}"
        );
        assert_eq!(runs.get(), 0, "the body never ran");
        holder.close().await.unwrap();
        assert_eq!(effects(&db, &id).await, 0);
        assert_eq!(claims(&*db, "failures-sqlite-busy", &id).await, 0);
    }
}
