//! The proxy hop's header policy, one for both HTTP/1 paths (the relay, which edits heads as
//! bytes, and hyper's, which edits `HeaderMap`s): which fields are hop-by-hop (RFC 9110 §7.6.1)
//! and which the hop reads ([`field`]), `Via`, `X-Forwarded-*`, and request-target normalisation
//! for the upstream's HTTP version.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{StatusCode, Uri};

use crate::conn::ConnMeta;
use crate::pool::Version;

pub(super) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(super) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Proto` when the client sent none: the hop's HTTP listeners are plain text.
pub(super) const FORWARDED_PROTO: &str = "http";
/// `Via` (RFC 9110 §7.6.3) on HTTP/1.1 and HTTP/2 messages: the protocol received, and this
/// hop's pseudonym.
pub(super) const VIA_HTTP1: &str = "1.1 spur";
const VIA_HTTP2: &str = "2.0 spur";

/// The protocols a request asks to upgrade to (`Connection: upgrade` + `Upgrade: x`), without
/// `h2c`. An upgrade to h2c (RFC 7540 §3.2, deprecated by RFC 9113 §3.1) would turn the rest of
/// the connection into HTTP/2 that the proxy never parses: every later request on it would
/// bypass per-request routing, capture and redaction. So the offer is dropped (the request goes
/// on as plain HTTP/1.1, which the RFC allows a server to do) and the other protocols offered
/// with it, if any, are kept.
pub(super) fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if !asks {
        return None;
    }
    let offered = headers.get(header::UPGRADE)?;
    let Ok(list) = offered.to_str() else {
        // Not visible ASCII: nothing to recognise h2c in, and nothing an upstream should get.
        return None;
    };
    let is_h2c = |t: &str| {
        let name = t.split('/').next().unwrap_or(t).trim();
        name.eq_ignore_ascii_case("h2c")
    };
    if !list.split(',').any(is_h2c) {
        return Some(offered.clone());
    }
    let kept: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty() && !is_h2c(t))
        .collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join(", ")).ok()
}

/// The header fields the proxy's HTTP/1 hop acts on, classified once for both paths: the relay
/// reads names as bytes, the hyper path as [`HeaderName`]s ([`is_hop_by_hop`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
    Host,
    ContentLength,
    TransferEncoding,
    Connection,
    Te,
    Expect,
    XForwardedFor,
    XForwardedProto,
    /// The rest of the fixed hop-by-hop set (RFC 9110 §7.6.1 and the legacy proxy fields):
    /// never forwarded.
    HopByHop,
    Other,
}

/// `name` in any case.
pub(super) fn field(name: &[u8]) -> Field {
    let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
    match name.len() {
        2 if is(b"te") => Field::Te,
        4 if is(b"host") => Field::Host,
        6 if is(b"expect") => Field::Expect,
        7 if is(b"upgrade") => Field::HopByHop,
        10 if is(b"connection") => Field::Connection,
        10 if is(b"keep-alive") => Field::HopByHop,
        14 if is(b"content-length") => Field::ContentLength,
        14 if is(b"http2-settings") => Field::HopByHop,
        15 if is(b"x-forwarded-for") => Field::XForwardedFor,
        16 if is(b"proxy-connection") => Field::HopByHop,
        17 if is(b"transfer-encoding") => Field::TransferEncoding,
        17 if is(b"x-forwarded-proto") => Field::XForwardedProto,
        18 if is(b"proxy-authenticate") => Field::HopByHop,
        19 if is(b"proxy-authorization") => Field::HopByHop,
        _ => Field::Other,
    }
}

/// The fixed hop-by-hop set (RFC 9110 §7.6.1, plus the legacy proxy headers and h2c's
/// settings), as [`field`] classifies it.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        field(name.as_str().as_bytes()),
        Field::Connection | Field::Te | Field::TransferEncoding | Field::HopByHop
    )
}

/// Removes hop-by-hop headers: the fixed set plus every header the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them: one pass comparing names is much cheaper than probing
    // the map once per name.
    let present: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    if present.is_empty() {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named.into_iter().chain(present) {
        headers.remove(name);
    }
}

fn via_value(version: Version) -> HeaderValue {
    match version {
        Version::Http1 => HeaderValue::from_static(VIA_HTTP1),
        Version::Http2 => HeaderValue::from_static(VIA_HTTP2),
    }
}

fn version_of(v: http::Version) -> Version {
    if v == http::Version::HTTP_2 {
        Version::Http2
    } else {
        Version::Http1
    }
}

pub(super) fn prepare_request(
    parts: &mut Parts,
    meta: &ConnMeta,
    upgrade: Option<&HeaderValue>,
    forwarded: bool,
) {
    let headers = &mut parts.headers;
    // gRPC needs `te: trailers` end to end; it is the one TE value worth keeping.
    let te_trailers = headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"));
    strip_hop_by_hop(headers);
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    if let Some(proto) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto.clone());
    }
    headers.append(header::VIA, via_value(version_of(parts.version)));
    if forwarded {
        let xff = match headers.get(X_FORWARDED_FOR) {
            Some(prev) => {
                let mut v = Vec::with_capacity(prev.len() + 2 + meta.client_ip.len());
                v.extend_from_slice(prev.as_bytes());
                v.extend_from_slice(b", ");
                v.extend_from_slice(meta.client_ip.as_bytes());
                HeaderValue::from_maybe_shared(bytes::Bytes::from(v)).ok()
            }
            None => Some(meta.client_ip.clone()),
        };
        if let Some(v) = xff {
            headers.insert(X_FORWARDED_FOR, v);
        }
        if !headers.contains_key(X_FORWARDED_PROTO) {
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(FORWARDED_PROTO));
        }
    }
}

/// HTTP/1 upstreams get origin-form targets (`/path?q`), with `Host` taken from an absolute-form
/// target if the client sent one; CONNECT keeps its authority form. HTTP/2 keeps the full URI,
/// which hyper turns into `:scheme`/`:authority`.
pub(super) fn normalize_target(parts: &mut Parts, version: Version) -> Result<(), StatusCode> {
    if version == Version::Http2 || parts.method == http::Method::CONNECT {
        return Ok(());
    }
    if let Some(authority) = parts.uri.authority() {
        if !parts.headers.contains_key(header::HOST) {
            let host =
                HeaderValue::from_str(authority.as_str()).map_err(|_| StatusCode::BAD_REQUEST)?;
            parts.headers.insert(header::HOST, host);
        }
        let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        parts.uri = pq.parse::<Uri>().map_err(|_| StatusCode::BAD_REQUEST)?;
    }
    Ok(())
}

pub(super) fn prepare_response(
    parts: &mut http::response::Parts,
    version: Version,
    keep_upgrade: bool,
) {
    let upgrade = keep_upgrade
        .then(|| parts.headers.get(header::UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(&mut parts.headers);
    if let Some(proto) = upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, proto);
    }
    parts.headers.append(header::VIA, via_value(version));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ConnMeta {
        ConnMeta::new(
            "10.1.2.3:5555".parse().unwrap(),
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
            crate::Protocol::Http1,
        )
    }

    #[test]
    fn strips_hop_by_hop_and_adds_via_and_forwarded() {
        let req = http::Request::get("/x")
            .header("connection", "keep-alive, x-secret-hop")
            .header("x-secret-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers, deflate")
            .header("proxy-authorization", "Basic Zm9v")
            .header("x-forwarded-for", "192.0.2.1")
            .header("x-kept", "yes")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        prepare_request(&mut parts, &meta(), None, true);
        let h = &parts.headers;
        for gone in [
            "connection",
            "x-secret-hop",
            "keep-alive",
            "proxy-authorization",
        ] {
            assert!(!h.contains_key(gone), "{gone} should be stripped");
        }
        assert_eq!(h["te"], "trailers");
        assert_eq!(h["x-kept"], "yes");
        assert_eq!(h["via"], "1.1 spur");
        assert_eq!(h["x-forwarded-for"], "192.0.2.1, 10.1.2.3");
        assert_eq!(h["x-forwarded-proto"], "http");
    }

    #[test]
    fn upgrade_headers_survive_for_upgrades_only() {
        let req = http::Request::get("/ws")
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .body(())
            .unwrap();
        let proto = upgrade_protocol(req.headers());
        assert_eq!(proto.as_ref().unwrap(), "websocket");
        let (mut parts, ()) = req.into_parts();
        prepare_request(&mut parts, &meta(), proto.as_ref(), false);
        assert_eq!(parts.headers["upgrade"], "websocket");
        assert_eq!(parts.headers["connection"], "upgrade");
        assert!(!parts.headers.contains_key("x-forwarded-for"));
    }

    #[test]
    fn an_h2c_upgrade_offer_never_reaches_the_upstream() {
        let offer = |upgrade: &str, connection: &str| {
            let req = http::Request::get("/")
                .header("connection", connection)
                .header("upgrade", upgrade)
                .header("http2-settings", "AAMAAABkAAQCAAAAAAIAAAAA")
                .body(())
                .unwrap();
            let proto = upgrade_protocol(req.headers());
            let (mut parts, ()) = req.into_parts();
            prepare_request(&mut parts, &meta(), proto.as_ref(), false);
            (proto, parts.headers)
        };
        for (upgrade, connection) in [
            ("h2c", "Upgrade, HTTP2-Settings"),
            ("H2C", "upgrade"),
            (" h2c ", "keep-alive, Upgrade"),
        ] {
            let (proto, h) = offer(upgrade, connection);
            assert_eq!(proto, None, "{upgrade:?}");
            for gone in ["upgrade", "connection", "http2-settings"] {
                assert!(!h.contains_key(gone), "{gone} kept for {upgrade:?}");
            }
        }
        // Another protocol offered beside h2c is kept; h2c and its settings are not.
        let (proto, h) = offer("h2c, websocket", "Upgrade");
        assert_eq!(proto.as_ref().unwrap(), "websocket");
        assert_eq!(h["upgrade"], "websocket");
        assert!(!h.contains_key("http2-settings"));
    }

    /// The relay (names as bytes, any case) and the hyper path (`HeaderName`s) strip one set.
    #[test]
    fn one_hop_by_hop_set_for_both_paths() {
        for name in [
            "connection",
            "te",
            "transfer-encoding",
            "upgrade",
            "proxy-authenticate",
            "proxy-authorization",
            "proxy-connection",
            "keep-alive",
            "http2-settings",
        ] {
            assert!(is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
            let upper = name.to_ascii_uppercase();
            assert!(!matches!(field(upper.as_bytes()), Field::Other), "{name}");
        }
        for kept in ["x-kept", "host", "content-length", "x-forwarded-for"] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(kept)), "{kept}");
        }
    }

    #[test]
    fn absolute_form_becomes_origin_form_for_http1() {
        let (mut parts, ()) = http::Request::get("http://example.test:81/a?b=1")
            .body(())
            .unwrap()
            .into_parts();
        normalize_target(&mut parts, Version::Http1).unwrap();
        assert_eq!(parts.uri, "/a?b=1");
        assert_eq!(parts.headers["host"], "example.test:81");
    }
}
