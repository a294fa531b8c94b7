//! [`StoredResponse`]: the response an idempotent handler returns, stored with its key and
//! replayed byte for byte.

use std::fmt;

use axum_core::body::Body;
use axum_core::response::Response;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};
use serde::de::{Deserializer, Error as _, Visitor};
use serde::ser::Serializer;

use super::problem::HttpError;

/// A response as an idempotent handler returns it (`Result<StoredResponse, HttpError>`
/// with `result = "stored"`): its status, its headers and its body, stored with the key in
/// the handler's transaction and sent again, byte for byte, to every retry.
///
/// A server error status is refused when it is built ([`CaptureError::ServerError`]): a
/// server error is an `Err`, never stored. The replayed headers are those the response
/// has; [`IdempotencyLayer::replay_headers`](super::IdempotencyLayer::replay_headers)
/// keeps only the ones it names (and `Content-Type`) when it captures an axum response.
///
/// ```
/// use dedup_runtime::http::StoredResponse;
/// use http::{StatusCode, header};
///
/// let created = StoredResponse::new(StatusCode::CREATED)
///     .header(header::CONTENT_TYPE, "application/json")?
///     .header(header::LOCATION, "/payments/7")?
///     .body(r#"{"id":7}"#);
/// assert_eq!(created.status(), StatusCode::CREATED);
/// assert_eq!(created.body_bytes(), br#"{"id":7}"#);
/// assert!(StoredResponse::new(StatusCode::BAD_GATEWAY).header("x", "y").is_err());
/// # Ok::<(), dedup_runtime::http::CaptureError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Vec<u8>,
}

/// Why a response cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaptureError {
    /// A server error status: a failure is an `Err(HttpError)`, never stored, so that a
    /// retry runs the handler again.
    ServerError(StatusCode),
    /// An invalid header name or value.
    InvalidHeader,
    /// The body is over the limit given to [`StoredResponse::capture`].
    TooLarge {
        /// The limit, in bytes.
        max: usize,
    },
    /// The body could not be read.
    Body(String),
}

impl fmt::Display for CaptureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureError::ServerError(status) => write!(
                f,
                "a {status} response is a server error: return it as Err(HttpError), which \
                 stores nothing"
            ),
            CaptureError::InvalidHeader => f.write_str("an invalid header name or value"),
            CaptureError::TooLarge { max } => {
                write!(
                    f,
                    "the response body is over {max} bytes, too large to store"
                )
            }
            CaptureError::Body(error) => write!(f, "the response body could not be read: {error}"),
        }
    }
}

impl std::error::Error for CaptureError {}

impl From<CaptureError> for HttpError {
    fn from(error: CaptureError) -> Self {
        HttpError::server(error)
    }
}

impl StoredResponse {
    /// A response of `status`, no header, an empty body. A server error status (5xx) is
    /// refused by the first [`header`](Self::header) call, or by
    /// [`checked`](Self::checked); one returned anyway is refused when it is stored: the
    /// transaction rolls back and the client gets a `500` of [`SERVER_ERROR`](super::SERVER_ERROR).
    pub fn new(status: StatusCode) -> StoredResponse {
        StoredResponse {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// The same response, refused if its status is a server error.
    pub fn checked(self) -> Result<StoredResponse, CaptureError> {
        if self.status.is_server_error() {
            return Err(CaptureError::ServerError(self.status));
        }
        Ok(self)
    }

    /// Adds a header (several of one name are kept in order).
    pub fn header<N, V>(mut self, name: N, value: V) -> Result<StoredResponse, CaptureError>
    where
        N: TryInto<HeaderName>,
        V: TryInto<HeaderValue>,
    {
        let name = name.try_into().map_err(|_| CaptureError::InvalidHeader)?;
        let value = value.try_into().map_err(|_| CaptureError::InvalidHeader)?;
        self.headers.push((name, value));
        self.checked()
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> StoredResponse {
        self.body = body.into();
        self
    }

    /// An axum response, read whole (at most `max_len` bytes of body): its status, its
    /// headers, its body. A server error status is refused.
    pub async fn capture(
        response: Response,
        max_len: usize,
    ) -> Result<StoredResponse, CaptureError> {
        let (parts, body) = response.into_parts();
        if parts.status.is_server_error() {
            return Err(CaptureError::ServerError(parts.status));
        }
        let limited = http_body_util::Limited::new(body, max_len);
        let bytes = match http_body_util::BodyExt::collect(limited).await {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                if error.is::<http_body_util::LengthLimitError>() {
                    return Err(CaptureError::TooLarge { max: max_len });
                }
                return Err(CaptureError::Body(error.to_string()));
            }
        };
        Ok(StoredResponse {
            status: parts.status,
            headers: parts
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
            body: bytes.to_vec(),
        })
    }

    /// Its status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Its headers, in order.
    pub fn headers(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.headers.iter().map(|(name, value)| (name, value))
    }

    /// Its body.
    pub fn body_bytes(&self) -> &[u8] {
        &self.body
    }

    /// Keeps only the headers named (and `Content-Type`).
    pub(crate) fn keep_headers(&mut self, names: &[HeaderName]) {
        self.headers.retain(|(name, _)| {
            name == http::header::CONTENT_TYPE || names.iter().any(|kept| kept == name)
        });
    }

    /// The response to send: `replayed` adds `Idempotent-Replayed: true`.
    pub(crate) fn into_response(self, replayed: bool) -> Response {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() = self.status;
        let headers: &mut HeaderMap = response.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        if replayed {
            headers.insert(
                HeaderName::from_static(super::IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
        }
        response
    }

    /// The stored form: a version byte, the status, the headers (name and value lengths
    /// first), the body.
    fn encode(&self) -> Vec<u8> {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| 6 + name.as_str().len() + value.len())
            .sum();
        let mut out = Vec::with_capacity(5 + headers + self.body.len());
        out.push(1);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    fn decode(bytes: &[u8]) -> Result<StoredResponse, &'static str> {
        fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], &'static str> {
            if bytes.len() < n {
                return Err("a stored response is cut short");
            }
            let (head, rest) = bytes.split_at(n);
            *bytes = rest;
            Ok(head)
        }
        let mut rest = bytes;
        if take(&mut rest, 1)? != [1] {
            return Err("a stored response of an unknown version");
        }
        let status = u16::from_be_bytes(take(&mut rest, 2)?.try_into().unwrap_or_default());
        let status = StatusCode::from_u16(status).map_err(|_| "a stored status is invalid")?;
        let count = u16::from_be_bytes(take(&mut rest, 2)?.try_into().unwrap_or_default());
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = u16::from_be_bytes(take(&mut rest, 2)?.try_into().unwrap_or_default());
            let name = HeaderName::from_bytes(take(&mut rest, usize::from(len))?)
                .map_err(|_| "a stored header name is invalid")?;
            let len = u32::from_be_bytes(take(&mut rest, 4)?.try_into().unwrap_or_default());
            let value = HeaderValue::from_bytes(take(&mut rest, len as usize)?)
                .map_err(|_| "a stored header value is invalid")?;
            headers.push((name, value));
        }
        Ok(StoredResponse {
            status,
            headers,
            body: rest.to_vec(),
        })
    }
}

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body_len", &self.body.len())
            .finish()
    }
}

impl serde::Serialize for StoredResponse {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The last guard: a server error built with `body` alone never commits.
        if self.status.is_server_error() {
            return Err(serde::ser::Error::custom(CaptureError::ServerError(
                self.status,
            )));
        }
        serializer.serialize_bytes(&self.encode())
    }
}

impl<'de> serde::Deserialize<'de> for StoredResponse {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl Visitor<'_> for Bytes {
            type Value = StoredResponse;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a stored HTTP response")
            }
            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<StoredResponse, E> {
                StoredResponse::decode(bytes).map_err(E::custom)
            }
        }
        deserializer
            .deserialize_bytes(Bytes)
            .map_err(D::Error::custom)
    }
}
