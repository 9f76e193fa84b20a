//! The small text forms the diff writes: terminal-safe strings, cut values, hex, base64 and
//! RFC 3339 times.

use base64::Engine as _;

/// Control characters escaped: paths and headers come from whoever sent the request, and
/// must not drive the reader's terminal.
pub fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

/// `s` cut to `max` characters, marked with `…` when cut.
pub(crate) fn cap(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

/// The first `max` bytes of `data` in hex, marked with `…` when there are more.
pub(crate) fn hex(data: &[u8], max: usize) -> String {
    let mut out: String = data.iter().take(max).map(|b| format!("{b:02x}")).collect();
    if data.len() > max {
        out.push('…');
    }
    out
}

/// Standard base64 with padding.
pub(crate) fn encode_base64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// RFC 3339 in UTC with milliseconds; outside the years RFC 3339 writes (0000 to 9999), the
/// microseconds themselves.
pub fn rfc3339(unix_micros: i64) -> String {
    const FORMAT: &[time::format_description::BorrowedFormatItem<'_>] = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_micros) * 1000)
        .ok()
        .and_then(|t| t.format(FORMAT).ok())
        .unwrap_or_else(|| format!("{unix_micros}µs since 1970"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings() {
        assert_eq!(encode_base64(b""), "");
        assert_eq!(encode_base64(b"f"), "Zg==");
        assert_eq!(encode_base64(b"fo"), "Zm8=");
        assert_eq!(encode_base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123_456), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(951_782_400_000_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(-1_000), "1969-12-31T23:59:59.999Z");
        // Past what RFC 3339 writes: the number itself.
        assert_eq!(rfc3339(i64::MAX), "9223372036854775807µs since 1970");
        assert_eq!(printable("/a\nb"), "/a\\nb");
    }
}
