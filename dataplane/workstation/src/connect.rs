//! `spur local connect`: one tunnel session and everything the workstation runs on it.
//!
//! ```text
//! Workstation::start
//!   ├─ TunnelClient (reconnects and re-binds on its own)      ── state → status + events
//!   ├─ tunnel API task: Hello, ListServices (every refresh), WatchLocalWorkloads → Binds
//!   ├─ services task: name table (arc-swap) → loopback listeners, hosts-file block
//!   ├─ SOCKS5 / HTTP CONNECT proxy (spur_proxy::forward) → forward tunnel streams
//!   ├─ DNS responder (UDP) ← name table
//!   └─ state-file writer ← status (watch)
//! ```
//!
//! Every piece reports into one [`Status`] (a watch channel, mirrored into the state file) and
//! one stream of human-readable [`Event`]s (the CLI prints them).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::registry::Registry;
use spur_forward::{ForwardConfig, serve_forward};
use spur_proto::tunnel::{
    ClusterService, HelloRequest, ListServicesRequest, WatchLocalWorkloadsRequest,
};
use spur_runtime::Drain;
use spur_tunnel::{ClientConfig, SessionState, TunnelClient};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::binds::Binds;
use crate::names::{Allocator, NameTable};
use crate::opener::{Opener, TunnelDialer, TunnelOpener};
use crate::services::{Listeners, hosts_entries};
use crate::shared::{Event, EventSink, Shared};
use crate::state::{self, Status, TunnelStatus};
use crate::{Error, api, dns, hosts};

/// What `spur local connect` runs. Build with [`ConnectConfig::new`] and adjust.
pub struct ConnectConfig {
    pub tunnel: ClientConfig,
    /// The server as the user named it (status and messages only).
    pub server: String,
    /// Local SOCKS5 + HTTP CONNECT proxy; `None` disables it.
    pub socks_addr: Option<SocketAddr>,
    /// Local DNS responder for cluster service names; `None` disables it.
    pub dns_addr: Option<SocketAddr>,
    /// Hosts file to keep a `# spur begin`/`# spur end` block in (opt-in; needs write access).
    pub hosts_file: Option<PathBuf>,
    /// Where the state file lives; `None`: no state file.
    pub state_dir: Option<PathBuf>,
    /// Only Services of these namespaces get names and listeners (all when empty).
    pub namespaces: Vec<String>,
    /// The /16 in 127.0.0.0/8 Service addresses come from (the first two octets count).
    pub service_net: Ipv4Addr,
    /// At most this many Services get names and listeners.
    pub max_services: usize,
    /// How often the Service list is fetched again.
    pub services_refresh: Duration,
    /// Timeout for connecting to a local process for a reverse stream.
    pub local_connect_timeout: Duration,
    /// Reverse streams may go to any `to_local` the Sandbox names, not only to this machine's
    /// loopback addresses (`--allow-remote-targets`).
    pub allow_remote_targets: bool,
    /// Timeout for opening the tunnel API connection and for opening a forward stream.
    pub open_timeout: Duration,
    /// Sent in `Hello`.
    pub client_version: String,
    pub on_event: Option<EventSink>,
}

impl ConnectConfig {
    pub fn new(tunnel: ClientConfig, server: impl Into<String>) -> Self {
        ConnectConfig {
            tunnel,
            server: server.into(),
            socks_addr: Some(SocketAddr::from(([127, 0, 0, 1], 1080))),
            dns_addr: Some(SocketAddr::from(([127, 0, 0, 1], 5353))),
            hosts_file: None,
            state_dir: None,
            namespaces: Vec::new(),
            service_net: Ipv4Addr::new(127, 77, 0, 0),
            max_services: 2000,
            services_refresh: Duration::from_secs(30),
            local_connect_timeout: Duration::from_secs(5),
            allow_remote_targets: false,
            open_timeout: Duration::from_secs(15),
            client_version: String::new(),
            on_event: None,
        }
    }

    fn services_enabled(&self) -> bool {
        self.dns_addr.is_some() || self.hosts_file.is_some()
    }
}

/// A running `spur local connect`.
pub struct Workstation {
    shared: Arc<Shared>,
    socks_addr: Option<SocketAddr>,
    dns_addr: Option<SocketAddr>,
    names: Arc<ArcSwap<NameTable>>,
    state_dir: Option<PathBuf>,
    cancel: CancellationToken,
    api_task: JoinHandle<()>,
    services_task: Option<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
    writer: Option<JoinHandle<()>>,
    _registry: Registry,
}

impl Workstation {
    /// Binds the local sockets (failing fast on a port in use or a hosts file it may not
    /// write), starts the tunnel client and every task. Returns while the tunnel connects.
    pub async fn start(config: ConnectConfig) -> Result<Workstation, Error> {
        if config.max_services == 0 || config.services_refresh.is_zero() {
            return Err(Error::Config(
                "max_services and services_refresh must be > 0".into(),
            ));
        }
        let allocator = Allocator::new(config.service_net)?;
        let services_enabled = config.services_enabled();
        if let Some(dir) = &config.state_dir
            && let Some(existing) = state::read(dir).ok().flatten()
            && existing.pid != std::process::id()
            && state::is_running(&existing)
        {
            return Err(Error::AlreadyRunning {
                pid: existing.pid,
                path: state::path(dir),
            });
        }
        let socks = match config.socks_addr {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| Error::Listen {
                        what: "SOCKS5/HTTP CONNECT proxy",
                        addr,
                        source,
                    })?,
            ),
            None => None,
        };
        let dns_socket = match config.dns_addr {
            Some(addr) => Some(
                UdpSocket::bind(addr)
                    .await
                    .map_err(|source| Error::Listen {
                        what: "DNS",
                        addr,
                        source,
                    })?,
            ),
            None => None,
        };
        if let Some(path) = &config.hosts_file {
            // Fails now, before connecting, when the file is not writable (e.g. /etc/hosts
            // without root).
            hosts::write_block(path, &[])?;
        }
        let socks_addr = socks.as_ref().and_then(|l| l.local_addr().ok());
        let dns_addr = dns_socket.as_ref().and_then(|s| s.local_addr().ok());

        let mut registry = Registry::with_prefix("spur_tunnel");
        let client = Arc::new(TunnelClient::start(config.tunnel, &mut registry)?);
        let status = Status {
            pid: std::process::id(),
            command: state::own_command(),
            server: config.server.clone(),
            started_at: state::now_unix(),
            tunnel: TunnelStatus {
                state: "connecting".into(),
                ..TunnelStatus::default()
            },
            socks_addr,
            dns_addr,
            hosts_file: config.hosts_file.clone(),
            ..Status::default()
        };
        let shared = Arc::new(Shared {
            client: client.clone(),
            status: watch::Sender::new(status),
            drain: Drain::new(),
            local_connect_timeout: config.local_connect_timeout,
            allow_remote_targets: config.allow_remote_targets,
            on_event: config.on_event.clone(),
        });
        let cancel = CancellationToken::new();
        let mut background = Vec::new();

        let writer = config.state_dir.clone().map(|dir| {
            let rx = shared.status.subscribe();
            tokio::spawn(write_state(dir, rx, cancel.clone()))
        });
        background.push(tokio::spawn(watch_tunnel(
            shared.clone(),
            config.server.clone(),
            cancel.clone(),
        )));
        if let (Some(listener), Some(addr)) = (socks, socks_addr) {
            let dialer = Arc::new(TunnelDialer {
                client: client.clone(),
            });
            let forward = ForwardConfig {
                handshake_timeout: Duration::from_secs(10),
                dial_timeout: config.open_timeout,
            };
            background.push(tokio::spawn(serve_forward(
                listener,
                dialer,
                forward,
                shared.drain.clone(),
            )));
            shared.emit(Event::Listening {
                what: "SOCKS5/HTTP CONNECT proxy",
                addr,
            });
        }
        let names = Arc::new(ArcSwap::from_pointee(NameTable::default()));
        if let (Some(socket), Some(addr)) = (dns_socket, dns_addr) {
            background.push(tokio::spawn(dns::serve(
                socket,
                names.clone(),
                cancel.clone(),
            )));
            shared.emit(Event::Listening { what: "DNS", addr });
        }
        let (services_tx, services_rx) = watch::channel(None);
        let services_task = services_enabled.then(|| {
            let opener: Arc<dyn Opener> = Arc::new(TunnelOpener(client.clone()));
            tokio::spawn(services_task(ServicesTask {
                shared: shared.clone(),
                names: names.clone(),
                allocator,
                listeners: Listeners::new(opener, shared.drain.clone(), config.open_timeout),
                hosts_file: config.hosts_file.clone(),
                max_services: config.max_services,
                input: services_rx,
                cancel: cancel.clone(),
            }))
        });
        let api_task = tokio::spawn(api_task(ApiTask {
            shared: shared.clone(),
            services: services_enabled.then_some(services_tx),
            namespaces: config.namespaces,
            refresh: config.services_refresh,
            open_timeout: config.open_timeout,
            client_version: config.client_version,
            cancel: cancel.clone(),
        }));
        Ok(Workstation {
            shared,
            socks_addr,
            dns_addr,
            names,
            state_dir: config.state_dir,
            cancel,
            api_task,
            services_task,
            background,
            writer,
            _registry: registry,
        })
    }

    pub fn socks_addr(&self) -> Option<SocketAddr> {
        self.socks_addr
    }

    pub fn dns_addr(&self) -> Option<SocketAddr> {
        self.dns_addr
    }

    /// The current status; changes as the tunnel, binds and Services change.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.shared.status.subscribe()
    }

    /// The current name table (Service names → loopback addresses).
    pub fn names(&self) -> Arc<NameTable> {
        self.names.load_full()
    }

    pub fn client(&self) -> Arc<TunnelClient> {
        self.shared.client.clone()
    }

    /// Resolves when the tunnel client has stopped for good (refused without retry, e.g. a
    /// bad or expired token), with the reason.
    pub async fn closed(&self) -> String {
        let mut rx = self.shared.client.state();
        let closed = rx
            .wait_for(|s| matches!(s, SessionState::Closed { .. }))
            .await;
        match closed.as_deref() {
            Ok(SessionState::Closed { reason }) => reason.clone(),
            _ => "tunnel client stopped".into(),
        }
    }

    /// The clean exit: drop every reverse bind, stop the listeners, remove the hosts-file
    /// block, let open connections finish (up to `grace`), close the tunnel gracefully and
    /// delete the state file.
    pub async fn shutdown(self, grace: Duration) {
        self.cancel.cancel();
        self.shared.drain.start();
        let _ = self.api_task.await;
        if let Some(t) = self.services_task {
            let _ = t.await;
        }
        let left = self.shared.drain.wait(grace).await;
        if left > 0 {
            tracing::info!(
                connections = left,
                "cutting connections still open after the grace period"
            );
        }
        self.shared.client.close(grace).await;
        for t in self.background {
            t.abort();
        }
        if let Some(w) = self.writer {
            let _ = w.await;
        }
        if let Some(dir) = &self.state_dir {
            state::remove(dir);
        }
    }
}

/// Mirrors the tunnel client's state into the status and events.
async fn watch_tunnel(shared: Arc<Shared>, server: String, cancel: CancellationToken) {
    let mut rx = shared.client.state();
    let mut first = true;
    loop {
        let now = rx.borrow_and_update().clone();
        let tunnel = match &now {
            SessionState::Connecting { attempt } => {
                if *attempt == 1 || first {
                    shared.emit(Event::Connecting {
                        server: server.clone(),
                    });
                }
                TunnelStatus {
                    state: "connecting".into(),
                    transport: None,
                    detail: Some(format!("attempt {attempt}")),
                }
            }
            SessionState::Connected {
                transport,
                identity,
                ..
            } => {
                shared.emit(Event::Connected {
                    transport: *transport,
                    identity: identity.clone(),
                });
                TunnelStatus {
                    state: "connected".into(),
                    transport: Some(transport.to_string()),
                    detail: None,
                }
            }
            SessionState::Disconnected { reason, retry_in } => {
                shared.emit(Event::Disconnected {
                    reason: reason.clone(),
                    retry_in: *retry_in,
                });
                TunnelStatus {
                    state: "disconnected".into(),
                    transport: None,
                    detail: Some(reason.clone()),
                }
            }
            SessionState::Closed { reason } => {
                if !cancel.is_cancelled() {
                    shared.emit(Event::Closed {
                        reason: reason.clone(),
                    });
                }
                TunnelStatus {
                    state: "closed".into(),
                    transport: None,
                    detail: Some(reason.clone()),
                }
            }
        };
        first = false;
        shared.status.send_modify(|s| s.tunnel = tunnel);
        tokio::select! {
            () = cancel.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

/// Writes the state file whenever the status changes.
async fn write_state(dir: PathBuf, mut rx: watch::Receiver<Status>, cancel: CancellationToken) {
    let mut warned = false;
    loop {
        let status = rx.borrow_and_update().clone();
        match state::write(&dir, &status) {
            Ok(()) => warned = false,
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(error = %e, "cannot write the state file");
            }
            Err(_) => {}
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

struct ApiTask {
    shared: Arc<Shared>,
    /// Where Service lists go (with the cluster domain); `None` when names are off.
    services: Option<watch::Sender<Option<ServiceList>>>,
    namespaces: Vec<String>,
    refresh: Duration,
    open_timeout: Duration,
    client_version: String,
    cancel: CancellationToken,
}

type ServiceList = (Arc<Vec<ClusterService>>, String);

/// Keeps a tunnel API conversation going on the current session; starts over on each new one.
async fn api_task(t: ApiTask) {
    let mut binds = Binds::new(t.shared.clone());
    let mut state = t.shared.client.state();
    let mut failures: u32 = 0;
    loop {
        let session = tokio::select! {
            () = t.cancel.cancelled() => break,
            s = state.wait_for(|s| matches!(s, SessionState::Connected { .. } | SessionState::Closed { .. })) => match s.as_deref() {
                Ok(SessionState::Connected { session_id, .. }) => *session_id,
                _ => break,
            },
        };
        let started = tokio::time::Instant::now();
        let ended = tokio::select! {
            () = t.cancel.cancelled() => break,
            r = api_session(&t, &mut binds, session) => r,
        };
        if let Err(e) = ended {
            // A lost session explains itself through the tunnel state; only report API
            // problems on a session that is still up.
            let still_up = matches!(&*state.borrow(), SessionState::Connected { session_id, .. } if *session_id == session);
            if still_up {
                t.shared.emit(Event::ApiError {
                    reason: e.to_string(),
                });
            }
            tracing::debug!(error = %e, "tunnel API conversation ended");
        }
        failures = if started.elapsed() > Duration::from_secs(30) {
            1
        } else {
            failures.saturating_add(1)
        };
        let delay = Duration::from_millis(200)
            .saturating_mul(1 << failures.min(5))
            .min(Duration::from_secs(5));
        tokio::select! {
            () = t.cancel.cancelled() => break,
            () = tokio::time::sleep(delay) => {}
        }
    }
    binds.stop_all().await;
}

async fn api_session(t: &ApiTask, binds: &mut Binds, session: u64) -> Result<(), Error> {
    let mut api = api::connect(t.shared.client.clone(), t.open_timeout)
        .await?
        .max_decoding_message_size(64 * 1024 * 1024);
    let hello = api
        .hello(HelloRequest {
            client_version: t.client_version.clone(),
        })
        .await?
        .into_inner();
    let domain = if hello.cluster_domain.is_empty() {
        "cluster.local".to_owned()
    } else {
        hello.cluster_domain.clone()
    };
    t.shared.status.send_modify(|s| {
        s.workstation = Some(hello.workstation.clone());
        s.proxy_pod = Some(hello.proxy_pod.clone());
        s.cluster_domain = Some(domain.clone());
    });
    t.shared.emit(Event::Hello {
        workstation: hello.workstation,
        proxy_pod: hello.proxy_pod,
        cluster_domain: domain.clone(),
    });
    let list_services = |mut api: spur_proto::tunnel::tunnel_api_client::TunnelApiClient<_>| {
        let req = ListServicesRequest {
            namespaces: t.namespaces.clone(),
        };
        async move { api.list_services(req).await }
    };
    if let Some(tx) = &t.services {
        let list = list_services(api.clone()).await?.into_inner().services;
        tx.send_replace(Some((Arc::new(list), domain.clone())));
    }
    let mut watch = api
        .watch_local_workloads(WatchLocalWorkloadsRequest {})
        .await?
        .into_inner();
    let mut refresh = tokio::time::interval(t.refresh);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    refresh.tick().await;
    let mut state = t.shared.client.state();
    loop {
        tokio::select! {
            m = watch.message() => match m? {
                Some(list) => binds.reconcile(&list.workloads).await,
                None => return Err(Error::Api("the workload watch ended".into())),
            },
            _ = refresh.tick(), if t.services.is_some() => {
                match list_services(api.clone()).await {
                    Ok(r) => {
                        if let Some(tx) = &t.services {
                            let list = r.into_inner().services;
                            tx.send_if_modified(|cur| {
                                let same = cur.as_ref().is_some_and(|(l, d)| **l == list && *d == domain);
                                if !same {
                                    *cur = Some((Arc::new(list), domain.clone()));
                                }
                                !same
                            });
                        }
                    }
                    Err(s) => tracing::debug!(error = %s, "ListServices failed; keeping the last list"),
                }
            }
            r = state.changed() => {
                if r.is_err() {
                    return Ok(());
                }
                let moved_on = match &*state.borrow() {
                    SessionState::Connected { session_id, .. } => *session_id != session,
                    SessionState::Closed { .. } => true,
                    _ => false,
                };
                if moved_on {
                    return Ok(());
                }
            }
        }
    }
}

struct ServicesTask {
    shared: Arc<Shared>,
    names: Arc<ArcSwap<NameTable>>,
    allocator: Allocator,
    listeners: Listeners,
    hosts_file: Option<PathBuf>,
    max_services: usize,
    input: watch::Receiver<Option<ServiceList>>,
    cancel: CancellationToken,
}

/// Service list → name table → listeners and hosts-file block.
async fn services_task(mut t: ServicesTask) {
    let mut last_hosts: Option<Vec<(Ipv4Addr, Vec<String>)>> = None;
    let mut last_counts = None;
    loop {
        tokio::select! {
            () = t.cancel.cancelled() => break,
            r = t.input.changed() => if r.is_err() { break },
        }
        let Some((list, domain)) = t.input.borrow_and_update().clone() else {
            continue;
        };
        let (table, skipped) = t.allocator.table(&list, &domain, t.max_services);
        let table = Arc::new(table);
        t.names.store(table.clone());
        let report = t.listeners.reconcile(&table).await;
        if !report.new_errors.is_empty() {
            t.shared.emit(Event::ListenFailed {
                errors: report.new_errors.clone(),
            });
        }
        if let Some(path) = &t.hosts_file {
            let entries = hosts_entries(&table);
            if last_hosts.as_ref() != Some(&entries) {
                match hosts::write_block(path, &entries) {
                    Ok(()) => t.shared.emit(Event::HostsFile {
                        path: path.clone(),
                        entries: entries.len(),
                    }),
                    Err(e) => t.shared.emit(Event::Warning(e.to_string())),
                }
                last_hosts = Some(entries);
            }
        }
        let counts = (table.len(), report.listeners, report.error_count, skipped);
        if last_counts != Some(counts) {
            last_counts = Some(counts);
            t.shared.emit(Event::Services {
                names: counts.0,
                listeners: counts.1,
                failed: counts.2,
                skipped,
            });
        }
        t.shared.status.send_modify(|s| {
            s.services = state::ServicesStatus {
                names: table.len(),
                listeners: report.listeners,
                listen_errors: report.errors.clone(),
                listen_error_count: report.error_count,
                skipped,
            };
        });
    }
    t.listeners.stop_all();
    t.names.store(Arc::new(NameTable::default()));
    if let Some(path) = &t.hosts_file
        && let Err(e) = hosts::remove_block(path)
    {
        t.shared.emit(Event::Warning(e.to_string()));
    }
}
