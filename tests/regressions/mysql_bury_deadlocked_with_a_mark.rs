//! MariaDB/MySQL: a claim deadlocked with another worker's mark under load, and the
//! worker's `process_batch` failed (CI: `four_workers_process_each_message_exactly_once`,
//! 1213 after the claim's retries).
//!
//! The claim first buries the rows whose worker stopped during their last attempt, with
//! an `UPDATE … WHERE state = 1 AND lease_until <= now …`. InnoDB ran it through the state
//! index: it locked a claimed row's index entry, then waited for the row, which a
//! worker's mark held — and the mark, which moves the row's entry in that index, waited
//! for the entry. The lease renewal and the release (`WHERE state = 1 AND owner = …`) and
//! the outbox relay's bury, renewal and release had the same shape. They now find their
//! rows by a plain read and update them by primary key, so they never wait for a row they
//! do not change.
//!
//! The mark is played here by a transaction that holds a claimed row's lock, as the mark
//! does; the sessions of the pool under test give up a lock wait after 1 s, so a
//! statement that waits for that row fails (1205) instead of deadlocking later.

use dedup_runtime::inbox::{Inbox, Incoming};
use dedup_runtime::outbox::{Cause, OutboxMessage, Publisher};
use sqlx::Executor as _;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use tokio::sync::Notify;

/// A pool whose sessions wait at most 1 s for a row lock.
async fn impatient() -> MySqlPool {
    dedup_suite::mysql().await;
    MySqlPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                    .await?;
                Ok(())
            })
        })
        .connect(&dedup_suite::mysql_url())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_claims_renewals_and_releases_never_wait_for_another_worker_s_row() {
    let pool = impatient().await;
    let table = dedup_suite::unique_table("regress_bury_inbox");
    dedup_runtime::inbox::migrate_table(&pool, &table)
        .await
        .unwrap();
    let inbox = Inbox::new(&pool, "regress-bury")
        .unwrap()
        .in_table(&table)
        .unwrap();
    inbox
        .receive_batch(&[
            Incoming::new("marked", b"p"),
            Incoming::new("other", b"p"),
            Incoming::new("left", b"p"),
        ])
        .await
        .unwrap();
    let first = inbox.worker().batch(1);
    let second = inbox.worker().batch(1);
    let marking = first.claim().await.unwrap();
    let others = second.claim().await.unwrap();
    assert_eq!(marking.messages()[0].id(), "marked");
    assert_eq!(others.messages()[0].id(), "other");

    // The first worker's mark, in flight: its row locked.
    let mut mark = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE consumer = ? AND message_id = ? FOR UPDATE"
    )))
    .bind("regress-bury")
    .bind("marked")
    .execute(&mut *mark)
    .await
    .unwrap();

    assert_eq!(second.renew(&others).await.unwrap(), 1, "renewed");
    let third = inbox.worker().batch(3).claim().await.unwrap();
    let claimed: Vec<&str> = third.messages().iter().map(|m| m.id()).collect();
    assert_eq!(claimed, ["left"], "the pending row, past the held one");
    assert_eq!(third.buried(), 0);
    assert_eq!(second.release(&others).await.unwrap(), 1, "released");

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET state = 2, processed_at = UTC_TIMESTAMP(6), lease_until = NULL \
         WHERE consumer = ? AND message_id = ? AND state = 1"
    )))
    .bind("regress-bury")
    .bind("marked")
    .execute(&mut *mark)
    .await
    .unwrap();
    mark.commit().await.unwrap();
    let states: Vec<(String, i8)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(message_id AS CHAR), state FROM {table} ORDER BY message_id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        [
            ("left".to_owned(), 1),
            ("marked".to_owned(), 2),
            ("other".to_owned(), 0)
        ]
    );
}

/// Holds every publish until the test lets it go.
struct Held(Notify, Notify);

impl Publisher for Held {
    type Error = String;

    async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
        self.0.notify_one();
        self.1.notified().await;
        Ok(())
    }
}

/// Publishes at once.
struct Quick;

impl Publisher for Quick {
    type Error = String;

    async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_s_claim_never_waits_for_another_relay_s_row() {
    let pool = impatient().await;
    let table = dedup_suite::unique_table("regress_bury_outbox");
    dedup_runtime::outbox::migrate_table(&pool, &table)
        .await
        .unwrap();
    let outbox = dedup_runtime::outbox::Outbox::new()
        .in_table(&table)
        .unwrap();
    let cause = Cause::new("regress-bury", "evt_1").unwrap();
    let mut tx = pool.begin().await.unwrap();
    for slot in ["sent", "next"] {
        let message = cause.outgoing(slot, "events", b"p").unwrap();
        outbox.enqueue(&mut *tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let sent = cause.id("sent").unwrap();

    // One relay has claimed `sent` and is publishing it.
    let held = std::sync::Arc::new(Held(Notify::new(), Notify::new()));
    let publishing = tokio::spawn({
        let (pool, held, outbox) = (pool.clone(), held.clone(), outbox.clone());
        async move { outbox.relay(&pool).batch(1).relay_batch(&*held).await }
    });
    held.0.notified().await;
    // Its sent mark, in flight: the row locked.
    let mut mark = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE id = ? FOR UPDATE"
    )))
    .bind(&sent.as_uuid().as_bytes()[..])
    .execute(&mut *mark)
    .await
    .unwrap();

    // Another relay claims past it (its bury first).
    let relayed = outbox.relay(&pool).batch(2).relay_batch(&Quick).await;
    assert_eq!(
        relayed
            .map(|relayed| (relayed.claimed, relayed.sent))
            .map_err(|error| error.to_string()),
        Ok((1, 1)),
        "the unsent row, past the held one"
    );

    mark.rollback().await.unwrap();
    held.1.notify_one();
    let relayed = publishing.await.unwrap().unwrap();
    assert_eq!((relayed.claimed, relayed.sent), (1, 1), "{relayed:?}");
    let unsent: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {table} WHERE state <> 2"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unsent, 0);
}
