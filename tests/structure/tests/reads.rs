//! The operator's controllers read through stores (ARCHITECTURE.md, "Controllers read through
//! stores"): a pass reads what wakes it, its children and the objects it matches from the
//! stores of its own watches. The API server is read directly only for the reasons below (in
//! short: users' objects and bulky revisions the operator does not cache, decisions of access
//! or ownership, key material, final cleanups, and what is not a controller pass), and every
//! function that does is listed in [`DIRECT_READS`] with its reason. A new direct read fails
//! this test until it is listed (with a reason a reviewer can check), and a listed function
//! that no longer reads directly fails it until it is struck off: the list only shrinks by
//! moving reads to stores. The check is per function: a second read added to a listed function
//! passes (see `spur_structure::reads` for what else the scanner cannot see).

use std::collections::BTreeSet;
use std::path::Path;

use spur_structure::reads::direct_reads;
use spur_structure::sizes::rust_files;

/// Workloads, Services, pods and namespaces of the users: the operator does not keep these in
/// memory cluster-wide (its watches of them are metadata-only, to wake the right objects), so a
/// pass reads the few it needs, from the API server's watch cache where it may.
const USER_OBJECT: &str = "a user's workload, Service, pod or namespace (not cached)";
/// What decides access, or whether a name belongs to this owner or to someone else: a cache
/// that is behind could grant what was withdrawn or take over another party's object.
const AUTHORITY: &str = "an access or ownership decision (the API server's word, not a cache)";
/// Secrets and CA material are read when needed and not held in long-lived stores.
const KEY_MATERIAL: &str = "key material (read when needed, not kept in a store)";
/// Not a watch-driven reconcile: an admission webhook, a periodic sweep or collector, the
/// certificate manager's timed pass, or start-up.
const NOT_A_PASS: &str = "not a controller pass (webhook, periodic sweep, start-up)";
/// The store first; the API server only for an object the store has not seen yet.
const FALLBACK: &str = "store first, the API server only for what it has not seen yet";
/// Users' objects through `spur_controller::verified`: the copy read before, while the
/// metadata store of the watch that wakes the controller shows the same version; the API
/// server only for what changed or what that store has not seen.
const VERIFIED: &str = "a user's object, read again only when its metadata store shows a change";
/// Reads an object re-read after a write conflict (409) or between retries of a
/// read-modify-write: by definition the store's copy was the stale one.
const AFTER_CONFLICT: &str = "a re-read after a write conflict";
/// A final cleanup, before a finalizer goes: nothing may be left behind that a store has not
/// seen yet (what comes after waits for it: a Sandbox's resources are deleted only once its
/// forks are gone; routes spliced into a user's VirtualService have no garbage collector).
/// Rare (once per deletion), so it costs the API server little.
const FINAL: &str = "a final cleanup before a finalizer goes (must miss nothing)";
/// EnvoyConfig revisions carry the encoded configuration they serve (up to ten per config):
/// caching every revision of every tenant would hold all of it in the operator's memory, so
/// a pass lists the revisions of the one config it works on.
const BULKY: &str = "revisions carry their encoded configuration (listed per config, not cached)";
/// Not moved yet: the object is the controller's own or its child and could come from a store
/// of the watch that wakes it. This is the list to shrink next.
const NOT_YET: &str = "not moved yet: a store of the waking watch would do";

/// Every function of the operator's crates that reads the API server directly
/// (path from the workspace root, function, why).
#[rustfmt::skip]
const DIRECT_READS: &[(&str, &str, &str)] = &[
    // Access: every read decides a grant or whose object something is.
    ("controlplane/operator-access/src/debug_pod.rs", "debug_pod", AUTHORITY),
    ("controlplane/operator-access/src/lib.rs", "get_template", AUTHORITY),
    ("controlplane/operator-access/src/lib.rs", "remove_grant", AUTHORITY),
    ("controlplane/operator-access/src/sweep.rs", "collect", NOT_A_PASS),
    ("controlplane/operator-access/src/sweep.rs", "sweep", NOT_A_PASS),
    ("controlplane/operator-access/src/targets.rs", "pick_pod", USER_OBJECT),
    ("controlplane/operator-access/src/targets.rs", "workload", USER_OBJECT),
    ("controlplane/operator-access/src/tunnel.rs", "remove_tunnel_token", AUTHORITY),
    ("controlplane/operator-access/src/tunnel.rs", "workstation_free", AUTHORITY),
    // Admission webhooks answer the API server; they have no watch behind them but the
    // namespace store they already read first.
    ("controlplane/operator-admission/src/lib.rs", "decide", NOT_A_PASS),
    ("controlplane/operator-admission/src/lib.rs", "ensure_bundle", NOT_A_PASS),
    ("controlplane/operator-admission/src/lib.rs", "fork_of", NOT_A_PASS),
    ("controlplane/operator-admission/src/lib.rs", "namespace_meta", NOT_A_PASS),
    // The certificate manager: a timed pass over CA Secrets, bundles and webhook
    // configurations.
    ("controlplane/operator-certificates/src/certs.rs", "pass", KEY_MATERIAL),
    ("controlplane/operator-certificates/src/certs.rs", "sync_bundle_config_map", NOT_A_PASS),
    ("controlplane/operator-certificates/src/certs.rs", "sync_listed_bundles", NOT_A_PASS),
    ("controlplane/operator-certificates/src/certs.rs", "sync_namespace_bundles", NOT_A_PASS),
    ("controlplane/operator-certificates/src/certs.rs", "sync_serving", KEY_MATERIAL),
    ("controlplane/operator-certificates/src/certs.rs", "sync_webhook_configuration", NOT_A_PASS),
    ("controlplane/operator-certificates/src/pki_config.rs", "signing_ca", KEY_MATERIAL),
    // Ownership records and adoption.
    ("controlplane/operator-core/src/owner.rs", "change_owners_once", AUTHORITY),
    ("controlplane/operator-core/src/owner.rs", "deployment_owner", USER_OBJECT),
    ("controlplane/operator-core/src/workstation_owner.rs", "claim", AUTHORITY),
    ("controlplane/operator-core/src/workstation_owner.rs", "read", AUTHORITY),
    // Mesh: the routes of another API group the operator keeps beside the user's.
    ("controlplane/operator-mesh/src/gateway.rs", "cleanup", FINAL),
    ("controlplane/operator-mesh/src/istio.rs", "cleanup", FINAL),
    ("controlplane/operator-mesh/src/istio.rs", "write", AFTER_CONFLICT),
    ("controlplane/operator-mesh/src/lib.rs", "apply_and_prune", NOT_YET),
    // Smart tests: a run's Job that already exists (409) is read to tell the run from a Job
    // someone else made under its name; the store had not seen it.
    ("controlplane/operator-smarttests/src/lib.rs", "start", AFTER_CONFLICT),
    // The chart's pre-upgrade hook (`spur-operator prepare-upgrade`): a one-off Job before
    // helm applies, with no watches; it reads the StatefulSets, claims and CA Secret it may
    // have to change, right before it changes them.
    ("controlplane/operator/src/upgrade.rs", "prepare", NOT_A_PASS),
    ("controlplane/operator/src/upgrade.rs", "replace", NOT_A_PASS),
    // `spur-operator apply-crds`, the chart's CRD hook: likewise one run of a hook Job, with no
    // watches; it reads each CRD right before and after it applies it, and lists and reads
    // back the objects it migrates.
    ("controlplane/operator/src/crds.rs", "apply", NOT_A_PASS),
    ("controlplane/operator/src/crds.rs", "established", NOT_A_PASS),
    ("controlplane/operator/src/crds.rs", "rewrite_all", NOT_A_PASS),
    ("controlplane/operator/src/crds.rs", "rewrite", NOT_A_PASS),
    // Resources: create-once objects (a Resource, its OLM, the io context) and step pods.
    ("controlplane/operator-resources/src/lib.rs", "apply", NOT_YET),
    // Whether the sandbox is valid: a wrong answer from a store that is behind tears its forks down.
    ("controlplane/operator-resources/src/lib.rs", "check", AUTHORITY),
    ("controlplane/operator-resources/src/lib.rs", "cleanup", FINAL),
    ("controlplane/operator-resources/src/lib.rs", "delete_all", FINAL),
    ("controlplane/operator-resources/src/lib.rs", "ensure", NOT_YET),
    ("controlplane/operator-resources/src/lib.rs", "plugins_once", NOT_YET),
    ("controlplane/operator-resources/src/lib.rs", "publish_outputs", KEY_MATERIAL),
    ("controlplane/operator-resources/src/lib.rs", "summaries", NOT_YET),
    ("controlplane/operator-resources/src/olm.rs", "ensure_ca_bundle", NOT_A_PASS),
    ("controlplane/operator-resources/src/olm.rs", "launch", AFTER_CONFLICT),
    ("controlplane/operator-resources/src/olm.rs", "missing_inputs", KEY_MATERIAL),
    ("controlplane/operator-resources/src/olm.rs", "observe", NOT_YET),
    ("controlplane/operator-resources/src/olm.rs", "reconcile", NOT_YET),
    ("controlplane/operator-resources/src/olm.rs", "stop", NOT_YET),
    // Workloads: baselines are the users'; a name the fork would take may be someone else's.
    ("controlplane/operator-workloads/src/baseline.rs", "read", USER_OBJECT),
    ("controlplane/operator-workloads/src/context.rs", "baseline_services", VERIFIED),
    ("controlplane/operator-workloads/src/external.rs", "apply", USER_OBJECT),
    ("controlplane/operator-workloads/src/external.rs", "collect_dead_tunnels", NOT_A_PASS),
    ("controlplane/operator-workloads/src/external.rs", "delete_children", FINAL),
    ("controlplane/operator-workloads/src/forked.rs", "conflicts", AUTHORITY),
    ("controlplane/operator-workloads/src/forked.rs", "coverage_of", USER_OBJECT),
    ("controlplane/operator-workloads/src/forked.rs", "delete_children", FINAL),
    ("controlplane/operator-workloads/src/routingconfig.rs", "read", FALLBACK),
    ("controlplane/operator-workloads/src/sandbox.rs", "not_enabled", USER_OBJECT),
    // Both the prune of removed workloads on every pass (watch cache) and the final one.
    ("controlplane/operator-workloads/src/sandbox.rs", "prune", FINAL),
    ("controlplane/operator-workloads/src/sandbox.rs", "routes_end", FINAL),
    // xDS: which config holds a node id is decided across tenants' configs; revisions are
    // immutable history that decides what is published.
    ("controlplane/operator-xds/src/envoyconfig/node_id.rs", "admission", NOT_A_PASS),
    ("controlplane/operator-xds/src/envoyconfig/node_id.rs", "unpublish_if_held", AUTHORITY),
    ("controlplane/operator-xds/src/envoyconfig.rs", "apply", BULKY),
    ("controlplane/operator-xds/src/envoyconfig.rs", "cleanup", FINAL),
    ("controlplane/operator-xds/src/envoyconfig.rs", "write_revision_status", BULKY),
    ("controlplane/operator-xds/src/listenerset.rs", "endpoint_slices", USER_OBJECT),
    ("controlplane/operator-xds/src/listenerset.rs", "services", AUTHORITY),
];

#[test]
fn controllers_read_the_api_server_only_where_listed() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let workspace = workspace.canonicalize().unwrap();
    let mut crates: Vec<_> = std::fs::read_dir(workspace.join("controlplane"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("operator"))
        })
        .collect();
    crates.sort();
    assert!(crates.len() >= 10, "operator crates: {crates:?}");
    let mut found: BTreeSet<(String, String)> = BTreeSet::new();
    let mut lines: Vec<String> = Vec::new();
    for krate in &crates {
        for file in rust_files(&krate.join("src")).unwrap() {
            let src = std::fs::read_to_string(&file).unwrap();
            let label = file.strip_prefix(&workspace).unwrap().display().to_string();
            for read in direct_reads(&src) {
                lines.push(format!(
                    "{label}:{} {} in {}",
                    read.line, read.method, read.function
                ));
                found.insert((label.clone(), read.function));
            }
        }
    }
    let listed: BTreeSet<(String, String)> = DIRECT_READS
        .iter()
        .map(|(f, func, _)| ((*f).to_owned(), (*func).to_owned()))
        .collect();
    assert_eq!(
        listed.len(),
        DIRECT_READS.len(),
        "a function is listed twice"
    );
    let mut problems = Vec::new();
    for (file, func) in found.difference(&listed) {
        let at: Vec<&String> = (lines.iter())
            .filter(|l| l.starts_with(&format!("{file}:")) && l.ends_with(&format!(" in {func}")))
            .collect();
        problems.push(format!(
            "{file}: `{func}` reads the API server directly ({at:?}); read the store of the \
             watch that wakes the controller, or list it in DIRECT_READS with its reason"
        ));
    }
    for (file, func) in listed.difference(&found) {
        problems.push(format!(
            "{file}: `{func}` is listed in DIRECT_READS but reads no longer directly (or is \
             gone): strike it off"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
