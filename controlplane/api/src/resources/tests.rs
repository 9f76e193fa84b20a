use std::collections::BTreeMap;

use super::*;

fn step(name: &str, inputs: Vec<StepInput>, outputs: &[&str]) -> PluginStep {
    PluginStep {
        name: name.into(),
        script: "#!/bin/sh\ntrue\n".into(),
        inputs,
        outputs: outputs
            .iter()
            .map(|o| StepOutput {
                name: (*o).into(),
                description: None,
                value_from_path: format!("/tmp/{o}"),
            })
            .collect(),
    }
}

fn from_step(name: &str, step: &str, output: &str) -> StepInput {
    StepInput {
        name: name.into(),
        value_from_sandbox: false,
        value_from_step: Some(StepOutputRef {
            name: step.into(),
            output: output.into(),
        }),
        as_: None,
        pattern: None,
    }
}

fn from_sandbox(name: &str) -> StepInput {
    StepInput {
        name: name.into(),
        value_from_sandbox: true,
        value_from_step: None,
        as_: None,
        pattern: None,
    }
}

fn plugin(create: Vec<PluginStep>, delete: Vec<PluginStep>) -> ResourcePluginSpec {
    ResourcePluginSpec {
        description: None,
        runner: Runner {
            image: "localhost/spur-postgres:dev".into(),
            pod_template_overlay: None,
        },
        create,
        delete,
    }
}

#[test]
fn plugin_names_and_versions() {
    assert_eq!(
        parse_plugin_object_name("postgres"),
        Some(("postgres", (0, 0, 0)))
    );
    assert_eq!(
        parse_plugin_object_name("postgres.1.10.0"),
        Some(("postgres", (1, 10, 0)))
    );
    for bad in [
        "Pg",
        "pg.1",
        "pg.1.0",
        "pg.01.0.0",
        "pg.1.0.0.0",
        "pg.a.b.c",
        "pg.",
    ] {
        assert_eq!(parse_plugin_object_name(bad), None, "{bad}");
    }
    let names = [
        "postgres",
        "postgres.1.2.0",
        "postgres.1.10.0",
        "mariadb.2.0.0",
    ];
    let pick = |s: &str| resolve_plugin(&parse_plugin_request(s).unwrap(), names);
    assert_eq!(pick("postgres"), Some("postgres.1.10.0"));
    assert_eq!(pick("postgres@latest"), Some("postgres.1.10.0"));
    assert_eq!(pick("postgres@1.2.0"), Some("postgres.1.2.0"));
    assert_eq!(pick("postgres@0.0.0"), Some("postgres"));
    assert_eq!(pick("postgres@3.0.0"), None);
    assert_eq!(pick("redis"), None);
    assert!(parse_plugin_request("postgres@1.2").is_err());
    assert!(parse_plugin_request("postgres@1.2.0-rc1").is_err());
}

#[test]
fn plugin_references_must_point_backwards() {
    let ok = plugin(
        vec![
            step("server", vec![from_sandbox("dbname")], &["host"]),
            step(
                "provision",
                vec![from_step("host", "server", "host")],
                &["dsn"],
            ),
        ],
        vec![step(
            "drop",
            vec![from_step("dsn", "provision", "dsn")],
            &[],
        )],
    );
    ok.validate().unwrap();
    assert_eq!(ok.parameters().collect::<Vec<_>>(), ["dbname"]);

    let forward = plugin(
        vec![
            step("a", vec![from_step("x", "b", "x")], &[]),
            step("b", vec![], &["x"]),
        ],
        vec![],
    );
    let e = forward.validate().unwrap_err().to_string();
    assert!(
        e.contains("spec.create[0].inputs[0].valueFromStep.name"),
        "{e}"
    );

    let undeclared = plugin(
        vec![
            step("a", vec![], &["x"]),
            step("b", vec![from_step("y", "a", "y")], &[]),
        ],
        vec![],
    );
    let e = undeclared.validate().unwrap_err().to_string();
    assert!(e.contains("declares no output"), "{e}");

    let dup = plugin(vec![step("a", vec![], &[])], vec![step("a", vec![], &[])]);
    assert!(
        dup.validate()
            .unwrap_err()
            .to_string()
            .contains("duplicate step")
    );

    let mut both = from_sandbox("x");
    both.value_from_step = Some(StepOutputRef {
        name: "a".into(),
        output: "x".into(),
    });
    let e = plugin(
        vec![step("a", vec![], &["x"]), step("b", vec![both], &[])],
        vec![],
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("exactly one"), "{e}");

    let mut reserved_env = from_sandbox("x");
    reserved_env.as_ = Some(InjectAs {
        env: Some("SPUR_X".into()),
        path: None,
    });
    let mut bad_path = from_sandbox("y");
    bad_path.as_ = Some(InjectAs {
        env: None,
        path: Some("/spur-io/x".into()),
    });
    let e = plugin(vec![step("a", vec![reserved_env, bad_path], &[])], vec![])
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("SPUR_"), "{e}");
    assert!(e.contains("as.path"), "{e}");
}

#[test]
fn io_paths() {
    for ok in ["/tmp/dsn", "/out/a-b.txt"] {
        assert!(is_io_path(ok), "{ok}");
    }
    for bad in [
        "",
        "/",
        "tmp/x",
        "/a/../b",
        "/a/./b",
        "/a//b",
        "/a/",
        "/spur-io",
        "/spur-io/in",
    ] {
        assert!(!is_io_path(bad), "{bad}");
    }
}

/// A parameter that reaches a script is held to its input's pattern, as a whole: the
/// documented PostgreSQL plugin's prefix cannot smuggle a quote into its SQL.
#[test]
fn parameters_must_match_their_inputs_pattern() {
    let mut prefix = from_sandbox("db-prefix");
    prefix.pattern = Some("[a-z][a-z0-9_]{0,30}".into());
    let p = plugin(vec![step("database", vec![prefix], &["dbname"])], vec![]);
    p.validate().unwrap();
    let with = |v: &str| BTreeMap::from([("db-prefix".to_string(), v.to_string())]);
    compile(&p, &with("orders_v2"), "ctx", &[]).unwrap();
    for hostile in [
        "x\"; DROP DATABASE postgres; --",
        "orders\nDROP",
        "orders' OR '1'='1",
        "Orders",
        "",
        "a-b",
    ] {
        let err = compile(&p, &with(hostile), "ctx", &[]).unwrap_err();
        assert!(
            err.contains("must match the plugin's pattern") && !err.contains("DROP"),
            "{hostile:?}: {err}"
        );
    }
    // A pattern is checked when the plugin is: it must compile and belong to a parameter.
    let mut bad = from_sandbox("db-prefix");
    bad.pattern = Some("[a-z".into());
    let e = plugin(vec![step("database", vec![bad], &[])], vec![])
        .validate()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pattern") && e.contains("regular expression"),
        "{e}"
    );
    let mut on_step = from_step("dbname", "database", "dbname");
    on_step.pattern = Some("[a-z]+".into());
    let e = plugin(
        vec![
            step("database", vec![from_sandbox("p")], &["dbname"]),
            step("user", vec![on_step], &[]),
        ],
        vec![],
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("only a valueFromSandbox input has a pattern"),
        "{e}"
    );
}

#[test]
fn compiling_fills_parameters_and_context_keys() {
    let p = plugin(
        vec![
            step("server", vec![from_sandbox("db-name")], &["host"]),
            step(
                "provision",
                vec![from_step("host", "server", "host")],
                &["dsn"],
            ),
        ],
        vec![step(
            "drop",
            vec![from_step("dsn", "provision", "dsn")],
            &[],
        )],
    );
    let params = BTreeMap::from([("db-name".to_string(), "orders".to_string())]);
    let olm = compile(&p, &params, "ctx1", &[(env::SANDBOX_NAME, "sb")]).unwrap();
    assert_eq!(olm.pre_start.len(), 2);
    assert_eq!(olm.pre_start[0].inputs[0].value.as_deref(), Some("orders"));
    assert_eq!(
        olm.pre_start[0].exec_unit_template.input_injects[0]
            .dst
            .env
            .as_deref(),
        Some("DB_NAME")
    );
    let step = &olm.pre_start[0].exec_unit_template.pod_template["spec"]["containers"][0];
    assert_eq!(step["name"], "step");
    assert_eq!(step["image"], "localhost/spur-postgres:dev");
    assert_eq!(step["env"][0]["name"], env::SANDBOX_NAME);
    assert_eq!(step["env"][1]["name"], env::STEP_NAME);
    let r = olm.post_stop[0].inputs[0].iocontext.as_ref().unwrap();
    assert_eq!((r.name.as_str(), r.key.as_str()), ("ctx1", "provision.dsn"));
    let spec = OlmSpec {
        io_context_name: "ctx1".into(),
        pre_start: olm.pre_start.clone(),
        post_stop: olm.post_stop.clone(),
    };
    spec.validate().unwrap();

    let mut foreign = spec.clone();
    foreign.post_stop[0].inputs[0]
        .iocontext
        .as_mut()
        .unwrap()
        .name = "other".into();
    assert!(
        foreign
            .validate()
            .unwrap_err()
            .to_string()
            .contains("own ioContextName")
    );

    let e = compile(&p, &BTreeMap::new(), "ctx1", &[]).unwrap_err();
    assert!(e.contains("db-name"), "{e}");
}
