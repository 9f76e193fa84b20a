//! Who may publish a preview (issue 42, point 3), against a real kube-apiserver with the chart's
//! policies (charts/spur/files/preview-admission-policy.yaml): an endpoint's target must be an
//! in-cluster Service in a namespace whose Services its creator may reach (`get` on
//! `services/proxy`); `cluster:` and `public` are RBAC verbs of their own. A developer with
//! rights only in namespace `a` cannot publish `b`'s Services, any outside address, another
//! cluster or a public preview, through a Sandbox or a RouteGroup, on create or on update.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use spur_api::{RouteGroup, Sandbox};
use spur_e2e::kube::{self as kt, eventually};
use spur_kube_harness::KubeApi;

fn sandbox(name: &str, endpoints: Value) -> Sandbox {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        // A fork (of namespace a; the creator-rights policy is not under test here) because a
        // sandbox needs a workload.
        "spec": {
            "forks": [{"forkOf": {"kind": "Deployment", "namespace": "a", "name": "app"}}],
            "defaultRouteGroup": {"endpoints": endpoints},
        }
    }))
    .unwrap()
}

fn route_group(name: &str, endpoints: Value) -> RouteGroup {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "RouteGroup",
        "metadata": {"name": name},
        "spec": {"match": {"label": {"key": "team", "value": "*"}}, "endpoints": endpoints}
    }))
    .unwrap()
}

fn ep(target: &str) -> Value {
    json!([{"name": "web", "target": target}])
}

/// The namespaces a refusal says it checked.
fn names_checked(message: &str) -> Vec<&str> {
    message
        .split("lacks it in one of: ")
        .nth(1)
        .map(|rest| rest.split(", ").collect())
        .unwrap_or_default()
}

/// The refusal's message, or a panic naming what was accepted.
fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) -> String {
    match r {
        Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => e.message,
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previews_reach_only_what_their_creator_may_reach() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    for ns in ["a", "b"] {
        kt::ensure_namespace(&admin, ns).await.unwrap();
    }
    let text =
        std::fs::read_to_string(kt::chart_path("files/preview-admission-policy.yaml")).unwrap();
    let docs: Vec<&str> = text.split("\n---\n").collect();
    assert_eq!(docs.len(), 4, "two policies and their bindings");
    for pair in docs.chunks(2) {
        let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(pair[0]).unwrap();
        let binding: ValidatingAdmissionPolicyBinding = serde_yaml_ng::from_str(pair[1]).unwrap();
        Api::<ValidatingAdmissionPolicy>::all(admin.clone())
            .create(&PostParams::default(), &policy)
            .await
            .unwrap();
        Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    // The developer: Sandboxes and RouteGroups anywhere (cluster-scoped), and the right to reach
    // Services of namespace `a` only.
    kt::grant_dev(
        &admin,
        "dev-previews",
        json!([{"apiGroups": ["spur.dev"], "resources": ["sandboxes", "routegroups"],
                "verbs": ["create", "get", "update", "patch", "delete"]}]),
    )
    .await
    .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "rules": [{"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["get"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev", "namespace": "a"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dev"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": kt::SYSTEM_NAMESPACE}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), "a")
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
    let token = api
        .service_account_token(kt::SYSTEM_NAMESPACE, "dev")
        .await
        .unwrap();
    let dev_client = api.client_with_token(&token).await.unwrap();
    let dev: Api<Sandbox> = Api::all(dev_client.clone());
    let dev_rg: Api<RouteGroup> = Api::all(dev_client);
    let admin_sb: Api<Sandbox> = Api::all(admin.clone());

    // A sandbox with nothing but a preview of namespace b's Service: refused (the policy may
    // take a moment to be in force; anything created before is undone and tried again).
    let message = eventually("the preview policy to refuse", || {
        let (dev, admin_sb) = (dev.clone(), admin_sb.clone());
        async move {
            match dev
                .create(
                    &PostParams::default(),
                    &sandbox("p1", ep("http://web.b.svc:80")),
                )
                .await
            {
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => Some(e.message),
                Ok(_) => {
                    admin_sb.delete("p1", &DeleteParams::default()).await.ok();
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await;
    assert!(
        message.contains("services/proxy") && message.contains("lacks it in one of: b"),
        "{message}"
    );
    let pp = PostParams::default();
    // The same in every spelling of the name, and among endpoints of `a`.
    for (name, endpoints) in [
        ("p2", ep("https://web.b.svc.cluster.local:8443")),
        ("p3", ep("grpc://WEB.B.SVC:9090")),
        (
            "p4",
            json!([{"name": "ok", "target": "http://web.a.svc:80"},
                   {"name": "no", "target": "http://web.b.svc:80"}]),
        ),
    ] {
        let m = refused(name, dev.create(&pp, &sandbox(name, endpoints)).await);
        assert!(names_checked(&m).contains(&"b"), "{name}: {m}");
        assert!(admin_sb.get_opt(name).await.unwrap().is_none(), "{name}");
    }
    // Anything but an in-cluster Service (an ExternalName would be one; the agent refuses
    // those): refused whatever the creator's rights.
    for (name, target) in [
        ("o1", "http://evil.example.com"),
        ("o2", "http://169.254.169.254:80"),
        ("o3", "tcp://localhost:22"),
        ("o4", "http://web.a:80"),
    ] {
        let m = refused(name, dev.create(&pp, &sandbox(name, ep(target))).await);
        assert!(m.contains("must be in-cluster Services"), "{name}: {m}");
    }
    // Namespace a's Services: allowed, in any spelling.
    dev.create(&pp, &sandbox("a1", ep("http://web.a.svc:8080")))
        .await
        .unwrap();
    dev.create(&pp, &sandbox("a2", ep("http://web.a.svc.cluster.local")))
        .await
        .unwrap();

    // Another cluster of the hub is a verb of its own, and so is a public preview.
    let remote = json!([{"name": "web", "target": "http://web.a.svc:80", "cluster": "east"}]);
    let m = refused(
        "remote",
        dev.create(&pp, &sandbox("r1", remote.clone())).await,
    );
    assert!(m.contains("clusters.spur.dev") && m.contains("east"), "{m}");
    let public = json!([{"name": "web", "target": "http://web.a.svc:80", "public": true}]);
    let m = refused(
        "public",
        dev.create(&pp, &sandbox("u1", public.clone())).await,
    );
    assert!(m.contains("sandboxes/public"), "{m}");
    // Nor can an allowed sandbox be changed to reach b, or to be public.
    let to_b =
        Patch::Merge(json!({"spec": {"defaultRouteGroup": {"endpoints": ep("http://web.b.svc")}}}));
    let m = refused(
        "update",
        dev.patch("a1", &PatchParams::default(), &to_b).await,
    );
    assert_eq!(names_checked(&m), ["b"], "{m}");
    let to_public = Patch::Merge(json!({"spec": {"defaultRouteGroup": {"endpoints": public}}}));
    let m = refused(
        "to public",
        dev.patch("a1", &PatchParams::default(), &to_public).await,
    );
    assert!(m.contains("sandboxes/public"), "{m}");

    // RouteGroups: the same rules.
    let m = refused(
        "route group",
        dev_rg
            .create(&pp, &route_group("g1", ep("http://web.b.svc:80")))
            .await,
    );
    assert_eq!(names_checked(&m), ["b"], "{m}");
    dev_rg
        .create(&pp, &route_group("g2", ep("http://web.a.svc:80")))
        .await
        .unwrap();
    let rg_public = json!([{"name": "web", "target": "http://web.a.svc:80", "public": true}]);
    let m = refused(
        "public route group",
        dev_rg
            .create(&pp, &route_group("g3", rg_public.clone()))
            .await,
    );
    assert!(m.contains("routegroups/public"), "{m}");

    // An admin's sandbox of b stays editable by the developer where the endpoints are left
    // alone (so the operator's own updates, finalizers, pass too).
    admin_sb
        .create(&pp, &sandbox("admin-b", ep("http://web.b.svc:80")))
        .await
        .unwrap();
    dev.patch(
        "admin-b",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"description": "touched by dev"}})),
    )
    .await
    .unwrap();

    // With the chart's ClusterRoles, the developer may publish publicly and to another cluster.
    kt::grant_dev(
        &admin,
        "dev-publisher",
        kt::chart_rules("preview-publisher-rules.yaml").unwrap(),
    )
    .await
    .unwrap();
    kt::grant_dev(
        &admin,
        "dev-remote",
        kt::chart_rules("preview-remote-clusters-rules.yaml").unwrap(),
    )
    .await
    .unwrap();
    eventually("a public preview with the publisher role", || {
        let dev = dev.clone();
        let to_public = to_public.clone();
        async move {
            dev.patch("a1", &PatchParams::default(), &to_public)
                .await
                .ok()
        }
    })
    .await;
    dev.create(&pp, &sandbox("r1", remote)).await.unwrap();
    dev_rg
        .create(&pp, &route_group("g3", rg_public))
        .await
        .unwrap();
    // Still not b: reaching a namespace is not something these roles give.
    let m = refused(
        "b with every role",
        dev.create(&pp, &sandbox("p5", ep("http://web.b.svc:80")))
            .await,
    );
    assert_eq!(names_checked(&m), ["b"], "{m}");
}
