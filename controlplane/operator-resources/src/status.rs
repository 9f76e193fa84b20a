//! Resource and ResourcePlugin status from what their children report, as pure functions.

use kube::{Resource as _, ResourceExt};
use spur_api::conditions::{ConditionStatus, READY, set_now};
use spur_api::resources::{
    OlmPhase, OlmStatus, ResourcePhase, ResourcePluginStatus, StepFailure, UnitPhase, UnitStatus,
};
use spur_api::sandbox::ResourceStatusSummary;
use spur_api::{Resource, ResourcePlugin, ResourceStatus};

/// A plugin's status from its verdict (`Some(why)` when sandboxes cannot use it), and the
/// message of its `Ready` condition.
pub(super) fn plugin(
    plugin: &ResourcePlugin,
    verdict: Option<&str>,
) -> (ResourcePluginStatus, String) {
    let mut st = plugin.status.clone().unwrap_or_default();
    st.observed_generation = plugin.meta().generation;
    let (status, reason, message) = match verdict {
        None => (
            ConditionStatus::True,
            "Valid",
            "sandboxes can use this plugin".to_string(),
        ),
        Some(why) => (ConditionStatus::False, "Invalid", why.to_owned()),
    };
    set_now(
        &mut st.conditions,
        plugin.meta().generation,
        READY,
        status,
        reason,
        &message,
    );
    (st, message)
}

/// A Resource's status while it lives, from its OLM's status and the output keys published
/// (read only in phase `Started`). The second value is the message of a create failure that
/// is news (the status changed with it): the caller records it as a Warning event.
pub(super) fn applied(
    res: &Resource,
    ost: &OlmStatus,
    output_keys: Vec<String>,
) -> (ResourceStatus, Option<String>) {
    let name = res.name_any();
    let old = res.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.io_context_name = Some(name.clone());
    st.olm_name = Some(name.clone());
    st.create = ost.pre_start.clone();
    st.delete = ost.post_stop.clone();
    st.observed_generation = res.meta().generation;
    let mut news = None;
    match ost.phase {
        OlmPhase::Pending | OlmPhase::Starting => {
            st.phase = ResourcePhase::Creating;
            st.failure = None;
            let msg = progress_message(&st);
            condition(&mut st, res, false, "Creating", &msg);
        }
        OlmPhase::Failed => {
            st.phase = ResourcePhase::Failed;
            let f = first_failure(&ost.pre_start).unwrap_or_else(|| StepFailure {
                step: String::new(),
                attempts: 0,
                message: ost
                    .conditions
                    .iter()
                    .find(|c| c.type_ == READY)
                    .map(|c| c.message.clone())
                    .unwrap_or_else(|| "the create workflow failed".into()),
                log_tail: None,
            });
            let msg = failure_message(&f);
            st.failure = Some(f);
            if st != old {
                news = Some(msg.clone());
            }
            condition(&mut st, res, false, "CreateFailed", &msg);
        }
        OlmPhase::Started => {
            st.phase = ResourcePhase::Ready;
            st.failure = None;
            st.output_secret = Some(name.clone());
            st.output_keys = output_keys;
            condition(
                &mut st,
                res,
                true,
                "Ready",
                &format!(
                    "created; outputs in Secret {name} of namespace(s) {}",
                    res.spec.output_namespaces.join(", ")
                ),
            );
        }
        OlmPhase::Stopping | OlmPhase::Stopped => {}
    }
    (st, news)
}

/// A Resource's status while its OLM runs the delete workflow.
pub(super) fn deleting(res: &Resource, ost: &OlmStatus) -> ResourceStatus {
    let mut st = res.status.clone().unwrap_or_default();
    st.phase = ResourcePhase::Deleting;
    st.create = ost.pre_start.clone();
    st.delete = ost.post_stop.clone();
    st.failure = first_failure(&ost.post_stop);
    let msg = match &st.failure {
        Some(f) => failure_message(f),
        None => progress_message(&st),
    };
    condition(&mut st, res, false, "Deleting", &msg);
    st
}

/// A sandbox's entry for its resource `name` (Resource `res`), and the phase it reports
/// (`Deleting` once the Resource's deletion started). `quiet_when_ready`: a Ready resource
/// without a failure gets no message.
pub(super) fn summary(
    name: &str,
    res: &Resource,
    quiet_when_ready: bool,
) -> (ResourceStatusSummary, ResourcePhase) {
    let st = res.status.clone().unwrap_or_default();
    let phase = if res.meta().deletion_timestamp.is_some() {
        ResourcePhase::Deleting
    } else {
        st.phase
    };
    let message = match (&st.failure, phase) {
        (Some(f), _) => Some(failure_message(f)),
        (None, ResourcePhase::Ready) if quiet_when_ready => None,
        (None, _) => Some(progress_message(&st)),
    };
    let entry = ResourceStatusSummary {
        name: name.to_owned(),
        resource: Some(res.name_any()),
        plugin: Some(res.spec.plugin.clone()),
        phase: phase.as_str().into(),
        output_secret: st.output_secret.clone(),
        message,
    };
    (entry, phase)
}

pub(super) fn failure_message(f: &StepFailure) -> String {
    let mut m = format!("step {} failed", f.step);
    if f.attempts > 1 {
        m.push_str(&format!(" (attempt {})", f.attempts));
    }
    m.push_str(&format!(": {}", f.message));
    if let Some(tail) = f.log_tail.as_deref().filter(|t| !t.is_empty()) {
        m.push_str(&format!("; log: {tail}"));
    }
    m
}

fn progress_message(st: &ResourceStatus) -> String {
    let units = match st.phase {
        ResourcePhase::Deleting => &st.delete,
        _ => &st.create,
    };
    match units.iter().find(|u| !u.phase.is_done()) {
        Some(u) => format!(
            "step {}: {}",
            u.name,
            u.message.clone().unwrap_or_else(|| "pending".into())
        ),
        None => st.phase.as_str().to_string(),
    }
}

fn first_failure(units: &[UnitStatus]) -> Option<StepFailure> {
    units
        .iter()
        .find(|u| u.phase == UnitPhase::Failed)
        .map(|u| StepFailure {
            step: u.name.clone(),
            attempts: u.attempts,
            message: u.message.clone().unwrap_or_default(),
            log_tail: u.log_tail.clone(),
        })
}

fn condition(st: &mut ResourceStatus, res: &Resource, ok: bool, reason: &str, message: &str) {
    set_now(
        &mut st.conditions,
        res.meta().generation,
        READY,
        ok,
        reason,
        message,
    );
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use serde_json::json;
    use spur_api::conditions::find_condition;

    use super::*;

    pub(crate) fn resource(status: serde_json::Value) -> Resource {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Resource",
            "metadata": {"name": "sb-db", "uid": "res-uid", "generation": 2},
            "spec": {
                "sandbox": "sb", "name": "db", "plugin": "postgres.1.0.0",
                "routingKey": "k1", "outputNamespaces": ["a", "b"],
                "olm": {"preStart": [{
                    "name": "create", "type": "ExecUnit",
                    "outputs": [{"name": "dsn"}, {"name": "user"}],
                    "execUnitTemplate": {"podTemplate": {"spec": {"containers": [{"name": "step", "image": "pg"}]}}}
                }]}
            },
            "status": status,
        }))
        .unwrap()
    }

    fn olm_status(v: serde_json::Value) -> OlmStatus {
        serde_json::from_value(v).unwrap()
    }

    fn ready(st: &ResourceStatus) -> (String, String, String) {
        let c = find_condition(&st.conditions, READY).unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn a_running_create_workflow_says_which_step_runs() {
        let ost = olm_status(json!({"phase": "Starting", "preStart": [
            {"name": "create", "phase": "Running", "attempts": 1, "message": "attempt 1: pod p runs"}
        ]}));
        let (st, news) = applied(&resource(json!({})), &ost, Vec::new());
        assert_eq!(st.phase, ResourcePhase::Creating);
        assert_eq!(st.olm_name.as_deref(), Some("sb-db"));
        assert_eq!(st.observed_generation, Some(2));
        assert_eq!(st.create.len(), 1);
        assert_eq!(news, None);
        let (status, reason, message) = ready(&st);
        assert_eq!((status.as_str(), reason.as_str()), ("False", "Creating"));
        assert_eq!(message, "step create: attempt 1: pod p runs");
    }

    #[test]
    fn a_failed_create_step_fails_the_resource_once() {
        let ost = olm_status(json!({"phase": "Failed", "preStart": [
            {"name": "create", "phase": "Failed", "attempts": 1, "message": "the step failed (exit code 3)", "logTail": "boom"}
        ]}));
        let (st, news) = applied(&resource(json!({})), &ost, Vec::new());
        assert_eq!(st.phase, ResourcePhase::Failed);
        let want = "step create failed: the step failed (exit code 3); log: boom";
        assert_eq!(news.as_deref(), Some(want));
        assert_eq!(ready(&st).2, want);
        assert_eq!(st.failure.as_ref().unwrap().step, "create");
        // The next pass finds the failure recorded: no second event.
        let again = resource(serde_json::to_value(&st).unwrap());
        let (st2, news2) = applied(&again, &ost, Vec::new());
        assert_eq!(news2, None);
        assert_eq!(st2.phase, ResourcePhase::Failed);
    }

    #[test]
    fn an_olm_failed_without_a_unit_reports_its_ready_message() {
        let ost = olm_status(json!({"phase": "Failed", "conditions": [{
            "type": "Ready", "status": "False", "reason": "Invalid", "message": "spec.preStart: bad",
            "lastTransitionTime": "2026-01-01T00:00:00Z"
        }]}));
        let (st, _) = applied(&resource(json!({})), &ost, Vec::new());
        assert_eq!(ready(&st).2, "step  failed: spec.preStart: bad");
    }

    #[test]
    fn a_started_olm_makes_the_resource_ready_with_its_outputs() {
        let ost = olm_status(json!({"phase": "Started"}));
        let prior = json!({"phase": "Creating", "failure": {"step": "x", "message": "old"}});
        let (st, news) = applied(&resource(prior), &ost, vec!["create.dsn".into()]);
        assert_eq!(st.phase, ResourcePhase::Ready);
        assert_eq!(st.failure, None);
        assert_eq!(st.output_secret.as_deref(), Some("sb-db"));
        assert_eq!(st.output_keys, ["create.dsn"]);
        assert_eq!(news, None);
        let (status, reason, message) = ready(&st);
        assert_eq!((status.as_str(), reason.as_str()), ("True", "Ready"));
        assert_eq!(
            message,
            "created; outputs in Secret sb-db of namespace(s) a, b"
        );
    }

    #[test]
    fn deleting_reports_the_delete_steps_failure_or_progress() {
        let ost = olm_status(json!({"phase": "Stopping", "postStop": [
            {"name": "drop", "phase": "Failed", "attempts": 2, "message": "attempt 2 failed: x; retrying in 20s"}
        ]}));
        let st = deleting(&resource(json!({"phase": "Ready"})), &ost);
        assert_eq!(st.phase, ResourcePhase::Deleting);
        assert_eq!(
            ready(&st).2,
            "step drop failed (attempt 2): attempt 2 failed: x; retrying in 20s"
        );
        let ost = olm_status(
            json!({"phase": "Stopping", "postStop": [{"name": "drop", "phase": "Pending"}]}),
        );
        let st = deleting(&resource(json!({})), &ost);
        assert_eq!(st.failure, None);
        assert_eq!(ready(&st).2, "step drop: pending");
    }

    #[test]
    fn a_sandbox_entry_is_quiet_only_when_ready_and_asked() {
        let res = resource(json!({"phase": "Ready", "outputSecret": "sb-db"}));
        let (entry, phase) = summary("db", &res, true);
        assert_eq!(phase, ResourcePhase::Ready);
        assert_eq!(entry.message, None);
        assert_eq!(entry.resource.as_deref(), Some("sb-db"));
        assert_eq!(entry.output_secret.as_deref(), Some("sb-db"));
        let (entry, _) = summary("db", &res, false);
        assert_eq!(entry.message.as_deref(), Some("Ready"));
        let mut gone = res.clone();
        gone.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-01-01T00:00:00Z")).unwrap();
        let (entry, phase) = summary("db", &gone, true);
        assert_eq!(phase, ResourcePhase::Deleting);
        assert_eq!(entry.phase, "Deleting");
    }

    #[test]
    fn a_plugin_is_ready_unless_it_has_a_problem() {
        let p: ResourcePlugin = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ResourcePlugin",
            "metadata": {"name": "postgres", "generation": 3},
            "spec": {"runner": {"image": "pg"}, "create": [{"name": "c", "script": "true"}]}
        }))
        .unwrap();
        let (st, msg) = plugin(&p, None);
        assert_eq!(st.observed_generation, Some(3));
        assert_eq!(msg, "sandboxes can use this plugin");
        assert!(spur_api::conditions::is_condition_true(
            &st.conditions,
            READY
        ));
        let (st, msg) = plugin(&p, Some("spec.create: bad"));
        assert_eq!(msg, "spec.create: bad");
        assert_eq!(
            find_condition(&st.conditions, READY).unwrap().reason,
            "Invalid"
        );
    }
}
