//! Header matches that select the requests carrying one routing key, for proxies Spur does not
//! run itself (Envoy through xDS, Istio VirtualServices, Gateway API HTTPRoutes): each proxy
//! spells a header match its own way, but what is matched is decided here, once.
//!
//! A request is routed by key when any one of these matches: proxies OR them by listing one
//! route (or one match) per entry, since a single match ANDs its headers.
//!
//! The matches derive from [`spur_routing::Carrier::ALL`], the one list of carriers the sidecar
//! reads and writes; they are defined there and named here for the control plane's renderers.

pub use spur_routing::carrier::{KeyMatch, MatchKind, key_matches};

#[cfg(test)]
mod tests {
    use super::*;
    use spur_routing::extract::LEGACY_HEADERS;

    #[test]
    fn one_match_per_carrier_regex_for_lists_exact_for_bare_keys() {
        let m = key_matches("sb1.k-2");
        assert_eq!(m.len(), 2 + LEGACY_HEADERS.len());
        assert_eq!(m[0].header, "baggage");
        assert_eq!(m[1].header, "tracestate");
        assert!(m[..2].iter().all(|k| k.kind == MatchKind::Regex));
        assert!(m[0].value.contains("sb1\\.k-2"), "{}", m[0].value);
        assert!(m[0].value.contains("sd-routing-key|spur-routing-key"));
        for (k, h) in m[2..].iter().zip(LEGACY_HEADERS) {
            assert_eq!(
                (k.header, k.kind, k.value.as_str()),
                (h, MatchKind::Exact, "sb1.k-2")
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
}
