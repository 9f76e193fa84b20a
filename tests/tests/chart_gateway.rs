//! The chart's L4 gateway (docs/l4.md, "Running a gateway"; `gateway.*` in
//! charts/spur/values.yaml).
//!
//! What `helm template` renders: nothing of it by default; with `gateway.namespaces` a
//! ServiceAccount without rights and a Deployment (and a PodDisruptionBudget) in each namespace,
//! the pods as `spur-gateway` needs them (route server, CA bundle, pod-bound token, downward
//! API, probes, hardening, the label ListenerSets select) and the operator told to keep the CA
//! bundle there; the release namespace when the list is empty; hostNetwork's extras; and what
//! the values schema and the template refuse.
//!
//! On a real kube-apiserver, the operator under the chart's RBAC (unchanged: it may already
//! create ConfigMaps and patch `spur-ca-bundle` anywhere) keeps the copies of
//! `--ca-bundle-namespace`: made in an existing namespace, made at once in one created later,
//! left alone where someone else's ConfigMap has the name, never in its own namespace, and
//! brought along when the CA rotates.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use spur_e2e::kube::{
    SYSTEM_NAMESPACE, chart_path, ensure_namespace, eventually, install_crds, operator_client,
};
use spur_kube_harness::KubeApi;
use spur_operator::PkiConfig;
use tokio_util::sync::CancellationToken;

/// `helm template spur charts/spur -n spur-system <args>`: the objects, or helm's stderr.
async fn template(args: &[&str]) -> Result<Vec<Value>, String> {
    let helm: PathBuf = spur_kube_harness::bin_dir().await.unwrap().join("helm");
    let home = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(&helm)
        .args(["template", "spur"])
        .arg(chart_path(""))
        .args(["--namespace", SYSTEM_NAMESPACE])
        .args(args)
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", helm.display()));
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = Vec::new();
    let mut doc = String::new();
    for line in text.lines().chain(std::iter::once("---")) {
        if line == "---" {
            let content = doc
                .lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
            if content {
                let v: Value = serde_yaml_ng::from_str(&doc)
                    .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{doc}"));
                objects.push(v);
            }
            doc.clear();
        } else {
            doc.push_str(line);
            doc.push('\n');
        }
    }
    Ok(objects)
}

fn find<'a>(objects: &'a [Value], kind: &str, namespace: &str, name: &str) -> Option<&'a Value> {
    objects.iter().find(|o| {
        o["kind"] == kind
            && o["metadata"]["name"] == name
            && o["metadata"]["namespace"].as_str().unwrap_or_default() == namespace
    })
}

fn named_gateway(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .filter(|o| o["metadata"]["name"] == "spur-gateway")
        .map(|o| format!("{} {}", o["kind"], o["metadata"]["namespace"]))
        .collect()
}

/// The operator's arguments that name CA bundle namespaces.
fn bundle_args(objects: &[Value]) -> Vec<String> {
    let operator = find(objects, "Deployment", SYSTEM_NAMESPACE, "spur-operator").unwrap();
    operator["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--ca-bundle-namespace"))
        .map(str::to_owned)
        .collect()
}

/// Name → value (or valueFrom's field path) of a container's environment.
fn env(container: &Value) -> BTreeMap<String, String> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let v = e["value"].as_str().map_or_else(
                || {
                    format!(
                        "fieldRef:{}",
                        e["valueFrom"]["fieldRef"]["fieldPath"].as_str().unwrap()
                    )
                },
                str::to_owned,
            );
            (e["name"].as_str().unwrap().to_owned(), v)
        })
        .collect()
}

/// The gateway Deployment of `ns` as every configuration renders it; returns its pod spec.
fn check_deployment<'a>(objects: &'a [Value], ns: &str, replicas: u64) -> &'a Value {
    let sa = find(objects, "ServiceAccount", ns, "spur-gateway")
        .unwrap_or_else(|| panic!("no ServiceAccount in {ns}: {:?}", named_gateway(objects)));
    assert_eq!(sa["automountServiceAccountToken"], false, "{sa:#}");
    let d = find(objects, "Deployment", ns, "spur-gateway")
        .unwrap_or_else(|| panic!("no Deployment in {ns}: {:?}", named_gateway(objects)));
    assert_eq!(d["spec"]["replicas"], replicas, "{d:#}");
    assert_eq!(d["metadata"]["labels"]["spur.dev/gateway"], "spur-gateway");
    let selector = d["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert_eq!(
        selector.get("app.kubernetes.io/name"),
        Some(&json!("spur-gateway"))
    );
    assert_eq!(
        selector.get("app.kubernetes.io/instance"),
        Some(&json!("spur"))
    );
    let template = &d["spec"]["template"];
    let labels = template["metadata"]["labels"].as_object().unwrap();
    for (k, v) in selector {
        assert_eq!(labels.get(k), Some(v), "the selector must match the pods");
    }
    // What a ListenerSet's spec.selector names (docs/l4.md).
    assert_eq!(
        labels.get("spur.dev/gateway"),
        Some(&json!("spur-gateway")),
        "{labels:?}"
    );
    assert_eq!(
        template["metadata"]["annotations"]["sidecar.spur.dev/inject"], "false",
        "a gateway pod is never injected"
    );

    let pod = &template["spec"];
    assert_eq!(pod["serviceAccountName"], "spur-gateway");
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["terminationGracePeriodSeconds"], 30);
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(c["image"], "localhost/spur:dev");
    assert_eq!(c["command"], json!(["spur-gateway"]));
    assert_eq!(c.get("args"), None);
    let env = env(c);
    let want: BTreeMap<String, String> = [
        ("SPUR_ROUTE_SERVER", "spur-routeserver.spur-system.svc:7777"),
        (
            "SPUR_ROUTE_SERVER_CA",
            "/var/run/spur/routeserver-ca/ca.crt",
        ),
        ("SPUR_TOKEN_FILE", "/var/run/spur/routeserver-token/token"),
        ("SPUR_ADMIN_ADDR", "0.0.0.0:15021"),
        ("SPUR_DNS_INTERVAL", "30s"),
        ("SPUR_REPORT_INTERVAL", "10s"),
        ("SPUR_LOG", "debug"),
        ("POD_NAME", "fieldRef:metadata.name"),
        ("POD_NAMESPACE", "fieldRef:metadata.namespace"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(env, want);

    assert_eq!(
        c["ports"],
        json!([{"name": "admin", "containerPort": 15021}])
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/ready", "port": "admin"})
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"path": "/live", "port": "admin"})
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true, "{sc:#}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc:#}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{sc:#}");
    assert_eq!(sc["capabilities"], json!({"drop": ["ALL"]}), "{sc:#}");
    assert!(sc["capabilities"].get("add").is_none());
    assert!(sc.get("privileged").is_none(), "{sc:#}");
    assert!(c["resources"]["requests"]["cpu"].is_string(), "{c:#}");
    assert!(c["resources"]["limits"]["memory"].is_string(), "{c:#}");

    let mounts: BTreeMap<&str, &str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["readOnly"], true);
            (
                m["name"].as_str().unwrap(),
                m["mountPath"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        BTreeMap::from([
            ("routeserver-ca", "/var/run/spur/routeserver-ca"),
            ("routeserver-token", "/var/run/spur/routeserver-token"),
        ])
    );
    let volumes = pod["volumes"].as_array().unwrap();
    let volume = |name: &str| volumes.iter().find(|v| v["name"] == name).unwrap();
    assert_eq!(
        volume("routeserver-ca")["configMap"],
        json!({"name": "spur-ca-bundle", "items": [{"key": "ca.crt", "path": "ca.crt"}]})
    );
    assert_eq!(
        volume("routeserver-token")["projected"]["sources"],
        json!([{"serviceAccountToken": {
            "audience": "spur-routeserver", "expirationSeconds": 3600, "path": "token"
        }}])
    );
    pod
}

const IMAGE: [&str; 4] = [
    "--set",
    "image.repository=localhost/spur",
    "--set",
    "image.tag=dev",
];

#[tokio::test]
async fn the_gateway_renders_only_when_enabled() {
    let objects = template(&IMAGE).await.unwrap();
    assert!(
        named_gateway(&objects).is_empty(),
        "{:?}",
        named_gateway(&objects)
    );
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "PodDisruptionBudget" && o["metadata"]["name"] == "spur-gateway"),
        "the gateway's PodDisruptionBudget with the gateway off"
    );
    assert!(bundle_args(&objects).is_empty());
    // Listing namespaces without enabling it changes nothing either.
    let objects = template(&[&IMAGE[..], &["--set", "gateway.namespaces={voip}"]].concat())
        .await
        .unwrap();
    assert!(named_gateway(&objects).is_empty());
    assert!(bundle_args(&objects).is_empty());
}

#[tokio::test]
async fn a_gateway_in_each_listed_namespace() {
    let args = [
        &IMAGE[..],
        &[
            "--set",
            "gateway.enabled=true",
            "--set",
            "gateway.namespaces={voip,edge}",
            "--set",
            "logLevel=debug",
        ],
    ]
    .concat();
    let objects = template(&args).await.unwrap();
    for ns in ["voip", "edge"] {
        let pod = check_deployment(&objects, ns, 2);
        assert!(pod.get("hostNetwork").is_none(), "{pod:#}");
        // Replicas apart where the cluster has nodes enough, not required.
        assert!(
            pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
                .is_array(),
            "{pod:#}"
        );
        let pdb = find(&objects, "PodDisruptionBudget", ns, "spur-gateway").unwrap();
        assert_eq!(pdb["spec"]["maxUnavailable"], 1);
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"],
            json!({"app.kubernetes.io/name": "spur-gateway", "app.kubernetes.io/instance": "spur"})
        );
    }
    let mut rendered = named_gateway(&objects);
    rendered.sort();
    assert_eq!(
        rendered,
        [
            "\"Deployment\" \"edge\"",
            "\"Deployment\" \"voip\"",
            "\"PodDisruptionBudget\" \"edge\"",
            "\"PodDisruptionBudget\" \"voip\"",
            "\"ServiceAccount\" \"edge\"",
            "\"ServiceAccount\" \"voip\"",
        ]
    );
    // No RBAC: nothing binds the gateway's ServiceAccount.
    for o in &objects {
        for s in o["subjects"].as_array().into_iter().flatten() {
            assert_ne!(s["name"], "spur-gateway", "{o:#}");
        }
    }
    // The operator keeps the CA bundle in both.
    assert_eq!(
        bundle_args(&objects),
        ["--ca-bundle-namespace=voip", "--ca-bundle-namespace=edge"]
    );

    // The release namespace among them holds the published bundle already.
    let args = [
        &IMAGE[..],
        &[
            "--set",
            "gateway.enabled=true",
            "--set",
            "gateway.namespaces={voip,spur-system}",
            "--set",
            "logLevel=debug",
        ],
    ]
    .concat();
    let objects = template(&args).await.unwrap();
    check_deployment(&objects, "voip", 2);
    check_deployment(&objects, SYSTEM_NAMESPACE, 2);
    assert_eq!(named_gateway(&objects).len(), 6);
    assert_eq!(bundle_args(&objects), ["--ca-bundle-namespace=voip"]);
}

#[tokio::test]
async fn the_release_namespace_by_default_and_host_network() {
    let args = [
        &IMAGE[..],
        &[
            "--set",
            "gateway.enabled=true",
            "--set",
            "gateway.replicas=1",
            "--set",
            "gateway.hostNetwork=true",
            "--set",
            "logLevel=debug",
        ],
    ]
    .concat();
    let objects = template(&args).await.unwrap();
    let pod = check_deployment(&objects, SYSTEM_NAMESPACE, 1);
    assert_eq!(
        named_gateway(&objects).len(),
        2,
        "no PodDisruptionBudget for one replica"
    );
    assert!(bundle_args(&objects).is_empty());
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    let required =
        &pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(required["topologyKey"], "kubernetes.io/hostname", "{pod:#}");
    let d = find(&objects, "Deployment", SYSTEM_NAMESPACE, "spur-gateway").unwrap();
    assert_eq!(
        d["spec"]["strategy"]["rollingUpdate"],
        json!({"maxSurge": 0, "maxUnavailable": 1})
    );
}

#[tokio::test]
async fn invalid_gateway_values_are_refused() {
    for (set, expect) in [
        ("gateway.namespaces={Voip_1}", "/gateway/namespaces/0"),
        ("gateway.namespaces={-edge}", "/gateway/namespaces/0"),
        (
            "gateway.namespaces={a-namespace-name-that-is-longer-than-sixty-three-characters-long}",
            "/gateway/namespaces/0",
        ),
        ("gateway.namespaces={voip,edge,voip}", "/gateway/namespaces"),
        ("gateway.dnsInterval=0s", "/gateway/dnsInterval"),
        ("gateway.reportInterval=10 s", "/gateway/reportInterval"),
        ("gateway.replica=3", "replica"),
        ("gateway.replicas=-1", "/gateway/replicas"),
        (
            "injection.routeserverCaConfigMap=",
            "routeserverCaConfigMap",
        ),
    ] {
        let args = [&IMAGE[..], &["--set", "gateway.enabled=true", "--set", set]].concat();
        let err = template(&args)
            .await
            .err()
            .unwrap_or_else(|| panic!("{set} was accepted"));
        assert!(err.contains(expect), "{set}: {err}");
    }
}

/// A copy of the CA bundle in `ns`: its `ca.crt` and whether the operator marks it as its own.
async fn copy(admin: &kube::Client, ns: &str) -> Option<(String, bool)> {
    let api: Api<ConfigMap> = Api::namespaced(admin.clone(), ns);
    let cm = api.get_opt("spur-ca-bundle").await.ok()??;
    let ours = cm
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("spur.dev/pki"))
        .is_some_and(|v| v == "namespace-bundle");
    Some((cm.data?.remove("ca.crt")?, ours))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_keeps_the_ca_bundle_in_gateway_namespaces() {
    spur_e2e::kube::capture_logs();
    let api = KubeApi::start().await.unwrap();
    install_crds(&api).await.unwrap();
    let admin = api.client();
    let operator = operator_client(&api).await.unwrap();
    // voip exists before the operator starts; edge comes later; mine holds someone else's
    // ConfigMap of that name.
    ensure_namespace(&admin, "voip").await.unwrap();
    ensure_namespace(&admin, "mine").await.unwrap();
    let theirs: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "spur-ca-bundle", "namespace": "mine"},
        "data": {"ca.crt": "not ours"},
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(admin.clone(), "mine")
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();

    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let mut pki = PkiConfig::new(SYSTEM_NAMESPACE, "spur-webhook");
    pki.namespace_bundle = Some("spur-ca-bundle".into());
    pki.bundle_namespaces = ["voip", "edge", "mine", SYSTEM_NAMESPACE]
        .map(String::from)
        .to_vec();
    pki.validate().unwrap();
    let ctx = Arc::new(
        spur_operator::Context::new(operator.clone(), Some("test".into()), metrics).with_pki(pki),
    );
    let stop = CancellationToken::new();
    let running = tokio::spawn(spur_operator::run(operator, ctx, stop.clone()));

    let published = eventually("the published CA bundle", || async {
        copy(&admin, SYSTEM_NAMESPACE).await
    })
    .await;
    assert!(
        !published.1,
        "the release namespace keeps the published bundle"
    );
    let bundle = published.0;
    assert!(bundle.contains("BEGIN CERTIFICATE"));
    let voip = eventually("the copy in voip", || async { copy(&admin, "voip").await }).await;
    assert_eq!(voip, (bundle.clone(), true));

    // A namespace made after the operator's passes gets its copy at once (its creation wakes
    // the certificate manager, whose next pass is otherwise hours away).
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure_namespace(&admin, "edge").await.unwrap();
    let edge = eventually("the copy in edge", || async { copy(&admin, "edge").await }).await;
    assert_eq!(edge, (bundle.clone(), true));

    // A requested CA rotation publishes the next CA in every bundle at once: the copies follow.
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    secrets
        .patch(
            "spur-ca",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "spur.dev/rotate-requested-at": at.to_string()
            }}})),
        )
        .await
        .unwrap();
    let rotated = eventually("the rotated bundle published", || async {
        copy(&admin, SYSTEM_NAMESPACE)
            .await
            .filter(|(b, _)| *b != bundle)
    })
    .await
    .0;
    assert_eq!(rotated.matches("BEGIN CERTIFICATE").count(), 2);
    for ns in ["voip", "edge"] {
        let got = eventually(&format!("the rotated bundle in {ns}"), || async {
            copy(&admin, ns).await.filter(|(b, _)| *b == rotated)
        })
        .await;
        assert!(got.1);
    }
    // Someone else's ConfigMap of that name is never taken over.
    assert_eq!(
        copy(&admin, "mine").await,
        Some(("not ours".to_owned(), false))
    );
    // A namespace not listed gets nothing.
    ensure_namespace(&admin, "other").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(copy(&admin, "other").await, None);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the operator stops")
        .unwrap();
}
