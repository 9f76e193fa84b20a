//! The control plane on a real kube-apiserver: the operator turns Sandboxes and RouteGroups into
//! forks, sandbox Services and RoutingConfigs; the route server (Kubernetes store) serves them;
//! a real sidecar routes keyed requests to the fork. There is no kubelet: the test marks fork
//! Deployments ready where a kubelet and the Deployment controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use spur_api::conditions::{READY, find_condition, is_condition_true};
use spur_api::keys::labels;
use spur_api::workstation::{CREATED_BY_ANNOTATION, Owner, owner_record_name};
use spur_api::{
    ExternalWorkload, ForkedWorkload, RouteGroup, RoutingConfig, Sandbox, VirtualWorkload,
    WorkloadKind, WorkloadRef, names,
};
use spur_e2e::kube as kube_rbac;
use spur_e2e::kube::control_plane::ControlPlane;
use spur_e2e::kube::{WAIT, eventually};
use spur_e2e::{AppKind, get, spawn_app};
use spur_kube_harness::KubeApi;
use spur_routing::BaselineWorkload;
use spur_sidecar::{Sidecar, SidecarConfig};
use tokio_util::sync::CancellationToken;

/// A baseline workload: a Deployment + Service in the API server, its process (an HTTP app) on
/// loopback, and a sidecar in front of it watching the route server.
struct Baseline {
    name: &'static str,
    sidecar: Sidecar,
}

const NS: &str = "shop";
/// The chart's `tunnelProxy.tokenNamespace`: the workstation token Secrets, away from the CA.
const TOKEN_NS: &str = "spur-workstation-tokens";

/// The tunnel proxy's client under the chart's RBAC: its ClusterRole, its Role in spur-system
/// (tunnel Leases) and its Role in the token namespace (token Secrets). It cannot read any
/// Secret of spur-system, where the operator keeps its CA's key.
async fn tunnel_proxy_client(cp: &ControlPlane) -> Client {
    let tp = kube_rbac::chart_client(
        &cp.api,
        "spur-tunnel-proxy",
        "tunnelproxy-rules.yaml",
        Some("tunnelproxy-namespace-rules.yaml"),
    )
    .await
    .unwrap();
    kube_rbac::grant_in_namespace(
        &cp.api,
        "spur-tunnel-proxy",
        TOKEN_NS,
        "tunnelproxy-token-rules.yaml",
    )
    .await
    .unwrap();
    for verb in ["list", "get"] {
        let denied = match verb {
            "list" => Api::<Secret>::namespaced(tp.clone(), "spur-system")
                .list(&ListParams::default())
                .await
                .map(|_| ()),
            _ => Api::<Secret>::namespaced(tp.clone(), "spur-system")
                .get("spur-ca")
                .await
                .map(|_| ()),
        };
        assert!(
            matches!(&denied, Err(kube::Error::Api(s)) if s.code == 403),
            "the tunnel proxy may {verb} Secrets in spur-system: {denied:?}"
        );
    }
    tp
}

async fn create_namespace(client: &Client) {
    // Labelled: Spur may write in it (the enroller binds the operator's rights there).
    let ns: Namespace = serde_json::from_value(json!({"metadata": {
        "name": NS, "labels": {(kube_rbac::ENABLED_LABEL): "true"}}}))
    .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    kube_rbac::wait_enrolled(client, NS).await.unwrap();
}

/// The baseline `name` and the forks that sandboxes may route to: `forks` maps a sandbox name
/// to the loopback app standing for that sandbox's fork (the test resolver).
async fn baseline(
    cp: &ControlPlane,
    name: &'static str,
    forks: &[(&str, SocketAddr)],
    apps: &CancellationToken,
) -> Baseline {
    let app = spawn_app(AppKind::Http, &format!("{name}-baseline"), apps.clone()).await;
    let client = cp.client();
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, "team": "shop"}},
                "spec": {"containers": [{
                    "name": name, "image": format!("{name}:1"),
                    "ports": [{"name": "http", "containerPort": app.port()}]
                }]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client, NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();

    let mut config: SidecarConfig = spur_e2e::sidecar_config(app);
    config.baseline = BaselineWorkload {
        kind: "Deployment".into(),
        namespace: NS.into(),
        name: name.into(),
    };
    config.routeserver = Some(spur_sidecar::RouteServerConn::plain(cp.routeserver_addr()));
    for (sandbox, fork) in forks {
        // Cluster DNS stand-in: the sandbox Service of this baseline → the fork's process.
        let host = format!("{}.{NS}.svc:80", names::sandbox_service_name(sandbox, name));
        config.proxy.resolve.insert(host, *fork);
    }
    Baseline {
        name,
        sidecar: Sidecar::start(config).await.unwrap(),
    }
}

impl Baseline {
    async fn served_by(&self, key: Option<&str>) -> String {
        let baggage = key.map(|k| format!("sd-routing-key={k}"));
        let headers: Vec<(&str, &str)> = baggage.iter().map(|b| ("baggage", b.as_str())).collect();
        let got = get(self.sidecar.inbound_addr, "/", &headers).await.unwrap();
        assert_eq!(got.status, 200, "{got:?}");
        got.served_by().to_string()
    }

    /// Waits until a request with `key` is served by `expected`.
    async fn routes(&self, key: &str, expected: &str) {
        eventually(&format!("{key} at {} → {expected}", self.name), || async {
            (self.served_by(Some(key)).await == expected).then_some(())
        })
        .await;
    }
}

fn sandbox(
    name: &str,
    labels_: serde_json::Value,
    forks: serde_json::Value,
    ttl: Option<serde_json::Value>,
) -> Sandbox {
    let mut spec = json!({"labels": labels_, "forks": forks});
    if let Some(ttl) = ttl {
        spec["ttl"] = ttl;
    }
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": spec
    }))
    .unwrap()
}

fn fork_of(baseline: &str) -> serde_json::Value {
    json!({"forkOf": {"kind": "Deployment", "namespace": NS, "name": baseline},
           "customizations": {"images": [{"image": format!("{baseline}:dev")}],
                              "env": [{"name": "FEATURE", "value": "on"}]}})
}

/// Plays kubelet and Deployment controller: marks the fork Deployment of `sandbox`/`baseline`
/// ready once it exists.
async fn mark_fork_ready(client: &Client, sandbox: &str, baseline: &str) -> Deployment {
    let fork = names::fork_name(
        sandbox,
        &WorkloadRef::new(WorkloadKind::Deployment, NS, baseline),
    );
    let api: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let d = eventually(&format!("fork Deployment {fork}"), || async {
        api.get_opt(&fork).await.unwrap()
    })
    .await;
    let generation = d.metadata.generation.unwrap();
    api.patch_status(
        &fork,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1,
            "readyReplicas": 1, "availableReplicas": 1
        }})),
    )
    .await
    .unwrap();
    d
}

async fn sandbox_status(client: &Client, name: &str) -> Option<Sandbox> {
    Api::<Sandbox>::all(client.clone())
        .get_opt(name)
        .await
        .unwrap()
}

/// Waits until the sandbox is Ready and returns its routing key.
async fn ready_key(client: &Client, name: &str) -> String {
    eventually(&format!("Sandbox {name} Ready"), || async {
        let sb = sandbox_status(client, name).await?;
        let st = sb.status?;
        is_condition_true(&st.conditions, READY).then_some(st.routing_key?)
    })
    .await
}

/// Waits until nothing labelled with the sandbox is left: ForkedWorkloads, Deployments,
/// Services, RoutingConfigs, and the Sandbox itself.
async fn all_gone(client: &Client, sandbox: &str) {
    let lp = ListParams::default().labels(&format!("{}={sandbox}", labels::SANDBOX));
    let mut left = Vec::new();
    let found = tokio::time::timeout(WAIT, async {
        loop {
            let mut names = Vec::new();
            names.extend(left_of::<ForkedWorkload>(client, &lp).await);
            names.extend(left_of::<Deployment>(client, &lp).await);
            names.extend(left_of::<Service>(client, &lp).await);
            names.extend(left_of::<RoutingConfig>(client, &lp).await);
            names.extend(left_of::<ExternalWorkload>(client, &lp).await);
            names.extend(left_of::<VirtualWorkload>(client, &lp).await);
            if let Some(sb) = sandbox_status(client, sandbox).await {
                names.push(format!(
                    "Sandbox/{} (finalizers {:?})",
                    sb.name_any(),
                    sb.finalizers()
                ));
            }
            if names.is_empty() {
                return;
            }
            left = names;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        found.is_ok(),
        "timed out waiting for everything of {sandbox} deleted; left: {left:?}"
    );
}

/// The objects of kind `K` that `lp` selects, as `Kind/namespace/name (finalizers)`.
async fn left_of<K>(client: &Client, lp: &ListParams) -> Vec<String>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + for<'de> k8s_openapi::serde::Deserialize<'de>,
{
    Api::<K>::all(client.clone())
        .list(lp)
        .await
        .unwrap()
        .items
        .iter()
        .map(|o| {
            format!(
                "{}/{}/{} (finalizers {:?}, deleting {})",
                K::kind(&()),
                o.namespace().unwrap_or_default(),
                o.name_any(),
                o.finalizers(),
                o.meta().deletion_timestamp.is_some()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_forks_routes_and_cleans_up() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let apps = CancellationToken::new();
    let fork_app = spawn_app(AppKind::Http, "web-fork", apps.clone()).await;
    let web = baseline(&cp, "web", &[("sb1", fork_app)], &apps).await;

    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    // An env value from a fork of the sandbox (here its own): the address of its sandbox
    // Service, in Signadot's template syntax.
    let mut fork = fork_of("web");
    fork["customizations"]["env"].as_array_mut().unwrap().push(
        json!({"name": "SELF_URL", "valueFrom": {"fork": {
            "forkOf": {"kind": "Deployment", "namespace": NS, "name": "web"},
            "expression": "http://{{ .Service.Host }}:{{.Service.Port}}/"}}}),
    );
    sandboxes
        .create(
            &PostParams::default(),
            &sandbox("sb1", json!({}), json!([fork]), None),
        )
        .await
        .unwrap();

    // Until its fork is ready the sandbox counts as converging (the alert SpurSandboxNotReady
    // reads how long).
    eventually("sb1 counted as converging", || async {
        (cp.metric("sandboxes{state=\"converging\"}") == 1.0).then_some(())
    })
    .await;

    // The fork: a customized copy that baseline Services cannot select.
    let d = mark_fork_ready(&client, "sb1", "web").await;
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(1));
    // Recreate: the fork never runs two builds at once.
    assert_eq!(
        spec.strategy.as_ref().and_then(|s| s.type_.as_deref()),
        Some("Recreate")
    );
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.containers[0].image.as_deref(), Some("web:dev"));
    let env = pod.containers[0].env.clone().unwrap();
    let value = |name: &str| {
        env.iter()
            .find(|v| v.name == name)
            .and_then(|v| v.value.clone())
    };
    assert_eq!(value("FEATURE").as_deref(), Some("on"));
    let key = sandbox_status(&client, "sb1")
        .await
        .and_then(|sb| sb.status?.routing_key)
        .unwrap();
    for (name, want) in [
        ("SPUR_SANDBOX_NAME", "sb1"),
        ("SIGNADOT_SANDBOX_NAME", "sb1"),
        ("SPUR_ROUTING_KEY", key.as_str()),
        ("SIGNADOT_ROUTING_KEY", key.as_str()),
        ("SIGNADOT_SANDBOX_ROUTING_KEY", key.as_str()),
    ] {
        assert_eq!(value(name).as_deref(), Some(want), "{name}");
    }
    assert_eq!(
        value("SELF_URL"),
        Some(format!(
            "http://{}.{NS}.svc:80/",
            names::sandbox_service_name("sb1", "web")
        ))
    );
    let pod_labels = spec.template.metadata.unwrap().labels.unwrap();
    assert!(!pod_labels.contains_key("app"), "{pod_labels:?}");
    assert_eq!(pod_labels["team"], "shop");
    assert_eq!(
        d.metadata.owner_references.unwrap()[0].kind,
        "ForkedWorkload"
    );
    // The sandbox Service: same ports, selecting the fork. It is applied right after the fork
    // Deployment, in the same reconcile: wait for it rather than race it.
    let svc_name = names::sandbox_service_name("sb1", "web");
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let svc = eventually("the sandbox Service", || {
        let services = services.clone();
        let svc_name = svc_name.clone();
        async move { services.get_opt(&svc_name).await.ok()? }
    })
    .await;
    let svc_spec = svc.spec.unwrap();
    assert_eq!(
        svc_spec.selector.unwrap()[labels::FORK],
        d.metadata.name.unwrap()
    );
    assert_eq!(svc_spec.ports.unwrap()[0].port, 80);

    let key = ready_key(&client, "sb1").await;
    eventually("sb1 counted as ready", || async {
        let ready = cp.metric("sandboxes{state=\"ready\"}") == 1.0;
        let converging = cp.metric("sandboxes{state=\"converging\"}") == 0.0;
        (ready && converging && cp.metric("sandbox_oldest_converging_seconds") == 0.0).then_some(())
    })
    .await;
    let sb = sandbox_status(&client, "sb1").await.unwrap();
    let st = sb.status.unwrap();
    assert_eq!(st.forks.len(), 1);
    assert!(st.forks[0].ready);
    assert_eq!(st.forks[0].services[0].sandbox_service, svc_name);

    web.routes(&key, "web-fork").await;
    assert_eq!(web.served_by(None).await, "web-baseline");

    // Baseline changes reach the fork through the watches, not the 5-minute resync: a new env
    // var in the baseline, and a new Service selecting the baseline.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [
                {"name": "web", "env": [{"name": "BASELINE_VERSION", "value": "2"}]}
            ]}}}})),
        )
        .await
        .unwrap();
    let fork_name = names::fork_name(
        "sb1",
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "web"),
    );
    eventually("baseline change reaches the fork", || async {
        let d = deployments.get(&fork_name).await.unwrap();
        let c = &d.spec?.template.spec?.containers[0];
        let env = c.env.clone().unwrap_or_default();
        (env.iter()
            .any(|v| v.name == "BASELINE_VERSION" && v.value.as_deref() == Some("2"))
            && c.image.as_deref() == Some("web:dev"))
        .then_some(())
    })
    .await;
    let admin: Service = serde_json::from_value(json!({
        "metadata": {"name": "web-admin", "namespace": NS},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 9090, "targetPort": 9090}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &admin)
        .await
        .unwrap();
    let admin_sbx = names::sandbox_service_name("sb1", "web-admin");
    eventually(
        "a new baseline Service gets its sandbox Service",
        || async {
            Api::<Service>::namespaced(client.clone(), NS)
                .get_opt(&admin_sbx)
                .await
                .unwrap()
                .map(|_| ())
        },
    )
    .await;
    assert_eq!(web.served_by(Some("someone-else")).await, "web-baseline");

    // A fork Deployment that rolls (as an earlier Spur made them: the API server defaults
    // `rollingUpdate`, which apply alone cannot drop) is put back to Recreate.
    deployments
        .patch(
            &fork_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"strategy": {"type": "RollingUpdate"}}})),
        )
        .await
        .unwrap();
    eventually("the fork back to Recreate", || async {
        let d = deployments.get(&fork_name).await.unwrap();
        let s = d.spec?.strategy?;
        (s.type_.as_deref() == Some("Recreate") && s.rolling_update.is_none()).then_some(())
    })
    .await;

    // The route server's view: one rule for this key, and the sandbox Service in
    // GetClusterServices with the key and the baseline it stands for.
    let services = cp.routeserver.as_ref().unwrap().index().services();
    let sbx = services
        .iter()
        .find(|s| s.hostname == format!("{svc_name}.{NS}.svc"))
        .unwrap();
    let info = sbx.sandbox_info.as_ref().unwrap();
    assert_eq!(info.sandbox_routing_key, key);
    assert_eq!(info.baseline_hostname, format!("web.{NS}.svc"));

    sandboxes
        .delete("sb1", &DeleteParams::default())
        .await
        .unwrap();
    all_gone(&client, "sb1").await;
    web.routes(&key, "web-baseline").await;
    // Each step of the life cycle is an Event on the Sandbox, once, in order (a cluster-scoped
    // object's events live in `default`).
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let steps = eventually("sb1's life cycle in events", || async {
        let mut of: Vec<_> = events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("sb1")
                    && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("Sandbox")
            })
            .collect();
        of.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
        let reasons: Vec<String> = of.into_iter().filter_map(|e| e.reason).collect();
        reasons.contains(&"Deleted".to_owned()).then_some(reasons)
    })
    .await;
    assert_eq!(
        steps,
        ["Accepted", "Ready", "Deleting", "Deleted"],
        "{steps:?}"
    );
    // Nothing in this life cycle is an error: a failure here meant reconciles racing each other
    // (two of one Sandbox at once once raced into 404s and backoff), the logs say which.
    assert_eq!(
        cp.reconcile_failures(),
        0.0,
        "reconcile failures, see the log"
    );

    web.sidecar.shutdown().await;
    apps.cancel();
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_group_spans_sandboxes_and_ttl_expires() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let apps = CancellationToken::new();
    let web_fork = spawn_app(AppKind::Http, "web-fork-a", apps.clone()).await;
    let api_fork = spawn_app(AppKind::Http, "api-fork-b", apps.clone()).await;
    let web = baseline(&cp, "web", &[("sb-a", web_fork)], &apps).await;
    let api = baseline(&cp, "api", &[("sb-b", api_fork)], &apps).await;

    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    sandboxes
        .create(
            &PostParams::default(),
            &sandbox(
                "sb-a",
                json!({"feature": "checkout-v2"}),
                json!([fork_of("web")]),
                None,
            ),
        )
        .await
        .unwrap();
    sandboxes
        .create(
            &PostParams::default(),
            &sandbox(
                "sb-b",
                json!({"feature": "checkout-v3"}),
                json!([fork_of("api")]),
                Some(json!({"duration": "1h", "offsetFrom": "updatedAt"})),
            ),
        )
        .await
        .unwrap();
    let rg: RouteGroup = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup",
        "metadata": {"name": "checkout"},
        "spec": {"match": {"label": {"key": "feature", "value": "checkout-*"}},
                 "ttl": {"duration": "1m"}}
    }))
    .unwrap();
    let groups: Api<RouteGroup> = Api::all(client.clone());
    groups.create(&PostParams::default(), &rg).await.unwrap();
    // A group with a TTL (from when it last matched no sandbox, Signadot's default) that
    // matches nothing.
    let lonely: RouteGroup = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup",
        "metadata": {"name": "lonely"},
        "spec": {"match": {"label": {"key": "feature", "value": "nothing-*"}},
                 "ttl": {"duration": "1h"}}
    }))
    .unwrap();
    groups
        .create(&PostParams::default(), &lonely)
        .await
        .unwrap();

    mark_fork_ready(&client, "sb-a", "web").await;
    mark_fork_ready(&client, "sb-b", "api").await;
    let key_a = ready_key(&client, "sb-a").await;
    let key_b = ready_key(&client, "sb-b").await;
    let group_key = eventually("RouteGroup Ready", || async {
        let st = groups.get("checkout").await.unwrap().status?;
        // A group with a TTL from when it last matched nothing does not expire while it
        // matches.
        (is_condition_true(&st.conditions, READY)
            && st.matched_sandboxes.len() == 2
            && st.expires_at.is_none()
            && st.unmatched_since.is_none())
        .then_some(st.routing_key?)
    })
    .await;
    assert_ne!(group_key, key_a);
    // The group's key reaches each sandbox's fork; each sandbox's own key only its own.
    web.routes(&group_key, "web-fork-a").await;
    api.routes(&group_key, "api-fork-b").await;
    web.routes(&key_a, "web-fork-a").await;
    api.routes(&key_b, "api-fork-b").await;
    assert_eq!(api.served_by(Some(&key_a)).await, "api-baseline");
    assert_eq!(web.served_by(Some(&key_b)).await, "web-baseline");

    // TTL: sb-b's 1 h counts from its last update; moving that an hour back (as time would)
    // makes it expire: the operator deletes it and everything it made.
    let past =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_hours(2);
    // A reconcile already in flight may write back the status it read before the patch; patch
    // again until the sandbox is gone (in a cluster, nothing but the operator writes updatedAt).
    // A status change does not wake the controller (its TTL timer would, an hour later): an
    // annotation does.
    eventually("sb-b expired", || async {
        let _ = sandboxes
            .patch_status(
                "sb-b",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"updatedAt": past.to_string()}})),
            )
            .await;
        let touch = k8s_openapi::jiff::Timestamp::now().to_string();
        let _ = sandboxes
            .patch(
                "sb-b",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"spur.dev/reconcile": touch}}})),
            )
            .await;
        let gone = sandbox_status(&client, "sb-b").await.is_none();
        gone.then_some(())
    })
    .await;
    all_gone(&client, "sb-b").await;
    api.routes(&group_key, "api-baseline").await;
    api.routes(&key_b, "api-baseline").await;
    web.routes(&group_key, "web-fork-a").await;
    eventually("RouteGroup down to one sandbox", || async {
        let st = groups.get("checkout").await.unwrap().status?;
        (st.matched_sandboxes == vec!["sb-a".to_string()]).then_some(())
    })
    .await;

    // The lonely group expires an hour after it first matched nothing: moving that instant
    // back (as time would) makes the operator delete it.
    let since = eventually("the lonely group's expiry", || async {
        let st = groups.get("lonely").await.unwrap().status?;
        let (since, at) = (st.unmatched_since?.0, st.expires_at?.0);
        assert_eq!(at, since + k8s_openapi::jiff::SignedDuration::from_hours(1));
        Some(since)
    })
    .await;
    assert!(since <= k8s_openapi::jiff::Timestamp::now());
    eventually("the lonely group expired", || async {
        let _ = groups
            .patch_status(
                "lonely",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"unmatchedSince": past.to_string()}})),
            )
            .await;
        let touch = k8s_openapi::jiff::Timestamp::now().to_string();
        let _ = groups
            .patch(
                "lonely",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"spur.dev/reconcile": touch}}})),
            )
            .await;
        groups
            .get_opt("lonely")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(groups.get_opt("checkout").await.unwrap().is_some());

    // Deleting the group removes its RoutingConfig and its key stops routing.
    groups
        .delete("checkout", &DeleteParams::default())
        .await
        .unwrap();
    web.routes(&group_key, "web-baseline").await;
    let rc_name = names::route_group_routing_config_name("checkout");
    eventually("group RoutingConfig deleted", || async {
        Api::<RoutingConfig>::all(client.clone())
            .get_opt(&rc_name)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    web.routes(&key_a, "web-fork-a").await;

    web.sidecar.shutdown().await;
    api.sidecar.shutdown().await;
    apps.cancel();
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_sandboxes_are_rejected_or_reported_and_leave_nothing() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let apps = CancellationToken::new();
    let _web = baseline(&cp, "web", &[], &apps).await;
    let sandboxes: Api<Sandbox> = Api::all(client.clone());

    // The schema rejects a baseline forked twice.
    let dup = sandbox(
        "dup",
        json!({}),
        json!([fork_of("web"), fork_of("web")]),
        None,
    );
    let err = sandboxes
        .create(&PostParams::default(), &dup)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("forked only once"), "{err}");

    // A missing baseline and a patch that cannot apply are reported as conditions.
    let cases = [
        (
            "missing",
            json!([fork_of("nope")]),
            "BaselineNotFound",
            "shop/nope not found",
        ),
        (
            "badpatch",
            json!([{"forkOf": {"kind": "Deployment", "namespace": NS, "name": "web"},
                    "customizations": {"patch": {"type": "json", "value": [{"op": "remove", "path": "/spec/nothing"}]}}}]),
            "InvalidCustomization",
            "patch",
        ),
        (
            "nocontainer",
            json!([{"forkOf": {"kind": "Deployment", "namespace": NS, "name": "web"},
                    "customizations": {"images": [{"image": "x:1", "container": "sidecar"}]}}]),
            "InvalidCustomization",
            "\"sidecar\" not found",
        ),
    ];
    for (name, forks, reason, message) in cases {
        sandboxes
            .create(
                &PostParams::default(),
                &sandbox(name, json!({}), forks, None),
            )
            .await
            .unwrap();
        let cond = eventually(&format!("{name} reported"), || async {
            let st = sandbox_status(&client, name).await?.status?;
            find_condition(&st.conditions, READY).cloned()
        })
        .await;
        assert_eq!(cond.status, "False");
        assert_eq!(cond.reason, reason, "{cond:?}");
        assert!(cond.message.contains(message), "{cond:?}");
        let lp = ListParams::default().labels(&format!("{}={name}", labels::SANDBOX));
        assert!(
            Api::<ForkedWorkload>::all(client.clone())
                .list(&lp)
                .await
                .unwrap()
                .items
                .is_empty()
        );
        assert!(
            Api::<Deployment>::all(client.clone())
                .list(&lp)
                .await
                .unwrap()
                .items
                .is_empty()
        );
        sandboxes
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
        all_gone(&client, name).await;
    }
    // Local and virtual workloads: their objects are created and owned, the sandbox waits for
    // them (no tunnel, no baseline `api`), and they are deleted with the sandbox.
    // Its creator owns the workstation (the webhooks that stamp and check this do not run here;
    // tests/tests/kube_workstation_owner.rs runs them).
    own_workstation(&client, "laptop-1", "dev-user").await;
    let mixed: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "mixed", "annotations": {CREATED_BY_ANNOTATION: "dev-user"}},
        "spec": {
            "workstation": "laptop-1",
            "local": [{"name": "dev", "from": {"kind": "Deployment", "namespace": NS, "name": "web"},
                       "mappings": [{"port": 8080, "toLocal": "localhost:9000"}]}],
            "virtual": [{"name": "shadow", "workload": {"kind": "Deployment", "namespace": NS, "name": "api"}}]
        }
    }))
    .unwrap();
    sandboxes
        .create(&PostParams::default(), &mixed)
        .await
        .unwrap();
    let shadow = names::virtual_workload_name("mixed", "shadow");
    let cond = eventually("mixed reported", || async {
        let st = sandbox_status(&client, "mixed").await?.status?;
        find_condition(&st.conditions, READY)
            .filter(|c| c.message.contains(&shadow))
            .cloned()
    })
    .await;
    assert_eq!(cond.reason, "NotReady", "{cond:?}");
    let ew = Api::<ExternalWorkload>::namespaced(client.clone(), NS)
        .get(&names::external_workload_name("mixed", "dev"))
        .await
        .unwrap();
    assert_eq!(ew.spec.workstation, "laptop-1");
    assert_eq!(ew.spec.mappings[0].port, 8080);
    let vw = Api::<VirtualWorkload>::namespaced(client.clone(), NS)
        .get(&names::virtual_workload_name("mixed", "shadow"))
        .await
        .unwrap();
    assert_eq!(vw.spec.baseline.name, "api");
    // The workstation changes hands (an administrator rewrote its record): the old owner's
    // Sandbox loses its ExternalWorkload, so none of its keyed traffic reaches the new owner's
    // laptop, and says why (issue 42: a claim is checked on every pass, not only at admission).
    own_workstation(&client, "laptop-1", "bob").await;
    let ew_name = names::external_workload_name("mixed", "dev");
    let cond = eventually("mixed loses its workstation", || async {
        let st = sandbox_status(&client, "mixed").await?.status?;
        find_condition(&st.conditions, READY)
            .filter(|c| c.reason == "WorkstationNotOwned")
            .cloned()
    })
    .await;
    assert!(cond.message.contains("belongs to another user"), "{cond:?}");
    eventually("the old owner's ExternalWorkload is gone", || async {
        Api::<ExternalWorkload>::namespaced(client.clone(), NS)
            .get_opt(&ew_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    sandboxes
        .delete("mixed", &DeleteParams::default())
        .await
        .unwrap();
    all_gone(&client, "mixed").await;

    // Nothing but the baseline exists in the namespace.
    let ds = Api::<Deployment>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(
        ds.items.iter().map(|d| d.name_any()).collect::<Vec<_>>(),
        vec!["web"]
    );

    apps.cancel();
    cp.shutdown().await;
}

/// A Sandbox forking a workload of a namespace that has not opted in (issue 42, point 8) says
/// so, rather than waiting for ever on writes RBAC refuses, and leaves nothing behind; once an
/// administrator labels the namespace it gets past that check. A virtual workload there (which
/// writes nothing in the namespace) is not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_in_a_namespace_that_has_not_opted_in_says_so() {
    const OTHER: &str = "payments";
    let cp = ControlPlane::start().await;
    let client = cp.client();
    kube_rbac::ensure_namespace_unenrolled(&client, OTHER)
        .await
        .unwrap();
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "ledger", "namespace": OTHER},
        "spec": {
            "selector": {"matchLabels": {"app": "ledger"}},
            "template": {
                "metadata": {"labels": {"app": "ledger"}},
                "spec": {"containers": [{"name": "ledger", "image": "ledger:1"}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), OTHER)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let forks = json!([{"forkOf": {"kind": "Deployment", "namespace": OTHER, "name": "ledger"}}]);
    sandboxes
        .create(
            &PostParams::default(),
            &sandbox("ledger-dev", json!({}), forks, None),
        )
        .await
        .unwrap();
    let reason_of = || async {
        let st = sandbox_status(&client, "ledger-dev").await?.status?;
        find_condition(&st.conditions, READY).cloned()
    };
    let cond = eventually("ledger-dev reported", reason_of).await;
    assert_eq!(
        cond.reason,
        spur_operator::sandbox::NAMESPACE_NOT_ENABLED,
        "{cond:?}"
    );
    // A failure waiting does not end: failed, not converging (no SpurSandboxNotReady for it).
    eventually("ledger-dev counted as failed", || async {
        (cp.metric("sandboxes{state=\"failed\"}") >= 1.0).then_some(())
    })
    .await;
    assert!(
        cond.message
            .contains(&format!("namespace {OTHER} has not opted in"))
            && cond.message.contains("spur.dev/enabled=true"),
        "{cond:?}"
    );
    assert!(
        left_of::<ForkedWorkload>(&client, &ListParams::default())
            .await
            .is_empty(),
        "nothing is made for a sandbox that failed its check"
    );

    // A virtual workload there writes nothing in the namespace: not refused.
    let virtual_only: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "ledger-capture"},
        "spec": {"virtual": [{"name": "ledger",
            "workload": {"kind": "Deployment", "namespace": OTHER, "name": "ledger"}}]}
    }))
    .unwrap();
    sandboxes
        .create(&PostParams::default(), &virtual_only)
        .await
        .unwrap();
    let cond = eventually("ledger-capture reported", || async {
        let st = sandbox_status(&client, "ledger-capture").await?.status?;
        find_condition(&st.conditions, READY).cloned()
    })
    .await;
    assert_ne!(
        cond.reason,
        spur_operator::sandbox::NAMESPACE_NOT_ENABLED,
        "{cond:?}"
    );

    // Labelled: the enroller binds, the check passes (a touch of the Sandbox wakes it at once).
    kube_rbac::ensure_namespace(&client, OTHER).await.unwrap();
    sandboxes
        .patch(
            "ledger-dev",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"touched": "1"}}})),
        )
        .await
        .unwrap();
    eventually("ledger-dev past the namespace check", || async {
        let c = reason_of().await?;
        (c.reason != spur_operator::sandbox::NAMESPACE_NOT_ENABLED).then_some(())
    })
    .await;
    cp.shutdown().await;
}

/// Baseline `shop/api` (a Deployment with container port 8080 and a Service `api` on port 80)
/// and Sandbox `dev` whose local workload stands in for it on workstation `alice`, sending
/// port 8080 to `to_local`. Returns the ExternalWorkload's name.
async fn local_sandbox(client: &Client, to_local: &str) -> String {
    create_namespace(client).await;
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "api"}},
                 "template": {"metadata": {"labels": {"app": "api"}},
                              "spec": {"containers": [{"name": "api", "image": "api:1", "ports": [{"name": "http", "containerPort": 8080}]}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": NS},
        "spec": {"selector": {"app": "api"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    own_workstation(client, "alice", "alice").await;
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "dev", "annotations": {CREATED_BY_ANNOTATION: "alice"}},
        "spec": {"workstation": "alice",
                 "local": [{"name": "api", "from": {"kind": "Deployment", "namespace": NS, "name": "api"},
                            "mappings": [{"port": 8080, "toLocal": to_local}]}]}
    }))
    .unwrap();
    Api::<Sandbox>::all(client.clone())
        .create(&PostParams::default(), &sb)
        .await
        .unwrap();
    names::external_workload_name("dev", "api")
}

/// Records `user` as the owner of `workstation` (what the signer, a tunnel grant or `spur local
/// token --owner` write), without an end.
async fn own_workstation(client: &Client, workstation: &str, user: &str) {
    let record = Owner {
        user: user.into(),
        expires_at: None,
    }
    .record("spur-system", workstation);
    Api::<ConfigMap>::namespaced(client.clone(), "spur-system")
        .patch(
            &owner_record_name(workstation),
            &PatchParams::apply("test").force(),
            &Patch::Apply(&record),
        )
        .await
        .unwrap();
}

/// The tunnel proxy's report of a workstation session (what `spur-tunnel-proxy` keeps renewed).
fn tunnel_lease(ew: &str, renewed: i64) -> k8s_openapi::api::coordination::v1::Lease {
    spur_api::tunnel::Session {
        workstation: "alice".into(),
        proxy_pod: "spur-tunnel-proxy-0".into(),
        address: "10.0.0.7".into(),
        ports: vec![spur_api::tunnel::PortAssignment {
            namespace: NS.into(),
            external_workload: ew.into(),
            port: 8080,
            proxy_port: 31001,
        }],
        renewed,
        duration: 6,
        started_micros: 0,
    }
    .to_lease("spur-system")
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_workload_follows_its_workstation_tunnel() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let cp = ControlPlane::start().await;
    let client = cp.client();
    let ew_name = local_sandbox(&client, "localhost:3000").await;
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let svc_name = names::sandbox_service_name("dev", "api");
    let ews: Api<ExternalWorkload> = Api::namespaced(client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let leases: Api<Lease> = Api::namespaced(client.clone(), "spur-system");
    let rcs: Api<RoutingConfig> = Api::all(client.clone());
    let ew_reason = |want: &'static str| {
        let ews = ews.clone();
        let ew_name = ew_name.clone();
        async move {
            let ew = ews.get_opt(&ew_name).await.ok()??;
            let c = find_condition(&ew.status?.conditions, READY)?.clone();
            (c.reason == want).then_some(())
        }
    };
    let endpoints = |want: usize| {
        let slices = slices.clone();
        let svc_name = svc_name.clone();
        async move {
            let s = slices.get_opt(&svc_name).await.ok()??;
            (s.endpoints.len() == want).then_some(s)
        }
    };
    let routes = |want: usize| {
        let rcs = rcs.clone();
        async move {
            let rc = rcs
                .get_opt(&names::sandbox_routing_config_name("dev"))
                .await
                .ok()??;
            let routes = rc.status?.route_server?.routes;
            (routes.len() == want).then_some(routes)
        }
    };

    // No tunnel yet: a selector-less sandbox Service with the mapped port, no endpoints, no
    // routes (keyed traffic stays with the baseline), and the sandbox says why.
    eventually("ExternalWorkload without a tunnel", || {
        ew_reason("NoTunnel")
    })
    .await;
    let sandbox_svc = Api::<Service>::namespaced(client.clone(), NS)
        .get(&svc_name)
        .await
        .unwrap();
    let spec = sandbox_svc.spec.unwrap();
    assert!(spec.selector.is_none());
    assert_eq!(spec.ports.unwrap()[0].port, 80);
    eventually("an empty EndpointSlice", || endpoints(0)).await;
    eventually("no routes", || routes(0)).await;

    // The tunnel proxy reports the workstation's tunnel: endpoints at the proxy's port, health
    // in status, the sandbox ready, keyed traffic routed to the sandbox Service.
    let now = spur_serving::pki::now_unix();
    leases
        .create(&PostParams::default(), &tunnel_lease(&ew_name, now))
        .await
        .unwrap();
    let slice = eventually("endpoints at the tunnel proxy", || endpoints(1)).await;
    assert_eq!(slice.endpoints[0].addresses, vec!["10.0.0.7".to_string()]);
    let port = &slice.ports.unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.port),
        (Some("http"), Some(31001))
    );
    eventually("ExternalWorkload ready", || ew_reason("Ready")).await;
    let tunnel = ews
        .get(&ew_name)
        .await
        .unwrap()
        .status
        .unwrap()
        .tunnel
        .unwrap();
    assert!(tunnel.connected);
    assert_eq!(tunnel.proxy_pod.as_deref(), Some("spur-tunnel-proxy-0"));
    assert_eq!(
        (tunnel.ports[0].port, tunnel.ports[0].proxy_port),
        (8080, 31001)
    );
    let r = eventually("the local workload's route", || routes(1)).await;
    assert_eq!(r[0].to_host, format!("{svc_name}.{NS}.svc"));
    assert_eq!((r[0].from_port, r[0].workload_port), (80, 8080));
    eventually(
        "sandbox ready with its local workload connected",
        || async {
            let st = sandbox_status(&client, "dev").await?.status?;
            let l = st.local.first()?;
            (l.connected && l.ready && is_condition_true(&st.conditions, READY)).then_some(())
        },
    )
    .await;

    // The tunnel stops being renewed (laptop gone): it expires after 6 s, endpoints and routes
    // are withdrawn, and 8 s later its Lease is garbage-collected.
    eventually("the tunnel counted as down", || ew_reason("TunnelDown")).await;
    eventually("endpoints withdrawn", || endpoints(0)).await;
    eventually("route withdrawn", || routes(0)).await;
    eventually("the dead tunnel collected", || {
        let leases = leases.clone();
        async move {
            leases
                .get_opt(&spur_api::tunnel::lease_name("alice"))
                .await
                .ok()?
                .is_none()
                .then_some(())
        }
    })
    .await;
    eventually("no tunnel again", || ew_reason("NoTunnel")).await;

    // The workstation reconnects: everything comes back.
    let now = spur_serving::pki::now_unix();
    leases
        .create(&PostParams::default(), &tunnel_lease(&ew_name, now))
        .await
        .unwrap();
    eventually("endpoints back", || endpoints(1)).await;
    eventually("route back", || routes(1)).await;

    sandboxes
        .delete("dev", &DeleteParams::default())
        .await
        .unwrap();
    all_gone(&client, "dev").await;
    let left = slices
        .list(&ListParams::default().labels(labels::EXTERNAL_WORKLOAD))
        .await
        .unwrap();
    assert!(left.items.is_empty());
    cp.shutdown().await;
}

/// The tunnel proxy's Kubernetes side under its chart RBAC: workstation tokens, the tunnel API
/// (served over loopback gRPC here; over a tunnel stream in production), bind authorization,
/// and the session Lease driving the operator's ExternalWorkload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_proxy_tokens_api_and_session_lease() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use spur_proto::tunnel::tunnel_api_client::TunnelApiClient;
    use spur_proto::tunnel::tunnel_api_server::TunnelApiServer;
    use spur_proto::tunnel::{
        HelloRequest, ListServicesRequest, ResolveRequest, WatchLocalWorkloadsRequest,
    };
    use spur_tunnelproxy::{Caches, SessionReporter, TokenStore, TunnelApiService, tokens};

    let cp = ControlPlane::start().await;
    let client = cp.client();
    let ew_name = local_sandbox(&client, "localhost:3000").await;

    let tp = tunnel_proxy_client(&cp).await;
    let stop = CancellationToken::new();

    // Tokens: alice's is valid, bob's expired, anything else unknown.
    kube_rbac::ensure_namespace(&client, TOKEN_NS)
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), TOKEN_NS);
    let alice_token = tokens::generate_token().unwrap();
    let bob_token = tokens::generate_token().unwrap();
    let past = std::time::SystemTime::now() - Duration::from_secs(60);
    for s in [
        tokens::token_secret(TOKEN_NS, "alice", &alice_token, None).unwrap(),
        tokens::token_secret(TOKEN_NS, "bob", &bob_token, Some(past)).unwrap(),
    ] {
        secrets.create(&PostParams::default(), &s).await.unwrap();
    }
    let store = TokenStore::start(tp.clone(), TOKEN_NS, stop.clone())
        .await
        .unwrap();
    let now = std::time::SystemTime::now();
    let who = eventually("alice's token known", || {
        let store = store.clone();
        let t = alice_token.clone();
        async move { store.lookup(&t, now).ok() }
    })
    .await;
    assert_eq!(who.name, "alice");
    assert_eq!(
        store.lookup(&bob_token, now),
        Err(spur_tunnelproxy::TokenError::Expired("bob".into()))
    );
    assert_eq!(
        store.lookup("guess", now),
        Err(spur_tunnelproxy::TokenError::Unknown)
    );

    // The caches see the sandbox's local workload; only alice may bind its port.
    let caches = Caches::start(tp.clone(), stop.clone()).await.unwrap();
    let bind = format!("{NS}/{ew_name}/8080");
    let locals = eventually("alice's local workload", || {
        let caches = caches.clone();
        async move {
            let l = caches.local_workloads("alice");
            (!l.is_empty()).then_some(l)
        }
    })
    .await;
    assert_eq!(locals[0].routing_key.len(), 13);
    assert_eq!(locals[0].mappings[0].bind_id, bind);
    assert_eq!(locals[0].mappings[0].to_local, "localhost:3000");
    assert!(caches.authorize_bind("alice", &bind).is_ok());
    assert!(
        caches
            .authorize_bind("bob", &bind)
            .unwrap_err()
            .contains("another workstation")
    );
    assert!(
        caches
            .authorize_bind("alice", &format!("{NS}/{ew_name}/9999"))
            .is_err()
    );
    assert!(caches.authorize_bind("alice", "garbage").is_err());
    assert!(caches.local_workloads("bob").is_empty());

    // The tunnel API, as alice.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = TunnelApiService {
        workstation: "alice".into(),
        proxy_pod: "tp-0".into(),
        cluster_domain: "cluster.local".into(),
        caches: caches.clone(),
        scope: None,
    };
    let api_stop = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TunnelApiServer::new(service))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                api_stop.cancelled_owned(),
            )
            .await
            .unwrap();
    });
    let mut api = TunnelApiClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let hello = api
        .hello(HelloRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (hello.workstation.as_str(), hello.proxy_pod.as_str()),
        ("alice", "tp-0")
    );
    let services = api
        .list_services(ListServicesRequest {
            namespaces: vec![NS.into()],
        })
        .await
        .unwrap()
        .into_inner()
        .services;
    assert!(
        services
            .iter()
            .any(|s| s.name == "api" && s.ports[0].port == 80),
        "{services:?}"
    );
    let local = api
        .resolve(ResolveRequest {
            name: "localhost".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        local
            .addresses
            .iter()
            .any(|a| a == "127.0.0.1" || a == "::1"),
        "{local:?}"
    );
    let bad = api
        .resolve(ResolveRequest {
            name: "no spaces".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    let mut watch = api
        .watch_local_workloads(WatchLocalWorkloadsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = first_local_workloads(&mut watch).await;
    assert_eq!(first.workloads.len(), 1);
    assert_eq!(first.workloads[0].mappings[0].bind_id, bind);

    // The session's Lease makes the ExternalWorkload ready with endpoints at the proxy; a
    // clean close withdraws them at once (no waiting for expiry).
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let svc_name = names::sandbox_service_name("dev", "api");
    let endpoint = |want: Option<(&'static str, i32)>| {
        let slices = slices.clone();
        let svc_name = svc_name.clone();
        async move {
            let s = slices.get_opt(&svc_name).await.ok()??;
            let got = s.endpoints.first().map(|e| e.addresses[0].clone());
            let port = s
                .ports
                .as_ref()
                .and_then(|p| p.first())
                .and_then(|p| p.port);
            match want {
                Some((ip, p)) => (got.as_deref() == Some(ip) && port == Some(p)).then_some(()),
                None => got.is_none().then_some(()),
            }
        }
    };
    let reporter = SessionReporter::start(
        tp.clone(),
        "spur-system",
        "alice",
        "tp-0",
        "10.0.0.9",
        Some("uid-tp-0"),
        Duration::from_secs(6),
    );
    reporter.set_ports(vec![spur_api::tunnel::PortAssignment {
        namespace: NS.into(),
        external_workload: ew_name.clone(),
        port: 8080,
        proxy_port: 32000,
    }]);
    eventually("endpoints at tp-0", || endpoint(Some(("10.0.0.9", 32000)))).await;
    // Another replica takes the workstation over (it reconnected there): the first notices and
    // stops; its close leaves the successor's Lease alone.
    let successor = SessionReporter::start(
        tp.clone(),
        "spur-system",
        "alice",
        "tp-1",
        "10.0.0.10",
        Some("uid-tp-1"),
        Duration::from_secs(6),
    );
    successor.set_ports(vec![spur_api::tunnel::PortAssignment {
        namespace: NS.into(),
        external_workload: ew_name.clone(),
        port: 8080,
        proxy_port: 32001,
    }]);
    eventually("endpoints at tp-1", || endpoint(Some(("10.0.0.10", 32001)))).await;
    let ended = tokio::time::timeout(WAIT, async {
        while !reporter.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        reporter.close().await
    })
    .await
    .unwrap();
    assert_eq!(ended, spur_tunnelproxy::Ended::Superseded("tp-1".into()));
    let leases: Api<Lease> = Api::namespaced(client.clone(), "spur-system");
    // The replica holding the session owns the Lease now (it goes with that pod), not both.
    eventually("the Lease owned by tp-1 alone", || {
        let leases = leases.clone();
        async move {
            let held = leases
                .get_opt(&spur_api::tunnel::lease_name("alice"))
                .await
                .ok()??;
            let owners: Vec<(String, String)> = held
                .metadata
                .owner_references
                .unwrap_or_default()
                .into_iter()
                .map(|o| (o.name, o.uid))
                .collect();
            (owners == [("tp-1".to_string(), "uid-tp-1".to_string())]).then_some(())
        }
    })
    .await;
    assert_eq!(successor.close().await, spur_tunnelproxy::Ended::Closed);
    assert!(
        leases
            .get_opt(&spur_api::tunnel::lease_name("alice"))
            .await
            .unwrap()
            .is_none()
    );
    eventually("endpoints withdrawn at close", || endpoint(None)).await;

    stop.cancel();
    cp.shutdown().await;
    kube_rbac::assert_no_secret_logged(&[&alice_token, &bob_token]);
}

/// The in-process tunnel proxy of these tests: every listener on loopback, tokens in
/// [`TOKEN_NS`].
fn test_tunnel_proxy_config(tls: spur_tunnel::ServerTls) -> spur_tunnelproxy::TunnelProxyConfig {
    spur_tunnelproxy::TunnelProxyConfig {
        namespace: "spur-system".into(),
        token_namespace: TOKEN_NS.into(),
        pod_name: "spur-tunnel-proxy-0".into(),
        // EndpointSlices refuse loopback addresses: the reported pod IP is a documentation
        // address nobody dials; the test connects to the reverse listener on loopback, as
        // kube-proxy would translate the Service address to the pod's.
        pod_ip: "192.0.2.10".parse().unwrap(),
        pod_uid: None,
        quic_addr: Some("127.0.0.1:0".parse().unwrap()),
        h2_addr: Some("127.0.0.1:0".parse().unwrap()),
        socks_addr: Some("127.0.0.1:0".parse().unwrap()),
        reverse_bind: "127.0.0.1".parse().unwrap(),
        reverse_ports: None,
        // The test connects to reverse listeners from loopback, where a sidecar would.
        reverse_sources: spur_tunnelproxy::ReverseSourcesConfig {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            gateway_namespaces: Vec::new(),
        },
        tls,
        lease_duration: Duration::from_secs(6),
        cluster_domain: "cluster.local".into(),
        dial_timeout: Duration::from_secs(5),
        resolve: Default::default(),
        // The test's "cluster" is loopback.
        destinations: spur_tunnelproxy::Destinations::default().allowing_loopback(),
    }
}

/// The first message of a local-workload watch that lists any: the stream starts with what
/// the proxy knows, which may be from before its own watch saw the ExternalWorkload.
async fn first_local_workloads(
    watch: &mut tonic::Streaming<spur_proto::tunnel::LocalWorkloads>,
) -> spur_proto::tunnel::LocalWorkloads {
    tokio::time::timeout(WAIT, async {
        loop {
            let m = watch.message().await.unwrap().unwrap();
            if !m.workloads.is_empty() {
                return m;
            }
        }
    })
    .await
    .expect("no local workload reached the watch")
}

/// A workstation's whole path through the real tunnel proxy (in process, under its chart RBAC)
/// and a real tunnel client, both transports: authentication (valid, unknown, expired), the
/// tunnel API over a tunnel stream, a forward stream into the "cluster", a reverse binding that
/// becomes an ExternalWorkload endpoint and carries cluster traffic to the laptop's process,
/// SOCKS5 with the token, and a clean disconnect withdrawing the endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workstation_session_through_the_tunnel_proxy() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use spur_proto::tunnel::tunnel_api_client::TunnelApiClient;
    use spur_proto::tunnel::{HelloRequest, WatchLocalWorkloadsRequest};
    use spur_tunnel::{
        ClientConfig, ClientTls, SessionState, Token, TransportPolicy, TunnelClient,
    };
    use spur_tunnelproxy::tokens;

    let cp = ControlPlane::start().await;
    let client = cp.client();
    let apps = CancellationToken::new();
    let cluster_app = spawn_app(AppKind::Http, "cluster-app", apps.clone()).await;
    let laptop_app = spawn_app(AppKind::Http, "laptop-app", apps.clone()).await;
    let ew_name = local_sandbox(&client, &format!("127.0.0.1:{}", laptop_app.port())).await;

    kube_rbac::ensure_namespace(&client, TOKEN_NS)
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), TOKEN_NS);
    let alice = tokens::generate_token().unwrap();
    let bob = tokens::generate_token().unwrap();
    let past = std::time::SystemTime::now() - Duration::from_secs(60);
    for s in [
        tokens::token_secret(TOKEN_NS, "alice", &alice, None).unwrap(),
        tokens::token_secret(TOKEN_NS, "bob", &bob, Some(past)).unwrap(),
    ] {
        secrets.create(&PostParams::default(), &s).await.unwrap();
    }

    let tp = tunnel_proxy_client(&cp).await;
    let cert = rcgen::generate_simple_self_signed(vec!["tunnel.spur.test".into()]).unwrap();
    let cert_der = cert.cert.der().clone();
    let key_der =
        rustls::pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
    let mut registry = prometheus_client::registry::Registry::with_prefix("spur");
    let stop = CancellationToken::new();
    let proxy = spur_tunnelproxy::run(
        tp,
        test_tunnel_proxy_config(spur_tunnel::ServerTls {
            cert: spur_tunnel::ServerCert::Static {
                chain: vec![cert_der.clone()],
                key: key_der,
            },
            client_ca: Vec::new(),
            require_client_cert: false,
        }),
        tokio::runtime::Handle::current(),
        &mut registry,
        stop.clone(),
    )
    .await
    .unwrap();
    let (quic, h2, socks) = (
        proxy.quic_addr.unwrap(),
        proxy.h2_addr.unwrap(),
        proxy.socks_addr.unwrap(),
    );
    let connect = |token: &str, policy: TransportPolicy| {
        let mut cfg = ClientConfig::new(
            "tunnel.spur.test",
            ClientTls {
                roots: vec![cert_der.clone()],
                client_cert: None,
            },
        );
        cfg.quic_addr = Some(quic.to_string());
        cfg.h2_addr = Some(h2.to_string());
        cfg.transports = policy;
        cfg.token = Some(Token::new(token));
        cfg.client_name = "laptop".into();
        TunnelClient::start(cfg, &mut prometheus_client::registry::Registry::default()).unwrap()
    };
    let final_state = |c: &TunnelClient| {
        let mut st = c.state();
        async move {
            tokio::time::timeout(WAIT, async {
                loop {
                    let s = st.borrow_and_update().clone();
                    if matches!(
                        s,
                        SessionState::Connected { .. } | SessionState::Closed { .. }
                    ) {
                        return s;
                    }
                    st.changed().await.unwrap();
                }
            })
            .await
            .unwrap()
        }
    };

    // Refused: an unknown token, and bob's expired one. Neither retries forever.
    for (token, why) in [("not-a-token", "unknown token"), (bob.as_str(), "expired")] {
        let c = connect(token, TransportPolicy::QuicThenH2);
        match final_state(&c).await {
            SessionState::Closed { reason } => assert!(reason.contains(why), "{reason}"),
            other => panic!("{token:.8}… was not refused: {other:?}"),
        }
    }

    for policy in [TransportPolicy::QuicOnly, TransportPolicy::H2Only] {
        let c = Arc::new(connect(&alice, policy));
        let SessionState::Connected {
            identity,
            transport,
            ..
        } = final_state(&c).await
        else {
            panic!("alice not connected over {policy:?}");
        };
        assert_eq!(identity, "alice");
        assert_eq!(
            transport,
            if policy == TransportPolicy::QuicOnly {
                spur_tunnel::Transport::Quic
            } else {
                spur_tunnel::Transport::H2
            }
        );

        // The tunnel API, over a tunnel stream.
        let opener = c.clone();
        let channel = tonic::transport::Endpoint::from_static("http://spur-tunnel-api")
            .connect_with_connector(tower::service_fn(move |_| {
                let opener = opener.clone();
                async move {
                    let s = opener
                        .open(spur_proto::TUNNEL_API_HOST, spur_proto::TUNNEL_API_PORT)
                        .await?;
                    Ok::<_, spur_tunnel::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }))
            .await
            .unwrap();
        let mut api = TunnelApiClient::new(channel);
        let hello = api
            .hello(HelloRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(hello.workstation, "alice");
        let mut watch = api
            .watch_local_workloads(WatchLocalWorkloadsRequest::default())
            .await
            .unwrap()
            .into_inner();
        let locals = first_local_workloads(&mut watch).await;
        let mapping = locals.workloads[0].mappings[0].clone();
        assert_eq!(mapping.bind_id, format!("{NS}/{ew_name}/8080"));

        // Laptop → cluster: a forward stream to a cluster address.
        let mut s = c.open("127.0.0.1", cluster_app.port()).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(
            &mut s,
            b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut s, &mut out)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("cluster-app"), "{text}");

        // Denied destinations (cloud metadata) are refused with the reason.
        let denied = c.open("169.254.169.254", 80).await.unwrap_err().to_string();
        assert!(denied.contains("not allowed"), "{denied}");

        // Cluster → laptop: bind, the ExternalWorkload gets an endpoint at the proxy, and a
        // connection there reaches the laptop's process.
        let mut listener = c.bind(&mapping.bind_id, "{}").await.unwrap();

        let to_local = mapping.to_local.clone();
        tokio::spawn(async move {
            while let Some(incoming) = listener.accept().await {
                let Ok(mut stream) = incoming.accept().await else {
                    continue;
                };
                let mut local = tokio::net::TcpStream::connect(&to_local).await.unwrap();
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut stream, &mut local).await;
                });
            }
        });
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
        let svc_name = names::sandbox_service_name("dev", "api");
        let proxy_port = eventually("an endpoint at the tunnel proxy", || {
            let slices = slices.clone();
            let svc_name = svc_name.clone();
            async move {
                let s = slices.get_opt(&svc_name).await.ok()??;
                s.endpoints.first()?;
                s.ports?.first()?.port
            }
        })
        .await;
        let got = get(format!("127.0.0.1:{proxy_port}").parse().unwrap(), "/", &[])
            .await
            .unwrap();
        assert_eq!(got.served_by(), "laptop-app");

        // A clean disconnect withdraws the endpoint at once (no waiting for expiry).
        c.close(Duration::from_secs(2)).await;
        eventually("endpoint withdrawn", || {
            let slices = slices.clone();
            let svc_name = svc_name.clone();
            async move {
                let s = slices.get_opt(&svc_name).await.ok()??;
                s.endpoints.is_empty().then_some(())
            }
        })
        .await;
    }

    // SOCKS5 inside the cluster: the workstation's name and token.
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--socks5-hostname"])
        .arg(format!("alice:{alice}@{socks}"))
        .arg(format!("http://localhost:{}/", cluster_app.port()))
        .output()
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("cluster-app"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let refused = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--socks5-hostname"])
        .arg(format!("alice:{bob}@{socks}"))
        .arg(format!("http://localhost:{}/", cluster_app.port()))
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success());

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert_eq!(
        spur_e2e::sample(&text, "spur_tunnel_proxy_refused_sessions_total"),
        2.0,
        "{text}"
    );
    assert!(
        spur_e2e::sample(
            &text,
            "spur_tunnel_proxy_connections_total{kind=\"reverse\"}"
        ) >= 2.0
    );
    assert!(
        spur_e2e::sample(
            &text,
            "spur_tunnel_proxy_connections_total{kind=\"forward\"}"
        ) >= 2.0
    );
    stop.cancel();
    proxy.stopped().await;
    apps.cancel();
    cp.shutdown().await;
    kube_rbac::assert_no_secret_logged(&[&alice, &bob]);
}

/// A Deployment that is not the ForkedWorkload's own, as a user made it.
async fn unrelated_deployment(client: &Client, name: &str) -> Deployment {
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"owner": "someone-else"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": name, "image": format!("{name}:7")}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap()
}

fn forked_workload(name: &str, baseline: &str) -> ForkedWorkload {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1",
        "kind": "ForkedWorkload",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "sandbox": "sb",
            "routingKey": "k1",
            "baseline": {"kind": "Deployment", "namespace": NS, "name": baseline},
        }
    }))
    .unwrap()
}

/// The operator writes and deletes only objects it owns: a ForkedWorkload named like an
/// unrelated Deployment (whose baseline is missing, or present) reports the conflict and leaves
/// that Deployment as it was, also when the ForkedWorkload is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forked_workloads_leave_objects_they_do_not_own_alone() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let apps = CancellationToken::new();
    let _web = baseline(&cp, "web", &[], &apps).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let fws: Api<ForkedWorkload> = Api::namespaced(client.clone(), NS);

    for (name, baseline, reason) in [
        ("payments", "nope", "BaselineNotFound"),
        ("conflict", "web", "NameConflict"),
    ] {
        let before = unrelated_deployment(&client, name).await;
        fws.create(&PostParams::default(), &forked_workload(name, baseline))
            .await
            .unwrap();
        let cond = eventually(&format!("{name} reported"), || async {
            let st = fws.get(name).await.ok()?.status?;
            find_condition(&st.conditions, READY)
                .filter(|c| c.reason == reason)
                .cloned()
        })
        .await;
        assert_eq!(cond.status, "False", "{cond:?}");
        if reason == "NameConflict" {
            assert!(
                cond.message.contains(&format!("Deployment {NS}/{name}")),
                "{cond:?}"
            );
        }
        // Let a few more reconcile passes happen, then compare.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = deployments.get(name).await.unwrap();
        assert_eq!(
            after.metadata.uid, before.metadata.uid,
            "{name} was replaced"
        );
        assert_eq!(
            after.metadata.generation, before.metadata.generation,
            "{name} was changed"
        );
        assert_eq!(after.metadata.labels, before.metadata.labels);
        assert!(
            after.metadata.owner_references.is_none(),
            "{name} was adopted"
        );

        fws.delete(name, &DeleteParams::default()).await.unwrap();
        eventually(&format!("ForkedWorkload {name} gone"), || async {
            fws.get_opt(name).await.unwrap().is_none().then_some(())
        })
        .await;
        let kept = deployments.get(name).await.unwrap();
        assert_eq!(
            kept.metadata.uid, before.metadata.uid,
            "{name} deleted with the fork"
        );
    }
    apps.cancel();
    cp.shutdown().await;
}

/// The chart's ValidatingAdmissionPolicy (charts/spur/files/sandbox-admission-policy.yaml):
/// a user who may change Deployments and Services only in namespace `a` can fork and redirect
/// workloads of `a`, and nothing in `b`, whatever the operator's own rights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_need_their_creators_rights_in_every_namespace_they_touch() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};

    let cp = ControlPlane::start().await;
    let admin = cp.client();
    for ns in ["a", "b"] {
        kube_rbac::ensure_namespace(&admin, ns).await.unwrap();
    }
    let policy_yaml =
        std::fs::read_to_string(kube_rbac::chart_path("files/sandbox-admission-policy.yaml"))
            .unwrap();
    let mut docs = policy_yaml.split("\n---\n");
    let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    let binding: ValidatingAdmissionPolicyBinding =
        serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    // The developer: Sandboxes anywhere (they are cluster-scoped), workloads only in `a`.
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "dev-sandboxes"},
        "rules": [{"apiGroups": ["spur.dev"], "resources": ["sandboxes"],
                   "verbs": ["create", "get", "list", "update", "patch", "delete"]}]
    }))
    .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev-sandboxes"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dev-sandboxes"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": "spur-system"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &crb)
        .await
        .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dev"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": "spur-system"}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
    let token = cp
        .api
        .service_account_token("spur-system", "dev")
        .await
        .unwrap();
    let dev = cp.api.client_with_token(&token).await.unwrap();
    let dev_sandboxes: Api<Sandbox> = Api::all(dev);
    let admin_sandboxes: Api<Sandbox> = Api::all(admin.clone());

    let fork_in = |ns: &str| {
        json!({"forkOf": {"kind": "Deployment", "namespace": ns, "name": "app"},
               "customizations": {"env": [{"name": "FEATURE", "value": "on"}]}})
    };
    let forks = |name: &str, nss: &[&str]| -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"forks": nss.iter().map(|ns| fork_in(ns)).collect::<Vec<_>>()}
        }))
        .unwrap()
    };
    let local_in = |name: &str, ns: &str| -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"workstation": "alice", "local": [{"name": "laptop",
                                "from": {"kind": "Deployment", "namespace": ns, "name": "app"},
                                "mappings": [{"port": 8080, "toLocal": "localhost:8080"}]}]}
        }))
        .unwrap()
    };
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    // The API server loads a new policy asynchronously: wait until it denies.
    let denial = eventually("the policy to be enforced", || async {
        match dev_sandboxes.create(&dry, &forks("probe", &["b"])).await {
            Err(kube::Error::Api(s)) => Some(s),
            _ => None,
        }
    })
    .await;
    assert!(
        denial.message.contains("lacks them in one of: b")
            && denial
                .message
                .contains("system:serviceaccount:spur-system:dev"),
        "{denial:?}"
    );

    // Allowed where the developer could do it all.
    dev_sandboxes
        .create(&PostParams::default(), &forks("in-a", &["a"]))
        .await
        .unwrap();
    dev_sandboxes
        .create(&PostParams::default(), &local_in("local-a", "a"))
        .await
        .unwrap();
    // Denied as soon as one namespace is out of reach; nothing is created.
    for (name, sb) in [
        ("in-b", forks("in-b", &["b"])),
        ("in-a-and-b", forks("in-a-and-b", &["a", "b"])),
        ("local-b", local_in("local-b", "b")),
    ] {
        let err = dev_sandboxes
            .create(&PostParams::default(), &sb)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.message.contains("lacks them in one of:") && s.message.contains('b')),
            "{name}: {err}"
        );
        assert!(admin_sandboxes.get_opt(name).await.unwrap().is_none());
    }
    // Nor can an allowed Sandbox be changed to reach `b`. (The operator writes its status
    // meanwhile: a stale resourceVersion is a 409, asked again.)
    let mut attempts = 0;
    let err = loop {
        let mut changed = dev_sandboxes.get("in-a").await.unwrap();
        changed.spec = forks("in-a", &["a", "b"]).spec;
        match dev_sandboxes
            .replace("in-a", &PostParams::default(), &changed)
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 409 && attempts < 20 => attempts += 1,
            other => break other.unwrap_err(),
        }
    };
    assert!(
        err.to_string().contains("lacks them in one of: a, b"),
        "{err}"
    );
    // Someone with the rights (here the admin) can.
    admin_sandboxes
        .create(&PostParams::default(), &forks("admin-b", &["b"]))
        .await
        .unwrap();
    for name in ["in-a", "local-a", "admin-b"] {
        admin_sandboxes
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    cp.shutdown().await;
}

/// Revoking a workstation (`spur local revoke`'s Secret) closes its open sessions, over a token
/// and over a client certificate, within seconds; both credentials are refused afterwards, and
/// a token issued after the revocation connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_workstation_credentials_close_their_sessions() {
    use spur_tunnel::{
        ClientConfig, ClientTls, SessionState, Token, TransportPolicy, TunnelClient,
    };
    use spur_tunnelproxy::tokens;

    let cp = ControlPlane::start().await;
    let client = cp.client();
    kube_rbac::ensure_namespace(&client, TOKEN_NS)
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), TOKEN_NS);
    let token = tokens::generate_token().unwrap();
    secrets
        .create(
            &PostParams::default(),
            &tokens::token_secret(TOKEN_NS, "alice", &token, None).unwrap(),
        )
        .await
        .unwrap();

    // The workstation CA and alice's client certificate, as the operator issues them.
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let alice_key = rcgen::KeyPair::generate().unwrap();
    let mut alice_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    alice_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "alice");
    alice_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    alice_params.not_before = rcgen::date_time_ymd(2026, 1, 1);
    let alice_cert = alice_params.signed_by(&alice_key, &issuer).unwrap();

    let tp = tunnel_proxy_client(&cp).await;
    let server_cert = rcgen::generate_simple_self_signed(vec!["tunnel.spur.test".into()]).unwrap();
    let server_der = server_cert.cert.der().clone();
    let mut registry = prometheus_client::registry::Registry::with_prefix("spur");
    let stop = CancellationToken::new();
    let proxy = spur_tunnelproxy::run(
        tp,
        test_tunnel_proxy_config(spur_tunnel::ServerTls {
            cert: spur_tunnel::ServerCert::Static {
                chain: vec![server_der.clone()],
                key: rustls::pki_types::PrivateKeyDer::try_from(
                    server_cert.signing_key.serialize_der(),
                )
                .unwrap(),
            },
            client_ca: vec![ca_cert.der().clone()],
            require_client_cert: false,
        }),
        tokio::runtime::Handle::current(),
        &mut registry,
        stop.clone(),
    )
    .await
    .unwrap();
    let quic = proxy.quic_addr.unwrap();
    let connect = |token: Option<&str>, with_cert: bool| {
        let mut cfg = ClientConfig::new(
            "tunnel.spur.test",
            ClientTls {
                roots: vec![server_der.clone()],
                client_cert: with_cert.then(|| {
                    (
                        vec![alice_cert.der().clone()],
                        rustls::pki_types::PrivateKeyDer::try_from(alice_key.serialize_der())
                            .unwrap(),
                    )
                }),
            },
        );
        cfg.quic_addr = Some(quic.to_string());
        cfg.transports = TransportPolicy::QuicOnly;
        cfg.token = token.map(Token::new);
        cfg.client_name = "laptop".into();
        TunnelClient::start(cfg, &mut prometheus_client::registry::Registry::default()).unwrap()
    };
    // The first state matching `want`.
    let reach = |c: &TunnelClient, want: fn(&SessionState) -> bool| {
        let mut st = c.state();
        async move {
            tokio::time::timeout(WAIT, async {
                loop {
                    let s = st.borrow_and_update().clone();
                    if want(&s) {
                        return s;
                    }
                    st.changed().await.unwrap();
                }
            })
            .await
            .unwrap()
        }
    };
    let connected = |s: &SessionState| matches!(s, SessionState::Connected { .. });
    let over_token = connect(Some(&token), false);
    let over_cert = connect(None, true);
    for c in [&over_token, &over_cert] {
        match reach(c, connected).await {
            SessionState::Connected { identity, .. } => assert_eq!(identity, "alice"),
            other => panic!("{other:?}"),
        }
    }

    let revoked_at = std::time::Instant::now();
    secrets
        .create(
            &PostParams::default(),
            &tokens::revocation_secret(TOKEN_NS, "alice", std::time::SystemTime::now()).unwrap(),
        )
        .await
        .unwrap();
    let closed = |s: &SessionState| matches!(s, SessionState::Closed { .. });
    for c in [&over_token, &over_cert] {
        match reach(c, closed).await {
            SessionState::Closed { reason } => assert!(reason.contains("revoked"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    eprintln!(
        "both sessions closed and refused {:?} after the revocation",
        revoked_at.elapsed()
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert_eq!(
        spur_e2e::sample(&text, "spur_tunnel_proxy_revoked_sessions_total"),
        2.0,
        "{text}"
    );
    // A new token, written after the revocation, works.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let fresh = tokens::generate_token().unwrap();
    let mut body =
        serde_json::to_value(tokens::token_secret(TOKEN_NS, "alice", &fresh, None).unwrap())
            .unwrap();
    body["apiVersion"] = "v1".into();
    body["kind"] = "Secret".into();
    secrets
        .patch(
            "spur-workstation-alice",
            &PatchParams::apply("test").force(),
            &Patch::Apply(&body),
        )
        .await
        .unwrap();
    let again = connect(Some(&fresh), false);
    let state = reach(&again, |s| {
        matches!(
            s,
            SessionState::Connected { .. } | SessionState::Closed { .. }
        )
    })
    .await;
    assert!(connected(&state), "{state:?}");
    stop.cancel();
    proxy.stopped().await;
}

/// A stop early in start-up, while the operator's watches cannot yet list their objects (here:
/// the CRDs are not installed, so they back off on 404s), still stops it, within the drain
/// grace. kube-runtime's graceful shutdown alone waits for the stores forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_stops_before_its_watches_are_ready() {
    kube_rbac::capture_logs();
    let api = KubeApi::start().await.unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = spur_operator::Metrics::register(&mut registry);
    let ctx = Arc::new(spur_operator::Context::new(
        api.client(),
        Some("test".into()),
        metrics,
    ));
    let stop = CancellationToken::new();
    let operator = tokio::spawn(spur_operator::run(api.client(), ctx, stop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!operator.is_finished(), "the operator stopped by itself");
    stop.cancel();
    tokio::time::timeout(spur_operator::DRAIN_GRACE + WAIT, operator)
        .await
        .expect("the operator stops")
        .unwrap();
}

/// What the operator made and someone else changed is put back, although the operator skips
/// applies that would change nothing (operator/src/apply.rs): a fork Deployment's image, a
/// sandbox Service's selector, a ForkedWorkload's routing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_changed_behind_the_operators_back_are_restored() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let apps = CancellationToken::new();
    let _web = baseline(&cp, "web", &[], &apps).await;
    Api::<Sandbox>::all(client.clone())
        .create(
            &PostParams::default(),
            &sandbox("sb1", json!({}), json!([fork_of("web")]), None),
        )
        .await
        .unwrap();
    mark_fork_ready(&client, "sb1", "web").await;
    let key = ready_key(&client, "sb1").await;
    let fork = names::fork_name(
        "sb1",
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "web"),
    );
    let svc_name = names::sandbox_service_name("sb1", "web");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let fws: Api<ForkedWorkload> = Api::namespaced(client.clone(), NS);
    // Another field manager's writes, as `kubectl edit` would make them.
    let theirs = PatchParams::apply("someone-else").force();

    deployments
        .patch(
            &fork,
            &theirs,
            &Patch::Apply(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "spec": {"template": {"spec": {"containers": [{"name": "web", "image": "evil:1"}]}}}
            })),
        )
        .await
        .unwrap();
    eventually("the fork's image restored", || async {
        let d = deployments.get(&fork).await.ok()?;
        let image = d.spec?.template.spec?.containers[0].image.clone()?;
        (image == "web:dev").then_some(())
    })
    .await;

    // A key added to the selector (an atomic map): it no longer selects the fork's pods.
    services
        .patch(
            &svc_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"selector": {"app": "web"}}})),
        )
        .await
        .unwrap();
    eventually("the sandbox Service's selector restored", || async {
        let selector = services.get(&svc_name).await.ok()?.spec?.selector?;
        (!selector.contains_key("app") && selector.get(labels::FORK) == Some(&fork)).then_some(())
    })
    .await;

    fws.patch(
        &fork,
        &theirs,
        &Patch::Apply(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
            "spec": {"routingKey": "stolen"}
        })),
    )
    .await
    .unwrap();
    eventually("the ForkedWorkload's routing key restored", || async {
        (fws.get(&fork).await.ok()?.spec.routing_key == key).then_some(())
    })
    .await;

    apps.cancel();
    cp.shutdown().await;
}

/// Virtual workloads (issue 27): nothing is deployed or routed; the VirtualWorkload reports
/// whether the baseline exists and which of its pods carry a sidecar, and the Sandbox is Ready
/// once every virtual workload is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_workloads_report_their_baselines_sidecars() {
    use k8s_openapi::api::core::v1::Pod;
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "orders", "namespace": NS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "orders"}},
            "template": {
                "metadata": {"labels": {"app": "orders"}},
                "spec": {"containers": [{"name": "app", "image": "orders:1"}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    // Plays kubelet: one running pod with a ready sidecar, one without a sidecar.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for (name, sidecar) in [("orders-1", true), ("orders-2", false)] {
        let mut containers = vec![json!({"name": "app", "image": "orders:1"})];
        let mut statuses = vec![json!({"name": "app", "ready": true, "restartCount": 0,
            "image": "orders:1", "imageID": "", "state": {"running": {}}})];
        if sidecar {
            containers.push(json!({"name": "spur-sidecar", "image": "spur:1"}));
            statuses.push(
                json!({"name": "spur-sidecar", "ready": true, "restartCount": 0,
                "image": "spur:1", "imageID": "", "state": {"running": {}}}),
            );
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "orders"},
                         "annotations": if sidecar { json!({"sidecar.spur.dev/status": "injected"}) } else { json!({}) }},
            "spec": {"containers": containers}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "containerStatuses": statuses}})),
        )
        .await
        .unwrap();
    }
    let virtual_sandbox = |name: &str, baseline: &str| -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"virtual": [{"name": "orders",
                "workload": {"kind": "Deployment", "namespace": NS, "name": baseline}}]}
        }))
        .unwrap()
    };
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    sandboxes
        .create(&PostParams::default(), &virtual_sandbox("ref", "orders"))
        .await
        .unwrap();
    sandboxes
        .create(&PostParams::default(), &virtual_sandbox("ghost", "nothere"))
        .await
        .unwrap();

    ready_key(&client, "ref").await;
    let vws: Api<VirtualWorkload> = Api::namespaced(client.clone(), NS);
    let vw = vws
        .get(&names::virtual_workload_name("ref", "orders"))
        .await
        .unwrap();
    let st = vw.status.unwrap();
    let ready = find_condition(&st.conditions, READY).unwrap();
    assert_eq!(ready.reason, "SidecarsReady", "{ready:?}");
    let cov = st.baseline_sidecars.unwrap();
    assert_eq!((cov.pods, cov.injected, cov.ready), (2, 1, 1), "{cov:?}");
    assert_eq!(cov.without_sidecar[0].name, "orders-2");
    assert!(st.services.is_empty(), "a virtual workload deploys nothing");
    let sb = sandbox_status(&client, "ref")
        .await
        .unwrap()
        .status
        .unwrap();
    assert!(sb.virtual_workloads[0].ready, "{sb:?}");
    let sidecars = find_condition(&sb.conditions, "BaselineSidecars").unwrap();
    assert!(sidecars.message.contains("orders-2"), "{sidecars:?}");
    assert!(sb.forks.is_empty());

    // A baseline that does not exist: not ready, and the sandbox says what it waits for.
    let ghost = names::virtual_workload_name("ghost", "orders");
    eventually(
        "the ghost's VirtualWorkload to report its baseline missing",
        || async {
            let st = vws.get_opt(&ghost).await.unwrap()?.status?;
            let c = find_condition(&st.conditions, READY)?;
            (c.reason == "BaselineNotFound").then_some(())
        },
    )
    .await;
    eventually("the ghost sandbox to wait for it", || async {
        let st = sandbox_status(&client, "ghost").await?.status?;
        let c = find_condition(&st.conditions, READY)?;
        (c.status == "False" && c.message.contains(&ghost)).then_some(())
    })
    .await;

    for name in ["ref", "ghost"] {
        sandboxes
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
        all_gone(&client, name).await;
    }
    assert!(
        vws.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    cp.shutdown().await;
}

/// A consumer baseline (no Service) whose pods' sidecars relay Kafka (`kafka`: the pod
/// template's `sidecar.spur.dev/kafka-ports` is 9092), or not.
async fn consumer_baseline(client: &Client, name: &str, kafka: bool) {
    let mut template_meta = json!({"labels": {"app": name}});
    if kafka {
        template_meta["annotations"] = json!({"sidecar.spur.dev/kafka-ports": "9092"});
    }
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": template_meta,
                "spec": {"containers": [{"name": name, "image": format!("{name}:1")}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
}

fn unix_ms() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_millisecond()
}

/// Deleting a sandbox whose fork relays Kafka drains it: the end of its route is fixed once
/// (5 s ahead) and written into its span, and the fork stays 10 s past it before everything
/// goes; the route server keeps that end after the RoutingConfig is gone. A fork without Kafka
/// gets no span, and its sandbox goes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_sandbox_drains_its_kafka_forks() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    consumer_baseline(&client, "orders", true).await;
    consumer_baseline(&client, "mailer", false).await;
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    for (sb, baseline) in [("drain", "orders"), ("plain", "mailer")] {
        let fork = json!({"forkOf": {"kind": "Deployment", "namespace": NS, "name": baseline}});
        sandboxes
            .create(
                &PostParams::default(),
                &sandbox(sb, json!({}), json!([fork]), None),
            )
            .await
            .unwrap();
        mark_fork_ready(&client, sb, baseline).await;
        ready_key(&client, sb).await;
    }
    let rcs: Api<RoutingConfig> = Api::all(client.clone());
    let routed = |sb: &'static str| {
        let rcs = rcs.clone();
        async move {
            let rc = rcs
                .get_opt(&names::sandbox_routing_config_name(sb))
                .await
                .unwrap()?;
            let st = rc.status.clone()?;
            is_condition_true(&st.conditions, READY).then_some(rc)
        }
    };

    // Without Kafka: no span, and the sandbox goes without waiting.
    let plain = eventually("plain RoutingConfig Ready", || routed("plain")).await;
    assert!(plain.spans().is_empty(), "{:?}", plain.spans());
    let started = std::time::Instant::now();
    sandboxes
        .delete("plain", &DeleteParams::default())
        .await
        .unwrap();
    all_gone(&client, "plain").await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );

    // With Kafka: one span, open.
    let rc = eventually("a span for the Kafka fork", || async {
        let rc = routed("drain").await?;
        (!rc.spans().is_empty()).then_some(rc)
    })
    .await;
    assert_eq!(rc.spans().len(), 1);
    let since = rc.spans()[0].since_ms;
    assert_eq!(rc.spans()[0].until_ms, None);
    let baseline = BaselineWorkload {
        kind: "Deployment".into(),
        namespace: NS.into(),
        name: "orders".into(),
    };
    let history = cp.routeserver.as_ref().unwrap().index().history().clone();
    eventually("the route server has the span", || async {
        let spans = history.current().spans(&baseline);
        (spans.len() == 1 && spans[0].since_ms == since).then_some(())
    })
    .await;

    let deleted_at = unix_ms();
    sandboxes
        .delete("drain", &DeleteParams::default())
        .await
        .unwrap();
    let rc = eventually("the span's end written", || async {
        let rc = rcs
            .get_opt(&names::sandbox_routing_config_name("drain"))
            .await
            .unwrap()?;
        rc.spans().first()?.until_ms.is_some().then_some(rc)
    })
    .await;
    let seen_at = unix_ms();
    let until = rc.spans()[0].until_ms.unwrap();
    assert_eq!(rc.spans()[0].since_ms, since, "the start is kept");
    assert!(
        until >= deleted_at + 5_000 && until <= seen_at + 5_000,
        "until {until}, deleted at {deleted_at}, seen at {seen_at}"
    );
    assert_eq!(
        rc.annotations()["spur.dev/routes-end-ms"],
        until.to_string(),
        "the end is fixed on the RoutingConfig"
    );
    eventually("the route server ends the span there", || async {
        let spans = history.current().spans(&baseline);
        (spans.len() == 1 && spans[0].until_ms == Some(until)).then_some(())
    })
    .await;
    let st = sandbox_status(&client, "drain")
        .await
        .unwrap()
        .status
        .unwrap();
    let ready = find_condition(&st.conditions, READY).unwrap();
    assert_eq!(ready.reason, "Draining", "{ready:?}");

    // The fork stays until 10 s past the end (checked 2 s before).
    let fws: Api<ForkedWorkload> = Api::namespaced(client.clone(), NS);
    let fork_name = names::fork_name(
        "drain",
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "orders"),
    );
    let check_at = until + 8_000;
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(check_at - unix_ms()).unwrap_or(0),
    ))
    .await;
    let fw = fws.get_opt(&fork_name).await.unwrap().expect("fork kept");
    assert!(
        fw.metadata.deletion_timestamp.is_none(),
        "{:?}",
        fw.metadata
    );
    let d = Api::<Deployment>::namespaced(client.clone(), NS)
        .get(&fork_name)
        .await
        .unwrap();
    assert!(d.metadata.deletion_timestamp.is_none());

    // Then everything goes; the route server keeps the span's end (no second stamp).
    all_gone(&client, "drain").await;
    assert!(unix_ms() >= until + 10_000);
    // (The config had no request routes: give the route server's watch time to see it go.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spans = history.current().spans(&baseline);
    assert_eq!(spans.len(), 1, "{spans:?}");
    assert_eq!((spans[0].since_ms, spans[0].until_ms), (since, Some(until)));
    assert_eq!(
        cp.reconcile_failures(),
        0.0,
        "reconcile failures, see the log"
    );
    cp.shutdown().await;
}

/// A `valueFrom.fork` value follows the other baseline's Services in another namespace at once
/// (the ForkedWorkload watches what it renders from; the resync is 5 minutes): a new Service
/// there that sorts first becomes the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn value_from_fork_follows_another_namespaces_services() {
    let cp = ControlPlane::start().await;
    let client = cp.client();
    create_namespace(&client).await;
    kube_rbac::ensure_namespace(&client, "payments")
        .await
        .unwrap();
    for (ns, name) in [(NS, "web"), ("payments", "api")] {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": name, "image": format!("{name}:1")}]}}}
        }))
        .unwrap();
        Api::<Deployment>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &d)
            .await
            .unwrap();
    }
    let payments: Api<Service> = Api::namespaced(client.clone(), "payments");
    let service = |name: &str, port: i32| -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "payments"},
            "spec": {"selector": {"app": "api"}, "ports": [{"port": port}]}
        }))
        .unwrap()
    };
    payments
        .create(&PostParams::default(), &service("api", 8080))
        .await
        .unwrap();
    let api = json!({"kind": "Deployment", "namespace": "payments", "name": "api"});
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "xns"},
        "spec": {"forks": [
            {"forkOf": {"kind": "Deployment", "namespace": NS, "name": "web"},
             "customizations": {"env": [{"name": "API_URL", "valueFrom": {"fork": {
                 "forkOf": api, "expression": "http://{{.Service.Host}}:{{.Service.Port}}"}}}]}},
            {"forkOf": api}
        ]}
    }))
    .unwrap();
    Api::<Sandbox>::all(client.clone())
        .create(&PostParams::default(), &sb)
        .await
        .unwrap();
    let web_fork = names::fork_name(
        "xns",
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "web"),
    );
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let api_url = |want: String| {
        let deployments = deployments.clone();
        let web_fork = web_fork.clone();
        async move {
            let d = deployments.get_opt(&web_fork).await.ok()??;
            let env = d.spec?.template.spec?.containers[0].env.clone()?;
            let got = env.iter().find(|e| e.name == "API_URL")?.value.clone()?;
            (got == want).then_some(())
        }
    };
    let url = |svc: &str, port: i32| {
        format!(
            "http://{}.payments.svc:{port}",
            names::sandbox_service_name("xns", svc)
        )
    };
    eventually("the web fork's API_URL", || api_url(url("api", 8080))).await;
    // The passes the fork's own objects queued run first (each reads the Services afresh): the
    // ForkedWorkload's status written, then a quiet moment, so only a watch can bring what
    // follows.
    let fws: Api<ForkedWorkload> = Api::namespaced(client.clone(), NS);
    eventually("the web ForkedWorkload's status", || async {
        let st = fws.get_opt(&web_fork).await.ok()??.status?;
        st.fork.is_some().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // A Service that sorts before `api` now stands first for the api baseline.
    payments
        .create(&PostParams::default(), &service("a-api", 9090))
        .await
        .unwrap();
    eventually("API_URL to follow the other namespace's Services", || {
        api_url(url("a-api", 9090))
    })
    .await;
    cp.shutdown().await;
}
