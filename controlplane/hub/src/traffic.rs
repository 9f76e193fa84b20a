//! The web view's traffic tab (`/traffic?cluster=C&sandbox=S`): a sandbox's captured exchanges
//! (docs/traffic.md), newest first, with their headers and the first bytes of their bodies.
//! They are read through the cluster's agent from the cluster's own traffic store when the page
//! is asked for; the hub keeps none of them. The hub asks only for a sandbox its user may see,
//! and the agent reads only what the user's Kubernetes identity may (`sandboxes/traffic`).

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use prost::Message as _;
use spur_proto::traffic::{Body as CapturedBody, Exchange, Header, QueryReply};

use crate::Error;
use crate::clusters::Clusters;
use crate::html::esc;
use crate::protocol::{KubeIdentity, MAX_TRAFFIC_LIMIT, Open, TRAFFIC_PATH};

/// How long opening the agent's stream may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the whole read may take (the agent's own limit is 10 s).
const READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest answer read from the agent (the store caps its replies at 16 MiB).
const MAX_REPLY: usize = 20 * 1024 * 1024;
/// Body bytes shown per direction (the agent sends no more); the rest is a `spur traffic query
/// --json` away.
const SHOWN_BODY: usize = crate::protocol::TRAFFIC_BODY_BYTES;
/// Bytes of a binary body shown, as hex.
const SHOWN_HEX: usize = 256;

/// What the page was asked for, from its query string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrafficParams {
    pub cluster: String,
    pub sandbox: String,
    pub path: String,
    pub method: String,
    pub status: String,
    pub limit: String,
}

impl TrafficParams {
    pub fn parse(query: &str) -> TrafficParams {
        let mut p = TrafficParams::default();
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            let v = v.trim().to_owned();
            match &*k {
                "cluster" => p.cluster = v,
                "sandbox" => p.sandbox = v,
                "path" => p.path = v,
                "method" => p.method = v.to_ascii_uppercase(),
                "status" => p.status = v,
                "limit" => p.limit = v,
                _ => {}
            }
        }
        p
    }

    /// The agent's query string (it checks every value again).
    fn agent_query(&self) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("sandbox", &self.sandbox);
        for (k, v) in [
            ("path", &self.path),
            ("method", &self.method),
            ("status", &self.status),
            ("limit", &self.limit),
        ] {
            if !v.is_empty() {
                q.append_pair(k, v);
            }
        }
        q.finish()
    }
}

/// Reads a sandbox's exchanges from `cluster`'s traffic store through its agent, for `as_user`
/// (the agent reads only what that Kubernetes identity may).
pub async fn read(
    clusters: &Clusters,
    p: &TrafficParams,
    as_user: KubeIdentity,
) -> Result<QueryReply, Error> {
    let attempt = async {
        let path = format!("{TRAFFIC_PATH}?{}", p.agent_query());
        let resp = clusters
            .http_get(&p.cluster, &Open::Traffic { as_user }, &path, OPEN_TIMEOUT)
            .await?;
        let status = resp.status();
        let body = crate::catalog::read_limited(
            resp.into_body(),
            MAX_REPLY,
            "reading the agent's traffic answer",
        )
        .await?;
        if status != StatusCode::OK {
            // The agent's errors are Kubernetes-style Status objects; say what they say.
            let message = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("message")?.as_str().map(str::to_owned))
                .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into());
            return Err(Error::Upstream(format!("{status}: {message}")));
        }
        QueryReply::decode(body)
            .map_err(|e| Error::Upstream(format!("the agent's answer is not a QueryReply: {e}")))
    };
    tokio::time::timeout(READ_TIMEOUT, attempt)
        .await
        .map_err(|_| {
            Error::Unavailable(format!(
                "no answer from {:?} within {READ_TIMEOUT:?}",
                p.cluster
            ))
        })?
}

/// The page's main content: the filter form, then the exchanges (or why there are none).
pub fn render(p: &TrafficParams, result: &Result<QueryReply, Error>, now: SystemTime) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<p><a href=\"/\">← all clusters</a></p><h2>Traffic of sandbox {} in {}</h2>",
        esc(&p.sandbox),
        esc(&p.cluster)
    );
    let _ = write!(
        out,
        "<form class=filter method=get action=\"/traffic\">\
         <input type=hidden name=cluster value=\"{}\"><input type=hidden name=sandbox value=\"{}\">\
         <label>Path prefix <input name=path value=\"{}\" placeholder=\"/api\"></label> \
         <label>Method <input name=method size=7 value=\"{}\"></label> \
         <label>Status <input name=status size=4 value=\"{}\"></label> \
         <label>Show <input name=limit size=4 value=\"{}\" placeholder=\"50\"></label> \
         <button>Filter</button></form>",
        esc(&p.cluster),
        esc(&p.sandbox),
        esc(&p.path),
        esc(&p.method),
        esc(&p.status),
        esc(&p.limit),
    );
    let reply = match result {
        Ok(reply) => reply,
        Err(e) => {
            let _ = write!(
                out,
                "<p class=bad>Cannot read this sandbox's traffic: {}</p>",
                esc(&e.to_string())
            );
            return out;
        }
    };
    if reply.exchanges.is_empty() {
        out.push_str(
            "<p class=dim>No captured exchange matches. Capture is off by default: \
             <code>spur traffic capture on SANDBOX</code> turns it on.</p>",
        );
        return out;
    }
    let _ = write!(
        out,
        "<p class=dim>{} exchanges, newest first (at most {MAX_TRAFFIC_LIMIT} per page). \
         Bodies are cut at {SHOWN_BODY} bytes here; <code>spur traffic query</code> and \
         <code>spur traffic diff</code> show the rest.</p>",
        reply.exchanges.len()
    );
    out.push_str(
        "<table class=traffic><tr><th>When</th><th>Workload</th><th>Answered by</th><th>Request</th>\
         <th>Status</th><th>Time</th><th>Sizes</th></tr>",
    );
    for stored in &reply.exchanges {
        let Some(x) = &stored.exchange else { continue };
        exchange_row(&mut out, x, now);
    }
    out.push_str("</table>");
    out
}

fn exchange_row(out: &mut String, x: &Exchange, now: SystemTime) {
    let when = u64::try_from(x.start_unix_micros)
        .ok()
        .map(|us| UNIX_EPOCH + Duration::from_micros(us))
        .map_or_else(|| "-".into(), |t| crate::html::ago(now, t));
    let workload = x
        .baseline
        .as_ref()
        .map_or_else(String::new, |w| format!("{}/{}", w.namespace, w.name));
    let answered = if x.destination.is_empty() {
        "baseline".to_owned()
    } else {
        x.destination.clone()
    };
    let status = match (x.status, x.error.is_empty()) {
        (0, true) => "<span class=dim>-</span>".to_owned(),
        (0, false) => format!("<span class=bad title=\"{}\">failed</span>", esc(&x.error)),
        (s, _) if s >= 500 => format!("<span class=bad>{s}</span>"),
        (s, _) => s.to_string(),
    };
    let size = |b: &Option<CapturedBody>| b.as_ref().map_or(0, |b| b.size);
    let _ = write!(
        out,
        "<tr><td>{}</td><td><code>{}</code></td><td><code>{}</code></td>\
         <td><details><summary><code>{} {}</code></summary>{}</details></td>\
         <td>{status}</td><td>{}</td><td>{} B / {} B</td></tr>",
        esc(&when),
        esc(&workload),
        esc(&answered),
        esc(&x.method),
        esc(&x.path),
        detail(x),
        millis(x.duration_micros),
        size(&x.request_body),
        size(&x.response_body),
    );
}

/// Headers and bodies of one exchange, for its `<details>`.
fn detail(x: &Exchange) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<div class=detail><p class=dim>authority <code>{}</code> · pod <code>{}</code> · \
         routing key <code>{}</code> · response head after {}</p>",
        esc(&x.authority),
        esc(&x.pod),
        esc(&x.routing_key),
        millis(x.response_micros),
    );
    if !x.error.is_empty() {
        let _ = write!(out, "<p class=bad>{}</p>", esc(&x.error));
    }
    headers(&mut out, "Request headers", &x.request_headers);
    body(&mut out, "Request body", x.request_body.as_ref());
    headers(&mut out, "Response headers", &x.response_headers);
    body(&mut out, "Response body", x.response_body.as_ref());
    if !x.response_trailers.is_empty() {
        headers(&mut out, "Response trailers", &x.response_trailers);
    }
    out.push_str("</div>");
    out
}

fn headers(out: &mut String, title: &str, headers: &[Header]) {
    let _ = write!(out, "<h3>{title}</h3><pre>");
    for h in headers {
        let _ = writeln!(
            out,
            "{}: {}",
            esc(&h.name),
            esc(&String::from_utf8_lossy(&h.value))
        );
    }
    out.push_str("</pre>");
}

fn body(out: &mut String, title: &str, b: Option<&CapturedBody>) {
    let Some(b) = b.filter(|b| b.size > 0) else {
        return;
    };
    let _ = write!(out, "<h3>{title} ({} bytes)</h3>", b.size);
    if b.data.is_empty() {
        out.push_str("<p class=dim>not stored (capture keeps no bodies here)</p>");
        return;
    }
    let mut shown = &b.data[..b.data.len().min(SHOWN_BODY)];
    match std::str::from_utf8(shown) {
        Ok(text) => {
            let _ = write!(out, "<pre>{}</pre>", esc(text));
        }
        // A cut may split a character: show what decodes.
        Err(e) if e.error_len().is_none() => {
            shown = &shown[..e.valid_up_to()];
            let text = std::str::from_utf8(shown).unwrap_or_default();
            let _ = write!(out, "<pre>{}</pre>", esc(text));
        }
        Err(_) => {
            shown = &shown[..shown.len().min(SHOWN_HEX)];
            let hex: String = shown
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ");
            let _ = write!(
                out,
                "<p class=dim>binary; the first bytes:</p><pre>{hex}</pre>"
            );
        }
    }
    if (shown.len() as u64) < b.size {
        let _ = write!(
            out,
            "<p class=dim>… {} of {} bytes shown</p>",
            shown.len(),
            b.size
        );
    }
}

fn millis(us: u64) -> String {
    if us < 10_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        format!("{} ms", us / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::traffic::{StoredExchange, Workload};

    fn exchange() -> Exchange {
        Exchange {
            id: "p/1/1".into(),
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: "backend".into(),
            }),
            pod: "backend-1".into(),
            sandbox: "sb".into(),
            routing_key: "k1".into(),
            destination: "backend-fix.shop.svc:80".into(),
            method: "POST".into(),
            path: "/cart?<x>".into(),
            status: 502,
            request_headers: vec![Header {
                name: "authorization".into(),
                value: b"<redacted>".to_vec(),
            }],
            response_body: Some(CapturedBody {
                size: 10_000,
                data: vec![b'a'; 5000],
                truncated: true,
            }),
            request_body: Some(CapturedBody {
                size: 3,
                data: vec![0xff, 0x00, 0x01],
                truncated: false,
            }),
            start_unix_micros: 1,
            duration_micros: 12_345,
            ..Exchange::default()
        }
    }

    #[test]
    fn params_round_trip_to_the_agent_query() {
        let p =
            TrafficParams::parse("cluster=east&sandbox=sb%201&path=%2Fapi&method=get&status=&x=1");
        assert_eq!(p.cluster, "east");
        assert_eq!(p.sandbox, "sb 1");
        assert_eq!(p.method, "GET");
        assert_eq!(p.agent_query(), "sandbox=sb+1&path=%2Fapi&method=GET");
        let q = crate::agent::traffic_query(&p.agent_query()).unwrap();
        let f = q.filter.unwrap();
        assert_eq!(
            (f.sandbox.as_str(), f.path_prefix.as_str(), q.limit),
            ("sb 1", "/api", 50)
        );
    }

    #[test]
    fn the_agent_refuses_bad_filters() {
        for bad in [
            "",
            "sandbox=a&limit=0",
            "sandbox=a&limit=201",
            "sandbox=a&status=42",
            "sandbox=a&evil=1",
        ] {
            assert!(crate::agent::traffic_query(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_agent_cuts_bodies_to_what_the_page_shows() {
        let mut reply = QueryReply {
            exchanges: vec![StoredExchange {
                exchange: Some(exchange()),
                stored_unix_micros: 1,
            }],
        };
        crate::agent::cut_bodies(&mut reply);
        let x = reply.exchanges[0].exchange.as_ref().unwrap();
        let resp = x.response_body.as_ref().unwrap();
        assert_eq!((resp.data.len(), resp.truncated), (SHOWN_BODY, true));
        let req = x.request_body.as_ref().unwrap();
        assert_eq!((req.data.len(), req.truncated), (3, false));
    }

    #[test]
    fn a_binary_body_says_how_much_of_it_is_shown() {
        let mut x = exchange();
        x.request_body = Some(CapturedBody {
            size: 1000,
            data: vec![0xfe; 1000],
            truncated: false,
        });
        let mut out = String::new();
        body(&mut out, "Request body", x.request_body.as_ref());
        assert!(out.contains("256 of 1000 bytes shown"), "{out}");
        assert_eq!(out.matches("fe").count(), SHOWN_HEX);
    }

    #[test]
    fn a_page_escapes_everything_and_cuts_bodies() {
        let p = TrafficParams::parse("cluster=east&sandbox=<sb>");
        let reply = QueryReply {
            exchanges: vec![StoredExchange {
                exchange: Some(exchange()),
                stored_unix_micros: 1,
            }],
        };
        let html = render(&p, &Ok(reply), SystemTime::now());
        assert!(
            !html.contains("<sb>") && html.contains("&lt;sb&gt;"),
            "{html}"
        );
        assert!(html.contains("/cart?&lt;x&gt;"));
        assert!(html.contains("<span class=bad>502</span>"));
        assert!(html.contains("12 ms"));
        assert!(
            html.contains(&"a".repeat(SHOWN_BODY)) && !html.contains(&"a".repeat(SHOWN_BODY + 1))
        );
        assert!(html.contains("4096 of 10000 bytes shown"));
        assert!(html.contains("ff 00 01"));
        assert!(html.contains("authorization: &lt;redacted&gt;"));
        let html = render(&p, &Err(Error::Upstream("<no>".into())), SystemTime::now());
        assert!(html.contains("&lt;no&gt;") && !html.contains("<no>"));
    }
}
