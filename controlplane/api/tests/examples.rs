//! The documented examples in `docs/examples/` parse into the types, pass `validate()`, keep
//! every field they set through a serde round trip (nothing silently dropped), and mean what
//! their comments say.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde_json::Value;
use spur_api::sandbox::{EnvOperation, PatchType, TtlOffset};
use spur_api::{RouteGroup, Sandbox, WorkloadKind};

fn example(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/examples")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Parses `yaml` as `T` and checks that serializing it again keeps everything the YAML said.
fn round_trip<T: DeserializeOwned + serde::Serialize + PartialEq + std::fmt::Debug>(
    yaml: &str,
) -> T {
    let source: Value = serde_yaml_ng::from_str(yaml).unwrap();
    let typed: T = serde_yaml_ng::from_str(yaml).unwrap();
    let json = serde_json::to_value(&typed).unwrap();
    assert_contains(&json, &source, "");
    let again: T = serde_json::from_value(json).unwrap();
    assert_eq!(again, typed);
    typed
}

/// Every value in `part` is in `whole` (which may add defaults).
fn assert_contains(whole: &Value, part: &Value, path: &str) {
    match (whole, part) {
        (Value::Object(w), Value::Object(p)) => {
            for (k, v) in p {
                let w = w
                    .get(k)
                    .unwrap_or_else(|| panic!("{path}.{k} was dropped by the types"));
                assert_contains(w, v, &format!("{path}.{k}"));
            }
        }
        (Value::Array(w), Value::Array(p)) => {
            assert_eq!(w.len(), p.len(), "{path}");
            for (i, (w, p)) in w.iter().zip(p).enumerate() {
                assert_contains(w, p, &format!("{path}[{i}]"));
            }
        }
        (w, p) => assert_eq!(w, p, "{path}"),
    }
}

#[test]
fn example_sandbox() {
    let sbx: Sandbox = round_trip(&example("sandbox.yaml"));
    sbx.spec.validate().unwrap();
    assert_eq!(sbx.metadata.name.as_deref(), Some("route-pr-42"));
    let spec = &sbx.spec;
    assert_eq!(spec.forks.len(), 1);
    let fork = &spec.forks[0];
    assert_eq!(fork.fork_of.kind, WorkloadKind::Deployment);
    let env = &fork.customizations.env;
    assert_eq!(env[0].operation, EnvOperation::Upsert, "the default");
    assert_eq!(env[2].operation, EnvOperation::Delete);
    let patch = fork.customizations.patch.as_ref().unwrap();
    assert_eq!(patch.type_, PatchType::Strategic);
    assert!(patch.value.is_object());
    assert!(spec.local.is_empty() && spec.virtual_workloads.is_empty());
    let ttl = spec.ttl.as_ref().unwrap();
    assert_eq!(ttl.offset_from, TtlOffset::UpdatedAt);
    assert_eq!(
        ttl.duration(),
        Some(std::time::Duration::from_secs(2 * 86_400))
    );
}

#[test]
fn example_local_sandbox() {
    let sbx: Sandbox = round_trip(&example("sandbox-local.yaml"));
    sbx.spec.validate().unwrap();
    let spec = &sbx.spec;
    assert_eq!(spec.workstation.as_deref(), Some("alice"));
    assert_eq!(spec.local[0].from.kind, WorkloadKind::Deployment);
    assert_eq!(spec.local[0].mappings[0].to_local, "localhost:8080");
    assert!(spec.forks.is_empty());
}

#[test]
fn example_route_group_matches_the_example_sandbox() {
    let rg: RouteGroup = round_trip(&example("routegroup.yaml"));
    rg.spec.validate().unwrap();
    let sbx: Sandbox = serde_yaml_ng::from_str(&example("sandbox.yaml")).unwrap();
    assert!(rg.spec.selector.matches(&sbx.spec.labels));

    let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert!(
        rg.spec
            .selector
            .matches(&labels(&[("team", "routing"), ("branch", "feature/x")]))
    );
    assert!(
        !rg.spec
            .selector
            .matches(&labels(&[("team", "routing"), ("branch", "main")]))
    );
    assert!(
        !rg.spec
            .selector
            .matches(&labels(&[("team", "search"), ("pr", "7")]))
    );
}

#[test]
fn example_job_and_runner_group() {
    use spur_api::jobs::InjectRoutingKey;
    use spur_api::{Job, JobRunnerGroup};
    let group: JobRunnerGroup = round_trip(&example("jobrunnergroup.yaml"));
    group.validate().unwrap();
    assert_eq!(group.spec.replicas, 2);
    assert!(group.spec.reuse_pods);
    assert_eq!(
        group.spec.job_timeout(),
        std::time::Duration::from_secs(1800)
    );
    let job: Job = round_trip(&example("job.yaml"));
    job.validate().unwrap();
    assert_eq!(job.spec.runner_group, "smoke");
    assert_eq!(
        job.spec
            .routing_context
            .as_ref()
            .unwrap()
            .sandbox
            .as_deref(),
        Some("route-pr-42")
    );
    assert!(job.spec.script.as_deref().unwrap().starts_with("#!/bin/sh"));
    assert_eq!(job.spec.inject_routing_key, InjectRoutingKey::Disabled);
    assert_eq!(
        job.spec.effective_timeout(&group.spec),
        std::time::Duration::from_secs(300)
    );
}

#[test]
fn example_resource_plugin_and_sandbox() {
    use spur_api::resources::{PluginRequest, parse_plugin_request};
    let plugin: spur_api::ResourcePlugin = round_trip(&example("resourceplugin-postgres.yaml"));
    plugin.validate().unwrap();
    assert_eq!(plugin.metadata.name.as_deref(), Some("postgres.1.0.0"));
    let steps: Vec<&str> = plugin.spec.create.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(steps, ["database", "user"]);
    assert_eq!(plugin.spec.delete[0].name, "drop");
    assert_eq!(plugin.spec.parameters().collect::<Vec<_>>(), ["db-prefix"]);

    let sbx: Sandbox = round_trip(&example("sandbox-resource.yaml"));
    sbx.spec.validate().unwrap();
    let r = &sbx.spec.resources[0];
    assert_eq!(
        parse_plugin_request(&r.plugin),
        Ok(PluginRequest::Exact("postgres", (1, 0, 0)))
    );
    let env = &sbx.spec.forks[0].customizations.env[0];
    let from = env.value_from.as_ref().unwrap().resource.as_ref().unwrap();
    assert_eq!(
        (from.name.as_str(), from.output_key.as_str()),
        ("db", "user.dsn")
    );
    // The output key names a step and an output the plugin declares.
    let (step, output) = from.output_key.split_once('.').unwrap();
    assert!(
        plugin
            .spec
            .create
            .iter()
            .any(|s| s.name == step && s.outputs.iter().any(|o| o.name == output))
    );
}
