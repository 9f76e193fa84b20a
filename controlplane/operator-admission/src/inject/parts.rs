//! The parts [`super::containers`] assembles into the injected containers: the inbound ports to
//! intercept, the sidecar's environment, the files it mounts, its security context for each
//! interception, the `spur-init` init container and the sidecar container itself. Split out so
//! each part reads (and is tested) on its own.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use serde_json::{Value, json};
use spur_api::keys::injection as keys;

use super::{Baseline, InjectionConfig, Placement};
use spur_operator_core::Error;

/// Where the sidecar finds the route server's CA bundle and its token.
const ROUTESERVER_CA_DIR: &str = "/var/run/spur/routeserver-ca";
const ROUTESERVER_TOKEN_DIR: &str = "/var/run/spur/routeserver-token";
const TRAFFIC_TOKEN_DIR: &str = "/var/run/spur/traffic-token";

/// The inbound ports a pod's interception covers, spelled as `spur-init` takes them.
pub(super) struct Inbound {
    /// Ports to redirect, comma-separated, or `*` for all.
    include: String,
    /// Ports never redirected, comma-separated; always includes the admin port.
    exclude: String,
}

impl Inbound {
    /// From the config and the pod's port annotations (an annotation that is not a list of
    /// ports is a Config error).
    pub(super) fn of(
        annotations: &BTreeMap<String, String>,
        cfg: &InjectionConfig,
    ) -> Result<Self, Error> {
        let mut exclude = vec![cfg.admin_port];
        exclude.extend(&cfg.exclude_inbound_ports);
        exclude.extend(annotated_ports(annotations, keys::EXCLUDE_INBOUND_PORTS)?);
        exclude.sort_unstable();
        exclude.dedup();
        let include = annotated_ports(annotations, keys::INBOUND_PORTS)?;
        let include = if include.is_empty() {
            "*".to_string()
        } else {
            join(&include)
        };
        Ok(Inbound {
            include,
            exclude: join(&exclude),
        })
    }
}

impl Inbound {
    /// Nothing inbound: a fork's pod, whose sidecar only relays Kafka.
    pub(super) fn none(cfg: &InjectionConfig) -> Self {
        Inbound {
            include: "none".into(),
            exclude: cfg.admin_port.to_string(),
        }
    }
}

/// The comma-separated ports of annotation `key` (none when absent or empty).
fn annotated_ports(annotations: &BTreeMap<String, String>, key: &str) -> Result<Vec<u16>, Error> {
    match annotations.get(key).map(|s| s.trim()) {
        None | Some("") => Ok(Vec::new()),
        Some(list) => list
            .split(',')
            .map(|p| {
                p.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| Error::Config(format!("annotation {key}: {p:?} is not a port")))
            })
            .collect(),
    }
}

/// The Kafka broker ports whose connections the pod's sidecar relays: the pod's annotation
/// (`none`: none) or else the config's `kafkaPorts`.
pub(super) fn kafka_ports(
    annotations: &BTreeMap<String, String>,
    cfg: &InjectionConfig,
) -> Result<Vec<u16>, Error> {
    let ports = match keys::kafka_ports(annotations) {
        keys::KafkaPorts::Off => return Ok(Vec::new()),
        keys::KafkaPorts::Default => cfg.kafka_ports.clone(),
        keys::KafkaPorts::Listed(_) => annotated_ports(annotations, keys::KAFKA_PORTS)?,
    };
    let mut ports = ports;
    ports.sort_unstable();
    ports.dedup();
    check_kafka_ports(&ports, cfg, &format!("annotation {}", keys::KAFKA_PORTS))?;
    Ok(ports)
}

/// Broker ports must leave the sidecar's own ports alone: a broker port that is the relay's,
/// the proxy's or the admin port would send the sidecar's listeners' traffic in a loop.
pub(super) fn check_kafka_ports(
    ports: &[u16],
    cfg: &InjectionConfig,
    what: &str,
) -> Result<(), Error> {
    for p in ports {
        if *p == 0 || [cfg.kafka_proxy_port, cfg.proxy_port, cfg.admin_port].contains(p) {
            return Err(Error::Config(format!(
                "{what}: {p} cannot be a Kafka broker port (0 or one of the sidecar's own ports {}, {}, {})",
                cfg.proxy_port, cfg.admin_port, cfg.kafka_proxy_port
            )));
        }
    }
    Ok(())
}

/// The sidecar's Kafka relay settings; none when the pod has no Kafka ports.
pub(super) fn kafka_env(ports: &[u16], cfg: &InjectionConfig) -> Vec<Value> {
    if ports.is_empty() {
        return Vec::new();
    }
    vec![
        env("SPUR_KAFKA_PORTS", join(ports)),
        env("SPUR_KAFKA_PROXY_PORT", cfg.kafka_proxy_port.to_string()),
    ]
}

fn join(ports: &[u16]) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) fn env(name: &str, value: String) -> Value {
    json!({"name": name, "value": value})
}

fn field(name: &str, path: &str) -> Value {
    json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
}

fn resources(r: &ResourceRequirements) -> Value {
    serde_json::to_value(r).unwrap_or(Value::Null)
}

/// The sidecar's environment every injection gives it, before the interception-, placement-
/// and file-specific variables.
pub(super) fn sidecar_env(baseline: &Baseline, cfg: &InjectionConfig) -> Vec<Value> {
    vec![
        env("SPUR_TRANSPARENT", "true".into()),
        env("SPUR_INBOUND_ADDR", format!("0.0.0.0:{}", cfg.proxy_port)),
        env("SPUR_ADMIN_ADDR", format!("0.0.0.0:{}", cfg.admin_port)),
        // A worker that dies is started again on the same listeners (docs/injection.md).
        env("SPUR_SUPERVISE", "true".into()),
        env("SPUR_BASELINE_KIND", baseline.kind.into()),
        env("SPUR_BASELINE_NAMESPACE", baseline.namespace.clone()),
        env("SPUR_BASELINE_NAME", baseline.name.clone()),
        env("SPUR_ROUTESERVER", cfg.routeserver.clone()),
        env("SPUR_THREADS", cfg.sidecar_threads.to_string()),
        env("SPUR_LOG", cfg.sidecar_log.clone()),
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
    ]
    .into_iter()
    .chain(carrier_env(&cfg.routing_keys))
    .collect()
}

/// The sidecar's variables for the configured carriers beyond the standard ones (none when
/// none is configured, so pods of a cluster without them are injected as before).
fn carrier_env(keys: &spur_routing::extract::ExtractConfig) -> Vec<Value> {
    let mut out = Vec::new();
    if !keys.custom_headers.is_empty() {
        out.push(env("SPUR_ROUTING_HEADERS", keys.custom_headers.join(",")));
    }
    if let Some(q) = &keys.query_param {
        out.push(env("SPUR_QUERY_PARAM", q.clone()));
    }
    out
}

/// The `spur-init` init container that programs the interception rules
/// (`interception: initContainer`).
pub(super) fn init_container(cfg: &InjectionConfig, inbound: &Inbound, kafka: &[u16]) -> Value {
    let mut init = json!({
        "name": keys::INIT_CONTAINER,
        "image": cfg.init_image,
        "command": ["spur-init"],
        "args": [
            "--mode", cfg.interception_mode,
            "--proxy-port", cfg.proxy_port.to_string(),
            "--proxy-uid", cfg.proxy_uid.to_string(),
            "--inbound-ports", inbound.include,
            "--exclude-inbound-ports", inbound.exclude,
            // The sidecar listens on IPv4 only: IPv6 inbound must bypass it, not be
            // redirected to a port nobody listens on.
            "--ipv6", "false",
        ],
        "resources": resources(&cfg.init_resources),
        "securityContext": {
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": false,
            "allowPrivilegeEscalation": false,
            "privileged": false,
            "readOnlyRootFilesystem": false,
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
        },
    });
    if !kafka.is_empty()
        && let Some(args) = init["args"].as_array_mut()
    {
        args.extend([
            "--kafka-ports".into(),
            join(kafka).into(),
            "--kafka-proxy-port".into(),
            cfg.kafka_proxy_port.to_string().into(),
        ]);
    }
    set_pull_policy(&mut init, cfg);
    init
}

/// The sidecar's security context when `spur-init` programs the rules: it never holds a
/// capability.
pub(super) fn unprivileged_security(cfg: &InjectionConfig) -> Value {
    json!({
        "runAsUser": cfg.proxy_uid,
        "runAsGroup": cfg.proxy_uid,
        "runAsNonRoot": true,
        "allowPrivilegeEscalation": false,
        "privileged": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]},
    })
}

/// The variables that make the sidecar program the interception rules itself
/// (`interception: sidecar`): spur-init's own variables; the redirect port and the admin port's
/// exclusion come from SPUR_INBOUND_ADDR and SPUR_ADMIN_ADDR.
pub(super) fn intercept_env(cfg: &InjectionConfig, inbound: &Inbound) -> Vec<Value> {
    vec![
        env("SPUR_INTERCEPT", "true".into()),
        env("SPUR_INIT_MODE", cfg.interception_mode.clone()),
        env("SPUR_PROXY_UID", cfg.proxy_uid.to_string()),
        env("SPUR_INBOUND_PORTS", inbound.include.clone()),
        env("SPUR_EXCLUDE_INBOUND_PORTS", inbound.exclude.clone()),
        env("SPUR_INIT_IPV6", "false".into()),
        // iptables-legacy's lock file, off the read-only root (a pod-local lock).
        env("XTABLES_LOCKFILE", "/dev/shm/spur-xtables.lock".into()),
    ]
}

/// The sidecar's security context when it programs the rules itself: root with what
/// programming netfilter and switching ids needs; the sidecar gives all of it up (uid and gid
/// 15337, no capabilities) before it opens a socket.
pub(super) fn intercepting_security() -> Value {
    json!({
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": false,
        "allowPrivilegeEscalation": false,
        "privileged": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"add": ["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"], "drop": ["ALL"]},
    })
}

/// Files the sidecar mounts: pod volumes, its mounts of them, and the variables that point it
/// at them.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Files {
    pub env: Vec<Value>,
    pub volumes: Vec<Value>,
    pub mounts: Vec<Value>,
}

/// The route server's CA bundle and a token for its audience (and the traffic store's token
/// when there is one), all files the kubelet keeps current (the sidecar re-reads them for every
/// connection).
pub(super) fn mounted_files(cfg: &InjectionConfig) -> Files {
    let mut files = Files::default();
    let Files {
        env: env_list,
        volumes,
        mounts,
    } = &mut files;
    if !cfg.routeserver_ca_config_map.is_empty() {
        env_list.push(env(
            "SPUR_ROUTESERVER_CA",
            format!("{ROUTESERVER_CA_DIR}/ca.crt"),
        ));
        volumes.push(json!({
            "name": keys::ROUTESERVER_CA_VOLUME,
            "configMap": {"name": cfg.routeserver_ca_config_map, "items": [{"key": "ca.crt", "path": "ca.crt"}]},
        }));
        mounts.push(json!({"name": keys::ROUTESERVER_CA_VOLUME, "mountPath": ROUTESERVER_CA_DIR, "readOnly": true}));
    }
    if !cfg.routeserver_token_audience.is_empty() {
        env_list.push(env(
            "SPUR_ROUTESERVER_TOKEN_FILE",
            format!("{ROUTESERVER_TOKEN_DIR}/token"),
        ));
        volumes.push(json!({
            "name": keys::ROUTESERVER_TOKEN_VOLUME,
            "projected": {"sources": [{"serviceAccountToken": {
                "audience": cfg.routeserver_token_audience,
                "expirationSeconds": 3600,
                "path": "token",
            }}]},
        }));
        mounts.push(json!({"name": keys::ROUTESERVER_TOKEN_VOLUME, "mountPath": ROUTESERVER_TOKEN_DIR, "readOnly": true}));
    }
    if !cfg.traffic_server.is_empty() {
        env_list.push(env("SPUR_TRAFFIC_SERVER", cfg.traffic_server.clone()));
        env_list.push(field("SPUR_POD_NAME", "metadata.name"));
        if !cfg.routeserver_ca_config_map.is_empty() {
            env_list.push(env(
                "SPUR_TRAFFIC_SERVER_CA",
                format!("{ROUTESERVER_CA_DIR}/ca.crt"),
            ));
        }
        env_list.push(env(
            "SPUR_TRAFFIC_SERVER_TOKEN_FILE",
            format!("{TRAFFIC_TOKEN_DIR}/token"),
        ));
        volumes.push(json!({
            "name": keys::TRAFFIC_TOKEN_VOLUME,
            "projected": {"sources": [{"serviceAccountToken": {
                "audience": cfg.traffic_token_audience,
                "expirationSeconds": 3600,
                "path": "token",
            }}]},
        }));
        mounts.push(json!({"name": keys::TRAFFIC_TOKEN_VOLUME, "mountPath": TRAFFIC_TOKEN_DIR, "readOnly": true}));
    }
    files
}

/// The `spur-sidecar` container, with its complete environment, security context and mounts.
pub(super) fn sidecar(
    cfg: &InjectionConfig,
    env_list: Vec<Value>,
    security: Value,
    mounts: Vec<Value>,
    placement: Placement,
) -> Value {
    let mut sidecar = json!({
        "name": keys::SIDECAR_CONTAINER,
        "image": cfg.sidecar_image,
        "command": ["spur-sidecar"],
        "env": env_list,
        "ports": [{"name": "spur-admin", "containerPort": cfg.admin_port, "protocol": "TCP"}],
        // Started (and so ready) means "listening", not "routes loaded": a route server outage
        // must not make the user's pods unready (keyed requests then fall back to the
        // baseline). The kubelet starts the next container once this hook returns: at once
        // when the sidecar listens. A startup probe instead costs a probe period or two (its
        // worker ticks once a second) and a readiness probe one more: 3 s per pod start on the
        // node tier (perf/results/node.md).
        "lifecycle": {"postStart": {"exec": {"command": ["spur-sidecar", "--wait-listening", "60s"]}}},
        "livenessProbe": {
            "httpGet": {"path": "/live", "port": cfg.admin_port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": resources(&cfg.sidecar_resources),
        "securityContext": security,
    });
    if !mounts.is_empty() {
        sidecar["volumeMounts"] = Value::Array(mounts);
    }
    if placement == Placement::Native {
        // A native sidecar: started before the app containers, stopped after them.
        sidecar["restartPolicy"] = "Always".into();
    }
    set_pull_policy(&mut sidecar, cfg);
    sidecar
}

/// Sets the configured `imagePullPolicy` on an injected container; none leaves Kubernetes'
/// default.
fn set_pull_policy(container: &mut Value, cfg: &InjectionConfig) {
    if let Some(policy) = &cfg.image_pull_policy {
        container["imagePullPolicy"] = policy.clone().into();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn names(values: &[Value]) -> Vec<&str> {
        values.iter().map(|v| v["name"].as_str().unwrap()).collect()
    }

    /// Configured carriers reach every sidecar as its flags' variables; none configured adds
    /// nothing; a bad one is refused when the config is read.
    #[test]
    fn configured_carriers_reach_the_sidecar() {
        let baseline = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let mut cfg = InjectionConfig::default();
        let plain = names(&sidecar_env(&baseline, &cfg)).join(" ");
        assert!(
            !plain.contains("ROUTING_HEADERS") && !plain.contains("QUERY_PARAM"),
            "{plain}"
        );
        cfg.routing_keys = serde_json::from_value(serde_json::json!(
            {"customHeaders": ["x-tenant-key", "x-route"], "queryParam": "sd-routing-key"}
        ))
        .unwrap();
        cfg.validate().unwrap();
        let env = sidecar_env(&baseline, &cfg);
        let get = |k: &str| {
            env.iter()
                .find(|v| v["name"] == k)
                .map(|v| v["value"].clone())
        };
        assert_eq!(
            get("SPUR_ROUTING_HEADERS"),
            Some("x-tenant-key,x-route".into())
        );
        assert_eq!(get("SPUR_QUERY_PARAM"), Some("sd-routing-key".into()));
        for bad in [
            serde_json::json!({"customHeaders": ["bad header"]}),
            serde_json::json!({"queryParam": "a b"}),
        ] {
            cfg.routing_keys = serde_json::from_value(bad).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains("routingKeys"), "{e}");
        }
    }

    /// The chart's `injection.sidecarLog` (Signadot's per-pod `signadot.com/log-level`, cluster
    /// wide here) is every sidecar's `SPUR_LOG`; `info` when unset.
    #[test]
    fn sidecar_log_is_the_sidecars_spur_log() {
        let baseline = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: None,
        };
        let spur_log = |cfg: &InjectionConfig| {
            sidecar_env(&baseline, cfg)
                .into_iter()
                .find(|v| v["name"] == "SPUR_LOG")
                .map(|v| v["value"].clone())
        };
        assert_eq!(spur_log(&InjectionConfig::default()), Some("info".into()));
        // As the chart writes it into the injection ConfigMap.
        let cfg: InjectionConfig =
            serde_json::from_value(serde_json::json!({"sidecarLog": "debug,spur_proxy=trace"}))
                .unwrap();
        assert_eq!(spur_log(&cfg), Some("debug,spur_proxy=trace".into()));
    }

    /// A namespace adds headers to the cluster's and replaces its query parameter; a malformed
    /// annotation is a configuration error naming it; no annotation leaves the config as it is.
    #[test]
    fn a_namespace_adds_its_own_carriers() {
        use crate::inject::for_namespace;
        let mut cfg = InjectionConfig::default();
        cfg.routing_keys.custom_headers = vec!["x-cluster".into()];
        cfg.routing_keys.query_param = Some("cluster-q".into());
        let none = for_namespace(&cfg, None).unwrap();
        assert!(matches!(none, std::borrow::Cow::Borrowed(_)));
        let ns = BTreeMap::from([
            (
                keys::ROUTING_HEADERS.to_string(),
                "X-Team-Key, x-other".to_string(),
            ),
            (keys::QUERY_PARAM.to_string(), "team-q".to_string()),
        ]);
        let mine = for_namespace(&cfg, Some(&ns)).unwrap();
        assert_eq!(
            mine.routing_keys.custom_headers,
            ["x-cluster", "x-team-key", "x-other"]
        );
        assert_eq!(mine.routing_keys.query_param.as_deref(), Some("team-q"));
        let bad = BTreeMap::from([(keys::ROUTING_HEADERS.to_string(), "a b".to_string())]);
        let e = for_namespace(&cfg, Some(&bad)).unwrap_err().to_string();
        assert!(e.contains(keys::ROUTING_HEADERS), "{e}");
    }

    /// The documented (default) configuration mounts the CA bundle and the route server token;
    /// these are the other branches: nothing at all, and a traffic store without a CA bundle.
    #[test]
    fn mounted_files_follow_the_config() {
        let none = InjectionConfig {
            routeserver_ca_config_map: String::new(),
            routeserver_token_audience: String::new(),
            ..InjectionConfig::default()
        };
        assert_eq!(mounted_files(&none), Files::default());

        let traffic = InjectionConfig {
            traffic_server: "spur-traffic.spur-system.svc:7778".into(),
            ..none
        };
        let files = mounted_files(&traffic);
        assert_eq!(
            names(&files.env),
            [
                "SPUR_TRAFFIC_SERVER",
                "SPUR_POD_NAME",
                "SPUR_TRAFFIC_SERVER_TOKEN_FILE"
            ]
        );
        assert_eq!(names(&files.volumes), [keys::TRAFFIC_TOKEN_VOLUME]);
        assert_eq!(
            files.volumes[0]["projected"]["sources"][0]["serviceAccountToken"]["audience"],
            "spur-traffic"
        );
        assert_eq!(files.mounts[0]["mountPath"], TRAFFIC_TOKEN_DIR);

        // With the CA bundle, the traffic store is dialled under it too.
        let with_ca = InjectionConfig {
            routeserver_ca_config_map: "spur-ca-bundle".into(),
            ..traffic
        };
        let files = mounted_files(&with_ca);
        assert!(names(&files.env).contains(&"SPUR_TRAFFIC_SERVER_CA"));
        assert_eq!(
            names(&files.mounts),
            [keys::ROUTESERVER_CA_VOLUME, keys::TRAFFIC_TOKEN_VOLUME]
        );
    }

    #[test]
    fn pull_policy_is_set_only_when_configured() {
        let cfg = InjectionConfig::default();
        let inbound = Inbound::of(&BTreeMap::new(), &cfg).unwrap();
        assert_eq!(
            init_container(&cfg, &inbound, &[]).get("imagePullPolicy"),
            None
        );
        let cfg = InjectionConfig {
            image_pull_policy: Some("IfNotPresent".into()),
            ..cfg
        };
        assert_eq!(
            init_container(&cfg, &inbound, &[])["imagePullPolicy"],
            "IfNotPresent"
        );
        let sidecar = sidecar(
            &cfg,
            Vec::new(),
            Value::Null,
            Vec::new(),
            Placement::Regular,
        );
        assert_eq!(sidecar["imagePullPolicy"], "IfNotPresent");
        // No mounts: no volumeMounts key at all.
        assert_eq!(sidecar.get("volumeMounts"), None);
    }

    /// A fork's pod is screened in only with Kafka ports, to be resolved as a fork; its sidecar
    /// then intercepts nothing inbound, captures nothing and relays Kafka in fork mode.
    #[test]
    fn a_forks_pod_gets_a_kafka_only_sidecar() {
        use super::super::{ReplicaSetOwner, Screen, containers, screen};
        let fork_pod = |annotations: Value| -> k8s_openapi::api::core::v1::Pod {
            serde_json::from_value(json!({"metadata": {
                "name": "api-sb1-x", "labels": {"spur.dev/fork": "api-sb1"},
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "api-sb1-5d8f7c", "uid": "u", "controller": true}]},
                "spec": {"containers": [{"name": "app", "image": "api:1"}]}}))
            .unwrap()
        };
        let cfg = InjectionConfig {
            traffic_server: "spur-traffic.spur-system.svc:7778".into(),
            ..InjectionConfig::default()
        };
        let plain = fork_pod(json!({(keys::INJECT): "true"}));
        assert!(
            matches!(screen(&plain, "shop", None, &cfg), Screen::Skip(r) if r.contains("without Kafka ports"))
        );
        let kafka = fork_pod(json!({(keys::INJECT): "true", (keys::KAFKA_PORTS): "9092"}));
        assert_eq!(
            screen(&kafka, "shop", None, &cfg),
            Screen::Resolve(ReplicaSetOwner {
                name: "api-sb1-5d8f7c".into(),
                fork: true
            })
        );
        let not_in = fork_pod(json!({(keys::KAFKA_PORTS): "9092"}));
        assert!(
            matches!(screen(&not_in, "shop", None, &cfg), Screen::Skip(r) if r.contains("not opted in"))
        );
        let baseline = Baseline {
            kind: "Deployment",
            namespace: "shop".into(),
            name: "api".into(),
            fork_of_sandbox: Some("sb1".into()),
        };
        let injected = containers(&kafka, &baseline, &cfg).unwrap();
        let env = &injected.containers[0]["env"];
        let get = |k: &str| {
            env.as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == k)
                .map(|e| e["value"].clone())
        };
        assert_eq!(get("SPUR_FORK_OF_SANDBOX"), Some("sb1".into()));
        assert_eq!(get("SPUR_INBOUND_PORTS"), Some("none".into()));
        assert_eq!(get("SPUR_KAFKA_PORTS"), Some("9092".into()));
        assert_eq!(
            get("SPUR_TRAFFIC_SERVER"),
            None,
            "a fork's sidecar captures nothing"
        );
        let baseline_pod = containers(
            &kafka,
            &Baseline {
                fork_of_sandbox: None,
                ..baseline
            },
            &cfg,
        )
        .unwrap();
        assert!(
            baseline_pod.containers[0]["env"]
                .to_string()
                .contains("SPUR_TRAFFIC_SERVER")
        );
    }

    /// Kafka ports come from the pod's annotation, else the config; `none` turns them off for a
    /// pod; none at all adds nothing to the sidecar or to spur-init.
    #[test]
    fn kafka_ports_from_the_annotation_or_the_config() {
        let ann = |v: &str| BTreeMap::from([(keys::KAFKA_PORTS.to_string(), v.to_string())]);
        let cfg = InjectionConfig::default();
        assert_eq!(
            kafka_ports(&BTreeMap::new(), &cfg).unwrap(),
            Vec::<u16>::new()
        );
        assert_eq!(kafka_env(&[], &cfg), Vec::<Value>::new());
        let inbound = Inbound::of(&BTreeMap::new(), &cfg).unwrap();
        let args = init_container(&cfg, &inbound, &[])["args"].clone();
        assert!(!args.to_string().contains("kafka"), "{args}");

        let cluster = InjectionConfig {
            kafka_ports: vec![9092],
            ..cfg.clone()
        };
        assert_eq!(kafka_ports(&BTreeMap::new(), &cluster).unwrap(), [9092]);
        assert_eq!(
            kafka_ports(&ann("9093, 9094,9093"), &cluster).unwrap(),
            [9093, 9094]
        );
        assert_eq!(
            kafka_ports(&ann("none"), &cluster).unwrap(),
            Vec::<u16>::new()
        );
        assert_eq!(
            kafka_env(&[9093, 9094], &cluster),
            [
                env("SPUR_KAFKA_PORTS", "9093,9094".into()),
                env("SPUR_KAFKA_PROXY_PORT", "15007".into())
            ]
        );
        let args = init_container(&cluster, &inbound, &[9092])["args"].clone();
        let args: Vec<&str> = args
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(
            args.ends_with(&["--kafka-ports", "9092", "--kafka-proxy-port", "15007"]),
            "{args:?}"
        );
        for bad in ["15007", "15006", "x", "0"] {
            let e = kafka_ports(&ann(bad), &cfg).unwrap_err().to_string();
            assert!(e.contains(keys::KAFKA_PORTS), "{e}");
        }
        let bad = InjectionConfig {
            kafka_ports: vec![15020],
            ..cfg.clone()
        };
        assert!(bad.validate().is_err());
        let bad = InjectionConfig {
            kafka_proxy_port: 15006,
            ..cfg
        };
        assert!(bad.validate().is_err());
    }
}
