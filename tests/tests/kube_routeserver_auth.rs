//! The route server's TLS and authentication against a real kube-apiserver (RBAC enforced):
//! the route server runs as the chart's ServiceAccount with the chart's rules, serves the
//! rules of RoutingConfigs, and checks readers' tokens with TokenReview and SubjectAccessReview.
//!
//! Checked: plaintext is refused on the TLS ports; no token, a token for another audience and a
//! token of a user without RBAC read nothing (gRPC and REST); a pod-bound token reads its own
//! baseline's rules and nothing else; a user allowed to list RoutingConfigs reads everything;
//! the sidecar's client (TLS + token file) syncs; renewing the serving certificate on disk
//! changes what new connections see while an open watch keeps delivering; no token is logged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use spur_api::RoutingConfig;
use spur_discovery::{Publisher, RouteServerConn, RouteServerSource};
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;
use spur_proto::history::WatchHistoryRequest;
use spur_proto::history::route_history_client::RouteHistoryClient;
use spur_proto::routes::routes_client::RoutesClient;
use spur_proto::routes::{self, WatchOp};
use spur_routeserver::{AuthConfig, KubeStore, RouteServer, RouteServerConfig};
use spur_serving::ServingTls;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const AUDIENCE: &str = "spur-routeserver";

struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: rcgen::Issuer::new(params, key),
    }
}

/// A serving certificate for `localhost` signed by `ca`, written to `dir`/tls.crt and tls.key.
fn write_leaf(ca: &Ca, dir: &Path) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    // The key first: the server must cope with a pair that does not match for a moment.
    std::fs::write(dir.join("tls.key.new"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("tls.crt.new"), cert.pem()).unwrap();
    std::fs::rename(dir.join("tls.key.new"), dir.join("tls.key")).unwrap();
    std::fs::rename(dir.join("tls.crt.new"), dir.join("tls.crt")).unwrap();
}

/// A gRPC client that trusts `ca_pem` only.
async fn client(port: u16, ca_pem: &str) -> Result<RoutesClient<Channel>, tonic::transport::Error> {
    Ok(RoutesClient::new(channel(port, ca_pem).await?))
}

/// The first update of a route-history watch of `baseline` (in `shop`): the routing keys of its
/// spans, or the refusal's code.
async fn history(
    c: &mut RouteHistoryClient<Channel>,
    baseline: &str,
    token: Option<&str>,
) -> Result<Vec<String>, Code> {
    let mut r = tonic::Request::new(WatchHistoryRequest {
        baseline: Some(spur_proto::history::Baseline {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: baseline.into(),
        }),
    });
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let mut stream = c.watch(r).await.map_err(|s| s.code())?.into_inner();
    let first = stream.message().await.map_err(|s| s.code())?.unwrap();
    Ok(first
        .spans
        .unwrap()
        .spans
        .into_iter()
        .map(|s| s.routing_key)
        .collect())
}

/// A TLS channel to the gRPC port that trusts `ca_pem` only.
async fn channel(port: u16, ca_pem: &str) -> Result<Channel, tonic::transport::Error> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
    let connector = tower::service_fn(move |_: http::Uri| {
        let tls = tls.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let s = tls.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
        }
    });
    tonic::transport::Endpoint::from_shared(format!("http://localhost:{port}"))
        .unwrap()
        .connect_with_connector(connector)
        .await
}

fn request(
    baseline: Option<&str>,
    token: Option<&str>,
) -> tonic::Request<routes::WorkloadRoutingRulesRequest> {
    let mut r = tonic::Request::new(routes::WorkloadRoutingRulesRequest {
        baseline_workload: baseline.map(|name| routes::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: name.into(),
        }),
        ..Default::default()
    });
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// The rules' baselines a Get returns, or the refusal's code.
async fn get(
    c: &mut RoutesClient<Channel>,
    baseline: Option<&str>,
    token: Option<&str>,
) -> Result<Vec<String>, Code> {
    c.get_workload_routing_rules(request(baseline, token))
        .await
        .map(|r| {
            let mut names: Vec<String> = r
                .into_inner()
                .routing_rules
                .into_iter()
                .map(|r| r.baseline.unwrap_or_default().name)
                .collect();
            names.sort();
            names
        })
        .map_err(|s| s.code())
}

/// `curl` over TLS to the REST port: the status code.
async fn rest_status(port: u16, ca: &Path, query: &str, token: Option<&str>) -> u16 {
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args([
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "10",
    ])
    .arg("--cacert")
    .arg(ca)
    .args(["--resolve", &format!("localhost:{port}:127.0.0.1")]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = cmd
        .arg(format!(
            "https://localhost:{port}/api/v1/workloads/routing-rules{query}"
        ))
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

/// A REST watch read line by line through `curl -N`.
struct RestWatch {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl RestWatch {
    /// Opens the watch of every rule and reads up to its SYNCED line.
    async fn open(port: u16, ca: &Path, token: &str) -> RestWatch {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new("curl")
            .args(["-sSN", "--max-time", "60", "--cacert"])
            .arg(ca)
            .args(["--resolve", &format!("localhost:{port}:127.0.0.1")])
            .args(["-H", &format!("Authorization: Bearer {token}")])
            .arg(format!(
                "https://localhost:{port}/api/v1/workloads/routing-rules/watch"
            ))
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut w = RestWatch {
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
        };
        loop {
            let line = w
                .lines
                .next_line()
                .await
                .unwrap()
                .expect("the watch ended before SYNCED");
            if line.contains(r#""op":"SYNCED""#) {
                return w;
            }
        }
    }

    /// The remaining lines, once the server ends the stream (at most 30 s).
    async fn rest(mut self) -> Vec<String> {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(l)) = self.lines.next_line().await {
                out.push(l);
            }
        })
        .await
        .expect("the REST watch ends");
        let _ = self.child.wait().await;
        out
    }
}

async fn create<K>(client: &Client, ns: Option<&str>, v: Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + for<'de> k8s_openapi::serde::Deserialize<'de>
        + k8s_openapi::serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let obj: K = serde_json::from_value(v).unwrap();
    Api::<K>::namespaced(client.clone(), ns.unwrap_or("shop"))
        .create(&PostParams::default(), &obj)
        .await
        .unwrap()
}

/// Deployment `name` in shop, a ReplicaSet it controls, and a pod of that ReplicaSet running
/// as ServiceAccount `sa`; returns the pod.
async fn workload(client: &Client, name: &str, sa: &str) -> Pod {
    chain(client, "shop", name, json!({}), json!({"app": name}), sa).await
}

/// A fork's Deployment `name` in `ns` as the operator makes it (controlled by a ForkedWorkload
/// when `forked`, annotated with the baseline it forks), a ReplicaSet, and a pod labelled
/// `spur.dev/fork` running as `sa`; returns the pod.
async fn fork_workload(
    client: &Client,
    ns: &str,
    name: &str,
    forked: bool,
    baseline: &str,
    sa: &str,
) -> Pod {
    let owners = if forked {
        json!([{"apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload", "name": name,
                "uid": "00000000-0000-0000-0000-00000000f0f0", "controller": true}])
    } else {
        json!([])
    };
    let meta = json!({"annotations": {"spur.dev/baseline": baseline}, "ownerReferences": owners});
    chain(client, ns, name, meta, json!({"spur.dev/fork": name}), sa).await
}

/// Deployment `name` in `ns` (with `meta` merged into its metadata), a ReplicaSet it controls
/// and a pod of it running as `sa`, all with `labels`; returns the pod.
async fn chain(client: &Client, ns: &str, name: &str, meta: Value, labels: Value, sa: &str) -> Pod {
    let template = json!({"metadata": {"labels": labels}, "spec": {"containers": [{"name": "app", "image": "app:1"}]}});
    let mut d_meta = json!({"name": name});
    for (k, v) in meta.as_object().cloned().unwrap_or_default() {
        d_meta[k] = v;
    }
    let d: Deployment = create(
        client,
        Some(ns),
        json!({
            "metadata": d_meta,
            "spec": {"selector": {"matchLabels": labels}, "template": template}
        }),
    )
    .await;
    let rs: ReplicaSet = create(client, Some(ns), json!({
        "metadata": {"name": format!("{name}-5d8f7c"), "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": d.uid().unwrap(), "controller": true}
        ]},
        "spec": {"selector": {"matchLabels": labels}, "template": template}
    }))
    .await;
    create(client, Some(ns), json!({
        "metadata": {"name": format!("{name}-5d8f7c-x1"), "labels": labels, "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs.name_any(), "uid": rs.uid().unwrap(), "controller": true}
        ]},
        "spec": {"serviceAccountName": sa, "containers": [{"name": "app", "image": "app:1"}]}
    }))
    .await
}

fn route(baseline: &str, key_host: &str) -> Value {
    json!({
        "fromHost": format!("{baseline}.shop.svc"), "fromPort": 80,
        "toHost": format!("{key_host}.shop.svc"), "toPort": 80,
        "workloadPort": 8080, "sandbox": "sb1",
        "baseline": {"kind": "Deployment", "namespace": "shop", "name": baseline},
    })
}

async fn token(
    api: &KubeApi,
    ns: &str,
    sa: &str,
    audiences: Vec<String>,
    pod: Option<&Pod>,
) -> String {
    api.token_request(
        ns,
        sa,
        TokenRequestSpec {
            audiences,
            expiration_seconds: Some(3600),
            bound_object_ref: pod.map(|p| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(p.name_any()),
                uid: p.uid(),
            }),
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_authenticated_readers_read_and_a_sidecar_reads_only_its_own_rules() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, "shop").await.unwrap();
    // The ServiceAccounts exist before their pods (no ServiceAccount admission here).
    let api_pod_token_sa = "api-sa";
    let _ = token(&api, "shop", api_pod_token_sa, vec![AUDIENCE.into()], None).await;
    let api_pod = workload(&admin, "api", api_pod_token_sa).await;
    let _ = workload(&admin, "web", api_pod_token_sa).await;

    // One rule for each baseline, from a RoutingConfig's status, as the operator writes it.
    let rcs: Api<RoutingConfig> = Api::all(admin.clone());
    let rc: RoutingConfig = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RoutingConfig",
        "metadata": {"name": "k1"}, "spec": {"routingKey": "k1"}
    }))
    .unwrap();
    rcs.create(&PostParams::default(), &rc).await.unwrap();
    let set_routes = |routes: Vec<Value>| {
        let rcs = rcs.clone();
        async move {
            rcs.patch_status(
                "k1",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"status": {"routeServer": {"routes": routes, "spans": [
                        {"baseline": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                         "sandbox": "sb1", "sinceMs": 1_000}
                    ]}}}),
                ),
            )
            .await
            .unwrap();
        }
    };
    set_routes(vec![route("api", "sb1-api"), route("web", "sb1-web")]).await;

    let dir = tempfile::tempdir().unwrap();
    let ca1 = ca("ca one");
    write_leaf(&ca1, dir.path());
    std::fs::write(dir.path().join("ca1.crt"), &ca1.pem).unwrap();
    let routeserver_client =
        kt::chart_client(&api, "spur-routeserver", "routeserver-rules.yaml", None)
            .await
            .unwrap();
    let server = RouteServer::start_with(
        RouteServerConfig {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            tls: Some(ServingTls {
                reload_every: Duration::from_millis(100),
                ..ServingTls::new(dir.path().join("tls.crt"), dir.path().join("tls.key"))
            }),
            auth: AuthConfig::Kubernetes {
                client: routeserver_client.clone(),
                audience: AUDIENCE.into(),
                watch_recheck: Duration::from_secs(2),
            },
            ..RouteServerConfig::new(dir.path())
        },
        KubeStore::new(routeserver_client),
    )
    .await
    .unwrap();
    let (grpc, http) = (server.grpc_addr.port(), server.http_addr.port());
    eventually("both rules indexed", || async {
        (server.index().current().rules.len() == 2).then_some(())
    })
    .await;

    // Tokens: the api pod's (bound, our audience), the same account's for the API server's
    // audience, a reader allowed to list RoutingConfigs, and a user with no rights.
    let pod_token = token(
        &api,
        "shop",
        api_pod_token_sa,
        vec![AUDIENCE.into()],
        Some(&api_pod),
    )
    .await;
    let wrong_audience = token(&api, "shop", api_pod_token_sa, vec![], Some(&api_pod)).await;
    let reader = token(&api, "tools", "reader", vec![AUDIENCE.into()], None).await;
    let nobody = token(&api, "tools", "nobody", vec![AUDIENCE.into()], None).await;
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "rules-reader"},
        "rules": [{"apiGroups": ["spur.dev"], "resources": ["routingconfigs"], "verbs": ["list"]}]
    }))
    .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "rules-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rules-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "tools"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    // Plaintext is not served.
    let plain = RoutesClient::connect(format!("http://127.0.0.1:{grpc}")).await;
    if let Ok(mut plain) = plain {
        let r = plain
            .get_workload_routing_rules(request(None, Some(&reader)))
            .await;
        assert!(r.is_err(), "plaintext gRPC answered: {r:?}");
    }
    // A client that does not trust the CA gets nowhere.
    let stranger = ca("stranger");
    let untrusted = client(grpc, &stranger.pem).await;
    match untrusted {
        Err(_) => {}
        Ok(mut c) => assert!(get(&mut c, None, Some(&reader)).await.is_err()),
    }

    let mut c = client(grpc, &ca1.pem).await.unwrap();
    assert_eq!(get(&mut c, None, None).await, Err(Code::Unauthenticated));
    assert_eq!(
        get(&mut c, Some("api"), None).await,
        Err(Code::Unauthenticated)
    );
    assert_eq!(
        get(&mut c, Some("api"), Some(&wrong_audience)).await,
        Err(Code::Unauthenticated)
    );
    assert_eq!(
        get(&mut c, Some("api"), Some("not-a-token-at-all")).await,
        Err(Code::Unauthenticated)
    );
    assert_eq!(
        get(&mut c, None, Some(&nobody)).await,
        Err(Code::PermissionDenied)
    );
    // The pod reads its own baseline's rules, and nothing else.
    assert_eq!(
        get(&mut c, Some("api"), Some(&pod_token)).await,
        Ok(vec!["api".to_string()])
    );
    assert_eq!(
        get(&mut c, Some("web"), Some(&pod_token)).await,
        Err(Code::PermissionDenied)
    );
    assert_eq!(
        get(&mut c, None, Some(&pod_token)).await,
        Err(Code::PermissionDenied)
    );
    // A fork's pod reads the rules of the baseline its Deployment forks (its sidecar relays
    // Kafka records by them), and nothing else, not even its own Deployment's.
    let fork_pod = fork_workload(
        &admin,
        "shop",
        "api-sb1",
        true,
        "Deployment/shop/api",
        api_pod_token_sa,
    )
    .await;
    let fork_token = token(
        &api,
        "shop",
        api_pod_token_sa,
        vec![AUDIENCE.into()],
        Some(&fork_pod),
    )
    .await;
    assert_eq!(
        get(&mut c, Some("api"), Some(&fork_token)).await,
        Ok(vec!["api".to_string()])
    );
    for other in ["web", "api-sb1"] {
        assert_eq!(
            get(&mut c, Some(other), Some(&fork_token)).await,
            Err(Code::PermissionDenied),
            "a fork's pod read {other}'s rules"
        );
    }
    // The label and the annotation without a ForkedWorkload controlling the Deployment name
    // nothing: such a pod reads its own Deployment's rules only.
    let forged = fork_workload(
        &admin,
        "shop",
        "forged",
        false,
        "Deployment/shop/web",
        api_pod_token_sa,
    )
    .await;
    let forged_token = token(
        &api,
        "shop",
        api_pod_token_sa,
        vec![AUDIENCE.into()],
        Some(&forged),
    )
    .await;
    assert_eq!(
        get(&mut c, Some("web"), Some(&forged_token)).await,
        Err(Code::PermissionDenied)
    );
    // A fork in another namespace cannot name this namespace's baseline.
    kt::ensure_namespace(&admin, "other").await.unwrap();
    let _ = token(&api, "other", "intruder", vec![AUDIENCE.into()], None).await;
    let intruder = fork_workload(
        &admin,
        "other",
        "api-sb1",
        true,
        "Deployment/shop/api",
        "intruder",
    )
    .await;
    let intruder_token = token(
        &api,
        "other",
        "intruder",
        vec![AUDIENCE.into()],
        Some(&intruder),
    )
    .await;
    assert_eq!(
        get(&mut c, Some("api"), Some(&intruder_token)).await,
        Err(Code::PermissionDenied)
    );
    // The route history (what Kafka relays decide by) is read with exactly the rights to read
    // the baseline's rules: the pod and its fork read theirs, nobody else does.
    let mut h = RouteHistoryClient::new(channel(grpc, &ca1.pem).await.unwrap());
    for t in [&pod_token, &fork_token] {
        assert_eq!(history(&mut h, "api", Some(t)).await, Ok(vec!["k1".into()]));
    }
    assert_eq!(
        history(&mut h, "api", None).await,
        Err(Code::Unauthenticated)
    );
    for (baseline, t) in [
        ("web", &pod_token),
        ("web", &fork_token),
        ("web", &forged_token),
        ("api", &intruder_token),
        ("api", &nobody),
    ] {
        assert_eq!(
            history(&mut h, baseline, Some(t)).await,
            Err(Code::PermissionDenied),
            "read {baseline}'s route history"
        );
    }
    let mut services = tonic::Request::new(routes::GetClusterServicesRequest {});
    services.metadata_mut().insert(
        "authorization",
        format!("Bearer {pod_token}").parse().unwrap(),
    );
    assert_eq!(
        c.get_cluster_services(services)
            .await
            .map(|_| ())
            .map_err(|s| s.code()),
        Err(Code::PermissionDenied)
    );
    let watch = c
        .watch_workload_routing_rules(request(Some("web"), Some(&pod_token)))
        .await;
    assert_eq!(
        watch.map(|_| ()).map_err(|s| s.code()),
        Err(Code::PermissionDenied)
    );
    // A reader with RBAC reads everything.
    assert_eq!(
        get(&mut c, None, Some(&reader)).await,
        Ok(vec!["api".to_string(), "web".to_string()])
    );

    // The same over REST.
    let ca_file = dir.path().join("ca1.crt");
    let api_query = "?baselineKind=Deployment&baselineNamespace=shop&baselineName=api";
    let web_query = "?baselineKind=Deployment&baselineNamespace=shop&baselineName=web";
    assert_eq!(rest_status(http, &ca_file, "", None).await, 401);
    assert_eq!(
        rest_status(http, &ca_file, "", Some(&wrong_audience)).await,
        401
    );
    assert_eq!(rest_status(http, &ca_file, "", Some(&nobody)).await, 403);
    assert_eq!(
        rest_status(http, &ca_file, api_query, Some(&pod_token)).await,
        200
    );
    assert_eq!(
        rest_status(http, &ca_file, web_query, Some(&pod_token)).await,
        403
    );
    assert_eq!(rest_status(http, &ca_file, "", Some(&reader)).await, 200);
    // Probes need no token; what they see names no problem, only counts them.
    let health = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&ca_file)
        .args(["--resolve", &format!("localhost:{http}:127.0.0.1")])
        .arg(format!("https://localhost:{http}/healthz"))
        .output()
        .await
        .unwrap();
    let health: Value = serde_json::from_slice(&health.stdout).unwrap();
    assert_eq!(health["status"], "ok", "{health}");
    assert!(health["problems"].is_u64(), "{health}");

    // The sidecar's client: TLS against the CA file, the token from a file.
    std::fs::write(dir.path().join("pod.token"), &pod_token).unwrap();
    let table = spur_routing::SharedTable::new();
    let mut registry = Registry::default();
    let publisher = Publisher::new(table.clone(), &mut registry);
    let source = RouteServerSource::new(
        RouteServerConn {
            addr: format!("localhost:{grpc}"),
            ca: Some(ca_file.clone()),
            token: Some(dir.path().join("pod.token")),
        },
        spur_routing::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: "api".into(),
        },
        publisher,
        &mut registry,
    )
    .unwrap();
    let stop = CancellationToken::new();
    let sidecar = tokio::spawn(source.run(stop.clone()));
    eventually("the sidecar's table from the route server", || async {
        (table.load().table.len() == 1).then_some(())
    })
    .await;

    // An open watch, then the serving certificate is renewed from another CA: new connections
    // must trust the new CA, and the open watch keeps delivering.
    let mut stream = c
        .watch_workload_routing_rules(request(Some("api"), Some(&pod_token)))
        .await
        .unwrap()
        .into_inner();
    let mut ops = Vec::new();
    while ops.last() != Some(&WatchOp::Synced) {
        ops.push(stream.message().await.unwrap().unwrap().op());
    }
    assert_eq!(ops, [WatchOp::Add, WatchOp::Synced]);
    let ca2 = ca("ca two");
    write_leaf(&ca2, dir.path());
    eventually("new connections get the renewed certificate", || async {
        let mut c2 = client(grpc, &ca2.pem).await.ok()?;
        get(&mut c2, None, Some(&reader)).await.ok()
    })
    .await;
    assert!(
        client(grpc, &ca1.pem).await.is_err() || {
            let mut old = client(grpc, &ca1.pem).await.unwrap();
            get(&mut old, None, Some(&reader)).await.is_err()
        }
    );
    set_routes(vec![route("api", "sb2-api"), route("web", "sb1-web")]).await;
    let op = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("the open watch delivers after the renewal")
        .unwrap()
        .unwrap();
    assert_eq!(op.op(), WatchOp::Replace);
    let rule = op.route.unwrap();
    assert_eq!(rule.baseline.unwrap().name, "api");
    assert!(
        format!("{:?}", rule.mappings).contains("sb2-api"),
        "{:?}",
        rule.mappings
    );

    // Access that lapses ends open watches at their next check (every 1–2 s here). The
    // reader's binding goes: its gRPC watch ends with PERMISSION_DENIED, its REST watch with a
    // last line saying so. The api pod goes: its watch ends with UNAUTHENTICATED.
    let mut reader_watch = c
        .watch_workload_routing_rules(request(None, Some(&reader)))
        .await
        .unwrap()
        .into_inner();
    let mut ops = Vec::new();
    while ops.last() != Some(&WatchOp::Synced) {
        ops.push(reader_watch.message().await.unwrap().unwrap().op());
    }
    // The server's certificate now chains to the second CA.
    let ca2_file = dir.path().join("ca2.crt");
    std::fs::write(&ca2_file, &ca2.pem).unwrap();
    let rest = RestWatch::open(http, &ca2_file, &reader).await;
    // Both stay open while access holds, across several checks.
    tokio::time::sleep(Duration::from_secs(5)).await;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .delete("rules-reader", &Default::default())
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), reader_watch.message())
        .await
        .expect("the revoked reader's watch ends");
    assert_eq!(
        ended.map(|_| ()).map_err(|s| s.code()),
        Err(Code::PermissionDenied)
    );
    let last = rest.rest().await;
    assert!(
        last.last()
            .is_some_and(|l| l.contains(r#""code":"PERMISSION_DENIED""#)),
        "{last:?}"
    );
    Api::<Pod>::namespaced(admin.clone(), "shop")
        .delete(&api_pod.name_any(), &Default::default())
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the deleted pod's watch ends");
    assert_eq!(
        ended.map(|_| ()).map_err(|s| s.code()),
        Err(Code::Unauthenticated)
    );

    stop.cancel();
    let _ = sidecar.await;
    server.shutdown().await;
    kt::assert_no_secret_logged(&[&pod_token, &reader, &nobody, &wrong_audience]);
}

/// The operator's PKI with short lifetimes (CA 24 s, serving certificates 8 s, a next CA trusted
/// 2 s before it signs) rotates the route server's certificate and its CA while a sidecar routes
/// keyed requests from the route server's rules. A task stands in for the kubelet, copying the
/// Secret and the CA bundle into files every 250 ms. Measured: no request fails, the sidecar's
/// watch never drops, and a fresh TLS connection (trusting the bundle file of the moment) succeeds
/// every half second through every rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_traffic_without_a_failed_request() {
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use spur_e2e::{AppKind, get, metrics, rule_yaml, sample, sidecar_config, spawn_app};
    use spur_operator::{PkiConfig, ServingCert};

    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, "spur-system").await.unwrap();
    let mut pki = PkiConfig::new("spur-system", "spur-webhook");
    pki.ca_lifetime = Duration::from_secs(24);
    pki.serving_lifetime = Duration::from_secs(8);
    pki.propagation = Duration::from_secs(2);
    pki.routeserver = Some(ServingCert::routeserver(
        "spur-system",
        &["localhost".into()],
    ));
    pki.validate().unwrap();
    let mut registry = Registry::with_prefix("spur_operator");
    let ctx = Arc::new(
        spur_operator::Context::new(
            admin.clone(),
            Some("test".into()),
            spur_operator::Metrics::register(&mut registry),
        )
        .with_pki(pki),
    );
    let stop = CancellationToken::new();
    let operator = tokio::spawn(spur_operator::run(admin.clone(), ctx, stop.clone()));

    // The kubelet's part: the mounted Secret and the CA bundle ConfigMap, as files.
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().to_path_buf();
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), "spur-system");
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), "spur-system");
    let sync = |secrets: Api<Secret>, config_maps: Api<ConfigMap>, files: std::path::PathBuf| async move {
        let write = |name: &str, data: &[u8]| {
            let path = files.join(name);
            if std::fs::read(&path).ok().as_deref() != Some(data) {
                std::fs::write(files.join(format!(".{name}")), data).unwrap();
                std::fs::rename(files.join(format!(".{name}")), path).unwrap();
            }
        };
        let tls = secrets.get_opt("spur-routeserver-tls").await.ok()??.data?;
        let bundle = config_maps.get_opt("spur-ca-bundle").await.ok()??.data?;
        write("tls.key", &tls.get("tls.key")?.0);
        write("tls.crt", &tls.get("tls.crt")?.0);
        write("ca.crt", bundle.get("ca.crt")?.as_bytes());
        Some(())
    };
    eventually("the route server's certificate and the bundle", || {
        sync(secrets.clone(), config_maps.clone(), files.clone())
    })
    .await;
    let kubelet_stop = CancellationToken::new();
    let kubelet = tokio::spawn({
        let (secrets, config_maps, files, stop) = (
            secrets.clone(),
            config_maps.clone(),
            files.clone(),
            kubelet_stop.clone(),
        );
        async move {
            while !stop.is_cancelled() {
                sync(secrets.clone(), config_maps.clone(), files.clone()).await;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });

    let apps = CancellationToken::new();
    let baseline = spawn_app(AppKind::Http, "baseline", apps.clone()).await;
    let fork = spawn_app(AppKind::Http, "fork", apps.clone()).await;
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(
        rules.path().join("rules.yaml"),
        rule_yaml("k1", baseline.port(), fork),
    )
    .unwrap();
    let server = RouteServer::start(RouteServerConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        tls: Some(ServingTls {
            reload_every: Duration::from_millis(200),
            ..ServingTls::new(files.join("tls.crt"), files.join("tls.key"))
        }),
        ..RouteServerConfig::new(rules.path())
    })
    .await
    .unwrap();
    let grpc = server.grpc_addr.port();
    let sidecar = spur_sidecar::Sidecar::start(spur_sidecar::SidecarConfig {
        inject_key_file: None,
        kafka: None,
        routeserver: Some(RouteServerConn {
            addr: format!("localhost:{grpc}"),
            ca: Some(files.join("ca.crt")),
            token: None,
        }),
        ..sidecar_config(baseline)
    })
    .await
    .unwrap();
    let at = sidecar.inbound_addr;
    let served_by = |key: Option<&'static str>| async move {
        let baggage = key.map(|k| format!("sd-routing-key={k}"));
        let headers: Vec<(&str, &str)> = baggage.iter().map(|b| ("baggage", b.as_str())).collect();
        let got = get(at, "/", &headers).await.ok()?;
        (got.status == 200).then(|| got.served_by().to_string())
    };
    eventually("keyed requests reach the fork", || async {
        (served_by(Some("k1")).await.as_deref() == Some("fork")).then_some(())
    })
    .await;

    // Traffic through 40 s of rotations: a keyed and an unkeyed request every 20 ms, a fresh
    // TLS connection every 500 ms.
    let handshake = |port: u16, bundle: Vec<u8>| async move {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&bundle) {
            roots.add(c.ok()?).ok()?;
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(
                rustls::pki_types::ServerName::try_from("localhost").ok()?,
                tcp,
            )
            .await
            .ok()?;
        Some(tls.get_ref().1.peer_certificates()?[0].to_vec())
    };
    let started = std::time::Instant::now();
    let (mut requests, mut failed, mut handshakes, mut failed_handshakes) =
        (0u32, 0u32, 0u32, 0u32);
    let mut leaves = std::collections::BTreeSet::new();
    let mut bundles = std::collections::BTreeSet::new();
    let mut next_handshake = started;
    while started.elapsed() < Duration::from_secs(40) {
        requests += 2;
        failed += u32::from(served_by(Some("k1")).await.as_deref() != Some("fork"));
        failed += u32::from(served_by(None).await.as_deref() != Some("baseline"));
        if std::time::Instant::now() >= next_handshake {
            next_handshake += Duration::from_millis(500);
            let bundle = std::fs::read(files.join("ca.crt")).unwrap();
            handshakes += 1;
            match handshake(grpc, bundle.clone()).await {
                Some(leaf) => {
                    leaves.insert(leaf);
                }
                None => failed_handshakes += 1,
            }
            bundles.insert(bundle);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "rotation under traffic: {requests} requests, {failed} failed; {handshakes} fresh TLS connections, {failed_handshakes} failed; {} serving certificates and {} CA bundles seen",
        leaves.len(),
        bundles.len()
    );
    // The rotation happened: several serving certificates, and the bundle changed with a CA.
    assert!(leaves.len() >= 4, "{} serving certificates", leaves.len());
    assert!(bundles.len() >= 2, "{} bundles", bundles.len());
    assert_eq!(failed, 0, "of {requests} requests");
    assert_eq!(failed_handshakes, 0, "of {handshakes} fresh connections");
    let admin_addr = sidecar.admin_addr.unwrap();
    let m = metrics(admin_addr).await;
    assert_eq!(sample(&m, "spur_routeserver_reconnects_total"), 0.0, "{m}");
    assert_eq!(sample(&m, "spur_routeserver_connected"), 1.0, "{m}");

    eprintln!("stopping the sidecar");
    sidecar.shutdown().await;
    eprintln!("stopping the route server");
    server.shutdown().await;
    kubelet_stop.cancel();
    eprintln!("stopping the kubelet stand-in");
    let _ = kubelet.await;
    stop.cancel();
    eprintln!("stopping the operator");
    tokio::time::timeout(Duration::from_secs(20), operator)
        .await
        .expect("the operator stops")
        .unwrap();
    apps.cancel();
    eprintln!("stopped");
}
