//! What a preview request becomes before it leaves for the cluster: the caller's credentials
//! and the hub's cookies gone, the preview's routing key the only key in every carrier the
//! cluster's sidecars read, forwarding headers added, the target's name as `Host`.
//!
//! The carriers include the optional ones a cluster's sidecars may be configured with
//! (`--routing-header`, `--query-param`: docs/routing-keys.md, "Configuration"). Both take
//! precedence over `baggage` in [`KeyExtractor::extract`], so a caller allowed to use one
//! preview could otherwise name another sandbox's key in one of them and reach its fork.

use std::net::SocketAddr;

use http::Request;
use http::header::{self, HeaderName, HeaderValue};
use spur_routing::extract::{ExtractConfig, strip_query_param};

use crate::carriers::Carriers;

use super::{API_KEY_HEADER, without_hub_cookie};
use crate::catalog::Resolved;

/// The query parameter the hub removes from every preview request unless told otherwise
/// (`spur-hub serve --query-param`): the name docs/routing-keys.md gives for preview links.
/// Removing a parameter that a cluster's sidecars do not read is harmless to routing (only an
/// app that reads `sd-routing-key` itself would notice), while leaving one they do read lets a
/// caller pick another sandbox's key; so the default errs on the side of removing it.
pub const DEFAULT_QUERY_PARAM: &str = "sd-routing-key";

/// The carriers the hub overwrites when it is given none: no custom headers (their names are
/// each installation's own choice, nothing to guess) and [`DEFAULT_QUERY_PARAM`].
pub fn default_carriers() -> ExtractConfig {
    ExtractConfig {
        custom_headers: Vec::new(),
        query_param: Some(DEFAULT_QUERY_PARAM.to_owned()),
    }
}

/// The carriers a preview to `to` must overwrite: the hub's (`--routing-header`,
/// `--query-param`) and every one the target cluster's namespaces name ([`Carriers`]). `None`
/// while the target cluster's namespaces are unknown: no preview is sent then.
pub(super) fn carriers_for(hub: &Carriers, to: &Resolved) -> Option<Carriers> {
    to.carriers.as_ref().map(|c| hub.union(c))
}

/// Strips the caller's credentials, the hub's cookies and every routing key the caller sent,
/// writes the preview's key into every carrier `carriers` names besides the standard ones, and
/// adds forwarding headers. Fails, and nothing may be sent, when the request would still carry
/// a key other than the preview's to a sidecar reading `carriers` (an invalid key in the
/// catalog, which [`spur_routing::inject::inject_key`] refuses to write, or a URI that cannot
/// be rebuilt).
pub(super) fn prepare<B>(
    req: &mut Request<B>,
    to: &Resolved,
    carriers: &Carriers,
    host: &str,
    peer: SocketAddr,
) -> Result<(), String> {
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
    // The standard carriers and each configured custom header (every line of it) now hold the
    // preview's key and nothing else.
    spur_routing::inject::inject_key(h, &to.routing_key, &carriers.header_names());
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
    // Origin-form for the target (HTTP/2 clients send an absolute URI), without the key
    // parameter. One `strip_query_param` removes every pair of that name; it leaves the URI
    // alone only when none of their values is a valid key once decoded, and such values are no
    // candidates to a sidecar either (it decodes and checks them the same way).
    let mut pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    for name in carriers.params() {
        if let Some((_, rewritten)) = strip_query_param(&pq, name) {
            pq = rewritten;
        }
    }
    *req.uri_mut() = http::Uri::try_from(pq.as_str())
        .map_err(|e| format!("the request's path cannot be rebuilt: {e}"))?;
    // What a sidecar reading these carriers would find (with any one of the parameters): the
    // preview's key and nothing else, or the request does not go.
    for ex in carriers.extractors() {
        let found = ex.extract(req.headers(), req.uri().query());
        if found.first() != Some(to.routing_key.as_str()) || found.len() != 1 {
            return Err(format!(
                "the request would carry the routing keys {found:?} instead of only the \
                 preview's {:?}",
                to.routing_key
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(key: &str) -> Resolved {
        Resolved {
            cluster: "c".into(),
            public: false,
            routing_key: key.into(),
            scheme: "http".into(),
            host: "web.shop.svc".into(),
            port: 8080,
            carriers: Some(Carriers::default()),
        }
    }

    fn carriers(custom: &[&str], query: Option<&str>) -> Carriers {
        Carriers::new(
            &ExtractConfig {
                custom_headers: custom.iter().map(|s| (*s).to_owned()).collect(),
                query_param: query.map(str::to_owned),
            },
            &[],
        )
        .unwrap()
    }

    fn peer() -> SocketAddr {
        "192.0.2.1:5000".parse().unwrap()
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
        let to = resolved("key123");
        let none = carriers(&[], None);
        prepare(&mut req, &to, &none, "web--sb.preview.test", peer()).unwrap();
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
            .header(
                "cookie",
                "a=1; __Host-spur_hub=spurs_secret; b=2; spur_preview=spurs_p",
            )
            .body(())
            .unwrap();
        prepare(&mut req, &to, &none, "h", peer()).unwrap();
        assert_eq!(req.headers().get("cookie").unwrap(), "a=1; b=2");
        let mut req = Request::get("/")
            .header("cookie", "spur_hub=spurs_x")
            .body(())
            .unwrap();
        prepare(&mut req, &to, &none, "h", peer()).unwrap();
        assert!(req.headers().get("cookie").is_none());
        // Someone else's bearer token (not a hub key) is the app's business and stays.
        let mut req = Request::get("/")
            .header("authorization", "Bearer app-token")
            .body(())
            .unwrap();
        prepare(&mut req, &to, &none, "h", peer()).unwrap();
        assert_eq!(
            req.headers().get("authorization").unwrap(),
            "Bearer app-token"
        );
    }

    /// Issue 42, point 10: the carriers a cluster's sidecars read before `baggage` (a custom
    /// header, the query parameter) cannot name another sandbox's key.
    #[test]
    fn another_key_in_a_custom_header_or_the_query_parameter_is_gone() {
        let cfg = ExtractConfig {
            custom_headers: vec!["x-route-to".into(), "X-Sandbox-Key".into()],
            query_param: Some(DEFAULT_QUERY_PARAM.into()),
        };
        let sidecar = spur_routing::KeyExtractor::new(&cfg).unwrap();
        let hub = Carriers::new(&cfg, &[]).unwrap();
        for uri in [
            "https://web--sb.preview.test/a?sd-routing-key=other&x=1",
            "/a?sd-routing-key=other&x=1",
            // Every occurrence, encoded or not, wherever it sits.
            "/a?sd-routing-key=bad%zz&x=1&sd-routing-key=oth%65r&sd-routing-key=third",
            "/a?x=1&sd-routing-key=%6Fther",
        ] {
            let mut req = Request::get(uri)
                .header("x-route-to", "other")
                .header("x-route-to", "third")
                .header("baggage", "sd-routing-key=other")
                .body(())
                .unwrap();
            prepare(&mut req, &resolved("key123"), &hub, "h", peer()).unwrap();
            assert_eq!(req.uri().path(), "/a", "{uri}");
            let query = req.uri().query().unwrap_or_default();
            assert!(query.split('&').any(|p| p == "x=1"), "{uri}: {query}");
            assert!(
                !query.contains("oth") && !query.contains("third"),
                "{uri}: the caller's key is left in {query:?}"
            );
            let h = req.headers();
            let lines: Vec<_> = h.get_all("x-route-to").iter().collect();
            assert_eq!(lines, ["key123"], "{uri}");
            assert_eq!(h.get("x-sandbox-key").unwrap(), "key123", "{uri}");
            // What the cluster's sidecar, configured the same way, routes by.
            let found = sidecar.extract(h, req.uri().query());
            assert_eq!(found.iter().collect::<Vec<_>>(), ["key123"], "{uri}");
        }
        // A query parameter of that name with no key in it is no candidate to anyone and stays.
        let mut req = Request::get("/a?sd-routing-key=&x=1").body(()).unwrap();
        prepare(&mut req, &resolved("key123"), &hub, "h", peer()).unwrap();
        assert_eq!(req.uri(), "/a?sd-routing-key=&x=1");
    }

    /// The default carriers cover the documented query parameter.
    #[test]
    fn the_default_removes_the_documented_query_parameter() {
        let defaults = Carriers::new(&default_carriers(), &[]).unwrap();
        let mut req = Request::get("/?sd-routing-key=other").body(()).unwrap();
        prepare(&mut req, &resolved("key123"), &defaults, "h", peer()).unwrap();
        assert_eq!(req.uri(), "/");
    }

    /// A key `inject_key` will not write (not a valid key) would leave the caller's keys in
    /// place: the request is refused instead.
    #[test]
    fn a_key_that_cannot_be_written_sends_nothing() {
        let mut req = Request::get("/")
            .header("baggage", "sd-routing-key=other")
            .body(())
            .unwrap();
        let why = prepare(
            &mut req,
            &resolved("not a key"),
            &carriers(&[], None),
            "h",
            peer(),
        )
        .unwrap_err();
        assert!(why.contains("other"), "{why}");
        // Nor does a request with no key at all go without the preview's.
        let mut req = Request::get("/").body(()).unwrap();
        assert!(
            prepare(
                &mut req,
                &resolved("not a key"),
                &carriers(&[], None),
                "h",
                peer()
            )
            .is_err()
        );
    }

    /// The cluster's namespaces add headers the preview overwrites and parameters it removes,
    /// besides the hub's (all of them, whichever namespace the target is in); a cluster whose
    /// namespaces are unknown gets no preview.
    #[test]
    fn the_clusters_namespaces_add_their_carriers() {
        let hub = carriers(&["x-route-to"], Some(DEFAULT_QUERY_PARAM));
        let mut to = resolved("sb1k");
        assert_eq!(carriers_for(&hub, &to), Some(hub.clone()));
        let mut seen = Carriers::default();
        seen.add_namespace(
            &[
                (
                    spur_api::keys::injection::ROUTING_HEADERS.to_owned(),
                    "X-Team".to_owned(),
                ),
                (
                    spur_api::keys::injection::QUERY_PARAM.to_owned(),
                    "team-key".to_owned(),
                ),
            ]
            .into(),
        );
        to.carriers = Some(seen);
        let all = carriers_for(&hub, &to).unwrap();
        let mut req = Request::get("/p?team-key=other&a=1&sd-routing-key=other2")
            .header("x-team", "other")
            .body(())
            .unwrap();
        prepare(&mut req, &to, &all, "h", "127.0.0.1:1".parse().unwrap()).unwrap();
        assert_eq!(req.headers()["x-team"], "sb1k");
        assert_eq!(req.headers()["x-route-to"], "sb1k");
        // Both parameters go: the namespace's does not replace the hub's here.
        assert_eq!(req.uri().path_and_query().unwrap().as_str(), "/p?a=1");
        to.carriers = None;
        assert!(carriers_for(&hub, &to).is_none());
    }
}
