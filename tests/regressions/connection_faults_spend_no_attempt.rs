//! Issue 24, item 5: connection faults used up messages' attempts. A claim whose reply
//! was lost (the connection cut after the server ran it) ended the call with an error and
//! left its rows held, their attempt counted, under an owner nobody had; a connection
//! cut under the worker's own `COMMIT` counted as the message's failure. Now a claim is
//! tried again after a lost connection under the same owner token and finds the rows it
//! took (their attempt counted once), and the worker runs a transaction cut by the
//! network again within its claim, as it does after a deadlock.
//!
//! The faults are real: a TCP proxy between the pool and the server (PostgreSQL, MariaDB)
//! loses the claim's reply after the server ran and committed it, or cuts the connection
//! as the worker's `COMMIT` goes out.

use std::sync::Mutex;

use dedup_runtime::inbox::{Inbox, InboxHandler, InboxMessage, Incoming, Processed};
use dedup_runtime::outbox::{Cause, Outbox, OutboxMessage, Publisher};
use dedup_suite::fault::{Fault, FaultProxy};
use dedup_suite::{unique, unique_table};

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

/// Writes one effect row per message, in the worker's transaction.
struct Effects;

macro_rules! backend {
    ($backend:ident, db = $db:ty, conn = $conn:ty, pool = $pool:expr, url = $url:expr,
     lose_claim = $lose_claim:expr, commit = $commit:expr,
     effects = $effects:literal, effect = $effect:literal, count = $count:literal,
     inbox_state = $inbox_state:literal, outbox_state = $outbox_state:literal) => {
        mod $backend {
            use super::*;

            impl InboxHandler<$db> for Effects {
                type Error = sqlx::Error;

                async fn handle(
                    &self,
                    tx: &mut $conn,
                    message: &InboxMessage,
                ) -> Result<(), sqlx::Error> {
                    sqlx::query($effect)
                        .bind(message.id())
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                }
            }

            /// A pool of 4 through a fresh proxy to the server.
            async fn through_proxy() -> (FaultProxy, sqlx::Pool<$db>) {
                let proxy = FaultProxy::in_front_of(&$url).await;
                let pool = sqlx::pool::PoolOptions::<$db>::new()
                    .max_connections(4)
                    .connect(&proxy.url(&$url))
                    .await
                    .unwrap();
                (proxy, pool)
            }

            async fn inbox_row(
                pool: &sqlx::Pool<$db>,
                consumer: &str,
                id: &str,
            ) -> (i64, i64, Option<String>) {
                sqlx::query_as($inbox_state)
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_inbox_claim_whose_reply_was_lost_finds_its_rows_with_one_attempt() {
                let db = $pool;
                let direct: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(direct).await.unwrap();
                sqlx::raw_sql($effects).execute(direct).await.unwrap();
                let consumer = unique("regress-lost-claim");
                let marker = format!("lost-reply:{consumer}");
                let ids = ["m0", "m1", "m2"];
                let messages: Vec<Incoming<'_>> = ids
                    .iter()
                    .map(|id| Incoming::new(id, marker.as_bytes()))
                    .collect();
                Inbox::new(direct, &consumer)
                    .unwrap()
                    .receive_batch(&messages)
                    .await
                    .unwrap();

                let (proxy, pool) = through_proxy().await;
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let worker = inbox.worker().batch(3);
                proxy.arm($lose_claim(marker.as_bytes()));
                let claims = worker
                    .claim()
                    .await
                    .expect("a claim whose reply was lost is tried again");
                assert_eq!(proxy.fired(), 1, "the claim's reply was lost");
                let claimed: Vec<(&str, u32)> = claims
                    .messages()
                    .iter()
                    .map(|m| (m.id(), m.attempt()))
                    .collect();
                assert_eq!(
                    claimed,
                    [("m0", 1), ("m1", 1), ("m2", 1)],
                    "the rows it took, once"
                );
                for message in claims.messages() {
                    assert_eq!(
                        worker.process(&claims, message, &Effects).await.unwrap(),
                        Processed::Processed
                    );
                }
                for id in ids {
                    assert_eq!(inbox_row(direct, &consumer, id).await, (2, 1, None), "{id}");
                    let effects: i64 = sqlx::query_scalar($count)
                        .bind(id)
                        .fetch_one(direct)
                        .await
                        .unwrap();
                    assert!(effects >= 1, "{id}: its effect");
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_commit_cut_by_the_network_is_not_the_messages_failure() {
                let db = $pool;
                let direct: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(direct).await.unwrap();
                sqlx::raw_sql($effects).execute(direct).await.unwrap();
                let consumer = unique("regress-cut-commit");
                let id = format!("{consumer}/m");
                Inbox::new(direct, &consumer)
                    .unwrap()
                    .receive(Incoming::new(&id, b"p"))
                    .await
                    .unwrap();

                let (proxy, pool) = through_proxy().await;
                let inbox = Inbox::new(&pool, &consumer).unwrap();
                let worker = inbox.worker();
                let claims = worker.claim().await.unwrap();
                assert_eq!(claims.messages().len(), 1);
                proxy.arm(Fault::CutBefore($commit.to_vec()));
                let processed = worker
                    .process(&claims, &claims.messages()[0], &Effects)
                    .await
                    .unwrap();
                assert_eq!(proxy.fired(), 1, "the commit was cut");
                assert_eq!(
                    processed,
                    Processed::Processed,
                    "run again within the claim"
                );
                assert_eq!(
                    inbox_row(direct, &consumer, &id).await,
                    (2, 1, None),
                    "no failure counted"
                );
                let effects: i64 = sqlx::query_scalar($count)
                    .bind(&id)
                    .fetch_one(direct)
                    .await
                    .unwrap();
                assert_eq!(effects, 1, "the effect once");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_relay_claim_whose_reply_was_lost_sends_its_rows_with_one_attempt() {
                let db = $pool;
                let direct: &sqlx::Pool<$db> = &db;
                let table = unique_table("regress_lost_claim");
                dedup_runtime::outbox::migrate_table(direct, &table)
                    .await
                    .unwrap();
                let outbox = Outbox::new().in_table(&table).unwrap();
                let cause = Cause::new("regress-lost-claim", "evt").unwrap();
                let marker = format!("lost-reply:{table}");
                let mut tx = direct.begin().await.unwrap();
                let mut ids = Vec::new();
                for slot in 0..3 {
                    let message = cause.nth_outgoing(slot, "events", marker.as_bytes());
                    outbox.enqueue(&mut *tx, &message).await.unwrap();
                    ids.push(message.id());
                }
                tx.commit().await.unwrap();

                let (proxy, pool) = through_proxy().await;
                let recorder = Recorder::default();
                let relay = outbox.relay(&pool).batch(3);
                proxy.arm($lose_claim(marker.as_bytes()));
                let relayed = relay.relay_batch(&recorder).await.expect("tried again");
                assert_eq!(proxy.fired(), 1, "the claim's reply was lost");
                assert_eq!((relayed.claimed, relayed.sent), (3, 3));
                assert_eq!(recorder.0.lock().unwrap().len(), 3, "each sent once");
                for id in ids {
                    let sql = format!($outbox_state, table);
                    let state: (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                        .bind(id.to_string())
                        .fetch_one(direct)
                        .await
                        .unwrap();
                    assert_eq!(state, (2, 1), "{id}: sent at its first attempt");
                }
            }
        }
    };
}

/// PostgreSQL runs the claim as one autocommitted statement: its reply is the rows.
fn lose_postgres_reply(marker: &[u8]) -> Fault {
    Fault::LoseReplyWith(marker.to_vec())
}

/// MariaDB claims in a transaction: the rows come back before the `COMMIT`, whose reply
/// is the one lost.
fn lose_mysql_reply(marker: &[u8]) -> Fault {
    Fault::LoseReplyAfter {
        seen: marker.to_vec(),
        then: b"COMMIT".to_vec(),
    }
}

backend!(
    postgres,
    db = sqlx::Postgres,
    conn = sqlx::PgConnection,
    pool = Box::new(dedup_suite::postgres().await),
    url = dedup_suite::postgres_url(),
    lose_claim = lose_postgres_reply,
    commit = b"COMMIT",
    effects = "CREATE TABLE IF NOT EXISTS regress_fault_effects (message_id text NOT NULL)",
    effect = "INSERT INTO regress_fault_effects (message_id) VALUES ($1)",
    count = "SELECT COUNT(*) FROM regress_fault_effects WHERE message_id = $1",
    inbox_state = "SELECT state::int8, attempts::int8, last_error FROM inbox_messages \
                   WHERE consumer = $1 AND message_id = $2",
    outbox_state = "SELECT state::int8, attempts::int8 FROM {} WHERE id = $1::uuid"
);
backend!(
    mysql,
    db = sqlx::MySql,
    conn = sqlx::MySqlConnection,
    pool = Box::new(dedup_suite::mysql().await),
    url = dedup_suite::mysql_url(),
    lose_claim = lose_mysql_reply,
    commit = b"SET autocommit = 1",
    effects = "CREATE TABLE IF NOT EXISTS regress_fault_effects \
               (message_id VARBINARY(255) NOT NULL) ENGINE = InnoDB",
    effect = "INSERT INTO regress_fault_effects (message_id) VALUES (?)",
    count = "SELECT COUNT(*) FROM regress_fault_effects WHERE message_id = ?",
    inbox_state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED), last_error \
                   FROM inbox_messages WHERE consumer = ? AND message_id = ?",
    outbox_state = "SELECT CAST(state AS SIGNED), CAST(attempts AS SIGNED) FROM {} \
                    WHERE id = UNHEX(REPLACE(?, '-', ''))"
);
