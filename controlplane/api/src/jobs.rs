//! `JobRunnerGroup` and `Job`: a pool of runner pods, and scripts or commands that run on it in
//! a sandbox's (or route group's) routing context, queued per group, with logs and artifacts
//! kept after the pods are gone.
//!
//! ```text
//! Job (namespaced) ──queue (status.phase Queued, ordered by submission)──► JobRunnerGroup (same namespace)
//!                                                                          └─► runner pods ─ spur-job-executor (gRPC, mTLS)
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::validation::*;

/// Longest runner group name: runner pods are named `<group>-<5 characters>`, and pod names
/// end up in label values (63 characters).
pub const RUNNER_GROUP_NAME_MAX: usize = 50;
/// Most runner pods one group may ask for.
pub const MAX_REPLICAS: i32 = 100;
/// Largest script (bytes): the Job object must stay well under etcd's 1.5 MiB.
pub const SCRIPT_MAX: usize = 256 * 1024;
/// Most arguments of a command.
pub const MAX_COMMAND_ARGS: usize = 256;
/// Most environment variables of a job.
pub const MAX_ENV: usize = 128;
/// Most artifacts of a job.
pub const MAX_ARTIFACTS: usize = 16;
/// Longest artifact path.
pub const ARTIFACT_PATH_MAX: usize = 1024;
/// Most metadata entries per artifact.
pub const MAX_ARTIFACT_META: usize = 16;
/// Most bytes of a job's result (`spec.resultPath`), the executor's limit too.
pub const RESULT_MAX: usize = 4096;
/// Longest job duration the API accepts (a week): timeouts are for bounding test runs.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// A job timeout: Go duration syntax restricted to hours, minutes and seconds, in that order
/// (`90s`, `30m`, `1h30m`).
pub const JOB_DURATION_PATTERN: &str = "^([0-9]{1,6}h)?([0-9]{1,6}m)?([0-9]{1,6}s)?$";
/// The runner group's execution timeout when it sets none.
pub const DEFAULT_JOB_TIMEOUT: &str = "30m";
/// Names a job's `env` cannot set: the operator sets them (routing key, names, attempt).
pub const RESERVED_ENV_PREFIX: &str = "SPUR_";

/// Environment variables every job gets.
pub mod env {
    /// The routing key of the job's routing context (absent without one).
    pub const ROUTING_KEY: &str = "SPUR_ROUTING_KEY";
    /// The sandbox of the routing context (absent without one, or for a route group).
    pub const SANDBOX_NAME: &str = "SPUR_SANDBOX_NAME";
    /// The route group of the routing context.
    pub const ROUTE_GROUP_NAME: &str = "SPUR_ROUTE_GROUP_NAME";
    /// The Job's name.
    pub const JOB_NAME: &str = "SPUR_JOB_NAME";
    /// The Job's namespace.
    pub const JOB_NAMESPACE: &str = "SPUR_JOB_NAMESPACE";
    /// The attempt, 1-based.
    pub const JOB_ATTEMPT: &str = "SPUR_JOB_ATTEMPT";
}

// === JobRunnerGroup ===

/// Desired state of a runner group.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "JobRunnerGroup",
    plural = "jobrunnergroups",
    shortname = "jrg",
    category = "spur",
    namespaced,
    status = "JobRunnerGroupStatus",
    derive = "PartialEq",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    doc = "A pool of runner pods for Jobs: any image, unchanged (Spur's job executor is copied in by an init container). Jobs of the group's namespace that name it queue for an idle runner.",
    validation = Rule::new("size(self.metadata.name) <= 50 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("a runner group name must be a DNS-1123 label of at most 50 characters: its pods are named after it"),
    printcolumn(name = "Image", type_ = "string", json_path = ".spec.image"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredReplicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(name = "Idle", type_ = "integer", json_path = ".status.idleReplicas"),
    printcolumn(name = "Queued", type_ = "integer", json_path = ".status.queued"),
    printcolumn(name = "Running", type_ = "integer", json_path = ".status.running"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.autoscaling) || self.autoscaling.minReplicas <= self.autoscaling.maxReplicas",
        "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"
    }
]))]
pub struct JobRunnerGroupSpec {
    /// Image of the runner container (any image: the executor is copied in, not built in).
    #[schemars(length(min = 1, max = IMAGE_MAX), regex(pattern = IMAGE_PATTERN))]
    pub image: String,
    /// Base pod template (`metadata` and `spec` of a PodTemplateSpec). The runner container is
    /// the first container (or one named `runner`); its image and command are set by the
    /// operator. Checked by the operator (condition `Ready=False`, `InvalidPodTemplate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_object")]
    pub pod_template: Option<serde_json::Value>,
    /// Number of runner pods without autoscaling (what `kubectl scale` sets).
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = MAX_REPLICAS))]
    pub replicas: i32,
    /// Scale between these bounds on the number of queued and running jobs instead of using
    /// `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// Longest a job may run on this group (default 30m). Go duration: `90s`, `30m`, `1h30m`.
    #[serde(default = "default_job_timeout")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = JOB_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{
            "rule": "duration(self) > duration('0s') && duration(self) <= duration('168h')",
            "message": "must be a duration above 0s and at most 168h (e.g. 90s, 30m, 1h30m)"
        }])
    )]
    pub job_timeout: String,
    /// Whether a job's `timeout` may exceed `jobTimeout` (else the smaller one applies).
    #[serde(default)]
    pub allow_increase_job_timeout: bool,
    /// Run several jobs, one after another, on the same pod (default). When false, a pod is
    /// replaced after each job, so no job can see what an earlier one left behind.
    #[serde(default = "default_true")]
    pub reuse_pods: bool,
    /// Runner pods get Spur's sidecar in outbound mode (default), so jobs with
    /// `injectRoutingKey: Auto` have their routing key added to every HTTP/1, h2 and gRPC request
    /// they make. The sidecar starts as root with NET_ADMIN, NET_RAW, SETUID and SETGID to
    /// program the pod's rules, then gives them up; turn this off where pod security forbids
    /// that (`Auto` jobs are then not accepted).
    #[serde(default = "default_true")]
    pub routing_key_injection: bool,
}

fn default_replicas() -> i32 {
    1
}

fn default_job_timeout() -> String {
    DEFAULT_JOB_TIMEOUT.to_owned()
}

fn default_true() -> bool {
    true
}

/// Queue-driven scaling bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Autoscaling {
    /// Fewest runner pods, also when nothing is queued.
    #[schemars(range(min = 0, max = MAX_REPLICAS))]
    pub min_replicas: i32,
    /// Most runner pods, however long the queue.
    #[schemars(range(min = 1, max = MAX_REPLICAS))]
    pub max_replicas: i32,
}

/// Observed state of a runner group.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobRunnerGroupStatus {
    /// Runner pods that exist (the scale subresource's `status.replicas`).
    #[serde(default)]
    pub replicas: i32,
    /// Runner pods the group wants now (from `replicas` or autoscaling).
    #[serde(default)]
    pub desired_replicas: i32,
    /// Runner pods whose executor is ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Ready runner pods with no job.
    #[serde(default)]
    pub idle_replicas: i32,
    /// Jobs waiting for a runner.
    #[serde(default)]
    pub queued: i32,
    /// Jobs running.
    #[serde(default)]
    pub running: i32,
    /// Label selector of the runner pods (for the scale subresource and `kubectl get pods -l`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: the pod template is valid and the wanted pods are ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl JobRunnerGroup {
    /// [`JobRunnerGroupSpec::validate`] plus the rule on the object's name.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        if let Some(name) = self.metadata.name.as_deref() {
            check_group_name(&mut c, "metadata.name", name);
        }
        self.spec.check(&mut c);
        c.finish("JobRunnerGroup")
    }
}

impl JobRunnerGroupSpec {
    /// The schema's rules, repeated in Rust (the pod template is checked by the operator, which
    /// knows what it adds to it).
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c);
        c.finish("JobRunnerGroup")
    }

    fn check(&self, c: &mut Checker) {
        c.require(
            is_image(&self.image),
            || "spec.image".into(),
            "must be an image reference (no whitespace)",
        );
        c.max_len(|| "spec.image".into(), &self.image, IMAGE_MAX);
        c.require(
            (0..=MAX_REPLICAS).contains(&self.replicas),
            || "spec.replicas".into(),
            "must be between 0 and 100",
        );
        if let Some(a) = &self.autoscaling {
            c.require(
                (0..=MAX_REPLICAS).contains(&a.min_replicas),
                || "spec.autoscaling.minReplicas".into(),
                "must be between 0 and 100",
            );
            c.require(
                (1..=MAX_REPLICAS).contains(&a.max_replicas),
                || "spec.autoscaling.maxReplicas".into(),
                "must be between 1 and 100",
            );
            c.require(
                a.min_replicas <= a.max_replicas,
                || "spec.autoscaling".into(),
                "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
            );
        }
        check_duration(c, "spec.jobTimeout", &self.job_timeout);
        if let Some(t) = &self.pod_template {
            c.require(
                t.is_object(),
                || "spec.podTemplate".into(),
                "must be an object",
            );
        }
    }

    /// The execution timeout (the default when malformed, which validation reports).
    pub fn job_timeout(&self) -> Duration {
        parse_job_duration(&self.job_timeout)
            .or_else(|| parse_job_duration(DEFAULT_JOB_TIMEOUT))
            .unwrap_or(Duration::from_secs(1800))
    }

    /// How many runner pods the group wants with `queued` jobs waiting and `running` running.
    pub fn desired_replicas(&self, queued: usize, running: usize) -> i32 {
        match self.autoscaling {
            None => self.replicas.clamp(0, MAX_REPLICAS),
            Some(a) => {
                let want = i32::try_from(queued.saturating_add(running)).unwrap_or(i32::MAX);
                want.clamp(a.min_replicas.max(0), a.max_replicas.clamp(1, MAX_REPLICAS))
            }
        }
    }
}

// === Job ===

/// A script or command to run once on a runner of a group, in a routing context.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "Job",
    plural = "jobs",
    shortname = "sjob",
    category = "spur",
    namespaced,
    status = "JobStatus",
    derive = "PartialEq",
    doc = "A job: a script or command run on a runner of a JobRunnerGroup in the job's namespace, with the routing key of a sandbox or route group in its environment (and optionally added to its HTTP requests). Immutable once submitted, except `canceled`.",
    printcolumn(name = "Group", type_ = "string", json_path = ".spec.runnerGroup"),
    printcolumn(
        name = "Sandbox",
        type_ = "string",
        json_path = ".spec.routingContext.sandbox"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Exit", type_ = "integer", json_path = ".status.exitCode"),
    printcolumn(
        name = "Attempts",
        type_ = "integer",
        json_path = ".status.attemptCount",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.script) != has(self.command)",
        "message": "exactly one of script and command must be set"
    },
    {
        "rule": "!oldSelf.canceled || self.canceled",
        "message": "a canceled job cannot be un-canceled"
    },
    {
        "rule": "self.runnerGroup == oldSelf.runnerGroup && has(self.script) == has(oldSelf.script) && (!has(self.script) || self.script == oldSelf.script) && has(self.command) == has(oldSelf.command) && (!has(self.command) || self.command == oldSelf.command) && has(self.env) == has(oldSelf.env) && (!has(self.env) || self.env == oldSelf.env) && has(self.routingContext) == has(oldSelf.routingContext) && (!has(self.routingContext) || self.routingContext == oldSelf.routingContext) && has(self.timeout) == has(oldSelf.timeout) && (!has(self.timeout) || self.timeout == oldSelf.timeout) && has(self.artifacts) == has(oldSelf.artifacts) && (!has(self.artifacts) || self.artifacts == oldSelf.artifacts) && has(self.resultPath) == has(oldSelf.resultPath) && (!has(self.resultPath) || self.resultPath == oldSelf.resultPath) && self.injectRoutingKey == oldSelf.injectRoutingKey",
        "message": "a job is immutable once submitted, except spec.canceled"
    }
]))]
pub struct JobSpec {
    /// The JobRunnerGroup (in the job's namespace) that runs the job.
    #[schemars(length(min = 1, max = RUNNER_GROUP_NAME_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub runner_group: String,
    /// A script, run as an executable file: start it with `#!` to choose the interpreter
    /// (`/bin/sh` runs it otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = SCRIPT_MAX))]
    pub script: Option<String>,
    /// A command and its arguments, run without a shell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = MAX_COMMAND_ARGS),
        inner(length(max = VALUE_MAX))
    )]
    pub command: Option<Vec<String>>,
    /// Environment variables of the job (names starting with `SPUR_` are the operator's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ENV),
        extend(
            "x-kubernetes-list-type" = "map",
            "x-kubernetes-list-map-keys" = ["name"]
        )
    )]
    pub env: Vec<JobEnvVar>,
    /// Whose routing key the job runs with: a sandbox or a route group. Without one the job
    /// talks to the baselines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_context: Option<RoutingContext>,
    /// Longest the job's process may run (Go duration: `90s`, `30m`, `1h30m`); capped by the
    /// runner group's `jobTimeout` unless the group allows raising it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = JOB_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{
            "rule": "duration(self) > duration('0s') && duration(self) <= duration('168h')",
            "message": "must be a duration above 0s and at most 168h (e.g. 90s, 30m, 1h30m)"
        }])
    )]
    pub timeout: Option<String>,
    /// Files (or directories) to keep after the run, downloadable with `spur artifact`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ARTIFACTS))]
    pub artifacts: Vec<ArtifactSpec>,
    /// Set to true to stop the job (queued: never runs; running: its processes are killed).
    #[serde(default)]
    pub canceled: bool,
    /// `Auto`: the runner pod gets Spur's sidecar in outbound mode, which adds the routing key
    /// to every HTTP/1, h2 and gRPC request the job makes, so scripts need not set headers.
    #[serde(default)]
    pub inject_routing_key: InjectRoutingKey,
    /// A file the job writes a short result to (absolute path in the runner container): once the
    /// process has ended, its content (UTF-8, at most 4096 bytes) becomes `status.result`, as a
    /// container's termination message does. Larger output belongs in an artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = ARTIFACT_PATH_MAX),
        extend("x-kubernetes-validations" = [{
            "rule": "self.startsWith('/') && !self.contains('/../') && !self.endsWith('/..')",
            "message": "a result path must be absolute, without '..'"
        }])
    )]
    pub result_path: Option<String>,
}

/// One environment variable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!self.name.startsWith('SPUR_')",
    "message": "names starting with SPUR_ are set by the operator"
}]))]
pub struct JobEnvVar {
    #[schemars(length(min = 1, max = ENV_NAME_MAX), regex(pattern = ENV_NAME_PATTERN))]
    pub name: String,
    #[serde(default)]
    #[schemars(length(max = VALUE_MAX))]
    pub value: String,
}

/// A sandbox or a route group (exactly one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.sandbox) != has(self.routeGroup)",
    "message": "a routing context names exactly one of sandbox and routeGroup"
}]))]
pub struct RoutingContext {
    /// A Sandbox (cluster-scoped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: Option<String>,
    /// A RouteGroup (cluster-scoped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub route_group: Option<String>,
}

/// A file or directory to keep.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.path.startsWith('/') && !self.path.contains('/../') && !self.path.endsWith('/..')",
    "message": "an artifact path must be absolute, without '..'"
}]))]
pub struct ArtifactSpec {
    /// Absolute path in the runner container; a directory is kept with everything under it.
    #[schemars(length(min = 1, max = ARTIFACT_PATH_MAX))]
    pub path: String,
    /// Free-form metadata shown with the artifact.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = MAX_ARTIFACT_META,
        "additionalProperties" = {"type": "string", "maxLength": FREE_LABEL_VALUE_MAX}
    ))]
    pub meta: BTreeMap<String, String>,
}

/// Whether requests of the job get the routing key added.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum InjectRoutingKey {
    /// The script sets headers itself (from `$SPUR_ROUTING_KEY`).
    #[default]
    Disabled,
    /// Spur's sidecar adds the key to the job's outbound HTTP/1, h2 and gRPC requests.
    Auto,
}

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum JobPhase {
    /// Waiting for an idle runner (or for its runner group or sandbox to exist).
    Queued,
    /// An attempt is running on a runner pod.
    Running,
    /// The process exited with 0.
    Succeeded,
    /// The process exited with another code, or could not be started.
    Failed,
    /// Stopped by `spec.canceled` or by its timeout.
    Canceled,
}

impl JobPhase {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobPhase::Succeeded | JobPhase::Failed | JobPhase::Canceled
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Queued => "Queued",
            JobPhase::Running => "Running",
            JobPhase::Succeeded => "Succeeded",
            JobPhase::Failed => "Failed",
            JobPhase::Canceled => "Canceled",
        }
    }
}

/// Who or what canceled a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CanceledBy {
    /// Its timeout ran out.
    Timeout,
    /// `spec.canceled` was set.
    Request,
}

/// Observed state of a job.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<JobPhase>,
    /// The job's `resourceVersion` when the controller first saw it (its creation revision):
    /// with the creation time, the job's place in its group's queue, so jobs created in the
    /// same second still run in the order they were submitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submission_revision: Option<u64>,
    /// The routing key the job runs with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
    /// Every attempt, oldest first; the last one is current.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Attempt>,
    /// Number of attempts (for `kubectl get -o wide`).
    #[serde(default)]
    pub attempt_count: i32,
    /// Exit code of the final attempt's process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Set when the job was canceled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canceled_by: Option<CanceledBy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// Size of the kept log (all attempts), once stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_bytes: Option<u64>,
    /// Kept artifacts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<ArtifactStatus>,
    /// The final attempt's result file (`spec.resultPath`), when it wrote one that fits; the
    /// `Finished` condition says why there is none otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = RESULT_MAX))]
    pub result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted` (the runner group and routing context exist, the spec is valid) and
    /// `Finished`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One attempt at running a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Attempt {
    /// 1-based.
    pub id: i32,
    /// The runner pod.
    pub pod: String,
    pub phase: AttemptPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Short reason for the phase (`Exited`, `PodLost`, `TimedOut`, `Canceled`, `StartFailed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Where an attempt is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AttemptPhase {
    /// Assigned to its pod; the executor is starting or running the process.
    Running,
    Succeeded,
    Failed,
    Canceled,
    /// The pod went away mid-run: the job is queued again for another attempt.
    Lost,
}

/// A kept artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactStatus {
    /// Path of the file in the runner container.
    pub path: String,
    pub size: u64,
    /// Hex SHA-256 of the content.
    pub sha256: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
}

impl Job {
    /// [`JobSpec::validate`]; the name has Kubernetes' own rules only.
    pub fn validate(&self) -> Result<(), Error> {
        self.spec.validate()
    }
}

/// Condition type: the job's runner group and routing context exist.
pub const ACCEPTED: &str = "Accepted";
/// Condition type: the job reached a terminal phase.
pub const FINISHED: &str = "Finished";

/// A job's place in its group's queue: creation second, creation revision, name.
pub fn queue_key(job: &Job) -> (i64, u64, String) {
    let rev = job
        .status
        .as_ref()
        .and_then(|s| s.submission_revision)
        .unwrap_or(u64::MAX);
    (created(job), rev, job.name_any())
}

/// A job's phase (`Queued` until the Job controller writes one).
pub fn phase(job: &Job) -> JobPhase {
    job.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(JobPhase::Queued)
}

/// A job's creation, Unix seconds (0 when unknown).
pub fn created(job: &Job) -> i64 {
    job.metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_second())
}

impl JobSpec {
    /// Every rule of the schema, in Rust, for controllers and tests.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c);
        c.finish("Job")
    }

    /// The transition rules: everything but `canceled` is immutable, and a cancel stays.
    pub fn validate_update(&self, old: &JobSpec) -> Result<(), Error> {
        let mut c = Checker::default();
        let mut same = self.clone();
        same.canceled = old.canceled;
        if same != *old {
            c.fail(
                "spec",
                "a job is immutable once submitted, except spec.canceled",
            );
        }
        if old.canceled && !self.canceled {
            c.fail("spec", "a canceled job cannot be un-canceled");
        }
        c.finish("Job")
    }

    fn check(&self, c: &mut Checker) {
        check_group_name(c, "spec.runnerGroup", &self.runner_group);
        match (&self.script, &self.command) {
            (Some(_), Some(_)) | (None, None) => {
                c.fail("spec", "exactly one of script and command must be set")
            }
            (Some(s), None) => {
                c.require(!s.is_empty(), || "spec.script".into(), "must not be empty");
                c.max_len(|| "spec.script".into(), s, SCRIPT_MAX);
            }
            (None, Some(cmd)) => {
                c.require(
                    !cmd.is_empty(),
                    || "spec.command".into(),
                    "must not be empty",
                );
                c.max_items(|| "spec.command".into(), cmd, MAX_COMMAND_ARGS);
                for (i, a) in cmd.iter().enumerate() {
                    c.max_len(|| format!("spec.command[{i}]"), a, VALUE_MAX);
                }
            }
        }
        c.max_items(|| "spec.env".into(), &self.env, MAX_ENV);
        for (i, e) in self.env.iter().enumerate() {
            c.require(
                is_env_name(&e.name),
                || format!("spec.env[{i}].name"),
                "must be an environment variable name ([-._a-zA-Z][-._a-zA-Z0-9]*)",
            );
            c.require(
                !e.name.starts_with(RESERVED_ENV_PREFIX),
                || format!("spec.env[{i}].name"),
                "names starting with SPUR_ are set by the operator",
            );
            c.max_len(|| format!("spec.env[{i}].value"), &e.value, VALUE_MAX);
            if self.env[..i].iter().any(|o| o.name == e.name) {
                c.fail(format!("spec.env[{i}].name"), "duplicate name");
            }
        }
        if let Some(rc) = &self.routing_context {
            match (&rc.sandbox, &rc.route_group) {
                (Some(s), None) => c.dns_label(|| "spec.routingContext.sandbox".into(), s),
                (None, Some(g)) => c.dns_label(|| "spec.routingContext.routeGroup".into(), g),
                _ => c.fail(
                    "spec.routingContext",
                    "a routing context names exactly one of sandbox and routeGroup",
                ),
            }
        }
        if let Some(t) = &self.timeout {
            check_duration(c, "spec.timeout", t);
        }
        c.max_items(|| "spec.artifacts".into(), &self.artifacts, MAX_ARTIFACTS);
        for (i, a) in self.artifacts.iter().enumerate() {
            c.require(
                is_artifact_path(&a.path),
                || format!("spec.artifacts[{i}].path"),
                "an artifact path must be absolute, without '..'",
            );
            c.max_len(
                || format!("spec.artifacts[{i}].path"),
                &a.path,
                ARTIFACT_PATH_MAX,
            );
            if a.meta.len() > MAX_ARTIFACT_META {
                c.fail(
                    format!("spec.artifacts[{i}].meta"),
                    format!("must have at most {MAX_ARTIFACT_META} entries"),
                );
            }
        }
        if let Some(p) = &self.result_path {
            // At least 2 characters (CEL's minLength): `/` alone is a directory.
            c.require(
                is_artifact_path(p) && p.len() >= 2,
                || "spec.resultPath".into(),
                "a result path must be absolute, without '..'",
            );
            c.max_len(|| "spec.resultPath".into(), p, ARTIFACT_PATH_MAX);
        }
    }

    /// The timeout that applies on `group`: the job's own (capped by the group's unless the
    /// group allows more), else the group's.
    pub fn effective_timeout(&self, group: &JobRunnerGroupSpec) -> Duration {
        let group_max = group.job_timeout();
        match self.timeout.as_deref().and_then(parse_job_duration) {
            Some(t) if group.allow_increase_job_timeout => t,
            Some(t) => t.min(group_max),
            None => group_max,
        }
    }
}

/// A runner group's name: a DNS label short enough for its pods' names.
fn check_group_name(c: &mut Checker, path: &str, name: &str) {
    c.require(
        is_dns_label(name) && name.len() <= RUNNER_GROUP_NAME_MAX,
        || path.into(),
        "must be a DNS-1123 label of at most 50 characters",
    );
}

/// Whether `p` is an absolute path with no `..` component.
pub fn is_artifact_path(p: &str) -> bool {
    p.starts_with('/') && !p.split('/').any(|c| c == "..") && !p.contains('\0')
}

fn check_duration(c: &mut Checker, path: &str, s: &str) {
    match parse_job_duration(s) {
        Some(d) if !d.is_zero() && d <= MAX_TIMEOUT => {}
        _ => c.fail(
            path,
            "must be a duration above 0s and at most 168h (e.g. 90s, 30m, 1h30m)",
        ),
    }
}

/// Parses [`JOB_DURATION_PATTERN`] (`1h30m`, `90s`); `None` when malformed.
pub fn parse_job_duration(s: &str) -> Option<Duration> {
    if s.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut rest = s;
    let mut last_unit = 0; // h=3, m=2, s=1: units must come in that order, each at most once
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 6 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        let (unit, secs) = match rest.as_bytes().get(digits)? {
            b'h' => (3, 3600),
            b'm' => (2, 60),
            b's' => (1, 1),
            _ => return None,
        };
        if last_unit != 0 && unit >= last_unit {
            return None;
        }
        last_unit = unit;
        total = total.checked_add(n.checked_mul(secs)?)?;
        rest = &rest[digits + 1..];
    }
    Some(Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(yaml: &str) -> JobSpec {
        serde_yaml_ng::from_str(yaml).unwrap_or_else(|e| panic!("{e}: {yaml}"))
    }

    #[test]
    fn durations_parse_like_go_for_h_m_s() {
        assert_eq!(parse_job_duration("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_job_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_job_duration("2h5s"), Some(Duration::from_secs(7205)));
        for bad in [
            "", "s", "1", "1d", "30m1h", "1m1m", "-1s", "1.5h", "1234567s", "1h ",
        ] {
            assert_eq!(parse_job_duration(bad), None, "{bad:?}");
        }
        assert_eq!(parse_job_duration("0s"), Some(Duration::ZERO));
    }

    #[test]
    fn a_job_needs_exactly_one_of_script_and_command() {
        let ok = job("runnerGroup: g\nscript: \"#!/bin/sh\\necho hi\"\n");
        assert!(ok.validate().is_ok());
        let both = job("runnerGroup: g\nscript: x\ncommand: [echo]\n");
        assert!(
            both.validate()
                .unwrap_err()
                .to_string()
                .contains("exactly one of script and command")
        );
        let none = job("runnerGroup: g\n");
        assert!(none.validate().is_err());
        let empty = job("runnerGroup: g\ncommand: []\n");
        assert!(
            empty
                .validate()
                .unwrap_err()
                .to_string()
                .contains("spec.command")
        );
    }

    #[test]
    fn bad_fields_are_reported_with_their_paths() {
        let j = job(
            "runnerGroup: Not_A_Label\ncommand: [x]\ntimeout: 0s\nenv: [{name: SPUR_ROUTING_KEY, value: x}, {name: A}, {name: A}]\nroutingContext: {sandbox: a, routeGroup: b}\nartifacts: [{path: relative}, {path: /a/../etc}]\n",
        );
        let err = j.validate().unwrap_err().to_string();
        for want in [
            "spec.runnerGroup",
            "spec.timeout",
            "spec.env[0].name: names starting with SPUR_",
            "spec.env[2].name: duplicate",
            "spec.routingContext",
            "spec.artifacts[0].path",
            "spec.artifacts[1].path",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
    }

    #[test]
    fn only_cancel_may_change() {
        let old = job("runnerGroup: g\ncommand: [x]\n");
        let mut canceled = old.clone();
        canceled.canceled = true;
        assert!(canceled.validate_update(&old).is_ok());
        assert!(old.validate_update(&canceled).is_err(), "un-cancel");
        let mut changed = old.clone();
        changed.command = Some(vec!["y".into()]);
        assert!(changed.validate_update(&old).is_err());
    }

    #[test]
    fn timeouts_are_capped_by_the_group_unless_it_allows_more() {
        let mut g: JobRunnerGroupSpec = serde_yaml_ng::from_str("image: busybox\n").unwrap();
        assert_eq!(g.job_timeout, "30m");
        assert!(g.reuse_pods);
        assert_eq!(g.replicas, 1);
        let j = job("runnerGroup: g\ncommand: [x]\ntimeout: 2h\n");
        assert_eq!(j.effective_timeout(&g), Duration::from_secs(1800));
        g.allow_increase_job_timeout = true;
        assert_eq!(j.effective_timeout(&g), Duration::from_secs(7200));
        let short = job("runnerGroup: g\ncommand: [x]\ntimeout: 10s\n");
        assert_eq!(short.effective_timeout(&g), Duration::from_secs(10));
        let none = job("runnerGroup: g\ncommand: [x]\n");
        assert_eq!(none.effective_timeout(&g), Duration::from_secs(1800));
    }

    #[test]
    fn autoscaling_follows_the_queue_within_bounds() {
        let mut g: JobRunnerGroupSpec =
            serde_yaml_ng::from_str("image: busybox\nreplicas: 3\n").unwrap();
        assert_eq!(g.desired_replicas(50, 0), 3);
        g.autoscaling = Some(Autoscaling {
            min_replicas: 1,
            max_replicas: 4,
        });
        assert_eq!(g.desired_replicas(0, 0), 1);
        assert_eq!(g.desired_replicas(2, 1), 3);
        assert_eq!(g.desired_replicas(50, 2), 4);
        assert!(g.validate().is_ok());
        g.autoscaling = Some(Autoscaling {
            min_replicas: 5,
            max_replicas: 4,
        });
        assert!(g.validate().is_err());
    }
}
