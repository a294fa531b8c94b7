//! The outbox's Redis Streams publisher (feature `redis`): [`RedisStreamsPublisher`].

use ::redis::aio::MultiplexedConnection;
use ::redis::{RedisError, Value};

use crate::outbox::{OutboxMessage, Publisher};

/// Publishes an outbox's rows to Redis Streams, for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each row an entry (`XADD <destination> *`)
/// of the stream named by its destination, with the outgoing id in the field `id` and the
/// payload in the field `body` — where the consumer downstream reads them
/// (`examples/redis_streams.rs`): the entry id Redis assigns changes when an entry is
/// added again, the `id` field does not. A row's trace context, if it has one, is the
/// field `traceparent`. A send is `Ok` once Redis answered its `XADD`.
///
/// A claim's entries go in one pipeline: one round trip for the whole claim. A pipeline
/// that fails fails every row of it (some entries may be in the stream: sent again later
/// with the same `id`, which the consumer dedups). The row's headers and ordering key are
/// not sent (a stream keeps its entries in order).
///
/// ```no_run
/// use dedup_runtime::outbox::Outbox;
/// use dedup_runtime::redis::RedisStreamsPublisher;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let publisher = RedisStreamsPublisher::new(client.get_multiplexed_async_connection().await?);
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsPublisher {
    connection: MultiplexedConnection,
}

impl std::fmt::Debug for RedisStreamsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsPublisher")
            .finish_non_exhaustive()
    }
}

impl RedisStreamsPublisher {
    /// A publisher on `connection`.
    pub fn new(connection: MultiplexedConnection) -> Self {
        RedisStreamsPublisher { connection }
    }
}

impl Publisher for RedisStreamsPublisher {
    type Error = RedisError;
    const SYSTEM: &'static str = "redis";

    async fn publish(&self, message: &OutboxMessage) -> Result<(), RedisError> {
        let mut answers = self.publish_batch(std::slice::from_ref(message)).await;
        answers.pop().unwrap_or(Ok(()))
    }

    /// Every `XADD` of the claim in one pipeline.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), RedisError>> {
        let mut pipeline = ::redis::pipe();
        for message in messages {
            pipeline
                .cmd("XADD")
                .arg(message.destination())
                .arg("*")
                .arg("id")
                .arg(message.id().to_string())
                .arg("body")
                .arg(message.payload());
            if let Some(traceparent) = message.traceparent() {
                pipeline.arg("traceparent").arg(traceparent);
            }
        }
        let mut connection = self.connection.clone();
        match pipeline.query_async::<Vec<Value>>(&mut connection).await {
            Ok(_) => messages.iter().map(|_| Ok(())).collect(),
            Err(error) => {
                let text = error.to_string();
                let mut answers = vec![Err(error)];
                answers.extend((1..messages.len()).map(|_| {
                    Err(RedisError::from(std::io::Error::other(format!(
                        "the claim's pipeline failed: {text}"
                    ))))
                }));
                answers
            }
        }
    }
}
