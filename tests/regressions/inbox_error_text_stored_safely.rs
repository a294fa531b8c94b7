//! Issue 24, item 8: the inbox and the outbox stored a handler's (or a publisher's) error
//! text in `last_error` as it came: a NUL byte made PostgreSQL refuse the failure's own
//! statement (22021), and a 1 MB text overflowed MySQL's `TEXT` (65,535 bytes) — the
//! failure was never recorded and the message stayed claimed. The text is now stored with
//! NUL bytes replaced (U+FFFD) and cut at a character boundary past 4 KiB, with a marker
//! that says how long it was. Checked on every backend through the dead row's text.

use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming};
use dedup_suite::unique;

/// Fails every message with a text no one should store as it is.
struct Hostile;

fn hostile_text() -> String {
    format!("bad\0text {}", "é".repeat(500_000)) // a NUL byte, 1 MB, two-byte chars
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Hostile {
                type Error = sqlx::Error;

                async fn handle(&self, _: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    Err(sqlx::Error::Protocol(hostile_text()))
                }
            }

            #[tokio::test]
            async fn a_nul_byte_and_a_megabyte_of_error_text_are_recorded() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-error-text");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                inbox.receive(Incoming::new("m1", b"p")).await.unwrap();
                let batch = inbox
                    .worker()
                    .max_attempts(1)
                    .backoff(Duration::ZERO, Duration::ZERO)
                    .process_batch(&Hostile)
                    .await
                    .expect("the failure is recorded");
                assert_eq!((batch.claimed, batch.dead), (1, 1));
                let dead = inbox.dead(10).await.unwrap();
                assert_eq!(dead.len(), 1);
                let text = dead[0].last_error.clone().expect("a last error");
                assert!(!text.contains('\0'), "no NUL byte stored");
                assert!(text.contains("bad\u{FFFD}text"), "{}", &text[..40]);
                assert!(text.len() < 4200, "{} bytes", text.len());
                // The error's whole text (its Display, with sqlx's prefix) was longer.
                let tail = &text[text.rfind(" [cut: ").expect("the marker")..];
                let full: usize = tail[7..tail.len() - " bytes in all]".len()]
                    .parse()
                    .unwrap();
                assert!(full > hostile_text().len(), "{tail}");
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await)
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await)
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    conn = sqlx::SqliteConnection,
    pool = dedup_suite::sqlite().await
);
