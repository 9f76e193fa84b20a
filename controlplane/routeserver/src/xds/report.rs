//! Reports what this replica's streams did with each published EnvoyConfigRevision into that
//! revision's `status.reports`, one entry per replica under the replica's own field manager, so
//! the operator can tell "every subscribed node rejected it" (roll back) from "some did" (say
//! so) across all route server replicas.
//!
//! Only the streams served the revision count: those of its node id whose client certificate
//! is of its namespace. An entry is written when its counts change and refreshed every
//! `interval` while the replica has such streams; the operator ignores entries older than three intervals (a
//! replica that died without removing its own). A replica whose last stream of a node id goes
//! removes its entry (server-side apply of an empty list under its manager).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use spur_api::EnvoyConfigRevision;
use spur_api::envoyconfig::ReplicaReport;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Nodes;
use super::model::Model;

/// Where and how this replica reports.
#[derive(Clone)]
pub struct Reports {
    pub client: Client,
    /// This replica's name (its pod's), the key of its entries.
    pub replica: String,
    /// How often an unchanged entry is refreshed.
    pub interval: Duration,
}

impl std::fmt::Debug for Reports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reports")
            .field("replica", &self.replica)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// How often the streams are looked at: a rejection reaches the revision within this (plus
/// the API call).
const TICK: Duration = Duration::from_millis(500);
/// Most bytes of a rejection message written into a report.
const MAX_MESSAGE: usize = 256;

struct Written {
    entry: Option<ReplicaReport>,
    at: Instant,
}

pub(crate) async fn run(
    cfg: Reports,
    nodes: Nodes,
    mut models: watch::Receiver<Option<Arc<Model>>>,
    stop: CancellationToken,
) {
    let manager = format!("spur-routeserver/{}", cfg.replica);
    let mut written: HashMap<String, Written> = HashMap::new();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let model = models.borrow_and_update().clone();
        let Some(model) = model else { continue };
        let mut wanted: HashMap<String, Option<ReplicaReport>> = HashMap::new();
        let served = model
            .node_configs
            .iter()
            .flat_map(|(node, by_ns)| by_ns.iter().map(move |(ns, nc)| (ns, node, nc)));
        for (ns, node, nc) in served {
            let c = nodes.revision_counts(ns, node, &nc.revision);
            let entry = (c.subscribed > 0).then(|| ReplicaReport {
                replica: cfg.replica.clone(),
                subscribed: c.subscribed,
                acked: c.acked,
                nacked: c.nacked,
                message: c.message.map(|m| shorten(&m)),
                unresolved_secrets: nc.unresolved_secrets.iter().map(|m| shorten(m)).collect(),
                updated_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::now(),
                ),
            });
            wanted.insert(nc.revision.to_string(), entry);
        }
        // Revisions no longer published: take this replica's entry out once.
        for rev in written.keys() {
            if !wanted.contains_key(rev) {
                wanted.insert(rev.clone(), None);
            }
        }
        for (rev, entry) in wanted {
            let due = match written.get(&rev) {
                None => entry.is_some(),
                Some(w) => {
                    !same_counts(w.entry.as_ref(), entry.as_ref())
                        || (entry.is_some() && w.at.elapsed() >= cfg.interval)
                }
            };
            if !due {
                continue;
            }
            match write(&cfg.client, &manager, &rev, entry.as_ref()).await {
                Ok(()) => {
                    if entry.is_none() {
                        written.remove(&rev);
                    } else {
                        written.insert(
                            rev,
                            Written {
                                entry,
                                at: Instant::now(),
                            },
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(revision = %rev, error = %e, "cannot report xDS acceptance of an EnvoyConfigRevision; retrying");
                }
            }
        }
    }
    // Leave no entry of this replica behind on a clean stop.
    for rev in written.keys() {
        if let Err(e) = write(&cfg.client, &manager, rev, None).await {
            tracing::debug!(revision = %rev, error = %e, "cannot remove this replica's report");
        }
    }
}

fn same_counts(a: Option<&ReplicaReport>, b: Option<&ReplicaReport>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            (
                a.subscribed,
                a.acked,
                a.nacked,
                &a.message,
                &a.unresolved_secrets,
            ) == (
                b.subscribed,
                b.acked,
                b.nacked,
                &b.message,
                &b.unresolved_secrets,
            )
        }
        _ => false,
    }
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

async fn write(
    client: &Client,
    manager: &str,
    revision: &str,
    entry: Option<&ReplicaReport>,
) -> Result<(), kube::Error> {
    let Some((ns, name)) = revision.split_once('/') else {
        return Ok(());
    };
    let api: Api<EnvoyConfigRevision> = Api::namespaced(client.clone(), ns);
    let body = serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1",
        "kind": "EnvoyConfigRevision",
        "status": { "reports": entry.into_iter().collect::<Vec<_>>() },
    });
    match api
        .patch_status(
            name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Deleted meanwhile (trimmed, or its config went): nothing to report on.
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e),
    }
}
