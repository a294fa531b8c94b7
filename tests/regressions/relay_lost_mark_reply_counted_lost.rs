//! Issue 39, item 7: when the server committed the relay's mark (`sent`) and its reply
//! was lost, the mark tried again found no row still claimed, and the relay reported its
//! own rows as `lost` — "another relay's" — in `Relayed` and in
//! `dedup_outbox_relayed_total{outcome="lost"}`, though the rows were right. A sent row
//! now keeps its claim's owner token, and a mark tried again counts the rows sent under
//! it. The fault is real: a TCP proxy between the pool and the server (PostgreSQL,
//! MariaDB) lets the mark's execution through and loses its reply. SQLite has no network to lose a
//! reply on.

use std::sync::Mutex;

use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_suite::fault::{Fault, FaultProxy};
use dedup_suite::unique_table;

/// Records what it sends.
#[derive(Default)]
struct Recorder(Mutex<Vec<Vec<u8>>>);

impl Publisher for Recorder {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        self.0.lock().unwrap().push(message.payload().to_vec());
        Ok(())
    }
}

/// The text of the mark's statement on every backend.
const MARK: &[u8] = b"SET state = 2, sent_at";

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, url = $url:expr, state = $state:literal) => {
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_mark_whose_reply_was_lost_counts_its_rows_sent() {
                let db = $pool;
                let direct: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_lost_mark");
                dedup_runtime::outbox::migrate_table(direct, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-lost-mark", "evt").unwrap();
                let mut tx = direct.begin().await.unwrap();
                let mut ids = Vec::new();
                for slot in 0..3 {
                    let message = cause.nth_outgoing(slot, "events", b"payload");
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();

                let proxy = FaultProxy::in_front_of(&$url).await;
                let pool = sqlx::pool::PoolOptions::<$db>::new()
                    .max_connections(2)
                    .connect(&proxy.url(&$url))
                    .await
                    .unwrap();
                let recorder = Recorder::default();
                proxy.arm(Fault::LoseExecutionReply(MARK.to_vec()));
                let relayed = outbox
                    .relay(&pool)
                    .batch(3)
                    .relay_batch(&recorder)
                    .await
                    .expect("the mark is tried again");
                assert_eq!(proxy.fired(), 1, "the mark's reply was lost");
                assert_eq!(
                    (relayed.claimed, relayed.sent, relayed.lost, relayed.failed),
                    (3, 3, 0, 0),
                    "its own rows, marked by the try whose reply was lost: sent, not lost"
                );
                assert_eq!(recorder.0.lock().unwrap().len(), 3, "each sent once");
                for id in ids {
                    let sql = format!($state, table);
                    let state: (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                        .bind(id.to_string())
                        .fetch_one(direct)
                        .await
                        .unwrap();
                    assert_eq!(state, (2, 1), "{id}: sent at its first attempt");
                }
                // Nothing left for a second relay to send.
                let again = outbox.relay(direct).relay_batch(&recorder).await.unwrap();
                assert_eq!(again.claimed, 0);
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    url = dedup_suite::postgres_url(),
    state = "SELECT state::int8, attempts::int8 FROM {} WHERE id = $1::uuid"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    url = dedup_suite::mysql_url(),
    state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED) FROM {} \
             WHERE id = UNHEX(REPLACE(?, '-', ''))"
);
