//! The documented PostgreSQL resource plugin (docs/examples/resourceplugin-postgres.yaml) against
//! a real PostgreSQL server (issue 42, point 9). Its steps run as the server's superuser with
//! parameters that sandbox creators choose, so a hostile parameter must neither get past the
//! plugin's input pattern nor, if it did, change the SQL the steps run: the steps are run here
//! exactly as a step pod would run them (`sh` with the step's env), with the outputs in a
//! temporary directory instead of /tmp.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use spur_api::ResourcePlugin;
use spur_api::resources::{PluginStep, compile, default_input_env};

use spur_kube_harness::postgres::{PASSWORD, Postgres, pg_bindir};

fn plugin() -> ResourcePlugin {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/examples/resourceplugin-postgres.yaml");
    let plugin: ResourcePlugin =
        serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    plugin.validate().unwrap();
    plugin
}

/// Runs `step` as its pod would: its script under `sh`, its inputs in env vars, the server in
/// PG* vars; its outputs are written under `out` (the script's paths rewritten) and returned.
async fn run_step(
    step: &PluginStep,
    pg: &Postgres,
    inputs: &BTreeMap<String, String>,
    out: &Path,
) -> Result<BTreeMap<String, String>, String> {
    let mut script = step.script.clone();
    for o in &step.outputs {
        let to = out.join(format!("{}.{}", step.name, o.name));
        script = script.replace(&o.value_from_path, to.to_str().unwrap());
    }
    let path = format!(
        "{}:{}",
        pg_bindir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(&script)
        .env_clear()
        .env("PATH", path)
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", pg.port.to_string())
        .env("PGUSER", "postgres")
        .env("PGPASSWORD", PASSWORD)
        .env("SPUR_SANDBOX_NAME", "sb")
        .env("SPUR_ROUTING_KEY", "k7x2")
        .env("SPUR_RESOURCE_NAME", "db")
        .env("SPUR_STEP_NAME", &step.name);
    for input in &step.inputs {
        cmd.env(default_input_env(&input.name), &inputs[&input.name]);
    }
    let done = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("a step hung")
        .unwrap();
    if !done.status.success() {
        return Err(String::from_utf8_lossy(&done.stderr).into_owned());
    }
    Ok(step
        .outputs
        .iter()
        .map(|o| {
            let at = out.join(format!("{}.{}", step.name, o.name));
            (
                format!("{}.{}", step.name, o.name),
                std::fs::read_to_string(at).unwrap(),
            )
        })
        .collect())
}

/// Runs the plugin's create steps with `prefix`, then its delete steps; returns the database
/// name the first step reported (None when a create step failed) and the outputs.
async fn create_and_delete(pg: &Postgres, prefix: &str) -> Option<String> {
    let plugin = plugin();
    let out = tempfile::tempdir().unwrap();
    let mut outputs: BTreeMap<String, String> = BTreeMap::new();
    for step in &plugin.spec.create {
        let inputs = step
            .inputs
            .iter()
            .map(|i| {
                let v = match &i.value_from_step {
                    Some(r) => outputs[&format!("{}.{}", r.name, r.output)].clone(),
                    None => prefix.to_owned(),
                };
                (i.name.clone(), v)
            })
            .collect();
        match run_step(step, pg, &inputs, out.path()).await {
            Ok(o) => outputs.extend(o),
            Err(_) => return None,
        }
    }
    let dbname = outputs["database.dbname"].clone();
    // The fork's DSN works and reaches the sandbox's own database.
    let dsn = &outputs["user.dsn"];
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let row = client
        .query_one("SELECT current_database(), current_user", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), dbname);
    assert_eq!(row.get::<_, String>(1), dbname);
    drop(client);
    for step in &plugin.spec.delete {
        let inputs = step
            .inputs
            .iter()
            .map(|i| (i.name.clone(), dbname.clone()))
            .collect();
        run_step(step, pg, &inputs, out.path()).await.unwrap();
    }
    Some(dbname)
}

async fn databases(admin: &tokio_postgres::Client) -> Vec<String> {
    admin
        .query("SELECT datname FROM pg_database ORDER BY datname", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_plugin_runs_no_sql_a_sandbox_creator_writes() {
    // The operator refuses a sandbox whose parameter does not match the input's pattern,
    // without repeating the value.
    let plugin = plugin();
    let params = |v: &str| BTreeMap::from([("db-prefix".to_string(), v.to_string())]);
    compile(&plugin.spec, &params("customers"), "ctx", &[]).unwrap();
    for hostile in [
        "x\" TEMPLATE secrets --",
        "x\"; DROP DATABASE postgres; --",
        "x' OR '1'='1",
        "customers\n",
    ] {
        let err = compile(&plugin.spec, &params(hostile), "ctx", &[]).unwrap_err();
        assert!(err.contains("must match the plugin's pattern"), "{err}");
    }

    let pg = Postgres::start().await;
    let admin = pg.admin().await;
    admin
        .batch_execute("CREATE DATABASE secrets")
        .await
        .unwrap();
    let (secrets, conn) = tokio_postgres::connect(
        &format!(
            "postgres://postgres:{PASSWORD}@127.0.0.1:{}/secrets",
            pg.port
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    secrets
        .batch_execute("CREATE TABLE payroll (who text); INSERT INTO payroll VALUES ('ceo')")
        .await
        .unwrap();
    drop(secrets);
    let before = databases(&admin).await;

    // An ordinary sandbox: a database and a role of its own, gone after the delete steps.
    let made = create_and_delete(&pg, "customers").await.unwrap();
    assert_eq!(made, "customers_k7x2");
    assert_eq!(databases(&admin).await, before);

    // Past the pattern (a plugin without one, or an operator that did not check), the steps
    // still run only their own SQL: a quote in the value is part of a name, nothing more.
    // Pasted into the SQL, this value made `CREATE DATABASE "x" TEMPLATE secrets` (a copy of
    // the secrets database, owned by the sandbox) and cut off the rest with a comment.
    let hostile = "x\" TEMPLATE secrets --";
    let made = create_and_delete(&pg, hostile).await;
    assert_eq!(made.as_deref(), Some("x\" TEMPLATE secrets --_k7x2"));
    let after = databases(&admin).await;
    assert!(
        !after.iter().any(|d| d == "x"),
        "the parameter's SQL ran: {after:?}"
    );
    assert_eq!(after, before, "a database was left behind");
}
