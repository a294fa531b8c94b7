//! A TCP proxy that takes a broker (or any server) away from its clients and gives it
//! back, as a restart or a cut network does: [`Outage::cut`] closes every connection
//! through it and refuses new ones, [`Outage::stall`] keeps the connections open and
//! passes no byte (a server that stopped answering), [`Outage::restore`] lets everything
//! through again. Bytes pass through as they are.
//!
//! ```no_run
//! # async fn example() {
//! let proxy = dedup_suite::outage::Outage::start("127.0.0.1:6379").await;
//! let url = format!("redis://127.0.0.1:{}", proxy.port());
//! // …a client on `url`; then:
//! proxy.cut();
//! proxy.restore();
//! # }
//! ```

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// What the proxy lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// Connections stay; no byte passes.
    Stalled,
    /// No connection: the live ones were closed, new ones are closed at once.
    Down,
}

/// The proxy: listens on a free loopback port of its own, forwards to one server.
pub struct Outage {
    port: u16,
    state: watch::Sender<State>,
    /// Every live connection's two pumps, to close them on a cut.
    live: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: AbortHandle,
}

impl Outage {
    /// A proxy in front of `target` (`host:port`), open.
    ///
    /// # Panics
    /// When no loopback port is free.
    pub async fn start(target: &str) -> Outage {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        Outage::listen(listener, target)
    }

    /// A proxy on `port` (free, say from [`free_port`]) in front of `target`, open.
    ///
    /// # Panics
    /// When the port cannot be bound.
    pub async fn start_on(port: u16, target: &str) -> Outage {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the proxy's port");
        Outage::listen(listener, target)
    }

    fn listen(listener: TcpListener, target: &str) -> Outage {
        let port = listener.local_addr().expect("bound").port();
        let (state, watching) = watch::channel(State::Open);
        let live: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let registry = live.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *watching.borrow() == State::Down {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let up = tokio::spawn(pump(client_read, server_write, watching.clone()));
                let down = tokio::spawn(pump(server_read, client_write, watching.clone()));
                let mut registry = registry.lock().expect("not poisoned");
                registry.retain(|handle| !handle.is_finished());
                registry.extend([up.abort_handle(), down.abort_handle()]);
            }
        })
        .abort_handle();
        Outage {
            port,
            state,
            live,
            accepting,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy and refuses new ones until
    /// [`restore`](Self::restore): the server is gone, as in a restart.
    pub fn cut(&self) {
        self.state.send_replace(State::Down);
        for handle in self.live.lock().expect("not poisoned").drain(..) {
            handle.abort();
        }
    }

    /// Keeps the connections open and passes no byte until [`restore`](Self::restore):
    /// the server stopped answering.
    pub fn stall(&self) {
        self.state.send_replace(State::Stalled);
    }

    /// Lets everything through again.
    pub fn restore(&self) {
        self.state.send_replace(State::Open);
    }
}

impl Drop for Outage {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cut();
    }
}

/// A free loopback port (bound and released: free for a moment).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Copies `from` to `to`, holding what it read while the proxy is stalled.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<State>,
) {
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if state
            .wait_for(|state| *state != State::Stalled)
            .await
            .map_or(true, |state| *state == State::Down)
        {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
