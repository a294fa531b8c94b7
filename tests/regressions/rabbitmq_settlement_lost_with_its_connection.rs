//! Issue 40 (seen in CI, once in three runs): the hosted RabbitMQ consumer awaited each
//! `ack`, `nack` and `reject` as lapin answered it, and lapin 4 never answers one sent as
//! its connection fails — the frame goes to an I/O loop that has stopped. The consumer sat
//! on that acknowledgement for ever: it never saw the connection go, never connected
//! again, and the rest of the queue waited. Now a settlement still under way when lapin
//! marks its channel's deliveries poisoned counts as not sent (the broker delivers the
//! message again, and its dedup row makes that copy a duplicate), and the channel's close
//! at shutdown is bounded.
//!
//! The race needs an acknowledgement on its way at the moment of the cut: a fast handler
//! on SQLite acknowledges every millisecond or two, and the connection is cut twelve
//! times while it runs. Before the fix this test hung in most runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dedup_runtime::consume::Message;
use dedup_runtime::lapin::RabbitMqConsumer;
use dedup_suite::outage::Outage;
use dedup_suite::rabbitmq::{channel, depth};
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, ConnectionProperties};

const MESSAGES: usize = 1_000;
const CUTS: usize = 12;

#[dedup_runtime::idempotent(consumer = "rabbitmq-cut-settlement", key = msg.id())]
async fn apply(tx: &mut sqlx::SqliteConnection, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO cut_settlement (message_id) VALUES (?1)")
        .bind(msg.id())
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledgement_cut_off_with_its_connection_does_not_hold_the_consumer() {
    let pool = dedup_suite::sqlite().await;
    dedup_runtime::migrate(&*pool).await.unwrap();
    sqlx::query("CREATE TABLE cut_settlement (message_id TEXT NOT NULL)")
        .execute(&*pool)
        .await
        .unwrap();
    let channel = channel().await;
    let queue = dedup_suite::unique("regress-cut-settlement");
    dedup_suite::rabbitmq::declare(&channel, &queue, false).await;
    let ids: Vec<String> = (0..MESSAGES)
        .map(|n| dedup_suite::unique(&format!("cut-{n}")))
        .collect();
    let mut confirms = Vec::with_capacity(MESSAGES);
    for id in &ids {
        let properties = BasicProperties::default().with_message_id(id.as_str().into());
        let published = channel.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"body",
            properties,
        );
        confirms.push(published.await.unwrap());
    }
    for confirm in confirms {
        confirm.await.unwrap();
    }

    let proxy = Outage::start("127.0.0.1:5672").await;
    let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let consumer =
        RabbitMqConsumer::new(&uri, ConnectionProperties::default(), &queue).prefetch(50);
    let handled = Arc::new(AtomicUsize::new(0));
    let handler = {
        let handled = handled.clone();
        move |pool: sqlx::SqlitePool, msg: Arc<Message>| {
            let handled = handled.clone();
            async move {
                let outcome = apply(&pool, &msg).await;
                handled.fetch_add(1, Ordering::Relaxed);
                outcome
            }
        }
    };
    // Each cut once the consumer is busy again (30 more messages handled since the last
    // one), for 50 ms; then the rest of the queue.
    let cuts = async {
        for _ in 0..CUTS {
            let from = handled.load(Ordering::Relaxed);
            while handled.load(Ordering::Relaxed) < (from + 30).min(MESSAGES) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(50)).await;
            proxy.restore();
        }
        // Every effect, and nothing ready: what a cut left unacknowledged came back as
        // a duplicate and was settled.
        while count(&pool).await != MESSAGES as i64 || depth(&channel, &queue).await.0 != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let consumed =
        tokio::time::timeout(Duration::from_secs(60), consumer.run(&*pool, handler, cuts))
            .await
            .expect("the consumer went on after every cut (it hung on an acknowledgement)")
            .unwrap();
    assert!(consumed.reconnects >= 1, "{consumed:?}");

    let effects = count(&pool).await;
    let distinct: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT message_id) FROM cut_settlement")
        .fetch_one(&*pool)
        .await
        .unwrap();
    assert_eq!(
        (effects, distinct),
        (MESSAGES as i64, MESSAGES as i64),
        "each once"
    );
    for id in &ids {
        assert_eq!(
            dedup_suite::claims(&*pool, "rabbitmq-cut-settlement", id).await,
            1,
            "{id}"
        );
    }
    assert_eq!(depth(&channel, &queue).await.0, 0, "{consumed:?}");
    for name in [queue.clone(), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

async fn count(pool: &sqlx::SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM cut_settlement")
        .fetch_one(pool)
        .await
        .unwrap()
}
