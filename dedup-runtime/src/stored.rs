//! What a dedup row remembers of the delivery that processed it: the handler's result
//! (`result = "stored"`), so that a duplicate returns it, and the payload's fingerprint
//! (`fingerprint = …`), so that the same id with another payload is caught.
//!
//! Both are opt-in per handler, written in the handler's own transaction (one statement
//! more, just before the commit), and read only when the claim finds the row there: a
//! handler without them sends the statements it always sent. They live in the dedup row
//! (`result`, `result_version`, `fingerprint`), so pruning removes them with it.
//!
//! **The codec** is [postcard](https://docs.rs/postcard) 1 (feature `serde`): its wire
//! format is specified and stable across 1.x, it is exact for every type of serde's data
//! model (nested `Option`s, floats bit for bit, `()`), and compact (a 1 MB `Vec<u8>` is
//! 1 MB and 3 bytes). It is not self-describing: a type that deserializes through
//! `deserialize_any` (`serde_json::Value`, untagged enums, `flatten`) cannot be read
//! back, and a value is therefore decoded once before it is stored — a result that
//! cannot round-trip rolls the transaction back ([`StoredResultError::Unencodable`]),
//! instead of committing an effect whose duplicates could never be answered.

use std::error::Error as StdError;
use std::fmt;

use sha2::{Digest as _, Sha256};

pub use dedup_limits::{DEFAULT_MAX_RESULT_LEN, MAX_RESULT_LEN, MAX_RESULT_VERSION};

/// A payload's fingerprint: its SHA-256.
pub type Fingerprint = [u8; 32];

/// What `fingerprint = …` hashes: bytes (`[u8]`, `Vec<u8>`, `[u8; N]`), text (`str`,
/// `String`), or a reference to one of them.
#[diagnostic::on_unimplemented(
    message = "`fingerprint = …` hashes bytes or text, and `{Self}` is neither",
    label = "`{Self}` is not bytes or text",
    note = "give the payload (`fingerprint = msg.payload`), or the part of it that makes the \
            message what it is, as bytes: `fingerprint = msg.amount.to_be_bytes()`, \
            `fingerprint = serde_json::to_vec(&msg.order)?`"
)]
pub trait FingerprintSource {
    /// The bytes hashed.
    fn fingerprint_bytes(&self) -> &[u8];
}

impl FingerprintSource for [u8] {
    fn fingerprint_bytes(&self) -> &[u8] {
        self
    }
}

impl<const N: usize> FingerprintSource for [u8; N] {
    fn fingerprint_bytes(&self) -> &[u8] {
        self
    }
}

impl FingerprintSource for Vec<u8> {
    fn fingerprint_bytes(&self) -> &[u8] {
        self
    }
}

impl FingerprintSource for str {
    fn fingerprint_bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl FingerprintSource for String {
    fn fingerprint_bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl<T: FingerprintSource + ?Sized> FingerprintSource for &T {
    fn fingerprint_bytes(&self) -> &[u8] {
        (**self).fingerprint_bytes()
    }
}

/// The fingerprint of `payload`: its SHA-256, as `fingerprint = …` stores it.
///
/// ```
/// let first = dedup_runtime::fingerprint(b"{\"amount\":100}");
/// assert_eq!(first, dedup_runtime::fingerprint(&b"{\"amount\":100}".to_vec()));
/// assert_ne!(first, dedup_runtime::fingerprint("{\"amount\":200}"));
/// ```
pub fn fingerprint<S: FingerprintSource + ?Sized>(payload: &S) -> Fingerprint {
    Sha256::digest(payload.fingerprint_bytes()).into()
}

/// The same message id arrived with another payload than the delivery that claimed it:
/// an id reused upstream, or a publisher that regenerates ids badly. Processing it as a
/// duplicate would drop real work, so the call fails with this error (inside
/// `sqlx::Error::AnyDriverError`, through the handler's `From<sqlx::Error>`), nothing
/// written; [`AckPolicy`](crate::AckPolicy) dead-letters it (a permanent failure), and its
/// text says why. An identical redelivery is a duplicate, never a mismatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintMismatch {
    consumer: String,
    message_id: String,
    stored: Fingerprint,
    received: Fingerprint,
}

impl FingerprintMismatch {
    pub(crate) fn new(
        consumer: &str,
        message_id: &str,
        stored: Fingerprint,
        received: Fingerprint,
    ) -> Self {
        FingerprintMismatch {
            consumer: consumer.to_owned(),
            message_id: message_id.to_owned(),
            stored,
            received,
        }
    }

    /// The mismatch of `received` with `stored`, a row's fingerprint as the database
    /// holds it, when the two differ.
    pub(crate) fn between(
        consumer: &str,
        message_id: &str,
        stored: &[u8],
        received: Fingerprint,
    ) -> Option<Self> {
        (stored != &received[..]).then(|| {
            let stored = <Fingerprint>::try_from(stored).unwrap_or_default();
            FingerprintMismatch::new(consumer, message_id, stored, received)
        })
    }

    /// The mismatch as the error a handler's call ends with.
    pub(crate) fn into_error(self) -> sqlx::Error {
        sqlx::Error::AnyDriverError(Box::new(self))
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The message id reused.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The fingerprint stored by the delivery that claimed the id.
    pub fn stored(&self) -> Fingerprint {
        self.stored
    }

    /// The fingerprint of this delivery's payload.
    pub fn received(&self) -> Fingerprint {
        self.received
    }

    /// The mismatch in `error` or its chain of sources (through `anyhow` and `thiserror`
    /// wrappers as well).
    ///
    /// ```
    /// let error = sqlx::Error::RowNotFound;
    /// assert!(dedup_runtime::FingerprintMismatch::find(&error).is_none());
    /// ```
    pub fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a FingerprintMismatch> {
        find(error)
    }
}

impl fmt::Display for FingerprintMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "message id `{}` of consumer `{}` reused with a different payload: fingerprint \
             {} stored by the delivery that claimed it, {} received (refused, not taken for \
             a duplicate)",
            self.message_id.escape_debug(),
            self.consumer.escape_debug(),
            short(&self.stored),
            short(&self.received),
        )
    }
}

impl StdError for FingerprintMismatch {}

/// The first 8 bytes, in hex: enough to tell two fingerprints apart in a log line.
fn short(fingerprint: &Fingerprint) -> String {
    use fmt::Write as _;
    let mut text = String::with_capacity(19);
    for byte in &fingerprint[..8] {
        let _ = write!(text, "{byte:02x}");
    }
    text.push('…');
    text
}

/// Why a result could not be stored (`result = "stored"`, before the commit: nothing of
/// the transaction committed) or replayed (for a duplicate: the first delivery's effects
/// stand). Reported inside `sqlx::Error::AnyDriverError`, through the handler's
/// `From<sqlx::Error>`; [`AckPolicy`](crate::AckPolicy) dead-letters it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoredResultError {
    /// The result, encoded, is `len` bytes, over the handler's `max_result_len`: the
    /// transaction rolled back. Never truncated.
    TooLarge {
        /// Its length, encoded.
        len: usize,
        /// The handler's `max_result_len`.
        max: usize,
    },
    /// The result could not be encoded, or would not decode back as its type (a type
    /// that needs a self-describing format): why. The transaction rolled back.
    Unencodable(String),
    /// The stored result was written under `result_version = stored`, and the handler now
    /// declares `expected`: its type changed shape, so the bytes are not read as the new
    /// one.
    VersionMismatch {
        /// The version stored with the result.
        stored: i64,
        /// The handler's `result_version`.
        expected: u32,
    },
    /// The stored bytes do not decode as the handler's type under the same version (its
    /// type changed without a new `result_version`): why.
    Undecodable(String),
}

impl StoredResultError {
    pub(crate) fn error(self) -> sqlx::Error {
        sqlx::Error::AnyDriverError(Box::new(self))
    }

    /// The error in `error` or its chain of sources.
    ///
    /// ```
    /// let error = sqlx::Error::RowNotFound;
    /// assert!(dedup_runtime::StoredResultError::find(&error).is_none());
    /// ```
    pub fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a StoredResultError> {
        find(error)
    }
}

impl fmt::Display for StoredResultError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoredResultError::TooLarge { len, max } => write!(
                f,
                "the handler's result is {len} bytes encoded, over its `max_result_len` of \
                 {max} bytes: not stored, and the transaction rolled back"
            ),
            StoredResultError::Unencodable(why) => write!(
                f,
                "the handler's result cannot be stored (the transaction rolled back): {why}"
            ),
            StoredResultError::VersionMismatch { stored, expected } => write!(
                f,
                "the stored result was written under `result_version = {stored}`, and the \
                 handler declares `result_version = {expected}`: not replayed"
            ),
            StoredResultError::Undecodable(why) => write!(
                f,
                "the stored result does not decode as the handler's type (did it change \
                 without a new `result_version`?): {why}"
            ),
        }
    }
}

impl StdError for StoredResultError {}

/// The first `T` along `error`'s chain of sources.
fn find<'a, T: StdError + 'static>(error: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    let mut link = Some(error);
    while let Some(error) = link {
        if let Some(found) = error.downcast_ref::<T>() {
            return Some(found);
        }
        link = error.source();
    }
    None
}

/// A handler's result type under `result = "stored"`: `serde`'s `Serialize` and
/// `DeserializeOwned`, with this crate's `serde` feature.
#[diagnostic::on_unimplemented(
    message = "`result = \"stored\"` stores the handler's result, and `{Self}` cannot be stored: \
               it must implement `serde::Serialize` and `serde::de::DeserializeOwned`",
    label = "`{Self}` is not `Serialize + DeserializeOwned`",
    note = "derive them (`#[derive(serde::Serialize, serde::Deserialize)]`) and turn on \
            dedup-runtime's `serde` feature; or return a type that has them (the id of what \
            the handler created, a reply struct)"
)]
pub trait Storable: Sized {
    #[doc(hidden)]
    fn encode(&self) -> Result<Vec<u8>, String>;
    #[doc(hidden)]
    fn decode(bytes: &[u8]) -> Result<Self, String>;
}

#[cfg(feature = "serde")]
#[diagnostic::do_not_recommend]
impl<T: serde::Serialize + serde::de::DeserializeOwned> Storable for T {
    fn encode(&self) -> Result<Vec<u8>, String> {
        postcard::to_allocvec(self).map_err(|error| match error {
            // postcard keeps no text of a custom error.
            postcard::Error::SerdeSerCustom => {
                "its `Serialize` implementation returned an error".to_owned()
            }
            other => format!("postcard cannot encode it: {other}"),
        })
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        match postcard::take_from_bytes(bytes) {
            Ok((value, [])) => Ok(value),
            Ok((_, rest)) => Err(format!("{} bytes left over after the value", rest.len())),
            Err(error) => Err(error.to_string()),
        }
    }
}

/// How a handler's `T` is stored and read back: [`Storable`]'s two functions, taken once
/// (where the generated code names the bound, so that a `T` without it is one error).
#[doc(hidden)]
pub struct Codec<T> {
    encode: fn(&T) -> Result<Vec<u8>, String>,
    decode: fn(&[u8]) -> Result<T, String>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Codec<T> {}

/// The codec of `T`.
pub fn codec<T: Storable>() -> Codec<T> {
    Codec {
        encode: T::encode,
        decode: T::decode,
    }
}

/// The result as stored: encoded, checked against `max_len`, and decoded once, so that a
/// value whose duplicates could not be answered is refused before the commit.
pub(crate) fn encode<T>(
    value: &T,
    codec: Codec<T>,
    max_len: usize,
) -> Result<Vec<u8>, StoredResultError> {
    let bytes = (codec.encode)(value).map_err(StoredResultError::Unencodable)?;
    if bytes.len() > max_len {
        return Err(StoredResultError::TooLarge {
            len: bytes.len(),
            max: max_len,
        });
    }
    if let Err(why) = (codec.decode)(&bytes) {
        return Err(StoredResultError::Unencodable(format!(
            "it does not decode back as its type ({why}): the codec, postcard, is not \
             self-describing, so types read through `deserialize_any` (`serde_json::Value`, \
             untagged enums, `flatten`) cannot be replayed"
        )));
    }
    Ok(bytes)
}

/// What a claim read of a row it found there, for a handler with a stored result or a
/// fingerprint.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Recalled {
    pub(crate) result: Option<Vec<u8>>,
    pub(crate) version: Option<i64>,
    pub(crate) fingerprint: Option<Vec<u8>>,
}

/// The columns `result`, `result_version` (the backend's integer) and `fingerprint` of a
/// row, as a recall reads them.
pub(crate) type RecalledRow<V> = (Option<Vec<u8>>, Option<V>, Option<Vec<u8>>);

impl<V: Into<i64>> From<RecalledRow<V>> for Recalled {
    fn from((result, version, fingerprint): RecalledRow<V>) -> Self {
        Recalled {
            result,
            version: version.map(Into::into),
            fingerprint,
        }
    }
}

/// Runs `sql`, a recall of one row (`result, result_version, fingerprint` where `consumer`
/// and the id match), with `V` the backend's integer for the version: the one place the
/// dedup table's and the leases' recalls are read, on every backend.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) async fn fetch_recalled<'c, DB, V>(
    conn: &'c mut DB::Connection,
    sql: &'static str,
    consumer: &'c str,
    id: &'c str,
) -> Result<Option<Recalled>, sqlx::Error>
where
    DB: sqlx::Database,
    V: Into<i64> + Send + Unpin,
    RecalledRow<V>: for<'r> sqlx::FromRow<'r, DB::Row>,
    for<'e> &'e mut DB::Connection: sqlx::Executor<'e, Database = DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> DB::Arguments: sqlx::IntoArguments<DB>,
{
    let row: Option<RecalledRow<V>> = sqlx::query_as(sql)
        .bind(consumer)
        .bind(id)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(Recalled::from))
}

/// What a handler's transaction writes into its dedup row before the commit.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub struct Remembered<'a> {
    /// The encoded result, if the handler stores results.
    pub(crate) result: Option<&'a [u8]>,
    /// Its version (with a result).
    pub(crate) version: Option<i32>,
    pub(crate) fingerprint: Option<&'a [u8]>,
}

/// What a handler declared: its stored result's version and size limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stored {
    pub version: u32,
    pub max_len: usize,
}

/// What one call of a handler with a stored result or a fingerprint carries: what it
/// declared, what a claim that found the row read of it, the body's result encoded for
/// the commit. The plain run and the leased run hold one each.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    /// `result = "stored"`.
    pub stored: Option<Stored>,
    /// `fingerprint = …`: this delivery's.
    pub fingerprint: Option<Fingerprint>,
    /// What the row held when a claim found it there.
    pub recalled: Option<Recalled>,
    /// The body's result, encoded (or why it cannot be).
    pub encoded: Option<Result<Vec<u8>, StoredResultError>>,
}

impl Memory {
    /// Whether a claim that finds the row reads what it remembers.
    pub fn recalls(&self) -> bool {
        self.stored.is_some() || self.fingerprint.is_some()
    }

    /// The version results are stored under (`result_version`).
    pub fn version(&self) -> u32 {
        self.stored.map_or(1, |stored| stored.version)
    }

    /// Keeps the body's result, encoded, for the commit.
    pub fn keep<T>(&mut self, value: &T, codec: Codec<T>) {
        if let Some(stored) = self.stored {
            self.encoded = Some(encode(value, codec, stored.max_len));
        }
    }

    /// The mismatch of this delivery's fingerprint with `recalled`'s, when both have one
    /// and they differ.
    pub fn mismatch(
        &self,
        consumer: &str,
        id: &str,
        recalled: Option<&Recalled>,
    ) -> Option<sqlx::Error> {
        let received = self.fingerprint?;
        let stored = recalled?.fingerprint.as_deref()?;
        FingerprintMismatch::between(consumer, id, stored, received)
            .map(FingerprintMismatch::into_error)
    }

    /// Whether `duplicate` is answered by a replay of a stored result (then the call's
    /// end is said once the result is decoded).
    pub fn replays(&self, duplicate: &crate::Duplicate) -> bool {
        *duplicate == crate::Duplicate::AlreadyProcessed
            && self.stored.is_some()
            && self
                .recalled
                .as_ref()
                .is_some_and(|recalled| recalled.result.is_some())
    }

    /// The answer to `duplicate` for a handler with a stored result — the result
    /// replayed, the duplicate as it is when nothing was stored, or why the stored result
    /// cannot be read — and whether the call's end is still to be said as a duplicate
    /// (the claim left it to the replay, [`replays`](Self::replays)).
    pub fn answer<T>(
        &mut self,
        duplicate: crate::Duplicate,
        codec: Codec<T>,
    ) -> (Result<crate::StoredOutcome<T>, StoredResultError>, bool) {
        let unsaid = self.replays(&duplicate);
        let recalled = match duplicate {
            crate::Duplicate::AlreadyProcessed => self.recalled.take(),
            _ => None,
        };
        let answer = replay(recalled, codec, self.version()).map(|replayed| match replayed {
            Some(value) => crate::StoredOutcome::Replayed(value),
            None => crate::StoredOutcome::Duplicate(duplicate),
        });
        (answer, unsaid)
    }
}

/// The value a recalled row answers with, as `T`: `None` when it has no result stored
/// (processed before the handler stored results, or by a handler that does not).
pub(crate) fn replay<T>(
    recalled: Option<Recalled>,
    codec: Codec<T>,
    version: u32,
) -> Result<Option<T>, StoredResultError> {
    let Some(Recalled {
        result: Some(bytes),
        version: stored,
        ..
    }) = recalled
    else {
        return Ok(None);
    };
    let stored = stored.unwrap_or(1);
    if stored != i64::from(version) {
        return Err(StoredResultError::VersionMismatch {
            stored,
            expected: version,
        });
    }
    (codec.decode)(&bytes)
        .map(Some)
        .map_err(StoredResultError::Undecodable)
}
