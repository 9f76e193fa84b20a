//! Configuration the components read once, at start, rolls them when it changes (issue 47,
//! "Configuration changes and upgrades that take effect"): the operator's pod template carries
//! the checksum of the injection config (ConfigMap `spur-injection`, which the webhook reads at
//! start), the agent's that of the hub's CA. `helm upgrade --set injection.sidecarLog=debug`
//! thus replaces the operator's pods and newly injected sidecars log at debug; a change of
//! nothing they read leaves them running. And the pre-upgrade hook that lets a persistence value
//! of a StatefulSet change describes every claim template the chart renders; the CRD hook runs
//! before it on every install and upgrade, unless turned off.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use spur_e2e::kube::helm_template;

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn annotation(objects: &[Value], deployment: &str, key: &str) -> String {
    find(objects, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"][key]
        .as_str()
        .unwrap_or_else(|| panic!("{deployment}: no pod annotation {key}"))
        .to_owned()
}

#[tokio::test]
async fn a_changed_injection_config_rolls_the_operator_and_nothing_else_does() {
    let base = helm_template(&[]).await.unwrap();
    let debug = helm_template(&["--set", "injection.sidecarLog=debug"])
        .await
        .unwrap();
    let other = helm_template(&["--set", "operator.resources.limits.memory=300Mi"])
        .await
        .unwrap();
    let key = "checksum/injection";
    let config = |objects: &[Value]| {
        find(objects, "ConfigMap", "spur-injection")["data"]["injection.yaml"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        config(&debug).contains("sidecarLog: debug"),
        "{}",
        config(&debug)
    );
    assert_ne!(
        annotation(&base, "spur-operator", key),
        annotation(&debug, "spur-operator", key),
        "the injection config changed and the operator's pods would keep the old one"
    );
    // The checksum is of the config, not of the values: unrelated values leave it alone.
    assert_eq!(
        annotation(&base, "spur-operator", key),
        annotation(&other, "spur-operator", key)
    );
    // Other value paths that feed the config roll it too.
    let keys = helm_template(&["--set", "routingKeys.queryParam=sbx"])
        .await
        .unwrap();
    assert!(
        config(&keys).contains("queryParam: \"sbx\""),
        "{}",
        config(&keys)
    );
    assert_ne!(
        annotation(&base, "spur-operator", key),
        annotation(&keys, "spur-operator", key)
    );
}

#[tokio::test]
async fn a_new_hub_ca_rolls_the_agent() {
    let agent = |ca: &'static str| async move {
        helm_template(&[
            "--set",
            "agent.enabled=true",
            "--set",
            "agent.hub=hub.example:7443",
            "--set",
            ca,
        ])
        .await
        .unwrap()
    };
    let a = agent("agent.hubCA=first").await;
    let b = agent("agent.hubCA=second").await;
    assert_ne!(
        annotation(&a, "spur-agent", "checksum/hub-ca"),
        annotation(&b, "spur-agent", "checksum/hub-ca")
    );
}

/// Every leaf of `v` as a dotted path (array items by index).
fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                leaves(v, path, out);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                leaves(v, format!("{at}.{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// The pre-upgrade hook (templates/upgrade.yaml, `spur_operator::upgrade`) compares a
/// StatefulSet's claim template by its size and class only: the chart's claim templates hold
/// nothing else that could change (a new field there would fail upgrades on the immutable
/// template again), and the hook's `--statefulset` arguments say what the templates say.
#[tokio::test]
async fn the_upgrade_hook_describes_every_claim_template_the_chart_renders() {
    for class in ["", "-", "fast"] {
        let jobs_class = format!("jobs.persistence.storageClass={class}");
        let hub_class = format!("hub.persistence.storageClass={class}");
        let objects = helm_template(&[
            "--set",
            "hub.enabled=true",
            "--set",
            "hub.previewDomain=preview.example",
            "--set",
            "jobs.persistence.size=7Gi",
            "--set",
            &jobs_class,
            "--set",
            &hub_class,
        ])
        .await
        .unwrap();
        let job = find(&objects, "Job", "spur-prepare-upgrade");
        assert_eq!(
            job["metadata"]["annotations"]["helm.sh/hook"],
            "pre-upgrade,pre-rollback"
        );
        let args: Vec<Value> = job["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a.as_str()?.strip_prefix("--statefulset="))
            .map(|j| serde_json::from_str(j).unwrap())
            .collect();
        for name in ["spur-jobs", "spur-hub"] {
            let sts = find(&objects, "StatefulSet", name);
            let templates = sts["spec"]["volumeClaimTemplates"].as_array().unwrap();
            assert_eq!(templates.len(), 1, "{name}");
            let t = &templates[0];
            let mut paths = Vec::new();
            leaves(t, String::new(), &mut paths);
            paths.sort();
            let mut allowed = vec![
                "metadata.name",
                "spec.accessModes.0",
                "spec.resources.requests.storage",
            ];
            if !class.is_empty() {
                allowed.push("spec.storageClassName");
            }
            allowed.sort();
            assert_eq!(
                paths, allowed,
                "{name}'s claim template (class {class:?}): {t}"
            );
            let arg = args
                .iter()
                .find(|a| a["name"] == name)
                .unwrap_or_else(|| panic!("the hook does not name {name}: {args:?}"));
            assert_eq!(arg["claim"], t["metadata"]["name"], "{arg}");
            assert_eq!(arg["enabled"], true, "{arg}");
            assert_eq!(
                arg["size"], t["spec"]["resources"]["requests"]["storage"],
                "{arg}"
            );
            assert_eq!(
                arg["storageClassName"], t["spec"]["storageClassName"],
                "{arg}"
            );
        }
        assert_eq!(
            find(&objects, "StatefulSet", "spur-jobs")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]
                ["requests"]["storage"],
            "7Gi"
        );
    }
    // Persistence off: the hook is told so (it replaces a StatefulSet that still has a claim
    // template), and the StatefulSet renders none.
    let off = helm_template(&["--set", "jobs.persistence.enabled=false"])
        .await
        .unwrap();
    assert!(find(&off, "StatefulSet", "spur-jobs")["spec"]["volumeClaimTemplates"].is_null());
    let job = find(&off, "Job", "spur-prepare-upgrade");
    let args = job["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains(r#"\"enabled\":false"#), "{args}");
}

/// The CRD hook (templates/crds.yaml, `spur_operator::crds`): by default every install and
/// upgrade (not a rollback) runs `spur-operator apply-crds` before the StatefulSet hook, under a ClusterRole with
/// exactly the rules of files/crds-rules.yaml (kube_crds.rs runs it under them); off, none of it
/// renders.
#[tokio::test]
async fn the_crd_hook_runs_before_every_upgrade_unless_turned_off() {
    let objects = helm_template(&[
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=p.example",
    ])
    .await
    .unwrap();
    let job = find(&objects, "Job", "spur-apply-crds");
    let hook = |o: &Value| o["metadata"]["annotations"]["helm.sh/hook"].clone();
    let weight = |o: &Value| {
        o["metadata"]["annotations"]["helm.sh/hook-weight"]
            .as_str()
            .unwrap()
            .parse::<i32>()
            .unwrap()
    };
    assert_eq!(hook(job), "pre-install,pre-upgrade");
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["command"], serde_json::json!(["spur-operator"]));
    assert_eq!(container["args"], serde_json::json!(["apply-crds"]));
    assert_eq!(
        job["spec"]["template"]["spec"]["serviceAccountName"],
        "spur-apply-crds"
    );
    let prepare = find(&objects, "Job", "spur-prepare-upgrade");
    assert!(weight(job) < weight(prepare), "the CRDs first");
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] {
        let o = find(&objects, kind, "spur-apply-crds");
        assert_eq!(hook(o), "pre-install,pre-upgrade", "{kind}");
        assert!(weight(o) < weight(job), "{kind} exists before the Job");
    }
    assert_eq!(
        find(&objects, "ClusterRole", "spur-apply-crds")["rules"],
        spur_e2e::kube::chart_rules("crds-rules.yaml").unwrap()
    );
    let off = helm_template(&["--set", "crds.upgrade=false"])
        .await
        .unwrap();
    assert!(
        !off.iter()
            .any(|o| o["metadata"]["name"] == "spur-apply-crds"),
        "crds.upgrade=false still renders the hook"
    );
}

/// The jobs component's S3 values become its flags, the credentials Secret its environment
/// (never a flag, so no secret shows in the pod spec's args or a process list), the CA
/// ConfigMap a read-only mount; without a bucket none of it renders; a misspelled key is
/// refused by the schema rather than silently left out.
#[tokio::test]
async fn the_jobs_s3_values_render_as_flags_environment_and_a_ca_mount() {
    let container = |objects: &[Value]| {
        find(objects, "StatefulSet", "spur-jobs")["spec"]["template"]["spec"]["containers"][0]
            .clone()
    };
    let args = |c: &Value| -> Vec<String> {
        c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let base = container(&helm_template(&[]).await.unwrap());
    assert!(
        !args(&base).iter().any(|a| a.starts_with("--s3")),
        "{:?}",
        args(&base)
    );
    assert!(base["envFrom"].is_null(), "{}", base["envFrom"]);

    let objects = helm_template(&[
        "--set",
        "jobs.s3.bucket=spur-logs,jobs.s3.prefix=cluster-a,jobs.s3.endpoint=https://s3.example:9000",
        "--set",
        "jobs.s3.region=eu-west-1,jobs.s3.credentialsSecret=s3-keys,jobs.s3.caConfigMap=s3-ca",
        "--set",
        "jobs.persistence.enabled=false",
    ])
    .await
    .unwrap();
    let c = container(&objects);
    let a = args(&c);
    for want in [
        "--s3-bucket=spur-logs",
        "--s3-prefix=cluster-a",
        "--s3-endpoint=https://s3.example:9000",
        "--s3-region=eu-west-1",
        "--s3-ca-file=/etc/spur-jobs/s3-ca/ca.crt",
    ] {
        assert!(a.iter().any(|x| x == want), "{want} not in {a:?}");
    }
    assert!(!a.iter().any(|x| x == "--s3-allow-http"), "{a:?}");
    assert_eq!(c["envFrom"][0]["secretRef"]["name"], "s3-keys");
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "s3-ca" && m["readOnly"] == true),
        "{}",
        c["volumeMounts"]
    );
    let pod = &find(&objects, "StatefulSet", "spur-jobs")["spec"]["template"]["spec"];
    let volumes = pod["volumes"].as_array().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v["name"] == "s3-ca" && v["configMap"]["name"] == "s3-ca"),
        "{volumes:?}"
    );
    assert!(
        volumes
            .iter()
            .any(|v| v["name"] == "data" && v["emptyDir"].is_object()),
        "{volumes:?}"
    );

    let typo = helm_template(&["--set", "jobs.s3.credentialSecret=s3-keys"]).await;
    let e = typo.unwrap_err().to_string();
    assert!(e.contains("credentialSecret"), "{e}");
    let bad = helm_template(&["--set", "jobs.s3.bucket=Not_A_Bucket"]).await;
    assert!(bad.is_err(), "an invalid bucket name rendered");
}
