use serde_json::{Value, json};

use super::*;

fn sandbox(status: Value) -> Sandbox {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "pr-42", "generation": 2},
        "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"}}],
                 "local": [{"name": "web", "from": {"kind": "Deployment", "namespace": "hotrod", "name": "frontend"},
                            "mappings": [{"port": 8080, "toLocal": "localhost:8080"}]}]},
        "status": status
    }))
    .unwrap()
}

fn ready(status: &str, reason: &str, generation: i64) -> Value {
    json!([{"type": "Ready", "status": status, "reason": reason, "message": format!("m {reason}"),
            "observedGeneration": generation, "lastTransitionTime": "2026-12-01T00:00:00Z"}])
}

fn forked(conditions: Value, fork: Option<&str>) -> ForkedWorkload {
    serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "ForkedWorkload",
        "metadata": {"name": "pr-42-route-fork", "namespace": "hotrod", "generation": 1},
        "spec": {"sandbox": "pr-42", "routingKey": "k1",
                 "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "route"}},
        "status": {"fork": fork, "conditions": conditions}
    }))
    .unwrap()
}

fn pod(name: &str, status: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "hotrod"},
        "spec": {"nodeName": "node-1", "containers": [{"name": "hotrod", "image": "x"}]},
        "status": status
    }))
    .unwrap()
}

fn scheduled() -> Value {
    json!({"type": "PodScheduled", "status": "True"})
}

fn steps(s: &Snapshot, item: &str) -> Vec<String> {
    stages(s)
        .into_iter()
        .find(|st| st.item == item)
        .unwrap()
        .steps
}

#[test]
fn a_fork_goes_through_every_step_in_order() {
    let status = json!({"observedGeneration": 2, "routingKey": "k1",
                        "conditions": ready("False", "NotReady", 2)});
    let mut snap = Snapshot {
        sandbox: sandbox(status.clone()),
        forks: vec![ForkView {
            forked: Ok(None),
            deployment: Ok(None),
            pods: Ok(vec![]),
        }],
    };
    assert_eq!(steps(&snap, "sandbox"), ["applied", "routing key k1"]);
    assert_eq!(steps(&snap, "hotrod/route"), ["waiting for the operator"]);
    assert_eq!(
        steps(&snap, "local web"),
        ["waiting for a workstation (spur local connect; docs/local.md)"]
    );
    assert_eq!(verdict(&snap), Verdict::Waiting("m NotReady".into()));

    let fw = forked(ready("False", "ForkNotReady", 1), Some("pr-42-route-fork"));
    snap.forks[0].forked = Ok(Some(fw));
    snap.forks[0].pods = Ok(vec![pod("p1", json!({"phase": "Pending"}))]);
    assert_eq!(
        steps(&snap, "hotrod/route"),
        [
            "waiting for the operator",
            "ForkedWorkload hotrod/pr-42-route-fork created",
            "Deployment hotrod/pr-42-route-fork created",
            "pod p1 created"
        ]
    );
    snap.forks[0].pods = Ok(vec![pod(
        "p1",
        json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/1 nodes are available"}]}),
    )]);
    assert_eq!(
        steps(&snap, "hotrod/route").last().unwrap(),
        "not scheduled yet (Unschedulable: 0/1 nodes are available)"
    );
    snap.forks[0].pods = Ok(vec![pod(
        "p1",
        json!({"phase": "Pending", "conditions": [scheduled()],
               "containerStatuses": [{"name": "hotrod", "image": "x", "imageID": "", "ready": false,
                                      "restartCount": 0,
                                      "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
    )]);
    assert_eq!(
        steps(&snap, "hotrod/route").last().unwrap(),
        "scheduled on node-1"
    );
    assert!(matches!(verdict(&snap), Verdict::Waiting(_)));
    snap.forks[0].pods = Ok(vec![pod(
        "p1",
        json!({"phase": "Running", "conditions": [scheduled(), {"type": "Ready", "status": "True"}],
               "containerStatuses": [{"name": "hotrod", "image": "x", "imageID": "sha256:1", "ready": true,
                                      "restartCount": 0, "state": {"running": {}}}]}),
    )]);
    let mut done = status.clone();
    done["forks"] = json!([{"forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "route"},
                            "forkedWorkload": "pr-42-route-fork", "fork": "pr-42-route-fork", "ready": true,
                            "baselineSidecars": {"pods": 2, "injected": 2, "ready": 2, "allReady": true}}]);
    snap.sandbox = sandbox(done.clone());
    assert_eq!(
        steps(&snap, "hotrod/route")[4..],
        [
            "scheduled on node-1",
            "images pulled",
            "pod ready",
            "routes published; 2 of 2 baseline pods have a ready sidecar"
        ]
    );
    done["local"] =
        json!([{"name": "web", "externalWorkload": "ew", "connected": true, "ready": true}]);
    done["conditions"] = ready("True", "Ready", 2);
    snap.sandbox = sandbox(done.clone());
    assert_eq!(
        steps(&snap, "local web")[1..],
        [
            "workstation connected",
            "keyed requests reach the workstation"
        ]
    );
    snap.forks[0].forked = Ok(Some(forked(
        ready("True", "ForkReady", 1),
        Some("pr-42-route-fork"),
    )));
    assert_eq!(verdict(&snap), Verdict::Ready);
    // A Ready condition of the previous generation is not this apply's.
    done["conditions"] = ready("True", "Ready", 1);
    snap.sandbox = sandbox(done);
    assert!(matches!(verdict(&snap), Verdict::Waiting(_)));
}

#[test]
fn failures_name_the_reason_and_the_object() {
    let waiting = json!({"observedGeneration": 2, "routingKey": "k1",
                         "conditions": ready("False", "NotReady", 2)});
    let mut snap = Snapshot {
        sandbox: sandbox(waiting),
        forks: vec![ForkView {
            forked: Ok(None),
            deployment: Ok(None),
            pods: Ok(vec![pod(
                "p1",
                json!({"phase": "Pending", "conditions": [scheduled()],
                   "containerStatuses": [{"name": "hotrod", "image": "nope:1", "imageID": "", "ready": false,
                     "restartCount": 0, "state": {"waiting": {"reason": "ErrImagePull",
                     "message": "failed to pull image \"nope:1\": not found"}}}]}),
            )]),
        }],
    };
    // The kubelet retries a pull: trouble, which the wait turns into a failure if it lasts.
    assert_eq!(
        verdict(&snap),
        Verdict::Troubled(Failure {
            reason: "ErrImagePull".into(),
            message: "failed to pull image \"nope:1\": not found".into(),
            object: "pod hotrod/p1, container hotrod".into()
        })
    );
    // A name that is no image reference is a failure at once.
    let bad_name = serde_json::to_string(&snap.forks[0].pods.as_ref().unwrap()[0])
        .unwrap()
        .replace("ErrImagePull", "InvalidImageName");
    snap.forks[0].pods = Ok(vec![serde_json::from_str(&bad_name).unwrap()]);
    assert!(
        matches!(verdict(&snap), Verdict::Failed(f) if f.reason == "InvalidImageName"),
        "{:?}",
        verdict(&snap)
    );
    // A fork that cannot be built.
    snap.forks[0].pods = Ok(vec![]);
    snap.forks[0].forked = Ok(Some(forked(ready("False", "BaselineChanged", 1), None)));
    let Verdict::Failed(f) = verdict(&snap) else {
        panic!()
    };
    assert_eq!(f.object, "ForkedWorkload hotrod/pr-42-route-fork");
    // The sandbox's own check.
    snap.sandbox = sandbox(json!({"observedGeneration": 2,
                                  "conditions": ready("False", "BaselineNotFound", 2)}));
    let Verdict::Failed(f) = verdict(&snap) else {
        panic!()
    };
    assert_eq!(
        (f.reason.as_str(), f.object.as_str()),
        ("BaselineNotFound", "Sandbox pr-42")
    );
    // The same reason of an older generation: the operator has not looked at this one yet.
    snap.sandbox = sandbox(json!({"observedGeneration": 1,
                                  "conditions": ready("False", "BaselineNotFound", 1)}));
    snap.forks[0].forked = Ok(None);
    assert!(matches!(verdict(&snap), Verdict::Waiting(_)));
    // Unreadable pods are said, not fatal.
    snap.forks[0].forked = Ok(Some(forked(ready("False", "ForkNotReady", 1), Some("d"))));
    snap.forks[0].pods = Err("forbidden to you".into());
    assert_eq!(
        steps(&snap, "hotrod/route").last().unwrap(),
        "(its pods are not readable: forbidden to you)"
    );
}

#[test]
fn several_pods_count_as_one_step_each() {
    let mut snap = Snapshot {
        sandbox: sandbox(json!({})),
        forks: vec![ForkView {
            forked: Ok(Some(forked(json!([]), Some("d")))),
            deployment: Ok(None),
            pods: Ok(vec![
                pod("p2", json!({"conditions": [scheduled()]})),
                pod("p1", json!({})),
            ]),
        }],
    };
    assert_eq!(
        steps(&snap, "hotrod/route")[3..],
        ["pod p1 created (2 pods)"]
    );
    snap.forks[0].pods = Ok(vec![
        pod("p2", json!({"conditions": [scheduled()]})),
        pod("p1", json!({"conditions": [scheduled()]})),
    ]);
    assert_eq!(
        steps(&snap, "hotrod/route").last().unwrap(),
        "scheduled on node-1 (2 pods)"
    );
}

fn deployment(generation: i64, status: Value) -> k8s_openapi::api::apps::v1::Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": "pr-42-route-fork", "namespace": "hotrod", "generation": generation},
        "spec": {"replicas": 1, "selector": {}, "template": {}},
        "status": status
    }))
    .unwrap()
}

#[test]
fn a_changed_sandbox_is_ready_once_its_forks_run_the_change() {
    let mut done = json!({"observedGeneration": 2, "routingKey": "k1",
                          "conditions": ready("True", "Ready", 2)});
    done["local"] =
        json!([{"name": "web", "externalWorkload": "ew", "connected": true, "ready": true}]);
    let mut snap = Snapshot {
        sandbox: sandbox(done),
        forks: vec![ForkView {
            // The ForkedWorkload's Ready is of its previous generation: not this change's.
            forked: Ok(Some(forked(
                ready("True", "ForkReady", 0),
                Some("pr-42-route-fork"),
            ))),
            deployment: Ok(None),
            pods: Ok(vec![]),
        }],
    };
    assert_eq!(
        verdict(&snap),
        Verdict::Waiting("waiting for ForkedWorkload pr-42-route-fork to take the change".into())
    );
    snap.forks[0].forked = Ok(Some(forked(
        ready("True", "ForkReady", 1),
        Some("pr-42-route-fork"),
    )));
    // The old pod still serves while the new one starts (a RollingUpdate fork).
    snap.forks[0].deployment = Ok(Some(deployment(
        3,
        json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}),
    )));
    assert_eq!(
        verdict(&snap),
        Verdict::Waiting(
            "waiting for Deployment pr-42-route-fork to roll out (1 of 1 updated, 1 available, 2 in all)".into()
        )
    );
    snap.forks[0].deployment = Ok(Some(deployment(
        3,
        json!({"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}),
    )));
    assert!(
        matches!(verdict(&snap), Verdict::Waiting(_)),
        "the controller has not seen it"
    );
    snap.forks[0].deployment = Ok(Some(deployment(
        3,
        json!({"observedGeneration": 3, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}),
    )));
    assert_eq!(verdict(&snap), Verdict::Ready);
    // A Deployment the user may not read is not waited for.
    snap.forks[0].deployment = Err("forbidden to you".into());
    assert_eq!(verdict(&snap), Verdict::Ready);
}

#[test]
fn old_and_finished_pods_do_not_decide() {
    let waiting = json!({"observedGeneration": 2, "conditions": ready("False", "NotReady", 2)});
    let with = |name: &str, hash: &str, created: &str, status: Value| {
        let mut p = pod(name, status);
        p.metadata.labels = Some([("pod-template-hash".to_string(), hash.to_string())].into());
        p.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            created.parse().unwrap(),
        ));
        p
    };
    let crashing = json!({"phase": "Running", "conditions": [scheduled()],
        "containerStatuses": [{"name": "hotrod", "image": "x", "imageID": "sha256:1", "ready": false,
          "restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}}]});
    let starting = json!({"phase": "Pending", "conditions": [scheduled()]});
    let snap = Snapshot {
        sandbox: sandbox(waiting),
        forks: vec![ForkView {
            forked: Ok(Some(forked(ready("False", "ForkNotReady", 1), Some("d")))),
            deployment: Ok(None),
            pods: Ok(vec![
                // The old template's crashing pod, going away in a rolling update...
                with("old", "aaa", "2026-12-01T00:00:00Z", crashing.clone()),
                // ... an evicted one ...
                with(
                    "evicted",
                    "bbb",
                    "2026-12-01T00:01:00Z",
                    json!({"phase": "Failed", "reason": "Evicted"}),
                ),
                // ... and the new one, starting.
                with("new", "bbb", "2026-12-01T00:02:00Z", starting),
            ]),
        }],
    };
    assert!(
        matches!(verdict(&snap), Verdict::Waiting(_)),
        "{:?}",
        verdict(&snap)
    );
    assert_eq!(
        steps(&snap, "hotrod/route").last().unwrap(),
        "scheduled on node-1"
    );
    // The newest template's pod crashing is a failure.
    let mut snap = snap;
    snap.forks[0].pods = Ok(vec![with("new", "bbb", "2026-12-01T00:02:00Z", crashing)]);
    assert!(matches!(verdict(&snap), Verdict::Failed(f) if f.reason == "CrashLoopBackOff"));
}

#[test]
fn an_older_forked_workload_failure_is_not_this_changes() {
    let waiting = json!({"observedGeneration": 2, "conditions": ready("False", "NotReady", 2)});
    let snap = Snapshot {
        sandbox: sandbox(waiting),
        forks: vec![ForkView {
            forked: Ok(Some(forked(ready("False", "BaselineChanged", 0), None))),
            deployment: Ok(None),
            pods: Ok(vec![]),
        }],
    };
    assert!(matches!(verdict(&snap), Verdict::Waiting(_)));
}

#[test]
fn a_ready_sandbox_whose_new_fork_pod_fails_has_failed() {
    let done = json!({"observedGeneration": 2, "routingKey": "k1",
                      "conditions": ready("True", "Ready", 2)});
    let mut p = pod(
        "new",
        json!({"phase": "Running", "conditions": [scheduled()],
               "containerStatuses": [{"name": "hotrod", "image": "x", "imageID": "sha256:1", "ready": false,
                 "restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}}]}),
    );
    p.metadata.labels = Some([("pod-template-hash".to_string(), "new".to_string())].into());
    let mut snap = Snapshot {
        sandbox: sandbox(done),
        forks: vec![ForkView {
            forked: Ok(Some(forked(ready("True", "ForkReady", 1), Some("d")))),
            deployment: Ok(Some(deployment(
                3,
                json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}),
            ))),
            pods: Ok(vec![p]),
        }],
    };
    assert!(
        matches!(verdict(&snap), Verdict::Failed(f) if f.reason == "CrashLoopBackOff"),
        "{:?}",
        verdict(&snap)
    );
    // A rollout past its progress deadline.
    snap.forks[0].pods = Ok(vec![]);
    snap.forks[0].deployment = Ok(Some(deployment(
        3,
        json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1,
               "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                               "message": "ReplicaSet \"d-2\" has timed out progressing."}]}),
    )));
    assert_eq!(
        verdict(&snap),
        Verdict::Failed(Failure {
            reason: "ProgressDeadlineExceeded".into(),
            message: "ReplicaSet \"d-2\" has timed out progressing.".into(),
            object: "Deployment hotrod/pr-42-route-fork".into()
        })
    );
}
