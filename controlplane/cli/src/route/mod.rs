//! `spur route explain`: where a request carrying a routing key to a Service goes. The key's
//! owner (a Sandbox or RouteGroup) and the destination its status gives, then, for each baseline
//! pod behind the Service, whether that pod's sidecar has the rule in its routing table now (its
//! `/config_dump`, read through a port-forward, which the sidecar answers for loopback clients
//! only). Everything is read with the user's own credentials (docs/cli.md).

mod explain;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Args, Subcommand};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::Api;
use kube::api::ListParams;
use spur_api::{RouteGroup, Sandbox};

use crate::sidecar_admin::{ViewError, admin_port, short};
use explain::SidecarView;

#[derive(Args)]
pub(crate) struct RouteArgs {
    #[command(subcommand)]
    command: RouteCommand,
}

#[derive(Subcommand)]
enum RouteCommand {
    /// Where a request with a routing key to a Service goes: the key's sandbox or route group,
    /// its destination, and for each baseline pod whether its sidecar has the rule live.
    #[command(
        after_help = "Exit codes: 0 the rule is live in every baseline pod's sidecar; 1 an error (a refusal, no such Service or port); 2 a usage error; 3 some baseline pod would not route the key (no sidecar, no rule, its sidecar could not be read), or the Service has no selector or no running pod.\nReading a sidecar needs `create` on pods/portforward in the Service's namespace (the `edit` role has it); without it the command is refused and prints nothing."
    )]
    Explain(ExplainArgs),
}

#[derive(Args)]
struct ExplainArgs {
    /// The Service: SERVICE[.NAMESPACE][:PORT] (all its ports without one).
    target: String,
    /// The routing key.
    #[arg(long)]
    key: String,
    /// The Service's namespace when the target does not name one [default: the kubeconfig's].
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

/// Largest `/config_dump` read from a sidecar.
const MAX_DUMP: usize = 16 << 20;
/// How long one sidecar may take to answer.
const SIDECAR_TIMEOUT: Duration = Duration::from_secs(15);

pub(crate) async fn run(args: RouteArgs) -> Result<ExitCode> {
    let RouteCommand::Explain(a) = args.command;
    let target = explain::parse_target(&a.target).map_err(anyhow::Error::msg)?;
    if let (Some(t), Some(n)) = (&target.namespace, &a.namespace)
        && t != n
    {
        anyhow::bail!(
            "{}: names namespace {t}, and --namespace says {n}",
            a.target
        );
    }
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let ns = target
        .namespace
        .clone()
        .or(a.namespace.clone())
        .unwrap_or_else(|| client.default_namespace().to_string());
    let name = &target.name;
    let svc = Api::<Service>::namespaced(client.clone(), &ns)
        .get_opt(name)
        .await
        .map_err(|e| crate::sandbox::api_error(e, &format!("reading Service {ns}/{name}")))?
        .with_context(|| format!("no Service {ns}/{name}"))?;
    let ports = explain::service_ports(&svc, target.port)
        .map_err(|e| anyhow::anyhow!("Service {ns}/{name}: {e}"))?;
    let key = &a.key;

    // Everything is read before anything is printed: a refusal (no right to list the pods or
    // to port-forward to them) is the command's error, and shows nothing of the namespace.
    let selector = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .unwrap_or_default();
    let pods_api = Api::<Pod>::namespaced(client.clone(), &ns);
    let mut pods: Vec<Pod> = Vec::new();
    if !selector.is_empty() {
        let labels: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        pods = pods_api
            .list(&ListParams::default().labels(&labels.join(",")))
            .await
            .map_err(|e| {
                crate::sandbox::api_error(e, &format!("listing the pods of Service {ns}/{name}"))
            })?
            .items
            .into_iter()
            .filter(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .collect();
        pods.sort_by_key(|p| p.metadata.name.clone());
    }
    let mut views = Vec::with_capacity(pods.len());
    for pod in &pods {
        let view = match pod_view(&pods_api, &ports, pod, key).await {
            Err(ViewError::Forbidden(why)) => {
                anyhow::bail!(
                    "reading the sidecar of pod {ns}/{}: {why} (needs create on pods/portforward in {ns})",
                    pod.metadata.name.clone().unwrap_or_default()
                )
            }
            Err(ViewError::Other(why)) => SidecarView::Unreadable(why),
            Ok(view) => view,
        };
        views.push(view);
    }

    // The key's owner, from what the user may list.
    let sandboxes = Api::<Sandbox>::all(client.clone())
        .list(&ListParams::default())
        .await;
    let groups = Api::<RouteGroup>::all(client.clone())
        .list(&ListParams::default())
        .await;
    match (&sandboxes, &groups) {
        (Ok(sbs), Ok(gs)) => match explain::owner(key, &sbs.items, &gs.items, &ns, name) {
            None => outln!(
                "Key {key}: no Sandbox or RouteGroup you can list has it; requests with it reach the baseline."
            ),
            Some(own) => {
                outln!("Key {key}: {}.", own.what);
                for (sb, dests) in &own.sandboxes {
                    if dests.is_empty() {
                        outln!("  sandbox {sb}: forks nothing behind Service {ns}/{name}");
                    } else {
                        outln!(
                            "  sandbox {sb}: Service {ns}/{name} -> {}",
                            dests.join(", ")
                        );
                    }
                }
            }
        },
        (Err(e), _) | (_, Err(e)) => outln!(
            "Key {key}: its owner is not known ({}); the sidecars below still say where it goes.",
            short(e)
        ),
    }
    if selector.is_empty() {
        outln!("Service {ns}/{name} has no selector: no baseline pods to look at.");
        return Ok(ExitCode::from(crate::sandbox::EXIT_FAILED));
    }
    if pods.is_empty() {
        outln!("Service {ns}/{name} has no running pod.");
        return Ok(ExitCode::from(crate::sandbox::EXIT_FAILED));
    }
    outln!("Baseline pods behind Service {ns}/{name} ({}):", pods.len());
    let mut all_live = true;
    for (pod, view) in pods.iter().zip(views) {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let line = match view {
            SidecarView::Live {
                version,
                destinations,
            } => {
                let to: Vec<String> = destinations
                    .iter()
                    .map(|(wp, d)| format!("port {wp} -> {}", d.join(" | ")))
                    .collect();
                format!("live (routing table version {version}): {}", to.join("; "))
            }
            SidecarView::Missing { version, ports } => {
                all_live = false;
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                format!(
                    "NOT live (routing table version {version}; no rule for port {}): keyed requests reaching this pod go to the baseline",
                    ports.join(", ")
                )
            }
            SidecarView::Unreadable(why) => {
                all_live = false;
                format!("unknown: {why}")
            }
        };
        outln!("  {pod_name}  {line}");
    }
    Ok(if all_live {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::sandbox::EXIT_FAILED)
    })
}

/// One pod's sidecar view of `key`.
async fn pod_view(
    pods: &Api<Pod>,
    ports: &[k8s_openapi::api::core::v1::ServicePort],
    pod: &Pod,
    key: &str,
) -> Result<SidecarView, ViewError> {
    let Some(admin) = admin_port(pod) else {
        return Err(ViewError::Other(
            "no Spur sidecar in this pod: keyed requests reaching it go to the baseline".into(),
        ));
    };
    let workload_ports = explain::workload_ports(ports, pod)?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let dump = tokio::time::timeout(
        SIDECAR_TIMEOUT,
        crate::sidecar_admin::get_json(pods, &name, admin, "/config_dump", MAX_DUMP),
    )
    .await
    .map_err(|_| format!("its sidecar did not answer within {SIDECAR_TIMEOUT:?}"))??;
    Ok(explain::sidecar_view(&dump, key, &workload_ports))
}
