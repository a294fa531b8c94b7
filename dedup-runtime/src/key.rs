//! Message ids: what `key = …` may be, and which ids are refused.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

/// The longest message id, in bytes of UTF-8, that the dedup table stores.
///
/// Longer ids are refused with [`InvalidMessageId::TooLong`] before anything is written:
/// never truncated, because two ids that share a prefix are different messages. 255 bytes
/// holds every broker's id (an SQS message id is at most 100 characters, a UUID 36).
pub const MAX_MESSAGE_ID_LEN: usize = dedup_limits::MAX_MESSAGE_ID_LEN;

/// The longest consumer name, in bytes; `#[idempotent]` checks it at compile time.
pub const MAX_CONSUMER_LEN: usize = dedup_limits::MAX_CONSUMER_LEN;

/// Room for the longest integer (`i128::MIN`, 40 characters) and a hyphenated UUID (36).
const INLINE: usize = 40;

/// A message id as the dedup table stores it: text, compared byte for byte.
///
/// Produced by [`MessageKey::message_id`]. Strings are borrowed, integers and UUIDs are
/// written into an inline buffer, so that computing the id allocates nothing.
///
/// ```
/// use dedup_runtime::{MessageId, MessageKey};
///
/// assert_eq!(1207_u64.message_id().as_str(), "1207");
/// // A Kafka record's offset repeats in every partition: key on all three.
/// let id = MessageId::owned(format!("{}/{}/{}", "orders", 3, 1207));
/// assert_eq!(id.to_string(), "orders/3/1207");
/// ```
#[derive(Clone)]
pub struct MessageId<'a>(Repr<'a>);

#[derive(Clone)]
enum Repr<'a> {
    Borrowed(&'a str),
    Owned(String),
    Inline { bytes: [u8; INLINE], len: u8 },
}

impl<'a> MessageId<'a> {
    /// An id that borrows its text.
    pub fn borrowed(id: &'a str) -> Self {
        MessageId(Repr::Borrowed(id))
    }

    /// An id that owns its text, for keys computed on the fly.
    pub fn owned(id: String) -> MessageId<'static> {
        MessageId(Repr::Owned(id))
    }

    /// The same id, owning its text (a borrowed one is copied).
    pub(crate) fn into_owned(self) -> MessageId<'static> {
        match self.0 {
            Repr::Borrowed(id) => MessageId(Repr::Owned(id.to_owned())),
            Repr::Owned(id) => MessageId(Repr::Owned(id)),
            Repr::Inline { bytes, len } => MessageId(Repr::Inline { bytes, len }),
        }
    }

    /// The id as text, whether or not it is valid.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Borrowed(id) => id,
            Repr::Owned(id) => id,
            // Only ASCII digits, signs and hex are ever written inline.
            Repr::Inline { bytes, len } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
        }
    }

    /// The id, or why the dedup table cannot store it.
    ///
    /// ```
    /// use dedup_runtime::{InvalidMessageId, MessageId};
    ///
    /// assert_eq!(MessageId::borrowed("evt_91c2").validate(), Ok("evt_91c2"));
    /// assert_eq!(MessageId::borrowed("").validate(), Err(InvalidMessageId::Empty));
    /// assert_eq!(
    ///     MessageId::borrowed("a\0b").validate(),
    ///     Err(InvalidMessageId::ContainsNul { position: 1 })
    /// );
    /// ```
    pub fn validate(&self) -> Result<&str, InvalidMessageId> {
        let id = self.as_str();
        if id.is_empty() {
            Err(InvalidMessageId::Empty)
        } else if id.len() > MAX_MESSAGE_ID_LEN {
            Err(InvalidMessageId::TooLong {
                len: id.len(),
                max: MAX_MESSAGE_ID_LEN,
            })
        } else if let Some(position) = id.bytes().position(|b| b == 0) {
            Err(InvalidMessageId::ContainsNul { position })
        } else {
            Ok(id)
        }
    }

    fn inline(write: impl FnOnce(&mut [u8; INLINE]) -> usize) -> MessageId<'static> {
        let mut bytes = [0; INLINE];
        let len = write(&mut bytes);
        MessageId(Repr::Inline {
            bytes,
            len: u8::try_from(len).unwrap_or(0),
        })
    }
}

impl fmt::Display for MessageId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for MessageId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// Why a message id was refused. Nothing was written and the handler's body did not run.
///
/// The generated function reports it through the handler's own error type `E`, as a
/// [`sqlx::Error::InvalidArgument`] whose text is this error's (`invalid message id: it is
/// empty`): of sqlx's variants, the one for an invalid argument, and the only one that
/// prints no words of sqlx's own before ours (`Encode`, which would carry the typed error
/// as its source, reads "error occurred while encoding a value: …"). It carries text, so
/// [`InvalidMessageId::find`] reads the typed error back from that text, which has one
/// fixed format per variant:
///
/// ```
/// use dedup_runtime::InvalidMessageId;
///
/// let error: sqlx::Error = InvalidMessageId::Empty.into();
/// assert_eq!(error.to_string(), "invalid message id: it is empty");
/// assert_eq!(InvalidMessageId::find(&error), Some(InvalidMessageId::Empty));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidMessageId {
    /// The id is the empty string.
    Empty,
    /// The id is longer than [`MAX_MESSAGE_ID_LEN`] bytes.
    TooLong {
        /// The id's length in bytes.
        len: usize,
        /// The limit, [`MAX_MESSAGE_ID_LEN`].
        max: usize,
    },
    /// The id contains a NUL byte, which PostgreSQL cannot store in text.
    ContainsNul {
        /// Byte offset of the first NUL.
        position: usize,
    },
}

/// The first words of every [`InvalidMessageId`]'s text.
const PREFIX: &str = "invalid message id: ";

/// The longest text of an [`InvalidMessageId`] (`TooLong` with two `u64::MAX`), rounded up.
const LONGEST_TEXT: usize = 128;

impl InvalidMessageId {
    /// Finds an `InvalidMessageId` in `error` or its chain of [`source`](StdError::source)s,
    /// so that it can be recognised behind `sqlx::Error`, a `thiserror` enum (`#[from]` or
    /// `#[error(transparent)]`), `Box<dyn Error>` or `anyhow::Error` (pass
    /// `error.as_ref()`).
    ///
    /// It finds the typed error itself, or its text: as a `sqlx::Error::InvalidArgument`
    /// (how the generated code reports it), or as the whole text of the chain's last link
    /// (an `#[error(transparent)]` wrapper shows the `sqlx::Error`'s text but hides it from
    /// the chain). An error type that keeps only a string of the error is not seen
    /// through unless that string is the last link's whole text.
    ///
    /// ```
    /// use std::error::Error;
    ///
    /// use dedup_runtime::InvalidMessageId;
    ///
    /// // What thiserror's `#[error(transparent)] Database(#[from] sqlx::Error)` generates.
    /// #[derive(Debug)]
    /// struct AppError(sqlx::Error);
    /// impl std::fmt::Display for AppError {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         self.0.fmt(f)
    ///     }
    /// }
    /// impl Error for AppError {
    ///     fn source(&self) -> Option<&(dyn Error + 'static)> {
    ///         self.0.source()
    ///     }
    /// }
    ///
    /// let error = AppError(InvalidMessageId::ContainsNul { position: 3 }.into());
    /// assert_eq!(error.to_string(), "invalid message id: it contains a NUL byte at 3");
    /// assert_eq!(
    ///     InvalidMessageId::find(&error),
    ///     Some(InvalidMessageId::ContainsNul { position: 3 })
    /// );
    /// assert_eq!(InvalidMessageId::find(&sqlx::Error::RowNotFound), None);
    /// ```
    pub fn find(error: &(dyn StdError + 'static)) -> Option<InvalidMessageId> {
        crate::chain::find(error, |link, _| {
            if let Some(found) = link.downcast_ref::<InvalidMessageId>() {
                return Some(found.clone());
            }
            match link.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::InvalidArgument(text)) => InvalidMessageId::parse(text),
                Some(_) => None,
                None if link.source().is_none() => InvalidMessageId::displayed(link),
                None => None,
            }
        })
    }

    /// The error whose text is exactly `text`.
    fn parse(text: &str) -> Option<InvalidMessageId> {
        let detail = text.strip_prefix(PREFIX)?;
        let number = |digits: &str| -> Option<usize> {
            // Only what `Display` writes: no sign, no leading zero.
            let canonical = digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            canonical.then(|| digits.parse().ok()).flatten()
        };
        if detail == "it is empty" {
            Some(InvalidMessageId::Empty)
        } else if let Some(position) = detail.strip_prefix("it contains a NUL byte at ") {
            Some(InvalidMessageId::ContainsNul {
                position: number(position)?,
            })
        } else {
            let (len, max) = detail
                .strip_prefix("it is ")?
                .split_once(" bytes long, the limit is ")?;
            Some(InvalidMessageId::TooLong {
                len: number(len)?,
                max: number(max)?,
            })
        }
    }

    /// The error whose text is exactly `link`'s, written into a buffer on the stack (an
    /// error whose text is longer is not one).
    fn displayed(link: &dyn fmt::Display) -> Option<InvalidMessageId> {
        struct Buffer {
            bytes: [u8; LONGEST_TEXT],
            len: usize,
        }
        impl fmt::Write for Buffer {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                let end = self.len + s.len();
                self.bytes
                    .get_mut(self.len..end)
                    .ok_or(fmt::Error)?
                    .copy_from_slice(s.as_bytes());
                self.len = end;
                Ok(())
            }
        }
        let mut buffer = Buffer {
            bytes: [0; LONGEST_TEXT],
            len: 0,
        };
        fmt::write(&mut buffer, format_args!("{link}")).ok()?;
        let text = std::str::from_utf8(&buffer.bytes[..buffer.len]).ok()?;
        InvalidMessageId::parse(text)
    }
}

impl fmt::Display for InvalidMessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `InvalidMessageId::parse` reads these back: change both together.
        f.write_str(PREFIX)?;
        match self {
            InvalidMessageId::Empty => f.write_str("it is empty"),
            InvalidMessageId::TooLong { len, max } => {
                write!(f, "it is {len} bytes long, the limit is {max}")
            }
            InvalidMessageId::ContainsNul { position } => {
                write!(f, "it contains a NUL byte at {position}")
            }
        }
    }
}

impl StdError for InvalidMessageId {}

/// A [`sqlx::Error::InvalidArgument`] with the id error's text, which
/// [`InvalidMessageId::find`] reads back.
impl From<InvalidMessageId> for sqlx::Error {
    fn from(error: InvalidMessageId) -> Self {
        sqlx::Error::InvalidArgument(error.to_string())
    }
}

/// A type that can identify a message: the `key = …` of `#[idempotent]`.
///
/// Implemented for `str`, `String`, `Cow<str>`, every integer type, `uuid::Uuid` (feature
/// `uuid`), and references and smart pointers to them. For your own id type, return the
/// text the broker uses:
///
/// ```
/// use dedup_runtime::{MessageId, MessageKey};
///
/// struct EventId(String);
///
/// impl MessageKey for EventId {
///     fn message_id(&self) -> MessageId<'_> {
///         MessageId::borrowed(&self.0)
///     }
/// }
/// assert_eq!(EventId("evt_91c2".into()).message_id().as_str(), "evt_91c2");
/// assert_eq!(42_u64.message_id().as_str(), "42");
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as a message id",
    label = "`key = …` must be a string, an integer or a `uuid::Uuid`",
    note = "pass a field that holds the broker's message id (`key = msg.id`), convert it \
            (`key = msg.id.to_string()`), or implement `dedup_runtime::MessageKey` for `{Self}`"
)]
pub trait MessageKey {
    /// The id under which the message is recorded.
    fn message_id(&self) -> MessageId<'_>;
}

impl MessageKey for str {
    fn message_id(&self) -> MessageId<'_> {
        MessageId::borrowed(self)
    }
}

impl MessageKey for String {
    fn message_id(&self) -> MessageId<'_> {
        MessageId::borrowed(self)
    }
}

impl MessageKey for Cow<'_, str> {
    fn message_id(&self) -> MessageId<'_> {
        MessageId::borrowed(self)
    }
}

impl<T: MessageKey + ?Sized> MessageKey for &T {
    fn message_id(&self) -> MessageId<'_> {
        (**self).message_id()
    }
}

impl<T: MessageKey + ?Sized> MessageKey for &mut T {
    fn message_id(&self) -> MessageId<'_> {
        (**self).message_id()
    }
}

impl<T: MessageKey + ?Sized> MessageKey for Box<T> {
    fn message_id(&self) -> MessageId<'_> {
        (**self).message_id()
    }
}

impl<T: MessageKey + ?Sized> MessageKey for Arc<T> {
    fn message_id(&self) -> MessageId<'_> {
        (**self).message_id()
    }
}

impl<T: MessageKey + ?Sized> MessageKey for Rc<T> {
    fn message_id(&self) -> MessageId<'_> {
        (**self).message_id()
    }
}

/// Writes the decimal digits of `magnitude`, after a `-` when `negative`.
fn write_decimal(bytes: &mut [u8; INLINE], negative: bool, mut magnitude: u128) -> usize {
    let mut digits = [0u8; INLINE];
    let mut n = 0;
    loop {
        digits[n] = b'0' + (magnitude % 10) as u8;
        n += 1;
        magnitude /= 10;
        if magnitude == 0 {
            break;
        }
    }
    let mut len = 0;
    if negative {
        bytes[0] = b'-';
        len = 1;
    }
    for digit in digits[..n].iter().rev() {
        bytes[len] = *digit;
        len += 1;
    }
    len
}

macro_rules! unsigned_keys {
    ($($ty:ty),*) => {$(
        impl MessageKey for $ty {
            fn message_id(&self) -> MessageId<'_> {
                let value = *self;
                MessageId::inline(|bytes| write_decimal(bytes, false, value as u128))
            }
        }
    )*};
}

macro_rules! signed_keys {
    ($($ty:ty),*) => {$(
        impl MessageKey for $ty {
            fn message_id(&self) -> MessageId<'_> {
                let value = *self;
                MessageId::inline(|bytes| {
                    write_decimal(bytes, value < 0, (value as i128).unsigned_abs())
                })
            }
        }
    )*};
}

unsigned_keys!(u8, u16, u32, u64, u128, usize);
signed_keys!(i8, i16, i32, i64, i128, isize);

#[cfg(feature = "uuid")]
impl MessageKey for uuid::Uuid {
    /// The lowercase hyphenated form, `67e55044-10b1-426f-9247-bb680e5fe0c8`.
    fn message_id(&self) -> MessageId<'_> {
        let uuid = *self;
        MessageId::inline(|bytes| uuid.hyphenated().encode_lower(&mut bytes[..]).len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_print_like_display() {
        for value in [0_i128, 1, -1, 9, 10, -10, i128::MAX, i128::MIN, 1234567890] {
            assert_eq!(value.message_id().as_str(), value.to_string());
        }
        assert_eq!(u128::MAX.message_id().as_str(), u128::MAX.to_string());
        assert_eq!(i8::MIN.message_id().as_str(), "-128");
        assert_eq!(0_u8.message_id().as_str(), "0");
    }

    #[test]
    fn refuses_bad_ids() {
        let long = "x".repeat(MAX_MESSAGE_ID_LEN + 1);
        assert_eq!(
            MessageId::borrowed(&long).validate(),
            Err(InvalidMessageId::TooLong {
                len: MAX_MESSAGE_ID_LEN + 1,
                max: MAX_MESSAGE_ID_LEN
            })
        );
        let longest = "é".repeat(MAX_MESSAGE_ID_LEN / 2);
        assert!(MessageId::borrowed(&longest).validate().is_ok());
        assert_eq!(
            MessageId::borrowed("").validate(),
            Err(InvalidMessageId::Empty)
        );
    }

    #[test]
    fn found_behind_sources() {
        #[derive(Debug)]
        struct Wrapper(sqlx::Error);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let error = Wrapper(InvalidMessageId::ContainsNul { position: 3 }.into());
        assert_eq!(
            InvalidMessageId::find(&error),
            Some(InvalidMessageId::ContainsNul { position: 3 })
        );
        assert_eq!(InvalidMessageId::find(&sqlx::Error::RowNotFound), None);
        // The typed error itself, as a user's error type may hold it.
        let typed = InvalidMessageId::TooLong { len: 300, max: 255 };
        assert_eq!(InvalidMessageId::find(&typed), Some(typed.clone()));
    }

    #[test]
    fn text_reads_back_as_the_same_error() {
        let errors = [
            InvalidMessageId::Empty,
            InvalidMessageId::TooLong {
                len: MAX_MESSAGE_ID_LEN + 1,
                max: MAX_MESSAGE_ID_LEN,
            },
            InvalidMessageId::TooLong {
                len: usize::MAX,
                max: usize::MAX,
            },
            InvalidMessageId::ContainsNul { position: 0 },
            InvalidMessageId::ContainsNul { position: 254 },
        ];
        for error in errors {
            let text = error.to_string();
            assert!(text.starts_with("invalid message id: "), "{text}");
            assert!(text.len() <= LONGEST_TEXT, "{text}");
            assert_eq!(
                InvalidMessageId::parse(&text),
                Some(error.clone()),
                "{text}"
            );
            assert_eq!(
                InvalidMessageId::displayed(&text),
                Some(error.clone()),
                "{text}"
            );
            let sqlx: sqlx::Error = error.clone().into();
            assert_eq!(sqlx.to_string(), text);
            assert_eq!(InvalidMessageId::find(&sqlx), Some(error));
        }
        // Only the exact text: not a prefix, a suffix, other digits, another argument.
        for text in [
            "invalid message id: it is empty.",
            "invalid message id: it is",
            "error: invalid message id: it is empty",
            "invalid message id: it is +300 bytes long, the limit is 255",
            "invalid message id: it is 0300 bytes long, the limit is 255",
            "invalid message id: it contains a NUL byte at ",
            "invalid message id: it contains a NUL byte at -1",
        ] {
            assert_eq!(InvalidMessageId::parse(text), None, "{text}");
        }
        let other = sqlx::Error::InvalidArgument("`limit` must be positive".into());
        assert_eq!(InvalidMessageId::find(&other), None);
        let long = "x".repeat(2 * LONGEST_TEXT);
        assert_eq!(InvalidMessageId::displayed(&long), None);
    }
}
