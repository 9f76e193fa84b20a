//! Forwarding a planned request over a pooled upstream socket and relaying the response: its
//! head re-emitted without hop-by-hop fields, its body following its framing.

use bytes::Buf;
use http::{StatusCode, header};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::framing::{Chunked, Framing};
use super::wire::{
    IoFail, copy_body, decimal, head_end, put_date, put_field, read_some, tokens, write,
};
use super::{BODY_READ, COALESCE, Conn, MAX_FIELDS, Next, Plan, Stop};
use crate::Error;
use crate::http::headers::{Field, VIA_HTTP1, field};
use crate::metrics::Outcome;

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
        // Body bytes read with the head ride in the same write.
        let have = usize::try_from(plan.body)
            .unwrap_or(usize::MAX)
            .min(self.buf.len());
        self.out.extend_from_slice(&self.buf[..have]);
        self.buf.advance(have);
        let body_left = plan.body - have as u64;
        let replayable = body_left == 0 && plan.idempotent;
        let close_client = plan.close || self.drain.is_draining();

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
            self.ubuf.clear();
            let sent = async {
                write(&mut up, &self.out, idle)
                    .await
                    .map_err(|_| IoFail::Upstream)?;
                if body_left > 0 {
                    copy_body(io, &mut self.buf, &mut up, body_left, idle).await?;
                }
                read_some(&mut up, &mut self.ubuf, 8 * 1024, idle)
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
                        return self
                            .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                            .await;
                    }
                }
            }
            if self.ubuf.len() >= max_head {
                tracing::warn!(upstream = %plan.upstream, "response head too large");
                return self
                    .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                    .await;
            }
            match read_some(&mut up, &mut self.ubuf, 8 * 1024, idle).await {
                Ok(n) if n > 0 => {}
                _ => {
                    tracing::warn!(upstream = %plan.upstream, "upstream closed mid-head");
                    return self
                        .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                        .await;
                }
            }
        };

        // The head goes out with as much of the body as is here already.
        let Ok((n, mut done)) = framing.take(&self.ubuf) else {
            tracing::warn!(upstream = %plan.upstream, "invalid response body framing");
            return self
                .fail(io, StatusCode::BAD_GATEWAY, close_client, plan.head)
                .await;
        };
        let client_err = |_| Stop::Close("client write error");
        self.record(plan.outcome);
        if n <= COALESCE {
            self.out.extend_from_slice(&self.ubuf[..n]);
            write(io, &self.out, idle).await.map_err(client_err)?;
        } else {
            write(io, &self.out, idle).await.map_err(client_err)?;
            write(io, &self.ubuf[..n], idle).await.map_err(client_err)?;
        }
        self.ubuf.advance(n);
        while !done {
            self.ubuf.clear();
            let n = match read_some(&mut up, &mut self.ubuf, BODY_READ, idle).await {
                Ok(0) if matches!(framing, Framing::UntilClose) => break,
                Ok(0) | Err(_) => return Err(Stop::Close("upstream closed mid-body")),
                Ok(_) => match framing.take(&self.ubuf) {
                    Ok((n, d)) => {
                        done = d;
                        n
                    }
                    Err(()) => return Err(Stop::Close("invalid response body framing")),
                },
            };
            write(io, &self.ubuf[..n], idle).await.map_err(client_err)?;
            self.ubuf.advance(n);
        }
        let until_close = matches!(framing, Framing::UntilClose);
        // Bytes past the response's end were never asked for: that connection is out of step.
        if keep && !until_close && self.ubuf.is_empty() {
            pool.put_raw(plan.upstream.clone(), up);
        }
        if close_client || until_close {
            let _ = io.shutdown().await;
            return Ok((Next::Close, plan.outcome));
        }
        Ok((Next::KeepAlive, plan.outcome))
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
        write(io, &self.out, idle)
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
