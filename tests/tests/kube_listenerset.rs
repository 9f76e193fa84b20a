//! ListenerSet against a real kube-apiserver, the operator under the chart's RBAC: the client
//! Service and the endpoint Services appear as the spec says (ports, protocols, selectors,
//! owner references), status follows the EndpointSlices of the endpoint Services (made by hand
//! as the EndpointSlice controller would: there is no kube-controller-manager here), an entry
//! the route server writes into `status.gateways` under its own field manager survives the
//! operator's status writes, a changed spec deletes what it no longer asks for, an invalid spec
//! (admission is not installed here) is reported as `Ready=False Invalid`, and a Service of the
//! same name that is not the set's is never taken over.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use spur_api::ListenerSet;
use spur_api::listenerset::{LISTENER_SET_LABEL, endpoint_service_name};
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;
use tokio_util::sync::CancellationToken;

const NS: &str = "media";
/// The field manager a route server replica's gateway reports are written under.
const GATEWAY_MANAGER: &str = "spur-routeserver/gateway-0";

fn spec() -> Value {
    json!({
        "selector": {"matchLabels": {"app": "gw"}},
        "listeners": [
            {"name": "rtp", "protocol": "udp", "port": 5000,
             "cluster": {"name": "media", "lb": "maglev",
                         "hashKey": {"firstBytes": {"offset": 8, "length": 4}},
                         "endpoints": [{"selector": {"matchLabels": {"app": "media"}}, "port": 6000}]},
             "keyRoute": {"routes": [{"sandbox": "alice", "cluster": "media-sbx"}]}},
            {"name": "sip", "protocol": "tcp", "port": 5060,
             "cluster": {"name": "sip", "endpoints": [
                 {"address": "10.0.0.9", "port": 5060},
                 {"dnsName": "sip.example.com", "port": 5060}]}}
        ],
        "clusters": [
            {"name": "media-sbx", "endpoints": [{"selector": {"matchLabels": {"app": "media", "fork": "alice"}}, "port": 6001}]}
        ]
    })
}

async fn apply(client: &Client, name: &str, spec: Value) {
    let api: Api<ListenerSet> = Api::namespaced(client.clone(), NS);
    let body = json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
        "metadata": {"name": name}, "spec": spec,
    });
    api.patch(
        name,
        &PatchParams::apply("spur-tests").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap();
}

async fn status(client: &Client, name: &str) -> Value {
    let api: Api<ListenerSet> = Api::namespaced(client.clone(), NS);
    let ls = api.get(name).await.unwrap();
    serde_json::to_value(ls.status).unwrap()
}

fn condition<'a>(st: &'a Value, type_: &str) -> &'a Value {
    st["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

/// `(endpoints, ready)` of listener `name` in status.
fn counts(st: &Value, name: &str) -> Option<(u64, u64)> {
    let l = st["listeners"]
        .as_array()?
        .iter()
        .find(|l| l["name"] == name)?;
    Some((l["endpoints"].as_u64()?, l["ready"].as_u64()?))
}

/// Waits until the status of set `name` satisfies `check`; returns it, or fails showing the
/// last status seen.
async fn status_where(
    client: &Client,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + kt::WAIT;
    loop {
        let st = status(client, name).await;
        if check(&st) {
            return st;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; last status: {st:#}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

async fn service(client: &Client, name: &str) -> Option<Value> {
    let api: Api<Service> = Api::namespaced(client.clone(), NS);
    api.get_opt(name)
        .await
        .unwrap()
        .map(|s| serde_json::to_value(s).unwrap())
}

/// An EndpointSlice of Service `svc` as the EndpointSlice controller writes one: pods by
/// address, each with its readiness and a reference to the pod.
fn slice(svc: &str, suffix: &str, port: u16, pods: &[(&str, &str, bool)]) -> EndpointSlice {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|(pod, ip, ready)| {
            json!({"addresses": [ip], "conditions": {"ready": ready},
                   "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}})
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{svc}-{suffix}"), "namespace": NS, "labels": {
            "kubernetes.io/service-name": svc,
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "endpoint", "port": port, "protocol": "UDP"}],
        "endpoints": endpoints,
    }))
    .unwrap()
}

fn assert_owned_by(svc: &Value, set: &Value) {
    let owners = svc["metadata"]["ownerReferences"].as_array().unwrap();
    assert_eq!(owners.len(), 1, "{svc:#}");
    let o = &owners[0];
    assert_eq!(o["kind"], "ListenerSet");
    assert_eq!(o["apiVersion"], "spur.dev/v1alpha1");
    assert_eq!(o["name"], set["metadata"]["name"]);
    assert_eq!(o["uid"], set["metadata"]["uid"]);
    assert_eq!(o["controller"], true);
    assert_eq!(
        svc["metadata"]["labels"][LISTENER_SET_LABEL],
        set["metadata"]["name"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_sets_get_their_services_and_a_status_that_follows_the_endpoints() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    kt::ensure_namespace(&admin, NS).await.unwrap();
    let stop = CancellationToken::new();
    let _stop_all = stop.clone().drop_guard();
    let operator_client = kt::operator_client(&api).await.unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = spur_operator::Metrics::register(&mut registry);
    let ctx = std::sync::Arc::new(spur_operator::Context::new(
        operator_client.clone(),
        Some("test".into()),
        metrics,
    ));
    // As `spur-operator --no-leader-elect` runs it: the only replica, which says it leads
    // (SpurOperatorNoLeader would fire on a 0).
    let operator = tokio::spawn(spur_operator::run_as(
        operator_client,
        ctx,
        stop.clone(),
        None,
    ));
    eventually("the only replica to report itself leader", || async {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text.lines().any(|l| l == "leader 1").then_some(())
    })
    .await;

    // The client Service and one headless Service per selector endpoint, all owned by the set.
    apply(&admin, "media", spec()).await;
    let sets: Api<ListenerSet> = Api::namespaced(admin.clone(), NS);
    let set = serde_json::to_value(sets.get("media").await.unwrap()).unwrap();
    let svc = eventually("the client Service", || service(&admin, "media")).await;
    assert_eq!(svc["spec"]["type"], "ClusterIP", "{svc:#}");
    assert_eq!(svc["spec"]["selector"], json!({"app": "gw"}), "{svc:#}");
    assert_eq!(
        svc["spec"]["ports"],
        json!([
            {"name": "rtp", "protocol": "UDP", "port": 5000, "targetPort": 5000},
            {"name": "sip", "protocol": "TCP", "port": 5060, "targetPort": 5060}
        ]),
        "{svc:#}"
    );
    assert_owned_by(&svc, &set);
    let media_svc = endpoint_service_name("media", "media", 0);
    let sbx_svc = endpoint_service_name("media", "media-sbx", 0);
    for (name, selector, port) in [
        (&media_svc, json!({"app": "media"}), 6000),
        (&sbx_svc, json!({"app": "media", "fork": "alice"}), 6001),
    ] {
        let svc = eventually("an endpoint Service", || service(&admin, name)).await;
        assert_eq!(svc["spec"]["clusterIP"], "None", "{svc:#}");
        assert_eq!(svc["spec"]["selector"], selector, "{svc:#}");
        assert_eq!(
            svc["spec"]["ports"],
            json!([{"name": "endpoint", "protocol": "UDP", "port": port, "targetPort": port}]),
            "{svc:#}"
        );
        assert_owned_by(&svc, &set);
    }

    // No pod yet: the rtp listener's cluster has no endpoint; the address and the DNS name of
    // sip count as ready.
    let st = status_where(&admin, "media", "the first status", |st| {
        counts(st, "rtp") == Some((0, 0)) && counts(st, "sip") == Some((2, 2))
    })
    .await;
    assert_eq!(st["observedGeneration"], 1, "{st:#}");
    assert_eq!(st["listenerCount"], 2, "{st:#}");
    assert_eq!(condition(&st, "Ready")["status"], "True", "{st:#}");
    let endpoints_ready = condition(&st, "EndpointsReady");
    assert_eq!(endpoints_ready["status"], "False", "{st:#}");
    assert_eq!(endpoints_ready["reason"], "NoReadyEndpoints", "{st:#}");
    assert!(
        endpoints_ready["message"]
            .as_str()
            .unwrap()
            .contains("cluster media"),
        "{st:#}"
    );

    // A route server replica reports what gateway-0's health checks see, under its own field
    // manager, as the route server does.
    let gateway = json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ListenerSet",
        "status": {"gateways": [{"pod": "gateway-0", "updatedAt": "2026-01-01T00:00:00Z",
            "endpoints": [{"cluster": "sip", "id": "10.0.0.9", "address": "10.0.0.9:5060", "healthy": true}]}]}
    });
    sets.patch_status(
        "media",
        &PatchParams::apply(GATEWAY_MANAGER),
        &Patch::Apply(&gateway),
    )
    .await
    .unwrap();

    // Pods come (one ready, one not): the slice of the endpoint Service changes the status.
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), NS);
    let first = slice(
        &media_svc,
        "a",
        6000,
        &[
            ("media-0", "10.1.0.1", true),
            ("media-1", "10.1.0.2", false),
        ],
    );
    slices.create(&PostParams::default(), &first).await.unwrap();
    let st = status_where(&admin, "media", "the pods in status", |st| {
        counts(st, "rtp") == Some((2, 1)) && condition(st, "EndpointsReady")["status"] == "True"
    })
    .await;
    // Written by the operator since the report: the report is still there.
    assert_eq!(st["gateways"][0]["pod"], "gateway-0", "{st:#}");
    assert_eq!(st["gateways"][0]["endpoints"][0]["healthy"], true, "{st:#}");
    // Readiness changes and a second slice (a pod seen in two slices counts once).
    let second = slice(
        &media_svc,
        "b",
        6000,
        &[("media-1", "10.1.0.2", true), ("media-2", "10.1.0.3", true)],
    );
    slices
        .create(&PostParams::default(), &second)
        .await
        .unwrap();
    status_where(&admin, "media", "three pods, all ready", |st| {
        counts(st, "rtp") == Some((3, 3))
    })
    .await;
    // Pods go: both slices deleted.
    for s in [&first, &second] {
        slices
            .delete(&s.name_any(), &DeleteParams::default())
            .await
            .unwrap();
    }
    let st = status_where(&admin, "media", "no pod left", |st| {
        counts(st, "rtp") == Some((0, 0)) && condition(st, "EndpointsReady")["status"] == "False"
    })
    .await;
    assert_eq!(st["gateways"][0]["pod"], "gateway-0", "{st:#}");

    // An endpoint Service deleted behind the operator's back comes back.
    let services: Api<Service> = Api::namespaced(admin.clone(), NS);
    let uid = services.get(&media_svc).await.unwrap().uid();
    services
        .delete(&media_svc, &DeleteParams::default())
        .await
        .unwrap();
    eventually("the endpoint Service made again", || async {
        let s = services.get_opt(&media_svc).await.unwrap()?;
        (s.uid() != uid).then_some(())
    })
    .await;

    // The key route and its cluster go: its endpoint Service is deleted, the rest stays.
    let mut less = spec();
    less["listeners"][0]
        .as_object_mut()
        .unwrap()
        .remove("keyRoute");
    less.as_object_mut().unwrap().remove("clusters");
    apply(&admin, "media", less.clone()).await;
    eventually("the stale endpoint Service deleted", || async {
        service(&admin, &sbx_svc).await.is_none().then_some(())
    })
    .await;
    assert!(service(&admin, &media_svc).await.is_some());
    assert!(service(&admin, "media").await.is_some());
    let st = status_where(&admin, "media", "generation 2 observed", |st| {
        st["observedGeneration"] == 2
    })
    .await;
    assert_eq!(st["gateways"][0]["pod"], "gateway-0", "{st:#}");
    // The report's fields are still the route server's own.
    let managers: Vec<String> = sets
        .get("media")
        .await
        .unwrap()
        .managed_fields()
        .iter()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(
        managers.contains(&GATEWAY_MANAGER.to_string())
            && managers.contains(&spur_operator::FIELD_MANAGER.to_string()),
        "{managers:?}"
    );

    // No Service wanted: the one the operator made goes.
    less["service"] = json!({"type": "None"});
    apply(&admin, "media", less).await;
    eventually("the client Service deleted", || async {
        service(&admin, "media").await.is_none().then_some(())
    })
    .await;
    assert!(service(&admin, &media_svc).await.is_some());

    // Invalid (admission is not installed here): two UDP listeners on one port. Reported, and
    // nothing is made for it.
    let mut broken = spec();
    broken["listeners"][1]["protocol"] = json!("udp");
    broken["listeners"][1]["port"] = json!(5000);
    apply(&admin, "broken", broken).await;
    let st = status_where(&admin, "broken", "Ready=False Invalid", |st| {
        condition(st, "Ready")["reason"] == "Invalid"
    })
    .await;
    let ready = condition(&st, "Ready");
    assert_eq!(ready["status"], "False", "{st:#}");
    assert!(
        ready["message"].as_str().unwrap().contains(
            "spec.listeners[1].port: udp port 5000 is already taken by spec.listeners[0]"
        ),
        "{st:#}"
    );
    assert!(service(&admin, "broken").await.is_none());
    assert!(
        service(&admin, &endpoint_service_name("broken", "media", 0))
            .await
            .is_none()
    );

    // A Service of the set's name that is someone else's is left alone.
    let theirs: Service = serde_json::from_value(json!({
        "metadata": {"name": "taken", "namespace": NS},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    apply(&admin, "taken", spec()).await;
    let st = status_where(&admin, "taken", "Ready=False ServiceConflict", |st| {
        condition(st, "Ready")["reason"] == "ServiceConflict"
    })
    .await;
    assert!(
        condition(&st, "Ready")["message"]
            .as_str()
            .unwrap()
            .contains("Service taken exists and is not this ListenerSet's"),
        "{st:#}"
    );
    let svc = service(&admin, "taken").await.unwrap();
    assert_eq!(svc["spec"]["selector"], json!({"app": "theirs"}), "{svc:#}");
    assert!(svc["metadata"]["ownerReferences"].is_null(), "{svc:#}");

    stop.cancel();
    tokio::time::timeout(kt::WAIT, operator)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
