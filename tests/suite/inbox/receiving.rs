//! The inbox receiving, on every backend: the same id three times is one row; two
//! consumers of one message each get it; payloads and headers round-trip byte for byte; a
//! batch answers per message, in order, with in-batch duplicates, earlier duplicates and
//! refused messages told apart, and one longer than a statement is stored in chunks; bad
//! ids and oversized payloads are typed refusals that write nothing, and a missing table a
//! typed error; concurrent receivers of the same ids store each once.

use dedup_runtime::InvalidMessageId;
use dedup_runtime::inbox::{
    DEFAULT_MAX_PAYLOAD_LEN, Inbox, InboxError, Incoming, MAX_BATCH, Received, Refused,
};
use dedup_suite::unique;

macro_rules! receiving_suite {
    (
        $backend:ident,
        db = $db:ty,
        conn = $conn:ty,
        pool = $pool:expr,
        row = $row:literal,
        count = $count:literal,
        effects = $effects:literal,
        effect = $effect:literal,
        group = $group:literal,
        state = $state:literal,
        expire = $expire:literal,
        age = $age:literal,
        url = |$db_ident:ident| $url:expr,
        $(takeover_mid_handler = $takeover:literal,)?
    ) => {
        mod $backend {
            use super::*;
            use crate::inbox::common::$backend::*;

            #[tokio::test]
            async fn the_same_id_three_times_is_one_pending_row() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-thrice");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let answers = [
                    inbox
                        .receive(Incoming::new("evt_1", b"first"))
                        .await
                        .unwrap(),
                    inbox
                        .receive(Incoming::new("evt_1", b"second"))
                        .await
                        .unwrap(),
                    inbox
                        .receive(Incoming::new("evt_1", b"third"))
                        .await
                        .unwrap(),
                ];
                assert_eq!(
                    answers,
                    [Received::Stored, Received::Duplicate, Received::Duplicate]
                );
                assert_eq!(rows(pool, &consumer).await, 1);
                let stored = row(pool, &consumer, "evt_1").await.unwrap();
                assert_eq!(
                    stored,
                    (Some(b"first".to_vec()), None, 0, 0),
                    "the first copy, pending"
                );
            }

            #[tokio::test]
            async fn two_consumers_of_one_message_each_store_it() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let (billing, shipping) = (unique("inbox-billing"), unique("inbox-shipping"));
                for consumer in [&billing, &shipping] {
                    let inbox = Inbox::new(pool, consumer).unwrap();
                    assert_eq!(
                        inbox.receive(Incoming::new("evt_7", b"x")).await.unwrap(),
                        Received::Stored
                    );
                    assert_eq!(rows(pool, consumer).await, 1);
                }
            }

            #[tokio::test]
            async fn payloads_and_headers_round_trip_byte_for_byte() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-bytes");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let binary: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
                let json =
                    "{\"name\": \"Zoë\", \"emoji\": \"🦀\", \"nul\": \"\\u0000\"}".as_bytes();
                let headers = b"{\"traceparent\": \"00-4bf92f3577b34da6-00f067aa0ba902b7-01\"}";
                let empty: &[u8] = b"";
                inbox
                    .receive(Incoming::new("binary", &binary))
                    .await
                    .unwrap();
                inbox
                    .receive(Incoming::new("json", json).headers(headers))
                    .await
                    .unwrap();
                inbox
                    .receive(Incoming::new("empty", empty).headers(empty))
                    .await
                    .unwrap();
                assert_eq!(
                    row(pool, &consumer, "binary").await.unwrap().0.as_deref(),
                    Some(&binary[..])
                );
                let (payload, stored_headers, _, _) = row(pool, &consumer, "json").await.unwrap();
                assert_eq!(payload.as_deref(), Some(json));
                assert_eq!(stored_headers.as_deref(), Some(&headers[..]));
                let (payload, stored_headers, _, _) = row(pool, &consumer, "empty").await.unwrap();
                assert_eq!(
                    (payload.as_deref(), stored_headers.as_deref()),
                    (Some(empty), Some(empty))
                );
            }

            #[tokio::test]
            async fn a_batch_answers_each_message_in_order() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-batch");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                inbox
                    .receive(Incoming::new("old", b"stored before"))
                    .await
                    .unwrap();
                let big = vec![7u8; DEFAULT_MAX_PAYLOAD_LEN + 1];
                let answers = inbox
                    .receive_batch(&[
                        Incoming::new("a", b"1"),
                        Incoming::new("old", b"again"),
                        Incoming::new("b", b"2"),
                        Incoming::new("a", b"1 again"),
                        Incoming::new("", b"no id"),
                        Incoming::new("big", &big),
                        Incoming::new("b", b"2 again"),
                    ])
                    .await
                    .unwrap();
                assert_eq!(
                    answers,
                    vec![
                        Ok(Received::Stored),
                        Ok(Received::Duplicate),
                        Ok(Received::Stored),
                        Ok(Received::DuplicateInBatch { first: 0 }),
                        Err(Refused::InvalidMessageId(InvalidMessageId::Empty)),
                        Err(Refused::PayloadTooLarge {
                            len: DEFAULT_MAX_PAYLOAD_LEN + 1,
                            max: DEFAULT_MAX_PAYLOAD_LEN
                        }),
                        Ok(Received::DuplicateInBatch { first: 2 }),
                    ]
                );
                assert_eq!(rows(pool, &consumer).await, 3, "old, a, b");
                assert_eq!(
                    row(pool, &consumer, "a").await.unwrap().0.as_deref(),
                    Some(&b"1"[..])
                );
                assert_eq!(
                    row(pool, &consumer, "old").await.unwrap().0.as_deref(),
                    Some(&b"stored before"[..])
                );
                assert!(row(pool, &consumer, "big").await.is_none());
            }

            #[tokio::test]
            async fn a_batch_longer_than_one_statement_is_stored_in_chunks() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-chunks");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let count = 2 * MAX_BATCH + 10;
                let ids: Vec<String> = (0..count).map(|n| format!("m{n}")).collect();
                let payloads: Vec<Vec<u8>> =
                    (0..count).map(|n| n.to_string().into_bytes()).collect();
                let batch: Vec<Incoming<'_>> = ids
                    .iter()
                    .zip(&payloads)
                    .map(|(id, payload)| Incoming::new(id.as_str(), payload))
                    .collect();
                let first = inbox.receive_batch(&batch[..MAX_BATCH / 2]).await.unwrap();
                assert!(first.iter().all(|answer| *answer == Ok(Received::Stored)));
                let answers = inbox.receive_batch(&batch).await.unwrap();
                assert_eq!(answers.len(), count);
                for (n, answer) in answers.iter().enumerate() {
                    let expected = if n < MAX_BATCH / 2 {
                        Received::Duplicate
                    } else {
                        Received::Stored
                    };
                    assert_eq!(*answer, Ok(expected), "message {n}");
                }
                assert_eq!(rows(pool, &consumer).await, count as i64);
                assert_eq!(
                    row(pool, &consumer, "m2009").await.unwrap().0.as_deref(),
                    Some(&b"2009"[..])
                );
            }

            #[tokio::test]
            async fn bad_ids_and_oversized_payloads_are_refused_and_write_nothing() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                dedup_runtime::inbox::migrate(pool).await.unwrap();
                let consumer = unique("inbox-refused");
                let inbox = Inbox::new(pool, &consumer).unwrap();
                let long = "x".repeat(dedup_runtime::MAX_MESSAGE_ID_LEN + 1);
                for id in ["", "a\0b", long.as_str()] {
                    let refused = inbox.receive(Incoming::new(id, b"p")).await.unwrap_err();
                    assert!(
                        matches!(refused, InboxError::Refused(Refused::InvalidMessageId(_))),
                        "{refused:?}"
                    );
                    assert!(
                        InvalidMessageId::find(&refused).is_some(),
                        "found through the chain"
                    );
                }
                let small = inbox.clone().max_payload_len(4);
                let refused = small
                    .receive(Incoming::new("five", b"12345"))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(
                        refused,
                        InboxError::Refused(Refused::PayloadTooLarge { len: 5, max: 4 })
                    ),
                    "{refused:?}"
                );
                assert!(
                    refused.to_string().contains("limit of 4 bytes"),
                    "{refused}"
                );
                let headers = vec![b'h'; dedup_runtime::inbox::MAX_HEADERS_LEN + 1];
                let refused = inbox
                    .receive(Incoming::new("h", b"p").headers(&headers))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(
                        refused,
                        InboxError::Refused(Refused::HeadersTooLarge { .. })
                    ),
                    "{refused:?}"
                );
                assert_eq!(rows(pool, &consumer).await, 0);
                assert_eq!(
                    small.receive(Incoming::new("four", b"1234")).await.unwrap(),
                    Received::Stored
                );
                assert!(Inbox::new(pool, "").is_err(), "an invalid consumer");
            }

            #[tokio::test]
            async fn a_missing_table_is_a_typed_error() {
                let db = $pool;
                let pool: &sqlx::Pool<$db> = &db;
                let inbox = Inbox::new(pool, "inbox-missing")
                    .unwrap()
                    .in_table("dedup_no_such_inbox")
                    .unwrap();
                let error = inbox.receive(Incoming::new("evt", b"p")).await.unwrap_err();
                assert!(
                    matches!(error, InboxError::MissingTable { .. }),
                    "{error:?}"
                );
            }

            /// Two receivers of the same 200 ids at once (a broker redelivering to another
            /// consumer process): each id is one row and exactly one `Stored` answer.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_receivers_store_each_id_once() {
                let db = $pool;
                let pool: sqlx::Pool<$db> = (*db).clone();
                dedup_runtime::inbox::migrate(&pool).await.unwrap();
                let consumer = unique("inbox-concurrent");
                let receiver = |batched: bool| {
                    let (pool, consumer) = (pool.clone(), consumer.clone());
                    tokio::spawn(async move {
                        let inbox = Inbox::new(&pool, &consumer).unwrap();
                        let ids: Vec<String> = (0..200).map(|n| format!("c{n}")).collect();
                        let mut stored = Vec::new();
                        if batched {
                            for chunk in ids.chunks(10) {
                                let batch: Vec<Incoming<'_>> = chunk
                                    .iter()
                                    .map(|id| Incoming::new(id.as_str(), b"p"))
                                    .collect();
                                for (id, answer) in
                                    chunk.iter().zip(inbox.receive_batch(&batch).await.unwrap())
                                {
                                    if answer == Ok(Received::Stored) {
                                        stored.push(id.clone());
                                    }
                                }
                            }
                        } else {
                            for id in &ids {
                                if inbox
                                    .receive(Incoming::new(id.as_str(), b"p"))
                                    .await
                                    .unwrap()
                                    == Received::Stored
                                {
                                    stored.push(id.clone());
                                }
                            }
                        }
                        stored
                    })
                };
                let (one, two) = (receiver(false), receiver(true));
                let (one, two) = (one.await.unwrap(), two.await.unwrap());
                let mut all: Vec<String> = one.into_iter().chain(two).collect();
                all.sort();
                let before = all.len();
                all.dedup();
                assert_eq!(before, 200, "exactly one Stored answer per id");
                assert_eq!(all.len(), 200);
                assert_eq!(rows(&pool, &consumer).await, 200);
            }
        }
    };
}

inbox_backends!(receiving_suite);
