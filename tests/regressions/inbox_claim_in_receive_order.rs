//! Issue 24, item 11: a PostgreSQL worker returned its claim in the order `UPDATE …
//! RETURNING` produced its rows, which follows where the rows lie in the table, not the
//! order they were received; SQLite's `RETURNING` promises no order either. MariaDB
//! sorted. A worker processes its claim in the claim's order: due time, then receive
//! order. Checked on every backend after the first rows' tuples were moved (updated, so
//! that their new versions lie after the later rows).

use std::sync::Mutex;
use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_suite::{unique, unique_table};

const ROWS: usize = 40;

/// Records the ids it is given, in the order it is given them.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, touch = $touch:literal) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Recorder {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    _: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), sqlx::Error> {
                    self.0.lock().unwrap().push(message.id().to_owned());
                    Ok(())
                }
            }

            #[tokio::test]
            async fn a_claim_is_processed_in_receive_order() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_claim_order");
                dedup_runtime::inbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let consumer = unique("regress-claim-order");
                let inbox = Inbox::new(pool, &consumer)
                    .unwrap()
                    .in_table(&table)
                    .unwrap();
                let ids: Vec<String> = (0..ROWS).map(|n| format!("m{n:02}")).collect();
                for id in &ids {
                    inbox.receive(Incoming::new(id, b"p")).await.unwrap();
                }
                // Move the first half's tuples past the second half's (a pending row's
                // last error is rewritten; nothing a claim reads changes).
                for id in ids.iter().take(ROWS / 2).rev() {
                    sqlx::query(sqlx::AssertSqlSafe(format!($touch, table)))
                        .bind(&consumer)
                        .bind(id)
                        .execute(pool)
                        .await
                        .unwrap();
                }
                let recorder = Recorder::default();
                let batch = inbox
                    .worker()
                    .batch(ROWS as u32)
                    .backoff(Duration::ZERO, Duration::ZERO)
                    .process_batch(&recorder)
                    .await
                    .unwrap();
                assert_eq!((batch.claimed, batch.processed), (ROWS, ROWS));
                assert_eq!(
                    *recorder.0.lock().unwrap(),
                    ids,
                    "processed in receive order"
                );
                assert_eq!(inbox.stats().await.unwrap().processed, ROWS as u64);
            }

            /// Received in one batch, in an order that is not the ids' order: processed in
            /// the batch's order (the batch insert may store rows in another order, to
            /// avoid deadlocks, but receive order is the batch's).
            #[tokio::test]
            async fn a_batch_is_processed_in_the_batch_s_order() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-batch-order");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let mut ids: Vec<String> = (0..ROWS).map(|n| format!("m{n:02}")).collect();
                dedup_suite::Shuffle::new(11).shuffle(&mut ids);
                let messages: Vec<Incoming<'_>> =
                    ids.iter().map(|id| Incoming::new(id, b"p")).collect();
                inbox.receive_batch(&messages).await.unwrap();
                let recorder = Recorder::default();
                let batch = inbox
                    .worker()
                    .batch(ROWS as u32)
                    .process_batch(&recorder)
                    .await
                    .unwrap();
                assert_eq!(batch.processed, ROWS);
                assert_eq!(
                    *recorder.0.lock().unwrap(),
                    ids,
                    "processed in the batch's order"
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
    touch = "UPDATE {} SET last_error = 'moved' WHERE consumer = $1 AND message_id = $2"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    touch = "UPDATE {} SET last_error = 'moved' WHERE consumer = ? AND message_id = ?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await,
    touch = "UPDATE {} SET last_error = 'moved' WHERE consumer = ?1 AND message_id = ?2"
);
