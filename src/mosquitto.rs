//! A Mosquitto broker of a test's own, on a free loopback port, killed when dropped (a
//! failing test does not leave it running). Not the machine's: that one keeps at most
//! 1,000 queued messages per offline session (`max_queued_messages`) and drops the rest,
//! and a test cannot stop or pause it. Beside it, the MQTT 5 clients the tests use:
//! [`session`] (a persistent session subscribed and left offline), [`publish`],
//! [`collect`] (what a session holds), each message a [`Wire`].
//!
//! ```no_run
//! let broker = dedup_suite::mosquitto::Mosquitto::start("my-test", "");
//! let options = rumqttc::v5::MqttOptions::new("client", "127.0.0.1", broker.port());
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};

/// How long a helper below waits for the broker's answer.
const PATIENCE: Duration = Duration::from_secs(15);

/// The Mosquitto binary, unless `DEDUP_TEST_MOSQUITTO` names another.
const MOSQUITTO: &str = "/usr/sbin/mosquitto";

/// A running broker of the test's own.
#[derive(Debug)]
pub struct Mosquitto {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Mosquitto {
    /// Starts one (no persistence, anonymous, no limit on a session's queue, errors and
    /// warnings logged), with `config` appended to its configuration, and waits until it
    /// listens. Panics, saying how to install it, when the binary is missing.
    pub fn start(name: &str, config: &str) -> Mosquitto {
        let binary = std::env::var("DEDUP_TEST_MOSQUITTO").unwrap_or_else(|_| MOSQUITTO.to_owned());
        assert!(
            Path::new(&binary).is_file(),
            "this test starts its own Mosquitto, and {binary} is missing: install it \
             (`apt-get install mosquitto`) or set DEDUP_TEST_MOSQUITTO"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let dir = std::env::temp_dir().join(format!("dedup-{name}"));
        std::fs::create_dir_all(&dir).expect("the broker's directory");
        let file = dir.join("mosquitto.conf");
        std::fs::write(
            &file,
            format!(
                "listener {port} 127.0.0.1\n\
                 allow_anonymous true\n\
                 persistence false\n\
                 # No limit on a session's queue: nothing dropped while a client is away.\n\
                 max_queued_messages 0\n\
                 set_tcp_nodelay true\n\
                 log_dest stderr\n\
                 log_type error\n\
                 log_type warning\n\
                 {config}\n"
            ),
        )
        .expect("write the broker's configuration");
        let mut broker = Mosquitto {
            child: spawn(&binary, &file, &dir),
            dir,
            port,
        };
        broker.wait_listening(&binary);
        broker
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its process id (to pause it with `SIGSTOP`, say).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("mosquitto.log")).unwrap_or_default()
    }

    /// Kills it and starts it again on the same port, with the same configuration: every
    /// connection is cut, and the broker is back.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let binary = std::env::var("DEDUP_TEST_MOSQUITTO").unwrap_or_else(|_| MOSQUITTO.to_owned());
        self.child = spawn(&binary, &self.dir.join("mosquitto.conf"), &self.dir);
        self.wait_listening(&binary);
    }

    fn wait_listening(&mut self, binary: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{binary} exited ({status}); its log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "{binary} does not listen on 127.0.0.1:{}; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn spawn(binary: &str, config: &Path, dir: &Path) -> Child {
    let log = std::fs::File::create(dir.join("mosquitto.log")).expect("the broker's log");
    Command::new(binary)
        .arg("-c")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|error| panic!("start {binary}: {error}"))
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// MQTT 5 clients for the tests: persistent sessions, publishing, collecting.

/// MQTT 5 options for a persistent session of `client_id`: clean start off, a session
/// that outlives its connection (without an expiry, an MQTT 5 session ends with it).
pub fn persistent(port: u16, client_id: &str) -> MqttOptions {
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options
        .set_clean_start(false)
        .set_session_expiry_interval(Some(u32::MAX))
        .set_max_packet_size(Some(16 << 20));
    options
}

/// A persistent session of `client_id` subscribed to `topic` at QoS 1, left offline: the
/// broker keeps what comes for it.
pub async fn session(port: u16, client_id: &str, topic: &str) {
    let (client, mut events) = AsyncClient::new(persistent(port, client_id), 16);
    client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    loop {
        match tokio::time::timeout(PATIENCE, events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
            Ok(Ok(_)) => {}
            other => panic!("subscribing {client_id}: {other:?}"),
        }
    }
    client.disconnect().await.unwrap();
    while events.poll().await.is_ok() {}
}

/// A message as MQTT carries it: its user properties (the id as `message-id`, where the
/// crate's publisher puts it) and its payload.
pub type Wire = (Vec<(String, String)>, Vec<u8>);

/// The message of id `id` (none: without the property) and payload `body`.
pub fn wire(id: Option<&str>, body: &[u8]) -> Wire {
    let properties = id
        .map(|id| vec![("message-id".to_owned(), id.to_owned())])
        .unwrap_or_default();
    (properties, body.to_vec())
}

/// Publishes each message to `topic` at QoS 1, every `PUBACK` back.
pub async fn publish(port: u16, topic: &str, messages: &[Wire]) {
    let options = MqttOptions::new(crate::unique("pub"), "127.0.0.1", port);
    let (client, mut events) = AsyncClient::new(options, 64);
    let sending = {
        let (client, topic, messages) = (client.clone(), topic.to_owned(), messages.to_vec());
        tokio::spawn(async move {
            for (user_properties, payload) in messages {
                let properties = PublishProperties {
                    user_properties,
                    ..PublishProperties::default()
                };
                client
                    .publish_with_properties(&topic, QoS::AtLeastOnce, false, payload, properties)
                    .await
                    .unwrap();
            }
        })
    };
    let mut acked = 0;
    while acked < messages.len() {
        match tokio::time::timeout(PATIENCE, events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            other => panic!("publishing: {other:?}"),
        }
    }
    sending.await.unwrap();
    client.disconnect().await.unwrap();
    while events.poll().await.is_ok() {}
}

/// What the persistent session `client_id` (subscribed to `topic`) gets, until nothing
/// more comes for a second: each message's user properties and payload.
pub async fn collect(port: u16, client_id: &str, topic: &str) -> Vec<Wire> {
    let (client, mut events) = AsyncClient::new(persistent(port, client_id), 64);
    client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    let mut got = Vec::new();
    while let Ok(Ok(event)) = tokio::time::timeout(Duration::from_secs(1), events.poll()).await {
        if let Event::Incoming(Packet::Publish(publish)) = event {
            let properties = publish.properties.unwrap_or_default().user_properties;
            got.push((properties, publish.payload.to_vec()));
        }
    }
    got
}

/// The value of the user property `name` of `message`.
pub fn property<'m>(message: &'m Wire, name: &str) -> Option<&'m str> {
    message
        .0
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}
