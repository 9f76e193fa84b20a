//! Loopback stand-ins for endpoints (UDP and TCP echo workers that say who they are, health
//! ports that can be made to fail), clients with bounded waits, and metric reading.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::registry::Registry;
use spur_l4::{
    ClusterConfig, EndpointConfig, L4Config, ListenerConfig, ListenerSet, Protocol, ValidConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a client waits for any one answer.
pub const WAIT: Duration = Duration::from_secs(2);

pub fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A task that is aborted when dropped: nothing a test starts outlives it.
pub struct Task(JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub fn spawn(f: impl Future<Output = ()> + Send + 'static) -> Task {
    Task(tokio::spawn(f))
}

/// A UDP worker: answers each datagram with `<id>|<payload>`, or with the payload alone when
/// that would not fit in one datagram (the size tests).
pub struct UdpWorker {
    pub id: String,
    pub addr: SocketAddr,
    _task: Task,
}

pub async fn udp_worker(id: &str) -> UdpWorker {
    let socket = UdpSocket::bind(localhost(0)).await.unwrap();
    let addr = socket.local_addr().unwrap();
    let tag = format!("{id}|").into_bytes();
    let task = spawn(async move {
        let mut buf = vec![0u8; 65_535];
        let mut out = Vec::with_capacity(65_535);
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                continue;
            };
            out.clear();
            if n + tag.len() <= 65_507 {
                out.extend_from_slice(&tag);
            }
            out.extend_from_slice(&buf[..n]);
            let _ = socket.send_to(&out, from).await;
        }
    });
    UdpWorker {
        id: id.into(),
        addr,
        _task: task,
    }
}

/// A TCP worker: writes `<id>|`, then echoes everything until the client's EOF, then closes.
pub struct TcpWorker {
    pub id: String,
    pub addr: SocketAddr,
    _task: Task,
}

pub async fn tcp_worker(id: &str) -> TcpWorker {
    let listener = TcpListener::bind(localhost(0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tag = format!("{id}|").into_bytes();
    let task = spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let tag = tag.clone();
            tokio::spawn(async move {
                if s.write_all(&tag).await.is_err() {
                    return;
                }
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    TcpWorker {
        id: id.into(),
        addr,
        _task: task,
    }
}

/// A health port: a TCP listener answering HTTP `GET`s with 200 while `healthy` is set and
/// 503 otherwise; [`HealthPort::close`] stops it listening (TCP checks then fail).
pub struct HealthPort {
    pub port: u16,
    pub healthy: Arc<AtomicBool>,
    task: Option<Task>,
}

impl HealthPort {
    pub fn close(&mut self) {
        self.task = None;
    }

    pub fn set(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }
}

pub async fn health_port() -> HealthPort {
    let listener = TcpListener::bind(localhost(0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let healthy = Arc::new(AtomicBool::new(true));
    let flag = healthy.clone();
    let task = spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let flag = flag.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                // A TCP check sends nothing and closes: a read of 0 ends this.
                let Ok(n) = s.read(&mut buf).await else {
                    return;
                };
                if n == 0 {
                    return;
                }
                let reply: &[u8] = if flag.load(Ordering::SeqCst) {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                } else {
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
                };
                let _ = s.write_all(reply).await;
            });
        }
    });
    HealthPort {
        port,
        healthy,
        task: Some(task),
    }
}

pub fn endpoint(id: &str, addr: SocketAddr, health: Option<u16>) -> EndpointConfig {
    EndpointConfig {
        id: id.into(),
        address: addr,
        health_check_port: health,
    }
}

pub fn listener(name: &str, protocol: Protocol, cluster: ClusterConfig) -> ListenerConfig {
    ListenerConfig::new(name, protocol, localhost(0), cluster)
}

pub fn valid(listeners: Vec<ListenerConfig>, clusters: Vec<ClusterConfig>) -> ValidConfig {
    L4Config {
        listeners,
        clusters,
        drain_grace: Duration::from_secs(1),
    }
    .validate()
    .unwrap()
}

/// A running set with its registry and shutdown token.
pub struct Harness {
    pub set: ListenerSet,
    pub registry: Registry,
    pub shutdown: CancellationToken,
}

impl Harness {
    pub async fn start(config: ValidConfig) -> Harness {
        let mut registry = Registry::default();
        let shutdown = CancellationToken::new();
        let set = ListenerSet::start(config, &mut registry, shutdown.clone())
            .await
            .unwrap();
        Harness {
            set,
            registry,
            shutdown,
        }
    }

    pub fn addr(&self, listener: &str) -> SocketAddr {
        self.set.local_addr(listener).unwrap()
    }

    /// The value of one series, e.g. `l4_icmp_errors_total{listener="u"}`; 0 if absent.
    pub fn metric(&self, series: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }

    /// Waits (bounded) until `f` holds, polling every 20 ms; returns how long it took.
    pub async fn until(&self, limit: Duration, mut f: impl FnMut(&Harness) -> bool) -> Duration {
        let start = tokio::time::Instant::now();
        while !f(self) {
            assert!(
                start.elapsed() < limit,
                "condition not met within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        start.elapsed()
    }

    pub fn healthy(&self, cluster: &str, endpoint: &str) -> bool {
        self.set
            .clusters()
            .iter()
            .find(|c| c.name == cluster)
            .and_then(|c| c.endpoints.iter().find(|e| e.id == endpoint))
            .unwrap()
            .healthy
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.set.closed())
            .await
            .expect("the set closes within its drain grace");
    }
}

/// A UDP client on its own port, connected to the listener.
pub async fn udp_client(to: SocketAddr) -> UdpSocket {
    let s = UdpSocket::bind(localhost(0)).await.unwrap();
    s.connect(to).await.unwrap();
    s
}

/// Sends `payload`, returns the answer (None if none came within `wait`).
pub async fn udp_ask(s: &UdpSocket, payload: &[u8], wait: Duration) -> Option<Vec<u8>> {
    s.send(payload).await.unwrap();
    let mut buf = vec![0u8; 65_535];
    let n = tokio::time::timeout(wait, s.recv(&mut buf))
        .await
        .ok()?
        .ok()?;
    buf.truncate(n);
    Some(buf)
}

/// The worker id in a tagged answer.
pub fn who(answer: &[u8]) -> String {
    let end = answer.iter().position(|b| *b == b'|').unwrap();
    String::from_utf8(answer[..end].to_vec()).unwrap()
}

/// Which worker answers a new UDP session whose first datagram is `payload`.
///
/// The client socket is dropped: use [`Clients`] where many sessions must have distinct
/// addresses (a dropped socket's port can come back for a later client and find its session).
pub async fn udp_who(to: SocketAddr, payload: &[u8]) -> String {
    let c = udp_client(to).await;
    who(&udp_ask(&c, payload, WAIT).await.expect("an answer"))
}

/// Client sockets kept open, so each new one has a port no earlier session had.
#[derive(Default)]
pub struct Clients(Vec<UdpSocket>);

impl Clients {
    /// Which worker answers a new session whose first datagram is `payload`.
    pub async fn who(&mut self, to: SocketAddr, payload: &[u8]) -> String {
        let c = udp_client(to).await;
        let answer = udp_ask(&c, payload, WAIT).await.expect("an answer");
        self.0.push(c);
        who(&answer)
    }

    /// Whether a new session whose first datagram is `payload` gets an answer.
    pub async fn answered(&mut self, to: SocketAddr, payload: &[u8]) -> bool {
        let c = udp_client(to).await;
        let answered = udp_ask(&c, payload, WAIT).await.is_some();
        self.0.push(c);
        answered
    }
}

/// A TCP exchange: sends `payload`, shuts down writing (half-close), reads to EOF.
pub async fn tcp_exchange(to: SocketAddr, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = tokio::time::timeout(WAIT, TcpStream::connect(to)).await??;
    s.write_all(payload).await?;
    s.shutdown().await?;
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut out)).await??;
    Ok(out)
}

pub async fn tcp_who(to: SocketAddr, payload: &[u8]) -> String {
    who(&tcp_exchange(to, payload).await.unwrap())
}
