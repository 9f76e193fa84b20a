//! The shared L4/L7 proxy core every Spur data-plane binary is built from.
//!
//! One accepted connection flows through these layers:
//!
//! ```text
//! listener (explicit port | transparent, SO_ORIGINAL_DST)
//!   └─ detect (bounded peek + timeout): HTTP/1.x | h2c prior knowledge | TLS ClientHello | opaque
//!        ├─ HTTP/1.1, HTTP/2 server (hyper) ─ per request: Router → upstream pool → response
//!        │      upgrades (WebSocket) and CONNECT are spliced after the upstream agrees
//!        └─ TLS and opaque TCP: spliced to the connection's original destination, with half-close
//! Kafka listener (transparent only; the pod's own broker connections)
//!   └─ kafka: frames through a spur_kafka::Session to the original destination, records filtered
//! ```
//!
//! Routing decisions are made by a [`Router`], and features beside routing (the HTTP/1 relay's
//! raw routing, traffic capture) plug in through [`Plugins`]; the sidecar brings its key router (routing keys
//! looked up in a [`spur_routing::SharedTable`], in `spur-sidecar`), and the tunnel proxy and
//! agent will bring their own.
//! Tables are swapped by a single writer off the hot path; when a table changes,
//! [`Proxy::on_table_change`] closes idle pooled connections to destinations that left it, so no
//! request ever reaches a stale destination over a kept-alive connection.
//!
//! Every connection runs under a [`Drain`]: on shutdown the listener stops accepting, HTTP
//! connections finish their in-flight requests (HTTP/2 sends GOAWAY), and whatever is still running
//! after the grace period is cut.

mod admin;
pub mod capture;
mod config;
mod conn;
mod detect;
mod error;
mod http;
mod io;
pub mod kafka;
mod listener;
mod metrics;
mod plugin;
mod pool;
mod router;
mod tcp;

pub use admin::{AdminState, serve_admin};
pub use config::ProxyConfig;
pub use conn::ConnMeta;
pub use detect::Protocol;
pub use error::Error;
pub use listener::Inbound;
pub use metrics::Metrics;
pub use plugin::{CapturePlugin, CaptureSelect, Plugins, RawRoute, RawRouter, TraceRecord};
pub use router::{Route, Router};
pub use spur_runtime::Drain;

use std::sync::Arc;

use prometheus_client::registry::Registry;
use spur_routing::SharedTable;

/// The proxy: configuration, router, upstream pools and metrics, shared by all its listeners.
/// Cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

/// What every connection of a proxy reads: passed by reference (an `Arc` where a task or a
/// hyper service must own it) to the listener and the protocol servers.
pub(crate) struct Shared {
    pub(crate) config: ProxyConfig,
    pub(crate) router: Arc<dyn Router>,
    /// Features beside routing: the relay's raw routing, capture.
    pub(crate) plugins: Plugins,
    pub(crate) pool: pool::Pool,
    pub(crate) metrics: Metrics,
}

/// Keeps a timer due within a second in the runtime, forever.
///
/// hyper arms a header-read deadline for every request. When a new timer is due earlier than
/// everything the time driver is waiting for, tokio wakes the driver through its eventfd: one
/// extra `write` and one extra `epoll_wait` per request (seen with `strace -c`). With a timer
/// always due sooner, registering a 10 s deadline never moves the driver's wake-up, at the
/// price of one wake-up per second.
async fn timer_anchor() {
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

impl Proxy {
    /// Builds a proxy. `config` must already be validated ([`ProxyConfig::validate`]); metrics are
    /// registered under `registry` (the caller chooses the prefix, e.g. `spur`).
    pub fn new(
        config: ProxyConfig,
        router: Arc<dyn Router>,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        Self::with_plugins(config, router, Plugins::default(), registry)
    }

    /// [`Proxy::new`] with features beside routing ([`Plugins`]).
    pub fn with_plugins(
        config: ProxyConfig,
        router: Arc<dyn Router>,
        plugins: Plugins,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        config.validate()?;
        let metrics = Metrics::register(registry);
        let pool = pool::Pool::new(&config, metrics.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(timer_anchor());
        }
        Ok(Proxy {
            shared: Arc::new(Shared {
                config,
                router,
                plugins,
                pool,
                metrics,
            }),
        })
    }

    /// Accepts connections on `listener` until `drain` starts, serving each one under `drain`.
    /// Returns once the listener has stopped; connections keep running until [`Drain::wait`].
    pub async fn serve(&self, listener: tokio::net::TcpListener, inbound: Inbound, drain: Drain) {
        listener::accept_loop(self.shared.clone(), listener, inbound, drain).await
    }

    /// Accepts Kafka connections on `listener` (redirected there by the interception rules, or
    /// made to it: see [`kafka::KafkaUpstream`]) and relays each to its broker through `relay`
    /// ([`kafka`]). Returns once the
    /// listener has stopped; connections keep running until [`Drain::wait`].
    pub async fn serve_kafka(
        &self,
        listener: tokio::net::TcpListener,
        to: kafka::KafkaUpstream,
        relay: kafka::KafkaRelay,
        drain: Drain,
    ) {
        kafka::accept_loop(self.shared.clone(), listener, to, Arc::new(relay), drain).await
    }

    /// Closes idle pooled connections to sandbox destinations that are not in `table`'s current
    /// snapshot, and marks them so in-flight ones are not returned to the pool. Call it after every
    /// table swap (see `spur_discovery`'s change notifications).
    pub fn on_table_change(&self, table: &SharedTable) {
        let snapshot = table.load();
        self.shared
            .pool
            .retain_sandbox_upstreams(&snapshot.table.locations());
    }

    /// Number of idle pooled upstream connections (HTTP/1 idle plus HTTP/2 shared), for tests and
    /// the admin dump.
    pub fn idle_upstream_connections(&self) -> usize {
        self.shared.pool.idle_count()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }
}
