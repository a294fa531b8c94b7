//! Counters and a latency histogram per handler, through the [`metrics`] facade (feature
//! `metrics`): no exporter is chosen for you, and without the feature nothing is
//! compiled in. Every metric carries the labels `handler` (the function's name) and
//! `consumer` (empty for a handler with `unique = …` alone).
//!
//! | name | kind | more labels | counts |
//! | --- | --- | --- | --- |
//! | `dedup_processed_total` | counter | | calls that committed the body's work |
//! | `dedup_duplicates_total` | counter | `rule`: `message_id`, `business_key` | calls that found a duplicate |
//! | `dedup_retries_total` | counter | | attempts run again after a transient failure |
//! | `dedup_failures_total` | counter | `class` (below) | calls that returned an error |
//! | `dedup_handler_duration_seconds` | histogram | `outcome`: `processed`, `duplicate`, `failed` | one call, all its attempts |
//!
//! A failure's `class`: `invalid_id` (the key was refused, nothing ran), `transient` (a
//! transient database failure no attempt was left for, or one inside the caller's
//! transaction, which the caller retries), `rolled_back` (the database rolled the
//! transaction back by itself, see [`RolledBack`](crate::RolledBack)), `database` (any
//! other error of ours: the connection, the claim, the commit), `body` (the body's own
//! error).
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
    Failed(Class),
}

impl End<'_> {
    /// The `outcome` of the call's span and histogram.
    pub(crate) fn outcome(self) -> &'static str {
        match self {
            End::Processed => "processed",
            End::Duplicate(_) => "duplicate",
            End::Failed(_) => "failed",
        }
    }
}

/// A failure's `class` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    InvalidId,
    Transient,
    RolledBack,
    Database,
    Body,
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

/// Records the end of one call.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn ended(handler: &'static str, consumer: &'static str, end: End<'_>, started: Started) {
    #[cfg(feature = "metrics")]
    {
        match end {
            End::Processed => metrics::counter!(
                "dedup_processed_total",
                "handler" => handler,
                "consumer" => consumer
            )
            .increment(1),
            End::Duplicate(duplicate) => metrics::counter!(
                "dedup_duplicates_total",
                "handler" => handler,
                "consumer" => consumer,
                "rule" => match duplicate {
                    Duplicate::AlreadyProcessed => "message_id",
                    Duplicate::BusinessKey { .. } => "business_key",
                }
            )
            .increment(1),
            End::Failed(class) => metrics::counter!(
                "dedup_failures_total",
                "handler" => handler,
                "consumer" => consumer,
                "class" => class.label()
            )
            .increment(1),
        }
        metrics::histogram!(
            "dedup_handler_duration_seconds",
            "handler" => handler,
            "consumer" => consumer,
            "outcome" => end.outcome()
        )
        .record(started.0.elapsed());
    }
}

/// Records an attempt that is run again.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn retried(handler: &'static str, consumer: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "dedup_retries_total",
        "handler" => handler,
        "consumer" => consumer
    )
    .increment(1);
}
