//! `spur test run|list|results|record|check`: a smart test (a file of HTTP and gRPC requests with optional checks,
//! docs/smart-tests.md) sent from here to a sandbox and, twice, to its baseline; the answers are
//! checked and diffed with the baseline's own differences learned as noise (`spur-smarttest`).
//!
//! Who may do what: the requests go out from this machine, so they reach what this machine
//! reaches (in a pod, the cluster; on a workstation, through `spur local connect`). The
//! sandbox's routing key is read with the user's own credentials (`get` on the Sandbox); with
//! `--key` nothing is read from the cluster at all. A user who may not read a sandbox learns
//! nothing of it here and sends nothing.

mod calls;
mod record;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use kube::Api;
use serde_json::Value;
use spur_api::conditions::{READY, find_condition};
use spur_api::{Sandbox, SmartTest, SmartTestSpec};
use spur_smarttest::TestSpec;

use crate::sandbox::api_error;

/// Largest test file read.
const MAX_FILE: u64 = 4 << 20;

#[derive(Args)]
pub(crate) struct TestArgs {
    #[command(subcommand)]
    command: TestCommand,
}

#[derive(Subcommand)]
enum TestCommand {
    /// Send a test's requests to a sandbox and twice to its baseline, check the answers, and
    /// report what the sandbox changed (noise, learned from the baseline's two answers, left
    /// out).
    #[command(
        after_help = "Exit codes: 0 no finding and every check passed on the sandbox; 1 findings or a failed check; 2 an error (a bad file, a refusal, no such sandbox, a sandbox not Ready).\nThe requests go out from this machine: run it in a pod of the cluster, or on a workstation after `spur local connect`."
    )]
    Run(RunArgs),
    /// The SmartTests of a namespace, with the Services each exercises; with --sandbox, which
    /// of them cover the sandbox (it forks a workload behind one of their Services).
    List(ListArgs),
    /// The automatic runs of a namespace's SmartTests (docs/smart-tests.md, "Automatic runs"):
    /// one line per run, newest first, with the sandbox generation it ran against and its
    /// outcome. Read with your credentials (`list` on jobs.spur.dev in the namespace).
    Results(ResultsArgs),
    /// Write a test from a sandbox's captured traffic (the traffic store, as `spur traffic
    /// query` reads it, with your token): one step per distinct request, oldest first, each
    /// checking the status the capture saw. Credentials, redacted values, the routing key and
    /// its carriers are left out; requests whose body was captured only in part are skipped
    /// (and said so on standard error). With --name, a SmartTest manifest.
    Record(Box<record::RecordArgs>),
    /// Read a test file and say whether it can run (nothing is sent).
    Check {
        /// The test: a file with `steps:`, or a SmartTest manifest (its `spec`); - for stdin.
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
    },
}

#[derive(Args)]
struct RunArgs {
    /// A SmartTest of the cluster, read with your credentials (`get` on smarttests in its
    /// namespace: the built-in view role has it).
    #[arg(conflicts_with = "file", required_unless_present = "file")]
    test: Option<String>,
    /// The SmartTest's namespace [default: the kubeconfig's].
    #[arg(short = 'n', long, requires = "test")]
    namespace: Option<String>,
    /// The test from a file instead: a file with `steps:`, or a SmartTest manifest (its
    /// `spec`); - for stdin.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// The sandbox whose routing key the sandbox's requests carry (read from the cluster, with
    /// your credentials, unless --key gives it).
    #[arg(long, required_unless_present = "key")]
    sandbox: Option<String>,
    /// A routing key, given directly (a route group's, or a sandbox's read elsewhere): nothing is
    /// read from the cluster. With --sandbox too, the sandbox only names whose run --calls
    /// captures (the key must be the one the traffic store knows it by).
    #[arg(long)]
    key: Option<String>,
    /// Run against a sandbox that is not Ready (its keyed requests may reach the baseline).
    #[arg(long)]
    allow_not_ready: bool,
    /// Run the test's script steps (commands, `script:`) on this machine, three times each.
    /// Without it a test with one is refused, naming the commands: whoever may edit a
    /// SmartTest would otherwise choose what runs on every machine that runs it by name.
    #[arg(long)]
    allow_scripts: bool,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Also write a summary of the run (counts, the most important findings and failed checks;
    /// JSON of at most 4096 bytes) to this file: a Job's `resultPath`, so the run's outcome
    /// lands in the Job's status.
    #[arg(long, value_name = "FILE")]
    summary_file: Option<PathBuf>,
    /// Also compare the calls each request causes downstream: the traffic store captures the
    /// sandbox's key and a reference key (which the baseline's requests then carry) at every
    /// sidecar of the sandbox's namespaces while the test runs. Needs the store (--server,
    /// --token-file, as `spur traffic`), `update` on the sandbox's sandboxes/capture and
    /// `create` on deployments in its namespaces to start, and `get` on its sandboxes/traffic
    /// to read what was captured.
    #[arg(long)]
    calls: bool,
    /// Compare the calls downstream through a run capture the operator started for this run
    /// (automatic runs of a SmartTest with `calls: true`): the environment variable holding it
    /// as JSON. The store connection's token (SPUR_TRAFFIC_TOKEN) is then the run's own, which
    /// reads back only this run's requests.
    #[arg(long, value_name = "VAR", conflicts_with = "calls")]
    run_capture_env: Option<String>,
    #[command(flatten)]
    store: crate::traffic::Conn,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

#[derive(Args)]
struct ListArgs {
    /// The namespace [default: the kubeconfig's].
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Say which tests cover this sandbox (read with your credentials).
    #[arg(long)]
    sandbox: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

#[derive(Args)]
struct ResultsArgs {
    /// The namespace [default: the kubeconfig's].
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Only the runs against this sandbox.
    #[arg(long)]
    sandbox: Option<String>,
    /// Only the runs of this SmartTest.
    #[arg(long)]
    test: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

pub(crate) async fn run(args: TestArgs) -> Result<ExitCode> {
    match args.command {
        TestCommand::Check { file } => {
            let (spec, from) = read_spec(&file)?;
            let steps = spec.validate().with_context(|| from.clone())?;
            outln!("{from}: {} steps, ready to run", steps.len());
            Ok(ExitCode::SUCCESS)
        }
        TestCommand::Record(a) => {
            record::record(*a).await?;
            Ok(ExitCode::SUCCESS)
        }
        TestCommand::List(a) => {
            outln!("{}", list(&a).await?.trim_end());
            Ok(ExitCode::SUCCESS)
        }
        TestCommand::Results(a) => {
            outln!("{}", results(&a).await?.trim_end());
            Ok(ExitCode::SUCCESS)
        }
        // Errors exit 2 here: 1 tells a script "the sandbox changed something".
        TestCommand::Run(a) => {
            let summary_file = a.summary_file.clone();
            Ok(run_test(a).await.unwrap_or_else(|e| {
                let message = format!("{e:#}");
                crate::sandbox::note(format_args!("spur: {message}"));
                // The summary says the run did not happen, rather than leave the file unwritten.
                if let Some(path) = summary_file {
                    let text = error_summary(&message, spur_api::jobs::RESULT_MAX);
                    if let Err(e) = std::fs::write(&path, text) {
                        crate::sandbox::note(format_args!(
                            "spur: writing the summary to {}: {e}",
                            path.display()
                        ));
                    }
                }
                ExitCode::from(2)
            }))
        }
    }
}

async fn run_test(a: RunArgs) -> Result<ExitCode> {
    // The test first: a bad one is said before the sandbox is read or anything is sent.
    let (spec, from) = match (&a.file, &a.test) {
        (Some(file), _) => read_spec(file)?,
        (None, Some(name)) => cluster_spec(&a, name).await?,
        (None, None) => bail!("name a SmartTest, or a file with -f"),
    };
    let steps = spec.validate().with_context(|| from.clone())?;
    refuse_scripts(&steps, a.allow_scripts, &from)?;
    if a.calls && a.sandbox.is_none() {
        bail!("--calls needs --sandbox: the traffic store captures the calls of a sandbox's run");
    }
    let key = match (&a.key, &a.sandbox) {
        (Some(key), _) => {
            if !spur_routing::extract::is_valid_key(key) {
                bail!("--key {key:?}: not a routing key (letters, digits, - and _)");
            }
            key.clone()
        }
        (None, Some(name)) => sandbox_key(&a, name).await?,
        (None, None) => bail!("name a --sandbox or a --key"),
    };
    // Steps with `reflection: true` learn their types from the baseline's server first.
    let mut steps = steps;
    spur_smarttest::reflect::resolve(&mut steps)
        .await
        .with_context(|| from.clone())?;
    // Script steps run processes of this machine: Ctrl-C stops the run and them (the default,
    // ending only this process, would leave them running in their own process group).
    let scripts = steps.iter().any(|s| s.script().is_some());
    let capture = match (&a.sandbox, a.calls, &a.run_capture_env) {
        (_, _, Some(var)) => {
            let json = std::env::var(var).with_context(|| {
                format!("--run-capture-env {var}: the variable is not set (or not UTF-8)")
            })?;
            Some(calls::adopt(&a.store, &json, &key).await?)
        }
        (Some(sandbox), true, None) => Some(calls::start(&a.store, sandbox, &key, &steps).await?),
        _ => None,
    };
    let report = match capture {
        Some(capture) => {
            let plan = match capture.plan() {
                Ok(p) => p,
                Err(e) => {
                    capture.end(&a.store).await;
                    return Err(e);
                }
            };
            let run = spur_smarttest::run(&steps, &key, Some(&plan));
            let mut report = match interruptible(scripts, run).await {
                Ok(report) => report,
                Err(e) => {
                    capture.end(&a.store).await;
                    return Err(e);
                }
            };
            let finish = capture.finish(&a.store, &plan, steps.len());
            let (captured, seen) = interruptible(scripts, finish)
                .await
                .context("the run's capture was not ended: it ends at its time limit")??;
            report.attach_calls(&plan, &captured, seen);
            report
        }
        _ => interruptible(scripts, spur_smarttest::run(&steps, &key, None)).await?,
    };
    if let Some(path) = &a.summary_file {
        std::fs::write(path, report.summary(spur_api::jobs::RESULT_MAX))
            .with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    match a.output {
        Output::Text => out!("{}", report.render()),
        Output::Json => outln!("{}", serde_json::to_string_pretty(&report.to_json())?),
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `work`, unless Ctrl-C, SIGTERM or SIGHUP comes first (only when `scripts`: otherwise these
/// end the process as they always do): then `work` is dropped, which kills the script a step is
/// running and everything it started (its own process group, which no signal sent to this
/// process's group reaches).
async fn interruptible<T>(scripts: bool, work: impl std::future::Future<Output = T>) -> Result<T> {
    use tokio::signal::unix::{SignalKind, signal};
    if !scripts {
        return Ok(work.await);
    }
    let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut hangup = signal(SignalKind::hangup()).context("handling SIGHUP")?;
    let stopped = |what: &str| {
        anyhow::anyhow!("interrupted ({what}): the run stopped, and its script with it")
    };
    tokio::select! {
        done = work => Ok(done),
        _ = tokio::signal::ctrl_c() => Err(stopped("Ctrl-C")),
        _ = term.recv() => Err(stopped("SIGTERM")),
        _ = hangup.recv() => Err(stopped("SIGHUP")),
    }
}

/// Refuses a test with script steps unless `allowed`, naming each command as it would run.
fn refuse_scripts(steps: &[spur_smarttest::Prepared], allowed: bool, from: &str) -> Result<()> {
    let commands: Vec<String> = steps
        .iter()
        .filter_map(|s| {
            let script = s.script()?;
            let argv = std::iter::once(&script.program).chain(&script.args);
            let words: Vec<String> = argv.map(|w| format!("{w:?}")).collect();
            Some(format!("  {}: {}", s.name, words.join(" ")))
        })
        .collect();
    if allowed || commands.is_empty() {
        return Ok(());
    }
    bail!(
        "{from} runs commands on this machine (script steps, each run three times):\n{}\npass --allow-scripts to run them",
        commands.join("\n")
    )
}

/// The sandbox's routing key, read with the user's credentials; refused unless it is Ready.
async fn sandbox_key(a: &RunArgs, name: &str) -> Result<String> {
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let sb = Api::<Sandbox>::all(client)
        .get_opt(name)
        .await
        .map_err(|e| api_error(e, &format!("reading Sandbox {name}")))?
        .with_context(|| format!("no Sandbox named {name}"))?;
    let status = sb.status.unwrap_or_default();
    let key = status
        .routing_key
        .with_context(|| format!("Sandbox {name} has no routing key yet"))?;
    let ready = find_condition(&status.conditions, READY);
    if !a.allow_not_ready && ready.is_none_or(|c| c.status != "True") {
        let why = ready.map_or_else(
            || "no Ready condition yet".to_owned(),
            |c| format!("{}: {}", c.reason, c.message),
        );
        bail!(
            "Sandbox {name} is not Ready ({why}): its keyed requests could reach the baseline and the test would see no difference. Wait for it (`spur sandbox apply --wait`), or pass --allow-not-ready"
        );
    }
    Ok(key)
}

/// `{"error": message}` in at most `max` bytes: the message is cut (at a character) until its
/// JSON, escapes included, fits.
fn error_summary(message: &str, max: usize) -> String {
    let json = |end: usize| serde_json::json!({ "error": &message[..end] }).to_string();
    // The longest prefix that fits, found by bisection over the character boundaries.
    let ends: Vec<usize> = message
        .char_indices()
        .map(|(i, _)| i)
        .chain([message.len()])
        .collect();
    let (mut lo, mut hi) = (0, ends.len() - 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if json(ends[mid]).len() <= max {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    json(ends[lo])
}

/// `spur test list`: a table of the namespace's SmartTests, read with the user's credentials
/// (and the sandbox too, with --sandbox).
async fn list(a: &ListArgs) -> Result<String> {
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let ns = a
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let sandbox = match &a.sandbox {
        None => None,
        Some(name) => Some(
            Api::<Sandbox>::all(client.clone())
                .get_opt(name)
                .await
                .map_err(|e| api_error(e, &format!("reading Sandbox {name}")))?
                .with_context(|| format!("no Sandbox named {name}"))?,
        ),
    };
    let mut tests = Api::<SmartTest>::namespaced(client, &ns)
        .list(&Default::default())
        .await
        .map_err(|e| api_error(e, &format!("listing SmartTests in namespace {ns}")))?
        .items;
    tests.sort_by(|x, y| x.metadata.name.cmp(&y.metadata.name));
    if tests.is_empty() {
        return Ok(format!("no SmartTests in namespace {ns}"));
    }
    let dash = |v: Vec<String>| {
        if v.is_empty() {
            "-".to_owned()
        } else {
            v.join(",")
        }
    };
    let mut rows = vec![vec!["NAME".to_owned(), "STEPS".into(), "SERVICES".into()]];
    if let Some(sb) = &sandbox {
        rows[0].push(format!(
            "COVERS {}",
            sb.metadata.name.clone().unwrap_or_default()
        ));
    }
    for t in &tests {
        let mut row = vec![
            t.metadata.name.clone().unwrap_or_default(),
            t.spec.steps.len().to_string(),
            dash(t.spec.services.clone()),
        ];
        if let Some(sb) = &sandbox {
            row.push(dash(t.spec.covers(&ns, sb)));
        }
        rows.push(row);
    }
    Ok(aligned(&rows))
}

/// `spur test results`: the automatic runs' Jobs of the namespace (labelled with their test),
/// read with the user's credentials, newest first.
async fn results(a: &ResultsArgs) -> Result<String> {
    use spur_api::smarttest::{RUN_SANDBOX_GENERATION, RUN_TEST_LABEL};
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let ns = a
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let mut selector = RUN_TEST_LABEL.to_owned();
    if let Some(t) = &a.test {
        selector = format!("{RUN_TEST_LABEL}={t}");
    }
    if let Some(s) = &a.sandbox {
        selector.push_str(&format!(",{}={s}", spur_api::keys::labels::SANDBOX));
    }
    let mut jobs = Api::<spur_api::jobs::Job>::namespaced(client, &ns)
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
        .map_err(|e| api_error(e, &format!("listing the runs (Jobs) in namespace {ns}")))?
        .items;
    if jobs.is_empty() {
        return Ok(format!("no automatic runs in namespace {ns}"));
    }
    let label = |j: &spur_api::jobs::Job, key: &str| {
        j.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .cloned()
            .unwrap_or_default()
    };
    let generation = |j: &spur_api::jobs::Job| {
        j.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(RUN_SANDBOX_GENERATION))
            .and_then(|g| g.parse::<i64>().ok())
            .unwrap_or(0)
    };
    jobs.sort_by_key(|j| std::cmp::Reverse((j.metadata.creation_timestamp.clone(), generation(j))));
    let mut rows = vec![
        ["TEST", "SANDBOX", "GEN", "JOB", "PHASE", "OUTCOME"]
            .map(String::from)
            .to_vec(),
    ];
    for j in &jobs {
        let st = j.status.clone().unwrap_or_default();
        let phase = st.phase.map_or("Queued", spur_api::jobs::JobPhase::as_str);
        let outcome = match (&st.result, st.phase) {
            (Some(text), _) => match spur_smarttest::summary::Outcome::parse(text) {
                Ok(spur_smarttest::summary::Outcome::Ran(s)) => s.brief(3),
                Ok(spur_smarttest::summary::Outcome::Error(e)) => format!("not run: {e}"),
                Err(e) => e,
            },
            (
                None,
                Some(spur_api::jobs::JobPhase::Queued | spur_api::jobs::JobPhase::Running) | None,
            ) => "-".into(),
            (None, Some(_)) => "no summary (spur job logs)".into(),
        };
        rows.push(vec![
            label(j, RUN_TEST_LABEL),
            label(j, spur_api::keys::labels::SANDBOX),
            generation(j).to_string(),
            j.metadata.name.clone().unwrap_or_default(),
            phase.to_owned(),
            // The outcome quotes what the fork answered.
            crate::text::one_line(&outcome),
        ]);
    }
    Ok(aligned(&rows))
}

/// Rows as columns aligned the way `kubectl get` prints them.
fn aligned(rows: &[Vec<String>]) -> String {
    let mut widths = vec![0usize; rows.iter().map(Vec::len).max().unwrap_or(0)];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, w) in r.iter().zip(&widths) {
            line.push_str(&format!("{c:<w$}   "));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// SmartTest `name`, read with the user's credentials.
async fn cluster_spec(a: &RunArgs, name: &str) -> Result<(TestSpec, String)> {
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let ns = a
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let test = Api::<SmartTest>::namespaced(client, &ns)
        .get_opt(name)
        .await
        .map_err(|e| api_error(e, &format!("reading SmartTest {ns}/{name}")))?
        .with_context(|| format!("no SmartTest {name} in namespace {ns}"))?;
    Ok((test.spec.test(), format!("SmartTest {ns}/{name}")))
}

/// The test in `file` (`-`: stdin): a spec (`steps:`) or a SmartTest manifest's `spec`.
fn read_spec(file: &Path) -> Result<(TestSpec, String)> {
    let (reader, from): (Box<dyn std::io::Read>, String) = if file == Path::new("-") {
        (Box::new(std::io::stdin()), "standard input".to_owned())
    } else {
        let from = file.display().to_string();
        let f = std::fs::File::open(file).with_context(|| format!("opening {from}"))?;
        (Box::new(f), from)
    };
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(reader, MAX_FILE + 1), &mut text)
        .with_context(|| format!("reading {from}"))?;
    if text.len() as u64 > MAX_FILE {
        bail!("{from}: larger than {} MiB", MAX_FILE >> 20);
    }
    let value: Value =
        serde_yaml_ng::from_str(&text).with_context(|| format!("{from}: not YAML or JSON"))?;
    // A manifest (`kind: SmartTest`) holds the test under `spec`.
    let spec: TestSpec = match value.get("kind").and_then(Value::as_str) {
        // A manifest's spec has the resource's own fields (services) besides the steps.
        Some("SmartTest") => {
            SmartTestSpec::from_file_value(value.get("spec").cloned().unwrap_or(Value::Null))
                .with_context(|| format!("{from}: not a SmartTest's spec"))?
                .test()
        }
        Some(other) => bail!("{from}: a {other}, not a SmartTest or a test's steps"),
        None => {
            TestSpec::from_file_value(value).with_context(|| format!("{from}: not a smart test"))?
        }
    };
    Ok((spec, from))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn an_error_summary_fits_its_bound_escapes_included() {
        let short = error_summary("no Sandbox named x", 4096);
        assert_eq!(short, r#"{"error":"no Sandbox named x"}"#);
        for message in [
            "\"".repeat(5000),
            "\u{1}".repeat(3000),
            "é".repeat(4000),
            "a".repeat(10_000),
        ] {
            let text = error_summary(&message, 4096);
            assert!(text.len() <= 4096, "{}", text.len());
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(message.starts_with(v["error"].as_str().unwrap()));
            assert!(text.len() > 1000, "cut no more than needed: {}", text.len());
        }
    }

    #[test]
    fn script_steps_run_only_when_allowed_and_the_refusal_names_the_commands() {
        let spec: spur_smarttest::TestSpec = serde_yaml_ng::from_str(
            "steps:\n- {name: k6, script: {command: [k6, run, \"a b.js\"]}}\n- {name: a, http: {url: \"http://a/\"}}",
        )
        .unwrap();
        let steps = spec.validate().unwrap();
        let e = refuse_scripts(&steps, false, "SmartTest shop/t")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("SmartTest shop/t runs commands on this machine")
                && e.contains(r#"  k6: "k6" "run" "a b.js""#)
                && e.contains("--allow-scripts"),
            "{e}"
        );
        refuse_scripts(&steps, true, "t").unwrap();
        refuse_scripts(&steps[1..], false, "t").unwrap();
    }

    #[test]
    fn a_file_is_steps_or_a_smarttest_manifest() {
        let steps = "steps: [{name: a, http: {url: \"http://api/\"}}]";
        let (spec, _) = read_spec(write(steps).path()).unwrap();
        assert_eq!(spec.steps.len(), 1);
        let manifest = format!(
            "apiVersion: spur.dev/v1alpha1\nkind: SmartTest\nmetadata: {{name: t}}\nspec: {{{steps}}}"
        );
        let (spec, _) = read_spec(write(&manifest).path()).unwrap();
        assert_eq!(spec.steps[0].name, "a");
        // A manifest's services are the resource's, not a step's: read, not refused.
        let with_services = format!(
            "apiVersion: spur.dev/v1alpha1\nkind: SmartTest\nmetadata: {{name: t}}\nspec: {{{steps}, services: [api]}}"
        );
        let (spec, _) = read_spec(write(&with_services).path()).unwrap();
        assert_eq!(spec.steps.len(), 1);
        let e = read_spec(write("kind: Sandbox\nspec: {}").path()).unwrap_err();
        assert!(e.to_string().contains("a Sandbox, not a SmartTest"), "{e}");
        let e = read_spec(write("steps: [{name: a, htp: {}}]").path()).unwrap_err();
        assert!(
            format!("{e:#}").contains("unknown field `steps[0].htp`"),
            "{e:#}"
        );
        let typo = "apiVersion: spur.dev/v1alpha1\nkind: SmartTest\nmetadata: {name: t}\nspec: {steps: [{name: a, http: {url: \"http://a/\", methd: GET}}]}";
        let e = read_spec(write(typo).path()).unwrap_err();
        assert!(
            format!("{e:#}").contains("unknown field `steps[0].http.methd`"),
            "{e:#}"
        );
    }
}
