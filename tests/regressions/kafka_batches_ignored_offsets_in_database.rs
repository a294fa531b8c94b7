//! Issue 40: `KafkaConsumer::run_batches` with `offsets_in_database(true)` ran, and kept no
//! position in the database: only the plain form's handler writes the partition's next
//! offset in its transaction, so a service that asked for the mode and used batches had
//! its offsets in Kafka alone without a word. Now the run is refused at start with
//! `ConsumeError::OffsetsInBatches`, before it connects to anything, and its message
//! says what to write instead.

use std::sync::Arc;

use dedup_runtime::consume::Message;
use dedup_runtime::rdkafka::{ConsumeError, KafkaConsumer};

#[dedup_runtime::idempotent(consumer = "never", batch = fresh, key = |msg| msg.id())]
async fn never(tx: &mut sqlx::SqliteConnection, fresh: &[&Message]) -> Result<(), sqlx::Error> {
    let _ = (tx, fresh);
    unreachable!("the run is refused before any batch")
}

#[tokio::test]
async fn run_batches_refuses_offsets_in_the_database() {
    let pool = dedup_suite::sqlite().await;
    let mut config = rdkafka::ClientConfig::new();
    // Nothing listens there: the refusal comes before any connection.
    config
        .set("bootstrap.servers", "127.0.0.1:9")
        .set("group.id", "g");
    let handler =
        |pool: sqlx::SqlitePool, batch: Arc<[Message]>| async move { never(&pool, &batch).await };
    let error = KafkaConsumer::new(config, "orders")
        .offsets_in_database(true)
        .run_batches(&*pool, 100, handler, std::future::pending())
        .await
        .expect_err("refused");
    assert!(matches!(error, ConsumeError::OffsetsInBatches), "{error}");
    let text = error.to_string();
    assert!(
        text.contains("offsets_in_database") && text.contains("`run`"),
        "{text}"
    );
}
