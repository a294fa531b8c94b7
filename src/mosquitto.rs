//! A Mosquitto broker of a test's own, on a free loopback port, killed when dropped (a
//! failing test does not leave it running). Not the machine's: that one keeps at most
//! 1,000 queued messages per offline session (`max_queued_messages`) and drops the rest,
//! and a test cannot stop or pause it.
//!
//! ```no_run
//! let broker = dedup_suite::mosquitto::Mosquitto::start("my-test", "");
//! let options = rumqttc::MqttOptions::new("client", "127.0.0.1", broker.port());
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
