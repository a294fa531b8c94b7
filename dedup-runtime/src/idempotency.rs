//! Idempotency keys for effects outside the database: derived from the message id, so
//! that every delivery of one message asks the other side for the same effect.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::key::MessageKey;

/// The longest key [`IdempotencyKey`] produces, in bytes: Stripe's limit, which most
/// providers meet or exceed.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// What marks a hashed key: `%` followed by a lowercase letter never occurs in the
/// escaped text of a plain key, so no plain key can look like a hashed one.
const HASHED: &str = "%sha256:";

/// An idempotency key for an effect outside the database (an email, a payment, a
/// partner's API), derived from the message id: `scope:id`.
///
/// Pass it to a provider that deduplicates on a key (Stripe's `Idempotency-Key`
/// header, an email API's idempotency or message-id field): a redelivered message, or a
/// send-first handler's call repeated after a crash, asks for the same effect again and
/// the provider performs it once.
///
/// ```
/// use dedup_runtime::IdempotencyKey;
///
/// let key = IdempotencyKey::new("email", "evt_91c2");
/// assert_eq!(key.to_string(), "email:evt_91c2");
/// assert_eq!(IdempotencyKey::new("charge", 42_u64).as_str(), "charge:42");
/// ```
///
/// # The format (it never changes between versions)
///
/// `scope`, a colon, and the id (the text [`MessageKey`] gives: an integer's decimal
/// digits, a UUID's hyphenated form), with every byte that is not visible ASCII
/// (`!` to `~`), and every `%`, written as `%` and two uppercase hex digits; in the scope
/// a `:` is written `%3A` too, so the first colon always ends the scope. Keys therefore
/// are printable ASCII, valid as an HTTP header value as they are, and two different
/// (scope, id) pairs never give the same key:
///
/// | scope | id | key |
/// | --- | --- | --- |
/// | `email` | `evt_91c2` | `email:evt_91c2` |
/// | `email` | `a:b` | `email:a:b` |
/// | `a:b` | `c` | `a%3Ab:c` |
/// | `email` | `évt` | `email:%C3%A9vt` |
/// | `email` | `a b` | `email:a%20b` |
/// | `email` | `100%` | `email:100%25` |
///
/// A key that would be longer than [`MAX_IDEMPOTENCY_KEY_LEN`] (255) bytes is hashed,
/// never truncated (a truncated key would collide with every id sharing its prefix):
/// `<escaped scope>:%sha256:<SHA-256 of the whole escaped key, 64 lowercase hex
/// digits>`, or `%sha256:<64 hex digits>` when the escaped scope alone is longer than 183
/// bytes. [`is_hashed`](Self::is_hashed) tells them apart; the `%` followed by a
/// lowercase letter is never part of a plain key.
///
/// # Scopes
///
/// The scope names the effect: one scope per kind of effect (`receipt-email`,
/// `charge`, `crm-sync`), so that two effects of one handler get two keys. The consumer
/// is not part of the key: two consumers of the same message that use the same scope
/// share a key, and the provider performs the effect once for both — say so by choosing
/// the same scope only when that is what you want; otherwise put the consumer in the
/// scope (`billing.charge`, `refunds.charge`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key of the effect `scope` for the message `id`.
    pub fn new(scope: &str, id: impl MessageKey) -> Self {
        let id = id.message_id();
        let mut key = String::with_capacity(scope.len() + 1 + id.as_str().len());
        escape(scope, true, &mut key);
        let scope_len = key.len();
        key.push(':');
        escape(id.as_str(), false, &mut key);
        if key.len() <= MAX_IDEMPOTENCY_KEY_LEN {
            return IdempotencyKey(key);
        }
        let digest = Sha256::digest(key.as_bytes());
        let hex = |out: &mut String| {
            for byte in digest {
                out.push(char::from(HEX_LOWER[usize::from(byte >> 4)]));
                out.push(char::from(HEX_LOWER[usize::from(byte & 0xf)]));
            }
        };
        let kept_scope = if scope_len + 1 + HASHED.len() + 64 <= MAX_IDEMPOTENCY_KEY_LEN {
            scope_len + 1
        } else {
            0
        };
        key.truncate(kept_scope);
        key.push_str(HASHED);
        hex(&mut key);
        IdempotencyKey(key)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key is the hashed form of a (scope, id) too long to spell out.
    ///
    /// ```
    /// use dedup_runtime::IdempotencyKey;
    ///
    /// let long = "x".repeat(300);
    /// let key = IdempotencyKey::new("email", long.as_str());
    /// assert!(key.is_hashed());
    /// assert!(key.as_str().starts_with("email:%sha256:"));
    /// assert_eq!(key.as_str().len(), 6 + 8 + 64);
    /// assert!(!IdempotencyKey::new("email", "evt_91c2").is_hashed());
    /// ```
    pub fn is_hashed(&self) -> bool {
        self.0.contains(HASHED)
    }

    /// The key as an owned `String`.
    pub fn into_string(self) -> String {
        self.0
    }
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";
const HEX_LOWER: &[u8; 16] = b"0123456789abcdef";

/// Appends `text`, with every byte outside visible ASCII, every `%` and (in a scope)
/// every `:` written as `%XX`.
fn escape(text: &str, scope: bool, out: &mut String) {
    for byte in text.bytes() {
        let plain = matches!(byte, b'!'..=b'~') && byte != b'%' && !(scope && byte == b':');
        if plain {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX_UPPER[usize::from(byte >> 4)]));
            out.push(char::from(HEX_UPPER[usize::from(byte & 0xf)]));
        }
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<IdempotencyKey> for String {
    fn from(key: IdempotencyKey) -> String {
        key.0
    }
}
