//! Enqueueing, on every backend: an enqueue commits with its transaction or rolls back
//! with it; the same message twice is one row; the same id with another payload is a typed
//! error that leaves the caller's transaction usable; bad input is refused before anything
//! is written, and a missing table is a typed error; concurrent enqueues of one message
//! store one row; inside an `#[idempotent]` body, the event commits with the effect.

use std::sync::Arc;

use dedup_runtime::outbox::{
    Cause, Enqueued, MAX_HEADERS_LEN, MAX_NAME_LEN, Outbox, OutboxError, OutgoingId, Refused,
};
use dedup_runtime::{Duplicate, Outcome, idempotent};
use dedup_suite::unique;

/// What a row holds: destination, payload, headers, ordering key, consumer, cause id,
/// slot, state, attempts.
type Stored = (
    String,
    Vec<u8>,
    Option<Vec<u8>>,
    Option<String>,
    String,
    String,
    String,
    i64,
    i64,
);

macro_rules! enqueue_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        effect_count = $effect_count:literal,
        begin_writing = $begin_writing:literal,
        state = $state:literal,
        expire = $expire:literal,
        $(late_commits = $late:literal,)?
    ) => {
        mod $backend {
            use super::*;

            async fn setup(pool: &sqlx::Pool<$db>) {
                dedup_runtime::outbox::migrate(pool).await.unwrap();
                dedup_suite::ddl(pool, $effects).await;
            }

            async fn row(pool: &sqlx::Pool<$db>, id: OutgoingId) -> Option<Stored> {
                sqlx::query_as($row)
                    .bind(id.to_string())
                    .fetch_optional(pool)
                    .await
                    .unwrap()
            }

            /// Rows of `consumer`'s causes.
            async fn rows(pool: &sqlx::Pool<$db>, consumer: &str) -> i64 {
                sqlx::query_scalar($count)
                    .bind(consumer)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn effects(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                sqlx::query_scalar($effect_count)
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            #[tokio::test]
            async fn an_enqueue_commits_with_its_transaction_and_rolls_back_with_it() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-tx");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let payload = b"\x00\xff{\"cents\": 4200}\n";
                let message = cause
                    .outgoing("invoice", "invoices", payload)
                    .unwrap()
                    .header("type", "invoice")
                    .header("raw", [0u8, 255])
                    .ordering_key("order-42");

                let mut tx = pool.begin().await.unwrap();
                assert_eq!(
                    outbox.enqueue(&mut *tx, &message).await.unwrap(),
                    Enqueued::Stored
                );
                tx.rollback().await.unwrap();
                assert_eq!(row(pool, message.id()).await, None, "rolled back: no row");

                let mut tx = pool.begin().await.unwrap();
                assert_eq!(
                    outbox.enqueue(&mut *tx, &message).await.unwrap(),
                    Enqueued::Stored
                );
                tx.commit().await.unwrap();
                assert_eq!(
                    row(pool, message.id()).await,
                    Some((
                        "invoices".to_owned(),
                        payload.to_vec(),
                        // The documented encoding: per pair, the name's length (one
                        // byte), the name, the value's length (four, big-endian), the value.
                        Some(
                            b"\x04type\x00\x00\x00\x07invoice\x03raw\x00\x00\x00\x02\x00\xff"
                                .to_vec()
                        ),
                        Some("order-42".to_owned()),
                        consumer.clone(),
                        "evt_1".to_owned(),
                        "invoice".to_owned(),
                        0,
                        0,
                    )),
                    "committed: the row, byte for byte, unsent"
                );
            }

            #[tokio::test]
            async fn the_same_message_twice_is_one_row() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-twice");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let first = cause.nth_outgoing(0, "invoices", b"a");
                let second = cause.nth_outgoing(1, "invoices", b"a");
                let mut tx = pool.begin().await.unwrap();
                for (message, expected) in [
                    (&first, Enqueued::Stored),
                    (&first, Enqueued::Duplicate),
                    (&second, Enqueued::Stored),
                ] {
                    assert_eq!(outbox.enqueue(&mut *tx, message).await.unwrap(), expected);
                }
                tx.commit().await.unwrap();
                // The handler runs again (its commit's outcome was lost): the same ids.
                let again = Cause::new(&consumer, "evt_1").unwrap();
                let mut tx = pool.begin().await.unwrap();
                for index in 0..2 {
                    let message = again.nth_outgoing(index, "invoices", b"a");
                    assert_eq!(
                        outbox.enqueue(&mut *tx, &message).await.unwrap(),
                        Enqueued::Duplicate
                    );
                }
                tx.commit().await.unwrap();
                assert_eq!(rows(pool, &consumer).await, 2);
            }

            /// The same id with another payload is a typed error, and the caller's
            /// transaction goes on: its other writes commit (no aborted PostgreSQL
            /// transaction, no InnoDB rollback).
            #[tokio::test]
            async fn another_payload_under_the_same_id_is_a_conflict_and_the_transaction_goes_on() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new();
                let consumer = unique("outbox-conflict");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let original = cause.outgoing("invoice", "invoices", b"4200").unwrap();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue(&mut *tx, &original).await.unwrap();
                tx.commit().await.unwrap();

                let mut tx = pool.begin().await.unwrap();
                for changed in [
                    cause.outgoing("invoice", "invoices", b"4300").unwrap(),
                    cause.outgoing("invoice", "refunds", b"4200").unwrap(),
                ] {
                    match outbox.enqueue(&mut *tx, &changed).await {
                        Err(OutboxError::Conflict { id }) => assert_eq!(id, original.id()),
                        other => panic!("expected a conflict, got {other:?}"),
                    }
                }
                let effect = unique("effect");
                sqlx::query($effect)
                    .bind(&effect)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                assert_eq!(effects(pool, &effect).await, 1, "the transaction committed");
                let stored = row(pool, original.id()).await.unwrap();
                assert_eq!(
                    (stored.0.as_str(), stored.1.as_slice()),
                    ("invoices", &b"4200"[..])
                );
                let error = OutboxError::Conflict { id: original.id() };
                assert!(error.to_string().contains("use another slot"), "{error}");
            }

            #[tokio::test]
            async fn bad_input_is_refused_and_writes_nothing() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let outbox = Outbox::new().max_payload_len(16);
                let consumer = unique("outbox-refused");
                let cause = Cause::new(&consumer, "evt_1").unwrap();
                let long = "d".repeat(MAX_NAME_LEN + 1);
                // One pair of name `h`: 1 + 1 + 4 bytes and the value, one over the limit.
                let headers = vec![b'h'; MAX_HEADERS_LEN - 5];
                let mut tx = pool.begin().await.unwrap();
                let cases = [
                    cause.nth_outgoing(0, "", b"p"),
                    cause.nth_outgoing(1, "a\0b", b"p"),
                    cause.nth_outgoing(2, &long, b"p"),
                    cause.nth_outgoing(3, "invoices", &[0; 17]),
                    cause
                        .nth_outgoing(4, "invoices", b"p")
                        .header("h", &headers),
                    cause.nth_outgoing(5, "invoices", b"p").ordering_key(""),
                    cause.nth_outgoing(6, "invoices", b"p").header("", "v"),
                    cause
                        .nth_outgoing(7, "invoices", b"p")
                        .header("with space", "v"),
                    cause
                        .nth_outgoing(8, "invoices", b"p")
                        .header("Message-Id", "v"),
                ];
                let mut refusals = Vec::new();
                for message in &cases {
                    match outbox.enqueue(&mut *tx, message).await {
                        Err(OutboxError::Refused(refused)) => refusals.push(refused),
                        other => panic!("expected a refusal, got {other:?}"),
                    }
                }
                tx.commit().await.unwrap();
                assert_eq!(
                    refusals,
                    [
                        Refused::InvalidDestination("it is empty".into()),
                        Refused::InvalidDestination("it contains a NUL byte at 1".into()),
                        Refused::InvalidDestination(
                            "it is 256 bytes, over the limit of 255".into()
                        ),
                        Refused::PayloadTooLarge { len: 17, max: 16 },
                        Refused::HeadersTooLarge {
                            len: MAX_HEADERS_LEN + 1,
                            max: MAX_HEADERS_LEN
                        },
                        Refused::InvalidOrderingKey("it is empty".into()),
                        Refused::InvalidHeader("a header name is empty or over 255 bytes".into()),
                        Refused::InvalidHeader(
                            "the header name \"with space\" has ' ', which a header name cannot \
                             hold (letters, digits and !#$%&'*+-.^_`|~)"
                                .into()
                        ),
                        Refused::InvalidHeader(
                            "the header name \"Message-Id\" is the publishers' own (message-id): \
                             name it otherwise"
                                .into()
                        ),
                    ]
                );
                assert_eq!(
                    OutboxError::Refused(refusals[3].clone()).to_string(),
                    "outgoing message refused by the outbox: the payload is 17 bytes, over \
                     the outbox's limit of 16 bytes: it is refused, never truncated"
                );
                assert_eq!(rows(pool, &consumer).await, 0);
            }

            #[tokio::test]
            async fn a_missing_table_is_a_typed_error() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let outbox = Outbox::new().in_table("outbox_never_created").unwrap();
                let cause = Cause::new("outbox-missing", "evt_1").unwrap();
                let mut conn = pool.acquire().await.unwrap();
                match outbox
                    .enqueue(&mut *conn, &cause.nth_outgoing(0, "invoices", b"p"))
                    .await
                {
                    Err(error @ OutboxError::MissingTable { .. }) => assert!(
                        error.to_string().contains("outbox_never_created"),
                        "{error}"
                    ),
                    other => panic!("expected a missing table, got {other:?}"),
                }
            }

            /// Two transactions enqueue the same message at once: one stores it, the
            /// other waits for it and finds it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_enqueues_of_one_message_store_one_row() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                setup(&pool).await;
                let consumer = unique("outbox-concurrent");
                let barrier = Arc::new(tokio::sync::Barrier::new(2));
                let tasks: Vec<_> = (0..2)
                    .map(|_| {
                        let (pool, consumer, barrier) =
                            (pool.clone(), consumer.clone(), barrier.clone());
                        tokio::spawn(async move {
                            let outbox = Outbox::new();
                            let cause = Cause::new(&consumer, "evt_1").unwrap();
                            let message = cause.nth_outgoing(0, "invoices", b"p");
                            barrier.wait().await;
                            let mut tx = pool.begin_with($begin_writing).await.unwrap();
                            let enqueued = outbox.enqueue(&mut *tx, &message).await.unwrap();
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            tx.commit().await.unwrap();
                            enqueued
                        })
                    })
                    .collect();
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                answers.sort_by_key(|answer| *answer == Enqueued::Duplicate);
                assert_eq!(answers, [Enqueued::Stored, Enqueued::Duplicate]);
                assert_eq!(rows(&pool, &consumer).await, 1);
            }

            /// In an `#[idempotent]` body: the event commits with the effect and the dedup
            /// record; the redelivery is a duplicate and enqueues nothing; a failed body
            /// leaves no event.
            #[tokio::test]
            async fn inside_an_idempotent_body_the_event_commits_with_the_effect() {
                #[idempotent(consumer = "outbox-handler", key = id)]
                async fn handle(tx: &mut $conn, id: &str, fail: bool) -> Result<(), sqlx::Error> {
                    sqlx::query($effect).bind(id).execute(&mut *tx).await?;
                    let cause = Cause::new("outbox-handler", id)?;
                    let event = cause.outgoing("paid", "payments", id.as_bytes())?;
                    Outbox::new().enqueue(&mut *tx, &event).await?;
                    if fail {
                        return Err(sqlx::Error::Protocol("the body failed on purpose".into()));
                    }
                    Ok(())
                }

                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                setup(pool).await;
                let id = unique("evt");
                let event = OutgoingId::derive("outbox-handler", id.as_str(), "paid").unwrap();
                assert!(handle(pool, &id, true).await.is_err());
                assert_eq!(
                    row(pool, event).await,
                    None,
                    "a failed body leaves no event"
                );
                assert_eq!(effects(pool, &id).await, 0);
                assert_eq!(
                    handle(pool, &id, false).await.unwrap(),
                    Outcome::Processed(())
                );
                assert_eq!(
                    handle(pool, &id, false).await.unwrap(),
                    Outcome::Duplicate(Duplicate::AlreadyProcessed)
                );
                let stored = row(pool, event).await.expect("the event");
                assert_eq!(
                    (stored.0.as_str(), stored.1),
                    ("payments", id.clone().into_bytes())
                );
                assert_eq!(effects(pool, &id).await, 1);
                assert_eq!(dedup_suite::claims(pool, "outbox-handler", &id).await, 1);
            }
        }
    };
}

outbox_backends!(enqueue_suite);

/// A handler's own error type, built as the outbox's docs say: one `#[from]` variant for
/// each of the outbox's errors, and `?` at every call — no `map_err`.
#[derive(Debug, thiserror::Error)]
enum PaymentError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Cause(#[from] dedup_runtime::outbox::InvalidCause),
    #[error(transparent)]
    Outbox(#[from] OutboxError),
    #[error("declined")]
    Declined,
}

#[idempotent(consumer = "own-error", key = id)]
async fn pay(
    tx: &mut sqlx::SqliteConnection,
    id: &str,
    payload: &[u8],
    outbox: &Outbox,
) -> Result<(), PaymentError> {
    if payload.is_empty() {
        return Err(PaymentError::Declined);
    }
    let cause = Cause::new("own-error", id)?;
    let event = cause.outgoing("paid", "payments", payload)?;
    outbox.enqueue(&mut *tx, &event).await?;
    Ok(())
}

/// The outbox's errors in a handler's own error type: `?` converts each, the event
/// commits with the dedup row, and `AckPolicy` still sees through the variants — a
/// conflict is dead-lettered, a transient database failure inside `enqueue` retried.
#[tokio::test]
async fn the_outbox_errors_convert_into_the_handlers_own_error_type() {
    use dedup_runtime::{Ack, AckPolicy};

    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    dedup_runtime::outbox::migrate(&*pool).await.unwrap();
    let outbox = Outbox::new();
    let id = unique("own");
    let outcome = pay(&*pool, &id, b"42", &outbox).await.unwrap();
    assert!(matches!(outcome, Outcome::Processed(())), "{outcome:?}");
    let stored: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM outbox_messages WHERE consumer = 'own-error' AND cause_id = ?1",
    )
    .bind(&id)
    .fetch_one(&*pool)
    .await
    .unwrap();
    assert_eq!(stored, 1, "the event committed with the dedup row");

    // The same cause and slot with another payload, under another dedup id: a conflict.
    let cause = Cause::new("own-error", id.as_str()).unwrap();
    let mut tx = pool.begin().await.unwrap();
    let other = cause.outgoing("paid", "payments", b"43").unwrap();
    let conflict: Result<(), PaymentError> = outbox
        .enqueue(&mut *tx, &other)
        .await
        .map(drop)
        .map_err(PaymentError::from);
    drop(tx);
    let policy = AckPolicy::<sqlx::Sqlite>::new();
    assert!(
        matches!(
            conflict,
            Err(PaymentError::Outbox(OutboxError::Conflict { .. }))
        ),
        "{conflict:?}"
    );
    assert_eq!(
        policy.decide_error(&conflict.unwrap_err(), 1),
        Ack::DeadLetter
    );

    // A transient database failure behind the outbox's variant: retried.
    let transient = PaymentError::from(OutboxError::Database(sqlx::Error::PoolTimedOut));
    assert!(matches!(
        policy.decide_error(&transient, 1),
        Ack::Retry { .. }
    ));
    let refused = PaymentError::from(Cause::new("own-error", "").unwrap_err());
    assert_eq!(policy.decide_error(&refused, 1), Ack::DeadLetter);
}
