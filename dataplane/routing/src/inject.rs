//! Writing a routing key into a request: the redundant header set every instrumented hop reads.
//!
//! Used when a Spur component is the one that knows the key (preview URLs, query-parameter
//! routing, jobs). Writing every carrier means the next hop propagates the key whichever
//! propagation library it uses, and writing the key first means it wins over any stale key.

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::baggage::{self, MAX_BYTES, Syntax};
use crate::carrier::{Carrier, MEMBER_NAMES, WRITTEN_MEMBERS};
use crate::extract::is_valid_key;

/// Writes the redundant header set carrying `key`:
/// - `baggage: sd-routing-key=K,sd-sandbox=K,<other members>`: existing `sd-routing-key`,
///   `spur-routing-key`, `sd-sandbox` and `sd-workspace` members are removed, other well-formed
///   members kept byte for byte (all `baggage` lines merge into one), within the W3C limits;
/// - `tracestate: sd-routing-key=K,sd-sandbox=K,<other members>`, new entries on the left as
///   trace-context requires, at most 32 entries;
/// - `ot-baggage-sd-routing-key`, `ot-baggage-sd-sandbox`, `uberctx-sd-routing-key`,
///   `uberctx-sd-sandbox` and each `custom` header set to K (other `ot-baggage-`/`uberctx-` key
///   headers removed).
///
/// Never panics; does nothing if `key` is not valid per [`is_valid_key`].
pub fn inject_key(headers: &mut HeaderMap, key: &str, custom: &[HeaderName]) {
    if !is_valid_key(key) {
        return;
    }
    let Ok(bare) = HeaderValue::from_str(key) else {
        return;
    };

    // Every list first, then the bare headers: removals before insertions, so the headers
    // written come out in the table's order.
    let standard = || Carrier::ALL.into_iter().zip(Carrier::header_names());
    for (carrier, name) in standard() {
        if let Carrier::List { syntax, .. } = carrier
            && let Ok(v) = HeaderValue::try_from(rewrite_list(headers, name, syntax, key))
        {
            headers.insert(name.clone(), v);
        }
    }
    for (carrier, name) in standard() {
        if let Carrier::Bare { written: false, .. } = carrier {
            headers.remove(name);
        }
    }
    for (carrier, name) in standard() {
        if let Carrier::Bare { written: true, .. } = carrier {
            headers.insert(name.clone(), bare.clone());
        }
    }
    for name in custom {
        headers.insert(name.clone(), bare.clone());
    }
}

/// The new value of one list header: the key members first, then the existing members that do
/// not name a key, as long as the result stays within `max_members` and [`MAX_BYTES`].
///
/// Malformed existing members are dropped rather than copied: several SDKs reject a whole
/// `baggage` header over one bad member, which would lose the key this function exists to send.
/// For the same reason the result never exceeds the limits those SDKs enforce.
fn rewrite_list(headers: &HeaderMap, name: &HeaderName, syntax: Syntax, key: &str) -> String {
    let max_members = syntax.max_members();
    let mut out = String::with_capacity(64);
    for (i, member) in WRITTEN_MEMBERS.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(member);
        out.push('=');
        out.push_str(key);
    }
    let mut count = WRITTEN_MEMBERS.len();
    for m in baggage::header_list(headers.get_all(name), syntax) {
        if count >= max_members {
            break;
        }
        if names_a_key(m.key) {
            continue;
        }
        if out.len() + 1 + m.raw.len() > MAX_BYTES {
            break;
        }
        out.push(',');
        out.push_str(m.raw);
        count += 1;
    }
    out
}

/// Whether an existing member's name reads as one of [`MEMBER_NAMES`] to any propagation
/// library downstream. Spur itself matches names exactly, but OpenTelemetry JS percent-decodes
/// member names and OpenTelemetry Python also takes `+` for a space and trims; some compare
/// without regard to case. A spelling only they read as a key name (`sd%2Drouting-key`,
/// `sd-routing-key+`, `SD-Routing-Key`) would survive next to the injected key and win in the
/// app's own outgoing calls, so the next hop would route by the caller's key. Such members are
/// dropped as the exact names are. Double-encoded names decode to something with a `%` in it,
/// which no library reads as a key name.
fn names_a_key(name: &str) -> bool {
    let is_member = |n: &str| MEMBER_NAMES.iter().any(|m| m.eq_ignore_ascii_case(n));
    is_member(name) || baggage::percent_decode(name, true).is_some_and(|d| is_member(d.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baggage::{MAX_BAGGAGE_MEMBERS, MAX_TRACESTATE_MEMBERS, members};
    use crate::carrier::LEGACY_HEADERS;
    use crate::extract::{ExtractConfig, KeyExtractor};

    fn extract_all(h: &HeaderMap) -> Vec<String> {
        KeyExtractor::new(&ExtractConfig::default())
            .unwrap()
            .extract(h, None)
            .iter()
            .map(str::to_owned)
            .collect()
    }

    fn get<'h>(h: &'h HeaderMap, name: &str) -> Vec<&'h str> {
        h.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    }

    /// The bare headers written, as the docs of [`inject_key`] list them.
    const WRITTEN_HEADERS: [&str; 4] = [
        "ot-baggage-sd-routing-key",
        "ot-baggage-sd-sandbox",
        "uberctx-sd-routing-key",
        "uberctx-sd-sandbox",
    ];

    #[test]
    fn writes_the_redundant_set() {
        let mut h = HeaderMap::new();
        let custom = [HeaderName::from_static("x-route")];
        inject_key(&mut h, "k1", &custom);
        assert_eq!(get(&h, "baggage"), ["sd-routing-key=k1,sd-sandbox=k1"]);
        assert_eq!(get(&h, "tracestate"), ["sd-routing-key=k1,sd-sandbox=k1"]);
        for name in WRITTEN_HEADERS {
            assert_eq!(get(&h, name), ["k1"], "{name}");
        }
        let written = Carrier::ALL.iter().filter_map(|c| match c {
            Carrier::Bare {
                header,
                written: true,
            } => Some(*header),
            _ => None,
        });
        assert!(written.eq(WRITTEN_HEADERS), "the table writes these four");
        assert!(WRITTEN_HEADERS.iter().all(|h| LEGACY_HEADERS.contains(h)));
        assert_eq!(get(&h, "x-route"), ["k1"]);
        assert_eq!(h.len(), 7);
    }

    #[test]
    fn replaces_old_keys_and_keeps_other_members() {
        let mut h = HeaderMap::new();
        h.append(
            "baggage",
            HeaderValue::from_static("userId=alice;p=1, sd-routing-key=old"),
        );
        h.append(
            "baggage",
            HeaderValue::from_static(
                "sd-workspace=old2,spur-routing-key=old3,x=caf%C3%A9,bad member",
            ),
        );
        h.append(
            "tracestate",
            HeaderValue::from_static("congo=t61rcWkgMzE,sd-sandbox=old,rojo=00f067aa0ba902b7"),
        );
        h.append("ot-baggage-sd-workspace", HeaderValue::from_static("old"));
        h.append("uberctx-sd-routing-key", HeaderValue::from_static("old"));
        h.append("x-route", HeaderValue::from_static("old"));
        inject_key(&mut h, "new", &[HeaderName::from_static("x-route")]);
        assert_eq!(
            get(&h, "baggage"),
            ["sd-routing-key=new,sd-sandbox=new,userId=alice;p=1,x=caf%C3%A9"]
        );
        assert_eq!(
            get(&h, "tracestate"),
            ["sd-routing-key=new,sd-sandbox=new,congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"]
        );
        assert!(h.get("ot-baggage-sd-workspace").is_none());
        assert_eq!(get(&h, "uberctx-sd-routing-key"), ["new"]);
        assert_eq!(get(&h, "x-route"), ["new"]);
        assert_eq!(extract_all(&h), ["new"], "no stale key survives");
    }

    /// Spellings that OpenTelemetry JS (names percent-decoded) or Python (`+` as a space,
    /// trimmed) read as a key name are dropped too: kept, they would override the injected key
    /// in the app's outgoing calls (issue 42, point 10).
    #[test]
    fn spellings_other_libraries_read_as_key_names_are_dropped() {
        let mut h = HeaderMap::new();
        h.append(
            "baggage",
            HeaderValue::from_static(
                "sd%2Drouting-key=other,sd-routing-key+=other2,SD-Sandbox=other3,\
                 sd-work%73pace=other4,%73d-routing-key=other5,sd%252Drouting-key=kept,a%2Db=1",
            ),
        );
        inject_key(&mut h, "new", &[]);
        assert_eq!(
            get(&h, "baggage"),
            ["sd-routing-key=new,sd-sandbox=new,sd%252Drouting-key=kept,a%2Db=1"]
        );
        assert_eq!(extract_all(&h), ["new"]);
    }

    #[test]
    fn round_trip_key_comes_first() {
        let mut h = HeaderMap::new();
        h.append("baggage", HeaderValue::from_static("a=1"));
        h.append("uberctx-sd-sandbox", HeaderValue::from_static("other"));
        inject_key(&mut h, "ltj9s8scupb86", &[]);
        assert_eq!(
            extract_all(&h).first().map(String::as_str),
            Some("ltj9s8scupb86")
        );
        let value = h.get("baggage").unwrap().to_str().unwrap();
        assert!(members(value).any(|m| m.key == "a" && m.value == "1"));
    }

    #[test]
    fn respects_limits() {
        let mut h = HeaderMap::new();
        let many: String = (0..200).map(|i| format!("m{i}=v,")).collect();
        h.insert("baggage", HeaderValue::from_str(&many).unwrap());
        let ts: String = (0..32).map(|i| format!("t{i}=v,")).collect();
        h.insert("tracestate", HeaderValue::from_str(&ts).unwrap());
        inject_key(&mut h, "k", &[]);
        let b = h.get("baggage").unwrap().to_str().unwrap();
        assert_eq!(members(b).count(), MAX_BAGGAGE_MEMBERS);
        assert!(b.len() <= MAX_BYTES);
        let t = h.get("tracestate").unwrap().to_str().unwrap();
        assert_eq!(t.split(',').count(), MAX_TRACESTATE_MEMBERS);
        assert!(t.ends_with(",t29=v"), "rightmost entries are dropped: {t}");

        let mut h = HeaderMap::new();
        let big = format!("big={}", "x".repeat(MAX_BYTES - 40));
        h.insert(
            "baggage",
            HeaderValue::from_str(&format!("small=1,{big}")).unwrap(),
        );
        inject_key(&mut h, &"k".repeat(64), &[]);
        let b = h.get("baggage").unwrap().to_str().unwrap();
        assert!(b.len() <= MAX_BYTES);
        assert!(
            b.ends_with(",small=1"),
            "the member that no longer fits is dropped"
        );
    }

    #[test]
    fn invalid_key_is_a_no_op() {
        let mut h = HeaderMap::new();
        h.insert("baggage", HeaderValue::from_static("a=1"));
        for bad in ["", "a b", "a,b", "k\r\nx: y", &"k".repeat(65)] {
            inject_key(&mut h, bad, &[HeaderName::from_static("x-route")]);
        }
        assert_eq!(h.len(), 1);
        assert_eq!(get(&h, "baggage"), ["a=1"]);
    }
}
