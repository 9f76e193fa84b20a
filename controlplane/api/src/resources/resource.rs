//! `Resource`: one plugin instance for one sandbox, and the step pod template it runs.

use std::collections::BTreeMap;

use super::plugin::input_pattern;
use super::*;

/// One plugin instance for one sandbox.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "Resource",
    plural = "resources",
    shortname = "sres",
    category = "spur",
    status = "ResourceStatus",
    derive = "PartialEq",
    doc = "A sandbox's resource (a database, a queue...): made by the operator from a Sandbox's spec.resources[] and a ResourcePlugin. Its create workflow runs before the sandbox's forks start; its outputs land in Secret <sandbox>-<resource> (see status.outputSecret) in each fork namespace; deleting it runs the delete workflow first.",
    printcolumn(name = "Sandbox", type_ = "string", json_path = ".spec.sandbox"),
    printcolumn(name = "Plugin", type_ = "string", json_path = ".spec.plugin"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a Resource is immutable"
}]))]
pub struct ResourceSpec {
    /// The sandbox it belongs to.
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub sandbox: String,
    /// Its name in the sandbox (`spec.resources[].name`).
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// The plugin object it was made from (resolved when the resource was created).
    #[schemars(length(min = 1, max = PLUGIN_OBJECT_NAME_MAX))]
    pub plugin: String,
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: String,
    /// Namespaces that get the output Secret (those of the sandbox's forks).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN)))]
    pub output_namespaces: Vec<String>,
    /// The plugin's steps as work units, with the sandbox's parameters filled in.
    pub olm: ResourceOlm,
}

/// The workflows of a resource.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceOlm {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_STEPS))]
    pub pre_start: Vec<WorkUnit>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_STEPS))]
    pub post_stop: Vec<WorkUnit>,
}

/// Where a resource is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ResourcePhase {
    #[default]
    Pending,
    /// The create workflow runs.
    Creating,
    /// Created; its outputs are in the output Secrets.
    Ready,
    /// A create step failed (see `failure`).
    Failed,
    /// The delete workflow runs (a failed step is retried; see `failure`).
    Deleting,
}

impl ResourcePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ResourcePhase::Pending => "Pending",
            ResourcePhase::Creating => "Creating",
            ResourcePhase::Ready => "Ready",
            ResourcePhase::Failed => "Failed",
            ResourcePhase::Deleting => "Deleting",
        }
    }
}

/// Observed state of a resource.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceStatus {
    #[serde(default)]
    pub phase: ResourcePhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_context_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub olm_name: Option<String>,
    /// Name of the output Secret (in each output namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_secret: Option<String>,
    /// Keys of the output Secret (`<step>.<output>`); the values are only in the Secret.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output_keys: Vec<String>,
    /// The create workflow's units.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub create: Vec<UnitStatus>,
    /// The delete workflow's units.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub delete: Vec<UnitStatus>,
    /// The step that failed, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<StepFailure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A failed step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepFailure {
    pub step: String,
    #[serde(default)]
    pub attempts: i32,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_tail: Option<String>,
}

/// Compiles a plugin's steps into work units for one sandbox resource: `valueFromSandbox`
/// inputs become constants from `params`, `valueFromStep` inputs keys of `io_context`; each
/// step's pod template is the runner's overlay with the step container (named `step`, the
/// runner image unless the overlay names another) given the sandbox's identity in env
/// (`identity`; it replaces the overlay's `SPUR_*` variables and any of the same names).
/// `Err` says what is missing or unusable.
pub fn compile(
    plugin: &ResourcePluginSpec,
    params: &BTreeMap<String, String>,
    io_context: &str,
    identity: &[(&str, &str)],
) -> Result<ResourceOlm, String> {
    let base = step_pod_template(&plugin.runner)?;
    let unit = |step: &PluginStep| -> Result<WorkUnit, String> {
        let mut inputs = Vec::with_capacity(step.inputs.len());
        let mut injects = Vec::with_capacity(step.inputs.len());
        for input in &step.inputs {
            let unit_input = match &input.value_from_step {
                Some(r) => UnitInput {
                    name: input.name.clone(),
                    value: None,
                    iocontext: Some(IoContextRef {
                        name: io_context.to_owned(),
                        key: io_key(&r.name, &r.output),
                    }),
                },
                None => {
                    let value = params.get(&input.name).ok_or_else(|| {
                        format!(
                            "step {:?} needs parameter {:?}: set it in params",
                            step.name, input.name
                        )
                    })?;
                    if let Some(pattern) = &input.pattern {
                        // The value is not repeated: the creator has it, and the status that
                        // carries this message is read by more people than the spec.
                        let re = input_pattern(pattern)
                            .map_err(|e| format!("input {:?}'s pattern is {e}", input.name))?;
                        if !re.is_match(value) {
                            return Err(format!(
                                "parameter {:?} must match the plugin's pattern {pattern:?}",
                                input.name
                            ));
                        }
                    }
                    UnitInput {
                        name: input.name.clone(),
                        value: Some(value.clone()),
                        iocontext: None,
                    }
                }
            };
            inputs.push(unit_input);
            let dst = match &input.as_ {
                Some(InjectAs {
                    path: Some(p),
                    env: None,
                }) => InjectDst {
                    env: None,
                    local_path: Some(p.clone()),
                },
                Some(InjectAs { env: Some(e), .. }) => InjectDst {
                    env: Some(e.clone()),
                    local_path: None,
                },
                _ => InjectDst {
                    env: Some(default_input_env(&input.name)),
                    local_path: None,
                },
            };
            injects.push(InputInject {
                input_name: input.name.clone(),
                dst,
            });
        }
        let mut env: Vec<serde_json::Value> = identity
            .iter()
            .map(|(k, v)| serde_json::json!({"name": k, "value": v}))
            .collect();
        env.push(serde_json::json!({"name": env::STEP_NAME, "value": step.name}));
        let mut pod_template = base.clone();
        if let Some(c) = pod_template
            .pointer_mut("/spec/containers/0/env")
            .and_then(|e| e.as_array_mut())
        {
            c.retain(|e| {
                !e.get("name").and_then(|n| n.as_str()).is_some_and(|n| {
                    n.starts_with("SPUR_") || identity.iter().any(|(k, _)| *k == n)
                })
            });
            c.extend(env);
        }
        Ok(WorkUnit {
            name: step.name.clone(),
            type_: WorkUnitType::ExecUnit,
            inputs,
            outputs: step
                .outputs
                .iter()
                .map(|o| UnitOutput {
                    name: o.name.clone(),
                })
                .collect(),
            exec_unit_template: ExecUnitTemplate {
                pod_template,
                script: Some(step.script.clone()),
                input_injects: injects,
                output_exports: step
                    .outputs
                    .iter()
                    .map(|o| OutputExport {
                        from_path: o.value_from_path.clone(),
                        output_name: o.name.clone(),
                    })
                    .collect(),
            },
        })
    };
    Ok(ResourceOlm {
        pre_start: plugin.create.iter().map(unit).collect::<Result<_, _>>()?,
        post_stop: plugin.delete.iter().map(unit).collect::<Result<_, _>>()?,
    })
}

/// The runner's overlay as a pod template whose first container is the step container,
/// named `step`, with the runner image (unless the overlay sets one) and an `env` list.
fn step_pod_template(runner: &Runner) -> Result<serde_json::Value, String> {
    let mut t = runner
        .pod_template_overlay
        .clone()
        .unwrap_or_else(|| serde_json::json!({}));
    let obj = t
        .as_object_mut()
        .ok_or("runner.podTemplateOverlay must be an object")?;
    let spec = obj
        .entry("spec")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()
        .ok_or("runner.podTemplateOverlay.spec must be an object")?;
    let containers = spec
        .entry("containers")
        .or_insert_with(|| serde_json::json!([]))
        .as_array_mut()
        .ok_or("runner.podTemplateOverlay.spec.containers must be a list")?;
    let name_of = |c: &serde_json::Value| c.get("name").and_then(|n| n.as_str()).map(str::to_owned);
    let at = containers
        .iter()
        .position(|c| name_of(c).as_deref() == Some(reserved::STEP_CONTAINER));
    let mut step = match at {
        Some(i) => containers.remove(i),
        None => serde_json::json!({ "name": reserved::STEP_CONTAINER }),
    };
    let c = step
        .as_object_mut()
        .ok_or("the step container must be an object")?;
    c.entry("image")
        .or_insert_with(|| serde_json::Value::String(runner.image.clone()));
    let env = c.entry("env").or_insert_with(|| serde_json::json!([]));
    if !env.is_array() {
        return Err("the step container's env must be a list".into());
    }
    containers.insert(0, step);
    Ok(t)
}
