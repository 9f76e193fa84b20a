//! Reverse binds: one tunnel listener per mapping of the workstation's local workloads
//! (`bind_id` from `WatchLocalWorkloads`), each reverse stream spliced to `to_local` on the
//! workstation. Binds that leave the list are dropped (the library unbinds them); binds survive
//! reconnects inside the tunnel library.
//!
//! A mapping's `to_local` comes from a Sandbox, which someone else may have written: unless
//! the user passes `--allow-remote-targets`, only this machine's loopback addresses are
//! connected to (`localhost`, 127.0.0.0/8, `::1`), so a Sandbox cannot make the workstation
//! a way into the network it sits in.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use spur_proto::tunnel::LocalWorkload;
use spur_tunnel::{BindStatus, Incoming};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::shared::{Event, Shared};
use crate::state::{MappingStatus, WorkloadStatus};

/// How long dropping a bind may take before reconcile moves on.
const STOP_WAIT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, PartialEq, Eq)]
struct Want {
    to_local: String,
    meta: String,
}

struct Running {
    want: Want,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

pub(crate) struct Binds {
    shared: Arc<Shared>,
    running: HashMap<String, Running>,
}

impl Binds {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Binds {
            shared,
            running: HashMap::new(),
        }
    }

    /// Makes the binds match `workloads` (the complete list).
    pub(crate) async fn reconcile(&mut self, workloads: &[LocalWorkload]) {
        let previous: HashMap<String, MappingStatus> = self
            .shared
            .status
            .borrow()
            .workloads
            .iter()
            .flat_map(|w| w.mappings.iter())
            .map(|m| (m.bind_id.clone(), m.clone()))
            .collect();
        let mut desired: BTreeMap<String, Want> = BTreeMap::new();
        let mut statuses = Vec::with_capacity(workloads.len());
        for w in workloads {
            let mut ws = WorkloadStatus {
                sandbox: w.sandbox.clone(),
                name: w.name.clone(),
                namespace: w.namespace.clone(),
                external_workload: w.external_workload.clone(),
                routing_key: w.routing_key.clone(),
                mappings: Vec::with_capacity(w.mappings.len()),
            };
            for m in &w.mappings {
                let mut ms = MappingStatus {
                    port: m.port,
                    to_local: m.to_local.clone(),
                    bind_id: m.bind_id.clone(),
                    bind: "pending".into(),
                    ..MappingStatus::default()
                };
                let problem = if desired.contains_key(&m.bind_id) {
                    Some(("invalid", "the same bind id appears twice".to_owned()))
                } else {
                    check_to_local(&m.to_local, self.shared.allow_remote_targets).err()
                };
                match problem {
                    Some((bind, why)) => {
                        // Said once per mapping, not on every re-sent list.
                        let known = previous
                            .get(&m.bind_id)
                            .is_some_and(|p| p.bind == bind && p.detail.as_deref() == Some(&why));
                        if bind == "refused" && !known {
                            self.shared.emit(Event::BindRefused {
                                id: m.bind_id.clone(),
                                reason: why.clone(),
                            });
                        }
                        ms.bind = bind.into();
                        ms.detail = Some(why);
                    }
                    None => {
                        let meta = serde_json::json!({
                            "sandbox": w.sandbox,
                            "workload": format!("{}/{}", w.namespace, w.external_workload),
                            "port": m.port,
                            "to_local": m.to_local,
                        })
                        .to_string();
                        desired.insert(
                            m.bind_id.clone(),
                            Want {
                                to_local: m.to_local.clone(),
                                meta,
                            },
                        );
                    }
                }
                ws.mappings.push(ms);
            }
            statuses.push(ws);
        }

        // Drop binds that left, changed, or ended (a rejected bind is tried again when the
        // list is sent again: after a change, or on a new session).
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(id, r)| desired.get(*id) != Some(&r.want) || r.task.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            if let Some(r) = self.running.remove(&id) {
                r.stop.cancel();
                let _ = tokio::time::timeout(STOP_WAIT, r.task).await;
                tracing::info!(bind = %id, "reverse bind dropped");
            }
        }
        // Unchanged binds keep their status; new ones start pending.
        for ws in &mut statuses {
            for ms in &mut ws.mappings {
                if self.running.contains_key(&ms.bind_id)
                    && let Some(prev) = previous.get(&ms.bind_id)
                {
                    ms.bind = prev.bind.clone();
                    ms.detail = prev.detail.clone();
                    ms.local_error = prev.local_error.clone();
                }
            }
        }
        let binds = desired.len();
        self.shared.status.send_modify(|s| s.workloads = statuses);
        for (id, want) in desired {
            if self.running.contains_key(&id) {
                continue;
            }
            let stop = CancellationToken::new();
            let task = tokio::spawn(bind_task(
                self.shared.clone(),
                id.clone(),
                want.clone(),
                stop.clone(),
            ));
            self.running.insert(id, Running { want, stop, task });
        }
        self.shared.emit(Event::Workloads {
            workloads: workloads.len(),
            binds,
        });
    }

    /// Drops every bind and waits (bounded) for them to unbind.
    pub(crate) async fn stop_all(&mut self) {
        for (_, r) in self.running.drain() {
            r.stop.cancel();
            let _ = tokio::time::timeout(STOP_WAIT, r.task).await;
        }
    }
}

/// `host:port` with a non-zero port, and (unless `allow_remote`) a loopback host. `Err` is the
/// status (`invalid` or `refused`) and the reason.
fn check_to_local(to_local: &str, allow_remote: bool) -> Result<(), (&'static str, String)> {
    let bad = || Err(("invalid", format!("to_local {to_local:?} is not host:port")));
    let Some((host, port)) = to_local.rsplit_once(':') else {
        return bad();
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match port.parse::<u16>() {
        Ok(p) if p != 0 && !host.is_empty() && !host.contains(char::is_whitespace) => {}
        _ => return bad(),
    }
    if allow_remote || is_loopback_host(host) {
        return Ok(());
    }
    Err((
        "refused",
        format!(
            "to_local {to_local:?} is not on this workstation: only localhost, 127.0.0.0/8 and ::1 are connected to unless `spur local connect --allow-remote-targets` is given"
        ),
    ))
}

/// `localhost` or a loopback address (an IPv4-mapped one too).
fn is_loopback_host(host: &str) -> bool {
    let name = host.strip_suffix('.').unwrap_or(host);
    name.eq_ignore_ascii_case("localhost")
        || host
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Connects to `to_local`. Without `allow_remote`, only to the loopback addresses the name
/// resolves to: `localhost` in a hosts file pointing elsewhere does not widen the check.
async fn connect_local(to_local: &str, allow_remote: bool) -> std::io::Result<TcpStream> {
    if allow_remote {
        return TcpStream::connect(to_local).await;
    }
    let loopback: Vec<SocketAddr> = tokio::net::lookup_host(to_local)
        .await?
        .filter(|a| a.ip().to_canonical().is_loopback())
        .collect();
    if loopback.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "it resolves to no loopback address (--allow-remote-targets allows others)",
        ));
    }
    TcpStream::connect(&loopback[..]).await
}

fn set_mapping(shared: &Shared, id: &str, f: impl FnOnce(&mut MappingStatus)) {
    shared.status.send_if_modified(|s| {
        let Some(m) = s
            .workloads
            .iter_mut()
            .flat_map(|w| w.mappings.iter_mut())
            .find(|m| m.bind_id == id)
        else {
            return false;
        };
        let before = m.clone();
        f(m);
        *m != before
    });
}

async fn bind_task(shared: Arc<Shared>, id: String, want: Want, stop: CancellationToken) {
    let bound = tokio::select! {
        () = stop.cancelled() => return,
        r = shared.client.bind(&id, &want.meta) => r,
    };
    let mut listener = match bound {
        Ok(l) => l,
        Err(e) => {
            let reason = match e {
                spur_tunnel::Error::BindRejected { reason, .. } => reason,
                other => other.to_string(),
            };
            set_mapping(&shared, &id, |m| {
                m.bind = "rejected".into();
                m.detail = Some(reason.clone());
            });
            shared.emit(Event::BindRejected { id, reason });
            return;
        }
    };
    let mut status = listener.status();
    let mut watching = true;
    let failing = Arc::new(AtomicBool::new(false));
    let mut announced = false;
    let mut last: Option<BindStatus> = None;
    loop {
        let now = status.borrow_and_update().clone();
        if watching && last.as_ref() != Some(&now) {
            last = Some(now.clone());
            let (bind, detail) = match &now {
                BindStatus::Pending => ("pending", None),
                BindStatus::Active => ("active", None),
                BindStatus::Rejected(r) => ("rejected", Some(r.clone())),
            };
            set_mapping(&shared, &id, |m| {
                m.bind = bind.into();
                m.detail = detail.clone();
            });
            match now {
                BindStatus::Active if !announced => {
                    announced = true;
                    shared.emit(Event::BindActive {
                        id: id.clone(),
                        to_local: want.to_local.clone(),
                    });
                }
                BindStatus::Rejected(reason) => {
                    shared.emit(Event::BindRejected {
                        id: id.clone(),
                        reason,
                    });
                }
                _ => {}
            }
        }
        tokio::select! {
            () = stop.cancelled() => break,
            changed = status.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                }
            }
            incoming = listener.accept() => match incoming {
                Some(i) => {
                    let (shared2, id2, to, failing) =
                        (shared.clone(), id.clone(), want.to_local.clone(), failing.clone());
                    shared.drain.spawn(async move {
                        reverse(&shared2, &id2, &to, i, &failing).await;
                    });
                }
                // Rejected by the server, or the client is closed.
                None => break,
            },
        }
    }
    // Dropping the listener unbinds it.
    drop(listener);
}

/// One reverse stream: connect to the local process first, then accept, so the cluster side
/// sees a refusal (with the reason) instead of a stream that closes at once.
async fn reverse(
    shared: &Shared,
    id: &str,
    to_local: &str,
    incoming: Incoming,
    failing: &AtomicBool,
) {
    let connect = connect_local(to_local, shared.allow_remote_targets);
    let why = match tokio::time::timeout(shared.local_connect_timeout, connect).await {
        Ok(Ok(tcp)) => {
            let _ = tcp.set_nodelay(true);
            if failing.swap(false, Ordering::Relaxed) {
                set_mapping(shared, id, |m| m.local_error = None);
                shared.emit(Event::LocalReachable {
                    id: id.to_owned(),
                    to_local: to_local.to_owned(),
                });
            }
            let Ok(mut stream) = incoming.accept().await else {
                return;
            };
            match stream.splice(tcp).await {
                Ok((up, down)) => {
                    tracing::debug!(bind = id, %to_local, to_local_bytes = down, to_cluster_bytes = up, "reverse connection done")
                }
                Err(e) => {
                    tracing::debug!(bind = id, %to_local, error = %e, "reverse connection failed")
                }
            }
            return;
        }
        Ok(Err(e)) => format!("nothing accepts connections at {to_local} on the workstation: {e}"),
        Err(_) => format!(
            "connecting to {to_local} on the workstation timed out after {:?}",
            shared.local_connect_timeout
        ),
    };
    if !failing.swap(true, Ordering::Relaxed) {
        set_mapping(shared, id, |m| m.local_error = Some(why.clone()));
        shared.emit(Event::LocalUnreachable {
            id: id.to_owned(),
            to_local: to_local.to_owned(),
            reason: why.clone(),
        });
    }
    // Not tracked by the drain: over QUIC a rejection lingers until the peer acknowledges it,
    // which must not hold up a shutdown.
    tokio::spawn(async move { incoming.reject(&why).await });
}

#[cfg(test)]
mod tests {
    use super::{check_to_local, connect_local};

    #[test]
    fn to_local_must_be_host_and_port() {
        for ok in [
            "localhost:8080",
            "127.0.0.1:1",
            "[::1]:9000",
            "web.local:80",
        ] {
            assert!(check_to_local(ok, true).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "8080",
            "localhost",
            "localhost:0",
            ":80",
            "a b:80",
            "h:99999",
        ] {
            assert_eq!(check_to_local(bad, true).unwrap_err().0, "invalid", "{bad}");
        }
    }

    /// A Sandbox points `toLocal` at an address on the developer's network (a router, a
    /// metadata service, another machine): refused without the flag, with the way to allow it.
    #[test]
    fn remote_targets_are_refused_without_the_flag() {
        for local in [
            "localhost:8080",
            "LOCALHOST.:8080",
            "127.0.0.1:1",
            "127.8.9.10:80",
            "[::1]:9000",
            "[::ffff:127.0.0.1]:80",
        ] {
            assert!(check_to_local(local, false).is_ok(), "{local}");
        }
        for remote in [
            "10.0.0.5:22",
            "192.168.1.1:80",
            "169.254.169.254:80",
            "[::ffff:169.254.169.254]:80",
            "0.0.0.0:80",
            "[::]:80",
            "db.internal.example.com:5432",
            "localhost.evil.example:80",
        ] {
            let (status, why) = check_to_local(remote, false).unwrap_err();
            assert_eq!(status, "refused", "{remote}");
            assert!(why.contains("--allow-remote-targets"), "{why}");
            assert!(check_to_local(remote, true).is_ok(), "{remote}");
        }
    }

    #[tokio::test]
    async fn only_loopback_addresses_are_dialed_without_the_flag() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        assert!(connect_local(&addr.to_string(), false).await.is_ok());
        // A name that resolves elsewhere is not dialed, whatever listens there.
        let err = connect_local("192.0.2.1:80", false).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
    }
}
