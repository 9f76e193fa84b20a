//! The L4 listener API (`spur.l4.v1.Listeners`, proto/l4.proto) for Spur gateway pods, served
//! on the gRPC port next to `routes.Routes` (docs/l4.md, "Gateway").
//!
//! ```text
//! ListenerSets + EndpointSlices + RoutingConfigs ─KubeStore─► Model (every set rendered) ─► Index
//!   Watch(namespace, pod): pod labels (GET, refreshed) ─► sets whose selector picks the pod,
//!        merged oldest first ─► ListenersUpdate (spur_l4::L4Config JSON) only when it changed
//!   Report(namespace, pod, endpoint health) ─► status.gateways[] of those sets (server-side apply)
//! ```
//!
//! Each Watch is its own task with a two-slot queue: a gateway that stops reading stalls only
//! its own task, which then sends the latest configuration, never a backlog. Readers are
//! checked as for the Routes API ([`crate::auth`]): a pod-bound token only for its own pod,
//! other identities with `list listenersets` in the namespace; an open stream is checked again
//! from time to time and when its token expires.

mod metrics;
mod report;

// The model is its own module: the index carries it from the store to this server.
pub use crate::l4_model::Model;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use spur_proto::l4::listeners_server::{Listeners, ListenersServer};
use spur_proto::l4::{GatewayReport, ListenersUpdate, ReportReply, WatchListenersRequest};
use spur_runtime::Drain;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::Index;
use crate::auth::{Authenticator, Denied, Scope};
use crate::metrics::Metrics;
use metrics::L4Metrics;
use report::{Gateway, Gateways, Writer};

/// How soon a stream's reader is checked again when the API server could not answer.
const RECHECK_RETRY: Duration = Duration::from_secs(30);
/// Most endpoints one report may carry.
const MAX_REPORT_ENDPOINTS: usize = 20_000;
/// How long the last message of an ending stream (its refusal) may wait for queue space.
const LAST_WORDS: Duration = Duration::from_secs(1);

/// How the L4 listener API is served (`--kubernetes` only: it needs the API server).
#[derive(Clone)]
pub struct L4Options {
    /// Reads gateway pods (their labels) and writes `status.gateways` of ListenerSets.
    pub client: Client,
    /// How often an unchanged `status.gateways` entry is written again (its `updatedAt`).
    pub report_refresh: Duration,
    /// How often a streaming gateway's pod is read again (a label change moves it to other
    /// sets within this).
    pub pod_refresh: Duration,
}

impl L4Options {
    pub fn new(client: Client) -> Self {
        L4Options {
            client,
            report_refresh: Duration::from_secs(30),
            pod_refresh: Duration::from_secs(30),
        }
    }
}

impl fmt::Debug for L4Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("L4Options")
            .field("report_refresh", &self.report_refresh)
            .field("pod_refresh", &self.pod_refresh)
            .finish_non_exhaustive()
    }
}

/// The `Listeners` service, plus a task that logs the model's problems when they change.
pub(crate) fn service(
    options: &L4Options,
    index: &Index,
    auth: &Authenticator,
    metrics: &Metrics,
    registry: &mut Registry,
    tasks: &Drain,
    stop: CancellationToken,
) -> ListenersServer<Handler> {
    let l4 = L4Metrics::register(registry);
    let mut models = index.subscribe_l4();
    let gauge = l4.set_problems.clone();
    let log_stop = stop.clone();
    tasks.spawn(async move {
        let mut last: Vec<String> = Vec::new();
        loop {
            let model = models.borrow_and_update().clone();
            if let Some(m) = model
                && m.problems != last
            {
                for p in m.problems.iter().filter(|p| !last.contains(p)) {
                    tracing::warn!(problem = %p, "ListenerSet not (fully) served");
                }
                gauge.set(i64::try_from(m.problems.len()).unwrap_or(i64::MAX));
                last.clone_from(&m.problems);
            }
            tokio::select! {
                () = log_stop.cancelled() => return,
                r = models.changed() => if r.is_err() { return },
            }
        }
    });
    ListenersServer::new(Handler {
        index: index.clone(),
        auth: auth.clone(),
        metrics: metrics.clone(),
        writer: Writer {
            client: options.client.clone(),
            refresh: options.report_refresh,
            metrics: l4.clone(),
        },
        l4,
        client: options.client.clone(),
        gateways: Gateways::default(),
        pod_refresh: options.pod_refresh,
        tasks: tasks.clone(),
        stop,
    })
}

#[derive(Clone)]
pub(crate) struct Handler {
    index: Index,
    auth: Authenticator,
    metrics: Metrics,
    l4: L4Metrics,
    writer: Writer,
    client: Client,
    gateways: Gateways,
    pod_refresh: Duration,
    tasks: Drain,
    stop: CancellationToken,
}

impl Handler {
    async fn authorize<T>(
        &self,
        request: &Request<T>,
        namespace: &str,
        pod: &str,
    ) -> Result<crate::auth::Grant, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        self.auth
            .check(header, Scope::Listeners { namespace, pod })
            .await
            .map_err(|d| {
                self.metrics.refused();
                tracing::debug!(namespace, pod, reason = %d, "L4 request refused");
                Status::from(d)
            })
    }

    /// The pod's labels; NOT_FOUND when it does not exist.
    async fn labels(&self, namespace: &str, pod: &str) -> Result<BTreeMap<String, String>, Status> {
        let found = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(pod)
            .await
            .map_err(|e| {
                tracing::warn!(namespace, pod, error = %e, "cannot read a gateway's pod");
                Status::unavailable("cannot read this pod now; retry")
            })?;
        let pod = found
            .ok_or_else(|| Status::not_found(format!("pod {namespace}/{pod} does not exist")))?;
        Ok(pod.metadata.labels.unwrap_or_default())
    }
}

/// The identity a stream was opened with, for its rechecks.
struct Reader {
    authorization: Option<Vec<u8>>,
    next: Option<Instant>,
}

fn names(namespace: &str, pod: &str) -> Result<(), Status> {
    let ok = |s: &str| !s.is_empty() && s.len() <= 253;
    if ok(namespace) && ok(pod) {
        Ok(())
    } else {
        Err(Status::invalid_argument(
            "namespace and pod must name the gateway's pod",
        ))
    }
}

#[tonic::async_trait]
impl Listeners for Handler {
    type WatchStream = tokio_stream::wrappers::ReceiverStream<Result<ListenersUpdate, Status>>;

    async fn watch(
        &self,
        request: Request<WatchListenersRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let WatchListenersRequest { namespace, pod } = request.get_ref().clone();
        names(&namespace, &pod)?;
        let grant = self.authorize(&request, &namespace, &pod).await?;
        let labels = self.labels(&namespace, &pod).await?;
        let reader = Reader {
            authorization: request
                .metadata()
                .get("authorization")
                .map(|v| v.as_bytes().to_vec()),
            next: self.auth.next_recheck(grant).map(|d| Instant::now() + d),
        };
        let (tx, rx) = mpsc::channel(2);
        let gateway = self.gateways.open(&namespace, &pod);
        let handler = self.clone();
        self.tasks.spawn(async move {
            handler.l4.streams.inc();
            handler
                .stream(&gateway, &namespace, &pod, labels, reader, &tx)
                .await;
            handler.l4.streams.dec();
            drop(tx);
            handler.gateways.close(&gateway, &handler.writer).await;
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn report(
        &self,
        request: Request<GatewayReport>,
    ) -> Result<Response<ReportReply>, Status> {
        let (namespace, pod) = {
            let r = request.get_ref();
            (r.namespace.clone(), r.pod.clone())
        };
        names(&namespace, &pod)?;
        if let Err(s) = self.authorize(&request, &namespace, &pod).await {
            self.l4.report("refused");
            return Err(s);
        }
        let report = request.into_inner();
        if report.endpoints.len() > MAX_REPORT_ENDPOINTS {
            self.l4.report("invalid");
            return Err(Status::invalid_argument(format!(
                "a report carries at most {MAX_REPORT_ENDPOINTS} endpoints"
            )));
        }
        let Some(gateway) = self.gateways.get(&namespace, &pod) else {
            self.l4.report("no_watch");
            return Err(Status::failed_precondition(
                "no Watch of this pod is open on this route server: open one first (on the same connection)",
            ));
        };
        if gateway.note_config_error(&report.config_error) && !report.config_error.is_empty() {
            self.l4.config_errors.inc();
            tracing::warn!(%namespace, %pod, error = %report.config_error, "a gateway refused its L4 configuration");
        }
        match gateway.report(&self.writer, report.endpoints).await {
            Ok(()) => {
                self.l4.report("ok");
                Ok(Response::new(ReportReply {}))
            }
            Err(e) => {
                self.l4.report("error");
                tracing::warn!(%namespace, %pod, error = %e, "cannot write a gateway's report into ListenerSet status");
                Err(Status::unavailable("cannot write the report now; retry"))
            }
        }
    }
}

impl Handler {
    /// Sends the pod's configuration whenever it changes, until the gateway goes, the reader
    /// may no longer read it, the pod is deleted or the server stops.
    async fn stream(
        &self,
        gateway: &Gateway,
        namespace: &str,
        pod: &str,
        mut labels: BTreeMap<String, String>,
        mut reader: Reader,
        tx: &mpsc::Sender<Result<ListenersUpdate, Status>>,
    ) {
        let mut models = self.index.subscribe_l4();
        let mut sent = 0u64;
        let mut next_pod = Instant::now() + spur_runtime::jitter(self.pod_refresh);
        let last_words = |status: Status| async move {
            let _ = tokio::time::timeout(LAST_WORDS, tx.send(Err(status))).await;
        };
        loop {
            let model = models.borrow_and_update().clone();
            // Nothing is sent before the store's first complete view: an empty configuration
            // would make the gateway close every listener it has.
            if let Some(model) = model {
                let config = model.for_pod(namespace, &labels);
                gateway.set_sets(config.sets, config.shadowed.clone());
                if config.update.version != sent {
                    if !config.shadowed.is_empty() {
                        let n: usize = config.shadowed.values().map(Vec::len).sum();
                        self.l4.shadowed.inc_by(n as u64);
                        tracing::warn!(namespace, pod, shadowed = ?config.shadowed, "listeners left out: an older ListenerSet serves their port");
                    }
                    sent = config.update.version;
                    tokio::select! {
                        r = tx.send(Ok(config.update)) => if r.is_err() { return },
                        () = self.stop.cancelled() => return,
                    }
                    self.l4.updates.inc();
                }
            }
            let recheck = async {
                match reader.next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tx.closed() => return,
                r = models.changed() => if r.is_err() { return },
                () = tokio::time::sleep_until(next_pod) => {
                    next_pod = Instant::now() + spur_runtime::jitter(self.pod_refresh);
                    match self.labels(namespace, pod).await {
                        Ok(l) => labels = l,
                        Err(s) if s.code() == tonic::Code::NotFound => {
                            last_words(s).await;
                            return;
                        }
                        // The API server is away: keep the labels known.
                        Err(_) => {}
                    }
                }
                () = recheck => {
                    let scope = Scope::Listeners { namespace, pod };
                    match self.auth.recheck(reader.authorization.as_deref(), scope).await {
                        Ok(grant) => {
                            reader.next = self.auth.next_recheck(grant).map(|d| Instant::now() + d);
                        }
                        Err(Denied::Unavailable(why)) => {
                            tracing::debug!(%why, "cannot check a gateway stream's reader again now");
                            reader.next = Some(Instant::now() + RECHECK_RETRY);
                        }
                        Err(refused) => {
                            self.metrics.refused();
                            tracing::info!(namespace, pod, reason = %refused, "gateway stream ended: its reader may no longer read it");
                            last_words(Status::from(refused)).await;
                            return;
                        }
                    }
                }
            }
        }
    }
}
