//! Capture settings from the cluster: every Sandbox with `spec.capture.enabled` and a routing
//! key captures, at the sidecars of the baselines it forks (`forks[].forkOf`), replaces with a
//! workstation (`local[].from`) or virtualizes (`virtual[].workload`).
//!
//! The Sandboxes are watched; each change recompiles the whole map (a cluster has at most a few
//! thousand sandboxes, so this is cheap) and [`SettingsIndex::replace`] wakes only the sidecars
//! whose settings changed.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use spur_api::Sandbox;
use tokio_util::sync::CancellationToken;

use crate::runs::SandboxEntry;
use crate::settings::{SandboxSettings, SettingsFile, SettingsIndex, SettingsMap, WorkloadRef};

/// What applies to every capturing sandbox (the chart's `traffic.capture` values).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterCapture {
    /// Redacted in addition to the always-redacted headers.
    pub redact_headers: Vec<String>,
    /// Body bytes kept per direction (None: the default).
    pub max_body_bytes: Option<u32>,
}

/// The settings the capturing sandboxes among `sandboxes` ask for. A sandbox's own extra
/// redacted headers apply at every baseline (redacting more than asked is the safe side).
pub fn compile(sandboxes: &[Sandbox], cluster: &ClusterCapture) -> SettingsMap {
    let mut redact = cluster.redact_headers.clone();
    let mut entries = Vec::new();
    let mut directory = HashMap::new();
    for sb in sandboxes {
        let Some(key) = sb
            .status
            .as_ref()
            .and_then(|s| s.routing_key.clone())
            .filter(|k| !k.is_empty())
        else {
            continue;
        };
        let workloads: Vec<WorkloadRef> = sb
            .spec
            .forks
            .iter()
            .map(|f| &f.fork_of)
            .chain(sb.spec.local.iter().map(|l| &l.from))
            .chain(sb.spec.virtual_workloads.iter().map(|v| &v.workload))
            .map(|w| WorkloadRef {
                kind: w.kind.routes_api_kind().to_string(),
                namespace: w.namespace.clone(),
                name: w.name.clone(),
            })
            .collect();
        // Every sandbox with a key, capturing or not: a smart test's run capture
        // (`crate::runs`) may name it.
        directory.insert(
            sb.name_any(),
            SandboxEntry {
                routing_key: key.clone(),
                namespaces: workloads.iter().map(|w| w.namespace.clone()).collect(),
            },
        );
        // Every sandbox's own list, capturing or not: a smart test's run may capture it
        // without its standing capture on.
        if let Some(capture) = &sb.spec.capture {
            redact.extend(capture.redact_headers.iter().cloned());
        }
        if !sb.spec.capture.as_ref().is_some_and(|c| c.enabled) {
            continue;
        }
        entries.push(SandboxSettings {
            name: sb.name_any(),
            routing_key: key,
            workloads,
        });
    }
    redact.sort();
    redact.dedup();
    let mut map = SettingsFile {
        redact_headers: redact,
        max_body_bytes: cluster.max_body_bytes,
        sandboxes: entries,
    }
    .compile();
    map.sandboxes = directory;
    map
}

/// Keeps `index` in step with the cluster's Sandboxes until `stop`. Nothing is captured before
/// the first complete list (the index starts empty); while the API server is unreachable the
/// last settings stay.
///
/// The settings are compiled from the reflector's store at the end of each complete (re)list
/// and after each change once the first list is complete: a deletion counts too. The stream is
/// the only thing that makes the store ready, so nothing here waits on the store while not
/// reading the stream (that waited forever when a list began with Sandboxes in it: a store
/// restarted in a cluster with Sandboxes never loaded its settings).
pub async fn watch_sandboxes(
    client: Client,
    index: SettingsIndex,
    cluster: ClusterCapture,
    stop: CancellationToken,
) {
    let api: Api<Sandbox> = Api::all(client);
    let (reader, writer) = kube::runtime::reflector::store();
    let stream = kube::runtime::reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut last_error = String::new();
    let mut events = Events::default();
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            e = stream.next() => e,
        };
        let Some(event) = event else { return };
        if !events.take(event, &mut last_error) {
            continue;
        }
        // A burst of changes settles before one recompile: events keep being read until none
        // came for 50 ms.
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                e = tokio::time::timeout(Duration::from_millis(50), stream.next()) => match e {
                    Err(_) => break,
                    Ok(None) => return,
                    Ok(Some(event)) => {
                        events.take(event, &mut last_error);
                    }
                },
            }
        }
        if events.listing {
            // A re-list began in the burst: its end recompiles.
            continue;
        }
        let sandboxes: Vec<Sandbox> = reader.state().iter().map(|s| (**s).clone()).collect();
        index.replace(compile(&sandboxes, &cluster));
    }
}

/// Where the Sandbox watch stands.
#[derive(Default)]
struct Events {
    /// A complete list has been read.
    listed: bool,
    /// A (re)list is being read: its objects replace the store's at its end.
    listing: bool,
}

impl Events {
    /// Takes one event of the watch; whether the settings may have changed with it.
    fn take(
        &mut self,
        event: Result<watcher::Event<Sandbox>, watcher::Error>,
        last_error: &mut String,
    ) -> bool {
        match event {
            Err(e) => {
                let e = e.to_string();
                if e != *last_error {
                    tracing::warn!(error = %e, "watching Sandboxes failed; the capture settings stay as they were");
                    *last_error = e;
                }
                false
            }
            Ok(event) => {
                last_error.clear();
                match event {
                    watcher::Event::Init | watcher::Event::InitApply(_) => {
                        self.listing = true;
                        false
                    }
                    watcher::Event::InitDone => {
                        self.listing = false;
                        self.listed = true;
                        true
                    }
                    watcher::Event::Apply(_) | watcher::Event::Delete(_) => {
                        self.listed && !self.listing
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use spur_api::common::{WorkloadKind, WorkloadRef as ApiRef};
    use spur_api::sandbox::{Fork, Virtual};
    use spur_api::{SandboxCapture, SandboxSpec, SandboxStatus};

    use super::*;
    use crate::settings::Baseline;

    fn sandbox(name: &str, key: Option<&str>, capture: bool) -> Sandbox {
        let mut sb = Sandbox::new(
            name,
            SandboxSpec {
                forks: vec![Fork {
                    fork_of: ApiRef::new(WorkloadKind::Deployment, "shop", "backend"),
                    customizations: Default::default(),
                }],
                virtual_workloads: vec![Virtual {
                    name: "v".into(),
                    workload: ApiRef::new(WorkloadKind::Rollout, "shop", "orders"),
                }],
                capture: Some(SandboxCapture {
                    enabled: capture,
                    redact_headers: vec!["x-team-secret".into()],
                }),
                ..serde_json::from_value(serde_json::json!({})).unwrap()
            },
        );
        sb.status = Some(SandboxStatus {
            routing_key: key.map(str::to_string),
            ..Default::default()
        });
        sb
    }

    #[test]
    fn only_enabled_sandboxes_with_a_key_capture_at_their_baselines() {
        let map = compile(
            &[
                sandbox("on", Some("k1"), true),
                sandbox("off", Some("k2"), false),
                sandbox("nokey", None, true),
            ],
            &ClusterCapture {
                redact_headers: vec!["x-api-key".into()],
                max_body_bytes: Some(1024),
            },
        );
        let backend = &map.baselines[&Baseline::new("Deployment", "shop", "backend")];
        let keys: Vec<_> = backend
            .keys
            .iter()
            .map(|k| (k.routing_key.as_str(), k.sandbox.as_str()))
            .collect();
        assert_eq!(keys, vec![("k1", "on")]);
        assert_eq!(backend.max_body_bytes, 1024);
        for h in ["authorization", "cookie", "x-api-key", "x-team-secret"] {
            assert!(backend.redact_headers.iter().any(|r| r == h), "{h}");
        }
        // Virtual workloads of a Rollout: the sidecar announces the Routes API's kind.
        assert!(
            map.baselines
                .contains_key(&Baseline::new("ArgoRollout", "shop", "orders"))
        );
        assert_eq!(map.baselines.len(), 2);
        assert!(map.default.keys.is_empty());
    }
}
