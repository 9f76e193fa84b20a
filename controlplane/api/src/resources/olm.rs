//! `ObjectLifecycleMethods`: the workflow engine a Resource drives (preStart and postStop work
//! units) and its validation.

use std::collections::{HashMap, HashSet};

use super::plugin::{check_env, check_path, io_name};
use super::*;

/// Workflows of work units run around a target object's life.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ObjectLifecycleMethods",
    plural = "objectlifecyclemethods",
    shortname = "solm",
    category = "spur",
    status = "OlmStatus",
    derive = "PartialEq",
    doc = "Workflows run around an object's life: preStart work units in order when it is created, postStop work units in order when it is deleted (behind a finalizer, retried with backoff until they succeed). Each work unit is a pod; its inputs and outputs go through the io context server. Made by the operator for each sandbox Resource.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Context",
        type_ = "string",
        json_path = ".spec.ioContextName",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "the workflows of an ObjectLifecycleMethods are immutable"
}]))]
pub struct OlmSpec {
    /// The io context whose values the work units read and write.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub io_context_name: String,
    /// Run in order when the object is created; the object is usable once they all succeed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_STEPS))]
    pub pre_start: Vec<WorkUnit>,
    /// Run in order when the object is deleted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_STEPS))]
    pub post_stop: Vec<WorkUnit>,
}

/// One unit of a workflow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkUnit {
    /// Unique across both workflows.
    #[schemars(length(min = 1, max = STEP_NAME_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    #[serde(rename = "type", default)]
    pub type_: WorkUnitType,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub inputs: Vec<UnitInput>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub outputs: Vec<UnitOutput>,
    pub exec_unit_template: ExecUnitTemplate,
}

/// Kinds of work units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum WorkUnitType {
    /// A pod.
    #[default]
    ExecUnit,
}

/// A constant, or a key of an io context (exactly one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.value) != has(self.iocontext)",
    "message": "an input has exactly one of value and iocontext"
}]))]
pub struct UnitInput {
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = VALUE_MAX))]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iocontext: Option<IoContextRef>,
}

/// A key of an io context.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IoContextRef {
    /// The context: must be the OLM's own `ioContextName`.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// `<unit>.<output>`.
    #[schemars(length(min = 3, max = 100), regex(pattern = IO_KEY_PATTERN))]
    pub key: String,
}

/// Keys of an io context: `<unit>.<output>`.
pub const IO_KEY_PATTERN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?[.][a-zA-Z]([a-zA-Z0-9-]*[a-zA-Z0-9])?$";

/// The io context key of a unit's output.
pub fn io_key(unit: &str, output: &str) -> String {
    format!("{unit}.{output}")
}

/// A declared output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnitOutput {
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub name: String,
}

/// The pod of an exec unit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecUnitTemplate {
    /// Starting point of the pod (`metadata` and `spec` of a PodTemplateSpec). The step's
    /// container is the one named `step` (or the first); the names in [`reserved`] are the
    /// operator's; `restartPolicy` must be unset or `Never`.
    #[schemars(schema_with = "crate::schema::any_object")]
    pub pod_template: serde_json::Value,
    /// The script the step container runs (its own command otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = STEP_SCRIPT_MAX))]
    pub script: Option<String>,
    /// Where inputs go in the step container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub input_injects: Vec<InputInject>,
    /// Which files become outputs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub output_exports: Vec<OutputExport>,
}

/// An input's destination.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InputInject {
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub input_name: String,
    pub dst: InjectDst,
}

/// An env var or a file in the step container (exactly one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.env) != has(self.localPath)",
    "message": "exactly one of env and localPath"
}]))]
pub struct InjectDst {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = ENV_NAME_MAX), regex(pattern = ENV_NAME_PATTERN))]
    pub env: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = IO_PATH_MAX))]
    pub local_path: Option<String>,
}

/// A file whose contents become an output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputExport {
    #[schemars(length(min = 2, max = IO_PATH_MAX))]
    pub from_path: String,
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub output_name: String,
}

/// Where an OLM is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OlmPhase {
    /// Nothing ran yet.
    #[default]
    Pending,
    /// The preStart workflow runs.
    Starting,
    /// Every preStart unit succeeded.
    Started,
    /// A preStart unit failed; the workflow stopped there (`failedPhase`, unit status).
    Failed,
    /// The object is being deleted: the postStop workflow runs (failures are retried).
    Stopping,
    /// Every postStop unit succeeded; the finalizer is released.
    Stopped,
}

/// Where a work unit is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum UnitPhase {
    #[default]
    Pending,
    Running,
    Succeeded,
    Failed,
    /// Not run: a postStop unit whose inputs come from outputs that were never written (the
    /// create step making them failed or never ran, so there is nothing for it to undo).
    Skipped,
}

impl UnitPhase {
    /// Succeeded or skipped: the workflow goes on past it.
    pub fn is_done(self) -> bool {
        matches!(self, UnitPhase::Succeeded | UnitPhase::Skipped)
    }
}

/// Which workflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Workflow {
    PreStart,
    PostStop,
}

impl Workflow {
    pub fn as_str(self) -> &'static str {
        match self {
            Workflow::PreStart => "preStart",
            Workflow::PostStop => "postStop",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "preStart" => Some(Workflow::PreStart),
            "postStop" => Some(Workflow::PostStop),
            _ => None,
        }
    }
}

/// Observed state of an OLM.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OlmStatus {
    #[serde(default)]
    pub phase: OlmPhase,
    /// The workflow that failed, in phase `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_phase: Option<Workflow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pre_start: Vec<UnitStatus>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_stop: Vec<UnitStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl OlmStatus {
    pub fn units(&self, w: Workflow) -> &[UnitStatus] {
        match w {
            Workflow::PreStart => &self.pre_start,
            Workflow::PostStop => &self.post_stop,
        }
    }

    pub fn units_mut(&mut self, w: Workflow) -> &mut Vec<UnitStatus> {
        match w {
            Workflow::PreStart => &mut self.pre_start,
            Workflow::PostStop => &mut self.post_stop,
        }
    }
}

/// Observed state of one work unit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnitStatus {
    pub name: String,
    #[serde(default)]
    pub phase: UnitPhase,
    /// The pod of the current (or last) attempt. The io context server serves a pod only if
    /// it is recorded here, name and UID: that is how it knows which unit is asking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_unit: Option<ExecUnitRef>,
    /// Attempts started (postStop units are retried).
    #[serde(default)]
    pub attempts: i32,
    /// When the next attempt may start, after a failed one (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Why the unit failed, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The end of the failed attempt's log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

/// A work-unit pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecUnitRef {
    pub name: String,
    pub namespace: String,
    /// Empty until the pod is created.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
}

impl OlmSpec {
    pub fn workflow(&self, w: Workflow) -> &[WorkUnit] {
        match w {
            Workflow::PreStart => &self.pre_start,
            Workflow::PostStop => &self.post_stop,
        }
    }

    /// A unit by name, in either workflow.
    pub fn unit(&self, w: Workflow, name: &str) -> Option<&WorkUnit> {
        self.workflow(w).iter().find(|u| u.name == name)
    }

    /// What the schema cannot check: unique unit names, inputs from this OLM's own io context
    /// and from outputs declared before them, injections and exports of declared names.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        let mut seen: HashMap<&str, HashSet<&str>> = HashMap::new();
        for w in [Workflow::PreStart, Workflow::PostStop] {
            for (i, unit) in self.workflow(w).iter().enumerate() {
                let path = format!("spec.{}[{i}]", w.as_str());
                c.require(
                    is_dns_label(&unit.name) && unit.name.len() <= STEP_NAME_MAX,
                    || format!("{path}.name"),
                    "must be a DNS-1123 label of at most 30 characters",
                );
                if seen.contains_key(unit.name.as_str()) {
                    c.fail(
                        format!("{path}.name"),
                        format!("duplicate unit name {:?}", unit.name),
                    );
                }
                let inputs: HashSet<&str> = unit.inputs.iter().map(|i| i.name.as_str()).collect();
                for (j, input) in unit.inputs.iter().enumerate() {
                    let ipath = format!("{path}.inputs[{j}]");
                    io_name(&mut c, &format!("{ipath}.name"), &input.name);
                    match (&input.value, &input.iocontext) {
                        (Some(v), None) => c.max_len(|| format!("{ipath}.value"), v, VALUE_MAX),
                        (None, Some(r)) => {
                            c.require(
                                r.name == self.io_context_name,
                                || format!("{ipath}.iocontext.name"),
                                "must be the OLM's own ioContextName",
                            );
                            let known = r.key.split_once('.').is_some_and(|(u, o)| {
                                seen.get(u).is_some_and(|outs| outs.contains(o))
                            });
                            c.require(
                                known,
                                || format!("{ipath}.iocontext.key"),
                                "must be <unit>.<output> of an output declared by an earlier unit",
                            );
                        }
                        _ => c.fail(ipath, "an input has exactly one of value and iocontext"),
                    }
                }
                let outputs: HashSet<&str> = unit.outputs.iter().map(|o| o.name.as_str()).collect();
                let t = &unit.exec_unit_template;
                c.require(
                    t.pod_template.is_object(),
                    || format!("{path}.execUnitTemplate.podTemplate"),
                    "must be an object",
                );
                let mut envs = HashSet::new();
                let mut paths = HashSet::new();
                for (j, inj) in t.input_injects.iter().enumerate() {
                    let jpath = format!("{path}.execUnitTemplate.inputInjects[{j}]");
                    c.require(
                        inputs.contains(inj.input_name.as_str()),
                        || format!("{jpath}.inputName"),
                        "must name one of the unit's inputs",
                    );
                    match (&inj.dst.env, &inj.dst.local_path) {
                        (Some(e), None) => {
                            check_env(&mut c, &format!("{jpath}.dst.env"), e, &mut envs)
                        }
                        (None, Some(p)) => {
                            check_path(&mut c, &format!("{jpath}.dst.localPath"), p, &mut paths)
                        }
                        _ => c.fail(format!("{jpath}.dst"), "exactly one of env and localPath"),
                    }
                }
                let mut exported = HashSet::new();
                for (j, e) in t.output_exports.iter().enumerate() {
                    let epath = format!("{path}.execUnitTemplate.outputExports[{j}]");
                    c.require(
                        outputs.contains(e.output_name.as_str()),
                        || format!("{epath}.outputName"),
                        "must name one of the unit's outputs",
                    );
                    if !exported.insert(e.output_name.as_str()) {
                        c.fail(format!("{epath}.outputName"), "exported twice");
                    }
                    let mut own = HashSet::new();
                    check_path(&mut c, &format!("{epath}.fromPath"), &e.from_path, &mut own);
                }
                seen.insert(&unit.name, outputs);
            }
        }
        c.finish("ObjectLifecycleMethods")
    }
}
