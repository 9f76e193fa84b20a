//! The chart's RBAC, as the API server enforces it: each component's ServiceAccount, bound to the
//! chart's rules exactly as the chart binds them, asks a real kube-apiserver (authorization mode
//! RBAC) what it may do (`SelfSubjectRulesReview`) in the release namespace, the token namespace,
//! an application namespace that opted in (`spur.dev/enabled=true`, where the operator's
//! enroller binds the chart's enrolled ClusterRoles) and one that did not. The answers must
//! equal the committed expectation `tests/rbac/expected.txt`, so a widened rule fails here until
//! someone writes it down there (and a reviewer sees it); and some invariants hold whatever the
//! expectation says: no wildcard, no component that writes workloads, Secrets, pods or RBAC in a
//! namespace that did not opt in (but the operator's fenced RoleBindings), a route server that
//! writes nothing, a tunnel proxy that reads no Secret but the tokens, a hub agent that only
//! reads Spur's objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use k8s_openapi::api::authorization::v1::{SelfSubjectRulesReview, SelfSubjectRulesReviewSpec};
use kube::api::{Api, PostParams};
use spur_e2e::kube as kube_rbac;
use spur_kube_harness::KubeApi;

const NAMESPACES: [&str; 6] = [
    "spur-system",
    "spur-workstation-tokens",
    "spur-resources",
    "spur-io-contexts",
    ENROLLED,
    NOT_ENROLLED,
];
/// An application namespace labelled `spur.dev/enabled=true`.
const ENROLLED: &str = "shop";
/// An application namespace without the label: no component may write in it.
const NOT_ENROLLED: &str = "payments";
/// What a component must not write outside the namespaces that opted in: workloads, their
/// Services and endpoints, Secrets, pods and RBAC (enough, each, to take over the cluster).
const GUARDED: [&str; 8] = [
    "deployments",
    "services",
    "endpointslices",
    "secrets",
    "pods",
    "roles",
    "rolebindings",
    "configmaps",
];
const EXPECTED: &str = include_str!("../rbac/expected.txt");
const WRITE_VERBS: [&str; 6] = [
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
    "*",
];

/// One line per (namespace, rule) the server reports for `client`, except the self-review rules
/// every authenticated user has.
async fn rules_of(who: &str, client: kube::Client) -> BTreeSet<String> {
    let api: Api<SelfSubjectRulesReview> = Api::all(client);
    let mut lines = BTreeSet::new();
    for ns in NAMESPACES {
        let review = SelfSubjectRulesReview {
            spec: SelfSubjectRulesReviewSpec {
                namespace: Some(ns.into()),
            },
            ..Default::default()
        };
        let answer = api.create(&PostParams::default(), &review).await.unwrap();
        let status = answer.status.expect("a rules review has a status");
        assert!(
            !status.incomplete,
            "{who} in {ns}: incomplete rules review: {:?}",
            status.evaluation_error
        );
        for rule in status.resource_rules {
            let resources = rule.resources.clone().unwrap_or_default();
            if resources.iter().all(|r| r.starts_with("selfsubject")) {
                continue;
            }
            let list = |v: Option<Vec<String>>| {
                let mut v = v.unwrap_or_default();
                v.sort();
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(",")
                }
            };
            // The core group is "" on the wire.
            let groups = rule.api_groups.clone().map(|g| {
                g.into_iter()
                    .map(|g| if g.is_empty() { "core".to_string() } else { g })
                    .collect()
            });
            let groups = list(groups);
            lines.insert(format!(
                "{who} {ns} groups={groups} resources={} names={} verbs={}",
                list(Some(resources)),
                list(rule.resource_names.clone()),
                list(Some(rule.verbs.clone())),
            ));
        }
    }
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_rbac_is_exactly_the_committed_expectation() {
    kube_rbac::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kube_rbac::install_crds(&api).await.unwrap();
    let admin = api.client();
    for ns in NAMESPACES {
        if ns == ENROLLED {
            kube_rbac::ensure_namespace(&admin, ns).await.unwrap();
        } else {
            kube_rbac::ensure_namespace_unenrolled(&admin, ns)
                .await
                .unwrap();
        }
    }
    // Also runs the enroller, which binds spur-operator-enrolled and spur-jobs-enrolled in
    // ENROLLED (and returns once it has).
    let operator = kube_rbac::operator_client(&api).await.unwrap();
    let routeserver =
        kube_rbac::chart_client(&api, "spur-routeserver", "routeserver-rules.yaml", None)
            .await
            .unwrap();
    let tunnel_proxy = kube_rbac::chart_client(
        &api,
        "spur-tunnel-proxy",
        "tunnelproxy-rules.yaml",
        Some("tunnelproxy-namespace-rules.yaml"),
    )
    .await
    .unwrap();
    kube_rbac::grant_in_namespace(
        &api,
        "spur-tunnel-proxy",
        "spur-workstation-tokens",
        "tunnelproxy-token-rules.yaml",
    )
    .await
    .unwrap();

    // As the chart binds it with xds.sds.namespaces=[shop].
    kube_rbac::grant_in_namespace(
        &api,
        "spur-routeserver",
        "shop",
        "routeserver-sds-rules.yaml",
    )
    .await
    .unwrap();

    let agent = kube_rbac::chart_client(&api, "spur-agent", "agent-rules.yaml", None)
        .await
        .unwrap();
    let jobs = kube_rbac::jobs_client(&api).await.unwrap();

    kube_rbac::grant_in_namespace(
        &api,
        "spur-operator",
        "spur-resources",
        "resources-namespace-rules.yaml",
    )
    .await
    .unwrap();
    kube_rbac::grant_in_namespace(
        &api,
        "spur-operator",
        "spur-io-contexts",
        "resources-context-rules.yaml",
    )
    .await
    .unwrap();
    let ics = kube_rbac::chart_client(&api, "spur-ics", "ics-rules.yaml", None)
        .await
        .unwrap();
    kube_rbac::grant_in_namespace(
        &api,
        "spur-ics",
        "spur-io-contexts",
        "ics-namespace-rules.yaml",
    )
    .await
    .unwrap();

    // What mesh.istio.enabled and mesh.gatewayAPI.enabled append to the operator's ClusterRole
    // (off by default), reviewed on their own: a ServiceAccount bound to those rules alone.
    let mesh = kube_rbac::chart_client(
        &api,
        "spur-operator-mesh",
        "operator-mesh-istio-rules.yaml",
        None,
    )
    .await
    .unwrap();
    kube_rbac::grant_cluster(
        &api,
        "spur-operator-mesh",
        "operator-mesh-gateway-api-rules.yaml",
    )
    .await
    .unwrap();

    // What access.enabled (on by default) appends to the operator's ClusterRole, on its own
    // like the mesh rules, and the ClusterRole the chart offers for binding to engineers.
    let access = kube_rbac::chart_client(
        &api,
        "spur-operator-access",
        "operator-access-rules.yaml",
        None,
    )
    .await
    .unwrap();
    kube_rbac::grant_in_namespace(
        &api,
        "spur-operator-access",
        "spur-workstation-tokens",
        "operator-access-token-rules.yaml",
    )
    .await
    .unwrap();
    // What jobs.enabled (on by default) appends to the operator's ClusterRole for automatic
    // smart-test runs, on its own likewise (its Job writes are in spur-operator-enrolled).
    let smart_tests = kube_rbac::chart_client(
        &api,
        "spur-operator-smarttests",
        "operator-smarttests-rules.yaml",
        None,
    )
    .await
    .unwrap();
    // The second sweeper (CronJob spur-access-sweeper): cluster-wide delete on Roles and
    // RoleBindings, held by the policy spur-access-sweeper to grants' own.
    let sweeper = kube_rbac::chart_client(
        &api,
        "spur-access-sweeper",
        "access-sweeper-rules.yaml",
        None,
    )
    .await
    .unwrap();
    let requester = kube_rbac::chart_client(
        &api,
        "spur-access-requester",
        "access-requester-rules.yaml",
        None,
    )
    .await
    .unwrap();
    // The other ClusterRoles the chart offers for binding to people (docs/install.md, "What
    // each user role can see and do"), each reviewed as if bound cluster-wide.
    let mut offered = Vec::new();
    for (role, file) in [
        ("spur-access-approver", "access-approver-rules.yaml"),
        ("spur-job-reader", "job-reader-rules.yaml"),
        ("spur-job-submitter", "job-submitter-rules.yaml"),
        ("spur-preview-publisher", "preview-publisher-rules.yaml"),
        (
            "spur-preview-remote-clusters",
            "preview-remote-clusters-rules.yaml",
        ),
        (
            "spur-resource-plugin-user",
            "resource-plugin-user-rules.yaml",
        ),
        ("spur-smarttest-reader", "smarttest-reader-rules.yaml"),
        ("spur-smarttest-writer", "smarttest-writer-rules.yaml"),
        ("spur-workstation", "workstation-rules.yaml"),
        (
            "spur-workstation-approver",
            "workstation-approver-rules.yaml",
        ),
    ] {
        let client = kube_rbac::chart_client(&api, role, file, None)
            .await
            .unwrap();
        offered.push((role, client));
    }

    // Traffic capture (traffic.enabled, on by default): the store, and the two ClusterRoles the
    // chart offers for binding to engineers.
    let traffic = kube_rbac::chart_client(&api, "spur-traffic", "traffic-rules.yaml", None)
        .await
        .unwrap();
    let traffic_reader = kube_rbac::chart_client(
        &api,
        "spur-traffic-reader",
        "traffic-reader-rules.yaml",
        None,
    )
    .await
    .unwrap();
    let traffic_capturer = kube_rbac::chart_client(
        &api,
        "spur-traffic-capturer",
        "traffic-capturer-rules.yaml",
        None,
    )
    .await
    .unwrap();

    // The pre-upgrade hook (templates/upgrade.yaml): a Role in the release namespace only.
    kube_rbac::grant_in_namespace(
        &api,
        "spur-prepare-upgrade",
        "spur-system",
        "upgrade-rules.yaml",
    )
    .await
    .unwrap();
    let upgrade = api
        .client_with_token(
            &api.service_account_token("spur-system", "spur-prepare-upgrade")
                .await
                .unwrap(),
        )
        .await
        .unwrap();

    // The CRD hook (templates/crds.yaml): a ClusterRole, Spur's CRDs and objects only.
    let crds_hook = kube_rbac::chart_client(&api, "spur-apply-crds", "crds-rules.yaml", None)
        .await
        .unwrap();

    let mut actual = BTreeSet::new();
    actual.extend(rules_of("spur-apply-crds", crds_hook).await);
    actual.extend(rules_of("spur-prepare-upgrade", upgrade).await);
    actual.extend(rules_of("spur-traffic", traffic).await);
    actual.extend(rules_of("spur-traffic-reader", traffic_reader).await);
    actual.extend(rules_of("spur-traffic-capturer", traffic_capturer).await);
    actual.extend(rules_of("spur-access-requester", requester).await);
    actual.extend(rules_of("spur-access-sweeper", sweeper).await);
    for (role, client) in offered {
        actual.extend(rules_of(role, client).await);
    }
    actual.extend(rules_of("spur-operator-access", access).await);
    actual.extend(rules_of("spur-operator-smarttests", smart_tests).await);
    actual.extend(rules_of("spur-agent", agent).await);
    actual.extend(rules_of("spur-ics", ics).await);
    actual.extend(rules_of("spur-jobs", jobs).await);
    actual.extend(rules_of("spur-operator", operator).await);
    actual.extend(rules_of("spur-operator-mesh", mesh).await);
    actual.extend(rules_of("spur-routeserver", routeserver).await);
    actual.extend(rules_of("spur-tunnel-proxy", tunnel_proxy).await);

    // Invariants, whatever the expectation says.
    for line in &actual {
        let fields: Vec<&str> = line.split(' ').collect();
        assert!(
            !line.contains('*'),
            "a wildcard in the chart's RBAC: {line}"
        );
        let verbs = fields.last().unwrap().trim_start_matches("verbs=");
        // Outside the namespaces that opted in (what a component may do there, it may do in
        // every namespace): no writes on what takes a cluster over. The operator's exceptions
        // are fenced by admission policies (templates/fences.yaml): its enroller's RoleBindings
        // (spur-operator-rolebindings: those bindings only, in labelled namespaces only) and
        // the CA bundle ConfigMap (spur-operator-writes: spur-ca-bundle only).
        if fields[1] == NOT_ENROLLED {
            let resources = fields[3].trim_start_matches("resources=");
            let writes = verbs.split(',').any(|v| WRITE_VERBS.contains(&v));
            let fenced = (line.starts_with("spur-operator ")
                && ((resources == "rolebindings"
                    && line.contains(" groups=rbac.authorization.k8s.io "))
                    || (resources == "configmaps"
                        && (verbs == "create" || line.contains(" names=spur-ca-bundle ")))))
                // The second access sweeper only deletes (which takes rights away, never gives
                // them), and the policy spur-access-sweeper holds it to the Roles and
                // RoleBindings named and labelled as grants (kube_access.rs, sweeper).
                || (line.starts_with("spur-access-sweeper ")
                    && resources == "rolebindings,roles"
                    && verbs == "delete,list");
            assert!(
                !(writes && resources.split(',').any(|r| GUARDED.contains(&r))) || fenced,
                "a component may write {resources} in a namespace that did not opt in: {line}"
            );
            // Binding: only the operator, only the two enrolled ClusterRoles.
            if verbs.split(',').any(|v| v == "bind" || v == "escalate") {
                assert!(
                    line.starts_with("spur-operator ")
                        && line.contains(" resources=clusterroles ")
                        && line.contains(" names=spur-jobs-enrolled,spur-operator-enrolled ")
                        && verbs == "bind",
                    "a component may bind or escalate beyond the enrolled ClusterRoles: {line}"
                );
            }
        }
        // Reviews are questions to the API server; nothing is stored.
        let review = line.contains("resources=tokenreviews ")
            || line.contains("resources=subjectaccessreviews ");
        // Its one write: each replica's report of what its xDS clients did with an EnvoyConfig
        // revision, in that revision's status (docs/xds.md, "Rollback").
        let report = (line.contains("resources=envoyconfigrevisions/status ")
            // and each gateway's endpoint health in the ListenerSets it serves (docs/l4.md).
            || line.contains("resources=listenersets/status "))
            && verbs == "patch";
        if line.starts_with("spur-routeserver ") && !(review && verbs == "create") && !report {
            assert!(
                !verbs.split(',').any(|v| WRITE_VERBS.contains(&v)),
                "the route server may write: {line}"
            );
        }
        // The agent serves a hub outside the cluster: it reads Spur's objects, gets single
        // Services (to refuse an ExternalName preview target, docs/hub.md), lists Namespaces
        // (their carrier annotations, which previews overwrite) and asks SubjectAccessReviews
        // (what each hub user may read), nothing else.
        if line.starts_with("spur-agent ") {
            let services = line.contains(" groups=core resources=services ") && verbs == "get";
            let namespaces =
                line.contains(" groups=core resources=namespaces ") && verbs == "list,watch";
            let asks = review && verbs == "create";
            assert!(
                asks || (!verbs.split(',').any(|v| WRITE_VERBS.contains(&v))
                    && (line.contains(" groups=spur.dev ") || services || namespaces)),
                "the agent may do more than read Spur's objects, get Services and list Namespaces: {line}"
            );
        }
        // The jobs component reads one Secret name in enrolled namespaces (the executors'
        // certificate) and its own CA's in its namespace; no other Secret.
        if line.starts_with("spur-jobs ") && line.contains("resources=secrets ") {
            assert!(
                verbs == "create"
                    || line.contains(" names=spur-job-executor-tls ")
                    || line.contains(" names=spur-jobs-ca "),
                "the jobs component may read Secrets it does not own: {line}"
            );
        }
        // The io context server reads and writes Secrets only in the io context namespace,
        // and creates or deletes none.
        if line.starts_with("spur-ics ") && line.contains("resources=secrets ") {
            assert!(
                line.starts_with("spur-ics spur-io-contexts ") && verbs == "get,patch",
                "the io context server may touch Secrets beyond its io contexts: {line}"
            );
        }
        // The operator never reads a Secret outside its own namespace and the io context
        // namespace (a resource's outputs are written into fork namespaces, never read back).
        if line.starts_with("spur-operator ")
            && line.contains("resources=secrets ")
            && !line.starts_with("spur-operator spur-system ")
            && !line.starts_with("spur-operator spur-io-contexts ")
        {
            assert!(
                !verbs
                    .split(',')
                    .any(|v| ["get", "list", "watch"].contains(&v)),
                "the operator may read Secrets outside its namespace: {line}"
            );
        }
        // SDS: the route server reads Secrets only in the namespaces xds.sds.namespaces names.
        if line.starts_with("spur-routeserver ") && line.contains("resources=secrets ") {
            assert!(
                line.starts_with("spur-routeserver shop ") && verbs == "list,watch",
                "the route server may read Secrets beyond its SDS namespaces: {line}"
            );
        }
        // The traffic store reads Sandboxes, gets single pods and ReplicaSets (a sidecar's
        // baseline, issue 42) and asks questions; it writes nothing.
        if line.starts_with("spur-traffic ") {
            let sidecar_lookup = (line.contains(" groups=core resources=pods ")
                || line.contains(" groups=apps resources=replicasets "))
                && verbs == "get";
            assert!(
                (review && verbs == "create")
                    || sidecar_lookup
                    || (line.contains(" resources=sandboxes ")
                        && !verbs.split(',').any(|v| WRITE_VERBS.contains(&v))),
                "the traffic store may do more than read Sandboxes and get pods and ReplicaSets: {line}"
            );
        }
        if line.starts_with("spur-tunnel-proxy ") && line.contains("secrets") {
            assert!(
                line.starts_with("spur-tunnel-proxy spur-workstation-tokens "),
                "the tunnel proxy may read Secrets outside the token namespace: {line}"
            );
        }
    }

    let expected: BTreeSet<String> = EXPECTED
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let widened: Vec<&String> = actual.difference(&expected).collect();
    let narrowed: Vec<&String> = expected.difference(&actual).collect();
    assert!(
        widened.is_empty() && narrowed.is_empty(),
        "the chart's RBAC differs from tests/rbac/expected.txt\nnot expected (widened?):\n{}\nexpected but missing:\n{}\nthe whole answer:\n{}",
        widened
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        narrowed
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        actual
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n"),
    );
}
