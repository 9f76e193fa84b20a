//! Reverse bindings (cluster → laptop): one TCP listener per bind of a session, its port in
//! the session's Lease, and the source check on every connection (`crate::sources`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spur_api::tunnel::PortAssignment;
use spur_tunnel::SessionHandle;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{Audit, Shared, audit, carry};
use crate::api::BindId;
use crate::sessions::SessionReporter;
use crate::sources::serve_reverse_listener;

/// Keeps one TCP listener per reverse binding of the session and the Lease's port list in step
/// with the session's binds; returns the reporter when the session ends.
pub(super) async fn track_binds(
    handle: SessionHandle,
    shared: Arc<Shared>,
    reporter: SessionReporter,
    stop: CancellationToken,
) -> SessionReporter {
    let mut binds = handle.binds();
    let mut listening: BTreeMap<String, (PortAssignment, CancellationToken)> = BTreeMap::new();
    loop {
        let wanted = binds.borrow_and_update().clone();
        // Gone binds: stop their listeners.
        let gone: Vec<String> = listening
            .keys()
            .filter(|b| !wanted.contains_key(*b))
            .cloned()
            .collect();
        for b in gone {
            if let Some((_, token)) = listening.remove(&b) {
                token.cancel();
            }
        }
        for bind in wanted.keys() {
            if listening.contains_key(bind) {
                continue;
            }
            let Ok(id) = bind.parse::<BindId>() else {
                continue;
            };
            match bind_reverse(&shared).await {
                Ok(l) => {
                    let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
                    let token = stop.child_token();
                    tokio::spawn(reverse_listener(
                        l,
                        bind.clone(),
                        id.namespace.clone(),
                        handle.clone(),
                        shared.clone(),
                        token.clone(),
                    ));
                    listening.insert(
                        bind.clone(),
                        (
                            PortAssignment {
                                namespace: id.namespace,
                                external_workload: id.external_workload,
                                port: i32::from(id.port),
                                proxy_port: i32::from(port),
                            },
                            token,
                        ),
                    );
                }
                Err(e) => tracing::warn!(%bind, error = %e, "cannot open a reverse listener"),
            }
        }
        reporter.set_ports(listening.values().map(|(p, _)| p.clone()).collect());
        tokio::select! {
            () = stop.cancelled() => break,
            r = binds.changed() => if r.is_err() { break },
        }
    }
    for (_, (_, token)) in listening {
        token.cancel();
    }
    reporter
}

/// A listener for a reverse binding: in `reverse_ports` if set (the first free one from a
/// rotating start), else on an ephemeral port.
async fn bind_reverse(shared: &Shared) -> std::io::Result<TcpListener> {
    let Some(range) = &shared.reverse_ports else {
        return TcpListener::bind((shared.reverse_bind, 0)).await;
    };
    let (first, last) = (u32::from(*range.start()), u32::from(*range.end()));
    let size = last - first + 1;
    let start = shared
        .next_reverse_port
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for i in 0..size {
        let port = u16::try_from(first + (start.wrapping_add(i)) % size).unwrap_or(0);
        match TcpListener::bind((shared.reverse_bind, port)).await {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "every port of the reverse range {first}-{last} is taken; widen \
             --reverse-ports (chart tunnelProxy.reversePorts) or add replicas"
        ),
    ))
}

/// Cluster connections arriving for a reverse binding go to the workstation, if they come
/// from a sidecar pod of the bind's namespace or a gateway (`sources.rs`).
async fn reverse_listener(
    listener: TcpListener,
    bind: String,
    namespace: String,
    handle: SessionHandle,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let sources = shared.sources.clone();
    let who = handle.identity().name.clone();
    let to = format!("workstation:{bind}");
    let refused = {
        let (who, to, metrics) = (who.clone(), to.clone(), shared.metrics.clone());
        move |from: SocketAddr, why: String| {
            metrics.reverse_refused.inc();
            tracing::warn!(workstation = %who, %from, reason = %why, "reverse listener: connection refused");
            audit(Audit {
                kind: "reverse",
                who: &who,
                from: &from.to_string(),
                to: &to,
                to_cluster: 0,
                to_workstation: 0,
                took: Duration::ZERO,
                outcome: &format!("refused: {why}"),
            });
        }
    };
    let admitted = move |tcp: TcpStream, from: SocketAddr| {
        let (handle, shared, bind, who, to) = (
            handle.clone(),
            shared.clone(),
            bind.clone(),
            who.clone(),
            to.clone(),
        );
        async move {
            let started = Instant::now();
            match handle.open_reverse(&bind).await {
                Ok(stream) => {
                    let (up, down, outcome) = carry(tcp, stream, "reverse", &shared.metrics).await;
                    audit(Audit {
                        kind: "reverse",
                        who: &who,
                        from: &from.to_string(),
                        to: &to,
                        to_cluster: down,
                        to_workstation: up,
                        took: started.elapsed(),
                        outcome: &outcome,
                    });
                }
                Err(e) => audit(Audit {
                    kind: "reverse",
                    who: &who,
                    from: &from.to_string(),
                    to: &to,
                    to_cluster: 0,
                    to_workstation: 0,
                    took: started.elapsed(),
                    outcome: &format!("workstation refused: {e}"),
                }),
            }
        }
    };
    serve_reverse_listener(listener, namespace, sources, stop, admitted, refused).await;
}
