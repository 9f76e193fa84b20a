//! Trace ids from a request's trace-context headers, and which traces a sidecar records.
//!
//! A sidecar keeps a small record of the requests of a few traces (which hop saw a routing key,
//! and through which carriers), so `spur doctor propagation` can show where a keyed request's
//! key was dropped (docs/routing-keys.md, "Which service dropped the key"). The traces recorded
//! are chosen by their id alone, [`is_recorded`]: one random trace in 65 536, and every trace
//! `spur doctor` starts, whose id it makes to match. Every hop decides alike, without
//! coordination and whatever the app's tracer sampled.
//!
//! The ids come from the three header formats in use: W3C `traceparent`, Zipkin's B3 (the
//! single `b3` header and the multi-header `x-b3-traceid`) and Jaeger's `uber-trace-id`. The
//! parsers are strict (lowercase hex where the format says so, exact field counts, bounded
//! lengths) and refuse an all-zero id, which every format calls invalid.

/// The trace-context carriers, in the order a record lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TraceCarrier {
    /// W3C `traceparent: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`.
    TraceParent,
    /// B3 single header `b3: <trace id>-<span id>[-<sampling>[-<parent id>]]`.
    B3,
    /// B3 multi-header `x-b3-traceid: <16 or 32 hex>`.
    B3Multi,
    /// Jaeger `uber-trace-id: <trace id>:<span id>:<parent id>:<flags>`.
    Uber,
}

impl TraceCarrier {
    pub const ALL: [TraceCarrier; 4] = [
        TraceCarrier::TraceParent,
        TraceCarrier::B3,
        TraceCarrier::B3Multi,
        TraceCarrier::Uber,
    ];

    /// The header name, lowercase.
    pub const fn header(self) -> &'static str {
        match self {
            TraceCarrier::TraceParent => "traceparent",
            TraceCarrier::B3 => "b3",
            TraceCarrier::B3Multi => "x-b3-traceid",
            TraceCarrier::Uber => "uber-trace-id",
        }
    }

    /// The header name, for lookups that need no parse of a string (made once, at compile
    /// time: `HeaderName::from_static` at run time would check the name on every call).
    pub fn header_name(self) -> &'static http::HeaderName {
        static NAMES: [http::HeaderName; 4] = [
            http::HeaderName::from_static(TraceCarrier::TraceParent.header()),
            http::HeaderName::from_static(TraceCarrier::B3.header()),
            http::HeaderName::from_static(TraceCarrier::B3Multi.header()),
            http::HeaderName::from_static(TraceCarrier::Uber.header()),
        ];
        &NAMES[self as usize]
    }

    /// The carrier a header name (any case) is.
    pub fn of(name: &[u8]) -> Option<TraceCarrier> {
        TraceCarrier::ALL
            .into_iter()
            .find(|c| c.header().as_bytes().eq_ignore_ascii_case(name))
    }

    /// Whether a value of this header may hold a recorded trace id: the last four digits of its
    /// id field are those of [`RECORDED_SUFFIX`]. A test of four bytes at a known place, so a
    /// request of a trace that is not recorded is dismissed without parsing its id; a value
    /// that passes still goes through [`TraceCarrier::trace_id`].
    pub fn may_be_recorded(self, v: &[u8]) -> bool {
        let field_end = |stop: &[u8]| {
            v.iter()
                .take(33)
                .position(|b| stop.contains(b))
                .unwrap_or(v.len().min(33))
        };
        let end = match self {
            TraceCarrier::TraceParent => 35,
            TraceCarrier::B3 => field_end(b"-"),
            TraceCarrier::B3Multi => v.len(),
            TraceCarrier::Uber => field_end(b":%"),
        };
        end >= 4 && v.get(end - 4..end) == Some(&RECORDED_DIGITS[..])
    }

    /// The trace id in a value of this header, if the value is well-formed.
    pub fn trace_id(self, value: &[u8]) -> Option<u128> {
        match self {
            TraceCarrier::TraceParent => traceparent(value),
            TraceCarrier::B3 => b3(value),
            TraceCarrier::B3Multi => b3_trace_id(value),
            TraceCarrier::Uber => uber(value),
        }
    }
}

/// The low 16 bits of a recorded trace's id.
pub const RECORDED_SUFFIX: u16 = 0x5b0d;
/// [`RECORDED_SUFFIX`] as the formats write it: the last four hex digits of the id.
const RECORDED_DIGITS: [u8; 4] = *b"5b0d";

/// Whether sidecars record the hops of the trace with this id: its low 16 bits are
/// [`RECORDED_SUFFIX`] (for a 64-bit B3 or Jaeger id, its own low bits).
pub fn is_recorded(trace_id: u128) -> bool {
    trace_id & 0xffff == u128::from(RECORDED_SUFFIX)
}

/// A trace id sidecars record, from 128 random bits (the caller's): their low 16 bits replaced.
pub fn recorded_id(random: u128) -> u128 {
    let id = (random & !0xffff) | u128::from(RECORDED_SUFFIX);
    // Never the invalid all-zero id: the suffix alone is non-zero, so `id` never is.
    debug_assert!(id != 0);
    id
}

/// The id as the formats write a 128-bit id: 32 lowercase hex digits.
pub fn format_id(id: u128) -> String {
    format!("{id:032x}")
}

/// `len` lowercase hex digits (no more, no fewer).
fn lower_hex(s: &[u8], len: usize) -> Option<u128> {
    if s.len() != len || len > 32 {
        return None;
    }
    let mut v: u128 = 0;
    for &b in s {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => return None,
        };
        v = (v << 4) | u128::from(d);
    }
    Some(v)
}

fn non_zero(v: u128) -> Option<u128> {
    (v != 0).then_some(v)
}

/// W3C Trace Context, level 1: version `00` is exactly 55 bytes; a later version (not `ff`) may
/// append `-`-led fields, which are ignored, as the specification tells a parser to.
fn traceparent(v: &[u8]) -> Option<u128> {
    if v.len() < 55 || v.len() > 512 {
        return None;
    }
    let version = lower_hex(&v[0..2], 2)?;
    if version == 0xff || (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let id = lower_hex(&v[3..35], 32)?;
    let parent = lower_hex(&v[36..52], 16)?;
    lower_hex(&v[53..55], 2)?;
    if parent == 0 {
        return None;
    }
    non_zero(id)
}

/// A B3 trace id: 16 or 32 lowercase hex digits.
fn b3_trace_id(v: &[u8]) -> Option<u128> {
    match v.len() {
        16 | 32 => non_zero(lower_hex(v, v.len())?),
        _ => None,
    }
}

/// B3 single header: `{trace id}-{span id}`, optionally `-{sampling}` and `-{parent span id}`.
/// A bare sampling decision (`0`, `1`, `d`) carries no trace id.
fn b3(v: &[u8]) -> Option<u128> {
    if v.len() > 128 {
        return None;
    }
    let mut fields = v.split(|&b| b == b'-');
    let id = b3_trace_id(fields.next()?)?;
    let span = fields.next()?;
    if span.len() != 16 || lower_hex(span, 16)? == 0 {
        return None;
    }
    if let Some(sampling) = fields.next()
        && !matches!(sampling, b"0" | b"1" | b"d")
    {
        return None;
    }
    if let Some(parent) = fields.next()
        && (parent.len() != 16 || lower_hex(parent, 16)? == 0)
    {
        return None;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(id)
}

/// The four fields of an `uber-trace-id`, split at `:` or at its URL-encoded form `%3A` (which
/// some Jaeger clients send), one separator kind per value.
fn uber_fields(v: &[u8]) -> Option<[&[u8]; 4]> {
    let encoded = !v.contains(&b':');
    let sep: &[u8] = if encoded { b"%3a" } else { b":" };
    let mut out: [&[u8]; 4] = [&[]; 4];
    let mut rest = v;
    for (i, slot) in out.iter_mut().enumerate() {
        if i == 3 {
            *slot = rest;
            break;
        }
        let at = rest
            .windows(sep.len())
            .position(|w| w.eq_ignore_ascii_case(sep))?;
        *slot = &rest[..at];
        rest = &rest[at + sep.len()..];
    }
    // A fifth field (a separator left in the last one) is malformed; so is a stray `%`.
    if out[3].contains(&b':') || out[3].contains(&b'%') {
        return None;
    }
    Some(out)
}

/// Jaeger: `{trace id}:{span id}:{parent span id}:{flags}`, the ids 1 to 32 (trace) and 1 to 16
/// (spans) hex digits, as Jaeger clients write them without leading zeros.
fn uber(v: &[u8]) -> Option<u128> {
    if v.len() > 128 {
        return None;
    }
    let [id, span, parent, flags] = uber_fields(v)?;
    let hex = |s: &[u8], max: usize| {
        if s.is_empty() || s.len() > max {
            return None;
        }
        lower_hex(s, s.len())
    };
    let id = hex(id, 32)?;
    if hex(span, 16)? == 0 {
        return None;
    }
    hex(parent, 16)?;
    if flags.is_empty() || flags.len() > 2 || hex(flags, 2).is_none() {
        return None;
    }
    non_zero(id)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const ID: u128 = 0x4bf92f3577b34da6a3ce929d0e0e4736;

    #[test]
    fn traceparent_is_read_strictly() {
        let ok = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(TraceCarrier::TraceParent.trace_id(ok), Some(ID));
        // A later version may carry more fields; version 00 may not.
        let later = b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever";
        assert_eq!(TraceCarrier::TraceParent.trace_id(later), Some(ID));
        for bad in [
            &b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x"[..],
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            b"",
        ] {
            assert_eq!(
                TraceCarrier::TraceParent.trace_id(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn b3_single_and_multi() {
        let b3 = TraceCarrier::B3;
        assert_eq!(
            b3.trace_id(b"4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1"),
            Some(ID)
        );
        assert_eq!(
            b3.trace_id(b"a3ce929d0e0e4736-00f067aa0ba902b7"),
            Some(0xa3ce929d0e0e4736)
        );
        assert_eq!(
            b3.trace_id(b"a3ce929d0e0e4736-00f067aa0ba902b7-d-05e3ac9a4f6e3b90"),
            Some(0xa3ce929d0e0e4736)
        );
        for bad in [
            &b"0"[..],
            b"1",
            b"a3ce929d0e0e4736",
            b"a3ce929d0e0e4736-00f067aa0ba902b7-2",
            b"a3ce929d0e0e4736-00f067aa0ba902b7-1-05e3ac9a4f6e3b90-x",
            b"a3ce929d0e0e473-00f067aa0ba902b7",
            b"0000000000000000-00f067aa0ba902b7",
        ] {
            assert_eq!(b3.trace_id(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let multi = TraceCarrier::B3Multi;
        assert_eq!(
            multi.trace_id(b"a3ce929d0e0e4736"),
            Some(0xa3ce929d0e0e4736)
        );
        assert_eq!(
            multi.trace_id(b"4bf92f3577b34da6a3ce929d0e0e4736"),
            Some(ID)
        );
        assert_eq!(multi.trace_id(b"a3ce929d0e0e473"), None);
    }

    #[test]
    fn uber_trace_id_allows_unpadded_ids() {
        let u = TraceCarrier::Uber;
        assert_eq!(
            u.trace_id(b"4bf92f3577b34da6a3ce929d0e0e4736:00f067aa0ba902b7:0:1"),
            Some(ID)
        );
        assert_eq!(u.trace_id(b"5b0d:1:0:01"), Some(0x5b0d));
        // URL-encoded, as jaeger-client-java and others send it.
        assert_eq!(u.trace_id(b"5b0d%3A1%3A0%3A1"), Some(0x5b0d));
        assert_eq!(u.trace_id(b"5b0d%3a1%3a0%3a1"), Some(0x5b0d));
        for bad in [
            &b"5b0d:1:0"[..],
            b"5b0d:1:0:1:2",
            b"0:1:0:1",
            b"5b0d:0:0:1",
            b"5b0d:1:0:",
            b"5b0d%3A1%3A0",
            b"5b0d%3A1:0%3A1",
            b"5b0d%3A1%3A0%3A1%3A2",
            b"5B0D:1:0:1",
        ] {
            assert_eq!(u.trace_id(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    /// The four-byte pre-test never turns away a value whose id is recorded.
    #[test]
    fn the_pre_test_agrees_with_the_parse() {
        let id = format_id(recorded_id(ID));
        let short = &id[16..];
        let values: [(TraceCarrier, String); 8] = [
            (
                TraceCarrier::TraceParent,
                format!("00-{id}-00f067aa0ba902b7-01"),
            ),
            (TraceCarrier::B3, format!("{id}-00f067aa0ba902b7-1")),
            (TraceCarrier::B3, format!("{short}-00f067aa0ba902b7")),
            (TraceCarrier::B3Multi, id.clone()),
            (TraceCarrier::B3Multi, short.to_string()),
            (TraceCarrier::Uber, format!("{id}:1:0:1")),
            (TraceCarrier::Uber, "5b0d%3A1%3A0%3A1".to_string()),
            (TraceCarrier::Uber, "5b0d:1:0:1".to_string()),
        ];
        for (c, v) in &values {
            assert!(c.may_be_recorded(v.as_bytes()), "{c:?} {v}");
            assert!(
                c.trace_id(v.as_bytes()).is_some_and(is_recorded),
                "{c:?} {v}"
            );
            let other = v.replacen("5b0d", "5b0e", 1);
            assert!(!c.may_be_recorded(other.as_bytes()), "{c:?} {other}");
        }
        assert!(!TraceCarrier::Uber.may_be_recorded(b"b0d:1:0:1"));
        assert!(!TraceCarrier::TraceParent.may_be_recorded(b"00-5b0d"));
    }

    #[test]
    fn recorded_ids_are_chosen_by_their_low_bits() {
        let id = recorded_id(ID);
        assert!(is_recorded(id));
        assert_eq!(id >> 16, ID >> 16);
        assert!(!is_recorded(ID));
        assert!(is_recorded(recorded_id(0)));
        // A 64-bit id and its 128-bit form (zero-extended) decide alike.
        assert!(is_recorded(0xa3ce929d0e0e5b0d));
        assert_eq!(format_id(id).len(), 32);
        assert_eq!(
            TraceCarrier::of(b"TraceParent"),
            Some(TraceCarrier::TraceParent)
        );
        assert_eq!(TraceCarrier::of(b"x-b3-spanid"), None);
        for c in TraceCarrier::ALL {
            assert_eq!(c.header_name().as_str(), c.header());
        }
    }
}
