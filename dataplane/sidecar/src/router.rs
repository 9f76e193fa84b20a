//! The sidecar's router: routing keys, read from a request's carriers, looked up in the rule
//! table for this sidecar's baseline workload.

use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use spur_proxy::capture::CaptureTag;
use spur_proxy::{CaptureSelect, ConnMeta, RawRoute, RawRouter, Route, Router};
use spur_routing::extract::strip_query_param;
use spur_routing::inject::inject_key;
use spur_routing::{BaselineWorkload, ExtractConfig, KeyExtractor, SharedTable};

use crate::Error;
use crate::capture::CaptureKeys;

/// Marks a request a sidecar has already sent to a sandbox; its value names the baseline whose
/// sidecar did it. If a misconfigured destination points back at the same sidecar, the request
/// arrives carrying its own mark and goes to the application instead of looping.
pub const ROUTED_HEADER: HeaderName = HeaderName::from_static("x-spur-routed");

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
    /// Lowercase names of every header `route_raw` reads, and their first bytes (both cases),
    /// so most names are dismissed by one table lookup.
    carriers: Vec<HeaderName>,
    carrier_first: [bool; 256],
}

impl KeyRouter {
    pub fn new(config: KeyRouterConfig, table: SharedTable) -> Result<Self, Error> {
        let extractor = KeyExtractor::new(&config.extract)
            .map_err(|e| Error::Config(format!("routing key carriers: {e}")))?;
        let mark = HeaderValue::from_str(&config.baseline.to_string()).map_err(|_| {
            Error::Config(format!(
                "baseline {} is not a valid header value",
                config.baseline
            ))
        })?;
        let mut carriers: Vec<HeaderName> = extractor.headers().cloned().collect();
        carriers.push(ROUTED_HEADER);
        let mut carrier_first = [false; 256];
        for name in &carriers {
            if let Some(&b) = name.as_str().as_bytes().first() {
                carrier_first[usize::from(b)] = true;
                carrier_first[usize::from(b.to_ascii_uppercase())] = true;
            }
        }
        Ok(KeyRouter {
            baseline: config.baseline,
            mark,
            extractor,
            table,
            carriers,
            carrier_first,
        })
    }

    /// The capture plug-in for this router's requests: captures those whose routing key is in
    /// `keys` (a routed request: its destination's key; one that stays on the baseline: its
    /// first candidate in `keys`, the traffic of a virtual workload).
    pub fn capture(&self, keys: CaptureKeys) -> KeyCapture {
        KeyCapture {
            mark: self.mark.clone(),
            extractor: self.extractor.clone(),
            keys,
        }
    }

    /// The decision once any routing query parameter has been lifted into headers.
    fn decide(&self, conn: &ConnMeta, headers: &HeaderMap, query: Option<&str>) -> Route {
        if is_marked(headers, &self.mark) {
            return Route::Original;
        }
        let candidates = self.extractor.extract(headers, query);
        if candidates.is_empty() {
            return Route::Original;
        }
        let snapshot = self.table.load();
        match snapshot
            .table
            .baseline(&self.baseline)
            .and_then(|rules| rules.route(conn.original_dst.port(), candidates.iter()))
        {
            Some(d) => Route::Destination(d.clone()),
            None => Route::Original,
        }
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

/// Whether a request carries this sidecar's own mark: it has been here already.
fn is_marked(headers: &HeaderMap, mark: &HeaderValue) -> bool {
    headers.get_all(ROUTED_HEADER).iter().any(|v| v == mark)
}

impl Router for KeyRouter {
    fn route_http(&self, conn: &ConnMeta, req: &mut http::request::Parts) -> Route {
        if is_marked(&req.headers, &self.mark) {
            return Route::Original;
        }
        self.lift_query_param(req);
        let route = self.decide(conn, &req.headers, req.uri.query());
        if let Route::Destination(_) = route {
            req.headers.insert(ROUTED_HEADER, self.mark.clone());
        }
        route
    }
}

impl RawRouter for KeyRouter {
    fn carrier(&self, name: &[u8]) -> Option<HeaderName> {
        match name.first() {
            Some(&b) if self.carrier_first[usize::from(b)] => self
                .carriers
                .iter()
                .find(|c| c.as_str().as_bytes().eq_ignore_ascii_case(name))
                .cloned(),
            _ => None,
        }
    }

    fn route_raw(&self, conn: &ConnMeta, target: &str, carriers: &HeaderMap) -> Option<RawRoute> {
        let query = target.split_once('?').map(|(_, q)| q);
        // Lifting the parameter out of the target is a head rewrite: the full path does it. A
        // substring match may send a few requests there needlessly, never one too few.
        if let (Some(name), Some(q)) = (self.extractor.query_param(), query)
            && q.contains(name)
        {
            return None;
        }
        let route = self.decide(conn, carriers, query);
        let set =
            matches!(route, Route::Destination(_)).then(|| (ROUTED_HEADER, self.mark.clone()));
        Some(RawRoute { route, set })
    }
}

/// Selects the exchanges to capture by routing key ([`KeyRouter::capture`]).
pub struct KeyCapture {
    mark: HeaderValue,
    extractor: KeyExtractor,
    keys: CaptureKeys,
}

impl CaptureSelect for KeyCapture {
    fn select(
        &self,
        _conn: &ConnMeta,
        route: &Route,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Option<CaptureTag> {
        // Most requests stay on the baseline and carry no key. The HTTP/1 relay passes only the
        // carrier headers: with none, and no key parameter in the query, there is nothing to
        // look up, which is decided before the keys are loaded (perf/results/capture.md).
        if matches!(route, Route::Original)
            && headers.is_empty()
            && !self
                .extractor
                .query_param()
                .is_some_and(|name| query.is_some_and(|q| q.contains(name)))
        {
            return None;
        }
        let keys = self.keys.load();
        if keys.is_empty() {
            return None;
        }
        match route {
            Route::Destination(d) => keys.get(&d.routing_key),
            // A request that has been here already is the application's, not captured again.
            Route::Original if is_marked(headers, &self.mark) => None,
            Route::Original => self
                .extractor
                .extract(headers, query)
                .iter()
                .find_map(|k| keys.get(k)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use arc_swap::ArcSwap;

    use super::*;
    use crate::capture::KeySet;

    /// A connection's metadata for unit tests of request-path plug-ins.
    pub(crate) fn meta() -> ConnMeta {
        ConnMeta::new(
            "10.0.0.1:5555".parse().unwrap(),
            "127.0.0.1:15006".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
            spur_proxy::Protocol::Http1,
        )
    }

    fn router() -> KeyRouter {
        let config = KeyRouterConfig {
            baseline: BaselineWorkload {
                kind: "Deployment".into(),
                namespace: "ns".into(),
                name: "app".into(),
            },
            extract: ExtractConfig::default(),
        };
        KeyRouter::new(config, SharedTable::new()).unwrap()
    }

    /// The capture plug-in decides beside the router: a request that stays on the baseline is
    /// captured by its candidate key (a virtual workload's traffic), unless it carries the
    /// sidecar's own mark; the raw and the full path route it alike.
    #[test]
    fn capture_selects_beside_routing() {
        let r = router();
        let keys: CaptureKeys = Arc::new(ArcSwap::from_pointee(KeySet::of("k1", "sb1")));
        let capture = r.capture(keys.clone());
        let mut headers = HeaderMap::new();
        headers.insert("baggage", HeaderValue::from_static("sd-routing-key=k1"));

        let raw = r.route_raw(&meta(), "/a", &headers).unwrap();
        assert_eq!(raw.route, Route::Original);
        assert_eq!(raw.set, None);
        let (mut parts, ()) = http::Request::get("/a").body(()).unwrap().into_parts();
        parts.headers = headers.clone();
        assert_eq!(r.route_http(&meta(), &mut parts), Route::Original);

        let tag = capture.select(&meta(), &Route::Original, &headers, None);
        assert_eq!(tag.map(|t| t.sandbox), Some("sb1".into()));
        let mut marked = headers.clone();
        marked.insert(ROUTED_HEADER, r.mark.clone());
        assert_eq!(
            capture.select(&meta(), &Route::Original, &marked, None),
            None
        );
        keys.store(Arc::new(KeySet::default()));
        assert_eq!(
            capture.select(&meta(), &Route::Original, &headers, None),
            None
        );
    }

    /// A request without carrier headers is captured by the key in its query parameter only;
    /// without either there is nothing to capture, whatever the keys.
    #[test]
    fn capture_reads_the_query_when_no_header_carries_a_key() {
        let config = KeyRouterConfig {
            baseline: BaselineWorkload {
                kind: "Deployment".into(),
                namespace: "ns".into(),
                name: "app".into(),
            },
            extract: ExtractConfig {
                query_param: Some("sd-routing-key".into()),
                ..ExtractConfig::default()
            },
        };
        let r = KeyRouter::new(config, SharedTable::new()).unwrap();
        let keys: CaptureKeys = Arc::new(ArcSwap::from_pointee(KeySet::of("k1", "sb1")));
        let capture = r.capture(keys);
        let none = HeaderMap::new();
        let select = |query| capture.select(&meta(), &Route::Original, &none, query);
        assert_eq!(
            select(Some("a=1&sd-routing-key=k1")).map(|t| t.sandbox),
            Some("sb1".into())
        );
        assert_eq!(select(Some("a=1&sd-routing-key=k2")), None);
        assert_eq!(select(Some("a=1")), None);
        assert_eq!(select(None), None);
    }
}
