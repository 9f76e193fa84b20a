//! Mesh modes on a real kube-apiserver, with Istio's and Gateway API's own CRDs (from their
//! published Go modules, fetched by tests/kube/build.sh): a Sandbox's routing key gets routes
//! ahead of the user's in their VirtualService and a derived HTTPRoute beside their HTTPRoute;
//! a pass that changes nothing writes nothing; a sandbox change reaches both; a user's edits of
//! their own routes survive, made before or during one; deleting the sandbox leaves the user's
//! objects exactly as they were. The operator runs under the chart's RBAC with both mesh rule files added.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use spur_api::conditions::{READY, is_condition_true};
use spur_api::keys::labels;
use spur_api::{
    GatewayAPIRoute, IstioRoute, RoutingConfig, Sandbox, WorkloadKind, WorkloadRef, names,
};
use spur_e2e::kube as kube_rbac;
use spur_e2e::kube::{WAIT, eventually};
use spur_kube_harness::KubeApi;
use tokio_util::sync::CancellationToken;

const NS: &str = "shop";

fn virtual_services() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("networking.istio.io", "v1", "VirtualService"),
        "virtualservices",
    )
}

fn http_routes() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    )
}

/// The CRDs named `names` from a multi-document YAML file of `mesh-crds/`.
fn mesh_crds(file: &std::path::Path, wanted: &[&str]) -> Vec<CustomResourceDefinition> {
    let text = std::fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("{}: {e} (tests/kube/build.sh fetches it)", file.display()));
    let crds: Vec<CustomResourceDefinition> = serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|doc| {
            let v =
                <serde_yaml_ng::Value as k8s_openapi::serde::Deserialize>::deserialize(doc).ok()?;
            serde_yaml_ng::from_value(v).ok()
        })
        .filter(|c: &CustomResourceDefinition| {
            wanted.contains(&c.metadata.name.as_deref().unwrap_or_default())
        })
        .collect();
    assert_eq!(crds.len(), wanted.len(), "{wanted:?} in {}", file.display());
    crds
}

struct ControlPlane {
    api: KubeApi,
    stop: CancellationToken,
    operator: tokio::task::JoinHandle<()>,
    registry: prometheus_client::registry::Registry,
}

impl ControlPlane {
    async fn start() -> ControlPlane {
        kube_rbac::capture_logs();
        let api = KubeApi::start().await.unwrap();
        kube_rbac::install_crds(&api).await.unwrap();
        let dir = spur_kube_harness::bin_dir()
            .await
            .unwrap()
            .join("mesh-crds");
        let istio = mesh_crds(
            &dir.join("istio.io_api/customresourcedefinitions.gen.yaml"),
            &["virtualservices.networking.istio.io"],
        );
        let gateway = mesh_crds(
            &dir.join("sigs.k8s.io_gateway-api/gateway.networking.k8s.io_httproutes.yaml"),
            &["httproutes.gateway.networking.k8s.io"],
        );
        api.install_crds(&[istio, gateway].concat()).await.unwrap();
        // The chart's operator rules plus what mesh.istio.enabled and mesh.gatewayAPI.enabled
        // add to its ClusterRole: a right the chart lacks fails this test.
        let client = kube_rbac::operator_client(&api).await.unwrap();
        for file in [
            "operator-mesh-istio-rules.yaml",
            "operator-mesh-gateway-api-rules.yaml",
        ] {
            kube_rbac::grant_cluster(&api, "spur-operator", file)
                .await
                .unwrap();
        }
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = spur_operator::Metrics::register(&mut registry);
        let ctx = Arc::new(
            spur_operator::Context::new(client.clone(), Some("test".into()), metrics).with_mesh(
                spur_operator::MeshConfig {
                    istio: true,
                    gateway_api: true,
                    cluster_domain: "cluster.local".into(),
                    // The chart's routingKeys.customHeaders, as the operator binary passes them.
                    routing_keys: spur_api::carriers::ExtractConfig {
                        custom_headers: vec!["x-route-to".into()],
                        query_param: None,
                    },
                },
            ),
        );
        let stop = CancellationToken::new();
        let operator = tokio::spawn(spur_operator::run(client, ctx, stop.clone()));
        ControlPlane {
            api,
            stop,
            operator,
            registry,
        }
    }

    fn reconcile_failures(&self) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        spur_e2e::sample(&text, "reconcile_failures_total")
    }

    async fn shutdown(mut self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, &mut self.operator)
            .await
            .unwrap()
            .unwrap();
    }
}

/// The baseline: Deployment `web` and Service `web` (port 80 → container port 8080).
async fn baseline(client: &Client) {
    // Labelled: Spur may write in it (the enroller binds the operator's rights there).
    let ns: Namespace = serde_json::from_value(json!({"metadata": {
        "name": NS, "labels": {(kube_rbac::ENABLED_LABEL): "true"}}}))
    .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    kube_rbac::wait_enrolled(client, NS).await.unwrap();
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "web:1", "ports": [
                    {"name": "http", "containerPort": 8080},
                    {"name": "admin", "containerPort": 9090}
                ]}]}
            }
        }
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": NS},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
}

/// Plays kubelet and Deployment controller for the fork of `web`.
async fn mark_fork_ready(client: &Client, sandbox: &str) {
    let fork = names::fork_name(
        sandbox,
        &WorkloadRef::new(WorkloadKind::Deployment, NS, "web"),
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
}

fn user_routes() -> Value {
    json!([
        {"name": "v2", "match": [{"uri": {"prefix": "/v2"}}],
         "route": [{"destination": {"host": "web", "port": {"number": 80}}, "weight": 100}]},
        {"name": "default", "route": [{"destination": {"host": "web.shop.svc.cluster.local"}}]}
    ])
}

async fn get_dyn(client: &Client, ar: &ApiResource, name: &str) -> DynamicObject {
    Api::<DynamicObject>::namespaced_with(client.clone(), NS, ar)
        .get(name)
        .await
        .unwrap()
}

fn http_of(vs: &DynamicObject) -> Vec<Value> {
    vs.data["spec"]["http"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn route_names(vs: &DynamicObject) -> Vec<String> {
    http_of(vs)
        .iter()
        .map(|r| r["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

async fn mesh_route<K>(client: &Client) -> K
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::de::DeserializeOwned,
{
    let lp = ListParams::default().labels(&format!("{}=sb1", labels::SANDBOX));
    eventually(&format!("one {}", K::kind(&())), || async {
        let mut items = Api::<K>::all(client.clone()).list(&lp).await.unwrap().items;
        (items.len() == 1).then(|| items.remove(0))
    })
    .await
}

/// Spur's routes in the VirtualService, once they are `want` (names, in order).
async fn vs_routes(client: &Client, want: &[String]) -> DynamicObject {
    let mut last = Vec::new();
    let found = tokio::time::timeout(WAIT, async {
        loop {
            let vs = get_dyn(client, &virtual_services(), "web").await;
            last = route_names(&vs);
            if last == want {
                return vs;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("VirtualService routes: want {want:?}, have {last:?}"))
}

/// The derived HTTPRoutes of the sandbox, by name, once there are `n`.
async fn derived(client: &Client, n: usize) -> Vec<DynamicObject> {
    let lp = ListParams::default().labels(&format!("{}=sb1", labels::SANDBOX));
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), NS, &http_routes());
    eventually(&format!("{n} derived HTTPRoute(s)"), || async {
        let mut items = api.list(&lp).await.unwrap().items;
        items.sort_by_key(ResourceExt::name_any);
        (items.len() == n).then_some(items)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_routes_follow_the_sandbox_and_leave_the_users_routes_alone() {
    let cp = ControlPlane::start().await;
    let client = cp.api.client();
    baseline(&client).await;

    // The user's mesh objects: a VirtualService for web with two routes of their own, one that
    // names another Service (never touched), and an HTTPRoute sending /api to web:80.
    let vs_api = Api::<DynamicObject>::namespaced_with(client.clone(), NS, &virtual_services());
    for (name, host, http) in [
        ("web", "web", user_routes()),
        (
            "other",
            "other.shop.svc.cluster.local",
            json!([{"name": "default", "route": [{"destination": {"host": "other"}}]}]),
        ),
    ] {
        let vs: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"hosts": [host], "http": http}
        }))
        .unwrap();
        vs_api.create(&PostParams::default(), &vs).await.unwrap();
    }
    let other_rv = get_dyn(&client, &virtual_services(), "other")
        .await
        .resource_version();
    let hr_api = Api::<DynamicObject>::namespaced_with(client.clone(), NS, &http_routes());
    let user_hr: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "shop", "namespace": NS},
        "spec": {
            "parentRefs": [{"name": "gateway", "namespace": "infra"}],
            "hostnames": ["shop.example.com"],
            "rules": [
                {"matches": [{"path": {"type": "PathPrefix", "value": "/api"}}],
                 "backendRefs": [{"name": "web", "port": 80}]},
                {"matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}],
                 "backendRefs": [{"name": "web", "port": 9090}]}
            ]
        }
    }))
    .unwrap();
    let user_hr = hr_api
        .create(&PostParams::default(), &user_hr)
        .await
        .unwrap();

    // A sandbox forking web.
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "sb1"},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": NS, "name": "web"}}]}
    }))
    .unwrap();
    Api::<Sandbox>::all(client.clone())
        .create(&PostParams::default(), &sb)
        .await
        .unwrap();
    mark_fork_ready(&client, "sb1").await;
    let key = eventually("Sandbox sb1 Ready", || async {
        let sb = Api::<Sandbox>::all(client.clone()).get("sb1").await.ok()?;
        let st = sb.status?;
        is_condition_true(&st.conditions, READY).then_some(st.routing_key?)
    })
    .await;
    let sandbox_svc = names::sandbox_service_name("sb1", "web");

    // Istio: one route for port 80 ahead of the user's two, matching the port and each key
    // carrier, sending to the sandbox Service; the user's routes exactly as they wrote them.
    let ir: IstioRoute = mesh_route(&client).await;
    assert_eq!(ir.spec.routing_key, key);
    assert_eq!(ir.spec.target_service.name, "web");
    assert_eq!(ir.owner_references()[0].kind, "RoutingConfig");
    let spur80 = format!("spur.{}.80", ir.name_any());
    let vs = vs_routes(&client, &[spur80.clone(), "v2".into(), "default".into()]).await;
    let http = http_of(&vs);
    assert_eq!(&http[1..], user_routes().as_array().unwrap().as_slice());
    let ours = &http[0];
    assert_eq!(
        ours["route"],
        json!([{"destination": {"host": format!("{sandbox_svc}.{NS}.svc.cluster.local"), "port": {"number": 80}}}])
    );
    // The cluster's custom header first, then the standard carriers.
    let matches = ours["match"].as_array().unwrap();
    assert_eq!(matches.len(), 11, "{matches:?}");
    assert!(matches.iter().all(|m| m["port"] == 80));
    assert_eq!(matches[0]["headers"]["x-route-to"]["exact"], json!(key));
    assert!(
        matches[1]["headers"]["baggage"]["regex"]
            .as_str()
            .unwrap()
            .contains(&key)
    );
    assert_eq!(
        matches[3]["headers"]["ot-baggage-sd-routing-key"]["exact"],
        json!(key)
    );
    let ir = eventually("IstioRoute Ready", || async {
        let ir = Api::<IstioRoute>::all(client.clone())
            .get(&ir.name_any())
            .await
            .ok()?;
        let st = ir.status.clone()?;
        is_condition_true(&st.conditions, READY).then_some(ir)
    })
    .await;
    let matched = &ir.status.as_ref().unwrap().matched_objects;
    assert_eq!(matched.len(), 1, "{matched:?}");
    assert_eq!(
        (matched[0].kind.as_str(), matched[0].name.as_str()),
        ("VirtualService", "web")
    );

    // Gateway API: a derived route for port 80 (the /admin rule sends to 9090, which the
    // sandbox Service does not have yet): the user's parents and hostnames, /api AND-ed with
    // one carrier per match, to the sandbox Service.
    let gr: GatewayAPIRoute = mesh_route(&client).await;
    let d = derived(&client, 1).await.remove(0);
    assert_eq!(d.owner_references()[0].name, gr.name_any());
    assert_eq!(
        d.data["spec"]["parentRefs"],
        user_hr.data["spec"]["parentRefs"]
    );
    assert_eq!(d.data["spec"]["hostnames"], json!(["shop.example.com"]));
    let rules = d.data["spec"]["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 1);
    let backends = rules[0]["backendRefs"].as_array().unwrap();
    assert_eq!(backends.len(), 1);
    assert_eq!(backends[0]["name"], json!(sandbox_svc));
    assert_eq!(backends[0]["port"], 80);
    let matches = rules[0]["matches"].as_array().unwrap();
    assert_eq!(matches.len(), 11);
    for m in matches {
        assert_eq!(m["path"], json!({"type": "PathPrefix", "value": "/api"}));
        assert_eq!(m["headers"].as_array().unwrap().len(), 1);
    }
    assert_eq!(
        matches[0]["headers"][0],
        json!({"type": "Exact", "name": "x-route-to", "value": key})
    );
    assert_eq!(matches[1]["headers"][0]["type"], "RegularExpression");
    assert_eq!(matches[1]["headers"][0]["name"], "baggage");
    assert_eq!(matches[4]["headers"][0]["type"], "Exact");
    assert_eq!(matches[4]["headers"][0]["value"], json!(key));

    // Idempotent: passes forced on the RoutingConfig and both mesh routes write nothing.
    let rvs = |vs: &DynamicObject, d: &DynamicObject| (vs.resource_version(), d.resource_version());
    let before = rvs(&vs, &d);
    let rc_name = names::sandbox_routing_config_name("sb1");
    let poke = json!({"metadata": {"annotations": {"spur.dev/reconcile": "1"}}});
    Api::<RoutingConfig>::all(client.clone())
        .patch(&rc_name, &PatchParams::default(), &Patch::Merge(&poke))
        .await
        .unwrap();
    Api::<IstioRoute>::all(client.clone())
        .patch(
            &ir.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&poke),
        )
        .await
        .unwrap();
    Api::<GatewayAPIRoute>::all(client.clone())
        .patch(
            &gr.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&poke),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let vs = get_dyn(&client, &virtual_services(), "web").await;
    let d = derived(&client, 1).await.remove(0);
    assert_eq!(rvs(&vs, &d), before, "a pass that changes nothing wrote");

    // The user edits their own routes while Spur's are there (as `kubectl edit` would: the
    // whole list back, with Spur's route in it): a timeout on v2 and a new route of theirs.
    let mut edited = http_of(&vs);
    edited[1]["timeout"] = json!("5s");
    edited.insert(
        2,
        json!({"name": "canary", "match": [{"headers": {"x-canary": {"exact": "1"}}}],
               "route": [{"destination": {"host": "web-canary"}}]}),
    );
    vs_api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"http": edited}})),
        )
        .await
        .unwrap();
    let users_now: Vec<Value> = edited[1..].to_vec();

    // The sandbox changes: the baseline Service gains port 9090, so does the sandbox Service,
    // and with it the routes: a second Spur route in the VirtualService, a second derived
    // HTTPRoute for the /admin rule.
    Api::<Service>::namespaced(client.clone(), NS)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ports": [
                {"name": "http", "port": 80, "targetPort": "http"},
                {"name": "admin", "port": 9090, "targetPort": "admin"}
            ]}})),
        )
        .await
        .unwrap();
    let spur9090 = format!("spur.{}.9090", ir.name_any());
    let vs = vs_routes(
        &client,
        &[
            spur80.clone(),
            spur9090,
            "v2".into(),
            "canary".into(),
            "default".into(),
        ],
    )
    .await;
    assert_eq!(
        &http_of(&vs)[2..],
        users_now.as_slice(),
        "the user's edit survives"
    );
    let ds = derived(&client, 2).await;
    let ports: Vec<&Value> = ds
        .iter()
        .map(|d| &d.data["spec"]["rules"][0]["backendRefs"][0]["port"])
        .collect();
    assert!(
        ports.contains(&&json!(80)) && ports.contains(&&json!(9090)),
        "{ports:?}"
    );

    // Truly at once: the user keeps editing their own route (forty read-modify-writes of the
    // whole list, as `kubectl edit` does) while the Service loses port 9090 again. Whatever
    // interleaving the two writers get, the user's last edit is there in the end, and Spur's
    // routes are what the sandbox now wants.
    let editor = {
        let vs_api = vs_api.clone();
        tokio::spawn(async move {
            // Istio's schema wants a timeout over 1 ms.
            for i in 1..=40 {
                let vs = vs_api.get("web").await.unwrap();
                let mut http = http_of(&vs);
                for r in &mut http {
                    if r["name"] == "default" {
                        r["timeout"] = json!(format!("{i}s"));
                    }
                }
                vs_api
                    .patch(
                        "web",
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"http": http}})),
                    )
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    Api::<Service>::namespaced(client.clone(), NS)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ports": [
                {"name": "http", "port": 80, "targetPort": "http"}
            ]}})),
        )
        .await
        .unwrap();
    editor.await.unwrap();
    let mut users_now = users_now;
    users_now[2]["timeout"] = json!("40s");
    let vs = vs_routes(
        &client,
        &[
            spur80.clone(),
            "v2".into(),
            "canary".into(),
            "default".into(),
        ],
    )
    .await;
    assert_eq!(
        &http_of(&vs)[1..],
        users_now.as_slice(),
        "the user's concurrent edits survive"
    );
    derived(&client, 1).await;

    // A user's apply that drops Spur's routes (theirs is the whole list) gets them back,
    // ahead of the user's, which stay as applied.
    vs_api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"http": users_now}})),
        )
        .await
        .unwrap();
    let vs = eventually("Spur's routes restored", || async {
        let vs = get_dyn(&client, &virtual_services(), "web").await;
        (http_of(&vs).len() == 4).then_some(vs)
    })
    .await;
    assert_eq!(&http_of(&vs)[1..], users_now.as_slice());

    // The namespace names carriers of its own (docs/routing-keys.md): a query parameter in
    // place of the cluster's none, a header besides the cluster's. The namespace watch brings
    // them to both mesh routes, the query parameter first, as the sidecars read it.
    Api::<Namespace>::all(client.clone())
        .patch(
            NS,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "sidecar.spur.dev/routing-headers": "X-Team",
                "sidecar.spur.dev/query-param": "q-key",
            }}})),
        )
        .await
        .unwrap();
    let first = eventually("the namespace's carriers in the VirtualService", || async {
        let vs = get_dyn(&client, &virtual_services(), "web").await;
        let ours = http_of(&vs).into_iter().next()?;
        let m = ours["match"].as_array()?.clone();
        (m.len() == 13).then_some(m)
    })
    .await;
    assert_eq!(
        first[0],
        json!({"port": 80, "queryParams": {"q-key": {"exact": key}}})
    );
    assert_eq!(first[1]["headers"]["x-route-to"]["exact"], json!(key));
    assert_eq!(first[2]["headers"]["x-team"]["exact"], json!(key));
    let d = eventually(
        "the namespace's carriers in the derived HTTPRoute",
        || async {
            let d = derived(&client, 1).await.remove(0);
            (d.data["spec"]["rules"][0]["matches"].as_array()?.len() == 13).then_some(d)
        },
    )
    .await;
    let m = &d.data["spec"]["rules"][0]["matches"];
    assert_eq!(
        m[0]["queryParams"],
        json!([{"type": "Exact", "name": "q-key", "value": key}])
    );
    assert_eq!(m[2]["headers"][0]["name"], "x-team");

    // The sandbox goes: so do its mesh routes, Spur's VirtualService routes and the derived
    // HTTPRoutes; the user's objects are as they left them, the other VirtualService and the
    // user's HTTPRoute never written at all.
    Api::<Sandbox>::all(client.clone())
        .delete("sb1", &DeleteParams::default())
        .await
        .unwrap();
    let vs = vs_routes(&client, &["v2".into(), "canary".into(), "default".into()]).await;
    assert_eq!(
        vs.data["spec"],
        json!({"hosts": ["web"], "http": users_now}),
        "the user's VirtualService, byte for byte"
    );
    derived(&client, 0).await;
    eventually("mesh routes and RoutingConfig gone", || async {
        let irs = Api::<IstioRoute>::all(client.clone())
            .list(&ListParams::default())
            .await
            .unwrap();
        let grs = Api::<GatewayAPIRoute>::all(client.clone())
            .list(&ListParams::default())
            .await
            .unwrap();
        let rc = Api::<RoutingConfig>::all(client.clone())
            .get_opt(&rc_name)
            .await
            .unwrap();
        (irs.items.is_empty() && grs.items.is_empty() && rc.is_none()).then_some(())
    })
    .await;
    let other = get_dyn(&client, &virtual_services(), "other").await;
    assert_eq!(other.resource_version(), other_rv);
    let hr = get_dyn(&client, &http_routes(), "shop").await;
    assert_eq!(hr.resource_version(), user_hr.resource_version());
    assert_eq!(
        cp.reconcile_failures(),
        0.0,
        "reconcile failures, see the log"
    );
    cp.shutdown().await;
}
