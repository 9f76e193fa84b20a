//! What the injection webhook does to a pod, as pure functions: whether a pod gets the DevMesh
//! sidecar (and if not, why), and the JSON patch that adds it. `docs/injection.md` documents
//! the result; `webhook.rs` serves it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use spur_api::keys::injection as keys;

use spur_operator_core::Error;

mod parts;

/// How injected pods are built. Plain serde (the chart renders it as YAML), validated once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct InjectionConfig {
    /// Image of the `spur-sidecar` container.
    pub sidecar_image: String,
    /// Image of the `spur-init` container.
    pub init_image: String,
    /// `imagePullPolicy` of both containers (unset: Kubernetes' default).
    pub image_pull_policy: Option<String>,
    /// Route server the sidecars watch, `host:port`.
    pub routeserver: String,
    /// ConfigMap (key `ca.crt`) with the CA bundle the route server's certificate chains to;
    /// the operator keeps a copy in every namespace it injects into. Empty: the sidecar dials
    /// the route server in plaintext (only for a route server run with `--insecure-plaintext`).
    pub routeserver_ca_config_map: String,
    /// Audience of the projected ServiceAccount token the sidecar presents to the route server.
    /// Empty: no token (only for a route server run with `--allow-unauthenticated`).
    pub routeserver_token_audience: String,
    /// Traffic store the sidecars watch capture settings from and ship captured exchanges to,
    /// `host:port`, with TLS under the same CA bundle as the route server. Empty: sidecars
    /// capture nothing (docs/traffic.md).
    pub traffic_server: String,
    /// Audience of the projected ServiceAccount token the sidecar presents to the traffic store.
    pub traffic_token_audience: String,
    /// Sidecar inbound port (where redirected connections land).
    pub proxy_port: u16,
    /// Sidecar admin port (/live, /ready, /metrics); never intercepted.
    pub admin_port: u16,
    /// UID (and GID) the sidecar runs as; its own connections are never intercepted.
    pub proxy_uid: i64,
    /// `spur-init --mode`: `auto`, `iptables` (legacy) or `nft`.
    pub interception_mode: String,
    /// Who programs the interception rules: the sidecar itself before it starts serving
    /// (`sidecar`, the default) or a `spur-init` init container (`initContainer`). Pods can
    /// choose with the annotation `sidecar.spur.dev/interception`.
    pub interception: Interception,
    /// Where the sidecar goes: first of the app containers (`regular`, the default) or a native
    /// sidecar among the init containers (`native`). Pods can choose with the annotation
    /// `sidecar.spur.dev/placement`.
    pub placement: Placement,
    /// With `regular` placement the sidecar receives SIGTERM together with the app; it keeps
    /// accepting this long before it drains (`SPUR_DRAIN_DELAY`).
    pub drain_delay_seconds: u32,
    /// Inbound ports never intercepted in any pod (the admin port always is excluded).
    pub exclude_inbound_ports: Vec<u16>,
    /// Kafka broker ports whose connections every injected sidecar relays by routing key
    /// (docs/async.md). Empty (the default): none, unless a pod names its own with the
    /// annotation `sidecar.spur.dev/kafka-ports`; a pod without Kafka ports gets no rule for
    /// them and its sidecar no Kafka listener.
    pub kafka_ports: Vec<u16>,
    /// The sidecar's Kafka relay port (on loopback), where the rules send those connections.
    pub kafka_proxy_port: u16,
    /// Routing-key carriers besides the standard ones (chart value `routingKeys`): headers whose
    /// whole value is a key (Signadot's `routing.customHeaders`) and a query parameter. Every
    /// injected sidecar reads them (docs/routing-keys.md).
    pub routing_keys: spur_routing::extract::ExtractConfig,
    /// Namespaces whose pods are never injected (the operator's own is added at start).
    pub system_namespaces: Vec<String>,
    /// Worker threads of the sidecar (it would otherwise start one per node CPU).
    pub sidecar_threads: u16,
    /// `SPUR_LOG` of the sidecar.
    pub sidecar_log: String,
    pub sidecar_resources: ResourceRequirements,
    pub init_resources: ResourceRequirements,
}

impl Default for InjectionConfig {
    fn default() -> Self {
        let resources = |cpu: &str, mem: &str, mem_limit: &str| ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity(cpu.into())),
                ("memory".to_string(), Quantity(mem.into())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity(mem_limit.into()),
            )])),
            ..Default::default()
        };
        let image = format!("ghcr.io/spur-dev/spur:{}", env!("CARGO_PKG_VERSION"));
        InjectionConfig {
            sidecar_image: image.clone(),
            init_image: image,
            image_pull_policy: None,
            routeserver: "spur-routeserver.spur-system.svc:7777".into(),
            routeserver_ca_config_map: "spur-ca-bundle".into(),
            routeserver_token_audience: "spur-routeserver".into(),
            traffic_server: String::new(),
            traffic_token_audience: "spur-traffic".into(),
            proxy_port: 15006,
            admin_port: 15020,
            proxy_uid: 15337,
            interception_mode: "auto".into(),
            interception: Interception::Sidecar,
            placement: Placement::Regular,
            drain_delay_seconds: 5,
            exclude_inbound_ports: Vec::new(),
            kafka_ports: Vec::new(),
            kafka_proxy_port: 15007,
            routing_keys: spur_routing::extract::ExtractConfig::default(),
            system_namespaces: vec![
                "kube-system".into(),
                "kube-public".into(),
                "kube-node-lease".into(),
            ],
            sidecar_threads: 2,
            sidecar_log: "info".into(),
            sidecar_resources: resources("10m", "16Mi", "128Mi"),
            init_resources: resources("10m", "16Mi", "64Mi"),
        }
    }
}

impl InjectionConfig {
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(m));
        if self.sidecar_image.trim().is_empty() || self.init_image.trim().is_empty() {
            return bad("sidecarImage and initImage must be set".into());
        }
        match self.routeserver.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
            _ => {
                return bad(format!(
                    "routeserver {:?} is not host:port",
                    self.routeserver
                ));
            }
        }
        if !self.traffic_server.is_empty() {
            match self.traffic_server.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
                _ => {
                    return bad(format!(
                        "trafficServer {:?} is not host:port",
                        self.traffic_server
                    ));
                }
            }
            if self.traffic_token_audience.is_empty() {
                return bad("trafficTokenAudience must be set with trafficServer".into());
            }
        }
        if self.proxy_port == 0 || self.admin_port == 0 || self.proxy_port == self.admin_port {
            return bad("proxyPort and adminPort must be distinct and non-zero".into());
        }
        if !(1..=i64::from(u32::MAX)).contains(&self.proxy_uid) {
            return bad(format!(
                "proxyUid {} must be a non-root uid",
                self.proxy_uid
            ));
        }
        if !["auto", "iptables", "nft"].contains(&self.interception_mode.as_str()) {
            return bad(format!(
                "interceptionMode {:?} must be auto, iptables or nft",
                self.interception_mode
            ));
        }
        if let Some(p) = &self.image_pull_policy
            && !["Always", "IfNotPresent", "Never"].contains(&p.as_str())
        {
            return bad(format!(
                "imagePullPolicy {p:?} is not Always, IfNotPresent or Never"
            ));
        }
        if self.kafka_proxy_port == 0
            || self.kafka_proxy_port == self.proxy_port
            || self.kafka_proxy_port == self.admin_port
        {
            return bad(format!(
                "kafkaProxyPort {} must be non-zero and differ from proxyPort and adminPort",
                self.kafka_proxy_port
            ));
        }
        parts::check_kafka_ports(&self.kafka_ports, self, "kafkaPorts")?;
        if let Err(e) = spur_routing::extract::KeyExtractor::new(&self.routing_keys) {
            return bad(format!("routingKeys: {e}"));
        }
        if self
            .routing_keys
            .custom_headers
            .iter()
            .any(|h| h.contains(','))
        {
            return bad("routingKeys: a header name cannot contain a comma".into());
        }
        if self.sidecar_threads == 0 {
            return bad("sidecarThreads must be at least 1".into());
        }
        Ok(())
    }
}

/// Who programs a pod's interception rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Interception {
    /// The sidecar, as root, before it serves; then it drops to the proxy uid with no
    /// capabilities. No init container: the kubelet starts the pod a relist (about 1 s) sooner.
    Sidecar,
    /// A `spur-init` init container; the sidecar never holds a capability.
    InitContainer,
}

/// Where the sidecar container goes in the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Placement {
    /// First of the app containers, started (and listening, through its postStart hook) before
    /// them in the same kubelet pass. It receives SIGTERM with the app (see
    /// `drainDelaySeconds`).
    Regular,
    /// A native sidecar (an init container with `restartPolicy: Always`, Kubernetes ≥ 1.29):
    /// stopped after the app, but the kubelet starts the app only at its next relist (about 1 s
    /// later).
    Native,
}

/// A per-pod setting from annotation `key`, spelled as in the injection config (its serde name),
/// or `default` when the annotation is absent or empty.
fn pod_setting<T: serde::de::DeserializeOwned>(
    annotations: &BTreeMap<String, String>,
    key: &str,
    default: T,
    expected: &str,
) -> Result<T, Error> {
    match annotations.get(key).map(|s| s.trim()) {
        None | Some("") => Ok(default),
        Some(v) => serde_json::from_value(Value::from(v))
            .map_err(|_| Error::Config(format!("annotation {key}: {v:?} is not {expected}"))),
    }
}

/// The workload a pod belongs to, as the sidecar announces it to the route server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Baseline {
    /// `Deployment` or `ArgoRollout` (the Routes API's spelling).
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    /// For a fork's pod: the fork's sandbox. Its sidecar only relays Kafka, in fork mode
    /// (docs/async.md): no inbound interception (a fork takes keyed traffic directly), no
    /// capture; `kind`/`namespace`/`name` are then the baseline the fork forks.
    pub fork_of_sandbox: Option<String>,
}

/// The pod's controlling ReplicaSet, to be resolved to its Deployment or Rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSetOwner {
    pub name: String,
    /// A fork's pod (label `spur.dev/fork`) with Kafka ports: its ReplicaSet's Deployment is
    /// to be resolved to the baseline it forks ([`spur_api::forkof::fork_of`]).
    pub fork: bool,
}

/// First look at a pod: skip it (with the reason recorded on it), leave it alone entirely, or
/// resolve its ReplicaSet's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Screen {
    Skip(String),
    /// Not ours to touch or annotate (already injected: a reinvocation).
    Ignore,
    Resolve(ReplicaSetOwner),
}

/// Whether `pod` is a sandbox fork's (label `spur.dev/fork`, set on the operator's fork
/// Deployments' pod templates).
fn is_fork(pod: &Pod) -> bool {
    (pod.metadata.labels.as_ref()).is_some_and(|l| l.contains_key(spur_api::keys::labels::FORK))
}

/// Whether `pod` is a fork's pod whose sidecar would relay Kafka (its annotation, or `cfg`'s
/// `kafkaPorts`; a malformed annotation counts as yes): without that sidecar it would join the
/// baseline's consumer groups with the fork's code, so it is refused rather than admitted
/// unchanged when the injection fails.
pub(crate) fn must_not_run_bare(pod: &Pod, cfg: &InjectionConfig) -> bool {
    is_fork(pod)
        && parts::kafka_ports(&pod.metadata.annotations.clone().unwrap_or_default(), cfg)
            .map_or(true, |ports| !ports.is_empty())
}

/// `cfg` with the carriers of a namespace whose annotations are `ns_annotations` (headers
/// added to the cluster's, a query parameter in place of it; docs/routing-keys.md). A malformed
/// annotation is an `Error::Config` naming it: the pod is then left without a sidecar, with
/// that reason on it, as for its own malformed annotations.
pub fn for_namespace<'a>(
    cfg: &'a InjectionConfig,
    ns_annotations: Option<&BTreeMap<String, String>>,
) -> Result<std::borrow::Cow<'a, InjectionConfig>, Error> {
    match spur_api::carriers::of_namespace(&cfg.routing_keys, ns_annotations) {
        Ok(None) => Ok(std::borrow::Cow::Borrowed(cfg)),
        Ok(Some(keys)) => {
            let mut out = cfg.clone();
            out.routing_keys = keys;
            Ok(std::borrow::Cow::Owned(out))
        }
        Err(e) => Err(Error::Config(e)),
    }
}

/// Decides everything that needs no API call. `namespace_labels` is `None` when the namespace
/// is unknown (treated as having no labels).
pub fn screen(
    pod: &Pod,
    namespace: &str,
    namespace_labels: Option<&BTreeMap<String, String>>,
    cfg: &InjectionConfig,
) -> Screen {
    if cfg.system_namespaces.iter().any(|n| n == namespace) {
        return Screen::Skip(format!("namespace {namespace} is a system namespace"));
    }
    if let Some(spec) = &pod.spec {
        let has = |cs: &[k8s_openapi::api::core::v1::Container]| {
            cs.iter().any(|c| c.name == keys::SIDECAR_CONTAINER)
        };
        if has(&spec.containers) || spec.init_containers.as_deref().is_some_and(has) {
            return Screen::Ignore;
        }
        if spec.host_network == Some(true) {
            return Screen::Skip(
                "hostNetwork pod: interception would capture the node's traffic".into(),
            );
        }
    }
    let fork = is_fork(pod);
    if fork {
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        match parts::kafka_ports(&annotations, cfg) {
            Ok(ports) if ports.is_empty() => {
                return Screen::Skip(
                    "forked pod (label spur.dev/fork) without Kafka ports: forks take keyed traffic directly".into(),
                );
            }
            // A sidecar that relays the fork's Kafka connections (docs/async.md).
            Ok(_) => {}
            Err(e) => return Screen::Skip(e.to_string()),
        }
    }
    let ns_flag = namespace_labels
        .and_then(|l| l.get(keys::INJECT))
        .map(String::as_str);
    let pod_flag = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(keys::INJECT))
        .map(String::as_str);
    if ns_flag == Some("false") {
        return Screen::Skip(format!(
            "namespace {namespace} opted out (label {}=false)",
            keys::INJECT
        ));
    }
    if pod_flag == Some("false") {
        return Screen::Skip(format!("pod opted out (annotation {}=false)", keys::INJECT));
    }
    if pod_flag != Some("true") && ns_flag != Some("true") {
        return Screen::Skip(format!(
            "not opted in (annotation {0}=\"true\" on the pod template or label {0}=true on the namespace)",
            keys::INJECT
        ));
    }
    let owner = pod
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|o| o.controller == Some(true));
    match owner {
        None => Screen::Skip(
            "no controlling owner: only pods of Deployments and Argo Rollouts are injected".into(),
        ),
        Some(o) if o.kind == "ReplicaSet" && o.api_version == "apps/v1" => {
            Screen::Resolve(ReplicaSetOwner {
                name: o.name.clone(),
                fork,
            })
        }
        Some(o) => Screen::Skip(format!(
            "owned by {}/{}: only pods of Deployments and Argo Rollouts are injected",
            o.kind, o.name
        )),
    }
}

/// The baseline behind a ReplicaSet, from its controlling owner reference, or why there is none.
pub fn baseline_of_replicaset(
    rs: &k8s_openapi::api::apps::v1::ReplicaSet,
    namespace: &str,
) -> Result<Baseline, String> {
    let rs_name = rs.metadata.name.clone().unwrap_or_default();
    let owner = rs
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|o| o.controller == Some(true));
    let kind = match owner {
        Some(o) if o.kind == "Deployment" && o.api_version == "apps/v1" => "Deployment",
        Some(o) if o.kind == "Rollout" && o.api_version.starts_with("argoproj.io/") => {
            "ArgoRollout"
        }
        Some(o) => {
            return Err(format!(
                "ReplicaSet {rs_name} is owned by {}/{}, not a Deployment or Argo Rollout",
                o.kind, o.name
            ));
        }
        None => {
            return Err(format!(
                "ReplicaSet {rs_name} has no controlling Deployment or Argo Rollout"
            ));
        }
    };
    let name = owner.map(|o| o.name.clone()).unwrap_or_default();
    Ok(Baseline {
        kind,
        namespace: namespace.into(),
        name,
        fork_of_sandbox: None,
    })
}

/// The patch recording why a pod was skipped.
pub fn skip_patch(pod: &Pod, reason: &str) -> Result<json_patch::Patch, Error> {
    let mut ops = Vec::new();
    annotate(
        pod,
        &mut ops,
        &[(keys::STATUS, "skipped"), (keys::REASON, reason)],
    );
    to_patch(ops)
}

/// What injection adds to a pod: containers to put first among its init containers and first
/// among its app containers, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Injected {
    pub init_containers: Vec<Value>,
    pub containers: Vec<Value>,
    /// Pod volumes the sidecar mounts (the route server's CA bundle and token).
    pub volumes: Vec<Value>,
}

/// The patch that puts the [`Injected`] containers first, in their order, and annotates the pod.
pub fn inject_patch(
    pod: &Pod,
    baseline: &Baseline,
    cfg: &InjectionConfig,
) -> Result<json_patch::Patch, Error> {
    // Found by the admission_review fuzz target: without a spec, the patch's paths have no
    // parent. The API server never sends such a pod; anyone else gets a reasoned skip.
    if pod.spec.is_none() {
        return Err(Error::Config("the pod has no spec".into()));
    }
    let mut ops = Vec::new();
    let baseline_text = format!("{}/{}/{}", baseline.kind, baseline.namespace, baseline.name);
    annotate(
        pod,
        &mut ops,
        &[(keys::STATUS, "injected"), (keys::BASELINE, &baseline_text)],
    );
    let injected = containers(pod, baseline, cfg)?;
    let has_inits = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some();
    if !injected.init_containers.is_empty() {
        if has_inits {
            // Inserting at index 0 in reverse order leaves them first, in order.
            for c in injected.init_containers.iter().rev() {
                ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": c}));
            }
        } else {
            ops.push(json!({"op": "add", "path": "/spec/initContainers", "value": injected.init_containers}));
        }
    }
    for c in injected.containers.iter().rev() {
        ops.push(json!({"op": "add", "path": "/spec/containers/0", "value": c}));
    }
    let has_volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_ref()).is_some();
    let has_account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    if !has_account && !injected.volumes.is_empty() {
        // A projected token needs a named ServiceAccount. The API server's ServiceAccount
        // admission names `default` before webhooks run; where it is disabled, say so here.
        ops.push(json!({"op": "add", "path": "/spec/serviceAccountName", "value": "default"}));
    }
    if has_volumes {
        for v in &injected.volumes {
            ops.push(json!({"op": "add", "path": "/spec/volumes/-", "value": v}));
        }
    } else if !injected.volumes.is_empty() {
        ops.push(json!({"op": "add", "path": "/spec/volumes", "value": injected.volumes}));
    }
    to_patch(ops)
}

/// The injected containers, exactly as `docs/injection.md` shows them for each interception and
/// placement.
pub fn containers(
    pod: &Pod,
    baseline: &Baseline,
    cfg: &InjectionConfig,
) -> Result<Injected, Error> {
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let interception = pod_setting(
        &annotations,
        keys::INTERCEPTION,
        cfg.interception,
        "sidecar or initContainer",
    )?;
    let placement = pod_setting(
        &annotations,
        keys::PLACEMENT,
        cfg.placement,
        "regular or native",
    )?;
    let fork = baseline.fork_of_sandbox.as_deref();
    let inbound = match fork {
        Some(_) => parts::Inbound::none(cfg),
        None => parts::Inbound::of(&annotations, cfg)?,
    };
    let kafka = parts::kafka_ports(&annotations, cfg)?;
    let mut env_list = parts::sidecar_env(baseline, cfg);
    env_list.extend(parts::kafka_env(&kafka, cfg));
    if let Some(sandbox) = fork {
        env_list.push(parts::env("SPUR_FORK_OF_SANDBOX", sandbox.to_owned()));
    }
    let mut init_containers = Vec::new();
    let security = match interception {
        Interception::InitContainer => {
            init_containers.push(parts::init_container(cfg, &inbound, &kafka));
            parts::unprivileged_security(cfg)
        }
        Interception::Sidecar => {
            env_list.extend(parts::intercept_env(cfg, &inbound));
            parts::intercepting_security()
        }
    };
    if placement == Placement::Regular {
        env_list.push(parts::env(
            "SPUR_DRAIN_DELAY",
            format!("{}s", cfg.drain_delay_seconds),
        ));
    }
    let files = match fork {
        // A fork's sidecar captures nothing: the traffic store knows it as no baseline's.
        Some(_) => parts::mounted_files(&InjectionConfig {
            traffic_server: String::new(),
            ..cfg.clone()
        }),
        None => parts::mounted_files(cfg),
    };
    env_list.extend(files.env);
    let sidecar = parts::sidecar(cfg, env_list, security, files.mounts, placement);
    let volumes = files.volumes;
    Ok(match placement {
        Placement::Native => {
            init_containers.push(sidecar);
            Injected {
                init_containers,
                containers: Vec::new(),
                volumes,
            }
        }
        Placement::Regular => Injected {
            init_containers,
            containers: vec![sidecar],
            volumes,
        },
    })
}

fn annotate(pod: &Pod, ops: &mut Vec<Value>, entries: &[(&str, &str)]) {
    if pod.metadata.annotations.is_none() {
        let map: serde_json::Map<String, Value> = entries
            .iter()
            .map(|(k, v)| ((*k).to_string(), Value::from(*v)))
            .collect();
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": map}));
        return;
    }
    for (k, v) in entries {
        // RFC 6901: `~` and `/` in a key are escaped.
        let key = k.replace('~', "~0").replace('/', "~1");
        ops.push(json!({"op": "add", "path": format!("/metadata/annotations/{key}"), "value": v}));
    }
}

fn to_patch(ops: Vec<Value>) -> Result<json_patch::Patch, Error> {
    Ok(serde_json::from_value(Value::Array(ops))?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pod(v: Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn rs_pod(annotations: Value, labels: Value) -> Pod {
        pod(json!({
            "metadata": {
                "generateName": "api-abc-",
                "annotations": annotations,
                "labels": labels,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "api-abc", "uid": "u1", "controller": true}],
            },
            "spec": {"containers": [{"name": "app", "image": "app"}]},
        }))
    }

    fn apply(p: &Pod, patch: &json_patch::Patch) -> Value {
        let mut v = serde_json::to_value(p).unwrap();
        json_patch::patch(&mut v, patch).unwrap();
        v
    }

    #[test]
    fn screening_follows_the_documented_order() {
        let cfg = InjectionConfig::default();
        let on = json!({(keys::INJECT): "true"});
        let ns_on = BTreeMap::from([(keys::INJECT.to_string(), "true".to_string())]);
        let ns_off = BTreeMap::from([(keys::INJECT.to_string(), "false".to_string())]);
        let p = rs_pod(on.clone(), json!({"app": "api"}));
        assert_eq!(
            screen(&p, "shop", None, &cfg),
            Screen::Resolve(ReplicaSetOwner {
                name: "api-abc".into(),
                fork: false,
            })
        );
        let plain = rs_pod(json!({}), json!({}));
        assert!(
            matches!(screen(&plain, "shop", None, &cfg), Screen::Skip(r) if r.contains("not opted in"))
        );
        assert!(matches!(
            screen(&plain, "shop", Some(&ns_on), &cfg),
            Screen::Resolve(_)
        ));
        assert!(
            matches!(screen(&p, "shop", Some(&ns_off), &cfg), Screen::Skip(r) if r.contains("opted out"))
        );
        let off = rs_pod(json!({(keys::INJECT): "false"}), json!({}));
        assert!(
            matches!(screen(&off, "shop", Some(&ns_on), &cfg), Screen::Skip(r) if r.contains("pod opted out"))
        );
        let fork = rs_pod(on.clone(), json!({"spur.dev/fork": "f"}));
        assert!(
            matches!(screen(&fork, "shop", None, &cfg), Screen::Skip(r) if r.contains("forked"))
        );
        assert!(
            matches!(screen(&p, "kube-system", None, &cfg), Screen::Skip(r) if r.contains("system"))
        );
        let mut sts = p.clone();
        sts.metadata.owner_references.as_mut().unwrap()[0].kind = "StatefulSet".into();
        assert!(
            matches!(screen(&sts, "shop", None, &cfg), Screen::Skip(r) if r.contains("StatefulSet/api-abc"))
        );
        let mut bare = p.clone();
        bare.metadata.owner_references = None;
        assert!(
            matches!(screen(&bare, "shop", None, &cfg), Screen::Skip(r) if r.contains("no controlling owner"))
        );
        let mut host = p.clone();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert!(
            matches!(screen(&host, "shop", None, &cfg), Screen::Skip(r) if r.contains("hostNetwork"))
        );
        let injected = apply(
            &p,
            &inject_patch(
                &p,
                &Baseline {
                    kind: "Deployment",
                    namespace: "shop".into(),
                    name: "api".into(),
                    fork_of_sandbox: None,
                },
                &cfg,
            )
            .unwrap(),
        );
        assert_eq!(screen(&pod(injected), "shop", None, &cfg), Screen::Ignore);
    }

    fn names(v: &Value) -> Vec<&str> {
        v.as_array()
            .map(|cs| cs.iter().map(|c| c["name"].as_str().unwrap()).collect())
            .unwrap_or_default()
    }

    fn with_migrate(annotations: Value) -> Pod {
        let mut p = rs_pod(annotations, json!({}));
        p.spec.as_mut().unwrap().init_containers = Some(vec![
            serde_json::from_value(json!({"name": "migrate", "image": "m"})).unwrap(),
        ]);
        p
    }

    #[test]
    fn inject_prepends_init_and_native_sidecar() {
        let cfg = InjectionConfig {
            interception: Interception::InitContainer,
            placement: Placement::Native,
            ..InjectionConfig::default()
        };
        let p = with_migrate(
            json!({(keys::INJECT): "true", (keys::EXCLUDE_INBOUND_PORTS): "9090, 8443"}),
        );
        let b = Baseline {
            kind: "ArgoRollout",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let out = apply(&p, &inject_patch(&p, &b, &cfg).unwrap());
        let inits = out["spec"]["initContainers"].as_array().unwrap();
        assert_eq!(
            names(&out["spec"]["initContainers"]),
            ["spur-init", "spur-sidecar", "migrate"]
        );
        assert_eq!(names(&out["spec"]["containers"]), ["app"]);
        assert_eq!(
            inits[0]["args"],
            json!([
                "--mode",
                "auto",
                "--proxy-port",
                "15006",
                "--proxy-uid",
                "15337",
                "--inbound-ports",
                "*",
                "--exclude-inbound-ports",
                "8443,9090,15020",
                "--ipv6",
                "false"
            ])
        );
        assert_eq!(inits[1]["restartPolicy"], "Always");
        assert_eq!(inits[1]["securityContext"]["runAsUser"], 15337);
        let env = inits[1]["env"].as_array().unwrap();
        let get = |n: &str| {
            env.iter()
                .find(|e| e["name"] == n)
                .map(|e| e["value"].clone())
        };
        assert_eq!(get("SPUR_BASELINE_KIND").unwrap(), "ArgoRollout");
        assert_eq!(get("SPUR_BASELINE_NAME").unwrap(), "api");
        assert_eq!(get("SPUR_INTERCEPT"), None);
        assert_eq!(get("SPUR_DRAIN_DELAY"), None);
        assert_eq!(out["metadata"]["annotations"][keys::STATUS], "injected");
        assert_eq!(
            out["metadata"]["annotations"][keys::BASELINE],
            "ArgoRollout/shop/api"
        );
        // The pod still parses as a Pod.
        let _: Pod = serde_json::from_value(out).unwrap();
    }

    #[test]
    fn by_default_the_sidecar_intercepts_and_is_the_first_app_container() {
        let cfg = InjectionConfig::default();
        let p = with_migrate(json!({(keys::INJECT): "true", (keys::INBOUND_PORTS): "8080"}));
        let b = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let out = apply(&p, &inject_patch(&p, &b, &cfg).unwrap());
        assert_eq!(names(&out["spec"]["initContainers"]), ["migrate"]);
        assert_eq!(names(&out["spec"]["containers"]), ["spur-sidecar", "app"]);
        let sidecar = &out["spec"]["containers"][0];
        assert_eq!(sidecar.get("restartPolicy"), None);
        let env = sidecar["env"].as_array().unwrap();
        let get = |n: &str| env.iter().find(|e| e["name"] == n).unwrap()["value"].clone();
        assert_eq!(get("SPUR_INTERCEPT"), "true");
        assert_eq!(get("SPUR_INBOUND_PORTS"), "8080");
        assert_eq!(get("SPUR_EXCLUDE_INBOUND_PORTS"), "15020");
        assert_eq!(get("SPUR_PROXY_UID"), "15337");
        assert_eq!(get("SPUR_DRAIN_DELAY"), "5s");
        let sc = &sidecar["securityContext"];
        assert_eq!(sc["runAsUser"], 0);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(
            sc["capabilities"]["add"],
            json!(["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"])
        );
        let _: Pod = serde_json::from_value(out).unwrap();

        // Each annotation overrides its setting; a bad value is a Config error (the webhook
        // skips the pod and records it).
        let p = with_migrate(json!({(keys::PLACEMENT): "native"}));
        let out = apply(&p, &inject_patch(&p, &b, &cfg).unwrap());
        assert_eq!(
            names(&out["spec"]["initContainers"]),
            ["spur-sidecar", "migrate"]
        );
        assert_eq!(out["spec"]["initContainers"][0]["restartPolicy"], "Always");
        let p = rs_pod(json!({(keys::INTERCEPTION): "initContainer"}), json!({}));
        let out = apply(&p, &inject_patch(&p, &b, &cfg).unwrap());
        assert_eq!(names(&out["spec"]["initContainers"]), ["spur-init"]);
        assert_eq!(names(&out["spec"]["containers"]), ["spur-sidecar", "app"]);
        assert_eq!(
            out["spec"]["containers"][0]["securityContext"]["runAsUser"],
            15337
        );
        for (key, value) in [(keys::PLACEMENT, "first"), (keys::INTERCEPTION, "cni")] {
            let p = rs_pod(json!({(key): value}), json!({}));
            let e = inject_patch(&p, &b, &cfg).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(value), "{e}");
        }
    }

    /// `docs/injection.md` shows the containers for the default configuration and for
    /// `interception: initContainer` with `placement: native`; keep both exact.
    #[test]
    fn documented_containers_are_what_is_injected() {
        let doc = include_str!("../../../docs/injection.md");
        let p = rs_pod(json!({(keys::INJECT): "true"}), json!({"app": "api"}));
        let b = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let init_native = InjectionConfig {
            interception: Interception::InitContainer,
            placement: Placement::Native,
            ..InjectionConfig::default()
        };
        for (marker, cfg) in [
            ("injected", InjectionConfig::default()),
            ("injected-init-native", init_native),
        ] {
            let start = doc.find(&format!("<!-- {marker}:begin -->")).unwrap();
            let end = doc.find(&format!("<!-- {marker}:end -->")).unwrap();
            let yaml = doc[start..end]
                .split("```yaml\n")
                .nth(1)
                .and_then(|b| b.split("```").next())
                .unwrap();
            let documented: Value = serde_yaml_ng::from_str(yaml).unwrap();
            let actual = injected_json(containers(&p, &b, &cfg).unwrap());
            assert_eq!(
                documented,
                actual,
                "docs/injection.md ({marker}) is stale; the injected containers are:\n{}",
                serde_yaml_ng::to_string(&actual).unwrap()
            );
        }
    }

    fn injected_json(injected: Injected) -> Value {
        let mut actual = serde_json::Map::new();
        if !injected.init_containers.is_empty() {
            actual.insert("initContainers".into(), injected.init_containers.into());
        }
        if !injected.containers.is_empty() {
            actual.insert("containers".into(), injected.containers.into());
        }
        if !injected.volumes.is_empty() {
            actual.insert("volumes".into(), injected.volumes.into());
        }
        Value::Object(actual)
    }

    #[test]
    fn skip_patch_works_with_and_without_annotations() {
        let p = rs_pod(json!(null), json!({}));
        let out = apply(&p, &skip_patch(&p, "why").unwrap());
        assert_eq!(out["metadata"]["annotations"][keys::REASON], "why");
        let p = rs_pod(json!({"a": "b"}), json!({}));
        let out = apply(&p, &skip_patch(&p, "why").unwrap());
        assert_eq!(out["metadata"]["annotations"]["a"], "b");
        assert_eq!(out["metadata"]["annotations"][keys::STATUS], "skipped");
        // A pod without a spec is skipped with a reason, never given a patch that cannot apply.
        let mut p = rs_pod(json!(null), json!({}));
        p.spec = None;
        let b = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let e = inject_patch(&p, &b, &InjectionConfig::default()).unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains("no spec")),
            "{e}"
        );
        apply(&p, &skip_patch(&p, &e.to_string()).unwrap());
    }

    #[test]
    fn bad_port_annotation_is_an_error_and_config_is_validated() {
        let cfg = InjectionConfig::default();
        cfg.validate().unwrap();
        let p = rs_pod(json!({(keys::EXCLUDE_INBOUND_PORTS): "80,x"}), json!({}));
        let b = Baseline {
            kind: "Deployment",
            namespace: "n".into(),
            name: "a".into(),
            fork_of_sandbox: None,
        };
        assert!(inject_patch(&p, &b, &cfg).is_err());
        let mut bad = cfg.clone();
        bad.routeserver = "nohost".into();
        assert!(bad.validate().is_err());
        let mut bad = cfg;
        bad.proxy_uid = 0;
        assert!(bad.validate().is_err());
        let parsed: InjectionConfig =
            serde_yaml_ng::from_str("sidecarImage: x\ninitImage: y\nproxyUid: 2000\n").unwrap();
        assert_eq!(parsed.proxy_uid, 2000);
        assert_eq!(parsed.proxy_port, 15006);
        assert!(serde_yaml_ng::from_str::<InjectionConfig>("sidecarImag: x\n").is_err());
    }
}
