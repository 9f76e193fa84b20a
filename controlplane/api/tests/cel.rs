//! The CRDs' CEL rules (`x-kubernetes-validations`), evaluated client-side with kube's CEL
//! engine on the documented examples and on broken variants of them. Each broken variant must be
//! rejected by CEL *and* by the Rust `validate()`, so the two stay in step. The OpenAPI patterns
//! are checked against the Rust predicates the same way. (Whether a real kube-apiserver accepts
//! the CRDs, including the CEL cost budget, is for the apiserver-backed tests.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use kube::CustomResourceExt;
use kube::core::cel::Validator;
use kube::core::cel::cel::{Context, Program, Value as CelValue};
use serde_json::{Value, json};
use spur_api::validation::*;
use spur_api::{RouteGroup, Sandbox};

fn example(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/examples")
        .join(name);
    serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A Sandbox that sets every field (tests/fixtures): the rule tests break each part of it.
fn every_field() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sandbox-every-field.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn schema<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

/// CEL failures as `path: message` strings.
fn cel(schema: &Value, obj: &Value, old: Option<&Value>) -> Vec<String> {
    match Validator::new().validate(schema, obj, old) {
        Ok(()) => Vec::new(),
        Err(errs) => errs.iter().map(ToString::to_string).collect(),
    }
}

fn sandbox_rust(obj: &Value) -> Result<(), String> {
    let s: Sandbox = serde_json::from_value(obj.clone()).map_err(|e| e.to_string())?;
    s.validate().map_err(|e| e.to_string())
}

/// `mutate` breaks the example sandbox; CEL and Rust must both reject it, CEL with `cel_says`
/// and Rust with `rust_says` in their messages.
fn sandbox_rejected(what: &str, mutate: impl FnOnce(&mut Value), cel_says: &str, rust_says: &str) {
    let mut obj = every_field();
    mutate(&mut obj);
    let errs = cel(&schema::<Sandbox>(), &obj, None);
    assert!(
        errs.iter().any(|e| e.contains(cel_says)),
        "{what}: CEL should say {cel_says:?}, said {errs:#?}"
    );
    let rust = sandbox_rust(&obj).expect_err(what);
    assert!(
        rust.contains(rust_says),
        "{what}: Rust should say {rust_says:?}, said {rust}"
    );
}

#[test]
fn examples_pass_every_rule() {
    for sandbox in [
        example("sandbox.yaml"),
        example("sandbox-local.yaml"),
        every_field(),
    ] {
        assert_eq!(
            cel(&schema::<Sandbox>(), &sandbox, None),
            Vec::<String>::new()
        );
    }
    assert_eq!(
        cel(&schema::<RouteGroup>(), &example("routegroup.yaml"), None),
        Vec::<String>::new()
    );
}

#[test]
fn sandbox_rules() {
    sandbox_rejected(
        "no workloads",
        |o| {
            let spec = o["spec"].as_object_mut().unwrap();
            spec.remove("forks");
            spec.remove("local");
            spec.remove("virtual");
        },
        "at least one fork, local or virtual",
        "at least one fork, local or virtual",
    );
    sandbox_rejected(
        "same baseline forked twice",
        |o| {
            let fork = o["spec"]["forks"][0].clone();
            o["spec"]["forks"].as_array_mut().unwrap().push(fork);
        },
        "forked only once",
        "only once across forks, local and virtual",
    );
    sandbox_rejected(
        "fork and local on one baseline",
        |o| o["spec"]["local"][0]["from"] = o["spec"]["forks"][0]["forkOf"].clone(),
        "only once across forks, local and virtual",
        "only once across forks, local and virtual",
    );
    sandbox_rejected(
        "a local file with both a value and a source",
        |o| o["spec"]["local"][0]["files"][1]["value"] = json!("x"),
        "exactly one of value and valueFrom",
        "exactly one of value and valueFrom",
    );
    sandbox_rejected(
        "a local file with two sources",
        |o| {
            o["spec"]["local"][0]["files"][1]["valueFrom"]["configMap"] =
                json!({"name": "a", "key": "b"})
        },
        "exactly one of configMap, secret and resource",
        "exactly one of configMap, secret and resource",
    );
    sandbox_rejected(
        "fork and virtual on one baseline",
        |o| o["spec"]["virtual"][0]["workload"] = o["spec"]["forks"][0]["forkOf"].clone(),
        "only once across forks, local and virtual",
        "only once across forks, local and virtual",
    );
    sandbox_rejected(
        "local and virtual on one baseline",
        |o| o["spec"]["virtual"][0]["workload"] = o["spec"]["local"][0]["from"].clone(),
        "only once across forks, local and virtual",
        "only once across forks, local and virtual",
    );
    sandbox_rejected(
        "two local workloads on one baseline",
        |o| {
            let mut other = o["spec"]["local"][0].clone();
            other["name"] = json!("frontend-2");
            o["spec"]["local"].as_array_mut().unwrap().push(other);
        },
        "replaced by only one local workload",
        "only once across forks, local and virtual",
    );
    sandbox_rejected(
        "local without workstation",
        |o| {
            o["spec"].as_object_mut().unwrap().remove("workstation");
        },
        "local workloads need spec.workstation",
        "local workloads need spec.workstation",
    );
    sandbox_rejected(
        "upsert with value and valueFrom",
        |o| {
            o["spec"]["forks"][0]["customizations"]["env"][0]["valueFrom"] =
                json!({"configMap": {"name": "cm", "key": "k"}})
        },
        "exactly one of value and valueFrom",
        "exactly one of value and valueFrom",
    );
    sandbox_rejected(
        "upsert without value",
        |o| {
            o["spec"]["forks"][0]["customizations"]["env"][0]
                .as_object_mut()
                .unwrap()
                .remove("value");
        },
        "exactly one of value and valueFrom",
        "exactly one of value and valueFrom",
    );
    sandbox_rejected(
        "delete with a value",
        |o| o["spec"]["forks"][0]["customizations"]["env"][2]["value"] = json!("x"),
        "neither value nor valueFrom",
        "neither value nor valueFrom",
    );
    sandbox_rejected(
        "two value sources",
        |o| {
            o["spec"]["forks"][0]["customizations"]["env"][1]["valueFrom"]["secret"] =
                json!({"name": "s", "key": "k"})
        },
        "exactly one of configMap, secret, resource and fork",
        "exactly one of configMap, secret, resource and fork",
    );
    sandbox_rejected(
        "two images for the first container",
        |o| {
            let img = o["spec"]["forks"][0]["customizations"]["images"][0].clone();
            o["spec"]["forks"][0]["customizations"]["images"]
                .as_array_mut()
                .unwrap()
                .push(img);
        },
        "at most one image per container",
        "at most one image per container",
    );
    sandbox_rejected(
        "one variable set twice",
        |o| {
            let env = o["spec"]["forks"][0]["customizations"]["env"][0].clone();
            o["spec"]["forks"][0]["customizations"]["env"]
                .as_array_mut()
                .unwrap()
                .push(env);
        },
        "at most one env entry per (name, container)",
        "is set twice for the same container",
    );
    sandbox_rejected(
        "bad label key",
        |o| o["spec"]["labels"]["Not A Key"] = json!("x"),
        "label keys must be Kubernetes label keys",
        "keys must be Kubernetes label keys",
    );
    sandbox_rejected(
        "label name part longer than 63",
        |o| o["spec"]["labels"][format!("spur.dev/{}", "a".repeat(64))] = json!("x"),
        "label keys must be Kubernetes label keys",
        "keys must be Kubernetes label keys",
    );
}

#[test]
fn sandbox_name_must_be_a_dns_label() {
    sandbox_rejected(
        "dotted name",
        |o| o["metadata"]["name"] = json!("route.pr-42"),
        "must be a DNS-1123 label",
        "metadata.name: must be a DNS-1123 label",
    );
}

#[test]
fn sandbox_resources_are_immutable() {
    let s = schema::<Sandbox>();
    let old = every_field();
    let mut new = old.clone();
    new["spec"]["ttl"]["duration"] = json!("3d");
    assert_eq!(
        cel(&s, &new, Some(&old)),
        Vec::<String>::new(),
        "other fields may change"
    );

    new["spec"]["resources"][0]["plugin"] = json!("mariadb@1.3.0");
    let errs = cel(&s, &new, Some(&old));
    assert!(
        errs.iter().any(|e| e.contains("resources are immutable")),
        "{errs:#?}"
    );

    let mut without = old.clone();
    without["spec"].as_object_mut().unwrap().remove("resources");
    let errs = cel(&s, &old, Some(&without));
    assert!(
        errs.iter().any(|e| e.contains("resources are immutable")),
        "added later: {errs:#?}"
    );

    let old: Sandbox = serde_json::from_value(old).unwrap();
    let new: Sandbox = serde_json::from_value(new).unwrap();
    assert!(new.spec.validate_update(&old.spec).is_err());
    assert!(old.spec.validate_update(&old.spec).is_ok());
}

#[test]
fn route_group_match_rules() {
    let s = schema::<RouteGroup>();
    let mut both = example("routegroup.yaml");
    both["spec"]["match"]["label"] = json!({"key": "team", "value": "x"});
    let errs = cel(&s, &both, None);
    assert!(
        errs.iter()
            .any(|e| e.contains("exactly one of label, any and all")),
        "{errs:#?}"
    );
    // The Rust type cannot even hold it.
    assert!(serde_json::from_value::<RouteGroup>(both).is_err());

    let mut nested_both = example("routegroup.yaml");
    nested_both["spec"]["match"]["all"][1]["label"] = json!({"key": "a", "value": "b"});
    let errs = cel(&s, &nested_both, None);
    assert!(
        errs.iter()
            .any(|e| e.contains("exactly one of label, any and all")),
        "{errs:#?}"
    );

    let mut none = example("routegroup.yaml");
    none["spec"]["match"] = json!({});
    let errs = cel(&s, &none, None);
    assert!(
        errs.iter()
            .any(|e| e.contains("exactly one of label, any and all")),
        "{errs:#?}"
    );
}

/// Each OpenAPI pattern agrees with the Rust predicate of the same name on every sample (within
/// the pattern's length bound, which the schema enforces separately).
#[test]
fn patterns_agree_with_predicates() {
    type Pred = fn(&str) -> bool;
    let samples: &[&str] = &[
        "",
        "a",
        "A",
        "0",
        "a-b",
        "-a",
        "a-",
        "a.b",
        "a..b",
        ".a",
        "a_b",
        "a b",
        "Ab9",
        "ab/cd",
        "spur.dev/sandbox",
        "a.b/C_d",
        "/a",
        "a/",
        "x@1.2.0",
        "x@",
        "pg@-1",
        "90m",
        "2d",
        "0m",
        "1y",
        "12345678901m",
        "localhost:8080",
        "[::1]:80",
        "127.0.0.1:1",
        "localhost",
        "http://route.hotrod.svc:8083",
        "grpc://api.ns.svc",
        "ftp://a:1",
        "http://a/b",
        "ghcr.io/acme/x:pr-42",
        "img with space",
        "PATH",
        "1A",
        "_x",
        "k.e_y-1",
        "ünï",
    ];
    let cases: &[(&str, &str, Pred)] = &[
        ("DNS_LABEL", DNS_LABEL_PATTERN, is_dns_label),
        ("DNS_SUBDOMAIN", DNS_SUBDOMAIN_PATTERN, is_dns_subdomain),
        ("ROUTING_KEY", ROUTING_KEY_PATTERN, is_routing_key),
        ("ENV_NAME", ENV_NAME_PATTERN, is_env_name),
        ("LABEL_KEY", LABEL_KEY_PATTERN, is_label_key),
        ("IMAGE", IMAGE_PATTERN, is_image),
        ("PLUGIN", PLUGIN_PATTERN, is_plugin),
        ("TTL", TTL_PATTERN, |s| {
            spur_api::sandbox::parse_ttl(s).is_some()
        }),
    ];
    let loose: &[(&str, &str, Pred)] = &[
        // The patterns only shape these; the predicates also range-check ports and IPv6 literals.
        ("HOST_PORT", HOST_PORT_PATTERN, is_host_port),
        (
            "ENDPOINT_TARGET",
            ENDPOINT_TARGET_PATTERN,
            is_endpoint_target,
        ),
    ];
    for (name, pattern, pred) in cases {
        for s in samples {
            assert_eq!(cel_matches(pattern, s), pred(s), "{name} on {s:?}");
        }
    }
    for (name, pattern, pred) in loose {
        for s in samples {
            if pred(s) {
                assert!(cel_matches(pattern, s), "{name} on {s:?}");
            }
        }
    }
    // Where the predicates are stricter than the patterns.
    assert!(cel_matches(HOST_PORT_PATTERN, "localhost:99999") && !is_host_port("localhost:99999"));
    assert!(
        cel_matches(TTL_PATTERN, "9999999999m")
            && spur_api::sandbox::parse_ttl("9999999999m").is_none()
    );
}

fn cel_matches(pattern: &str, s: &str) -> bool {
    let mut ctx = Context::default();
    ctx.add_variable_from_value("s", s);
    ctx.add_variable_from_value("p", pattern);
    match Program::compile("s.matches(p)")
        .unwrap()
        .execute(&ctx)
        .unwrap()
    {
        CelValue::Bool(b) => b,
        other => panic!("{other:?}"),
    }
}

fn job_example() -> Value {
    example("job.yaml")
}

/// `mutate` breaks the example job; CEL and Rust must both reject it.
fn job_rejected(what: &str, mutate: impl FnOnce(&mut Value), cel_says: &str, rust_says: &str) {
    let mut obj = job_example();
    mutate(&mut obj);
    let errs = cel(&schema::<spur_api::Job>(), &obj, None);
    assert!(
        errs.iter().any(|e| e.contains(cel_says)),
        "{what}: CEL should say {cel_says:?}, said {errs:#?}"
    );
    let job: spur_api::Job = serde_json::from_value(obj).unwrap();
    let rust = job.validate().expect_err(what).to_string();
    assert!(
        rust.contains(rust_says),
        "{what}: Rust should say {rust_says:?}, said {rust}"
    );
}

#[test]
fn job_rules() {
    assert_eq!(
        cel(&schema::<spur_api::Job>(), &job_example(), None),
        Vec::<String>::new()
    );
    assert_eq!(
        cel(
            &schema::<spur_api::JobRunnerGroup>(),
            &example("jobrunnergroup.yaml"),
            None
        ),
        Vec::<String>::new()
    );
    job_rejected(
        "script and command",
        |o| o["spec"]["command"] = json!(["echo"]),
        "exactly one of script and command",
        "exactly one of script and command",
    );
    job_rejected(
        "neither script nor command",
        |o| {
            o["spec"].as_object_mut().unwrap().remove("script");
        },
        "exactly one of script and command",
        "exactly one of script and command",
    );
    job_rejected(
        "reserved env",
        |o| o["spec"]["env"][0]["name"] = json!("SPUR_ROUTING_KEY"),
        "set by the operator",
        "set by the operator",
    );
    job_rejected(
        "both sandbox and route group",
        |o| o["spec"]["routingContext"]["routeGroup"] = json!("g"),
        "exactly one of sandbox and routeGroup",
        "exactly one of sandbox and routeGroup",
    );
    job_rejected(
        "relative artifact",
        |o| o["spec"]["artifacts"][0]["path"] = json!("/tmp/../etc/shadow"),
        "absolute, without '..'",
        "absolute, without '..'",
    );
    job_rejected(
        "relative result path",
        |o| o["spec"]["resultPath"] = json!("out/result.json"),
        "a result path must be absolute, without '..'",
        "a result path must be absolute, without '..'",
    );
    job_rejected(
        "result path with ..",
        |o| o["spec"]["resultPath"] = json!("/tmp/../etc/shadow"),
        "a result path must be absolute, without '..'",
        "a result path must be absolute, without '..'",
    );
    job_rejected(
        "zero timeout",
        |o| o["spec"]["timeout"] = json!("0s"),
        "above 0s",
        "above 0s",
    );
    job_rejected(
        "timeout beyond a week",
        |o| o["spec"]["timeout"] = json!("200h"),
        "above 0s",
        "above 0s",
    );
}

#[test]
fn a_job_is_immutable_except_cancel() {
    let schema = schema::<spur_api::Job>();
    let old = job_example();
    let mut canceled = old.clone();
    canceled["spec"]["canceled"] = json!(true);
    assert_eq!(cel(&schema, &canceled, Some(&old)), Vec::<String>::new());
    let errs = cel(&schema, &old, Some(&canceled));
    assert!(errs.iter().any(|e| e.contains("un-canceled")), "{errs:?}");
    for (what, mutate) in [
        (
            "script",
            Box::new(|o: &mut Value| o["spec"]["script"] = json!("#!/bin/sh\ntrue"))
                as Box<dyn Fn(&mut Value)>,
        ),
        (
            "timeout removed",
            Box::new(|o: &mut Value| {
                o["spec"].as_object_mut().unwrap().remove("timeout");
            }),
        ),
        (
            "runner group",
            Box::new(|o: &mut Value| o["spec"]["runnerGroup"] = json!("other")),
        ),
        (
            "inject",
            Box::new(|o: &mut Value| o["spec"]["injectRoutingKey"] = json!("Auto")),
        ),
        (
            "result path",
            Box::new(|o: &mut Value| o["spec"]["resultPath"] = json!("/tmp/other.txt")),
        ),
        (
            "result path removed",
            Box::new(|o: &mut Value| {
                o["spec"].as_object_mut().unwrap().remove("resultPath");
            }),
        ),
    ] {
        let mut new = old.clone();
        mutate(&mut new);
        let errs = cel(&schema, &new, Some(&old));
        assert!(
            errs.iter().any(|e| e.contains("immutable")),
            "{what}: {errs:?}"
        );
    }
}

fn plugin_rejected(what: &str, mutate: impl FnOnce(&mut Value), cel_says: &str, rust_says: &str) {
    let mut obj = example("resourceplugin-postgres.yaml");
    mutate(&mut obj);
    let errs = cel(&schema::<spur_api::ResourcePlugin>(), &obj, None);
    assert!(
        errs.iter().any(|e| e.contains(cel_says)),
        "{what}: CEL should say {cel_says:?}, said {errs:#?}"
    );
    let plugin: spur_api::ResourcePlugin = serde_json::from_value(obj).unwrap();
    let rust = plugin.validate().expect_err(what).to_string();
    assert!(
        rust.contains(rust_says),
        "{what}: Rust should say {rust_says:?}, said {rust}"
    );
}

#[test]
fn resource_plugin_rules() {
    let plugin = example("resourceplugin-postgres.yaml");
    assert_eq!(
        cel(
            &schema::<Sandbox>(),
            &example("sandbox-resource.yaml"),
            None
        ),
        Vec::<String>::new()
    );
    let schema = schema::<spur_api::ResourcePlugin>();
    assert_eq!(cel(&schema, &plugin, None), Vec::<String>::new());
    plugin_rejected(
        "input from both the sandbox and a step",
        |o| o["spec"]["create"][1]["inputs"][0]["valueFromSandbox"] = json!(true),
        "exactly one of valueFromSandbox",
        "exactly one of valueFromSandbox",
    );
    plugin_rejected(
        "input from neither",
        |o| {
            o["spec"]["create"][0]["inputs"][0]
                .as_object_mut()
                .unwrap()
                .remove("valueFromSandbox");
        },
        "exactly one of valueFromSandbox",
        "exactly one of valueFromSandbox",
    );
    plugin_rejected(
        "env and path",
        |o| o["spec"]["create"][0]["inputs"][0]["as"] = json!({"env": "X", "path": "/tmp/x"}),
        "exactly one of env and path",
        "exactly one of env and path",
    );
    plugin_rejected(
        "a version with a leading zero",
        |o| o["metadata"]["name"] = json!("postgres.01.0.0"),
        "<plugin>.<major>.<minor>.<patch>",
        "<plugin>.<major>.<minor>.<patch>",
    );
    // Immutable: any change to a published version is refused.
    let mut changed = plugin.clone();
    changed["spec"]["create"][0]["script"] = json!("#!/bin/sh\ntrue\n");
    let errs = cel(&schema, &changed, Some(&plugin));
    assert!(errs.iter().any(|e| e.contains("immutable")), "{errs:?}");
    assert_eq!(cel(&schema, &plugin, Some(&plugin)), Vec::<String>::new());
}
