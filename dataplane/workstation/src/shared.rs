//! What every task of a workstation shares ([`Shared`]: the tunnel client, the status, the
//! drain) and the one stream of human-readable [`Event`]s they report into (the CLI prints
//! them). `connect` assembles it; the binds, API and services tasks only use it.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use spur_runtime::Drain;
use spur_tunnel::{Transport, TunnelClient};
use tokio::sync::watch;

use crate::state::Status;

/// Receives every [`Event`]; must not block.
pub type EventSink = Arc<dyn Fn(&Event) + Send + Sync>;

/// Progress and problems, for a person. `Display` is the line the CLI prints.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    Listening {
        what: &'static str,
        addr: SocketAddr,
    },
    Connecting {
        server: String,
    },
    Connected {
        transport: Transport,
        identity: String,
    },
    Disconnected {
        reason: String,
        retry_in: Duration,
    },
    Closed {
        reason: String,
    },
    Hello {
        workstation: String,
        proxy_pod: String,
        cluster_domain: String,
    },
    ApiError {
        reason: String,
    },
    Workloads {
        workloads: usize,
        binds: usize,
    },
    BindActive {
        id: String,
        to_local: String,
    },
    BindRejected {
        id: String,
        reason: String,
    },
    /// Not bound by the workstation itself (a `to_local` it will not connect to).
    BindRefused {
        id: String,
        reason: String,
    },
    LocalUnreachable {
        id: String,
        to_local: String,
        reason: String,
    },
    LocalReachable {
        id: String,
        to_local: String,
    },
    Services {
        names: usize,
        listeners: usize,
        failed: usize,
        skipped: usize,
    },
    ListenFailed {
        errors: Vec<String>,
    },
    HostsFile {
        path: PathBuf,
        entries: usize,
    },
    Warning(String),
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Listening { what, addr } => write!(f, "{what} listening on {addr}"),
            Event::Connecting { server } => write!(f, "connecting to {server}…"),
            Event::Connected {
                transport,
                identity,
            } => {
                let t = match transport {
                    Transport::Quic => "QUIC",
                    Transport::H2 => "HTTP/2 over TLS",
                };
                write!(f, "connected via {t} as {identity}")
            }
            Event::Disconnected { reason, retry_in } => write!(
                f,
                "tunnel down: {reason}; reconnecting in {:.1}s",
                retry_in.as_secs_f64()
            ),
            Event::Closed { reason } => write!(f, "tunnel closed: {reason}"),
            Event::Hello {
                workstation,
                proxy_pod,
                cluster_domain,
            } => write!(
                f,
                "workstation {workstation} on proxy pod {proxy_pod} (cluster domain {cluster_domain})"
            ),
            Event::ApiError { reason } => write!(f, "tunnel API: {reason}; retrying"),
            Event::Workloads { workloads, binds } => {
                write!(f, "{workloads} local workload(s), {binds} reverse bind(s)")
            }
            Event::BindActive { id, to_local } => {
                write!(f, "reverse bind {id} active → {to_local}")
            }
            Event::BindRejected { id, reason } => {
                write!(f, "warning: reverse bind {id} rejected: {reason}")
            }
            Event::BindRefused { id, reason } => {
                write!(f, "warning: reverse bind {id} refused here: {reason}")
            }
            Event::LocalUnreachable {
                id,
                to_local,
                reason,
            } => write!(
                f,
                "warning: cluster traffic for {id} cannot reach {to_local}: {reason} (is your local process running?)"
            ),
            Event::LocalReachable { id, to_local } => {
                write!(f, "{to_local} answers again for {id}")
            }
            Event::Services {
                names,
                listeners,
                failed,
                skipped,
            } => {
                write!(
                    f,
                    "{names} cluster service name(s), {listeners} service port(s) on loopback"
                )?;
                if *failed > 0 {
                    write!(f, ", {failed} port(s) could not be listened on")?;
                }
                if *skipped > 0 {
                    write!(f, ", {skipped} service(s) left out (over the limit)")?;
                }
                Ok(())
            }
            Event::ListenFailed { errors } => {
                write!(
                    f,
                    "warning: cannot listen on {} service port(s)",
                    errors.len()
                )?;
                for e in errors.iter().take(3) {
                    write!(f, "\n  {e}")?;
                }
                if errors.len() > 3 {
                    write!(f, "\n  … (see `spur local status`)")?;
                }
                Ok(())
            }
            Event::HostsFile { path, entries } => {
                write!(f, "{} updated: {entries} name line(s)", path.display())
            }
            Event::Warning(w) => write!(f, "warning: {w}"),
        }
    }
}

/// State every task of a workstation shares.
pub(crate) struct Shared {
    pub(crate) client: Arc<TunnelClient>,
    pub(crate) status: watch::Sender<Status>,
    pub(crate) drain: Drain,
    pub(crate) local_connect_timeout: Duration,
    pub(crate) allow_remote_targets: bool,
    pub(crate) on_event: Option<EventSink>,
}

impl Shared {
    pub(crate) fn emit(&self, e: Event) {
        tracing::debug!(event = %e, "workstation event");
        if let Some(sink) = &self.on_event {
            sink(&e);
        }
    }
}
