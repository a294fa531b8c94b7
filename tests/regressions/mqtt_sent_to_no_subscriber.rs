//! Issue 40: on MQTT 3.1.1 a `PUBACK` says only that the broker took the message, and an
//! MQTT broker keeps a message only for the sessions subscribed to its topic: the
//! outbox's publisher marked a row sent that went nowhere, and the consumer acknowledged
//! the original of a dead letter that went nowhere — a lost message either way, counted
//! as delivered. On MQTT 5 the `PUBACK` says *no matching subscribers*: the row is not
//! marked sent, and the original of such a dead letter stays unacknowledged in its
//! session until the dead topic has a subscriber.

use std::sync::Arc;
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_runtime::rumqttc::{MqttConsumer, MqttPublisher};
use dedup_suite::mosquitto::{Mosquitto, collect, publish, session, wire};
use rumqttc::v5::MqttOptions;

/// Never runs its body here: the message has no id, which the claim refuses.
#[dedup_runtime::idempotent(consumer = "regress-dead", key = msg.id())]
async fn apply(tx: &mut sqlx::SqliteConnection, msg: &Message) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

#[tokio::test]
async fn a_row_to_a_topic_without_subscribers_is_not_marked_sent() {
    let broker = Mosquitto::start(&dedup_suite::unique("regress-nobody"), "");
    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("regress-nobody", dedup_suite::unique("evt")).unwrap();
    let message = cause.outgoing("event", "nobody/listens", b"lost?").unwrap();
    let mut tx = db.begin().await.unwrap();
    outbox.enqueue(&mut *tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    let options = MqttOptions::new(dedup_suite::unique("relay"), "127.0.0.1", broker.port());
    let relayed = outbox
        .relay(&*db)
        .relay_batch(&MqttPublisher::new(options))
        .await
        .unwrap();
    assert_eq!((relayed.sent, relayed.failed), (0, 1), "{relayed:?}");
    let state: i64 = sqlx::query_scalar("SELECT state FROM outbox_messages WHERE id = ?1")
        .bind(&message.id().as_uuid().as_bytes()[..])
        .fetch_one(&*db)
        .await
        .unwrap();
    assert_ne!(state, 2, "not marked sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_nobody_receives_leaves_the_original_unacknowledged() {
    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    let broker = Mosquitto::start(&dedup_suite::unique("regress-dead"), "");
    let topic = dedup_suite::unique("dead-nowhere");
    let client_id = dedup_suite::unique("consumer");
    session(broker.port(), &client_id, &topic).await;
    // No id: the handler refuses it, and the policy dead-letters it.
    publish(broker.port(), &topic, &[wire(None, b"poison")]).await;
    let handler =
        |pool: sqlx::SqlitePool, msg: Arc<Message>| async move { apply(&pool, &msg).await };
    let options = MqttOptions::new(&client_id, "127.0.0.1", broker.port());
    let consumer = MqttConsumer::new(options, &topic);
    let consumed = consumer
        .run(&*pool, handler, tokio::time::sleep(Duration::from_secs(2)))
        .await
        .unwrap();
    assert_eq!(consumed.dead_lettered, 0, "{consumed:?}");
    assert!(consumed.dropped >= 1, "{consumed:?}");
    // The dead topic gets a subscriber: the next run dead-letters it, and acknowledges it.
    let dead_id = dedup_suite::unique("dead");
    let dead_topic = format!("{topic}/dead");
    session(broker.port(), &dead_id, &dead_topic).await;
    let consumed = consumer
        .run(&*pool, handler, tokio::time::sleep(Duration::from_secs(2)))
        .await
        .unwrap();
    assert_eq!(consumed.dead_lettered, 1, "{consumed:?}");
    let dead = collect(broker.port(), &dead_id, &dead_topic).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1, b"poison");
    assert!(collect(broker.port(), &client_id, &topic).await.is_empty());
}
