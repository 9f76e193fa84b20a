//! Request-path features that plug in beside the [`Router`](crate::Router) instead of widening
//! it: the HTTP/1 relay's routing of heads as read ([`RawRouter`]), the choice of which
//! exchanges are captured ([`CaptureSelect`]) and the record of sampled traces' hops
//! ([`TraceRecord`]). A proxy carries them in [`Plugins`]; each one is
//! asked at most once per request (per header field for [`RawRouter::carrier`]), and a
//! feature that is absent costs nothing.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::capture::{Capture, CaptureTag};
use crate::conn::ConnMeta;
use crate::router::Route;

/// What a proxy runs beside its router. The default has none of them: every HTTP/1 request
/// takes the full (hyper) path and nothing is captured.
#[derive(Clone, Default)]
pub struct Plugins {
    /// Routing for the HTTP/1 relay; without it the relay hands every connection to the full
    /// path after its first head.
    pub raw: Option<Arc<dyn RawRouter>>,
    /// Traffic capture: which exchanges, and where their records go.
    pub capture: Option<CapturePlugin>,
    /// The hops of sampled traces: which request of a trace reached this proxy, with or
    /// without a routing key.
    pub trace: Option<Arc<dyn TraceRecord>>,
}

/// Capture's two halves: the per-request choice and the sink the chosen exchanges are copied to.
#[derive(Clone)]
pub struct CapturePlugin {
    pub select: Arc<dyn CaptureSelect>,
    pub sink: Arc<Capture>,
}

/// A routing decision of [`RawRouter::route_raw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRoute {
    pub route: Route,
    /// A header the forwarded request must carry with exactly this value (any the client sent
    /// under that name are dropped).
    pub set: Option<(HeaderName, HeaderValue)>,
}

/// Routing for the HTTP/1.1 relay, which forwards request heads as read instead of building a
/// header map. It must decide as the proxy's [`Router`](crate::Router) would for the same
/// request.
pub trait RawRouter: Send + Sync + 'static {
    /// The name of a request header (name as sent, any case) that can influence
    /// [`RawRouter::route_raw`], which must be `name` in lower case; `None` for any other. The
    /// relay files the header's value under the name given, so a router hands out the names it
    /// holds (a reference count at most) rather than the relay building one for each request.
    fn carrier(&self, name: &[u8]) -> Option<HeaderName>;

    /// `carriers` holds only the request's headers for which [`RawRouter::carrier`] gave a name
    /// (most requests have none, so nothing is allocated) and `target` its origin-form request
    /// target. `None` sends the request (and the rest of its connection) down the full path, for
    /// requests this cannot express, such as a head rewrite.
    fn route_raw(&self, conn: &ConnMeta, target: &str, carriers: &HeaderMap) -> Option<RawRoute>;
}

/// Decides whether an exchange is captured (and under which sandbox), once it is routed.
pub trait CaptureSelect: Send + Sync + 'static {
    /// `route` is the router's decision for the request whose (possibly rewritten) headers and
    /// query string these are. On the HTTP/1 relay `headers` holds only the raw router's
    /// carriers; a request selected there is handed to the full path, where capture happens.
    fn select(
        &self,
        conn: &ConnMeta,
        route: &Route,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Option<CaptureTag>;
}

/// Records the requests of sampled traces. The HTTP/1 relay asks [`TraceRecord::is_sampled`]
/// of the header fields that are not routing carriers and hands a sampled request to the full
/// path, which calls [`TraceRecord::record`] for every request once it is routed; so a request
/// of a trace that is not sampled costs what these two methods make of its headers.
pub trait TraceRecord: Send + Sync + 'static {
    /// Whether this request header (name as sent, any case) marks the request as one of a
    /// sampled trace.
    fn is_sampled(&self, name: &[u8], value: &[u8]) -> bool;

    /// Called for every request on the full path, after routing (`headers` as they will be
    /// forwarded, bar hop-by-hop fields); records it if its trace is sampled.
    fn record(&self, conn: &ConnMeta, route: &Route, headers: &HeaderMap, path: &str);
}
