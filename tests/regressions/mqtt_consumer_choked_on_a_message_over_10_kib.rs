//! Issue 40: the hosted MQTT consumer connected with the caller's `MqttOptions` as they
//! were, and rumqttc reads at most 10 KiB per packet unless told otherwise: a larger
//! message failed the connection each time the broker sent it, the consumer connected
//! again, and the session sent it again — the subscription stuck behind it for ever,
//! nothing dead-lettered. Now the consumer announces MQTT's own limit when the options
//! set none, and a 1 MiB message (NUL bytes in it) reaches the handler byte for byte.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::rumqttc::MqttConsumer;
use dedup_suite::mosquitto::{Mosquitto, collect, publish, session, wire};
use rumqttc::v5::MqttOptions;

#[dedup_runtime::idempotent(consumer = "mqtt-large", key = msg.id())]
async fn apply(tx: &mut sqlx::SqliteConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("CREATE TABLE IF NOT EXISTS mqtt_large (body BLOB NOT NULL)")
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO mqtt_large (body) VALUES (?1)")
        .bind(msg.payload())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_message_reaches_the_handler() {
    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    let broker = Mosquitto::start(&dedup_suite::unique("regress-large"), "");
    let topic = dedup_suite::unique("large");
    let client_id = dedup_suite::unique("consumer");
    session(broker.port(), &client_id, &topic).await;
    let body: Vec<u8> = (0..1 << 20).map(|n| (n % 251) as u8).collect();
    let id = dedup_suite::unique("big");
    publish(broker.port(), &topic, &[wire(Some(&id), &body)]).await;

    let seen = Arc::new(Mutex::new(0usize));
    let handler = {
        let seen = seen.clone();
        move |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let seen = seen.clone();
            async move {
                let outcome = apply(&pool, &msg).await;
                *seen.lock().unwrap() += 1;
                outcome
            }
        }
    };
    let done = {
        let seen = seen.clone();
        async move {
            while *seen.lock().unwrap() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let options = MqttOptions::new(&client_id, "127.0.0.1", broker.port());
    let consumed = tokio::time::timeout(
        Duration::from_secs(30),
        MqttConsumer::new(options, &topic).run(&*pool, handler, done),
    )
    .await
    .expect("the message handled within 30 s")
    .unwrap();
    assert_eq!(
        (consumed.acknowledged, consumed.reconnects),
        (1, 0),
        "{consumed:?}"
    );
    let stored: Vec<u8> = sqlx::query_scalar("SELECT body FROM mqtt_large")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert!(
        stored == body,
        "byte for byte: {} bytes stored",
        stored.len()
    );
    assert_eq!(dedup_suite::claims(&*pool, "mqtt-large", &id).await, 1);
    assert!(
        collect(broker.port(), &client_id, &topic).await.is_empty(),
        "acknowledged: nothing left in the session"
    );
}
