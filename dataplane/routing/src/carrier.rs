//! The standard routing-key carriers, defined once: where a request carries a key, how it is
//! read ([`crate::extract`]), written ([`crate::inject`]), listed for the HTTP/1 relay (the
//! sidecar's router) and matched by proxies Spur does not run ([`crate::KeyExtractor::key_matches`], rendered for xDS,
//! Istio and the Gateway API).
//!
//! A new standard carrier is one entry in [`Carrier::ALL`] (and, for a new list grammar, its arm
//! in [`Carrier::key_match`]); everything else derives from the table. The configured carriers
//! (custom headers, a query parameter) come from [`crate::ExtractConfig`] instead, and
//! [`crate::KeyExtractor::key_matches`] adds them to the standard ones.

use std::borrow::Cow;

use http::HeaderName;

use crate::baggage::Syntax;

/// `baggage` / `tracestate` member names that carry a key, in precedence order: Signadot's current
/// name, Spur's own, then Signadot's two historical names.
pub const MEMBER_NAMES: [&str; 4] = [
    "sd-routing-key",
    "spur-routing-key",
    "sd-sandbox",
    "sd-workspace",
];

/// Member names written by [`crate::inject::inject_key`], in that order.
pub const WRITTEN_MEMBERS: [&str; 2] = ["sd-routing-key", "sd-sandbox"];

/// One place a request carries a routing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// A W3C list header: its members named by [`MEMBER_NAMES`] carry the key. Injection writes
    /// the [`WRITTEN_MEMBERS`] first and keeps the other members.
    List {
        header: &'static str,
        syntax: Syntax,
    },
    /// A header whose whole value is the key (OpenTracing `ot-baggage-`, Jaeger `uberctx-`).
    /// Injection writes it when `written`, and removes it otherwise, so that no stale key
    /// survives next to the injected one.
    Bare { header: &'static str, written: bool },
}

impl Carrier {
    /// Every standard carrier, in extraction precedence order (after the configured query
    /// parameter and custom headers; see [`crate::KeyExtractor::extract`]).
    pub const ALL: [Carrier; 10] = [
        Carrier::List {
            header: "baggage",
            syntax: Syntax::Baggage,
        },
        Carrier::List {
            header: "tracestate",
            syntax: Syntax::TraceState,
        },
        Carrier::bare("ot-baggage-sd-routing-key", true),
        Carrier::bare("ot-baggage-spur-routing-key", false),
        Carrier::bare("ot-baggage-sd-sandbox", true),
        Carrier::bare("ot-baggage-sd-workspace", false),
        Carrier::bare("uberctx-sd-routing-key", true),
        Carrier::bare("uberctx-spur-routing-key", false),
        Carrier::bare("uberctx-sd-sandbox", true),
        Carrier::bare("uberctx-sd-workspace", false),
    ];

    const fn bare(header: &'static str, written: bool) -> Carrier {
        Carrier::Bare { header, written }
    }

    /// The header's lower-case name.
    pub const fn header(self) -> &'static str {
        match self {
            Carrier::List { header, .. } | Carrier::Bare { header, .. } => header,
        }
    }

    /// [`Carrier::ALL`]'s header names, in the same order, built once (a `HeaderName` may hold
    /// `Bytes`, which must not be rebuilt per request).
    pub fn header_names() -> &'static [HeaderName; Carrier::ALL.len()] {
        &HEADER_NAMES
    }

    /// The header match that selects requests carrying `key` here. `key` must be a valid routing
    /// key (`[A-Za-z0-9._-]`, which the CRD schemas enforce): only `.` means anything to RE2
    /// among its characters, and it is escaped.
    pub fn key_match(self, key: &str) -> KeyMatch {
        let escaped = regex_escape(key);
        let names = MEMBER_NAMES.map(regex_escape).join("|");
        // A member starts the value or follows a comma (a `;` starts a property of the member
        // before it); after its value come properties, more members, or nothing. Baggage allows
        // optional whitespace around `=`; tracestate does not.
        let (kind, value) = match self {
            Carrier::List {
                syntax: Syntax::Baggage,
                ..
            } => (
                MatchKind::Regex,
                format!("^(?:.*,)?[ \\t]*(?:{names})[ \\t]*=[ \\t]*{escaped}[ \\t]*(?:[;,].*)?$"),
            ),
            Carrier::List {
                syntax: Syntax::TraceState,
                ..
            } => (
                MatchKind::Regex,
                format!("^(?:.*,)?[ \\t]*(?:{names})={escaped}[ \\t]*(?:,.*)?$"),
            ),
            Carrier::Bare { .. } => (MatchKind::Exact, key.to_owned()),
        };
        KeyMatch {
            on: MatchOn::Header(Cow::Borrowed(self.header())),
            kind,
            value,
        }
    }
}

/// [`Carrier::ALL`]'s header names, in the same order.
static HEADER_NAMES: [HeaderName; Carrier::ALL.len()] = {
    let mut out = [const { HeaderName::from_static("baggage") }; Carrier::ALL.len()];
    let mut i = 0;
    while i < Carrier::ALL.len() {
        // Plain assignment would drop the placeholder, which a constant cannot do.
        std::mem::forget(std::mem::replace(
            &mut out[i],
            HeaderName::from_static(Carrier::ALL[i].header()),
        ));
        i += 1;
    }
    out
};

const BARE_COUNT: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < Carrier::ALL.len() {
        if let Carrier::Bare { .. } = Carrier::ALL[i] {
            n += 1;
        }
        i += 1;
    }
    n
};

/// The bare-key headers of [`Carrier::ALL`] (OpenTracing `ot-baggage-` and Jaeger `uberctx-`),
/// in precedence order.
pub const LEGACY_HEADERS: [&str; BARE_COUNT] = {
    let mut out = [""; BARE_COUNT];
    let (mut n, mut i) = (0, 0);
    while i < Carrier::ALL.len() {
        if let Carrier::Bare { header, .. } = Carrier::ALL[i] {
            out[n] = header;
            n += 1;
        }
        i += 1;
    }
    out
};

/// Whether a byte starts one of [`Carrier::ALL`]'s header names (lower case), so that most header
/// names are dismissed by one table lookup.
pub(crate) const FIRST_BYTES: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < Carrier::ALL.len() {
        let name = Carrier::ALL[i].header().as_bytes();
        if !name.is_empty() {
            t[name[0] as usize] = true;
        }
        i += 1;
    }
    t
};

/// How a header's value is compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchKind {
    /// The whole value matches an RE2 regular expression (anchored at both ends, so it means
    /// the same under full-match and partial-match engines).
    Regex,
    /// The value is exactly the key (the bare-key headers).
    Exact,
}

/// Where a [`KeyMatch`] looks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MatchOn {
    /// A header, by its lower-case name.
    Header(Cow<'static, str>),
    /// A query parameter, by its name (valid keys never need percent-encoding, so the raw
    /// value of a well-formed URL is the key itself).
    Query(Box<str>),
}

/// One match of a routing key: a header or a query parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMatch {
    pub on: MatchOn,
    pub kind: MatchKind,
    /// The regular expression, or the exact value.
    pub value: String,
}

impl KeyMatch {
    /// The header this match tests, if it tests one.
    pub fn header(&self) -> Option<&str> {
        match &self.on {
            MatchOn::Header(h) => Some(h),
            MatchOn::Query(_) => None,
        }
    }
}

/// Keys are `[A-Za-z0-9._-]`, member names `[a-z-]`: only `.` means anything to RE2.
fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};

    use super::*;
    use crate::extract::{ExtractConfig, KeyExtractor};
    use crate::inject::inject_key;

    fn extract(h: &HeaderMap) -> Vec<String> {
        KeyExtractor::new(&ExtractConfig::default())
            .unwrap()
            .extract(h, None)
            .iter()
            .map(str::to_owned)
            .collect()
    }

    fn matches(m: &KeyMatch, value: &str) -> bool {
        match m.kind {
            MatchKind::Exact => value == m.value,
            MatchKind::Regex => regex::Regex::new(&m.value).unwrap().is_match(value),
        }
    }

    #[test]
    fn the_table_is_consistent() {
        for (c, name) in Carrier::ALL.iter().zip(&HEADER_NAMES) {
            assert_eq!(name.as_str(), c.header());
            assert!(FIRST_BYTES[usize::from(c.header().as_bytes()[0])]);
        }
        let bare: Vec<&str> = Carrier::ALL
            .iter()
            .filter(|c| matches!(c, Carrier::Bare { .. }))
            .map(|c| c.header())
            .collect();
        assert_eq!(bare, LEGACY_HEADERS);
        assert!(WRITTEN_MEMBERS.iter().all(|m| MEMBER_NAMES.contains(m)));
    }

    /// Each carrier alone, read by extraction, written by injection and selected by its own
    /// match: the three derivations agree on every entry of the table.
    #[test]
    fn every_carrier_extracts_injects_and_matches() {
        let key = "sb1.k-2";
        let injected = {
            let mut h = HeaderMap::new();
            inject_key(&mut h, key, &[]);
            h
        };
        for (c, name) in Carrier::ALL.into_iter().zip(Carrier::header_names()) {
            let m = c.key_match(key);
            assert_eq!(m.header(), Some(c.header()));
            let carried: Vec<String> = match c {
                Carrier::List { .. } => MEMBER_NAMES.iter().map(|n| format!("{n}={key}")).collect(),
                Carrier::Bare { .. } => vec![key.to_owned()],
            };
            for value in &carried {
                let mut h = HeaderMap::new();
                h.insert(name.clone(), HeaderValue::from_str(value).unwrap());
                assert_eq!(extract(&h), [key], "{c:?} {value}");
                assert!(matches(&m, value), "{c:?} {value}");
                assert!(!matches(&c.key_match("other"), value), "{c:?} {value}");
            }
            let written = match c {
                Carrier::List { .. } => true,
                Carrier::Bare { written, .. } => written,
            };
            match injected.get(name) {
                Some(v) => {
                    assert!(written, "{c:?} written but not in the table's set");
                    assert!(matches(&m, v.to_str().unwrap()), "{c:?}");
                    let mut h = HeaderMap::new();
                    h.insert(name.clone(), v.clone());
                    assert_eq!(extract(&h), [key], "{c:?} reads what it writes");
                }
                None => {
                    assert!(!written, "{c:?} not written");
                    let mut h = HeaderMap::new();
                    h.insert(name.clone(), HeaderValue::from_static("stale"));
                    inject_key(&mut h, key, &[]);
                    assert!(h.get(name).is_none(), "{c:?}: a stale key is removed");
                    assert_eq!(extract(&h), [key]);
                }
            }
        }
        let none = KeyExtractor::new(&ExtractConfig::default()).unwrap();
        assert_eq!(none.key_matches(key).len(), Carrier::ALL.len());
    }

    /// The configured carriers come first, in the extractor's precedence order, each an exact
    /// match of the key: what the extractor reads from them is the whole (trimmed) value.
    #[test]
    fn configured_carriers_match_first_and_exactly() {
        let cfg = ExtractConfig {
            custom_headers: vec!["X-Route-To".into(), "x-team".into()],
            query_param: Some("sd-routing-key".into()),
        };
        let ex = KeyExtractor::new(&cfg).unwrap();
        let m = ex.key_matches("sb1.k");
        assert_eq!(m.len(), 3 + Carrier::ALL.len());
        assert_eq!(m[0].on, MatchOn::Query("sd-routing-key".into()));
        assert_eq!(m[1].header(), Some("x-route-to"));
        assert_eq!(m[2].header(), Some("x-team"));
        assert_eq!(m[3].header(), Some("baggage"));
        for k in &m[..3] {
            assert_eq!((k.kind, k.value.as_str()), (MatchKind::Exact, "sb1.k"));
        }
        // What each configured match selects is what the extractor reads there.
        let mut h = HeaderMap::new();
        h.insert("x-route-to", HeaderValue::from_static("sb1.k"));
        assert_eq!(ex.extract(&h, None).first(), Some("sb1.k"));
        assert_eq!(
            ex.extract(&HeaderMap::new(), Some("a=1&sd-routing-key=sb1.k"))
                .first(),
            Some("sb1.k")
        );
    }
}
