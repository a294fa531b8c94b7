//! MQTT: a persistent session on a Mosquitto of the test's own.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use dedup_suite::Shuffle;

use ::rumqttc::{
    AsyncClient, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS, SubscribeReasonCode,
};
use dedup_suite::mosquitto::Mosquitto;

use crate::checks::*;
use crate::harness::*;

/// The broker's `max_inflight_messages`: QoS 1 messages it sends to a client ahead of
/// the client's `PUBACK`s (Mosquitto's default is 20). The consumer handles them one at
/// a time; a kill leaves up to this many to come back with the DUP flag.
const MAX_INFLIGHT: usize = 16;
/// The consumer's client id (its persistent session) and the dead-letter checker's.
const CLIENT_ID: &str = "crash-harness";
const DEAD_CLIENT_ID: &str = "crash-harness-dead";

/// A connection under `client_id` (persistent session unless `clean`), connected: the
/// event loop has returned the CONNACK, whose `session_present` comes back too.
async fn connect(
    port: u16,
    client_id: &str,
    clean: bool,
    manual_acks: bool,
) -> (AsyncClient, EventLoop, bool) {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options
        .set_clean_session(clean)
        .set_manual_acks(manual_acks)
        .set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut eventloop) = AsyncClient::new(options, 64);
    match eventloop.poll().await {
        Ok(Event::Incoming(Packet::ConnAck(connack))) => {
            (client, eventloop, connack.session_present)
        }
        other => panic!("connect to Mosquitto on port {port} as {client_id}: {other:?}"),
    }
}

/// Polls until our DISCONNECT is out.
async fn disconnect(client: &AsyncClient, eventloop: &mut EventLoop) {
    client.disconnect().await.expect("DISCONNECT");
    loop {
        match eventloop.poll().await {
            Ok(Event::Outgoing(Outgoing::Disconnect)) => return,
            Ok(_) => {}
            Err(error) => panic!("MQTT connection before DISCONNECT: {error}"),
        }
    }
}

/// Creates the persistent session `client_id` subscribed to `topic` at QoS 1, as the
/// consumer would, so that the broker queues for it what is published from now on.
async fn session(port: u16, client_id: &str, topic: &str) {
    let (client, mut eventloop, _) = connect(port, client_id, false, true).await;
    client
        .subscribe(topic, QoS::AtLeastOnce)
        .await
        .expect("SUBSCRIBE");
    loop {
        match eventloop.poll().await.expect("MQTT connection") {
            Event::Incoming(Packet::SubAck(suback)) => {
                assert_eq!(
                    suback.return_codes,
                    [SubscribeReasonCode::Success(QoS::AtLeastOnce)],
                    "the subscription of {client_id} to {topic}"
                );
                break;
            }
            Event::Incoming(Packet::Publish(publish)) => {
                panic!("{client_id}: a message before any was published: {publish:?}")
            }
            _ => {}
        }
    }
    disconnect(&client, &mut eventloop).await;
}

/// The payload `examples/mqtt.rs` reads: `<id>\n<body>`, or the body alone for a
/// message without an id.
fn payload(message: &Publish) -> Vec<u8> {
    match &message.id {
        Some(id) => format!("{id}\n{}", message.body).into_bytes(),
        None => message.body.clone().into_bytes(),
    }
}

/// Publishes `published` to `topic` at QoS 1, waiting for every PUBACK.
async fn publish_all(port: u16, topic: &str, published: &[Publish]) {
    let (client, mut eventloop, _) = connect(port, "crash-harness-publisher", true, false).await;
    let sending = async {
        for message in published {
            client
                .publish(topic, QoS::AtLeastOnce, false, payload(message))
                .await
                .expect("PUBLISH");
        }
    };
    let confirming = async {
        let mut confirmed = 0;
        while confirmed < published.len() {
            if let Event::Incoming(Packet::PubAck(_)) =
                eventloop.poll().await.expect("MQTT connection")
            {
                confirmed += 1;
            }
        }
    };
    tokio::join!(sending, confirming);
    disconnect(&client, &mut eventloop).await;
}

/// Reconnects to the persistent session `client_id` (which must exist) and collects
/// the payloads that arrive until none has for `quiet`; acknowledges them if `ack`.
async fn drain(port: u16, client_id: &str, ack: bool, quiet: Duration) -> Vec<Vec<u8>> {
    let (client, mut eventloop, session_present) = connect(port, client_id, false, !ack).await;
    assert!(
        session_present,
        "the broker has no session for {client_id}: checking it would prove nothing"
    );
    let mut payloads = Vec::new();
    loop {
        match tokio::time::timeout(quiet, eventloop.poll()).await {
            Err(_) => break,
            Ok(Ok(Event::Incoming(Packet::Publish(publish)))) => {
                payloads.push(publish.payload.to_vec());
            }
            Ok(Ok(_)) => {}
            Ok(Err(error)) => panic!("MQTT connection of {client_id}: {error}"),
        }
    }
    disconnect(&client, &mut eventloop).await;
    payloads
}

/// The crash harness on MQTT: `examples/mqtt.rs`, one persistent session (QoS 1,
/// manual acknowledgements, one message at a time), on a Mosquitto of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_consumer_is_effectively_once_under_sigkill() {
    let _lane = BUSY.lock().await;
    let started = Instant::now();
    let scale = Scale::from_env();
    let run = dedup_suite::unique("mqtt");
    let topic = format!("dedup-crash/{run}");
    let dead_topic = format!("{topic}/dead");
    // A Mosquitto of the test's own (`dedup_suite::mosquitto`): the machine's keeps at
    // most 1,000 queued messages per offline session and drops the rest, which would
    // lose messages of a 5,000-message run for the broker's reason, not the consumer's.
    let broker = Mosquitto::start(&run, &format!("max_inflight_messages {MAX_INFLIGHT}"));
    let port = broker.port();
    let pool = dedup_suite::postgres().await;

    // The sessions first, so that the broker queues every message for the consumer
    // and every dead letter for the checker.
    session(port, CLIENT_ID, &topic).await;
    session(port, DEAD_CLIENT_ID, &dead_topic).await;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS mqtt_example_effects (message_id text NOT NULL, \
         body text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await
    .expect("create the effects table");

    let published = plan(&run, &scale, &mut Shuffle::new(scale.seed));
    publish_all(port, &topic, &published).await;

    let env = vec![
        ("MQTT_URL", format!("mqtt://127.0.0.1:{port}")),
        ("DATABASE_URL", database_url()),
        ("TOPIC", topic.clone()),
        ("CLIENT_ID", CLIENT_ID.to_owned()),
        ("DEDUP_CRASH_WINDOW_MS", CRASH_WINDOW_MS.to_owned()),
    ];
    // Nothing to outlast: the broker sends a session's messages as soon as it
    // reconnects. 1.5 s also covers the first in-process retry's backoff (1 s).
    let idle = Duration::from_millis(1500);
    let under_test = Subject {
        example: "mqtt",
        effects_table: "mqtt_example_effects",
        consumer: "mqtt-example",
    };
    let (tally, stored) =
        crash_and_check(&pool, &under_test, env, &scale, idle, &run, &published).await;
    // Nothing left for the consumer: no message queued or unacknowledged (which the
    // broker would send again on this reconnect, with the DUP flag). Not acknowledged
    // here, should there be any.
    let left = drain(port, CLIENT_ID, false, Duration::from_millis(1500)).await;
    assert!(
        left.is_empty(),
        "{} messages left for the consumer's session, first: {:?}",
        left.len(),
        left.first()
            .map(|payload| String::from_utf8_lossy(payload).into_owned())
    );
    let dead = drain(port, DEAD_CLIENT_ID, true, Duration::from_millis(1000)).await;
    let dead_bodies: HashSet<String> = dead
        .iter()
        .map(|payload| String::from_utf8_lossy(payload).into_owned())
        .collect();
    // A crash between the copy to the dead-letter topic and the PUBACK copies a poison
    // message again on its redelivery: at least once each, nothing else.
    assert_eq!(
        dead_bodies,
        poison_bodies(),
        "the dead-letter topic got the poison messages and nothing else"
    );
    report(
        "MQTT (Mosquitto)",
        &published,
        &stored,
        &tally,
        &scale,
        dead.len(),
        &format!(
            "session {CLIENT_ID}: nothing queued or unacknowledged on reconnect \
             (max_inflight_messages {MAX_INFLIGHT}, max_queued_messages 0)"
        ),
        started.elapsed(),
    );
    drop(broker);
    forget_run(&pool, "mqtt_example_effects", "mqtt-example", &run).await;
}
