//! Sandbox resources: `ResourcePlugin` (how to create and delete something stateful, such as a
//! database, as ordered steps run in pods), `Resource` (one plugin instance for one sandbox)
//! and `ObjectLifecycleMethods` (the workflow engine a Resource drives: its `preStart` work
//! units run before the sandbox's forks start, its `postStop` units after the sandbox is gone).
//!
//! ```text
//! Sandbox.spec.resources[] ──► Resource (cluster) ──► ObjectLifecycleMethods (cluster) ──► work-unit pods
//!        ▲                          │                        (spur-io in each pod ◄──► io context server)
//!        └── forks start once ──────┘ outputs copied into Secret <sandbox>-<resource> in each fork namespace
//! ```
//!
//! Values a step produces (a DSN, a password) live in the io context Secret and in the output
//! Secrets only: never in a spec or status.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::validation::*;

/// Object names of plugins: `<plugin>` (version 0.0.0) or `<plugin>.<major>.<minor>.<patch>`,
/// so that a (plugin, version) pair is one object by construction.
pub const PLUGIN_OBJECT_NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8}))?$";
/// Longest plugin object name.
pub const PLUGIN_OBJECT_NAME_MAX: usize = 100;
/// Step and work-unit names: short DNS labels (they end up in pod names).
pub const STEP_NAME_MAX: usize = 30;
/// Input and output names, as Signadot writes them.
pub const IO_NAME_PATTERN: &str = "^[a-zA-Z]([a-zA-Z0-9-]*[a-zA-Z0-9])?$";
pub const IO_NAME_MAX: usize = 63;
/// Most steps per workflow.
pub const MAX_STEPS: usize = 16;
/// Most inputs, or outputs, per step.
pub const MAX_IO: usize = 32;
/// Largest step script (bytes).
pub const STEP_SCRIPT_MAX: usize = 64 * 1024;
/// Longest path of an injected input or an exported output.
pub const IO_PATH_MAX: usize = 1024;
/// Largest value of one output (bytes): outputs are small strings (a host, a DSN), and all of
/// a resource's values share one Secret (1 MiB).
pub const OUTPUT_VALUE_MAX: usize = 64 * 1024;
/// Kept bytes of a failed step's log, for status.
pub const LOG_TAIL_MAX: usize = 2048;

/// Names work-unit pods reserve: a plugin's pod template overlay may not use them.
pub mod reserved {
    /// The emptyDir holding the spur-io binary and the step's inputs.
    pub const IO_VOLUME: &str = "spur-io";
    /// The projected ServiceAccount token (audience: the io context server).
    pub const TOKEN_VOLUME: &str = "spur-io-token";
    /// The io context server's CA bundle.
    pub const CA_VOLUME: &str = "spur-io-ca";
    /// The init container that copies spur-io in and fetches the inputs.
    pub const INIT_CONTAINER: &str = "spur-io-init";
    /// The step's container.
    pub const STEP_CONTAINER: &str = "step";
}

/// Environment every step gets (names starting with `SPUR_` are the operator's).
pub mod env {
    /// The sandbox the resource belongs to.
    pub const SANDBOX_NAME: &str = "SPUR_SANDBOX_NAME";
    /// The sandbox's routing key: a good unique suffix for database and user names.
    pub const ROUTING_KEY: &str = "SPUR_ROUTING_KEY";
    /// The resource's name in the sandbox.
    pub const RESOURCE_NAME: &str = "SPUR_RESOURCE_NAME";
    /// The step's name.
    pub const STEP_NAME: &str = "SPUR_STEP_NAME";
}

// === ResourcePlugin ===

/// How to create and delete one kind of resource.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "ResourcePlugin",
    plural = "resourceplugins",
    shortname = "srp",
    category = "spur",
    status = "ResourcePluginStatus",
    derive = "PartialEq",
    doc = "A resource plugin: create and delete steps (scripts run in pods of the runner image) that make something stateful, such as a database, for one sandbox. Named <plugin> (version 0.0.0) or <plugin>.<major>.<minor>.<patch>; sandboxes ask for <plugin>[@<version>]. A version is immutable.",
    validation = Rule::new("size(self.metadata.name) <= 100 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8}))?$')").message("a plugin is named <plugin> or <plugin>.<major>.<minor>.<patch> (e.g. postgres.1.0.0), at most 100 characters"),
    printcolumn(name = "Image", type_ = "string", json_path = ".spec.runner.image"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Description", type_ = "string", json_path = ".spec.description", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a plugin version is immutable: publish a new version (<plugin>.<major>.<minor>.<patch>) instead"
}]))]
pub struct ResourcePluginSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX))]
    pub description: Option<String>,
    /// What the steps run in.
    pub runner: Runner,
    /// Steps that create the resource, run in order before the sandbox's forks start.
    #[schemars(length(min = 1, max = MAX_STEPS))]
    pub create: Vec<PluginStep>,
    /// Steps that delete it, run in order after the sandbox's forks are gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_STEPS))]
    pub delete: Vec<PluginStep>,
}

/// Observed state of a plugin.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourcePluginStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: the steps refer only to outputs declared by earlier steps and the pod template
    /// overlay is usable (what the schema cannot check); sandboxes cannot use it otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The pods steps run in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Runner {
    /// Image of the step container (any image with the interpreter the scripts name: Spur's
    /// io helper is copied in, not built in).
    #[schemars(length(min = 1, max = IMAGE_MAX), regex(pattern = IMAGE_PATTERN))]
    pub image: String,
    /// Merged into each step's pod (`metadata` and `spec` of a PodTemplateSpec): resources,
    /// node selectors, tolerations, extra env or volumes. The names in [`reserved`] are the
    /// operator's. Checked by the operator when a sandbox uses the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_object")]
    pub pod_template_overlay: Option<serde_json::Value>,
}

/// One step of a plugin workflow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginStep {
    /// Unique across the plugin's create and delete steps; names the step's outputs
    /// (`<step>.<output>`).
    #[schemars(length(min = 1, max = STEP_NAME_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    /// Run as an executable file: start it with `#!` to choose the interpreter (`/bin/sh`
    /// otherwise). A non-zero exit fails the step.
    #[schemars(length(min = 1, max = STEP_SCRIPT_MAX))]
    pub script: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub inputs: Vec<StepInput>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IO))]
    pub outputs: Vec<StepOutput>,
}

/// An input of a step: a sandbox parameter or an earlier step's output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.valueFromSandbox) && self.valueFromSandbox) != has(self.valueFromStep)",
    "message": "an input has exactly one of valueFromSandbox: true and valueFromStep"
}]))]
pub struct StepInput {
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub name: String,
    /// The sandbox's `resources[].params[<name>]` (required: a sandbox without it is refused).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub value_from_sandbox: bool,
    /// An output of an earlier create step (or, in a delete step, of any create step or an
    /// earlier delete step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from_step: Option<StepOutputRef>,
    /// How the step sees it; default: an env var named after the input, upper-cased, `-` → `_`.
    #[serde(default, rename = "as", skip_serializing_if = "Option::is_none")]
    pub as_: Option<InjectAs>,
    /// For a `valueFromSandbox` input: a regular expression (Rust `regex` syntax) the whole
    /// parameter must match, or the sandbox is refused. Sandbox creators are not plugin authors:
    /// a parameter that reaches a shell command or SQL should be held to the characters the
    /// script expects (e.g. `[a-z][a-z0-9_]{0,30}` for a database name prefix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = INPUT_PATTERN_MAX))]
    pub pattern: Option<String>,
}

/// Longest `inputs[].pattern`.
pub const INPUT_PATTERN_MAX: usize = 512;
/// Compiled size limit of an input pattern (the `regex` crate's own limit is 10 MiB): the
/// operator compiles it for every sandbox that uses the plugin.
const INPUT_PATTERN_SIZE_LIMIT: usize = 256 * 1024;

/// An input's pattern, anchored to match the whole parameter.
fn input_pattern(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(INPUT_PATTERN_SIZE_LIMIT)
        .build()
        .map_err(|e| format!("not a usable regular expression: {e}"))
}

/// `<step>.<output>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepOutputRef {
    #[schemars(length(min = 1, max = STEP_NAME_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub name: String,
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub output: String,
}

/// An env var or a file (exactly one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.env) != has(self.path)",
    "message": "exactly one of env and path"
}]))]
pub struct InjectAs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = ENV_NAME_MAX), regex(pattern = ENV_NAME_PATTERN))]
    pub env: Option<String>,
    /// Absolute path of a file holding the value (mode 0600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = IO_PATH_MAX))]
    pub path: Option<String>,
}

/// A value the step leaves in a file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepOutput {
    #[schemars(length(min = 1, max = IO_NAME_MAX), regex(pattern = IO_NAME_PATTERN))]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX))]
    pub description: Option<String>,
    /// Absolute path the step writes the value to (read when the script ends, even if it
    /// failed; a missing file fails the step).
    #[schemars(length(min = 2, max = IO_PATH_MAX))]
    pub value_from_path: String,
}

/// A plugin version as a comparable triple.
pub type PluginVersion = (u32, u32, u32);

/// Splits a plugin object name into (plugin, version); `None` if it is not one.
pub fn parse_plugin_object_name(name: &str) -> Option<(&str, PluginVersion)> {
    if name.len() > PLUGIN_OBJECT_NAME_MAX {
        return None;
    }
    match name.split_once('.') {
        None => is_dns_label(name).then_some((name, (0, 0, 0))),
        Some((plugin, version)) => {
            let v = parse_version(version)?;
            is_dns_label(plugin).then_some((plugin, v))
        }
    }
}

/// `major.minor.patch`, numeric, without leading zeros.
pub fn parse_version(s: &str) -> Option<PluginVersion> {
    let mut parts = s.split('.');
    let mut next = || -> Option<u32> {
        let p = parts.next()?;
        if p.is_empty() || p.len() > 9 || (p.len() > 1 && p.starts_with('0')) {
            return None;
        }
        p.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| p.parse().ok())?
    };
    let v = (next()?, next()?, next()?);
    parts.next().is_none().then_some(v)
}

/// What a sandbox's `plugin: name[@version]` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginRequest<'a> {
    /// The highest version at the time the resource is created.
    Latest(&'a str),
    Exact(&'a str, PluginVersion),
}

/// Parses `name`, `name@latest` or `name@<major>.<minor>.<patch>`; the error says why not.
pub fn parse_plugin_request(s: &str) -> Result<PluginRequest<'_>, String> {
    let (name, version) = match s.split_once('@') {
        None => (s, None),
        Some((n, v)) => (n, Some(v)),
    };
    if !is_dns_label(name) {
        return Err(format!("{s:?}: the plugin name must be a DNS-1123 label"));
    }
    match version {
        None | Some("latest") => Ok(PluginRequest::Latest(name)),
        Some(v) => parse_version(v)
            .map(|v| PluginRequest::Exact(name, v))
            .ok_or_else(|| {
                format!("{s:?}: a version is <major>.<minor>.<patch> (numbers) or latest")
            }),
    }
}

/// Picks the plugin object a request resolves to among the names of existing plugins.
pub fn resolve_plugin<'a>(
    request: &PluginRequest<'_>,
    names: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let candidates = names.into_iter().filter_map(|n| {
        let (plugin, v) = parse_plugin_object_name(n)?;
        Some((n, plugin, v))
    });
    match request {
        PluginRequest::Latest(want) => candidates
            .filter(|(_, p, _)| p == want)
            .max_by_key(|(_, _, v)| *v)
            .map(|(n, _, _)| n),
        PluginRequest::Exact(want, version) => candidates
            .filter(|(_, p, v)| p == want && v == version)
            .map(|(n, _, _)| n)
            .next(),
    }
}

/// The env var an input goes to without `as`.
pub fn default_input_env(input: &str) -> String {
    input.to_ascii_uppercase().replace('-', "_")
}

impl ResourcePlugin {
    /// [`ResourcePluginSpec::validate`] plus the rule on the object's name.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        if let Some(name) = self.metadata.name.as_deref() {
            c.require(
                parse_plugin_object_name(name).is_some(),
                || "metadata.name".into(),
                "must be <plugin> or <plugin>.<major>.<minor>.<patch>, at most 100 characters",
            );
        }
        self.spec.check(&mut c);
        c.finish("ResourcePlugin")
    }
}

impl ResourcePluginSpec {
    /// The schema's rules and what it cannot express: unique step names, inputs that refer to
    /// declared outputs of earlier steps, unique injection targets.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c);
        c.finish("ResourcePlugin")
    }

    fn check(&self, c: &mut Checker) {
        c.require(
            is_image(&self.runner.image),
            || "spec.runner.image".into(),
            "must be an image reference (no whitespace)",
        );
        c.max_len(|| "spec.runner.image".into(), &self.runner.image, IMAGE_MAX);
        if let Some(o) = &self.runner.pod_template_overlay {
            c.require(
                o.is_object(),
                || "spec.runner.podTemplateOverlay".into(),
                "must be an object",
            );
        }
        c.require(
            !self.create.is_empty(),
            || "spec.create".into(),
            "needs at least one step",
        );
        c.max_items(|| "spec.create".into(), &self.create, MAX_STEPS);
        c.max_items(|| "spec.delete".into(), &self.delete, MAX_STEPS);
        // Outputs visible so far, by step: create steps see earlier create steps; delete steps
        // see every create step and earlier delete steps.
        let mut seen: HashMap<&str, HashSet<&str>> = HashMap::new();
        for (workflow, steps) in [("create", &self.create), ("delete", &self.delete)] {
            for (i, step) in steps.iter().enumerate() {
                let path = format!("spec.{workflow}[{i}]");
                check_step(c, &path, step, &seen);
                if seen.contains_key(step.name.as_str()) {
                    c.fail(
                        format!("{path}.name"),
                        format!(
                            "duplicate step name {:?} (names are unique across create and delete)",
                            step.name
                        ),
                    );
                }
                seen.insert(
                    &step.name,
                    step.outputs.iter().map(|o| o.name.as_str()).collect(),
                );
            }
        }
    }

    /// Names of the sandbox parameters the plugin's steps read.
    pub fn parameters(&self) -> impl Iterator<Item = &str> {
        self.create
            .iter()
            .chain(&self.delete)
            .flat_map(|s| &s.inputs)
            .filter(|i| i.value_from_sandbox)
            .map(|i| i.name.as_str())
    }
}

fn check_step(c: &mut Checker, path: &str, step: &PluginStep, seen: &HashMap<&str, HashSet<&str>>) {
    c.require(
        is_dns_label(&step.name) && step.name.len() <= STEP_NAME_MAX,
        || format!("{path}.name"),
        "must be a DNS-1123 label of at most 30 characters",
    );
    c.require(
        !step.script.is_empty(),
        || format!("{path}.script"),
        "must not be empty",
    );
    c.max_len(|| format!("{path}.script"), &step.script, STEP_SCRIPT_MAX);
    c.max_items(|| format!("{path}.inputs"), &step.inputs, MAX_IO);
    c.max_items(|| format!("{path}.outputs"), &step.outputs, MAX_IO);
    let mut names = HashSet::new();
    let mut envs = HashSet::new();
    let mut paths = HashSet::new();
    for (i, input) in step.inputs.iter().enumerate() {
        let ipath = format!("{path}.inputs[{i}]");
        io_name(c, &format!("{ipath}.name"), &input.name);
        if !names.insert(input.name.as_str()) {
            c.fail(
                format!("{ipath}.name"),
                format!("duplicate input {:?}", input.name),
            );
        }
        match (&input.value_from_step, input.value_from_sandbox) {
            (Some(r), false) => match seen.get(r.name.as_str()) {
                None => c.fail(
                    format!("{ipath}.valueFromStep.name"),
                    format!("{:?} is not an earlier step", r.name),
                ),
                Some(outputs) if !outputs.contains(r.output.as_str()) => c.fail(
                    format!("{ipath}.valueFromStep.output"),
                    format!("step {:?} declares no output {:?}", r.name, r.output),
                ),
                Some(_) => {}
            },
            (None, true) => {}
            _ => c.fail(
                ipath.clone(),
                "an input has exactly one of valueFromSandbox: true and valueFromStep",
            ),
        }
        if let Some(pattern) = &input.pattern {
            if !input.value_from_sandbox {
                c.fail(
                    format!("{ipath}.pattern"),
                    "only a valueFromSandbox input has a pattern (step outputs come from the plugin's own steps)",
                );
            }
            c.max_len(|| format!("{ipath}.pattern"), pattern, INPUT_PATTERN_MAX);
            if let Err(e) = input_pattern(pattern) {
                c.fail(format!("{ipath}.pattern"), e);
            }
        }
        match &input.as_ {
            None => {
                let env = default_input_env(&input.name);
                check_env(c, &format!("{ipath}.name"), &env, &mut envs);
            }
            Some(InjectAs {
                env: Some(env),
                path: None,
            }) => check_env(c, &format!("{ipath}.as.env"), env, &mut envs),
            Some(InjectAs {
                env: None,
                path: Some(p),
            }) => check_path(c, &format!("{ipath}.as.path"), p, &mut paths),
            Some(_) => c.fail(format!("{ipath}.as"), "exactly one of env and path"),
        }
    }
    let mut outputs = HashSet::new();
    for (i, output) in step.outputs.iter().enumerate() {
        let opath = format!("{path}.outputs[{i}]");
        io_name(c, &format!("{opath}.name"), &output.name);
        if !outputs.insert(output.name.as_str()) {
            c.fail(
                format!("{opath}.name"),
                format!("duplicate output {:?}", output.name),
            );
        }
        let mut own = HashSet::new();
        check_path(
            c,
            &format!("{opath}.valueFromPath"),
            &output.value_from_path,
            &mut own,
        );
    }
}

fn io_name(c: &mut Checker, path: &str, name: &str) {
    c.require(
        is_io_name(name),
        || path.into(),
        "must be 1-63 of [a-zA-Z0-9-], starting with a letter and ending with a letter or digit",
    );
}

fn check_env(c: &mut Checker, path: &str, env: &str, seen: &mut HashSet<String>) {
    c.require(is_env_name(env), || path.into(), "must be an env var name");
    c.require(
        !env.starts_with("SPUR_"),
        || path.into(),
        "env names starting with SPUR_ are set by the operator",
    );
    if !seen.insert(env.to_owned()) {
        c.fail(path, format!("two inputs go to env {env:?}"));
    }
}

fn check_path<'a>(c: &mut Checker, path: &str, p: &'a str, seen: &mut HashSet<&'a str>) {
    c.require(
        is_io_path(p),
        || path.into(),
        "must be an absolute file path without '..', not under /spur-io",
    );
    c.max_len(|| path.into(), p, IO_PATH_MAX);
    if !seen.insert(p) {
        c.fail(path, format!("two inputs go to file {p:?}"));
    }
}

/// [`IO_NAME_PATTERN`].
pub fn is_io_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= IO_NAME_MAX
        && b[0].is_ascii_alphabetic()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
}

/// An absolute file path with no `..`, `.` or empty component, outside Spur's own directory.
pub fn is_io_path(p: &str) -> bool {
    p.len() >= 2
        && p.starts_with('/')
        && !p.ends_with('/')
        && !p.contains('\0')
        && p[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != ".." && c != ".")
        && p != "/spur-io"
        && !p.starts_with("/spur-io/")
}

// === ObjectLifecycleMethods ===

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

// === Resource ===

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
/// runner image unless the overlay names another) given the sandbox's identity in `SPUR_*` env.
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
                !e.get("name")
                    .and_then(|n| n.as_str())
                    .is_some_and(|n| n.starts_with("SPUR_"))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, inputs: Vec<StepInput>, outputs: &[&str]) -> PluginStep {
        PluginStep {
            name: name.into(),
            script: "#!/bin/sh\ntrue\n".into(),
            inputs,
            outputs: outputs
                .iter()
                .map(|o| StepOutput {
                    name: (*o).into(),
                    description: None,
                    value_from_path: format!("/tmp/{o}"),
                })
                .collect(),
        }
    }

    fn from_step(name: &str, step: &str, output: &str) -> StepInput {
        StepInput {
            name: name.into(),
            value_from_sandbox: false,
            value_from_step: Some(StepOutputRef {
                name: step.into(),
                output: output.into(),
            }),
            as_: None,
            pattern: None,
        }
    }

    fn from_sandbox(name: &str) -> StepInput {
        StepInput {
            name: name.into(),
            value_from_sandbox: true,
            value_from_step: None,
            as_: None,
            pattern: None,
        }
    }

    fn plugin(create: Vec<PluginStep>, delete: Vec<PluginStep>) -> ResourcePluginSpec {
        ResourcePluginSpec {
            description: None,
            runner: Runner {
                image: "localhost/spur-postgres:dev".into(),
                pod_template_overlay: None,
            },
            create,
            delete,
        }
    }

    #[test]
    fn plugin_names_and_versions() {
        assert_eq!(
            parse_plugin_object_name("postgres"),
            Some(("postgres", (0, 0, 0)))
        );
        assert_eq!(
            parse_plugin_object_name("postgres.1.10.0"),
            Some(("postgres", (1, 10, 0)))
        );
        for bad in [
            "Pg",
            "pg.1",
            "pg.1.0",
            "pg.01.0.0",
            "pg.1.0.0.0",
            "pg.a.b.c",
            "pg.",
        ] {
            assert_eq!(parse_plugin_object_name(bad), None, "{bad}");
        }
        let names = [
            "postgres",
            "postgres.1.2.0",
            "postgres.1.10.0",
            "mariadb.2.0.0",
        ];
        let pick = |s: &str| resolve_plugin(&parse_plugin_request(s).unwrap(), names);
        assert_eq!(pick("postgres"), Some("postgres.1.10.0"));
        assert_eq!(pick("postgres@latest"), Some("postgres.1.10.0"));
        assert_eq!(pick("postgres@1.2.0"), Some("postgres.1.2.0"));
        assert_eq!(pick("postgres@0.0.0"), Some("postgres"));
        assert_eq!(pick("postgres@3.0.0"), None);
        assert_eq!(pick("redis"), None);
        assert!(parse_plugin_request("postgres@1.2").is_err());
        assert!(parse_plugin_request("postgres@1.2.0-rc1").is_err());
    }

    #[test]
    fn plugin_references_must_point_backwards() {
        let ok = plugin(
            vec![
                step("server", vec![from_sandbox("dbname")], &["host"]),
                step(
                    "provision",
                    vec![from_step("host", "server", "host")],
                    &["dsn"],
                ),
            ],
            vec![step(
                "drop",
                vec![from_step("dsn", "provision", "dsn")],
                &[],
            )],
        );
        ok.validate().unwrap();
        assert_eq!(ok.parameters().collect::<Vec<_>>(), ["dbname"]);

        let forward = plugin(
            vec![
                step("a", vec![from_step("x", "b", "x")], &[]),
                step("b", vec![], &["x"]),
            ],
            vec![],
        );
        let e = forward.validate().unwrap_err().to_string();
        assert!(
            e.contains("spec.create[0].inputs[0].valueFromStep.name"),
            "{e}"
        );

        let undeclared = plugin(
            vec![
                step("a", vec![], &["x"]),
                step("b", vec![from_step("y", "a", "y")], &[]),
            ],
            vec![],
        );
        let e = undeclared.validate().unwrap_err().to_string();
        assert!(e.contains("declares no output"), "{e}");

        let dup = plugin(vec![step("a", vec![], &[])], vec![step("a", vec![], &[])]);
        assert!(
            dup.validate()
                .unwrap_err()
                .to_string()
                .contains("duplicate step")
        );

        let mut both = from_sandbox("x");
        both.value_from_step = Some(StepOutputRef {
            name: "a".into(),
            output: "x".into(),
        });
        let e = plugin(
            vec![step("a", vec![], &["x"]), step("b", vec![both], &[])],
            vec![],
        )
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("exactly one"), "{e}");

        let mut reserved_env = from_sandbox("x");
        reserved_env.as_ = Some(InjectAs {
            env: Some("SPUR_X".into()),
            path: None,
        });
        let mut bad_path = from_sandbox("y");
        bad_path.as_ = Some(InjectAs {
            env: None,
            path: Some("/spur-io/x".into()),
        });
        let e = plugin(vec![step("a", vec![reserved_env, bad_path], &[])], vec![])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("SPUR_"), "{e}");
        assert!(e.contains("as.path"), "{e}");
    }

    #[test]
    fn io_paths() {
        for ok in ["/tmp/dsn", "/out/a-b.txt"] {
            assert!(is_io_path(ok), "{ok}");
        }
        for bad in [
            "",
            "/",
            "tmp/x",
            "/a/../b",
            "/a/./b",
            "/a//b",
            "/a/",
            "/spur-io",
            "/spur-io/in",
        ] {
            assert!(!is_io_path(bad), "{bad}");
        }
    }

    /// A parameter that reaches a script is held to its input's pattern, as a whole: the
    /// documented PostgreSQL plugin's prefix cannot smuggle a quote into its SQL.
    #[test]
    fn parameters_must_match_their_inputs_pattern() {
        let mut prefix = from_sandbox("db-prefix");
        prefix.pattern = Some("[a-z][a-z0-9_]{0,30}".into());
        let p = plugin(vec![step("database", vec![prefix], &["dbname"])], vec![]);
        p.validate().unwrap();
        let with = |v: &str| BTreeMap::from([("db-prefix".to_string(), v.to_string())]);
        compile(&p, &with("orders_v2"), "ctx", &[]).unwrap();
        for hostile in [
            "x\"; DROP DATABASE postgres; --",
            "orders\nDROP",
            "orders' OR '1'='1",
            "Orders",
            "",
            "a-b",
        ] {
            let err = compile(&p, &with(hostile), "ctx", &[]).unwrap_err();
            assert!(
                err.contains("must match the plugin's pattern") && !err.contains("DROP"),
                "{hostile:?}: {err}"
            );
        }
        // A pattern is checked when the plugin is: it must compile and belong to a parameter.
        let mut bad = from_sandbox("db-prefix");
        bad.pattern = Some("[a-z".into());
        let e = plugin(vec![step("database", vec![bad], &[])], vec![])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pattern") && e.contains("regular expression"),
            "{e}"
        );
        let mut on_step = from_step("dbname", "database", "dbname");
        on_step.pattern = Some("[a-z]+".into());
        let e = plugin(
            vec![
                step("database", vec![from_sandbox("p")], &["dbname"]),
                step("user", vec![on_step], &[]),
            ],
            vec![],
        )
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("only a valueFromSandbox input has a pattern"),
            "{e}"
        );
    }

    #[test]
    fn compiling_fills_parameters_and_context_keys() {
        let p = plugin(
            vec![
                step("server", vec![from_sandbox("db-name")], &["host"]),
                step(
                    "provision",
                    vec![from_step("host", "server", "host")],
                    &["dsn"],
                ),
            ],
            vec![step(
                "drop",
                vec![from_step("dsn", "provision", "dsn")],
                &[],
            )],
        );
        let params = BTreeMap::from([("db-name".to_string(), "orders".to_string())]);
        let olm = compile(&p, &params, "ctx1", &[(env::SANDBOX_NAME, "sb")]).unwrap();
        assert_eq!(olm.pre_start.len(), 2);
        assert_eq!(olm.pre_start[0].inputs[0].value.as_deref(), Some("orders"));
        assert_eq!(
            olm.pre_start[0].exec_unit_template.input_injects[0]
                .dst
                .env
                .as_deref(),
            Some("DB_NAME")
        );
        let step = &olm.pre_start[0].exec_unit_template.pod_template["spec"]["containers"][0];
        assert_eq!(step["name"], "step");
        assert_eq!(step["image"], "localhost/spur-postgres:dev");
        assert_eq!(step["env"][0]["name"], env::SANDBOX_NAME);
        assert_eq!(step["env"][1]["name"], env::STEP_NAME);
        let r = olm.post_stop[0].inputs[0].iocontext.as_ref().unwrap();
        assert_eq!((r.name.as_str(), r.key.as_str()), ("ctx1", "provision.dsn"));
        let spec = OlmSpec {
            io_context_name: "ctx1".into(),
            pre_start: olm.pre_start.clone(),
            post_stop: olm.post_stop.clone(),
        };
        spec.validate().unwrap();

        let mut foreign = spec.clone();
        foreign.post_stop[0].inputs[0]
            .iocontext
            .as_mut()
            .unwrap()
            .name = "other".into();
        assert!(
            foreign
                .validate()
                .unwrap_err()
                .to_string()
                .contains("own ioContextName")
        );

        let e = compile(&p, &BTreeMap::new(), "ctx1", &[]).unwrap_err();
        assert!(e.contains("db-name"), "{e}");
    }
}
