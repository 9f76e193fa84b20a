//! `spur test record SANDBOX`: a smart test written from a sandbox's captured traffic (the
//! traffic store, read as `spur traffic query` reads it, with the user's own token): one step
//! per distinct request, oldest first, each checking the status the capture saw. What a test
//! stored in the cluster must not hold is left out: credentials and redacted values, the routing
//! key and its carriers (a run adds its own key), framing and hop-by-hop headers. Requests whose
//! body the capture cut short are skipped, and said so.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use base64::Engine as _;
use clap::Args;
use serde_json::{Value, json};
use spur_proto::traffic::{Exchange, Header, Protocol};
use spur_smarttest::TestSpec;
use spur_smarttest::spec::{
    Check, GrpcRequest, HeaderEntry, HttpRequest, MAX_BODY, MAX_HEADERS, MAX_STEPS, NAME_MAX, Step,
};

use crate::traffic::{Conn, Filters, STORE_LIMIT, connect, query};

/// What the sidecars write in place of a redacted header value (`spur_proxy::capture::REDACTED`,
/// checked by a test).
pub(crate) const REDACTED: &[u8] = b"<redacted>";

/// Request headers a recorded step never carries besides the reserved ones
/// (`spur_routing::extract::RESERVED_HEADERS`, less `content-type`), the routing-key carriers
/// and [`DROPPED_PREFIXES`]: the answers must be comparable (no compression), nothing of a
/// session's credentials or gRPC framing is kept, and nothing a proxy added on the way (the
/// capture sees the request as the sidecar forwarded it: a replayed `x-spur-routed` would tell
/// the sidecar the request was routed already, and it would go to the baseline).
const DROPPED: [&str; 8] = [
    "accept-encoding",
    "set-cookie",
    "via",
    "forwarded",
    "x-request-id",
    "grpc-timeout",
    "grpc-encoding",
    "grpc-accept-encoding",
];

/// Prefixes of the names of headers proxies add (Spur's sidecars, Envoy, forwarders).
const DROPPED_PREFIXES: [&str; 5] = ["x-spur-", "x-envoy-", "x-forwarded-", "proxy-", ":"];

#[derive(Args)]
pub(crate) struct RecordArgs {
    /// The sandbox (or route group) whose captured requests to turn into a test.
    sandbox: String,
    #[command(flatten)]
    filters: Filters,
    /// Only exchanges that started within this long (e.g. 10m, 1h).
    #[arg(long, value_parser = spur_runtime::parse_duration)]
    since: Option<Duration>,
    /// At most this many steps: the newest distinct requests, kept in the order they were made
    /// (at most 100).
    #[arg(long, default_value_t = 20)]
    limit: usize,
    /// Write a SmartTest manifest of this name (apply it with kubectl) instead of a test file
    /// for `spur test run -f`.
    #[arg(long)]
    name: Option<String>,
    /// The manifest's namespace, whose Services it lists as exercised [default: the namespace of
    /// the first step's Service].
    #[arg(short = 'n', long, requires = "name")]
    namespace: Option<String>,
    /// Write to this file instead of standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    #[command(flatten)]
    conn: Conn,
}

pub(crate) async fn record(a: RecordArgs) -> Result<()> {
    if a.limit == 0 || a.limit > MAX_STEPS {
        bail!("--limit {}: between 1 and {MAX_STEPS}", a.limit);
    }
    if let Some(name) = &a.name
        && !spur_api::validation::is_dns_label(name)
    {
        bail!("--name {name:?}: not a DNS label (a SmartTest's name)");
    }
    let filter = a.filters.filter(a.sandbox.clone(), a.since)?;
    let mut client = connect(&a.conn).await?;
    let limit = u32::try_from(a.limit * 10)
        .unwrap_or(STORE_LIMIT)
        .min(STORE_LIMIT);
    // Newest first from the store; the test goes in the order the requests were made.
    let mut exchanges: Vec<Exchange> = query(&mut client, &a.conn, filter, limit)
        .await?
        .into_iter()
        .map(|(x, _)| x)
        .collect();
    exchanges.reverse();
    if exchanges.is_empty() {
        bail!(
            "no captured exchanges of {} match: is capture on for it (`spur traffic capture on {}`), and were requests made with its key?",
            a.sandbox,
            a.sandbox
        );
    }
    let recorded = steps_from(&exchanges, a.limit);
    for note in &recorded.skipped {
        crate::sandbox::note(format_args!("spur: skipped {note}"));
    }
    if recorded.spec.steps.is_empty() {
        bail!(
            "none of the {} exchanges could become a step (reasons above)",
            exchanges.len()
        );
    }
    recorded
        .spec
        .validate()
        .context("the recorded test does not validate (a bug: please report it)")?;
    let header = format!(
        "# Recorded by `spur test record` from {} captured exchanges of {}: {} steps.\n\
         # Each checks the status the capture saw; add checks of your own (docs/smart-tests.md).\n",
        exchanges.len(),
        a.sandbox,
        recorded.spec.steps.len()
    );
    let body = match &a.name {
        None => serde_yaml_ng::to_string(&recorded.spec)?,
        Some(name) => {
            let namespace = a
                .namespace
                .clone()
                .or_else(|| recorded.namespaces.first().cloned());
            let services = services_in(&recorded.spec, namespace.as_deref());
            let mut metadata = json!({"name": name});
            if let Some(ns) = &namespace {
                metadata["namespace"] = ns.clone().into();
            }
            let mut spec = serde_json::to_value(&recorded.spec)?;
            if !services.is_empty() {
                spec["services"] = services.into_iter().collect::<Vec<_>>().into();
            }
            let manifest = json!({
                "apiVersion": "spur.dev/v1alpha1",
                "kind": "SmartTest",
                "metadata": metadata,
                "spec": spec,
            });
            // What `kubectl apply` will be asked to take, checked as the resource.
            spur_api::SmartTestSpec::from_file_value(manifest["spec"].clone())
                .context("the recorded SmartTest does not validate (a bug: please report it)")?;
            serde_yaml_ng::to_string(&manifest)?
        }
    };
    let text = format!("{header}{body}");
    match &a.output {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
            crate::sandbox::note(format_args!(
                "spur: wrote {} steps to {}",
                recorded.spec.steps.len(),
                path.display()
            ));
        }
        None => out!("{text}"),
    }
    Ok(())
}

/// A test made of exchanges, and what could not be used.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    pub(crate) spec: TestSpec,
    /// One line per exchange left out, and why.
    pub(crate) skipped: Vec<String>,
    /// The namespaces of the steps' Services, in the order first seen.
    pub(crate) namespaces: Vec<String>,
}

/// The steps of `exchanges` (oldest first): one per distinct request, the newest `limit` of
/// them, in order.
pub(crate) fn steps_from(exchanges: &[Exchange], limit: usize) -> Recorded {
    let mut out = Recorded::default();
    let mut steps: Vec<(Step, String, String)> = Vec::new();
    for x in exchanges {
        let what = format!("{} {}{}", x.method, x.authority, x.path);
        match step_of(x) {
            Ok((step, namespace)) => {
                // The same request twice is one step (its last answer's status is checked).
                let same = serde_json::to_string(&(&step.http, &step.grpc)).unwrap_or_default();
                steps.retain(|(_, _, other)| *other != same);
                steps.push((step, namespace, same));
            }
            Err(why) => out
                .skipped
                .push(format!("{}: {why}", crate::text::one_line(&what))),
        }
    }
    let first = steps.len().saturating_sub(limit);
    if first > 0 {
        out.skipped.push(format!(
            "{first} older distinct requests (--limit {limit} keeps the newest)"
        ));
    }
    let mut names = BTreeSet::new();
    for (mut step, namespace, _) in steps.into_iter().skip(first) {
        step.name = unique(&step.name, &mut names);
        if !namespace.is_empty() && !out.namespaces.contains(&namespace) {
            out.namespaces.push(namespace);
        }
        out.spec.steps.push(step);
    }
    out
}

/// One exchange as a step, with the namespace of the Service it was sent to (empty when the
/// address names none); `Err` says why it cannot be one.
fn step_of(x: &Exchange) -> Result<(Step, String), String> {
    if !x.error.is_empty() {
        return Err(format!("it failed ({})", x.error));
    }
    let body = x.request_body.clone().unwrap_or_default();
    if body.truncated {
        return Err(format!(
            "its request body ({} bytes) was captured only in part (the capture's body limit)",
            body.size
        ));
    }
    if body.data.len() > MAX_BODY {
        return Err(format!(
            "its request body is larger than a step may hold ({MAX_BODY} bytes)"
        ));
    }
    let baseline_ns = x
        .baseline
        .as_ref()
        .map(|b| b.namespace.as_str())
        .unwrap_or_default();
    let (authority, namespace) = address(&x.authority, baseline_ns)?;
    let headers = kept_headers(&x.request_headers, &x.routing_key);
    let protocol = Protocol::try_from(x.protocol).unwrap_or(Protocol::Unspecified);
    let step = match protocol {
        Protocol::Grpc => {
            let message = grpc_message(&body.data)?;
            let status = header_value(&x.response_trailers, "grpc-status")
                .or_else(|| header_value(&x.response_headers, "grpc-status"))
                .and_then(|s| s.parse().ok());
            let method = x.path.trim_start_matches('/').to_owned();
            Step {
                name: step_name("grpc", method.rsplit('/').next().unwrap_or_default()),
                grpc: Some(GrpcRequest {
                    target: authority,
                    method,
                    message_base64: base64::engine::general_purpose::STANDARD.encode(message),
                    metadata: headers
                        .into_iter()
                        .filter(|h| h.name != "content-type" && h.name != "user-agent")
                        .collect(),
                    ..Default::default()
                }),
                checks: status
                    .map(|s| Check {
                        grpc_status: Some(s),
                        ..Default::default()
                    })
                    .into_iter()
                    .collect(),
                ..Default::default()
            }
        }
        Protocol::Http1 | Protocol::Http2 => {
            if x.status == 0 {
                return Err("no response was captured".into());
            }
            let (text, json) = request_body(&body.data, &headers)?;
            let method = (!x.method.eq_ignore_ascii_case("GET")).then(|| x.method.clone());
            Step {
                name: step_name(&x.method, x.path.split('?').next().unwrap_or_default()),
                http: Some(HttpRequest {
                    method,
                    url: format!("http://{authority}{}", x.path),
                    headers,
                    body: text,
                    json,
                }),
                checks: vec![Check {
                    status: u16::try_from(x.status).ok(),
                    ..Default::default()
                }],
                ..Default::default()
            }
        }
        Protocol::Websocket => return Err("a WebSocket: a step is one request".into()),
        Protocol::Unspecified => return Err("its protocol is unknown".into()),
    };
    Ok((step, namespace))
}

/// Where a step sends what the capture saw sent to `authority`, and that Service's namespace.
/// A bare Service name was resolved in the client's namespace, which the capture does not know:
/// it is the baseline's (the Service is in its workload's namespace), and says so, so the test
/// runs from any namespace.
fn address(authority: &str, baseline_ns: &str) -> Result<(String, String), String> {
    let uri: http::uri::Authority = authority
        .parse()
        .map_err(|_| format!("its address {authority:?} is not host[:port]"))?;
    let host = uri.host();
    let port = uri.port_u16().map(|p| format!(":{p}")).unwrap_or_default();
    if host.parse::<std::net::IpAddr>().is_ok()
        || host.starts_with('[')
        || host.eq_ignore_ascii_case("localhost")
    {
        return Ok((authority.to_owned(), String::new()));
    }
    let labels: Vec<&str> = host.split('.').collect();
    Ok(match labels.as_slice() {
        [service] if !baseline_ns.is_empty() => (
            format!("{service}.{baseline_ns}{port}"),
            baseline_ns.to_owned(),
        ),
        [_, ns, ..] => (authority.to_owned(), (*ns).to_owned()),
        _ => (authority.to_owned(), String::new()),
    })
}

/// The headers a step keeps (see the module's comment), at most [`MAX_HEADERS`].
fn kept_headers(headers: &[Header], key: &str) -> Vec<HeaderEntry> {
    let extractor = spur_routing::extract::KeyExtractor::standard();
    let carriers: Vec<&str> = extractor.headers().map(|h| h.as_str()).collect();
    headers
        .iter()
        .filter_map(|h| {
            let name = h.name.to_ascii_lowercase();
            let value = std::str::from_utf8(&h.value).ok()?;
            let reserved = spur_routing::extract::RESERVED_HEADERS.contains(&name.as_str())
                && name != "content-type";
            let dropped = DROPPED_PREFIXES.iter().any(|p| name.starts_with(p))
                || reserved
                || DROPPED.contains(&name.as_str())
                || carriers.contains(&name.as_str())
                || h.value == REDACTED
                || (!key.is_empty() && value.contains(key));
            (!dropped).then(|| HeaderEntry {
                name,
                value: value.to_owned(),
            })
        })
        .take(MAX_HEADERS)
        .collect()
}

fn header_value<'a>(headers: &'a [Header], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(name))
        .and_then(|h| std::str::from_utf8(&h.value).ok())
}

/// A request body as a step's `body` (text) or `json` (when the request said it is JSON, so the
/// step sends it the same way); a body that is not text cannot be a step's.
fn request_body(
    data: &[u8],
    headers: &[HeaderEntry],
) -> Result<(Option<String>, Option<Value>), String> {
    if data.is_empty() {
        return Ok((None, None));
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return Err("its request body is not text (a step's body is)".into());
    };
    let is_json = headers
        .iter()
        .any(|h| h.name == "content-type" && h.value.contains("json"));
    if is_json && let Ok(v) = serde_json::from_str::<Value>(text) {
        return Ok((None, Some(v)));
    }
    Ok((Some(text.to_owned()), None))
}

/// The message of a unary gRPC request's body: one uncompressed length-prefixed frame.
fn grpc_message(data: &[u8]) -> Result<&[u8], String> {
    let Some((&[flag, a, b, c, d], rest)) = data.split_first_chunk::<5>() else {
        return Err("its gRPC request has no whole message".into());
    };
    if flag != 0 {
        return Err("its gRPC request message is compressed".into());
    }
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if rest.len() != len {
        return Err("its gRPC request is not one message (a streaming call?)".into());
    }
    Ok(rest)
}

/// `get-api-items` for `GET /api/items`: lower-case letters, digits and dashes, starting with a
/// letter, short enough for a `-NN` suffix.
fn step_name(method: &str, path: &str) -> String {
    let mut name = String::new();
    for c in format!("{method}-{path}").chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            name.push(c);
        } else if !name.ends_with('-') {
            name.push('-');
        }
    }
    let mut name: String = name.trim_matches('-').chars().take(NAME_MAX - 4).collect();
    while name.ends_with('-') {
        name.pop();
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        name.insert_str(0, "step-");
    }
    name
}

/// `base`, or `base-2`, `base-3`… the first not in `names` (then added to it).
fn unique(base: &str, names: &mut BTreeSet<String>) -> String {
    let mut name = base.to_owned();
    let mut n = 1;
    while names.contains(&name) {
        n += 1;
        name = String::new();
        let _ = write!(name, "{base}-{n}");
    }
    names.insert(name.clone());
    name
}

/// The Services in `namespace` the steps send to (a SmartTest's `services`).
fn services_in(spec: &TestSpec, namespace: Option<&str>) -> BTreeSet<String> {
    let Some(namespace) = namespace else {
        return BTreeSet::new();
    };
    spec.steps
        .iter()
        .filter_map(|s| {
            let authority = match (&s.http, &s.grpc) {
                (Some(h), _) => h
                    .url
                    .strip_prefix("http://")?
                    .split(['/', '?'])
                    .next()?
                    .to_owned(),
                (None, Some(g)) => g.target.clone(),
                (None, None) => return None,
            };
            let host = authority
                .rsplit_once(':')
                .map_or(authority.as_str(), |(h, _)| h);
            let mut labels = host.split('.');
            let service = labels.next()?;
            (labels.next() == Some(namespace) && spur_api::validation::is_dns_label(service))
                .then(|| service.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::traffic::{Body, Workload};

    fn header(name: &str, value: &str) -> Header {
        Header {
            name: name.into(),
            value: value.as_bytes().to_vec(),
        }
    }

    fn exchange(method: &str, authority: &str, path: &str, body: &str) -> Exchange {
        Exchange {
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: "api".into(),
            }),
            sandbox: "pr-1".into(),
            routing_key: "k1abc".into(),
            protocol: Protocol::Http1.into(),
            method: method.into(),
            path: path.into(),
            authority: authority.into(),
            status: 200,
            request_headers: vec![
                header("host", authority),
                header("baggage", "sd-routing-key=k1abc"),
                header("x-team-key", "k1abc"),
                header("authorization", "<redacted>"),
                header("x-api-token", "<redacted>"),
                header("accept-encoding", "gzip"),
                header("content-type", "application/json"),
                header("x-feature", "blue"),
                header("x-spur-routed", "Deployment/shop/api"),
                header("via", "1.1 spur"),
                header("x-forwarded-for", "10.0.0.1"),
            ],
            request_body: Some(Body {
                size: body.len() as u64,
                data: body.as_bytes().to_vec(),
                truncated: false,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn exchanges_become_steps_without_credentials_or_the_key() {
        let mut cut = exchange("POST", "api:8080", "/upload", "xx");
        cut.request_body = Some(Body {
            size: 1 << 20,
            data: b"xx".to_vec(),
            truncated: true,
        });
        let mut failed = exchange("GET", "api:8080", "/down", "");
        failed.error = "upstream unreachable".into();
        let xs = [
            exchange("GET", "api:8080", "/api/items?page=2", ""),
            exchange("POST", "api.shop.svc:8080", "/api/items", r#"{"name":"a"}"#),
            cut,
            failed,
            // The same request again: one step.
            exchange("GET", "api:8080", "/api/items?page=2", ""),
            exchange("GET", "api:8080", "/api/items?page=3", ""),
        ];
        let r = steps_from(&xs, 20);
        let names: Vec<&str> = r.spec.steps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["post-api-items", "get-api-items", "get-api-items-2"]
        );
        let get = r.spec.steps[1].http.as_ref().unwrap();
        assert_eq!(get.url, "http://api.shop:8080/api/items?page=2");
        assert_eq!(get.method, None);
        let kept: Vec<(&str, &str)> = get
            .headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_str()))
            .collect();
        assert_eq!(
            kept,
            [("content-type", "application/json"), ("x-feature", "blue")]
        );
        let post = r.spec.steps[0].http.as_ref().unwrap();
        assert_eq!(post.method.as_deref(), Some("POST"));
        assert_eq!(post.url, "http://api.shop.svc:8080/api/items");
        assert_eq!(post.json, Some(json!({"name": "a"})));
        assert_eq!(r.spec.steps[0].checks[0].status, Some(200));
        assert_eq!(r.skipped.len(), 2, "{:?}", r.skipped);
        assert!(
            r.skipped[0].contains("captured only in part"),
            "{:?}",
            r.skipped
        );
        assert!(
            r.skipped[1].contains("upstream unreachable"),
            "{:?}",
            r.skipped
        );
        assert_eq!(r.namespaces, ["shop"]);
        r.spec.validate().unwrap();
        assert_eq!(
            services_in(&r.spec, Some("shop")),
            BTreeSet::from(["api".to_owned()])
        );

        // The newest distinct requests when there are more than the limit.
        let r = steps_from(&xs, 1);
        assert_eq!(r.spec.steps.len(), 1);
        assert_eq!(
            r.spec.steps[0].http.as_ref().unwrap().url,
            "http://api.shop:8080/api/items?page=3"
        );
        assert!(
            r.skipped.iter().any(|s| s.contains("2 older distinct")),
            "{:?}",
            r.skipped
        );
    }

    #[test]
    fn a_unary_grpc_call_becomes_a_grpc_step() {
        let mut x = exchange("POST", "grpc-api:9090", "/shop.Items/Get", "");
        x.protocol = Protocol::Grpc.into();
        let frame = [&[0u8, 0, 0, 0, 2][..], &[8, 1]].concat();
        x.request_body = Some(Body {
            size: frame.len() as u64,
            data: frame,
            truncated: false,
        });
        x.response_trailers = vec![header("grpc-status", "5")];
        let r = steps_from(std::slice::from_ref(&x), 20);
        let step = &r.spec.steps[0];
        assert_eq!(step.name, "grpc-get");
        let g = step.grpc.as_ref().unwrap();
        assert_eq!(g.target, "grpc-api.shop:9090");
        assert_eq!(g.method, "shop.Items/Get");
        assert_eq!(g.message_base64, "CAE=");
        assert_eq!(step.checks[0].grpc_status, Some(5));
        r.spec.validate().unwrap();

        // Two messages: a streaming call, not a step.
        let two = [&[0u8, 0, 0, 0, 1][..], &[8], &[0, 0, 0, 0, 1], &[8]].concat();
        x.request_body = Some(Body {
            size: two.len() as u64,
            data: two,
            truncated: false,
        });
        let r = steps_from(&[x], 20);
        assert!(r.spec.steps.is_empty());
        assert!(r.skipped[0].contains("not one message"), "{:?}", r.skipped);
    }

    #[test]
    fn names_and_addresses() {
        assert_eq!(step_name("GET", "/"), "get");
        assert_eq!(step_name("GET", "/Ünïcode/ÄÖ/x"), "get-n-code-x");
        assert_eq!(step_name("", "/9lives"), "step-9lives");
        assert!(step_name("GET", &"/a".repeat(100)).len() <= NAME_MAX - 4);
        let mut names = BTreeSet::new();
        assert_eq!(unique("a", &mut names), "a");
        assert_eq!(unique("a", &mut names), "a-2");
        assert_eq!(
            address("127.0.0.1:8080", "shop").unwrap(),
            ("127.0.0.1:8080".into(), String::new())
        );
        assert_eq!(
            address("localhost", "shop").unwrap(),
            ("localhost".into(), String::new())
        );
        assert_eq!(
            address("api", "shop").unwrap(),
            ("api.shop".into(), "shop".into())
        );
        assert!(address("a b", "shop").is_err());
    }

    #[test]
    fn the_redaction_marker_is_the_sidecars() {
        assert_eq!(REDACTED, spur_proxy::capture::REDACTED);
    }
}
