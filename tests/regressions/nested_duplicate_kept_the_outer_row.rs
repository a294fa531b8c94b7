//! Issue 24, item 2 — MySQL/MariaDB: a handler that called another `#[idempotent]`
//! handler inside its own transaction, where the inner one was a duplicate, could never
//! commit. The checked commit finds its row through session variables, and the inner
//! claim overwrote them (even the duplicate's, whose `VALUES (@x := …)` runs before the
//! duplicate-key error): the outer commit checked a row that was not its own, failed with
//! 1242, and was retried into `RolledBack` on every delivery. A claim inside a caller's
//! transaction now leaves those variables alone. Checked on every backend: nested
//! handlers, duplicate and fresh, and the outer's effect and dedup row read back.

use dedup_runtime::{Duplicate, Outcome, idempotent};
use dedup_suite::{claims, unique};

const OUTER: &str = "regress-nested-outer";
const INNER: &str = "regress-nested-inner";

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, effects = $effects:literal,
     record = $record:literal) => {
        mod $backend {
            use super::*;

            #[idempotent(consumer = "regress-nested-inner", key = id)]
            async fn inner(tx: &mut $conn, id: &str) -> Result<(), sqlx::Error> {
                sqlx::query($record).bind(id).execute(&mut *tx).await?;
                Ok(())
            }

            /// Its own effect, then the inner handler on the same transaction.
            #[idempotent(consumer = "regress-nested-outer", key = id)]
            async fn outer(
                tx: &mut $conn,
                id: &str,
                inner_id: &str,
            ) -> Result<Outcome<()>, sqlx::Error> {
                sqlx::query($record).bind(id).execute(&mut *tx).await?;
                inner(&mut *tx, inner_id).await
            }

            async fn effects(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "regress_nested_effects", "message_id", id).await
            }

            #[tokio::test]
            async fn an_outer_handler_commits_around_a_duplicate_inner_one() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                let inner_id = unique("regress-nested-inner");
                assert_eq!(
                    inner(pool, &inner_id).await.unwrap(),
                    Outcome::Processed(())
                );

                let id = unique("regress-nested-outer");
                let outcome = outer(pool, &id, &inner_id).await.unwrap();
                assert_eq!(
                    outcome,
                    Outcome::Processed(Outcome::Duplicate(Duplicate::AlreadyProcessed))
                );
                assert_eq!(effects(pool, &id).await, 1, "the outer's effect committed");
                assert_eq!(claims(pool, OUTER, &id).await, 1, "with its dedup row");
                assert_eq!(effects(pool, &inner_id).await, 1, "the inner ran once");
                assert_eq!(
                    outer(pool, &id, &inner_id).await.unwrap(),
                    Outcome::Duplicate(Duplicate::AlreadyProcessed)
                );
            }

            #[tokio::test]
            async fn an_outer_handler_commits_around_a_fresh_inner_one() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_suite::ddl(pool, $effects).await;
                let id = unique("regress-nested-outer-fresh");
                let inner_id = unique("regress-nested-inner-fresh");
                let outcome = outer(pool, &id, &inner_id).await.unwrap();
                assert_eq!(outcome, Outcome::Processed(Outcome::Processed(())));
                assert_eq!(effects(pool, &id).await, 1);
                assert_eq!(effects(pool, &inner_id).await, 1);
                assert_eq!(claims(pool, OUTER, &id).await, 1);
                assert_eq!(claims(pool, INNER, &inner_id).await, 1);
                // The inner alone, later: a duplicate of what the outer's commit made.
                assert_eq!(
                    inner(pool, &inner_id).await.unwrap(),
                    Outcome::Duplicate(Duplicate::AlreadyProcessed)
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_nested_effects (message_id text NOT NULL)",
    record = "INSERT INTO regress_nested_effects (message_id) VALUES ($1)"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    effects = "CREATE TABLE IF NOT EXISTS regress_nested_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    record = "INSERT INTO regress_nested_effects (message_id) VALUES (?)"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    effects = "CREATE TABLE IF NOT EXISTS regress_nested_effects (message_id TEXT NOT NULL)",
    record = "INSERT INTO regress_nested_effects (message_id) VALUES (?1)"
);
