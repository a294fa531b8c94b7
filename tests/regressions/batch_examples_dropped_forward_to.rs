//! The RabbitMQ and NATS examples in batch mode (`BATCH` over 1) ignored `FORWARD_TO`:
//! their batch handler has no outbox, so a two-hop service A started with both committed
//! its effects and never sent an event, with nothing said. Every broker example with both
//! settings now refuses to start, naming them.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn batch_mode_with_forward_to_is_refused_at_start_up() {
    for name in ["rabbitmq", "nats", "kafka"] {
        let program = dedup_suite::example_binary("brokers", &["rabbitmq", "nats", "kafka"], name);
        let mut child = Command::new(&program)
            .env("BATCH", "16")
            .env("FORWARD_TO", "dedup-regression.events")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the example");
        // Before the fix the example started consuming: it never ended by itself.
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for the example") {
                break status;
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{name}: started with BATCH and FORWARD_TO (still running after 20 s)");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .expect("piped stderr")
            .read_to_string(&mut stderr)
            .expect("read stderr");
        assert!(
            !status.success(),
            "{name}: exited successfully with BATCH and FORWARD_TO"
        );
        assert!(
            stderr.contains("BATCH over 1 does not forward: unset FORWARD_TO, or BATCH"),
            "{name}: {stderr}"
        );
    }
}
