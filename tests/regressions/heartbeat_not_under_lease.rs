//! Issue 24, item 18: `Worker::heartbeat` (and `Relay::heartbeat`) took an interval as
//! long as the lease or longer, which silently turned renewal off: every claim could run
//! out between two renewals and be taken over mid-handler. Such a heartbeat is now
//! refused, as `Prune` refuses bad values: `process_batch`, `relay_batch` and both `run`s
//! return the typed `HeartbeatNotUnderLease` before they claim anything. Checked on every
//! backend: at the lease and over it refused with nothing claimed, just under it accepted.

use std::time::Duration;

use dedup_runtime::inbox::{Inbox, InboxError, InboxHandler, InboxMessage, Incoming};
use dedup_runtime::outbox::{Cause, Outbox, OutboxError, OutboxMessage, Publisher};
use dedup_suite::{unique, unique_table};

struct Pass;

struct Discard;

impl Publisher for Discard {
    type Error = String;

    async fn publish(&self, _: &OutboxMessage) -> Result<(), String> {
        Ok(())
    }
}

const LEASE: Duration = Duration::from_secs(2);

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Pass {
                type Error = sqlx::Error;

                async fn handle(&self, _: &mut $conn, _: &InboxMessage) -> Result<(), sqlx::Error> {
                    Ok(())
                }
            }

            #[tokio::test]
            async fn a_worker_refuses_a_heartbeat_not_under_its_lease() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("regress-heartbeat");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                inbox.receive(Incoming::new("m1", b"p")).await.unwrap();
                for heartbeat in [LEASE, LEASE * 2] {
                    let worker = inbox.worker().lease(LEASE).heartbeat(heartbeat);
                    let refused = worker.process_batch(&Pass).await;
                    assert!(
                        matches!(
                            refused,
                            Err(InboxError::HeartbeatNotUnderLease { heartbeat: h, lease })
                                if h == heartbeat && lease == LEASE
                        ),
                        "{refused:?}"
                    );
                    let message = refused.unwrap_err().to_string();
                    assert!(message.contains("not shorter than its lease"), "{message}");
                    let run = worker.run(&Pass, std::future::pending()).await;
                    assert!(matches!(run, Err(InboxError::HeartbeatNotUnderLease { .. })));
                    let stats = inbox.stats().await.unwrap();
                    assert_eq!((stats.pending, stats.claimed), (1, 0), "nothing claimed");
                }
                let accepted = inbox
                    .worker()
                    .lease(LEASE)
                    .heartbeat(LEASE - Duration::from_millis(1))
                    .process_batch(&Pass)
                    .await
                    .unwrap();
                assert_eq!((accepted.claimed, accepted.processed), (1, 1));
            }

            #[tokio::test]
            async fn a_relay_refuses_a_heartbeat_not_under_its_lease() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_heartbeat");
                dedup_runtime::outbox::migrate_table(pool, &table).await.unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-heartbeat", "evt_1").unwrap();
                let message = cause.nth_outgoing(0, "events", b"p");
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &message).await.unwrap();
                tx.commit().await.unwrap();
                for heartbeat in [LEASE, LEASE * 2] {
                    let relay = outbox.relay(pool).lease(LEASE).heartbeat(heartbeat);
                    let refused = relay.relay_batch(&Discard).await;
                    assert!(
                        matches!(
                            refused,
                            Err(OutboxError::HeartbeatNotUnderLease { heartbeat: h, lease })
                                if h == heartbeat && lease == LEASE
                        ),
                        "{refused:?}"
                    );
                    let run = relay.run(&Discard, std::future::pending()).await;
                    assert!(matches!(run, Err(OutboxError::HeartbeatNotUnderLease { .. })));
                    let stats = outbox.stats(pool).await.unwrap();
                    assert_eq!((stats.unsent, stats.claimed), (1, 0), "nothing claimed");
                }
                let accepted = outbox
                    .relay(pool)
                    .lease(LEASE)
                    .heartbeat(LEASE - Duration::from_millis(1))
                    .relay_batch(&Discard)
                    .await
                    .unwrap();
                assert_eq!((accepted.claimed, accepted.sent), (1, 1));
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
