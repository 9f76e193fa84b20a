//! Reports a workstation's tunnel to the operator: while the session lives, its Lease
//! (`spur_api::tunnel`) is renewed a few times per lease duration and rewritten at once when the
//! forwarded ports change; a clean close deletes it so routes are withdrawn immediately. A crash
//! leaves it to expire.
//!
//! When the workstation reconnects through another replica, that replica takes the Lease over
//! and this one notices (another holder whose session started later, `spec.acquireTime`) and
//! stops, instead of fighting it.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client};
use spur_api::tunnel::{PortAssignment, Session, lease_name};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Field manager of the tunnel proxy's Lease writes.
pub const FIELD_MANAGER: &str = "spur-tunnel-proxy";

/// Why a reporter stopped on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// `close` was called; the Lease was deleted.
    Closed,
    /// Another tunnel-proxy replica holds the workstation's Lease now.
    Superseded(String),
}

/// Keeps one session's Lease current until closed.
pub struct SessionReporter {
    ports: watch::Sender<Vec<PortAssignment>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Ended>,
}

impl SessionReporter {
    /// Starts reporting `workstation`'s tunnel, held by `proxy_pod` reachable at `address`.
    /// The Lease is valid for `duration` and renewed every third of it. With `proxy_pod_uid`,
    /// the pod owns the Lease: a crashed session's Lease then goes with the pod (a rollout,
    /// `helm uninstall`) instead of waiting for an operator to remove it.
    pub fn start(
        client: Client,
        namespace: &str,
        workstation: &str,
        proxy_pod: &str,
        address: &str,
        proxy_pod_uid: Option<&str>,
        duration: Duration,
    ) -> SessionReporter {
        let owner = proxy_pod_uid.map(|uid| OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: proxy_pod.into(),
            uid: uid.into(),
            controller: None,
            block_owner_deletion: None,
        });
        let (ports, mut changes) = watch::channel(Vec::new());
        let stop = CancellationToken::new();
        let api: Api<Lease> = Api::namespaced(client, namespace);
        let template = Session {
            workstation: workstation.into(),
            proxy_pod: proxy_pod.into(),
            address: address.into(),
            ports: Vec::new(),
            renewed: 0,
            duration: i64::try_from(duration.as_secs().max(1)).unwrap_or(i64::MAX),
            started_micros: now_micros(),
        };
        let ns = namespace.to_string();
        let every = (duration / 3).max(Duration::from_millis(500));
        let task_stop = stop.clone();
        let task = tokio::spawn(async move {
            let name = lease_name(&template.workstation);
            loop {
                let mut session = template.clone();
                session.ports = changes.borrow_and_update().clone();
                session.renewed = now_unix();
                match api.get_opt(&name).await {
                    Ok(Some(current)) => {
                        // A session that started later (the workstation reconnected through
                        // another replica) wins; an older one is overwritten.
                        if let Ok(theirs) = Session::from_lease(&current)
                            && theirs.proxy_pod != session.proxy_pod
                            && theirs.started_micros > session.started_micros
                        {
                            tracing::info!(workstation = %session.workstation, holder = %theirs.proxy_pod, "tunnel taken over by another replica");
                            return Ended::Superseded(theirs.proxy_pod);
                        }
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot read the tunnel Lease"),
                }
                match session.to_lease(&ns) {
                    Ok(mut lease) => {
                        // The same field manager on every replica: the one that holds the
                        // session now owns the Lease, the previous owner drops out.
                        lease.metadata.owner_references = owner.clone().map(|o| vec![o]);
                        let pp = PatchParams::apply(FIELD_MANAGER).force();
                        if let Err(e) = api.patch(&name, &pp, &Patch::Apply(&lease)).await {
                            tracing::warn!(error = %e, "cannot renew the tunnel Lease");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot build the tunnel Lease"),
                }
                tokio::select! {
                    () = task_stop.cancelled() => break,
                    () = tokio::time::sleep(every) => {}
                    r = changes.changed() => if r.is_err() { break },
                }
            }
            // A clean close: routes to the workstation are withdrawn now, not at expiry. Only
            // our own Lease, and only the version we read: never a successor's.
            match api.get_opt(&name).await {
                Ok(Some(current)) => {
                    let ours = current
                        .spec
                        .as_ref()
                        .and_then(|s| s.holder_identity.as_deref())
                        == Some(template.proxy_pod.as_str());
                    if !ours {
                        return Ended::Superseded(
                            current
                                .spec
                                .and_then(|s| s.holder_identity)
                                .unwrap_or_default(),
                        );
                    }
                    let dp = DeleteParams {
                        preconditions: Some(kube::api::Preconditions {
                            resource_version: current.metadata.resource_version.clone(),
                            uid: current.metadata.uid.clone(),
                        }),
                        ..DeleteParams::default()
                    };
                    if let Err(e) = api.delete(&name, &dp).await {
                        tracing::debug!(error = %e, "tunnel Lease not deleted");
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read the tunnel Lease to delete it"),
            }
            Ended::Closed
        });
        SessionReporter { ports, stop, task }
    }

    /// Publishes the ports the session forwards now.
    pub fn set_ports(&self, ports: Vec<PortAssignment>) {
        self.ports.send_replace(ports);
    }

    /// Whether the reporter stopped on its own (superseded).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops renewing and deletes the Lease (unless another replica took it over).
    pub async fn close(self) -> Ended {
        self.stop.cancel();
        self.task
            .await
            .unwrap_or(Ended::Superseded("reporter task failed".into()))
    }
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
