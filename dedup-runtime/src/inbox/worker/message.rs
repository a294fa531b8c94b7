//! [`InboxMessage`]: a claimed message as the handler sees it.

/// A message a worker claimed, as the handler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxMessage {
    pub(crate) id: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) attempt: u32,
}

impl InboxMessage {
    /// The message id, as received.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The payload, byte for byte as received.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers, byte for byte as received, if any.
    pub fn headers(&self) -> Option<&[u8]> {
        self.headers.as_deref()
    }

    /// Its ordering key, if it was received with one.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Which attempt this is, from 1: counted when the row was claimed, so an attempt
    /// that killed its process counts too (a stopped worker's rows that never started get
    /// theirs back).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}
