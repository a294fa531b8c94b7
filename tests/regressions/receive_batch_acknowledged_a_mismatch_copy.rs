//! Issue 39, item 3: with fingerprints on and id X stored with payload A,
//! `receive_batch([X with B, X with B])` answered `[Err(FingerprintMismatch),
//! Ok(DuplicateInBatch { first: 0 })]`: the second copy was "received" (a consumer
//! acknowledges it) while `receive` of the same copy is refused. Every copy of an id
//! refused for its stored fingerprint is refused. Checked on every backend, with the
//! copies adjacent and apart, and with the stored row pending and processed; the inbox
//! keeps payload A (nothing of B is stored).

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming, Received, Refused};
use dedup_runtime::{Fingerprint, fingerprint};
use dedup_suite::unique;

/// Processes every message, writing nothing.
struct Done;

/// The mismatch an answer carries; panics on any other answer.
fn mismatch(answer: &Result<Received, Refused>) -> (Fingerprint, Fingerprint) {
    match answer {
        Err(Refused::FingerprintMismatch(mismatch)) => (mismatch.stored(), mismatch.received()),
        other => panic!("a copy with another payload was not refused: {other:?}"),
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Done {
                type Error = sqlx::Error;

                async fn handle(&self, _: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    Ok(())
                }
            }

            #[tokio::test]
            async fn every_copy_of_a_mismatching_id_is_refused() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                for processed in [false, true] {
                    let consumer = unique("regress-batch-mismatch");
                    let inbox = Inbox::new(pool, &consumer).unwrap().fingerprints(true);
                    let id = unique("reused");
                    let other = unique("fresh");
                    assert_eq!(
                        inbox.receive(Incoming::new(&id, b"A")).await.unwrap(),
                        Received::Stored
                    );
                    if processed {
                        let done = inbox.worker().process_batch(&Done).await.unwrap();
                        assert_eq!(done.processed, 1);
                    }
                    let expected = (fingerprint(b"A"), fingerprint(b"B"));
                    // Adjacent copies, then copies with another message between them.
                    let adjacent = [Incoming::new(&id, b"B"), Incoming::new(&id, b"B")];
                    let answers = inbox.receive_batch(&adjacent).await.unwrap();
                    assert_eq!(mismatch(&answers[0]), expected, "processed: {processed}");
                    assert_eq!(mismatch(&answers[1]), expected, "processed: {processed}");
                    let apart = [
                        Incoming::new(&id, b"B"),
                        Incoming::new(&other, b"C"),
                        Incoming::new(&id, b"B"),
                    ];
                    let answers = inbox.receive_batch(&apart).await.unwrap();
                    assert_eq!(mismatch(&answers[0]), expected);
                    assert_eq!(answers[1], Ok(Received::Stored));
                    assert_eq!(mismatch(&answers[2]), expected);
                    // What `receive` says of the same copy.
                    assert!(inbox.receive(Incoming::new(&id, b"B")).await.is_err());
                    // The identical copy is still a duplicate, in a batch as alone.
                    let same = [Incoming::new(&id, b"A"), Incoming::new(&id, b"A")];
                    assert_eq!(
                        inbox.receive_batch(&same).await.unwrap(),
                        [
                            Ok(Received::Duplicate),
                            Ok(Received::DuplicateInBatch { first: 0 })
                        ]
                    );
                    // Two rows: the reused id (processed or not, as it was) and the other.
                    let stats = inbox.stats().await.unwrap();
                    let reused = if processed { (1, 1) } else { (2, 0) };
                    assert_eq!((stats.pending, stats.processed), reused);
                }
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
