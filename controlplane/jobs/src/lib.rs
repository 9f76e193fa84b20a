//! Jobs and JobRunnerGroups (`spur jobs`): runner pods that run Spur's job executor in any
//! image, a queue per runner group kept in the Jobs' status, attempt drivers that stream logs
//! and collect artifacts into a store, and an aggregated API that serves them under Kubernetes
//! RBAC (`jobs/log`, `jobs/artifacts` in group `jobs.spur.dev`). See docs/jobs.md.
//!
//! ```text
//! Job ──(Accepted: group, routing context)──► queue (status.phase Queued, submission order)
//! JobRunnerGroup ──► runner pods ──(idle, ready)──► attempt driver ──mTLS gRPC──► spur-job-executor
//!                                                        │ log chunks, artifacts
//!                                                        ▼
//!                                              store (object_store) ◄── aggregated API ◄── kubectl / spur job logs
//! ```

pub mod api;
mod controller;
mod driver;
mod leader;
mod metrics;
pub mod objects;
pub mod pki;
pub mod pods;
pub mod queue;
mod queue_metrics;
pub mod quota;
mod status;
pub mod store;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio_util::sync::CancellationToken;

pub use controller::run;
pub use leader::run_as;
pub use metrics::Metrics;
pub use queue_metrics::QueueGauges;
pub use spur_controller::leader::Election;

/// Everything that can fail in the jobs component.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("store: {0}")]
    Store(String),
    #[error("certificates: {0}")]
    Pki(String),
    #[error("executor of {pod}: {message}")]
    Executor { pod: String, message: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("waiting for {0}")]
    Pending(String),
    #[error("serving: {0}")]
    Serve(String),
    #[error("leader election: {0}")]
    Lease(String),
}

/// How the jobs component runs (flags of `spur-jobs serve`).
#[derive(Debug, Clone)]
pub struct Config {
    /// The namespace of the component (its CA Secret lives there).
    pub namespace: String,
    /// The image of runner pods' init container: Spur's, with `spur-job-executor`.
    pub executor_image: String,
    pub executor_pull_policy: Option<String>,
    /// The component's volume: running attempts' spools, and the objects unless `objects` says
    /// otherwise.
    pub store_dir: PathBuf,
    /// Where sealed logs and artifacts are kept.
    pub objects: objects::Objects,
    /// Output beyond this per attempt is dropped by the executor.
    pub max_log_bytes: u64,
    /// Artifacts beyond this per attempt are not kept (the attempt's status says so).
    pub max_artifact_bytes: u64,
    /// What one namespace's jobs may keep in the store (logs and artifacts, all jobs);
    /// output and artifacts past it are not kept.
    pub max_namespace_bytes: u64,
    /// Finished jobs (and what is stored for them) are deleted this long after they end.
    pub retention: Duration,
    /// Attempts of a job whose runner pod is lost before it is failed.
    pub max_attempts: i32,
    /// The component's StatefulSet, made the owner of what it creates in its namespace (the
    /// jobs CA Secret), so `helm uninstall` removes it.
    pub owner_statefulset: Option<String>,
    /// Custom headers an `Auto` job's requests carry its key in besides the standard carriers:
    /// the cluster's (chart `routingKeys.customHeaders`), for apps that propagate only those.
    pub routing_headers: Vec<String>,
}

impl Config {
    pub fn validate(&self) -> Result<(), Error> {
        self.objects.validate()?;
        if self.executor_image.trim().is_empty() {
            return Err(Error::Config("--executor-image is required".into()));
        }
        if self.max_attempts < 1 {
            return Err(Error::Config("--max-attempts must be at least 1".into()));
        }
        if self.max_namespace_bytes < self.max_log_bytes {
            return Err(Error::Config(
                "--max-namespace-bytes must be at least --max-log-bytes (one attempt's log)".into(),
            ));
        }
        if self.retention < Duration::from_secs(60) {
            return Err(Error::Config("--retention must be at least 1m".into()));
        }
        let carriers = spur_routing::ExtractConfig {
            custom_headers: self.routing_headers.clone(),
            query_param: None,
        };
        if let Err(e) = spur_routing::KeyExtractor::new(&carriers) {
            return Err(Error::Config(format!("--routing-header: {e}")));
        }
        Ok(())
    }
}

/// Shared by the controllers, the drivers and the API.
pub struct Context {
    pub client: Client,
    pub cfg: Config,
    pub store: store::Store,
    pub pki: pki::JobsPki,
    pub metrics: Metrics,
    pub(crate) drivers: driver::Drivers,
    pub(crate) live: driver::Live,
    pub(crate) wake: tokio::sync::mpsc::Sender<(String, String)>,
    /// The current term's token (crate::run replaces it): drivers stop with their term, and
    /// the attempts they drove are resumed by the next term, here or on another replica.
    pub(crate) term: std::sync::Mutex<CancellationToken>,
    /// The component's StatefulSet as an owner (of the CA Secret and the leader Lease).
    pub owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// The wake-up channel's receiving end, for [`run`]: one for the component, read by the
/// controllers of whichever term is running.
#[derive(Clone)]
pub struct Wakeups(Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<(String, String)>>>);

impl Wakeups {
    /// The runner groups woken, as a stream (held by one term at a time).
    pub(crate) fn stream(&self) -> impl futures_util::Stream<Item = (String, String)> + use<> {
        futures_util::stream::unfold(self.0.clone(), |rx| async move {
            let next = rx.lock().await.recv().await?;
            Some((next, rx))
        })
    }
}

impl Context {
    /// Loads or creates the jobs CA and opens the store.
    pub async fn new(
        client: Client,
        cfg: Config,
        metrics: Metrics,
    ) -> Result<(Arc<Context>, Wakeups), Error> {
        cfg.validate()?;
        let store = store::Store::open(&cfg.store_dir, &cfg.objects, cfg.max_namespace_bytes)?;
        store.count_stored().await.map_err(|e| match e {
            Error::Store(m) => Error::Store(format!(
                "cannot list what is stored in {}: {m}",
                cfg.objects.describe(&cfg.store_dir)
            )),
            e => e,
        })?;
        let owner = match cfg.owner_statefulset.as_deref().filter(|s| !s.is_empty()) {
            None => None,
            Some(name) => Some(statefulset_owner(&client, &cfg.namespace, name).await?),
        };
        let pki = pki::JobsPki::load_or_create(&client, &cfg.namespace, owner.as_ref()).await?;
        // A capacity that one term's burst of wake-ups never fills; a full queue drops wake-ups
        // that passes already pending cover.
        let (wake, rx) = tokio::sync::mpsc::channel(1024);
        Ok((
            Arc::new(Context {
                client,
                cfg,
                store,
                pki,
                metrics,
                drivers: driver::Drivers::default(),
                live: driver::Live::default(),
                wake,
                term: std::sync::Mutex::new(CancellationToken::new()),
                owner,
            }),
            Wakeups(Arc::new(tokio::sync::Mutex::new(rx))),
        ))
    }

    /// Asks for a pass over runner group `ns/name` (never blocks: a full queue already holds
    /// passes enough).
    pub(crate) fn wake(&self, ns: &str, name: &str) {
        let _ = self.wake.try_send((ns.to_owned(), name.to_owned()));
    }

    /// The running term's token.
    pub(crate) fn term(&self) -> CancellationToken {
        self.term.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn statefulset_owner(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference, Error> {
    let s =
        kube::Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), namespace)
            .get_opt(name)
            .await?
            .ok_or_else(|| {
                Error::Config(format!(
                    "owner StatefulSet {namespace}/{name} not found (--owner-statefulset)"
                ))
            })?;
    let uid = s
        .metadata
        .uid
        .ok_or_else(|| Error::Config(format!("StatefulSet {namespace}/{name} has no uid")))?;
    Ok(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: name.into(),
            uid,
            controller: None,
            block_owner_deletion: None,
        },
    )
}
