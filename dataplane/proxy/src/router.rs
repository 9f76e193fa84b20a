//! Per-request routing decisions. [`Router`] is the seam between the proxy mechanics and the
//! component built on them; [`KeyRouter`] is the sidecar's: routing keys → rule table.

use std::sync::Arc;

use http::{HeaderName, HeaderValue, Uri};
use spur_routing::extract::strip_query_param;
use spur_routing::inject::inject_key;
use spur_routing::{BaselineWorkload, Destination, ExtractConfig, KeyExtractor, SharedTable};

use crate::Error;
use crate::listener::ConnMeta;

/// Marks a request a sidecar has already sent to a sandbox; its value names the baseline whose
/// sidecar did it. If a misconfigured destination points back at the same sidecar, the request
/// arrives carrying its own mark and goes to the application instead of looping.
pub const ROUTED_HEADER: HeaderName = HeaderName::from_static("x-spur-routed");

/// Where one request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The connection's original destination (in a sidecar: the baseline application).
    Original,
    /// A destination from the routing table.
    Destination(Arc<Destination>),
}

/// Decides where each HTTP request goes. Runs on the request path: it must not block and should
/// not allocate more than it has to.
pub trait Router: Send + Sync + 'static {
    /// May rewrite the request head (e.g. move a routing query parameter into headers).
    fn route_http(&self, conn: &ConnMeta, req: &mut http::request::Parts) -> Route;
}

/// Configuration of the sidecar's router.
#[derive(Debug, Clone)]
pub struct KeyRouterConfig {
    /// The workload this sidecar fronts: only its rules apply.
    pub baseline: BaselineWorkload,
    pub extract: ExtractConfig,
}

/// Routes by routing key: candidates from the request (precedence documented in
/// `docs/routing-keys.md`) are looked up for (baseline, original destination port); the first
/// with a rule wins, anything else goes to the original destination.
pub struct KeyRouter {
    baseline: BaselineWorkload,
    mark: HeaderValue,
    extractor: KeyExtractor,
    table: SharedTable,
}

impl KeyRouter {
    pub fn new(config: KeyRouterConfig, table: SharedTable) -> Result<Self, Error> {
        let extractor = KeyExtractor::new(&config.extract)?;
        let mark = HeaderValue::from_str(&config.baseline.to_string()).map_err(|_| {
            Error::Config(format!(
                "baseline {} is not a valid header value",
                config.baseline
            ))
        })?;
        Ok(KeyRouter {
            baseline: config.baseline,
            mark,
            extractor,
            table,
        })
    }

    /// Moves `?<param>=<key>` out of the URL and into the standard key headers, so the
    /// application never sees the parameter and downstream hops can propagate the key.
    fn lift_query_param(&self, req: &mut http::request::Parts) {
        let Some(name) = self.extractor.query_param() else {
            return;
        };
        let Some(pq) = req.uri.path_and_query() else {
            return;
        };
        if pq.query().is_none() {
            return;
        }
        let Some((key, stripped)) = strip_query_param(pq.as_str(), name) else {
            return;
        };
        let mut parts = req.uri.clone().into_parts();
        match stripped.parse() {
            Ok(pq) => parts.path_and_query = Some(pq),
            Err(_) => return,
        }
        if let Ok(uri) = Uri::from_parts(parts) {
            req.uri = uri;
            inject_key(&mut req.headers, &key, self.extractor.custom_headers());
        }
    }
}

impl Router for KeyRouter {
    fn route_http(&self, conn: &ConnMeta, req: &mut http::request::Parts) -> Route {
        if req
            .headers
            .get_all(ROUTED_HEADER)
            .iter()
            .any(|v| v == self.mark)
        {
            return Route::Original;
        }
        self.lift_query_param(req);
        let destination = {
            let candidates = self.extractor.extract(&req.headers, req.uri.query());
            if candidates.is_empty() {
                return Route::Original;
            }
            let snapshot = self.table.load();
            let Some(rules) = snapshot.table.baseline(&self.baseline) else {
                return Route::Original;
            };
            match rules.route(conn.original_dst.port(), candidates.iter()) {
                Some(d) => d.clone(),
                None => return Route::Original,
            }
        };
        req.headers.insert(ROUTED_HEADER, self.mark.clone());
        Route::Destination(destination)
    }
}
