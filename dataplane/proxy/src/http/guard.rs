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

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Longest chunk size line (with extensions) followed; hyper's limit is far below.
const MAX_CHUNK_LINE: usize = 4096;
/// Headers parsed per head; a request with more is left to hyper's own limit.
const MAX_HEADERS: usize = 128;

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

/// The framing follower (see the module docs); separate from the I/O so it can be tested with
/// any split of the byte stream.
#[derive(Debug)]
pub(crate) struct Framing {
    state: State,
    /// The current head, chunk size line or trailer section.
    line: Vec<u8>,
    prev: u8,
    max_head: usize,
}

impl Framing {
    pub(crate) fn new(max_head: usize) -> Self {
        Framing {
            state: State::Head,
            line: Vec::new(),
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
                        (State::Fixed(_), 0) => self.begin(State::Head),
                        (State::Fixed(_), _) => State::Fixed(left),
                        (_, 0) => State::ChunkEnd(0),
                        _ => State::ChunkData(left),
                    };
                }
                State::ChunkEnd(seen) => {
                    let b = data[i];
                    match (seen, b) {
                        (0, b'\r') => self.state = State::ChunkEnd(1),
                        (1, b'\n') => self.state = self.begin(State::ChunkSize),
                        (0, b'\n') => return self.bare_lf(data, i),
                        // hyper refuses chunk data that does not end with CRLF.
                        _ => self.state = State::Passthrough,
                    }
                    i += 1;
                }
                State::Head | State::ChunkSize | State::Trailers => {
                    let rest = &data[i..];
                    match rest.iter().position(|&b| b == b'\n') {
                        None => {
                            self.push(rest);
                            i = data.len();
                        }
                        Some(nl) => {
                            let before = if nl == 0 { self.prev } else { rest[nl - 1] };
                            if before != b'\r' {
                                return self.bare_lf(data, i + nl);
                            }
                            self.push(&rest[..=nl]);
                            i += nl + 1;
                            if self.state != State::Passthrough {
                                self.line_ended();
                            }
                        }
                    }
                }
            }
        }
        false
    }

    /// Adds bytes to the current line; past the limit, stops checking (hyper refuses heads that
    /// long itself).
    fn push(&mut self, bytes: &[u8]) {
        let Some(&last) = bytes.last() else {
            return;
        };
        self.prev = last;
        self.line.extend_from_slice(bytes);
        let limit = match self.state {
            State::ChunkSize => MAX_CHUNK_LINE,
            _ => self.max_head,
        };
        if self.line.len() > limit {
            self.state = State::Passthrough;
            self.line = Vec::new();
        }
    }

    fn bare_lf(&mut self, data: &mut [u8], at: usize) -> bool {
        data[at] = 0;
        self.state = State::Passthrough;
        self.line = Vec::new();
        true
    }

    /// Enters `state` with an empty line buffer.
    fn begin(&mut self, state: State) -> State {
        // A large head once must not pin its buffer for the life of a keep-alive connection.
        if self.line.capacity() > 8 * 1024 {
            self.line = Vec::new();
        }
        self.line.clear();
        self.prev = 0;
        state
    }

    /// A CRLF-terminated line was added to `self.line`.
    fn line_ended(&mut self) {
        let line = self.line.as_slice();
        self.state = match self.state {
            // Empty lines before a request line are allowed (RFC 9112 §2.2).
            State::Head if line == b"\r\n" => self.begin(State::Head),
            State::Head if line.ends_with(b"\r\n\r\n") => {
                let next = body_of(line);
                self.begin(next)
            }
            State::ChunkSize => match httparse::parse_chunk_size(line) {
                Ok(httparse::Status::Complete((_, 0))) => self.begin(State::Trailers),
                Ok(httparse::Status::Complete((_, size))) => {
                    self.line.clear();
                    State::ChunkData(size)
                }
                // hyper refuses it too (and the proxy answers 400).
                _ => State::Passthrough,
            },
            State::Trailers if line == b"\r\n" || line.ends_with(b"\r\n\r\n") => {
                self.begin(State::Head)
            }
            other => other,
        };
    }
}

/// What follows a complete request head.
fn body_of(head: &[u8]) -> State {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) {
        return State::Passthrough;
    }
    if req.method == Some("CONNECT") {
        return State::Passthrough;
    }
    let mut length: Option<u64> = None;
    let mut chunked = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("upgrade") {
            // If the upgrade happens, what follows is another protocol.
            return State::Passthrough;
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.split(',').map(str::trim).next_back())
                .map(|c| c.eq_ignore_ascii_case("chunked"));
            chunked = Some(last == Some(true));
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok());
            match (n, length) {
                (Some(n), None) => length = Some(n),
                (Some(n), Some(prev)) if n == prev => {}
                // Differing or invalid: hyper answers 400.
                _ => return State::Passthrough,
            }
        }
    }
    match (chunked, length) {
        // hyper frames by Transfer-Encoding when both are present (and closes afterwards).
        (Some(true), _) => State::ChunkSize,
        (Some(false), _) => State::Passthrough,
        (None, Some(n)) if n > 0 => State::Fixed(n),
        (None, _) => State::Head,
    }
}

pin_project_lite::pin_project! {
    /// An HTTP/1 client connection whose reads pass through [`Framing`].
    pub(crate) struct Guard<T> {
        #[pin]
        inner: T,
        framing: Framing,
    }
}

impl<T> Guard<T> {
    pub(crate) fn new(inner: T, max_head: usize) -> Self {
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

impl<T: AsyncWrite> AsyncWrite for Guard<T> {
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
