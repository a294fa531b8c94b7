//! Counters and a latency histogram per handler, through the [`metrics`] facade (feature
//! `metrics`): no exporter is chosen for you, and without the feature nothing is
//! compiled in. Every metric carries the labels `handler` (the function's name) and
//! `consumer` (empty for a handler with `unique = …` alone).
//!
//! | name | kind | more labels | counts |
//! | --- | --- | --- | --- |
//! | `dedup_processed_total` | counter | | calls that committed the body's work |
//! | `dedup_duplicates_total` | counter | `rule`: `message_id`, `business_key`, `outcome_unknown` | calls that found a duplicate (`outcome_unknown`: a mark-first mark whose owner never completed it) |
//! | `dedup_in_progress_total` | counter | | leased calls that found another delivery's unexpired lease |
//! | `dedup_retries_total` | counter | | attempts run again after a transient failure |
//! | `dedup_failures_total` | counter | `class` (below) | calls that returned an error |
//! | `dedup_handler_duration_seconds` | histogram | `outcome`: `processed`, `duplicate`, `failed`, `in_progress` | one call, all its attempts |
//!
//! A failure's `class`: `invalid_id` (the key was refused, nothing ran), `transient` (a
//! transient database failure no attempt was left for, or one inside the caller's
//! transaction, which the caller retries), `rolled_back` (the database rolled the
//! transaction back by itself, see [`RolledBack`](crate::RolledBack)), `database` (any
//! other error of ours: the connection, the claim, the commit), `body` (the body's own
//! error), `lease_lost` (a leased call's completion refused: another delivery took its
//! lease over, see [`LeaseLost`](crate::LeaseLost)), `fingerprint_mismatch` (the id came
//! with another payload than the delivery that claimed it, see
//! [`FingerprintMismatch`](crate::FingerprintMismatch)), `stored_result` (a result that
//! could not be stored or replayed, see [`StoredResultError`](crate::StoredResultError)).
//!
//! The inbox ([`inbox`](crate::inbox)) records, with the label `consumer`:
//!
//! | name | kind | more labels | counts |
//! | --- | --- | --- | --- |
//! | `dedup_inbox_received_total` | counter | `outcome`: `stored`, `duplicate`, `refused` | messages received |
//! | `dedup_inbox_processed_total` | counter | `outcome`: `processed`, `failed`, `dead`, `lost`, `released` | messages a worker ended, as [`Processed`](crate::inbox::Processed) says (`dead` includes rows buried after their worker stopped) |
//! | `dedup_inbox_rows` | gauge | `state`: `pending`, `claimed`, `processed`, `dead` | rows, at each [`Inbox::stats`](crate::inbox::Inbox::stats) |
//! | `dedup_inbox_oldest_pending_seconds` | gauge | | the oldest pending row's age, at each `stats` (0 when none) |
//!
//! Batches ([`batch`](crate::batch)) record, with the label `consumer`:
//!
//! | name | kind | more labels | counts |
//! | --- | --- | --- | --- |
//! | `dedup_batch_size` | histogram | | messages per [`Batch::run`](crate::batch::Batch::run) |
//! | `dedup_batch_messages_total` | counter | `outcome`: `processed`, `duplicate`, `failed`, `in_progress`, `fingerprint_mismatch`, `copy`, `invalid` | messages, as their [`BatchItem`](crate::batch::BatchItem) says |
//! | `dedup_batch_splits_total` | counter | | failing transactions split in two |
//!
//! HTTP idempotency keys ([`http`](crate::http), feature `axum`) record every answer the
//! layer or [`IdempotentRequest::answer`](crate::http::IdempotentRequest::answer) gives
//! (the handler's own metrics above count its calls):
//!
//! | name | kind | more labels | counts |
//! | --- | --- | --- | --- |
//! | `dedup_http_answers_total` | counter | `answer`: `processed`, `replayed`, `in_progress`, `key_reused`, `no_stored_response`, `missing_key`, `malformed_key`, `unidentified_caller`, `request_too_large`, `unreadable_request`, `response_too_large`, `server_error`, `application_error` | answers to requests with (or missing) an `Idempotency-Key` |
//!
//! Capabilities added later record theirs here, under the same prefix and labels.

#[cfg(feature = "metrics")]
use std::time::Instant;

use crate::outcome::Duplicate;

/// How a call ended, for its metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End<'a> {
    Processed,
    Duplicate(&'a Duplicate),
    /// A leased call found another delivery's lease (`LeaseOutcome::InProgress`).
    InProgress,
    Failed(Class),
}

impl End<'_> {
    /// The `outcome` of the call's span and histogram.
    pub(crate) fn outcome(self) -> &'static str {
        match self {
            End::Processed => "processed",
            End::Duplicate(_) => "duplicate",
            End::InProgress => "in_progress",
            End::Failed(_) => "failed",
        }
    }
}

/// A failure's `class` label.
/// In the order of `Keys::failures`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    InvalidId,
    Transient,
    RolledBack,
    Database,
    Body,
    LeaseLost,
    Mismatch,
    StoredResult,
}

impl Class {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn label(self) -> &'static str {
        match self {
            Class::InvalidId => "invalid_id",
            Class::Transient => "transient",
            Class::RolledBack => "rolled_back",
            Class::Database => "database",
            Class::Body => "body",
            Class::LeaseLost => "lease_lost",
            Class::Mismatch => "fingerprint_mismatch",
            Class::StoredResult => "stored_result",
        }
    }
}

/// When a call started, if anyone measures it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Started(#[cfg(feature = "metrics")] Instant);

impl Started {
    pub(crate) fn now() -> Self {
        Started(
            #[cfg(feature = "metrics")]
            Instant::now(),
        )
    }
}

/// One handler's metric keys, built at its first recorded call: after that, recording
/// allocates nothing (a key with labels that are not literals is otherwise built, and
/// its labels allocated, at every call). The generated code keeps one in a `static` per
/// handler; without the `metrics` feature it is empty.
pub struct HandlerMetrics {
    #[cfg(feature = "metrics")]
    keys: std::sync::OnceLock<Keys>,
}

impl HandlerMetrics {
    /// No keys yet: they are built at the first recorded call.
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        HandlerMetrics {
            #[cfg(feature = "metrics")]
            keys: std::sync::OnceLock::new(),
        }
    }

    #[cfg(feature = "metrics")]
    fn keys(&self, handler: &'static str, consumer: &'static str) -> &Keys {
        self.keys.get_or_init(|| Keys::new(handler, consumer))
    }
}

#[cfg(feature = "metrics")]
struct Keys {
    processed: metrics::Key,
    duplicate_message_id: metrics::Key,
    duplicate_business_key: metrics::Key,
    duplicate_outcome_unknown: metrics::Key,
    in_progress: metrics::Key,
    retries: metrics::Key,
    /// By [`Class`], in its order.
    failures: [metrics::Key; 8],
    /// By [`End::outcome`]: processed, duplicate, failed, in progress.
    duration: [metrics::Key; 4],
}

#[cfg(feature = "metrics")]
impl Keys {
    fn new(handler: &'static str, consumer: &'static str) -> Keys {
        use metrics::{Key, Label};
        let key = |name: &'static str, extra: Option<(&'static str, &'static str)>| {
            let mut labels = vec![
                Label::from_static_parts("handler", handler),
                Label::from_static_parts("consumer", consumer),
            ];
            labels.extend(extra.map(|(key, value)| Label::from_static_parts(key, value)));
            Key::from_parts(name, labels)
        };
        let failure = |class: Class| key("dedup_failures_total", Some(("class", class.label())));
        let duration = |outcome| key("dedup_handler_duration_seconds", Some(("outcome", outcome)));
        Keys {
            processed: key("dedup_processed_total", None),
            duplicate_message_id: key("dedup_duplicates_total", Some(("rule", "message_id"))),
            duplicate_business_key: key("dedup_duplicates_total", Some(("rule", "business_key"))),
            duplicate_outcome_unknown: key(
                "dedup_duplicates_total",
                Some(("rule", "outcome_unknown")),
            ),
            in_progress: key("dedup_in_progress_total", None),
            retries: key("dedup_retries_total", None),
            failures: [
                failure(Class::InvalidId),
                failure(Class::Transient),
                failure(Class::RolledBack),
                failure(Class::Database),
                failure(Class::Body),
                failure(Class::LeaseLost),
                failure(Class::Mismatch),
                failure(Class::StoredResult),
            ],
            duration: [
                duration("processed"),
                duration("duplicate"),
                duration("failed"),
                duration("in_progress"),
            ],
        }
    }
}

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Records the end of one call.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn ended(
    metrics: &HandlerMetrics,
    handler: &'static str,
    consumer: &'static str,
    end: End<'_>,
    started: Started,
) {
    #[cfg(feature = "metrics")]
    {
        let keys = metrics.keys(handler, consumer);
        let (counter, duration) = match end {
            End::Processed => (&keys.processed, &keys.duration[0]),
            End::Duplicate(Duplicate::BusinessKey { .. }) => {
                (&keys.duplicate_business_key, &keys.duration[1])
            }
            End::Duplicate(Duplicate::OutcomeUnknown) => {
                (&keys.duplicate_outcome_unknown, &keys.duration[1])
            }
            End::Duplicate(_) => (&keys.duplicate_message_id, &keys.duration[1]),
            End::InProgress => (&keys.in_progress, &keys.duration[3]),
            End::Failed(class) => (&keys.failures[class as usize], &keys.duration[2]),
        };
        let elapsed = started.0.elapsed();
        metrics::with_recorder(|recorder| {
            recorder.register_counter(counter, &METADATA).increment(1);
            recorder
                .register_histogram(duration, &METADATA)
                .record(elapsed);
        });
    }
}

/// Records an attempt that is run again.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn retried(metrics: &HandlerMetrics, handler: &'static str, consumer: &'static str) {
    #[cfg(feature = "metrics")]
    {
        let key = &metrics.keys(handler, consumer).retries;
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA).increment(1));
    }
}

/// Adds `count` to the counter `name` of `consumer` (the inbox's, the batches'), with one
/// more label.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn consumer_count(
    name: &'static str,
    consumer: &str,
    label: (&'static str, &'static str),
    count: u64,
) {
    #[cfg(feature = "metrics")]
    if count > 0 {
        let key = metrics::Key::from_parts(
            name,
            vec![
                metrics::Label::new("consumer", consumer.to_owned()),
                metrics::Label::from_static_parts(label.0, label.1),
            ],
        );
        metrics::with_recorder(|recorder| {
            recorder.register_counter(&key, &METADATA).increment(count);
        });
    }
}

/// Records one [`Batch::run`](crate::batch::Batch::run): its size, its messages by
/// outcome, its splits.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn batch_ran(
    consumer: &str,
    size: usize,
    outcomes: [(&'static str, usize); 7],
    splits: usize,
) {
    #[cfg(feature = "metrics")]
    {
        let label = || metrics::Label::new("consumer", consumer.to_owned());
        let size_key = metrics::Key::from_parts("dedup_batch_size", vec![label()]);
        let splits_key = metrics::Key::from_parts("dedup_batch_splits_total", vec![label()]);
        metrics::with_recorder(|recorder| {
            recorder
                .register_histogram(&size_key, &METADATA)
                .record(size as f64);
            if splits > 0 {
                recorder
                    .register_counter(&splits_key, &METADATA)
                    .increment(splits as u64);
            }
        });
        for (outcome, count) in outcomes {
            consumer_count(
                "dedup_batch_messages_total",
                consumer,
                ("outcome", outcome),
                count as u64,
            );
        }
    }
}

/// Adds `count` to `dedup_outbox_relayed_total{table, outcome}`. The outbox's label is
/// its table: one outbox table serves every consumer of a process, and two outboxes are
/// two tables.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn outbox_count(table: &str, outcome: &'static str, count: u64) {
    #[cfg(feature = "metrics")]
    if count > 0 {
        let key = metrics::Key::from_parts(
            "dedup_outbox_relayed_total",
            vec![
                metrics::Label::new("table", table.to_owned()),
                metrics::Label::from_static_parts("outcome", outcome),
            ],
        );
        metrics::with_recorder(|recorder| {
            recorder.register_counter(&key, &METADATA).increment(count);
        });
    }
}

/// Sets the outbox gauge `name` of `table` (with one more label, if any).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn outbox_gauge(
    name: &'static str,
    table: &str,
    label: Option<(&'static str, &'static str)>,
    value: f64,
) {
    #[cfg(feature = "metrics")]
    {
        let mut labels = vec![metrics::Label::new("table", table.to_owned())];
        labels.extend(label.map(|(key, value)| metrics::Label::from_static_parts(key, value)));
        let key = metrics::Key::from_parts(name, labels);
        metrics::with_recorder(|recorder| recorder.register_gauge(&key, &METADATA).set(value));
    }
}

/// Sets the inbox gauge `name` of `consumer` (with one more label, if any).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn inbox_gauge(
    name: &'static str,
    consumer: &str,
    label: Option<(&'static str, &'static str)>,
    value: f64,
) {
    #[cfg(feature = "metrics")]
    {
        let mut labels = vec![metrics::Label::new("consumer", consumer.to_owned())];
        labels.extend(label.map(|(key, value)| metrics::Label::from_static_parts(key, value)));
        let key = metrics::Key::from_parts(name, labels);
        metrics::with_recorder(|recorder| recorder.register_gauge(&key, &METADATA).set(value));
    }
}

/// Adds one to `dedup_http_answers_total{answer}`.
#[cfg(feature = "axum")]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn http_answered(answer: &'static str) {
    #[cfg(feature = "metrics")]
    {
        let key = metrics::Key::from_parts(
            "dedup_http_answers_total",
            vec![metrics::Label::from_static_parts("answer", answer)],
        );
        metrics::with_recorder(|recorder| {
            recorder.register_counter(&key, &METADATA).increment(1);
        });
    }
}
