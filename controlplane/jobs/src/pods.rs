//! Runner pods: the group's pod template, with the job executor added. The user's image is
//! used unchanged: an init container (Spur's image) copies the static executor and its TLS
//! files into a shared volume, and the runner container runs the executor from there.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EmptyDirVolumeSource, Pod, PodSpec, PodTemplateSpec, Probe,
    SecretVolumeSource, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use spur_api::JobRunnerGroup;

use crate::pki::EXECUTOR_SECRET;

/// Label of runner pods: their group's name.
pub const GROUP_LABEL: &str = "spur.dev/runner-group";
/// Annotation of runner pods: a digest of what they were built from. Idle pods built from an
/// older spec are replaced.
pub const TEMPLATE_ANNOTATION: &str = "spur.dev/runner-template";
/// The runner container (the first container unless one has this name).
pub const RUNNER_CONTAINER: &str = "runner";
/// Names the operator adds; a template that uses them is rejected.
pub const INIT_CONTAINER: &str = "spur-job-init";
/// The outbound sidecar (groups with `routingKeyInjection`).
pub const SIDECAR_CONTAINER: &str = "spur-sidecar";
/// Where the executor writes the running job's key for the sidecar.
pub const KEY_FILE: &str = "/spur-job/routing-key";
/// The outbound sidecar's listener (redirect target).
pub const OUTBOUND_PORT: u16 = 15001;
pub const VOLUME: &str = "spur-job";
pub const TLS_VOLUME: &str = "spur-job-tls";
/// Where the shared volume is mounted.
pub const MOUNT: &str = "/spur-job";

/// Why a pod template cannot be used.
pub fn check_template(group: &JobRunnerGroup) -> Result<PodTemplateSpec, String> {
    let template: PodTemplateSpec = match &group.spec.pod_template {
        None => PodTemplateSpec::default(),
        Some(v) => {
            serde_json::from_value(v.clone()).map_err(|e| format!("spec.podTemplate: {e}"))?
        }
    };
    let spec = template.spec.clone().unwrap_or_default();
    let reserved_c = |c: &Container| c.name == INIT_CONTAINER || c.name == SIDECAR_CONTAINER;
    if spec.containers.iter().any(reserved_c)
        || spec.init_containers.iter().flatten().any(reserved_c)
    {
        return Err(format!(
            "spec.podTemplate: container names {INIT_CONTAINER} and {SIDECAR_CONTAINER} are reserved"
        ));
    }
    if let Some(v) = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == VOLUME || v.name == TLS_VOLUME)
    {
        return Err(format!(
            "spec.podTemplate: volume name {} is reserved",
            v.name
        ));
    }
    if spec
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .any(|m| m.mount_path == MOUNT || m.mount_path.starts_with("/spur-job/"))
    {
        return Err(format!("spec.podTemplate: mount path {MOUNT} is reserved"));
    }
    if spec.host_network == Some(true) {
        return Err("spec.podTemplate: hostNetwork runners are not supported (the executor's port would be the node's)".into());
    }
    Ok(template)
}

/// What runner pods are built with besides the group.
#[derive(Debug, Clone)]
pub struct Build<'a> {
    pub executor_image: &'a str,
    pub pull_policy: Option<&'a str>,
    pub max_log_bytes: u64,
    /// Custom headers the outbound sidecar writes the key into besides the standard carriers
    /// ([`crate::Config::routing_headers`]).
    pub routing_headers: &'a [String],
}

/// The runner pod for `group` (named by the API server from `<group>-`).
pub fn runner_pod(group: &JobRunnerGroup, template: PodTemplateSpec, b: &Build<'_>) -> Pod {
    let name = group.name_any();
    let ns = group.namespace().unwrap_or_default();
    let mut meta = template.metadata.unwrap_or_default();
    let mut labels = meta.labels.take().unwrap_or_default();
    labels.insert(GROUP_LABEL.into(), name.clone());
    labels.insert(
        spur_api::keys::labels::MANAGED_BY.into(),
        spur_api::keys::labels::MANAGED_BY_VALUE.into(),
    );
    let mut annotations = meta.annotations.take().unwrap_or_default();
    annotations.insert(TEMPLATE_ANNOTATION.into(), template_digest(group));
    let mut spec: PodSpec = template.spec.unwrap_or_default();

    let shared = VolumeMount {
        name: VOLUME.into(),
        mount_path: MOUNT.into(),
        ..Default::default()
    };
    let init = Container {
        name: INIT_CONTAINER.into(),
        image: Some(b.executor_image.into()),
        image_pull_policy: b.pull_policy.map(Into::into),
        command: Some(vec![
            "spur-job-executor".into(),
            "install".into(),
            "--to".into(),
            MOUNT.into(),
            "--tls-from".into(),
            "/etc/spur-job-tls".into(),
        ]),
        volume_mounts: Some(vec![
            shared.clone(),
            VolumeMount {
                name: TLS_VOLUME.into(),
                mount_path: "/etc/spur-job-tls".into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    let mut inits = vec![init];
    inits.extend(spec.init_containers.take().unwrap_or_default());
    spec.init_containers = Some(inits);

    if spec.containers.is_empty() {
        spec.containers.push(Container {
            name: RUNNER_CONTAINER.into(),
            ..Default::default()
        });
    }
    let idx = spec
        .containers
        .iter()
        .position(|c| c.name == RUNNER_CONTAINER)
        .unwrap_or(0);
    let runner = &mut spec.containers[idx];
    runner.image = Some(group.spec.image.clone());
    runner.command = Some(vec![
        format!("{MOUNT}/bin/spur-job-executor"),
        "serve".into(),
        "--listen".into(),
        format!("0.0.0.0:{}", spur_job_executor::DEFAULT_PORT),
        "--tls-dir".into(),
        format!("{MOUNT}/tls"),
        "--work-dir".into(),
        format!("{MOUNT}/work"),
        "--max-log-bytes".into(),
        b.max_log_bytes.to_string(),
    ]);
    if group.spec.routing_key_injection
        && let Some(cmd) = runner.command.as_mut()
    {
        cmd.extend(["--routing-key-file".to_owned(), KEY_FILE.to_owned()]);
    }
    runner.args = None;
    let mut ports = runner.ports.take().unwrap_or_default();
    ports.push(ContainerPort {
        name: Some("spur-executor".into()),
        container_port: i32::from(spur_job_executor::DEFAULT_PORT),
        ..Default::default()
    });
    runner.ports = Some(ports);
    runner.readiness_probe = Some(Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(i32::from(spur_job_executor::DEFAULT_PORT)),
            ..Default::default()
        }),
        period_seconds: Some(2),
        ..Default::default()
    });
    runner.liveness_probe = None;
    let mut mounts = runner.volume_mounts.take().unwrap_or_default();
    mounts.push(shared);
    runner.volume_mounts = Some(mounts);

    if group.spec.routing_key_injection {
        // First, so the kubelet starts the runner only once the sidecar listens (its postStart
        // hook) and the pod's outbound rules are in place.
        spec.containers.insert(0, outbound_sidecar(group, b));
    }
    let mut volumes = spec.volumes.take().unwrap_or_default();
    volumes.push(Volume {
        name: VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    });
    volumes.push(Volume {
        name: TLS_VOLUME.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(EXECUTOR_SECRET.into()),
            // The init container runs as the image's non-root user.
            default_mode: Some(0o444),
            ..Default::default()
        }),
        ..Default::default()
    });
    spec.volumes = Some(volumes);
    // A runner is replaced, never restarted: a restarted executor would have forgotten its job.
    spec.restart_policy = Some("Never".into());
    // No API access unless the template asks for it: a job is code from whoever submitted it.
    if spec.automount_service_account_token.is_none() && spec.service_account_name.is_none() {
        spec.automount_service_account_token = Some(false);
    }

    Pod {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}-")),
            namespace: Some(ns),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: group.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// Spur's sidecar in outbound mode: it programs the pod's rules (the pod's own outbound TCP to
/// it; nothing inbound), drops to its own uid without capabilities, and adds the key in
/// [`KEY_FILE`] to every request (the executor writes it only for `Auto` jobs).
fn outbound_sidecar(group: &JobRunnerGroup, b: &Build<'_>) -> Container {
    use k8s_openapi::api::core::v1::{
        Capabilities, EnvVar, ExecAction, Lifecycle, LifecycleHandler, SecurityContext,
    };
    let env = |name: &str, value: &str| EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    };
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let listen = format!("0.0.0.0:{OUTBOUND_PORT}");
    let ns = group.namespace().unwrap_or_default();
    let name = group.name_any();
    Container {
        name: SIDECAR_CONTAINER.into(),
        image: Some(b.executor_image.into()),
        image_pull_policy: b.pull_policy.map(Into::into),
        command: Some(strings(&[
            "spur-sidecar",
            "--transparent",
            "--intercept",
            "--inbound-addr",
            &listen,
            "--admin-addr",
            "127.0.0.1:15020",
            "--inject-key-file",
            KEY_FILE,
            "--baseline-kind",
            "JobRunnerGroup",
            "--baseline-namespace",
            &ns,
            "--baseline-name",
            &name,
        ])),
        env: Some(
            [
                env("SPUR_INIT_IPV6", "false"),
                // iptables-legacy's lock file, off the read-only root (a pod-local lock).
                env("XTABLES_LOCKFILE", "/dev/shm/spur-xtables.lock"),
            ]
            .into_iter()
            // The cluster's custom carriers, for apps that propagate only those.
            .chain(
                (!b.routing_headers.is_empty())
                    .then(|| env("SPUR_ROUTING_HEADERS", &b.routing_headers.join(","))),
            )
            .collect(),
        ),
        lifecycle: Some(Lifecycle {
            post_start: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(strings(&["spur-sidecar", "--wait-listening", "60s"])),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: VOLUME.into(),
            mount_path: MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_group: Some(0),
            run_as_non_root: Some(false),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                add: Some(strings(&["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"])),
                drop: Some(vec!["ALL".into()]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A digest of what a group's pods are built from (image and template).
pub fn template_digest(group: &JobRunnerGroup) -> String {
    let v = serde_json::json!({
        "image": group.spec.image,
        "podTemplate": group.spec.pod_template,
        "routingKeyInjection": group.spec.routing_key_injection,
    });
    let text = serde_json::to_string(&v).unwrap_or_default();
    crate::store::hex_sha256(text.as_bytes())[..16].to_owned()
}

/// Where a runner pod is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerState {
    /// Being deleted, or its containers ended: replaced.
    Gone,
    /// Not ready yet.
    Starting,
    Ready,
}

pub fn runner_state(pod: &Pod) -> RunnerState {
    if pod.meta().deletion_timestamp.is_some() {
        return RunnerState::Gone;
    }
    let Some(st) = &pod.status else {
        return RunnerState::Starting;
    };
    match st.phase.as_deref() {
        Some("Succeeded" | "Failed") => return RunnerState::Gone,
        Some("Running") => {}
        _ => return RunnerState::Starting,
    }
    let ready = st
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if ready && st.pod_ip.is_some() {
        RunnerState::Ready
    } else {
        RunnerState::Starting
    }
}

pub fn labels_selector(group: &str) -> String {
    format!("{GROUP_LABEL}={group}")
}

/// Labels a template sets, for the status selector.
pub fn selector_labels(group: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(GROUP_LABEL.to_owned(), group.to_owned())])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn group(template: serde_json::Value) -> JobRunnerGroup {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
            "metadata": {"name": "smoke", "namespace": "team", "uid": "u1"},
            "spec": {"image": "busybox:1", "podTemplate": template}
        }))
        .unwrap()
    }

    #[test]
    fn the_executor_is_added_around_the_users_image() {
        let g = group(json!({
            "metadata": {"labels": {"team": "a"}},
            "spec": {"containers": [{"name": "side", "image": "x"}, {"name": "runner", "env": [{"name": "A", "value": "1"}]}],
                     "volumes": [{"name": "data", "emptyDir": {}}]}
        }));
        let t = check_template(&g).unwrap();
        let pod = runner_pod(
            &g,
            t,
            &Build {
                executor_image: "spur:dev",
                pull_policy: Some("Never"),
                max_log_bytes: 1000,
                routing_headers: &["x-tenant-route".to_owned()],
            },
        );
        assert_eq!(pod.metadata.generate_name.as_deref(), Some("smoke-"));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[GROUP_LABEL], "smoke");
        assert_eq!(labels["team"], "a");
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0].name,
            INIT_CONTAINER
        );
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0].image.as_deref(),
            Some("spur:dev")
        );
        assert_eq!(
            spec.containers[0].name, SIDECAR_CONTAINER,
            "the outbound sidecar first"
        );
        let sidecar_cmd = spec.containers[0].command.clone().unwrap();
        assert!(sidecar_cmd.contains(&"--inject-key-file".to_owned()));
        let sidecar_env = spec.containers[0].env.clone().unwrap();
        assert!(
            sidecar_env.iter().any(|e| e.name == "SPUR_ROUTING_HEADERS"
                && e.value.as_deref() == Some("x-tenant-route")),
            "{sidecar_env:?}"
        );
        assert!(sidecar_cmd.contains(&"--intercept".to_owned()));
        let runner = &spec.containers[2];
        assert!(
            runner
                .command
                .as_ref()
                .unwrap()
                .ends_with(&["--routing-key-file".to_owned(), KEY_FILE.to_owned()])
        );
        assert_eq!(runner.image.as_deref(), Some("busybox:1"));
        assert_eq!(
            runner.command.as_ref().unwrap()[0],
            "/spur-job/bin/spur-job-executor"
        );
        assert!(
            runner
                .command
                .as_ref()
                .unwrap()
                .contains(&"1000".to_owned())
        );
        assert_eq!(
            runner.env.as_ref().unwrap()[0].name,
            "A",
            "the template's env stays"
        );
        assert_eq!(
            spec.containers[1].image.as_deref(),
            Some("x"),
            "other containers untouched"
        );
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let vols: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(vols, ["data", VOLUME, TLS_VOLUME]);
        // The TLS Secret is mounted into the init container only.
        assert!(
            runner
                .volume_mounts
                .as_ref()
                .unwrap()
                .iter()
                .all(|m| m.name != TLS_VOLUME)
        );

        // Without injection: no sidecar, no key file, another digest.
        let mut plain = g.clone();
        plain.spec.routing_key_injection = false;
        let pod = runner_pod(
            &plain,
            check_template(&plain).unwrap(),
            &Build {
                executor_image: "spur:dev",
                pull_policy: None,
                max_log_bytes: 1000,
                routing_headers: &[],
            },
        );
        let spec = pod.spec.unwrap();
        assert!(spec.containers.iter().all(|c| c.name != SIDECAR_CONTAINER));
        let cmd = spec.containers[1].command.clone().unwrap();
        assert!(!cmd.contains(&"--routing-key-file".to_owned()));
        assert_ne!(template_digest(&plain), template_digest(&g));
    }

    #[test]
    fn reserved_names_and_bad_templates_are_refused() {
        for (t, want) in [
            (
                json!({"spec": {"containers": [{"name": "spur-job-init"}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"containers": [{"name": "r"}], "volumes": [{"name": "spur-job", "emptyDir": {}}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"containers": [{"name": "r", "volumeMounts": [{"name": "d", "mountPath": "/spur-job"}]}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"hostNetwork": true, "containers": [{"name": "r"}]}}),
                "hostNetwork",
            ),
            (json!({"spec": {"containers": "nope"}}), "spec.podTemplate"),
        ] {
            let err = check_template(&group(t.clone())).unwrap_err();
            assert!(err.contains(want), "{t}: {err}");
        }
        assert!(check_template(&group(serde_json::Value::Null)).is_ok());
    }
}
