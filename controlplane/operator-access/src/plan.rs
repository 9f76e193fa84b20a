//! The decisions of a grant that are not objects, as pure functions: whose a debug pod found
//! under the request's name is, what a refused creation means, which pods of a workload a grant
//! may pick and which one it picks, and whose grant holds a workstation.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use spur_api::access::{TargetKind, TunnelAccessRequest, labels as access_labels};
use spur_api::keys::labels::FORK;

use super::{Refusal, deadline, until};
use spur_operator_core::Error;

// === Debug pods ===

/// The debug pod found under the request's name: this request's (`owner_uid` is its
/// controller) and not going, or why it cannot be the grant's.
pub(super) fn existing_debug_pod(pod: Pod, owner_uid: &str, name: &str) -> Result<Pod, Refusal> {
    let ours = pod
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == owner_uid);
    match (ours, pod.metadata.deletion_timestamp.is_some()) {
        (true, false) => Ok(pod),
        (true, true) => Err((
            "PodGone",
            format!("debug pod {name} is being deleted: file a new request"),
        )),
        (false, _) => Err((
            "PodConflict",
            format!("a pod named {name} exists and is not this request's"),
        )),
    }
}

/// What creating debug pod `name` came to: the pod, a condition (the user's to fix, or a
/// pass a moment ago made it), or an error to back off on.
pub(super) fn created_debug_pod(
    created: Result<Pod, kube::Error>,
    name: &str,
) -> Result<Result<Pod, Refusal>, Error> {
    match created {
        Ok(created) => Ok(Ok(created)),
        // Made by a pass a moment ago: the next pass reads it.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Err((
            "Waiting",
            format!("debug pod {name} is being created"),
        ))),
        // The pod is refused (quota, pod security): the user's to fix, not a reason to back off.
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => Ok(Err((
            "PodRefused",
            format!("the debug pod was refused: {}", s.message),
        ))),
        Err(e) => Err(e.into()),
    }
}

// === Picking a pod ===

/// The pod a grant is on, or why there is none.
pub(super) enum PodChoice {
    Chosen(Box<Pod>),
    /// A condition reason and message.
    Unavailable(&'static str, String),
}

/// Whether pod `p` may be picked at all (it is live, no grant's debug pod, and of the baseline,
/// or with `sandbox` of that sandbox's fork `fork`): its controller when it may.
pub(super) fn candidate(p: &Pod, sandbox: Option<&str>, fork: &str) -> Option<OwnerReference> {
    // Fork pods are the fork's: a grant on the baseline never reaches them, and one in a
    // sandbox reaches only its own fork's (fork pods drop the baseline's selector labels too;
    // this holds even if someone copied them back).
    let fork_label = p.labels().get(FORK);
    let fork_ok = match sandbox {
        None => fork_label.is_none(),
        Some(_) => fork_label.map(String::as_str) == Some(fork),
    };
    if !fork_ok
        || p.labels().contains_key(access_labels::ACCESS_REQUEST)
        || p.metadata.deletion_timestamp.is_some()
    {
        return None;
    }
    p.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .cloned()
}

/// Whether the owner of a pod controlled by `controller` must be read to tell whose it is
/// (a Deployment's or Rollout's pods are its ReplicaSets').
pub(super) fn through_replicaset(kind: TargetKind, controller: &OwnerReference) -> bool {
    matches!(kind, TargetKind::Deployment | TargetKind::Rollout) && controller.kind == "ReplicaSet"
}

/// Whether a pod controlled by `controller` is workload `uid`'s: directly, or through the
/// ReplicaSet whose controller's uid is `rs_owner`.
pub(super) fn owned(
    kind: TargetKind,
    controller: &OwnerReference,
    uid: &str,
    rs_owner: Option<&str>,
) -> bool {
    match kind {
        TargetKind::StatefulSet | TargetKind::DaemonSet => controller.uid == uid,
        TargetKind::Deployment | TargetKind::Rollout => {
            through_replicaset(kind, controller) && rs_owner == Some(uid)
        }
    }
}

/// Of the workload's pods (`of_what`, for messages): `wanted` if it is one, else a running one
/// (ready ones first, then by name).
pub(super) fn choose(mut candidates: Vec<Pod>, wanted: Option<&str>, of_what: &str) -> PodChoice {
    if let Some(wanted) = wanted {
        return match candidates.into_iter().find(|p| p.name_any() == wanted) {
            Some(p) => PodChoice::Chosen(Box::new(p)),
            None => PodChoice::Unavailable(
                "NoPod",
                format!("pod {wanted} is not a (live) pod of {of_what}"),
            ),
        };
    }
    candidates.sort_by_key(|p| (!is_running(p, true), p.name_any()));
    match candidates.into_iter().next() {
        Some(p) if is_running(&p, false) => PodChoice::Chosen(Box::new(p)),
        _ => PodChoice::Unavailable("NoPod", format!("{of_what} has no running pod")),
    }
}

/// Whether the pod runs (and, with `need_ready`, is ready).
pub(super) fn is_running(pod: &Pod, need_ready: bool) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    status.phase.as_deref() == Some("Running") && (ready || !need_ready)
}

// === Tunnel grants ===

/// Another user's live grant that holds `workstation` against request `me` of `user`: one
/// already in effect, or, while `me` is not (`ready` false), an older one not yet in effect.
/// (Creation times have whole seconds, so age alone would often be a coin toss: the uid
/// breaks ties.)
pub(super) fn holder<'a>(
    others: &'a [TunnelAccessRequest],
    me: &ObjectMeta,
    workstation: &str,
    user: &str,
    ready: bool,
) -> Option<&'a TunnelAccessRequest> {
    let mine = (me.creation_timestamp.clone(), me.uid.clone());
    others.iter().find(|o| {
        let in_effect = o.status.as_ref().is_some_and(|s| s.ready);
        o.spec.workstation == workstation
            && o.metadata.uid != me.uid
            && o.metadata.deletion_timestamp.is_none()
            && o.spec.requester.as_ref().map(|q| q.username.as_str()) != Some(user)
            && until(deadline(*o)) > Duration::ZERO
            && (in_effect
                || (!ready
                    && (
                        o.metadata.creation_timestamp.clone(),
                        o.metadata.uid.clone(),
                    ) < mine))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kube::core::Status;
    use serde_json::json;

    use super::*;

    /// A pod controlled by `controller` (`kind`, `name`, `uid`), running and ready or not.
    fn pod(
        name: &str,
        labels: serde_json::Value,
        controller: (&str, &str, &str),
        phase: &str,
        ready: bool,
    ) -> Pod {
        let (kind, owner, uid) = controller;
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "labels": labels,
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": kind, "name": owner, "uid": uid,
                    "controller": true,
                }],
            },
            "status": {
                "phase": phase,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn running(name: &str, ready: bool) -> Pod {
        pod(
            name,
            json!({}),
            ("ReplicaSet", "web-abc", "rs-1"),
            "Running",
            ready,
        )
    }

    fn chosen(c: PodChoice) -> Result<String, (&'static str, String)> {
        match c {
            PodChoice::Chosen(p) => Ok(p.name_any()),
            PodChoice::Unavailable(reason, message) => Err((reason, message)),
        }
    }

    #[test]
    fn a_found_debug_pod_is_used_only_when_it_is_this_requests_and_staying() {
        let mine = pod(
            "d",
            json!({}),
            ("PodAccessRequest", "alice-web", "req-1"),
            "Running",
            true,
        );
        assert!(existing_debug_pod(mine.clone(), "req-1", "d").is_ok());
        assert_eq!(
            existing_debug_pod(mine.clone(), "req-2", "d")
                .unwrap_err()
                .0,
            "PodConflict"
        );
        let mut going = mine;
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T10:00:00Z".parse().unwrap(),
            ));
        let (reason, message) = existing_debug_pod(going, "req-1", "d").unwrap_err();
        assert_eq!(reason, "PodGone");
        assert_eq!(message, "debug pod d is being deleted: file a new request");
    }

    #[test]
    fn a_refused_debug_pod_is_a_condition_other_failures_an_error() {
        let refused = |code| {
            Err(kube::Error::Api(
                Status::failure("quota", "Forbidden")
                    .with_code(code)
                    .boxed(),
            ))
        };
        assert_eq!(
            created_debug_pod(refused(409), "d").unwrap().unwrap_err().0,
            "Waiting"
        );
        for code in [403, 422] {
            let (reason, message) = created_debug_pod(refused(code), "d").unwrap().unwrap_err();
            assert_eq!(reason, "PodRefused");
            assert_eq!(message, "the debug pod was refused: quota");
        }
        assert!(created_debug_pod(refused(500), "d").is_err());
        assert!(
            created_debug_pod(Ok(running("d", false)), "d")
                .unwrap()
                .is_ok()
        );
    }

    #[test]
    fn only_live_pods_of_the_right_side_of_a_fork_are_candidates() {
        let baseline = running("web-1", true);
        assert_eq!(
            candidate(&baseline, None, "web").map(|c| c.uid),
            Some("rs-1".into())
        );
        assert!(
            candidate(&baseline, Some("sb"), "web-sb").is_none(),
            "not the fork's"
        );
        let forked = pod(
            "web-sb-1",
            json!({FORK: "web-sb"}),
            ("ReplicaSet", "x", "rs-2"),
            "Running",
            true,
        );
        assert!(
            candidate(&forked, None, "web").is_none(),
            "a baseline grant never reaches a fork"
        );
        assert!(candidate(&forked, Some("sb"), "web-sb").is_some());
        assert!(candidate(&forked, Some("other"), "web-other").is_none());
        let debug = pod(
            "d",
            json!({access_labels::ACCESS_REQUEST: "bob"}),
            ("ReplicaSet", "x", "rs-1"),
            "Running",
            true,
        );
        assert!(
            candidate(&debug, None, "web").is_none(),
            "another grant's debug pod"
        );
        let mut going = running("web-2", true);
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T10:00:00Z".parse().unwrap(),
            ));
        assert!(candidate(&going, None, "web").is_none());
        let mut orphan = running("web-3", true);
        orphan.metadata.owner_references = None;
        assert!(candidate(&orphan, None, "web").is_none());
    }

    #[test]
    fn a_pod_is_the_workloads_through_its_controller_chain() {
        let rs = OwnerReference {
            kind: "ReplicaSet".into(),
            uid: "rs-1".into(),
            ..OwnerReference::default()
        };
        assert!(through_replicaset(TargetKind::Deployment, &rs));
        assert!(!through_replicaset(TargetKind::StatefulSet, &rs));
        assert!(owned(TargetKind::Deployment, &rs, "dep-1", Some("dep-1")));
        assert!(!owned(TargetKind::Deployment, &rs, "dep-1", Some("dep-2")));
        assert!(!owned(TargetKind::Deployment, &rs, "dep-1", None));
        let sts = OwnerReference {
            kind: "StatefulSet".into(),
            uid: "sts-1".into(),
            ..OwnerReference::default()
        };
        assert!(owned(TargetKind::StatefulSet, &sts, "sts-1", None));
        assert!(!owned(TargetKind::DaemonSet, &sts, "ds-1", None));
        assert!(
            !owned(TargetKind::Rollout, &sts, "sts-1", Some("sts-1")),
            "a Rollout's pods are its ReplicaSets'"
        );
    }

    #[test]
    fn the_wanted_pod_else_a_ready_one_else_a_running_one() {
        let pods = || {
            vec![
                running("web-b", true),
                running("web-a", false),
                running("web-c", true),
            ]
        };
        assert_eq!(
            chosen(choose(pods(), None, "Deployment/web")),
            Ok("web-b".into())
        );
        assert_eq!(
            chosen(choose(pods(), Some("web-a"), "Deployment/web")),
            Ok("web-a".into())
        );
        let (reason, message) =
            chosen(choose(pods(), Some("web-z"), "Deployment/web")).unwrap_err();
        assert_eq!(reason, "NoPod");
        assert_eq!(message, "pod web-z is not a (live) pod of Deployment/web");
        assert_eq!(
            chosen(choose(vec![running("web-a", false)], None, "w")),
            Ok("web-a".into())
        );
        let pending = pod(
            "web-p",
            json!({}),
            ("ReplicaSet", "x", "rs-1"),
            "Pending",
            false,
        );
        assert_eq!(
            chosen(choose(vec![pending], None, "Deployment/web"))
                .unwrap_err()
                .1,
            "Deployment/web has no running pod"
        );
        assert!(chosen(choose(Vec::new(), None, "w")).is_err());
    }

    #[test]
    fn running_needs_the_phase_and_readiness_when_asked() {
        assert!(is_running(&running("a", true), true));
        assert!(!is_running(&running("a", false), true));
        assert!(is_running(&running("a", false), false));
        let pending = pod("p", json!({}), ("ReplicaSet", "x", "rs-1"), "Pending", true);
        assert!(!is_running(&pending, false));
        assert!(!is_running(&Pod::default(), false));
    }

    fn tunnel_request(
        name: &str,
        uid: &str,
        created: &str,
        user: &str,
        ready: bool,
    ) -> TunnelAccessRequest {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "TunnelAccessRequest",
            "metadata": {"name": name, "namespace": "shop", "uid": uid, "creationTimestamp": created},
            "spec": {
                "templateName": "tunnel", "workstation": "laptop", "tokenSha256": "abc",
                "requester": {"username": user},
            },
            "status": {"ready": ready},
        }))
        .unwrap()
    }

    #[test]
    fn a_workstation_is_held_by_a_live_grant_or_an_older_request_of_another_user() {
        let now = k8s_openapi::jiff::Timestamp::now();
        let earlier = now
            .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(60))
            .unwrap()
            .to_string();
        let later = now.to_string();
        let me = tunnel_request("alice", "u-alice", &later, "alice", false);
        let older_bob = tunnel_request("bob", "u-bob", &earlier, "bob", false);
        let newer_bob = tunnel_request(
            "bob",
            "u-bob",
            &now.checked_add(k8s_openapi::jiff::SignedDuration::from_secs(1))
                .unwrap()
                .to_string(),
            "bob",
            false,
        );
        let live_bob = tunnel_request("bob", "u-bob", &later, "bob", true);
        let holder_of = |others: Vec<TunnelAccessRequest>, ready: bool| {
            holder(&others, &me.metadata, "laptop", "alice", ready).map(|h| h.name_any())
        };
        assert_eq!(
            holder_of(vec![older_bob.clone()], false),
            Some("bob".into())
        );
        assert_eq!(
            holder_of(vec![older_bob], true),
            None,
            "a grant in effect keeps it"
        );
        assert_eq!(holder_of(vec![newer_bob], false), None);
        assert_eq!(holder_of(vec![live_bob.clone()], true), Some("bob".into()));
        let mine_too = tunnel_request("alice-2", "u-a2", &earlier, "alice", true);
        assert_eq!(
            holder_of(vec![mine_too, me.clone()], false),
            None,
            "the same user, or itself"
        );
        let mut elsewhere = live_bob;
        elsewhere.spec.workstation = "desktop".into();
        assert_eq!(holder_of(vec![elsewhere], false), None);
    }
}
