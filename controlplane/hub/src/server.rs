//! The hub process: the registry, the agents' tunnel listener and (in later modules) the
//! preview front end and the web view, with their TLS identity.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use spur_tunnel::{ServerCert, ServerConfig, ServerTls, TunnelServer};
use tokio_util::sync::CancellationToken;

use tokio_rustls::TlsAcceptor;

use crate::catalog::Catalog;
use crate::clusters::{Clusters, RegistryAuthenticator};
use crate::preview::Preview;
use crate::{Error, Store};

/// Lifetime of the hub's CA, and of the serving certificate it issues at each start.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 86_400);
const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 86_400);

/// Where the hub's TLS certificate comes from.
#[derive(Clone, Debug)]
pub enum TlsSource {
    /// PEM files the user provides (chain, key).
    Files { cert: PathBuf, key: PathBuf },
    /// Issued at start by the hub's own CA for these DNS names and IP addresses.
    OwnCa { names: Vec<String> },
}

/// The hub's settings, validated by [`Hub::start`].
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// UDP address of the agents' QUIC listener; `None` disables QUIC.
    pub tunnel_quic: Option<SocketAddr>,
    /// TCP address of the agents' HTTP/2-over-TLS listener; `None` disables it.
    pub tunnel_h2: Option<SocketAddr>,
    pub tls: TlsSource,
    /// How often the registry is checked for revocations made by other writers (the CLI).
    pub revocation_poll: Duration,
    /// The preview front end, if any.
    pub preview: Option<PreviewSettings>,
}

/// Where previews are served.
#[derive(Clone, Debug)]
pub struct PreviewSettings {
    /// HTTPS listener.
    pub addr: SocketAddr,
    /// Preview hosts are `<endpoint>--<name>[--<cluster>].<domain>`. The hub's own certificate
    /// covers `*.<domain>`.
    pub domain: String,
    /// The web view's host: served on this listener under this name only. It must not share a
    /// site with `domain` ([`crate::preview::check_sites`]).
    pub web_host: String,
    /// What one client may hold of the listener.
    pub limits: crate::listener::ListenerLimits,
    /// How long a target may take to send its response head.
    pub response_timeout: Duration,
    /// Serve endpoints marked `public` without authentication.
    pub allow_public: bool,
    /// The routing-key carriers the clusters' sidecars read besides the standard ones (their
    /// `--routing-header` and `--query-param`): the hub overwrites those headers with the
    /// preview's key and removes that parameter, so a caller cannot name another sandbox's key
    /// in them. Cover every cluster's settings. [`crate::preview::default_carriers`] when unsure.
    /// Each cluster's namespaces' own come through its agent and are added.
    pub carriers: spur_routing::ExtractConfig,
    /// More query parameters removed from every preview request (`--query-param` given more
    /// than once: the clusters' sidecars may read different ones).
    pub more_query_params: Vec<String>,
}

/// A running hub.
pub struct Hub {
    store: Store,
    tunnel: Arc<TunnelServer>,
    clusters: Clusters,
    /// The CA that issued the serving certificate (PEM), when it is the hub's own.
    ca_pem: Option<String>,
    revocation_poll: Duration,
    catalog: Catalog,
    preview: Option<(Arc<Preview>, tokio::net::TcpListener, TlsAcceptor)>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("quic", &self.tunnel.quic_addr())
            .field("h2", &self.tunnel.h2_addr())
            .finish_non_exhaustive()
    }
}

/// The hub's CA from the store, made on first use.
pub fn hub_ca(store: &Store) -> Result<spur_serving::pki::Pair, Error> {
    let (cert, key) = store.ca_or_create(|| {
        let pair =
            spur_serving::pki::new_ca("spur hub CA", CA_LIFETIME, spur_serving::pki::now_unix())
                .map_err(|e| Error::Config(format!("making the hub CA: {e}")))?;
        Ok((pair.cert, pair.key))
    })?;
    Ok(spur_serving::pki::Pair { cert, key })
}

/// The serving certificate chain and key, and the CA PEM when the hub issued it.
pub fn serving_identity(
    store: &Store,
    tls: &TlsSource,
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        PrivateKeyDer<'static>,
        Option<String>,
    ),
    Error,
> {
    let (cert, key, ca) = match tls {
        TlsSource::Files { cert, key } => {
            let read = |p: &PathBuf| {
                std::fs::read(p).map_err(|e| Error::Config(format!("{}: {e}", p.display())))
            };
            (read(cert)?, read(key)?, None)
        }
        TlsSource::OwnCa { names } => {
            if names.is_empty() {
                return Err(Error::Config(
                    "the hub's own CA needs at least one name for its certificate".into(),
                ));
            }
            let ca = hub_ca(store)?;
            let pair = spur_serving::pki::issue_serving(
                &ca,
                &names[0],
                names,
                SERVING_LIFETIME,
                spur_serving::pki::now_unix(),
            )
            .map_err(|e| Error::Config(format!("issuing the hub's certificate: {e}")))?;
            (pair.cert.into_bytes(), pair.key.into_bytes(), Some(ca.cert))
        }
    };
    let chain = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Config(format!("the hub certificate: {e}")))?;
    if chain.is_empty() {
        return Err(Error::Config(
            "the hub certificate file holds no certificate".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&key)
        .map_err(|e| Error::Config(format!("the hub key: {e}")))?;
    Ok((chain, key, ca))
}

impl Hub {
    /// Opens the listeners. Metrics go under `registry`.
    pub async fn start(
        config: HubConfig,
        store: Store,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<Hub, Error> {
        if config.revocation_poll.is_zero() {
            return Err(Error::Config("revocation_poll must be > 0".into()));
        }
        if let Some(p) = &config.preview {
            crate::preview::check_sites(&p.web_host, &p.domain).map_err(Error::Config)?;
            p.limits.validate()?;
        }
        // Validated as the sidecars validate theirs, before anything is bound.
        let carriers = config
            .preview
            .as_ref()
            .map(|p| crate::carriers::Carriers::new(&p.carriers, &p.more_query_params))
            .transpose()
            .map_err(|e| {
                Error::Config(format!(
                    "{e}: the routing-key carriers the clusters' sidecars read \
                     (--routing-header: HTTP header names; --query-param: 1-64 characters of \
                     [A-Za-z0-9._-], or empty for none)"
                ))
            })?;
        let mut tls_source = config.tls.clone();
        if let (TlsSource::OwnCa { names }, Some(p)) = (&mut tls_source, &config.preview) {
            if !names.iter().any(|n| n.eq_ignore_ascii_case(&p.web_host)) {
                names.push(p.web_host.clone());
            }
            names.push(format!("*.{}", p.domain));
        }
        let (chain, key, ca_pem) = serving_identity(&store, &tls_source)?;
        // Keys made before hub users existed see nothing until an admin gives them a user.
        let unbound = store.unbound_api_keys()?;
        if !unbound.is_empty() {
            tracing::warn!(
                keys = %unbound.join(", "),
                "API keys of no hub user are refused; give each one with `spur-hub apikey bind \
                 NAME --user USER` (users: `spur-hub user add`)"
            );
        }
        let metrics = crate::metrics::Metrics::register(registry);
        registry.register(
            "database_errors",
            "Hub calls that failed in its database (unreachable, timed out, a conflict that did not resolve): logins, new agent sessions and registry changes fail with them",
            store.database_errors(),
        );
        let clusters = Clusters::default().with_metrics(metrics.clone());
        let catalog = Catalog::default();
        let preview = match (&config.preview, carriers) {
            (Some(p), Some(carriers)) => {
                let mut server = rustls::ServerConfig::builder()
                    .with_no_client_auth()
                    .with_single_cert(chain.clone(), key.clone_key())
                    .map_err(|e| Error::Config(format!("the preview certificate: {e}")))?;
                server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                let listener = tokio::net::TcpListener::bind(p.addr).await.map_err(|e| {
                    Error::Config(format!("binding the preview address {}: {e}", p.addr))
                })?;
                let preview = Preview {
                    domain: p.domain.trim_end_matches('.').to_ascii_lowercase(),
                    web_host: p
                        .web_host
                        .trim_end_matches('.')
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_ascii_lowercase(),
                    limits: p.limits,
                    catalog: catalog.clone(),
                    clusters: clusters.clone(),
                    store: store.clone(),
                    upstreams: crate::upstream::Upstreams::default(),
                    response_timeout: p.response_timeout,
                    auth_cache: Default::default(),
                    allow_public: p.allow_public,
                    carriers,
                    metrics: metrics.clone(),
                };
                Some((
                    Arc::new(preview),
                    listener,
                    TlsAcceptor::from(Arc::new(server)),
                ))
            }
            _ => None,
        };
        let tls = ServerTls {
            cert: ServerCert::Static { chain, key },
            client_ca: Vec::new(),
            require_client_cert: false,
        };
        let mut tunnel =
            ServerConfig::new(tls, Arc::new(RegistryAuthenticator::new(store.clone())));
        tunnel.quic_addr = config.tunnel_quic;
        tunnel.h2_addr = config.tunnel_h2;
        let tunnel = TunnelServer::bind(tunnel, registry).await?;
        Ok(Hub {
            store,
            tunnel: Arc::new(tunnel),
            clusters,
            ca_pem,
            revocation_poll: config.revocation_poll,
            catalog,
            preview,
        })
    }

    pub fn tunnel_quic_addr(&self) -> Option<SocketAddr> {
        self.tunnel.quic_addr()
    }

    pub fn tunnel_h2_addr(&self) -> Option<SocketAddr> {
        self.tunnel.h2_addr()
    }

    /// The CA agents must trust (PEM), when the hub issued its own certificate.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// The preview listener's address.
    pub fn preview_addr(&self) -> Option<SocketAddr> {
        self.preview
            .as_ref()
            .and_then(|(_, l, _)| l.local_addr().ok())
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub fn clusters(&self) -> &Clusters {
        &self.clusters
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Serves until `stop`, then tells every agent to go away (they reconnect to the next hub)
    /// and waits up to `grace` for open streams.
    pub async fn run(self, stop: CancellationToken, grace: Duration) {
        let drain = spur_runtime::Drain::under(&stop);
        if let Some((preview, listener, tls)) = self.preview {
            // Clients (and their pools) of clusters that left go with them.
            let (upstreams, clusters, token) = (
                preview.upstreams.clone(),
                self.clusters.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut changes = clusters.changes();
                loop {
                    tokio::select! {
                        r = changes.changed() => if r.is_err() { return },
                        () = token.cancelled() => return,
                    }
                    upstreams.retain(|c| clusters.get(c).is_some());
                }
            });
            drain.spawn(preview.serve(listener, tls, drain.clone()));
        }
        let catalog = self.catalog.run(self.clusters.clone(), stop.clone());
        let sessions = self
            .clusters
            .serve(self.tunnel.clone(), self.store.clone(), stop.clone());
        let revocations = self.clusters.enforce_revocations(
            self.store.clone(),
            self.revocation_poll,
            stop.clone(),
        );
        tokio::join!(sessions, revocations, catalog);
        let (left, ()) = tokio::join!(drain.wait(grace), self.tunnel.shutdown(grace));
        if left > 0 {
            tracing::warn!(
                left,
                "preview connections cut at the end of the grace period"
            );
        }
    }
}
