//! The in-cluster end of workstation tunnels (`spur-tunnel-proxy`): workstation tokens kept in
//! Secrets, the tunnel API each authenticated workstation talks to (cluster DNS, Services, its
//! local workloads, and which reverse bindings it may register), and the Lease that reports each
//! live tunnel to the operator's ExternalWorkload controller.
//!
//! ```text
//! spur local connect ══ tunnel (QUIC | h2/TLS, spur-tunnel) ══► tunnel proxy
//!   ├─ tunnel API (gRPC on a tunnel stream) ─► Caches (Services, ExternalWorkloads), DNS
//!   ├─ reverse binds <ns>/<ew>/<port> ─► a listener per bind ─► Lease spur-tunnel-<workstation>
//!   └─ forward streams / SOCKS5 ─► cluster addresses                    │
//!        (a tunnel grant's: only its namespace's Services and pods)     │
//!                                                                          ▼
//!                        operator: ExternalWorkload ─► EndpointSlice ─► routes for the key
//! ```

mod addr;
pub mod api;
pub mod destinations;
mod ipindex;
pub mod scope;
pub mod server;
pub mod sessions;
pub mod sources;
pub mod tokens;

pub use api::{BindId, Caches, TunnelApiService};
pub use destinations::Destinations;
pub use scope::Owners;
pub use server::{RunningProxy, TunnelProxyConfig, run};
pub use sessions::{Ended, SessionReporter};
pub use sources::{ReverseSources, ReverseSourcesConfig};
pub use tokens::{TokenError, TokenStore, Workstation};

/// Errors of the tunnel proxy's Kubernetes side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}
