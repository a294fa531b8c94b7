//! What an inbox call refuses ([`Refused`]) and how it fails ([`InboxError`]).

use std::fmt;

use crate::key::InvalidMessageId;
use crate::stored::FingerprintMismatch;
use crate::table::Table;
#[cfg(doc)]
use {
    super::{Inbox, Worker, migrate, migrate_table},
    crate::MAX_CONSUMER_LEN,
};

/// Why the inbox refused one message. Nothing of it was written; another delivery of the
/// same message would be refused the same way: dead-letter it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refused {
    /// The message id is empty, too long or contains NUL, as `#[idempotent]` refuses it.
    InvalidMessageId(InvalidMessageId),
    /// The payload is longer than the inbox's limit.
    PayloadTooLarge {
        /// The payload's length in bytes.
        len: usize,
        /// The inbox's limit ([`Inbox::max_payload_len`]).
        max: usize,
    },
    /// The ordering key is empty, too long or contains NUL (the message id's rules).
    InvalidOrderingKey(InvalidMessageId),
    /// The headers are longer than [`MAX_HEADERS_LEN`](super::MAX_HEADERS_LEN).
    HeadersTooLarge {
        /// The headers' length in bytes.
        len: usize,
        /// [`MAX_HEADERS_LEN`](super::MAX_HEADERS_LEN).
        max: usize,
    },
    /// The id is stored already, with another payload: an id reused upstream, not a
    /// redelivery (the inbox compares the payloads' SHA-256, [`Inbox::fingerprints`]).
    /// Nothing was written, and the stored message stands.
    FingerprintMismatch(FingerprintMismatch),
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::InvalidMessageId(error) => error.fmt(f),
            Refused::InvalidOrderingKey(error) => write!(f, "invalid ordering key: {error}"),
            Refused::PayloadTooLarge { len, max } => write!(
                f,
                "the payload is {len} bytes, over the inbox's limit of {max} bytes: it is \
                 refused, never truncated"
            ),
            Refused::HeadersTooLarge { len, max } => write!(
                f,
                "the headers are {len} bytes, over the limit of {max} bytes: refused, never \
                 truncated"
            ),
            Refused::FingerprintMismatch(mismatch) => mismatch.fmt(f),
        }
    }
}

impl std::error::Error for Refused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Refused::InvalidMessageId(error) | Refused::InvalidOrderingKey(error) => Some(error),
            Refused::FingerprintMismatch(mismatch) => Some(mismatch),
            _ => None,
        }
    }
}

/// A failed inbox call.
#[derive(Debug)]
#[non_exhaustive]
pub enum InboxError {
    /// The message was refused before anything was written ([`Inbox::receive`]).
    Refused(Refused),
    /// The inbox table does not exist: run [`migrate`] (or [`migrate_table`]) first.
    MissingTable {
        /// The table the inbox uses.
        table: Table,
        /// The database's error.
        error: sqlx::Error,
    },
    /// The database failed; nothing can be assumed stored: do not acknowledge.
    Database(sqlx::Error),
    /// The worker's heartbeat is not shorter than its lease: a claim would run out
    /// between two renewals. Refused by [`Worker::process_batch`] and [`Worker::run`]
    /// before they claim anything.
    HeartbeatNotUnderLease {
        /// [`Worker::heartbeat`].
        heartbeat: std::time::Duration,
        /// [`Worker::lease`].
        lease: std::time::Duration,
    },
}

impl fmt::Display for InboxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InboxError::Refused(refused) => write!(f, "message refused by the inbox: {refused}"),
            InboxError::MissingTable { table, .. } => write!(
                f,
                "the inbox table `{}` does not exist: run `dedup_runtime::inbox::migrate` first",
                table.name()
            ),
            InboxError::Database(error) => write!(f, "inbox: {error}"),
            InboxError::HeartbeatNotUnderLease { heartbeat, lease } => write!(
                f,
                "the inbox worker's heartbeat ({heartbeat:?}) is not shorter than its lease \
                 ({lease:?}): its claims would run out between renewals; set a heartbeat of \
                 at most a third of the lease, or leave it unset"
            ),
        }
    }
}

impl std::error::Error for InboxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            InboxError::Refused(refused) => Some(refused),
            InboxError::MissingTable { error, .. } | InboxError::Database(error) => Some(error),
            InboxError::HeartbeatNotUnderLease { .. } => None,
        }
    }
}

impl From<Refused> for InboxError {
    fn from(refused: Refused) -> Self {
        InboxError::Refused(refused)
    }
}
