//! Fuzzes key extraction, query-parameter stripping and injection on arbitrary requests.
//!
//! Input: the first line is the query string; every further line is `<n><value>` where the byte
//! `<n>` picks a header name (mostly the carriers extraction reads) and `<value>` is the raw value.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use spur_routing::extract::{LEGACY_HEADERS, MAX_CANDIDATES, is_valid_key, strip_query_param};
use spur_routing::inject::inject_key;
use spur_routing::{ExtractConfig, KeyExtractor};

/// Header names the input picks from: every carrier extraction reads, plus one it ignores.
const OTHER_NAMES: [&str; 4] = ["baggage", "tracestate", "x-route", "accept"];

fn header_name(n: u8) -> &'static str {
    let i = usize::from(n) % (OTHER_NAMES.len() + LEGACY_HEADERS.len());
    OTHER_NAMES
        .get(i)
        .copied()
        .unwrap_or_else(|| LEGACY_HEADERS[i - OTHER_NAMES.len()])
}

fn check(extractor: &KeyExtractor, headers: &HeaderMap, query: Option<&str>) {
    let c = extractor.extract(headers, query);
    assert!(c.len() <= MAX_CANDIDATES);
    let keys: Vec<&str> = c.iter().collect();
    assert_eq!(keys.len(), c.len());
    for (i, k) in keys.iter().enumerate() {
        assert!(is_valid_key(k), "{k:?}");
        assert!(!keys[..i].contains(k), "duplicate {k:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(extractor) = KeyExtractor::new(&ExtractConfig {
        custom_headers: vec!["x-route".into()],
        query_param: Some("sd-routing-key".into()),
    }) else {
        return;
    };
    let mut lines = data.split(|&b| b == b'\n');
    let query = lines
        .next()
        .and_then(|q| std::str::from_utf8(q).ok())
        .unwrap_or("");
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some((&n, value)) = line.split_first() else {
            continue;
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        headers.append(HeaderName::from_static(header_name(n)), value);
    }

    check(&extractor, &headers, Some(query));
    check(&extractor, &headers, None);

    let path_and_query = format!("/p?{query}");
    if let Some((key, rewritten)) = strip_query_param(&path_and_query, "sd-routing-key") {
        assert!(is_valid_key(&key));
        let q = rewritten.split_once('?').map_or("", |(_, q)| q);
        assert!(
            q.is_empty()
                || q.split('&')
                    .all(|p| !p.is_empty() && p.split('=').next() != Some("sd-routing-key")),
            "{rewritten:?}"
        );

        // What the proxy does next: the lifted key must come out first.
        let mut injected = headers.clone();
        inject_key(&mut injected, &key, extractor.custom_headers());
        let c = extractor.extract(&injected, Some(q));
        assert_eq!(c.first(), Some(key.as_str()));
        check(&extractor, &injected, Some(q));
    }
});
