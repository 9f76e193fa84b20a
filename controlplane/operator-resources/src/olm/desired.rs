//! The pod of a work unit's attempt, and the checks on the templates it is made from, as pure
//! functions.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use serde_json::{Map, Value, json};
use spur_api::ObjectLifecycleMethods;
use spur_api::keys::labels;
use spur_api::resources::{WorkUnit, Workflow, reserved};

use super::ResourceConfig;

/// Where the step pods' token is mounted.
const TOKEN_DIR: &str = "/var/run/secrets/spur.dev/io";
/// Where the CA bundle is mounted.
const CA_DIR: &str = "/etc/spur-io-ca";
/// The shared volume's mount point (also `spur-io --dir`'s default).
const IO_DIR: &str = "/spur-io";
/// Lifetime asked for the projected token (the kubelet renews it at 80 %).
const TOKEN_SECONDS: i64 = 600;

/// Whether a pod template (a plugin overlay or a unit's template) uses a name the operator
/// reserves, or a restart policy other than Never. `Err` says which.
pub fn check_template(template: &Value) -> Result<(), String> {
    let names = |path: &str| -> Vec<String> {
        template
            .pointer(path)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    for v in names("/spec/volumes") {
        if [
            reserved::IO_VOLUME,
            reserved::TOKEN_VOLUME,
            reserved::CA_VOLUME,
        ]
        .contains(&v.as_str())
        {
            return Err(format!("volume name {v} is reserved for Spur"));
        }
    }
    for c in names("/spec/initContainers") {
        if c == reserved::INIT_CONTAINER {
            return Err(format!("init container name {c} is reserved for Spur"));
        }
    }
    for c in names("/spec/containers") {
        if c == reserved::INIT_CONTAINER {
            return Err(format!("container name {c} is reserved for Spur"));
        }
    }
    match template
        .pointer("/spec/restartPolicy")
        .and_then(Value::as_str)
    {
        None | Some("Never") => {}
        Some(p) => return Err(format!("restartPolicy must be unset or Never, not {p}")),
    }
    if template.pointer("/metadata/name").is_some() {
        return Err("the pod name must be left empty: the operator names step pods".into());
    }
    Ok(())
}

/// The pod of one attempt of `unit`.
pub(super) fn build_pod(
    olm: &ObjectLifecycleMethods,
    cfg: &ResourceConfig,
    workflow: Workflow,
    unit: &WorkUnit,
    name: &str,
) -> Result<Pod, String> {
    let t = &unit.exec_unit_template;
    check_template(&t.pod_template)?;
    let mut template = t.pod_template.clone();
    let spec = template
        .as_object_mut()
        .ok_or("the pod template must be an object")?
        .entry("spec")
        .or_insert_with(|| json!({}));
    let spec = spec.as_object_mut().ok_or("spec must be an object")?;
    spec.insert("restartPolicy".into(), json!("Never"));
    spec.entry("serviceAccountName")
        .or_insert_with(|| json!(cfg.service_account));
    spec.entry("automountServiceAccountToken")
        .or_insert_with(|| json!(false));
    spec.entry("enableServiceLinks")
        .or_insert_with(|| json!(false));

    let io = IoEnv {
        cfg,
        olm: olm.name_any(),
        workflow,
        unit: &unit.name,
    };
    add_volumes(spec, cfg)?;
    let script_env = t
        .script
        .iter()
        .map(|s| json!({"name": "SPUR_IO_SCRIPT", "value": s}))
        .collect();
    let mut init = json!({
        "name": reserved::INIT_CONTAINER,
        "image": cfg.io_image,
        "command": ["spur-io", "init"],
        "env": io.env(script_env),
        "volumeMounts": mounts(),
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]}
        },
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
    });
    if let Some(p) = &cfg.io_pull_policy {
        init["imagePullPolicy"] = json!(p);
    }
    spec.entry("initContainers")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("initContainers must be a list")?
        .push(init);
    wrap_step(spec, unit, &io)?;

    let mut pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": template.get("metadata").cloned().unwrap_or_else(|| json!({})),
        "spec": template.get("spec").cloned().unwrap_or_else(|| json!({})),
    }))
    .map_err(|e| format!("the pod template does not decode as a pod: {e}"))?;
    let mut labels_map = pod.metadata.labels.take().unwrap_or_default();
    labels_map.insert(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into());
    labels_map.insert(
        labels::OLM.into(),
        spur_api::names::label_value(&olm.name_any()),
    );
    labels_map.insert(labels::WORK_UNIT.into(), unit.name.clone());
    pod.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some(cfg.namespace.clone()),
        labels: Some(labels_map),
        annotations: pod.metadata.annotations.take(),
        owner_references: olm.controller_owner_ref(&()).map(|o| vec![o]),
        ..ObjectMeta::default()
    };
    Ok(pod)
}

/// What `spur-io` needs to find the io context server and say which unit it runs.
struct IoEnv<'a> {
    cfg: &'a ResourceConfig,
    olm: String,
    workflow: Workflow,
    unit: &'a str,
}

impl IoEnv<'_> {
    fn env(&self, extra: Vec<Value>) -> Vec<Value> {
        let mut env = vec![
            json!({"name": "SPUR_IO_SERVER", "value": self.cfg.ics_url}),
            json!({"name": "SPUR_IO_CA_FILE", "value": format!("{CA_DIR}/ca.crt")}),
            json!({"name": "SPUR_IO_TOKEN_FILE", "value": format!("{TOKEN_DIR}/token")}),
            json!({"name": "SPUR_IO_OLM", "value": self.olm}),
            json!({"name": "SPUR_IO_WORKFLOW", "value": self.workflow.as_str()}),
            json!({"name": "SPUR_IO_UNIT", "value": self.unit}),
        ];
        env.extend(extra);
        env
    }
}

/// The mounts of Spur's volumes, in the init and the step container.
fn mounts() -> Value {
    json!([
        {"name": reserved::IO_VOLUME, "mountPath": IO_DIR},
        {"name": reserved::TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": true},
        {"name": reserved::CA_VOLUME, "mountPath": CA_DIR, "readOnly": true},
    ])
}

/// Spur's volumes: the shared directory, the io token, the CA bundle.
fn add_volumes(spec: &mut Map<String, Value>, cfg: &ResourceConfig) -> Result<(), String> {
    let volumes = spec
        .entry("volumes")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("volumes must be a list")?;
    volumes.push(json!({"name": reserved::IO_VOLUME, "emptyDir": {}}));
    volumes.push(json!({"name": reserved::TOKEN_VOLUME, "projected": {"sources": [
        {"serviceAccountToken": {"audience": spur_ics_audience(), "expirationSeconds": TOKEN_SECONDS, "path": "token"}}
    ]}}));
    volumes.push(json!({"name": reserved::CA_VOLUME, "configMap": {"name": cfg.ca_config_map}}));
    Ok(())
}

/// Runs the step container (named `step`, else the first) under `spur-io run`, which injects
/// the unit's inputs and exports its outputs.
fn wrap_step(spec: &mut Map<String, Value>, unit: &WorkUnit, io: &IoEnv<'_>) -> Result<(), String> {
    let t = &unit.exec_unit_template;
    let containers = spec
        .get_mut("containers")
        .and_then(Value::as_array_mut)
        .filter(|c| !c.is_empty())
        .ok_or("the pod template has no container")?;
    let idx = containers
        .iter()
        .position(|c| c.get("name").and_then(Value::as_str) == Some(reserved::STEP_CONTAINER))
        .unwrap_or(0);
    let step = containers[idx]
        .as_object_mut()
        .ok_or("a container must be an object")?;
    let mut args: Vec<String> = vec![format!("{IO_DIR}/bin/spur-io"), "run".into()];
    let input_names: BTreeMap<&str, ()> =
        unit.inputs.iter().map(|i| (i.name.as_str(), ())).collect();
    for inj in &t.input_injects {
        if !input_names.contains_key(inj.input_name.as_str()) {
            return Err(format!("inputInjects: {} is not an input", inj.input_name));
        }
        match (&inj.dst.env, &inj.dst.local_path) {
            (Some(e), None) => args.push(format!("--env={e}={}", inj.input_name)),
            (None, Some(p)) => args.push(format!("--file={p}={}", inj.input_name)),
            _ => return Err("an inputInject has exactly one of env and localPath".into()),
        }
    }
    for e in &t.output_exports {
        args.push(format!("--export={}={}", e.output_name, e.from_path));
    }
    if t.script.is_none() {
        let own: Vec<String> = ["command", "args"]
            .iter()
            .filter_map(|k| step.get(*k).and_then(Value::as_array))
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        if own.is_empty() {
            return Err(
                "a unit without a script needs the step container's command (an image's entrypoint cannot be wrapped)".into(),
            );
        }
        args.push("--".into());
        args.extend(own);
    }
    step.insert("command".into(), json!(args));
    step.remove("args");
    let env = step
        .entry("env")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("env must be a list")?;
    env.extend(io.env(Vec::new()));
    step.entry("volumeMounts")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("volumeMounts must be a list")?
        .extend(mounts().as_array().cloned().unwrap_or_default());
    Ok(())
}

fn spur_ics_audience() -> &'static str {
    // The io context server's default audience (`spur ics serve --audience`).
    "spur-io"
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    pub(crate) fn cfg() -> ResourceConfig {
        ResourceConfig {
            namespace: "spur-resources".into(),
            service_account: "spur-resource-runner".into(),
            io_image: "localhost/spur:dev".into(),
            io_pull_policy: Some("Never".into()),
            ics_url: "https://spur-ics.spur-system.svc:8443".into(),
            ics_namespace: "spur-io-contexts".into(),
            ca_config_map: "spur-ca-bundle".into(),
            operator_namespace: "spur-system".into(),
            retry_base: Duration::from_secs(10),
            retry_max: Duration::from_secs(300),
        }
    }

    /// An OLM with one preStart unit whose exec template is `template`.
    pub(crate) fn olm_with(template: Value) -> ObjectLifecycleMethods {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "ObjectLifecycleMethods",
            "metadata": {"name": "db-1", "uid": "olm-uid", "generation": 1},
            "spec": {"ioContextName": "db-1", "preStart": [{
                "name": "user", "type": "ExecUnit",
                "inputs": [{"name": "dbname", "iocontext": {"name": "db-1", "key": "database.dbname"}}],
                "outputs": [{"name": "dsn"}],
                "execUnitTemplate": template
            }]}
        }))
        .unwrap()
    }

    pub(crate) fn olm() -> ObjectLifecycleMethods {
        olm_with(json!({
            "podTemplate": {"spec": {"containers": [{"name": "step", "image": "pg", "env": [{"name": "A", "value": "b"}]}]}},
            "script": "#!/bin/sh\ntrue\n",
            "inputInjects": [{"inputName": "dbname", "dst": {"env": "DBNAME"}}],
            "outputExports": [{"fromPath": "/tmp/dsn", "outputName": "dsn"}]
        }))
    }

    fn pod_of(o: &ObjectLifecycleMethods) -> Result<Pod, String> {
        build_pod(
            o,
            &cfg(),
            Workflow::PreStart,
            &o.spec.pre_start[0],
            "db-1-user-1",
        )
    }

    #[test]
    fn step_pods_get_spur_io_and_nothing_else_of_the_operator() {
        let o = olm();
        let pod = pod_of(&o).unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("db-1-user-1"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("spur-resources"));
        assert_eq!(
            pod.metadata.labels.as_ref().unwrap()[labels::WORK_UNIT],
            "user"
        );
        let spec = pod.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("spur-resource-runner")
        );
        assert_eq!(spec.automount_service_account_token, Some(false));
        let init = &spec.init_containers.unwrap()[0];
        assert_eq!(init.name, "spur-io-init");
        assert_eq!(init.command.as_deref().unwrap(), ["spur-io", "init"]);
        assert_eq!(init.image_pull_policy.as_deref(), Some("Never"));
        let step = &spec.containers[0];
        let cmd = step.command.clone().unwrap();
        assert_eq!(cmd[..2], ["/spur-io/bin/spur-io".to_string(), "run".into()]);
        assert!(cmd.contains(&"--env=DBNAME=dbname".to_string()), "{cmd:?}");
        assert!(
            cmd.contains(&"--export=dsn=/tmp/dsn".to_string()),
            "{cmd:?}"
        );
        let env: Vec<_> = step
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(env.contains(&"A".to_string()) && env.contains(&"SPUR_IO_UNIT".to_string()));
        let token = spec
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == "spur-io-token")
            .unwrap();
        let src = &token.projected.unwrap().sources.unwrap()[0];
        assert_eq!(
            src.service_account_token
                .as_ref()
                .unwrap()
                .audience
                .as_deref(),
            Some("spur-io")
        );
        let owner = &pod.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.uid.as_str(), owner.controller),
            ("olm-uid", Some(true))
        );
    }

    #[test]
    fn a_unit_without_a_script_wraps_its_own_command() {
        let o = olm_with(json!({"podTemplate": {"spec": {"containers": [
            {"name": "side", "image": "x"},
            {"name": "step", "image": "pg", "command": ["psql"], "args": ["-c", "select 1"]}
        ]}}}));
        let spec = pod_of(&o).unwrap().spec.unwrap();
        let step = &spec.containers[1];
        assert_eq!(
            step.command.as_deref().unwrap(),
            [
                "/spur-io/bin/spur-io",
                "run",
                "--",
                "psql",
                "-c",
                "select 1"
            ]
        );
        assert_eq!(step.args, None);
        assert_eq!(spec.containers[0].command, None);
    }

    #[test]
    fn templates_the_operator_cannot_run_say_why() {
        for (template, says) in [
            (
                json!({"podTemplate": {"spec": {"containers": []}}, "script": "true"}),
                "no container",
            ),
            (
                json!({"podTemplate": {"spec": {"containers": [{"name": "step", "image": "pg"}]}}}),
                "needs the step container's command",
            ),
            (
                json!({"podTemplate": {"spec": {"containers": [{"name": "step", "image": "pg"}]}}, "script": "true",
                       "inputInjects": [{"inputName": "nope", "dst": {"env": "X"}}]}),
                "nope is not an input",
            ),
            (
                json!({"podTemplate": {"spec": {"restartPolicy": "OnFailure"}}}),
                "restartPolicy",
            ),
        ] {
            let e = pod_of(&olm_with(template)).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn reserved_names_and_restart_policies_are_refused() {
        for (t, says) in [
            (
                json!({"spec": {"volumes": [{"name": "spur-io"}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"initContainers": [{"name": "spur-io-init"}]}}),
                "reserved",
            ),
            (
                json!({"spec": {"restartPolicy": "Always"}}),
                "restartPolicy",
            ),
            (json!({"metadata": {"name": "x"}}), "pod name"),
        ] {
            let e = check_template(&t).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        check_template(&json!({"spec": {"restartPolicy": "Never", "volumes": [{"name": "data"}]}}))
            .unwrap();
    }
}
