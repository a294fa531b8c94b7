//! A stand-in for a payment provider: a real HTTP server on loopback that "charges a card".
//!
//! It is what `examples/partner_api.rs` and `tests/partner_api.rs` call through a real HTTP
//! client, so that an `effect = "send-first"` handler meets a provider as it is: a server
//! on the other side of a socket, which performs whatever request reaches it. It is not a
//! provider's SDK, and it keeps its records in memory only.
//!
//! `POST /charges` with a JSON body [`ChargeRequest`] performs a charge and answers `200`
//! with a [`ChargeResponse`]. An optional `Idempotency-Key` header works as Stripe's does
//! when the server [`Keys::Honoured`] them: the first request with a key performs the
//! charge, and every later request with that key gets the first response again, with
//! `Idempotent-Replayed: true`, and charges nothing; a later request with the same key
//! and other parameters is refused (`400`), as a key reused for another effect must be.
//! A server that [`Keys::Ignored`] them (a provider without idempotency keys) performs
//! every request it receives.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! use dedup_suite::partner::{Keys, Partner};
//!
//! let partner = Partner::start(Keys::Honoured).await?;
//! // POST partner.url() … then read back what it did:
//! assert_eq!(partner.charges().len(), 0);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// The request header that carries an idempotency key.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The response header on a replayed response.
pub const REPLAYED: &str = "Idempotent-Replayed";

/// What the server does with an `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// One charge per key; a repeat gets the first response (Stripe's behaviour).
    Honoured,
    /// Every request is charged, key or not (a provider without idempotency keys).
    Ignored,
}

/// The body of `POST /charges`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The order the charge pays for.
    pub order_id: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// The answer to a charge: the charge the server performed (or, replayed, performed
/// before).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeResponse {
    /// The server's id of the charge: `ch_1`, `ch_2`, … in the order performed.
    pub id: String,
    /// As requested.
    pub order_id: String,
    /// As requested.
    pub amount_cents: i64,
}

/// A charge the server performed: its record, kept for the caller to read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// The charge as answered.
    pub charge: ChargeResponse,
    /// The `Idempotency-Key` header of the request that performed it, if any.
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Default)]
struct Ledger {
    /// Every charge performed, in order.
    charges: Vec<Charge>,
    /// Every `POST /charges` received, charged or not.
    requests: usize,
    /// Requests answered with a stored response instead of a charge.
    replays: usize,
    /// Key → the request it was first used with, and the response to it.
    keys: HashMap<String, (ChargeRequest, ChargeResponse)>,
}

#[derive(Clone)]
struct Shared {
    keys: Keys,
    ledger: Arc<Mutex<Ledger>>,
}

/// The running server. Dropping it stops the server.
#[derive(Debug)]
pub struct Partner {
    addr: SocketAddr,
    keys: Keys,
    ledger: Arc<Mutex<Ledger>>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Partner {
    /// Starts a server on `127.0.0.1`, on a port the system picks, on the current tokio
    /// runtime.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(keys: Keys) -> std::io::Result<Partner> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let state = Shared {
            keys,
            ledger: ledger.clone(),
        };
        let app = Router::new()
            .route("/charges", post(charge))
            .with_state(state);
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(Partner {
            addr,
            keys,
            ledger,
            server,
        })
    }

    /// The URL of `POST /charges`: `http://127.0.0.1:<port>/charges`.
    pub fn url(&self) -> String {
        format!("http://{}/charges", self.addr)
    }

    /// What the server does with idempotency keys.
    pub fn keys(&self) -> Keys {
        self.keys
    }

    /// Every charge performed so far, in order.
    pub fn charges(&self) -> Vec<Charge> {
        lock(&self.ledger).charges.clone()
    }

    /// The charges performed so far for `order_id`.
    pub fn charges_for(&self, order_id: &str) -> usize {
        let ledger = lock(&self.ledger);
        let of_order = |record: &&Charge| record.charge.order_id == order_id;
        ledger.charges.iter().filter(of_order).count()
    }

    /// Every `POST /charges` the server received so far, charged, replayed or refused.
    pub fn requests(&self) -> usize {
        lock(&self.ledger).requests
    }

    /// The requests answered with the first response to their key, charging nothing.
    pub fn replays(&self) -> usize {
        lock(&self.ledger).replays
    }
}

impl Drop for Partner {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The ledger, even after a panic elsewhere poisoned its lock (a test's assertion).
fn lock(ledger: &Mutex<Ledger>) -> MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `POST /charges`. The whole decision — replay or charge — is taken under the ledger's
/// lock, so two requests with one key never both charge.
async fn charge(
    State(state): State<Shared>,
    headers: HeaderMap,
    Json(request): Json<ChargeRequest>,
) -> Response {
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let mut ledger = lock(&state.ledger);
    ledger.requests += 1;
    let honoured = key.as_ref().filter(|_| state.keys == Keys::Honoured);
    if let Some(key) = honoured
        && let Some((first, response)) = ledger.keys.get(key)
    {
        if *first != request {
            let refused = format!("idempotency key `{key}` was used with other parameters");
            return (StatusCode::BAD_REQUEST, refused).into_response();
        }
        let response = response.clone();
        ledger.replays += 1;
        return ([(REPLAYED, "true")], Json(response)).into_response();
    }
    let response = ChargeResponse {
        id: format!("ch_{}", ledger.charges.len() + 1),
        order_id: request.order_id.clone(),
        amount_cents: request.amount_cents,
    };
    if let Some(key) = honoured {
        ledger.keys.insert(key.clone(), (request, response.clone()));
    }
    ledger.charges.push(Charge {
        charge: response.clone(),
        idempotency_key: key,
    });
    Json(response).into_response()
}
