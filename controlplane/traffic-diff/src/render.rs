//! Exchanges and comparisons as text for a person (control characters escaped) and as the
//! JSON that `spur traffic ... --json` prints.

use serde_json::{Value, json};
use spur_proto::traffic::{Body, Exchange, Header, Protocol};

use crate::compare::{Comparison, Difference, body};
use crate::pair::{Pair, PairedOn, workload_name};
use crate::text::{encode_base64, printable, rfc3339};

/// The line for a sandbox exchange no baseline exchange answers.
pub fn unpaired_line(x: &Exchange) -> String {
    format!(
        "no baseline exchange for {} {} (add a virtual workload of {} to a reference sandbox \
         and send the same request with its key)",
        printable(&x.method),
        printable(&x.path),
        workload_name(x)
    )
}

/// A compared pair as text, appended to `out`.
pub fn render_pair(out: &mut String, p: &Pair<'_>, c: &Comparison) {
    use std::fmt::Write as _;
    let (b, s) = (p.baseline, p.sandbox);
    let from = if b.sandbox.is_empty() {
        "-"
    } else {
        &b.sandbox
    };
    let mark = if c.differences.is_empty() { '=' } else { '≠' };
    let _ = writeln!(
        out,
        "{mark} {} {}  {}  baseline {} ({from}) → sandbox {}",
        printable(&s.method),
        printable(&s.path),
        workload_name(s),
        rfc3339(b.start_unix_micros),
        rfc3339(s.start_unix_micros),
    );
    if p.on == PairedOn::Path {
        let path = printable(&b.path);
        let _ = writeln!(
            out,
            "    (paired on the path only: the baseline's was {path})"
        );
    }
    for d in &c.differences {
        let _ = writeln!(out, "    {}", d.render());
    }
    for n in &c.notes {
        let _ = writeln!(out, "    ({n})");
    }
}

/// A compared pair as JSON (`spur traffic diff --json`).
pub fn pair_json(p: &Pair<'_>, c: &Comparison) -> Value {
    let side = |x: &Exchange| {
        json!({"id": x.id, "time": rfc3339(x.start_unix_micros), "sandbox": x.sandbox,
               "destination": x.destination, "path": x.path})
    };
    let on = match p.on {
        PairedOn::PathAndQuery => "pathAndQuery",
        PairedOn::Path => "path",
    };
    let differences: Vec<Value> = c.differences.iter().map(Difference::to_json).collect();
    json!({
        "workload": workload_name(p.sandbox),
        "method": p.sandbox.method,
        "path": p.sandbox.path,
        "pairedOn": on,
        "sandboxExchange": side(p.sandbox),
        "baselineExchange": side(p.baseline),
        "differences": differences,
        "notes": c.notes,
    })
}

/// One `tail`/`query` line.
pub fn exchange_line(x: &Exchange) -> String {
    let routed = if x.destination.is_empty() {
        "baseline"
    } else {
        &x.destination
    };
    let status = match x.status {
        0 => "-".to_owned(),
        n => n.to_string(),
    };
    let mut line = format!(
        "{}  {}  {routed}  {} {}  {status}  {:.1}ms  {}B",
        rfc3339(x.start_unix_micros),
        x.sandbox,
        printable(&x.method),
        printable(&x.path),
        x.duration_micros as f64 / 1000.0,
        body(x).size,
    );
    if !x.error.is_empty() {
        line = format!("{line}  error: {}", printable(&x.error));
    }
    line
}

/// The `--json` shape of an exchange (documented on `spur traffic query --help`).
pub fn exchange_json(x: &Exchange, stored_unix_micros: i64) -> Value {
    let w = x.baseline.clone().unwrap_or_default();
    let protocol = match Protocol::try_from(x.protocol) {
        Ok(Protocol::Http1) => "http1",
        Ok(Protocol::Http2) => "http2",
        Ok(Protocol::Grpc) => "grpc",
        Ok(Protocol::Websocket) => "websocket",
        _ => "unspecified",
    };
    let error = (!x.error.is_empty()).then_some(&x.error);
    json!({
        "id": x.id,
        "time": rfc3339(x.start_unix_micros),
        "startUnixMicros": x.start_unix_micros,
        "storedUnixMicros": stored_unix_micros,
        "sandbox": x.sandbox,
        "routingKey": x.routing_key,
        "baseline": {"kind": w.kind, "namespace": w.namespace, "name": w.name},
        "pod": x.pod,
        "routed": if x.destination.is_empty() { "baseline" } else { "sandbox" },
        "destination": x.destination,
        "protocol": protocol,
        "method": x.method,
        "path": x.path,
        "authority": x.authority,
        "status": x.status,
        "responseMicros": x.response_micros,
        "durationMicros": x.duration_micros,
        "error": error,
        "requestHeaders": headers_json(&x.request_headers),
        "responseHeaders": headers_json(&x.response_headers),
        "responseTrailers": headers_json(&x.response_trailers),
        "requestBody": body_json(x.request_body.clone().unwrap_or_default()),
        "responseBody": body_json(body(x)),
    })
}

pub(crate) fn headers_json(headers: &[Header]) -> Value {
    headers
        .iter()
        .map(|h| match std::str::from_utf8(&h.value) {
            Ok(v) => json!([h.name, v]),
            Err(_) => json!([h.name, encode_base64(&h.value), "base64"]),
        })
        .collect()
}

pub(crate) fn body_json(b: Body) -> Value {
    let (encoding, data) = match String::from_utf8(b.data) {
        Ok(text) => ("utf8", text),
        Err(e) => ("base64", encode_base64(e.as_bytes())),
    };
    json!({"size": b.size, "truncated": b.truncated, "encoding": encoding, "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::exchange;

    #[test]
    fn exchange_line_and_json() {
        let mut x = exchange("api", "GET", "/items", 1_700_000_000_000_000);
        x.sandbox = "sb".into();
        x.destination = "10.0.0.7:8080".into();
        x.duration_micros = 12_345;
        x.response_body = Some(Body {
            size: 42,
            data: b"ok".to_vec(),
            truncated: true,
        });
        assert_eq!(
            exchange_line(&x),
            "2023-11-14T22:13:20.000Z  sb  10.0.0.7:8080  GET /items  200  12.3ms  42B"
        );
        let j = exchange_json(&x, 7);
        assert_eq!(j["routed"], "sandbox");
        assert_eq!(j["error"], Value::Null);
        assert_eq!(
            j["responseBody"],
            json!({"size": 42, "truncated": true, "encoding": "utf8", "data": "ok"})
        );
    }
}
