//! A handler error type with `#[error(transparent)]` hid the database error from the chain
//! walker. thiserror's most common spelling,
//!
//! ```text
//! #[derive(Debug, thiserror::Error)]
//! enum AppError { #[error(transparent)] Database(#[from] sqlx::Error) }
//! ```
//!
//! forwards `source()` to the `sqlx::Error`'s own source: the chain goes from `AppError`
//! straight to the boxed `DatabaseError` and never shows the `sqlx::Error`, which is all
//! the walker looked for. A serialization failure behind it was not retried. The walker
//! now also classifies a `Box<dyn DatabaseError>` link; the unique-violation search that
//! came later (`unique = "…"`) shares it.
//!
//! On every backend: the chain has that shape; the walker classifies the transient error
//! in it; a business-key violation behind it is a `Duplicate::BusinessKey`. The handler's
//! retry through this type, end to end, is the `ThiserrorTransparent` row of the error-type
//! table in tests/suite/failures.rs.

use std::error::Error as _;

use dedup_runtime::{Duplicate, Failure, Outcome, idempotent};
use sqlx::error::DatabaseError;

#[derive(Debug, thiserror::Error)]
enum TransparentError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

const ORDER_KEY: Duplicate = Duplicate::BusinessKey {
    constraint: "regress_transparent_key",
};

macro_rules! transparent_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        pool = $pool:expr,
        ddl = $ddl:literal,
        insert = $insert:literal,
        raise_transient = $raise:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = <$conn as sqlx::Connection>::Database;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $ddl).await;
                pool
            }

            #[idempotent(consumer = "transparent", key = id, unique = "regress_transparent_key")]
            async fn place(tx: &mut $conn, id: &str, order: &str) -> Result<(), TransparentError> {
                sqlx::query($insert).bind(order).execute(&mut *tx).await?;
                Ok(())
            }

            #[tokio::test]
            async fn a_transient_error_behind_it_is_transient() {
                let pool = pool().await;
                // The server's own transient error, inside a transaction (SQLite's needs one).
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("SELECT COUNT(*) FROM processed_messages")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let raised = sqlx::raw_sql($raise).execute(&mut *tx).await.unwrap_err();
                tx.rollback().await.unwrap();
                let error = TransparentError::from(raised);

                // The shape that hid it: no `sqlx::Error` anywhere in the chain.
                let source = error.source().expect("the boxed database error");
                assert!(source.downcast_ref::<sqlx::Error>().is_none(), "{source:?}");
                assert!(
                    source.downcast_ref::<Box<dyn DatabaseError>>().is_some(),
                    "{source:?}"
                );

                assert!(dedup_runtime::is_transient::<Db>(&error), "{error:?}");
                assert_eq!(Failure::of::<Db>(&error), Failure::Transient, "{error:?}");
            }

            #[tokio::test]
            async fn a_unique_violation_behind_it_is_a_business_key() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                let (first, second) = (dedup_suite::unique("msg"), dedup_suite::unique("msg"));
                assert_eq!(
                    place(&*pool, &first, &order).await.unwrap(),
                    Outcome::Processed(())
                );
                let outcome = place(&*pool, &second, &order).await;
                assert!(
                    matches!(outcome, Ok(Outcome::Duplicate(ORDER_KEY))),
                    "a violation of the business key behind `#[error(transparent)]`: {outcome:?}"
                );
                assert_eq!(dedup_suite::claims(&*pool, "transparent", &first).await, 1);
                assert_eq!(dedup_suite::claims(&*pool, "transparent", &second).await, 0);
                assert_eq!(
                    dedup_suite::rows(&*pool, "regress_transparent", "order_id", &order).await,
                    1
                );
            }
        }
    };
}

transparent_suite!(
    postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    ddl = "CREATE TABLE IF NOT EXISTS regress_transparent (order_id text NOT NULL, \
           CONSTRAINT regress_transparent_key UNIQUE (order_id))",
    insert = "INSERT INTO regress_transparent (order_id) VALUES ($1)",
    raise_transient = "DO $$ BEGIN RAISE EXCEPTION 'simulated serialization failure' \
                       USING ERRCODE = '40001'; END $$",
);

transparent_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    ddl = "CREATE TABLE IF NOT EXISTS regress_transparent \
           (order_id VARBINARY(255) NOT NULL, \
            UNIQUE KEY regress_transparent_key (order_id)) ENGINE = InnoDB",
    insert = "INSERT INTO regress_transparent (order_id) VALUES (?)",
    raise_transient = "SIGNAL SQLSTATE '40001' \
                       SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'simulated deadlock'",
);

transparent_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    ddl = "CREATE TABLE IF NOT EXISTS regress_transparent (order_id TEXT NOT NULL); \
           CREATE UNIQUE INDEX IF NOT EXISTS regress_transparent_key \
           ON regress_transparent (order_id)",
    insert = "INSERT INTO regress_transparent (order_id) VALUES (?)",
    // SQLITE_LOCKED: no checkpoint inside a transaction.
    raise_transient = "PRAGMA wal_checkpoint(PASSIVE)",
);
