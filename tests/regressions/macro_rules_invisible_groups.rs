//! Literals forwarded through `macro_rules!` were refused. A `macro_rules!` macro that
//! generates handlers and forwards `$consumer:literal` (or `:expr`) to
//! `#[idempotent(consumer = $consumer, …)]` hands the attribute the literal wrapped in an
//! invisible group (`Expr::Group`), and the attribute took that for something other than
//! a string literal: "`consumer` takes a string literal". The same for `table`, `crate`
//! and `unique` (each name, and the list). The attribute now looks through the group.
//!
//! Checked under the lints of tests/suite/accepted.rs, so that what the attribute generates from
//! forwarded arguments stays warning-free too.

#![deny(
    clippy::pedantic,
    unused_qualifications,
    unused_results,
    missing_debug_implementations
)]

use dedup_runtime::{Duplicate, Outcome, idempotent};
use sqlx::SqliteConnection;

async fn insert(tx: &mut SqliteConnection, id: &str, order: &str) -> Result<(), sqlx::Error> {
    let _ = sqlx::query("INSERT INTO orders (message_id, order_id) VALUES (?, ?)")
        .bind(id)
        .bind(order)
        .execute(tx)
        .await?;
    Ok(())
}

/// Every string argument as a `literal` fragment; `unique` a list of two.
macro_rules! literal_handler {
    ($name:ident, $c:literal, $t:literal, $k:literal, [$($u:literal),*]) => {
        #[idempotent(consumer = $c, key = id, table = $t, crate = $k, unique = [$($u),*])]
        async fn $name(
            tx: &mut SqliteConnection,
            id: &str,
            order: &str,
        ) -> Result<(), sqlx::Error> {
            insert(tx, id, order).await
        }
    };
}

/// Every string argument as an `expr` fragment; `unique` one name.
macro_rules! expr_handler {
    ($name:ident, $c:expr, $t:expr, $k:expr, $u:expr) => {
        #[idempotent(consumer = $c, key = id, table = $t, crate = $k, unique = $u)]
        async fn $name(
            tx: &mut SqliteConnection,
            id: &str,
            order: &str,
        ) -> Result<(), sqlx::Error> {
            insert(tx, id, order).await
        }
    };
}

literal_handler!(
    by_literals,
    "regress-forwarded-literal",
    "forwarded_processed",
    "dedup_runtime",
    ["orders_other_key", "orders_order_key"]
);

expr_handler!(
    by_exprs,
    "regress-forwarded-expr",
    "forwarded_processed",
    "dedup_runtime",
    "orders_order_key"
);

const ORDER_KEY: Duplicate = Duplicate::BusinessKey {
    constraint: "orders_order_key",
};

#[tokio::test]
async fn forwarded_literals_and_exprs_are_accepted() {
    let db = dedup_suite::sqlite().await;
    dedup_runtime::migrate_table(&*db, "forwarded_processed")
        .await
        .unwrap();
    let _ = sqlx::raw_sql(
        "CREATE TABLE orders (message_id TEXT NOT NULL, order_id TEXT NOT NULL); \
         CREATE UNIQUE INDEX orders_order_key ON orders (order_id); \
         CREATE UNIQUE INDEX orders_other_key ON orders (message_id)",
    )
    .execute(&*db)
    .await
    .unwrap();

    for (consumer, id, order) in [
        ("regress-forwarded-literal", "l-1", "order-1"),
        ("regress-forwarded-expr", "e-1", "order-2"),
    ] {
        let call = |id: &'static str, order: &'static str| {
            let pool = db.pool.clone();
            async move {
                if consumer == "regress-forwarded-literal" {
                    by_literals(&pool, id, order).await
                } else {
                    by_exprs(&pool, id, order).await
                }
            }
        };
        // The forwarded consumer and table: processed, then a duplicate by id.
        assert_eq!(call(id, order).await.unwrap(), Outcome::Processed(()));
        assert_eq!(
            call(id, order).await.unwrap(),
            Outcome::Duplicate(Duplicate::AlreadyProcessed)
        );
        // The forwarded business key: another message for the same order.
        let other = if id == "l-1" { "l-2" } else { "e-2" };
        assert_eq!(
            call(other, order).await.unwrap(),
            Outcome::Duplicate(ORDER_KEY)
        );
        assert_eq!(
            dedup_suite::claims_in(&*db, "forwarded_processed", consumer, id).await,
            1,
            "{consumer}: claimed in the forwarded table"
        );
        assert_eq!(
            dedup_suite::claims_in(&*db, "forwarded_processed", consumer, other).await,
            0,
            "{consumer}: a business-key duplicate leaves no dedup row"
        );
        assert_eq!(dedup_suite::claims(&*db, consumer, id).await, 0);
        assert_eq!(
            dedup_suite::rows(&*db, "orders", "order_id", order).await,
            1
        );
    }
}
