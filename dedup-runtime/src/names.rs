//! Consumer names, checked as `#[idempotent(consumer = "…")]` checks them at compile
//! time. A ground-floor file: it imports nothing of this crate but its limits.

use std::error::Error as StdError;
use std::fmt;

use dedup_limits::MAX_CONSUMER_LEN;

/// Refuses a consumer name that `#[idempotent(consumer = "…")]` would refuse at compile
/// time (the rule is `dedup_limits::consumer_problem`): no handler can have recorded an id
/// under it.
pub(crate) fn check_consumer(consumer: &str) -> Result<(), InvalidConsumer> {
    use dedup_limits::ConsumerProblem;
    match dedup_limits::consumer_problem(consumer) {
        None => Ok(()),
        Some(ConsumerProblem::Empty) => Err(InvalidConsumer::Empty),
        Some(ConsumerProblem::ContainsNul { position }) => {
            Err(InvalidConsumer::ContainsNul { position })
        }
        Some(ConsumerProblem::TooLong { len }) => Err(InvalidConsumer::TooLong {
            len,
            max: MAX_CONSUMER_LEN,
        }),
    }
}

/// A consumer name that `#[idempotent(consumer = "…")]` refuses, so that no id can have
/// been recorded under it. Nothing was read or deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidConsumer {
    /// The name is the empty string.
    Empty,
    /// The name is longer than [`MAX_CONSUMER_LEN`] bytes.
    TooLong {
        /// The name's length in bytes.
        len: usize,
        /// The limit, [`MAX_CONSUMER_LEN`].
        max: usize,
    },
    /// The name contains a NUL byte.
    ContainsNul {
        /// Byte offset of the first NUL.
        position: usize,
    },
}

impl fmt::Display for InvalidConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidConsumer::Empty => f.write_str(
                "invalid consumer: it is empty; give the `consumer = \"…\"` of the handler",
            ),
            InvalidConsumer::TooLong { len, max } => write!(
                f,
                "invalid consumer: it is {len} bytes long, the limit is {max}"
            ),
            InvalidConsumer::ContainsNul { position } => {
                write!(f, "invalid consumer: it contains a NUL byte at {position}")
            }
        }
    }
}

impl StdError for InvalidConsumer {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumers_refused_like_the_attribute_refuses_them() {
        assert_eq!(check_consumer("billing"), Ok(()));
        assert_eq!(check_consumer(&"c".repeat(MAX_CONSUMER_LEN)), Ok(()));
        assert_eq!(check_consumer(""), Err(InvalidConsumer::Empty));
        assert_eq!(
            check_consumer("a\0b"),
            Err(InvalidConsumer::ContainsNul { position: 1 })
        );
        assert_eq!(
            check_consumer(&"c".repeat(MAX_CONSUMER_LEN + 1)),
            Err(InvalidConsumer::TooLong {
                len: MAX_CONSUMER_LEN + 1,
                max: MAX_CONSUMER_LEN
            })
        );
    }
}
