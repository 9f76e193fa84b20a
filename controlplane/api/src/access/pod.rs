//! Debug pods: `PodAccessTemplate` (which workloads may be cloned into a debug pod, and how the
//! clone is changed) and `PodAccessRequest`.

use super::*;

/// A debug pod made for one request: from a workload's pod template (mutated) or a pod spec.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "PodAccessTemplate",
    plural = "podaccesstemplates",
    shortname = "pat",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessTemplateStatus",
    derive = "PartialEq",
    doc = "Who may ask for a debug pod cloned from a workload (or built from a pod spec), and for how long (docs/access.md).",
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
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.targetRef) != has(self.podSpec)", "message": "set exactly one of targetRef and podSpec"},
    {"rule": "!has(self.podSpec) || !has(self.mutation)", "message": "mutation applies to targetRef only: write podSpec as the pod should be"}
]))]
pub struct PodAccessTemplateSpec {
    pub access_config: AccessConfig,
    /// The workload (in this namespace) whose pod template the debug pod is cloned from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_ref: Option<TargetRef>,
    /// A pod spec (`spec` of a Pod) to run instead of a workload's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_object")]
    pub pod_spec: Option<serde_json::Value>,
    /// How the cloned pod differs from the workload's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutation: Option<PodMutation>,
}

impl PodAccessTemplateSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.access_config.check(&mut c, "spec.accessConfig");
        match (&self.target_ref, &self.pod_spec) {
            (Some(t), None) => c.dns_subdomain(|| "spec.targetRef.name".into(), &t.name),
            (None, Some(spec)) => c.require(
                spec.is_object(),
                || "spec.podSpec".into(),
                "must be an object",
            ),
            _ => c.fail("spec", "set exactly one of targetRef and podSpec"),
        }
        if let Some(m) = &self.mutation {
            if self.pod_spec.is_some() {
                c.fail(
                    "spec.mutation",
                    "applies to targetRef only: write podSpec as the pod should be",
                );
            }
            m.check(&mut c, "spec.mutation");
        }
        c.finish("PodAccessTemplate")
    }
}

/// How a debug pod differs from the workload's pod template. Labels and annotations are always
/// replaced (by Spur's own and `podLabels`/`podAnnotations`), so no Service or controller
/// selects the pod; probes are stripped unless kept, so a shell session is not killed for a
/// failing probe.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodMutation {
    /// The container changed and exec'd into (default: the
    /// `kubectl.kubernetes.io/default-container` annotation, else the first container).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub default_container: Option<String>,
    /// Replaces the container's command (e.g. `["sleep", "infinity"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MUTATION_ITEMS), inner(length(max = VALUE_MAX)))]
    pub command: Vec<String>,
    /// Replaces the container's arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MUTATION_ITEMS), inner(length(max = VALUE_MAX)))]
    pub args: Vec<String>,
    /// Set on the container (replacing a variable of the same name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MUTATION_ITEMS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub env: Vec<EnvValue>,
    /// Replaces the container's `resources` (a ResourceRequirements).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_object")]
    pub resources: Option<serde_json::Value>,
    /// Labels of the debug pod besides Spur's own.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,
    /// Annotations of the debug pod (the template's are dropped).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub keep_liveness_probe: bool,
    #[serde(default)]
    pub keep_readiness_probe: bool,
    #[serde(default)]
    pub keep_startup_probe: bool,
}

impl PodMutation {
    fn check(&self, c: &mut Checker, path: &str) {
        if let Some(name) = &self.default_container {
            c.dns_label(|| format!("{path}.defaultContainer"), name);
        }
        c.max_items(
            || format!("{path}.command"),
            &self.command,
            MAX_MUTATION_ITEMS,
        );
        c.max_items(|| format!("{path}.args"), &self.args, MAX_MUTATION_ITEMS);
        c.max_items(|| format!("{path}.env"), &self.env, MAX_MUTATION_ITEMS);
        for (i, e) in self.env.iter().enumerate() {
            c.require(
                is_env_name(&e.name),
                || format!("{path}.env[{i}].name"),
                "must be an environment variable name",
            );
            c.max_len(|| format!("{path}.env[{i}].value"), &e.value, VALUE_MAX);
        }
        for (k, v) in &self.pod_labels {
            c.require(
                is_label_key(k),
                || format!("{path}.podLabels[{k}]"),
                "must be a label key",
            );
            c.require(
                is_label_value(v),
                || format!("{path}.podLabels[{k}]"),
                "must be a label value",
            );
            c.require(
                !k.starts_with("spur.dev/"),
                || format!("{path}.podLabels[{k}]"),
                "spur.dev/ labels are Spur's own",
            );
        }
        for k in self.pod_annotations.keys() {
            c.require(
                is_label_key(k),
                || format!("{path}.podAnnotations[{k}]"),
                "must be an annotation key",
            );
        }
    }
}

/// One environment variable with a plain value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvValue {
    #[schemars(length(min = 1, max = ENV_NAME_MAX), regex(pattern = ENV_NAME_PATTERN))]
    pub name: String,
    #[serde(default)]
    #[schemars(length(max = VALUE_MAX))]
    pub value: String,
}

/// A request for a debug pod of a PodAccessTemplate, exec-able by the requester.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "PodAccessRequest",
    plural = "podaccessrequests",
    shortname = "par",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessRequestStatus",
    derive = "PartialEq",
    doc = "A request for a time-bound debug pod cloned from a PodAccessTemplate's workload, exec-able by the requester (docs/access.md).",
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
pub struct PodAccessRequestSpec {
    /// The PodAccessTemplate (in this namespace).
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub template_name: String,
    /// How long (default: the template's `defaultDuration`; capped at its `maxDuration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = ACCESS_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": DURATION_RULE, "message": DURATION_MESSAGE}])
    )]
    pub duration: Option<String>,
    /// A sandbox forking the template's workload: the debug pod is then cloned from the fork.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: Option<String>,
    /// Who filed the request: set at admission from the API server's user info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<Requester>,
}

impl PodAccessRequestSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        check_request(
            &mut c,
            &self.template_name,
            self.duration.as_deref(),
            self.sandbox.as_deref(),
        );
        c.finish("PodAccessRequest")
    }
}
