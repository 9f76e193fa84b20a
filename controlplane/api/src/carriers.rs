//! Header matches that select the requests carrying one routing key, for proxies Spur does not
//! run itself (Envoy through xDS, Istio VirtualServices, Gateway API HTTPRoutes): each proxy
//! spells a header match its own way, but what is matched is decided here, once.
//!
//! A request is routed by key when any one of these matches: proxies OR them by listing one
//! route (or one match) per entry, since a single match ANDs its headers.
//!
//! The matches derive from [`spur_routing::Carrier::ALL`], the one list of carriers the sidecar
//! reads and writes, and from the configured carriers ([`spur_routing::KeyExtractor::key_matches`]);
//! they are defined there and named here for the control plane's renderers, with the one reading
//! of a namespace's carrier annotations ([`of_namespace`]).

use std::collections::BTreeMap;

pub use spur_routing::carrier::{KeyMatch, MatchKind, MatchOn};
pub use spur_routing::{ExtractConfig, KeyExtractor};

use crate::keys::injection::{QUERY_PARAM, ROUTING_HEADERS};

/// The carriers a namespace's annotations name, as written: the headers of [`ROUTING_HEADERS`]
/// (trimmed, lower-cased, empty entries left out) and the parameter of [`QUERY_PARAM`]. Not
/// validated: [`of_namespace`] checks them all at once, the hub keeps each valid one.
pub fn annotated(ns_annotations: &BTreeMap<String, String>) -> (Vec<String>, Option<String>) {
    let get = |k: &str| {
        ns_annotations
            .get(k)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    };
    let headers = get(ROUTING_HEADERS)
        .into_iter()
        .flat_map(|h| h.split(','))
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect();
    (headers, get(QUERY_PARAM).map(str::to_owned))
}

/// The carriers read in a namespace whose annotations are `ns_annotations`: the cluster's
/// (`routingKeys`), plus the custom headers of [`ROUTING_HEADERS`], with the query parameter of
/// [`QUERY_PARAM`] in place of the cluster's (docs/routing-keys.md, "Per namespace"). The one
/// reading of those annotations, for the sidecars the webhook injects, the route matches the
/// operator and the route server write, and the carriers a preview overwrites. `None` when the
/// namespace changes nothing. A malformed annotation is an error naming it.
pub fn of_namespace(
    cluster: &ExtractConfig,
    ns_annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<ExtractConfig>, String> {
    let Some((headers, query)) = ns_annotations.map(annotated) else {
        return Ok(None);
    };
    if headers.is_empty() && query.is_none() {
        return Ok(None);
    }
    let mut out = cluster.clone();
    out.custom_headers.extend(headers);
    if let Some(q) = query {
        out.query_param = Some(q);
    }
    match KeyExtractor::new(&out) {
        Ok(_) => Ok(Some(out)),
        Err(e) => Err(format!(
            "the namespace's annotation {ROUTING_HEADERS} or {QUERY_PARAM}: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_routing::extract::LEGACY_HEADERS;

    fn key_matches(key: &str) -> Vec<KeyMatch> {
        KeyExtractor::new(&ExtractConfig::default())
            .unwrap()
            .key_matches(key)
    }

    #[test]
    fn one_match_per_carrier_regex_for_lists_exact_for_bare_keys() {
        let m = key_matches("sb1.k-2");
        assert_eq!(m.len(), 2 + LEGACY_HEADERS.len());
        assert_eq!(m[0].header(), Some("baggage"));
        assert_eq!(m[1].header(), Some("tracestate"));
        assert!(m[..2].iter().all(|k| k.kind == MatchKind::Regex));
        assert!(m[0].value.contains("sb1\\.k-2"), "{}", m[0].value);
        assert!(m[0].value.contains("sd-routing-key|spur-routing-key"));
        for (k, h) in m[2..].iter().zip(LEGACY_HEADERS) {
            assert_eq!(
                (k.header(), k.kind, k.value.as_str()),
                (Some(h), MatchKind::Exact, "sb1.k-2")
            );
        }
    }

    #[test]
    fn regexes_match_members_carrying_the_key_and_nothing_else() {
        let m = key_matches("sb1.k");
        let baggage = regex::Regex::new(&m[0].value).unwrap();
        let tracestate = regex::Regex::new(&m[1].value).unwrap();
        for yes in [
            "sd-routing-key=sb1.k",
            "a=b, sd-routing-key = sb1.k ;prop=1, c=d",
            "spur-routing-key=sb1.k,x=y",
            "sd-sandbox=sb1.k",
        ] {
            assert!(baggage.is_match(yes), "{yes}");
        }
        for no in [
            "sd-routing-key=sb1xk",
            "sd-routing-key=sb1.kk",
            "xsd-routing-key=sb1.k",
            "other=sb1.k",
            "sd-routing-key=a,other=sb1.k",
        ] {
            assert!(!baggage.is_match(no), "{no}");
        }
        assert!(tracestate.is_match("vendor=1,sd-routing-key=sb1.k"));
        assert!(!tracestate.is_match("sd-routing-key = sb1.k"));
    }

    #[test]
    fn a_namespace_adds_headers_and_replaces_the_query_parameter() {
        let cluster = ExtractConfig {
            custom_headers: vec!["x-cluster".into()],
            query_param: Some("cluster-q".into()),
        };
        assert_eq!(of_namespace(&cluster, None), Ok(None));
        let blank = BTreeMap::from([(ROUTING_HEADERS.to_owned(), " ".to_owned())]);
        assert_eq!(of_namespace(&cluster, Some(&blank)), Ok(None));
        let ns = BTreeMap::from([
            (ROUTING_HEADERS.to_owned(), "X-Team, x-route".to_owned()),
            (QUERY_PARAM.to_owned(), "team-q".to_owned()),
        ]);
        let mine = of_namespace(&cluster, Some(&ns)).unwrap().unwrap();
        assert_eq!(mine.custom_headers, ["x-cluster", "x-team", "x-route"]);
        assert_eq!(mine.query_param.as_deref(), Some("team-q"));
        for bad in [
            (ROUTING_HEADERS, "bad header"),
            (ROUTING_HEADERS, "baggage"),
            (QUERY_PARAM, "a b"),
        ] {
            let a = BTreeMap::from([(bad.0.to_owned(), bad.1.to_owned())]);
            let e = of_namespace(&cluster, Some(&a)).unwrap_err();
            assert!(e.contains(ROUTING_HEADERS), "{e}");
        }
    }
}
