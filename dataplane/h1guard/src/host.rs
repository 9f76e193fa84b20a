//! The `Host` rules of the HTTP/1 front door (RFC 9112 §3.2, RFC 3986 §3.2.2).

use http::header;

/// RFC 9112 §3.2: an HTTP/1.1 request has exactly one `Host`, and an HTTP/1.0 one at most one;
/// its value is an authority without user info; with an absolute-form target it names the same
/// authority as the target. Anything else is answered 400 (and the connection closed): two
/// hops that pick different hosts from one request are how requests get smuggled past routing.
pub fn check_host<B>(req: &http::Request<B>) -> Result<(), &'static str> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err("more than one Host header");
    }
    let Some(host) = host else {
        if req.version() == http::Version::HTTP_11 {
            return Err("HTTP/1.1 request without a Host header");
        }
        return Ok(());
    };
    let host = host.as_bytes();
    if !valid_authority(host) {
        return Err("invalid Host header");
    }
    if req.method() != http::Method::CONNECT
        && let Some(target) = req.uri().authority()
        && !target.as_str().as_bytes().eq_ignore_ascii_case(host)
    {
        return Err("Host header does not match the request target");
    }
    Ok(())
}

/// Bytes of a reg-name or IPv4 address: unreserved, pct-encoded and sub-delims (RFC 3986 §3.2.2);
/// no '@', '/', '?', '#', ':' or whitespace.
const REG_NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric();
        b += 1;
    }
    let extra = b"-._~%!$&'()*+,;=";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

/// `uri-host [ ":" port ]` (RFC 3986 §3.2) without user info: a reg-name, an IPv4 address or a
/// bracketed IP literal, and a port of digits. Checked byte by byte, without allocating: it runs
/// for every request.
pub fn valid_authority(host: &[u8]) -> bool {
    let (name, port) = match host.first() {
        Some(b'[') => match host.iter().position(|&b| b == b']') {
            Some(end) => {
                // An IPv6 address (RFC 3986 IP-literal; IPvFuture is not accepted). Rare enough
                // in a Host header that parsing it properly costs nothing that matters.
                let literal = std::str::from_utf8(&host[1..end]).unwrap_or("");
                if literal.parse::<std::net::Ipv6Addr>().is_err() {
                    return false;
                }
                match &host[end + 1..] {
                    [] => return true,
                    [b':', port @ ..] => (&host[..0], port),
                    _ => return false,
                }
            }
            None => return false,
        },
        Some(_) => match host.iter().rposition(|&b| b == b':') {
            Some(colon) => (&host[..colon], &host[colon + 1..]),
            None => (host, &host[..0]),
        },
        None => return false,
    };
    let reg_name = |b: &u8| REG_NAME[usize::from(*b)];
    (host.first() == Some(&b'[') || !name.is_empty())
        && name.iter().all(reg_name)
        && pct_encoded_ok(name)
        && port.len() <= 5
        && port.iter().all(u8::is_ascii_digit)
}

/// Every `%` is followed by two hex digits (RFC 3986 pct-encoded).
fn pct_encoded_ok(name: &[u8]) -> bool {
    let mut i = 0;
    while i < name.len() {
        if name[i] == b'%' {
            match name.get(i + 1..i + 3) {
                Some([a, b]) if a.is_ascii_hexdigit() && b.is_ascii_hexdigit() => i += 3,
                _ => return false,
            }
        } else {
            i += 1;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        for ok in [
            "a",
            "a.example",
            "a:80",
            "10.0.0.1:8080",
            "[::1]",
            "[::1]:80",
            "a-b_c~d",
            "a:",
            "a%41b",
            "[2001:db8::1]:443",
        ] {
            assert!(valid_authority(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "",
            "u@a",
            "a/b",
            "a b",
            "a?x",
            "a#x",
            ":80",
            "a:80:90",
            "a:x",
            "[::1",
            "[]",
            "[::1]x",
            "a:123456",
            // Found by the http1_guard fuzz target: malformed percent-encoding and bracketed
            // text that is no IPv6 address.
            "%a",
            "a%",
            "a%zz",
            "[zz]",
            "[:::::::::]",
            "[1.2.3.4]",
        ] {
            assert!(!valid_authority(bad.as_bytes()), "{bad}");
        }
    }
}
