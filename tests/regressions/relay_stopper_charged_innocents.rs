//! Issue 25: the pipelined relay sends a whole claim before it marks any row, so a relay
//! stopped mid-claim (killed, cut off) left every row of it unmarked, and the take-back
//! charged the first row in the claim's order — which was not necessarily the one that
//! stopped it. A row whose send stops the relay every time (a publisher that hangs or
//! crashes on it) got the first row of its claim charged at every stop: that innocent row
//! was dead after its attempts, "the relay stopped", never sent, while the culprit went on
//! stopping relays. A row on a later attempt is now sent alone, in its place in the
//! claim's order: the innocent one charged once goes through alone the next time, and the
//! culprit, once charged, is charged only for itself and is dead after its attempts.
//!
//! The stopping relay is a task aborted while its publisher hangs on the `stop` payload;
//! its lease is ended on the database's clock. PostgreSQL, MariaDB and SQLite.

use std::sync::Arc;

use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_suite::unique_table;
use tokio::sync::Notify;

/// Sends everything but a `stop` payload, on which it hangs (its relay is aborted there).
struct Stopping {
    hung: Arc<Notify>,
}

impl Publisher for Stopping {
    type Error = String;

    async fn publish(&self, message: &OutboxMessage) -> Result<(), String> {
        if message.payload() == b"stop" {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

macro_rules! backend {
    ($backend:ident, db = $db:ty, pool = $pool:expr, state = $state:literal, expire = $expire:literal) => {
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_that_stops_its_relay_is_dead_and_the_rows_before_it_are_sent() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_stopper");
                dedup_runtime::outbox::migrate_table(pool, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-stopper", "evt").unwrap();
                let payloads: [&[u8]; 4] = [b"a", b"b", b"stop", b"c"];
                let mut tx = pool.begin().await.unwrap();
                let mut ids = Vec::new();
                for (slot, payload) in payloads.iter().enumerate() {
                    let message = cause.nth_outgoing(slot as u32, "events", payload);
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();
                let state = |id: dedup_runtime::outbox::OutgoingId| {
                    let sql = format!($state, table);
                    async move {
                        sqlx::query_as::<_, (i64, i64)>(sqlx::AssertSqlSafe(sql))
                            .bind(id.to_string())
                            .fetch_one(pool)
                            .await
                            .unwrap()
                    }
                };
                // Relays until one finishes its claim without stopping: each stopped one
                // is aborted in its hang, its lease ended for the next to take back.
                let mut stops = 0;
                loop {
                    let hung = Arc::new(Notify::new());
                    let mut task = tokio::spawn({
                        let (pool, outbox, hung) = ((*db).clone(), outbox.clone(), hung.clone());
                        async move {
                            let relay = outbox.relay(&pool).max_attempts(2).batch(4);
                            relay.relay_batch(&Stopping { hung }).await
                        }
                    });
                    let finished =
                        tokio::time::timeout(std::time::Duration::from_secs(15), async {
                            tokio::select! {
                                () = hung.notified() => false,
                                done = &mut task => {
                                    done.unwrap().unwrap();
                                    true
                                }
                            }
                        })
                        .await
                        .expect("the relay stops in its hang or finishes");
                    if finished {
                        break;
                    }
                    task.abort();
                    let _ = task.await;
                    stops += 1;
                    assert!(stops <= 6, "still stopping after {stops} stops");
                    let expire = format!($expire, table);
                    sqlx::query(sqlx::AssertSqlSafe(expire))
                        .execute(pool)
                        .await
                        .unwrap();
                }
                // a, b, then the stopping row charged once each; the stopping row alone
                // once more, and buried by the take-back of the relay that finished.
                assert_eq!(stops, 4, "one stop per charge");
                assert_eq!(
                    state(ids[2]).await,
                    (3, 2),
                    "the stopping row: dead after 2 attempts"
                );
                for (id, name) in [(ids[0], "a"), (ids[1], "b"), (ids[3], "c")] {
                    assert_eq!(state(id).await.0, 2, "{name}: sent, not dead");
                }
            }
        }
    };
}

backend!(
    postgres,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    state = "SELECT state::int8, attempts::int8 FROM {} WHERE id = $1::uuid",
    expire = "UPDATE {} SET lease_until = clock_timestamp() - interval '1 second' WHERE state = 1"
);
backend!(
    mysql,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED) FROM {} \
             WHERE id = UNHEX(REPLACE(?, '-', ''))",
    expire = "UPDATE {} SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE state = 1"
);
backend!(
    sqlite,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    state = "SELECT state, attempts FROM {} WHERE id = unhex(replace(?1, '-', ''))",
    expire = "UPDATE {} SET lease_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE state = 1"
);
