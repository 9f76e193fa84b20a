//! Envoy xDS (ADS, state of the world) from the route server's view of the cluster, so that
//! proxyless gRPC clients and Envoy route by sandbox key exactly as Spur's sidecar does.
//!
//! ```text
//! Services + EndpointSlices + RoutingConfigs ─► Model ─► Snapshot (LDS/RDS/CDS/EDS, a version per type)
//!                                                          └─► one task per ADS stream :7779
//! ```
//!
//! Every Service port is served: a listener named as the client dials it
//! (`xds:///<svc>.<ns>[.svc[.cluster.local]]:<port>`), a route configuration of that name whose
//! routes send each sandbox's routing key (in any carrier the sidecar reads) to the sandbox
//! Service's cluster and everything else to the baseline, and an EDS cluster per Service port
//! with its ready endpoints. The port requires a client certificate from the operator's CA;
//! plaintext is an explicit opt-in.

mod ads;
mod kind;
mod metrics;
pub mod model;
mod node_config;
pub mod render;
mod report;

pub use ads::{Nack, NodeStatus, Nodes, RevisionCounts, TypeStatus};
pub use report::Reports;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use prometheus_client::registry::Registry;
use spur_runtime::Drain;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::{Error, Index};
use metrics::XdsMetrics;
use render::{Kind, Snapshot};
use spur_serving::tls::{self, ServingTls};

/// How the xDS port is served.
#[derive(Debug, Clone)]
pub struct XdsConfig {
    /// Default `0.0.0.0:7779`.
    pub addr: SocketAddr,
    /// None serves plaintext without client authentication (an explicit opt-in of the binary).
    pub tls: Option<XdsTls>,
    /// The cluster's DNS domain, stripped from the names clients dial.
    pub cluster_domain: String,
    /// Most resource names one stream may subscribe to per type.
    pub max_names: usize,
    /// Most open ADS streams (all connections); beyond, new ones are refused.
    pub max_streams: usize,
    /// Most concurrent streams on one connection.
    pub max_streams_per_connection: u32,
    /// Where this replica reports what its streams did with EnvoyConfig revisions (the
    /// operator's rollback reads it); None reports nothing.
    pub reports: Option<Reports>,
}

impl XdsConfig {
    pub fn new(tls: Option<XdsTls>) -> Self {
        XdsConfig {
            addr: SocketAddr::from(([0, 0, 0, 0], 7779)),
            tls,
            cluster_domain: "cluster.local".into(),
            max_names: 10_000,
            max_streams: 20_000,
            max_streams_per_connection: 100,
            reports: None,
        }
    }
}

/// The common-name prefix of the client certificates the operator issues for xDS
/// (`system:spur:xds:<namespace>`): its CA also signs workstations' certificates, which must not
/// read xDS.
pub const CLIENT_CN_PREFIX: &str = "system:spur:xds:";

/// The server's certificate and the CA whose client certificates it accepts.
#[derive(Debug, Clone)]
pub struct XdsTls {
    pub serving: ServingTls,
    pub client_ca: PathBuf,
    /// Client certificates must name a subject starting with this ([`CLIENT_CN_PREFIX`] from
    /// the CLI); None accepts any certificate of the CA.
    pub client_cn_prefix: Option<String>,
}

/// A running xDS server.
pub(crate) struct XdsServer {
    pub(crate) addr: SocketAddr,
    pub(crate) nodes: Nodes,
}

/// Binds the port, then renders every model the index publishes and serves ADS until `stop`.
pub(crate) async fn start(
    config: &XdsConfig,
    index: &Index,
    registry: &mut Registry,
    tasks: &Drain,
    stop: CancellationToken,
) -> Result<XdsServer, Error> {
    let listener = TcpListener::bind(config.addr)
        .await
        .map_err(|source| Error::Bind {
            what: "xDS",
            addr: config.addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Bind {
        what: "xDS",
        addr: config.addr,
        source,
    })?;
    let tls = match &config.tls {
        Some(t) => Some(tls::start_mutual(
            &t.serving,
            &t.client_ca,
            t.client_cn_prefix.as_deref(),
            tasks,
            stop.clone(),
        )?),
        None => None,
    };
    let metrics = XdsMetrics::register(registry);
    let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
    let mut models = index.subscribe_xds();
    let render_metrics = metrics.clone();
    let render_stop = stop.clone();
    tasks.spawn(async move {
        loop {
            // Nothing is served before the store's first complete view: an empty state of the
            // world would make clients drop every listener and cluster they hold.
            if let Some(model) = models.borrow_and_update().clone() {
                let next = tx.borrow().next(model);
                for kind in Kind::ALL {
                    render_metrics.set_version(kind, next.resources(kind).version);
                }
                // A stream re-evaluates only the types whose version moved.
                tx.send_replace(Arc::new(next));
            }
            tokio::select! {
                () = render_stop.cancelled() => return,
                r = models.changed() => if r.is_err() { return },
            }
        }
    });
    let nodes = Nodes::default();
    if let Some(r) = config.reports.clone() {
        tasks.spawn(report::run(
            r,
            nodes.clone(),
            index.subscribe_xds(),
            stop.clone(),
        ));
    }
    let ads = ads::Ads {
        snapshots: rx,
        cluster_domain: config.cluster_domain.as_str().into(),
        metrics,
        nodes: nodes.clone(),
        stop: stop.clone(),
        max_names: config.max_names,
        max_streams: config.max_streams,
        open: Arc::default(),
        next_stream: Arc::new(AtomicU64::new(1)),
    };
    let incoming = tls::incoming(listener, addr, tls, tasks, stop.clone());
    let max_per_connection = config.max_streams_per_connection;
    tasks.spawn(async move {
        let res = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .max_concurrent_streams(Some(max_per_connection))
            .add_service(AggregatedDiscoveryServiceServer::new(ads))
            .serve_with_incoming_shutdown(incoming.into_stream(), stop.cancelled())
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "xDS server failed");
        }
    });
    Ok(XdsServer { addr, nodes })
}
