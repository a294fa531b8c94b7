//! Issue 24, item 4 — MariaDB: headers of exactly `MAX_HEADERS_LEN` (65,536 bytes) did not
//! fit the inbox's and the outbox's `headers BLOB` column (65,535 bytes): on a strict
//! server an untyped error 1406 on every attempt, with `sql_mode = ''` the row stored
//! with its last byte cut (and the relay forwarded the truncated headers). The column is
//! `MEDIUMBLOB` now, and `migrate` widens a table made before. Checked at exactly the
//! limit and one over, strict and with `sql_mode = ''`, on a table upgraded from `BLOB`.

use dedup_runtime::inbox::{Inbox, InboxError, Incoming, MAX_HEADERS_LEN, Refused};
use dedup_runtime::outbox::{self, Cause, Outbox, OutboxError};
use dedup_suite::{unique, unique_table};
use sqlx::AssertSqlSafe;
use sqlx::mysql::MySqlPool;

async fn length(pool: &MySqlPool, sql: String, key: &str) -> Option<i64> {
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Makes `table`'s `headers` the `BLOB` an earlier release created, then migrates it again.
async fn downgrade_then_migrate(pool: &MySqlPool, table: &str, inbox: bool) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {table} MODIFY headers BLOB NULL"
    )))
    .execute(pool)
    .await
    .unwrap();
    if inbox {
        dedup_runtime::inbox::migrate_table(pool, table)
            .await
            .unwrap();
    } else {
        outbox::migrate_table(pool, table).await.unwrap();
    }
    let data_type: String = sqlx::query_scalar(
        "SELECT CAST(DATA_TYPE AS CHAR) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'headers'",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(data_type, "mediumblob", "{table}");
}

#[tokio::test]
async fn inbox_headers_at_the_limit_are_stored_whole() {
    let strict = dedup_suite::mysql().await;
    let table = unique_table("regress_headers_inbox");
    dedup_runtime::inbox::migrate_table(&strict, &table)
        .await
        .unwrap();
    downgrade_then_migrate(&strict, &table, true).await;
    let lenient = dedup_suite::mysql_lenient().await;
    let at = vec![b'h'; MAX_HEADERS_LEN];
    let over = vec![b'h'; MAX_HEADERS_LEN + 1];
    for (mode, pool) in [("strict", &strict), ("sql_mode=''", &lenient)] {
        let consumer = unique("regress-headers");
        let inbox = Inbox::new(pool, &consumer)
            .unwrap()
            .in_table(&table)
            .unwrap();
        inbox
            .receive(Incoming::new("at", b"p").headers(&at))
            .await
            .unwrap_or_else(|error| panic!("{mode}: {error}"));
        let sql =
            format!("SELECT LENGTH(headers) FROM {table} WHERE consumer = ? AND message_id = 'at'");
        assert_eq!(
            length(pool, sql, &consumer).await,
            Some(MAX_HEADERS_LEN as i64),
            "{mode}"
        );
        let refused = inbox
            .receive(Incoming::new("over", b"p").headers(&over))
            .await
            .unwrap_err();
        assert!(
            matches!(
                refused,
                InboxError::Refused(Refused::HeadersTooLarge { .. })
            ),
            "{mode}: {refused:?}"
        );
    }
}

#[tokio::test]
async fn outbox_headers_at_the_limit_are_stored_whole() {
    let strict = dedup_suite::mysql().await;
    let table = unique_table("regress_headers_outbox");
    outbox::migrate_table(&strict, &table).await.unwrap();
    downgrade_then_migrate(&strict, &table, false).await;
    let lenient = dedup_suite::mysql_lenient().await;
    // One header `h`: 1 + 1 + 4 bytes and its value, as the row keeps it.
    let at = vec![b'h'; MAX_HEADERS_LEN - 6];
    let over = vec![b'h'; MAX_HEADERS_LEN - 5];
    let outbox = Outbox::new().in_table(&table).unwrap();
    for (mode, pool) in [("strict", &strict), ("sql_mode=''", &lenient)] {
        let consumer = unique("regress-headers");
        let cause = Cause::new(&consumer, "evt_1").unwrap();
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(
                &mut *tx,
                &cause.nth_outgoing(0, "invoices", b"p").header("h", &at),
            )
            .await
            .unwrap_or_else(|error| panic!("{mode}: {error}"));
        let refused = outbox
            .enqueue(
                &mut *tx,
                &cause.nth_outgoing(1, "invoices", b"p").header("h", &over),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(refused, OutboxError::Refused(_)),
            "{mode}: {refused:?}"
        );
        tx.commit().await.unwrap();
        let sql = format!("SELECT LENGTH(headers) FROM {table} WHERE consumer = ?");
        assert_eq!(
            length(pool, sql, &consumer).await,
            Some(MAX_HEADERS_LEN as i64),
            "{mode}"
        );
    }
}
