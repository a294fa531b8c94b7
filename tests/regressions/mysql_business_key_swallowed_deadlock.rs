//! MariaDB/MySQL: a handler with a business key and no dedup row (`unique = …` alone)
//! committed what a body wrote after a deadlock it swallowed.
//!
//! InnoDB ends the transaction on a deadlock; the session stays out of autocommit, so the
//! body's next statements go into a new transaction. A handler with a dedup row refused to
//! commit that one (its commit read the row first); one without a dedup row committed it:
//! `Processed`, with the order row gone and only the rest of the effect there, so the
//! redelivery — its order key free again — applied the effect a second time. Every
//! transaction of the handler's own now begins with a savepoint that its commit releases
//! first: gone with the ended transaction, the release fails and nothing is committed.

use dedup_runtime::idempotent;

use crate::mysql_swallowed_deadlock::{both_processed, lock_rows, swallow_updates};
use dedup_suite::Runs;
use sqlx::MySqlConnection;
use sqlx::mysql::MySqlPool;
use tokio::sync::Barrier;

async fn pool() -> MySqlPool {
    let pool = dedup_suite::mysql().await;
    dedup_suite::ddl(
        &pool,
        "CREATE TABLE IF NOT EXISTS regress_bk_deadlock_orders \
         (order_id VARBINARY(255) NOT NULL, \
          CONSTRAINT regress_bk_deadlock_orders_key UNIQUE (order_id)) ENGINE = InnoDB; \
         CREATE TABLE IF NOT EXISTS regress_bk_deadlock_effects \
         (order_id VARBINARY(255) NOT NULL) ENGINE = InnoDB; \
         CREATE TABLE IF NOT EXISTS regress_bk_deadlock_locks \
         (name VARBINARY(255) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
    )
    .await;
    pool
}

/// The order row (the business key), then the two lock rows in the given order (the
/// first run waits for the other task in between, so that the two deadlock), then the
/// effect. A failed update is swallowed.
#[idempotent(unique = "regress_bk_deadlock_orders_key")]
async fn place_order(
    tx: &mut MySqlConnection,
    order: &str,
    first: &str,
    second: &str,
    barrier: &Barrier,
    runs: &Runs,
) -> Result<(), sqlx::Error> {
    let run = runs.next();
    sqlx::query("INSERT INTO regress_bk_deadlock_orders (order_id) VALUES (?)")
        .bind(order)
        .execute(&mut *tx)
        .await?;
    swallow_updates(
        tx,
        "regress_bk_deadlock_locks",
        [first, second],
        barrier,
        run,
    )
    .await;
    sqlx::query("INSERT INTO regress_bk_deadlock_effects (order_id) VALUES (?)")
        .bind(order)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// (order rows, effect rows) of `order`.
async fn counts(pool: &MySqlPool, order: &str) -> (i64, i64) {
    (
        dedup_suite::rows(pool, "regress_bk_deadlock_orders", "order_id", order).await,
        dedup_suite::rows(pool, "regress_bk_deadlock_effects", "order_id", order).await,
    )
}

#[tokio::test]
async fn a_business_key_handler_commits_all_or_nothing_after_a_swallowed_deadlock() {
    let pool = pool().await;
    let (a, b) = lock_rows(&pool, "regress_bk_deadlock_locks", "bk").await;
    let (order_1, order_2) = (dedup_suite::unique("bk-1"), dedup_suite::unique("bk-2"));
    let barrier = Barrier::new(2);
    let (runs_1, runs_2) = (Runs::new(), Runs::new());
    both_processed(
        place_order(&pool, &order_1, &a, &b, &barrier, &runs_1),
        place_order(&pool, &order_2, &b, &a, &barrier, &runs_2),
        [&runs_1, &runs_2],
    )
    .await;
    // Each order: its row and its effect, once.
    assert_eq!(counts(&pool, &order_1).await, (1, 1));
    assert_eq!(counts(&pool, &order_2).await, (1, 1));

    // Redeliveries are duplicates by the business key, and change nothing.
    for (order, first, second) in [(&order_1, &a, &b), (&order_2, &b, &a)] {
        let outcome = place_order(
            &pool,
            order,
            first,
            second,
            &Barrier::new(1),
            &Runs::starting_at(9),
        )
        .await
        .unwrap();
        assert!(outcome.is_duplicate());
        assert_eq!(counts(&pool, order).await, (1, 1));
    }
}
