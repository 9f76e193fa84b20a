//! Per-request routing decisions. [`Router`] is the seam between the proxy mechanics and the
//! component built on them (the sidecar's key router lives in `spur-sidecar`). Features beside
//! routing (the relay's raw routing, capture) plug in through [`crate::plugin`] instead.

use std::sync::Arc;

use spur_routing::Destination;

use crate::conn::ConnMeta;

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
