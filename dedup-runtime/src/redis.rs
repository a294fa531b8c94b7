//! Redis Streams (feature `redis`): the hosted consumer [`RedisStreamsConsumer`], and the
//! outbox's publisher [`RedisStreamsPublisher`].

use std::sync::Arc;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, RedisError, RedisResult, Value};
use tokio::sync::Mutex;

use crate::outbox::{OutboxMessage, Publisher};

mod consumer;

pub use consumer::{ConsumeError, MessageIdFrom, RedisStreamsConsumer};

/// Publishes an outbox's rows to Redis Streams, for the relay
/// ([`Relay::run`](crate::outbox::Relay::run)): each row an entry (`XADD <destination> *`)
/// of the stream named by its destination, with the outgoing id in the field `id` and the
/// payload in the field `body` — where the consumer downstream reads them
/// ([`RedisStreamsConsumer`]): the entry id Redis assigns changes when an entry is
/// added again, the `id` field does not. A row's trace context, if it has one, is the
/// field `traceparent`; its headers
/// ([`OutboxMessage::headers`](crate::outbox::OutboxMessage::headers)) are fields of their
/// own after `body`, in order — the consumer's [`Message::header`](crate::consume::Message::header)s.
/// A send is `Ok` once Redis answered its `XADD`.
///
/// A claim's entries go in one pipeline: one round trip for the whole claim, one answer
/// per entry (an error reply fails its row alone). A pipeline that fails on the way —
/// the connection lost — fails every row of it (some entries may be in the stream: sent
/// again later with the same `id`, which the consumer dedups) with an error the relay
/// takes for an unreachable broker: the rows go back with their attempts not counted.
/// The publisher owns its connection, made from the [`Client`] given here, and makes a
/// new one for the next claim once it was lost (a Redis restart, a cut network). The
/// row's headers and ordering key are not sent (a stream keeps its entries in order).
///
/// ```no_run
/// use dedup_runtime::outbox::Outbox;
/// use dedup_runtime::redis::RedisStreamsPublisher;
///
/// # async fn relay(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let publisher = RedisStreamsPublisher::new(client);
/// Outbox::new().relay(&pool).run(&publisher, std::future::pending()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsPublisher {
    client: Client,
    /// The connection in use; `None` until the first claim, and again once it was lost.
    /// Clones share it.
    connection: Arc<Mutex<Option<MultiplexedConnection>>>,
}

impl std::fmt::Debug for RedisStreamsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsPublisher")
            .finish_non_exhaustive()
    }
}

impl RedisStreamsPublisher {
    /// A publisher through `client`: it connects at its first claim, and again after a
    /// connection was lost.
    pub fn new(client: Client) -> Self {
        RedisStreamsPublisher {
            client,
            connection: Arc::default(),
        }
    }

    /// The connection to send on: the one in use, or a new one.
    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        let mut held = self.connection.lock().await;
        if let Some(connection) = held.as_ref() {
            return Ok(connection.clone());
        }
        let connection = self.client.get_multiplexed_async_connection().await?;
        *held = Some(connection.clone());
        Ok(connection)
    }
}

/// Whether `error` says Redis could not be reached (no connection, or it was lost).
fn unreachable(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_refusal()
        || error.is_connection_dropped()
        || error.is_timeout()
        || error.is_unrecoverable_error()
}

impl Publisher for RedisStreamsPublisher {
    type Error = RedisError;
    const SYSTEM: &'static str = "redis";

    /// A connection error ([`RedisError::is_io_error`], a refused or dropped connection,
    /// a time-out): Redis could not be reached. An error reply is not.
    fn unreachable(error: &RedisError) -> bool {
        unreachable(error)
    }

    async fn publish(&self, message: &OutboxMessage) -> Result<(), RedisError> {
        let mut answers = self.publish_batch(std::slice::from_ref(message)).await;
        answers.pop().unwrap_or(Ok(()))
    }

    /// Every `XADD` of the claim in one pipeline, one answer each.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<Result<(), RedisError>> {
        let mut pipeline = ::redis::pipe();
        pipeline.ignore_errors();
        for message in messages {
            pipeline
                .cmd("XADD")
                .arg(message.destination())
                .arg("*")
                .arg("id")
                .arg(message.id().to_string())
                .arg("body")
                .arg(message.payload());
            for (name, value) in message.headers() {
                pipeline.arg(name).arg(value);
            }
            if let Some(traceparent) = message.traceparent() {
                pipeline.arg("traceparent").arg(traceparent);
            }
        }
        let answers = match self.connection().await {
            Ok(mut connection) => {
                pipeline
                    .query_async::<Vec<RedisResult<Value>>>(&mut connection)
                    .await
            }
            Err(error) => Err(error),
        };
        match answers {
            Ok(answers) if answers.len() == messages.len() => answers
                .into_iter()
                .map(|answer| answer.map(|_| ()))
                .collect(),
            Ok(answers) => {
                let error = RedisError::from((
                    ::redis::ErrorKind::UnexpectedReturnType,
                    "Redis answered a pipeline with another number of replies",
                    format!("{} replies to {} entries", answers.len(), messages.len()),
                ));
                messages.iter().map(|_| Err(error.clone())).collect()
            }
            Err(error) => {
                if unreachable(&error) {
                    // The next claim connects again.
                    *self.connection.lock().await = None;
                }
                messages.iter().map(|_| Err(error.clone())).collect()
            }
        }
    }
}
