//! The preview front end: HTTPS (HTTP/1.1 and HTTP/2 by ALPN) for
//! `<endpoint>--<name>[--<cluster>].<preview domain>`, and the path form
//! `/p/<endpoint>--<name>[--<cluster>]/...` on any host for set-ups without wildcard DNS. A request
//! is authenticated (API key), its credentials are stripped, the routing key of the sandbox or
//! route group is written into every carrier Spur reads (replacing whatever the caller sent, so
//! no caller can reach another sandbox by spoofing a key), forwarding headers are added, and it
//! goes through the cluster's agent to the endpoint's target. Nothing reaches a cluster before
//! the request is authenticated.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use spur_runtime::Drain;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::Store;
use crate::catalog::{Catalog, ResolveError, Resolved};
use crate::clusters::Clusters;

/// Header carrying an API key (besides `Authorization: Bearer`).
pub const API_KEY_HEADER: &str = "x-spur-api-key";
/// Path prefix of the path form.
pub const PATH_PREFIX: &str = "/p/";
/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long opening a stream to a target through an agent may take (the agent answers after
/// its own connect to the target, itself bounded by 5 s by default).
const OPEN_TIMEOUT: Duration = Duration::from_secs(6);
/// How long a credential found valid is trusted without asking the database again: the bound
/// on how late a revoked API key or ended session still works.
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(2);
/// Credentials remembered at most.
const AUTH_CACHE_MAX: usize = 4096;
/// Largest HTTP/1 request head followed by the framing guard.
const MAX_HEAD: usize = 64 * 1024;

// A concrete error type: with a boxed trait object here, the connection future's `Send` bound
// runs into a higher-ranked lifetime limitation of the compiler.
pub(crate) type Body = UnsyncBoxBody<Bytes, hyper::Error>;

/// The preview front end's shared state.
pub struct Preview {
    /// `preview.example.com`: hosts `<label>.<domain>` are previews.
    pub domain: String,
    pub catalog: Catalog,
    pub clusters: Clusters,
    pub store: Store,
    /// Pooled connections to targets, per cluster.
    pub upstreams: crate::upstream::Upstreams,
    /// How long a target may take to send its response head (a 504 after that). A stalled
    /// agent is also noticed by the tunnel's keepalive (20 s), which fails every stream.
    pub response_timeout: Duration,
    /// Serve endpoints marked `public` without authentication.
    pub allow_public: bool,
    pub metrics: crate::metrics::Metrics,
    /// Credentials found valid, by SHA-256, and when.
    pub auth_cache:
        std::sync::Mutex<std::collections::HashMap<([u8; 32], bool), std::time::Instant>>,
}

impl std::fmt::Debug for Preview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preview")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

/// A preview name: `<endpoint>--<name>` or `<endpoint>--<name>--<cluster>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreviewName<'a> {
    pub endpoint: &'a str,
    pub owner: &'a str,
    pub cluster: Option<&'a str>,
}

impl<'a> PreviewName<'a> {
    pub fn parse(label: &'a str) -> Option<Self> {
        let mut parts = label.split("--");
        let endpoint = parts.next().filter(|s| is_label(s))?;
        let owner = parts.next().filter(|s| is_label(s))?;
        let cluster = match parts.next() {
            Some(c) if is_label(c) => Some(c),
            Some(_) => return None,
            None => None,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(PreviewName {
            endpoint,
            owner,
            cluster,
        })
    }
}

fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

pub use spur_api::sandbox::preview_url;

impl Preview {
    /// Accepts TLS connections on `listener` until the drain starts.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, tls: TlsAcceptor, drain: Drain) {
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: back off rather than spin.
                        tracing::warn!("preview listener: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = drain.signaled() => return,
            };
            let _ = tcp.set_nodelay(true);
            let this = self.clone();
            let tls = tls.clone();
            let conn_drain = drain.clone();
            drain.spawn(serve_conn(this, tcp, peer, tls, conn_drain));
        }
    }

    async fn handle(&self, mut req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        if let Err(why) = spur_proxy::check_host(&req) {
            return text(StatusCode::BAD_REQUEST, why);
        }
        let host = request_host(&req).unwrap_or_default();
        let host = host.rsplit_once(':').map_or(host.as_str(), |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host.as_str()
            }
        });
        let host = host.to_ascii_lowercase();
        // Host form, else path form; anything else is not a preview.
        let (label, strip) = match host
            .strip_suffix(self.domain.as_str())
            .and_then(|h| h.strip_suffix('.'))
        {
            Some(label) if !label.contains('.') => (label.to_owned(), None),
            _ => match req.uri().path().strip_prefix(PATH_PREFIX) {
                Some(rest) => {
                    let label = rest.split('/').next().unwrap_or_default().to_owned();
                    let strip = PATH_PREFIX.len() + label.len();
                    (label, Some(strip))
                }
                // The hub's own pages.
                None => return self.web(req, &host).await,
            },
        };
        if strip.is_none() && req.uri().path() == "/.spur/login" {
            return match self.login_routes(req, &host).await {
                Ok(resp) => resp,
                Err(_) => text(StatusCode::NOT_FOUND, "not found\n"),
            };
        }
        let Some(name) = PreviewName::parse(&label) else {
            return text(
                StatusCode::BAD_REQUEST,
                "a preview name is <endpoint>--<sandbox or route group>[--<cluster>]\n",
            );
        };
        let resolved = self
            .catalog
            .resolve(name.cluster, name.owner, name.endpoint);
        // Authentication comes before anything about the cluster is revealed or touched, unless
        // the endpoint opted in to public access and the hub allows that.
        let public = self.allow_public && resolved.as_ref().is_ok_and(|r| r.public);
        if !public {
            match self.authenticate(req.headers()).await {
                Ok(true) => {}
                Ok(false) if wants_html(req.headers()) => return self.login_required(),
                Ok(false) => {
                    let mut r = text(
                        StatusCode::UNAUTHORIZED,
                        "an API key is required: `x-spur-api-key: <key>` or `Authorization: Bearer <key>` (spur hub apikey add)\n",
                    );
                    r.headers_mut().insert(
                        header::WWW_AUTHENTICATE,
                        HeaderValue::from_static("Bearer realm=\"spur hub\""),
                    );
                    return r;
                }
                Err(e) => {
                    tracing::warn!("API key check: {e}");
                    return text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "cannot check credentials now\n",
                    );
                }
            }
        }
        let resolved = match resolved {
            Ok(r) => r,
            Err(e @ ResolveError::NoKey(_)) => {
                return text(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n"));
            }
            Err(e @ ResolveError::Ambiguous(_)) => {
                return text(StatusCode::CONFLICT, &format!("{e}\n"));
            }
            Err(e) => return text(StatusCode::NOT_FOUND, &format!("{e}\n")),
        };
        if let Some(strip) = strip {
            let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
            let rest = pq.get(strip..).unwrap_or_default();
            let rest = if rest.starts_with('/') {
                rest.to_owned()
            } else {
                format!("/{rest}")
            };
            match rest.parse() {
                Ok(uri) => *req.uri_mut() = uri,
                Err(_) => return text(StatusCode::BAD_REQUEST, "malformed path\n"),
            }
        }
        prepare(&mut req, &resolved, &host, peer);
        match self.forward(req, &resolved).await {
            Ok(resp) => resp,
            Err(e) => {
                tracing::debug!(cluster = %resolved.cluster, target = %resolved.host, "preview: {e}");
                // The cluster or its agent cannot be reached: 503; the target failed: 502.
                let status = match e {
                    crate::Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
                    crate::Error::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
                    _ => StatusCode::BAD_GATEWAY,
                };
                text(status, &format!("{e}\n"))
            }
        }
    }

    /// Whether the request carries a valid API key or session cookie.
    pub(crate) async fn authenticate(
        &self,
        headers: &http::HeaderMap,
    ) -> Result<bool, crate::Error> {
        if let Some(token) = crate::web::cookie(headers, crate::web::COOKIE)
            && self.credential_valid(token, true).await?
        {
            return Ok(true);
        }
        let key = headers
            .get(API_KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .or_else(|| {
                headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
            })
            .map(str::trim);
        match key {
            Some(key) => self.credential_valid(key, false).await,
            None => Ok(false),
        }
    }

    /// Whether an API key (or, with `session`, a session token) is valid. A valid answer is
    /// remembered for [`AUTH_CACHE_TTL`], so a revocation takes effect within that time and the
    /// database is not read on every request; invalid answers are never cached.
    async fn credential_valid(&self, secret: &str, session: bool) -> Result<bool, crate::Error> {
        let hash = crate::store::sha256(secret);
        let now = std::time::Instant::now();
        {
            let cache = self.auth_cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache
                .get(&(hash, session))
                .is_some_and(|at| now.duration_since(*at) < AUTH_CACHE_TTL)
            {
                return Ok(true);
            }
        }
        let (store, secret) = (self.store.clone(), secret.to_owned());
        let valid = tokio::task::spawn_blocking(move || {
            if session {
                store.session_key(&secret)
            } else {
                store.api_key_name(&secret)
            }
        })
        .await
        .map_err(|e| crate::Error::Db(e.to_string()))??
        .is_some();
        if valid {
            let mut cache = self.auth_cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= AUTH_CACHE_MAX {
                cache.retain(|_, at| now.duration_since(*at) < AUTH_CACHE_TTL);
                if cache.len() >= AUTH_CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert((hash, session), now);
        }
        Ok(valid)
    }

    async fn forward(
        &self,
        mut req: Request<Incoming>,
        to: &Resolved,
    ) -> Result<Response<Body>, crate::Error> {
        let upgrade = req
            .headers()
            .get(header::UPGRADE)
            .is_some()
            .then(|| hyper::upgrade::on(&mut req));
        // The pooling client wants an absolute URI; the target's name picks the pool.
        let pq = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        *req.uri_mut() = format!("http://{}:{}{pq}", to.host, to.port)
            .parse()
            .map_err(|e| crate::Error::Invalid(format!("target URI: {e}")))?;
        let h2 = to.scheme == "grpc";
        *req.version_mut() = if h2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        let client = self
            .upstreams
            .client(&self.clusters, &to.cluster, h2, OPEN_TIMEOUT);
        let started = std::time::Instant::now();
        let resp = tokio::time::timeout(self.response_timeout, client.request(req))
            .await
            .map_err(|_| {
                crate::Error::Timeout(format!(
                    "the target sent no response within {:?}",
                    self.response_timeout
                ))
            })?
            .map_err(|e| match crate::upstream::hub_error(&e) {
                Some(crate::Error::Unavailable(m)) => crate::Error::Unavailable(m.clone()),
                Some(other) => crate::Error::Upstream(other.to_string()),
                None => crate::Error::Upstream(format!("the target: {e}")),
            })?;
        self.metrics.upstream(started.elapsed().as_secs_f64());
        let mut resp = resp;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = upgrade
        {
            let target_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(client), Ok(target)) = (client_upgrade.await, target_upgrade.await) {
                    let _ = tokio::io::copy_bidirectional(
                        &mut TokioIo::new(client),
                        &mut TokioIo::new(target),
                    )
                    .await;
                }
            });
        }
        Ok(resp.map(BodyExt::boxed_unsync))
    }
}

async fn serve_conn(
    this: Arc<Preview>,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: TlsAcceptor,
    drain: Drain,
) {
    let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await else {
        return;
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let service = hyper::service::service_fn(move |req| {
        let this = this.clone();
        let fut: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
            let resp = this.handle(req, peer).await;
            this.metrics.preview(resp.status().as_u16());
            Ok::<_, std::convert::Infallible>(resp)
        });
        fut
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // hyper's connection futures are Send, but the drain's generic helper (a closure over a
    // pinned borrow) trips a higher-ranked lifetime limitation here: the same select, inline.
    macro_rules! drive {
        ($conn:expr) => {{
            let mut conn = std::pin::pin!($conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = drain.signaled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        }};
    }
    if h2 {
        drive!(
            builder
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .into_owned()
        );
    } else {
        let io = TokioIo::new(spur_proxy::Http1Guard::new(tls, MAX_HEAD));
        drive!(
            builder
                .serve_connection_with_upgrades(io, service)
                .into_owned()
        );
    }
}

/// A browser navigating (it would rather see a login form than a bare 401).
fn wants_html(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// The `Cookie` header without the hub's session cookie (the app never sees it).
fn without_hub_cookie(headers: &mut http::HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|kv| {
            !kv.is_empty()
                && kv
                    .split_once('=')
                    .is_none_or(|(k, _)| k != crate::web::COOKIE)
        })
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if !kept.is_empty()
        && let Ok(v) = HeaderValue::try_from(kept.join("; "))
    {
        headers.insert(header::COOKIE, v);
    }
}

fn request_host<B>(req: &Request<B>) -> Option<String> {
    req.uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        })
}

/// Strips the caller's credentials and routing keys, writes the resolved key into every
/// carrier, and adds forwarding headers.
fn prepare<B>(req: &mut Request<B>, to: &Resolved, host: &str, peer: SocketAddr) {
    let h = req.headers_mut();
    h.remove(API_KEY_HEADER);
    let bearer_is_ours = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.starts_with("Bearer ") && v[7..].trim().starts_with(crate::store::API_KEY_PREFIX)
        });
    if bearer_is_ours {
        h.remove(header::AUTHORIZATION);
    }
    without_hub_cookie(h);
    // Hop-by-hop headers of the client's connection are not the target's business (an upgrade
    // is re-requested by hyper from the upgrade extension; keep Upgrade and Connection for it).
    h.remove("proxy-connection");
    h.remove(header::TE);
    spur_routing::inject::inject_key(h, &to.routing_key, &[]);
    let peer_ip = peer.ip().to_string();
    let xff = match h.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {peer_ip}"),
        None => peer_ip.clone(),
    };
    if let Ok(v) = HeaderValue::try_from(xff) {
        h.insert(HeaderName::from_static("x-forwarded-for"), v);
    }
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("https"),
    );
    if let Ok(v) = HeaderValue::try_from(host) {
        h.insert(HeaderName::from_static("x-forwarded-host"), v);
    }
    // The target sees its own name as Host, as it would from a client in the cluster.
    let target_host = if to.port == 80 || to.port == 443 {
        to.host.clone()
    } else {
        format!("{}:{}", to.host, to.port)
    };
    if let Ok(v) = HeaderValue::try_from(target_host) {
        h.insert(header::HOST, v);
    }
    // Origin-form for the target (HTTP/2 clients send an absolute URI).
    if let Some(pq) = req.uri().path_and_query().cloned()
        && let Ok(uri) = http::Uri::try_from(pq.as_str())
    {
        *req.uri_mut() = uri;
    }
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::copy_from_slice(body.as_bytes()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let n = PreviewName::parse("web--feature-x").unwrap();
        assert_eq!((n.endpoint, n.owner, n.cluster), ("web", "feature-x", None));
        let n = PreviewName::parse("web--feature-x--east").unwrap();
        assert_eq!(n.cluster, Some("east"));
        for bad in [
            "web",
            "web--",
            "--x",
            "a--b--c--d",
            "A--b",
            "a---b",
            "a--b.c",
            "",
        ] {
            assert_eq!(PreviewName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn prepare_replaces_keys_and_strips_credentials() {
        let mut req = Request::get("https://web--sb.preview.test/x?y=1")
            .header(API_KEY_HEADER, "spurk_secret")
            .header("authorization", "Bearer spurk_secret")
            .header("baggage", "sd-routing-key=other,user=1")
            .header("uberctx-sd-routing-key", "other")
            .header("ot-baggage-sd-routing-key", "other")
            .header("tracestate", "sd-routing-key=other")
            .body(())
            .unwrap();
        let to = Resolved {
            cluster: "c".into(),
            public: false,
            routing_key: "key123".into(),
            scheme: "http".into(),
            host: "web.shop.svc".into(),
            port: 8080,
        };
        prepare(
            &mut req,
            &to,
            "web--sb.preview.test",
            "192.0.2.1:5000".parse().unwrap(),
        );
        let h = req.headers();
        assert!(h.get(API_KEY_HEADER).is_none() && h.get("authorization").is_none());
        let baggage = h.get("baggage").unwrap().to_str().unwrap();
        assert!(
            baggage.contains("sd-routing-key=key123") && !baggage.contains("other"),
            "{baggage}"
        );
        assert!(baggage.contains("user=1"));
        assert_eq!(h.get("uberctx-sd-routing-key").unwrap(), "key123");
        assert_eq!(h.get("ot-baggage-sd-routing-key").unwrap(), "key123");
        assert!(
            !h.get("tracestate")
                .unwrap()
                .to_str()
                .unwrap()
                .contains("other")
        );
        assert_eq!(h.get("host").unwrap(), "web.shop.svc:8080");
        assert_eq!(h.get("x-forwarded-for").unwrap(), "192.0.2.1");
        assert_eq!(req.uri(), "/x?y=1");
        let mut req = Request::get("/")
            .header("cookie", "a=1; spur_hub=spurs_secret; b=2")
            .body(())
            .unwrap();
        prepare(&mut req, &to, "h", "192.0.2.1:1".parse().unwrap());
        assert_eq!(req.headers().get("cookie").unwrap(), "a=1; b=2");
        let mut req = Request::get("/")
            .header("cookie", "spur_hub=spurs_x")
            .body(())
            .unwrap();
        prepare(&mut req, &to, "h", "192.0.2.1:1".parse().unwrap());
        assert!(req.headers().get("cookie").is_none());
        // Someone else's bearer token (not a hub key) is the app's business and stays.
        let mut req = Request::get("/")
            .header("authorization", "Bearer app-token")
            .body(())
            .unwrap();
        prepare(&mut req, &to, "h", "192.0.2.1:1".parse().unwrap());
        assert_eq!(
            req.headers().get("authorization").unwrap(),
            "Bearer app-token"
        );
    }
}
