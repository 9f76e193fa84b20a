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

/// How a read from the runner ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Read {
    /// The runner has nothing more for this attempt: its process exited and all its output was
    /// read, or the Job no longer says the attempt is running. The sealed log, if any, has the
    /// rest.
    Ended,
    /// There may be more: the reader left, the bound was reached, or the runner cannot serve it
    /// yet (the Job says running before the driver has started the attempt on it, the pod has
    /// no IP yet). A follower asks again on its next turn, with a fresher Job.
    More,
}

/// Sends attempt `attempt` of `job` from `*offset` as its runner has it: with `follow`, as it
/// comes until the process exits; without, what there is now. `*offset` follows what was sent,
/// also when the read fails part-way. The runner is the pod the Job's
/// status names for a running attempt, in the Job's namespace, and is reached as the driver
/// reaches it: with the jobs client certificate, accepting only the executor certificate of
/// that namespace.
pub(super) async fn read(
    ctx: &Context,
    job: &Job,
    attempt: i32,
    offset: &mut u64,
    follow: bool,
    tx: &mpsc::Sender<Bytes>,
) -> Result<Read, Error> {
    let running = job.status.as_ref().and_then(|s| {
        s.attempts
            .iter()
            .find(|a| a.id == attempt && a.phase == AttemptPhase::Running)
    });
    let Some(pod) = running.map(|a| a.pod.clone()) else {
        return Ok(Read::Ended);
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
        // Not started yet, or gone (the driver then declares the attempt lost, and the Job
        // says so on a later turn).
        return Ok(Read::More);
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
            // Not started on the runner yet, or released (the sealed log has it).
            return Ok(Read::More);
        }
        now.log_bytes
    };
    let read = spur_job_executor::client::read_log(&mut client, &auid, offset, until, tx);
    // A follower that leaves while the job is quiet ends the read too.
    let reached = tokio::select! {
        r = read => r,
        () = tx.closed() => return Ok(Read::More),
    };
    match reached {
        Ok(true) => Ok(Read::Ended),
        Ok(false) => Ok(Read::More),
        // The Job says running before the driver has started the attempt on its runner, and
        // after the runner released it (the sealed log has it then): asked again next turn.
        Err(s) if s.code() == tonic::Code::NotFound => Ok(Read::More),
        Err(s) => Err(err(s.message().to_owned())),
    }
}
