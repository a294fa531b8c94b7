//! Issue 24, item 6: MariaDB's `Inbox::receive_batch` split a batch by rows only, so 20
//! messages of 1 MiB (each within the inbox's default limit) made one statement over the
//! server's `max_allowed_packet` (16 MiB): the connection was reset, nothing stored, and
//! every redelivery failed the same way. The MySQL insert now reads the server's
//! `max_allowed_packet` when a batch is large and sends it in groups under it. Checked on
//! every backend: 20 messages of exactly the default payload limit are stored whole, a
//! redelivery of the batch is all duplicates, and each row holds its payload byte for byte.

use dedup_runtime::inbox::{DEFAULT_MAX_PAYLOAD_LEN, Inbox, Incoming, Received};
use dedup_suite::unique;

const MESSAGES: usize = 20;

fn payload(n: usize) -> Vec<u8> {
    (0..DEFAULT_MAX_PAYLOAD_LEN)
        .map(|i| (i.wrapping_mul(31) ^ n) as u8)
        .collect()
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, read = $read:literal) => {
        mod $backend {
            use super::*;

            #[tokio::test]
            async fn twenty_messages_of_a_mebibyte_are_stored_whole() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-packet");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let ids: Vec<String> = (0..MESSAGES).map(|n| format!("big-{n:02}")).collect();
                let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(payload).collect();
                let messages: Vec<Incoming<'_>> = ids
                    .iter()
                    .zip(&payloads)
                    .map(|(id, payload)| Incoming::new(id, payload))
                    .collect();
                let answers = inbox
                    .receive_batch(&messages)
                    .await
                    .expect("stored, in groups");
                assert!(
                    answers.iter().all(|answer| *answer == Ok(Received::Stored)),
                    "{answers:?}"
                );
                let again = inbox
                    .receive_batch(&messages)
                    .await
                    .expect("the redelivery");
                assert!(
                    again
                        .iter()
                        .all(|answer| *answer == Ok(Received::Duplicate)),
                    "{again:?}"
                );
                for (id, expected) in ids.iter().zip(&payloads) {
                    let stored: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe($read.to_owned()))
                        .bind(&consumer)
                        .bind(id)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                    assert!(stored == *expected, "{id}: {} bytes stored", stored.len());
                }
                assert_eq!(inbox.stats().await.unwrap().pending, MESSAGES as u64);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    read = "SELECT payload FROM inbox_messages WHERE consumer = $1 AND message_id = $2"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    read = "SELECT payload FROM inbox_messages WHERE consumer = ? AND message_id = ?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    read = "SELECT payload FROM inbox_messages WHERE consumer = ?1 AND message_id = ?2"
);
