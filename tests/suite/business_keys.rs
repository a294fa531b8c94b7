//! Technique 2 on every backend: `unique = "constraint"` turns a violation of a named
//! unique constraint inside the body into a duplicate, and any other violation into an
//! error. Each backend identifies the constraint its own way: PostgreSQL by the error's
//! constraint field, MariaDB by the key name of an English message (the handler sets the
//! session's `lc_messages`), SQLite by resolving the index to the columns it reports.

use std::sync::Arc;

use dedup_runtime::{Duplicate, Outcome, idempotent};

/// "Create the shipment for this order": the order id is the business key.
#[derive(Debug, Clone)]
pub struct ShipOrder {
    pub id: String,
    pub order_id: String,
    pub tracking: Option<String>,
}

impl ShipOrder {
    pub fn new(order_id: &str) -> Self {
        ShipOrder {
            id: dedup_suite::unique("msg"),
            order_id: order_id.to_owned(),
            tracking: None,
        }
    }
}

const ORDER_KEY: Duplicate = Duplicate::BusinessKey {
    constraint: "dedup_shipments_order_key",
};

macro_rules! business_key_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        ddl = [$($ddl:expr),* $(,)?],
        insert = $insert:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                $(dedup_suite::ddl(&*pool, $ddl).await;)*
                pool
            }

            async fn shipments(pool: &Pool<Db>, order_id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_shipments", "order_id", order_id).await
            }

            async fn claims(pool: &Pool<Db>, consumer: &str, id: &str) -> i64 {
                dedup_suite::claims(pool, consumer, id).await
            }

            async fn insert(tx: &mut $conn, msg: &ShipOrder) -> Result<(), sqlx::Error> {
                sqlx::query($insert)
                    .bind(&msg.order_id)
                    .bind(&msg.id)
                    .bind(&msg.tracking)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            /// Business key only: no dedup table involved.
            #[idempotent(unique = "dedup_shipments_order_key")]
            async fn ship(tx: &mut $conn, msg: &ShipOrder) -> Result<u8, sqlx::Error> {
                insert(tx, msg).await?;
                Ok(1)
            }

            /// Message id and business key together, with a list of constraints.
            #[idempotent(
                consumer = "business-keys",
                key = msg.id,
                unique = ["dedup_shipments_other_key", "dedup_shipments_order_key"]
            )]
            async fn ship_keyed(tx: &mut $conn, msg: &ShipOrder) -> Result<(), sqlx::Error> {
                insert(tx, msg).await
            }

            #[tokio::test]
            async fn same_business_key_from_two_message_ids() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                let first = ShipOrder::new(&order);
                let second = ShipOrder::new(&order);
                assert_eq!(ship(&*pool, &first).await.unwrap(), Outcome::Processed(1));
                assert_eq!(ship(&*pool, &second).await.unwrap(), Outcome::Duplicate(ORDER_KEY));
                assert_eq!(ship(&*pool, &first).await.unwrap(), Outcome::Duplicate(ORDER_KEY));
                assert_eq!(shipments(&pool, &order).await, 1);
            }

            #[tokio::test]
            async fn an_undeclared_constraint_is_an_error() {
                let pool = pool().await;
                let tracking = dedup_suite::unique("track");
                let mut first = ShipOrder::new(&dedup_suite::unique("order"));
                first.tracking = Some(tracking.clone());
                let mut second = ShipOrder::new(&dedup_suite::unique("order"));
                second.tracking = Some(tracking);
                assert!(ship(&*pool, &first).await.unwrap().is_processed());
                let error = ship(&*pool, &second).await.unwrap_err();
                let database = error.as_database_error().expect("a database error");
                assert_eq!(database.kind(), sqlx::error::ErrorKind::UniqueViolation);
                assert_eq!(shipments(&pool, &second.order_id).await, 0);
            }

            #[tokio::test]
            async fn keyed_business_duplicate_leaves_no_dedup_row() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                let first = ShipOrder::new(&order);
                let second = ShipOrder::new(&order);
                assert!(ship_keyed(&*pool, &first).await.unwrap().is_processed());
                assert_eq!(ship_keyed(&*pool, &second).await.unwrap(), Outcome::Duplicate(ORDER_KEY));
                assert_eq!(claims(&pool, "business-keys", &first.id).await, 1);
                assert_eq!(claims(&pool, "business-keys", &second.id).await, 0);
                // A redelivery of the first message is caught by its id, before the body.
                assert_eq!(
                    ship_keyed(&*pool, &first).await.unwrap(),
                    Outcome::Duplicate(Duplicate::AlreadyProcessed)
                );
                assert_eq!(shipments(&pool, &order).await, 1);
            }

            /// 8 messages with different ids and the same business key, at once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_copies_of_a_business_key() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                let barrier = Arc::new(tokio::sync::Barrier::new(8));
                let tasks: Vec<_> = (0..8)
                    .map(|n| {
                        let (pool, barrier) = ((*pool).clone(), barrier.clone());
                        let msg = ShipOrder::new(&order);
                        tokio::spawn(async move {
                            barrier.wait().await;
                            if n % 2 == 0 { ship(&pool, &msg).await.map(|o| o.map(|_| ())) } else { ship_keyed(&pool, &msg).await }
                        })
                    })
                    .collect();
                let mut processed = 0;
                for task in tasks {
                    match task.await.unwrap().expect("no copy fails") {
                        Outcome::Processed(()) => processed += 1,
                        Outcome::Duplicate(duplicate) => assert_eq!(duplicate, ORDER_KEY),
                    }
                }
                assert_eq!(processed, 1);
                assert_eq!(shipments(&pool, &order).await, 1);
            }

            #[tokio::test]
            async fn inside_a_callers_transaction() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                let mut tx = pool.begin().await.unwrap();
                assert!(ship(&mut tx, &ShipOrder::new(&order)).await.unwrap().is_processed());
                assert_eq!(
                    ship(&mut tx, &ShipOrder::new(&order)).await.unwrap(),
                    Outcome::Duplicate(ORDER_KEY)
                );
                // Only the handler's savepoint was rolled back: the first shipment stands.
                tx.commit().await.unwrap();
                assert_eq!(shipments(&pool, &order).await, 1);
            }

            /// The violation is found through the user's error type: a thiserror enum with
            /// a `#[from] sqlx::Error` variant of its own message, and anyhow with context.
            /// (`#[error(transparent)]` is tests/regressions/
            /// thiserror_transparent_source_chain.rs's.)
            #[derive(Debug, thiserror::Error)]
            enum ShippingError {
                #[error("the shipment could not be stored")]
                Database(#[from] sqlx::Error),
            }

            #[idempotent(unique = "dedup_shipments_order_key")]
            async fn ship_thiserror(tx: &mut $conn, msg: &ShipOrder) -> Result<(), ShippingError> {
                Ok(insert(tx, msg).await?)
            }

            #[idempotent(unique = "dedup_shipments_order_key")]
            async fn ship_anyhow(tx: &mut $conn, msg: &ShipOrder) -> anyhow::Result<()> {
                use anyhow::Context as _;
                insert(tx, msg).await.context("inserting the shipment")
            }

            #[tokio::test]
            async fn seen_through_user_error_types() {
                let pool = pool().await;
                let order = dedup_suite::unique("order");
                assert!(ship_thiserror(&*pool, &ShipOrder::new(&order)).await.unwrap().is_processed());
                assert_eq!(
                    ship_thiserror(&*pool, &ShipOrder::new(&order)).await.unwrap(),
                    Outcome::Duplicate(ORDER_KEY)
                );
                assert_eq!(
                    ship_anyhow(&*pool, &ShipOrder::new(&order)).await.unwrap(),
                    Outcome::Duplicate(ORDER_KEY)
                );
                assert_eq!(shipments(&pool, &order).await, 1);
            }
        }
    };
}

business_key_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    ddl = ["CREATE TABLE IF NOT EXISTS dedup_shipments (\
             order_id text NOT NULL, message_id text NOT NULL, tracking text, \
             CONSTRAINT dedup_shipments_order_key UNIQUE (order_id), \
             CONSTRAINT dedup_shipments_tracking_key UNIQUE (tracking))",],
    insert = "INSERT INTO dedup_shipments (order_id, message_id, tracking) VALUES ($1, $2, $3)",
);

const MYSQL_SHIPMENTS: &str = "CREATE TABLE IF NOT EXISTS dedup_shipments (\
     order_id VARBINARY(255) NOT NULL, message_id VARBINARY(255) NOT NULL, \
     tracking VARBINARY(255) NULL, \
     UNIQUE KEY dedup_shipments_order_key (order_id), \
     UNIQUE KEY dedup_shipments_tracking_key (tracking)) ENGINE = InnoDB";

business_key_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(german_mysql().await),
    ddl = [MYSQL_SHIPMENTS],
    insert = "INSERT INTO dedup_shipments (order_id, message_id, tracking) VALUES (?, ?, ?)",
);

business_key_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    ddl = [
        "CREATE TABLE IF NOT EXISTS dedup_shipments (\
             order_id TEXT NOT NULL, message_id TEXT NOT NULL, tracking TEXT)",
        "CREATE UNIQUE INDEX IF NOT EXISTS dedup_shipments_order_key ON dedup_shipments (order_id)",
        "CREATE UNIQUE INDEX IF NOT EXISTS dedup_shipments_tracking_key \
             ON dedup_shipments (tracking)",
    ],
    insert = "INSERT INTO dedup_shipments (order_id, message_id, tracking) VALUES (?, ?, ?)",
);

/// MariaDB whose sessions report errors in German, as a server configured for German
/// users would: the business-key detection must not depend on the server's language.
async fn german_mysql() -> sqlx::MySqlPool {
    use sqlx::Executor as _;
    drop(dedup_suite::mysql().await); // migrated
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(10)
        .after_connect(|conn, _| {
            Box::pin(async move {
                let _ = conn.execute("SET SESSION lc_messages = 'de_DE'").await?;
                Ok(())
            })
        })
        .connect(&dedup_suite::mysql_url())
        .await
        .expect("MariaDB is not reachable")
}

/// The German setting is real: a duplicate outside a handler is reported in German.
#[tokio::test]
async fn mysql_messages_really_are_german() {
    let pool = german_mysql().await;
    let order = dedup_suite::unique("order");
    let insert = "INSERT INTO dedup_shipments (order_id, message_id) VALUES (?, 'x')";
    dedup_suite::ddl(&pool, MYSQL_SHIPMENTS).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(insert)
        .bind(&order)
        .execute(&mut *conn)
        .await
        .unwrap();
    let error = sqlx::query(insert)
        .bind(&order)
        .execute(&mut *conn)
        .await
        .unwrap_err();
    let message = error.as_database_error().unwrap().message().to_owned();
    assert!(
        !message.contains("Duplicate entry"),
        "not German: {message}"
    );
    assert!(message.contains("dedup_shipments_order_key"), "{message}");
}

/// SQLite also accepts the `table.column` form for a single-column unique index.
mod sqlite_table_column {
    use super::*;

    #[idempotent(unique = "dedup_shipments.order_id")]
    async fn ship(tx: &mut sqlx::SqliteConnection, msg: &ShipOrder) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO dedup_shipments (order_id, message_id) VALUES (?, ?)")
            .bind(&msg.order_id)
            .bind(&msg.id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    #[tokio::test]
    async fn table_column_form() {
        let pool = dedup_suite::sqlite().await;
        sqlx::raw_sql(
            "CREATE TABLE dedup_shipments (order_id TEXT NOT NULL, message_id TEXT NOT NULL); \
             CREATE UNIQUE INDEX dedup_shipments_order_key ON dedup_shipments (order_id);",
        )
        .execute(&*pool)
        .await
        .unwrap();
        assert!(
            ship(&*pool, &ShipOrder::new("o-1"))
                .await
                .unwrap()
                .is_processed()
        );
        assert_eq!(
            ship(&*pool, &ShipOrder::new("o-1")).await.unwrap(),
            Outcome::Duplicate(Duplicate::BusinessKey {
                constraint: "dedup_shipments.order_id"
            })
        );
    }
}
