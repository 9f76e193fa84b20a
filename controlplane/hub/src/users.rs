//! Hub users and what each may see. Every API key and every browser session belongs to a hub
//! user; a user has a scope per cluster (or `*`, every cluster not named on its own): the
//! namespaces it may see there (or all), and the Kubernetes user and groups it acts as in that
//! cluster, which the cluster's agent checks with SubjectAccessReviews before it reads anything
//! for it (`crate::agent::access`).
//!
//! An object is visible to a user only when every namespace it is in ([`crate::namespaces`])
//! is; an object that names none is visible only to users who may see every namespace.

use spur_api::validation::is_dns_label;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use spur_api::Sandbox;

use crate::Error;
use crate::catalog::ClusterView;
use crate::namespaces::{
    job_namespaces, route_group_namespaces, routing_config_namespaces, sandbox_namespaces,
};
// The identity moved to `protocol` (the agent reads it from the `Open` frame); its old path stays.
pub use crate::protocol::KubeIdentity;

/// The cluster name of a scope that covers every cluster not named on its own.
pub const ANY_CLUSTER: &str = "*";
/// Groups one scope may name.
pub const MAX_GROUPS: usize = 32;
/// Longest Kubernetes user or group name accepted.
const MAX_KUBE_NAME: usize = 256;

/// A hub user and its scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubUser {
    pub name: String,
    /// By cluster name ([`ANY_CLUSTER`] for the rest).
    pub clusters: BTreeMap<String, ClusterScope>,
}

/// What a user may see in one cluster, and as whom it asks the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterScope {
    pub namespaces: Namespaces,
    /// The Kubernetes user it acts as (None: the hub user's name).
    pub kube_user: Option<String>,
    pub kube_groups: Vec<String>,
}

/// Which namespaces of a cluster a user may see.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Namespaces {
    /// Every namespace (stored as `"*"`).
    All(AllMarker),
    Only(BTreeSet<String>),
}

/// The `"*"` of [`Namespaces::All`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllMarker {
    #[serde(rename = "*")]
    All,
}

impl Namespaces {
    pub const ALL: Namespaces = Namespaces::All(AllMarker::All);

    /// Namespaces from names (DNS labels); `*` alone means all.
    pub fn parse(names: &[String]) -> Result<Namespaces, Error> {
        if names.iter().any(|n| n == "*") {
            if names.len() > 1 {
                return Err(Error::Invalid(
                    "namespace \"*\" (all) cannot be combined with named namespaces".into(),
                ));
            }
            return Ok(Namespaces::ALL);
        }
        if names.is_empty() {
            return Err(Error::Invalid(
                "name at least one namespace (--namespace N, repeatable) or all of them \
                 (--all-namespaces)"
                    .into(),
            ));
        }
        for n in names {
            if !is_dns_label(n) {
                return Err(Error::Invalid(format!(
                    "namespace {n:?}: a namespace name is a DNS label (lowercase letters, \
                     digits and '-', at most 63)"
                )));
            }
        }
        Ok(Namespaces::Only(names.iter().cloned().collect()))
    }

    /// Whether every namespace in `touched` is one of these; an empty `touched` (an object in
    /// no namespace) only when these are all namespaces.
    pub fn cover(&self, touched: &BTreeSet<String>) -> bool {
        match self {
            Namespaces::All(_) => true,
            Namespaces::Only(mine) => !touched.is_empty() && touched.is_subset(mine),
        }
    }

    pub fn is_all(&self) -> bool {
        matches!(self, Namespaces::All(_))
    }
}

impl std::fmt::Display for Namespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Namespaces::All(_) => f.write_str("*"),
            Namespaces::Only(n) => f.write_str(&n.iter().cloned().collect::<Vec<_>>().join(",")),
        }
    }
}

/// Checks a Kubernetes user or group name given to a scope.
pub fn check_kube_name(what: &str, name: &str) -> Result<(), Error> {
    if name.trim().is_empty()
        || name.len() > MAX_KUBE_NAME
        || name.chars().any(char::is_control)
        || name.trim() != name
    {
        return Err(Error::Invalid(format!(
            "Kubernetes {what} {name:?}: 1 to {MAX_KUBE_NAME} characters, no control \
             characters or surrounding spaces"
        )));
    }
    Ok(())
}

impl HubUser {
    /// The scope of `cluster`: its own, else the `*` one; None when the user may not see it.
    pub fn scope(&self, cluster: &str) -> Option<&ClusterScope> {
        self.clusters
            .get(cluster)
            .or_else(|| self.clusters.get(ANY_CLUSTER))
    }

    /// Whether the user may see an object of `cluster` in exactly the namespaces `touched`.
    pub fn sees(&self, cluster: &str, touched: &BTreeSet<String>) -> bool {
        self.scope(cluster)
            .is_some_and(|s| s.namespaces.cover(touched))
    }

    /// The identity the user acts as in `cluster`, when it may see the cluster at all.
    pub fn identity(&self, cluster: &str) -> Option<KubeIdentity> {
        let scope = self.scope(cluster)?;
        Some(KubeIdentity {
            user: scope.kube_user.clone().unwrap_or_else(|| self.name.clone()),
            groups: scope.kube_groups.clone(),
        })
    }

    /// `view` with only what the user may see of `cluster`.
    pub fn filter(&self, cluster: &str, view: &ClusterView) -> ClusterView {
        let Some(scope) = self.scope(cluster) else {
            return ClusterView {
                synced: view.synced,
                ..ClusterView::default()
            };
        };
        filter_view(view, |touched| scope.namespaces.cover(touched))
    }
}

/// `view` with only the objects whose namespaces `allowed` accepts.
pub fn filter_view(view: &ClusterView, allowed: impl Fn(&BTreeSet<String>) -> bool) -> ClusterView {
    let sandboxes: BTreeMap<String, Sandbox> = view
        .sandboxes
        .iter()
        .filter(|(_, s)| allowed(&sandbox_namespaces(s)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    ClusterView {
        route_groups: view
            .route_groups
            .iter()
            .filter(|(_, g)| allowed(&route_group_namespaces(g, &view.sandboxes)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        routing_configs: view
            .routing_configs
            .iter()
            .filter(|(_, c)| allowed(&routing_config_namespaces(c)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        jobs: view
            .jobs
            .iter()
            .filter(|(_, j)| allowed(&job_namespaces(j)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        sandboxes,
        synced: view.synced,
        // Namespaces are the hub's own business (previews' carriers), never a user's.
        ..ClusterView::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sandbox(name: &str, namespaces: &[&str], target: Option<&str>) -> Sandbox {
        let forks: Vec<_> = namespaces
            .iter()
            .map(|ns| serde_json::json!({"forkOf": {"kind": "Deployment", "namespace": ns, "name": "web"}}))
            .collect();
        let endpoints: Vec<_> = target
            .iter()
            .map(|t| serde_json::json!({"name": "web", "target": t}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name},
            "spec": {"forks": forks, "defaultRouteGroup": {"endpoints": endpoints}}
        }))
        .unwrap()
    }

    fn user(cluster: &str, namespaces: &[&str]) -> HubUser {
        let names: Vec<String> = namespaces.iter().map(|s| s.to_string()).collect();
        HubUser {
            name: "alice".into(),
            clusters: BTreeMap::from([(
                cluster.to_owned(),
                ClusterScope {
                    namespaces: Namespaces::parse(&names).unwrap(),
                    kube_user: None,
                    kube_groups: vec![],
                },
            )]),
        }
    }

    #[test]
    fn a_sandbox_is_in_every_namespace_it_reaches() {
        let s = sandbox("sb", &["a"], Some("http://web.b.svc:80"));
        assert_eq!(
            sandbox_namespaces(&s),
            BTreeSet::from(["a".to_string(), "b".to_string()])
        );
        let alice = user("east", &["a"]);
        assert!(!alice.sees("east", &sandbox_namespaces(&s)));
        assert!(alice.sees("east", &sandbox_namespaces(&sandbox("x", &["a"], None))));
        assert!(!alice.sees("west", &sandbox_namespaces(&sandbox("x", &["a"], None))));
        // An object in no namespace: only for all namespaces.
        assert!(!alice.sees("east", &BTreeSet::new()));
        assert!(user("*", &["*"]).sees("west", &BTreeSet::new()));
    }

    #[test]
    fn a_named_cluster_wins_over_any() {
        let mut u = user("*", &["*"]);
        u.clusters.insert(
            "east".into(),
            ClusterScope {
                namespaces: Namespaces::parse(&["a".into()]).unwrap(),
                kube_user: Some("alice@corp".into()),
                kube_groups: vec!["devs".into()],
            },
        );
        assert!(!u.sees("east", &BTreeSet::from(["b".to_string()])));
        assert!(u.sees("west", &BTreeSet::from(["b".to_string()])));
        assert_eq!(u.identity("east").unwrap().user, "alice@corp");
        assert_eq!(u.identity("west").unwrap().user, "alice");
    }

    #[test]
    fn namespaces_parse_and_store() {
        assert!(Namespaces::parse(&[]).is_err());
        assert!(Namespaces::parse(&["*".into(), "a".into()]).is_err());
        assert!(Namespaces::parse(&["A".into()]).is_err());
        let all = Namespaces::parse(&["*".into()]).unwrap();
        assert_eq!(serde_json::to_string(&all).unwrap(), "\"*\"");
        let some = Namespaces::parse(&["b".into(), "a".into()]).unwrap();
        let text = serde_json::to_string(&some).unwrap();
        assert_eq!(text, "[\"a\",\"b\"]");
        assert_eq!(serde_json::from_str::<Namespaces>(&text).unwrap(), some);
        assert_eq!(serde_json::from_str::<Namespaces>("\"*\"").unwrap(), all);
        assert!(check_kube_name("user", "system:serviceaccount:a:b").is_ok());
        assert!(check_kube_name("user", " x").is_err());
        assert!(check_kube_name("user", "").is_err());
    }
}
