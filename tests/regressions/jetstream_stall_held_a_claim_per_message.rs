//! Issue 39, item 6: the JetStream publisher awaited the stream's acknowledgements in
//! turn, and async-nats starts each one's time-out when it is awaited: with a stalled
//! server a claim of 20 rows at a 300 ms time-out took 6.0 s — with the defaults (5 s,
//! claims of 500) about 42 minutes, during which the heartbeat kept the claim from every
//! other relay. `Publisher::publish_batch` promises one wait per claim: the claim's
//! acknowledgements now share one deadline (`JetStreamPublisher::ack_timeout`).
//!
//! The stall is real: a proxy between the publisher and NATS keeps the connection open
//! and passes no byte. The bound checked is what the fix is about — a few time-outs for
//! the claim, not one per row — with room for a slow machine; the figure is printed.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use dedup_runtime::async_nats::JetStreamPublisher;
use dedup_runtime::outbox::{Cause, Outbox};
use dedup_suite::outage::Outage;

const ROWS: u32 = 20;
const TIMEOUT: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_holds_a_claim_for_one_time_out() {
    let proxy = Outage::start("127.0.0.1:4222").await;
    let direct = jetstream::new(
        async_nats::connect("nats://127.0.0.1:4222")
            .await
            .expect("NATS on 127.0.0.1:4222"),
    );
    let run = dedup_suite::unique("stall").replace('-', "_");
    let (name, subject) = (format!("REGRESS_{run}"), format!("regress.{run}"));
    direct
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    let client = async_nats::connect(format!("nats://127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    let context = jetstream::ContextBuilder::new()
        .timeout(TIMEOUT)
        .build(client);
    let publisher = JetStreamPublisher::new(context).ack_timeout(TIMEOUT);

    let db = dedup_suite::sqlite().await;
    dedup_runtime::outbox::migrate(&*db).await.unwrap();
    let outbox = Outbox::new();
    let cause = Cause::new("regress-stall", dedup_suite::unique("evt")).unwrap();
    let mut tx = db.begin().await.unwrap();
    for slot in 0..ROWS {
        let message = cause.nth_outgoing(slot, &subject, b"p");
        outbox.enqueue(&mut *tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = outbox
        .relay(&*db)
        .backoff(Duration::from_millis(1), Duration::from_millis(1));

    proxy.stall();
    let started = Instant::now();
    let relayed = relay.relay_batch(&publisher).await.unwrap();
    let held = started.elapsed();
    proxy.restore();
    println!("a claim of {ROWS} rows, the server stalled, {TIMEOUT:?} time-out: {held:?}");
    assert_eq!(
        (relayed.claimed, relayed.failed),
        (ROWS as usize, ROWS as usize),
        "{relayed:?}"
    );
    assert!(
        held < TIMEOUT * 5,
        "one wait for the claim, not one per row ({ROWS} × {TIMEOUT:?}): held {held:?}"
    );

    // The server answers again: the next claim sends every row.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let relayed = relay.relay_batch(&publisher).await.unwrap();
    assert_eq!(relayed.sent, ROWS as usize, "{relayed:?}");
    direct.delete_stream(&name).await.unwrap();
}
