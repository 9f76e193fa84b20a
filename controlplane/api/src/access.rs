//! Just-in-time access (after Oz): a platform team writes **templates** (which workload, which
//! groups may ask, default and maximum duration); an engineer files a **request** for one of
//! them; the operator grants it for a bounded time and takes it back on time.
//!
//! ```text
//! ExecAccessTemplate ◄─templateName─ ExecAccessRequest ──► Role + RoleBinding (pods/exec on one pod, for the requester)
//! PodAccessTemplate  ◄─templateName─ PodAccessRequest  ──► debug pod (cloned from the workload) + Role + RoleBinding
//! ```
//!
//! The requester is stamped into `spec.requester` at admission from the API server's user info
//! (a mutating webhook), checked against that user info by a ValidatingAdmissionPolicy, and the
//! whole spec is immutable (CEL `self == oldSelf`): nobody can file a request in another's name
//! or change one after the fact. Only the requester is bound; the template's groups decide who
//! may ask, not who may use a grant.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::validation::*;

pub mod approval;
mod pod;
mod tunnel;

pub use approval::{Approval, ApprovalState, Approver};
pub use pod::*;
pub use tunnel::*;

/// Durations: Go syntax restricted to hours, minutes and seconds, in that order (`90s`, `30m`,
/// `1h30m`), as for job timeouts.
pub const ACCESS_DURATION_PATTERN: &str = crate::jobs::JOB_DURATION_PATTERN;
/// Longest grant the API accepts (a week); templates usually cap far lower.
pub const MAX_ACCESS_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);
/// A template's default duration when it names none.
pub const DEFAULT_DURATION: &str = "1h";
/// A template's maximum duration when it names none.
pub const DEFAULT_MAX_DURATION: &str = "24h";
/// Most groups a template may allow.
pub const MAX_ALLOWED_GROUPS: usize = 64;
/// Longest group or user name (Kubernetes sets no limit; these end up in RoleBindings and
/// status, so they are kept bounded).
pub const IDENTITY_MAX: usize = 512;
/// Most groups stamped on a request (a user in more has the rest dropped, which only loses
/// the ability to match a template through them).
pub const MAX_REQUESTER_GROUPS: usize = 256;
/// Longest `accessCommand` template.
pub const ACCESS_COMMAND_MAX: usize = 1024;
/// Most environment variables, command or argument items of a pod mutation.
pub const MAX_MUTATION_ITEMS: usize = 128;

/// CEL for a duration field (the same bounds as [`check_duration`]).
const DURATION_RULE: &str = "duration(self) > duration('0s') && duration(self) <= duration('168h')";
const DURATION_MESSAGE: &str =
    "must be a duration above 0s and at most 168h (e.g. 90s, 30m, 1h30m)";

/// Who may ask and for how long: shared by both template kinds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "duration(self.defaultDuration) <= duration(self.maxDuration)",
    "message": "defaultDuration must not exceed maxDuration"
}]))]
pub struct AccessConfig {
    /// Groups (as the API server authenticates them: `system:serviceaccounts:<ns>`, an OIDC
    /// group, ...) whose members may file requests against this template. Only the requester
    /// is bound, never the group.
    #[schemars(length(min = 1, max = MAX_ALLOWED_GROUPS), inner(length(min = 1, max = IDENTITY_MAX)))]
    pub allowed_groups: Vec<String>,
    /// Duration of a request that names none.
    #[serde(default = "default_duration")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = ACCESS_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": DURATION_RULE, "message": DURATION_MESSAGE}])
    )]
    pub default_duration: String,
    /// Longest grant: a request above it is granted this much, and its `AccessDurationsValid`
    /// condition says so.
    #[serde(default = "default_max_duration")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = ACCESS_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": DURATION_RULE, "message": DURATION_MESSAGE}])
    )]
    pub max_duration: String,
    /// The command shown in a ready request's `status.accessMessage`, with `{namespace}`,
    /// `{pod}` and `{container}` replaced. Default:
    /// `kubectl exec -ti -n {namespace} {pod} -c {container} -- /bin/sh`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = ACCESS_COMMAND_MAX))]
    pub access_command: Option<String>,
    /// Whether a second user must approve a request before it is granted (docs/access.md,
    /// "Approval").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
}

fn default_duration() -> String {
    DEFAULT_DURATION.to_owned()
}

fn default_max_duration() -> String {
    DEFAULT_MAX_DURATION.to_owned()
}

/// The command of a ready grant when the template names none.
pub const DEFAULT_ACCESS_COMMAND: &str =
    "kubectl exec -ti -n {namespace} {pod} -c {container} -- /bin/sh";

impl AccessConfig {
    /// `accessCommand` (or the default) for one pod.
    pub fn access_command(&self, namespace: &str, pod: &str, container: &str) -> String {
        self.access_command
            .as_deref()
            .unwrap_or(DEFAULT_ACCESS_COMMAND)
            .replace("{namespace}", namespace)
            .replace("{pod}", pod)
            .replace("{container}", container)
    }

    /// Whether a user with `groups` may file requests against this template.
    pub fn allows(&self, groups: &[String]) -> bool {
        self.allowed_groups.iter().any(|g| groups.contains(g))
    }

    /// The grant for a request asking for `requested` (`None`: the default): the duration and,
    /// when it was capped, why.
    pub fn grant(&self, requested: Option<&str>) -> Result<Grant, String> {
        let max = parse_access_duration(&self.max_duration).ok_or_else(|| {
            format!(
                "the template's maxDuration {:?} is invalid",
                self.max_duration
            )
        })?;
        let default = parse_access_duration(&self.default_duration).ok_or_else(|| {
            format!(
                "the template's defaultDuration {:?} is invalid",
                self.default_duration
            )
        })?;
        let Some(requested) = requested else {
            return Ok(Grant {
                duration: default.min(max),
                capped: false,
            });
        };
        let asked = parse_access_duration(requested)
            .ok_or_else(|| format!("duration {requested:?} is invalid"))?;
        Ok(Grant {
            duration: asked.min(max),
            capped: asked > max,
        })
    }

    fn check(&self, c: &mut Checker, path: &str) {
        c.require(
            !self.allowed_groups.is_empty(),
            || format!("{path}.allowedGroups"),
            "must name at least one group",
        );
        c.max_items(
            || format!("{path}.allowedGroups"),
            &self.allowed_groups,
            MAX_ALLOWED_GROUPS,
        );
        for (i, g) in self.allowed_groups.iter().enumerate() {
            c.require(
                !g.is_empty() && g.len() <= IDENTITY_MAX,
                || format!("{path}.allowedGroups[{i}]"),
                "must be 1-512 bytes",
            );
        }
        check_duration(c, format!("{path}.defaultDuration"), &self.default_duration);
        check_duration(c, format!("{path}.maxDuration"), &self.max_duration);
        if let (Some(d), Some(m)) = (
            parse_access_duration(&self.default_duration),
            parse_access_duration(&self.max_duration),
        ) && d > m
        {
            c.fail(
                format!("{path}.defaultDuration"),
                "must not exceed maxDuration",
            );
        }
        if let Some(cmd) = &self.access_command {
            c.require(
                !cmd.is_empty(),
                || format!("{path}.accessCommand"),
                "must not be empty",
            );
            c.max_len(|| format!("{path}.accessCommand"), cmd, ACCESS_COMMAND_MAX);
        }
        if let Some(a) = &self.approval {
            a.check(c, &format!("{path}.approval"));
        }
    }

    /// Where a request of `requester` stands with this template's approval.
    pub fn approval_state(&self, requester: &str, approver: Option<&Approver>) -> ApprovalState {
        self.approval
            .as_ref()
            .map_or(ApprovalState::NotRequired, |a| a.state(requester, approver))
    }
}

/// What a request is granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub duration: Duration,
    /// The request asked for more than the template's maximum.
    pub capped: bool,
}

/// Kinds of workload a template can target.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum TargetKind {
    /// `apps/v1` Deployment.
    Deployment,
    /// `apps/v1` StatefulSet.
    StatefulSet,
    /// `apps/v1` DaemonSet.
    DaemonSet,
    /// Argo Rollout (`argoproj.io/v1alpha1`).
    Rollout,
}

impl TargetKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetKind::Deployment => "Deployment",
            TargetKind::StatefulSet => "StatefulSet",
            TargetKind::DaemonSet => "DaemonSet",
            TargetKind::Rollout => "Rollout",
        }
    }

    /// The kind as a sandbox can fork it (Deployments and Rollouts only).
    pub fn forkable(self) -> Option<crate::WorkloadKind> {
        match self {
            TargetKind::Deployment => Some(crate::WorkloadKind::Deployment),
            TargetKind::Rollout => Some(crate::WorkloadKind::Rollout),
            TargetKind::StatefulSet | TargetKind::DaemonSet => None,
        }
    }
}

impl fmt::Display for TargetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A workload in the template's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetRef {
    pub kind: TargetKind,
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
}

impl fmt::Display for TargetRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// The user who filed a request, as the API server authenticated them. Set at admission;
/// whatever a client writes here is replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Requester {
    #[schemars(length(min = 1, max = IDENTITY_MAX))]
    pub username: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = IDENTITY_MAX))]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_REQUESTER_GROUPS), inner(length(max = IDENTITY_MAX)))]
    pub groups: Vec<String>,
}

// === Exec access ===

/// Which pods of a workload may be exec'd into, by whom, for how long.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ExecAccessTemplate",
    plural = "execaccesstemplates",
    shortname = "eat",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessTemplateStatus",
    derive = "PartialEq",
    doc = "Who may ask for exec access to a workload's pods, and for how long (docs/access.md).",
    printcolumn(name = "Target", type_ = "string", json_path = ".spec.targetRef.name"),
    printcolumn(name = "Kind", type_ = "string", json_path = ".spec.targetRef.kind"),
    printcolumn(
        name = "Max",
        type_ = "string",
        json_path = ".spec.accessConfig.maxDuration"
    ),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ExecAccessTemplateSpec {
    pub access_config: AccessConfig,
    /// The workload (in this namespace) whose pods are exec'd into.
    pub target_ref: TargetRef,
    /// Container the access command names (default: the pod's
    /// `kubectl.kubernetes.io/default-container` annotation, else its first container).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub container: Option<String>,
}

impl ExecAccessTemplateSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.access_config.check(&mut c, "spec.accessConfig");
        c.dns_subdomain(|| "spec.targetRef.name".into(), &self.target_ref.name);
        if let Some(name) = &self.container {
            c.dns_label(|| "spec.container".into(), name);
        }
        c.finish("ExecAccessTemplate")
    }
}

/// A request for exec access to one pod of a template's workload.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ExecAccessRequest",
    plural = "execaccessrequests",
    shortname = "ear",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessRequestStatus",
    derive = "PartialEq",
    doc = "A request for time-bound exec access to one pod of an ExecAccessTemplate's workload (docs/access.md).",
    printcolumn(name = "Template", type_ = "string", json_path = ".spec.templateName"),
    printcolumn(
        name = "Requester",
        type_ = "string",
        json_path = ".spec.requester.username"
    ),
    printcolumn(name = "Pod", type_ = "string", json_path = ".status.podName"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(name = "Expires", type_ = "date", json_path = ".status.expiresAt"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a request cannot be changed: delete it and file a new one"
}]))]
pub struct ExecAccessRequestSpec {
    /// The ExecAccessTemplate (in this namespace).
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub template_name: String,
    /// A pod of the target workload (default: a ready one the operator picks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub target_pod: Option<String>,
    /// How long (default: the template's `defaultDuration`; capped at its `maxDuration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = ACCESS_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": DURATION_RULE, "message": DURATION_MESSAGE}])
    )]
    pub duration: Option<String>,
    /// A sandbox forking the template's workload: the grant is then on that sandbox's fork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: Option<String>,
    /// Who filed the request: set at admission from the API server's user info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<Requester>,
}

impl ExecAccessRequestSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        check_request(
            &mut c,
            &self.template_name,
            self.duration.as_deref(),
            self.sandbox.as_deref(),
        );
        if let Some(p) = &self.target_pod {
            c.dns_subdomain(|| "spec.targetPod".into(), p);
        }
        c.finish("ExecAccessRequest")
    }
}

fn check_request(c: &mut Checker, template: &str, duration: Option<&str>, sandbox: Option<&str>) {
    c.dns_subdomain(|| "spec.templateName".into(), template);
    if let Some(d) = duration {
        check_duration(c, "spec.duration".into(), d);
    }
    if let Some(s) = sandbox {
        c.dns_label(|| "spec.sandbox".into(), s);
    }
}

// === Status ===

/// Observed state of a template.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccessTemplateStatus {
    /// `TemplateDurationsValid`, `TargetRefExists` and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Requests against the template can be granted.
    #[serde(default)]
    pub ready: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Observed state of a request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccessRequestStatus {
    /// `TargetTemplateExists`, `RequesterAllowed`, `Approved`, `AccessDurationsValid`,
    /// `AccessStillValid`, `AccessResourcesCreated`, `AccessResourcesReady` and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The grant is in place: the requester can run `accessMessage`.
    #[serde(default)]
    pub ready: bool,
    /// The pod the grant is for (chosen once, never changed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// Its container the access command names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The command to run once ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_message: Option<String>,
    /// The duration granted (the request's, or the template's default or maximum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    /// When the grant ends and the request is deleted (creation time + duration; with a
    /// required approval, the time the operator saw the approval + duration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// Who approved the request, when its template requires approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by: Option<String>,
}

/// Condition types, as Oz names them (plus `RequesterAllowed`).
pub mod conditions {
    /// Template: its durations parse and the default is within the maximum.
    pub const TEMPLATE_DURATIONS_VALID: &str = "TemplateDurationsValid";
    /// Template: its target workload exists.
    pub const TARGET_REF_EXISTS: &str = "TargetRefExists";
    /// Request: its template exists and is ready.
    pub const TARGET_TEMPLATE_EXISTS: &str = "TargetTemplateExists";
    /// Request: the requester is in one of the template's allowed groups.
    pub const REQUESTER_ALLOWED: &str = "RequesterAllowed";
    /// Request: approved by a second user, or its template requires no approval.
    pub const APPROVED: &str = "Approved";
    /// Request: the duration is valid (message: capped or not).
    pub const ACCESS_DURATIONS_VALID: &str = "AccessDurationsValid";
    /// Request: not expired.
    pub const ACCESS_STILL_VALID: &str = "AccessStillValid";
    /// Request: Role, RoleBinding (and debug pod) exist.
    pub const ACCESS_RESOURCES_CREATED: &str = "AccessResourcesCreated";
    /// Request: the pod is running and the API server says the requester may exec into it.
    pub const ACCESS_RESOURCES_READY: &str = "AccessResourcesReady";
}

/// Labels (and the expiry annotation) on what a request creates (Role, RoleBinding, debug pod).
pub mod labels {
    /// The request's name.
    pub const ACCESS_REQUEST: &str = "spur.dev/access-request";
    /// `exec` or `pod`.
    pub const ACCESS_KIND: &str = "spur.dev/access-kind";
    /// Annotation of a grant's Role and RoleBinding: when the grant ends (RFC 3339). The
    /// second sweeper (`spur-operator sweep-access`) deletes them then even if the operator is down.
    pub const EXPIRES_AT: &str = "spur.dev/expires-at";
}

/// Parses [`ACCESS_DURATION_PATTERN`]; `None` when malformed, zero or above
/// [`MAX_ACCESS_DURATION`].
pub fn parse_access_duration(s: &str) -> Option<Duration> {
    crate::jobs::parse_job_duration(s).filter(|d| !d.is_zero() && *d <= MAX_ACCESS_DURATION)
}

/// `1h30m`-style text of a duration (whole seconds).
pub fn format_access_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 || out.is_empty() {
        out.push_str(&format!("{s}s"));
    }
    out
}

fn check_duration(c: &mut Checker, path: String, s: &str) {
    if parse_access_duration(s).is_none() {
        c.fail(path, DURATION_MESSAGE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(default: &str, max: &str) -> AccessConfig {
        AccessConfig {
            allowed_groups: vec!["dev".into()],
            default_duration: default.into(),
            max_duration: max.into(),
            access_command: None,
            approval: None,
        }
    }

    #[test]
    fn a_request_above_the_maximum_gets_the_maximum() {
        let c = config("30m", "2h");
        let hour = Duration::from_secs(3600);
        assert_eq!(
            c.grant(None).unwrap(),
            Grant {
                duration: hour / 2,
                capped: false
            }
        );
        assert_eq!(
            c.grant(Some("1h30m")).unwrap(),
            Grant {
                duration: hour * 3 / 2,
                capped: false
            }
        );
        assert_eq!(
            c.grant(Some("5h")).unwrap(),
            Grant {
                duration: hour * 2,
                capped: true
            }
        );
        assert!(c.grant(Some("0s")).is_err());
        assert!(c.grant(Some("1d")).is_err());
        assert!(config("1h", "bad").grant(None).is_err());
    }

    #[test]
    fn durations_format_back() {
        for s in ["1h", "1h30m", "90s", "2h0m5s", "0s"] {
            let d = crate::jobs::parse_job_duration(s).unwrap();
            assert_eq!(
                crate::jobs::parse_job_duration(&format_access_duration(d)),
                Some(d)
            );
        }
        assert_eq!(format_access_duration(Duration::from_secs(5400)), "1h30m");
    }

    #[test]
    fn templates_are_checked() {
        let mut t = ExecAccessTemplateSpec {
            access_config: config("2h", "1h"),
            target_ref: TargetRef {
                kind: TargetKind::Deployment,
                name: "Web".into(),
            },
            container: Some("-x".into()),
        };
        t.access_config.allowed_groups.clear();
        let e = t.validate().unwrap_err().to_string();
        for want in [
            "spec.accessConfig.allowedGroups",
            "spec.accessConfig.defaultDuration: must not exceed",
            "spec.targetRef.name",
            "spec.container",
        ] {
            assert!(e.contains(want), "{want} not in {e}");
        }
        let p = PodAccessTemplateSpec {
            access_config: config("1h", "2h"),
            target_ref: None,
            pod_spec: None,
            mutation: Some(PodMutation {
                pod_labels: [("spur.dev/fork".to_string(), "x".to_string())].into(),
                ..PodMutation::default()
            }),
        };
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains("exactly one of targetRef and podSpec"), "{e}");
        assert!(e.contains("Spur's own"), "{e}");
    }

    #[test]
    fn the_access_command_names_the_pod() {
        let c = config("1h", "2h");
        assert_eq!(
            c.access_command("shop", "web-1", "app"),
            "kubectl exec -ti -n shop web-1 -c app -- /bin/sh"
        );
        assert!(c.allows(&["system:authenticated".into(), "dev".into()]));
        assert!(!c.allows(&["system:authenticated".into()]));
    }
}
