//! `spur doctor propagation`: which service dropped a routing key. It sends one request with the
//! key and a trace id that every Spur sidecar records (spur_routing::trace), then reads the
//! hops the sidecars of the given namespaces recorded for that trace (their `/traces`, through
//! port-forwards made with the user's credentials) and prints the chain, marking the first hop
//! the trace reached without the key (docs/cli.md).

mod chain;

use std::hash::{BuildHasher as _, Hasher as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use clap::{Args, Subcommand};
use futures_util::StreamExt as _;
use http::{HeaderName, HeaderValue, Request};
use http_body_util::BodyExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use spur_routing::trace::{format_id, recorded_id};

use crate::sidecar_admin::{ViewError, admin_port, get_json, short};
use chain::{Seen, Verdict};

#[derive(Args)]
pub(crate) struct DoctorArgs {
    #[command(subcommand)]
    command: DoctorCommand,
}

#[derive(Subcommand)]
enum DoctorCommand {
    /// Send a traced request with a routing key and show the services it went through, marking
    /// the first one the trace reached without the key.
    #[command(
        after_help = "TARGET is http://HOST[:PORT][/PATH], sent from here, or svc/NAME[.NAMESPACE]:PORT[/PATH], sent through the API server's service proxy with your credentials (needs get on services/proxy).\nThe hops are read from the Spur sidecars of the namespaces given with -n (default: the target's, else the kubeconfig's), which needs list on pods and create on pods/portforward there; both are checked before anything is sent.\nExit codes: 0 the key reached every hop; 1 an error (a refusal, a target that does not answer); 2 a usage error; 3 the key was dropped, or never arrived, or no sidecar saw the request, or the target answered with a server error (5xx)."
    )]
    Propagation(PropagationArgs),
}

#[derive(Args)]
struct PropagationArgs {
    /// Where to send the request (see below).
    target: String,
    /// The routing key, sent as `baggage: sd-routing-key=KEY`.
    #[arg(long)]
    key: String,
    /// A namespace whose sidecars to read (repeatable).
    #[arg(short = 'n', long = "namespace")]
    namespaces: Vec<String>,
    /// A further request header, `Name: value` (repeatable).
    #[arg(short = 'H', long = "header")]
    headers: Vec<String>,
    /// How long to let the request's asynchronous work finish before the sidecars are read.
    #[arg(long, default_value = "1s", value_parser = spur_runtime::parse_duration)]
    settle: Duration,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// How long the request may take, and one sidecar.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const SIDECAR_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest answer read: the target's (only its size is used) and a sidecar's `/traces`.
const MAX_BODY: usize = 4 << 20;
/// Sidecars read at once.
const PARALLEL: usize = 8;

/// Where the request goes.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// Sent from here.
    Url(http::Uri),
    /// Through the API server's service proxy.
    Service {
        name: String,
        namespace: Option<String>,
        port: String,
        path: String,
    },
}

fn parse_target(s: &str) -> Result<Target, String> {
    if let Some(rest) = s.strip_prefix("svc/") {
        let (head, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (service, port) = head
            .rsplit_once(':')
            .ok_or_else(|| format!("{s}: svc/NAME[.NAMESPACE]:PORT needs a port"))?;
        let (name, namespace) = match service.split_once('.') {
            Some((n, ns)) => (n, Some(ns)),
            None => (service, None),
        };
        let label = spur_api::validation::is_dns_label;
        if !label(name) || !namespace.is_none_or(label) || !label(port) {
            return Err(format!(
                "{s}: svc/NAME[.NAMESPACE]:PORT wants DNS labels and a port number or name"
            ));
        }
        if path.contains('#') {
            return Err(format!("{s}: a request has no #fragment"));
        }
        return Ok(Target::Service {
            name: name.into(),
            namespace: namespace.map(str::to_owned),
            port: port.into(),
            path: path.into(),
        });
    }
    let uri: http::Uri = s.parse().map_err(|e| format!("{s}: not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(Target::Url(uri)),
        Some("https") => Err(format!(
            "{s}: https is not supported yet; use http:// or svc/NAME.NAMESPACE:PORT"
        )),
        _ => Err(format!(
            "{s}: want http://HOST[:PORT][/PATH] or svc/NAME[.NAMESPACE]:PORT[/PATH]"
        )),
    }
}

fn parse_header(h: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (n, v) = h
        .split_once(':')
        .ok_or_else(|| format!("--header {h:?}: want `Name: value`"))?;
    let n = HeaderName::try_from(n.trim()).map_err(|_| format!("--header {h:?}: bad name"))?;
    let v = HeaderValue::try_from(v.trim()).map_err(|_| format!("--header {h:?}: bad value"))?;
    Ok((n, v))
}

/// 128 random bits from the standard library's per-process random hash keys.
fn random_u128() -> u128 {
    let mut out = 0u128;
    for i in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        out = (out << 64) | u128::from(h.finish());
    }
    out
}

/// The trace context and key of the request, each carrier with the same trace id, so a hop is
/// recorded whichever of them its tracer continues.
fn traced_headers(trace: u128, span: u64, key: &str) -> Result<Vec<(HeaderName, HeaderValue)>> {
    let id = format_id(trace);
    let span = format!("{:016x}", span.max(1));
    let h = |n: &'static str, v: String| -> Result<(HeaderName, HeaderValue)> {
        Ok((
            HeaderName::from_static(n),
            HeaderValue::try_from(v).context("--key must be a header-safe routing key")?,
        ))
    };
    Ok(vec![
        h("traceparent", format!("00-{id}-{span}-01"))?,
        h("b3", format!("{id}-{span}-1"))?,
        h("uber-trace-id", format!("{id}:{span}:0:1"))?,
        h("baggage", format!("sd-routing-key={key}"))?,
    ])
}

pub(crate) async fn run(args: DoctorArgs) -> Result<ExitCode> {
    let DoctorCommand::Propagation(a) = args.command;
    let target = parse_target(&a.target).map_err(anyhow::Error::msg)?;
    if a.key.is_empty() || a.key.len() > spur_routing::extract::MAX_KEY_LEN {
        bail!(
            "--key: a routing key is 1 to {} characters",
            spur_routing::extract::MAX_KEY_LEN
        );
    }
    let mut extra = Vec::new();
    for h in &a.headers {
        extra.push(parse_header(h).map_err(anyhow::Error::msg)?);
    }
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let namespaces = if !a.namespaces.is_empty() {
        a.namespaces.clone()
    } else if let Target::Service {
        namespace: Some(ns),
        ..
    } = &target
    {
        vec![ns.clone()]
    } else {
        vec![client.default_namespace().to_string()]
    };

    // What the command will need, checked before anything is sent: the pods of each namespace
    // (listed now, read after the request) and the rights to port-forward to them and, for a
    // svc/ target, to proxy to the Service.
    let mut pods_of: Vec<(Api<Pod>, String, Pod)> = Vec::new();
    for ns in &namespaces {
        let api = Api::<Pod>::namespaced(client.clone(), ns);
        let list = api.list(&ListParams::default()).await.map_err(|e| {
            crate::sandbox::api_error(e, &format!("listing the pods of namespace {ns}"))
        })?;
        for pod in list.items {
            let running = pod.metadata.deletion_timestamp.is_none()
                && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            if running && admin_port(&pod).is_some() {
                pods_of.push((api.clone(), ns.clone(), pod));
            }
        }
        may(&client, "create", "pods", "portforward", ns).await?;
    }
    if let Target::Service {
        name, namespace, ..
    } = &target
    {
        let ns = namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        may(&client, "get", "services", "proxy", &ns)
            .await
            .with_context(|| format!("sending to svc/{name}.{ns}"))?;
    }

    let rnd = random_u128();
    let trace = recorded_id(rnd);
    let trace_id = format_id(trace);
    let mut headers = traced_headers(trace, rnd as u64, &a.key)?;
    headers.extend(extra);

    // The request.
    let started = Instant::now();
    let (shown, status, size) = match &target {
        Target::Url(uri) => {
            let mut req = Request::get(uri.clone());
            for (n, v) in &headers {
                req = req.header(n, v);
            }
            let req = req
                .body(http_body_util::Empty::<Bytes>::new())
                .context("building the request")?;
            let http =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build_http();
            let resp = tokio::time::timeout(REQUEST_TIMEOUT, http.request(req))
                .await
                .map_err(|_| anyhow::anyhow!("{uri}: no answer within {REQUEST_TIMEOUT:?}"))?
                .with_context(|| format!("{uri}"))?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("{uri}: reading the answer: {e}"))?
                .to_bytes();
            (uri.to_string(), status, body.len())
        }
        Target::Service {
            name,
            namespace,
            port,
            path,
        } => {
            let ns = namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            let url = format!("/api/v1/namespaces/{ns}/services/{name}:{port}/proxy{path}");
            let mut req = Request::get(&url);
            for (n, v) in &headers {
                req = req.header(n, v);
            }
            let req = req
                .body(kube::client::Body::empty())
                .context("building the request")?;
            let resp = tokio::time::timeout(REQUEST_TIMEOUT, client.send(req))
                .await
                .map_err(|_| {
                    anyhow::anyhow!("svc/{name}.{ns}: no answer within {REQUEST_TIMEOUT:?}")
                })?
                .map_err(|e| anyhow::anyhow!("svc/{name}.{ns}: {}", short(&e)))?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("svc/{name}.{ns}: reading the answer: {e}"))?
                .to_bytes();
            // The API server's refusal is a Status object; an app's own 403 is an answer.
            let refusal = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .filter(|v| v["kind"] == "Status" && v["status"] == "Failure");
            if let (http::StatusCode::FORBIDDEN, Some(v)) = (status, &refusal) {
                bail!(
                    "svc/{name}.{ns}: forbidden to you: {} (needs get on services/proxy in {ns})",
                    v["message"].as_str().unwrap_or_default()
                );
            }
            (format!("svc/{name}.{ns}:{port}{path}"), status, body.len())
        }
    };
    let took = started.elapsed();
    tokio::time::sleep(a.settle).await;

    // The sidecars' records, read before anything is printed: a refusal is the command's error.
    let reads = futures_util::stream::iter(pods_of.iter().map(|(api, ns, pod)| async move {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let port = admin_port(pod).unwrap_or_default();
        let got = tokio::time::timeout(
            SIDECAR_TIMEOUT,
            get_json(api, &name, port, "/traces", MAX_BODY),
        )
        .await
        .unwrap_or_else(|_| {
            Err(ViewError::Other(format!(
                "its sidecar did not answer within {SIDECAR_TIMEOUT:?}"
            )))
        });
        (format!("{ns}/{name}"), got)
    }))
    .buffer_unordered(PARALLEL)
    .collect::<Vec<_>>()
    .await;
    let mut seen = Vec::new();
    let mut unreadable = Vec::new();
    for (pod, got) in reads {
        match got {
            Err(ViewError::Forbidden(why)) => {
                let ns = pod.split('/').next().unwrap_or_default();
                bail!(
                    "reading the sidecar of pod {pod}: {why} (needs create on pods/portforward in {ns})"
                );
            }
            Err(ViewError::Other(why)) => unreadable.push(format!("{pod}: {why}")),
            Ok(body) => {
                let b = &body["identity"]["baseline"];
                let workload = format!(
                    "{} {}/{}",
                    b["kind"].as_str().unwrap_or("?"),
                    b["namespace"].as_str().unwrap_or("?"),
                    b["name"].as_str().unwrap_or("?")
                );
                let hops: Vec<chain::Hop> = match serde_json::from_value(body["hops"].clone()) {
                    Ok(h) => h,
                    Err(e) => {
                        unreadable.push(format!("{pod}: its /traces: {e}"));
                        continue;
                    }
                };
                seen.extend(hops.into_iter().map(|hop| Seen {
                    workload: workload.clone(),
                    pod: pod.clone(),
                    hop,
                }));
            }
        }
    }
    let (chain, verdict) = chain::analyse(seen, &trace_id, &a.key);

    outln!(
        "Sent GET {shown} with routing key {} (baggage) and trace {trace_id} (traceparent, b3, uber-trace-id): {status} in {took:.0?}, {size} bytes.",
        a.key
    );
    outln!(
        "Read the Spur sidecars of {} pods in {}.",
        pods_of.len(),
        namespaces.join(", ")
    );
    for u in &unreadable {
        outln!("  could not read {u}");
    }
    let t0 = chain.first().map(|s| s.hop.at_micros).unwrap_or(0);
    for (i, s) in chain.iter().enumerate() {
        let key = if s.hop.keys.contains(&a.key) {
            format!("key {} ({})", a.key, s.hop.key_carriers.join(", "))
        } else if s.hop.keys.is_empty() {
            "NO KEY".to_string()
        } else {
            format!("NOT THE KEY (carried {})", s.hop.keys.join(", "))
        };
        let routed = match &s.hop.sandbox {
            Some(sb) => format!("; routed to sandbox {sb}"),
            None => String::new(),
        };
        outln!(
            "  {:>2}. {:>+9.1}ms  {}  (pod {})  {}  {key}; trace via {}{routed}",
            i + 1,
            s.hop.at_micros.saturating_sub(t0) as f64 / 1000.0,
            s.workload,
            s.pod,
            s.hop.path,
            s.hop.trace_carriers.join(", "),
        );
    }
    // A service that dropped the trace context with the key starts a trace of its own, which is
    // not recorded: the chain ends there. Say which workloads were read and saw nothing.
    let mut silent: Vec<String> = pods_of
        .iter()
        .map(|(_, ns, pod)| (ns, pod))
        .filter(|(ns, pod)| {
            let p = format!("{ns}/{}", pod.metadata.name.clone().unwrap_or_default());
            !chain.iter().any(|s| s.pod == p)
                && !unreadable.iter().any(|u| u.starts_with(&format!("{p}:")))
        })
        .map(|(ns, pod)| format!("{ns}/{}", pod.metadata.name.clone().unwrap_or_default()))
        .collect();
    silent.sort();
    if !chain.is_empty() && !silent.is_empty() {
        outln!(
            "Saw nothing of this request: {} (not on its path, or past a service that dropped the trace context too, where the recorded chain ends).",
            silent.join(", ")
        );
    }
    let code = match verdict {
        Verdict::NotSeen => {
            outln!(
                "No sidecar in {} recorded this request: the target's pods have no Spur sidecar, or are in another namespace (-n), or the request never reached them.",
                namespaces.join(", ")
            );
            crate::sandbox::EXIT_FAILED
        }
        Verdict::Reached if status.is_server_error() => {
            outln!(
                "The key reached every recorded hop ({}), but the answer was {status}: the request may have stopped before the end of its path. Try again once the services answer.",
                chain.len()
            );
            crate::sandbox::EXIT_FAILED
        }
        Verdict::Reached => {
            outln!(
                "The key reached every recorded hop ({}): propagation works along this path.",
                chain.len()
            );
            return Ok(ExitCode::SUCCESS);
        }
        Verdict::NeverArrived => {
            outln!(
                "The first hop, {}, already came without the key: whatever is between you and it (an ingress, a gateway, a service without a Spur sidecar) dropped it.",
                chain[0].workload
            );
            crate::sandbox::EXIT_FAILED
        }
        Verdict::Dropped { by, at } => {
            let (by, at) = (&chain[by], &chain[at]);
            outln!(
                "The key was dropped by {}: its call to {} carried the trace ({}) but not the routing key. Make {} forward `baggage` as it forwards the trace context (docs/routing-keys.md).",
                by.workload,
                at.workload,
                at.hop.trace_carriers.join(", "),
                by.workload
            );
            crate::sandbox::EXIT_FAILED
        }
    };
    Ok(ExitCode::from(code))
}

/// Fails unless the user may `verb` `resource/subresource` in `ns` (a SelfSubjectAccessReview:
/// the API server's own answer for the user's credentials).
async fn may(
    client: &kube::Client,
    verb: &str,
    resource: &str,
    subresource: &str,
    ns: &str,
) -> Result<()> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_string()),
                verb: Some(verb.to_string()),
                resource: Some(resource.to_string()),
                subresource: Some(subresource.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&kube::api::PostParams::default(), &review)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "asking whether you may {verb} {resource}/{subresource} in {ns}: {}",
                short(&e)
            )
        })?;
    let status = answer.status.unwrap_or_default();
    if !status.allowed {
        bail!(
            "forbidden to you: {verb} on {resource}/{subresource} in namespace {ns}{} (the doctor needs it; nothing was sent)",
            if status.reason.as_deref().unwrap_or_default().is_empty() {
                String::new()
            } else {
                format!(" ({})", status.reason.unwrap_or_default())
            }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use spur_routing::trace::{TraceCarrier, is_recorded};

    #[test]
    fn targets_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_target("svc/front.chain:8080/a/b?x=1").unwrap(),
            Target::Service {
                name: "front".into(),
                namespace: Some("chain".into()),
                port: "8080".into(),
                path: "/a/b?x=1".into()
            }
        );
        assert_eq!(
            parse_target("svc/front:http").unwrap(),
            Target::Service {
                name: "front".into(),
                namespace: None,
                port: "http".into(),
                path: "/".into()
            }
        );
        assert!(matches!(
            parse_target("http://localhost:18080/x").unwrap(),
            Target::Url(_)
        ));
        for bad in [
            "svc/front",
            "svc/Front:80",
            "svc/front.a.b:80",
            "svc/:80",
            "https://example.com/",
            "example.com",
            "ftp://x/",
        ] {
            let e = parse_target(bad).unwrap_err();
            assert!(e.starts_with(bad), "{e}");
        }
        assert!(parse_header("x-a: 1").is_ok());
        assert!(parse_header("x-a").is_err());
        assert!(parse_header("bad name: 1").is_err());
    }

    /// Every carrier the doctor sends names the same, recorded, trace.
    #[test]
    fn the_request_is_one_the_sidecars_record() {
        let trace = recorded_id(random_u128());
        let headers = traced_headers(trace, 7, "k1").unwrap();
        for (n, v) in &headers {
            match TraceCarrier::of(n.as_str().as_bytes()) {
                Some(c) => {
                    assert_eq!(c.trace_id(v.as_bytes()), Some(trace), "{n}");
                    assert!(is_recorded(trace));
                }
                None => assert_eq!(
                    (n.as_str(), v.to_str().unwrap()),
                    ("baggage", "sd-routing-key=k1")
                ),
            }
        }
        assert_ne!(random_u128(), random_u128());
        assert!(traced_headers(trace, 0, "bad\nkey").is_err());
    }
}
