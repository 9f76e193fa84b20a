//! Runs against real servers on loopback (HTTP/1.1 and gRPC over h2c) that answer as a baseline
//! does (a fresh id and timestamp in every answer) or, for requests carrying the routing key in
//! `baggage`, as a fork does. Which one answered is in the answer itself (`served_by`), so each
//! test sees the key reach the fork and the key-less requests reach the baseline.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use spur_smarttest::run::grpc_status;
use spur_smarttest::{TestSpec, run};

const KEY: &str = "k3y7test";

/// How the fork differs from the baseline.
#[derive(Clone, Copy)]
enum Fork {
    Same,
    NoPrice,
    GrpcUnavailable,
    Slow,
    /// The fork's first answer (the `list` step's, request 1 of the server) is slow, as when a
    /// SYN is retransmitted; the next is not.
    SlowOnce,
    /// The fork's `shop.Items/Describe` answers without a price.
    GrpcNoPrice,
}

/// A server answering `/items` (JSON) and `/shop.Items/Get` (gRPC); `fork` decides what keyed
/// requests get. Returns its address; it lives as long as the test's runtime.
async fn server(fork: Fork) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counter = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    answer(req, fork, n)
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

async fn answer(
    req: Request<Incoming>,
    fork: Fork,
    n: u64,
) -> Result<Response<BoxBody<Bytes, Infallible>>, Infallible> {
    let keyed = req
        .headers()
        .get("baggage")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains(&format!("sd-routing-key={KEY}")));
    let served_by = if keyed { "fork" } else { "baseline" };
    if req.uri().path() == "/shop.Items/Describe" {
        // shop.Item {id = 1 (fresh each time), name = 2, price = 3}, hand-encoded.
        let id = format!("r{n}");
        let mut item = vec![0x0a, id.len() as u8];
        item.extend(id.as_bytes());
        item.extend([0x12, 3, b't', b'e', b'a']);
        if !(keyed && matches!(fork, Fork::GrpcNoPrice)) {
            item.extend([0x18, 3]);
        }
        let mut framed = vec![0];
        framed.extend((item.len() as u32).to_be_bytes());
        framed.extend(item);
        return Ok(grpc_reply(Bytes::from(framed), "0", served_by));
    }
    if req.uri().path() == "/shop.Items/Get" {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        // The request message back, framed, as the reply; the status in the trailers.
        let status = if keyed && matches!(fork, Fork::GrpcUnavailable) {
            "14"
        } else {
            "0"
        };
        return Ok(grpc_reply(body, status, served_by));
    }
    if keyed && (matches!(fork, Fork::Slow) || matches!(fork, Fork::SlowOnce) && n == 1) {
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let price = !(keyed && matches!(fork, Fork::NoPrice));
    let item = |i: u64| {
        let mut v = json!({"id": format!("item-{n}-{i}"), "name": format!("tea {i}")});
        if price {
            v["price"] = json!(3 + i);
        }
        v
    };
    let body = json!({
        "generatedAt": format!("2026-12-04T10:00:{:02}Z", n % 60),
        "requestId": n * 7919,
        "items": [item(0), item(1), item(2)],
        "servedBy": served_by,
    });
    // servedBy differs by side on purpose in the answer; the tests strip it from what they
    // compare by reading it first (see `served_by`), so it never shows as a finding.
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    resp.headers_mut()
        .insert("x-served-by", served_by.parse().unwrap());
    Ok(resp)
}

/// A gRPC answer: `framed` (length-prefixed messages), the status in the trailers.
fn grpc_reply(
    framed: Bytes,
    status: &str,
    served_by: &str,
) -> Response<BoxBody<Bytes, Infallible>> {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", status.parse().unwrap());
    let body = Full::new(framed)
        .with_trailers(async move { Some(Ok(trailers)) })
        .boxed();
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    resp.headers_mut()
        .insert("x-served-by", served_by.parse().unwrap());
    resp
}

fn spec(addr: SocketAddr, extra: &str) -> TestSpec {
    let yaml = format!(
        r#"
steps:
  - name: list
    http: {{url: "http://{addr}/items?limit=3"}}
    checks:
      - status: 200
      - jsonPath: {{path: "$.items[0].name", equals: "tea 0"}}
      - jsonPath: {{path: "$.items[0].price"}}
  - name: get
    grpc: {{target: "{addr}", method: shop.Items/Get, messageBase64: CgN0ZWE=}}
    checks: [{{grpcStatus: 0}}]
{extra}"#
    );
    serde_yaml_ng::from_str(&yaml).unwrap()
}

fn served_by(x: &spur_proto::traffic::Exchange) -> String {
    x.response_headers
        .iter()
        .find(|h| h.name == "x-served-by")
        .map(|h| String::from_utf8_lossy(&h.value).into_owned())
        .unwrap_or_else(|| format!("nobody ({})", x.error))
}

/// The run, after checking who answered each request.
async fn run_against(fork: Fork, extra: &str) -> spur_smarttest::RunReport {
    let addr = server(fork).await;
    checked(run(&spec(addr, extra).validate().unwrap(), KEY, None).await)
}

/// `report` after checking that the fork answered the keyed requests and the baseline the
/// others, with the side that answered (a header, a body field) taken out of what is compared,
/// as a real fork's answer would not say it.
fn checked(mut report: spur_smarttest::RunReport) -> spur_smarttest::RunReport {
    for s in &report.steps {
        assert_eq!(served_by(&s.sandbox), "fork", "{}", s.name);
        for b in &s.baseline {
            assert_eq!(served_by(b), "baseline", "{}", s.name);
        }
    }
    // The side that answered is in the body and a header: not what the sandbox changed.
    // Recompute without them, as a real fork's answer would not say it.
    for s in &mut report.steps {
        let decoded = s.decoded.iter_mut().flatten();
        for x in s.baseline.iter_mut().chain([&mut s.sandbox]).chain(decoded) {
            x.response_headers.retain(|h| h.name != "x-served-by");
            if let Some(b) = x.response_body.as_mut()
                && let Ok(mut v) = serde_json::from_slice::<Value>(&b.data)
            {
                if let Some(o) = v.as_object_mut() {
                    o.remove("servedBy");
                }
                b.data = serde_json::to_vec(&v).unwrap();
                b.size = b.data.len() as u64;
            }
        }
    }
    refind(&mut report);
    eprintln!("{}", report.render());
    report
}

/// The findings of `report` made again from its answers as they are now.
fn refind(report: &mut spur_smarttest::RunReport) {
    let observations: Vec<_> = report
        .steps
        .iter()
        .map(|s| {
            let [b1, b2, x] = s.compared();
            spur_traffic_diff::Observation {
                endpoint: s.endpoint.clone(),
                baseline: [b1, b2],
                sandbox: x,
                calls: None,
            }
        })
        .collect();
    report.findings = spur_traffic_diff::findings(&observations);
}

fn summary(r: &spur_smarttest::RunReport) -> Vec<String> {
    r.findings
        .top(50)
        .iter()
        .map(|(e, f)| format!("{e}: {} {}", f.rank.as_str(), f.difference.render()))
        .collect()
}

#[tokio::test]
async fn an_unchanged_fork_passes_though_every_answer_has_new_ids_and_times() {
    let r = run_against(Fork::Same, "").await;
    assert!(r.passed(), "{}", r.render());
    assert_eq!(r.findings.count(), 0);
    assert_eq!(r.checks_failed(), 0);
    let noise = &r.findings.endpoints.values().next().unwrap().noise;
    assert!(
        noise.iter().any(|(_, at)| at == "$.items[*].id"),
        "{noise:?}"
    );
    let j = r.to_json();
    assert_eq!(j["passed"], true);
    assert_eq!(j["steps"][1]["sandbox"]["grpcStatus"], 0);
}

#[tokio::test]
async fn a_removed_field_is_a_schema_finding_on_its_endpoint_and_a_failed_check() {
    let r = run_against(Fork::NoPrice, "").await;
    let addr = r.steps[0].endpoint.clone();
    assert_eq!(
        summary(&r),
        [format!("{addr}: schema $.items[*].price: removed 3")]
    );
    assert!(addr.starts_with("GET 127.0.0.1:") && addr.ends_with("/items"));
    let price = &r.steps[0].checks[2];
    assert_eq!(price.sandbox, Err("absent".into()));
    assert_eq!(price.baseline, Ok(()));
    assert!(!r.passed());
    assert_eq!(r.findings.endpoints[&addr].findings[0].occurrences, 3);
}

#[tokio::test]
async fn a_failing_grpc_call_is_a_status_finding() {
    let r = run_against(Fork::GrpcUnavailable, "").await;
    let get = &r.steps[1];
    assert_eq!(grpc_status(&get.sandbox), Some(14));
    assert_eq!(
        summary(&r),
        [format!(
            "{}: status trailer grpc-status: \"0\" → \"14\"",
            get.endpoint
        )]
    );
    assert_eq!(get.checks[0].sandbox, Err("grpc-status 14".into()));
}

#[tokio::test]
async fn a_slow_fork_is_a_timing_finding_and_a_timeout_is_an_error() {
    let r = run_against(Fork::Slow, "").await;
    let s = summary(&r);
    assert_eq!(s.len(), 1, "{s:?}");
    assert!(s[0].contains(": timing duration:"), "{s:?}");
    // A timeout of 1 s on a fork that never answers in time: the step records why.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    let steps: TestSpec = serde_yaml_ng::from_str(&format!(
        "steps: [{{name: hang, timeoutSeconds: 1, http: {{url: \"http://{silent}/\"}}, checks: [{{status: 200}}]}}]"
    ))
    .unwrap();
    let r = run(&steps.validate().unwrap(), KEY, None).await;
    drop(listener);
    assert_eq!(r.steps[0].sandbox.error, "no whole answer within 1 s");
    assert_eq!(
        r.steps[0].checks[0].sandbox,
        Err("no answer: no whole answer within 1 s".into())
    );
}

/// A GET whose sandbox answer would be a timing finding is timed once more: a one-off delay
/// (the network's) is no finding; a fork that stays slow is one (above).
#[tokio::test]
async fn a_slow_answer_once_is_timed_again_and_is_no_finding() {
    let r = run_against(Fork::SlowOnce, "").await;
    assert_eq!(summary(&r), Vec::<String>::new());
    assert!(r.passed(), "{}", r.render());
}

#[tokio::test]
async fn an_unreachable_service_is_an_error_on_every_side_not_a_finding() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed = listener.local_addr().unwrap();
    drop(listener);
    let steps: TestSpec = serde_yaml_ng::from_str(&format!(
        "steps: [{{name: gone, http: {{url: \"http://{closed}/\"}}, checks: [{{status: 200}}]}}]"
    ))
    .unwrap();
    let r = run(&steps.validate().unwrap(), KEY, None).await;
    assert!(
        r.steps[0]
            .sandbox
            .error
            .starts_with("connecting to 127.0.0.1:")
    );
    // Both sides failed alike: no finding, but the check failed on both (a broken test).
    assert_eq!(r.findings.count(), 0);
    let c = &r.steps[0].checks[0];
    assert!(c.sandbox.is_err() && c.baseline.is_err());
    assert!(!r.passed());
}

/// shop.Items, compiled to a FileDescriptorSet as `protoc --include_imports` would, in base64.
fn descriptor_set() -> String {
    use base64::Engine as _;
    use prost::Message as _;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("shop.proto"),
        r#"syntax = "proto3";
package shop;
message GetRequest { string name = 1; }
message Item { string id = 1; string name = 2; int32 price = 3; }
service Items { rpc Describe(GetRequest) returns (Item); }
"#,
    )
    .unwrap();
    let fds = protox::compile([dir.path().join("shop.proto")], [dir.path()]).unwrap();
    base64::engine::general_purpose::STANDARD.encode(fds.encode_to_vec())
}

fn describe_step(addr: SocketAddr, descriptors: Option<&str>) -> TestSpec {
    let mut grpc = json!({"target": addr.to_string(), "method": "shop.Items/Describe"});
    if let Some(d) = descriptors {
        grpc["descriptorSetBase64"] = json!(d);
        grpc["json"] = json!({"name": "tea"});
    }
    serde_json::from_value(json!({"steps": [{
        "name": "describe",
        "grpc": grpc,
        "checks": [{"grpcStatus": 0}, {"jsonPath": {"path": "$.name", "equals": "tea"}}],
    }]}))
    .unwrap()
}

#[tokio::test]
async fn with_a_descriptor_set_grpc_answers_are_compared_field_by_field() {
    let addr = server(Fork::GrpcNoPrice).await;
    // Without the types, the fresh id in every answer makes the whole message noise: the price
    // the fork dropped goes unseen, and a JSON path cannot be read.
    let r = checked(run(&describe_step(addr, None).validate().unwrap(), KEY, None).await);
    assert_eq!(r.findings.count(), 0, "{:?}", summary(&r));
    assert!(r.steps[0].decoded.is_none());
    assert!(r.steps[0].checks[1].sandbox.is_err());
    // With them: the id is noise, the price a finding (protobuf has no absent scalar: the field
    // reads as its default, so it is a value change), and `$.name` holds on both sides.
    let descriptors = descriptor_set();
    let r = checked(
        run(
            &describe_step(addr, Some(&descriptors)).validate().unwrap(),
            KEY,
            None,
        )
        .await,
    );
    eprintln!("{}", r.render());
    let s = &r.steps[0];
    let decoded: Value = serde_json::from_slice(
        &s.decoded.as_ref().unwrap()[2]
            .response_body
            .as_ref()
            .unwrap()
            .data,
    )
    .unwrap();
    // The sandbox's answer is the 5th request the server saw (3 before, then baseline first).
    assert_eq!(decoded, json!({"id": "r4", "name": "tea", "price": 0}));
    assert_eq!(
        summary(&r),
        [format!("{}: value $.price: 3 → 0", s.endpoint)]
    );
    let noise = &r.findings.endpoints[&s.endpoint].noise;
    assert!(noise.contains(&("json".into(), "$.id".into())), "{noise:?}");
    assert_eq!(s.checks[1].sandbox, Ok(()));
    assert_eq!(s.checks[1].baseline, Ok(()));
    // The request was encoded from its JSON: the server saw a GetRequest {name: "tea"} (it does
    // not echo it, so the step's own body is what shows it).
    assert_eq!(
        s.sandbox.request_body.as_ref().unwrap().data,
        [0, 0, 0, 0, 5, 0x0a, 3, b't', b'e', b'a']
    );
}

#[test]
fn descriptor_set_mistakes_are_refused_naming_the_field() {
    let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let descriptors = descriptor_set();
    let with = |method: &str, json: Value| -> String {
        let spec: TestSpec = serde_json::from_value(json!({"steps": [{"name": "d", "grpc": {
            "target": addr.to_string(), "method": method,
            "descriptorSetBase64": descriptors, "json": json}}]}))
        .unwrap();
        spec.validate().unwrap_err().to_string()
    };
    assert!(with("shop.Nope/Describe", json!({})).contains("has no service shop.Nope"));
    assert!(with("shop.Items/Nope", json!({})).contains("service shop.Items has no method Nope"));
    assert!(
        with("shop.Items/Describe", json!({"nope": 1}))
            .contains("grpc.json is not a shop.GetRequest")
    );
    let spec: TestSpec = serde_json::from_value(json!({"steps": [{"name": "d", "grpc": {
        "target": addr.to_string(), "method": "shop.Items/Describe", "json": {"name": "x"}}}]}))
    .unwrap();
    assert!(
        spec.validate()
            .unwrap_err()
            .to_string()
            .contains("grpc.json needs grpc.descriptorSetBase64")
    );
    let spec: TestSpec = serde_json::from_value(json!({"steps": [{"name": "d", "grpc": {
        "target": addr.to_string(), "method": "shop.Items/Describe", "descriptorSetBase64": "AAAA"}}]}))
    .unwrap();
    assert!(
        spec.validate()
            .unwrap_err()
            .to_string()
            .contains("not a FileDescriptorSet")
    );
}

/// A script step (here `sh` and `curl`, as a k6 or Playwright script would be): run once per
/// pass with `SPUR_BAGGAGE` only on the sandbox's, its output compared as an answer. Which side
/// answered each pass's request is logged by the script (and taken out of what it prints).
async fn script_run(fork: Fork) -> (spur_smarttest::RunReport, Vec<String>) {
    assert!(
        std::process::Command::new("curl")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "this test needs curl (tests/run.sh installs it)"
    );
    let addr = server(fork).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("served-by");
    // The scripts as files (`sh FILE`), as a runner image would hold them.
    let fetch = format!(
        r#"curl -sS -o "$OUT" ${{SPUR_BAGGAGE:+-H "baggage: $SPUR_BAGGAGE"}} "http://{addr}/items?limit=3" || exit 2
grep -o '"servedBy":"[a-z]*"' "$OUT" >>"{log}"
"#,
        log = log.display()
    );
    let items = dir.path().join("items.sh");
    let print = r#"sed 's/"servedBy":"[a-z]*"/"servedBy":"?"/' "$OUT""#;
    std::fs::write(&items, format!("{fetch}{print}\n")).unwrap();
    let prices = dir.path().join("has-prices.sh");
    std::fs::write(&prices, format!("{fetch}grep -q '\"price\"' \"$OUT\"\n")).unwrap();
    let yaml = format!(
        r#"
steps:
  - name: items
    script:
      command: [sh, "{items}"]
      env: [{{name: OUT, value: "{out}"}}]
  - name: has-prices
    script:
      command: [sh, "{prices}"]
      env: [{{name: OUT, value: "{out}"}}]
    timeoutSeconds: 30
    checks: [{{status: 0}}]
"#,
        items = items.display(),
        prices = prices.display(),
        out = dir.path().join("answer").display()
    );
    let spec: TestSpec = serde_yaml_ng::from_str(&yaml).unwrap();
    let mut report = run(&spec.validate().unwrap(), KEY, None).await;
    // What is asserted is what the scripts printed and how they exited: their run times (a
    // process start on a loaded machine) are left out of the findings.
    for s in &mut report.steps {
        for x in s.baseline.iter_mut().chain([&mut s.sandbox]) {
            x.duration_micros = 1000;
        }
    }
    refind(&mut report);
    eprintln!("{}", report.render());
    let served: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            l.trim_start_matches("\"servedBy\":")
                .trim_matches('"')
                .to_owned()
        })
        .collect();
    (report, served)
}

/// Who answered each pass of the two steps, in order: the baseline, the fork, the baseline, and
/// the fork once more when its run was slow enough to be timed again (a loaded machine).
fn assert_passes(served: &[String]) {
    let mut rest = served;
    for step in 0..2 {
        let [b1, s, b2] = ["baseline", "fork", "baseline"];
        assert!(
            rest.len() >= 3 && rest[..3] == [b1, s, b2],
            "step {step}: {served:?}"
        );
        rest = &rest[3..];
        if rest.first().is_some_and(|s| s == "fork") {
            rest = &rest[1..];
        }
    }
    assert!(rest.is_empty(), "{served:?}");
}

#[tokio::test]
async fn a_script_step_is_run_per_pass_with_the_key_on_the_sandbox_only_and_its_output_compared() {
    let (r, served) = script_run(Fork::Same).await;
    assert_passes(&served);
    assert!(r.passed(), "{}", r.render());
    assert_eq!(r.steps[0].endpoint, "SCRIPT items");
    assert_eq!(r.steps[0].sandbox.status, 0);
    // The ids and times in the output differ between the baseline's own two runs: noise.
    let noise = &r.findings.endpoints["SCRIPT items"].noise;
    assert!(
        noise.iter().any(|(_, at)| at == "$.items[*].id"),
        "{noise:?}"
    );

    let (r, served) = script_run(Fork::NoPrice).await;
    assert_passes(&served);
    assert_eq!(
        summary(&r),
        [
            "SCRIPT has-prices: status status: 0 → 1".to_owned(),
            "SCRIPT items: schema $.items[*].price: removed 3".to_owned(),
        ]
    );
    let exit = &r.steps[1].checks[0];
    assert_eq!(
        (&exit.sandbox, &exit.baseline),
        (&Err("status 1".into()), &Ok(()))
    );
    assert!(!r.passed());
}
