//! The gRPC job-execution service (`spur.jobs.v1.JobExecutor`).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use spur_proto::jobs::{self as pb, attempt_status::State, job_executor_server::JobExecutor};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::artifacts;
use crate::attempt::{Attempt, Limits, Program, Run, reap_orphans};

/// Longest attempt id the executor accepts.
const MAX_UID: usize = 128;
/// Longest result path accepted (PATH_MAX).
const MAX_RESULT_PATH: usize = 4096;
/// Bytes per log or artifact message.
const CHUNK: usize = 64 * 1024;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// How many released attempt ids the executor remembers (a late or repeated Start of one of
/// them is refused, never run again).
const REMEMBERED: usize = 1024;

/// The executor: at most one attempt at a time.
pub struct Service {
    current: Mutex<Option<Arc<Attempt>>>,
    released: Mutex<std::collections::VecDeque<String>>,
    work_dir: PathBuf,
    limits: Limits,
    seq: AtomicU64,
}

impl Service {
    pub fn new(work_dir: PathBuf, limits: Limits) -> Self {
        Service {
            current: Mutex::new(None),
            released: Mutex::new(std::collections::VecDeque::new()),
            work_dir,
            limits,
            seq: AtomicU64::new(0),
        }
    }

    /// Cancels a running attempt and waits for it to end (SIGTERM: the pod is going away).
    pub async fn shutdown(&self) {
        if let Some(a) = self.current()
            && a.snapshot().end.is_none()
        {
            tracing::info!(attempt = %a.program.attempt_uid, "stopping: canceling the running attempt");
            a.cancel();
            a.ended().await;
        }
    }

    fn current(&self) -> Option<Arc<Attempt>> {
        self.current.lock().map(|g| g.clone()).unwrap_or(None)
    }

    /// The current attempt if it is `uid`.
    fn attempt(&self, uid: &str) -> Result<Arc<Attempt>, Status> {
        match self.current() {
            Some(a) if a.program.attempt_uid == uid => Ok(a),
            Some(a) => Err(Status::not_found(format!(
                "attempt {uid} is not here (this executor has {})",
                a.program.attempt_uid
            ))),
            None => Err(Status::not_found(format!(
                "attempt {uid} is not here (this executor is idle)"
            ))),
        }
    }
}

/// The wire status of `attempt` (IDLE for none).
pub fn status_of(attempt: Option<&Attempt>) -> pb::AttemptStatus {
    let Some(a) = attempt else {
        return pb::AttemptStatus::default();
    };
    let p = a.snapshot();
    let mut s = pb::AttemptStatus {
        state: State::Running as i32,
        attempt_uid: a.program.attempt_uid.clone(),
        log_bytes: p.log_bytes,
        log_truncated: p.truncated,
        started_at_unix_ms: a.started_at_ms,
        ..Default::default()
    };
    if let Some(end) = p.end {
        s.state = State::Exited as i32;
        s.exit_code = end.exit_code;
        s.signal = end.signal;
        s.timed_out = end.timed_out;
        s.canceled = end.canceled;
        s.start_error = end.start_error;
        s.finished_at_unix_ms = end.finished_at_ms;
        match end.result {
            Some(Ok(r)) => s.result = Some(r),
            Some(Err(e)) => s.result_error = e,
            None => {}
        }
    }
    s
}

fn program(req: pb::StartRequest, key_file: bool) -> Result<Program, Status> {
    let inject_key = match req.inject_routing_key.as_str() {
        "" => None,
        k if !key_file => {
            return Err(Status::failed_precondition(format!(
                "cannot inject routing key {k}: this runner has no outbound sidecar (--routing-key-file)"
            )));
        }
        k if k.len() > 63
            || !k
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)) =>
        {
            return Err(Status::invalid_argument(
                "inject_routing_key is not a routing key",
            ));
        }
        k => Some(k.to_owned()),
    };
    let uid = req.attempt_uid;
    if uid.is_empty()
        || uid.len() > MAX_UID
        || !uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
    {
        return Err(Status::invalid_argument(
            "attempt_uid must be 1-128 of [A-Za-z0-9._-]",
        ));
    }
    let run = match req.program {
        Some(pb::start_request::Program::Script(s)) if !s.is_empty() => Run::Script(s),
        Some(pb::start_request::Program::Command(c)) if !c.args.is_empty() => Run::Command(c.args),
        _ => {
            return Err(Status::invalid_argument(
                "a script or a command is required",
            ));
        }
    };
    let mut env = Vec::with_capacity(req.env.len());
    for e in req.env {
        if e.name.is_empty() || e.name.contains(['=', '\0']) || e.value.contains('\0') {
            return Err(Status::invalid_argument(format!(
                "environment variable {:?} cannot be set",
                e.name
            )));
        }
        env.push((e.name, e.value));
    }
    for p in &req.artifact_paths {
        if !p.starts_with('/') {
            return Err(Status::invalid_argument(format!(
                "artifact path {p:?} is not absolute"
            )));
        }
    }
    let result_path = match req.result_path.as_str() {
        "" => None,
        p if !p.starts_with('/') || p.len() > MAX_RESULT_PATH || p.contains('\0') => {
            return Err(Status::invalid_argument(format!(
                "result path {p:?} is not an absolute path of at most {MAX_RESULT_PATH} bytes"
            )));
        }
        p => Some(p.to_owned()),
    };
    Ok(Program {
        attempt_uid: uid,
        run,
        env,
        timeout: (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms)),
        artifact_paths: req.artifact_paths,
        inject_key,
        result_path,
    })
}

#[tonic::async_trait]
impl JobExecutor for Service {
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::AttemptStatus>, Status> {
        Ok(Response::new(status_of(self.current().as_deref())))
    }

    async fn start(
        &self,
        req: Request<pb::StartRequest>,
    ) -> Result<Response<pb::AttemptStatus>, Status> {
        let program = program(req.into_inner(), self.limits.routing_key_file.is_some())?;
        if self
            .released
            .lock()
            .map_err(|_| Status::internal("executor state poisoned"))?
            .contains(&program.attempt_uid)
        {
            return Err(Status::already_exists(format!(
                "attempt {} already ran here and was released",
                program.attempt_uid
            )));
        }
        let mut cur = self
            .current
            .lock()
            .map_err(|_| Status::internal("executor state poisoned"))?;
        if let Some(a) = cur.as_ref() {
            if a.program.attempt_uid == program.attempt_uid {
                return Ok(Response::new(status_of(Some(a))));
            }
            return Err(Status::failed_precondition(format!(
                "attempt {} is not released yet",
                a.program.attempt_uid
            )));
        }
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let dir = self.work_dir.join(format!("attempt-{n}"));
        tracing::info!(attempt = %program.attempt_uid, dir = %dir.display(), "starting attempt");
        let attempt = Attempt::start(program, dir, self.limits.clone());
        let status = status_of(Some(&attempt));
        *cur = Some(attempt);
        Ok(Response::new(status))
    }

    type LogsStream = BoxStream<pb::LogChunk>;

    async fn logs(
        &self,
        req: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let req = req.into_inner();
        let attempt = self.attempt(&req.attempt_uid)?;
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            if let Err(status) = stream_log(&attempt, req.offset, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::AttemptStatus>, Status> {
        let attempt = self.attempt(&req.into_inner().attempt_uid)?;
        tracing::info!(attempt = %attempt.program.attempt_uid, "cancel requested");
        attempt.cancel();
        Ok(Response::new(status_of(Some(&attempt))))
    }

    type ArtifactsStream = BoxStream<pb::ArtifactChunk>;

    async fn artifacts(
        &self,
        req: Request<pb::ArtifactsRequest>,
    ) -> Result<Response<Self::ArtifactsStream>, Status> {
        let req = req.into_inner();
        let attempt = self.attempt(&req.attempt_uid)?;
        if attempt.snapshot().end.is_none() {
            return Err(Status::failed_precondition("the attempt is still running"));
        }
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            if let Err(status) = stream_artifacts(&attempt, req.max_bytes, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::AttemptStatus>, Status> {
        let uid = req.into_inner().attempt_uid;
        let released = {
            let mut cur = self
                .current
                .lock()
                .map_err(|_| Status::internal("executor state poisoned"))?;
            match cur.as_ref() {
                Some(a) if a.program.attempt_uid == uid => {
                    if a.snapshot().end.is_none() {
                        return Err(Status::failed_precondition(
                            "the attempt is still running: cancel it first",
                        ));
                    }
                    cur.take()
                }
                // Already released (a retried call), or another attempt: nothing to do.
                other => return Ok(Response::new(status_of(other.map(|a| &**a)))),
            }
        };
        if let Some(a) = released {
            if let Ok(mut r) = self.released.lock() {
                if r.len() >= REMEMBERED {
                    r.pop_front();
                }
                r.push_back(a.program.attempt_uid.clone());
            }
            if let Err(e) = tokio::fs::remove_dir_all(&a.dir).await {
                tracing::warn!(dir = %a.dir.display(), error = %e, "cannot remove the attempt's files");
            }
            tracing::info!(attempt = %uid, "attempt released");
        }
        reap_orphans();
        Ok(Response::new(pb::AttemptStatus::default()))
    }
}

type Tx<T> = mpsc::Sender<Result<T, Status>>;

async fn stream_log(
    attempt: &Attempt,
    mut offset: u64,
    tx: &Tx<pb::LogChunk>,
) -> Result<(), Status> {
    let mut progress = attempt.progress();
    let path = attempt.log_path();
    let mut file: Option<tokio::fs::File> = None;
    let mut buf = vec![0u8; CHUNK];
    loop {
        let p = progress.borrow_and_update().clone();
        while offset < p.log_bytes {
            let f = match file.as_mut() {
                Some(f) => f,
                None => {
                    let f = tokio::fs::File::open(&path)
                        .await
                        .map_err(|e| Status::internal(format!("log: {e}")))?;
                    file.insert(f)
                }
            };
            f.seek(std::io::SeekFrom::Start(offset))
                .await
                .map_err(|e| Status::internal(format!("log: {e}")))?;
            let want = ((p.log_bytes - offset) as usize).min(CHUNK);
            let n = f
                .read(&mut buf[..want])
                .await
                .map_err(|e| Status::internal(format!("log: {e}")))?;
            if n == 0 {
                break;
            }
            let chunk = pb::LogChunk {
                offset,
                data: buf[..n].to_vec(),
                r#final: None,
            };
            offset += n as u64;
            if tx.send(Ok(chunk)).await.is_err() {
                return Ok(());
            }
        }
        if p.end.is_some() && offset >= p.log_bytes {
            let chunk = pb::LogChunk {
                offset,
                data: Vec::new(),
                r#final: Some(status_of(Some(attempt))),
            };
            let _ = tx.send(Ok(chunk)).await;
            return Ok(());
        }
        if offset > p.log_bytes && p.end.is_some() {
            return Err(Status::out_of_range(format!(
                "offset {offset} is past the end of the log ({} bytes)",
                p.log_bytes
            )));
        }
        tokio::select! {
            r = progress.changed() => if r.is_err() { return Ok(()) },
            () = tx.closed() => return Ok(()),
        }
    }
}

async fn stream_artifacts(
    attempt: &Attempt,
    max_bytes: u64,
    tx: &Tx<pb::ArtifactChunk>,
) -> Result<(), Status> {
    use pb::artifact_chunk::Part;
    let mut total: u64 = 0;
    let mut buf = vec![0u8; CHUNK];
    for declared in &attempt.program.artifact_paths {
        let declared = declared.clone();
        let found = tokio::task::spawn_blocking({
            let d = declared.clone();
            move || artifacts::find(&d)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let files = match found {
            Ok(files) => files,
            Err(reason) => {
                let skipped = Part::Skipped(pb::ArtifactSkipped {
                    declared: declared.clone(),
                    reason,
                });
                if tx
                    .send(Ok(pb::ArtifactChunk {
                        part: Some(skipped),
                    }))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
                continue;
            }
        };
        for f in files {
            total = total.saturating_add(f.size);
            if max_bytes > 0 && total > max_bytes {
                return Err(Status::resource_exhausted(format!(
                    "artifacts exceed {max_bytes} bytes"
                )));
            }
            let mut file = tokio::fs::File::open(&f.path)
                .await
                .map_err(|e| Status::internal(format!("{}: {e}", f.path.display())))?;
            let header = Part::File(pb::ArtifactFile {
                path: f.path.to_string_lossy().into_owned(),
                size: f.size,
                declared: f.declared.clone(),
            });
            if tx
                .send(Ok(pb::ArtifactChunk { part: Some(header) }))
                .await
                .is_err()
            {
                return Ok(());
            }
            // Exactly `size` bytes: a file that changes under us is an error, not a silent
            // mismatch between header and content.
            let mut left = f.size;
            while left > 0 {
                let want = (left as usize).min(CHUNK);
                let n = file
                    .read(&mut buf[..want])
                    .await
                    .map_err(|e| Status::internal(format!("{}: {e}", f.path.display())))?;
                if n == 0 {
                    return Err(Status::data_loss(format!(
                        "{} shrank while being read",
                        f.path.display()
                    )));
                }
                left -= n as u64;
                let data = Part::Data(buf[..n].to_vec());
                if tx
                    .send(Ok(pb::ArtifactChunk { part: Some(data) }))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}
