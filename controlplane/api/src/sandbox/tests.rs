use serde_json::json;

use super::*;
use crate::common::WorkloadKind;
use crate::workloads::ForkedWorkloadSpec;

fn deployment(name: &str) -> WorkloadRef {
    WorkloadRef::new(WorkloadKind::Deployment, "hotrod", name)
}

fn fork(name: &str) -> Fork {
    Fork {
        fork_of: deployment(name),
        customizations: Customizations::default(),
    }
}

fn spec(forks: Vec<Fork>) -> SandboxSpec {
    SandboxSpec {
        description: None,
        labels: BTreeMap::new(),
        forks,
        local: vec![],
        virtual_workloads: vec![],
        resources: vec![],
        default_route_group: None,
        ttl: None,
        workstation: None,
        capture: None,
    }
}

fn env(name: &str) -> EnvOverride {
    EnvOverride {
        name: name.into(),
        value: Some("v".into()),
        value_from: None,
        container: None,
        operation: EnvOperation::Upsert,
    }
}

fn errors(s: &SandboxSpec) -> Vec<String> {
    match s.validate() {
        Ok(()) => vec![],
        Err(e) => e.field_errors().iter().map(ToString::to_string).collect(),
    }
}

fn assert_error(s: &SandboxSpec, needle: &str) {
    let errs = errors(s);
    assert!(
        errs.iter().any(|e| e.contains(needle)),
        "want {needle:?} in {errs:#?}"
    );
}

#[test]
fn minimal_sandbox_is_valid() {
    assert_eq!(errors(&spec(vec![fork("route")])), Vec::<String>::new());
}

#[test]
fn env_references_must_resolve_within_the_sandbox() {
    let mut s = spec(vec![fork("route"), fork("driver")]);
    let mut from_resource = env("DB_HOST");
    from_resource.value = None;
    from_resource.value_from = Some(EnvValueFrom {
        config_map: None,
        secret: None,
        resource: Some(ResourceOutputRef {
            name: "db".into(),
            output_key: "provision.host".into(),
        }),
        fork: None,
    });
    let mut from_fork = env("DRIVER_ADDR");
    from_fork.value = None;
    from_fork.value_from = Some(EnvValueFrom {
        config_map: None,
        secret: None,
        resource: None,
        fork: Some(ForkValueRef {
            fork_of: deployment("driver"),
            expression: "{{.Service.Host}}:{{.Service.Port}}".into(),
        }),
    });
    s.forks[0].customizations.env = vec![from_resource.clone(), from_fork.clone()];
    assert_error(
        &s,
        "spec.forks[0].customizations.env[0].valueFrom.resource.name: must name one of spec.resources",
    );

    s.resources.push(SandboxResource {
        name: "db".into(),
        plugin: "mariadb".into(),
        params: BTreeMap::new(),
    });
    assert_eq!(errors(&s), Vec::<String>::new());

    s.forks.pop();
    assert_error(
        &s,
        "valueFrom.fork.forkOf: must be the forkOf of one of spec.forks",
    );

    // A ForkedWorkload carries the same customizations without the sandbox around it: the
    // references are resolved by the Sandbox controller, not re-checked there.
    let fw = ForkedWorkloadSpec {
        sandbox: "sb1".into(),
        routing_key: "ltj9s8scupb86".into(),
        baseline: deployment("route"),
        customizations: s.forks[0].customizations.clone(),
    };
    fw.validate().unwrap();
}

#[test]
fn patch_shape_follows_its_type() {
    let mut s = spec(vec![fork("route")]);
    let patch = |type_, value| Some(Patch { type_, value });
    for (t, v, ok) in [
        (PatchType::Strategic, json!({"spec": {}}), true),
        (
            PatchType::Merge,
            json!({"metadata": {"labels": {"a": "b"}}}),
            true,
        ),
        (
            PatchType::Json,
            json!([{"op": "add", "path": "/a", "value": 1}]),
            true,
        ),
        (PatchType::Strategic, json!([]), false),
        (PatchType::Merge, json!("x"), false),
        (PatchType::Json, json!({"op": "add"}), false),
        (
            PatchType::Json,
            json!([{"op": "frobnicate", "path": "/a"}]),
            false,
        ),
        (PatchType::Json, json!([{"op": "remove"}]), false),
    ] {
        s.forks[0].customizations.patch = patch(t, v.clone());
        assert_eq!(errors(&s).is_empty(), ok, "{t:?} {v}");
    }
    s.forks[0].customizations.patch = patch(
        PatchType::Merge,
        json!({ "data": "x".repeat(MAX_PATCH_BYTES) }),
    );
    assert_error(&s, "must be at most 65536 bytes");
}

#[test]
fn env_operations() {
    let mut s = spec(vec![fork("route")]);
    let mut delete = env("DEBUG");
    delete.operation = EnvOperation::Delete;
    s.forks[0].customizations.env = vec![delete.clone()];
    assert_error(&s, "operation delete takes neither value nor valueFrom");
    delete.value = None;
    s.forks[0].customizations.env = vec![delete];
    assert_eq!(errors(&s), Vec::<String>::new());

    let mut bad = env("1BAD");
    bad.container = Some("Main".into());
    s.forks[0].customizations.env = vec![bad];
    assert_error(&s, "env[0].name: must be an environment variable name");
    assert_error(&s, "env[0].container: must be a container name");

    let mut other_container = env("X");
    other_container.container = Some("sidecar".into());
    s.forks[0].customizations.env = vec![env("X"), other_container];
    assert_eq!(
        errors(&s),
        Vec::<String>::new(),
        "same name, different containers"
    );
}

#[test]
fn local_workloads() {
    let mut s = spec(vec![]);
    s.local.push(Local {
        name: "frontend".into(),
        from: deployment("frontend"),
        mappings: vec![
            LocalMapping {
                port: 8080,
                to_local: "localhost:8080".into(),
            },
            LocalMapping {
                port: 8080,
                to_local: "localhost:99999".into(),
            },
        ],
        container: None,
        env: vec![],
        files: vec![],
    });
    let errs = errors(&s);
    for needle in [
        "spec.workstation: local workloads need spec.workstation",
        "mappings[1].port: port 8080 is mapped twice",
        "mappings[1].toLocal: must be host:port",
    ] {
        assert!(
            errs.iter().any(|e| e.contains(needle)),
            "{needle} in {errs:#?}"
        );
    }
    s.workstation = Some("ws-1".into());
    s.local[0].mappings.truncate(1);
    assert_eq!(errors(&s), Vec::<String>::new());
    s.local[0].mappings.clear();
    assert_error(&s, "spec.local[0].mappings: must not be empty");
}

/// A local workload's env and files: a fork's env rules, without `container` or `fork`; files
/// with safe, distinct paths and one source each.
#[test]
fn local_env_and_files() {
    let mut s = spec(vec![]);
    s.workstation = Some("ws-1".into());
    let env: Vec<EnvOverride> = serde_json::from_value(serde_json::json!([
        {"name": "A", "value": "1"},
        {"name": "B", "valueFrom": {"secret": {"name": "db", "key": "password"}}},
        {"name": "C", "operation": "delete"},
    ]))
    .unwrap();
    let files: Vec<FileOverride> = serde_json::from_value(serde_json::json!([
        {"path": "/etc/app/config.yaml", "value": "a: 1"},
        {"path": "certs/ca.crt", "valueFrom": {"configMap": {"name": "ca", "key": "ca.crt"}}},
    ]))
    .unwrap();
    s.local.push(Local {
        name: "frontend".into(),
        from: deployment("frontend"),
        mappings: vec![LocalMapping {
            port: 8080,
            to_local: "localhost:8080".into(),
        }],
        container: Some("app".into()),
        env,
        files,
    });
    assert_eq!(errors(&s), Vec::<String>::new());

    let mut bad = s.clone();
    let l = &mut bad.local[0];
    l.env[0].container = Some("app".into());
    l.env[1].value_from = serde_json::from_value(serde_json::json!(
        {"fork": {"forkOf": {"kind": "Deployment", "namespace": "default", "name": "x"}, "expression": "e"}}
    ))
    .unwrap();
    l.env.push(l.env[0].clone());
    for (i, p) in ["../../.ssh/authorized_keys", "/a//b", "/", "a/./b"]
        .into_iter()
        .enumerate()
    {
        l.files.push(FileOverride {
            path: p.into(),
            value: Some(format!("{i}")),
            value_from: None,
        });
    }
    l.files.push(FileOverride {
        path: "etc/app/config.yaml".into(),
        value: None,
        value_from: None,
    });
    let errs = errors(&bad);
    for needle in [
        "spec.local[0].env[0].container: a local workload has one process",
        "spec.local[0].env[1].valueFrom.fork: not supported for local workloads",
        "spec.local[0].env[3].name: \"A\" is set twice",
        "spec.local[0].files[2].path: must be a file path",
        "spec.local[0].files[3].path: must be a file path",
        "spec.local[0].files[4].path: must be a file path",
        "spec.local[0].files[5].path: must be a file path",
        "spec.local[0].files[6].path: \"etc/app/config.yaml\" is set twice",
        "spec.local[0].files[6]: exactly one of value and valueFrom",
    ] {
        assert!(
            errs.iter().any(|e| e.contains(needle)),
            "{needle} in {errs:#?}"
        );
    }
}

#[test]
fn all_problems_are_reported_at_once() {
    let mut s = spec(vec![fork("route"), fork("route")]);
    s.forks[1].fork_of.namespace = "Bad_NS".into();
    s.forks[0].customizations.images.push(ImageOverride {
        image: "a b".into(),
        container: None,
    });
    s.ttl = Some(Ttl {
        duration: "0m".into(),
        offset_from: TtlOffset::CreatedAt,
    });
    s.default_route_group = Some(DefaultRouteGroup {
        endpoints: vec![Endpoint {
            name: "web".into(),
            target: "ftp://x:1".into(),
            cluster: Some("Not_A_Label".into()),
            public: false,
        }],
    });
    let err = s.validate().unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("invalid Sandbox: "), "{text}");
    for needle in [
        "spec.forks[1].forkOf.namespace: must be a DNS-1123 label",
        "spec.forks[0].customizations.images[0].image",
        "spec.ttl.duration",
        "spec.defaultRouteGroup.endpoints[0].target",
        "spec.defaultRouteGroup.endpoints[0].cluster",
    ] {
        assert!(text.contains(needle), "{needle} in {text}");
    }
    assert_eq!(err.field_errors().len(), 5, "{text}");

    // Same baseline twice, now spelled identically.
    s.forks[1].fork_of.namespace = "hotrod".into();
    assert_error(
        &s,
        "spec.forks[1].forkOf: baseline Deployment/hotrod/route is already used by spec.forks[0].forkOf",
    );
}

#[test]
fn ttl() {
    assert_eq!(parse_ttl("90m"), Some(Duration::from_secs(5400)));
    assert_eq!(parse_ttl("1w"), Some(Duration::from_secs(604_800)));
    assert_eq!(
        parse_ttl("4294967295w"),
        Some(Duration::from_secs(4_294_967_295 * 604_800))
    );
    for bad in [
        "",
        "m",
        "0m",
        "01h",
        "4294967296m",
        "1y",
        "1.5h",
        "-1h",
        " 1h",
    ] {
        assert_eq!(parse_ttl(bad), None, "{bad}");
    }
    let at = |s| Timestamp::from_second(s).unwrap();
    let mut t = Ttl {
        duration: "1h".into(),
        offset_from: TtlOffset::CreatedAt,
    };
    assert_eq!(t.expires_at(at(1000), at(5000)), Some(at(4600)));
    t.offset_from = TtlOffset::UpdatedAt;
    assert_eq!(t.expires_at(at(1000), at(5000)), Some(at(8600)));
    t.duration = "4294967295w".into();
    assert_eq!(t.expires_at(at(0), at(0)), None, "beyond year 9999");
}

#[test]
fn wire_names() {
    let mut s = spec(vec![]);
    s.virtual_workloads.push(Virtual {
        name: "driver".into(),
        workload: WorkloadRef::new(WorkloadKind::Rollout, "hotrod", "driver"),
    });
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(
        v,
        json!({"virtual": [{"name": "driver", "workload": {"kind": "Rollout", "namespace": "hotrod", "name": "driver"}}]})
    );
    let mut e = env("A");
    e.value = None;
    e.operation = EnvOperation::Delete;
    assert_eq!(
        serde_json::to_value(&e).unwrap(),
        json!({"name": "A", "operation": "delete"})
    );
}
