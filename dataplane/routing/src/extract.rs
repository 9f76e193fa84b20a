//! Candidate routing keys of a request, from every carrier, in one documented precedence order.
//!
//! Extraction runs on every request, so it borrows from the request wherever it can: a
//! [`Candidates`] set lives inline (no `Vec`) and only a percent-encoded key is ever copied.

use std::borrow::Cow;
use std::fmt;
use std::iter::Map;
use std::slice;

use http::header::GetAll;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::Error;
use crate::baggage::{self, Syntax, percent_decode, trim_ows};
use crate::carrier::{Carrier, FIRST_BYTES, KeyMatch, MatchKind, MatchOn};

pub use crate::carrier::{LEGACY_HEADERS, MEMBER_NAMES};

/// Longest accepted routing key. Signadot's keys are 13 characters and sandbox ids at most 32;
/// the slack leaves room for route-group keys without letting a header carry an unbounded one.
pub const MAX_KEY_LEN: usize = 64;

/// The most candidate keys one request yields; more would only be tried after these lose.
pub const MAX_CANDIDATES: usize = 8;

/// A routing key: 1..=[`MAX_KEY_LEN`] bytes of `[A-Za-z0-9._-]`. Narrow enough to be safe in a
/// header value, a baggage value, a tracestate value and a URL without any escaping.
pub fn is_valid_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_KEY_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Headers no custom carrier may be: HTTP framing and hop-by-hop headers, the host, credentials
/// and forwarding headers, and the trace context (a preview or a job writes the key into every
/// custom header, and a namespace's annotation names them for the whole cluster's previews).
pub const RESERVED_HEADERS: [&str; 18] = [
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "upgrade",
    "te",
    "trailer",
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-spur-api-key",
    "traceparent",
];

/// Which extra carriers to read besides the standard ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct ExtractConfig {
    /// Headers whose whole value is a bare key (Signadot's `routing.customHeaders`).
    #[serde(alias = "customHeaders")]
    pub custom_headers: Vec<String>,
    /// A query parameter carrying a key (e.g. `sd-routing-key` for preview links).
    #[serde(alias = "queryParam")]
    pub query_param: Option<String>,
}

/// Reads candidate keys out of requests; built once from an [`ExtractConfig`].
#[derive(Debug, Clone)]
pub struct KeyExtractor {
    custom_headers: Vec<HeaderName>,
    query_param: Option<Box<str>>,
}

impl KeyExtractor {
    /// Validates the configuration: header names must be valid HTTP field names and the query
    /// parameter must be 1-64 characters of `[A-Za-z0-9._-]` (so it never needs URL-escaping).
    pub fn new(cfg: &ExtractConfig) -> Result<Self, Error> {
        let mut custom_headers: Vec<HeaderName> = Vec::with_capacity(cfg.custom_headers.len());
        for name in &cfg.custom_headers {
            let h = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| Error::InvalidHeaderName { name: name.clone() })?;
            if crate::carrier::Carrier::header_names().contains(&h) {
                return Err(Error::StandardHeader { name: name.clone() });
            }
            if RESERVED_HEADERS.contains(&h.as_str()) {
                return Err(Error::ReservedHeader { name: name.clone() });
            }
            // A repeated name would only repeat the same candidates.
            if !custom_headers.contains(&h) {
                custom_headers.push(h);
            }
        }
        let query_param = match &cfg.query_param {
            Some(q) if is_valid_key(q) => Some(Box::from(q.as_str())),
            Some(q) => return Err(Error::InvalidQueryParam { name: q.clone() }),
            None => None,
        };
        Ok(KeyExtractor {
            custom_headers,
            query_param,
        })
    }

    /// The configuration this extractor was built from, normalized (lower-case header names,
    /// no repeats): `KeyExtractor::new(&x.config())` reads what `x` reads.
    pub fn config(&self) -> ExtractConfig {
        ExtractConfig {
            custom_headers: self
                .custom_headers
                .iter()
                .map(|h| h.as_str().to_owned())
                .collect(),
            query_param: self.query_param.as_deref().map(str::to_owned),
        }
    }

    /// The standard carriers alone (what [`ExtractConfig::default`] configures), infallibly.
    pub fn standard() -> Self {
        KeyExtractor {
            custom_headers: Vec::new(),
            query_param: None,
        }
    }

    /// The matches for `key`, in the precedence order of the sidecar's extractor
    /// ([`KeyExtractor::extract`]): the configured query parameter, the configured custom headers,
    /// then one per carrier of [`Carrier::ALL`]. For proxies Spur does not run itself (Envoy
    /// through xDS, Istio VirtualServices, Gateway API HTTPRoutes), which each spell a match their
    /// own way; the configured carriers are what the sidecars they stand beside read (the cluster's
    /// `routingKeys` and the namespace's annotations), so the carriers stay one definition.
    ///
    /// A request is routed by key when any one of these matches: proxies OR them by listing one
    /// route (or one match) per entry, since a single match ANDs its conditions.
    pub fn key_matches(&self, key: &str) -> Vec<KeyMatch> {
        let exact = |on| KeyMatch {
            on,
            kind: MatchKind::Exact,
            value: key.to_owned(),
        };
        let mut out = Vec::with_capacity(Carrier::ALL.len() + self.custom_headers.len() + 1);
        if let Some(q) = &self.query_param {
            out.push(exact(MatchOn::Query(q.clone())));
        }
        for h in &self.custom_headers {
            out.push(exact(MatchOn::Header(Cow::Owned(h.as_str().to_owned()))));
        }
        out.extend(Carrier::ALL.iter().map(|c| c.key_match(key)));
        out
    }

    pub fn query_param(&self) -> Option<&str> {
        self.query_param.as_deref()
    }

    /// The configured custom headers, normalized to lowercase, without repeats.
    pub fn custom_headers(&self) -> &[HeaderName] {
        &self.custom_headers
    }

    /// Every header [`KeyExtractor::extract`] reads: the standard carriers' ([`Carrier::ALL`])
    /// and the configured custom headers.
    pub fn headers(&self) -> impl Iterator<Item = &HeaderName> {
        Carrier::header_names().iter().chain(&self.custom_headers)
    }

    /// Candidate keys in precedence order, deduplicated (first position kept), at most
    /// [`MAX_CANDIDATES`], each valid per [`is_valid_key`]. `query` is the raw query string (after
    /// `?`), if any. Precedence:
    ///
    /// 1. the configured query parameter (percent- and `+`-decoded), every occurrence in order;
    /// 2. the configured custom headers, in configured order, value = bare key (OWS-trimmed);
    /// 3. `baggage` members named by [`MEMBER_NAMES`], in that name order, all `baggage` lines
    ///    read as one list (percent-decoded, W3C limits: 8192 bytes, 180 members);
    /// 4. `tracestate` members with the same names (32 members);
    /// 5. the [`LEGACY_HEADERS`], in that order (OWS-trimmed, percent-decoded as Jaeger encodes).
    ///
    /// Values that are not valid keys are skipped silently: hostile input yields fewer
    /// candidates, never an error. Nothing is allocated unless a key had to be percent-decoded.
    pub fn extract<'a>(&self, headers: &'a HeaderMap, query: Option<&'a str>) -> Candidates<'a> {
        let mut out = Candidates::default();
        if let (Some(name), Some(query)) = (self.query_param.as_deref(), query) {
            for (_, value) in query_pairs(query).filter(|(n, _)| *n == name) {
                if let Some(v) = percent_decode(value, true)
                    && out.push(v)
                {
                    return out;
                }
            }
        }
        for name in &self.custom_headers {
            for v in headers.get_all(name) {
                if let Ok(s) = v.to_str()
                    && out.push(Cow::Borrowed(trim_ows(s)))
                {
                    return out;
                }
            }
        }
        let present = present_carriers(headers);
        if present == 0 {
            return out;
        }
        let standard = Carrier::ALL.iter().zip(Carrier::header_names());
        for (i, (carrier, name)) in standard.enumerate() {
            if present & (1 << i) == 0 {
                continue;
            }
            let full = match *carrier {
                Carrier::List { syntax, .. } => {
                    list_candidates(&mut out, headers.get_all(name), syntax)
                }
                Carrier::Bare { .. } => bare_candidates(&mut out, headers.get_all(name)),
            };
            if full {
                return out;
            }
        }
        out
    }
}

/// Which standard carriers a request has: bit i for [`Carrier::ALL`]`[i]`.
///
/// One walk over the distinct names costs less than ten hash lookups of absent names (hashing a
/// custom header name is a byte-at-a-time FNV over ~25 bytes), and most requests carry neither.
fn present_carriers(headers: &HeaderMap) -> u16 {
    const _: () = assert!(Carrier::ALL.len() <= 16, "one bit per carrier");
    let mut present = 0;
    for name in headers.keys() {
        let s = name.as_str();
        if !s
            .as_bytes()
            .first()
            .is_some_and(|&b| FIRST_BYTES[usize::from(b)])
        {
            continue;
        }
        if let Some(i) = Carrier::ALL.iter().position(|c| c.header() == s) {
            present |= 1 << i;
        }
    }
    present
}

/// Pushes the keys of one bare-key header (OWS-trimmed, percent-decoded as Jaeger encodes);
/// `true` once `out` is full.
fn bare_candidates<'a>(out: &mut Candidates<'a>, values: GetAll<'a, HeaderValue>) -> bool {
    for v in values {
        if let Ok(s) = v.to_str()
            && let Some(key) = percent_decode(trim_ows(s), false)
            && out.push(key)
        {
            return true;
        }
    }
    false
}

fn member_index(key: &str) -> Option<usize> {
    if !key.starts_with('s') {
        return None;
    }
    MEMBER_NAMES.iter().position(|n| *n == key)
}

/// Pushes the keys of one list header in [`MEMBER_NAMES`] order; `true` once `out` is full.
///
/// Name order must win over position without buffering values, so each pass pushes the members
/// of one name and notes the lower-precedence names it saw that could still add a candidate. A
/// list is thus read once unless it carries different keys under different names; the usual
/// `sd-routing-key=K,sd-sandbox=K` takes one pass since the second member would add nothing.
fn list_candidates<'a>(
    out: &mut Candidates<'a>,
    values: GetAll<'a, HeaderValue>,
    syntax: Syntax,
) -> bool {
    let mut target = 0;
    loop {
        let mut later = 0u8;
        let mut list = baggage::header_list(values.iter(), syntax);
        let mut index = 0;
        while let Some(m) = list.next_where(|k| {
            member_index(k).is_some_and(|i| {
                index = i;
                i >= target
            })
        }) {
            if index == target {
                let value = match syntax {
                    Syntax::Baggage => m.decode_value(),
                    Syntax::TraceState => Some(Cow::Borrowed(m.value)),
                };
                if let Some(v) = value
                    && out.push(v)
                {
                    return true;
                }
            } else if m.value.contains('%') || (is_valid_key(m.value) && !out.contains(m.value)) {
                later |= 1 << index;
            }
        }
        if later == 0 {
            return false;
        }
        target = later.trailing_zeros() as usize;
    }
}

/// `name=value` pairs of a raw query string; a pair without `=` has an empty value.
fn query_pairs(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
}

/// Removes every `name=...` pair from a path-and-query (`"/a?x=1&sd-routing-key=k&y=2"` becomes
/// `"/a?x=1&y=2"`; the `?` goes if nothing remains; empty pairs such as `&&` are dropped).
///
/// Returns the first occurrence's value that is a valid key once percent-decoded, with the
/// rewritten path-and-query; `None` if the parameter is absent or none of its values is a valid
/// key (the URL is then best left untouched: the parameter is not routing anything).
pub fn strip_query_param(path_and_query: &str, name: &str) -> Option<(String, String)> {
    let (path, query) = path_and_query.split_once('?')?;
    if name.is_empty() || !query.contains(name) {
        return None;
    }
    let key = query_pairs(query)
        .filter(|(n, _)| *n == name)
        .filter_map(|(_, v)| percent_decode(v, true))
        .find(|v| is_valid_key(v))?
        .into_owned();
    let mut rewritten = String::with_capacity(path_and_query.len());
    rewritten.push_str(path);
    let mut sep = '?';
    for pair in query.split('&') {
        if pair.is_empty() || pair.split_once('=').map_or(pair, |(n, _)| n) == name {
            continue;
        }
        rewritten.push(sep);
        rewritten.push_str(pair);
        sep = '&';
    }
    Some((key, rewritten))
}

/// Candidate keys of one request, in precedence order. Stored inline: building one never
/// allocates, and each key is borrowed from the request unless it had to be percent-decoded.
#[derive(Clone, Default)]
pub struct Candidates<'a> {
    keys: [Cow<'a, str>; MAX_CANDIDATES],
    len: usize,
}

type KeyIter<'c, 'a> = Map<slice::Iter<'c, Cow<'a, str>>, fn(&'c Cow<'a, str>) -> &'c str>;

impl<'a> Candidates<'a> {
    /// Adds `key` unless it is invalid or already present; returns `true` once full, so callers
    /// stop scanning carriers that can no longer contribute.
    fn push(&mut self, key: Cow<'a, str>) -> bool {
        if self.len < MAX_CANDIDATES
            && is_valid_key(&key)
            && !self.contains(&key)
            && let Some(slot) = self.keys.get_mut(self.len)
        {
            *slot = key;
            self.len += 1;
        }
        self.len >= MAX_CANDIDATES
    }

    fn contains(&self, key: &str) -> bool {
        self.iter().any(|k| k == key)
    }

    fn as_slice(&self) -> &[Cow<'a, str>] {
        self.keys.get(..self.len).unwrap_or_default()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.into_iter()
    }

    /// The highest-precedence candidate.
    pub fn first(&self) -> Option<&str> {
        self.as_slice().first().map(|k| k.as_ref())
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        self.as_slice().get(i).map(|k| k.as_ref())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'c, 'a> IntoIterator for &'c Candidates<'a> {
    type Item = &'c str;
    type IntoIter = KeyIter<'c, 'a>;

    fn into_iter(self) -> KeyIter<'c, 'a> {
        let as_str: fn(&'c Cow<'a, str>) -> &'c str = |k| k.as_ref();
        self.as_slice().iter().map(as_str)
    }
}

impl fmt::Debug for Candidates<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extractor(custom: &[&str], query: Option<&str>) -> KeyExtractor {
        KeyExtractor::new(&ExtractConfig {
            custom_headers: custom.iter().map(|s| (*s).to_owned()).collect(),
            query_param: query.map(str::to_owned),
        })
        .unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn keys(c: &Candidates<'_>) -> Vec<String> {
        c.iter().map(str::to_owned).collect()
    }

    fn plain(pairs: &[(&str, &str)]) -> Vec<String> {
        keys(&extractor(&[], None).extract(&headers(pairs), None))
    }

    #[test]
    fn key_validity() {
        assert!(is_valid_key("ltj9s8scupb86"));
        assert!(is_valid_key("A.b_c-9"));
        assert!(is_valid_key(&"k".repeat(MAX_KEY_LEN)));
        assert!(!is_valid_key(&"k".repeat(MAX_KEY_LEN + 1)));
        for bad in ["", " k", "k k", "k/", "k%41", "ké", "k,k", "k;p"] {
            assert!(!is_valid_key(bad), "{bad:?}");
        }
    }

    #[test]
    fn config_validation() {
        let bad_header = ExtractConfig {
            custom_headers: vec!["bad header".into()],
            query_param: None,
        };
        assert!(matches!(
            KeyExtractor::new(&bad_header),
            Err(Error::InvalidHeaderName { .. })
        ));
        for standard in ["baggage", "Tracestate", "ot-baggage-sd-routing-key"] {
            let cfg = ExtractConfig {
                custom_headers: vec![standard.into()],
                query_param: None,
            };
            assert!(
                matches!(KeyExtractor::new(&cfg), Err(Error::StandardHeader { .. })),
                "{standard}"
            );
        }
        for reserved in [
            "Host",
            "content-length",
            "transfer-encoding",
            "cookie",
            "x-spur-api-key",
        ] {
            let cfg = ExtractConfig {
                custom_headers: vec![reserved.into()],
                query_param: None,
            };
            assert!(
                matches!(KeyExtractor::new(&cfg), Err(Error::ReservedHeader { .. })),
                "{reserved}"
            );
        }
        for q in ["", "a b", "a&b", "a=b"] {
            let cfg = ExtractConfig {
                custom_headers: vec![],
                query_param: Some(q.into()),
            };
            assert!(
                matches!(
                    KeyExtractor::new(&cfg),
                    Err(Error::InvalidQueryParam { .. })
                ),
                "{q:?}"
            );
        }
        let e = extractor(&["X-Route", "x-route", "x-other"], Some("sd-routing-key"));
        assert_eq!(e.custom_headers(), ["x-route", "x-other"]);
        assert_eq!(e.query_param(), Some("sd-routing-key"));
        let json: ExtractConfig = serde_json::from_str(r#"{"customHeaders":["x-a"]}"#).unwrap();
        assert_eq!(json.custom_headers, ["x-a"]);
        assert_eq!(json.query_param, None);
    }

    #[test]
    fn every_carrier_alone() {
        for name in MEMBER_NAMES {
            assert_eq!(
                plain(&[("baggage", &format!("{name}=k1"))]),
                ["k1"],
                "baggage {name}"
            );
            assert_eq!(
                plain(&[("tracestate", &format!("{name}=k1"))]),
                ["k1"],
                "tracestate {name}"
            );
        }
        for name in LEGACY_HEADERS {
            assert_eq!(plain(&[(name, " k1 ")]), ["k1"], "{name}");
        }
        let e = extractor(&["x-route"], Some("rk"));
        assert_eq!(
            keys(&e.extract(&headers(&[("x-route", "\tk1 ")]), None)),
            ["k1"]
        );
        assert_eq!(
            keys(&e.extract(&HeaderMap::new(), Some("a=1&rk=k1"))),
            ["k1"]
        );
        assert!(
            e.extract(
                &headers(&[("x-other", "k1"), ("accept", "*/*")]),
                Some("x=1")
            )
            .is_empty()
        );
    }

    #[test]
    fn precedence_across_carriers() {
        let e = extractor(&["x-b", "x-a"], Some("rk"));
        let h = headers(&[
            ("uberctx-sd-routing-key", "legacy2"),
            ("ot-baggage-sd-sandbox", "legacy1"),
            ("tracestate", "sd-routing-key=ts"),
            (
                "baggage",
                "sd-workspace=bw,sd-routing-key=brk,sd-sandbox=bs,spur-routing-key=bspur",
            ),
            ("x-a", "ha"),
            ("x-b", "hb"),
        ]);
        let c = e.extract(&h, Some("rk=q"));
        assert_eq!(
            keys(&c),
            ["q", "hb", "ha", "brk", "bspur", "bs", "bw", "ts"],
            "{c:?}"
        );
        assert_eq!(c.len(), MAX_CANDIDATES);
        let c = e.extract(&h, None);
        assert_eq!(
            keys(&c),
            ["hb", "ha", "brk", "bspur", "bs", "bw", "ts", "legacy1"]
        );
        assert_eq!(c.first(), Some("hb"));
        assert_eq!(c.get(7), Some("legacy1"));
        assert_eq!(c.get(8), None);
    }

    #[test]
    fn legacy_header_order() {
        let pairs: Vec<(&str, String)> = LEGACY_HEADERS
            .iter()
            .rev()
            .map(|n| (*n, format!("v-{n}")))
            .collect();
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let expected: Vec<String> = LEGACY_HEADERS.iter().map(|n| format!("v-{n}")).collect();
        assert_eq!(plain(&pairs), expected);
    }

    #[test]
    fn dedup_keeps_first_position() {
        let got = plain(&[
            ("baggage", "sd-sandbox=a,sd-routing-key=b,sd-routing-key=a"),
            ("tracestate", "sd-routing-key=a,sd-sandbox=c"),
            ("uberctx-sd-routing-key", "b"),
        ]);
        assert_eq!(got, ["b", "a", "c"]);
    }

    #[test]
    fn several_baggage_headers_form_one_list() {
        // Name order wins over line order: sd-routing-key on the second line beats sd-sandbox on the first.
        let got = plain(&[
            ("baggage", "other=1,sd-sandbox=s1"),
            ("baggage", "sd-routing-key=r1"),
            ("baggage", ""),
        ]);
        assert_eq!(got, ["r1", "s1"]);
    }

    #[test]
    fn baggage_ows_properties_and_encoding() {
        assert_eq!(
            plain(&[("baggage", "a=1 , sd-routing-key = k1 ;prop=1;flag ,b=2")]),
            ["k1"]
        );
        assert_eq!(plain(&[("baggage", "sd-routing-key=k%2D1%5F")]), ["k-1_"]);
        let h = headers(&[("baggage", "sd-routing-key=k1")]);
        let e = extractor(&[], None);
        let c = e.extract(&h, None);
        assert!(
            matches!(c.keys[0], Cow::Borrowed(_)),
            "no copy without encoding"
        );
    }

    #[test]
    fn invalid_values_are_skipped() {
        let got = plain(&[
            (
                "baggage",
                "sd-routing-key=bad%zz,sd-routing-key=has%20space,sd-routing-key=,sd-sandbox=ok1",
            ),
            ("tracestate", "sd-routing-key=%41"),
            ("ot-baggage-sd-routing-key", "a,b"),
            ("uberctx-sd-routing-key", &"x".repeat(MAX_KEY_LEN + 1)),
            ("uberctx-sd-sandbox", "ok2"),
        ]);
        assert_eq!(got, ["ok1", "ok2"]);
    }

    #[test]
    fn non_utf8_header_values_are_skipped() {
        let mut h = HeaderMap::new();
        h.append(
            "baggage",
            HeaderValue::from_bytes(b"sd-routing-key=\xffk").unwrap(),
        );
        h.append("baggage", HeaderValue::from_static("sd-sandbox=good"));
        h.append(
            "uberctx-sd-routing-key",
            HeaderValue::from_bytes(b"\xe2\x98\x95").unwrap(),
        );
        h.append("x-route", HeaderValue::from_bytes(b"k\xff").unwrap());
        let c = extractor(&["x-route"], None).extract(&h, None);
        assert_eq!(keys(&c), ["good"]);
    }

    #[test]
    fn limits_bound_the_work() {
        // 10 000 baggage lines: only the first 8192 bytes count.
        let mut h = HeaderMap::new();
        for i in 0..10_000 {
            h.append(
                "baggage",
                HeaderValue::from_str(&format!("m{i}=v")).unwrap(),
            );
        }
        h.append("baggage", HeaderValue::from_static("sd-routing-key=late"));
        assert!(extractor(&[], None).extract(&h, None).is_empty());

        // A member beyond the 180th is ignored even within the byte budget.
        let many: String = (0..180).map(|i| format!("m{i}=v,")).collect();
        assert!(plain(&[("baggage", &format!("{many}sd-routing-key=late"))]).is_empty());
        let some: String = (0..179).map(|i| format!("m{i}=v,")).collect();
        assert_eq!(
            plain(&[("baggage", &format!("{some}sd-routing-key=ok"))]),
            ["ok"]
        );

        // 1 MB of commas, a lone '%'.
        let commas = ",".repeat(1 << 20);
        assert!(plain(&[("baggage", &commas), ("tracestate", &commas)]).is_empty());
        assert!(plain(&[("baggage", "sd-routing-key=%")]).is_empty());

        // More than MAX_CANDIDATES distinct keys: the first eight win.
        let lots: String = (0..20).map(|i| format!("sd-routing-key=k{i},")).collect();
        let got = plain(&[("baggage", &lots)]);
        assert_eq!(got.len(), MAX_CANDIDATES);
        assert_eq!(got[7], "k7");
    }

    #[test]
    fn query_parameter_carrier() {
        let e = extractor(&[], Some("sd-routing-key"));
        let q = |s: &'static str| keys(&e.extract(&HeaderMap::new(), Some(s)));
        assert_eq!(q("sd-routing-key=k1&sd-routing-key=k2"), ["k1", "k2"]);
        assert_eq!(
            q("sd-routing-keyx=no&xsd-routing-key=no"),
            Vec::<String>::new()
        );
        assert_eq!(q("a&&sd-routing-key=k%2D1"), ["k-1"]);
        assert_eq!(
            q("sd-routing-key=a+b&sd-routing-key&sd-routing-key=%&sd-routing-key=ok"),
            ["ok"]
        );
        // Without a configured parameter the query string is ignored.
        assert!(
            extractor(&[], None)
                .extract(&HeaderMap::new(), Some("sd-routing-key=k1"))
                .is_empty()
        );
    }

    #[test]
    fn strip_query_param_cases() {
        let s = |pq: &str| strip_query_param(pq, "sd-routing-key");
        let kv = |k: &str, pq: &str| Some((k.to_owned(), pq.to_owned()));
        assert_eq!(s("/a?x=1&sd-routing-key=k&y=2"), kv("k", "/a?x=1&y=2"));
        assert_eq!(s("/a?sd-routing-key=k"), kv("k", "/a"));
        assert_eq!(s("/?sd-routing-key=k&"), kv("k", "/"));
        assert_eq!(s("/a?&&sd-routing-key=k&&x=1&&"), kv("k", "/a?x=1"));
        assert_eq!(
            s("/a?sd-routing-key=k1&x=1&sd-routing-key=k2"),
            kv("k1", "/a?x=1")
        );
        assert_eq!(
            s("/a?sd-routing-key=bad%20&sd-routing-key=k2"),
            kv("k2", "/a"),
            "first valid value"
        );
        assert_eq!(s("/a?sd-routing-key=k%2D1"), kv("k-1", "/a"));
        assert_eq!(
            s("/a?sd-routing-keyx=1&x=sd-routing-key"),
            None,
            "prefix or value is not the parameter"
        );
        assert_eq!(
            s("/a?sd-routing-keyx=1&sd-routing-key=k"),
            kv("k", "/a?sd-routing-keyx=1")
        );
        assert_eq!(s("/a"), None);
        assert_eq!(s("/a?"), None);
        assert_eq!(s("/a?sd-routing-key="), None, "no valid key");
        assert_eq!(s("/a?sd-routing-key=%zz"), None);
        assert_eq!(strip_query_param("/a?=1", ""), None);
    }
}
