//! Reading a request head and planning its exchange: whether the relay forwards it, where the
//! router sends it, and the upstream head with the proxy's header edits spliced in.

use http::{HeaderValue, header};
use spur_h1guard::valid_authority;

use super::wire::{decimal, origin_form, put_field, tokens};
use super::{Conn, MAX_FIELDS, MAX_RELAY_BODY, Plan, Stop};
use crate::http::headers::{
    FORWARDED_PROTO, Field, VIA_HTTP1, X_FORWARDED_FOR, X_FORWARDED_PROTO, field,
};
use crate::metrics::Outcome;
use crate::plugin::RawRoute;
use crate::pool::Upstream;
use crate::router::Route;

impl Conn<'_> {
    /// Reads the head at the start of `buf`, decides whether the relay forwards it, routes it,
    /// and writes the upstream head into `out`.
    pub(super) fn plan(&mut self, len: usize) -> Result<Plan, Stop> {
        let shared = self.shared;
        let config = &shared.config;
        // Without raw routing no request can be forwarded as read.
        let Some(raw) = shared.plugins.raw.as_deref() else {
            return Err(Stop::HandOver);
        };
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        let mut req = httparse::Request::new(&mut fields);
        match req.parse(&self.buf[..len]) {
            Ok(httparse::Status::Complete(n)) if n == len => {}
            _ => return Err(Stop::HandOver),
        }
        let (Some(method), Some(target), Some(1)) = (req.method, req.path, req.version) else {
            return Err(Stop::HandOver);
        };
        if req.headers.len() > config.max_headers
            || target.len() > config.max_uri_len
            || method == "CONNECT"
            || !origin_form(target.as_bytes())
        {
            return Err(Stop::HandOver);
        }

        let mut hosts = 0;
        let mut body = None;
        let mut close = false;
        let mut te_trailers = false;
        let mut xff = None;
        let mut xfp = false;
        // Empty: the map is emptied once a request is routed, and every return before that hands
        // the connection over to hyper (`?` in `exchange`), so no later request reads it.
        let carriers = &mut self.carriers;
        debug_assert!(carriers.is_empty());
        let mut kinds = [Field::Other; MAX_FIELDS];
        for (i, (f, kind)) in req.headers.iter().zip(kinds.iter_mut()).enumerate() {
            let name = f.name.as_bytes();
            *kind = field(name);
            match *kind {
                Field::Host => {
                    hosts += 1;
                    if !valid_authority(f.value) {
                        return Err(Stop::HandOver);
                    }
                }
                Field::ContentLength => {
                    if body.is_some() {
                        return Err(Stop::HandOver);
                    }
                    match decimal(f.value) {
                        Some(n) if n <= MAX_RELAY_BODY => body = Some(n),
                        _ => return Err(Stop::HandOver),
                    }
                }
                Field::TransferEncoding | Field::Expect => return Err(Stop::HandOver),
                Field::Connection => {
                    for token in tokens(f.value) {
                        if token.eq_ignore_ascii_case(b"close") {
                            close = true;
                        } else if !token.eq_ignore_ascii_case(b"keep-alive") {
                            // It names fields to strip, or asks for an upgrade.
                            return Err(Stop::HandOver);
                        }
                    }
                }
                Field::Te => {
                    te_trailers |= tokens(f.value).any(|t| t.eq_ignore_ascii_case(b"trailers"));
                }
                Field::XForwardedFor => {
                    if xff.replace(i).is_some() {
                        return Err(Stop::HandOver);
                    }
                }
                Field::XForwardedProto => xfp = true,
                Field::HopByHop => {}
                Field::Other => {
                    if let Some(trace) = &shared.plugins.trace
                        && trace.is_sampled(name, f.value)
                    {
                        // Recorded on the full path, which sees every header.
                        return Err(Stop::HandOver);
                    }
                    if let Some(n) = raw.carrier(name) {
                        debug_assert!(n.as_str().as_bytes().eq_ignore_ascii_case(name));
                        match HeaderValue::from_bytes(f.value) {
                            Ok(v) => {
                                carriers.append(n, v);
                            }
                            Err(_) => return Err(Stop::HandOver),
                        }
                    }
                }
            }
        }
        if hosts != 1 {
            return Err(Stop::HandOver);
        }
        let Some(RawRoute { route, set }) = raw.route_raw(self.meta, target, carriers) else {
            return Err(Stop::HandOver);
        };
        if let Some(capture) = &shared.plugins.capture {
            // A byte search: cheaper than `split_once`'s char searcher on short targets.
            let query = target
                .bytes()
                .position(|b| b == b'?')
                .and_then(|i| target.get(i + 1..));
            if capture
                .select
                .select(self.meta, &route, carriers, query)
                .is_some()
            {
                // Captured exchanges take the full path, where the capture is.
                return Err(Stop::HandOver);
            }
        }
        // Nothing reads them after this: an idle connection does not keep a key's values.
        carriers.clear();
        let (upstream, outcome) = match &route {
            Route::Original => (
                Upstream::Original(self.meta.original_dst),
                Outcome::Baseline,
            ),
            Route::Destination(d) => {
                tracing::debug!(client = %self.meta.client, key = %d.routing_key, sandbox = %d.sandbox, to = %d.location, "routed to sandbox");
                (Upstream::Sandbox(d.location.clone()), Outcome::Sandbox)
            }
        };

        let out = &mut self.out;
        out.clear();
        out.extend_from_slice(method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        let set_name = set.as_ref().map(|(n, _)| n.as_str().as_bytes());
        for (i, (f, kind)) in req.headers.iter().zip(kinds).enumerate() {
            let name = f.name.as_bytes();
            match kind {
                Field::Connection | Field::Te | Field::HopByHop => continue,
                Field::XForwardedFor if config.forwarded_headers && xff == Some(i) => {
                    out.extend_from_slice(name);
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(f.value);
                    out.extend_from_slice(b", ");
                    out.extend_from_slice(self.meta.client_ip.as_bytes());
                    out.extend_from_slice(b"\r\n");
                    continue;
                }
                _ => {}
            }
            if set_name.is_some_and(|s| s.eq_ignore_ascii_case(name)) {
                continue;
            }
            put_field(out, name, f.value);
        }
        if te_trailers {
            out.extend_from_slice(b"te: trailers\r\n");
        }
        if let Some((name, value)) = &set {
            put_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
        put_field(out, header::VIA.as_str().as_bytes(), VIA_HTTP1.as_bytes());
        if config.forwarded_headers {
            if xff.is_none() {
                put_field(
                    out,
                    X_FORWARDED_FOR.as_str().as_bytes(),
                    self.meta.client_ip.as_bytes(),
                );
            }
            if !xfp {
                put_field(
                    out,
                    X_FORWARDED_PROTO.as_str().as_bytes(),
                    FORWARDED_PROTO.as_bytes(),
                );
            }
        }
        out.extend_from_slice(b"\r\n");
        Ok(Plan {
            upstream,
            outcome,
            body: body.unwrap_or(0),
            head: method == "HEAD",
            close,
            idempotent: matches!(
                method,
                "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
            ),
        })
    }
}
