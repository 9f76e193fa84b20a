//! The HTTP/1 front door's line-ending check. hyper's parser (httparse) accepts a bare LF as a
//! line ending, which RFC 9112 §2.2 allows a recipient to do; a proxy in front of apps must not:
//! a hop that ends lines differently from the next one is how requests are smuggled past it.
//!
//! [`Guard`] wraps the client side of an HTTP/1 connection and follows its request framing with
//! httparse (each head, then a `Content-Length` body or a chunked body with its size lines and
//! trailers) without holding any bytes back. A bare LF where a line ends — in a head, a chunk
//! size line, after chunk data or in trailers — is overwritten with NUL before hyper reads it, so
//! hyper's own parser refuses the message: a 400 and a closed connection for a head, a failed
//! body (which the proxy answers with 400 and closes) for a chunk. Body bytes are skipped, never
//! inspected. After an upgrade or CONNECT request, or anything the check cannot follow (hyper
//! rejects those itself), the rest of the connection passes unchecked.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, ReadBuf};

/// Longest chunk size line (with extensions) followed; hyper's limit is far below.
const MAX_CHUNK_LINE: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a request head (or the empty lines allowed before one).
    Head,
    /// A `Content-Length` body: bytes left.
    Fixed(u64),
    ChunkSize,
    /// Chunk data: bytes left.
    ChunkData(u64),
    /// The CRLF after chunk data: how many of its bytes were seen.
    ChunkEnd(u8),
    Trailers,
    /// Unchecked from here on.
    Passthrough,
}

/// What the current head says about the body that follows it.
#[derive(Debug, Default, Clone, Copy)]
struct HeadInfo {
    /// The request line has been seen.
    started: bool,
    /// Bytes of the head so far.
    bytes: usize,
    length: Option<u64>,
    /// Whether `chunked` is the final transfer coding (of the last `Transfer-Encoding`).
    chunked: Option<bool>,
    /// An upgrade or CONNECT request (what follows may be another protocol), or framing hyper
    /// refuses itself: stop checking after this head.
    stop_after: bool,
}

/// The framing follower (see the module docs); separate from the I/O so it can be tested with
/// any split of the byte stream. It reads each line where it lies in the read buffer and copies
/// only a line that a read boundary cuts.
#[derive(Debug)]
pub(crate) struct Framing {
    state: State,
    head: HeadInfo,
    /// The start of a line cut by the end of the last read.
    partial: Vec<u8>,
    /// The last byte seen: a CR at the end of one read may pair with an LF in the next.
    prev: u8,
    max_head: usize,
}

impl Framing {
    pub(crate) fn new(max_head: usize) -> Self {
        Framing {
            state: State::Head,
            head: HeadInfo::default(),
            partial: Vec::new(),
            prev: 0,
            max_head,
        }
    }

    /// Follows `data`, the next bytes from the client; returns whether a bare LF was found (and
    /// overwritten).
    pub(crate) fn scan(&mut self, data: &mut [u8]) -> bool {
        let mut i = 0;
        while i < data.len() {
            match self.state {
                State::Passthrough => return false,
                State::Fixed(left) | State::ChunkData(left) => {
                    let take = left.min((data.len() - i) as u64);
                    i += take as usize;
                    let left = left - take;
                    self.state = match (self.state, left) {
                        (State::Fixed(_), 0) => State::Head,
                        (State::Fixed(_), _) => State::Fixed(left),
                        (_, 0) => State::ChunkEnd(0),
                        _ => State::ChunkData(left),
                    };
                    self.prev = 0;
                }
                State::ChunkEnd(seen) => {
                    let b = data[i];
                    match (seen, b) {
                        (0, b'\r') => self.state = State::ChunkEnd(1),
                        (1, b'\n') => self.state = State::ChunkSize,
                        (0, b'\n') => return self.bare_lf(data, i),
                        // hyper refuses chunk data that does not end with CRLF.
                        _ => self.state = State::Passthrough,
                    }
                    self.prev = b;
                    i += 1;
                }
                State::Head | State::ChunkSize | State::Trailers => {
                    let rest = &data[i..];
                    let Some(nl) = memchr::memchr(b'\n', rest) else {
                        self.keep_partial(rest);
                        return false;
                    };
                    let before = if nl == 0 { self.prev } else { rest[nl - 1] };
                    if before != b'\r' {
                        return self.bare_lf(data, i + nl);
                    }
                    if self.partial.is_empty() {
                        self.line(&data[i..=i + nl]);
                    } else {
                        let mut line = std::mem::take(&mut self.partial);
                        line.extend_from_slice(&data[i..=i + nl]);
                        self.line(&line);
                        line.clear();
                        // A large cut line once must not pin its buffer for the connection's
                        // life.
                        if line.capacity() <= 8 * 1024 {
                            self.partial = line;
                        }
                    }
                    self.prev = b'\n';
                    i += nl + 1;
                }
            }
        }
        false
    }

    /// Keeps the start of a line cut by the end of a read; past the limits, stops checking
    /// (hyper refuses heads that long itself).
    fn keep_partial(&mut self, bytes: &[u8]) {
        let Some(&last) = bytes.last() else {
            return;
        };
        self.prev = last;
        let limit = match self.state {
            State::ChunkSize => MAX_CHUNK_LINE,
            _ => self.max_head.saturating_sub(self.head.bytes),
        };
        if self.partial.len() + bytes.len() > limit {
            self.passthrough();
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }

    fn bare_lf(&mut self, data: &mut [u8], at: usize) -> bool {
        data[at] = 0;
        self.passthrough();
        true
    }

    fn passthrough(&mut self) {
        self.state = State::Passthrough;
        self.partial = Vec::new();
    }

    /// One complete, CRLF-terminated line.
    fn line(&mut self, line: &[u8]) {
        match self.state {
            State::Head => self.head_line(line),
            State::ChunkSize => {
                self.state = match httparse::parse_chunk_size(line) {
                    Ok(httparse::Status::Complete((_, 0))) => State::Trailers,
                    Ok(httparse::Status::Complete((_, size))) => State::ChunkData(size),
                    // hyper refuses it too (and the proxy answers 400).
                    _ => State::Passthrough,
                };
            }
            State::Trailers if line == b"\r\n" => self.state = State::Head,
            _ => {}
        }
    }

    fn head_line(&mut self, line: &[u8]) {
        let head = &mut self.head;
        head.bytes += line.len();
        if head.bytes > self.max_head {
            self.passthrough();
            return;
        }
        if line == b"\r\n" {
            // Empty lines before a request line are allowed (RFC 9112 §2.2); after it, one ends
            // the head.
            if head.started {
                let h = std::mem::take(&mut self.head);
                self.state = match (h.stop_after, h.chunked, h.length) {
                    (true, _, _) | (false, Some(false), _) => State::Passthrough,
                    // hyper frames by Transfer-Encoding when both are present (and closes
                    // afterwards).
                    (false, Some(true), _) => State::ChunkSize,
                    (false, None, Some(n)) if n > 0 => State::Fixed(n),
                    (false, None, _) => State::Head,
                };
            }
            return;
        }
        if !head.started {
            head.started = true;
            head.stop_after = line.starts_with(b"CONNECT ");
            return;
        }
        let value = |name: &[u8]| -> Option<&[u8]> {
            (line.len() > name.len() && line[..name.len()].eq_ignore_ascii_case(name))
                .then(|| line[name.len()..line.len() - 2].trim_ascii())
        };
        match line.first() {
            Some(b'c' | b'C') => {
                if let Some(v) = value(b"content-length:") {
                    let n = (!v.is_empty() && v.iter().all(u8::is_ascii_digit))
                        .then(|| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                        .flatten();
                    match (n, head.length) {
                        (Some(n), None) => head.length = Some(n),
                        (Some(n), Some(prev)) if n == prev => {}
                        // Differing or invalid: hyper answers 400.
                        _ => head.stop_after = true,
                    }
                }
            }
            Some(b't' | b'T') => {
                if let Some(v) = value(b"transfer-encoding:") {
                    let last = v.rsplit(|&b| b == b',').next().map(<[u8]>::trim_ascii);
                    head.chunked = Some(last.is_some_and(|c| c.eq_ignore_ascii_case(b"chunked")));
                }
            }
            // If the upgrade happens, what follows is another protocol.
            Some(b'u' | b'U') if value(b"upgrade:").is_some() => head.stop_after = true,
            _ => {}
        }
    }
}

pin_project_lite::pin_project! {
    /// An HTTP/1 client connection whose reads pass through [`Framing`]: a request head with a
    /// bare LF (or framing it cannot follow unambiguously) ends the connection with a 400
    /// before hyper sees it. Every HTTP/1 server Spur runs reads through one.
    pub struct Guard<T> {
        #[pin]
        inner: T,
        framing: Framing,
    }
}

impl<T> Guard<T> {
    /// `max_head`: the largest request head followed (a larger one is refused).
    pub fn new(inner: T, max_head: usize) -> Self {
        Guard {
            inner,
            framing: Framing::new(max_head),
        }
    }
}

impl<T: AsyncRead> AsyncRead for Guard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        ready!(this.inner.poll_read(cx, buf))?;
        if this.framing.scan(&mut buf.filled_mut()[before..]) {
            tracing::debug!("bare LF in an HTTP/1 request; refused");
        }
        Poll::Ready(Ok(()))
    }
}

// Writes go straight through: the guard follows only what the client sends.
impl<T: tokio::io::AsyncWrite> tokio::io::AsyncWrite for Guard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` in pieces of `step` bytes; returns the bytes as hyper would see them and
    /// whether a bare LF was reported.
    fn feed(input: &[u8], step: usize) -> (Vec<u8>, bool) {
        let mut f = Framing::new(64 * 1024);
        let mut out = input.to_vec();
        let mut found = false;
        for piece in out.chunks_mut(step) {
            found |= f.scan(piece);
        }
        (out, found)
    }

    fn every_split(input: &[u8]) -> Vec<(Vec<u8>, bool)> {
        (1..=input.len().max(1)).map(|s| feed(input, s)).collect()
    }

    #[test]
    fn valid_pipelines_pass_unchanged_however_they_are_split() {
        let pipeline: &[u8] = b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n\
            POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\na\nb\nc\
            POST /y HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\
            3;ext=1\r\n\n\n\n\r\n0\r\nX-T: 1\r\n\r\n\
            POST /z HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n\
            GET /last HTTP/1.1\r\nHost: a\r\n\r\n";
        for (out, found) in every_split(pipeline) {
            assert!(!found);
            assert_eq!(out, pipeline);
        }
    }

    #[test]
    fn bare_lf_where_a_line_ends_is_overwritten() {
        // Each has exactly one bare LF, where a line ends.
        let cases: [&[u8]; 6] = [
            b"GET / HTTP/1.1\nHost: a\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\nHost: a\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\n0\r\n\r\n",
        ];
        for input in cases {
            let bare = |i: usize| input[i] == b'\n' && (i == 0 || input[i - 1] != b'\r');
            let at = (0..input.len()).find(|&i| bare(i)).unwrap_or(usize::MAX);
            assert_eq!((at + 1..input.len()).find(|&i| bare(i)), None);
            for (out, found) in every_split(input) {
                assert!(found, "{:?}", String::from_utf8_lossy(input));
                assert_eq!(out[at], 0);
                assert_eq!(out[..at], input[..at]);
            }
        }
    }

    #[test]
    fn upgrades_connect_and_what_hyper_refuses_end_the_check() {
        let after = |head: &[u8]| {
            let mut input = head.to_vec();
            input.extend_from_slice(b"raw\nbytes\n");
            let (out, found) = feed(&input, 7);
            !found && out == input
        };
        assert!(after(
            b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
        ));
        assert!(after(b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n"));
        assert!(after(
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        ));
        assert!(after(
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n"
        ));
        let (_, found) = feed(&vec![b'a'; 70 * 1024], 4096);
        assert!(!found);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// One valid request: a head with a few headers, then no body, a `Content-Length` body
        /// or a chunked one (with trailers sometimes). Bodies hold any bytes, bare LFs included.
        fn request() -> impl Strategy<Value = Vec<u8>> {
            let value = "[ -~]{0,20}";
            let body = proptest::collection::vec(any::<u8>(), 0..40);
            let chunks =
                proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..20), 0..4);
            (
                prop_oneof![Just("GET"), Just("POST"), Just("PUT")],
                proptest::collection::vec(("x-[a-z]{1,8}", value), 0..4),
                0u8..3,
                body,
                chunks,
                any::<bool>(),
            )
                .prop_map(|(method, headers, framing, body, chunks, trailers)| {
                    let mut out = format!("{method} /p HTTP/1.1\r\nHost: h\r\n").into_bytes();
                    for (k, v) in headers {
                        out.extend_from_slice(format!("{k}: {}\r\n", v.trim()).as_bytes());
                    }
                    match framing {
                        0 => out.extend_from_slice(b"\r\n"),
                        1 => {
                            out.extend_from_slice(
                                format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes(),
                            );
                            out.extend_from_slice(&body);
                        }
                        _ => {
                            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                            for c in chunks {
                                out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
                                out.extend_from_slice(&c);
                                out.extend_from_slice(b"\r\n");
                            }
                            out.extend_from_slice(b"0\r\n");
                            if trailers {
                                out.extend_from_slice(b"X-Trailer: t\r\n");
                            }
                            out.extend_from_slice(b"\r\n");
                        }
                    }
                    out
                })
        }

        proptest! {
            #[test]
            fn valid_pipelines_are_never_touched(
                reqs in proptest::collection::vec(request(), 1..5),
                cuts in proptest::collection::vec(1usize..64, 1..20),
            ) {
                let input: Vec<u8> = reqs.concat();
                let mut f = Framing::new(64 * 1024);
                let mut out = input.clone();
                let mut at = 0;
                for cut in cuts.iter().cycle() {
                    if at >= out.len() { break; }
                    let end = (at + cut).min(out.len());
                    prop_assert!(!f.scan(&mut out[at..end]));
                    at = end;
                }
                prop_assert_eq!(out, input);
            }

            #[test]
            fn any_bytes_any_split_at_most_one_lf_overwritten(
                input in proptest::collection::vec(any::<u8>(), 0..300),
                step in 1usize..50,
            ) {
                let mut f = Framing::new(256);
                let mut out = input.clone();
                let mut found = false;
                for piece in out.chunks_mut(step) {
                    found |= f.scan(piece);
                }
                let changed: Vec<usize> = (0..input.len()).filter(|&i| input[i] != out[i]).collect();
                prop_assert!(changed.len() <= 1);
                prop_assert_eq!(found, changed.len() == 1);
                for i in changed {
                    prop_assert_eq!((input[i], out[i]), (b'\n', 0));
                }
            }
        }
    }
}
