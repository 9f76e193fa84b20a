//! The sidecar watch clients, and waiting for them and for the Sandboxes' status.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use futures_util::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use spur_api::Sandbox;
use spur_api::conditions::{READY, is_condition_true};
use spur_perf::kube_bench::{APP_PORT, NS};
use spur_routing::{BaselineWorkload, SharedTable};

use crate::component::Component;
use crate::{BASELINES, POLL};

/// One sidecar client: its own table, publisher, registry and connection.
pub(crate) struct Watcher {
    pub(crate) baseline: BaselineWorkload,
    pub(crate) table: SharedTable,
    pub(crate) registry: Registry,
}

impl Watcher {
    fn missing(&self, keys: &[String]) -> usize {
        let snapshot = self.table.load();
        keys.iter()
            .filter(|k| snapshot.table.lookup(&self.baseline, APP_PORT, k).is_none())
            .count()
    }

    /// `routeserver_connected`: a watch stream is up and past SYNCED.
    pub(crate) fn connected(&self) -> bool {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).is_ok()
            && text.lines().any(|l| l == "routeserver_connected 1")
    }
}

pub(crate) fn baseline(i: usize) -> BaselineWorkload {
    BaselineWorkload {
        kind: "Deployment".into(),
        namespace: NS.into(),
        name: BASELINES[i % BASELINES.len()].into(),
    }
}

/// Waits until every watcher holds all `keys` (and, with `synced`, is connected and past SYNCED);
/// returns when the first and the last one got there.
pub(crate) async fn wait_watchers(
    watchers: &[Watcher],
    keys: &[String],
    synced: bool,
    procs: &mut [&mut Component],
    deadline: Instant,
    what: &str,
) -> Result<(Instant, Instant)> {
    let mut done: Vec<Option<Instant>> = vec![None; watchers.len()];
    loop {
        for (w, d) in watchers.iter().zip(done.iter_mut()) {
            if d.is_none() && (!synced || w.connected()) && w.missing(keys) == 0 {
                *d = Some(Instant::now());
            }
        }
        let times: Vec<Instant> = done.iter().flatten().copied().collect();
        if times.len() == watchers.len() {
            let first = times.iter().min().copied().unwrap_or_else(Instant::now);
            let last = times.iter().max().copied().unwrap_or_else(Instant::now);
            return Ok((first, last));
        }
        if Instant::now() > deadline {
            let lagging: Vec<String> = watchers
                .iter()
                .enumerate()
                .filter(|(i, _)| done[*i].is_none())
                .map(|(i, w)| {
                    format!(
                        "watcher {i} ({}): {} of {} rules missing{}",
                        w.baseline.name,
                        w.missing(keys),
                        keys.len(),
                        if synced && !w.connected() {
                            ", not connected"
                        } else {
                            ""
                        }
                    )
                })
                .collect();
            bail!(
                "{what}: not every watcher holds the full table: {}",
                lagging.join("; ")
            );
        }
        for p in procs.iter_mut() {
            p.check_alive().with_context(|| what.to_string())?;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Watches the Sandboxes until `n` of them satisfy `ok`; returns when the last one did.
pub(crate) async fn wait_sandboxes(
    client: &Client,
    n: usize,
    deadline: Instant,
    what: &str,
    ok: impl Fn(&Sandbox) -> bool,
) -> Result<Instant> {
    let api: Api<Sandbox> = Api::all(client.clone());
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut state: HashMap<String, bool> = HashMap::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.next()).await {
            Err(_) | Ok(None) => {
                let mut bad: Vec<&String> = state
                    .iter()
                    .filter(|(_, ok)| !**ok)
                    .map(|(k, _)| k)
                    .collect();
                bad.sort();
                bail!(
                    "{what}: {} of {n} sandboxes not there (seen: {}), e.g. {:?}",
                    n - state.values().filter(|ok| **ok).count().min(n),
                    state.len(),
                    bad.iter().take(5).collect::<Vec<_>>()
                );
            }
            Ok(Some(Err(_))) => {}
            Ok(Some(Ok(sb))) => {
                state.insert(sb.name_any(), ok(&sb));
                if state.values().filter(|ok| **ok).count() >= n {
                    return Ok(Instant::now());
                }
            }
        }
    }
}

/// The status describes the current generation, and says Ready.
pub(crate) fn converged(sb: &Sandbox) -> bool {
    sb.status.as_ref().is_some_and(|st| {
        st.observed_generation.is_some()
            && st.observed_generation == sb.metadata.generation
            && is_condition_true(&st.conditions, READY)
    })
}
