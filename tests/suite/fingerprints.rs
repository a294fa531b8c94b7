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
    #[allow(dead_code)] // never read: the part a declared fingerprint leaves out
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
        delete_consumer = $delete_consumer:literal,
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
                let inbox = Inbox::new(&*pool, "fp-old").unwrap().in_table(&table).unwrap().fingerprints(true);
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

            /// A batch of the same consumer as `whole`, fingerprinting each message's payload.
            #[idempotent(consumer = "fingerprints-whole", batch = fresh, key = |msg| msg.id, fingerprint = |msg| msg.payload)]
            async fn batched(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    effect(tx, msg).await?;
                }
                Ok(())
            }

            /// A batch of the leased handlers' consumer.
            #[idempotent(consumer = "fingerprints-leased", batch = fresh, key = |msg| msg.id, fingerprint = |msg| msg.payload)]
            async fn batched_leased(tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                for msg in fresh {
                    effect(tx, msg).await?;
                }
                Ok(())
            }

            /// Send-first under a lease, its fingerprint written with the claim.
            #[idempotent(consumer = "fingerprints-leased", key = msg.id, effect = "send-first", lease = "30s", fingerprint = msg.payload)]
            async fn sent(lease: &mut dedup_runtime::Lease<'_, Db>, msg: &Msg, gate: &Gate) -> Result<(), sqlx::Error> {
                gate.pass().await;
                let tx = lease.transaction().await?;
                effect(tx, msg).await
            }

            fn batch_mismatch<E>(item: &dedup_runtime::batch::BatchItem<E>, msg: &Msg, stored: &[u8]) {
                match item {
                    dedup_runtime::batch::BatchItem::FingerprintMismatch(found) => {
                        assert_eq!(found.consumer().is_empty(), false);
                        assert_eq!(found.message_id(), msg.id);
                        assert_eq!(found.received(), fingerprint(&msg.payload));
                        assert_eq!(found.stored(), fingerprint(stored));
                        // The broker's action for it: dead-letter, with the reason.
                        assert_eq!(AckPolicy::<Db>::new().decide_error(found, 1), Ack::DeadLetter);
                    }
                    _ => panic!("not a mismatch"),
                }
            }

            /// Batch members: the fingerprint is written with the batch's claim; a member
            /// whose id was processed with another payload, and a copy in the batch with
            /// another payload than its first, are mismatches (not processed, not
            /// acknowledged); an identical one is a duplicate; the single handler compares
            /// against what the batch stored, and the batch against a single handler's.
            #[tokio::test]
            async fn a_batch_member_with_another_payload_is_a_mismatch() {
                use dedup_runtime::batch::BatchItem;
                let pool = pool().await;
                let done = Msg::new("batch-done", b"one");
                let reused = Msg::new("batch-reused", b"four");
                for msg in [&done, &reused] {
                    assert!(whole(&*pool, msg).await.unwrap().is_processed());
                }
                let fresh = Msg::new("batch-fresh", b"two");
                let delivered = [
                    done.clone(),
                    fresh.clone(),
                    fresh.with_payload(b"three"),
                    reused.with_payload(b"not four"),
                    fresh.clone(),
                ];
                let outcome = batched(&*pool, &delivered).await.unwrap();
                let items = outcome.items();
                assert!(matches!(items[0], BatchItem::Duplicate(Duplicate::AlreadyProcessed)), "{items:?}");
                assert!(matches!(items[1], BatchItem::Processed), "{items:?}");
                batch_mismatch(&items[2], &delivered[2], b"two");
                batch_mismatch(&items[3], &delivered[3], b"four");
                assert!(matches!(items[4], BatchItem::SameAs { first: 1 }), "{items:?}");
                assert_eq!((outcome.processed(), outcome.duplicates(), outcome.mismatches()), (1, 1, 2));
                assert_eq!((0..5).map(|n| outcome.ack(n)).collect::<Vec<_>>(), [true, true, false, false, true]);
                // The database: one effect each, the batch's fingerprint with its row.
                for msg in [&done, &fresh, &reused] {
                    assert_eq!(effects(&pool, &msg.id).await, 1, "{}", msg.id);
                }
                assert_eq!(stored(&pool, "fingerprints-whole", &fresh.id).await, Some(fingerprint(b"two").to_vec()));
                assert_eq!(stored(&pool, "fingerprints-whole", &reused.id).await, Some(fingerprint(b"four").to_vec()));
                // The single handler reads what the batch stored.
                assert!(whole(&*pool, &fresh).await.unwrap().is_duplicate());
                mismatch(&whole(&*pool, &fresh.with_payload(b"three")).await.unwrap_err(), &fresh.with_payload(b"three"));
                // Delivered again, identical: all duplicates.
                let again = batched(&*pool, &[done.clone(), fresh.clone(), reused.clone()]).await.unwrap();
                assert_eq!((again.duplicates(), again.mismatches()), (3, 0));
                // A row stored without a fingerprint has nothing to compare: a duplicate.
                let old = Msg::new("batch-unprinted", b"old");
                assert!(unprinted(&*pool, &old).await.unwrap().is_processed());
                let outcome = batched(&*pool, &[old.with_payload(b"new")]).await.unwrap();
                assert!(matches!(outcome.items()[0], BatchItem::Duplicate(Duplicate::AlreadyProcessed)));
                assert_eq!(effects(&pool, &old.id).await, 1);
            }

            /// Rows of leased handlers: a lease in progress is in progress for the same
            /// payload and a mismatch for another; an unknown outcome likewise; an expired
            /// send-first lease is taken over for the same payload only.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_member_meets_leases_with_their_fingerprints() {
                use dedup_runtime::batch::BatchItem;
                let pool = Arc::new(pool().await);
                let held = Msg::new("batch-held", b"one");
                let gate = Gate::held();
                let task = {
                    let (pool, msg, gate) = (pool.clone(), held.clone(), gate.clone());
                    tokio::spawn(async move { marked(&**pool, &msg, &gate).await })
                };
                gate.entered.notified().await;
                let other = held.with_payload(b"two");
                let outcome = batched_leased(&**pool, std::slice::from_ref(&held)).await.unwrap();
                assert!(matches!(outcome.items()[0], BatchItem::InProgress(_)), "{:?}", outcome.items());
                let outcome = batched_leased(&**pool, std::slice::from_ref(&other)).await.unwrap();
                batch_mismatch(&outcome.items()[0], &other, b"one");
                // The call never completes: after its lease, the outcome is unknown.
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                expire(&pool, "fingerprints-leased", &held.id).await;
                let outcome = batched_leased(&**pool, std::slice::from_ref(&held)).await.unwrap();
                assert!(matches!(outcome.items()[0], BatchItem::Duplicate(Duplicate::OutcomeUnknown)), "{:?}", outcome.items());
                let outcome = batched_leased(&**pool, std::slice::from_ref(&other)).await.unwrap();
                batch_mismatch(&outcome.items()[0], &other, b"one");
                assert_eq!(effects(&pool, &held.id).await, 0);

                // An expired send-first lease.
                let lapsed = Msg::new("batch-lapsed", b"one");
                let gate = Gate::held();
                let task = {
                    let (pool, msg, gate) = (pool.clone(), lapsed.clone(), gate.clone());
                    tokio::spawn(async move { sent(&**pool, &msg, &gate).await })
                };
                gate.entered.notified().await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                expire(&pool, "fingerprints-leased", &lapsed.id).await;
                let other = lapsed.with_payload(b"two");
                let outcome = batched_leased(&**pool, std::slice::from_ref(&other)).await.unwrap();
                batch_mismatch(&outcome.items()[0], &other, b"one");
                assert_eq!(effects(&pool, &lapsed.id).await, 0, "not taken over");
                let outcome = batched_leased(&**pool, std::slice::from_ref(&lapsed)).await.unwrap();
                assert!(matches!(outcome.items()[0], BatchItem::Processed), "{:?}", outcome.items());
                assert_eq!(effects(&pool, &lapsed.id).await, 1);
                assert_eq!(stored(&pool, "fingerprints-leased", &lapsed.id).await, Some(fingerprint(b"one").to_vec()));
                mismatch(&plain_leased(&**pool, &other).await.unwrap_err(), &other);
            }

            /// The runtime's `Batch::fingerprint`, as a `BatchHandler` with state uses it.
            #[tokio::test]
            async fn batch_fingerprint_on_the_runtime() {
                use dedup_runtime::batch::{Batch, BatchHandler, BatchItem};
                struct Record;
                impl BatchHandler<Db, Msg> for Record {
                    type Error = sqlx::Error;
                    async fn handle(&self, tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                        for msg in fresh {
                            effect(tx, msg).await?;
                        }
                        Ok(())
                    }
                }
                let pool = pool().await;
                // The declared part: the amount.
                let batch = Batch::new("fingerprints-runtime")
                    .unwrap()
                    .fingerprint(|msg: &Msg| fingerprint(&msg.amount.to_be_bytes()));
                let msg = Msg::new("runtime", b"payload");
                let outcome = batch.run(&*pool, std::slice::from_ref(&msg), |msg| msg.id.as_str(), &Record).await.unwrap();
                assert_eq!(outcome.processed(), 1);
                assert_eq!(stored(&pool, "fingerprints-runtime", &msg.id).await, Some(fingerprint(&100u64.to_be_bytes()).to_vec()));
                // Another payload, same amount: a duplicate; another amount: the mismatch.
                let same_part = Msg { payload: b"other".to_vec(), delivered_at: "later".into(), ..msg.clone() };
                let outcome = batch.run(&*pool, &[same_part], |msg| msg.id.as_str(), &Record).await.unwrap();
                assert!(matches!(outcome.items()[0], BatchItem::Duplicate(Duplicate::AlreadyProcessed)));
                let more = Msg { amount: 200, ..msg.clone() };
                let mut conn = pool.acquire().await.unwrap();
                let outcome = batch.run_on(&mut *conn, &[more], |msg| msg.id.as_str(), &Record).await.unwrap();
                match &outcome.items()[0] {
                    BatchItem::FingerprintMismatch(found) => {
                        assert_eq!(found.stored(), fingerprint(&100u64.to_be_bytes()));
                        assert_eq!(found.received(), fingerprint(&200u64.to_be_bytes()));
                        assert_eq!(found.consumer(), "fingerprints-runtime");
                    }
                    other => panic!("{other:?}"),
                }
                assert_eq!(effects(&pool, &msg.id).await, 1);
            }

            /// The statement limits: 10,001 messages (past the 10,000 rows of one MySQL
            /// and the 5,000 of one SQLite statement), each id and the consumer 255 bytes
            /// long, with their fingerprints: all claimed, then all duplicates, and the
            /// last one's reuse caught.
            #[tokio::test]
            async fn a_batch_at_the_limits_with_fingerprints() {
                use dedup_runtime::batch::{Batch, BatchHandler};
                struct Nothing;
                impl BatchHandler<Db, Msg> for Nothing {
                    type Error = sqlx::Error;
                    async fn handle(&self, tx: &mut $conn, fresh: &[&Msg]) -> Result<(), sqlx::Error> {
                        sqlx::query("SELECT 1").execute(&mut *tx).await?;
                        assert!(!fresh.is_empty());
                        Ok(())
                    }
                }
                let pool = pool().await;
                let consumer = format!("{:x<255}", "fingerprints-limits-");
                sqlx::query($delete_consumer).bind(&consumer).execute(&*pool).await.unwrap();
                let batch = Batch::new(&consumer)
                    .unwrap()
                    .fingerprint(|msg: &Msg| fingerprint(&msg.payload));
                let messages: Vec<Msg> = (0..10_001)
                    .map(|n| {
                        let id = format!("{n:05}-");
                        Msg { id: format!("{id:y<255}"), ..Msg::new("", format!("payload {n}").as_bytes()) }
                    })
                    .collect();
                let outcome = batch.run(&*pool, &messages, |msg| msg.id.as_str(), &Nothing).await.unwrap();
                assert_eq!(outcome.processed(), 10_001);
                for n in [0, 5_000, 9_999, 10_000] {
                    let msg = &messages[n];
                    assert_eq!(stored(&pool, &consumer, &msg.id).await, Some(fingerprint(&msg.payload).to_vec()), "{n}");
                }
                let mut again = messages.clone();
                again[10_000].payload = b"reused".to_vec();
                let outcome = batch.run(&*pool, &again, |msg| msg.id.as_str(), &Nothing).await.unwrap();
                assert_eq!((outcome.duplicates(), outcome.mismatches()), (10_000, 1));
                batch_mismatch(&outcome.items()[10_000], &again[10_000], b"payload 10000");
            }

            /// Two batches at once carrying one id with different payloads: one processes
            /// it, the other waits for its row and then is the mismatch.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_batches_at_once_one_processed_one_mismatch() {
                use dedup_runtime::batch::BatchItem;
                let pool = Arc::new(pool().await);
                for round in 0..10 {
                    let msg = Msg::new(&format!("batch-race-{round}"), b"left");
                    let mut tasks = Vec::new();
                    for copy in [msg.clone(), msg.with_payload(b"right")] {
                        let pool = pool.clone();
                        tasks.push(tokio::spawn(async move { batched(&**pool, &[copy]).await }));
                    }
                    let mut seen = (0, 0);
                    for task in tasks {
                        let outcome = task.await.unwrap().unwrap();
                        match &outcome.items()[0] {
                            BatchItem::Processed => seen.0 += 1,
                            BatchItem::FingerprintMismatch(_) => seen.1 += 1,
                            other => panic!("round {round}: {other:?}"),
                        }
                    }
                    assert_eq!(seen, (1, 1), "round {round}");
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
    delete_consumer = "DELETE FROM processed_messages WHERE consumer = $1",
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
    delete_consumer = "DELETE FROM processed_messages WHERE consumer = ?",
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
    delete_consumer = "DELETE FROM processed_messages WHERE consumer = ?",
    expire = "UPDATE processed_messages \
              SET expires_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 seconds') \
              WHERE consumer = ?1 AND message_id = ?2",
);
