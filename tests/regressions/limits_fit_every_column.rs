//! Issue 24, item 4, the audit: after the MariaDB headers (a `BLOB` one byte short of the
//! limit, `mysql_headers_at_the_limit`), every other documented limit of the inbox and
//! the outbox, checked against each backend's column at exactly the limit and one over:
//! the consumer, message id and ordering key (255 bytes, made of two-byte characters
//! where the bytes could be miscounted as characters), the outbox's slot and destination
//! (255 bytes), and the payload at `MAX_PAYLOAD_LEN` (8 MiB). At the limit each is stored
//! whole (its length read back from the database); one over, each is refused with its
//! typed error before anything is written. On MariaDB also with `sql_mode = ''`, where a
//! column too narrow would cut the value silently instead of refusing it.

use dedup_runtime::inbox::{self, Inbox, InboxError, Incoming, Refused};
use dedup_runtime::outbox::{self, Cause, InvalidCause, MAX_NAME_LEN, Outbox, OutboxError};
use dedup_runtime::{MAX_CONSUMER_LEN, MAX_MESSAGE_ID_LEN};
use dedup_suite::{unique, unique_table};

/// `len` bytes: two-byte characters, and an ASCII letter first when `len` is odd.
fn text(len: usize) -> String {
    let mut text = if len % 2 == 1 {
        String::from("a")
    } else {
        String::new()
    };
    text.push_str(&"é".repeat(len / 2));
    assert_eq!(text.len(), len);
    text
}

/// `prefix` followed by two-byte characters up to `len` bytes.
fn named(prefix: &str, len: usize) -> String {
    let mut name = prefix.to_owned();
    name.push_str(&text(len - prefix.len()));
    name
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, length = $length:literal, p = $p:literal) => {
        mod $backend {
            use super::*;

            /// The database's own byte length of `column` in the row `key_column = key`.
            async fn length(
                pool: &sqlx::Pool<$db>,
                table: &str,
                column: &str,
                key_column: &str,
                key: &str,
            ) -> i64 {
                let sql = format!(
                    "SELECT {} FROM {table} WHERE {key_column} = {}",
                    format!($length, column),
                    $p
                );
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .bind(key)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            #[tokio::test]
            async fn inbox_limits_at_the_limit_and_one_over() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_limits_inbox");
                inbox::migrate_table(pool, &table).await.unwrap();
                let consumer = named(&unique("lim"), MAX_CONSUMER_LEN);
                assert!(Inbox::new(pool, &named(&unique("lim"), MAX_CONSUMER_LEN + 1)).is_err());
                let inbox = Inbox::new(pool, &consumer)
                    .unwrap()
                    .in_table(&table)
                    .unwrap()
                    .max_payload_len(inbox::MAX_PAYLOAD_LEN);
                let id = text(MAX_MESSAGE_ID_LEN);
                let key = named("k", MAX_MESSAGE_ID_LEN);
                let payload = vec![7u8; inbox::MAX_PAYLOAD_LEN];
                inbox
                    .receive(Incoming::new(&id, &payload).ordering_key(&key))
                    .await
                    .unwrap();
                for (column, expected) in [
                    ("consumer", MAX_CONSUMER_LEN),
                    ("message_id", MAX_MESSAGE_ID_LEN),
                    ("ordering_key", MAX_MESSAGE_ID_LEN),
                    ("payload", inbox::MAX_PAYLOAD_LEN),
                ] {
                    assert_eq!(
                        length(pool, &table, column, "consumer", &consumer).await,
                        expected as i64,
                        "{column} stored whole"
                    );
                }
                let over_id = text(MAX_MESSAGE_ID_LEN + 1);
                let refused = inbox
                    .receive(Incoming::new(&over_id, b"p"))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(refused, InboxError::Refused(Refused::InvalidMessageId(_))),
                    "{refused:?}"
                );
                let over_key = named("k", MAX_MESSAGE_ID_LEN + 1);
                let refused = inbox
                    .receive(Incoming::new("other", b"p").ordering_key(&over_key))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(refused, InboxError::Refused(Refused::InvalidOrderingKey(_))),
                    "{refused:?}"
                );
                let over_payload = vec![7u8; inbox::MAX_PAYLOAD_LEN + 1];
                let refused = inbox
                    .receive(Incoming::new("other", &over_payload))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(
                        refused,
                        InboxError::Refused(Refused::PayloadTooLarge { .. })
                    ),
                    "{refused:?}"
                );
                assert_eq!(
                    inbox.stats().await.unwrap().pending,
                    1,
                    "nothing of the refused ones"
                );
            }

            #[tokio::test]
            async fn outbox_limits_at_the_limit_and_one_over() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_limits_outbox");
                outbox::migrate_table(pool, &table).await.unwrap();
                let outbox = Outbox::new()
                    .in_table(&table)
                    .unwrap()
                    .max_payload_len(outbox::MAX_PAYLOAD_LEN);
                let consumer = named(&unique("lim"), MAX_CONSUMER_LEN);
                let incoming = text(MAX_MESSAGE_ID_LEN);
                let cause = Cause::new(&consumer, incoming.as_str()).unwrap();
                assert!(matches!(
                    Cause::new(&consumer, text(MAX_MESSAGE_ID_LEN + 1).as_str()),
                    Err(InvalidCause::MessageId(_))
                ));
                let slot = text(MAX_NAME_LEN);
                let destination = named("d", MAX_NAME_LEN);
                let key = named("k", MAX_NAME_LEN);
                let payload = vec![9u8; outbox::MAX_PAYLOAD_LEN];
                let message = cause
                    .outgoing(&slot, &destination, &payload)
                    .unwrap()
                    .ordering_key(&key);
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &message).await.unwrap();
                tx.commit().await.unwrap();
                for (column, expected) in [
                    ("cause_id", MAX_MESSAGE_ID_LEN),
                    ("slot", MAX_NAME_LEN),
                    ("destination", MAX_NAME_LEN),
                    ("ordering_key", MAX_NAME_LEN),
                    ("payload", outbox::MAX_PAYLOAD_LEN),
                ] {
                    assert_eq!(
                        length(pool, &table, column, "consumer", &consumer).await,
                        expected as i64,
                        "{column} stored whole"
                    );
                }
                assert!(
                    cause.outgoing(&text(MAX_NAME_LEN + 1), "d", b"p").is_err(),
                    "slot one over"
                );
                let over_destination = named("d", MAX_NAME_LEN + 1);
                let over_key = named("k", MAX_NAME_LEN + 1);
                let over_payload = vec![9u8; outbox::MAX_PAYLOAD_LEN + 1];
                let refusals = [
                    cause.nth_outgoing(1, &over_destination, b"p"),
                    cause.nth_outgoing(2, "d", b"p").ordering_key(&over_key),
                    cause.nth_outgoing(3, "d", &over_payload),
                ];
                let mut tx = pool.begin().await.unwrap();
                for refused in &refusals {
                    let error = outbox.enqueue(&mut *tx, refused).await.unwrap_err();
                    assert!(matches!(error, OutboxError::Refused(_)), "{error:?}");
                }
                tx.commit().await.unwrap();
                assert_eq!(
                    outbox.stats(pool).await.unwrap().unsent,
                    1,
                    "nothing of the refused ones"
                );
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    length = "octet_length({})::int8",
    p = "$1"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    length = "CAST(LENGTH({}) AS SIGNED)",
    p = "?"
);
backend!(
    mysql_lenient,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql_lenient().await),
    length = "CAST(LENGTH({}) AS SIGNED)",
    p = "?"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    length = "length(CAST({} AS BLOB))",
    p = "?1"
);
