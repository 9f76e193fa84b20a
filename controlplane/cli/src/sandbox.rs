//! `spur sandbox get` and `spur preview open`: a sandbox as a person wants to see it (key,
//! readiness, resources, forks, time left, preview URLs), and its preview URL in a browser.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand};
use kube::Api;
use spur_api::routingconfig::RouteSpan;
use spur_api::{RouteGroup, RoutingConfig, Sandbox};

#[derive(Args)]
pub(crate) struct SandboxArgs {
    #[command(subcommand)]
    command: SandboxCommand,
}

#[derive(Subcommand)]
enum SandboxCommand {
    /// Show a sandbox: routing key, readiness, forks, expiry and preview URLs.
    Get {
        name: String,
        /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
        #[arg(long, env = "SPUR_KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
    },
}

#[derive(Args)]
pub(crate) struct PreviewArgs {
    #[command(subcommand)]
    command: PreviewCommand,
}

#[derive(Subcommand)]
enum PreviewCommand {
    /// Print a sandbox's (or route group's) preview URL and open it in the browser.
    Open {
        /// The sandbox or route group.
        name: String,
        /// The endpoint (default: the only one).
        endpoint: Option<String>,
        /// Print the URL only.
        #[arg(long)]
        print: bool,
        /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
        #[arg(long, env = "SPUR_KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
    },
}

const NO_URLS: &str = "no preview URLs in its status: the operator publishes them when it knows \
                       the hub's preview domain (chart value agent.previewDomain; docs/hub.md)";

pub(crate) async fn sandbox(args: SandboxArgs) -> Result<ExitCode> {
    let SandboxCommand::Get { name, kubeconfig } = args.command;
    let client = crate::kube_client(kubeconfig.as_deref()).await?;
    let sb = Api::<Sandbox>::all(client.clone())
        .get_opt(&name)
        .await
        .with_context(|| format!("reading Sandbox {name}"))?
        .with_context(|| format!("no Sandbox named {name}"))?;
    // What its forks receive from Kafka: the route history's spans in its RoutingConfig, read
    // with the user's own rights (a cluster-scoped object: a user may not be allowed to).
    let rc_name = spur_api::names::sandbox_routing_config_name(&name);
    let spans = match Api::<RoutingConfig>::all(client).get_opt(&rc_name).await {
        Ok(rc) => Ok(rc.map(|rc| rc.spans().to_vec()).unwrap_or_default()),
        Err(kube::Error::Api(e)) if e.code == 403 => Err(format!(
            "RoutingConfig {rc_name} is not readable with your credentials"
        )),
        Err(e) => Err(format!("cannot read RoutingConfig {rc_name}: {e}")),
    };
    print!("{}", describe(&sb));
    print!("{}", describe_records(&sb, &spans));
    Ok(ExitCode::SUCCESS)
}

/// The "Kafka records" part of `spur sandbox get`: since when each fork's keyed records are its
/// own (docs/async.md), or why that is not known.
pub(crate) fn describe_records(sb: &Sandbox, spans: &Result<Vec<RouteSpan>, String>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if sb.spec.forks.is_empty() {
        return out;
    }
    let _ = writeln!(out, "Kafka records (keyed, to forks with a Kafka relay):");
    match spans {
        Err(why) => {
            let _ = writeln!(out, "  unknown: {why}");
        }
        Ok(spans) if spans.is_empty() => {
            let _ = writeln!(
                out,
                "  none (no fork with a Kafka relay is ready: a fork's keyed records are its own from 5 s after it is)"
            );
        }
        Ok(spans) => {
            let at = |ms: i64| {
                k8s_openapi::jiff::Timestamp::from_millisecond(ms)
                    .map_or_else(|_| format!("{ms} ms"), |t| t.to_string())
            };
            for s in spans {
                let _ = write!(
                    out,
                    "  {}/{}: records stamped from {}",
                    s.baseline.namespace,
                    s.baseline.name,
                    at(s.since_ms)
                );
                // Set when the sandbox is being deleted: its forks drain until a while past it.
                match s.until_ms {
                    Some(until) => {
                        let _ = writeln!(out, " until {} (the sandbox is going)", at(until));
                    }
                    None => {
                        let _ = writeln!(out);
                    }
                }
            }
        }
    }
    out
}

/// The text `spur sandbox get` prints.
pub(crate) fn describe(sb: &Sandbox) -> String {
    use std::fmt::Write as _;
    let st = sb.status.clone().unwrap_or_default();
    let mut out = String::new();
    let name = sb.metadata.name.as_deref().unwrap_or_default();
    let _ = writeln!(out, "Sandbox:     {name}");
    if let Some(d) = &sb.spec.description {
        let _ = writeln!(out, "Description: {d}");
    }
    let _ = writeln!(
        out,
        "Routing key: {}",
        st.routing_key.as_deref().unwrap_or("(not assigned yet)")
    );
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready");
    let _ = match ready {
        Some(c) if c.status == "True" => writeln!(out, "Ready:       yes"),
        Some(c) => writeln!(out, "Ready:       no ({}: {})", c.reason, c.message),
        None => writeln!(out, "Ready:       unknown"),
    };
    if let Some(t) = &st.expires_at {
        let _ = writeln!(out, "Expires:     {}", t.0);
    }
    if !st.resources.is_empty() {
        let _ = writeln!(out, "Resources:");
        for r in &st.resources {
            let _ = writeln!(
                out,
                "  {} ({}): {}{}",
                r.name,
                r.plugin.as_deref().unwrap_or("plugin not resolved yet"),
                r.phase,
                r.message
                    .as_deref()
                    .map(|m| format!(" - {m}"))
                    .unwrap_or_default()
            );
            if let Some(secret) = &r.output_secret {
                let _ = writeln!(out, "    outputs in Secret {secret} of each fork namespace");
            }
        }
    }
    if !st.forks.is_empty() {
        let _ = writeln!(out, "Forks:");
        for f in &st.forks {
            let _ = writeln!(
                out,
                "  {}/{} -> {} ({})",
                f.fork_of.namespace,
                f.fork_of.name,
                f.fork.as_deref().unwrap_or("(not created yet)"),
                if f.ready { "ready" } else { "not ready" }
            );
        }
    }
    let endpoints = sb
        .spec
        .default_route_group
        .as_ref()
        .map(|g| g.endpoints.as_slice())
        .unwrap_or_default();
    if !endpoints.is_empty() {
        let _ = writeln!(out, "Previews:");
        for e in endpoints {
            let url = st
                .endpoints
                .iter()
                .find(|s| s.name == e.name)
                .map_or("(no URL: the operator has no preview domain)", |s| {
                    s.url.as_str()
                });
            let _ = writeln!(out, "  {:<12} {url}  -> {}", e.name, e.target);
        }
    }
    out
}

pub(crate) async fn preview(args: PreviewArgs) -> Result<ExitCode> {
    let PreviewCommand::Open {
        name,
        endpoint,
        print,
        kubeconfig,
    } = args.command;
    let client = crate::kube_client(kubeconfig.as_deref()).await?;
    let urls = match Api::<Sandbox>::all(client.clone()).get_opt(&name).await? {
        Some(sb) => sb.status.map(|s| s.endpoints).unwrap_or_default(),
        None => match Api::<RouteGroup>::all(client).get_opt(&name).await? {
            Some(rg) => rg.status.map(|s| s.endpoints).unwrap_or_default(),
            None => bail!("no Sandbox or RouteGroup named {name}"),
        },
    };
    if urls.is_empty() {
        bail!("{name} has {NO_URLS}");
    }
    let url = match &endpoint {
        Some(e) => urls.iter().find(|u| &u.name == e).with_context(|| {
            let known: Vec<&str> = urls.iter().map(|u| u.name.as_str()).collect();
            format!(
                "{name} has no endpoint {e:?} (it has: {})",
                known.join(", ")
            )
        })?,
        None if urls.len() == 1 => &urls[0],
        None => {
            let known: Vec<&str> = urls.iter().map(|u| u.name.as_str()).collect();
            bail!(
                "{name} has several endpoints; name one: {}",
                known.join(", ")
            )
        }
    };
    println!("{}", url.url);
    if !print {
        // A desktop's opener; on a server there is none, and the printed URL is the answer.
        match std::process::Command::new("xdg-open")
            .arg(&url.url)
            .status()
        {
            Ok(s) if s.success() => {}
            _ => eprintln!("(no browser opener here; open the URL above yourself)"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_show_their_phase_failure_and_secret() {
        let sb: Sandbox = serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "customer-db"},
            "spec": {"resources": [{"name": "db", "plugin": "postgres"}],
                     "forks": [{"forkOf": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"}}]},
            "status": {"routingKey": "k1", "resources": [
                {"name": "db", "plugin": "postgres.1.0.0", "phase": "Failed",
                 "message": "step user failed: the step failed (exit code 3)"},
                {"name": "cache", "phase": "Ready", "outputSecret": "customer-db-cache-1"}
            ]}
        }))
        .unwrap();
        let text = describe(&sb);
        assert!(
            text.contains(
                "  db (postgres.1.0.0): Failed - step user failed: the step failed (exit code 3)"
            ),
            "{text}"
        );
        assert!(
            text.contains("  cache (plugin not resolved yet): Ready"),
            "{text}"
        );
        assert!(
            text.contains("outputs in Secret customer-db-cache-1 of each fork namespace"),
            "{text}"
        );
        let span: RouteSpan = serde_json::from_value(serde_json::json!({
            "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"},
            "sandbox": "customer-db", "sinceMs": 1_800_000_000_123i64
        }))
        .unwrap();
        assert_eq!(
            describe_records(&sb, &Ok(vec![span])),
            "Kafka records (keyed, to forks with a Kafka relay):\n  hotrod/customer: records stamped from 2027-01-15T08:00:00.123Z\n"
        );
        let ending: RouteSpan = serde_json::from_value(serde_json::json!({
            "baseline": {"kind": "Deployment", "namespace": "hotrod", "name": "customer"},
            "sandbox": "customer-db", "sinceMs": 1_800_000_000_123i64,
            "untilMs": 1_800_000_060_000i64
        }))
        .unwrap();
        assert_eq!(
            describe_records(&sb, &Ok(vec![ending])),
            "Kafka records (keyed, to forks with a Kafka relay):\n  hotrod/customer: records stamped from 2027-01-15T08:00:00.123Z until 2027-01-15T08:01:00Z (the sandbox is going)\n"
        );
        assert!(describe_records(&sb, &Ok(vec![])).contains("none (no fork with a Kafka relay"));
        assert!(
            describe_records(&sb, &Err("not readable".into())).contains("unknown: not readable")
        );
    }
}
