//! Forwarding a planned request over a pooled upstream socket and relaying the response: its
//! head re-emitted without hop-by-hop fields, its body following its framing.

use bytes::{Buf, BytesMut};
use http::{StatusCode, header};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::batch::{IoFail, READ_MAX, READ_MIN, copy_body, due, write_parts};
use super::framing::{Chunked, Framing};
use super::wire::{decimal, head_end, put_date, put_field, tokens};
use super::{COALESCE, Conn, MAX_FIELDS, Next, Plan, Stop};
use crate::Error;
use crate::http::headers::{Field, VIA_HTTP1, field};
use crate::metrics::Outcome;

/// Why a body stopped before its framing said it was complete.
enum Cut {
    /// The upstream closed: the end of a close-delimited body.
    Eof,
    /// A read failed.
    Failed,
    /// The body broke its framing.
    Invalid,
}

impl Conn<'_> {
    /// Sends the planned request (head in `out`, body from the client) and relays the response.
    /// From here on the request is the relay's: failures are answered, not handed over.
    pub(super) async fn forward<IO>(
        &mut self,
        io: &mut IO,
        plan: &Plan,
    ) -> Result<(Next, Outcome), Stop>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let idle = self.shared.config.idle_timeout;
        let pool = &self.shared.pool;
        // Body bytes read with the head ride in the same write: copied behind it when few, as a
        // part of a vectored write otherwise (kept until the request is sent, for a retry).
        let have = usize::try_from(plan.body)
            .unwrap_or(usize::MAX)
            .min(self.buf.len());
        let mut body_left = plan.body - have as u64;
        let replayable = body_left == 0 && plan.idempotent;
        let close_client = plan.close || self.drain.is_draining();
        let body_now = if have <= COALESCE {
            self.out.extend_from_slice(&self.buf[..have]);
            self.buf.advance(have);
            BytesMut::new()
        } else {
            self.buf.split_to(have)
        };
        // So does what the client has sent of the rest since its head was read: a read that
        // does not wait (free when tokio knows the socket drained). All it held was body, so a
        // byte past the body begins the next request. EOF or an error shows again to
        // `copy_body`, which reports it.
        self.ubuf.clear();
        let mut more = 0;
        if body_left > 0
            && let Some(Ok(n)) = self.ubuf.read_now(io, due(body_left, READ_MAX))
        {
            more = usize::try_from(body_left).unwrap_or(usize::MAX).min(n);
            self.buf.extend_from_slice(&self.ubuf[more..]);
            self.ubuf.truncate(more);
            body_left -= more as u64;
        }

        let mut pooled = pool.take_raw(&plan.upstream);
        let mut up = loop {
            let (mut up, reused) = match pooled.take() {
                Some(s) => (s, true),
                None => match pool.connect_tcp(&plan.upstream).await {
                    Ok(s) => (s, false),
                    Err(e) => {
                        tracing::warn!(client = %self.meta.client, error = %e, "upstream request failed");
                        let status = match e {
                            Error::ConnectTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                            _ => StatusCode::BAD_GATEWAY,
                        };
                        return self
                            .fail(io, status, close_client || body_left > 0, plan.head)
                            .await;
                    }
                },
            };
            let sent = async {
                // A retry only follows a request whose body was all read with its head
                // (`replayable`), so `more` is 0 then and `ubuf` holds no body.
                write_parts(&mut up, [&self.out, &body_now, &self.ubuf[..more]], idle)
                    .await
                    .map_err(|_| IoFail::Upstream)?;
                if body_left > 0 {
                    copy_body(io, &mut self.ubuf, &mut self.buf, &mut up, body_left, idle).await?;
                }
                self.ubuf.clear();
                self.read_response(&mut up)
                    .await
                    .map_err(|_| IoFail::Upstream)
            }
            .await;
            match sent {
                Ok(n) if n > 0 => break up,
                // A kept-alive connection its server closed just before this request: nothing
                // was processed, so a request that can be sent again is, on a new connection.
                Ok(_) | Err(IoFail::Upstream) if reused && replayable => continue,
                Err(IoFail::Client) => return Err(Stop::Close("client failed mid-body")),
                Ok(_) | Err(IoFail::Upstream) => {
                    tracing::warn!(client = %self.meta.client, upstream = %plan.upstream, "upstream closed before responding");
                    return self
                        .fail(
                            io,
                            StatusCode::BAD_GATEWAY,
                            close_client || body_left > 0,
                            plan.head,
                        )
                        .await;
                }
            }
        };
        drop(body_now);

        let (next, outcome, reusable) = self.respond(io, &mut up, plan, close_client).await?;
        if reusable {
            pool.put_raw(plan.upstream.clone(), up);
        }
        Ok((next, outcome))
    }

    /// One read of a response into `ubuf`, as large as recent ones showed arrives at once.
    pub(super) async fn read_response<U>(&mut self, up: &mut U) -> std::io::Result<usize>
    where
        U: AsyncRead + Unpin,
    {
        let size = self.reads.get();
        let n = self
            .ubuf
            .read(up, size, self.shared.config.idle_timeout)
            .await?;
        self.reads.record(n);
        Ok(n)
    }

    /// Relays the response from `up`, whose first bytes are in `ubuf` ([`Conn::read_response`]).
    /// Also says whether `up` may carry another request: its response ended where its framing
    /// said, with nothing after it.
    pub(super) async fn respond<IO, U>(
        &mut self,
        io: &mut IO,
        up: &mut U,
        plan: &Plan,
        close_client: bool,
    ) -> Result<(Next, Outcome, bool), Stop>
    where
        IO: AsyncWrite + Unpin,
        U: AsyncRead + Unpin,
    {
        let failed = |r: Result<(Next, Outcome), Stop>| r.map(|(n, o)| (n, o, false));
        // The response head, after any interim (1xx) responses, which are not forwarded.
        let max_head = self.shared.config.max_header_bytes * 2;
        let mut scanned = 0;
        let mut bare_lf = false;
        let (mut framing, keep) = loop {
            if let Some(len) = head_end(&self.ubuf, &mut scanned, &mut bare_lf) {
                match self.response_head(len, plan.head, close_client) {
                    Ok(Resp::Interim) => {
                        self.ubuf.advance(len);
                        scanned = 0;
                        continue;
                    }
                    Ok(Resp::Final { framing, keep }) => {
                        self.ubuf.advance(len);
                        break (framing, keep);
                    }
                    Err(why) => {
                        tracing::warn!(upstream = %plan.upstream, why, "invalid response from upstream");
                        let r = self
                            .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                            .await;
                        return failed(r);
                    }
                }
            }
            if self.ubuf.len() >= max_head {
                tracing::warn!(upstream = %plan.upstream, "response head too large");
                let r = self
                    .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                    .await;
                return failed(r);
            }
            match self.read_response(up).await {
                Ok(n) if n > 0 => {}
                _ => {
                    tracing::warn!(upstream = %plan.upstream, "upstream closed mid-head");
                    let r = self
                        .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                        .await;
                    return failed(r);
                }
            }
        };

        // The head goes out with as much of the body as is here already.
        let Ok((taken, done)) = framing.take(&self.ubuf) else {
            tracing::warn!(upstream = %plan.upstream, "invalid response body framing");
            let r = self
                .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                .await;
            return failed(r);
        };
        self.record(plan.outcome);
        let drained = self
            .relay_body(io, up, &mut framing, (taken, done), keep)
            .await?;
        let until_close = matches!(framing, Framing::UntilClose);
        let reusable = keep && !until_close && drained;
        if close_client || until_close {
            let _ = io.shutdown().await;
            return Ok((Next::Close, plan.outcome, reusable));
        }
        Ok((Next::KeepAlive, plan.outcome, reusable))
    }

    /// Writes the head in `out` and the body that follows it from `up`, whose first `taken`
    /// bytes start `ubuf` (`done`: that is all of it). What has come is written at once, in one
    /// write per batch; a batch grows without waiting while reads fill what they asked for (see
    /// [`super::batch`]), up to [`READ_MAX`] bytes. True: the body ended as framed, and `up` is
    /// known to hold nothing more (checked only if `keep`).
    async fn relay_body<IO, U>(
        &mut self,
        io: &mut IO,
        up: &mut U,
        framing: &mut Framing,
        (mut taken, mut done): (usize, bool),
        keep: bool,
    ) -> Result<bool, Stop>
    where
        IO: AsyncWrite + Unpin,
        U: AsyncRead + Unpin,
    {
        let idle = self.shared.config.idle_timeout;
        let client_err = |_| Stop::Close("client write error");
        let until_close = matches!(framing, Framing::UntilClose);
        let mut head = true;
        loop {
            let mut cut = None;
            while !done && self.ubuf.full() {
                let room = READ_MAX.saturating_sub(self.ubuf.len());
                let (size, ends) = match framing {
                    Framing::Fixed(left) => {
                        let size = due(*left, room);
                        (size, size as u64 > *left)
                    }
                    _ => (self.reads.get().min(room), false),
                };
                // A small read that cannot end the body would only split the next one.
                if size == 0 || (size < READ_MIN && !ends) {
                    break;
                }
                match self.ubuf.read_now(up, size) {
                    None => break,
                    Some(Ok(0)) => cut = Some(Cut::Eof),
                    Some(Err(_)) => cut = Some(Cut::Failed),
                    Some(Ok(n)) => {
                        self.reads.record(n);
                        match framing.take(&self.ubuf[taken..]) {
                            Ok((n, d)) => (taken, done) = (taken + n, d),
                            Err(()) => cut = Some(Cut::Invalid),
                        }
                    }
                }
                if cut.is_some() {
                    break;
                }
            }
            let body = &self.ubuf[..taken];
            let written = if std::mem::take(&mut head) {
                if taken <= COALESCE {
                    self.out.extend_from_slice(body);
                    write_parts(io, [&self.out], idle).await
                } else {
                    write_parts(io, [&self.out, body], idle).await
                }
            } else {
                write_parts(io, [body], idle).await
            };
            written.map_err(client_err)?;
            self.ubuf.advance(taken);
            if done {
                break;
            }
            match cut {
                Some(Cut::Eof) if until_close => return Ok(false),
                Some(Cut::Eof | Cut::Failed) => {
                    return Err(Stop::Close("upstream closed mid-body"));
                }
                Some(Cut::Invalid) => return Err(Stop::Close("invalid response body framing")),
                None => {}
            }
            self.ubuf.clear();
            let size = match framing {
                Framing::Fixed(left) => due(*left, READ_MAX),
                _ => self.reads.get(),
            };
            match self.ubuf.read(up, size, idle).await {
                Ok(0) if until_close => return Ok(false),
                Ok(0) | Err(_) => return Err(Stop::Close("upstream closed mid-body")),
                Ok(n) => self.reads.record(n),
            }
            (taken, done) = framing
                .take(&self.ubuf)
                .map_err(|()| Stop::Close("invalid response body framing"))?;
        }
        // Bytes past the response's end were never asked for: that connection is out of step.
        if !keep || !self.ubuf.is_empty() {
            return Ok(false);
        }
        // The read that ended the response filled what it asked for, so tokio still deems the
        // socket readable and the pool would drop it: a read that does not wait settles it
        // (nothing there: reusable; bytes, EOF or an error: not).
        if self.ubuf.full() {
            return Ok(self.ubuf.read_now(up, READ_MIN).is_none());
        }
        Ok(true)
    }

    /// Reads the response head at the start of `ubuf` and writes the client's version of it into
    /// `out`.
    fn response_head(
        &mut self,
        len: usize,
        head_request: bool,
        close_client: bool,
    ) -> Result<Resp, &'static str> {
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        let mut resp = httparse::Response::new(&mut fields);
        match resp.parse(&self.ubuf[..len]) {
            Ok(httparse::Status::Complete(n)) if n == len => {}
            _ => return Err("unparsable head"),
        }
        let (Some(version), Some(code)) = (resp.version, resp.code) else {
            return Err("unparsable head");
        };
        // httparse reads any three digits; `StatusCode` holds HTTP's, 100 to 999 (RFC 9110 §15).
        let Ok(status) = StatusCode::from_u16(code) else {
            return Err("invalid status code");
        };
        if code == 101 {
            return Err("101 without an upgrade request");
        }
        if (100..200).contains(&code) {
            return Ok(Resp::Interim);
        }
        let mut keep = version == 1;
        let mut named: Vec<&[u8]> = Vec::new();
        let mut chunked = None;
        let mut length = None;
        let mut kinds = [Field::Other; MAX_FIELDS];
        for (f, kind) in resp.headers.iter().zip(kinds.iter_mut()) {
            *kind = field(f.name.as_bytes());
            match *kind {
                Field::Connection => {
                    for t in tokens(f.value) {
                        if t.eq_ignore_ascii_case(b"close") {
                            keep = false;
                        } else if t.eq_ignore_ascii_case(b"keep-alive") {
                            keep |= version == 0;
                        } else {
                            named.push(t);
                        }
                    }
                }
                Field::TransferEncoding => {
                    // The last coding of the last field is the final one.
                    match tokens(f.value).last() {
                        Some(last) => chunked = Some(last.eq_ignore_ascii_case(b"chunked")),
                        None => return Err("empty Transfer-Encoding"),
                    }
                }
                Field::ContentLength => match decimal(f.value) {
                    Some(n) if length.is_none_or(|l| l == n) => length = Some(n),
                    _ => return Err("invalid or conflicting Content-Length"),
                },
                _ => {}
            }
        }
        // Framing fields are checked even where no body follows (HEAD, 204, 304): a response
        // that carries both is refused, not passed on for the next hop to read its own way.
        let framing = match (chunked, length) {
            (Some(_), Some(_)) => return Err("both Transfer-Encoding and Content-Length"),
            _ if head_request || code == 204 || code == 304 => Framing::Empty,
            (Some(true), None) => Framing::Chunked(Chunked::default()),
            (Some(false), None) | (None, None) => Framing::UntilClose,
            (None, Some(n)) => Framing::Fixed(n),
        };

        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        let mut dated = false;
        for (f, kind) in resp.headers.iter().zip(kinds) {
            let name = f.name.as_bytes();
            if matches!(kind, Field::Connection | Field::Te | Field::HopByHop)
                || named.iter().any(|n| n.eq_ignore_ascii_case(name))
            {
                continue;
            }
            dated |= name.eq_ignore_ascii_case(b"date");
            put_field(out, name, f.value);
        }
        if !dated {
            put_date(out);
        }
        if close_client || matches!(framing, Framing::UntilClose) {
            out.extend_from_slice(b"connection: close\r\n");
        }
        put_field(out, header::VIA.as_str().as_bytes(), VIA_HTTP1.as_bytes());
        out.extend_from_slice(b"\r\n");
        Ok(Resp::Final { framing, keep })
    }

    /// Answers an exchange the proxy could not complete (without the body if the request was a
    /// HEAD). The client's connection stays open unless part of its request body is unread.
    async fn fail<IO>(
        &mut self,
        io: &mut IO,
        status: StatusCode,
        close: bool,
        head: bool,
    ) -> Result<(Next, Outcome), Stop>
    where
        IO: AsyncWrite + Unpin,
    {
        const BODY: &[u8] = b"spur: upstream unavailable\n";
        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        put_date(out);
        out.extend_from_slice(b"content-type: text/plain\r\ncontent-length: ");
        out.extend_from_slice(BODY.len().to_string().as_bytes());
        if close {
            out.extend_from_slice(b"\r\nconnection: close");
        }
        out.extend_from_slice(b"\r\n\r\n");
        if !head {
            out.extend_from_slice(BODY);
        }
        self.record(Outcome::Error);
        let idle = self.shared.config.idle_timeout;
        write_parts(io, [&self.out], idle)
            .await
            .map_err(|_| Stop::Close("client write error"))?;
        if close {
            let _ = io.shutdown().await;
            return Ok((Next::Close, Outcome::Error));
        }
        Ok((Next::KeepAlive, Outcome::Error))
    }
}

enum Resp {
    /// A 1xx response other than 101: read past it.
    Interim,
    Final {
        framing: Framing,
        /// The upstream connection may carry another request afterwards.
        keep: bool,
    },
}
