//! Outgoing ids derived from their cause: [`OutgoingId`], [`Cause`], [`InvalidCause`].

use std::borrow::Cow;
use std::fmt;

use uuid::Uuid;

use super::{MAX_NAME_LEN, NAMESPACE, Outgoing};
use crate::key::{InvalidMessageId, MessageId, MessageKey};
use crate::names::{InvalidConsumer, check_consumer};

/// An outgoing message's id: a UUIDv5 in [`NAMESPACE`] of its cause — the consumer, the
/// incoming message's id and the slot, joined by NUL bytes (none of them may contain one):
/// `uuid5(NAMESPACE, consumer + "\0" + incoming id + "\0" + slot)`. The incoming id is
/// the text [`MessageKey`] gives, as `#[idempotent]` keys on it (an integer's decimal
/// digits, a UUID's hyphenated form). The scheme never changes between versions; any
/// language's UUID library computes the same id — Python's, for a producer without this
/// library:
///
/// ```text
/// >>> uuid.uuid5(uuid.UUID("f05ab860-2a3e-578c-897a-484e8894600b"),
/// ...            "billing\0evt_91c2\0invoice-created")
/// UUID('d52783e3-eaa0-5242-b33a-713ba7314074')
/// ```
///
/// Its text is the hyphenated lowercase form, which the relay sends as the broker's
/// message id (AMQP `message-id`, JetStream `Nats-Msg-Id`). Downstream it is a
/// [`MessageKey`]: `#[idempotent(key = …)]` dedups on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OutgoingId(pub(super) Uuid);

impl OutgoingId {
    /// The id of the outgoing message in `slot` of the cause (`consumer`, `incoming`):
    /// [`Cause::id`] without the [`Cause`].
    pub fn derive(
        consumer: &str,
        incoming: impl MessageKey,
        slot: &str,
    ) -> Result<OutgoingId, InvalidCause> {
        Cause::new(consumer, incoming)?.id(slot)
    }

    /// The id as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// The id of a UUID read back (from a broker's message id, say).
    pub fn from_uuid(uuid: Uuid) -> OutgoingId {
        OutgoingId(uuid)
    }

    /// The id a row holds as 16 bytes (MySQL, SQLite).
    #[cfg_attr(not(any(feature = "mysql", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn decode_bytes(bytes: &[u8]) -> Result<OutgoingId, sqlx::Error> {
        Uuid::from_slice(bytes)
            .map(OutgoingId)
            .map_err(|error| sqlx::Error::Decode(error.into()))
    }

    /// The id a row holds as `uuid`, read as text (PostgreSQL).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn decode_text(text: &str) -> Result<OutgoingId, sqlx::Error> {
        Uuid::parse_str(text)
            .map(OutgoingId)
            .map_err(|error| sqlx::Error::Decode(error.into()))
    }
}

impl fmt::Display for OutgoingId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl MessageKey for OutgoingId {
    fn message_id(&self) -> MessageId<'_> {
        MessageId::owned(self.to_string())
    }
}

/// What an outgoing id is derived from: the consumer and the incoming message's id.
///
/// ```
/// use dedup_runtime::outbox::{Cause, OutgoingId};
///
/// let cause = Cause::new("billing", "evt_91c2")?;
/// let id = cause.id("invoice-created")?;
/// assert_eq!(id, OutgoingId::derive("billing", "evt_91c2", "invoice-created")?);
/// // By index: the n-th message the handler sends is the slot named n.
/// assert_eq!(cause.nth_id(0), cause.id("0")?);
/// // Another consumer of the same message derives other ids.
/// assert_ne!(Cause::new("audit", "evt_91c2")?.id("invoice-created")?, id);
/// # Ok::<(), dedup_runtime::outbox::InvalidCause>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    pub(super) consumer: String,
    pub(super) incoming: String,
}

impl Cause {
    /// The cause of a handler's outgoing messages: its consumer (as in `#[idempotent]`)
    /// and the incoming message's id, checked as `#[idempotent]` checks them.
    pub fn new(consumer: &str, incoming: impl MessageKey) -> Result<Cause, InvalidCause> {
        check_consumer(consumer).map_err(InvalidCause::Consumer)?;
        let id = incoming.message_id();
        let incoming = id.validate().map_err(InvalidCause::MessageId)?.to_owned();
        Ok(Cause {
            consumer: consumer.to_owned(),
            incoming,
        })
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The incoming message's id.
    pub fn incoming(&self) -> &str {
        &self.incoming
    }

    /// The id of the outgoing message in `slot`: a name the handler gives it (1 to 255
    /// bytes, no NUL), the same on every run.
    pub fn id(&self, slot: &str) -> Result<OutgoingId, InvalidCause> {
        check_slot(slot)?;
        Ok(self.derive(slot))
    }

    /// The id of the handler's `index`-th outgoing message (from 0): the slot named by the
    /// index's decimal digits. Only as stable as the order in which the handler sends:
    /// prefer named slots where that order may change between versions.
    pub fn nth_id(&self, index: u32) -> OutgoingId {
        self.derive(&index.to_string())
    }

    /// The outgoing message in `slot` ([`id`](Self::id)), to `destination`, with
    /// `payload`; headers and an ordering key are added with [`Outgoing::header`] and
    /// [`Outgoing::ordering_key`].
    pub fn outgoing<'a>(
        &'a self,
        slot: &'a str,
        destination: &'a str,
        payload: &'a [u8],
    ) -> Result<Outgoing<'a>, InvalidCause> {
        let id = self.id(slot)?;
        Ok(Outgoing::new(
            self,
            id,
            Cow::Borrowed(slot),
            destination,
            payload,
        ))
    }

    /// The handler's `index`-th outgoing message ([`nth_id`](Self::nth_id)).
    pub fn nth_outgoing<'a>(
        &'a self,
        index: u32,
        destination: &'a str,
        payload: &'a [u8],
    ) -> Outgoing<'a> {
        let id = self.nth_id(index);
        Outgoing::new(
            self,
            id,
            Cow::Owned(index.to_string()),
            destination,
            payload,
        )
    }

    fn derive(&self, slot: &str) -> OutgoingId {
        let mut name =
            Vec::with_capacity(self.consumer.len() + self.incoming.len() + slot.len() + 2);
        name.extend_from_slice(self.consumer.as_bytes());
        name.push(0);
        name.extend_from_slice(self.incoming.as_bytes());
        name.push(0);
        name.extend_from_slice(slot.as_bytes());
        OutgoingId(Uuid::new_v5(&NAMESPACE, &name))
    }
}

fn check_slot(slot: &str) -> Result<(), InvalidCause> {
    if slot.is_empty() {
        return Err(InvalidCause::EmptySlot);
    }
    if slot.len() > MAX_NAME_LEN {
        return Err(InvalidCause::SlotTooLong {
            len: slot.len(),
            max: MAX_NAME_LEN,
        });
    }
    if let Some(position) = slot.bytes().position(|byte| byte == 0) {
        return Err(InvalidCause::SlotContainsNul { position });
    }
    Ok(())
}

/// Why a [`Cause`] or an outgoing id could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidCause {
    /// The consumer is empty, too long or contains NUL.
    Consumer(InvalidConsumer),
    /// The incoming message id is empty, too long or contains NUL.
    MessageId(InvalidMessageId),
    /// The slot is empty.
    EmptySlot,
    /// The slot is longer than [`MAX_NAME_LEN`] bytes.
    SlotTooLong {
        /// Its length in bytes.
        len: usize,
        /// [`MAX_NAME_LEN`].
        max: usize,
    },
    /// The slot contains a NUL byte (the separator of the id's name).
    SlotContainsNul {
        /// The byte offset of the first NUL.
        position: usize,
    },
}

impl fmt::Display for InvalidCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidCause::Consumer(error) => error.fmt(f),
            InvalidCause::MessageId(error) => error.fmt(f),
            InvalidCause::EmptySlot => f.write_str("invalid outgoing slot: it is empty"),
            InvalidCause::SlotTooLong { len, max } => write!(
                f,
                "invalid outgoing slot: it is {len} bytes, over the limit of {max}"
            ),
            InvalidCause::SlotContainsNul { position } => write!(
                f,
                "invalid outgoing slot: it contains a NUL byte at {position}"
            ),
        }
    }
}

impl std::error::Error for InvalidCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            InvalidCause::Consumer(error) => Some(error),
            InvalidCause::MessageId(error) => Some(error),
            _ => None,
        }
    }
}

/// For a handler whose error type is built `From<sqlx::Error>`: a
/// `sqlx::Error::InvalidArgument` with this error's text, as an invalid message id is.
impl From<InvalidCause> for sqlx::Error {
    fn from(error: InvalidCause) -> sqlx::Error {
        sqlx::Error::InvalidArgument(error.to_string())
    }
}
