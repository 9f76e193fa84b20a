//! The preview front end: HTTPS (HTTP/1.1 and HTTP/2 by ALPN) for
//! `<endpoint>--<name>[--<cluster>].<preview domain>`. A request is authenticated (API key or the
//! previews' session cookie), its credentials are stripped, the routing key of the sandbox or
//! route group is written into every carrier Spur reads, the configured custom headers and
//! query parameter included (replacing or removing whatever the caller sent, so no caller can
//! reach another sandbox by spoofing a key: `preview/outgoing.rs`), forwarding headers are added, and it
//! goes through the cluster's agent to the endpoint's target. Nothing reaches a cluster before
//! the request is authenticated.
//!
//! The same listener serves the web view, on its own host only (`--web-host`), which the hub
//! refuses to start with unless it lies outside the preview domain's site (see
//! [`check_sites`]): a preview's page runs on its preview host and can never be same-origin, or
//! even same-site, with the web view. There is no path form (`/p/<name>/` on the hub's host):
//! it would run a sandbox's page on the web view's origin. A target's `Set-Cookie` for a hub
//! cookie is dropped.

use spur_api::validation::is_dns_label;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Body as _, Incoming};
use hyper_util::rt::TokioIo;

use crate::Store;
use crate::catalog::{Catalog, ResolveError, Resolved};
use crate::clusters::Clusters;
use crate::store::{Principal, SessionScope};
use crate::users::HubUser;

mod outgoing;
pub use outgoing::{DEFAULT_QUERY_PARAM, default_carriers};
use outgoing::{carriers_for, prepare};

/// Header carrying an API key (besides `Authorization: Bearer`).
pub const API_KEY_HEADER: &str = "x-spur-api-key";
/// The path prefix of the former path form, refused on the web view's host with a pointer to
/// the host form.
const PATH_PREFIX: &str = "/p/";
/// How long opening a stream to a target through an agent may take (the agent answers after
/// its own connect to the target, itself bounded by 5 s by default).
const OPEN_TIMEOUT: Duration = Duration::from_secs(6);
/// How long a credential found valid is trusted without asking the database again: the bound
/// on how late a revoked API key or ended session still works.
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(2);
/// Credentials remembered at most.
const AUTH_CACHE_MAX: usize = 4096;

// A concrete error type: with a boxed trait object here, the connection future's `Send` bound
// runs into a higher-ranked lifetime limitation of the compiler.
pub(crate) type Body = UnsyncBoxBody<Bytes, hyper::Error>;

/// Credentials found valid: (SHA-256, the session scope or None for an API key) → when, and
/// whose.
pub type AuthCache = std::collections::HashMap<
    ([u8; 32], Option<SessionScope>),
    (std::time::Instant, std::sync::Arc<HubUser>),
>;

/// Who a request is.
#[derive(Clone, Debug)]
pub(crate) enum Caller {
    /// A hub user (by an API key or a session of one).
    User(std::sync::Arc<HubUser>),
    /// A valid API key (or its session) that belongs to no hub user yet: refused, saying so.
    Unbound(String),
    /// No valid credential.
    Nobody,
}

/// The label of the preview domain's login host; never a preview (those hold `--`).
pub const LOGIN_LABEL: &str = "login";

/// How a listener bounds what one client can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// How long an HTTP/1 request head may take to arrive, counted from when the connection is
    /// ready for it (so it also ends a kept-alive connection that sends nothing).
    pub header_read_timeout: Duration,
    /// How long a connection may stay with no request in flight (an open response body, such
    /// as the web view's event stream, counts as in flight).
    pub idle_timeout: Duration,
    /// Connections one peer address may hold at once.
    pub max_per_peer: usize,
    /// Connections the listener holds at once.
    pub max_total: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_per_peer: 128,
            max_total: 10_000,
        }
    }
}

impl ListenerLimits {
    pub fn validate(&self) -> Result<(), crate::Error> {
        let zero = [
            ("handshake timeout", self.handshake_timeout.is_zero()),
            ("header read timeout", self.header_read_timeout.is_zero()),
            ("idle timeout", self.idle_timeout.is_zero()),
            ("connections per peer", self.max_per_peer == 0),
            ("connections", self.max_total == 0),
        ];
        match zero.iter().find(|(_, z)| *z) {
            Some((what, _)) => Err(crate::Error::Config(format!(
                "the listener's {what} must be above zero"
            ))),
            None => Ok(()),
        }
    }
}

/// The preview front end's shared state.
pub struct Preview {
    /// `preview.example.com`: hosts `<label>.<domain>` are previews.
    pub domain: String,
    /// The web view's host name (lowercase, no port).
    pub web_host: String,
    /// What one client may hold of the listener.
    pub limits: ListenerLimits,
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
    /// The key carriers the clusters' sidecars read besides the standard ones: each is
    /// overwritten with (custom headers) or removed from (the query parameter) every request.
    pub carriers: crate::carriers::Carriers,
    pub metrics: crate::metrics::Metrics,
    /// Credentials found valid, by SHA-256, and when.
    pub auth_cache: std::sync::Mutex<AuthCache>,
}

impl std::fmt::Debug for Preview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preview")
            .field("domain", &self.domain)
            .field("web_host", &self.web_host)
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
        let endpoint = parts.next().filter(|s| is_dns_label(s))?;
        let owner = parts.next().filter(|s| is_dns_label(s))?;
        let cluster = match parts.next() {
            Some(c) if is_dns_label(c) => Some(c),
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

pub use spur_api::sandbox::preview_url;

/// Refuses a web view host and preview domain that could share a site (so a preview could send
/// the web view same-site requests or set cookies it reads): the same name, one inside the
/// other, or the same last two labels (`hub.example.com` and `preview.example.com` share
/// `example.com`). Without a public-suffix list this is stricter than browsers under suffixes
/// of two labels (`a.example.co.uk` and `b.other.co.uk` are refused though they are separate
/// sites): pick names whose last two labels differ, e.g. `hub.example.com` and
/// `example-preview.net`.
pub fn check_sites(web_host: &str, preview_domain: &str) -> Result<(), String> {
    let norm = |s: &str| s.trim().trim_end_matches('.').to_ascii_lowercase();
    let (web, preview) = (norm(web_host), norm(preview_domain));
    if preview.is_empty() || preview.parse::<std::net::IpAddr>().is_ok() {
        return Err(format!(
            "the preview domain {preview_domain:?} must be a DNS name (previews are \
             <endpoint>--<name>.<domain>)"
        ));
    }
    let web_ip = web
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok();
    if web.is_empty() {
        return Err("the web view's host name is empty (--web-host)".into());
    }
    if web_ip {
        // An address shares no cookies or site with a DNS name.
        return Ok(());
    }
    let inside = |a: &str, b: &str| a == b || a.ends_with(&format!(".{b}"));
    let last_two = |s: &str| {
        let labels: Vec<&str> = s.rsplitn(3, '.').take(2).collect();
        (labels.len() == 2).then(|| format!("{}.{}", labels[1], labels[0]))
    };
    let shared = match (last_two(&web), last_two(&preview)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    };
    if inside(&web, &preview) || inside(&preview, &web) || shared {
        return Err(format!(
            "the web view's host {web:?} and the preview domain {preview:?} may share a site: a \
             preview's page could then send the web view requests with its cookies. Use a \
             preview domain under another registrable domain (e.g. hub.example.com and \
             example-preview.net); --web-host and --preview-domain"
        ));
    }
    Ok(())
}

impl Preview {
    pub(crate) async fn handle(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        if let Err(why) = spur_serving::http1::check_host(&req) {
            return text(StatusCode::BAD_REQUEST, why);
        }
        let authority = request_host(&req).unwrap_or_default().to_ascii_lowercase();
        let host = strip_port(&authority);
        // A preview host, the previews' login host, the web view's host; nothing else.
        let label = match host
            .strip_suffix(self.domain.as_str())
            .and_then(|h| h.strip_suffix('.'))
        {
            Some(LOGIN_LABEL) => {
                return self.preview_login(req, &authority).await;
            }
            Some(label) if !label.contains('.') => label.to_owned(),
            _ if host == self.web_host => {
                if req.uri().path().starts_with(PATH_PREFIX) {
                    return text(
                        StatusCode::NOT_FOUND,
                        &format!(
                            "previews are served only on their own hosts, \
                             https://<endpoint>--<name>[--<cluster>].{}/, never on the web view's\n",
                            self.domain
                        ),
                    );
                }
                return self.web(req, &authority).await;
            }
            _ => {
                return text(
                    StatusCode::MISDIRECTED_REQUEST,
                    &format!(
                        "this hub serves its web view at https://{}/ and previews at \
                         https://<endpoint>--<name>[--<cluster>].{}/\n",
                        self.web_host, self.domain
                    ),
                );
            }
        };
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
        let resolved = if public {
            resolved
        } else {
            match self
                .authenticate(req.headers(), SessionScope::Preview)
                .await
            {
                // Only what the user may see: another namespace's or cluster's sandbox is
                // unknown to it, and nothing is asked of any agent.
                Ok(Caller::User(user)) => {
                    self.catalog
                        .resolve_for(name.cluster, name.owner, name.endpoint, |c, ns| {
                            user.sees(c, ns)
                        })
                }
                Ok(Caller::Unbound(key)) => {
                    return text(
                        StatusCode::FORBIDDEN,
                        &format!("{}\n", Principal::unbound_message(&key)),
                    );
                }
                Ok(Caller::Nobody) if wants_html(req.headers()) => {
                    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    return self.login_required(&authority, &format!("https://{authority}{pq}"));
                }
                Ok(Caller::Nobody) => {
                    let mut r = text(
                        StatusCode::UNAUTHORIZED,
                        "an API key is required: `x-spur-api-key: <key>` or `Authorization: Bearer <key>` (spur-hub apikey add)\n",
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
        };
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
        let Some(carriers) = carriers_for(&self.carriers, &resolved) else {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "the hub has not read this cluster's namespaces yet (their routing-key carriers); \
                 the request was not sent. If this lasts, the cluster's agent may be older than \
                 the hub or lack the right to list namespaces\n",
            );
        };
        if let Err(why) = prepare(&mut req, &resolved, &carriers, host, peer) {
            // A key in the catalog that is no valid key (so it cannot be written), or a path
            // that cannot be rebuilt: never send a request that might still carry the caller's.
            tracing::warn!(cluster = %resolved.cluster, owner = name.owner, "preview not sent: {why}");
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "this preview's routing key cannot be written into the request; the request was not sent\n",
            );
        }
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

    /// Who the request is: by a session cookie of `scope`, else an API key.
    pub(crate) async fn authenticate(
        &self,
        headers: &http::HeaderMap,
        scope: SessionScope,
    ) -> Result<Caller, crate::Error> {
        let name = match scope {
            SessionScope::Web => crate::browser::WEB_COOKIE,
            SessionScope::Preview => crate::browser::PREVIEW_COOKIE,
        };
        if let Some(token) = crate::browser::cookie(headers, name) {
            match self.caller(token, Some(scope)).await? {
                Caller::Nobody => {}
                found => return Ok(found),
            }
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
            Some(key) => self.caller(key, None).await,
            None => Ok(Caller::Nobody),
        }
    }

    /// Who an API key (or, with a scope, a session token of one) is. A hub user found is
    /// remembered for [`AUTH_CACHE_TTL`], so a revocation or a change of the user's scope takes
    /// effect within that time and the database is not read on every request; other answers
    /// are never cached.
    async fn caller(
        &self,
        secret: &str,
        session: Option<SessionScope>,
    ) -> Result<Caller, crate::Error> {
        let hash = crate::store::sha256(secret);
        let now = std::time::Instant::now();
        {
            let cache = self.auth_cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, user)) = cache.get(&(hash, session))
                && now.duration_since(*at) < AUTH_CACHE_TTL
            {
                return Ok(Caller::User(user.clone()));
            }
        }
        let (store, secret) = (self.store.clone(), secret.to_owned());
        let found = tokio::task::spawn_blocking(move || match session {
            Some(scope) => store.principal_for_session(&secret, scope),
            None => store.principal_for_key(&secret),
        })
        .await
        .map_err(|e| crate::Error::Db(e.to_string()))??;
        let user = match found {
            None => return Ok(Caller::Nobody),
            Some(Principal { key, user: None }) => return Ok(Caller::Unbound(key)),
            Some(Principal {
                user: Some(user), ..
            }) => std::sync::Arc::new(user),
        };
        let mut cache = self.auth_cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= AUTH_CACHE_MAX {
            cache.retain(|_, (at, _)| now.duration_since(*at) < AUTH_CACHE_TTL);
            if cache.len() >= AUTH_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert((hash, session), (now, user.clone()));
        Ok(Caller::User(user))
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
        // A safe request without a body can be sent again: kept for that (below).
        let again = (upgrade.is_none()
            && matches!(
                *req.method(),
                http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
            )
            && req.body().is_end_stream())
        .then(|| {
            let mut copy = Request::new(());
            *copy.method_mut() = req.method().clone();
            *copy.uri_mut() = req.uri().clone();
            *copy.version_mut() = req.version();
            *copy.headers_mut() = req.headers().clone();
            copy
        });
        let started = std::time::Instant::now();
        let send = async {
            match client.request(req.map(BodyExt::boxed_unsync)).await {
                // A pooled connection through an agent replica that is going away (its stream
                // ended as the request went out) failed; our own open errors (every session
                // of the cluster tried) are not retried. A safe, bodiless request is sent
                // once more, on another connection, as RFC 9110 9.2.2 allows, so an agent's
                // restart or loss does not fail viewers' page loads.
                Err(e) if crate::upstream::hub_error(&e).is_none() => match again {
                    Some(copy) => {
                        tracing::debug!(
                            "preview request failed on its connection ({e}); sent again"
                        );
                        self.metrics.retried();
                        let empty = http_body_util::Empty::new()
                            .map_err(|never| match never {})
                            .boxed_unsync();
                        client.request(copy.map(|()| empty)).await
                    }
                    None => Err(e),
                },
                other => other,
            }
        };
        let resp = tokio::time::timeout(self.response_timeout, send)
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
        without_hub_set_cookie(resp.headers_mut());
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

/// A browser navigating (it would rather see a login form than a bare 401).
fn wants_html(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// Whether `name` is one of the hub's own cookies (browsers compare the `__Host-` prefix without
/// regard to case, so the whole name is compared so).
fn is_hub_cookie(name: &str) -> bool {
    crate::browser::HUB_COOKIES
        .iter()
        .any(|c| c.eq_ignore_ascii_case(name.trim()))
}

/// A target's response without its `Set-Cookie` for any of the hub's cookies: an app must not
/// replace a viewer's session with another (its own key's, say).
fn without_hub_set_cookie(headers: &mut http::HeaderMap) {
    let all: Vec<HeaderValue> = headers
        .get_all(header::SET_COOKIE)
        .iter()
        .cloned()
        .collect();
    if all.is_empty() {
        return;
    }
    headers.remove(header::SET_COOKIE);
    for v in all {
        let name = v
            .to_str()
            .ok()
            .map(|s| s.split(';').next().unwrap_or_default())
            .map(|kv| kv.split_once('=').map_or(kv, |(k, _)| k));
        // A value that is not text cannot be checked, so it goes too.
        if name.is_some_and(|n| !is_hub_cookie(n)) {
            headers.append(header::SET_COOKIE, v);
        }
    }
}

/// The `Cookie` header without the hub's session cookies (the app never sees them).
fn without_hub_cookie(headers: &mut http::HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|kv| !kv.is_empty() && kv.split_once('=').is_none_or(|(k, _)| !is_hub_cookie(k)))
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if !kept.is_empty()
        && let Ok(v) = HeaderValue::try_from(kept.join("; "))
    {
        headers.insert(header::COOKIE, v);
    }
}

/// `host` of `host[:port]` (an IPv6 literal without its brackets).
fn strip_port(authority: &str) -> &str {
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) && !h.ends_with(':') => h,
        _ => authority,
    };
    host.trim_start_matches('[').trim_end_matches(']')
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

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::copy_from_slice(body.as_bytes()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    crate::browser::hub_headers(r.headers_mut());
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
}
