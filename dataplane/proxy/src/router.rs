//! Per-request routing decisions. [`Router`] is the seam between the proxy mechanics and the
//! component built on them (the sidecar's key router lives in `spur-sidecar`).

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use spur_routing::Destination;

use crate::capture::CaptureTag;
use crate::conn::ConnMeta;

/// Where one request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The connection's original destination (in a sidecar: the baseline application).
    Original,
    /// A destination from the routing table.
    Destination(Arc<Destination>),
}

/// A routing decision of [`Router::route_raw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRoute {
    pub route: Route,
    /// A header the forwarded request must carry with exactly this value (any the client sent
    /// under that name are dropped).
    pub set: Option<(HeaderName, HeaderValue)>,
}

/// Decides where each HTTP request goes. Runs on the request path: it must not block and should
/// not allocate more than it has to.
pub trait Router: Send + Sync + 'static {
    /// May rewrite the request head (e.g. move a routing query parameter into headers).
    fn route_http(&self, conn: &ConnMeta, req: &mut http::request::Parts) -> Route;

    /// [`Router::route_http`], and whether the exchange is captured (and under which sandbox).
    /// The proxy calls it instead of `route_http` only when it has a capture sink. A router that
    /// captures must also make [`Router::route_raw`] decline every request it would capture, so
    /// the HTTP/1 relay hands those to the full path, where capture happens.
    fn route_http_capture(
        &self,
        conn: &ConnMeta,
        req: &mut http::request::Parts,
    ) -> (Route, Option<CaptureTag>) {
        (self.route_http(conn, req), None)
    }

    /// Whether a request header (name as sent, any case) can influence [`Router::route_raw`].
    fn is_carrier(&self, _name: &[u8]) -> bool {
        false
    }

    /// Routing for the HTTP/1.1 relay, which forwards request heads as read instead of building
    /// a header map: `carriers` holds only the request's headers for which
    /// [`Router::is_carrier`] is true (most requests have none, so nothing is allocated) and
    /// `target` its origin-form request target. `None` sends the request (and the rest of its
    /// connection) down the full path, for requests this cannot express, such as a head rewrite.
    /// The default always does.
    fn route_raw(
        &self,
        _conn: &ConnMeta,
        _target: &str,
        _carriers: &HeaderMap,
    ) -> Option<RawRoute> {
        None
    }
}
