//! Header matches that select the requests carrying one routing key, for proxies Spur does not
//! run itself (Envoy through xDS, Istio VirtualServices, Gateway API HTTPRoutes): each proxy
//! spells a header match its own way, but what is matched is decided here, once.
//!
//! A request is routed by key when any one of these matches: proxies OR them by listing one
//! route (or one match) per entry, since a single match ANDs its headers.

use spur_routing::extract::{LEGACY_HEADERS, MEMBER_NAMES};

/// How a header's value is compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchKind {
    /// The whole value matches an RE2 regular expression (anchored at both ends, so it means
    /// the same under full-match and partial-match engines).
    Regex,
    /// The value is exactly the key (the bare-key headers).
    Exact,
}

/// One header match of a routing key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMatch {
    /// Lower-case header name.
    pub header: &'static str,
    pub kind: MatchKind,
    /// The regular expression, or the exact value.
    pub value: String,
}

/// The matches for `key`, one per carrier, in the precedence order of the sidecar's extractor:
/// `baggage` and `tracestate` members named by [`MEMBER_NAMES`] (regular expressions), then the
/// OpenTracing and Jaeger headers of [`LEGACY_HEADERS`] (exact).
///
/// `key` must be a valid routing key (`[A-Za-z0-9._-]`, which the CRD schemas enforce): only
/// `.` means anything to RE2 among its characters, and it is escaped.
pub fn key_matches(key: &str) -> Vec<KeyMatch> {
    let escaped = regex_escape(key);
    let names = MEMBER_NAMES.map(regex_escape).join("|");
    // A member starts the value or follows a comma (a `;` starts a property of the member
    // before it); after its value come properties, more members, or nothing. Baggage allows
    // optional whitespace around `=`; tracestate does not.
    let mut out = vec![
        KeyMatch {
            header: "baggage",
            kind: MatchKind::Regex,
            value: format!(
                "^(?:.*,)?[ \\t]*(?:{names})[ \\t]*=[ \\t]*{escaped}[ \\t]*(?:[;,].*)?$"
            ),
        },
        KeyMatch {
            header: "tracestate",
            kind: MatchKind::Regex,
            value: format!("^(?:.*,)?[ \\t]*(?:{names})={escaped}[ \\t]*(?:,.*)?$"),
        },
    ];
    out.extend(LEGACY_HEADERS.iter().map(|h| KeyMatch {
        header: h,
        kind: MatchKind::Exact,
        value: key.to_owned(),
    }));
    out
}

/// Keys are `[A-Za-z0-9._-]`, member names `[a-z-]`: only `.` means anything to RE2.
fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

#[cfg(test)]
mod tests {
    use super::*;

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
