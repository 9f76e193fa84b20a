//! Sandbox resources on the node (docs/resources.md): the documented PostgreSQL plugin gives a
//! sandbox a database of its own before its fork starts, keyed writes land there and unkeyed
//! ones in the shared database (checked with psql), and deleting the sandbox drops it. Then:
//! a second step reading the first's output while the operator is restarted (no finished step
//! runs twice), a failing create step (the sandbox says which and why, no fork starts), and a
//! delete step that fails twice before it succeeds (retried, visible, then released).

use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
use spur_e2e::node::{Node, SPUR_NAMESPACE, eventually};

const NS: &str = "hotrod";
use spur_e2e::node::POSTGRES_IMAGE as PG_IMAGE;
const STEPS_NAMESPACE: &str = "spur-resources";
/// The shared server's superuser password (a test value; it must never reach a log).
const PG_PASSWORD: &str = "pg-admin-pw-7f3e1c";

fn example(name: &str) -> String {
    let path = format!("{}/../docs/examples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `psql -tA -c sql` against `db` on the shared server.
fn psql(node: &Node, db: &str, sql: &str) -> anyhow::Result<String> {
    spur_e2e::node::psql(node, NS, PG_PASSWORD, db, sql)
}

/// POST `value` to `url` from the client pod, with the routing key if given; the JSON answer.
fn post_row(
    node: &Node,
    client: &str,
    url: &str,
    key: Option<&str>,
    value: &str,
) -> anyhow::Result<Value> {
    let mut args = vec![
        "-n".to_string(),
        NS.into(),
        "exec".into(),
        client.into(),
        "--".into(),
        "curl".into(),
        "-sS".into(),
        "--max-time".into(),
        "10".into(),
        "-X".into(),
        "POST".into(),
        "--data-binary".into(),
        value.into(),
    ];
    if let Some(k) = key {
        args.push("-H".into());
        args.push(format!("baggage: sd-routing-key={k}"));
    }
    args.push(url.into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = node.kubectl(&args)?;
    let v: Value = serde_json::from_str(out.trim()).with_context(|| format!("not JSON: {out}"))?;
    if v["database"].is_null() {
        bail!("no database in the answer: {out}");
    }
    Ok(v)
}

fn sandbox_json(node: &Node, name: &str) -> anyhow::Result<Value> {
    node.get_json("default", &["sandbox", name])
}

fn ready_condition(s: &Value) -> (String, String, String) {
    let c = s["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready");
    let f = |k: &str| {
        c.and_then(|c| c[k].as_str())
            .unwrap_or_default()
            .to_string()
    };
    (f("status"), f("reason"), f("message"))
}

fn wait_ready(node: &Node, name: &str, limit: Duration) -> Value {
    eventually(&format!("Sandbox {name} to be Ready"), limit, || {
        let s = sandbox_json(node, name)?;
        Ok((ready_condition(&s).0 == "True").then_some(s))
    })
    .with_context(|| {
        format!(
            "{}\n{}",
            node.kubectl(&["get", "sandbox", name, "-o", "yaml"])
                .unwrap_or_default(),
            node.describe(STEPS_NAMESPACE)
        )
    })
    .unwrap()
}

fn wait_gone(node: &Node, kind: &str, name: &str, limit: Duration) {
    // Cluster-scoped kinds only (Sandboxes).
    eventually(&format!("{kind} {name} to go"), limit, || {
        let out = node.kubectl(&["get", kind, name, "--ignore-not-found", "-o", "name"])?;
        Ok(out.trim().is_empty().then_some(()))
    })
    .with_context(|| {
        node.kubectl(&["get", kind, name, "-o", "yaml"])
            .unwrap_or_default()
    })
    .unwrap();
}

/// A plugin on the shared server: steps get PGHOST/PGUSER/PGPASSWORD from the overlay.
fn plugin(name: &str, create: &str, delete: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: ResourcePlugin
metadata:
  name: {name}
spec:
  runner:
    image: {PG_IMAGE}
    podTemplateOverlay:
      spec:
        containers:
          - name: step
            env:
              - {{name: PGHOST, value: postgres.{NS}.svc}}
              - {{name: PGUSER, value: postgres}}
              - name: PGPASSWORD
                valueFrom: {{secretKeyRef: {{name: postgres-admin, key: password}}}}
  create:
{create}
  delete:
{delete}
"#
    )
}

/// A Sandbox with resource `db` of `plugin` and a fork of `customer`; with `dsn_from`, the
/// fork's database URL is that output of the resource.
fn sandbox_with(name: &str, plugin: &str, dsn_from: Option<&str>) -> String {
    let env = match dsn_from {
        Some(key) => format!(
            "          - name: SPUR_APP_DATABASE_URL\n            valueFrom: {{resource: {{name: db, outputKey: {key}}}}}\n"
        ),
        None => "          - {name: SPUR_APP_MARKER, value: plain}\n".to_string(),
    };
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {name}
spec:
  resources:
    - {{name: db, plugin: {plugin}}}
  forks:
    - forkOf: {{kind: Deployment, namespace: {NS}, name: customer}}
      customizations:
        env:
{env}"#
    )
}

/// Runs the scenario; returns secrets that must never reach a log (the admin password, the
/// sandbox database's DSN).
pub(crate) fn resources_on_the_node(node: &Node) -> Vec<String> {
    // --- the shared PostgreSQL server, its admin Secret where the steps run ------------------
    node.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n  labels:\n    sidecar.spur.dev/inject: \"true\"\n    spur.dev/enabled: \"true\"\n"
    ))
    .unwrap();
    for ns in [NS, STEPS_NAMESPACE] {
        node.kubectl(&[
            "-n",
            ns,
            "delete",
            "secret",
            "postgres-admin",
            "--ignore-not-found",
        ])
        .unwrap();
        node.kubectl(&[
            "-n",
            ns,
            "create",
            "secret",
            "generic",
            "postgres-admin",
            &format!("--from-literal=password={PG_PASSWORD}"),
        ])
        .unwrap();
    }
    spur_e2e::node::postgres(node, NS, "postgres-admin").unwrap();

    // --- the baseline: the demo app writing to the shared database ---------------------------
    let baseline_url = format!("postgres://postgres:{PG_PASSWORD}@postgres.{NS}.svc:5432/postgres");
    let customer = spur_e2e::node::demo_app(NS, "customer", None).replace(
        "          env:\n            - name: POD_NAME\n",
        &format!(
            "          env:\n            - name: SPUR_APP_DATABASE_URL\n              value: {baseline_url:?}\n            - name: POD_NAME\n"
        ),
    );
    assert!(customer.contains("SPUR_APP_DATABASE_URL"), "{customer}");
    node.apply(&customer).unwrap();
    node.rollout(NS, "customer").unwrap();
    let baseline_pod = node.pods(NS, "app=customer").unwrap()[0].clone();
    let client = node.client_pod(NS).unwrap();
    let url = format!("http://customer.{NS}.svc.cluster.local:8080/rows");

    // --- the documented plugin and sandbox ----------------------------------------------------
    node.apply(&example("resourceplugin-postgres.yaml"))
        .unwrap();
    eventually("the plugin to be Ready", Duration::from_secs(60), || {
        let p = node.get_json("default", &["resourceplugin", "postgres.1.0.0"])?;
        Ok((condition_status(&p, "Ready") == Some("True")).then_some(()))
    })
    .unwrap();
    node.apply(&example("sandbox-resource.yaml")).unwrap();
    let sb = wait_ready(node, "customer-db", Duration::from_secs(240));
    let key = sb["status"]["routingKey"].as_str().unwrap().to_string();
    let res = &sb["status"]["resources"][0];
    assert_eq!(res["phase"], "Ready", "{sb}");
    let secret = res["outputSecret"].as_str().unwrap().to_string();
    // The outputs are in the fork namespace's Secret, and nowhere in any status.
    let keys = node
        .kubectl(&["-n", NS, "get", "secret", &secret, "-o", "jsonpath={.data}"])
        .unwrap();
    assert!(
        keys.contains("user.dsn") && keys.contains("database.dbname"),
        "{keys}"
    );
    let dbname = format!("customers_{key}");
    let dsn = node
        .kubectl(&[
            "-n",
            NS,
            "get",
            "secret",
            &secret,
            "-o",
            "jsonpath={.data.user\\.dsn}",
        ])
        .unwrap();
    let dsn = String::from_utf8(base64_decode(dsn.trim())).unwrap();
    assert!(dsn.starts_with(&format!("postgres://{dbname}:")), "{dsn}");
    let fork_env = node
        .kubectl(&[
            "-n",
            NS,
            "get",
            "deployments",
            "-l",
            "spur.dev/sandbox=customer-db",
            "-o",
            "json",
        ])
        .unwrap();
    assert!(
        fork_env.contains(&format!("\"name\": \"{secret}\"")) && !fork_env.contains(&dsn),
        "the fork reads its DSN from the Secret: {fork_env}"
    );
    let resource = node
        .kubectl(&[
            "get",
            "resources.spur.dev",
            res["resource"].as_str().unwrap(),
            "-o",
            "json",
        ])
        .unwrap();
    let olm = node
        .kubectl(&[
            "get",
            "objectlifecyclemethods",
            res["resource"].as_str().unwrap(),
            "-o",
            "json",
        ])
        .unwrap();
    for (what, text) in [
        ("Resource", &resource),
        ("ObjectLifecycleMethods", &olm),
        ("Sandbox", &sb.to_string()),
    ] {
        assert!(!text.contains(&dsn), "the DSN is in the {what}: {text}");
    }

    // Keyed: the fork, in the sandbox's database. Unkeyed: the baseline, in the shared one.
    let keyed = eventually(
        "a keyed write to reach the fork",
        Duration::from_secs(60),
        || {
            let v = post_row(node, &client, &url, Some(&key), "from-the-sandbox")?;
            Ok((v["pod"].as_str() != Some(baseline_pod.as_str())).then_some(v))
        },
    )
    .with_context(|| node.describe(NS))
    .unwrap();
    assert_eq!(keyed["database"], dbname.as_str(), "{keyed}");
    let unkeyed = post_row(node, &client, &url, None, "from-the-baseline").unwrap();
    assert_eq!(unkeyed["database"], "postgres", "{unkeyed}");
    assert_eq!(unkeyed["pod"], baseline_pod.as_str(), "{unkeyed}");
    assert_eq!(
        psql(
            node,
            &dbname,
            "select string_agg(value, ',') from spur_demo_rows"
        )
        .unwrap(),
        "from-the-sandbox"
    );
    let shared = psql(
        node,
        "postgres",
        "select string_agg(value, ',') from spur_demo_rows",
    )
    .unwrap();
    assert!(
        shared.contains("from-the-baseline") && !shared.contains("from-the-sandbox"),
        "{shared}"
    );

    // Deleting the sandbox runs the delete step: the database and its role are gone.
    node.kubectl(&[
        "delete",
        "sandbox",
        "customer-db",
        "--wait=true",
        "--timeout=180s",
    ])
    .with_context(|| node.describe(STEPS_NAMESPACE))
    .unwrap();
    let left = psql(
        node,
        "postgres",
        &format!("select count(*) from pg_database where datname = '{dbname}'"),
    )
    .unwrap();
    assert_eq!(left, "0", "the sandbox's database is dropped");
    assert_eq!(
        psql(
            node,
            "postgres",
            &format!("select count(*) from pg_roles where rolname = '{dbname}'")
        )
        .unwrap(),
        "0"
    );
    // The outputs went with the resource (garbage-collected with it).
    eventually("the output Secret to go", Duration::from_secs(60), || {
        let out = node.kubectl(&[
            "-n",
            NS,
            "get",
            "secret",
            &secret,
            "--ignore-not-found",
            "-o",
            "name",
        ])?;
        Ok(out.trim().is_empty().then_some(()))
    })
    .unwrap();

    two_steps_survive_an_operator_restart(node, &client, &url, &baseline_pod);
    a_failing_create_step_stops_the_sandbox(node);
    a_failing_delete_step_is_retried(node);
    vec![PG_PASSWORD.to_string(), dsn]
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .unwrap_or_default()
}

fn condition_status<'a>(obj: &'a Value, type_: &str) -> Option<&'a str> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?["status"]
        .as_str()
}

/// Step `two` reads step `one`'s output; the operator restarts while `two` runs. Step `one`
/// records each run in the shared database: it must have run once.
fn two_steps_survive_an_operator_restart(node: &Node, client: &str, url: &str, baseline_pod: &str) {
    psql(
        node,
        "postgres",
        "create table if not exists step_runs (step text, sandbox text)",
    )
    .unwrap();
    node.apply(&plugin(
        "twostep",
        r##"    - name: one
      script: |
        #!/bin/sh
        set -eu
        db="two_${SPUR_ROUTING_KEY}"
        psql -v ON_ERROR_STOP=1 -d postgres -c "insert into step_runs values ('one', '$SPUR_SANDBOX_NAME')" -c "CREATE DATABASE \"$db\""
        printf '%s' "$db" > /tmp/db
      outputs:
        - {name: db, valueFromPath: /tmp/db}
    - name: two
      inputs:
        - name: db
          valueFromStep: {name: one, output: db}
          as: {path: /var/tmp/db-name}
      script: |
        #!/bin/sh
        set -eu
        db=$(cat /var/tmp/db-name)
        psql -v ON_ERROR_STOP=1 -d postgres -c "insert into step_runs values ('two', '$SPUR_SANDBOX_NAME')"
        sleep 8
        printf 'postgres://postgres:%s@%s:5432/%s' "$PGPASSWORD" "$PGHOST" "$db" > /tmp/dsn
      outputs:
        - {name: dsn, valueFromPath: /tmp/dsn}"##,
        r##"    - name: drop
      inputs:
        - {name: db, valueFromStep: {name: one, output: db}}
      script: |
        #!/bin/sh
        psql -v ON_ERROR_STOP=1 -d postgres -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)""##,
    ))
    .unwrap();
    node.apply(&sandbox_with("restarted", "twostep", Some("two.dsn")))
        .unwrap();
    // While step two runs (its pod exists), the operator goes away and comes back.
    eventually("step two to run", Duration::from_secs(120), || {
        let pods = node.pods(STEPS_NAMESPACE, "spur.dev/work-unit=two")?;
        Ok((!pods.is_empty()).then_some(()))
    })
    .unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "delete",
        "pod",
        "-l",
        "app.kubernetes.io/name=spur-operator",
        "--wait=true",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    let sb = wait_ready(node, "restarted", Duration::from_secs(240));
    let key = sb["status"]["routingKey"].as_str().unwrap().to_string();
    let runs = psql(
        node,
        "postgres",
        "select step || '=' || count(*) from step_runs where sandbox = 'restarted' group by step order by step",
    )
    .unwrap();
    assert_eq!(
        runs, "one=1\ntwo=1",
        "a finished step ran again after the restart"
    );
    // The fork got step two's output, built from step one's.
    let v = eventually(
        "a keyed write to reach the fork",
        Duration::from_secs(60),
        || {
            let v = post_row(node, client, url, Some(&key), "two-steps")?;
            Ok((v["pod"].as_str() != Some(baseline_pod)).then_some(v))
        },
    )
    .unwrap();
    assert_eq!(v["database"], format!("two_{key}").as_str(), "{v}");
    node.kubectl(&[
        "delete",
        "sandbox",
        "restarted",
        "--wait=true",
        "--timeout=180s",
    ])
    .unwrap();
}

/// A create step that fails: the sandbox names it and shows why, and no fork is created. Its
/// delete step, which would undo what the failed step never wrote, is skipped rather than
/// retried forever: the sandbox goes.
fn a_failing_create_step_stops_the_sandbox(node: &Node) {
    node.apply(&plugin(
        "broken",
        r##"    - name: fails
      script: |
        #!/bin/sh
        echo "cannot reach the quota service: boom" >&2
        exit 3
      outputs:
        - {name: dsn, valueFromPath: /tmp/dsn}
    - name: two
      script: "#!/bin/sh\ntrue\n"
      outputs:
        - {name: dsn, valueFromPath: /tmp/dsn}"##,
        r##"    - name: cleanup
      inputs:
        - {name: dsn, valueFromStep: {name: fails, output: dsn}}
      script: "#!/bin/sh\nexit 1\n""##,
    ))
    .unwrap();
    node.apply(&sandbox_with("broken-db", "broken", Some("two.dsn")))
        .unwrap();
    let (reason, message) = eventually("the sandbox to fail", Duration::from_secs(120), || {
        let s = sandbox_json(node, "broken-db")?;
        let (status, reason, message) = ready_condition(&s);
        Ok((status == "False" && reason == "ResourceFailed").then_some((reason, message)))
    })
    .with_context(|| {
        node.kubectl(&["get", "sandbox", "broken-db", "-o", "yaml"])
            .unwrap_or_default()
    })
    .unwrap();
    assert_eq!(reason, "ResourceFailed");
    assert!(
        message.contains("step fails failed") && message.contains("exit code 3"),
        "{message}"
    );
    assert!(message.contains("boom"), "the log tail is shown: {message}");
    let fws = node
        .kubectl(&[
            "get",
            "forkedworkloads",
            "-A",
            "-l",
            "spur.dev/sandbox=broken-db",
            "-o",
            "name",
        ])
        .unwrap();
    assert_eq!(fws.trim(), "", "no fork starts");
    // Step two never ran.
    assert!(
        node.pods(STEPS_NAMESPACE, "spur.dev/work-unit=two")
            .unwrap()
            .is_empty()
    );
    node.kubectl(&[
        "delete",
        "sandbox",
        "broken-db",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
}

/// A delete step that fails twice, then succeeds: retried with backoff, shown while it fails,
/// and the sandbox goes once it succeeds.
fn a_failing_delete_step_is_retried(node: &Node) {
    psql(
        node,
        "postgres",
        "create table if not exists flaky (n serial)",
    )
    .unwrap();
    node.apply(&plugin(
        "flaky",
        r##"    - name: make
      script: "#!/bin/sh\ntrue\n""##,
        r##"    - name: unmake
      script: |
        #!/bin/sh
        set -eu
        n=$(psql -qtA -v ON_ERROR_STOP=1 -d postgres -c "insert into flaky default values returning n")
        if [ "$n" -lt 3 ]; then echo "attempt $n: the server is busy" >&2; exit 1; fi
        echo "attempt $n: done""##,
    ))
    .unwrap();
    node.apply(&sandbox_with("flaky-db", "flaky", None))
        .unwrap();
    wait_ready(node, "flaky-db", Duration::from_secs(120));
    node.kubectl(&["delete", "sandbox", "flaky-db", "--wait=false"])
        .unwrap();
    // While it fails, the sandbox (still there, deleting) and its Resource say so.
    let shown = eventually(
        "the failed delete step to show",
        Duration::from_secs(120),
        || {
            let s = sandbox_json(node, "flaky-db")?;
            let r = &s["status"]["resources"][0];
            let m = r["message"].as_str().unwrap_or_default().to_string();
            Ok((r["phase"] == "Deleting" && m.contains("step unmake failed")).then_some(m))
        },
    )
    .unwrap();
    assert!(shown.contains("busy"), "{shown}");
    wait_gone(node, "sandbox", "flaky-db", Duration::from_secs(180));
    assert_eq!(
        psql(node, "postgres", "select count(*) from flaky").unwrap(),
        "3"
    );
    let events = node
        .kubectl(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            "reason=UnitFailed",
            "-o",
            "json",
        ])
        .unwrap();
    assert!(
        events.contains("unmake"),
        "each failed attempt is an event: {events}"
    );
}
