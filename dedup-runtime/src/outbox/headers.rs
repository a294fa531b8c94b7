//! An outgoing message's headers: name → bytes pairs ([`Outgoing::header`]), kept in the
//! outbox row's `headers` column in one encoding, given back to publishers as pairs
//! ([`OutboxMessage::headers`]), which send them as the broker's own headers.
//!
//! The column's encoding, for whoever reads the table: the pairs one after the other,
//! each as its name's length (one byte, 1 to 255), the name (UTF-8), its value's length
//! (four bytes, big-endian) and the value.
//!
//! [`Outgoing::header`]: super::Outgoing::header
//! [`OutboxMessage::headers`]: super::OutboxMessage::headers

use std::fmt;

/// Header names the crate's publishers write themselves (the message's id, a Redis
/// Streams entry's body, the trace context): refused as the names of a message's own
/// headers, in any case.
pub const RESERVED_HEADERS: [&str; 5] = ["id", "body", "message-id", "nats-msg-id", "traceparent"];

/// Appends the pair to `encoded` (the name unchecked: [`check`] does that at enqueue).
pub(crate) fn push(encoded: &mut Vec<u8>, name: &str, value: &[u8]) {
    // Names over 255 bytes are refused by `check`; their length byte is then 0, which no
    // valid name has, so that `check` sees it.
    encoded.push(u8::try_from(name.len()).unwrap_or(0));
    encoded.extend_from_slice(name.as_bytes());
    encoded.extend_from_slice(&u32::try_from(value.len()).unwrap_or(u32::MAX).to_be_bytes());
    encoded.extend_from_slice(value);
}

/// The pairs of `encoded`, in order. A column written otherwise than by this crate ends
/// the pairs where it stops decoding.
#[derive(Clone)]
pub struct Headers<'m> {
    rest: &'m [u8],
}

impl<'m> Headers<'m> {
    pub(crate) fn new(encoded: &'m [u8]) -> Self {
        Headers { rest: encoded }
    }
}

impl<'m> Iterator for Headers<'m> {
    type Item = (&'m str, &'m [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (&len, rest) = self.rest.split_first()?;
        let decoded = (|| {
            let (name, rest) = rest.split_at_checked(usize::from(len))?;
            let name = std::str::from_utf8(name).ok()?;
            let (len, rest) = rest.split_at_checked(4)?;
            let len = usize::try_from(u32::from_be_bytes(len.try_into().ok()?)).ok()?;
            let (value, rest) = rest.split_at_checked(len)?;
            Some((name, value, rest))
        })();
        match decoded {
            Some((name, value, rest)) if len > 0 => {
                self.rest = rest;
                Some((name, value))
            }
            _ => {
                self.rest = &[];
                None
            }
        }
    }
}

impl fmt::Debug for Headers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                self.clone()
                    .map(|(name, value)| (name, String::from_utf8_lossy(value))),
            )
            .finish()
    }
}

/// Checks `encoded`'s names: 1 to 255 bytes of an HTTP token (letters, digits and
/// ``!#$%&'*+-.^_`|~``: what every broker's header names take), none of
/// [`RESERVED_HEADERS`]; why not, for the first that is not.
pub(crate) fn check(encoded: &[u8]) -> Result<(), String> {
    let mut rest = encoded;
    while let Some((&len, after)) = rest.split_first() {
        if len == 0 {
            return Err("a header name is empty or over 255 bytes".to_owned());
        }
        let Some((name, after)) = after.split_at_checked(usize::from(len)) else {
            return Err("the headers are cut short".to_owned());
        };
        let token = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
        let Some(bad) = name.iter().position(|b| !token(b)).map(|at| name[at]) else {
            let name = std::str::from_utf8(name).expect("ASCII");
            if let Some(reserved) = RESERVED_HEADERS
                .iter()
                .find(|reserved| reserved.eq_ignore_ascii_case(name))
            {
                return Err(format!(
                    "the header name {name:?} is the publishers' own ({reserved}): name it otherwise"
                ));
            }
            let Some((len, after)) = after.split_at_checked(4) else {
                return Err("the headers are cut short".to_owned());
            };
            let len = u32::from_be_bytes(len.try_into().expect("four bytes")) as usize;
            let Some((_, after)) = after.split_at_checked(len) else {
                return Err("the headers are cut short".to_owned());
            };
            rest = after;
            continue;
        };
        return Err(format!(
            "the header name {:?} has {:?}, which a header name cannot hold (letters, digits \
             and !#$%&'*+-.^_`|~)",
            String::from_utf8_lossy(name),
            char::from(bad)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip_in_order() {
        let mut encoded = Vec::new();
        push(&mut encoded, "type", b"invoice");
        push(&mut encoded, "empty", b"");
        push(&mut encoded, "bytes", &[0, 255, b'\n']);
        push(&mut encoded, "type", b"again");
        assert_eq!(check(&encoded), Ok(()));
        let pairs: Vec<_> = Headers::new(&encoded).collect();
        assert_eq!(
            pairs,
            [
                ("type", b"invoice".as_slice()),
                ("empty", b"".as_slice()),
                ("bytes", [0, 255, b'\n'].as_slice()),
                ("type", b"again".as_slice()),
            ]
        );
        assert_eq!(Headers::new(&[]).count(), 0);
    }

    #[test]
    fn bad_names_are_refused() {
        for name in [
            "",
            "with space",
            "colon:",
            "é",
            "line\nbreak",
            "ID",
            "Traceparent",
        ] {
            let mut encoded = Vec::new();
            push(&mut encoded, name, b"v");
            assert!(check(&encoded).is_err(), "{name:?}");
        }
        let mut long = Vec::new();
        push(&mut long, &"n".repeat(256), b"v");
        assert!(check(&long).is_err());
        let mut at_the_limit = Vec::new();
        push(&mut at_the_limit, &"n".repeat(255), b"v");
        assert_eq!(check(&at_the_limit), Ok(()));
    }

    #[test]
    fn a_foreign_encoding_ends_the_pairs() {
        assert_eq!(Headers::new(br#"{"type": "json"}"#).count(), 0);
        let mut encoded = Vec::new();
        push(&mut encoded, "a", b"1");
        encoded.extend_from_slice(&[3, b'b']); // cut short
        let pairs: Vec<_> = Headers::new(&encoded).collect();
        assert_eq!(pairs, [("a", b"1".as_slice())]);
        assert!(check(&encoded).is_err());
    }
}
