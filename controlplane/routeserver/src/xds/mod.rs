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
mod metrics;
pub mod model;
pub mod render;

pub use ads::{Nack, NodeStatus, Nodes, TypeStatus};

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

use crate::tls::{self, ServingTls};
use crate::{Error, Index};
use metrics::XdsMetrics;
use render::{Kind, Snapshot};

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
}

impl XdsConfig {
    pub fn new(tls: Option<XdsTls>) -> Self {
        XdsConfig {
            addr: SocketAddr::from(([0, 0, 0, 0], 7779)),
            tls,
            cluster_domain: "cluster.local".into(),
            max_names: 10_000,
        }
    }
}

/// The server's certificate and the CA whose client certificates it accepts.
#[derive(Debug, Clone)]
pub struct XdsTls {
    pub serving: ServingTls,
    pub client_ca: PathBuf,
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
            let model = models.borrow_and_update().clone();
            let next = tx.borrow().next(model);
            for kind in Kind::ALL {
                render_metrics.set_version(kind, next.resources(kind).version);
            }
            // Streams compare what they would send with what they sent: publishing a snapshot
            // whose versions did not move costs each of them one comparison.
            tx.send_replace(Arc::new(next));
            tokio::select! {
                () = render_stop.cancelled() => return,
                r = models.changed() => if r.is_err() { return },
            }
        }
    });
    let nodes = Nodes::default();
    let ads = ads::Ads {
        snapshots: rx,
        cluster_domain: config.cluster_domain.as_str().into(),
        metrics,
        nodes: nodes.clone(),
        stop: stop.clone(),
        max_names: config.max_names,
        next_stream: Arc::new(AtomicU64::new(1)),
    };
    let incoming = tls::incoming(listener, addr, tls, tasks, stop.clone());
    tasks.spawn(async move {
        let res = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .add_service(AggregatedDiscoveryServiceServer::new(ads))
            .serve_with_incoming_shutdown(incoming.into_stream(), stop.cancelled())
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "xDS server failed");
        }
    });
    Ok(XdsServer { addr, nodes })
}
