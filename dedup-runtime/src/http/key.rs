//! The `Idempotency-Key` header, read as the draft defines it: an RFC 8941 structured
//! field whose value is a String; and the message id a key and its scope make.

use std::fmt;

use crate::MAX_MESSAGE_ID_LEN;

/// Between a scope and a key in their message id: U+001F, which neither a key (printable
/// ASCII) nor a scope (refused) contains.
const SEPARATOR: char = '\u{1f}';

/// Why a key, or a key with its scope, was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has no `Idempotency-Key`.
    Missing,
    /// More than one `Idempotency-Key` field.
    Repeated,
    /// The value is not a structured-field string; `why` says where it fails.
    Malformed {
        /// What is wrong with it.
        why: &'static str,
    },
    /// The key is empty (`""`).
    Empty,
    /// The key, with its scope, does not fit a message id.
    TooLong {
        /// The key's length in bytes.
        len: usize,
        /// The longest key this scope leaves room for.
        max: usize,
    },
    /// The scope the application gave is not usable: empty, holding U+001F or NUL, or so
    /// long (over 253 bytes) that no key fits beside it.
    InvalidScope,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Missing => f.write_str("the request has no Idempotency-Key header"),
            KeyError::Repeated => f.write_str("the request has more than one Idempotency-Key"),
            KeyError::Malformed { why } => write!(
                f,
                "the Idempotency-Key is not a structured-field string (\"…\"): {why}"
            ),
            KeyError::Empty => f.write_str("the Idempotency-Key is empty"),
            KeyError::TooLong { len, max } => write!(
                f,
                "the Idempotency-Key is {len} bytes long; at most {max} are accepted here"
            ),
            KeyError::InvalidScope => f.write_str(
                "the caller's scope is empty, over 253 bytes, or holds U+001F or NUL: the \
                 application's scope closure must return another text",
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// Parses one `Idempotency-Key` field value: an RFC 8941 String (`"…"`: printable ASCII,
/// with `\"` and `\\` the only escapes), surrounded by spaces at most. Parameters, other
/// item types and anything after the string are refused. The key is what the string holds.
///
/// ```
/// use dedup_runtime::http::{KeyError, parse_key};
///
/// assert_eq!(parse_key(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#).unwrap(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
/// assert_eq!(parse_key(br#" "a \"quoted\" \\ key" "#).unwrap(), r#"a "quoted" \ key"#);
/// assert!(matches!(parse_key(b"8e03978e"), Err(KeyError::Malformed { .. }))); // a token
/// assert!(matches!(parse_key(br#""a";p=1"#), Err(KeyError::Malformed { .. })));
/// assert_eq!(parse_key(br#""""#), Err(KeyError::Empty));
/// ```
pub fn parse_key(value: &[u8]) -> Result<String, KeyError> {
    let value = trim_spaces(value);
    let Some((&b'"', rest)) = value.split_first() else {
        return Err(KeyError::Malformed {
            why: "it does not start with a double quote",
        });
    };
    let mut key = String::with_capacity(rest.len());
    let mut bytes = rest.iter();
    loop {
        match bytes.next() {
            None => {
                return Err(KeyError::Malformed {
                    why: "the closing double quote is missing",
                });
            }
            Some(b'\\') => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                _ => {
                    return Err(KeyError::Malformed {
                        why: "a backslash escapes only a double quote or a backslash",
                    });
                }
            },
            Some(b'"') => break,
            Some(&byte @ 0x20..=0x7e) => key.push(char::from(byte)),
            Some(_) => {
                return Err(KeyError::Malformed {
                    why: "it holds a byte that is not printable ASCII",
                });
            }
        }
    }
    if !bytes.as_slice().is_empty() {
        return Err(KeyError::Malformed {
            why: "something follows the closing double quote",
        });
    }
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    Ok(key)
}

fn trim_spaces(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// The message id of `key` for a caller `scope`: `<scope>` U+001F `<key>`, or `key` alone
/// without a scope — what the layer claims under the handler's consumer, and what an
/// operator gives [`Ledger`](crate::Ledger) to look one up. Together they fit a message
/// id (255 bytes); a scope must not be empty or hold U+001F or NUL.
///
/// ```
/// use dedup_runtime::http::{KeyError, message_id};
///
/// assert_eq!(message_id(None, "k-1").unwrap(), "k-1");
/// assert_eq!(message_id(Some("acct_42"), "k-1").unwrap(), "acct_42\u{1f}k-1");
/// let long = "k".repeat(248);
/// assert_eq!(message_id(Some("acct_42"), &long), Err(KeyError::TooLong { len: 248, max: 247 }));
/// ```
pub fn message_id(scope: Option<&str>, key: &str) -> Result<String, KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    match scope {
        None => {
            if key.len() > MAX_MESSAGE_ID_LEN {
                return Err(KeyError::TooLong {
                    len: key.len(),
                    max: MAX_MESSAGE_ID_LEN,
                });
            }
            Ok(key.to_owned())
        }
        Some(scope) => {
            if scope.is_empty()
                || scope.len() + 2 > MAX_MESSAGE_ID_LEN
                || scope.contains([SEPARATOR, '\0'])
            {
                return Err(KeyError::InvalidScope);
            }
            let max = MAX_MESSAGE_ID_LEN.saturating_sub(scope.len() + 1);
            if key.len() > max {
                return Err(KeyError::TooLong {
                    len: key.len(),
                    max,
                });
            }
            let mut id = String::with_capacity(scope.len() + 1 + key.len());
            id.push_str(scope);
            id.push(SEPARATOR);
            id.push_str(key);
            Ok(id)
        }
    }
}
