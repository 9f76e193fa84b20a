//! Crate layering, checked on the resolved dependency graph (`cargo metadata`) rather than
//! promised in a comment:
//! - no crate under `dataplane/` reaches the Kubernetes client (`kube*`, `k8s-openapi`) through
//!   its normal or build dependencies, however indirectly, so the sidecar, the proxy core, the
//!   gateway and the workstation side never link it. cargo-deny (`deny.toml`, run by `.ci/run`)
//!   bans direct dependencies outside its `wrappers`; this test also covers indirect ones and any
//!   `kube-*` crate that `deny.toml` does not name;
//! - no server crate links another server's crate: what servers share (serving TLS, the PKI, the
//!   HTTP/1 front door, the probe server) comes from the serving kit, `spur-serving`;
//! - the wire crate, `spur-proto`, depends on no other Spur crate: conversions live with the
//!   domain types they convert to;
//! - the operator is assembled from crates by feature (`spur-operator-<feature>`) that stand on
//!   a shared core (`spur-operator-core`), never on one another or on the assembly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The crates that each run as a server role of their own.
const SERVERS: &[&str] = &[
    "spur-routeserver",
    "spur-operator",
    "spur-hub",
    "spur-jobs",
    "spur-ics",
    "spur-traffic",
    "spur-tunnelproxy",
];

/// The server role a crate belongs to: a server crate itself, or one of the operator's feature
/// crates (`spur-operator-<feature>`, not the binary), which are the operator's.
fn server_of(name: &str) -> Option<&'static str> {
    if name.starts_with("spur-operator-") && !name.ends_with("-bin") {
        return Some("spur-operator");
    }
    SERVERS.iter().copied().find(|s| *s == name)
}

fn is_kubernetes(name: &str) -> bool {
    name == "kube" || name.starts_with("kube-") || name == "k8s-openapi"
}

/// The resolved graph, with only the edges that end up in a built artifact (normal and build
/// dependencies, not dev ones).
struct Graph {
    root: PathBuf,
    /// Package id to name.
    name: HashMap<String, String>,
    /// Package id to manifest path.
    manifest: HashMap<String, PathBuf>,
    deps: HashMap<String, Vec<String>>,
}

impl Graph {
    fn load() -> Graph {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .canonicalize()
            .unwrap();
        let out = Command::new(env!("CARGO"))
            .args(["metadata", "--format-version", "1", "--locked"])
            .current_dir(&root)
            .output()
            .expect("cargo metadata runs");
        assert!(
            out.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
        let packages = meta["packages"].as_array().unwrap();
        let name = packages
            .iter()
            .map(|p| {
                let id = p["id"].as_str().unwrap().to_string();
                (id, p["name"].as_str().unwrap().to_string())
            })
            .collect();
        let manifest = packages
            .iter()
            .map(|p| {
                let id = p["id"].as_str().unwrap().to_string();
                (id, PathBuf::from(p["manifest_path"].as_str().unwrap()))
            })
            .collect();
        let mut deps = HashMap::new();
        for node in meta["resolve"]["nodes"].as_array().unwrap() {
            let linked = node["deps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k["kind"].is_null() || k["kind"] == "build")
                })
                .map(|d| d["pkg"].as_str().unwrap().to_string())
                .collect();
            deps.insert(node["id"].as_str().unwrap().to_string(), linked);
        }
        Graph {
            root,
            name,
            manifest,
            deps,
        }
    }

    fn id(&self, name: &str) -> &str {
        self.name
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(id, _)| id.as_str())
            .unwrap_or_else(|| panic!("{name} is not in the workspace"))
    }

    /// Workspace members whose manifest is under `dir` (relative to the workspace root).
    fn members_under(&self, dir: &str) -> Vec<&str> {
        let dir = self.root.join(dir).canonicalize().unwrap();
        self.manifest
            .iter()
            .filter(|(_, m)| m.canonicalize().is_ok_and(|m| m.starts_with(&dir)))
            .map(|(id, _)| id.as_str())
            .collect()
    }

    fn direct(&self, id: &str) -> impl Iterator<Item = &str> {
        self.deps.get(id).into_iter().flatten().map(String::as_str)
    }

    /// Every path from `from` to a crate `bad` names, as `a -> b -> c`, breadth first (one path
    /// per offending crate).
    fn paths_to(&self, from: &str, bad: impl Fn(&str) -> bool) -> Vec<String> {
        let mut found = Vec::new();
        let mut via: HashMap<&str, &str> = HashMap::new();
        let mut seen = HashSet::from([from]);
        let mut queue = VecDeque::from([from]);
        while let Some(id) = queue.pop_front() {
            if id != from && bad(&self.name[id]) {
                let mut chain = vec![self.name[id].as_str()];
                let mut at = id;
                while let Some(&prev) = via.get(at) {
                    chain.push(self.name[prev].as_str());
                    at = prev;
                }
                chain.reverse();
                found.push(chain.join(" -> "));
                continue;
            }
            for d in self.direct(id) {
                if seen.insert(d) {
                    via.insert(d, id);
                    queue.push_back(d);
                }
            }
        }
        found
    }
}

#[test]
fn dataplane_crates_never_depend_on_kubernetes() {
    let graph = Graph::load();
    let members = graph.members_under("dataplane");
    assert!(members.len() >= 8, "dataplane crates found: {members:?}");
    let violations: Vec<String> = members
        .iter()
        .flat_map(|m| graph.paths_to(m, is_kubernetes))
        .collect();
    assert!(
        violations.is_empty(),
        "dataplane crates reach the Kubernetes client:\n{}",
        violations.join("\n")
    );
}

#[test]
fn no_server_links_another_servers_crate() {
    let graph = Graph::load();
    let mut violations = Vec::new();
    for server in SERVERS {
        let id = graph.id(server);
        violations.extend(graph.paths_to(id, |n| server_of(n).is_some_and(|s| s != *server)));
    }
    assert!(
        violations.is_empty(),
        "server crates link other servers' crates (share code through spur-serving or a \
         library crate instead):\n{}",
        violations.join("\n")
    );
    // The kit is what they share: each server that serves TLS or probes links it, itself or
    // through a crate of its own (the operator's features, `spur-operator-<feature>`; not its
    // binary).
    for server in SERVERS.iter().filter(|s| **s != "spur-tunnelproxy") {
        let own: Vec<&str> = graph
            .name
            .iter()
            .filter(|(_, n)| server_of(n) == Some(*server))
            .map(|(id, _)| id.as_str())
            .collect();
        assert!(
            own.iter()
                .any(|id| graph.direct(id).any(|d| graph.name[d] == "spur-serving")),
            "{server} does not use the serving kit"
        );
    }
}

#[test]
fn the_wire_crate_depends_on_no_domain_crate() {
    let graph = Graph::load();
    let proto = graph.id("spur-proto");
    let spur: Vec<&str> = graph
        .direct(proto)
        .map(|d| graph.name[d].as_str())
        .filter(|n| n.starts_with("spur-"))
        .collect();
    assert!(
        spur.is_empty(),
        "spur-proto depends on {spur:?}; put conversions beside the domain types instead"
    );
}

/// The crates `cargo tree -p package` builds for `package` alone, with the features it asks for
/// (not the workspace's union that `cargo metadata` resolves): normal and build edges.
fn built_alone(package: &str) -> HashSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--locked", "-p", package, "-e", "normal,build"])
        .args(["--prefix", "none", "--format", "{p}"])
        .current_dir(&root)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

/// The L4 gateway's binary (`bin/gateway`), built alone as its image entrypoint is: no
/// Kubernetes client, no operator or hub, no other server's crate. It is configured by the route
/// server, never by the API server.
#[test]
fn the_gateway_binary_links_no_kubernetes_client() {
    let names = built_alone("spur-gateway-bin");
    assert!(names.contains("spur-gateway"), "{names:?}");
    let heavy: Vec<&String> = names
        .iter()
        .filter(|n| is_kubernetes(n) || SERVERS.contains(&n.as_str()) || *n == "spur-api")
        .collect();
    assert!(
        heavy.is_empty(),
        "spur-gateway-bin builds {heavy:?}: the gateway's binary must not link the cluster side"
    );
}

/// Each server role's binary (`bin/<role>`) links its own server crate and no other.
#[test]
fn each_role_binary_links_only_its_own_server() {
    let graph = Graph::load();
    for (binary, own) in [
        ("spur-routeserver-bin", "spur-routeserver"),
        ("spur-operator-bin", "spur-operator"),
        ("spur-tunnel-proxy-bin", "spur-tunnelproxy"),
        ("spur-hub-bin", "spur-hub"),
        ("spur-agent-bin", "spur-hub"),
        ("spur-jobs-bin", "spur-jobs"),
        ("spur-ics-bin", "spur-ics"),
        ("spur-traffic-store-bin", "spur-traffic"),
    ] {
        let id = graph.id(binary);
        assert!(
            graph.direct(id).any(|d| graph.name[d] == own),
            "{binary} does not link {own}"
        );
        let others = graph.paths_to(id, |n| server_of(n).is_some_and(|s| s != own));
        assert!(
            others.is_empty(),
            "{binary} links other servers' crates:\n{}",
            others.join("\n")
        );
    }
}

/// The user's `spur` links none of the servers: what `spur access`, `spur local` and `spur job`
/// share with them (token Secrets, the signer's name, the queue order, digests) is the API
/// crate's, and the access sweep is `spur-operator sweep-access`. (Through `spur demo` it links
/// the route server without its Kubernetes side, the demo's own.)
#[test]
fn the_user_cli_links_no_role_it_does_not_run() {
    let graph = Graph::load();
    let cli = graph.id("spur-cli");
    let servers = [
        "spur-gateway",
        "spur-hub",
        "spur-ics",
        "spur-traffic",
        "spur-operator",
        "spur-tunnelproxy",
        "spur-jobs",
    ];
    let linked = graph.paths_to(cli, |n| {
        servers.contains(&n) || n.starts_with("spur-operator-")
    });
    assert!(
        linked.is_empty(),
        "spur-cli links server roles of their own binaries:\n{}",
        linked.join("\n")
    );
}

/// The README's first command builds `spur-demo` alone, with the features it asks for (not the
/// workspace's union that `cargo metadata` resolves): it must not compile the Kubernetes client,
/// Envoy's types or any operator-side crate.
#[test]
fn the_demo_builds_without_the_cluster_side() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "-p",
            "spur-demo",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(&root)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout).unwrap();
    let names: HashSet<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(names.contains("spur-routeserver"), "{names:?}");
    let heavy: Vec<&&str> = names
        .iter()
        .filter(|n| {
            is_kubernetes(n)
                || n.starts_with("envoy-")
                || ["spur-api", "spur-operator", "spur-envoy", "spur-l4"].contains(n)
        })
        .collect();
    assert!(
        heavy.is_empty(),
        "spur-demo builds {heavy:?}: keep the route server's `kubernetes` feature off for it"
    );
}

/// Which operator feature may build on which (`(from, to)`): the EnvoyConfig webhook refuses
/// a node id another config holds by the xds feature's own rule; the Sandbox controller makes
/// a sandbox's resources and refuses namespaces not enrolled, and the RoutingConfig controller
/// keeps its mesh routes.
const OPERATOR_FEATURE_EDGES: &[(&str, &str)] = &[
    ("spur-operator-admission", "spur-operator-xds"),
    ("spur-operator-workloads", "spur-operator-enroll"),
    ("spur-operator-workloads", "spur-operator-mesh"),
    ("spur-operator-workloads", "spur-operator-resources"),
];

/// The operator's features are crates of their own (`spur-operator-<feature>`, docs in
/// ARCHITECTURE.md): each links the shared core, `spur-operator-core`, and no other feature
/// (except an edge [`OPERATOR_FEATURE_EDGES`] allows); the core links no feature; neither links
/// the assembly, `spur-operator`.
#[test]
fn operator_features_stand_on_the_core_not_on_each_other() {
    let graph = Graph::load();
    let core = graph.id("spur-operator-core");
    let is_operator = |n: &str| n == "spur-operator" || n.starts_with("spur-operator-");
    let mut features: Vec<&str> = graph
        .name
        .iter()
        .filter(|(_, n)| {
            n.starts_with("spur-operator-") && *n != "spur-operator-core" && !n.ends_with("-bin")
        })
        .map(|(id, _)| id.as_str())
        .collect();
    features.sort_by_key(|id| &graph.name[*id]);
    assert!(!features.is_empty(), "no operator feature crate found");
    let up = graph.paths_to(core, is_operator);
    assert!(
        up.is_empty(),
        "spur-operator-core links the operator's features or assembly:\n{}",
        up.join("\n")
    );
    for (from, to) in OPERATOR_FEATURE_EDGES {
        let from_id = graph.id(from);
        assert!(
            graph.direct(from_id).any(|d| graph.name[d] == *to),
            "OPERATOR_FEATURE_EDGES allows {from} -> {to}, which is no longer an edge: remove it"
        );
    }
    for id in features {
        let name = graph.name[id].as_str();
        assert!(
            graph.direct(id).any(|d| d == core),
            "{name} does not build on spur-operator-core"
        );
        let allowed = |n: &str| {
            n == "spur-operator-core" || n == name || OPERATOR_FEATURE_EDGES.contains(&(name, n))
        };
        let sideways: Vec<String> = graph
            .direct(id)
            .filter(|d| is_operator(&graph.name[*d]) && !allowed(&graph.name[*d]))
            .map(|d| format!("{name} -> {}", graph.name[d]))
            .collect();
        assert!(
            sideways.is_empty(),
            "operator feature crates link each other or the assembly (move what they share \
             into spur-operator-core, or declare the edge in OPERATOR_FEATURE_EDGES):\n{}",
            sideways.join("\n")
        );
    }
}
