//! Run captures (`StartRunCapture`, `EndRunCapture`: docs/smart-tests.md, "Downstream calls")
//! against a real kube-apiserver: a run needs `update` on the sandbox's `sandboxes/capture` and
//! `create` on Deployments in each namespace the sandbox forks from, asked of the caller's own
//! token; it captures the sandbox's key and a reference key at every sidecar of those
//! namespaces and at no other; a user of another namespace can neither start one nor end
//! someone else's, even holding its id.

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};

use super::*;

fn start(sandbox: &str) -> pb::StartRunCaptureRequest {
    pb::StartRunCaptureRequest {
        sandbox: sandbox.into(),
        seconds: 120,
        run_for: None,
    }
}

/// A ServiceAccount `name` of `namespace` and a token of it for the store's audience.
async fn user(api: &KubeApi, namespace: &str, name: &str) -> String {
    let admin = api.client();
    kt::ensure_namespace(&admin, namespace).await.unwrap();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<ServiceAccount>::namespaced(admin, namespace)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    kt::traffic_token(api, namespace, name).await.unwrap()
}

/// Lets ServiceAccount dev (spur-system) create Deployments in `namespace`.
async fn dev_may_deploy_in(admin: &kube::Client, namespace: &str) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "deployer"},
        "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "dev-deployer"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "deployer"},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": kt::SYSTEM_NAMESPACE}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_capture_needs_the_callers_rights_and_captures_only_the_sandboxes_namespaces() {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let store = Store::start(&api, spur_traffic::DEFAULT_RECHECK).await;
    // A sandbox forking shop/backend, capture off: a run still may capture it.
    let sandboxes: Api<Sandbox> = Api::all(admin.clone());
    sandboxes
        .create(&PostParams::default(), &sandbox("runs-sb", false))
        .await
        .unwrap();
    sandboxes
        .patch_status(
            "runs-sb",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"routingKey": "key-runs"}})),
        )
        .await
        .unwrap();
    // The sidecars of another baseline of shop, and of a baseline of another namespace.
    let (_, catalog_token) = sidecar_pod(&api, "shop", "catalog", "catalog-1", true).await;
    let (_, billing_token) = sidecar_pod(&api, "billing", "ledger", "ledger-1", true).await;
    let mut at_catalog = store
        .watch_settings(workload("shop", "catalog"), &catalog_token)
        .await
        .unwrap();
    let mut at_billing = store
        .watch_settings(workload("billing", "ledger"), &billing_token)
        .await
        .unwrap();
    next_settings(&mut at_catalog, |s| s.keys.is_empty()).await;
    next_settings(&mut at_billing, |s| s.keys.is_empty()).await;

    // No rights: refused, naming the right, before anything says whether the sandbox exists.
    let dev = reader_token(&api).await;
    for name in ["runs-sb", "no-such-sandbox"] {
        let err = store
            .client()
            .await
            .start_run_capture(with(start(name), &dev))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{name}: {err:?}");
        assert!(err.message().contains("sandboxes/capture"), "{err:?}");
    }
    // The capture right on the sandbox alone is not enough: the run captures in shop.
    let mut rules = kt::chart_rules("traffic-capturer-rules.yaml").unwrap();
    rules[0]["resourceNames"] = json!(["runs-sb"]);
    kt::grant_dev(&admin, "dev-capture-runs-sb", rules)
        .await
        .unwrap();
    let err = eventually("the capture grant", || async {
        let e = store
            .client()
            .await
            .start_run_capture(with(start("runs-sb"), &dev))
            .await
            .unwrap_err();
        e.message().contains("deployments").then_some(e)
    })
    .await;
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("namespace shop"), "{err:?}");
    dev_may_deploy_in(&admin, "shop").await;
    let run = eventually("the deploy grant", || async {
        store
            .client()
            .await
            .start_run_capture(with(start("runs-sb"), &dev))
            .await
            .ok()
    })
    .await
    .into_inner();
    assert_eq!(run.routing_key, "key-runs");
    assert_eq!(run.namespaces, ["shop"]);
    assert!(run.reference_key.starts_with("spur-run-"), "{run:?}");
    assert!(run.watching_baselines >= 1, "{run:?}");

    // The sidecars of shop capture both keys; billing's nothing.
    let keys = next_settings(&mut at_catalog, |s| s.keys.len() == 2).await;
    let mut got: Vec<&str> = keys.keys.iter().map(|k| k.routing_key.as_str()).collect();
    got.sort_unstable();
    let mut want = vec!["key-runs", run.reference_key.as_str()];
    want.sort_unstable();
    assert_eq!(got, want);
    assert!(keys.keys.iter().all(|k| k.sandbox == "runs-sb"));
    let referenced = exchange(
        workload("shop", "catalog"),
        "runs-sb",
        &run.reference_key,
        "c/1",
    );
    assert_eq!(pushed(&store, &catalog_token, vec![referenced]).await, 1);
    let err = store
        .client()
        .await
        .push(with(
            push(vec![exchange(
                workload("billing", "ledger"),
                "runs-sb",
                &run.reference_key,
                "l/1",
            )]),
            &billing_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // A user of another namespace, even with the run's id, cannot end it.
    let other = user(&api, "team-b", "other").await;
    let end = || pb::EndRunCaptureRequest {
        id: run.id.clone(),
        job: String::new(),
    };
    let err = store
        .client()
        .await
        .end_run_capture(with(end(), &other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = store
        .client()
        .await
        .start_run_capture(with(start("runs-sb"), &other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), at_catalog.message())
            .await
            .is_err(),
        "the run still captures"
    );

    // Its user ends it: the keys leave shop's settings; ending again finds nothing.
    store
        .client()
        .await
        .end_run_capture(with(end(), &dev))
        .await
        .unwrap();
    next_settings(&mut at_catalog, |s| s.keys.is_empty()).await;
    let err = store
        .client()
        .await
        .end_run_capture(with(end(), &dev))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    store.stop.cancel();
}

/// Binds user `user` to `rules`, cluster-wide (`namespace` None) or in a namespace.
async fn grant_user(
    admin: &kube::Client,
    name: &str,
    user: &str,
    namespace: Option<&str>,
    rules: serde_json::Value,
) {
    let subjects = json!([{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}]);
    match namespace {
        None => {
            kt::grant_dev(admin, name, rules).await.unwrap();
            let binding: ClusterRoleBinding = serde_json::from_value(json!({
                "metadata": {"name": format!("{name}-user")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": subjects,
            }))
            .unwrap();
            Api::<ClusterRoleBinding>::all(admin.clone())
                .create(&PostParams::default(), &binding)
                .await
                .unwrap();
        }
        Some(ns) => {
            kt::ensure_namespace(admin, ns).await.unwrap();
            let role: Role =
                serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules}))
                    .unwrap();
            Api::<Role>::namespaced(admin.clone(), ns)
                .create(&PostParams::default(), &role)
                .await
                .unwrap();
            let binding: RoleBinding = serde_json::from_value(json!({
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": subjects,
            }))
            .unwrap();
            Api::<RoleBinding>::namespaced(admin.clone(), ns)
                .create(&PostParams::default(), &binding)
                .await
                .unwrap();
        }
    }
}

fn now_micros() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(d.as_micros()).unwrap()
}

/// A marked exchange: `baggage` with `marker`, a secret header and a query.
fn marked(key: &str, id: &str, marker: Option<String>) -> pb::Exchange {
    let mut x = exchange(workload("shop", "catalog"), "deleg-sb", key, id);
    x.start_unix_micros = now_micros();
    x.path = format!("/{id}?session=s3cr3t");
    x.request_headers.push(pb::Header {
        name: "x-api-key".into(),
        value: b"s3cr3t".to_vec(),
    });
    if let Some(m) = marker {
        x.request_headers.push(pb::Header {
            name: "baggage".into(),
            value: format!("sd-routing-key={key},spur-test-step={m}").into_bytes(),
        });
    }
    x
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_for_a_user_needs_the_delegate_right_and_its_user_s_and_reads_back_only_its_own_requests()
 {
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let store = Store::start(&api, spur_traffic::DEFAULT_RECHECK).await;
    let sandboxes: Api<Sandbox> = Api::all(admin.clone());
    let sb = sandbox("deleg-sb", false);
    sandboxes.create(&PostParams::default(), &sb).await.unwrap();
    sandboxes
        .patch_status(
            "deleg-sb",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"routingKey": "key-deleg"}})),
        )
        .await
        .unwrap();
    let (_, catalog_token) = sidecar_pod(&api, "shop", "catalog", "catalog-1", true).await;
    let mut at_catalog = store
        .watch_settings(workload("shop", "catalog"), &catalog_token)
        .await
        .unwrap();
    next_settings(&mut at_catalog, |s| s.keys.is_empty()).await;

    // ann may do what `spur test run --calls` needs; bob nothing.
    let mut rules = kt::chart_rules("traffic-capturer-rules.yaml").unwrap();
    rules.as_array_mut().unwrap().extend(
        kt::chart_rules("traffic-reader-rules.yaml")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .cloned(),
    );
    grant_user(&admin, "ann-capture", "ann", None, rules).await;
    grant_user(
        &admin,
        "ann-deploy",
        "ann",
        Some("shop"),
        json!([{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]}]),
    )
    .await;
    let for_user = |username: &str| pb::StartRunCaptureRequest {
        run_for: Some(pb::RunFor {
            username: username.into(),
            groups: vec!["team-a".into()],
            job: String::new(),
        }),
        ..start("deleg-sb")
    };

    // A component without `delegate` cannot start a run for ann, though ann could start it.
    let op = user(&api, kt::SYSTEM_NAMESPACE, "op").await;
    let err = store
        .client()
        .await
        .start_run_capture(with(for_user("ann"), &op))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("delegate"), "{err:?}");
    // With the chart's operator rules it can, for a user with the rights only.
    kt::grant_cluster(&api, "op", "operator-smarttests-rules.yaml")
        .await
        .unwrap();
    let err = eventually("the delegate grant", || async {
        let e = store
            .client()
            .await
            .start_run_capture(with(for_user("bob"), &op))
            .await
            .unwrap_err();
        (!e.message().contains("delegate")).then_some(e)
    })
    .await;
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("bob"), "{err:?}");
    let run = eventually("the run for ann", || async {
        store
            .client()
            .await
            .start_run_capture(with(for_user("ann"), &op))
            .await
            .ok()
    })
    .await
    .into_inner();
    assert_eq!(run.routing_key, "key-deleg");
    assert_eq!(run.run_token.len(), 64, "{}", run.run_token.len());
    assert_eq!(run.marker_tag.len(), 16);
    next_settings(&mut at_catalog, |s| s.keys.len() == 2).await;

    // What reached catalog meanwhile: the run's requests (both keys), another request with the
    // sandbox's key (someone else's, unmarked), one marked by another run.
    let tag = &run.marker_tag;
    let exchanges = vec![
        marked("key-deleg", "c/mine-s", Some(format!("{tag}.0.s"))),
        marked(&run.reference_key, "c/mine-b1", Some(format!("{tag}.0.b1"))),
        marked("key-deleg", "c/someone-else", None),
        marked(
            "key-deleg",
            "c/other-run",
            Some("0123456789abcdef.0.s".into()),
        ),
    ];
    assert_eq!(pushed(&store, &catalog_token, exchanges).await, 4);

    let read = |token: String| {
        let store = &store;
        let id = run.id.clone();
        async move {
            store
                .client()
                .await
                .read_run(with(pb::ReadRunRequest { id }, &token))
                .await
        }
    };
    // Not with another namespace's token, the operator's own, or a wrong run token.
    let other = user(&api, "team-b", "other").await;
    for token in [other.clone(), op.clone(), "0".repeat(64)] {
        let err = read(token).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    }
    // An id of no run, whatever the token.
    let err = store
        .client()
        .await
        .read_run(with(
            pb::ReadRunRequest { id: "nope".into() },
            &run.run_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    // The run's token reads the run's two requests, cut down; nothing else.
    let got = read(run.run_token.clone()).await.unwrap().into_inner();
    assert!(got.live && !got.truncated);
    let mut paths: Vec<&str> = got.exchanges.iter().map(|x| x.path.as_str()).collect();
    paths.sort_unstable();
    assert_eq!(paths, ["/c/mine-b1", "/c/mine-s"]);
    let printed = format!("{:?}", got.exchanges);
    assert!(!printed.contains("s3cr3t"), "{printed}");
    assert!(!printed.contains("sd-routing-key"), "{printed}");
    // The run's token is no reader's: Query refuses it.
    let err = store
        .client()
        .await
        .query(with(query("deleg-sb"), &run.run_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    // Another namespace's user cannot end it; its token can. Read back once more, ended.
    let end = || pb::EndRunCaptureRequest {
        id: run.id.clone(),
        job: String::new(),
    };
    let err = store
        .client()
        .await
        .end_run_capture(with(end(), &other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    store
        .client()
        .await
        .end_run_capture(with(end(), &run.run_token))
        .await
        .unwrap();
    next_settings(&mut at_catalog, |s| s.keys.is_empty()).await;
    let got = read(run.run_token.clone()).await.unwrap().into_inner();
    assert!(!got.live);
    assert_eq!(got.exchanges.len(), 2);
    // A run for a Job: started again for the same Job (the operator lost the answer, stopped
    // before it made the Job, or makes a deleted Job again), the store ends the first run and
    // starts another: the first token reads it as ended, the new Job never reads its exchanges.
    let for_job = |job: &str| {
        let mut req = for_user("ann");
        if let Some(f) = req.run_for.as_mut() {
            f.job = job.into();
        }
        req
    };
    let err = store
        .client()
        .await
        .start_run_capture(with(for_job("team-a/x/y"), &op))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let start_for_job = || async {
        store
            .client()
            .await
            .start_run_capture(with(for_job("team-a/run-1"), &op))
            .await
            .unwrap()
            .into_inner()
    };
    let read_of = |id: String, token: String| {
        let store = &store;
        async move {
            store
                .client()
                .await
                .read_run(with(pb::ReadRunRequest { id }, &token))
                .await
        }
    };
    let first = start_for_job().await;
    let again = start_for_job().await;
    assert_ne!(again.id, first.id);
    assert_ne!(again.marker_tag, first.marker_tag);
    let got = read_of(first.id.clone(), first.run_token.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(!got.live, "replaced");
    assert!(
        read_of(again.id.clone(), again.run_token.clone())
            .await
            .unwrap()
            .into_inner()
            .live
    );
    let read_again = |token: String| read_of(again.id.clone(), token);
    // Another namespace's user naming the same Job (to end the run by replacing it) is refused
    // before anything changes.
    let err = store
        .client()
        .await
        .start_run_capture(with(for_job("team-a/run-1"), &other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        read_again(again.run_token.clone())
            .await
            .unwrap()
            .into_inner()
            .live
    );
    // The component that started a run for a user may end it with its own right (when the
    // run's Job ended), naming the Job: a Job whose record names another Job's run ends
    // nothing. Another namespace's user cannot.
    let end_again = |job: &str| pb::EndRunCaptureRequest {
        id: again.id.clone(),
        job: job.into(),
    };
    let err = store
        .client()
        .await
        .end_run_capture(with(end_again("team-a/run-1"), &other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("delegate"), "{err:?}");
    for job in ["", "team-a/run-2"] {
        let err = store
            .client()
            .await
            .end_run_capture(with(end_again(job), &op))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{job}: {err:?}");
    }
    assert!(
        read_again(again.run_token.clone())
            .await
            .unwrap()
            .into_inner()
            .live
    );
    store
        .client()
        .await
        .end_run_capture(with(end_again("team-a/run-1"), &op))
        .await
        .unwrap();
    assert!(
        !read_again(again.run_token.clone())
            .await
            .unwrap()
            .into_inner()
            .live
    );
    // Ended, the Job's next start is a new run.
    let next = start_for_job().await;
    assert_ne!(next.id, again.id);
    store
        .client()
        .await
        .end_run_capture(with(
            pb::EndRunCaptureRequest {
                id: next.id.clone(),
                job: "team-a/run-1".into(),
            },
            &op,
        ))
        .await
        .unwrap();
    store.stop.cancel();
}
