//! An effectively-once MQTT consumer: rumqttc (MQTT 3.1.1), a persistent session, a QoS 1
//! subscription with manual acknowledgements, `PUBACK` after the commit, and an
//! `#[idempotent]` handler writing to PostgreSQL.
//!
//! Each message's effect is one row in `mqtt_example_effects`, a table with no unique
//! constraint: only the dedup record, committed in the same transaction as the row, stands
//! between a redelivery and a second row. Kill the consumer whenever you like (`kill -9`
//! included): the session (`CLIENT_ID`, clean session off) outlives the connection, the
//! broker keeps what it had sent and not had acknowledged, and sends it again, with the DUP
//! flag, when the restarted process connects; a message whose transaction had committed
//! comes back as a duplicate and is only acknowledged.
//!
//! ```text
//! cargo run --features brokers --example mqtt -- publish 1000   # 1,000 messages, sent twice
//! cargo run --features brokers --example mqtt                   # consume; kill, run again …
//! ```
//!
//! Configuration, from the environment:
//!
//! | variable | default | |
//! | --- | --- | --- |
//! | `MQTT_URL` | `mqtt://127.0.0.1:1883` | the broker, `mqtt://host:port`: plain TCP, no credentials |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` | PostgreSQL |
//! | `TOPIC` | `dedup-example/payments` | the topic subscribed to at QoS 1: a topic name, no wildcards (`TOPIC/dead` is the dead-letter topic) |
//! | `CLIENT_ID` | `dedup-example` | the persistent session: a restarted process takes it back, with the messages queued for it |
//! | `DEDUP_EXIT_WHEN_IDLE_MS` | unset: run forever | exit cleanly after this long without a delivery |
//! | `DEDUP_CRASH_WINDOW_MS` | `0` | testing: pause between COMMIT and the `PUBACK` |
//!
//! One process per `CLIENT_ID`: a second connection with the same id takes the session
//! over, and the broker closes the first. A lost connection ends the process (with an
//! error): run it under a supervisor that restarts it. It does not reconnect by itself,
//! because the deliveries it still holds belong to the old connection: the broker sends
//! them again on the new one, under packet ids that it may by then have given to other
//! messages, and a `PUBACK` of the old delivery would acknowledge another message.
//!
//! **Acknowledgements are manual** (`set_manual_acks(true)`). rumqttc's default sends the
//! `PUBACK` as soon as the `PUBLISH` arrives, before the handler has run: a crash then loses
//! the message, which the broker considers delivered. Here the `PUBACK` goes out only after
//! the transaction has committed (and `acked` is printed once rumqttc has written it to
//! the socket). MQTT wants `PUBACK`s in the order the `PUBLISH`es came, so the consumer
//! handles **one message at a time, in order**: no concurrency within a session. Throughput
//! comes from several sessions on several topics (or shared subscriptions, which this
//! example does not use).
//!
//! **The message id is in the payload**: the payload is `<id>\n<body>`, the id being the
//! first line (UTF-8), the body everything after the first `\n`. A payload without a `\n`
//! has no id (all of it is the body), and neither has one whose first line is empty or not
//! UTF-8. It is not the MQTT packet id: that one identifies an exchange on one session, and
//! the broker reuses it for other messages as soon as the exchange is done, and a producer
//! that publishes again after a lost `PUBACK` sends a new message anyway. A message without
//! an id is poison: the handler refuses its empty id (`InvalidMessageId`, a permanent
//! error) and it is dead-lettered.
//!
//! Dead letters are published to `TOPIC/dead` at QoS 1, the original payload unchanged;
//! once the broker has acknowledged that copy with its `PUBACK`, the original is
//! acknowledged. A crash in between redelivers the original, and `TOPIC/dead` may then get
//! it twice, never zero times. (Only subscribers of `TOPIC/dead` — with a persistent
//! session of their own, created before the dead letters come — get them: MQTT keeps no
//! message for a topic nobody is subscribed to.)
//!
//! What each outcome does to the message (the mapping is `dedup_runtime::AckPolicy`'s):
//!
//! | handler result | `AckPolicy` says | MQTT |
//! | --- | --- | --- |
//! | `Outcome::Processed` / `Outcome::Duplicate` | `Ack::Ack` | `PUBACK` |
//! | transient error (database contended or away) | `Ack::Retry { after }` | nothing yet: wait `after`, run the handler again, in this process, until it succeeds or fails for good |
//! | permanent error (bad or missing id, failing body) | `Ack::DeadLetter` | copy to `TOPIC/dead` (QoS 1, its `PUBACK` awaited), then `PUBACK` |
//!
//! **Transient errors are retried in process, without a bound.** MQTT has no negative
//! acknowledgement and delivers a message again only on a new connection; and since
//! `PUBACK`s go in order, the messages behind a failing one cannot be acknowledged before
//! it either. So the consumer keeps the message and retries with the policy's backoff (1 s,
//! doubling, at most 60 s; the count of attempts in this process is what `decide` is given):
//! the session stalls while the database is away, and goes on when it is back. Dropping to
//! the dead-letter topic after a few tries would park good messages during an outage.
//!
//! **There is no delivery count.** MQTT 3.1.1 has none (nor has 5), only the DUP flag of a
//! `PUBLISH` sent again; the `delivered` line says `2` for a DUP delivery ("at least the
//! second") and `1` otherwise. DUP over-counts: Mosquitto 2.0.11, on a reconnect, sends
//! every message queued for the session with DUP set, sent before or not (seen here: 36 of
//! 36 after a kill, with 16 in flight at most). Permanent errors need no count (they are dead-lettered on
//! their first delivery), and transient ones are retried as above; what is *not* bounded is
//! a message that kills the process every time it is handled: it comes back on every
//! restart. A count kept in process would not see that (a crash resets it); bound it
//! outside, in the supervisor that restarts the process.
//!
//! **The broker can drop messages**: Mosquitto keeps at most `max_queued_messages` (default
//! 1000) QoS 1 messages queued per session beyond those in flight, and silently drops the
//! rest — for a consumer that is disconnected, or just behind. A persistent session is
//! only as durable as that limit (and `max_queued_bytes`, and `persistence`, for a broker
//! restart) allow: raise it (`0` is no limit) for a consumer that must not lose messages.
//!
//! **QoS 2 would not make the database write exactly-once.** QoS 2's four-packet handshake
//! (`PUBLISH`, `PUBREC`, `PUBREL`, `PUBCOMP`) gives exactly-once delivery between the
//! broker and the client's session, and no further: the client must keep the packet ids
//! it has received (rumqttc keeps them in memory). A commit before the client's `PUBREC`
//! gets the message delivered again when the process dies in between, exactly as with QoS
//! 1; a commit after it loses the message when the process dies in between. And a
//! producer that publishes again after a lost acknowledgement makes a new message, which
//! no QoS recognises. The dedup record in the effect's transaction is what makes the
//! effect happen once either way, so this example uses QoS 1.
//!
//! The consumer reports what it does on standard output, one line per step, which the
//! crash harness in `tests/brokers/` reads: `ready` (the subscription confirmed),
//! `delivered <1, or 2 for a DUP delivery> <id>`, `committed <id>`, `duplicate <id>`,
//! `acked <id>`, `retry <id>`, `dead <id> <body>` (an empty id is written `-`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dedup_runtime::{Ack, AckPolicy, Outcome, idempotent};
use dedup_suite::consumer::{self, Error, report};
use rumqttc::{
    AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, NetworkOptions, Outgoing, Packet,
    Publish, QoS, SubscribeReasonCode,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, watch};

/// How long the consumer waits for rumqttc to write a `PUBACK`, or for the broker to
/// acknowledge a dead letter, before it gives up (and exits).
const WIRE_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest packet sent or received.
const MAX_PACKET: usize = 1024 * 1024;

/// One message: its id (the dedup key) and its body.
struct Message {
    id: String,
    body: String,
}

impl Message {
    /// `<id>\n<body>`: the id is the first line. Without a `\n`, or with a first line that
    /// is empty or not UTF-8, the id is empty (the handler refuses it).
    fn parse(payload: &[u8]) -> Message {
        match payload.iter().position(|&byte| byte == b'\n') {
            Some(end) => Message {
                id: std::str::from_utf8(&payload[..end])
                    .unwrap_or_default()
                    .to_owned(),
                body: String::from_utf8_lossy(&payload[end + 1..]).into_owned(),
            },
            None => Message {
                id: String::new(),
                body: String::from_utf8_lossy(payload).into_owned(),
            },
        }
    }

    /// The payload of a message with an id.
    fn payload(id: &str, body: &str) -> Vec<u8> {
        format!("{id}\n{body}").into_bytes()
    }
}

/// The effect of one message. Not unique on purpose: a message applied twice would show
/// as two rows.
const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS mqtt_example_effects (\
                              message_id text NOT NULL, \
                              body text NOT NULL, \
                              applied_at timestamptz NOT NULL DEFAULT now())";

/// Applies a message: one row, in the same transaction as the dedup record for
/// `(mqtt-example, msg.id)`.
#[idempotent(consumer = "mqtt-example", key = msg.id)]
async fn apply(tx: &mut PgConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO mqtt_example_effects (message_id, body) VALUES ($1, $2)")
        .bind(&msg.id)
        .bind(&msg.body)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

struct Config {
    host: String,
    port: u16,
    database_url: String,
    topic: String,
    client_id: String,
    exit_when_idle: Option<Duration>,
    crash_window: Duration,
}

impl Config {
    fn from_env() -> Result<Config, Error> {
        let url = consumer::var("MQTT_URL", "mqtt://127.0.0.1:1883");
        let (host, port) = host_port(&url)?;
        let topic = consumer::var("TOPIC", "dedup-example/payments");
        if topic.is_empty() || topic.contains(['+', '#']) {
            return Err(format!("TOPIC {topic:?}: expected a topic name, no wildcards").into());
        }
        Ok(Config {
            host,
            port,
            database_url: consumer::database_url(),
            topic,
            client_id: consumer::var("CLIENT_ID", "dedup-example"),
            exit_when_idle: consumer::exit_when_idle()?,
            crash_window: consumer::crash_window()?,
        })
    }

    fn dead_topic(&self) -> String {
        format!("{}/dead", self.topic)
    }

    /// A connection to the broker under `client_id`: a persistent session unless `clean`.
    fn connect(&self, client_id: &str, clean: bool, manual_acks: bool) -> (AsyncClient, EventLoop) {
        let mut options = MqttOptions::new(client_id, self.host.clone(), self.port);
        options
            .set_clean_session(clean)
            .set_manual_acks(manual_acks)
            .set_keep_alive(Duration::from_secs(30))
            .set_max_packet_size(MAX_PACKET, MAX_PACKET);
        let (client, mut eventloop) = AsyncClient::new(options, 64);
        let mut network = NetworkOptions::new();
        // A PUBACK is a few bytes: send it now, not when Nagle's algorithm lets it go.
        network.set_tcp_nodelay(true);
        network.set_connection_timeout(10);
        eventloop.set_network_options(network);
        (client, eventloop)
    }
}

/// `mqtt://host:port` (or `tcp://`, or no scheme; the port defaults to 1883).
fn host_port(url: &str) -> Result<(String, u16), Error> {
    let rest = url
        .strip_prefix("mqtt://")
        .or_else(|| url.strip_prefix("tcp://"))
        .unwrap_or(url)
        .trim_end_matches('/');
    let invalid = || format!("MQTT_URL {url:?}: expected mqtt://host:port");
    if rest.is_empty() || rest.contains(['/', '@']) {
        return Err(invalid().into());
    }
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => {
            Ok((host.to_owned(), port.parse().map_err(|_| invalid())?))
        }
        Some(_) => Err(invalid().into()),
        None => Ok((rest.to_owned(), 1883)),
    }
}

// ---------------------------------------------------------------------------------------
// Publishing
// ---------------------------------------------------------------------------------------

/// `publish N`: publishes N messages, each twice (two MQTT messages with the same id in
/// the payload: the second is for dedup to catch), at QoS 1, waits for every `PUBACK`, and
/// exits. Run the consumer once first: the broker keeps messages only for the sessions
/// subscribed when they arrive.
async fn publish(config: &Config, count: usize) -> Result<(), Error> {
    let id = format!("{}-publisher", config.client_id);
    let (client, mut eventloop) = config.connect(&id, true, false);
    let batch = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let sending = async {
        for n in 0..count {
            let payload = Message::payload(&format!("msg-{batch}-{n}"), &format!("payment {n}"));
            for _copy in 0..2 {
                client
                    .publish(&config.topic, QoS::AtLeastOnce, false, payload.clone())
                    .await?;
            }
        }
        Ok::<(), Error>(())
    };
    let confirming = async {
        let mut confirmed = 0;
        while confirmed < 2 * count {
            if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await? {
                confirmed += 1;
            }
        }
        Ok::<(), ConnectionError>(())
    };
    let (sent, confirmed) = tokio::join!(sending, confirming);
    sent?;
    confirmed?;
    disconnect(&client, &mut eventloop).await?;
    println!("published {count} messages twice each to {}", config.topic);
    Ok(())
}

/// Sends `DISCONNECT` after whatever was requested before it, and polls until it is out.
async fn disconnect(client: &AsyncClient, eventloop: &mut EventLoop) -> Result<(), Error> {
    client.disconnect().await?;
    loop {
        if let Event::Outgoing(Outgoing::Disconnect) = eventloop.poll().await? {
            return Ok(());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Consuming
// ---------------------------------------------------------------------------------------

/// What the network task tells the consumer besides deliveries: packets written, packets
/// acknowledged.
enum Wire {
    /// A `PUBACK` of ours, for this packet id, was written to the socket.
    PubAckSent(u16),
    /// A `PUBLISH` of ours (a dead letter) was written, under this packet id.
    Published(u16),
    /// The broker acknowledged our `PUBLISH` with this packet id.
    PubAckReceived(u16),
}

/// The network task: polls rumqttc's event loop (it must be polled all the time: that is
/// what reads, writes and pings), passes on deliveries and the events the consumer waits
/// for, and says `ready` when the SUBACK comes. Returns after our `DISCONNECT` is written; fails on a lost connection.
async fn drive(
    mut eventloop: EventLoop,
    deliveries: mpsc::UnboundedSender<Publish>,
    wire: mpsc::UnboundedSender<Wire>,
    subscribed: watch::Sender<bool>,
) -> Result<(), Error> {
    loop {
        let event = eventloop
            .poll()
            .await
            .map_err(|error| format!("MQTT connection: {error}"))?;
        // A send fails only when the consumer has stopped listening: nothing to do then.
        match event {
            Event::Incoming(Packet::ConnAck(connack)) if !connack.session_present => {
                eprintln!("new session: the broker kept nothing for this client id");
            }
            Event::Incoming(Packet::SubAck(suback)) => {
                match suback.return_codes.as_slice() {
                    [SubscribeReasonCode::Success(QoS::AtLeastOnce | QoS::ExactlyOnce)] => {}
                    codes => {
                        return Err(format!("subscription refused or downgraded: {codes:?}").into());
                    }
                }
                if !subscribed.send_replace(true) {
                    report::ready();
                }
            }
            Event::Incoming(Packet::Publish(publish)) => {
                let _ = deliveries.send(publish);
            }
            Event::Incoming(Packet::PubAck(puback)) => {
                let _ = wire.send(Wire::PubAckReceived(puback.pkid));
            }
            Event::Outgoing(Outgoing::PubAck(pkid)) => {
                let _ = wire.send(Wire::PubAckSent(pkid));
            }
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                let _ = wire.send(Wire::Published(pkid));
            }
            Event::Outgoing(Outgoing::Disconnect) => return Ok(()),
            _ => {}
        }
    }
}

/// The consumer: handles deliveries one at a time, in order, and acknowledges each before
/// taking the next.
struct Consumer {
    client: AsyncClient,
    wire: mpsc::UnboundedReceiver<Wire>,
    pool: PgPool,
    policy: AckPolicy<sqlx::Postgres>,
    crash_window: Duration,
    dead_topic: String,
}

impl Consumer {
    /// Waits for the first wire event `wanted` picks (others are of no use any more: the
    /// consumer waits for one thing at a time, and they come in order).
    async fn wait_for<T>(
        &mut self,
        what: &str,
        wanted: impl Fn(&Wire) -> Option<T>,
    ) -> Result<T, Error> {
        let found = tokio::time::timeout(WIRE_TIMEOUT, async {
            while let Some(event) = self.wire.recv().await {
                if let Some(found) = wanted(&event) {
                    return Some(found);
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(found)) => Ok(found),
            Ok(None) => Err(format!("connection ended while waiting for {what}").into()),
            Err(_) => Err(format!("no {what} within {WIRE_TIMEOUT:?}").into()),
        }
    }

    /// `PUBACK`, returning once it is written to the socket.
    async fn ack(&mut self, publish: &Publish) -> Result<(), Error> {
        self.client.ack(publish).await?;
        let pkid = publish.pkid;
        self.wait_for("our PUBACK to be written", |event| {
            matches!(event, Wire::PubAckSent(sent) if *sent == pkid).then_some(())
        })
        .await
    }

    /// A copy of the payload to `TOPIC/dead`, at QoS 1, returning once the broker has
    /// acknowledged it.
    async fn dead_letter(&mut self, publish: &Publish) -> Result<(), Error> {
        self.client
            .publish(
                &self.dead_topic,
                QoS::AtLeastOnce,
                false,
                publish.payload.to_vec(),
            )
            .await?;
        let pkid = self
            .wait_for("the dead letter to be written", |event| match event {
                Wire::Published(pkid) => Some(*pkid),
                _ => None,
            })
            .await?;
        self.wait_for("the broker's PUBACK of the dead letter", |event| {
            matches!(event, Wire::PubAckReceived(acked) if *acked == pkid).then_some(())
        })
        .await
    }

    /// Handles one delivery and acknowledges it.
    async fn handle(&mut self, publish: &Publish) -> Result<(), Error> {
        let msg = Message::parse(&publish.payload);
        let shown = report::shown(&msg.id);
        report::delivered(if publish.dup { 2 } else { 1 }, &msg.id);

        // Attempts in this process: what the policy's backoff grows with.
        let mut attempt = 1;
        let ack = loop {
            let result = apply(&self.pool, &msg).await;
            match &result {
                Ok(Outcome::Processed(())) => {
                    report::committed(&msg.id);
                    consumer::crash_pause(self.crash_window).await;
                }
                Ok(Outcome::Duplicate(_)) => report::duplicate(&msg.id),
                Err(error) => eprintln!("message {shown:?} failed: {error}"),
            }
            match self.policy.decide(&result, attempt) {
                // No redelivery without a new connection, and no PUBACK of a later
                // message before this one's: retry here.
                Ack::Retry { after } => {
                    report::retry(&msg.id);
                    tokio::time::sleep(after).await;
                    attempt += 1;
                }
                ack => break ack,
            }
        };
        if ack == Ack::DeadLetter {
            self.dead_letter(publish).await?;
            self.ack(publish).await?;
            report::dead(&msg.id, &msg.body);
        } else {
            self.ack(publish).await?;
            report::acked(&msg.id);
        }
        Ok(())
    }

    /// Handles deliveries until none has come for `exit_when_idle` (counted from the
    /// subscription's confirmation at the earliest), or forever.
    async fn run(
        &mut self,
        deliveries: &mut mpsc::UnboundedReceiver<Publish>,
        subscribed: &watch::Receiver<bool>,
        exit_when_idle: Option<Duration>,
    ) -> Result<(), Error> {
        let tick = Duration::from_millis(50);
        // The last delivery handled, or the moment the subscription was seen confirmed.
        let mut last: Option<Instant> = None;
        loop {
            if last.is_none() && *subscribed.borrow() {
                last = Some(Instant::now());
            }
            match tokio::time::timeout(tick, deliveries.recv()).await {
                Ok(Some(publish)) => {
                    self.handle(&publish).await?;
                    if last.is_some() {
                        last = Some(Instant::now());
                    }
                }
                Ok(None) => return Err("the connection ended".into()),
                Err(_) => {
                    let idle = last.map(|last| last.elapsed());
                    if idle
                        .zip(exit_when_idle)
                        .is_some_and(|(idle, limit)| idle >= limit)
                    {
                        return Ok(());
                    }
                }
            }
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let config = Config::from_env()?;
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        None => {}
        Some("publish") => {
            let count = args.next().map_or(Ok(100), |n| n.parse())?;
            return publish(&config, count).await;
        }
        Some(other) => {
            return Err(
                format!("unknown command {other:?}; expected none or `publish [N]`").into(),
            );
        }
    }

    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&config.database_url)
        .await
        .map_err(|error| format!("cannot connect to {}: {error}", config.database_url))?;
    dedup_runtime::migrate(&pool).await?;
    sqlx::query(CREATE_EFFECTS).execute(&pool).await?;

    // The persistent session, manual acknowledgements. The SUBSCRIBE is queued now and
    // sent once connected (an existing session has the subscription already; the broker
    // may start delivering before the SUBACK).
    let (client, eventloop) = config.connect(&config.client_id, false, true);
    client.subscribe(&config.topic, QoS::AtLeastOnce).await?;
    let (deliveries_tx, mut deliveries) = mpsc::unbounded_channel();
    let (wire_tx, wire) = mpsc::unbounded_channel();
    let (subscribed_tx, subscribed) = watch::channel(false);
    let network = tokio::spawn(drive(eventloop, deliveries_tx, wire_tx, subscribed_tx));

    let mut consumer = Consumer {
        client: client.clone(),
        wire,
        pool: pool.clone(),
        policy: AckPolicy::<sqlx::Postgres>::new(),
        crash_window: config.crash_window,
        dead_topic: config.dead_topic(),
    };
    let consumed = consumer
        .run(&mut deliveries, &subscribed, config.exit_when_idle)
        .await;
    match consumed {
        Ok(()) => {
            // Every PUBACK is written already; DISCONNECT ends the connection cleanly (the
            // session stays).
            client.disconnect().await?;
            network.await??;
        }
        Err(error) => {
            // A lost connection: the network task's error says why.
            if let Ok(Ok(Err(network_error))) =
                tokio::time::timeout(Duration::from_secs(1), network).await
            {
                return Err(network_error);
            }
            return Err(error);
        }
    }
    pool.close().await;
    Ok(())
}
