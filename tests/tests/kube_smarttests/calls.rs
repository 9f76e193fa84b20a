//! A SmartTest with `calls: true` (docs/smart-tests.md, "Downstream calls") in automatic runs,
//! against a real traffic store reviewing tokens with the same API server: the operator starts
//! the run's capture for the test's creator, with its own `delegate` right, only once the
//! creator may capture and read the sandbox's traffic; the run's Job gets the capture and a
//! token that reads back only that run; the operator ends the capture when the Job ends, or
//! when it is deleted before it ended (by hand: the run made again gets a new capture; or by
//! the operator, once the test no longer covers the sandbox).

use std::net::SocketAddr;

use spur_operator::smarttests::RUN_CAPTURE_ANNOTATION;
use spur_proto::traffic as pb;
use spur_proto::traffic::traffic_client::TrafficClient;
use spur_traffic::ClusterCapture;

use super::*;

/// A traffic store reviewing tokens with `api` (the chart's rights), until `stop`.
pub(super) async fn start_store(api: &KubeApi, stop: CancellationToken) -> SocketAddr {
    spur_e2e::kube::traffic_store(
        api,
        ClusterCapture::default(),
        spur_traffic::DEFAULT_RECHECK,
        std::time::Duration::ZERO,
        stop,
    )
    .await
    .unwrap()
}

/// The operator's configuration for the store: its ServiceAccount's token for the store's
/// audience in a file under `dir`.
pub(super) async fn store_config(
    api: &KubeApi,
    store: SocketAddr,
    dir: &std::path::Path,
) -> spur_operator::smarttests::store::StoreConfig {
    let token = spur_e2e::kube::traffic_token(api, SYSTEM_NAMESPACE, "spur-operator")
        .await
        .unwrap();
    let token_file = dir.join("operator-traffic-token");
    std::fs::write(&token_file, token).unwrap();
    let cfg = spur_operator::smarttests::store::StoreConfig {
        server: format!("http://{store}"),
        ca_file: None,
        token_file,
    };
    cfg.validate().unwrap();
    cfg
}

async fn read_run(
    store: SocketAddr,
    id: &str,
    token: &str,
) -> Result<pb::ReadRunReply, tonic::Status> {
    let mut client = TrafficClient::connect(format!("http://{store}"))
        .await
        .unwrap();
    let mut req = tonic::Request::new(pb::ReadRunRequest { id: id.into() });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    client.read_run(req).await.map(tonic::Response::into_inner)
}

/// Ann's test of sandbox pr-1 (Ready) that compares calls.
pub(super) async fn a_test_comparing_calls_runs_with_a_capture_its_creator_may_start(
    admin: &Client,
    ann: &Client,
    store: SocketAddr,
) {
    let pp = PostParams::default();
    let mut test = smart_test("calls", NS, &["api"]);
    test.spec.calls = true;
    Api::<SmartTest>::namespaced(ann.clone(), NS)
        .create(&pp, &test)
        .await
        .unwrap();
    // Ann may fork and submit, but not capture pr-1's traffic: not run, and the row says why.
    let c = tests_condition(admin, "pr-1", "the calls test refused", |c| {
        c.message.contains("shop/calls: not run")
    })
    .await;
    assert!(
        c.message
            .contains("may not update sandboxes/capture.spur.dev pr-1"),
        "{}",
        c.message
    );
    assert!(runs(admin, NS, "calls").await.is_empty());

    // Ann gets the capture and reader roles of the chart (for pr-1); her test is looked at
    // again (a label of hers), and runs.
    let mut rules = spur_e2e::kube::chart_rules("traffic-capturer-rules.yaml").unwrap();
    let reader = spur_e2e::kube::chart_rules("traffic-reader-rules.yaml").unwrap();
    rules
        .as_array_mut()
        .unwrap()
        .extend(reader.as_array().unwrap().iter().cloned());
    for r in rules.as_array_mut().unwrap() {
        r["resourceNames"] = json!(["pr-1"]);
    }
    let role: ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": "ann-captures-pr-1"}, "rules": rules}))
            .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "ann-captures-pr-1"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ann-captures-pr-1"},
        "subjects": [{"kind": "ServiceAccount", "name": "ann", "namespace": "shop-devs"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    let tests = Api::<SmartTest>::namespaced(ann.clone(), NS);
    let touched = std::sync::atomic::AtomicUsize::new(0);
    let job = eventually("the calls test's run", || async {
        let n = touched.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let touch = json!({"metadata": {"labels": {"touched": n.to_string()}}});
        tests
            .patch("calls", &PatchParams::default(), &Patch::Merge(touch))
            .await
            .unwrap();
        runs(admin, NS, "calls").await.into_iter().next()
    })
    .await;
    let (id, token) = capture_of(&job);
    let script = job.spec.script.clone().unwrap();
    assert!(
        script.contains(&format!(
            "--run-capture-env SPUR_RUN_CAPTURE --server 'http://{store}'"
        )),
        "{script}"
    );
    assert!(script.contains(&format!("\"id\":\"{id}\"")), "{script}");

    // The run's token reads the run (nothing was sent yet); another token does not.
    let read = read_run(store, &id, &token).await.unwrap();
    assert!(read.live && read.exchanges.is_empty(), "{read:?}");
    let err = read_run(store, &id, &"0".repeat(64)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");

    // The Job ends: the operator ends the capture (read back once more within the grace).
    Api::<Job>::namespaced(admin.clone(), NS)
        .patch_status(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded", "exitCode": 0,
                "result": r#"{"passed":true,"steps":1,"checksFailed":0,"findings":0}"#}})),
        )
        .await
        .unwrap();
    eventually("the run's capture ended", || async {
        let read = read_run(store, &id, &token).await.ok()?;
        (!read.live).then_some(())
    })
    .await;

    // The test changes: a new run, with a capture of its own. Its Job is deleted before it
    // ends: the operator ends its capture, then makes the run again with a new capture (not
    // the old one resumed).
    let step = json!({"spec": {"steps": [{"name": "list", "http": {"url": format!("http://api.{NS}/items?v=2")},
                                         "checks": [{"status": 200}]}]}});
    tests
        .patch("calls", &PatchParams::default(), &Patch::Merge(step))
        .await
        .unwrap();
    let second = eventually("the changed test's run", || async {
        runs(admin, NS, "calls")
            .await
            .into_iter()
            .find(|j| j.name_any() != job.name_any())
    })
    .await;
    let (second_id, second_token) = capture_of(&second);
    assert_ne!(second_id, id);
    assert!(
        read_run(store, &second_id, &second_token)
            .await
            .unwrap()
            .live
    );
    Api::<Job>::namespaced(admin.clone(), NS)
        .delete(&second.name_any(), &Default::default())
        .await
        .unwrap();
    eventually("the deleted run's capture ended", || async {
        match read_run(store, &second_id, &second_token).await {
            Ok(read) => (!read.live).then_some(()),
            Err(e) => (e.code() == tonic::Code::NotFound).then_some(()),
        }
    })
    .await;
    let again = eventually("the run made again", || async {
        runs(admin, NS, "calls")
            .await
            .into_iter()
            .find(|j| j.name_any() == second.name_any() && j.uid() != second.uid())
    })
    .await;
    let (again_id, again_token) = capture_of(&again);
    assert_ne!(again_id, second_id, "a new capture, not the deleted Job's");
    assert!(read_run(store, &again_id, &again_token).await.unwrap().live);

    // The test stops covering the sandbox: the operator deletes its runs, and ends the
    // capture of the one that had not ended (no Job of its name is made again to replace it).
    let elsewhere = json!({"spec": {"services": ["not-forked"]}});
    tests
        .patch("calls", &PatchParams::default(), &Patch::Merge(elsewhere))
        .await
        .unwrap();
    eventually(
        "the runs of a test that no longer covers pr-1 deleted",
        || async { runs(admin, NS, "calls").await.is_empty().then_some(()) },
    )
    .await;
    eventually(
        "the capture of the run deleted by the operator ended",
        || async {
            match read_run(store, &again_id, &again_token).await {
                Ok(read) => (!read.live).then_some(()),
                Err(e) => (e.code() == tonic::Code::NotFound).then_some(()),
            }
        },
    )
    .await;
}

/// The capture id and the run token the operator gave the run's Job.
fn capture_of(job: &Job) -> (String, String) {
    let id = job
        .annotations()
        .get(RUN_CAPTURE_ANNOTATION)
        .unwrap()
        .clone();
    let script = job.spec.script.clone().unwrap();
    let token = script
        .split("export SPUR_TRAFFIC_TOKEN='")
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .unwrap()
        .to_owned();
    (id, token)
}
