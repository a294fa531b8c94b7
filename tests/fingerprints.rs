//! Payload fingerprints (`fingerprint = …`, issue 26) on PostgreSQL, MariaDB and SQLite:
//! the SHA-256 of the payload (or of the declared part of it) is stored with the dedup row
//! in the handler's transaction, and every claim that finds the row compares it: the same
//! id with another payload is a typed `FingerprintMismatch` (nothing written, dead-lettered
//! by `AckPolicy`), never a silent duplicate; an identical redelivery after completion is
//! a duplicate, never a mismatch — on the processed path, the replay path of a stored
//! result, inside the caller's transaction, and with two copies at once.

use std::sync::Arc;

use dedup_runtime::{
    Ack, AckPolicy, Duplicate, FingerprintMismatch, Outcome, StoredOutcome, fingerprint, idempotent,
};

/// A delivery: its id, its payload, and a field the declared part leaves out.
#[derive(Debug, Clone)]
pub struct Msg {
    pub id: String,
    pub payload: Vec<u8>,
    pub amount: u64,
    pub delivered_at: String,
}

impl Msg {
    fn new(prefix: &str, payload: &[u8]) -> Self {
        Msg {
            id: dedup_suite::unique(prefix),
            payload: payload.to_vec(),
            amount: 100,
            delivered_at: "first".to_owned(),
        }
    }

    fn with_payload(&self, payload: &[u8]) -> Self {
        Msg {
            payload: payload.to_vec(),
            ..self.clone()
        }
    }
}

use dedup_suite::Gate;

macro_rules! backend_suite {
    (
        $backend:ident,
        conn = $conn:ty,
        db = $db:ty,
        pool = $pool:expr,
        effects_ddl = $effects_ddl:literal,
        insert_effect = $insert_effect:literal,
        select_fingerprint = $select_fingerprint:literal,
        expire = $expire:literal $(,)?
    ) => {
        mod $backend {
            use super::*;
            use sqlx::Pool;

            type Db = $db;

            async fn pool() -> impl std::ops::Deref<Target = Pool<Db>> {
                let pool = $pool;
                dedup_suite::ddl(&*pool, $effects_ddl).await;
                pool
            }

            async fn effects(pool: &Pool<Db>, id: &str) -> i64 {
                dedup_suite::rows(pool, "dedup_fingerprint_effects", "message_id", id).await
            }

            /// The fingerprint stored in the dedup row of `(consumer, id)`.
            async fn stored(pool: &Pool<Db>, consumer: &str, id: &str) -> Option<Vec<u8>> {
                sqlx::query_scalar::<_, Option<Vec<u8>>>($select_fingerprint)
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn effect(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                sqlx::query($insert_effect)
                    .bind(&msg.id)
                    .execute(&mut *tx)
                    .await?;
                Ok(())
            }

            #[idempotent(consumer = "fingerprints-whole", key = msg.id, fingerprint = msg.payload)]
            async fn whole(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                effect(tx, msg).await
            }

            /// The declared part: the amount, not the delivery time.
            #[idempotent(consumer = "fingerprints-part", key = msg.id, fingerprint = msg.amount.to_be_bytes())]
            async fn part(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                effect(tx, msg).await
            }

            #[idempotent(consumer = "fingerprints-reply", key = msg.id, result = "stored", fingerprint = &msg.payload)]
            async fn reply(tx: &mut $conn, msg: &Msg) -> Result<String, sqlx::Error> {
                effect(tx, msg).await?;
                Ok(format!("reply to {} bytes", msg.payload.len()))
            }

            /// The same consumer as `whole`, no fingerprint.
            #[idempotent(consumer = "fingerprints-whole", key = msg.id)]
            async fn unprinted(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                effect(tx, msg).await
            }

            /// Mark-first, its fingerprint written with the mark.
            #[idempotent(consumer = "fingerprints-leased", key = msg.id, effect = "mark-first", lease = "30s", fingerprint = msg.payload)]
            async fn marked(lease: &mut dedup_runtime::Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<(), sqlx::Error> {
                gate.pass().await;
                let tx = lease.transaction().await?;
                effect(tx, msg).await
            }

            /// A plain handler of the same consumer.
            #[idempotent(consumer = "fingerprints-leased", key = msg.id, fingerprint = msg.payload)]
            async fn plain_leased(tx: &mut $conn, msg: &Msg) -> Result<(), sqlx::Error> {
                effect(tx, msg).await
            }

            async fn expire(pool: &Pool<Db>, consumer: &str, id: &str) {
                sqlx::query($expire).bind(consumer).bind(id).execute(pool).await.unwrap();
            }

            /// A copy while the lease runs: another payload is the mismatch (for a leased
            /// copy and a plain one), the same payload in progress.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn in_progress_another_payload_is_a_mismatch() {
                let pool = Arc::new(pool().await);
                let msg = Msg::new("leased", b"one");
                let gate = Gate::held();
                let first = {
                    let (pool, msg, gate) = (pool.clone(), msg.clone(), gate.clone());
                    tokio::spawn(async move { marked(&**pool, &msg, &gate).await })
                };
                gate.entered.notified().await;
                assert_eq!(
                    stored(&pool, "fingerprints-leased", &msg.id).await,
                    Some(fingerprint(b"one").to_vec()),
                    "written with the mark"
                );
                let open = Gate::default();
                let reused = msg.with_payload(b"two");
                let error = marked(&**pool, &reused, &open).await.unwrap_err();
                mismatch(&error, &reused);
                let error = plain_leased(&**pool, &reused).await.unwrap_err();
                mismatch(&error, &reused);
                assert!(marked(&**pool, &msg, &open).await.unwrap().is_in_progress());
                let error = plain_leased(&**pool, &msg).await.unwrap_err();
                assert!(dedup_runtime::InProgress::find(&error).is_some(), "{error:?}");
                gate.go.notify_one();
                assert!(first.await.unwrap().unwrap().is_processed());
                // Processed: the same payload a duplicate, another one the mismatch.
                assert!(marked(&**pool, &msg, &open).await.unwrap().is_duplicate());
                assert!(plain_leased(&**pool, &msg).await.unwrap().is_duplicate());
                mismatch(&marked(&**pool, &reused, &open).await.unwrap_err(), &reused);
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// A mark-first call that never completed: after its lease, the same payload is
            /// the unknown outcome, another payload the mismatch.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn outcome_unknown_another_payload_is_a_mismatch() {
                let pool = Arc::new(pool().await);
                let msg = Msg::new("unknown", b"one");
                let gate = Gate::held();
                let task = {
                    let (pool, msg, gate) = (pool.clone(), msg.clone(), gate.clone());
                    tokio::spawn(async move { marked(&**pool, &msg, &gate).await })
                };
                gate.entered.notified().await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                expire(&pool, "fingerprints-leased", &msg.id).await;
                let open = Gate::default();
                let reused = msg.with_payload(b"two");
                mismatch(&marked(&**pool, &reused, &open).await.unwrap_err(), &reused);
                mismatch(&plain_leased(&**pool, &reused).await.unwrap_err(), &reused);
                assert_eq!(
                    marked(&**pool, &msg, &open).await.unwrap(),
                    dedup_runtime::LeaseOutcome::Duplicate(Duplicate::OutcomeUnknown)
                );
                assert_eq!(effects(&pool, &msg.id).await, 0, "the documented mark-first loss");
            }

            /// The inbox compares payloads when asked to: an identical redelivery is a
            /// duplicate before and after processing (its payload dropped, its fingerprint
            /// kept), another payload is refused — alone and in a batch — and nothing of it
            /// is written.
            #[tokio::test]
            async fn the_inbox_refuses_an_id_reused_with_another_payload() {
                use dedup_runtime::inbox::{Inbox, InboxError, InboxHandler, InboxMessage, Incoming, Received, Refused};

                struct Done;
                impl InboxHandler<Db> for Done {
                    type Error = sqlx::Error;
                    async fn handle(&self, tx: &mut $conn, message: &InboxMessage) -> Result<(), sqlx::Error> {
                        sqlx::query($insert_effect).bind(message.id()).execute(&mut *tx).await?;
                        Ok(())
                    }
                }

                let pool = pool().await;
                dedup_runtime::inbox::migrate(&*pool).await.unwrap();
                let consumer = dedup_suite::unique("fp-inbox");
                let inbox = Inbox::new(&*pool, &consumer)
                    .unwrap()
                    .drop_payloads(true)
                    .fingerprints(true);
                let id = dedup_suite::unique("in");
                assert_eq!(inbox.receive(Incoming::new(&id, b"one")).await.unwrap(), Received::Stored);
                assert_eq!(inbox.receive(Incoming::new(&id, b"one")).await.unwrap(), Received::Duplicate);
                let refused = |result: Result<Received, InboxError>| match result {
                    Err(InboxError::Refused(Refused::FingerprintMismatch(mismatch))) => mismatch,
                    other => panic!("not refused: {other:?}"),
                };
                let mismatch = refused(inbox.receive(Incoming::new(&id, b"two")).await);
                assert_eq!((mismatch.stored(), mismatch.received()), (fingerprint(b"one"), fingerprint(b"two")));
                assert_eq!(mismatch.message_id(), id);
                // Found through the error's chain, as `AckPolicy` finds it.
                let error = inbox.receive(Incoming::new(&id, b"two")).await.unwrap_err();
                assert!(FingerprintMismatch::find(&error).is_some());

                // Processed, its payload dropped: the fingerprint stays, and compares.
                let done = inbox.worker().process_batch(&Done).await.unwrap();
                assert_eq!(done.processed, 1);
                assert_eq!(effects(&pool, &id).await, 1);
                assert_eq!(inbox.receive(Incoming::new(&id, b"one")).await.unwrap(), Received::Duplicate);
                refused(inbox.receive(Incoming::new(&id, b"two")).await);

                // A batch: one answer each, the reused id refused, the rest stored.
                let fresh = dedup_suite::unique("in-fresh");
                let twice = dedup_suite::unique("in-twice");
                let answers = inbox
                    .receive_batch(&[
                        Incoming::new(&id, b"one"),
                        Incoming::new(&fresh, b"f"),
                        Incoming::new(&id, b"two"),
                        Incoming::new(&twice, b"a"),
                        Incoming::new(&twice, b"a"),
                        Incoming::new(&twice, b"b"),
                    ])
                    .await
                    .unwrap();
                assert_eq!(answers[0], Ok(Received::Duplicate));
                assert_eq!(answers[1], Ok(Received::Stored));
                assert!(matches!(&answers[2], Err(Refused::FingerprintMismatch(m)) if m.received() == fingerprint(b"two")), "{answers:?}");
                assert_eq!(answers[3], Ok(Received::Stored));
                assert_eq!(answers[4], Ok(Received::DuplicateInBatch { first: 3 }));
                assert!(matches!(&answers[5], Err(Refused::FingerprintMismatch(m)) if m.stored() == fingerprint(b"a")), "{answers:?}");
                let done = inbox.worker().process_batch(&Done).await.unwrap();
                assert_eq!(done.processed, 2, "the fresh one and the first of the twice");
                assert_eq!(effects(&pool, &id).await, 1);
                assert_eq!(effects(&pool, &twice).await, 1);

                // Off (the default): another payload is taken for a redelivery, as before.
                let lax = Inbox::new(&*pool, &consumer).unwrap();
                assert_eq!(lax.receive(Incoming::new(&id, b"three")).await.unwrap(), Received::Duplicate);
                let unprinted = dedup_suite::unique("in-unprinted");
                assert_eq!(lax.receive(Incoming::new(&unprinted, b"x")).await.unwrap(), Received::Stored);
                // A row stored without a fingerprint has nothing to compare.
                assert_eq!(inbox.receive(Incoming::new(&unprinted, b"y")).await.unwrap(), Received::Duplicate);
            }

            /// An inbox table made before the fingerprints gets the column from
            /// `migrate_table` (and `migrate` again changes nothing).
            #[tokio::test]
            async fn an_older_inbox_table_gets_the_column() {
                use dedup_runtime::inbox::{Inbox, Incoming, Received};
                let pool = pool().await;
                let table = dedup_suite::unique_table("fp_old_inbox");
                dedup_runtime::inbox::migrate_table(&*pool, &table).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("ALTER TABLE {table} DROP COLUMN fingerprint")))
                    .execute(&*pool)
                    .await
                    .unwrap();
                dedup_runtime::inbox::migrate_table(&*pool, &table).await.unwrap();
                dedup_runtime::inbox::migrate_table(&*pool, &table).await.unwrap();
                let inbox = Inbox::new(&*pool, "fp-old").unwrap().with_table(&table).unwrap().fingerprints(true);
                assert_eq!(inbox.receive(Incoming::new("a", b"1")).await.unwrap(), Received::Stored);
                assert!(inbox.receive(Incoming::new("a", b"2")).await.is_err(), "compared");
            }

            fn mismatch<E: std::error::Error + 'static>(error: &E, msg: &Msg) -> FingerprintMismatch {
                let found = FingerprintMismatch::find(error)
                    .unwrap_or_else(|| panic!("not a mismatch: {error:?}"))
                    .clone();
                assert_eq!(found.message_id(), msg.id);
                assert_eq!(found.received(), fingerprint(&msg.payload));
                found
            }

            #[tokio::test]
            async fn an_identical_redelivery_is_a_duplicate_and_another_payload_a_mismatch() {
                let pool = pool().await;
                let msg = Msg::new("whole", b"{\"amount\":100}");
                assert!(whole(&*pool, &msg).await.unwrap().is_processed());
                assert_eq!(
                    stored(&pool, "fingerprints-whole", &msg.id).await,
                    Some(fingerprint(&msg.payload).to_vec()),
                    "the payload's SHA-256, stored with the row"
                );
                for _ in 0..2 {
                    let again = whole(&*pool, &msg).await.unwrap();
                    assert_eq!(again, Outcome::Duplicate(Duplicate::AlreadyProcessed));
                }

                let reused = msg.with_payload(b"{\"amount\":999}");
                let error = whole(&*pool, &reused).await.unwrap_err();
                let found = mismatch(&error, &reused);
                assert_eq!(found.stored(), fingerprint(&msg.payload));
                assert_eq!(found.consumer(), "fingerprints-whole");
                assert!(error.to_string().contains("reused with a different payload"), "{error}");
                let failed: Result<Outcome<()>, sqlx::Error> = Err(error);
                assert_eq!(AckPolicy::<Db>::new().decide(&failed, 1), Ack::DeadLetter);
                // Nothing changed: one effect, the first fingerprint.
                assert_eq!(effects(&pool, &msg.id).await, 1);
                assert_eq!(dedup_suite::claims(&*pool, "fingerprints-whole", &msg.id).await, 1);
                assert_eq!(
                    stored(&pool, "fingerprints-whole", &msg.id).await,
                    Some(fingerprint(&msg.payload).to_vec())
                );
                // And the first payload is still a duplicate after the mismatch.
                assert!(whole(&*pool, &msg).await.unwrap().is_duplicate());
            }

            #[tokio::test]
            async fn the_declared_part_is_what_counts() {
                let pool = pool().await;
                let msg = Msg::new("part", b"payload");
                assert!(part(&*pool, &msg).await.unwrap().is_processed());
                // Another delivery time and other bytes, the same amount: a duplicate.
                let later = Msg {
                    delivered_at: "later".to_owned(),
                    payload: b"other".to_vec(),
                    ..msg.clone()
                };
                assert!(part(&*pool, &later).await.unwrap().is_duplicate());
                // Another amount: a mismatch.
                let changed = Msg {
                    amount: 101,
                    ..msg.clone()
                };
                let error = part(&*pool, &changed).await.unwrap_err();
                let found = FingerprintMismatch::find(&error).expect("a mismatch");
                assert_eq!(found.stored(), fingerprint(&100u64.to_be_bytes()));
                assert_eq!(found.received(), fingerprint(&101u64.to_be_bytes()));
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// With a stored result: an identical redelivery gets the replay, another
            /// payload the mismatch — never the first reply.
            #[tokio::test]
            async fn the_replay_path_compares_too() {
                let pool = pool().await;
                let msg = Msg::new("reply", b"abc");
                let first = reply(&*pool, &msg).await.unwrap();
                assert_eq!(first, StoredOutcome::Processed("reply to 3 bytes".to_owned()));
                let again = reply(&*pool, &msg).await.unwrap();
                assert_eq!(again, StoredOutcome::Replayed("reply to 3 bytes".to_owned()));
                let reused = msg.with_payload(b"abcd");
                let error = reply(&*pool, &reused).await.unwrap_err();
                mismatch(&error, &reused);
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// A row without a fingerprint (processed by a handler that has none, or
            /// before the option) has nothing to compare: a duplicate.
            #[tokio::test]
            async fn a_row_without_a_fingerprint_is_a_duplicate() {
                let pool = pool().await;
                let msg = Msg::new("unprinted", b"one");
                assert!(unprinted(&*pool, &msg).await.unwrap().is_processed());
                assert_eq!(stored(&pool, "fingerprints-whole", &msg.id).await, None);
                let other = msg.with_payload(b"two");
                assert!(whole(&*pool, &other).await.unwrap().is_duplicate());
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// Inside the caller's transaction: the mismatch rolls back the handler's
            /// savepoint only, and the caller's transaction goes on.
            #[tokio::test]
            async fn in_the_callers_transaction_a_mismatch_leaves_it_usable() {
                let pool = pool().await;
                let msg = Msg::new("caller", b"one");
                let mut tx = pool.begin().await.unwrap();
                assert!(whole(&mut *tx, &msg).await.unwrap().is_processed());
                let error = whole(&mut *tx, &msg.with_payload(b"two")).await.unwrap_err();
                assert!(FingerprintMismatch::find(&error).is_some(), "{error:?}");
                assert!(whole(&mut *tx, &msg).await.unwrap().is_duplicate());
                tx.commit().await.unwrap();
                assert_eq!(effects(&pool, &msg.id).await, 1);
                assert_eq!(
                    stored(&pool, "fingerprints-whole", &msg.id).await,
                    Some(fingerprint(b"one").to_vec())
                );
            }

            /// Two copies with different payloads at once: one is processed, the other
            /// waits for it and then is the mismatch — whichever comes first.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_copies_at_once_one_processed_one_mismatch() {
                let pool = Arc::new(pool().await);
                for round in 0..10 {
                    let msg = Msg::new(&format!("race-{round}"), b"left");
                    let copies = [msg.clone(), msg.with_payload(b"right")];
                    let mut tasks = Vec::new();
                    for copy in copies {
                        let pool = pool.clone();
                        tasks.push(tokio::spawn(async move { whole(&**pool, &copy).await }));
                    }
                    let mut processed = 0;
                    let mut mismatched = 0;
                    for task in tasks {
                        match task.await.unwrap() {
                            Ok(outcome) if outcome.is_processed() => processed += 1,
                            Err(error) if FingerprintMismatch::find(&error).is_some() => mismatched += 1,
                            other => panic!("round {round}: {other:?}"),
                        }
                    }
                    assert_eq!((processed, mismatched), (1, 1), "round {round}");
                    assert_eq!(effects(&pool, &msg.id).await, 1);
                }
            }
        }
    };
}

backend_suite!(
    postgres,
    conn = sqlx::PgConnection,
    db = sqlx::Postgres,
    pool = Box::new(dedup_suite::postgres().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_fingerprint_effects (message_id text NOT NULL)",
    insert_effect = "INSERT INTO dedup_fingerprint_effects (message_id) VALUES ($1)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = $1 AND message_id = $2",
    expire = "UPDATE processed_messages SET expires_at = clock_timestamp() - interval '1 second' \
              WHERE consumer = $1 AND message_id = $2",
);

backend_suite!(
    mysql,
    conn = sqlx::MySqlConnection,
    db = sqlx::MySql,
    pool = Box::new(dedup_suite::mysql().await),
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_fingerprint_effects \
                   (message_id VARBINARY(255) NOT NULL, KEY (message_id)) ENGINE = InnoDB",
    insert_effect = "INSERT INTO dedup_fingerprint_effects (message_id) VALUES (?)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = ? AND message_id = ?",
    expire = "UPDATE processed_messages SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND \
              WHERE consumer = ? AND message_id = ?",
);

backend_suite!(
    sqlite,
    conn = sqlx::SqliteConnection,
    db = sqlx::Sqlite,
    pool = dedup_suite::sqlite().await,
    effects_ddl = "CREATE TABLE IF NOT EXISTS dedup_fingerprint_effects (message_id TEXT NOT NULL)",
    insert_effect = "INSERT INTO dedup_fingerprint_effects (message_id) VALUES (?)",
    select_fingerprint =
        "SELECT fingerprint FROM processed_messages WHERE consumer = ? AND message_id = ?",
    expire = "UPDATE processed_messages \
              SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND message_id = ?2",
);
