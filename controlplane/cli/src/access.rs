//! `spur access request exec|pod TEMPLATE`, `spur access list` and `spur access revoke`: file a
//! just-in-time access request, wait for it and print the command to run; see and end one's
//! grants (docs/access.md). The requester is whoever the kubeconfig authenticates as: the API
//! server stamps it, nothing here can choose it. `spur access approve` approves another user's
//! request where a template requires it. (The chart's second sweeper, which ends expired grants
//! while the operator is down, is `spur-operator sweep-access`.)

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use spur_api::access::{AccessRequestStatus, parse_access_duration};
use spur_api::conditions::READY;
use spur_api::{ExecAccessRequest, PodAccessRequest, TunnelAccessRequest};

#[derive(Args)]
pub(crate) struct AccessArgs {
    #[command(subcommand)]
    command: AccessCommand,
    /// Namespace (default: the kubeconfig's, else `default`).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG", global = true)]
    kubeconfig: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// Exec into a pod of the template's workload (ExecAccessTemplate).
    Exec,
    /// A debug pod cloned from the template's workload (PodAccessTemplate).
    Pod,
    /// A workstation tunnel token for `spur local connect` (TunnelAccessTemplate).
    Tunnel,
}

#[derive(Subcommand)]
enum AccessCommand {
    /// File a request against a template; with --wait, print the command to run once granted.
    Request {
        kind: Kind,
        /// The ExecAccessTemplate or PodAccessTemplate.
        template: String,
        /// A sandbox forking the template's workload: the grant is on its fork.
        #[arg(long)]
        sandbox: Option<String>,
        /// How long (default: the template's; above its maximum, the maximum is granted).
        #[arg(long)]
        duration: Option<String>,
        /// A pod of the workload (exec only; default: one the operator picks).
        #[arg(long)]
        pod: Option<String>,
        /// The workstation (tunnel only): what Sandboxes' `local[].workstation` name.
        #[arg(long)]
        workstation: Option<String>,
        /// Where to write the tunnel token (tunnel only; created with mode 0600). Only its
        /// SHA-256 goes to the cluster.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Wait until the grant is ready (or refused): `--wait` for up to 2m, `--wait=5m` for
        /// up to 5 minutes.
        #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "2m", value_parser = parse_wait)]
        wait: Option<Duration>,
    },
    /// List access requests: template, requester, pod, readiness, expiry.
    List {
        #[arg(short = 'A', long)]
        all_namespaces: bool,
    },
    /// Delete a request, ending its grant now (yours, or anyone's with the `revoke` verb).
    Revoke { kind: Kind, name: String },
    /// Approve another user's request, where its template requires approval (needs the verb
    /// `approve` on the request's kind, e.g. through the ClusterRole spur-access-approver).
    Approve { kind: Kind, name: String },
    /// The second access sweeper is now `spur-operator sweep-access` (the chart's CronJob
    /// spur-access-sweeper runs it); this says so.
    #[command(hide = true)]
    Sweep(crate::moved::Rest),
}

pub(crate) async fn run(args: AccessArgs) -> Result<ExitCode> {
    // Answered before connecting: the command moved, whatever the cluster.
    if let AccessCommand::Sweep(rest) = &args.command {
        return Ok(sweep_moved(rest));
    }
    let client = crate::kube_client(args.kubeconfig.as_deref()).await?;
    let ns = args
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    match args.command {
        AccessCommand::Request {
            kind,
            template,
            sandbox,
            duration,
            pod,
            workstation,
            token_file,
            wait,
        } => {
            if let Some(d) = &duration
                && parse_access_duration(d).is_none()
            {
                bail!("--duration {d:?}: expected e.g. 30m, 1h30m or 90s (at most 168h)");
            }
            if pod.is_some() && kind != Kind::Exec {
                bail!("--pod applies to exec requests only");
            }
            let mut spec = serde_json::json!({
                "templateName": template,
                "duration": duration,
                "sandbox": sandbox,
                "targetPod": pod,
            });
            if kind == Kind::Tunnel {
                let (Some(ws), Some(file)) = (&workstation, &token_file) else {
                    bail!("a tunnel request needs --workstation and --token-file");
                };
                let token = spur_api::tunnel::credentials::generate_token()?;
                write_private(file, &token)
                    .with_context(|| format!("writing the token to {}", file.display()))?;
                spec["workstation"] = serde_json::json!(ws);
                spec["tokenSha256"] =
                    serde_json::json!(spur_api::tunnel::credentials::token_sha256(&token));
            } else if workstation.is_some() || token_file.is_some() {
                bail!("--workstation and --token-file apply to tunnel requests only");
            }
            let name = request_name(&template);
            let meta = serde_json::json!({"generateName": name, "namespace": ns});
            let created = match kind {
                Kind::Exec => {
                    let r: ExecAccessRequest = serde_json::from_value(serde_json::json!({
                        "apiVersion": "spur.dev/v1alpha1", "kind": "ExecAccessRequest",
                        "metadata": meta, "spec": without_nulls(spec),
                    }))?;
                    Api::<ExecAccessRequest>::namespaced(client.clone(), &ns)
                        .create(&PostParams::default(), &r)
                        .await
                        .context("filing the ExecAccessRequest")?
                        .name_any()
                }
                Kind::Pod => {
                    let r: PodAccessRequest = serde_json::from_value(serde_json::json!({
                        "apiVersion": "spur.dev/v1alpha1", "kind": "PodAccessRequest",
                        "metadata": meta, "spec": without_nulls(spec),
                    }))?;
                    Api::<PodAccessRequest>::namespaced(client.clone(), &ns)
                        .create(&PostParams::default(), &r)
                        .await
                        .context("filing the PodAccessRequest")?
                        .name_any()
                }
                Kind::Tunnel => {
                    let r: TunnelAccessRequest = serde_json::from_value(serde_json::json!({
                        "apiVersion": "spur.dev/v1alpha1", "kind": "TunnelAccessRequest",
                        "metadata": meta, "spec": without_nulls(spec),
                    }))?;
                    Api::<TunnelAccessRequest>::namespaced(client.clone(), &ns)
                        .create(&PostParams::default(), &r)
                        .await
                        .context("filing the TunnelAccessRequest")?
                        .name_any()
                }
            };
            let Some(wait) = wait else {
                println!("{created}");
                return Ok(ExitCode::SUCCESS);
            };
            eprintln!("waiting for {created} to be granted ...");
            let deadline = Instant::now() + wait;
            loop {
                let status = match kind {
                    Kind::Exec => Api::<ExecAccessRequest>::namespaced(client.clone(), &ns)
                        .get_opt(&created)
                        .await?
                        .map(|r| r.status.unwrap_or_default()),
                    Kind::Pod => Api::<PodAccessRequest>::namespaced(client.clone(), &ns)
                        .get_opt(&created)
                        .await?
                        .map(|r| r.status.unwrap_or_default()),
                    Kind::Tunnel => Api::<TunnelAccessRequest>::namespaced(client.clone(), &ns)
                        .get_opt(&created)
                        .await?
                        .map(|r| r.status.unwrap_or_default()),
                };
                let Some(status) = status else {
                    eprintln!("{created} was deleted (expired or revoked) before it was granted");
                    return Ok(ExitCode::FAILURE);
                };
                if status.ready {
                    if let Some(at) = &status.expires_at {
                        eprintln!("granted until {}", at.0);
                    }
                    let mut command = status.access_message.unwrap_or_default();
                    if let Some(file) = &token_file {
                        command = command.replace("<token file>", &file.display().to_string());
                    }
                    println!("{command}");
                    return Ok(ExitCode::SUCCESS);
                }
                // Refusals that waiting will not change.
                if let Some(c) = refused(&status.conditions) {
                    eprintln!("{created} is not granted: {}: {}", c.reason, c.message);
                    return Ok(ExitCode::FAILURE);
                }
                if Instant::now() >= deadline {
                    let why = spur_api::conditions::find_condition(&status.conditions, READY)
                        .map(|c| format!("{}: {}", c.reason, c.message))
                        .unwrap_or_else(|| {
                            "no status yet (is the operator running with access enabled?)".into()
                        });
                    eprintln!("{created} is not ready after {wait:?}: {why}");
                    return Ok(ExitCode::FAILURE);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        AccessCommand::List { all_namespaces } => {
            let lp = ListParams::default();
            let (execs, pods, tunnels) = if all_namespaces {
                (
                    Api::<ExecAccessRequest>::all(client.clone())
                        .list(&lp)
                        .await?,
                    Api::<PodAccessRequest>::all(client.clone())
                        .list(&lp)
                        .await?,
                    Api::<TunnelAccessRequest>::all(client.clone())
                        .list(&lp)
                        .await?,
                )
            } else {
                (
                    Api::<ExecAccessRequest>::namespaced(client.clone(), &ns)
                        .list(&lp)
                        .await?,
                    Api::<PodAccessRequest>::namespaced(client.clone(), &ns)
                        .list(&lp)
                        .await?,
                    Api::<TunnelAccessRequest>::namespaced(client.clone(), &ns)
                        .list(&lp)
                        .await?,
                )
            };
            println!(
                "{:<16} {:<5} {:<28} {:<20} {:<36} {:<28} {:<6} EXPIRES",
                "NAMESPACE", "KIND", "NAME", "TEMPLATE", "REQUESTER", "POD", "READY"
            );
            let row = |ns: String,
                       kind: &str,
                       name: String,
                       template: &str,
                       requester: Option<&spur_api::access::Requester>,
                       status: Option<&AccessRequestStatus>| {
                let st = status.cloned().unwrap_or_default();
                println!(
                    "{:<16} {:<5} {:<28} {:<20} {:<36} {:<28} {:<6} {}",
                    ns,
                    kind,
                    name,
                    template,
                    requester.map(|r| r.username.as_str()).unwrap_or("-"),
                    st.pod_name.as_deref().unwrap_or("-"),
                    st.ready,
                    st.expires_at.map(|t| t.0.to_string()).unwrap_or_default()
                );
            };
            for r in execs.items {
                row(
                    r.namespace().unwrap_or_default(),
                    "exec",
                    r.name_any(),
                    &r.spec.template_name,
                    r.spec.requester.as_ref(),
                    r.status.as_ref(),
                );
            }
            for r in tunnels.items {
                let mut st = r.status.clone().unwrap_or_default();
                // The workstation stands where a pod would.
                st.pod_name = Some(format!("workstation {}", r.spec.workstation));
                row(
                    r.namespace().unwrap_or_default(),
                    "tunnel",
                    r.name_any(),
                    &r.spec.template_name,
                    r.spec.requester.as_ref(),
                    Some(&st),
                );
            }
            for r in pods.items {
                row(
                    r.namespace().unwrap_or_default(),
                    "pod",
                    r.name_any(),
                    &r.spec.template_name,
                    r.spec.requester.as_ref(),
                    r.status.as_ref(),
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        AccessCommand::Revoke { kind, name } => {
            let dp = DeleteParams::default();
            match kind {
                Kind::Exec => {
                    Api::<ExecAccessRequest>::namespaced(client, &ns)
                        .delete(&name, &dp)
                        .await
                        .with_context(|| format!("revoking {name}"))?;
                }
                Kind::Pod => {
                    Api::<PodAccessRequest>::namespaced(client, &ns)
                        .delete(&name, &dp)
                        .await
                        .with_context(|| format!("revoking {name}"))?;
                }
                Kind::Tunnel => {
                    Api::<TunnelAccessRequest>::namespaced(client, &ns)
                        .delete(&name, &dp)
                        .await
                        .with_context(|| format!("revoking {name}"))?;
                }
            }
            println!("{name} revoked");
            Ok(ExitCode::SUCCESS)
        }
        AccessCommand::Approve { kind, name } => approve(client, &ns, kind, &name).await,
        AccessCommand::Sweep(rest) => Ok(sweep_moved(&rest)),
    }
}

/// `spur access sweep` is now the operator binary's `sweep-access`.
fn sweep_moved(rest: &crate::moved::Rest) -> ExitCode {
    crate::moved::Moved::refuse_as("access sweep", "spur-operator sweep-access", rest)
}

/// Records the approval on the request: the approver's own username and groups, as the API
/// server authenticates them (the chart's policy spur-access-requests refuses anything else).
async fn approve(client: kube::Client, ns: &str, kind: Kind, name: &str) -> Result<ExitCode> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let me = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .context("asking the API server who you are (SelfSubjectReview)")?;
    let user = me.status.and_then(|s| s.user_info).unwrap_or_default();
    let Some(username) = user.username.filter(|u| !u.is_empty()) else {
        bail!("the API server did not say who you are: cannot record an approval");
    };
    let approver = spur_api::access::Approver {
        username,
        groups: user.groups.unwrap_or_default(),
    };
    let patch = Patch::Merge(serde_json::json!({
        "metadata": {"annotations": approver.annotations()}
    }));
    let pp = PatchParams::default();
    let what = format!(
        "approving {name} (you need the verb approve on its kind, and must not be its requester)"
    );
    match kind {
        Kind::Exec => {
            Api::<ExecAccessRequest>::namespaced(client, ns)
                .patch(name, &pp, &patch)
                .await
                .context(what)?;
        }
        Kind::Pod => {
            Api::<PodAccessRequest>::namespaced(client, ns)
                .patch(name, &pp, &patch)
                .await
                .context(what)?;
        }
        Kind::Tunnel => {
            Api::<TunnelAccessRequest>::namespaced(client, ns)
                .patch(name, &pp, &patch)
                .await
                .context(what)?;
        }
    }
    println!("{name} approved by {}", approver.username);
    Ok(ExitCode::SUCCESS)
}

/// `--wait`'s value: the same syntax as `--duration` (`90s`, `5m`, `1h30m`).
fn parse_wait(s: &str) -> Result<Duration, String> {
    spur_api::jobs::parse_job_duration(s)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s:?}: expected e.g. 90s, 5m or 1h30m"))
}

/// `<template>-` (the API server appends 5 characters), within the 253 of a name.
fn request_name(template: &str) -> String {
    let mut base: String = template.chars().take(200).collect();
    base.push('-');
    base
}

/// Writes `token` to `path`, readable by its owner alone.
fn write_private(path: &std::path::Path, token: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(token.as_bytes())?;
    f.write_all(b"\n")
}

fn without_nulls(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            serde_json::Value::Object(m.into_iter().filter(|(_, v)| !v.is_null()).collect())
        }
        v => v,
    }
}

/// A condition that says the request will not be granted without someone changing something.
fn refused(conditions: &[Condition]) -> Option<&Condition> {
    conditions.iter().find(|c| {
        c.status == "False"
            && matches!(
                c.reason.as_str(),
                "NotInAllowedGroups"
                    | "NoRequester"
                    | "Invalid"
                    | "InvalidDuration"
                    | "Expired"
                    | "PodGone"
                    | "PodRefused"
                    | "PodConflict"
                    | "WorkstationTaken"
                    | "NoSandbox"
                    | "NoTokenNamespace"
            )
    })
}
