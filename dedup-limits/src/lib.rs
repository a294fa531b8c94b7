//! The limits and name rules of dedup, in one place for the two crates that check them:
//! `#[idempotent]` (`dedup-macros`) at compile time, and `dedup-runtime` at run time.
//!
//! Use them through `dedup-runtime`, which re-exports the constants.

#![no_std]
#![deny(missing_docs)]

/// The longest message id, in bytes of UTF-8, that the dedup table stores.
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// The longest consumer name, in bytes, that the dedup table stores.
pub const MAX_CONSUMER_LEN: usize = 255;

/// The longest table or schema name every backend accepts (PostgreSQL's limit).
pub const MAX_TABLE_NAME_LEN: usize = 63;

/// The longest constraint or index name every backend reports (MySQL's limit).
pub const MAX_CONSTRAINT_LEN: usize = 64;

/// The default of `max_result_len`: the longest stored result (`result = "stored"`), in
/// bytes of its encoding, 4 MiB.
pub const DEFAULT_MAX_RESULT_LEN: usize = 4 * 1024 * 1024;

/// The highest `max_result_len` a handler may declare, 8 MiB: a result that size, in the
/// statement that stores it, fits MariaDB's default `max_allowed_packet` (16 MiB) with
/// room to spare, and every backend's column (PostgreSQL `bytea`, MySQL `LONGBLOB`, SQLite
/// `BLOB`) holds it whole.
pub const MAX_RESULT_LEN: usize = 8 * 1024 * 1024;

/// The highest `result_version` a handler may declare (the column is a 32-bit integer on
/// every backend).
pub const MAX_RESULT_VERSION: u32 = i32::MAX as u32;

/// Why a consumer name is refused: `#[idempotent(consumer = "…")]` at compile time and
/// the runtime's operator tools apply the same rule, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerProblem {
    /// The empty string.
    Empty,
    /// A NUL byte, at this byte offset (the first one).
    ContainsNul {
        /// Byte offset of the first NUL.
        position: usize,
    },
    /// Longer than [`MAX_CONSUMER_LEN`] bytes.
    TooLong {
        /// The name's length in bytes.
        len: usize,
    },
}

/// What is wrong with `name` as a consumer name, if anything.
///
/// ```
/// use dedup_limits::{ConsumerProblem, consumer_problem};
///
/// assert_eq!(consumer_problem("email-sender"), None);
/// assert_eq!(consumer_problem(""), Some(ConsumerProblem::Empty));
/// assert_eq!(consumer_problem("a\0b"), Some(ConsumerProblem::ContainsNul { position: 1 }));
/// ```
pub fn consumer_problem(name: &str) -> Option<ConsumerProblem> {
    if name.is_empty() {
        Some(ConsumerProblem::Empty)
    } else if let Some(position) = name.bytes().position(|b| b == 0) {
        Some(ConsumerProblem::ContainsNul { position })
    } else if name.len() > MAX_CONSUMER_LEN {
        Some(ConsumerProblem::TooLong { len: name.len() })
    } else {
        None
    }
}

/// Whether `name` is a dedup table name: a plain SQL identifier (an ASCII letter or `_`,
/// then letters, digits and `_`, at most [`MAX_TABLE_NAME_LEN`] bytes), optionally
/// qualified by a schema of the same form (`audit.processed_messages`). The name is
/// spliced into SQL, so nothing else is accepted.
///
/// ```
/// assert!(dedup_limits::is_table_name("audit.processed_messages"));
/// assert!(!dedup_limits::is_table_name("processed_messages; DROP TABLE users"));
/// assert!(!dedup_limits::is_table_name("a.b.c"));
/// ```
pub fn is_table_name(name: &str) -> bool {
    qualified(name, |part| identifier(part, MAX_TABLE_NAME_LEN, false))
}

/// Whether `name` can be a name in `unique = […]`: a constraint or index name (letters,
/// digits, `_` and `$`, at most [`MAX_CONSTRAINT_LEN`] bytes), or `table.name`.
///
/// ```
/// assert!(dedup_limits::is_constraint_name("shipments_order_id_key"));
/// assert!(dedup_limits::is_constraint_name("shipments.order_id"));
/// assert!(!dedup_limits::is_constraint_name(""));
/// ```
pub fn is_constraint_name(name: &str) -> bool {
    qualified(name, |part| identifier(part, MAX_CONSTRAINT_LEN, true))
}

/// `name` is one part, or two joined by a dot, each accepted by `part`.
fn qualified(name: &str, part: impl Fn(&str) -> bool) -> bool {
    match name.split_once('.') {
        Some((first, second)) => part(first) && part(second),
        None => part(name),
    }
}

fn identifier(part: &str, max: usize, dollar: bool) -> bool {
    let mut chars = part.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (dollar && c == '$'))
        && part.len() <= max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names() {
        for good in ["processed_messages", "_t", "audit.processed_messages", "T1"] {
            assert!(is_table_name(good), "{good}");
        }
        let longest = "a".repeat(MAX_TABLE_NAME_LEN);
        assert!(is_table_name(&longest));
        let too_long = "a".repeat(MAX_TABLE_NAME_LEN + 1);
        for bad in [
            "", ".", "a.", ".a", "a.b.c", "1t", "t-1", "t$", "t 1", "tä", &too_long,
        ] {
            assert!(!is_table_name(bad), "{bad}");
        }
    }

    #[test]
    fn constraint_names() {
        for good in ["k", "shipments_order_id_key", "t.order_id", "k$1"] {
            assert!(is_constraint_name(good), "{good}");
        }
        let too_long = "a".repeat(MAX_CONSTRAINT_LEN + 1);
        for bad in ["", "a.b.c", "1k", "k-1", &too_long] {
            assert!(!is_constraint_name(bad), "{bad}");
        }
    }
}
