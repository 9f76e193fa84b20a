//! kubefwd-style listeners: for every Service in the name table, a TCP listener on its
//! loopback address and each of its ports; every accepted connection becomes a forward tunnel
//! stream to `<svc>.<ns>.svc:<port>`. No TUN device, no route, no resolver change.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use spur_runtime::Drain;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::names::NameTable;
use crate::opener::{Opener, splice};

/// How many listen failures are kept (with their reason) for the status.
const KEEP_ERRORS: usize = 8;
/// Connections carried at once through all Service listeners; beyond that, new ones are reset.
pub(crate) const MAX_CONNECTIONS: usize = 1024;

/// Outcome of one reconcile.
#[derive(Debug, Default)]
pub(crate) struct ListenReport {
    pub(crate) listeners: usize,
    /// Failures new in this round (already-failing ports are not retried until they leave).
    pub(crate) new_errors: Vec<String>,
    pub(crate) errors: Vec<String>,
    pub(crate) error_count: usize,
}

struct Listening {
    target: String,
    stop: CancellationToken,
}

/// The listeners, reconciled against each new name table.
pub(crate) struct Listeners {
    opener: Arc<dyn Opener>,
    drain: Drain,
    open_timeout: Duration,
    active: HashMap<SocketAddr, Listening>,
    limit: Arc<Semaphore>,
    /// Address → reason, for ports that could not be listened on.
    failed: HashMap<SocketAddr, String>,
}

impl Listeners {
    pub(crate) fn new(opener: Arc<dyn Opener>, drain: Drain, open_timeout: Duration) -> Self {
        Listeners {
            opener,
            drain,
            open_timeout,
            active: HashMap::new(),
            limit: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            failed: HashMap::new(),
        }
    }

    pub(crate) async fn reconcile(&mut self, table: &NameTable) -> ListenReport {
        let mut desired: HashMap<SocketAddr, String> = HashMap::new();
        for s in table.services() {
            for p in &s.ports {
                desired.insert(
                    SocketAddr::from((s.addr, *p)),
                    format!("{}:{p}", s.cluster_host()),
                );
            }
        }
        // Stop listeners that are gone or now stand for another Service.
        self.active.retain(|addr, l| {
            let keep = desired.get(addr) == Some(&l.target);
            if !keep {
                l.stop.cancel();
            }
            keep
        });
        self.failed.retain(|addr, _| desired.contains_key(addr));
        let mut report = ListenReport::default();
        let mut todo: Vec<(SocketAddr, String)> = desired
            .into_iter()
            .filter(|(a, _)| !self.active.contains_key(a) && !self.failed.contains_key(a))
            .collect();
        todo.sort();
        for (addr, target) in todo {
            match TcpListener::bind(addr).await {
                Ok(listener) => {
                    let stop = CancellationToken::new();
                    let (host, port) = split_target(&target);
                    self.drain.spawn(accept_loop(
                        listener,
                        Target { host, port },
                        self.opener.clone(),
                        self.open_timeout,
                        self.limit.clone(),
                        stop.clone(),
                        self.drain.clone(),
                    ));
                    self.active.insert(addr, Listening { target, stop });
                }
                Err(e) => {
                    let why = listen_error(addr, &e);
                    report.new_errors.push(why.clone());
                    self.failed.insert(addr, why);
                }
            }
        }
        report.listeners = self.active.len();
        report.error_count = self.failed.len();
        let mut errors: Vec<&String> = self.failed.values().collect();
        errors.sort();
        report.errors = errors.into_iter().take(KEEP_ERRORS).cloned().collect();
        report
    }

    pub(crate) fn stop_all(&mut self) {
        for (_, l) in self.active.drain() {
            l.stop.cancel();
        }
    }
}

fn split_target(target: &str) -> (String, u16) {
    match target.rsplit_once(':') {
        Some((h, p)) => (h.to_owned(), p.parse().unwrap_or(0)),
        None => (target.to_owned(), 0),
    }
}

/// A reason that tells the user what to do about it.
fn listen_error(addr: SocketAddr, e: &std::io::Error) -> String {
    let hint = match e.kind() {
        std::io::ErrorKind::PermissionDenied if addr.port() < 1024 => {
            " (ports below 1024 need root or a lower net.ipv4.ip_unprivileged_port_start)"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            " (the address is not on a loopback interface; on macOS: sudo ifconfig lo0 alias <addr>)"
        }
        std::io::ErrorKind::AddrInUse => " (something else listens there)",
        _ => "",
    };
    format!("{addr}: {e}{hint}")
}

struct Target {
    host: String,
    port: u16,
}

async fn accept_loop(
    listener: TcpListener,
    target: Target,
    opener: Arc<dyn Opener>,
    open_timeout: Duration,
    limit: Arc<Semaphore>,
    stop: CancellationToken,
    drain: Drain,
) {
    let host: Arc<str> = target.host.into();
    let port = target.port;
    let stopped = || async {
        tokio::select! {
            () = stop.cancelled() => {}
            () = drain.signaled() => {}
        }
    };
    while let Some((tcp, from)) = spur_runtime::accept(&listener, stopped(), "service").await {
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            tracing::warn!(%from, "too many service connections at once; resetting a new one");
            reset(&tcp);
            continue;
        };
        let (opener, host) = (opener.clone(), host.clone());
        drain.spawn(async move {
            forward_one(tcp, from, &host, port, &*opener, open_timeout).await;
            drop(permit);
        });
    }
}

async fn forward_one(
    tcp: TcpStream,
    from: SocketAddr,
    host: &str,
    port: u16,
    opener: &dyn Opener,
    open_timeout: Duration,
) {
    let _ = tcp.set_nodelay(true);
    match tokio::time::timeout(open_timeout, opener.open(host, port)).await {
        Ok(Ok(stream)) => match splice(tcp, stream).await {
            Ok((up, down)) => {
                tracing::debug!(%from, target = %format!("{host}:{port}"), up, down, "service connection done")
            }
            Err(e) => {
                tracing::debug!(%from, target = %format!("{host}:{port}"), error = %e, "service connection failed")
            }
        },
        Ok(Err(e)) => {
            tracing::warn!(%from, target = %format!("{host}:{port}"), error = %e, "cannot reach the service through the tunnel");
            reset(&tcp);
        }
        Err(_) => {
            tracing::warn!(%from, target = %format!("{host}:{port}"), "opening a tunnel stream timed out");
            reset(&tcp);
        }
    }
}

/// Closes with RST, so the client sees "connection reset" rather than a clean, empty reply.
pub(crate) fn reset(tcp: &TcpStream) {
    let _ = socket2::SockRef::from(tcp).set_linger(Some(Duration::ZERO));
}

/// The loopback addresses in use, for the hosts file.
pub(crate) fn hosts_entries(table: &NameTable) -> Vec<(Ipv4Addr, Vec<String>)> {
    table
        .services()
        .iter()
        .map(|s| (s.addr, s.names(table.domain()).to_vec()))
        .collect()
}
