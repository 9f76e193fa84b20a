//! A request's and a template's status from what a pass observed, as pure functions: each step
//! of a grant (`super::grant`) records here what it found, so the conditions, phase and
//! messages are decided without an apiserver.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use spur_api::access::{
    AccessConfig, AccessRequestStatus, AccessTemplateStatus, ApprovalState, Approver, Grant,
    PodAccessTemplateSpec, Requester, conditions as cond, format_access_duration,
};
use spur_api::conditions::{ConditionStatus, NewCondition, READY, set_condition};

use super::targets::default_container;
use super::{AccessRequest, Refusal, Template, kind_name};
use spur_operator_core::now;

/// Sets one condition of a request's status.
pub(super) fn mark(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    type_: &str,
    ok: ConditionStatus,
    reason: &str,
    message: &str,
) {
    spur_api::conditions::set_now(
        &mut status.conditions,
        generation,
        type_,
        ok,
        reason,
        message,
    );
}

/// The request is not (or no longer) granted: `Ready=False`; the two resource conditions say
/// `Removed` when something of the grant was (`removed`) or the request was ready.
pub(super) fn withheld(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    removed: bool,
    reason: &str,
    message: &str,
) {
    if removed || status.ready {
        for type_ in [cond::ACCESS_RESOURCES_CREATED, cond::ACCESS_RESOURCES_READY] {
            mark(
                status,
                generation,
                type_,
                ConditionStatus::False,
                "Removed",
                message,
            );
        }
    }
    not_ready(status, generation, reason, message);
}

/// `Ready=False`, and no command to run.
fn not_ready(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
) {
    status.ready = false;
    status.access_message = None;
    mark(
        status,
        generation,
        READY,
        ConditionStatus::False,
        reason,
        message,
    );
}

/// Why a request's template grants nothing: it is not there (`found` false) or not ready.
pub(super) fn template_unusable<K: AccessRequest>(found: bool, ns: &str, name: &str) -> Refusal {
    if found {
        (
            "TemplateNotReady",
            format!("template {name} is not ready (see its conditions)"),
        )
    } else {
        (
            "TemplateNotFound",
            format!(
                "no {} {name} in namespace {ns}",
                kind_name::<K>().replace("Request", "Template")
            ),
        )
    }
}

/// The requester, if the webhook stamped one and the template lets them ask.
pub(super) fn requester<'a>(
    requester: Option<&'a Requester>,
    access: &AccessConfig,
) -> Result<&'a Requester, Refusal> {
    let Some(requester) = requester.filter(|q| !q.username.is_empty()) else {
        return Err((
            "NoRequester",
            "spec.requester is not set: the access webhook stamps it at admission (is the chart's access.enabled on?)".into(),
        ));
    };
    if !access.allows(&requester.groups) {
        return Err((
            "NotInAllowedGroups",
            format!(
                "{} is in none of the template's allowed groups ({})",
                requester.username,
                access.allowed_groups.join(", ")
            ),
        ));
    }
    Ok(requester)
}

/// Records the request's approval (condition `Approved`, `approvedBy`); without the approval
/// its template requires, why not.
pub(super) fn approval<K: AccessRequest>(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    access: &AccessConfig,
    requester: &Requester,
    approver: Option<&Approver>,
    (ns, name): (&str, &str),
) -> Result<(), Refusal> {
    let (reason, message) = match access.approval_state(&requester.username, approver) {
        ApprovalState::NotRequired => {
            status.approved_by = None;
            let message = "the template requires no approval";
            mark(
                status,
                generation,
                cond::APPROVED,
                ConditionStatus::True,
                "NotRequired",
                message,
            );
            return Ok(());
        }
        ApprovalState::Approved(user) => {
            let message = format!("approved by {user}");
            status.approved_by = Some(user);
            mark(
                status,
                generation,
                cond::APPROVED,
                ConditionStatus::True,
                "Approved",
                &message,
            );
            return Ok(());
        }
        ApprovalState::Pending => (
            "PendingApproval",
            format!(
                "waiting for approval by a user other than {} who holds the verb approve on {}: \
                 spur access approve {} {name} -n {ns}",
                requester.username,
                plural::<K>(),
                K::ACCESS,
            ),
        ),
        ApprovalState::ByRequester => (
            "SelfApproved",
            format!(
                "{} cannot approve their own request: another user must approve it",
                requester.username
            ),
        ),
        ApprovalState::NotAnApprover(user) => (
            "ApproverNotAllowed",
            format!(
                "{user} approved it but presented none of the template's approver groups ({}): \
                 a member of one must approve it",
                access
                    .approval
                    .as_ref()
                    .map(|a| a.approvers.join(", "))
                    .unwrap_or_default()
            ),
        ),
    };
    status.approved_by = None;
    mark(
        status,
        generation,
        cond::APPROVED,
        ConditionStatus::False,
        reason,
        &message,
    );
    Err((reason, message))
}

/// The request kind's resource name, as RBAC names it.
fn plural<K: AccessRequest>() -> String {
    format!("{}s", kind_name::<K>().to_ascii_lowercase())
}

/// Decides the grant's duration and expiry, once (a template changed later does not stretch
/// a grant). An approved grant runs from the approval (seen `now`), not from the filing
/// (`created`): waiting for an approver does not eat into it. `grant` is the template's answer
/// to the duration asked (`asked`); its error is the refusal's message.
pub(super) fn expiry(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    grant: Result<Grant, String>,
    asked: Option<&str>,
    (created, now): (Timestamp, Timestamp),
) -> Result<(), String> {
    let g = match grant {
        Ok(g) => g,
        Err(e) => {
            mark(
                status,
                generation,
                cond::ACCESS_DURATIONS_VALID,
                ConditionStatus::False,
                "Invalid",
                &e,
            );
            return Err(e);
        }
    };
    // The deadline still never passes creation plus the longest grant (`super::deadline`).
    let start = if status.approved_by.is_some() {
        now
    } else {
        created
    };
    let at = start.checked_add(g.duration).unwrap_or(start);
    let message = if g.capped {
        format!(
            "asked for {}, above the template's maximum: granted {}",
            asked.unwrap_or_default(),
            format_access_duration(g.duration)
        )
    } else {
        format!("granted {}", format_access_duration(g.duration))
    };
    let reason = if g.capped { "Capped" } else { "Valid" };
    mark(
        status,
        generation,
        cond::ACCESS_DURATIONS_VALID,
        ConditionStatus::True,
        reason,
        &message,
    );
    status.duration = Some(format_access_duration(g.duration));
    status.expires_at = Some(Time(at));
    mark(
        status,
        generation,
        cond::ACCESS_STILL_VALID,
        ConditionStatus::True,
        "NotExpired",
        "",
    );
    Ok(())
}

/// The pod chosen first is gone (or no longer the workload's) when another is chosen now: a
/// grant never moves. The message, when it has.
pub(super) fn pod_gone(status: &AccessRequestStatus, chosen: &str) -> Option<String> {
    let first = status.pod_name.as_deref().filter(|p| *p != chosen)?;
    Some(format!("pod {first} is gone: file a new request"))
}

/// The container a grant names: the template's, else the pod's default one.
pub(super) fn container(template: &Template, pod: &Pod) -> Option<String> {
    match template {
        Template::Exec(t) => t.spec.container.clone(),
        Template::Pod(t) => t
            .spec
            .mutation
            .as_ref()
            .and_then(|m| m.default_container.clone()),
        Template::Tunnel(_) => None,
    }
    .or_else(|| default_container(pod))
}

/// The Role and RoleBinding are there, but the pod is not running (`running` false) or the API
/// server does not yet let the requester exec into it.
pub(super) fn waiting(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    running: bool,
    pod: &str,
    user: &str,
) {
    let message = if running {
        format!("the API server does not yet allow {user} to exec into {pod}")
    } else {
        format!("pod {pod} is not running and ready yet")
    };
    mark(
        status,
        generation,
        cond::ACCESS_RESOURCES_READY,
        ConditionStatus::False,
        "Waiting",
        &message,
    );
    not_ready(status, generation, "Waiting", &message);
}

/// The grant is in place: `Ready=True` with the command to run (`access_message`); the
/// message, for the event.
pub(super) fn granted(
    status: &mut AccessRequestStatus,
    generation: Option<i64>,
    access_message: String,
    message: String,
) -> String {
    mark(
        status,
        generation,
        cond::ACCESS_RESOURCES_READY,
        ConditionStatus::True,
        "Allowed",
        "",
    );
    status.access_message = Some(access_message);
    status.ready = true;
    mark(
        status,
        generation,
        READY,
        ConditionStatus::True,
        "Granted",
        &message,
    );
    message
}

/// The grant's expiry as written on the status (empty before it is decided).
pub(super) fn expires(status: &AccessRequestStatus) -> String {
    status
        .expires_at
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default()
}

/// Why a PodAccessTemplate's spec is unusable: `validate`'s answer, then a pod spec that does
/// not read as one.
pub(super) fn pod_template_valid(spec: &PodAccessTemplateSpec) -> Result<(), String> {
    spec.validate().map_err(|e| e.to_string())?;
    if let Some(pod_spec) = &spec.pod_spec
        && let Err(e) =
            serde_json::from_value::<k8s_openapi::api::core::v1::PodSpec>(pod_spec.clone())
    {
        return Err(format!("spec.podSpec: {e}"));
    }
    Ok(())
}

/// A template's status: whether its spec is valid (`valid`) and its target exists (`target`;
/// `None`: it names none).
pub(super) fn template(
    old: Option<&AccessTemplateStatus>,
    generation: Option<i64>,
    valid: Result<(), String>,
    target: Option<Result<(), String>>,
) -> AccessTemplateStatus {
    let mut status = old.cloned().unwrap_or_default();
    let t = now();
    let mut set = |type_, ok: bool, reason: &str, message: &str| {
        set_condition(
            &mut status.conditions,
            NewCondition {
                type_,
                status: ok.into(),
                reason,
                message,
                observed_generation: generation,
            },
            &t,
        );
    };
    match &valid {
        Ok(()) => set(cond::TEMPLATE_DURATIONS_VALID, true, "Valid", ""),
        Err(e) => set(cond::TEMPLATE_DURATIONS_VALID, false, "Invalid", e),
    }
    match &target {
        None => set(
            cond::TARGET_REF_EXISTS,
            true,
            "NoTarget",
            "the template names no workload",
        ),
        Some(Ok(())) => set(cond::TARGET_REF_EXISTS, true, "Found", ""),
        Some(Err(e)) => set(cond::TARGET_REF_EXISTS, false, "NotFound", e),
    }
    let ready = valid.is_ok() && target.as_ref().is_none_or(Result::is_ok);
    let message = match (&valid, &target) {
        (Err(e), _) | (_, Some(Err(e))) => e.as_str(),
        _ => "",
    };
    set(
        READY,
        ready,
        if ready { "Ready" } else { "NotReady" },
        message,
    );
    status.ready = ready;
    status.observed_generation = generation;
    status
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use serde_json::json;
    use spur_api::access::{ExecAccessRequest, ExecAccessTemplate, PodAccessTemplate};

    use super::*;

    fn condition<'a>(conditions: &'a [Condition], type_: &str) -> &'a Condition {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no condition {type_} in {conditions:?}"))
    }

    /// `(status, reason)` of condition `type_`.
    fn cond_of(st: &AccessRequestStatus, type_: &str) -> (String, String) {
        let c = condition(&st.conditions, type_);
        (c.status.clone(), c.reason.clone())
    }

    fn access(extra: serde_json::Value) -> AccessConfig {
        let mut config = json!({"allowedGroups": ["devs"], "maxDuration": "2h"});
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        serde_json::from_value(config).unwrap()
    }

    fn alice() -> Requester {
        serde_json::from_value(json!({"username": "alice", "groups": ["devs"]})).unwrap()
    }

    fn exec_template() -> Template {
        Template::Exec(
            serde_json::from_value::<ExecAccessTemplate>(json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "ExecAccessTemplate",
                "metadata": {"name": "web", "namespace": "shop"},
                "spec": {
                    "accessConfig": {"allowedGroups": ["devs"]},
                    "targetRef": {"kind": "Deployment", "name": "web"},
                },
            }))
            .unwrap(),
        )
    }

    fn pod(annotations: serde_json::Value, containers: &[&str]) -> Pod {
        let containers: Vec<_> = containers
            .iter()
            .map(|c| json!({"name": c, "image": "x"}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "annotations": annotations},
            "spec": {"containers": containers},
        }))
        .unwrap()
    }

    #[test]
    fn withheld_says_removed_only_when_something_was_granted() {
        let mut st = AccessRequestStatus::default();
        withheld(&mut st, Some(1), false, "NoRequester", "no requester");
        assert_eq!(cond_of(&st, READY), ("False".into(), "NoRequester".into()));
        assert!(
            !st.conditions
                .iter()
                .any(|c| c.type_ == cond::ACCESS_RESOURCES_CREATED),
            "nothing was granted: {:?}",
            st.conditions
        );

        let mut st = AccessRequestStatus {
            ready: true,
            access_message: Some("kubectl exec".into()),
            ..AccessRequestStatus::default()
        };
        withheld(&mut st, Some(2), false, "PodGone", "pod web-1 is gone");
        assert!(!st.ready);
        assert_eq!(st.access_message, None);
        for type_ in [cond::ACCESS_RESOURCES_CREATED, cond::ACCESS_RESOURCES_READY] {
            let c = condition(&st.conditions, type_);
            assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Removed"));
            assert_eq!(c.message, "pod web-1 is gone");
            assert_eq!(c.observed_generation, Some(2));
        }
        assert_eq!(cond_of(&st, READY), ("False".into(), "PodGone".into()));
    }

    #[test]
    fn a_missing_template_and_a_broken_one_are_told_apart() {
        let (reason, message) = template_unusable::<ExecAccessRequest>(false, "shop", "web");
        assert_eq!(reason, "TemplateNotFound");
        assert_eq!(message, "no ExecAccessTemplate web in namespace shop");
        let (reason, message) = template_unusable::<ExecAccessRequest>(true, "shop", "web");
        assert_eq!(reason, "TemplateNotReady");
        assert!(message.contains("template web is not ready"), "{message}");
    }

    #[test]
    fn the_requester_must_be_stamped_and_in_an_allowed_group() {
        let config = access(json!({}));
        let q = alice();
        assert_eq!(
            requester(Some(&q), &config).map(|q| &q.username),
            Ok(&q.username)
        );
        assert_eq!(requester(None, &config).unwrap_err().0, "NoRequester");
        let nameless = Requester {
            username: String::new(),
            ..alice()
        };
        assert_eq!(
            requester(Some(&nameless), &config).unwrap_err().0,
            "NoRequester"
        );
        let outsider = Requester {
            groups: vec!["ops".into()],
            ..alice()
        };
        let (reason, message) = requester(Some(&outsider), &config).unwrap_err();
        assert_eq!(reason, "NotInAllowedGroups");
        assert_eq!(
            message,
            "alice is in none of the template's allowed groups (devs)"
        );
    }

    #[test]
    fn approval_opens_only_for_another_user_of_an_approver_group() {
        let approve = |config: &AccessConfig, by: Option<(&str, &str)>| {
            let mut st = AccessRequestStatus {
                approved_by: Some("stale".into()),
                ..AccessRequestStatus::default()
            };
            let approver = by.map(|(user, group)| Approver {
                username: user.into(),
                groups: vec![group.into()],
            });
            let result = approval::<ExecAccessRequest>(
                &mut st,
                Some(1),
                config,
                &alice(),
                approver.as_ref(),
                ("shop", "alice-web"),
            );
            (result, st)
        };
        let (result, st) = approve(&access(json!({})), None);
        assert_eq!(result, Ok(()));
        assert_eq!(st.approved_by, None);
        assert_eq!(
            cond_of(&st, cond::APPROVED),
            ("True".into(), "NotRequired".into())
        );

        let required = access(json!({"approval": {"required": true, "approvers": ["leads"]}}));
        let (result, st) = approve(&required, Some(("bob", "leads")));
        assert_eq!(result, Ok(()));
        assert_eq!(st.approved_by.as_deref(), Some("bob"));
        assert_eq!(
            condition(&st.conditions, cond::APPROVED).message,
            "approved by bob"
        );

        let (result, st) = approve(&required, None);
        let (reason, message) = result.unwrap_err();
        assert_eq!(reason, "PendingApproval");
        assert!(
            message.ends_with("execaccessrequests: spur access approve exec alice-web -n shop"),
            "{message}"
        );
        assert_eq!(st.approved_by, None);
        assert_eq!(
            cond_of(&st, cond::APPROVED),
            ("False".into(), "PendingApproval".into())
        );

        let (result, _) = approve(&required, Some(("alice", "leads")));
        assert_eq!(result.unwrap_err().0, "SelfApproved");
        let (result, _) = approve(&required, Some(("bob", "devs")));
        let (reason, message) = result.unwrap_err();
        assert_eq!(reason, "ApproverNotAllowed");
        assert!(message.contains("(leads)"), "{message}");
    }

    #[test]
    fn the_expiry_runs_from_creation_or_from_the_approval() {
        let created: Timestamp = "2026-01-01T10:00:00Z".parse().unwrap();
        let now: Timestamp = "2026-01-01T10:30:00Z".parse().unwrap();
        let hour = Grant {
            duration: Duration::from_secs(3600),
            capped: false,
        };
        let mut st = AccessRequestStatus::default();
        assert_eq!(
            expiry(&mut st, Some(1), Ok(hour), None, (created, now)),
            Ok(())
        );
        assert_eq!(
            st.expires_at.as_ref().map(|t| t.0.to_string()).as_deref(),
            Some("2026-01-01T11:00:00Z")
        );
        assert_eq!(st.duration.as_deref(), Some("1h"));
        assert_eq!(
            cond_of(&st, cond::ACCESS_DURATIONS_VALID),
            ("True".into(), "Valid".into())
        );
        assert_eq!(
            cond_of(&st, cond::ACCESS_STILL_VALID),
            ("True".into(), "NotExpired".into())
        );

        let mut approved = AccessRequestStatus {
            approved_by: Some("bob".into()),
            ..AccessRequestStatus::default()
        };
        let capped = Grant {
            capped: true,
            ..hour
        };
        expiry(
            &mut approved,
            Some(1),
            Ok(capped),
            Some("9h"),
            (created, now),
        )
        .unwrap();
        assert_eq!(
            approved
                .expires_at
                .as_ref()
                .map(|t| t.0.to_string())
                .as_deref(),
            Some("2026-01-01T11:30:00Z")
        );
        let c = condition(&approved.conditions, cond::ACCESS_DURATIONS_VALID);
        assert_eq!(c.reason, "Capped");
        assert_eq!(
            c.message,
            "asked for 9h, above the template's maximum: granted 1h"
        );

        let mut invalid = AccessRequestStatus::default();
        let e = expiry(
            &mut invalid,
            Some(1),
            Err("bad".into()),
            None,
            (created, now),
        );
        assert_eq!(e, Err("bad".into()));
        assert_eq!(invalid.expires_at, None);
        assert_eq!(
            cond_of(&invalid, cond::ACCESS_DURATIONS_VALID),
            ("False".into(), "Invalid".into())
        );
        assert!(
            !invalid
                .conditions
                .iter()
                .any(|c| c.type_ == cond::ACCESS_STILL_VALID)
        );
    }

    #[test]
    fn a_grant_never_moves_to_another_pod() {
        let mut st = AccessRequestStatus::default();
        assert_eq!(pod_gone(&st, "web-2"), None);
        st.pod_name = Some("web-1".into());
        assert_eq!(pod_gone(&st, "web-1"), None);
        assert_eq!(
            pod_gone(&st, "web-2").as_deref(),
            Some("pod web-1 is gone: file a new request")
        );
    }

    #[test]
    fn the_container_is_the_templates_else_the_pods_default() {
        let annotated = pod(
            json!({"kubectl.kubernetes.io/default-container": "app"}),
            &["spur-proxy", "app"],
        );
        assert_eq!(
            container(&exec_template(), &annotated).as_deref(),
            Some("app")
        );
        let plain = pod(
            json!({}),
            &[spur_api::keys::injection::SIDECAR_CONTAINER, "main"],
        );
        assert_eq!(container(&exec_template(), &plain).as_deref(), Some("main"));
        let Template::Exec(mut t) = exec_template() else {
            unreachable!()
        };
        t.spec.container = Some("debug".into());
        assert_eq!(
            container(&Template::Exec(t), &plain).as_deref(),
            Some("debug")
        );
        let pod_template: PodAccessTemplate = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "PodAccessTemplate",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {
                "accessConfig": {"allowedGroups": ["devs"]},
                "podSpec": {"containers": [{"name": "tools"}]},
                "mutation": {"defaultContainer": "tools"},
            },
        }))
        .unwrap();
        assert_eq!(
            container(&Template::Pod(pod_template), &plain).as_deref(),
            Some("tools")
        );
    }

    #[test]
    fn waiting_and_granted_set_ready_and_the_command() {
        let mut st = AccessRequestStatus::default();
        waiting(&mut st, Some(1), false, "web-1", "alice");
        assert!(!st.ready);
        let c = condition(&st.conditions, READY);
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Waiting"));
        assert_eq!(c.message, "pod web-1 is not running and ready yet");
        waiting(&mut st, Some(1), true, "web-1", "alice");
        assert_eq!(
            condition(&st.conditions, cond::ACCESS_RESOURCES_READY).message,
            "the API server does not yet allow alice to exec into web-1"
        );

        let message = granted(&mut st, Some(1), "kubectl exec".into(), "alice may".into());
        assert_eq!(message, "alice may");
        assert!(st.ready);
        assert_eq!(st.access_message.as_deref(), Some("kubectl exec"));
        assert_eq!(cond_of(&st, READY), ("True".into(), "Granted".into()));
        assert_eq!(
            cond_of(&st, cond::ACCESS_RESOURCES_READY),
            ("True".into(), "Allowed".into())
        );

        waiting(&mut st, Some(1), false, "web-1", "alice");
        assert!(!st.ready, "a pod that stops running takes Ready back");
        assert_eq!(st.access_message, None);
    }

    #[test]
    fn expires_is_empty_until_decided() {
        let mut st = AccessRequestStatus::default();
        assert_eq!(expires(&st), "");
        st.expires_at = Some(Time("2026-01-01T11:00:00Z".parse().unwrap()));
        assert_eq!(expires(&st), "2026-01-01T11:00:00Z");
    }

    fn template_cond(st: &AccessTemplateStatus, type_: &str) -> (String, String, String) {
        let c = condition(&st.conditions, type_);
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn a_template_is_ready_when_valid_and_its_target_exists() {
        // An exec or pod template whose workload is there.
        let st = template(None, Some(3), Ok(()), Some(Ok(())));
        assert!(st.ready);
        assert_eq!(st.observed_generation, Some(3));
        assert_eq!(template_cond(&st, cond::TARGET_REF_EXISTS).1, "Found");
        assert_eq!(template_cond(&st, READY).1, "Ready");

        // Its workload gone: not ready, and Ready says why.
        let gone = template(Some(&st), Some(4), Ok(()), Some(Err("no web".into())));
        assert!(!gone.ready);
        assert_eq!(
            template_cond(&gone, cond::TARGET_REF_EXISTS),
            ("False".into(), "NotFound".into(), "no web".into())
        );
        assert_eq!(
            template_cond(&gone, READY),
            ("False".into(), "NotReady".into(), "no web".into())
        );

        // A tunnel template (or a pod-spec one) names no workload.
        let tunnel = template(None, Some(1), Ok(()), None);
        assert!(tunnel.ready);
        assert_eq!(
            template_cond(&tunnel, cond::TARGET_REF_EXISTS).1,
            "NoTarget"
        );

        // An invalid spec is the first reason, before the target's.
        let invalid = template(
            None,
            Some(1),
            Err("bad duration".into()),
            Some(Err("no web".into())),
        );
        assert!(!invalid.ready);
        assert_eq!(
            template_cond(&invalid, cond::TEMPLATE_DURATIONS_VALID),
            ("False".into(), "Invalid".into(), "bad duration".into())
        );
        assert_eq!(template_cond(&invalid, READY).2, "bad duration");
    }

    #[test]
    fn a_pod_template_needs_a_readable_pod_spec() {
        let spec = |pod_spec: serde_json::Value| -> PodAccessTemplateSpec {
            serde_json::from_value(json!({
                "accessConfig": {"allowedGroups": ["devs"]},
                "podSpec": pod_spec,
            }))
            .unwrap()
        };
        assert_eq!(
            pod_template_valid(&spec(json!({"containers": [{"name": "tools"}]}))),
            Ok(())
        );
        let e = pod_template_valid(&spec(json!({"containers": "tools"}))).unwrap_err();
        assert!(e.starts_with("spec.podSpec: "), "{e}");
    }
}
