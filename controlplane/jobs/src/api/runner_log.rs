//! A running attempt's log read from its runner's executor, for a replica that does not drive
//! the attempt: every replica serves the API, but only the leader drives attempts and spools
//! their output, and a replica that has just become leader has not resumed them yet. Without
//! this, such a replica would serve a running attempt's log only once the driver sealed it.

use std::net::SocketAddr;

use bytes::Bytes;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};
use spur_api::Job;
use spur_api::jobs::AttemptPhase;
use spur_proto::jobs as pb;
use tokio::sync::mpsc;

use crate::{Context, Error};

/// How far a read from the runner got.
pub(super) struct Read {
    /// The offset reached (bytes of the attempt's output sent so far).
    pub offset: u64,
    /// The runner has nothing more for this attempt: it exited, or its runner no longer has it
    /// (released after the driver kept the log, or lost). The sealed log, if any, has the rest.
    pub ended: bool,
}

/// Sends attempt `attempt` of `job` from `offset` as its runner has it: with `follow`, as it
/// comes until the process exits; without, what there is now. The runner is the pod the Job's
/// status names for a running attempt, in the Job's namespace, and is reached as the driver
/// reaches it: with the jobs client certificate, accepting only the executor certificate of
/// that namespace.
pub(super) async fn read(
    ctx: &Context,
    job: &Job,
    attempt: i32,
    offset: u64,
    follow: bool,
    tx: &mpsc::Sender<Bytes>,
) -> Result<Read, Error> {
    let ended = Read {
        offset,
        ended: true,
    };
    let running = job.status.as_ref().and_then(|s| {
        s.attempts
            .iter()
            .find(|a| a.id == attempt && a.phase == AttemptPhase::Running)
    });
    let Some(pod) = running.map(|a| a.pod.clone()) else {
        return Ok(ended);
    };
    let ns = job.namespace().unwrap_or_default();
    let err = |message: String| Error::Executor {
        pod: pod.clone(),
        message,
    };
    let ip = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&pod)
        .await?
        .and_then(|p| p.status?.pod_ip);
    let Some(ip) = ip else {
        // Gone, or not started: the driver declares the attempt lost.
        return Ok(ended);
    };
    let addr: SocketAddr = format!("{ip}:{}", spur_job_executor::DEFAULT_PORT)
        .parse()
        .map_err(|e| err(format!("pod IP {ip}: {e}")))?;
    let mut client = spur_job_executor::client::connect(
        addr,
        &spur_job_executor::client::server_name(&ns),
        ctx.pki.client()?,
    )
    .map_err(err)?;
    let auid = crate::driver::attempt_uid(&job.uid().unwrap_or_default(), attempt);
    let until = if follow {
        u64::MAX
    } else {
        let now = client
            .status(pb::StatusRequest {})
            .await
            .map_err(|s| err(s.message().to_owned()))?
            .into_inner();
        if now.attempt_uid != auid {
            return Ok(ended);
        }
        now.log_bytes
    };
    let read = spur_job_executor::client::read_log(&mut client, &auid, offset, until, tx);
    // A follower that leaves while the job is quiet ends the read too.
    let reached = tokio::select! {
        r = read => r,
        () = tx.closed() => return Ok(Read { offset, ended: false }),
    };
    match reached {
        Ok((offset, exited)) => Ok(Read {
            offset,
            ended: exited,
        }),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(ended),
        Err(s) => Err(err(s.message().to_owned())),
    }
}
