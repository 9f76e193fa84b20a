//! The commands people use with the jobs component (`spur-jobs`): `spur job
//! submit|list|get|logs|cancel`, `spur artifact list|download`, `spur runner-group list`.
//! Logs and artifacts come through the Kubernetes API server (the aggregated API
//! `jobs.spur.dev`), so RBAC on `jobs/log` and `jobs/artifacts` decides who may read them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand};
use futures_util::AsyncReadExt;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use spur_api::jobs::{CanceledBy, JobPhase};
use spur_api::{Job, JobRunnerGroup};

#[derive(Args)]
pub(crate) struct JobArgs {
    #[command(subcommand)]
    command: JobCommand,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Clone)]
struct Common {
    /// Namespace (default: the kubeconfig's, else `default`).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG", global = true)]
    kubeconfig: Option<PathBuf>,
}

#[derive(Subcommand)]
enum JobCommand {
    /// Submit a Job from a YAML file (`-` for stdin). With --attach, wait for a runner, stream
    /// the output and exit with the job's exit code; Ctrl-C asks whether to cancel.
    Submit {
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        #[arg(long)]
        attach: bool,
    },
    /// List jobs.
    List {
        /// Every namespace.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Show a job: phase, routing key, attempts, artifacts.
    Get { name: String },
    /// Print a job's output (the latest attempt's unless --attempt).
    Logs {
        name: String,
        /// Keep printing until the job ends.
        #[arg(short, long)]
        follow: bool,
        #[arg(long)]
        attempt: Option<i32>,
    },
    /// Cancel a job (queued: it never runs; running: its processes are killed).
    Cancel { name: String },
}

#[derive(Args)]
pub(crate) struct ArtifactArgs {
    #[command(subcommand)]
    command: ArtifactCommand,
    #[command(flatten)]
    common: Common,
}

#[derive(Subcommand)]
enum ArtifactCommand {
    /// List a job's artifacts.
    List { job: String },
    /// Download one artifact (checked against its SHA-256).
    Download {
        job: String,
        /// The artifact's path in the runner (as `list` shows it).
        path: String,
        /// Where to write it (default: its file name, in the current directory; `-`: stdout).
        #[arg(short, long)]
        output: Option<PathBuf>,
        #[arg(long)]
        attempt: Option<i32>,
    },
}

#[derive(Args)]
pub(crate) struct RunnerGroupArgs {
    #[command(subcommand)]
    command: RunnerGroupCommand,
    #[command(flatten)]
    common: Common,
}

#[derive(Subcommand)]
enum RunnerGroupCommand {
    /// List runner groups: pods wanted, ready and idle; jobs queued and running.
    List {
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
}

async fn client_ns(c: &Common) -> Result<(kube::Client, String)> {
    let client = crate::kube_client(c.kubeconfig.as_deref()).await?;
    let ns = c
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    Ok((client, ns))
}

pub(crate) async fn job(args: JobArgs) -> Result<ExitCode> {
    let (client, ns) = client_ns(&args.common).await?;
    let api: Api<Job> = Api::namespaced(client.clone(), &ns);
    match args.command {
        JobCommand::Submit { file, attach } => {
            let text = if file.as_os_str() == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                s
            } else {
                std::fs::read_to_string(&file)
                    .with_context(|| format!("reading {}", file.display()))?
            };
            let mut job: Job = serde_yaml_ng::from_str(&text)
                .with_context(|| format!("{} is not a Job", file.display()))?;
            if let Err(e) = job.validate() {
                bail!("{e}");
            }
            let ns = job.namespace().unwrap_or(ns);
            job.metadata.namespace = Some(ns.clone());
            if job.metadata.name.is_none() && job.metadata.generate_name.is_none() {
                job.metadata.generate_name = Some("job-".into());
            }
            let api: Api<Job> = Api::namespaced(client.clone(), &ns);
            let created = api
                .create(&PostParams::default(), &job)
                .await
                .context("submitting the job")?;
            let name = created.name_any();
            eprintln!("job {ns}/{name} submitted");
            if !attach {
                println!("{name}");
                return Ok(ExitCode::SUCCESS);
            }
            attach_to(&client, &ns, &name).await
        }
        JobCommand::List { all_namespaces } => {
            let list = if all_namespaces {
                Api::<Job>::all(client).list(&ListParams::default()).await?
            } else {
                api.list(&ListParams::default()).await?
            };
            let mut items = list.items;
            items.sort_by_key(spur_api::jobs::queue_key);
            println!(
                "{:<20} {:<28} {:<16} {:<10} {:>5} {:>8}",
                "NAMESPACE", "NAME", "GROUP", "PHASE", "EXIT", "ATTEMPTS"
            );
            for j in items {
                let st = j.status.clone().unwrap_or_default();
                println!(
                    "{:<20} {:<28} {:<16} {:<10} {:>5} {:>8}",
                    j.namespace().unwrap_or_default(),
                    j.name_any(),
                    j.spec.runner_group,
                    st.phase.map_or("Queued", JobPhase::as_str),
                    st.exit_code.map(|c| c.to_string()).unwrap_or_default(),
                    st.attempts.len()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Get { name } => {
            let j = api
                .get(&name)
                .await
                .with_context(|| format!("reading job {name}"))?;
            print!("{}", describe(&j));
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Logs {
            name,
            follow,
            attempt,
        } => {
            api.get(&name)
                .await
                .with_context(|| format!("reading job {name}"))?;
            if follow && attempt.is_none() {
                follow_until_done(&client, &ns, &name).await?;
                return Ok(ExitCode::SUCCESS);
            }
            let mut out = std::io::stdout();
            stream_log(&client, &ns, &name, attempt, follow, &mut out).await?;
            Ok(ExitCode::SUCCESS)
        }
        JobCommand::Cancel { name } => {
            cancel(&api, &name).await?;
            eprintln!("job {ns}/{name}: cancel requested");
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn cancel(api: &Api<Job>, name: &str) -> Result<()> {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"canceled": true}})),
    )
    .await
    .with_context(|| format!("canceling job {name}"))?;
    Ok(())
}

/// What `spur job get` prints.
pub(crate) fn describe(j: &Job) -> String {
    use std::fmt::Write as _;
    let st = j.status.clone().unwrap_or_default();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "Job:          {}/{}",
        j.namespace().unwrap_or_default(),
        j.name_any()
    );
    let _ = writeln!(o, "Runner group: {}", j.spec.runner_group);
    if let Some(rc) = &j.spec.routing_context {
        if let Some(s) = &rc.sandbox {
            let _ = writeln!(o, "Sandbox:      {s}");
        }
        if let Some(g) = &rc.route_group {
            let _ = writeln!(o, "Route group:  {g}");
        }
    }
    if let Some(k) = &st.routing_key {
        let _ = writeln!(o, "Routing key:  {k}");
    }
    let phase = st.phase.map_or("Queued", JobPhase::as_str);
    let detail = match (st.phase, st.exit_code, st.canceled_by) {
        (Some(JobPhase::Canceled), _, Some(CanceledBy::Timeout)) => " (timed out)".to_owned(),
        (Some(JobPhase::Canceled), _, _) => " (by request)".to_owned(),
        (_, Some(c), _) => format!(" (exit code {c})"),
        _ => String::new(),
    };
    let _ = writeln!(o, "Phase:        {phase}{detail}");
    for c in &st.conditions {
        // Messages quote what the job chose (its result and artifact paths, its files' names).
        let _ = writeln!(
            o,
            "  {}={} {}: {}",
            c.type_,
            c.status,
            c.reason,
            crate::text::one_line(&c.message)
        );
    }
    if !st.attempts.is_empty() {
        let _ = writeln!(o, "Attempts:");
        for a in &st.attempts {
            let _ = writeln!(
                o,
                "  #{} on {}: {:?}{}{}",
                a.id,
                a.pod,
                a.phase,
                a.exit_code
                    .map(|c| format!(", exit {c}"))
                    .unwrap_or_default(),
                a.message
                    .as_ref()
                    .map(|m| format!(" ({})", crate::text::one_line(m)))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(b) = st.log_bytes {
        let _ = writeln!(
            o,
            "Log:          {b} bytes (spur job logs {})",
            j.name_any()
        );
    }
    if let Some(r) = &st.result {
        let _ = writeln!(o, "Result:\n  {}", crate::text::lines(r, "  "));
    }
    if !st.artifacts.is_empty() {
        let _ = writeln!(o, "Artifacts:");
        for a in &st.artifacts {
            let _ = writeln!(
                o,
                "  {} ({} bytes, sha256 {})",
                crate::text::one_line(&a.path),
                a.size,
                &a.sha256[..a.sha256.len().min(16)]
            );
        }
    }
    o
}

fn api_path(ns: &str, name: &str, sub: &str) -> String {
    format!("/apis/jobs.spur.dev/v1alpha1/namespaces/{ns}/jobs/{name}/{sub}")
}

/// Copies the log (one attempt, or the latest) to `out`, following it when asked.
async fn stream_log(
    client: &kube::Client,
    ns: &str,
    name: &str,
    attempt: Option<i32>,
    follow: bool,
    out: &mut impl std::io::Write,
) -> Result<()> {
    let mut q = Vec::new();
    if let Some(a) = attempt {
        q.push(format!("attempt={a}"));
    }
    if follow {
        q.push("follow=true".into());
    }
    let mut path = api_path(ns, name, "log");
    if !q.is_empty() {
        path = format!("{path}?{}", q.join("&"));
    }
    let req = http::Request::get(&path).body(Vec::new())?;
    let mut reader = client
        .request_stream(req)
        .await
        .map_err(|e| log_error(e, name))?;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = reader.read(&mut buf).await.context("reading the log")?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        out.flush()?;
    }
    Ok(())
}

fn log_error(e: kube::Error, name: &str) -> anyhow::Error {
    match &e {
        kube::Error::Api(s) if s.code == 403 => anyhow::anyhow!(
            "not allowed to read the log of job {name}: {} (RBAC: get on jobs/log in group jobs.spur.dev)",
            s.message
        ),
        kube::Error::Api(s) if s.code == 503 || s.code == 404 => anyhow::anyhow!(
            "the jobs API is not available ({}): is the chart's spur-jobs running? (kubectl get apiservice v1alpha1.jobs.spur.dev)",
            s.message
        ),
        _ => anyhow::anyhow!("reading the log of job {name}: {e}"),
    }
}

/// Follows the job's log across attempts until it ends; returns its final state.
async fn follow_until_done(client: &kube::Client, ns: &str, name: &str) -> Result<Job> {
    let api: Api<Job> = Api::namespaced(client.clone(), ns);
    let mut out = std::io::stdout();
    let mut attempt = 1;
    loop {
        let job = wait_for_attempt(&api, name, attempt).await?;
        if job
            .status
            .as_ref()
            .is_some_and(|s| s.attempts.len() as i32 >= attempt)
        {
            stream_log(client, ns, name, Some(attempt), true, &mut out).await?;
        }
        // Ended, or the attempt was lost and the job was queued again.
        loop {
            let job = api.get(name).await?;
            let st = job.status.clone().unwrap_or_default();
            if st.phase.is_some_and(JobPhase::is_terminal) {
                return Ok(job);
            }
            if st.attempts.len() as i32 > attempt || st.phase == Some(JobPhase::Queued) {
                eprintln!("[spur] attempt {attempt} lost its runner; the job is queued again");
                attempt += 1;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Waits until the job has its `attempt`th attempt (or ends), showing where it waits.
async fn wait_for_attempt(api: &Api<Job>, name: &str, attempt: i32) -> Result<Job> {
    let mut last = String::new();
    loop {
        let job = api
            .get(name)
            .await
            .with_context(|| format!("reading job {name}"))?;
        let st = job.status.clone().unwrap_or_default();
        if st.attempts.len() as i32 >= attempt || st.phase.is_some_and(JobPhase::is_terminal) {
            return Ok(job);
        }
        let msg = match st
            .conditions
            .iter()
            .find(|c| c.type_ == spur_api::jobs::ACCEPTED)
        {
            Some(c) if c.status != "True" => format!("not accepted yet: {}", c.message),
            _ => {
                let all = api.list(&ListParams::default()).await?.items;
                let mut queued: Vec<&Job> = all
                    .iter()
                    .filter(|j| {
                        j.spec.runner_group == job.spec.runner_group
                            && spur_api::jobs::phase(j) == JobPhase::Queued
                    })
                    .collect();
                queued.sort_by_key(|j| spur_api::jobs::queue_key(j));
                let pos = queued
                    .iter()
                    .position(|j| j.name_any() == name)
                    .map_or(0, |p| p + 1);
                let group = Api::<JobRunnerGroup>::namespaced(
                    api.clone().into_client(),
                    &job.namespace().unwrap_or_default(),
                )
                .get_opt(&job.spec.runner_group)
                .await?
                .and_then(|g| g.status)
                .unwrap_or_default();
                format!(
                    "waiting for a runner: position {pos} of {} in group {} ({} ready, {} idle)",
                    queued.len(),
                    job.spec.runner_group,
                    group.ready_replicas,
                    group.idle_replicas
                )
            }
        };
        if msg != last {
            eprintln!("[spur] {msg}");
            last = msg;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `submit --attach`: the output, then the job's exit code.
async fn attach_to(client: &kube::Client, ns: &str, name: &str) -> Result<ExitCode> {
    let api: Api<Job> = Api::namespaced(client.clone(), ns);
    let follow = follow_until_done(client, ns, name);
    tokio::pin!(follow);
    let job = loop {
        tokio::select! {
            r = &mut follow => break r?,
            _ = tokio::signal::ctrl_c() => {
                if std::io::stdin().is_terminal() {
                    eprint!("\n[spur] cancel job {name}? [y/N] ");
                    let answer = tokio::task::spawn_blocking(|| {
                        let mut s = String::new();
                        let _ = std::io::stdin().read_line(&mut s);
                        s
                    })
                    .await
                    .unwrap_or_default();
                    if answer.trim().eq_ignore_ascii_case("y") {
                        cancel(&api, name).await?;
                        eprintln!("[spur] cancel requested; waiting for the job to end");
                        continue;
                    }
                }
                eprintln!("[spur] detached; the job goes on: spur job logs -f {name} -n {ns}");
                return Ok(ExitCode::from(130));
            }
        }
    };
    let st = job.status.unwrap_or_default();
    eprintln!(
        "[spur] job {name}: {}{}",
        st.phase.map_or("?", JobPhase::as_str),
        st.exit_code
            .map(|c| format!(", exit code {c}"))
            .unwrap_or_default()
    );
    Ok(match (st.phase, st.exit_code, st.canceled_by) {
        (Some(JobPhase::Succeeded), _, _) => ExitCode::SUCCESS,
        (Some(JobPhase::Canceled), _, Some(CanceledBy::Timeout)) => ExitCode::from(124),
        (Some(JobPhase::Canceled), _, _) => ExitCode::from(130),
        (_, Some(c), _) => ExitCode::from(u8::try_from(c).unwrap_or(1).max(1)),
        _ => ExitCode::FAILURE,
    })
}

// === spur artifact ===

pub(crate) async fn artifact(args: ArtifactArgs) -> Result<ExitCode> {
    let (client, ns) = client_ns(&args.common).await?;
    match args.command {
        ArtifactCommand::List { job } => {
            let req = http::Request::get(api_path(&ns, &job, "artifacts")).body(Vec::new())?;
            let v: serde_json::Value = client
                .request(req)
                .await
                .map_err(|e| artifact_error(e, &job))?;
            println!("{:>7} {:>12}  {:<16} PATH", "ATTEMPT", "SIZE", "SHA256");
            for a in v["items"].as_array().into_iter().flatten() {
                println!(
                    "{:>7} {:>12}  {:<16} {}",
                    a["attempt"].to_string(),
                    a["size"].to_string(),
                    a["sha256"]
                        .as_str()
                        .unwrap_or_default()
                        .get(..16)
                        .unwrap_or_default(),
                    crate::text::one_line(a["path"].as_str().unwrap_or_default())
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        ArtifactCommand::Download {
            job,
            path,
            output,
            attempt,
        } => {
            let mut q = format!(
                "path={}",
                form_urlencoded::byte_serialize(path.as_bytes()).collect::<String>()
            );
            if let Some(a) = attempt {
                q.push_str(&format!("&attempt={a}"));
            }
            let req = http::Request::get(format!("{}?{q}", api_path(&ns, &job, "artifacts")))
                .body(Vec::new())?;
            let mut reader = client
                .request_stream(req)
                .await
                .map_err(|e| artifact_error(e, &job))?;
            let mut data = Vec::new();
            reader.read_to_end(&mut data).await.context("downloading")?;
            // The list says what the content must hash to.
            let list_req = http::Request::get(api_path(&ns, &job, "artifacts")).body(Vec::new())?;
            let list: serde_json::Value = client
                .request(list_req)
                .await
                .map_err(|e| artifact_error(e, &job))?;
            let want = list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["path"] == path.as_str() && attempt.is_none_or(|n| a["attempt"] == n))
                .max_by_key(|a| a["attempt"].as_i64())
                .and_then(|a| a["sha256"].as_str().map(str::to_owned));
            let got = spur_api::digest::sha256_hex(&data);
            if want.as_deref() != Some(got.as_str()) {
                bail!(
                    "downloaded {path} does not match its recorded SHA-256 (got {got}, want {want:?})"
                );
            }
            match output.as_deref() {
                Some(p) if p.as_os_str() == "-" => {
                    use std::io::Write as _;
                    std::io::stdout().write_all(&data)?;
                }
                other => {
                    let dest = other.map(PathBuf::from).unwrap_or_else(|| {
                        PathBuf::from(
                            std::path::Path::new(&path)
                                .file_name()
                                .map(|f| f.to_os_string())
                                .unwrap_or_else(|| "artifact".into()),
                        )
                    });
                    std::fs::write(&dest, &data)
                        .with_context(|| format!("writing {}", dest.display()))?;
                    eprintln!(
                        "{} ({} bytes, sha256 {got})",
                        crate::text::one_line(&dest.to_string_lossy()),
                        data.len()
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn artifact_error(e: kube::Error, job: &str) -> anyhow::Error {
    match &e {
        kube::Error::Api(s) if s.code == 403 => anyhow::anyhow!(
            "not allowed to read the artifacts of job {job}: {} (RBAC: get on jobs/artifacts in group jobs.spur.dev)",
            s.message
        ),
        _ => anyhow::anyhow!("artifacts of job {job}: {e}"),
    }
}

// === spur runner-group ===

pub(crate) async fn runner_group(args: RunnerGroupArgs) -> Result<ExitCode> {
    let (client, ns) = client_ns(&args.common).await?;
    let RunnerGroupCommand::List { all_namespaces } = args.command;
    let list = if all_namespaces {
        Api::<JobRunnerGroup>::all(client)
            .list(&ListParams::default())
            .await?
    } else {
        Api::<JobRunnerGroup>::namespaced(client, &ns)
            .list(&ListParams::default())
            .await?
    };
    println!(
        "{:<20} {:<20} {:<32} {:>7} {:>5} {:>4} {:>6} {:>7}",
        "NAMESPACE", "NAME", "IMAGE", "DESIRED", "READY", "IDLE", "QUEUED", "RUNNING"
    );
    for g in list.items {
        let st = g.status.clone().unwrap_or_default();
        println!(
            "{:<20} {:<20} {:<32} {:>7} {:>5} {:>4} {:>6} {:>7}",
            g.namespace().unwrap_or_default(),
            g.name_any(),
            g.spec.image,
            st.desired_replicas,
            st.ready_replicas,
            st.idle_replicas,
            st.queued,
            st.running
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn what_the_job_wrote_or_named_is_shown_with_its_control_characters_escaped() {
        let j: Job = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {"runnerGroup": "g", "command": ["true"], "resultPath": "/tmp/r"},
            "status": {"phase": "Succeeded", "exitCode": 0,
                       "result": "passed 3\nfindings 0\t(none)\n\u{1b}]0;pwned\u{7}\n",
                       "conditions": [{"type": "Finished", "status": "True", "reason": "Succeeded",
                                       "message": "result /tmp/\u{1b}[2Kx: is not a regular file",
                                       "lastTransitionTime": "2026-12-05T00:00:00Z"}],
                       "attempts": [{"id": 1, "pod": "p", "phase": "Succeeded",
                                     "message": "a\nFAKE LINE\u{1b}[1A"}],
                       "artifacts": [{"attempt": 1, "path": "/out/\u{1b}]0;t\u{7}", "size": 1,
                                      "sha256": "00"}]}
        }))
        .unwrap();
        let out = describe(&j);
        assert!(
            out.contains("Result:\n  passed 3\n  findings 0\t(none)\n  \\u{1b}]0;pwned\\u{7}\n"),
            "{out}"
        );
        assert!(out.contains("result /tmp/\\u{1b}[2Kx: is not"), "{out}");
        assert!(out.contains("(a\\nFAKE LINE\\u{1b}[1A)"), "{out}");
        assert!(out.contains("/out/\\u{1b}]0;t\\u{7} (1 bytes"), "{out}");
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out}");
    }
}
