//! The tunnel API (`spur.tunnel.v1.TunnelApi`) for one authenticated workstation: cluster DNS,
//! the cluster's Services, and the local workloads bound to this workstation, all from watch
//! caches shared by every session of the replica.
//!
//! Reverse bindings are named `<namespace>/<externalWorkload>/<port>` ([`BindId`]); a
//! workstation may only bind the ports of ExternalWorkloads whose `spec.workstation` is its own
//! ([`Caches::authorize_bind`]), so one developer's routing key never reaches another's laptop.

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::ExternalWorkload;
use spur_proto::tunnel::tunnel_api_server::TunnelApi;
use spur_proto::tunnel::{
    ClusterService, HelloRequest, HelloResponse, ListServicesRequest, ListServicesResponse,
    LocalMapping, LocalWorkload, LocalWorkloads, ResolveRequest, ResolveResponse, ServicePort,
    WatchLocalWorkloadsRequest, Workload,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::Error;
use crate::addr::canonical;
use crate::ipindex::{IpIndex, apply_event};

/// A reverse binding: one mapped port of one ExternalWorkload.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct BindId {
    pub namespace: String,
    pub external_workload: String,
    pub port: u16,
}

impl std::fmt::Display for BindId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.namespace, self.external_workload, self.port
        )
    }
}

impl std::str::FromStr for BindId {
    type Err = String;

    fn from_str(s: &str) -> Result<BindId, String> {
        let mut parts = s.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(ns), Some(ew), Some(port), None) if !ns.is_empty() && !ew.is_empty() => {
                Ok(BindId {
                    namespace: ns.into(),
                    external_workload: ew.into(),
                    port: port
                        .parse()
                        .ok()
                        .filter(|p| *p != 0)
                        .ok_or_else(|| format!("bind {s:?}: bad port"))?,
                })
            }
            _ => Err(format!("bind {s:?} is not namespace/externalWorkload/port")),
        }
    }
}

/// Logs a failed watch (it retries with backoff) and keeps the error for the start-up timeout.
fn watch_failed(last: &std::sync::Mutex<Option<String>>, kind: &str, e: &watcher::Error) {
    tracing::warn!(error = %e, "{kind} watch failed; retrying");
    if let Ok(mut last) = last.lock() {
        *last = Some(format!("{kind}s: {e}"));
    }
}

/// Watch caches every session of a replica reads.
#[derive(Clone)]
pub struct Caches {
    services: Store<Service>,
    /// Every Service's cluster IPs → its namespace (a tunnel grant's sessions may reach the
    /// Services of their namespace, crate::scope).
    service_ips: Arc<RwLock<IpIndex<String>>>,
    externals: Store<ExternalWorkload>,
    /// Bumped whenever an ExternalWorkload changes, so watchers re-send their list.
    generation: watch::Receiver<u64>,
}

impl Caches {
    /// Starts the Service and ExternalWorkload watches (cluster-wide); resolves once both have
    /// listed.
    pub async fn start(client: Client, stop: CancellationToken) -> Result<Caches, Error> {
        let (services, svc_writer) = reflector::store();
        let svc_stream = reflector::reflector(
            svc_writer,
            watcher(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff();
        let (externals, ew_writer) = reflector::store();
        let ew_stream = reflector::reflector(
            ew_writer,
            watcher(
                Api::<ExternalWorkload>::all(client),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .touched_objects();
        let (bump, generation) = watch::channel(0u64);
        // The newest watch error, for the start-up timeout's message: a missing CRD or RBAC
        // rule otherwise looks like a hang.
        let last_error = Arc::new(std::sync::Mutex::new(None::<String>));
        let s1 = stop.clone();
        let e1 = last_error.clone();
        let service_ips = Arc::new(RwLock::new(IpIndex::default()));
        let index = service_ips.clone();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(svc_stream.take_until(s1.cancelled_owned()));
            let mut listing = None;
            while let Some(ev) = s.next().await {
                match ev {
                    Ok(ev) => {
                        apply_event(&index, &mut listing, ev, service_entry);
                    }
                    Err(e) => watch_failed(&e1, "Service", &e),
                }
            }
        });
        let e2 = last_error.clone();
        tokio::spawn(async move {
            let mut s = std::pin::pin!(ew_stream.take_until(stop.cancelled_owned()));
            while let Some(ev) = s.next().await {
                match ev {
                    Ok(_) => bump.send_modify(|g| *g = g.wrapping_add(1)),
                    Err(e) => watch_failed(&e2, "ExternalWorkload", &e),
                }
            }
        });
        let ready = async {
            services.wait_until_ready().await?;
            externals.wait_until_ready().await
        };
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .map_err(|_| {
                let last = last_error.lock().ok().and_then(|l| l.clone());
                Error::Kube(match last {
                    Some(e) => {
                        format!("timed out listing Services and ExternalWorkloads; last error: {e}")
                    }
                    None => "timed out listing Services and ExternalWorkloads".into(),
                })
            })?
            .map_err(|e| Error::Kube(e.to_string()))?;
        Ok(Caches {
            services,
            service_ips,
            externals,
            generation,
        })
    }

    /// Every Service's cluster IPs → its namespace, kept current by the Service watch.
    pub(crate) fn service_ips(&self) -> Arc<RwLock<IpIndex<String>>> {
        self.service_ips.clone()
    }

    /// The local workloads bound to `workstation`, sorted.
    pub fn local_workloads(&self, workstation: &str) -> Vec<LocalWorkload> {
        let mut out: Vec<LocalWorkload> = self
            .externals
            .state()
            .iter()
            .filter(|ew| {
                ew.spec.workstation == workstation && ew.metadata.deletion_timestamp.is_none()
            })
            .map(|ew| {
                let ns = ew.namespace().unwrap_or_default();
                let name = ew.name_any();
                LocalWorkload {
                    sandbox: ew.spec.sandbox.clone(),
                    routing_key: ew.spec.routing_key.clone(),
                    name: ew.spec.name.clone(),
                    namespace: ns.clone(),
                    external_workload: name.clone(),
                    baseline: Some(Workload {
                        kind: ew.spec.baseline.kind.routes_api_kind().to_string(),
                        namespace: ew.spec.baseline.namespace.clone(),
                        name: ew.spec.baseline.name.clone(),
                    }),
                    mappings: ew
                        .spec
                        .mappings
                        .iter()
                        .map(|m| LocalMapping {
                            port: u32::try_from(m.port).unwrap_or(0),
                            to_local: m.to_local.clone(),
                            bind_id: BindId {
                                namespace: ns.clone(),
                                external_workload: name.clone(),
                                port: u16::try_from(m.port).unwrap_or(0),
                            }
                            .to_string(),
                        })
                        .collect(),
                }
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.namespace, &a.external_workload).cmp(&(&b.namespace, &b.external_workload))
        });
        out
    }

    /// Whether `workstation` may bind `bind`: the ExternalWorkload exists, is bound to that
    /// workstation, and maps that port.
    pub fn authorize_bind(&self, workstation: &str, bind: &str) -> Result<BindId, String> {
        let id: BindId = bind.parse()?;
        let ew = self
            .externals
            .get(&ObjectRef::new(&id.external_workload).within(&id.namespace))
            .ok_or_else(|| {
                format!(
                    "no ExternalWorkload {}/{}",
                    id.namespace, id.external_workload
                )
            })?;
        if ew.spec.workstation != workstation {
            return Err(format!(
                "ExternalWorkload {}/{} belongs to another workstation",
                id.namespace, id.external_workload
            ));
        }
        if !ew
            .spec
            .mappings
            .iter()
            .any(|m| m.port == i32::from(id.port))
        {
            return Err(format!("port {} is not mapped", id.port));
        }
        Ok(id)
    }
}

/// What the Service index keeps of `svc`: its cluster IPs (all families; not headless
/// `None`, not `externalIPs` or load-balancer addresses, which a Service's writer may set to
/// any address) and its namespace.
pub(crate) fn service_entry(svc: &Service) -> (String, Option<(Vec<IpAddr>, String)>) {
    let namespace = svc.namespace().unwrap_or_default();
    let key = format!("{namespace}/{}", svc.name_any());
    let spec = svc.spec.as_ref();
    let mut ips: Vec<IpAddr> = spec
        .and_then(|s| s.cluster_ips.as_ref())
        .into_iter()
        .flatten()
        .chain(spec.and_then(|s| s.cluster_ip.as_ref()))
        .filter_map(|ip| ip.parse::<IpAddr>().ok())
        .map(canonical)
        .collect();
    ips.sort();
    ips.dedup();
    (key, Some((ips, namespace)))
}

/// The tunnel API of one session.
pub struct TunnelApiService {
    pub workstation: String,
    pub proxy_pod: String,
    pub cluster_domain: String,
    pub caches: Caches,
    /// A tunnel grant's namespace: the session lists only that namespace's Services (it may
    /// dial nothing else, crate::scope, and other namespaces' Service names are not its
    /// business).
    pub scope: Option<String>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<LocalWorkloads, Status>> + Send>>;

#[tonic::async_trait]
impl TunnelApi for TunnelApiService {
    async fn hello(&self, _: Request<HelloRequest>) -> Result<Response<HelloResponse>, Status> {
        Ok(Response::new(HelloResponse {
            workstation: self.workstation.clone(),
            proxy_pod: self.proxy_pod.clone(),
            cluster_domain: self.cluster_domain.clone(),
        }))
    }

    async fn resolve(
        &self,
        req: Request<ResolveRequest>,
    ) -> Result<Response<ResolveResponse>, Status> {
        let name = req.into_inner().name;
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if !valid {
            return Err(Status::invalid_argument(format!(
                "{name:?} is not a DNS name"
            )));
        }
        if let Ok(ip) = name.parse::<IpAddr>() {
            return Ok(Response::new(ResolveResponse {
                addresses: vec![ip.to_string()],
            }));
        }
        // The pod's resolver is the cluster's DNS: names resolve as they would for any pod.
        let lookup = tokio::net::lookup_host((name.as_str(), 0));
        let addresses = match tokio::time::timeout(Duration::from_secs(5), lookup).await {
            Ok(Ok(addrs)) => {
                let mut v: Vec<String> = addrs.map(|a| a.ip().to_string()).collect();
                v.sort();
                v.dedup();
                v
            }
            // NXDOMAIN and friends: an empty answer, not an error.
            Ok(Err(_)) => Vec::new(),
            Err(_) => return Err(Status::deadline_exceeded("DNS lookup timed out")),
        };
        Ok(Response::new(ResolveResponse { addresses }))
    }

    async fn list_services(
        &self,
        req: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
        let wanted = req.into_inner().namespaces;
        let scope = self.scope.as_deref();
        let mut services: Vec<ClusterService> = self
            .caches
            .services
            .state()
            .iter()
            .filter(|s| {
                let ns = s.namespace().unwrap_or_default();
                (wanted.is_empty() || wanted.contains(&ns)) && scope.is_none_or(|n| n == ns)
            })
            .map(|s| ClusterService {
                namespace: s.namespace().unwrap_or_default(),
                name: s.name_any(),
                ports: s
                    .spec
                    .as_ref()
                    .and_then(|sp| sp.ports.as_ref())
                    .map(|ps| {
                        ps.iter()
                            .map(|p| ServicePort {
                                name: p.name.clone().unwrap_or_default(),
                                port: u32::try_from(p.port).unwrap_or(0),
                                protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            })
            .collect();
        services.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        Ok(Response::new(ListServicesResponse { services }))
    }

    type WatchLocalWorkloadsStream = WatchStream;

    async fn watch_local_workloads(
        &self,
        _: Request<WatchLocalWorkloadsRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let caches = self.caches.clone();
        let workstation = self.workstation.clone();
        let mut generation = caches.generation.clone();
        let stream = async_stream(move |tx| async move {
            let mut last = None;
            loop {
                let now = caches.local_workloads(&workstation);
                if last.as_ref() != Some(&now) {
                    if tx
                        .send(Ok(LocalWorkloads {
                            workloads: now.clone(),
                        }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    last = Some(now);
                }
                if generation.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }
}

/// A stream fed by a task through a small bounded channel (a slow client holds the task, not
/// memory).
fn async_stream<F, Fut>(f: F) -> WatchStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<LocalWorkloads, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bind_ids_round_trip_and_reject_garbage() {
        let id: BindId = "shop/dev-api-1/8080".parse().unwrap();
        assert_eq!(id.to_string(), "shop/dev-api-1/8080");
        for bad in [
            "",
            "shop/x",
            "shop/x/0",
            "shop/x/70000",
            "/x/80",
            "a/b/80/extra",
            "shop//80",
        ] {
            assert!(bad.parse::<BindId>().is_err(), "{bad}");
        }
    }
}
