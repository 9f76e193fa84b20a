//! What the benchmarks on a real kube-apiserver (`sandbox_latency`, `sandbox_scale`) share: the
//! Spur CRDs, baseline Deployments + Services, `Sandbox`es forking them, a stand-in kubelet, and
//! CPU and memory readings of a process.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use spur_api::Sandbox;
use spur_kube_harness::KubeApi;
use tokio_util::sync::CancellationToken;

use crate::bench::proc;

/// The namespace of the baselines and of their forks.
pub const NS: &str = "bench";
/// The baselines' container port (named `http`), which their routing rules are for.
pub const APP_PORT: u16 = 8080;

/// Installs every CRD in charts/spur/crds, in file-name order.
pub async fn install_crds(api: &KubeApi) -> Result<()> {
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/spur/crds");
    let mut files: Vec<_> = std::fs::read_dir(&crds)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.sort();
    for f in files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
    {
        api.install_crd_file(f).await?;
    }
    Ok(())
}

/// Creates the namespace [`NS`] and in it one Deployment + Service per name in `baselines`.
pub async fn setup_baselines(client: &Client, baselines: &[&str]) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    for name in baselines {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": name, "image": "web:1",
                                                           "ports": [{"name": "http", "containerPort": APP_PORT}]}]}}}
        }))?;
        Api::<Deployment>::namespaced(client.clone(), NS)
            .create(&PostParams::default(), &d)
            .await?;
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": "http"}]}
        }))?;
        Api::<Service>::namespaced(client.clone(), NS)
            .create(&PostParams::default(), &svc)
            .await?;
    }
    Ok(())
}

/// A `Sandbox` with one fork per baseline Deployment in `baselines`, each with its image changed.
pub fn sandbox(name: &str, baselines: &[&str]) -> Result<Sandbox> {
    let forks: Vec<_> = baselines
        .iter()
        .map(|b| {
            json!({"forkOf": {"kind": "Deployment", "namespace": NS, "name": b},
                   "customizations": {"images": [{"image": "web:dev"}]}})
        })
        .collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": name},
        "spec": {"forks": forks}
    }))?)
}

/// Creates the [`sandbox`] `name`; returns its routing key.
pub async fn create_sandbox(api: &Api<Sandbox>, name: &str, baselines: &[&str]) -> Result<String> {
    let created = api
        .create(&PostParams::default(), &sandbox(name, baselines)?)
        .await?;
    Ok(spur_api::names::routing_key(
        &created.uid().context("no uid")?,
    ))
}

/// Creates a [`sandbox`] per name, `clients` create calls at a time; returns their routing keys,
/// in the order the creates completed.
pub async fn create_sandboxes(
    api: &Api<Sandbox>,
    names: impl IntoIterator<Item = String>,
    baselines: &[&str],
    clients: usize,
) -> Result<Vec<String>> {
    futures_util::stream::iter(names)
        .map(|name| async move { create_sandbox(api, &name, baselines).await })
        .buffer_unordered(clients)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// How many status patches the stand-in kubelet has in flight at once (a kubelet and the
/// Deployment controller each write status from several workers).
const KUBELET_PATCHES: usize = 8;
/// How long a failed status patch waits before it is tried again.
const KUBELET_RETRY: Duration = Duration::from_millis(250);

/// Marks every fork Deployment ready once per generation, as a kubelet and the Deployment
/// controller would (instantly), [`KUBELET_PATCHES`] at a time. A patch that fails (the API
/// server busy or timing out under a bulk create) is tried again until it lands or a newer
/// generation replaces it: a fork never stays unready because one write was lost, which would
/// leave its sandbox unconverged for good and the bench measuring the stand-in, not Spur.
pub async fn fake_kubelet(client: Client, stop: CancellationToken) {
    let api: Api<Deployment> = Api::namespaced(client, NS);
    let wc = watcher::Config::default().labels("app.kubernetes.io/managed-by=spur");
    // The generation marked ready, per Deployment.
    let mut done: HashMap<String, i64> = HashMap::new();
    // The newest generation seen and not yet marked, per Deployment, in arrival order.
    let mut wanted: HashMap<String, i64> = HashMap::new();
    let mut queue: VecDeque<String> = VecDeque::new();
    let mut in_flight = FuturesUnordered::new();
    let mut events = watcher(api.clone(), wc)
        .default_backoff()
        .applied_objects()
        .boxed();
    loop {
        while in_flight.len() < KUBELET_PATCHES {
            let Some(name) = queue.pop_front() else { break };
            let Some(&generation) = wanted.get(&name) else {
                continue;
            };
            let api = api.clone();
            in_flight.push(async move {
                let status = json!({"status": {"observedGeneration": generation, "replicas": 1,
                    "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}});
                let result = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await;
                // Gone (deleted meanwhile): nothing left to mark, counted as done.
                let gone = matches!(&result, Err(kube::Error::Api(s)) if s.is_not_found());
                let ok = result.is_ok() || gone;
                if !ok {
                    tokio::time::sleep(KUBELET_RETRY).await;
                }
                (name, generation, ok)
            });
        }
        tokio::select! {
            () = stop.cancelled() => return,
            Some((name, generation, ok)) = in_flight.next(), if !in_flight.is_empty() => {
                if ok {
                    done.insert(name.clone(), generation);
                }
                match wanted.get(&name) {
                    // Marked, and nothing newer arrived meanwhile.
                    Some(&g) if ok && g == generation => { wanted.remove(&name); }
                    // Failed, or a newer generation is waiting: (again) behind the others.
                    Some(_) => queue.push_back(name),
                    None => {}
                }
            }
            next = events.next() => match next {
                Some(Ok(d)) => {
                    let generation = d.metadata.generation.unwrap_or(0);
                    let name = d.name_any();
                    if done.get(&name) == Some(&generation) {
                        continue;
                    }
                    // Queued once: a patch in flight for it re-queues it when it ends.
                    if wanted.insert(name.clone(), generation).is_none() {
                        queue.push_back(name);
                    }
                }
                Some(Err(_)) => continue,
                None => return,
            },
        }
    }
}

/// utime + stime of a process, in seconds (ticks of `CLK_TCK`); 0 if it cannot be read.
pub fn cpu_seconds(pid: u32) -> f64 {
    proc::cpu_seconds(pid).unwrap_or(0.0)
}

/// Resident memory (VmRSS) of a process, in MiB; 0 if it cannot be read.
pub fn rss_mib(pid: u32) -> f64 {
    proc::status_kib(pid, "VmRSS").map_or(0.0, |kib| kib as f64 / 1024.0)
}
