//! Fuzzes the W3C `baggage` / `tracestate` list parsers: arbitrary bytes, one header line per `\n`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spur_routing::baggage::{
    List, MAX_BAGGAGE_MEMBERS, MAX_BYTES, MAX_TRACESTATE_MEMBERS, Syntax, encode_value,
    is_baggage_octet, is_token, members,
};

fuzz_target!(|data: &[u8]| {
    let lines = || data.split(|&b| b == b'\n');

    let mut seen = 0;
    let mut bytes = 0;
    for m in List::new(lines(), Syntax::Baggage) {
        seen += 1;
        bytes += m.raw.len();
        assert!(is_token(m.key), "{m:?}");
        assert!(m.value.bytes().all(is_baggage_octet), "{m:?}");
        assert!(m.raw.contains(m.key) && m.raw.contains(m.value), "{m:?}");
        // A decoded value re-encodes to something that parses back to the same value.
        if let Some(v) = m.decode_value() {
            let mut line = String::from("k=");
            encode_value(&v, &mut line);
            let back: Vec<_> = members(&line).collect();
            assert_eq!(back.len(), 1, "{line:?}");
            assert_eq!(back[0].value, v);
        }
    }
    assert!(seen <= MAX_BAGGAGE_MEMBERS);
    assert!(bytes <= MAX_BYTES);

    let mut seen = 0;
    for m in List::new(lines(), Syntax::TraceState) {
        seen += 1;
        assert!(
            !m.key.is_empty() && !m.value.is_empty() && m.properties.is_empty(),
            "{m:?}"
        );
        assert!(!m.value.contains(',') && !m.value.contains('='), "{m:?}");
    }
    assert!(seen <= MAX_TRACESTATE_MEMBERS);

    if let Ok(s) = std::str::from_utf8(data) {
        for m in members(s) {
            assert!(is_token(m.key));
        }
    }
});
