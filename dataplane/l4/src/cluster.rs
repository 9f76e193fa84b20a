//! Clusters of endpoints: membership snapshots behind `arc-swap`, endpoint health and ejection
//! state that survives membership updates, and endpoint selection.
//!
//! Health and ejection are atomics on the endpoint, read at pick time: a health flip costs no
//! table rebuild, and a key whose endpoint is out of rotation is looked up past it (the ring's
//! next point, Maglev's next probe), so only the keys of endpoints out of rotation move.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{ClusterPlan, EndpointPlan, HealthPlan, LbPlan, OutlierPlan};
use crate::hash::{Maglev, Ring, rehash};
use crate::metrics::{EndpointMetrics, Metrics};

/// Milliseconds on a process-wide monotonic clock: one `u64` to store in atomics.
pub(crate) fn now_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    u64::try_from(BASE.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Maglev probes tried past an unavailable endpoint before a linear scan.
const MAGLEV_PROBES: u32 = 32;

/// One endpoint: its address and everything learnt about it.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) id: String,
    pub(crate) addr: SocketAddr,
    pub(crate) health_addr: SocketAddr,
    healthy: AtomicBool,
    /// Left its cluster: sessions on it move on their next datagram.
    removed: AtomicBool,
    ok_streak: AtomicU32,
    fail_streak: AtomicU32,
    connect_failures: AtomicU32,
    /// Ejections since the last successful connect: the next one lasts twice as long.
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
    last_health_error: Mutex<Option<String>>,
    /// The cluster's change counter, bumped whenever this endpoint enters or leaves rotation.
    epoch: Arc<AtomicU64>,
    metrics: EndpointMetrics,
}

impl Endpoint {
    fn new(plan: &EndpointPlan, epoch: Arc<AtomicU64>, metrics: EndpointMetrics) -> Self {
        // Optimistic: an endpoint is in rotation until checks say otherwise, so a new listener or
        // a scale-up serves at once instead of waiting a health interval.
        metrics.healthy.set(1);
        Endpoint {
            id: plan.id.clone(),
            addr: plan.addr,
            health_addr: plan.health_addr,
            healthy: AtomicBool::new(true),
            removed: AtomicBool::new(false),
            ok_streak: AtomicU32::new(0),
            fail_streak: AtomicU32::new(0),
            connect_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            last_health_error: Mutex::new(None),
            epoch,
            metrics,
        }
    }

    /// In rotation: a member, healthy and not ejected.
    pub(crate) fn available(&self, now: u64) -> bool {
        !self.removed.load(Relaxed)
            && self.healthy.load(Relaxed)
            && self.ejected_until_ms.load(Relaxed) <= now
    }

    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    /// Applies one active health check's result (one writer: the cluster's health task).
    pub(crate) fn observe_health(
        &self,
        result: Result<(), String>,
        plan: &HealthPlan,
        cluster: &str,
    ) {
        match result {
            Ok(()) => {
                self.fail_streak.store(0, Relaxed);
                let ok = self.ok_streak.load(Relaxed).saturating_add(1);
                self.ok_streak.store(ok, Relaxed);
                if !self.healthy.load(Relaxed) && ok >= plan.healthy_threshold {
                    self.healthy.store(true, Relaxed);
                    self.metrics.healthy.set(1);
                    self.epoch.fetch_add(1, Relaxed);
                    tracing::info!(cluster, endpoint = %self.id, "endpoint healthy again");
                }
            }
            Err(e) => {
                self.metrics.health_failures.inc();
                self.ok_streak.store(0, Relaxed);
                let failed = self.fail_streak.load(Relaxed).saturating_add(1);
                self.fail_streak.store(failed, Relaxed);
                if self.healthy.load(Relaxed) && failed >= plan.unhealthy_threshold {
                    self.healthy.store(false, Relaxed);
                    self.metrics.healthy.set(0);
                    self.epoch.fetch_add(1, Relaxed);
                    tracing::warn!(cluster, endpoint = %self.id, error = %e, "endpoint unhealthy: out of rotation");
                }
                *self
                    .last_health_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        }
    }

    fn set_healthy(&self) {
        self.healthy.store(true, Relaxed);
        self.metrics.healthy.set(1);
        self.fail_streak.store(0, Relaxed);
        *self
            .last_health_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// A TCP connect to the endpoint failed or timed out: counts towards ejection.
    pub(crate) fn connect_failed(&self, outlier: &OutlierPlan, now: u64) {
        self.metrics.connect_failures.inc();
        if outlier.consecutive_failures == 0 {
            return;
        }
        let failures = self
            .connect_failures
            .fetch_add(1, Relaxed)
            .saturating_add(1);
        if failures < outlier.consecutive_failures {
            return;
        }
        self.connect_failures.store(0, Relaxed);
        let times = self.ejections.fetch_add(1, Relaxed).min(16);
        let ejection = outlier
            .base_ejection
            .saturating_mul(1 << times)
            .min(outlier.max_ejection);
        self.ejected_until_ms
            .store(now.saturating_add(millis(ejection)), Relaxed);
        self.metrics.ejections.inc();
        self.epoch.fetch_add(1, Relaxed);
        tracing::warn!(endpoint = %self.id, addr = %self.addr, ?ejection, "endpoint ejected after consecutive connect failures");
    }

    pub(crate) fn connect_succeeded(&self) {
        // Loads first: the common case writes nothing to a line every connection shares.
        if self.connect_failures.load(Relaxed) != 0 {
            self.connect_failures.store(0, Relaxed);
        }
        if self.ejections.load(Relaxed) != 0 {
            self.ejections.store(0, Relaxed);
        }
    }

    fn status(&self, now: u64) -> EndpointStatus {
        EndpointStatus {
            id: self.id.clone(),
            address: self.addr,
            healthy: self.healthy.load(Relaxed),
            ejected: self.ejected_until_ms.load(Relaxed) > now,
            last_health_error: self
                .last_health_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}

/// An endpoint as the status API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointStatus {
    pub id: String,
    pub address: SocketAddr,
    /// Passing its active health checks (always true without health checks).
    pub healthy: bool,
    /// Ejected for consecutive connect failures, for now.
    pub ejected: bool,
    /// Why the last failed health check failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_health_error: Option<String>,
}

/// A cluster as the status API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    pub name: String,
    pub endpoints: Vec<EndpointStatus>,
}

impl ClusterStatus {
    /// Endpoints in rotation (healthy and not ejected).
    pub fn available(&self) -> usize {
        self.endpoints
            .iter()
            .filter(|e| e.healthy && !e.ejected)
            .count()
    }
}

#[derive(Debug)]
enum Balancer {
    RoundRobin,
    Ring(Ring),
    Maglev(Maglev),
}

/// One immutable membership of a cluster.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub(crate) plan: ClusterPlan,
    /// Sorted by id; indices match the balancer's.
    pub(crate) endpoints: Vec<Arc<Endpoint>>,
    balancer: Balancer,
}

impl Snapshot {
    /// The endpoint for `hash` among those in rotation and not `skip`ped; if none is in
    /// rotation, among all members (a cluster whose every endpoint fails its checks still gets
    /// traffic, as Envoy's panic threshold does: better than certain failure).
    pub(crate) fn pick(
        &self,
        hash: u64,
        rr: &AtomicUsize,
        now: u64,
        skip: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        self.pick_where(hash, rr, |i| !skip(i) && self.endpoints[i].available(now))
            .or_else(|| self.pick_where(hash, rr, |i| !skip(i) && !self.endpoints[i].is_removed()))
    }

    fn pick_where(&self, hash: u64, rr: &AtomicUsize, ok: impl Fn(usize) -> bool) -> Option<usize> {
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        match &self.balancer {
            Balancer::RoundRobin => {
                let start = rr.fetch_add(1, Relaxed);
                (0..n).map(|i| start.wrapping_add(i) % n).find(|i| ok(*i))
            }
            Balancer::Ring(ring) => ring.walk(hash).find(|i| ok(*i)),
            Balancer::Maglev(table) => {
                let first = table.get(hash);
                if ok(first) {
                    return Some(first);
                }
                (1..=MAGLEV_PROBES)
                    .map(|a| table.get(rehash(hash, a)))
                    .find(|i| ok(*i))
                    .or_else(|| {
                        let start = (hash % n as u64) as usize;
                        (0..n).map(|i| (start + i) % n).find(|i| ok(*i))
                    })
            }
        }
    }
}

/// A named cluster: the current snapshot and what outlives snapshots.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub(crate) name: String,
    snapshot: ArcSwap<Snapshot>,
    pub(crate) rr: AtomicUsize,
    /// Bumped whenever an endpoint enters or leaves rotation or membership: a UDP session whose
    /// endpoint is out of rotation looks for another only when this moved since it last
    /// looked, so a cluster with nothing in rotation costs no lookup per datagram.
    pub(crate) epoch: Arc<AtomicU64>,
    health: Mutex<Option<(HealthPlan, CancellationToken)>>,
    metrics: Metrics,
}

impl Cluster {
    pub(crate) fn new(plan: ClusterPlan, metrics: Metrics) -> Arc<Self> {
        let epoch = Arc::new(AtomicU64::new(0));
        let endpoints = plan
            .endpoints
            .iter()
            .map(|p| {
                Arc::new(Endpoint::new(
                    p,
                    epoch.clone(),
                    metrics.endpoint(&plan.name, &p.id),
                ))
            })
            .collect();
        Arc::new(Cluster {
            name: plan.name.clone(),
            snapshot: ArcSwap::from_pointee(build(plan, endpoints)),
            rr: AtomicUsize::new(0),
            epoch,
            health: Mutex::new(None),
            metrics,
        })
    }

    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.snapshot.load()
    }

    pub(crate) fn load_full(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Picks an endpoint for `hash` in the current snapshot.
    pub(crate) fn pick(&self, hash: u64, now: u64) -> Option<Arc<Endpoint>> {
        let snap = self.snapshot.load();
        snap.pick(hash, &self.rr, now, |_| false)
            .map(|i| snap.endpoints[i].clone())
    }

    /// Replaces the membership and settings. Endpoints that keep their id and addresses keep
    /// their health and ejection state (and their sessions); the others are marked removed.
    pub(crate) fn update(&self, plan: ClusterPlan) {
        let old = self.snapshot.load_full();
        let same = |e: &Endpoint, p: &EndpointPlan| {
            e.id == p.id && e.addr == p.addr && e.health_addr == p.health_addr
        };
        let incoming: BTreeMap<&str, &EndpointPlan> =
            plan.endpoints.iter().map(|p| (p.id.as_str(), p)).collect();
        // Leavers first: a replaced id gets fresh series below, under the same labels.
        for e in &old.endpoints {
            if !incoming.get(e.id.as_str()).is_some_and(|p| same(e, p)) {
                e.removed.store(true, Relaxed);
                self.metrics.remove_endpoint(&self.name, &e.id);
            }
        }
        let kept: BTreeMap<&str, &Arc<Endpoint>> = old
            .endpoints
            .iter()
            .filter(|e| !e.is_removed())
            .map(|e| (e.id.as_str(), e))
            .collect();
        let endpoints = plan
            .endpoints
            .iter()
            .map(|p| match kept.get(p.id.as_str()) {
                Some(e) => Arc::clone(e),
                None => Arc::new(Endpoint::new(
                    p,
                    self.epoch.clone(),
                    self.metrics.endpoint(&self.name, &p.id),
                )),
            })
            .collect();
        if plan.health.is_none() {
            for e in &old.endpoints {
                e.set_healthy();
            }
        }
        self.snapshot.store(Arc::new(build(plan, endpoints)));
        self.epoch.fetch_add(1, Relaxed);
    }

    /// The cluster left the configuration: every endpoint leaves rotation (sessions on them
    /// re-route from scratch) and health checks stop.
    pub(crate) fn retire(&self) {
        for e in &self.snapshot.load().endpoints {
            e.removed.store(true, Relaxed);
            self.metrics.remove_endpoint(&self.name, &e.id);
        }
        self.epoch.fetch_add(1, Relaxed);
        if let Some((_, stop)) = self.health.lock().unwrap_or_else(|p| p.into_inner()).take() {
            stop.cancel();
        }
    }

    /// Starts, restarts or stops the health task to match the current snapshot's plan.
    pub(crate) fn sync_health(self: &Arc<Self>, tracker: &TaskTracker, parent: &CancellationToken) {
        let want = self.snapshot.load().plan.health.clone();
        let mut running = self.health.lock().unwrap_or_else(|p| p.into_inner());
        if running.as_ref().map(|(p, _)| p) == want.as_ref() {
            return;
        }
        if let Some((_, stop)) = running.take() {
            stop.cancel();
        }
        if let Some(plan) = want {
            let stop = parent.child_token();
            tracker.spawn(health_task(self.clone(), plan.clone(), stop.clone()));
            *running = Some((plan, stop));
        }
    }

    pub(crate) fn status(&self) -> ClusterStatus {
        let now = now_ms();
        ClusterStatus {
            name: self.name.clone(),
            endpoints: self
                .snapshot
                .load()
                .endpoints
                .iter()
                .map(|e| e.status(now))
                .collect(),
        }
    }
}

/// A cluster's health task: checks every endpoint each interval, all at once, each bounded by
/// the plan's timeout (see [`crate::health`]).
async fn health_task(cluster: Arc<Cluster>, plan: HealthPlan, stop: CancellationToken) {
    // The first round starts at once: a configuration that starts with a dead endpoint takes it
    // out of rotation within its thresholds, not an interval later.
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(next) => {}
        }
        let started = tokio::time::Instant::now();
        let snap = cluster.load_full();
        let mut checks = tokio::task::JoinSet::new();
        for e in &snap.endpoints {
            let (e, plan) = (e.clone(), plan.clone());
            checks.spawn(async move {
                let result = crate::health::check(&plan, e.health_addr).await;
                (e, result)
            });
        }
        loop {
            let done = tokio::select! {
                () = stop.cancelled() => return,
                done = checks.join_next() => done,
            };
            match done {
                None => break,
                Some(Ok((e, result))) => e.observe_health(result, &plan, &cluster.name),
                Some(Err(_)) => {} // a check task panicked: counts as nothing
            }
        }
        next += plan.interval;
        if next < started {
            next = started + plan.interval;
        }
    }
}

fn build(plan: ClusterPlan, endpoints: Vec<Arc<Endpoint>>) -> Snapshot {
    let ids = endpoints.iter().map(|e| e.id.as_str());
    let balancer = match plan.lb {
        LbPlan::RoundRobin => Balancer::RoundRobin,
        LbPlan::Ring { virtual_nodes } => Balancer::Ring(Ring::new(ids, virtual_nodes)),
        LbPlan::Maglev { table_size } => Balancer::Maglev(Maglev::new(ids, table_size)),
    };
    Snapshot {
        plan,
        endpoints,
        balancer,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::config::{ClusterConfig, EndpointConfig, HashKey, LbPolicy, cluster_plan};
    use crate::hash::hash_bytes;

    fn plan(lb: LbPolicy, n: u16) -> ClusterPlan {
        let endpoints = (0..n)
            .map(|i| EndpointConfig {
                id: format!("w{i}"),
                address: SocketAddr::from(([127, 0, 0, 1], 9000 + i)),
                health_check_port: None,
            })
            .collect();
        let mut c = ClusterConfig::new("c", endpoints);
        c.lb = lb;
        if lb != LbPolicy::RoundRobin {
            c.hash_key = Some(HashKey::SourceIpPort);
        }
        cluster_plan(&c, None).unwrap()
    }

    fn owners(c: &Cluster, keys: &[u64]) -> Vec<String> {
        keys.iter()
            .map(|k| c.pick(*k, now_ms()).unwrap().id.clone())
            .collect()
    }

    #[test]
    fn an_unhealthy_endpoint_loses_only_its_keys_and_gets_them_back() {
        let keys: Vec<u64> = (0..1000u32).map(|i| hash_bytes(&i.to_le_bytes())).collect();
        for lb in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let mut reg = Registry::default();
            let c = Cluster::new(plan(lb, 3), Metrics::register(&mut reg));
            let before = owners(&c, &keys);
            let hc = crate::config::HealthPlan {
                protocol: crate::config::HealthProtocol::Tcp,
                path: String::new(),
                interval: Duration::from_secs(1),
                timeout: Duration::from_secs(1),
                healthy_threshold: 2,
                unhealthy_threshold: 1,
            };
            let snap = c.load_full();
            let w1 = &snap.endpoints[1];
            let epoch = c.epoch.load(Relaxed);
            w1.observe_health(Err("refused".into()), &hc, "c");
            assert!(c.epoch.load(Relaxed) > epoch);
            let during = owners(&c, &keys);
            for (b, d) in before.iter().zip(&during) {
                assert_ne!(d, "w1");
                if b != "w1" {
                    assert_eq!(b, d, "{lb:?}: a key of a healthy endpoint moved");
                }
            }
            // w1's keys spread over both others, not all onto one.
            let to_w0 = before
                .iter()
                .zip(&during)
                .filter(|(b, d)| *b == "w1" && *d == "w0")
                .count();
            let w1_keys = before.iter().filter(|b| *b == "w1").count();
            assert!(
                to_w0 > w1_keys / 5 && to_w0 < w1_keys * 4 / 5,
                "{lb:?}: {to_w0} of {w1_keys}"
            );
            // Healthy threshold 2: one pass is not enough.
            w1.observe_health(Ok(()), &hc, "c");
            assert!(!w1.is_healthy());
            w1.observe_health(Ok(()), &hc, "c");
            assert_eq!(owners(&c, &keys), before);
        }
    }

    #[test]
    fn nothing_in_rotation_still_routes_and_round_robin_skips_the_unavailable() {
        let mut reg = Registry::default();
        let c = Cluster::new(plan(LbPolicy::RoundRobin, 3), Metrics::register(&mut reg));
        let snap = c.load_full();
        let outlier = OutlierPlan {
            consecutive_failures: 2,
            base_ejection: Duration::from_secs(60),
            max_ejection: Duration::from_secs(600),
        };
        let now = now_ms();
        snap.endpoints[0].connect_failed(&outlier, now);
        assert!(
            snap.endpoints[0].available(now),
            "one failure is not enough"
        );
        snap.endpoints[0].connect_failed(&outlier, now);
        assert!(!snap.endpoints[0].available(now));
        assert!(
            snap.endpoints[0].available(now + 60_001),
            "the ejection ends"
        );
        let picked: Vec<String> = (0..6).map(|_| c.pick(0, now).unwrap().id.clone()).collect();
        assert!(!picked.contains(&"w0".to_string()), "{picked:?}");
        assert!(picked.contains(&"w1".to_string()) && picked.contains(&"w2".to_string()));
        // The second ejection in a row lasts twice as long.
        snap.endpoints[0].connect_failed(&outlier, now);
        snap.endpoints[0].connect_failed(&outlier, now);
        assert!(!snap.endpoints[0].available(now + 60_001));
        assert!(snap.endpoints[0].available(now + 120_001));
        for e in &snap.endpoints[1..] {
            for _ in 0..2 {
                e.connect_failed(&outlier, now);
            }
        }
        assert!(
            c.pick(0, now).is_some(),
            "panic mode: all ejected still routes"
        );
    }

    #[test]
    fn updates_keep_state_of_unchanged_endpoints() {
        let mut reg = Registry::default();
        let c = Cluster::new(plan(LbPolicy::RingHash, 3), Metrics::register(&mut reg));
        let old = c.load_full();
        let mut next = plan(LbPolicy::RingHash, 4);
        next.endpoints.retain(|e| e.id != "w2");
        next.endpoints[0].addr = SocketAddr::from(([127, 0, 0, 2], 9000));
        c.update(next);
        let new = c.load_full();
        assert!(
            old.endpoints[0].is_removed(),
            "w0 changed address: a new endpoint"
        );
        assert!(!old.endpoints[1].is_removed());
        assert!(Arc::ptr_eq(&old.endpoints[1], &new.endpoints[1]), "w1 kept");
        assert!(old.endpoints[2].is_removed(), "w2 left");
        let ids: Vec<&str> = new.endpoints.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["w0", "w1", "w3"]);
        c.retire();
        assert!(new.endpoints.iter().all(|e| e.is_removed()));
        assert!(c.pick(1, now_ms()).is_none());
    }
}
