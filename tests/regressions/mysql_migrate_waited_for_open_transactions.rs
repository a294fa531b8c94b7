//! MariaDB/MySQL: `migrate` ran `ALTER TABLE … ALTER COLUMN processed_at SET DEFAULT
//! (UTC_TIMESTAMP(6))` every time, on a table already right. Even an `ALTER` that changes
//! nothing waits for an exclusive metadata lock behind every open transaction on the
//! table, and every statement on the table queues behind it: a service starting
//! (`migrate` at start-up) beside one handler in its transaction stalled every other
//! handler's claim until that transaction ended — forever, when that handler waited on
//! one of the stalled ones (seen in CI: `mysql_swallowed_deadlock`, whose two handlers
//! meet at a barrier, hung while another test's pool migrated). The upgrade now runs only
//! when the catalog says the default is not UTC yet.

use std::time::Duration;

use dedup_runtime::{Outcome, idempotent};
use sqlx::MySqlConnection;

#[idempotent(consumer = "regress-my-migrate", key = id)]
async fn handle(tx: &mut MySqlConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    let _ = id;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_beside_an_open_transaction_stalls_no_claim() {
    let pool = dedup_suite::mysql().await;
    // A handler's transaction, open on the dedup table.
    let mut open = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES (?, ?)")
        .bind("regress-my-migrate")
        .bind(dedup_suite::unique("held"))
        .execute(&mut *open)
        .await
        .unwrap();
    // A service starting beside it.
    let migrating = {
        let pool = pool.clone();
        tokio::spawn(async move { dedup_runtime::migrate(&pool).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another handler's claim goes through while the transaction stays open.
    let id = dedup_suite::unique("claim");
    let claimed = tokio::time::timeout(Duration::from_secs(10), handle(&pool, &id)).await;
    let migrated = tokio::time::timeout(Duration::from_secs(10), migrating).await;
    open.rollback().await.unwrap();
    assert_eq!(
        claimed
            .expect("a claim beside migrate is not stalled")
            .unwrap(),
        Outcome::Processed(())
    );
    migrated
        .expect("migrate does not wait for the open transaction")
        .unwrap()
        .unwrap();
    assert_eq!(
        dedup_suite::claims(&pool, "regress-my-migrate", &id).await,
        1
    );
}
