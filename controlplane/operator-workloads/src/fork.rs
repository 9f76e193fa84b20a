//! Plans a fork: the customized copy of a baseline Deployment and one sandbox Service per
//! baseline Service. Pure functions over API objects, so every rule here is unit-tested
//! without an API server.
//!
//! The copy must never receive the baseline's traffic: every label that a Service selecting the
//! baseline's pods (or the baseline's own selector) uses is dropped from the fork's pod template,
//! and the fork's pods are selected by `spur.dev/fork=<fork name>` alone.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    ConfigMapKeySelector, Container, EnvVar, EnvVarSource, PodSpec, PodTemplateSpec,
    SecretKeySelector, Service, ServicePort as K8sServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use spur_api::keys::{annotations, labels, signadot_env};
use spur_api::sandbox::{Customizations, EnvOperation, PatchType};
use spur_api::{ServiceMapping, ServicePort, names};

use crate::baseline::Baseline;
use crate::{Error, patch};

/// Environment variables every forked container gets, so the application can tell it runs in a
/// sandbox and propagate the key on requests it makes itself.
pub const ENV_SANDBOX_NAME: &str = "SPUR_SANDBOX_NAME";
pub const ENV_ROUTING_KEY: &str = "SPUR_ROUTING_KEY";

/// What a fork consists of.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkPlan {
    pub deployment: Deployment,
    /// Sandbox Services with the mapping each one stands for.
    pub services: Vec<(Service, ServiceMapping)>,
}

/// The identity of a fork.
#[derive(Debug, Clone, Copy)]
pub struct ForkId<'a> {
    /// The fork's name (ForkedWorkload, Deployment, `spur.dev/fork` label value).
    pub name: &'a str,
    pub sandbox: &'a str,
    pub routing_key: &'a str,
}

/// Selects the Services that may stand for a baseline: all but the operator's own sandbox
/// Services. Listed from the API server's watch cache (`resourceVersion=0`, as
/// `spur_controller::verified` lists): label selectors are not indexed in etcd, so a
/// consistent list would read every Service of the namespace from etcd. A slightly stale list
/// is fine: a new baseline Service reaches the fork on the next reconcile.
pub fn baseline_services() -> kube::core::Selector {
    kube::core::Expression::NotEqual(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into())
        .into()
}

/// Builds the fork of `baseline` with `customizations`, and its sandbox Services for the
/// Services among `services` that select the baseline. The error is a message for the user.
pub fn plan(
    id: ForkId<'_>,
    baseline: &Baseline,
    customizations: &Customizations,
    services: &[Service],
    policy: &ForkPolicy,
) -> Result<ForkPlan, String> {
    let namespace = baseline.namespace();
    let baseline_name = baseline.name();
    let spec = baseline
        .workload
        .spec
        .as_ref()
        .ok_or_else(|| format!("{} has no spec", baseline.describe()))?;
    let selecting = baseline.selecting(services);

    let dropped = dropped_labels(spec, &selecting);
    let mut pod_labels: BTreeMap<String, String> = baseline
        .template_labels()
        .into_iter()
        .filter(|(k, _)| !dropped.contains(k))
        .collect();
    pod_labels.extend(owned_labels(id, &baseline_name));

    let mut template: PodTemplateSpec = spec.template.clone();
    let mut meta = template.metadata.take().unwrap_or_default();
    meta.labels = Some(pod_labels.clone());
    template.metadata = Some(meta);
    let pod = template
        .spec
        .as_mut()
        .ok_or_else(|| format!("{} has no pod spec", baseline.describe()))?;
    customize(&mut pod.containers, customizations, id.sandbox)?;
    for c in &mut pod.containers {
        for (name, value) in [
            (ENV_SANDBOX_NAME, id.sandbox),
            (ENV_ROUTING_KEY, id.routing_key),
            // Signadot's downward API, and the name its jobs use, for apps written for it.
            (signadot_env::SANDBOX_NAME, id.sandbox),
            (signadot_env::SANDBOX_ROUTING_KEY, id.routing_key),
            (signadot_env::ROUTING_KEY, id.routing_key),
        ] {
            upsert_env(c, name, Some(value.to_owned()), None);
        }
    }

    let mut deployment = Deployment {
        metadata: ObjectMeta {
            name: Some(id.name.to_owned()),
            namespace: Some(namespace.clone()),
            labels: Some(owned_labels(id, &baseline_name)),
            annotations: Some(BTreeMap::from([(
                annotations::BASELINE.to_owned(),
                format!("{}/{namespace}/{baseline_name}", baseline.kind),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            // One replica: a fork serves one developer's requests, not production load.
            replicas: Some(1),
            selector: fork_selector(id),
            template,
            min_ready_seconds: spec.min_ready_seconds,
            progress_deadline_seconds: spec.progress_deadline_seconds,
            revision_history_limit: spec.revision_history_limit,
            // Recreate (Signadot's default too): the old pod is gone before the new one starts,
            // so a fork never answers with two builds at once. A patch may choose
            // RollingUpdate (docs/operator.md).
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                rolling_update: None,
            }),
            paused: None,
        }),
        status: None,
    };

    if let Some(p) = &customizations.patch {
        let kept = Kept {
            id,
            namespace: &namespace,
            baseline_name: &baseline_name,
            dropped: &dropped,
        };
        deployment = patched(deployment, p, kept, spec.template.spec.as_ref(), policy)?;
    }

    let containers = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers.as_slice())
        .unwrap_or_default();
    let services = selecting
        .iter()
        .map(|svc| sandbox_service(id, svc, &baseline_name, containers))
        .collect();
    Ok(ForkPlan {
        deployment,
        services,
    })
}

/// Labels that would let baseline Services (the `selecting` ones) or the baseline's
/// ReplicaSets (its `spec`'s selector) pick fork pods: the fork's pods never carry them.
fn dropped_labels(spec: &DeploymentSpec, selecting: &[&Service]) -> BTreeSet<String> {
    let mut dropped: BTreeSet<String> = spec
        .selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, _)| k.clone())
        .collect();
    if let Some(exprs) = &spec.selector.match_expressions {
        dropped.extend(exprs.iter().map(|e| e.key.clone()));
    }
    for svc in selecting {
        if let Some(sel) = svc.spec.as_ref().and_then(|s| s.selector.as_ref()) {
            dropped.extend(sel.keys().cloned());
        }
    }
    dropped
}

/// The fork's own selector: `spur.dev/fork=<fork name>` alone.
fn fork_selector(id: ForkId<'_>) -> LabelSelector {
    LabelSelector {
        match_labels: Some(BTreeMap::from([(
            labels::FORK.to_owned(),
            id.name.to_owned(),
        )])),
        match_expressions: None,
    }
}

/// What a patch may not change about a fork: its identity, and the labels that keep it out of
/// the baseline's traffic.
#[derive(Clone, Copy)]
struct Kept<'a> {
    id: ForkId<'a>,
    namespace: &'a str,
    baseline_name: &'a str,
    dropped: &'a BTreeSet<String>,
}

/// `deployment` with the customizations' patch `p` applied, and then what it may not change
/// (`kept`) restored. The patched pod spec is held to `policy` against the baseline's
/// (`baseline_pod`). The error is a message for the user.
fn patched(
    deployment: Deployment,
    p: &spur_api::sandbox::Patch,
    kept: Kept<'_>,
    baseline_pod: Option<&PodSpec>,
    policy: &ForkPolicy,
) -> Result<Deployment, String> {
    let Kept {
        id,
        namespace,
        baseline_name,
        dropped,
    } = kept;
    let kind = match p.type_ {
        PatchType::Strategic => patch::PatchType::Strategic,
        PatchType::Merge => patch::PatchType::Merge,
        PatchType::Json => patch::PatchType::Json,
    };
    let mut value =
        serde_json::to_value(&deployment).map_err(|e| format!("cannot serialize the fork: {e}"))?;
    patch::apply(&mut value, kind, &p.value).map_err(|e| format!("patch: {e}"))?;
    let mut deployment: Deployment = serde_json::from_value(value)
        .map_err(|e| format!("patch: the patched Deployment is not valid: {e}"))?;
    // The patch may change the workload, never what keeps it out of baseline traffic.
    deployment.metadata.name = Some(id.name.to_owned());
    deployment.metadata.namespace = Some(namespace.to_owned());
    let s = deployment
        .spec
        .as_mut()
        .ok_or_else(|| "patch: the patched Deployment has no spec".to_string())?;
    s.selector = fork_selector(id);
    let meta = s.template.metadata.get_or_insert_with(ObjectMeta::default);
    let l = meta.labels.get_or_insert_with(BTreeMap::new);
    for k in dropped {
        l.remove(k);
    }
    l.extend(owned_labels(id, baseline_name));
    if s.template
        .spec
        .as_ref()
        .is_none_or(|p| p.containers.is_empty())
    {
        return Err("patch: the patched Deployment has no containers".into());
    }
    let refused = refused_changes(baseline_pod, s.template.spec.as_ref(), policy);
    if !refused.is_empty() {
        return Err(format!(
            "patch: a fork may not change {} (the fork policy allows {}); docs/operator.md",
            refused.join(", "),
            policy.describe()
        ));
    }
    Ok(deployment)
}

/// Pod spec fields a fork patch may change by default (besides `containers`, `initContainers`
/// and `volumes`, checked one by one): where the fork is scheduled, not what it may do.
const POD_ALLOWED: &[&str] = &[
    "terminationGracePeriodSeconds",
    "activeDeadlineSeconds",
    "nodeSelector",
    "affinity",
    "tolerations",
    "topologySpreadConstraints",
    "dnsConfig",
    "imagePullSecrets",
];

/// Container fields a fork patch may change by default: what runs and how it is configured,
/// not its privileges (`securityContext` is not among them).
const CONTAINER_ALLOWED: &[&str] = &[
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "workingDir",
    "env",
    "envFrom",
    "resources",
    "ports",
    "volumeMounts",
    "readinessProbe",
    "livenessProbe",
    "startupProbe",
    "lifecycle",
    "terminationMessagePath",
    "terminationMessagePolicy",
];

/// Which pod and container fields a fork patch may change. The defaults allow what a developer
/// changes to try a build (image, command, environment, resources, probes, scheduling) and
/// nothing that grants privileges; an installation whose sandbox creators may have more (for
/// example `serviceAccountName`) adds those fields (chart value `forkPolicy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForkPolicy {
    /// PodSpec fields (JSON names, e.g. `serviceAccountName`) a patch may change.
    pub pod_fields: BTreeSet<String>,
    /// Container fields (JSON names, e.g. `securityContext`) a patch may change, in any
    /// container or init container.
    pub container_fields: BTreeSet<String>,
    /// Whether a patch may add `hostPath` volumes.
    pub host_path_volumes: bool,
}

impl Default for ForkPolicy {
    fn default() -> Self {
        ForkPolicy {
            pod_fields: POD_ALLOWED.iter().map(|s| (*s).to_owned()).collect(),
            container_fields: CONTAINER_ALLOWED.iter().map(|s| (*s).to_owned()).collect(),
            host_path_volumes: false,
        }
    }
}

impl ForkPolicy {
    /// The defaults plus `pod` and `container` fields; `hostPath` among the pod fields allows
    /// `hostPath` volumes. Names must be JSON field names (letters, camelCase).
    pub fn with_extra(pod: &[String], container: &[String]) -> Result<Self, Error> {
        let mut p = ForkPolicy::default();
        for (what, names) in [("pod", pod), ("container", container)] {
            for n in names {
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_alphanumeric()) {
                    return Err(Error::Config(format!(
                        "fork policy: {n:?} is not a {what} field name (a JSON name like serviceAccountName)"
                    )));
                }
            }
        }
        for n in pod {
            match n.as_str() {
                "hostPath" => p.host_path_volumes = true,
                "containers" | "initContainers" | "volumes" => {
                    return Err(Error::Config(format!(
                        "fork policy: {n} is checked field by field; list container fields instead"
                    )));
                }
                _ => {
                    p.pod_fields.insert(n.clone());
                }
            }
        }
        p.container_fields.extend(container.iter().cloned());
        Ok(p)
    }

    /// The allowed fields, for error messages.
    fn describe(&self) -> String {
        let join = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>().join(", ");
        format!(
            "pod fields {}; container fields {}; volumes{}",
            join(&self.pod_fields),
            join(&self.container_fields),
            if self.host_path_volumes {
                ""
            } else {
                " other than hostPath"
            }
        )
    }
}

/// What a fork patch changed in the pod spec beyond the allow-lists above: the service account,
/// security contexts, host namespaces, `hostPath` volumes, added or removed containers, and
/// every other field. The operator creates forks with its own rights, so a patch must not give
/// a fork more than its baseline has.
fn refused_changes(
    baseline: Option<&k8s_openapi::api::core::v1::PodSpec>,
    fork: Option<&k8s_openapi::api::core::v1::PodSpec>,
    policy: &ForkPolicy,
) -> Vec<String> {
    use serde_json::Value;
    let to_map = |p: Option<&k8s_openapi::api::core::v1::PodSpec>| match p
        .and_then(|p| serde_json::to_value(p).ok())
    {
        Some(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let (b, f) = (to_map(baseline), to_map(fork));
    let mut refused = Vec::new();
    let keys: BTreeSet<&String> = b.keys().chain(f.keys()).collect();
    for key in keys {
        let (bv, fv) = (b.get(key.as_str()), f.get(key.as_str()));
        match key.as_str() {
            "containers" | "initContainers" => {
                let by_name =
                    |v: Option<&Value>| -> BTreeMap<String, serde_json::Map<String, Value>> {
                        v.and_then(Value::as_array)
                            .into_iter()
                            .flatten()
                            .filter_map(|c| {
                                let m = c.as_object()?.clone();
                                Some((m.get("name")?.as_str()?.to_owned(), m))
                            })
                            .collect()
                    };
                let (bc, fc) = (by_name(bv), by_name(fv));
                if bc.keys().ne(fc.keys()) {
                    refused.push(format!("{key} (added or removed)"));
                    continue;
                }
                for (name, fm) in &fc {
                    let bm = &bc[name];
                    let fields: BTreeSet<&String> = bm.keys().chain(fm.keys()).collect();
                    for field in fields {
                        if field != "name"
                            && !policy.container_fields.contains(field.as_str())
                            && bm.get(field.as_str()) != fm.get(field.as_str())
                        {
                            refused.push(format!("{key}[{name}].{field}"));
                        }
                    }
                }
            }
            "volumes" => {
                let host_paths = |v: Option<&Value>| -> Vec<Value> {
                    v.and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter(|vol| vol.get("hostPath").is_some())
                        .cloned()
                        .collect()
                };
                let before = host_paths(bv);
                if !policy.host_path_volumes && host_paths(fv).iter().any(|v| !before.contains(v)) {
                    refused.push("volumes (hostPath)".to_owned());
                }
            }
            k if policy.pod_fields.contains(k) => {}
            _ if bv != fv => refused.push(key.clone()),
            _ => {}
        }
    }
    refused
}

/// Labels on everything a fork consists of.
fn owned_labels(id: ForkId<'_>, baseline_name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), id.sandbox.to_owned()),
        (labels::ROUTING_KEY.to_owned(), id.routing_key.to_owned()),
        (
            labels::FORK_OF.to_owned(),
            names::label_value(baseline_name),
        ),
        (labels::FORK.to_owned(), id.name.to_owned()),
    ])
}

fn sandbox_service(
    id: ForkId<'_>,
    baseline_svc: &Service,
    baseline_name: &str,
    containers: &[Container],
) -> (Service, ServiceMapping) {
    let svc_name = baseline_svc.name_any();
    let name = names::sandbox_service_name(id.sandbox, &svc_name);
    let ports: Vec<K8sServicePort> = baseline_svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|p| K8sServicePort {
            name: p.name,
            port: p.port,
            target_port: p.target_port,
            protocol: p.protocol,
            app_protocol: p.app_protocol,
            node_port: None,
        })
        .collect();
    let mapping = ServiceMapping {
        baseline_service: svc_name.clone(),
        sandbox_service: name.clone(),
        ports: ports
            .iter()
            .filter_map(|p| {
                Some(ServicePort {
                    port: p.port,
                    target_port: resolve_target_port(p, containers)?,
                })
            })
            .collect(),
    };
    let mut meta_labels = owned_labels(id, baseline_name);
    meta_labels.remove(labels::FORK_OF);
    let service = Service {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: baseline_svc.namespace(),
            labels: Some(meta_labels),
            annotations: Some(BTreeMap::from([(
                annotations::BASELINE.to_owned(),
                format!(
                    "Service/{}/{svc_name}",
                    baseline_svc.namespace().unwrap_or_default()
                ),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(BTreeMap::from([(
                labels::FORK.to_owned(),
                id.name.to_owned(),
            )])),
            ports: Some(ports),
            type_: Some("ClusterIP".into()),
            ..ServiceSpec::default()
        }),
        status: None,
    };
    (service, mapping)
}

/// The container port a Service port reaches: its number, a named container port, or (no
/// target port) the Service port itself. `None` when a name matches no container port.
pub(crate) fn resolve_target_port(p: &K8sServicePort, containers: &[Container]) -> Option<i32> {
    match &p.target_port {
        None => Some(p.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(name)) => containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|cp| cp.name.as_deref() == Some(name.as_str()))
            .map(|cp| cp.container_port),
    }
}

fn customize(
    containers: &mut [Container],
    c: &Customizations,
    sandbox: &str,
) -> Result<(), String> {
    let names: Vec<String> = containers.iter().map(|c| c.name.clone()).collect();
    let find = |want: &str| -> Result<usize, String> {
        names.iter().position(|n| n == want).ok_or_else(|| {
            format!(
                "container {want:?} not found (containers: {})",
                names.join(", ")
            )
        })
    };
    for img in &c.images {
        // Without a container name the image replaces the first (main) container's.
        let i = match &img.container {
            Some(name) => find(name)?,
            None => 0,
        };
        if let Some(container) = containers.get_mut(i) {
            container.image = Some(img.image.clone());
        }
    }
    for e in &c.env {
        // Without a container name an env change applies to every container.
        let targets: Vec<usize> = match &e.container {
            Some(name) => vec![find(name)?],
            None => (0..containers.len()).collect(),
        };
        for i in targets {
            let Some(container) = containers.get_mut(i) else {
                continue;
            };
            match e.operation {
                EnvOperation::Delete => {
                    if let Some(env) = &mut container.env {
                        env.retain(|v| v.name != e.name);
                    }
                }
                EnvOperation::Upsert => {
                    let from = match &e.value_from {
                        None => None,
                        Some(vf) => Some(env_source(&e.name, vf, sandbox)?),
                    };
                    upsert_env(container, &e.name, e.value.clone(), from);
                }
            }
        }
    }
    Ok(())
}

fn env_source(
    name: &str,
    vf: &spur_api::sandbox::EnvValueFrom,
    sandbox: &str,
) -> Result<EnvVarSource, String> {
    if let Some(cm) = &vf.config_map {
        return Ok(EnvVarSource {
            config_map_key_ref: Some(ConfigMapKeySelector {
                name: cm.name.clone(),
                key: cm.key.clone(),
                optional: cm.optional.then_some(true),
            }),
            ..EnvVarSource::default()
        });
    }
    if let Some(s) = &vf.secret {
        return Ok(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: s.name.clone(),
                key: s.key.clone(),
                optional: s.optional.then_some(true),
            }),
            ..EnvVarSource::default()
        });
    }
    if let Some(r) = &vf.resource {
        // The resource's outputs, in the Secret the operator fills in the fork's namespace
        // before the fork is created (docs/resources.md). Not optional: a fork without its
        // resource would write to the wrong place.
        return Ok(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: spur_api::names::resource_name(sandbox, &r.name),
                key: r.output_key.clone(),
                optional: None,
            }),
            ..EnvVarSource::default()
        });
    }
    // The ForkedWorkload controller renders `valueFrom.fork` into a value before planning
    // (`crate::fork_refs`); one that reaches here had no rendering.
    Err(format!("env {name}: valueFrom.fork was not rendered"))
}

fn upsert_env(c: &mut Container, name: &str, value: Option<String>, from: Option<EnvVarSource>) {
    let env = c.env.get_or_insert_with(Vec::new);
    let var = EnvVar {
        name: name.to_owned(),
        value,
        value_from: from,
    };
    match env.iter_mut().find(|v| v.name == name) {
        Some(v) => *v = var,
        None => env.push(var),
    }
}

/// A fork can take traffic while at least one of its pods is ready: the sandbox Service then
/// has an endpoint. With the default Recreate strategy a changed fork has none while it restarts
/// (its routes are withdrawn until the new pod is ready); a fork patched to RollingUpdate keeps
/// its old pod serving, so its routes stay.
pub(crate) fn deployment_ready(d: &Deployment) -> bool {
    d.status
        .as_ref()
        .is_some_and(|st| st.ready_replicas.unwrap_or(0) >= 1)
}

/// Whether the Deployment's current template is what serves: its controller has seen the
/// current generation, every replica runs that template and is ready, and no pod of an older
/// one is left (`kubectl rollout status`'s test). A fork can be ready (serving) before this,
/// with its previous build.
pub(crate) fn deployment_rolled_out(d: &Deployment) -> bool {
    let Some(st) = d.status.as_ref() else {
        return false;
    };
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let updated = st.updated_replicas.unwrap_or(0);
    st.observed_generation.is_some()
        && st.observed_generation >= d.metadata.generation
        && updated >= want
        && st.replicas.unwrap_or(0) <= updated
        && st.ready_replicas.unwrap_or(0) >= want.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_fork_is_rolled_out_once_its_current_template_serves_alone() {
        let d = |generation: i64, status: serde_json::Value| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "sb-api", "generation": generation},
                "spec": {"replicas": 1, "selector": {}, "template": {}},
                "status": status
            }))
            .unwrap()
        };
        let done = json!({"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1});
        assert!(deployment_rolled_out(&d(2, done.clone())));
        // Just changed: the old pod still serves (ready), the change is not rolled out.
        let old = json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1});
        assert!(deployment_ready(&d(2, old.clone())) && !deployment_rolled_out(&d(2, old)));
        // Rolling: the new pod is up, the old one not gone yet.
        let rolling = json!({"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1, "readyReplicas": 2});
        assert!(!deployment_rolled_out(&d(2, rolling)));
        // Recreate: nothing ready yet.
        let starting = json!({"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1});
        assert!(!deployment_rolled_out(&d(2, starting)));
        assert!(!deployment_rolled_out(&d(2, json!(null))));
    }

    fn baseline() -> Baseline {
        Baseline::deployment(serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "route", "namespace": "hotrod", "uid": "u1", "resourceVersion": "7"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "route"}},
                "template": {
                    "metadata": {"labels": {"app": "route", "tier": "backend", "team": "geo"}},
                    "spec": {"containers": [
                        {"name": "route", "image": "route:1", "ports": [{"name": "http", "containerPort": 8083}],
                         "env": [{"name": "LOG", "value": "info"}]},
                        {"name": "agent", "image": "agent:1"}
                    ]}
                }
            },
            "status": {"readyReplicas": 3}
        }))
        .unwrap())
    }

    fn service(name: &str, selector: serde_json::Value, ports: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "hotrod"},
            "spec": {"selector": selector, "ports": ports, "clusterIP": "10.0.0.5"}
        }))
        .unwrap()
    }

    const ID: ForkId<'static> = ForkId {
        name: "sb1-route-1234567890",
        sandbox: "sb1",
        routing_key: "k3y",
    };

    #[test]
    fn fork_is_kept_out_of_baseline_services_and_gets_sandbox_services() {
        let services = vec![
            service(
                "route",
                json!({"app": "route"}),
                json!([{"name": "http", "port": 80, "targetPort": "http"}]),
            ),
            service(
                "backend",
                json!({"tier": "backend"}),
                json!([{"port": 9000}]),
            ),
            service("other", json!({"app": "other"}), json!([{"port": 80}])),
            service("headless-no-selector", json!(null), json!([{"port": 80}])),
        ];
        let plan = plan(
            ID,
            &baseline(),
            &Customizations::default(),
            &services,
            &ForkPolicy::default(),
        )
        .unwrap();
        let d = &plan.deployment;
        assert_eq!(d.metadata.name.as_deref(), Some(ID.name));
        assert!(
            d.metadata.resource_version.is_none() && d.metadata.uid.is_none() && d.status.is_none()
        );
        let spec = d.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(1));
        let pod_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        // Selector keys of the baseline and of both selecting Services are gone; others stay.
        assert!(!pod_labels.contains_key("app") && !pod_labels.contains_key("tier"));
        assert_eq!(pod_labels["team"], "geo");
        assert_eq!(pod_labels[labels::FORK], ID.name);
        assert_eq!(
            spec.selector.match_labels.as_ref().unwrap(),
            &BTreeMap::from([(labels::FORK.to_string(), ID.name.to_string())])
        );
        // No baseline Service selects the fork's pods any more.
        for svc in &services {
            if let Some(sel) = svc.spec.as_ref().unwrap().selector.as_ref() {
                assert!(
                    !sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
                    "{}",
                    svc.name_any()
                );
            }
        }
        let env = spec.template.spec.as_ref().unwrap().containers[0]
            .env
            .as_ref()
            .unwrap();
        assert!(
            env.iter()
                .any(|v| v.name == ENV_ROUTING_KEY && v.value.as_deref() == Some("k3y"))
        );
        assert!(
            env.iter()
                .any(|v| v.name == ENV_SANDBOX_NAME && v.value.as_deref() == Some("sb1"))
        );
        for (name, value) in [
            ("SIGNADOT_SANDBOX_NAME", "sb1"),
            ("SIGNADOT_SANDBOX_ROUTING_KEY", "k3y"),
            ("SIGNADOT_ROUTING_KEY", "k3y"),
        ] {
            assert!(
                env.iter()
                    .any(|v| v.name == name && v.value.as_deref() == Some(value)),
                "{name}"
            );
        }
        // Recreate by default: a fork never runs two builds at once.
        let strategy = spec.strategy.as_ref().unwrap();
        assert_eq!(strategy.type_.as_deref(), Some("Recreate"));
        assert!(strategy.rolling_update.is_none());

        let names: Vec<_> = plan.services.iter().map(|(s, _)| s.name_any()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let (route_svc, mapping) = plan
            .services
            .iter()
            .find(|(_, m)| m.baseline_service == "route")
            .unwrap();
        assert_eq!(
            route_svc.spec.as_ref().unwrap().selector.as_ref().unwrap()[labels::FORK],
            ID.name
        );
        assert_eq!(
            mapping.ports,
            vec![ServicePort {
                port: 80,
                target_port: 8083
            }],
            "named port resolved"
        );
        let (_, backend) = plan
            .services
            .iter()
            .find(|(_, m)| m.baseline_service == "backend")
            .unwrap();
        assert_eq!(
            backend.ports,
            vec![ServicePort {
                port: 9000,
                target_port: 9000
            }]
        );
    }

    fn customizations(v: serde_json::Value) -> Customizations {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn images_env_and_patches() {
        let c = customizations(json!({
            "images": [{"image": "route:dev"}, {"image": "agent:dev", "container": "agent"}],
            "env": [
                {"name": "LOG", "value": "debug", "container": "route"},
                {"name": "FEATURE", "value": "on"},
                {"name": "LOG", "operation": "delete", "container": "agent"},
                {"name": "DB", "valueFrom": {"secret": {"name": "db", "key": "url"}}, "container": "route"}
            ],
            "patch": {"type": "strategic", "value": {"spec": {
                "selector": {"matchLabels": {"app": "route"}},
                "template": {"metadata": {"labels": {"app": "route"}}, "spec": {"containers": [{"name": "route", "args": ["--dev"]}]}}
            }}}
        }));
        let plan = plan(ID, &baseline(), &c, &[], &ForkPolicy::default()).unwrap();
        let spec = plan.deployment.spec.unwrap();
        let cs = &spec.template.spec.as_ref().unwrap().containers;
        assert_eq!(cs[0].image.as_deref(), Some("route:dev"));
        assert_eq!(cs[1].image.as_deref(), Some("agent:dev"));
        assert_eq!(cs[0].args, Some(vec!["--dev".to_string()]));
        let env0 = cs[0].env.as_ref().unwrap();
        assert!(
            env0.iter()
                .any(|v| v.name == "LOG" && v.value.as_deref() == Some("debug"))
        );
        assert!(env0.iter().any(|v| v.name == "FEATURE"));
        assert!(
            env0.iter()
                .any(|v| v.name == "DB" && v.value_from.as_ref().unwrap().secret_key_ref.is_some())
        );
        let env1 = cs[1].env.as_ref().unwrap();
        assert!(env1.iter().any(|v| v.name == "FEATURE") && !env1.iter().any(|v| v.name == "LOG"));
        // The patch tried to put the baseline selector back: the fork's own selector wins.
        assert_eq!(spec.selector.match_labels.as_ref().unwrap().len(), 1);
        assert!(
            !spec
                .template
                .metadata
                .unwrap()
                .labels
                .unwrap()
                .contains_key("app")
        );
    }

    #[test]
    fn a_patch_may_choose_a_rolling_update() {
        let c = customizations(json!({"patch": {"type": "strategic", "value": {"spec": {
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}}}}}));
        let plan = plan(ID, &baseline(), &c, &[], &ForkPolicy::default()).unwrap();
        let strategy = plan.deployment.spec.unwrap().strategy.unwrap();
        assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
        assert!(strategy.rolling_update.is_some());
    }

    #[test]
    fn bad_customizations_are_reported() {
        let e = plan(
            ID,
            &baseline(),
            &customizations(json!({"images": [{"image": "x:1", "container": "nope"}]})),
            &[],
            &ForkPolicy::default(),
        )
        .unwrap_err();
        assert!(
            e.contains("\"nope\" not found") && e.contains("route, agent"),
            "{e}"
        );
        let e = plan(
            ID,
            &baseline(),
            &customizations(json!({"patch": {"type": "json", "value": [{"op": "remove", "path": "/spec/nothing"}]}})),
            &[],
            &ForkPolicy::default(),
        )
        .unwrap_err();
        assert!(e.starts_with("patch:"), "{e}");
        let e = plan(
            ID,
            &baseline(),
            &customizations(
                json!({"patch": {"type": "merge", "value": {"spec": {"replicas": "many"}}}}),
            ),
            &[],
            &ForkPolicy::default(),
        )
        .unwrap_err();
        assert!(e.contains("not valid"), "{e}");
        let e = plan(
            ID,
            &baseline(),
            &customizations(json!({"patch": {"type": "strategic", "value": {"spec": {"template": {"spec": {"containers": [{"$patch": "replace"}]}}}}}})),
            &[],
            &ForkPolicy::default(),
        )
        .unwrap_err();
        assert!(e.contains("no containers"), "{e}");
    }

    #[test]
    fn patches_may_not_raise_a_forks_privileges() {
        let strategic = |spec: serde_json::Value| {
            customizations(json!({"patch": {"type": "strategic",
                "value": {"spec": {"template": {"spec": spec}}}}}))
        };
        let refused = [
            (json!({"serviceAccountName": "admin"}), "serviceAccountName"),
            (json!({"hostNetwork": true}), "hostNetwork"),
            (json!({"hostPID": true}), "hostPID"),
            (
                json!({"securityContext": {"runAsUser": 0}}),
                "securityContext",
            ),
            (
                json!({"containers": [{"name": "route", "securityContext": {"privileged": true}}]}),
                "containers[route].securityContext",
            ),
            (
                json!({"containers": [{"name": "shell", "image": "busybox"}]}),
                "containers (added or removed)",
            ),
            (
                json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}),
                "volumes (hostPath)",
            ),
        ];
        for (spec, field) in refused {
            let e = plan(
                ID,
                &baseline(),
                &strategic(spec.clone()),
                &[],
                &ForkPolicy::default(),
            )
            .unwrap_err();
            assert!(
                e.starts_with("patch: a fork may not change") && e.contains(field),
                "{spec}: {e}"
            );
        }
        let allowed = json!({
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {"pool": "dev"},
            "volumes": [{"name": "cfg", "configMap": {"name": "route-dev"}}],
            "containers": [{"name": "route", "image": "route:dev", "args": ["--dev"],
                "resources": {"limits": {"memory": "1Gi"}},
                "volumeMounts": [{"name": "cfg", "mountPath": "/etc/route"}]}]
        });
        plan(
            ID,
            &baseline(),
            &strategic(allowed),
            &[],
            &ForkPolicy::default(),
        )
        .unwrap();
        // An installation that lets sandbox creators pick a ServiceAccount and hostPath volumes
        // says so in its fork policy; everything else stays refused.
        let wider = ForkPolicy::with_extra(
            &["serviceAccountName".into(), "hostPath".into()],
            &["securityContext".into()],
        )
        .unwrap();
        for spec in [
            json!({"serviceAccountName": "builder"}),
            json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}),
            json!({"containers": [{"name": "route", "securityContext": {"runAsUser": 1000}}]}),
        ] {
            plan(ID, &baseline(), &strategic(spec), &[], &wider).unwrap();
        }
        let e = plan(
            ID,
            &baseline(),
            &strategic(json!({"hostNetwork": true})),
            &[],
            &wider,
        )
        .unwrap_err();
        assert!(
            e.contains("hostNetwork") && e.contains("serviceAccountName"),
            "{e}"
        );
        for (pod, container) in [
            (vec!["host-network".to_string()], vec![]),
            (vec!["containers".to_string()], vec![]),
            (vec![], vec![String::new()]),
        ] {
            assert!(ForkPolicy::with_extra(&pod, &container).is_err());
        }
    }
}
