//! Issue 39, item 1: the RabbitMQ publisher sent a claim all at once, then awaited the
//! confirms, and took a message returned as unroutable (`mandatory`, no queue bound) for
//! the return of whichever confirm completed next. RabbitMQ returns an unroutable message
//! at once, before the confirms of messages published earlier, and lapin hands a return
//! to the next confirm it completes: in claims of 60 rows with every third routed to
//! nowhere, 1–4 unroutable rows were marked sent (on no queue: lost) and as many routed
//! rows failed and were sent again. A return is now matched to its row by the
//! `message-id` it carries. Checked with what the queue really received.

use std::collections::BTreeSet;

use dedup_runtime::lapin::RabbitMqPublisher;
use dedup_runtime::outbox::{Cause, Outbox};
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};

const ROWS: u32 = 60;
const CLAIMS: usize = 5;

#[tokio::test]
async fn an_unroutable_row_in_a_mixed_claim_fails_alone() {
    let url = std::env::var("DEDUP_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|error| panic!("RabbitMQ is not reachable at {url}: {error}"));
    let setup = connection.create_channel().await.unwrap();
    let publisher = RabbitMqPublisher::connect(&url, ConnectionProperties::default(), "")
        .await
        .unwrap();
    for claim in 0..CLAIMS {
        let queue = dedup_suite::unique("regress-returns");
        dedup_suite::rabbitmq::declare(&setup, &queue, false).await;
        let nowhere = dedup_suite::unique("regress-returns-nowhere");
        let db = dedup_suite::sqlite().await;
        dedup_runtime::outbox::migrate(&*db).await.unwrap();
        let outbox = Outbox::new();
        let cause = Cause::new("regress-returns", dedup_suite::unique("evt")).unwrap();
        let (mut routed, mut unroutable) = (BTreeSet::new(), BTreeSet::new());
        let mut tx = db.begin().await.unwrap();
        for slot in 0..ROWS {
            let to_nowhere = slot % 3 == 2;
            let destination = if to_nowhere { &nowhere } else { &queue };
            let message = cause.nth_outgoing(slot, destination, b"p");
            outbox.enqueue(&mut *tx, &message).await.unwrap();
            let id = message.id().to_string();
            if to_nowhere {
                unroutable.insert(id);
            } else {
                routed.insert(id);
            }
        }
        tx.commit().await.unwrap();

        let relayed = outbox.relay(&*db).relay_batch(&publisher).await.unwrap();
        assert_eq!(relayed.claimed, ROWS as usize, "claim {claim}: one claim");
        assert_eq!(
            (relayed.sent, relayed.failed),
            (routed.len(), unroutable.len()),
            "claim {claim}: {relayed:?}"
        );
        let rows: Vec<(Vec<u8>, i64, Option<String>)> =
            sqlx::query_as("SELECT id, state, last_error FROM outbox_messages")
                .fetch_all(&*db)
                .await
                .unwrap();
        for (id, state, last_error) in rows {
            let id = uuid::Uuid::from_slice(&id).unwrap().to_string();
            if routed.contains(&id) {
                assert_eq!(state, 2, "claim {claim}: routed row {id} marked sent");
            } else {
                assert_eq!(
                    state, 0,
                    "claim {claim}: unroutable row {id} not marked sent"
                );
                assert!(
                    last_error.is_some_and(|error| error.contains("nothing routed it")),
                    "claim {claim}: {id} failed as returned"
                );
            }
        }
        // The queue holds every routed row once, and nothing else.
        let mut received = BTreeSet::new();
        while let Some(message) = setup
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let id = message.properties.message_id().clone().unwrap().to_string();
            assert!(received.insert(id), "claim {claim}: a row received twice");
        }
        assert_eq!(received, routed, "claim {claim}: what the queue received");
        for name in [queue.clone(), format!("{queue}.dead")] {
            setup
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
    }
}
