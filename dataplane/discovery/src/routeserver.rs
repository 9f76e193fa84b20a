//! The sidecar's route-server client: one watch stream for its own baseline.
//!
//! - Nothing is published until the stream's SYNCED: a (re)connection builds the complete rule
//!   set off to the side and swaps it in whole, so routes never vanish during a resync.
//! - Every rule is validated on arrival (`TryFrom` via the shared validator); an invalid one is
//!   logged, counted and dropped — for a REPLACE, the previous version of that rule stays.
//! - Ops that arrive together are applied together and published as one table.
//! - When the stream breaks, the last table stays in force and the client reconnects with
//!   jittered exponential backoff.
//! - In a cluster the connection is TLS, verified against the CA bundle the operator publishes
//!   into the pod's namespace, and authenticated with the pod's projected ServiceAccount token.
//!   Both files are re-read for every connection: the kubelet replaces them as they rotate.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use spur_proto::routes::routes_client::RoutesClient;
use spur_proto::routes::{self, WatchOp, WorkloadRoutingRuleOp};
use spur_routing::{BaselineWorkload, RoutingRule};
use tokio_util::sync::CancellationToken;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Endpoint;

use crate::{Error, Publisher};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The route server to watch, and how to reach it safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteServerConn {
    /// `host:port` or an `http://` URL; the host is also the name the certificate must carry.
    pub addr: String,
    /// CA bundle (PEM) the route server's certificate must chain to. Set: TLS; unset: plaintext.
    pub ca: Option<PathBuf>,
    /// File holding the bearer token to present (a projected ServiceAccount token).
    pub token: Option<PathBuf>,
}

impl RouteServerConn {
    /// Plaintext and no token: for a route server that serves loopback only.
    pub fn plain(addr: impl Into<String>) -> Self {
        RouteServerConn {
            addr: addr.into(),
            ca: None,
            token: None,
        }
    }
}

/// Watches the route server for one baseline's rules and publishes them.
pub struct RouteServerSource {
    addr: String,
    conn: RouteServerConn,
    /// The name verified against the route server's certificate.
    server_name: String,
    endpoint: Endpoint,
    baseline: BaselineWorkload,
    publisher: Publisher,
    connected: Gauge,
    reconnects: Counter,
    rejected: Counter,
}

impl RouteServerSource {
    /// Registers `routeserver_connected`, `routeserver_reconnects_total` and
    /// `routeserver_rules_rejected_total`.
    pub fn new(
        conn: RouteServerConn,
        baseline: BaselineWorkload,
        publisher: Publisher,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        let addr = conn.addr.as_str();
        let invalid = |reason: String| Error::RouteServer {
            addr: addr.to_string(),
            reason,
        };
        let url = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        // TLS is ours (see `session`), so tonic always sees http://.
        let endpoint =
            Endpoint::from_shared(url).map_err(|e| invalid(format!("invalid address: {e}")))?;
        let server_name = endpoint
            .uri()
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
            .ok_or_else(|| invalid("no host in the address".into()))?;
        if endpoint.uri().scheme_str() != Some("http") {
            return Err(invalid(
                "the address is host:port or http://host:port (TLS is on when a CA is given)"
                    .into(),
            ));
        }
        let endpoint = endpoint
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let connected = Gauge::default();
        let reconnects = Counter::default();
        let rejected = Counter::default();
        registry.register(
            "routeserver_connected",
            "1 while a watch stream to the route server is synced",
            connected.clone(),
        );
        registry.register(
            "routeserver_reconnects",
            "Watch streams to the route server that ended or failed",
            reconnects.clone(),
        );
        registry.register(
            "routeserver_rules_rejected",
            "Rules from the route server that failed validation",
            rejected.clone(),
        );
        Ok(RouteServerSource {
            addr: addr.to_string(),
            server_name,
            conn,
            endpoint,
            baseline,
            publisher,
            connected,
            reconnects,
            rejected,
        })
    }

    /// Watches until `stop` is cancelled, reconnecting as needed.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let res = tokio::select! {
                () = stop.cancelled() => return,
                r = self.session(&mut backoff) => r,
            };
            self.connected.set(0);
            self.reconnects.inc();
            match res {
                Ok(()) => {
                    tracing::info!(addr = %self.addr, "route server closed the watch stream; reconnecting")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "route server watch failed; keeping the last table")
                }
            }
            let delay = spur_runtime::jitter(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    fn err(&self, reason: impl std::fmt::Display) -> Error {
        Error::RouteServer {
            addr: self.addr.clone(),
            reason: reason.to_string(),
        }
    }

    /// A TLS client for the CA bundle in `path`, read now.
    fn tls(&self, path: &PathBuf) -> Result<tokio_rustls::TlsConnector, Error> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let pem = std::fs::read(path)
            .map_err(|e| self.err(format!("cannot read the CA bundle {}: {e}", path.display())))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| self.err(format!("CA bundle {}: {e}", path.display())))?;
            roots
                .add(cert)
                .map_err(|e| self.err(format!("CA bundle {}: {e}", path.display())))?;
        }
        if roots.is_empty() {
            return Err(self.err(format!(
                "the CA bundle {} holds no certificate",
                path.display()
            )));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| self.err(e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    /// `Bearer <token>` from the token file, read now.
    fn authorization(&self) -> Result<Option<MetadataValue<Ascii>>, Error> {
        let Some(path) = &self.conn.token else {
            return Ok(None);
        };
        let token = std::fs::read_to_string(path)
            .map_err(|e| self.err(format!("cannot read the token {}: {e}", path.display())))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(self.err(format!("the token file {} is empty", path.display())));
        }
        // Never echo the value: it is a credential.
        MetadataValue::try_from(format!("Bearer {token}"))
            .map(Some)
            .map_err(|_| {
                self.err(format!(
                    "the token in {} has characters a header cannot carry",
                    path.display()
                ))
            })
    }

    async fn channel(&self) -> Result<tonic::transport::Channel, Error> {
        let Some(ca) = &self.conn.ca else {
            return self
                .endpoint
                .connect()
                .await
                .map_err(|e| self.err(tonic_error_chain(&e)));
        };
        let tls = self.tls(ca)?;
        let name = rustls::pki_types::ServerName::try_from(self.server_name.clone())
            .map_err(|e| self.err(format!("{}: {e}", self.server_name)))?;
        let connector = tower::service_fn(move |uri: http::Uri| {
            let tls = tls.clone();
            let name = name.clone();
            async move {
                let host = uri.host().unwrap_or_default();
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let port = uri.port_u16().unwrap_or(80);
                let tcp = tokio::net::TcpStream::connect((host, port)).await?;
                tcp.set_nodelay(true)?;
                let stream = tls.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        });
        self.endpoint
            .connect_with_connector(connector)
            .await
            .map_err(|e| self.err(tonic_error_chain(&e)))
    }

    async fn session(&self, backoff: &mut Duration) -> Result<(), Error> {
        let authorization = self.authorization()?;
        let channel = self.channel().await?;
        let mut client = RoutesClient::new(channel);
        let request = routes::WorkloadRoutingRulesRequest {
            baseline_workload: Some(routes::BaselineWorkload {
                kind: self.baseline.kind.clone(),
                namespace: self.baseline.namespace.clone(),
                name: self.baseline.name.clone(),
            }),
            ..Default::default()
        };
        let mut request = tonic::Request::new(request);
        if let Some(value) = authorization {
            request.metadata_mut().insert("authorization", value);
        }
        let mut stream = client
            .watch_workload_routing_rules(request)
            .await
            .map_err(|s| self.err(s))?
            .into_inner();

        let mut rules: BTreeMap<String, RoutingRule> = BTreeMap::new();
        loop {
            let op = stream.message().await.map_err(|s| self.err(s))?;
            let Some(op) = op else {
                return Err(self.err("stream ended before SYNCED"));
            };
            match op.op() {
                WatchOp::Add => self.apply(&mut rules, &op),
                WatchOp::Synced => break,
                other => {
                    return Err(self.err(format!("protocol violation: {other:?} before SYNCED")));
                }
            }
        }
        self.publish(&rules);
        self.connected.set(1);
        *backoff = BACKOFF_MIN;

        loop {
            let Some(op) = stream.message().await.map_err(|s| self.err(s))? else {
                return Ok(());
            };
            self.apply(&mut rules, &op);
            // Apply everything already received before publishing once.
            while let Some(next) = stream.message().now_or_never() {
                match next.map_err(|s| self.err(s))? {
                    Some(op) => self.apply(&mut rules, &op),
                    None => {
                        self.publish(&rules);
                        return Ok(());
                    }
                }
            }
            self.publish(&rules);
        }
    }

    fn apply(&self, rules: &mut BTreeMap<String, RoutingRule>, op: &WorkloadRoutingRuleOp) {
        let Some(route) = &op.route else {
            if op.op() != WatchOp::Synced {
                self.rejected.inc();
                tracing::warn!(op = ?op.op(), "route server sent an op without a rule; ignored");
            }
            return;
        };
        match op.op() {
            WatchOp::Remove => {
                rules.remove(&route.routing_key);
            }
            WatchOp::Add | WatchOp::Replace => {
                match RoutingRule::from_spec(0, spur_proto::rule_from_proto(route)) {
                    Ok(rule) if rule.baseline == self.baseline => {
                        rules.insert(rule.routing_key.clone(), rule);
                    }
                    Ok(rule) => {
                        self.rejected.inc();
                        tracing::warn!(baseline = %rule.baseline, "route server sent a rule for another baseline; ignored");
                    }
                    Err(e) => {
                        self.rejected.inc();
                        tracing::warn!(error = %e, "invalid rule from the route server ignored");
                    }
                }
            }
            WatchOp::Synced => {}
        }
    }

    fn publish(&self, rules: &BTreeMap<String, RoutingRule>) {
        let version = self.publisher.publish(rules.values().cloned().collect());
        tracing::debug!(
            version,
            rules = rules.len(),
            "routing table published from the route server"
        );
    }
}

/// tonic's transport error says only "transport error"; the cause (a refused certificate, a
/// refused connection) is in its sources.
fn tonic_error_chain(e: &tonic::transport::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
