//! One handler call of a hosted consumer, in either form: [`Plain`] (one message per
//! call, an `#[idempotent]` handler) or [`Batches`] (up to `max` per call, an
//! `#[idempotent(batch = …)]` handler), and what [`AckPolicy`] makes of each message's
//! result. The consumers' loops are written once over [`Calls`]: the plain form is the
//! batch form with batches of one.
//!
//! The Kafka consumer's lanes call their handler themselves; with its feature alone,
//! only [`item_settlement`] is used.
#![cfg_attr(
    not(any(
        feature = "lapin",
        feature = "async-nats",
        feature = "redis",
        feature = "rumqttc"
    )),
    allow(dead_code)
)]

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use sqlx::Pool;

use crate::ack::{Ack, AckOutcome, AckPolicy, DecideError};
use crate::backend::Backend;
use crate::batch::{BatchItem, BatchOutcome};
use crate::consume::Message;

use super::shared::header_text;

/// How one message of a call is settled: the policy's [`Ack`], and for a failure the
/// error's type and text (at most [`ERROR_LIMIT`](super::shared::ERROR_LIMIT) bytes, no
/// control characters: a dead letter's provenance, a log line).
pub(crate) type Settlement = (Ack, Option<(&'static str, String)>);

/// A handler, in one of the two forms a consumer runs.
pub(crate) trait Calls<DB: Backend>: Sync {
    /// Messages per call: 1 for the plain form.
    fn max(&self) -> usize;

    /// Whether this is the batch form (its span says so, even for a batch of one).
    fn batches(&self) -> bool;

    /// Calls the handler for `messages` (1 to [`max`](Self::max), in the order the
    /// broker gave them), inside `span`, and settles each message through `policy` by
    /// its own delivery count: one [`Settlement`] per message, in order.
    fn call(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        messages: Vec<Message>,
        span: &tracing::Span,
    ) -> impl Future<Output = Vec<Settlement>> + Send;
}

/// The types a handler's own are named by, held by nothing (`Send` and `Sync` whatever
/// they are).
type Names<T> = PhantomData<fn() -> T>;

/// The plain form: `Fn(Pool, Arc<Message>) -> Result<O, E>`.
pub(crate) struct Plain<F, Fut, O, E>(F, Names<(Fut, O, E)>);

impl<F, Fut, O, E> Plain<F, Fut, O, E> {
    pub(crate) fn new(handler: F) -> Self {
        Plain(handler, PhantomData)
    }
}

impl<DB, F, Fut, O, E> Calls<DB> for Plain<F, Fut, O, E>
where
    DB: Backend,
    F: Fn(Pool<DB>, Arc<Message>) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, E>> + Send + 'static,
    O: AckOutcome + Send,
    E: DecideError + std::fmt::Display + Send,
{
    fn max(&self) -> usize {
        1
    }

    fn batches(&self) -> bool {
        false
    }

    fn call(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        mut messages: Vec<Message>,
        span: &tracing::Span,
    ) -> impl Future<Output = Vec<Settlement>> + Send {
        debug_assert_eq!(messages.len(), 1, "the plain form calls with one message");
        let message = Arc::new(messages.pop().expect("one message per call"));
        let count = message.delivery_count();
        let call = tracing::Instrument::instrument((self.0)(pool.clone(), message), span.clone());
        async move {
            let result = call.await;
            let ack = policy.decide(&result, count);
            let error = match (&ack, &result) {
                (Ack::Ack, _) | (_, Ok(_)) => None,
                (_, Err(error)) => {
                    Some((std::any::type_name::<E>(), header_text(&error.to_string())))
                }
            };
            vec![(ack, error)]
        }
    }
}

/// The batch form: `Fn(Pool, Arc<[Message]>) -> Result<BatchOutcome<E>, B>`, up to `max`
/// messages per call.
pub(crate) struct Batches<F, Fut, E, B>(F, usize, Names<(Fut, E, B)>);

impl<F, Fut, E, B> Batches<F, Fut, E, B> {
    /// At most `max` messages per call (at least 1).
    pub(crate) fn new(handler: F, max: usize) -> Self {
        Batches(handler, max.max(1), PhantomData)
    }
}

impl<DB, F, Fut, E, B> Calls<DB> for Batches<F, Fut, E, B>
where
    DB: Backend,
    F: Fn(Pool<DB>, Arc<[Message]>) -> Fut + Send + Sync,
    Fut: Future<Output = Result<BatchOutcome<E>, B>> + Send + 'static,
    E: std::error::Error + Send + 'static,
    B: std::error::Error + Send + 'static,
{
    fn max(&self) -> usize {
        self.1
    }

    fn batches(&self) -> bool {
        true
    }

    fn call(
        &self,
        pool: &Pool<DB>,
        policy: &AckPolicy<DB>,
        messages: Vec<Message>,
        span: &tracing::Span,
    ) -> impl Future<Output = Vec<Settlement>> + Send {
        let counts: Vec<u64> = messages.iter().map(Message::delivery_count).collect();
        let call = tracing::Instrument::instrument(
            (self.0)(pool.clone(), Arc::from(messages)),
            span.clone(),
        );
        async move {
            match call.await {
                Ok(outcome) => counts
                    .iter()
                    .enumerate()
                    .map(|(n, &count)| item_settlement(policy, outcome.settled(n), count))
                    .collect(),
                Err(error) => {
                    let text = header_text(&error.to_string());
                    counts
                        .iter()
                        .map(|&count| {
                            let ack = policy.decide_error(&error, count);
                            (ack, Some((std::any::type_name::<B>(), text.clone())))
                        })
                        .collect()
                }
            }
        }
    }
}

/// What `policy` says of a batch's item at its `count`th delivery.
pub(crate) fn item_settlement<DB: Backend, E: std::error::Error + 'static>(
    policy: &AckPolicy<DB>,
    item: &BatchItem<E>,
    count: u64,
) -> Settlement {
    let failed = |error: &(dyn std::error::Error + 'static), class: &'static str| {
        let text = header_text(&error.to_string());
        (policy.decide_error(error, count), Some((class, text)))
    };
    match item {
        BatchItem::Processed | BatchItem::Duplicate(_) | BatchItem::SameAs { .. } => {
            (Ack::Ack, None)
        }
        BatchItem::Failed(error) => failed(error, std::any::type_name::<E>()),
        BatchItem::CommitFailed(error) => failed(error, std::any::type_name::<sqlx::Error>()),
        BatchItem::Invalid(error) => failed(error, std::any::type_name_of_val(error)),
        BatchItem::FingerprintMismatch(error) => failed(error, std::any::type_name_of_val(error)),
        BatchItem::InProgress(busy) => (crate::LeaseOutcome::<()>::InProgress(*busy).ack(), None),
    }
}

/// The consumer span of a call: `process` with OpenTelemetry's messaging names —
/// `system`, the `destination`, the `group` where the broker has one — and for the plain
/// form the message's id and `traceparent`, for the batch form the message count; the
/// trace hook called once per message.
pub(crate) fn span<DB: Backend>(
    calls: &impl Calls<DB>,
    system: &'static str,
    destination: &str,
    group: Option<&str>,
    messages: &[Message],
    hook: Option<super::TraceParent>,
) -> tracing::Span {
    let span = if calls.batches() {
        tracing::info_span!(
            "process",
            messaging.system = system,
            messaging.operation.type = "process",
            messaging.destination.name = %destination,
            messaging.consumer.group.name = group,
            messaging.batch.message_count = messages.len(),
        )
    } else {
        let span = tracing::info_span!(
            "process",
            messaging.system = system,
            messaging.operation.type = "process",
            messaging.destination.name = %destination,
            messaging.consumer.group.name = group,
            messaging.message.id = messages.first().map(Message::id),
            traceparent = tracing::field::Empty,
        );
        if let Some(traceparent) = messages.first().and_then(|m| m.header("traceparent"))
            && let Ok(traceparent) = std::str::from_utf8(traceparent)
        {
            span.record("traceparent", traceparent);
        }
        span
    };
    if let Some(hook) = hook {
        for message in messages {
            hook(&span, message);
        }
    }
    span
}
