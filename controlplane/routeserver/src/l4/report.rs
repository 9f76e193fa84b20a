//! Gateways' health reports into `status.gateways[]` of the ListenerSets they serve: one entry
//! per gateway pod, written by server-side apply under the field manager
//! `spur-routeserver/gateway/<pod>` (forced), so entries of different pods, and the operator's
//! fields, never conflict.
//!
//! An entry is written when its endpoints change and refreshed every `refresh` (its
//! `updatedAt` says how fresh it is). When a pod's last Watch stream on this replica ends, its
//! entries are removed (an empty list applied under its manager), as EnvoyConfig reports do.
//!
//! A gateway that moves to another replica before this one notices its old stream is gone
//! (the HTTP/2 keepalive: up to 40 s) can lose its entry for up to one `refresh`: both
//! replicas write under the pod's one manager, so this replica's removal takes the other's
//! write with it until the other refreshes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use spur_api::ListenerSet;
use spur_api::listenerset::{EndpointHealth, GatewayStatus};
use spur_proto::l4::EndpointReport;

use super::metrics::L4Metrics;

/// Most bytes of an endpoint's message written into status.
const MAX_MESSAGE: usize = 256;
/// Longest field manager name the API server accepts.
const MAX_MANAGER: usize = 128;

/// Writes status entries.
#[derive(Clone)]
pub(crate) struct Writer {
    pub(crate) client: Client,
    pub(crate) refresh: Duration,
    pub(crate) metrics: L4Metrics,
}

/// The gateway pods with a Watch stream open on this replica.
#[derive(Clone, Default)]
pub(crate) struct Gateways {
    inner: Arc<Mutex<GatewayMap>>,
}

/// (namespace, pod) → its state.
type GatewayMap = HashMap<(String, String), Arc<Gateway>>;

/// One gateway pod.
pub(crate) struct Gateway {
    namespace: String,
    pod: String,
    /// Its open streams; changed only under the [`Gateways`] lock.
    streams: AtomicUsize,
    /// The sets it serves, as its newest stream last computed them, each with its listeners
    /// left out for an older set's (see `crate::l4_model::PodConfig::shadowed`).
    sets: Mutex<BTreeMap<String, Vec<String>>>,
    /// What this replica wrote per set. Held across the writes, so the reports of one pod and
    /// its removal are applied one at a time and in order.
    written: tokio::sync::Mutex<BTreeMap<String, Written>>,
    /// The last configuration error it reported (logged once per change).
    config_error: Mutex<String>,
}

/// One set's entry for a pod.
#[derive(Debug, Clone, Default, PartialEq)]
struct Entry {
    endpoints: Vec<EndpointHealth>,
    shadowed: Vec<String>,
}

struct Written {
    entry: Entry,
    at: Instant,
}

impl Gateways {
    fn lock(&self) -> std::sync::MutexGuard<'_, GatewayMap> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A stream of `namespace/pod` opens.
    pub(crate) fn open(&self, namespace: &str, pod: &str) -> Arc<Gateway> {
        let mut map = self.lock();
        let g = map
            .entry((namespace.to_owned(), pod.to_owned()))
            .or_insert_with(|| {
                Arc::new(Gateway {
                    namespace: namespace.to_owned(),
                    pod: pod.to_owned(),
                    streams: AtomicUsize::new(0),
                    sets: Mutex::default(),
                    written: tokio::sync::Mutex::default(),
                    config_error: Mutex::default(),
                })
            })
            .clone();
        g.streams.fetch_add(1, Ordering::SeqCst);
        g
    }

    /// The pod, if a stream of it is open here.
    pub(crate) fn get(&self, namespace: &str, pod: &str) -> Option<Arc<Gateway>> {
        self.lock()
            .get(&(namespace.to_owned(), pod.to_owned()))
            .filter(|g| g.streams.load(Ordering::SeqCst) > 0)
            .cloned()
    }

    /// A stream of `g` ended; the last one takes the pod's entries out of status.
    pub(crate) async fn close(&self, g: &Arc<Gateway>, writer: &Writer) {
        {
            let _map = self.lock();
            if g.streams.fetch_sub(1, Ordering::SeqCst) > 1 {
                return;
            }
        }
        let mut written = g.written.lock().await;
        if g.streams.load(Ordering::SeqCst) > 0 {
            // Reconnected meanwhile: the new stream keeps the entries.
            return;
        }
        for set in written.keys() {
            if let Err(e) = writer.write(&g.namespace, set, &g.pod, None).await {
                tracing::debug!(namespace = %g.namespace, set, pod = %g.pod, error = %e, "cannot remove a gateway's status entry");
            }
        }
        written.clear();
        drop(written);
        let mut map = self.lock();
        let key = (g.namespace.clone(), g.pod.clone());
        if g.streams.load(Ordering::SeqCst) == 0 && map.get(&key).is_some_and(|m| Arc::ptr_eq(m, g))
        {
            map.remove(&key);
        }
    }
}

impl Gateway {
    pub(crate) fn set_sets(
        &self,
        sets: BTreeSet<String>,
        mut shadowed: BTreeMap<String, Vec<String>>,
    ) {
        let sets = sets
            .into_iter()
            .map(|s| {
                let left_out = shadowed.remove(&s).unwrap_or_default();
                (s, left_out)
            })
            .collect();
        *self.sets.lock().unwrap_or_else(|p| p.into_inner()) = sets;
    }

    /// Remembers the gateway's configuration error; true when it changed.
    pub(crate) fn note_config_error(&self, error: &str) -> bool {
        let mut last = self.config_error.lock().unwrap_or_else(|p| p.into_inner());
        if *last == error {
            return false;
        }
        *last = error.to_owned();
        true
    }

    /// Writes the report's entries that changed or are due for a refresh, and removes this
    /// pod's entries from sets it no longer serves.
    pub(crate) async fn report(
        &self,
        writer: &Writer,
        endpoints: Vec<EndpointReport>,
    ) -> Result<(), kube::Error> {
        let sets = self.sets.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut by_set: BTreeMap<String, Entry> = sets
            .into_iter()
            .map(|(s, shadowed)| {
                let entry = Entry {
                    endpoints: Vec::new(),
                    shadowed,
                };
                (s, entry)
            })
            .collect();
        for e in endpoints {
            // Endpoints of sets the pod does not serve are not its to report.
            if let Some(entry) = by_set.get_mut(&e.listener_set) {
                entry.endpoints.push(EndpointHealth {
                    cluster: e.cluster,
                    id: e.id,
                    address: e.address,
                    healthy: e.healthy,
                    ejected: e.ejected,
                    message: (!e.message.is_empty()).then(|| shorten(&e.message)),
                });
            }
        }
        let mut written = self.written.lock().await;
        if self.streams.load(Ordering::SeqCst) == 0 {
            // Its stream ended while this report waited: the entries are gone, leave them so.
            return Ok(());
        }
        for (set, mut entry) in by_set
            .iter_mut()
            .map(|(s, e)| (s.clone(), std::mem::take(e)))
        {
            entry
                .endpoints
                .sort_by(|a, b| (&a.cluster, &a.id).cmp(&(&b.cluster, &b.id)));
            let due = written
                .get(&set)
                .is_none_or(|w| w.entry != entry || w.at.elapsed() >= writer.refresh);
            if !due {
                continue;
            }
            writer
                .write(&self.namespace, &set, &self.pod, Some(&entry))
                .await?;
            written.insert(
                set,
                Written {
                    entry,
                    at: Instant::now(),
                },
            );
        }
        let gone: Vec<String> = written
            .keys()
            .filter(|s| !by_set.contains_key(*s))
            .cloned()
            .collect();
        for set in gone {
            writer.write(&self.namespace, &set, &self.pod, None).await?;
            written.remove(&set);
        }
        Ok(())
    }
}

impl Writer {
    /// Applies this pod's entry of `set` (None: no entry) under the pod's field manager.
    async fn write(
        &self,
        namespace: &str,
        set: &str,
        pod: &str,
        entry: Option<&Entry>,
    ) -> Result<(), kube::Error> {
        let api: Api<ListenerSet> = Api::namespaced(self.client.clone(), namespace);
        let entries: Vec<GatewayStatus> = entry
            .map(|e| GatewayStatus {
                pod: pod.to_owned(),
                endpoints: e.endpoints.clone(),
                shadowed: e.shadowed.iter().map(|s| shorten(s)).collect(),
                updated_at: Some(Time(k8s_openapi::jiff::Timestamp::now())),
            })
            .into_iter()
            .collect();
        let body = serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1",
            "kind": "ListenerSet",
            "status": { "gateways": entries },
        });
        let result = api
            .patch_status(
                set,
                &PatchParams::apply(&manager(pod)).force(),
                &Patch::Apply(&body),
            )
            .await;
        match result {
            Ok(_) => {
                self.metrics.write(true);
                Ok(())
            }
            // Deleted meanwhile: nothing to report on.
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => {
                self.metrics.write(false);
                Err(e)
            }
        }
    }
}

/// `spur-routeserver/gateway/<pod>`, shortened with a hash of the pod's name when that is
/// longer than a field manager may be.
pub(crate) fn manager(pod: &str) -> String {
    let full = format!("spur-routeserver/gateway/{pod}");
    if full.len() <= MAX_MANAGER {
        return full;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in pod.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut end = MAX_MANAGER - 17;
    while !full.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}-{h:016x}", &full[..end])
}

fn shorten(s: &str) -> String {
    if s.len() <= MAX_MESSAGE {
        return s.to_owned();
    }
    let mut end = MAX_MESSAGE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managers_fit() {
        assert_eq!(manager("gw-0"), "spur-routeserver/gateway/gw-0");
        let long = "g".repeat(253);
        let m = manager(&long);
        assert_eq!(m.len(), MAX_MANAGER);
        assert_ne!(m, manager(&"g".repeat(252)));
        assert_eq!(shorten(&"é".repeat(200)).chars().count(), 129);
    }
}
