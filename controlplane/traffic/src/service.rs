//! The gRPC service (`spur.traffic.v1.Traffic`): sidecars watch their settings and push what
//! they captured; readers query the store and tail what arrives.

use std::sync::Arc;

use spur_proto::traffic::traffic_server::{Traffic, TrafficServer};
use spur_proto::traffic::{
    CaptureSettings, EndRunCaptureReply, EndRunCaptureRequest, PushReply, PushRequest, QueryReply,
    QueryRequest, ReadRunReply, ReadRunRequest, RunCapture, StartRunCaptureRequest, StoredExchange,
    TailEvent, TailRequest, WatchSettingsRequest,
};
use tokio::sync::{broadcast, mpsc};
use tokio::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::Error;
use crate::auth::{self, Authorizer, Caller, Credentials};
use crate::metrics::Metrics;
use crate::run_index::{NewRun, unix_micros};
use crate::run_read;
use crate::runs::Delegated;
use crate::settings::{Baseline, SettingsIndex};
use crate::store::{self, Store};
use crate::streams::{self, Access, Recheck};

/// Most exchanges one Push may carry.
pub const MAX_BATCH: usize = 1024;
/// Largest message the server decodes: a 16 MiB push and room for its framing.
pub const MAX_MESSAGE_BYTES: usize = 17 * 1024 * 1024;
/// Stored exchanges waiting for the slowest Tail reader; past it, that reader lags.
const TAIL_BUFFER: usize = 4096;
/// Messages queued per open stream before its task waits for the client.
const STREAM_BUFFER: usize = 16;
/// How long a sidecar's push, from its arrival, waits for a store that just started to load its
/// settings: under the sidecar's push timeout (5 s), so that the answer, not the timeout, ends
/// the call.
const LOAD_WAIT: Duration = Duration::from_secs(3);
/// Pushes wait for the settings only this long after the store started: one that could not list
/// the Sandboxes in that time (no CRD, no RBAC: its log says why) answers "retry" at once
/// rather than hold every sidecar's batch in memory.
const LOAD_WINDOW: Duration = Duration::from_secs(60);

/// The `Traffic` service. Cheap to clone: clones share the store and the Tail feed.
#[derive(Clone)]
pub struct TrafficService {
    store: Store,
    settings: SettingsIndex,
    auth: Authorizer,
    metrics: Metrics,
    tail: broadcast::Sender<Arc<StoredExchange>>,
    /// Ends every open stream (WatchSettings, Tail) when the server drains.
    stop: CancellationToken,
    started: Instant,
    /// ReadRuns reading the store at once: each may read many pages on the store's one
    /// thread, and runners poll; the others wait their turn, up to [`READ_RUN_WAIT`].
    read_runs: Arc<tokio::sync::Semaphore>,
    /// The runs being read: one read per run at a time, so one holder of a run token cannot
    /// take every turn.
    reading: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

/// ReadRuns reading the store at once, at most.
const READ_RUNS_AT_ONCE: usize = 2;
/// How long a ReadRun waits for its turn.
const READ_RUN_WAIT: Duration = Duration::from_secs(10);

/// A run's read under way; the run is free to be read again when it drops.
struct Reading {
    reading: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    id: String,
}

impl Reading {
    fn start(
        reading: &Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
        id: &str,
    ) -> Option<Reading> {
        let mut set = reading.lock().unwrap_or_else(|p| p.into_inner());
        set.insert(id.to_owned()).then(|| Reading {
            reading: Arc::clone(reading),
            id: id.to_owned(),
        })
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.reading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl TrafficService {
    pub fn new(
        store: Store,
        settings: SettingsIndex,
        auth: Authorizer,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Self {
        let (tail, _) = broadcast::channel(TAIL_BUFFER);
        TrafficService {
            store,
            settings,
            auth,
            metrics,
            tail,
            stop,
            started: Instant::now(),
            read_runs: Arc::new(tokio::sync::Semaphore::new(READ_RUNS_AT_ONCE)),
            reading: Arc::default(),
        }
    }

    /// The tonic service, accepting pushes up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> TrafficServer<Self> {
        TrafficServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    async fn push_inner(&self, req: Request<PushRequest>) -> Result<PushReply, Status> {
        let arrived = Instant::now();
        let caller = self.auth.sidecar(req.metadata()).await?;
        let mut push = req.into_inner();
        if push.exchanges.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "{} exchanges in one push; at most {MAX_BATCH} (nothing stored)",
                push.exchanges.len()
            )));
        }
        let mut baselines = Vec::with_capacity(push.exchanges.len());
        for (i, e) in push.exchanges.iter().enumerate() {
            let baseline = e.baseline.as_ref().ok_or_else(|| {
                Status::invalid_argument(format!("exchanges[{i}]: no baseline (nothing stored)"))
            })?;
            baselines.push(Baseline::try_from(baseline).map_err(|e| {
                Status::invalid_argument(format!("exchanges[{i}]: {e} (nothing stored)"))
            })?);
        }
        // The whole batch or nothing: what a sidecar pushes is its own baseline's exchanges of
        // sandboxes that capture there, or a sign that it is not what it says.
        let source = match &caller {
            Caller::Anyone => STATIC_SOURCE.to_string(),
            Caller::Sidecar { pod, .. } => {
                // A store just started lists the cluster's Sandboxes in moments: hold the
                // push that long rather than have the sidecar drop the batch.
                if !self.settings.is_loaded() {
                    let deadline = (arrived + LOAD_WAIT).min(self.started + LOAD_WINDOW);
                    let loaded = tokio::select! {
                        () = self.stop.cancelled() => false,
                        r = tokio::time::timeout_at(deadline, self.settings.loaded()) => r.is_ok(),
                    };
                    if !loaded {
                        return Err(Status::unavailable(
                            "the store has not loaded the capture settings yet; retry",
                        ));
                    }
                }
                for (i, (e, baseline)) in push.exchanges.iter_mut().zip(&baselines).enumerate() {
                    caller
                        .may_use(baseline)
                        .map_err(|s| refused(pod, i, s.message()))?;
                    if !self.settings.captures(baseline, &e.sandbox, &e.routing_key) {
                        let why = format!(
                            "sandbox {:?} does not capture {} with routing key {:?}",
                            e.sandbox,
                            auth::describe(baseline),
                            e.routing_key
                        );
                        return Err(refused(pod, i, &why));
                    }
                    // The pod is the one the token names, whatever the sidecar wrote.
                    e.pod.clone_from(&pod.name);
                }
                pod.uid.clone()
            }
        };
        let stored = self
            .store
            .insert(source, push.exchanges)
            .await
            .map_err(status)?;
        self.metrics.sidecar_dropped.inc_by(push.dropped);
        self.metrics.pushes.inc();
        self.metrics.exchanges_stored.inc_by(stored.len() as u64);
        let count = stored.len();
        for s in stored {
            // No reader: nothing to do.
            let _ = self.tail.send(Arc::new(s));
        }
        Ok(PushReply {
            stored: u32::try_from(count).unwrap_or(u32::MAX),
        })
    }

    async fn query_inner(&self, req: Request<QueryRequest>) -> Result<QueryReply, Status> {
        let filter = req.get_ref().filter.clone().unwrap_or_default();
        self.auth.reader(req.metadata(), &filter.sandbox).await?;
        store::validate_filter(&filter).map_err(status)?;
        let limit = req.get_ref().limit;
        let bodies = if req.get_ref().without_bodies {
            store::Bodies::Left
        } else {
            store::Bodies::Kept
        };
        let exchanges = self
            .store
            .query_with(filter, limit, bodies)
            .await
            .map_err(status)?;
        Ok(QueryReply { exchanges })
    }

    async fn start_run_inner(
        &self,
        req: Request<StartRunCaptureRequest>,
    ) -> Result<RunCapture, Status> {
        let sandbox = req.get_ref().sandbox.clone();
        if sandbox.is_empty() || sandbox.len() > 253 {
            return Err(Status::invalid_argument(
                "sandbox: the name of a sandbox (1 to 253 characters) is required",
            ));
        }
        // The sandbox's right first: whether it exists is nothing to tell someone without it.
        let run_for = req.get_ref().run_for.as_ref();
        let (user, delegate) = match run_for {
            Some(run_for) => {
                self.auth
                    .run_delegate(req.metadata(), &sandbox, run_for)
                    .await?
            }
            None => (
                self.auth.run_capturer(req.metadata(), &sandbox).await?,
                String::new(),
            ),
        };
        self.wait_loaded().await?;
        let entry = self.settings.sandbox(&sandbox).ok_or_else(|| {
            status(Error::NotFound(format!(
                "sandbox {sandbox} has no routing key yet (or does not exist)"
            )))
        })?;
        self.auth
            .run_namespaces(user.as_ref(), &entry.namespaces)
            .await?;
        let id = random_hex(16).map_err(status)?;
        let reference_key = format!("spur-run-{}", random_hex(10).map_err(status)?);
        // A reviewed token without a username still counts, as one user: only the static
        // token (no review at all) is not bounded per user. A run for a user is that user's.
        let started_by = match (&user, run_for) {
            (_, Some(f)) => f.username.clone(),
            (Some(u), None) => u.username.clone().unwrap_or_else(|| "(no username)".into()),
            (None, None) => String::new(),
        };
        let delegated = match run_for {
            Some(f) => Some(Delegated {
                token: random_hex(32).map_err(status)?,
                tag: random_hex(8).map_err(status)?,
                job: valid_job(&f.job)?.to_owned(),
                by: delegate,
            }),
            None => None,
        };
        let new = NewRun {
            id,
            reference_key,
            started_by,
            delegated,
        };
        let started = self
            .settings
            .start_run(&sandbox, &entry, req.get_ref().seconds, new)
            .map_err(status)?;
        self.metrics
            .run_captures
            .set(i64::try_from(self.settings.sweep_runs()).unwrap_or(i64::MAX));
        let left = started
            .run
            .until
            .saturating_duration_since(std::time::Instant::now());
        let until_unix_micros = unix_micros(std::time::SystemTime::now() + left);
        tracing::info!(
            sandbox = %sandbox,
            namespaces = ?started.run.namespaces,
            seconds = left.as_secs(),
            watching = started.watching,
            r#for = run_for.map(|f| f.username.as_str()),
            "run capture started"
        );
        let (run_token, marker_tag) = started
            .run
            .delegated
            .map(|d| (d.token, d.tag))
            .unwrap_or_default();
        Ok(RunCapture {
            run_token,
            marker_tag,
            id: started.id,
            routing_key: started.run.routing_key,
            reference_key: started.run.reference_key,
            namespaces: started.run.namespaces.into_iter().collect(),
            until_unix_micros,
            watching_baselines: u32::try_from(started.watching).unwrap_or(u32::MAX),
        })
    }

    async fn end_run_inner(
        &self,
        req: Request<EndRunCaptureRequest>,
    ) -> Result<EndRunCaptureReply, Status> {
        // Credentials before anything else: no answer about runs to a caller without any.
        Credentials::from_metadata(req.metadata())?;
        let id = &req.get_ref().id;
        // Unknown and ended look the same: an id is a secret, not something to probe for.
        let run = self
            .settings
            .run(id)
            .ok_or_else(|| Status::not_found("no such run capture (it ended, or expired)"))?;
        // A run started for a user is ended by its token, or by a caller with the right that
        // started it (`delegate`); any other run by a caller with the rights to start it.
        let by_token = run.delegated.as_ref().is_some_and(|d| {
            auth::is_run_token(&d.token, auth::bearer(req.metadata()).unwrap_or(""))
        });
        if let Some(d) = &run.delegated {
            if !by_token {
                self.auth
                    .run_delegator(req.metadata(), &run.sandbox)
                    .await?;
                // The delegate ends the run of the job it names, and no other (a job whose
                // record was changed to name another run's id ends nothing).
                let job = &req.get_ref().job;
                if d.job != *job {
                    let job: String = job.chars().take(MAX_JOB).collect();
                    return Err(Status::not_found(format!(
                        "no such run capture for job {job:?} (a run started for a job is ended \
                         by naming it)"
                    )));
                }
            }
        } else {
            let user = self.auth.run_capturer(req.metadata(), &run.sandbox).await?;
            self.auth
                .run_namespaces(user.as_ref(), &run.namespaces)
                .await?;
        }
        self.settings.end_run(id);
        self.metrics
            .run_captures
            .set(i64::try_from(self.settings.sweep_runs()).unwrap_or(i64::MAX));
        tracing::info!(sandbox = %run.sandbox, "run capture ended");
        Ok(EndRunCaptureReply {})
    }

    async fn read_run_inner(&self, req: Request<ReadRunRequest>) -> Result<ReadRunReply, Status> {
        let presented = auth::bearer(req.metadata())?;
        let id = &req.get_ref().id;
        let (run, live) = self
            .settings
            .find_run(id)
            .ok_or_else(|| Status::not_found("no such run capture (it ended, or expired)"))?;
        // Only the run's own token: a user's token, whatever it may read, is not this run's
        // (their reads go through Query).
        let Some(delegated) = run
            .delegated
            .as_ref()
            .filter(|d| auth::is_run_token(&d.token, presented))
        else {
            return Err(Status::permission_denied(
                "ReadRun takes the run's own token (a run started for a user is read back by \
                 the run it was started for; other readers use Query)",
            ));
        };
        let Some(_reading) = Reading::start(&self.reading, id) else {
            return Err(Status::resource_exhausted(
                "this run is being read already (one read of a run at a time); retry",
            ));
        };
        let _turn = tokio::time::timeout(READ_RUN_WAIT, self.read_runs.acquire())
            .await
            .map_err(|_| Status::unavailable("the store is busy reading other runs; retry"))?
            .map_err(|_| Status::unavailable("the store is stopping"))?;
        let read = run_read::read(&self.store, &run, &delegated.tag)
            .await
            .map_err(status)?;
        Ok(ReadRunReply {
            exchanges: read.exchanges,
            truncated: read.truncated,
            live,
        })
    }

    /// Waits, as a push does, for a store that just started to load its settings.
    async fn wait_loaded(&self) -> Result<(), Status> {
        if self.settings.is_loaded() {
            return Ok(());
        }
        let deadline = (Instant::now() + LOAD_WAIT).min(self.started + LOAD_WINDOW);
        let loaded = tokio::select! {
            () = self.stop.cancelled() => false,
            r = tokio::time::timeout_at(deadline, self.settings.loaded()) => r.is_ok(),
        };
        if loaded {
            Ok(())
        } else {
            Err(Status::unavailable(
                "the store has not loaded the cluster's sandboxes yet; retry",
            ))
        }
    }

    async fn watch_inner(
        &self,
        req: Request<WatchSettingsRequest>,
    ) -> Result<ReceiverStream<Result<CaptureSettings, Status>>, Status> {
        let credentials = Credentials::from_metadata(req.metadata())?;
        let caller = self.auth.sidecar_with(&credentials, false).await?;
        let workload = req
            .get_ref()
            .baseline
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("baseline is required"))?;
        let baseline = Baseline::try_from(workload).map_err(status)?;
        caller.may_use(&baseline)?;
        let settings = self.settings.watch(&baseline);
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let recheck = Recheck::new(
            self.auth.clone(),
            credentials,
            Access::Sidecar(baseline),
            self.metrics.clone(),
        );
        tokio::spawn(streams::settings(
            self.settings.clone(),
            settings,
            tx,
            recheck,
            self.stop.clone(),
            self.metrics.clone(),
        ));
        Ok(ReceiverStream::new(rx))
    }

    async fn tail_inner(
        &self,
        req: Request<TailRequest>,
    ) -> Result<ReceiverStream<Result<TailEvent, Status>>, Status> {
        let credentials = Credentials::from_metadata(req.metadata())?;
        let filter = req.get_ref().filter.clone().unwrap_or_default();
        self.auth
            .reader_with(&credentials, &filter.sandbox, false)
            .await?;
        store::validate_filter(&filter).map_err(status)?;
        // Subscribed before answering: nothing stored after the call is missed.
        let feed = self.tail.subscribe();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let recheck = Recheck::new(
            self.auth.clone(),
            credentials,
            Access::Reader(filter.sandbox.clone()),
            self.metrics.clone(),
        );
        tokio::spawn(streams::tail(
            feed,
            filter,
            tx,
            recheck,
            self.stop.clone(),
            self.metrics.clone(),
        ));
        Ok(ReceiverStream::new(rx))
    }
}

/// The longest `run_for.job`: a namespace, `/` and a name.
const MAX_JOB: usize = 63 + 1 + 253;

/// `run_for.job`: empty, or `namespace/name` as Kubernetes names them (a DNS label and a DNS
/// subdomain).
fn valid_job(job: &str) -> Result<&str, Status> {
    use spur_api::validation::{is_dns_label, is_dns_subdomain};
    match job.split_once('/') {
        _ if job.is_empty() => Ok(job),
        Some((ns, name)) if is_dns_label(ns) && is_dns_subdomain(name) => Ok(job),
        _ => {
            let job: String = job.chars().take(MAX_JOB).collect();
            Err(Status::invalid_argument(format!(
                "run_for.job: {job:?} is not namespace/name"
            )))
        }
    }
}

/// `bytes` random bytes in lowercase hex.
fn random_hex(bytes: usize) -> Result<String, Error> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| {
        tracing::error!(error = %e, "no randomness for a run capture");
        Error::Serve(format!("no randomness: {e}"))
    })?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Who pushed, for a static-token caller (trusted for everything): its exchanges' ids are
/// compared only with each other.
const STATIC_SOURCE: &str = "static-token";

/// A refused push: logged (a pod pushing what it may not is worth a line), and the status.
fn refused(pod: &auth::PodRef, i: usize, why: &str) -> Status {
    tracing::info!(pod = %format!("{}/{}", pod.namespace, pod.name), reason = %why, "push refused");
    Status::permission_denied(format!("exchanges[{i}]: {why} (nothing stored)"))
}

fn status(e: Error) -> Status {
    match e {
        Error::Invalid(m) => Status::invalid_argument(m),
        Error::Closed => Status::unavailable("the store is shutting down"),
        Error::NotFound(m) => Status::not_found(m),
        Error::Exhausted(m) => Status::resource_exhausted(m),
        Error::Changed(m) => Status::aborted(m),
        e => {
            // Logged where it happened; the client learns only that it failed.
            tracing::debug!(error = %e, "store call failed");
            Status::internal("the store failed; see its log")
        }
    }
}

fn code<T>(r: &Result<T, Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

#[tonic::async_trait]
impl Traffic for TrafficService {
    type WatchSettingsStream = ReceiverStream<Result<CaptureSettings, Status>>;
    type TailStream = ReceiverStream<Result<TailEvent, Status>>;

    async fn watch_settings(
        &self,
        req: Request<WatchSettingsRequest>,
    ) -> Result<Response<Self::WatchSettingsStream>, Status> {
        let out = self.watch_inner(req).await;
        self.metrics.call("WatchSettings", code(&out));
        out.map(Response::new)
    }

    async fn push(&self, req: Request<PushRequest>) -> Result<Response<PushReply>, Status> {
        let out = self.push_inner(req).await;
        self.metrics.call("Push", code(&out));
        out.map(Response::new)
    }

    async fn query(&self, req: Request<QueryRequest>) -> Result<Response<QueryReply>, Status> {
        let out = self.query_inner(req).await;
        self.metrics.call("Query", code(&out));
        out.map(Response::new)
    }

    async fn start_run_capture(
        &self,
        req: Request<StartRunCaptureRequest>,
    ) -> Result<Response<RunCapture>, Status> {
        let out = self.start_run_inner(req).await;
        self.metrics.call("StartRunCapture", code(&out));
        out.map(Response::new)
    }

    async fn read_run(
        &self,
        req: Request<ReadRunRequest>,
    ) -> Result<Response<ReadRunReply>, Status> {
        self.read_run_inner(req).await.map(Response::new)
    }

    async fn end_run_capture(
        &self,
        req: Request<EndRunCaptureRequest>,
    ) -> Result<Response<EndRunCaptureReply>, Status> {
        let out = self.end_run_inner(req).await;
        self.metrics.call("EndRunCapture", code(&out));
        out.map(Response::new)
    }

    async fn tail(&self, req: Request<TailRequest>) -> Result<Response<Self::TailStream>, Status> {
        let out = self.tail_inner(req).await;
        self.metrics.call("Tail", code(&out));
        out.map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_read_once_at_a_time_and_free_again_when_its_read_ends() {
        let reading = Arc::default();
        let first = Reading::start(&reading, "run-1");
        assert!(first.is_some());
        assert!(Reading::start(&reading, "run-1").is_none(), "a second read");
        let other = Reading::start(&reading, "run-2");
        assert!(other.is_some(), "another run is read meanwhile");
        drop(first);
        assert!(Reading::start(&reading, "run-1").is_some());
    }

    #[test]
    fn a_job_is_a_namespace_and_a_name() {
        for ok in ["", "team-a/run-1", "team-a/run.1-x"] {
            assert_eq!(valid_job(ok).ok(), Some(ok));
        }
        let long_ns = format!("{}/run", "a".repeat(64));
        for bad in [
            "team-a",
            "/run",
            "team-a/",
            "team-a/x/y",
            "Team/run",
            "te.am/run",
            &long_ns,
        ] {
            assert!(valid_job(bad).is_err(), "{bad}");
        }
    }
}
