//! Byte-level pieces of HTTP/1 the relay reads and writes with: head boundaries, request
//! targets, field values.

/// Where a head ends: the index after the empty line that closes it, once `buf` holds one.
/// `scanned` carries the position to resume from between calls; `bare_lf` is set when a line
/// ends in LF alone.
pub(super) fn head_end(buf: &[u8], scanned: &mut usize, bare_lf: &mut bool) -> Option<usize> {
    for i in memchr::memchr_iter(b'\n', &buf[*scanned..]).map(|i| i + *scanned) {
        if i == 0 || buf[i - 1] != b'\r' {
            *bare_lf = true;
        }
        match &buf[i + 1..] {
            [b'\n', ..] => {
                *bare_lf = true;
                return Some(i + 2);
            }
            [b'\r', b'\n', ..] => return Some(i + 3),
            [] | [b'\r'] => {
                // Not yet known whether this line is the last one.
                *scanned = i;
                return None;
            }
            _ => {}
        }
    }
    *scanned = buf.len();
    None
}

/// A request target the relay forwards unchanged: origin form (RFC 9112 §3.2.1), made of
/// characters RFC 3986 allows in a path and query. Anything else (absolute form, `*`, a
/// fragment, characters some parsers accept and others do not) goes to hyper.
pub(super) fn origin_form(target: &[u8]) -> bool {
    target.first() == Some(&b'/') && target.iter().all(|&b| TARGET[usize::from(b)])
}

const TARGET: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let extra = b"-._~%!$&'()*+,;=:@/?";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

/// A `Content-Length` value: digits only (no sign, no list), at most 18 of them.
pub(super) fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 18 {
        return None;
    }
    v.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

/// The comma-separated, whitespace-trimmed, non-empty elements of a list field.
pub(super) fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

pub(super) fn put_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `date: <now>` (`crate::http::date`), or nothing for a clock before 1970.
pub(super) fn put_date(out: &mut Vec<u8>) {
    if let Some(v) = crate::http::date::now() {
        put_field(out, b"date", v.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::headers::{Field, field};

    fn end(buf: &[u8]) -> (Option<usize>, bool) {
        let (mut scanned, mut bare) = (0, false);
        (head_end(buf, &mut scanned, &mut bare), bare)
    }

    #[test]
    fn head_ends() {
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"), (Some(27), false));
        assert_eq!(end(b"GET / HTTP/1.1\r\n\r\nGET"), (Some(18), false));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n"), (None, false));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\r"), (None, false));
        assert_eq!(end(b"GET / HTTP/1.1\nHost: a\r\n\r\n"), (Some(26), true));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\r\n\n"), (Some(26), true));
        assert_eq!(end(b"GET / HTTP/1.1\r\nHost: a\n\n"), (Some(25), true));
        // Resuming where the last call stopped finds the same end as one call over everything.
        let head = b"GET / HTTP/1.1\r\nHost: a\r\nX: y\r\n\r\n";
        for cut in 0..head.len() {
            let (mut scanned, mut bare) = (0, false);
            let first = head_end(&head[..cut], &mut scanned, &mut bare);
            assert_eq!(first, None, "cut {cut}");
            assert_eq!(
                head_end(head, &mut scanned, &mut bare),
                Some(head.len()),
                "cut {cut}"
            );
            assert!(!bare);
        }
    }

    #[test]
    fn fields_and_values() {
        assert!(matches!(field(b"Content-Length"), Field::ContentLength));
        assert!(matches!(
            field(b"TRANSFER-ENCODING"),
            Field::TransferEncoding
        ));
        assert!(matches!(field(b"Proxy-Authorization"), Field::HopByHop));
        assert!(matches!(field(b"Keep-Alive"), Field::HopByHop));
        assert!(matches!(field(b"x-forwarded-for"), Field::XForwardedFor));
        assert!(matches!(field(b"Content-Type"), Field::Other));
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"65536"), Some(65536));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b"1,1",
            b" 1",
            b"0x10",
            b"1234567890123456789",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        let t: Vec<&[u8]> = tokens(b" keep-alive ,, Close,").collect();
        assert_eq!(t, [&b"keep-alive"[..], b"Close"]);
        assert!(origin_form(b"/a/b?x=1&y=%20"));
        for bad in [
            &b"*"[..],
            b"http://a/",
            b"/a#f",
            b"/a b",
            b"/\"",
            b"/<",
            b"/{",
            b"",
            b"a",
        ] {
            assert!(!origin_form(bad), "{bad:?}");
        }
    }
}
