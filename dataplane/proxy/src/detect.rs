//! Protocol detection from a connection's first bytes: bounded in size and time.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Enough for the HTTP/2 preface, the longest method we look for and a TLS record header.
const MAX_PEEK: usize = 32;
const MAX_METHOD: usize = 20;

/// What a connection speaks, as far as the proxy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    /// HTTP/2 with prior knowledge (h2c).
    Http2,
    /// A TLS ClientHello: passed through untouched.
    Tls,
    /// Anything else, a server that speaks first, or a port configured as opaque.
    Opaque,
    /// Kafka, on the Kafka relay's own listener (never detected: the interception rules send
    /// only connections to configured broker ports there).
    Kafka,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http1 => "http1",
            Protocol::Http2 => "http2",
            Protocol::Tls => "tls",
            Protocol::Opaque => "tcp",
            Protocol::Kafka => "kafka",
        }
    }
}

enum Verdict {
    Known(Protocol),
    NeedMore,
}

/// Reads up to [`MAX_PEEK`] bytes until the protocol is known, the client stops sending for
/// `timeout`, or it closes. The bytes read are returned so the caller can replay them.
/// `Ok(None)` means the client closed without sending anything; `Opaque` with no bytes, that it
/// sent none in time (the listener then waits to see who speaks first).
pub(crate) async fn detect(
    io: &mut TcpStream,
    timeout: Duration,
) -> std::io::Result<Option<(Protocol, Bytes)>> {
    // A fixed array: whatever the client sends, detection never holds more than MAX_PEEK bytes.
    let mut buf = [0u8; MAX_PEEK];
    let mut len = 0;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let read = tokio::time::timeout_at(deadline, io.read(&mut buf[len..])).await;
        let seen = |len: usize| Bytes::copy_from_slice(&buf[..len]);
        match read {
            Err(_elapsed) => return Ok(Some((Protocol::Opaque, seen(len)))),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(0)) if len == 0 => return Ok(None),
            Ok(Ok(0)) => return Ok(Some((classify_final(&buf[..len]), seen(len)))),
            Ok(Ok(n)) => len += n,
        }
        if let Verdict::Known(p) = classify(&buf[..len]) {
            return Ok(Some((p, seen(len))));
        }
        if len == MAX_PEEK {
            return Ok(Some((Protocol::Opaque, seen(len))));
        }
    }
}

/// Classification when the client has closed its side: no more bytes will come.
fn classify_final(buf: &[u8]) -> Protocol {
    match classify(buf) {
        Verdict::Known(p) => p,
        Verdict::NeedMore => Protocol::Opaque,
    }
}

fn classify(buf: &[u8]) -> Verdict {
    if buf.is_empty() {
        return Verdict::NeedMore;
    }
    // TLS handshake record: content type 22, protocol major version 3.
    if buf[0] == 0x16 {
        return match buf.get(1) {
            None => Verdict::NeedMore,
            Some(3) => Verdict::Known(Protocol::Tls),
            Some(_) => Verdict::Known(Protocol::Opaque),
        };
    }
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if n == H2_PREFACE.len() {
            Verdict::Known(Protocol::Http2)
        } else {
            Verdict::NeedMore
        };
    }
    // `PRI` is reserved for the HTTP/2 preface (RFC 9113 §3.4): a client that starts with it and
    // then deviates sent a broken preface, which the HTTP/2 server answers as a connection
    // error. Served as HTTP/1 it would be answered as if it were a request.
    if buf.starts_with(b"PRI ") {
        return Verdict::Known(Protocol::Http2);
    }
    classify_http1(buf)
}

/// An HTTP/1 request line starts with a method token (we accept uppercase letters and `-`, which
/// covers the registered methods, WebDAV's and most custom ones), one space, and a request target
/// that starts with `/`, `*` or an absolute URI; CONNECT takes an authority.
///
/// A first word of other visible ASCII with at least one uppercase letter, followed by an
/// origin-form or `*` target, has the shape of a request line whose method is not a plain
/// uppercase token (`G@T /`, `Get /`): HTTP/1 too, so that the parser answers it (400 and a
/// closed connection for an invalid token) rather than the app receiving it unparsed.
/// All-lowercase words stay opaque: text protocols (memcached, Redis inline commands) look like
/// that.
fn classify_http1(buf: &[u8]) -> Verdict {
    let word = buf
        .iter()
        .take_while(|b| (0x21..=0x7e).contains(*b))
        .count();
    if word == buf.len() {
        return if word <= MAX_METHOD {
            Verdict::NeedMore
        } else {
            Verdict::Known(Protocol::Opaque)
        };
    }
    if word == 0 || word > MAX_METHOD || buf[word] != b' ' {
        return Verdict::Known(Protocol::Opaque);
    }
    let method = &buf[..word];
    let plain = method.iter().all(|b| b.is_ascii_uppercase() || *b == b'-');
    match buf.get(word + 1) {
        None => Verdict::NeedMore,
        Some(b'/' | b'*') if plain || method.iter().any(u8::is_ascii_uppercase) => {
            Verdict::Known(Protocol::Http1)
        }
        Some(b'h' | b'H') if plain => Verdict::Known(Protocol::Http1),
        Some(_) if method == b"CONNECT" => Verdict::Known(Protocol::Http1),
        Some(_) => Verdict::Known(Protocol::Opaque),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(b: &[u8]) -> Option<Protocol> {
        match classify(b) {
            Verdict::Known(p) => Some(p),
            Verdict::NeedMore => None,
        }
    }

    #[test]
    fn classifies() {
        assert_eq!(known(b"GET / HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(known(b"PROPFIND /x"), Some(Protocol::Http1));
        assert_eq!(
            known(b"CONNECT example.com:443 HTTP/1.1"),
            Some(Protocol::Http1)
        );
        assert_eq!(known(b"GET http://a/ HTTP/1.1"), Some(Protocol::Http1));
        assert_eq!(known(H2_PREFACE), Some(Protocol::Http2));
        assert_eq!(known(&[0x16, 0x03, 0x01, 0x02, 0x00]), Some(Protocol::Tls));
        assert_eq!(known(b"\x00\x01binary"), Some(Protocol::Opaque));
        assert_eq!(known(b"get / HTTP/1.1"), Some(Protocol::Opaque));
        assert_eq!(known(b"HELLO world"), Some(Protocol::Opaque));
        assert_eq!(
            known(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n"),
            Some(Protocol::Opaque)
        );
        // Request lines with an invalid or mixed-case method go to the HTTP parser, which
        // answers them; a broken HTTP/2 preface goes to the HTTP/2 server, which refuses it.
        assert_eq!(known(b"G@T / HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(known(b"Get /x HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(known(b"G@T x"), Some(Protocol::Opaque));
        assert_eq!(
            known(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"),
            Some(Protocol::Http2)
        );
        assert_eq!(known(b"PRI * HTTP/1.1\r\n"), Some(Protocol::Http2));
        // Prefixes that could still become something.
        assert_eq!(known(b"GE"), None);
        assert_eq!(known(b"G@"), None);
        assert_eq!(known(b"GET "), None);
        assert_eq!(known(b"PRI * HTTP/2"), None);
        assert_eq!(known(&[0x16]), None);
        assert_eq!(classify_final(b"GE"), Protocol::Opaque);
        assert_eq!(known(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"), Some(Protocol::Opaque));
    }
}
