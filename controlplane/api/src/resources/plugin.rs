//! `ResourcePlugin`: how to create and delete one kind of resource, as ordered steps run in
//! pods; its inputs, outputs and their validation.

use std::collections::{HashMap, HashSet};

use super::*;

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
pub(super) fn input_pattern(pattern: &str) -> Result<regex::Regex, String> {
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

pub(super) fn io_name(c: &mut Checker, path: &str, name: &str) {
    c.require(
        is_io_name(name),
        || path.into(),
        "must be 1-63 of [a-zA-Z0-9-], starting with a letter and ending with a letter or digit",
    );
}

pub(super) fn check_env(c: &mut Checker, path: &str, env: &str, seen: &mut HashSet<String>) {
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

pub(super) fn check_path<'a>(c: &mut Checker, path: &str, p: &'a str, seen: &mut HashSet<&'a str>) {
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
