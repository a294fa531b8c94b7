//! A TCP proxy between a pool and its database server that loses one reply or cuts one
//! request on cue: the connection faults of a real network (a reset after the server ran
//! a statement, a cut before it did), against the real server. Bytes pass through as
//! they are; the proxy only looks for a marker in them.
//!
//! ```no_run
//! # async fn example() {
//! use dedup_suite::fault::{Fault, FaultProxy};
//!
//! let proxy = FaultProxy::in_front_of(&dedup_suite::postgres_url()).await;
//! let url = proxy.url(&dedup_suite::postgres_url());
//! // …a pool on `url`; then, before the statement whose reply is to be lost:
//! proxy.arm(Fault::LoseReplyWith(b"marker in the reply".to_vec()));
//! # }
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long the proxy lets the server finish (run the statement, commit) before it
/// closes the server's side of a connection whose reply it lost.
const SETTLE: Duration = Duration::from_millis(300);

/// One fault, fired once, on the first connection whose traffic matches it.
#[derive(Debug, Clone)]
pub enum Fault {
    /// The first server reply that carries the marker (and everything after it) never
    /// reaches the client: the statement ran, and its reply is lost. The server's
    /// connection closes after it had time to finish (an autocommitted statement
    /// commits), the client's at once.
    LoseReplyWith(Vec<u8>),
    /// After a server reply that carries `seen`, the client's next bytes that carry
    /// `then` (say, its `COMMIT`) reach the server, and their reply is lost: the
    /// transaction committed, and the client cannot know.
    LoseReplyAfter {
        /// What the server's reply carries first.
        seen: Vec<u8>,
        /// What the client sends next, whose reply is lost.
        then: Vec<u8>,
    },
    /// The statement whose text carries the marker is prepared as usual (the client's
    /// bytes that carry it, and their reply, pass); the client's next bytes — the
    /// statement's execution — reach the server, and their reply is lost: the statement
    /// ran (autocommitted), and the client cannot know. For a statement the pool has not
    /// prepared before (a fresh pool): a cached one sends no text.
    LoseExecutionReply(Vec<u8>),
    /// The client's first bytes that carry the marker never reach the server: the
    /// connection is cut before the statement ran.
    CutBefore(Vec<u8>),
}

/// The proxy: listens on a port of its own, forwards to one server.
pub struct FaultProxy {
    port: u16,
    armed: Arc<Mutex<Option<Fault>>>,
    fired: Arc<std::sync::atomic::AtomicUsize>,
}

impl FaultProxy {
    /// A proxy in front of the server of `url` (its host and port).
    ///
    /// # Panics
    /// When `url` names no host and port, or no port is free.
    pub async fn in_front_of(url: &str) -> FaultProxy {
        let (_, rest) = url.split_once("://").expect("a URL");
        let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
        let address = rest.split('/').next().expect("a host");
        FaultProxy::start(address).await
    }

    /// Listens on 127.0.0.1 (a free port) and forwards every connection to `target`
    /// (`host:port`).
    ///
    /// # Panics
    /// When no port is free.
    pub async fn start(target: &str) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let port = listener.local_addr().expect("bound").port();
        let armed: Arc<Mutex<Option<Fault>>> = Arc::new(Mutex::new(None));
        let fired = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let target = target.to_owned();
        let (accept_armed, accept_fired) = (armed.clone(), fired.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                tokio::spawn(connection(
                    client,
                    server,
                    accept_armed.clone(),
                    accept_fired.clone(),
                ));
            }
        });
        FaultProxy { port, armed, fired }
    }

    /// `url` (of the server this proxy forwards to) with its host and port this proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (credentials, rest) = match rest.split_once('@') {
            Some((credentials, rest)) => (format!("{credentials}@"), rest),
            None => (String::new(), rest),
        };
        let path = rest.find('/').map_or("", |at| &rest[at..]);
        format!("{scheme}://{credentials}127.0.0.1:{}{path}", self.port)
    }

    /// Arms `fault`: the next connection whose traffic matches it gets it, once.
    pub fn arm(&self, fault: Fault) {
        *self.armed.lock().expect("not poisoned") = Some(fault);
    }

    /// How many faults fired so far.
    pub fn fired(&self) -> usize {
        self.fired.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Where one connection stands with the armed fault.
#[derive(Default)]
struct Stage {
    /// `LoseReplyAfter`: the server's reply carried `seen` on this connection.
    seen: bool,
    /// `LoseExecutionReply`: the client sent the statement's text on this connection.
    prepared: bool,
    /// The client gets nothing more.
    mute: bool,
}

async fn connection(
    client: TcpStream,
    server: TcpStream,
    armed: Arc<Mutex<Option<Fault>>>,
    fired: Arc<std::sync::atomic::AtomicUsize>,
) {
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let stage = Arc::new(Mutex::new(Stage::default()));
    let fire = {
        let fired = fired.clone();
        move || {
            fired.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    };
    let upstream = {
        let (armed, stage, fire) = (armed.clone(), stage.clone(), fire.clone());
        async move {
            let mut buffer = vec![0u8; 64 << 10];
            loop {
                let read = match client_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => read,
                };
                let bytes = &buffer[..read];
                let mut lose_reply = false;
                {
                    let mut armed = armed.lock().expect("not poisoned");
                    match armed.as_ref() {
                        Some(Fault::CutBefore(marker)) if contains(bytes, marker) => {
                            *armed = None;
                            fire();
                            return;
                        }
                        Some(Fault::LoseReplyAfter { then, .. })
                            if stage.lock().expect("not poisoned").seen
                                && contains(bytes, then) =>
                        {
                            *armed = None;
                            lose_reply = true;
                        }
                        Some(Fault::LoseExecutionReply(_))
                            if stage.lock().expect("not poisoned").prepared =>
                        {
                            *armed = None;
                            lose_reply = true;
                        }
                        Some(Fault::LoseExecutionReply(marker)) if contains(bytes, marker) => {
                            stage.lock().expect("not poisoned").prepared = true;
                        }
                        _ => {}
                    }
                }
                if lose_reply {
                    stage.lock().expect("not poisoned").mute = true;
                    fire();
                }
                if server_write.write_all(bytes).await.is_err() {
                    return;
                }
                if lose_reply {
                    tokio::time::sleep(SETTLE).await;
                    return;
                }
            }
        }
    };
    let downstream = {
        let (armed, stage, fire) = (armed.clone(), stage.clone(), fire.clone());
        async move {
            let mut buffer = vec![0u8; 64 << 10];
            loop {
                let read = match server_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => read,
                };
                let bytes = &buffer[..read];
                {
                    let mut armed = armed.lock().expect("not poisoned");
                    match armed.as_ref() {
                        Some(Fault::LoseReplyWith(marker)) if contains(bytes, marker) => {
                            *armed = None;
                            stage.lock().expect("not poisoned").mute = true;
                            fire();
                        }
                        Some(Fault::LoseReplyAfter { seen, .. }) if contains(bytes, seen) => {
                            stage.lock().expect("not poisoned").seen = true;
                        }
                        _ => {}
                    }
                }
                if stage.lock().expect("not poisoned").mute {
                    // Let the server finish, then close both sides.
                    tokio::time::sleep(SETTLE).await;
                    return;
                }
                if client_write.write_all(bytes).await.is_err() {
                    return;
                }
            }
        }
    };
    // Either direction ending ends the connection: both sides are dropped, closed.
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty()
        && haystack
            .windows(needle.len())
            .any(|window| window == needle)
}
