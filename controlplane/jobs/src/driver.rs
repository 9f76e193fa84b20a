//! Attempt drivers: one task per running attempt that starts it on its runner's executor,
//! copies its output into the spool as it comes (followers read it live), cancels it on
//! request, collects its artifacts, seals the log into the store, records the outcome in the
//! Job's status, and releases the executor.
//!
//! Every step is safe to repeat after a restart of `spur jobs`: `Start` is idempotent for the
//! same attempt, the log resumes from the spool's length, and the executor is released only
//! after the outcome is written, so an attempt is never run twice nor forgotten.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kube::{Api, ResourceExt};
use spur_api::jobs::{AttemptPhase, CanceledBy, JobPhase, env};
use spur_api::keys::signadot_env;
use spur_api::{Job, JobRunnerGroup};
use spur_proto::jobs::{self as pb, attempt_status::State};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::queue::FINISHED;
use crate::status::{self, condition, now_string};
use crate::store::{StoredArtifact, hex_sha256};
use crate::{Context, Error};

/// How long an executor may stay unreachable mid-attempt before the attempt counts as lost.
const UNREACHABLE: Duration = Duration::from_secs(90);

/// Running drivers by job UID, and the attempts whose outcome is recorded (so a pass working
/// from a list a moment old never drives one again).
#[derive(Default)]
pub(crate) struct Drivers(Mutex<HashMap<String, Handle>>, Mutex<Done>);

/// The last attempts driven to their end, oldest first.
#[derive(Default)]
struct Done {
    order: std::collections::VecDeque<(String, i32)>,
    set: std::collections::HashSet<(String, i32)>,
}

/// How many finished attempts [`Drivers`] remembers.
const DONE_REMEMBERED: usize = 16 * 1024;

struct Handle {
    attempt: i32,
    cancel: CancellationToken,
    abandon: CancellationToken,
}

impl Drivers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Handle>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn running(&self, uid: &str, attempt: i32) -> bool {
        self.lock().get(uid).is_some_and(|h| h.attempt == attempt)
    }

    fn done(&self) -> std::sync::MutexGuard<'_, Done> {
        self.1.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the attempt's outcome is recorded (by a driver of this process).
    pub(crate) fn finished(&self, uid: &str, attempt: i32) -> bool {
        self.done().set.contains(&(uid.to_owned(), attempt))
    }

    fn mark_finished(&self, uid: &str, attempt: i32) {
        let mut d = self.done();
        let k = (uid.to_owned(), attempt);
        if d.set.insert(k.clone()) {
            d.order.push_back(k);
            if d.order.len() > DONE_REMEMBERED
                && let Some(old) = d.order.pop_front()
            {
                d.set.remove(&old);
            }
        }
    }

    /// Asks the job's running attempt to stop (its `spec.canceled`).
    pub(crate) fn cancel(&self, uid: &str) {
        if let Some(h) = self.lock().get(uid) {
            h.cancel.cancel();
        }
    }

    /// Stops driving the job's attempt without writing anything (its pod is gone, or the Job).
    pub(crate) fn abandon(&self, uid: &str) {
        if let Some(h) = self.lock().remove(uid) {
            h.abandon.cancel();
        }
    }
}

/// Where a running attempt's spool is, for followers; `opened` ticks whenever an attempt starts
/// being driven, so a follower waiting for one wakes at once.
pub(crate) struct Live(
    Mutex<HashMap<(String, i32), watch::Sender<LiveState>>>,
    watch::Sender<u64>,
);

impl Default for Live {
    fn default() -> Self {
        Live(Mutex::new(HashMap::new()), watch::channel(0).0)
    }
}

/// Bytes spooled so far, and whether the attempt's log is sealed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LiveState {
    pub bytes: u64,
    pub sealed: bool,
}

impl Live {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i32), watch::Sender<LiveState>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A follower's view of the attempt, if it is being driven.
    pub(crate) fn watch(&self, uid: &str, attempt: i32) -> Option<watch::Receiver<LiveState>> {
        self.lock()
            .get(&(uid.to_owned(), attempt))
            .map(|s| s.subscribe())
    }

    fn open(&self, uid: &str, attempt: i32, bytes: u64) -> watch::Sender<LiveState> {
        let (tx, _) = watch::channel(LiveState {
            bytes,
            sealed: false,
        });
        self.lock().insert((uid.to_owned(), attempt), tx.clone());
        self.1.send_modify(|n| *n = n.wrapping_add(1));
        tx
    }

    /// Ticks whenever an attempt starts being driven.
    pub(crate) fn opened(&self) -> watch::Receiver<u64> {
        self.1.subscribe()
    }

    fn close(&self, uid: &str, attempt: i32) {
        if let Some(tx) = self.lock().remove(&(uid.to_owned(), attempt)) {
            tx.send_modify(|s| s.sealed = true);
        }
    }
}

/// What a driver is given.
pub(crate) struct Assignment {
    pub job: Job,
    pub attempt: i32,
    pub pod: String,
    pub pod_ip: String,
    pub group: JobRunnerGroup,
    pub routing_key: Option<String>,
}

/// Starts driving an attempt unless it already is.
pub(crate) fn spawn(ctx: &Arc<Context>, a: Assignment) {
    let uid = a.job.uid().unwrap_or_default();
    if ctx.drivers.finished(&uid, a.attempt) {
        return;
    }
    let (cancel, abandon) = (CancellationToken::new(), CancellationToken::new());
    {
        let mut d = ctx.drivers.lock();
        if d.get(&uid).is_some_and(|h| h.attempt == a.attempt) {
            return;
        }
        d.insert(
            uid.clone(),
            Handle {
                attempt: a.attempt,
                cancel: cancel.clone(),
                abandon: abandon.clone(),
            },
        );
    }
    if a.job.spec.canceled {
        cancel.cancel();
    }
    let ctx = ctx.clone();
    tokio::spawn(async move {
        ctx.metrics.running.inc();
        let ns = a.job.namespace().unwrap_or_default();
        let group = a.group.name_any();
        let (job, attempt, pod) = (a.job.name_any(), a.attempt, a.pod.clone());
        let term = ctx.term();
        tokio::select! {
            () = abandon.cancelled() => {
                tracing::info!(%ns, %job, attempt, %pod, "attempt abandoned");
            }
            // The term ended (shutting down, or the lease lost): the attempt goes on in its pod
            // and the next term resumes it, so this one is no longer driven here.
            () = term.cancelled() => {
                let mut d = ctx.drivers.lock();
                if d.get(&uid).is_some_and(|h| h.attempt == attempt) {
                    d.remove(&uid);
                }
            }
            r = drive(&ctx, &a, cancel) => {
                match r {
                    Ok(()) => ctx.drivers.mark_finished(&uid, attempt),
                    Err(e) => tracing::warn!(%ns, %job, attempt, %pod, error = %e, "driving the attempt failed; the next pass retries"),
                }
                let mut d = ctx.drivers.lock();
                if d.get(&uid).is_some_and(|h| h.attempt == attempt) {
                    d.remove(&uid);
                }
            }
        }
        ctx.live.close(&uid, attempt);
        ctx.metrics.running.dec();
        ctx.wake(&ns, &group);
    });
}

fn environment(a: &Assignment) -> Vec<pb::EnvVar> {
    let mut out: Vec<pb::EnvVar> = a
        .job
        .spec
        .env
        .iter()
        .map(|e| pb::EnvVar {
            name: e.name.clone(),
            value: e.value.clone(),
        })
        .collect();
    // The operator's value wins over one the job set under the same (Signadot) name: one
    // variable, not two the executor would have to choose between.
    let mut put = |name: &str, value: String| {
        out.retain(|e| e.name != name);
        out.push(pb::EnvVar {
            name: name.to_owned(),
            value,
        })
    };
    if let Some(key) = &a.routing_key {
        put(env::ROUTING_KEY, key.clone());
        put(signadot_env::ROUTING_KEY, key.clone());
    }
    if let Some(rc) = &a.job.spec.routing_context {
        if let Some(s) = &rc.sandbox {
            put(env::SANDBOX_NAME, s.clone());
            put(signadot_env::SANDBOX_NAME, s.clone());
        }
        if let Some(g) = &rc.route_group {
            put(env::ROUTE_GROUP_NAME, g.clone());
        }
    }
    put(env::JOB_NAME, a.job.name_any());
    put(env::JOB_NAMESPACE, a.job.namespace().unwrap_or_default());
    put(env::JOB_ATTEMPT, a.attempt.to_string());
    out
}

pub(crate) fn attempt_uid(job_uid: &str, attempt: i32) -> String {
    format!("{job_uid}.{attempt}")
}

/// How an attempt ended, as the driver saw it.
enum Outcome {
    /// The attempt ended; `true` when output past the namespace's storage quota was dropped.
    Ended(pb::AttemptStatus, bool),
    Lost(String),
}

async fn drive(ctx: &Arc<Context>, a: &Assignment, cancel: CancellationToken) -> Result<(), Error> {
    let ns = a.job.namespace().unwrap_or_default();
    let uid = a.job.uid().unwrap_or_default();
    let auid = attempt_uid(&uid, a.attempt);
    let err = |message: String| Error::Executor {
        pod: a.pod.clone(),
        message,
    };
    let addr: SocketAddr = format!("{}:{}", a.pod_ip, spur_job_executor::DEFAULT_PORT)
        .parse()
        .map_err(|e| err(format!("pod IP {}: {e}", a.pod_ip)))?;
    let mut client = spur_job_executor::client::connect(
        addr,
        &spur_job_executor::client::server_name(&ns),
        ctx.pki.client()?,
    )
    .map_err(err)?;

    let outcome = match start(&mut client, a, &auid).await {
        Err(lost) => Outcome::Lost(lost),
        Ok(Started::AlreadyRan) => {
            // Its outcome was recorded before the runner released it; nothing to do.
            tracing::info!(%ns, job = %a.job.name_any(), attempt = a.attempt, "attempt already ran");
            return Ok(());
        }
        Ok(Started::Running) => {
            ctx.metrics.attempts_started.inc();
            tracing::info!(%ns, job = %a.job.name_any(), attempt = a.attempt, pod = %a.pod, "attempt running");
            follow(ctx, &mut client, a, &uid, &auid, cancel).await?
        }
    };
    match outcome {
        Outcome::Lost(reason) => {
            let len = ctx.store.seal_log(&ns, &uid, a.attempt).await?;
            lost(ctx, &a.job, a.attempt, &reason, Some(len)).await
        }
        Outcome::Ended(fin, over_quota) => {
            let (artifacts, note) =
                collect_artifacts(ctx, &mut client, a, &ns, &uid, &auid).await?;
            let note = match (over_quota, note) {
                (false, note) => note,
                (true, note) => Some(
                    std::iter::once(quota_note(ctx, "output"))
                        .chain(note)
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
            };
            let len = ctx.store.seal_log(&ns, &uid, a.attempt).await?;
            finish(ctx, a, &fin, len, artifacts, note).await?;
            let _ = client
                .release(pb::ReleaseRequest {
                    attempt_uid: auid.clone(),
                })
                .await;
            Ok(())
        }
    }
}

/// What starting found.
enum Started {
    Running,
    /// The runner ran and released it already.
    AlreadyRan,
}

/// Starts (or finds) the attempt on the executor. `Err` is why the attempt is lost.
async fn start(
    client: &mut spur_proto::jobs::job_executor_client::JobExecutorClient<
        tonic::transport::Channel,
    >,
    a: &Assignment,
    auid: &str,
) -> Result<Started, String> {
    let program = match (&a.job.spec.script, &a.job.spec.command) {
        (Some(s), _) => pb::start_request::Program::Script(s.clone()),
        (None, Some(c)) => pb::start_request::Program::Command(pb::Command { args: c.clone() }),
        (None, None) => return Err("the job has neither script nor command".into()),
    };
    let req = pb::StartRequest {
        attempt_uid: auid.to_owned(),
        program: Some(program),
        env: environment(a),
        timeout_ms: u64::try_from(a.job.spec.effective_timeout(&a.group.spec).as_millis())
            .unwrap_or(u64::MAX),
        artifact_paths: a
            .job
            .spec
            .artifacts
            .iter()
            .map(|x| x.path.clone())
            .collect(),
        inject_routing_key: match a.job.spec.inject_routing_key {
            spur_api::jobs::InjectRoutingKey::Auto => a.routing_key.clone().unwrap_or_default(),
            spur_api::jobs::InjectRoutingKey::Disabled => String::new(),
        },
        result_path: a.job.spec.result_path.clone().unwrap_or_default(),
    };
    let deadline = tokio::time::Instant::now() + UNREACHABLE;
    loop {
        match client.start(req.clone()).await {
            Ok(_) => return Ok(Started::Running),
            Err(s) if s.code() == Code::AlreadyExists => return Ok(Started::AlreadyRan),
            Err(s) if s.code() == Code::FailedPrecondition => {
                let st = client
                    .status(pb::StatusRequest {})
                    .await
                    .map_err(|e| format!("executor status: {}", e.message()))?
                    .into_inner();
                tracing::info!(pod = %a.pod, attempt = %auid, on_runner = %st.attempt_uid, state = st.state, "start refused: the runner has another attempt");
                if st.attempt_uid == auid {
                    // Ours after all (a Start that raced the release of the one before): it
                    // runs, and must not be started anywhere else.
                    return Ok(Started::Running);
                }
                if st.state == State::Exited as i32 {
                    // An earlier attempt (another job's) that ended but was not released yet:
                    // its outcome is recorded before any release, so it can go.
                    tracing::info!(pod = %a.pod, stale = %st.attempt_uid, "releasing a finished attempt left on the runner");
                    client
                        .release(pb::ReleaseRequest {
                            attempt_uid: st.attempt_uid,
                        })
                        .await
                        .map_err(|e| format!("executor release: {}", e.message()))?;
                    continue;
                }
                // Idle again (released meanwhile) or still running another attempt: the
                // queue's view was a moment old. Try again until the deadline.
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "the runner is busy with attempt {}",
                        st.attempt_uid
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) if transient(&s) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(s) => return Err(format!("cannot start on the runner: {}", s.message())),
        }
    }
}

fn transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
    )
}

/// Streams the log into the spool until the attempt ends; passes cancel requests on.
async fn follow(
    ctx: &Arc<Context>,
    client: &mut spur_proto::jobs::job_executor_client::JobExecutorClient<
        tonic::transport::Channel,
    >,
    a: &Assignment,
    uid: &str,
    auid: &str,
    cancel: CancellationToken,
) -> Result<Outcome, Error> {
    let ns = a.job.namespace().unwrap_or_default();
    // `offset` is the executor's (what it has sent); `kept` what the spool holds. They part
    // when the namespace's storage quota is reached: from then on nothing more of this attempt
    // is kept, so the log is a prefix of the output, never one with a hole.
    let mut offset = ctx.store.resume_spool(&ns, uid, a.attempt).await;
    let mut kept = offset;
    let mut over_quota = false;
    let mut spool = ctx.store.open_spool(uid, a.attempt, offset).await?;
    let live = ctx.live.open(uid, a.attempt, offset);
    let mut canceled_sent = false;
    let mut unreachable_since: Option<tokio::time::Instant> = None;
    // The executor enforces the timeout; this backstop covers an executor that cannot.
    let backstop = a.job.spec.effective_timeout(&a.group.spec) + Duration::from_secs(60);
    let backstop = tokio::time::sleep(backstop);
    tokio::pin!(backstop);
    loop {
        let stream = client
            .logs(pb::LogsRequest {
                attempt_uid: auid.to_owned(),
                offset,
            })
            .await;
        let mut stream = match stream {
            Ok(s) => {
                unreachable_since = None;
                s.into_inner()
            }
            Err(s) if s.code() == Code::NotFound => {
                return Ok(Outcome::Lost(format!(
                    "the runner no longer has the attempt: {}",
                    s.message()
                )));
            }
            Err(s) => {
                let since = *unreachable_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() > UNREACHABLE {
                    return Ok(Outcome::Lost(format!(
                        "the runner is unreachable: {}",
                        s.message()
                    )));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                () = cancel.cancelled(), if !canceled_sent => {
                    canceled_sent = true;
                    tracing::info!(job = %a.job.name_any(), attempt = a.attempt, "canceling the attempt");
                    if let Err(e) = client.cancel(pb::CancelRequest { attempt_uid: auid.to_owned() }).await {
                        tracing::warn!(error = %e.message(), "cancel request failed; retried on the next log message");
                        canceled_sent = false;
                    }
                    continue;
                }
                () = &mut backstop, if !canceled_sent => {
                    canceled_sent = true;
                    let _ = client.cancel(pb::CancelRequest { attempt_uid: auid.to_owned() }).await;
                    continue;
                }
            };
            match msg {
                Ok(Some(chunk)) => {
                    if chunk.offset != offset {
                        return Err(Error::Executor {
                            pod: a.pod.clone(),
                            message: format!(
                                "log offset {} where {offset} was expected",
                                chunk.offset
                            ),
                        });
                    }
                    if !chunk.data.is_empty() {
                        let n = chunk.data.len() as u64;
                        if !over_quota {
                            if ctx
                                .store
                                .append_spool(&ns, uid, a.attempt, &mut spool, &chunk.data)
                                .await?
                            {
                                kept += n;
                                live.send_modify(|s| s.bytes = kept);
                            } else {
                                over_quota = true;
                                ctx.metrics.over_quota("log");
                                tracing::warn!(%ns, job = %a.job.name_any(), attempt = a.attempt, "the namespace's storage quota is reached; the rest of this attempt's output is dropped");
                            }
                        }
                        offset += n;
                        ctx.metrics.log_bytes.inc_by(n);
                    }
                    if let Some(fin) = chunk.r#final {
                        return Ok(Outcome::Ended(fin, over_quota));
                    }
                }
                // The stream broke (executor restarted, network): resume from `offset`.
                Ok(None) | Err(_) => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Keeps the attempt's artifacts; returns the list and a note when some were not kept.
async fn collect_artifacts(
    ctx: &Arc<Context>,
    client: &mut spur_proto::jobs::job_executor_client::JobExecutorClient<
        tonic::transport::Channel,
    >,
    a: &Assignment,
    ns: &str,
    uid: &str,
    auid: &str,
) -> Result<(Vec<StoredArtifact>, Option<String>), Error> {
    if a.job.spec.artifacts.is_empty() {
        return Ok((Vec::new(), None));
    }
    let mut kept: Vec<StoredArtifact> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut stream = match client
        .artifacts(pb::ArtifactsRequest {
            attempt_uid: auid.to_owned(),
            max_bytes: ctx.cfg.max_artifact_bytes,
        })
        .await
    {
        Ok(s) => s.into_inner(),
        Err(s) => return Ok((kept, Some(format!("artifacts not kept: {}", s.message())))),
    };
    let mut current: Option<(pb::ArtifactFile, BytesMut)> = None;
    loop {
        let msg = match stream.message().await {
            Ok(m) => m,
            Err(s) => {
                notes.push(format!("artifacts cut short: {}", s.message()));
                // A partial file is not kept.
                current = None;
                break;
            }
        };
        let Some(msg) = msg else { break };
        match msg.part {
            Some(pb::artifact_chunk::Part::File(f)) => {
                if let Some((f, data)) = current.take() {
                    notes.extend(keep(ctx, ns, uid, a.attempt, f, data.freeze(), &mut kept).await?);
                }
                let cap = usize::try_from(f.size.min(1 << 20)).unwrap_or(0);
                current = Some((f, BytesMut::with_capacity(cap)));
            }
            Some(pb::artifact_chunk::Part::Data(d)) => {
                if let Some((_, buf)) = current.as_mut() {
                    buf.extend_from_slice(&d);
                }
            }
            Some(pb::artifact_chunk::Part::Skipped(s)) => {
                notes.push(format!("{}: {}", s.declared, s.reason));
            }
            None => {}
        }
    }
    if let Some((f, data)) = current.take() {
        notes.extend(keep(ctx, ns, uid, a.attempt, f, data.freeze(), &mut kept).await?);
    }
    // Earlier attempts' artifacts stay listed.
    let mut index = ctx.store.artifacts(ns, uid).await?;
    index.retain(|x| x.attempt != a.attempt);
    index.extend(kept.iter().cloned());
    ctx.store.put_artifact_index(ns, uid, &index).await?;
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    Ok((kept, note))
}

async fn keep(
    ctx: &Arc<Context>,
    ns: &str,
    uid: &str,
    attempt: i32,
    f: pb::ArtifactFile,
    data: Bytes,
    kept: &mut Vec<StoredArtifact>,
) -> Result<Option<String>, Error> {
    if data.len() as u64 != f.size {
        tracing::warn!(path = %f.path, "artifact size mismatch; not kept");
        return Ok(None);
    }
    let sha = hex_sha256(&data);
    if !ctx
        .store
        .put_artifact(ns, uid, attempt, &f.path, data)
        .await?
    {
        ctx.metrics.over_quota("artifact");
        return Ok(Some(format!(
            "{}: {}",
            f.declared,
            quota_note(ctx, "not kept")
        )));
    }
    ctx.metrics.artifact_bytes.inc_by(f.size);
    kept.push(StoredArtifact {
        attempt,
        path: f.path,
        size: f.size,
        sha256: sha,
        declared: f.declared,
    });
    Ok(None)
}

/// Says that `what` fell past the namespace's storage quota.
fn quota_note(ctx: &Context, what: &str) -> String {
    format!(
        "{what}: the namespace's storage quota ({} bytes, --max-namespace-bytes) is used up; delete finished jobs to free it",
        ctx.store.quota().limit()
    )
}

/// Records the attempt's end in the Job's status.
async fn finish(
    ctx: &Arc<Context>,
    a: &Assignment,
    fin: &pb::AttemptStatus,
    log_len: u64,
    artifacts: Vec<StoredArtifact>,
    note: Option<String>,
) -> Result<(), Error> {
    let (phase, attempt_phase, reason, canceled_by) = if fin.timed_out {
        (
            JobPhase::Canceled,
            AttemptPhase::Canceled,
            "TimedOut",
            Some(CanceledBy::Timeout),
        )
    } else if fin.canceled {
        (
            JobPhase::Canceled,
            AttemptPhase::Canceled,
            "Canceled",
            Some(CanceledBy::Request),
        )
    } else if !fin.start_error.is_empty() {
        (JobPhase::Failed, AttemptPhase::Failed, "StartFailed", None)
    } else if fin.exit_code == Some(0) {
        (JobPhase::Succeeded, AttemptPhase::Succeeded, "Exited", None)
    } else {
        (JobPhase::Failed, AttemptPhase::Failed, "Exited", None)
    };
    let mut message = match (fin.exit_code, fin.signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => fin.start_error.clone(),
    };
    if fin.timed_out {
        message = format!(
            "timed out after {:?} ({message})",
            a.job.spec.effective_timeout(&a.group.spec)
        );
    }
    if fin.log_truncated {
        message.push_str("; output beyond the log limit was dropped");
    }
    if let Some(n) = &note {
        message.push_str("; ");
        message.push_str(n);
    }
    let (result, why_none) = result(a.job.spec.result_path.as_deref(), fin);
    if let Some(why) = why_none {
        message.push_str("; ");
        message.push_str(&why);
    }
    let api: Api<Job> = Api::namespaced(ctx.client.clone(), &a.job.namespace().unwrap_or_default());
    let attempt = a.attempt;
    let status_artifacts: Vec<spur_api::jobs::ArtifactStatus> = artifacts
        .iter()
        .map(|x| spur_api::jobs::ArtifactStatus {
            path: x.path.clone(),
            size: x.size,
            sha256: x.sha256.clone(),
            meta: a
                .job
                .spec
                .artifacts
                .iter()
                .find(|d| d.path == x.declared)
                .map(|d| d.meta.clone())
                .unwrap_or_default(),
        })
        .collect();
    let written = status::update(&api, &a.job.name_any(), |job, st| {
        let Some(cur) = st.attempts.last_mut() else {
            return false;
        };
        if cur.id != attempt || cur.phase != AttemptPhase::Running {
            return false;
        }
        let now = now_string();
        cur.phase = attempt_phase;
        cur.finished_at = Some(now.clone());
        cur.exit_code = fin.exit_code;
        cur.reason = Some(reason.to_owned());
        cur.message = Some(message.clone());
        st.phase = Some(phase);
        st.exit_code = fin.exit_code;
        st.canceled_by = canceled_by;
        st.finished_at = Some(now);
        st.log_bytes = Some(st.log_bytes.unwrap_or(0) + log_len);
        st.artifacts = status_artifacts.clone();
        st.result = result.clone();
        condition(st, job, FINISHED, true, phase.as_str(), &message);
        true
    })
    .await?;
    if written.is_some() {
        ctx.metrics.finished(phase.as_str());
        tracing::info!(ns = %a.job.namespace().unwrap_or_default(), job = %a.job.name_any(), attempt, phase = phase.as_str(), %message, "job finished");
    }
    Ok(())
}

/// The job's result (`spec.resultPath`) from the attempt's final status, or a note saying why
/// there is none.
fn result(path: Option<&str>, fin: &pb::AttemptStatus) -> (Option<String>, Option<String>) {
    let Some(path) = path else {
        return (None, None);
    };
    if !fin.start_error.is_empty() {
        // The process never ran: the start error says it all.
        return (None, None);
    }
    if !fin.result_error.is_empty() {
        return (
            None,
            Some(format!("no result: {path} {}", fin.result_error)),
        );
    }
    let Some(bytes) = &fin.result else {
        return (
            None,
            Some(format!(
                "no result: the executor returned none for {path}: a runner's executor older than result files, or an attempt started by an older spur-jobs replica that did not ask for it"
            )),
        );
    };
    if bytes.len() > spur_api::jobs::RESULT_MAX {
        return (
            None,
            Some(format!(
                "no result: {path} has more than {} bytes",
                spur_api::jobs::RESULT_MAX
            )),
        );
    }
    match String::from_utf8(bytes.clone()) {
        Ok(r) => (Some(r), None),
        Err(_) => (None, Some(format!("no result: {path} is not UTF-8 text"))),
    }
}

/// Records that the attempt's runner went away: the job is queued again, or fails after
/// `max_attempts`.
pub(crate) async fn lost(
    ctx: &Context,
    job: &Job,
    attempt: i32,
    reason: &str,
    log_len: Option<u64>,
) -> Result<(), Error> {
    let api: Api<Job> = Api::namespaced(ctx.client.clone(), &job.namespace().unwrap_or_default());
    let max = ctx.cfg.max_attempts;
    let written = status::update(&api, &job.name_any(), |job, st| {
        let Some(cur) = st.attempts.last_mut() else {
            return false;
        };
        if cur.id != attempt || cur.phase != AttemptPhase::Running {
            return false;
        }
        let now = now_string();
        cur.phase = AttemptPhase::Lost;
        cur.finished_at = Some(now.clone());
        cur.reason = Some("PodLost".into());
        cur.message = Some(reason.to_owned());
        st.log_bytes = Some(st.log_bytes.unwrap_or(0) + log_len.unwrap_or(0));
        if st.attempts.len() >= usize::try_from(max).unwrap_or(1) {
            st.phase = Some(JobPhase::Failed);
            st.finished_at = Some(now);
            let m = format!(
                "{} attempts lost their runner; last: {reason}",
                st.attempts.len()
            );
            condition(st, job, FINISHED, true, "Failed", &m);
        } else if job.spec.canceled {
            status::canceled_by_request(st, job, "canceled after its runner was lost");
        } else {
            st.phase = Some(JobPhase::Queued);
        }
        true
    })
    .await?;
    if written.is_some() {
        ctx.metrics.attempts_lost.inc();
        tracing::warn!(ns = %job.namespace().unwrap_or_default(), job = %job.name_any(), attempt, %reason, "attempt lost");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn a_result_is_kept_when_it_is_text_and_explained_when_not() {
        let fin = |result: &[u8], error: &str| pb::AttemptStatus {
            result: error.is_empty().then(|| result.to_vec()),
            result_error: error.into(),
            ..Default::default()
        };
        let p = Some("/out/r.json");
        assert_eq!(result(None, &fin(b"x", "")), (None, None));
        assert_eq!(
            result(p, &fin(b"{\"passed\":2}", "")),
            (Some("{\"passed\":2}".into()), None)
        );
        assert_eq!(result(p, &fin(b"", "")), (Some(String::new()), None));
        assert_eq!(
            result(p, &fin(b"", "the job did not write it")),
            (
                None,
                Some("no result: /out/r.json the job did not write it".into())
            )
        );
        assert_eq!(
            result(p, &fin(&[0xff, 0xfe], "")),
            (
                None,
                Some("no result: /out/r.json is not UTF-8 text".into())
            )
        );
        let big = vec![b'a'; spur_api::jobs::RESULT_MAX + 1];
        assert!(
            result(p, &fin(&big, ""))
                .1
                .unwrap()
                .contains("more than 4096")
        );
        let never_ran = pb::AttemptStatus {
            start_error: "no such file".into(),
            result_error: "the job did not write it".into(),
            ..Default::default()
        };
        assert_eq!(result(p, &never_ran), (None, None));
        let older_executor = pb::AttemptStatus::default();
        assert!(
            result(p, &older_executor)
                .1
                .unwrap()
                .contains("the executor returned none")
        );
    }

    #[test]
    fn a_job_gets_spurs_and_signadots_names_once_each() {
        let job: Job = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Job",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {"runnerGroup": "g", "command": ["true"],
                     "routingContext": {"sandbox": "sb"},
                     "env": [{"name": "SIGNADOT_ROUTING_KEY", "value": "mine"},
                             {"name": "OTHER", "value": "x"}]}
        }))
        .unwrap();
        let group: JobRunnerGroup = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "JobRunnerGroup",
            "metadata": {"name": "g", "namespace": "ns"},
            "spec": {"image": "busybox"}
        }))
        .unwrap();
        let a = Assignment {
            job,
            attempt: 2,
            pod: "p".into(),
            pod_ip: "10.0.0.1".into(),
            group,
            routing_key: Some("k3y".into()),
        };
        let env = environment(&a);
        let get = |name: &str| -> Vec<&str> {
            env.iter()
                .filter(|e| e.name == name)
                .map(|e| e.value.as_str())
                .collect()
        };
        assert_eq!(get("SIGNADOT_ROUTING_KEY"), ["k3y"]);
        assert_eq!(get("SPUR_ROUTING_KEY"), ["k3y"]);
        assert_eq!(get("SIGNADOT_SANDBOX_NAME"), ["sb"]);
        assert_eq!(get("SPUR_SANDBOX_NAME"), ["sb"]);
        assert_eq!(get("OTHER"), ["x"]);
        assert_eq!(get("SPUR_JOB_ATTEMPT"), ["2"]);
    }
}
