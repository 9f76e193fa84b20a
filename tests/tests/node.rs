//! The node tier, end to end on running pods (tests/node/README.md): Spur's chart installed with
//! helm into a real one-node cluster under an RBAC-enforcing apiserver, sidecars injected by the
//! webhook into pods that really start, forks that really answer, and a keyed request from a
//! client pod checked by the name of the pod that answered it.
//!
//! One test walks the whole user path in order, because helm install, upgrade and uninstall act
//! on the one cluster-wide installation every step depends on. It begins with the previous
//! release (RELEASES) installed and upgraded to this tree under load (tests/tests/node_upgrade),
//! and ends with docs/quickstart.md's fresh install.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
mod node_access;
mod node_chaos;
mod node_cli;
mod node_day2;
mod node_hub_ha;
mod node_jobs;
mod node_jobs_ha;
mod node_kafka;
mod node_l4;
mod node_local;
mod node_parity;
mod node_quickstart;
mod node_resources;
mod node_smarttests;
mod node_tenancy;
mod node_traffic;
mod node_upgrade;
mod node_usage;
mod node_xds;

use spur_e2e::node::{
    Answer, CHART_VALUES, Node, SPUR_NAMESPACE, demo_app, demo_app_annotated, eventually, node,
    spur_bin,
};

/// The chart's `tunnelProxy.tokenNamespace` default.
const TOKEN_NAMESPACE: &str = "spur-workstation-tokens";
/// The chart's `resources.namespace` default.
const RESOURCE_NAMESPACE: &str = "spur-resources";
/// The chart's `resources.contextNamespace` default.
const CONTEXT_NAMESPACE: &str = "spur-io-contexts";
const RELEASE: &str = "spur";

fn helm_args<'a>(first: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = first.to_vec();
    v.extend_from_slice(CHART_VALUES);
    v.extend_from_slice(extra);
    v
}

fn chart() -> String {
    format!("{}/../charts/spur", env!("CARGO_MANIFEST_DIR"))
}

const COMPONENTS: &[(&str, &str)] = &[
    ("spur-ics", "spur-ics"),
    ("spur-operator", "spur-operator"),
    ("spur-routeserver", "spur-routeserver"),
    ("spur-tunnel-proxy", "spur-tunnel-proxy"),
    ("spur-traffic", "spur-traffic"),
];

#[test]
fn helm_install_and_the_user_path_on_running_pods() {
    let started = std::time::Instant::now();
    // Where the run's time goes (CI's budget, issue 47: the node tier's cold and warm time).
    let mark = |what: &str| {
        eprintln!(
            "node tier: {what} at {:.0} s",
            started.elapsed().as_secs_f64()
        )
    };
    let node = node();
    let chart = chart();
    // What every container uses through the whole run (the chart's requests and limits are set
    // from it: perf/results/requests-limits.md).
    let usage = spur_e2e::usage::Sampler::start(node).unwrap();

    // --- helm lint, template, server-side dry run -------------------------------------------
    node.helm(&helm_args(&["lint", &chart], &[])).unwrap();
    let rendered = node
        .helm(&helm_args(
            &["template", RELEASE, &chart, "--namespace", SPUR_NAMESPACE],
            &[],
        ))
        .unwrap();
    ensure_namespace(node, SPUR_NAMESPACE);
    // Objects inside the token namespace cannot be checked before it exists (a dry run creates
    // nothing); the install below creates them for real.
    let checkable: Vec<&str> = rendered
        .split("\n---\n")
        .filter(|doc| {
            !doc.contains(&format!("namespace: {TOKEN_NAMESPACE}\n"))
                && !doc.contains(&format!("namespace: {RESOURCE_NAMESPACE}\n"))
                && !doc.contains(&format!("namespace: {CONTEXT_NAMESPACE}\n"))
        })
        .collect();
    assert!(checkable.len() > 10, "{rendered}");
    node.kubectl_stdin(&["apply", "--dry-run=server"], &checkable.join("\n---\n"))
        .unwrap();

    mark("without a default StorageClass the install stops at once, naming the value");
    // --- without a default StorageClass the install stops at once, naming the value ---------
    node_quickstart::install_without_a_default_storage_class_fails_at_once(node);
    node_quickstart::give_the_node_a_default_storage_class(node);

    // --- helm install of the previous release, upgraded to this tree under load -------------
    // (The tree's own fresh install is docs/quickstart.md's, at the end.)
    mark("helm install of the previous release");
    let previous = node_upgrade::Release::previous();
    previous.install(node, RELEASE);
    mark("the upgrade from the previous release, under load");
    node_upgrade::from_the_previous_release(node, &previous, || {
        node.helm(&helm_args(
            &[
                "upgrade",
                RELEASE,
                &chart,
                "--namespace",
                SPUR_NAMESPACE,
                "--wait",
                "--timeout",
                "5m",
            ],
            &[],
        ))
        .with_context(|| node.describe(SPUR_NAMESPACE))
        .unwrap();
    });

    mark("every component Ready under its own ServiceAccount");
    // --- every component Ready under its own ServiceAccount ---------------------------------
    for (deployment, account) in COMPONENTS {
        node.rollout(SPUR_NAMESPACE, deployment).unwrap();
        let d = node
            .get_json(SPUR_NAMESPACE, &["deployment", deployment])
            .unwrap();
        assert_eq!(
            d["spec"]["template"]["spec"]["serviceAccountName"], *account,
            "{deployment} runs under its own ServiceAccount"
        );
    }
    // The apiserver enforces RBAC: the operator's account may not read Secrets outside its own
    // namespace.
    // `kubectl auth can-i` answers on stdout and exits 0 for yes, 1 for no (anything else is an
    // error). A control question the chart does grant shows the answers are the apiserver's.
    let operator = format!("--as=system:serviceaccount:{SPUR_NAMESPACE}:spur-operator");
    let can_i = |verb: &str, what: &str, ns: &str| {
        node.kubectl_status(&["auth", "can-i", verb, what, "-n", ns, &operator])
            .unwrap()
    };
    assert_eq!(can_i("get", "secrets", "default"), (Some(1), "no".into()));
    // The tunnel proxy faces the internet: it may list the workstation token Secrets in their
    // own namespace, and no Secret of the release namespace, where the CA's key is.
    let tunnel_proxy = format!("--as=system:serviceaccount:{SPUR_NAMESPACE}:spur-tunnel-proxy");
    let tp_can_i = |verb: &str, what: &str, ns: &str| {
        node.kubectl_status(&["auth", "can-i", verb, what, "-n", ns, &tunnel_proxy])
            .unwrap()
    };
    for verb in ["get", "list", "watch"] {
        assert_eq!(
            tp_can_i(verb, "secrets", SPUR_NAMESPACE),
            (Some(1), "no".into()),
            "tunnel proxy may {verb} Secrets in {SPUR_NAMESPACE}"
        );
    }
    assert_eq!(
        tp_can_i("list", "secrets", TOKEN_NAMESPACE),
        (Some(0), "yes".into())
    );
    assert_eq!(
        can_i("list", "sandboxes.spur.dev", "default"),
        (Some(0), "yes".into())
    );

    mark("two demo services with injected sidecars");
    // --- two demo services with injected sidecars -------------------------------------------
    let shop = node
        .namespace(
            "shop",
            &[
                ("sidecar.spur.dev/inject", "true"),
                ("spur.dev/enabled", "true"),
            ],
        )
        .unwrap();
    let ns = shop.name.as_str();
    // backend in the layout with an init container and a native sidecar; frontend in the
    // default one (the sidecar programs the rules and is the first app container).
    node.apply(&demo_app_annotated(
        ns,
        "backend",
        None,
        &[
            ("sidecar.spur.dev/interception", "initContainer"),
            ("sidecar.spur.dev/placement", "native"),
        ],
    ))
    .unwrap();
    node.apply(&demo_app(ns, "frontend", Some("http://backend:8080")))
        .unwrap();
    node.rollout(ns, "backend").unwrap();
    node.rollout(ns, "frontend").unwrap();
    let backend_pods = node.pods(ns, "app=backend").unwrap();
    assert_eq!(backend_pods.len(), 1, "{}", node.describe(ns));
    for app in ["backend", "frontend"] {
        let pod = &node.pods(ns, &format!("app={app}")).unwrap()[0];
        let p = node.get_json(ns, &["pod", pod]).unwrap();
        assert_eq!(
            p["metadata"]["annotations"]["sidecar.spur.dev/status"], "injected",
            "{pod}: {}",
            p["metadata"]["annotations"]
        );
        let names = |key: &str| -> Vec<&str> {
            p["spec"][key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["name"].as_str())
                .collect()
        };
        if app == "backend" {
            assert_eq!(
                names("initContainers"),
                ["spur-init", "spur-sidecar"],
                "{pod}"
            );
            assert_eq!(names("containers"), ["app"], "{pod}");
        } else {
            assert_eq!(names("initContainers"), Vec::<&str>::new(), "{pod}");
            assert_eq!(names("containers"), ["spur-sidecar", "app"], "{pod}");
            // The sidecar started as root, programmed the rules and runs without privileges.
            let id = p["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["name"] == "spur-sidecar")
                .and_then(|c| c["containerID"].as_str())
                .unwrap();
            let pid = node.task_pid(id).unwrap();
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            for line in [
                "Uid:\t15337\t15337\t15337\t15337",
                "CapEff:\t0000000000000000",
            ] {
                assert!(
                    status.contains(line),
                    "{pod}: sidecar status lacks {line:?}:\n{status}"
                );
            }
        }
        // The rules (spur-init's or the sidecar's) live in the pod's own network namespace.
        let rules = node
            .in_pod_netns(
                ns,
                pod,
                "app",
                &[
                    "sh",
                    "-c",
                    "iptables-legacy-save -t nat 2>/dev/null; nft list ruleset 2>/dev/null; true",
                ],
            )
            .unwrap();
        assert!(
            rules.contains("15006"),
            "{pod}: no redirect to the sidecar in the pod's network namespace:\n{rules}"
        );
    }
    let client = node.client_pod(ns).unwrap();
    let frontend = format!("http://frontend.{ns}.svc.cluster.local:8080/");
    // The cluster's DNS answers cluster names and nothing else: no query leaves the node.
    let outside = node
        .kubectl(&[
            "-n",
            ns,
            "exec",
            &client,
            "--",
            "sh",
            "-c",
            "curl -sS --max-time 5 http://example.com/ 2>&1; true",
        ])
        .unwrap();
    assert!(
        outside.contains("Could not resolve host"),
        "a name outside the cluster resolved: {outside}"
    );

    let baseline = get(node, ns, &client, &frontend, None);
    assert_eq!(
        baseline.answered_by(),
        Some(backend_pods[0].as_str()),
        "{baseline:?}"
    );

    mark("a Sandbox forking backend");
    // --- a Sandbox forking backend: keyed requests reach the fork pod ------------------------
    node.apply(&sandbox(
        "backend-fix",
        ns,
        "backend",
        "fix",
        Some("team-a"),
    ))
    .unwrap();
    let key = sandbox_ready(node, "backend-fix");
    let fork = fork_pod(node, ns, "backend-fix");
    let keyed = until_answered_by(node, ns, &client, &frontend, &key, &fork)
        .with_context(|| node.describe(ns))
        .unwrap();
    assert_eq!(keyed.marker(), Some("fix"), "{keyed:?}");
    assert_eq!(
        keyed.json["pod"]
            .as_str()
            .map(|p| p.starts_with("frontend-")),
        Some(true)
    );
    let unkeyed = get(node, ns, &client, &frontend, None);
    assert_eq!(
        unkeyed.answered_by(),
        Some(backend_pods[0].as_str()),
        "{unkeyed:?}"
    );

    mark("the route server");
    // --- the route server: TLS, and rules only for the reader they belong to -----------------
    routeserver_refuses_strangers(node, ns, &client, &backend_pods[0]);

    mark("jobs in the sandbox's routing context, on a pool of runner pods");
    // --- jobs in the sandbox's routing context, on a pool of runner pods ---------------------
    node_jobs::jobs_on_the_node(node, ns, "backend-fix", &key, &fork, &backend_pods[0]);

    mark("automatic smart-test runs");
    // --- a SmartTest covering backend runs when a sandbox forking it is Ready, and again ------
    node_smarttests::smart_tests_on_the_node(node, ns);

    mark("just-in-time access");
    // --- just-in-time access: kubectl exec under a grant, audited, refused after expiry -------
    node_access::access_on_the_node(node, ns, "backend-fix", &fork, &backend_pods[0]);

    mark("traffic capture");
    // --- traffic capture: tail, diff against a virtual workload, redaction, load, outage ------
    node_traffic::traffic_on_the_node(
        node,
        &node_traffic::Scene {
            ns,
            client: &client,
            frontend: &frontend,
            sandbox: "backend-fix",
            key: &key,
            fork_pod: &fork,
            backend_pod: &backend_pods[0],
        },
    );

    mark("a RouteGroup over two sandboxes routes by its own key");
    // --- a RouteGroup over two sandboxes routes by its own key -------------------------------
    node.apply(&sandbox(
        "frontend-fix",
        ns,
        "frontend",
        "front",
        Some("team-a"),
    ))
    .unwrap();
    let front_key = sandbox_ready(node, "frontend-fix");
    let front_fork = fork_pod(node, ns, "frontend-fix");
    node.apply(&routegroup("team-a", ns)).unwrap();
    let group_key = eventually("the RouteGroup's key", Duration::from_secs(60), || {
        let g = node.get_json("default", &["routegroup", "team-a"])?;
        Ok(g["status"]["routingKey"].as_str().map(String::from))
    })
    .unwrap();
    let grouped = eventually(
        "a RouteGroup-keyed request to reach both forks",
        Duration::from_secs(60),
        || {
            let a = try_get(node, ns, &client, &frontend, Some(&group_key))?;
            Ok(
                (a.json["pod"] == front_fork.as_str() && a.answered_by() == Some(fork.as_str()))
                    .then_some(a),
            )
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap();
    assert_eq!(grouped.json["marker"], "front", "{grouped:?}");
    // Each sandbox's own key reaches only its own fork.
    let only_front = get(node, ns, &client, &frontend, Some(&front_key));
    assert_eq!(only_front.json["pod"], front_fork.as_str());
    assert_eq!(only_front.answered_by(), Some(backend_pods[0].as_str()));

    mark("deleting a Sandbox removes its fork, Services and routes");
    // --- deleting a Sandbox removes its fork, Services and routes ----------------------------
    node.kubectl(&["delete", "routegroup", "team-a", "--wait=true"])
        .unwrap();
    node.kubectl(&[
        "delete",
        "sandbox",
        "frontend-fix",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    node.kubectl(&[
        "delete",
        "sandbox",
        "backend-fix",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    eventually("the fork pod to go", Duration::from_secs(120), || {
        Ok(node
            .pods(ns, "spur.dev/sandbox=backend-fix")?
            .is_empty()
            .then_some(()))
    })
    .unwrap();
    let services = node
        .kubectl(&[
            "-n",
            ns,
            "get",
            "services",
            "-l",
            "spur.dev/sandbox=backend-fix",
            "-o",
            "name",
        ])
        .unwrap();
    assert_eq!(services.trim(), "", "the sandbox's Services are gone");
    let after = get(node, ns, &client, &frontend, Some(&key));
    assert_eq!(
        after.answered_by(),
        Some(backend_pods[0].as_str()),
        "{after:?}"
    );

    mark("TTL expiry does the same");
    // --- TTL expiry does the same -------------------------------------------------------------
    node.apply(&sandbox_with_ttl("backend-ttl", ns, "backend", "1m"))
        .unwrap();
    sandbox_ready(node, "backend-ttl");
    eventually(
        "the expired sandbox to go",
        Duration::from_secs(150),
        || Ok(node.is_gone(None, "sandbox", "backend-ttl")?.then_some(())),
    )
    .unwrap();
    eventually(
        "the expired sandbox's fork pod to go",
        Duration::from_secs(120),
        || {
            Ok(node
                .pods(ns, "spur.dev/sandbox=backend-ttl")?
                .is_empty()
                .then_some(()))
        },
    )
    .unwrap();

    mark("sandbox resources");
    // --- sandbox resources: a database per sandbox, made before its fork starts ---------------
    // (in namespace hotrod, as docs/examples/resourceplugin-postgres.yaml says; before the
    // other examples, whose check ends by deleting that namespace)
    let resource_secrets = node_resources::resources_on_the_node(node);

    mark("proxyless gRPC");
    // --- proxyless gRPC: grpc-go's xDS client in a pod routes by key through the route server -
    node_xds::proxyless_grpc_on_the_node(node);

    mark("UDP listeners");
    // --- UDP listeners: a ListenerSet on a spur-gateway pod, sessions hashed over workers -----
    node_l4::l4_listeners_on_the_node(node);

    mark("Kafka records by routing key");
    // --- Kafka records by routing key: a sandbox comes and goes mid-stream, each record has
    // exactly one consumer, with each of three independent clients ------------------------------
    node_kafka::kafka_on_the_node(node);

    mark("Signadot parity");
    // --- Signadot parity: valueFrom.fork, SIGNADOT_* env, Recreate forks, RouteGroup ttl ----
    node_parity::signadot_parity_on_the_node(node);

    mark("every file under docs/examples/ does what its comments say");
    // --- every file under docs/examples/ does what its comments say ---------------------------
    docs_examples_on_the_node(node);

    mark("which service dropped the key");
    // --- which service dropped the key: `spur doctor propagation` over a three-service chain -
    node_cli::propagation::propagation_doctor(node);

    mark("the hub");
    // --- the hub: an agent in the cluster dials a hub on a "laptop"; previews reach the fork --
    hub_previews_through_the_agent(node, ns, &backend_pods[0]);

    mark("a laptop joins through the tunnel-proxy pod");
    // --- a laptop joins through the tunnel-proxy pod: keyed requests reach its process --------
    let workstation_token =
        laptop_joins_through_the_tunnel_proxy(node, ns, &client, &frontend, &backend_pods[0]);

    mark("the same in one command");
    // --- the same in one command: `spur sandbox apply --local` from a laptop, Ctrl-C ends it --
    node_local::apply_local::joins_in_one_command(node, ns, &client, &frontend, &backend_pods[0]);

    mark("a user with rights in one namespace cannot reach through Spur into others");
    // --- a user with rights in one namespace cannot reach through Spur into others -----------
    // (workstation `alice` is the admin's since the step above)
    node_tenancy::a_tenant_cannot_reach_through(node, "alice", ns, "backend");

    mark("the CA rotation begins");
    // --- the CA rotates while traffic flows: no request fails --------------------------------
    let reader_token =
        certificates_rotate_under_load(node, ns, &client, &frontend, &backend_pods[0]);

    // --- no component logged a secret, at debug level ----------------------------------------
    let mut secrets = vec![workstation_token.as_str(), reader_token.as_str()];
    secrets.extend(resource_secrets.iter().map(String::as_str));
    secrets_never_logged(node, ns, &secrets);

    // --- each control-plane component deleted in turn under load: no request fails -----------
    mark("chaos begins");
    node_chaos::control_plane_outages_under_load(node, ns, &frontend, &backend_pods[0]);
    mark("chaos ends");

    // --- with the webhook down, new pods still start, uninjected ------------------------------
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment/spur-operator",
        "--replicas=0",
    ])
    .unwrap();
    // Gone, not just terminating: a terminating replica still answers admission reviews.
    eventually("the operator's pods to go", Duration::from_secs(90), || {
        let left = node.kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/name=spur-operator",
            "-o",
            "name",
        ])?;
        Ok(left.trim().is_empty().then_some(()))
    })
    .unwrap();
    node.kubectl(&["-n", ns, "rollout", "restart", "deployment/backend"])
        .unwrap();
    node.rollout(ns, "backend").unwrap();
    let restarted = node.pods(ns, "app=backend").unwrap();
    let p = node.get_json(ns, &["pod", &restarted[0]]).unwrap();
    assert!(
        p["metadata"]["annotations"]["sidecar.spur.dev/status"].is_null(),
        "a pod admitted without the webhook carries no injection record: {}",
        p["metadata"]["annotations"]
    );
    assert!(
        p["spec"]["initContainers"].is_null(),
        "nothing injected without the webhook"
    );
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "scale",
        "deployment/spur-operator",
        "--replicas=1",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-operator").unwrap();
    // The operator, back, records it: a sandbox forking that baseline reports its one pod
    // without a sidecar (keyed requests reaching it would not be routed). Creating a Sandbox
    // goes through the operator's webhook (sandbox-creator.spur.dev, Fail), which answers once
    // its Service has the new pod's endpoint: with one replica there is a moment after the
    // rollout when the API server cannot reach it yet (the chart runs two).
    let coverage_sandbox = sandbox("coverage", ns, "backend", "coverage", None);
    eventually(
        "the Sandbox webhook to answer after the operator's restart",
        Duration::from_secs(60),
        || match node.apply(&coverage_sandbox) {
            Ok(_) => Ok(Some(())),
            Err(e) if format!("{e:#}").contains("failed calling webhook") => Ok(None),
            Err(e) => Err(e),
        },
    )
    .unwrap();
    let coverage = eventually(
        "the Sandbox to report the uninjected baseline pod",
        Duration::from_secs(90),
        || {
            let s = node.get_json("default", &["sandbox", "coverage"])?;
            let c = &s["status"]["forks"][0]["baselineSidecars"];
            Ok((c["pods"] == 1 && c["injected"] == 0).then(|| c.clone()))
        },
    )
    .unwrap();
    assert_eq!(coverage["allReady"], false, "{coverage}");
    node.kubectl(&[
        "delete",
        "sandbox",
        "coverage",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    // The baseline injected again, as its owner would do once the webhook is back (later steps
    // fork it): restarted until a new pod carries the injection record (the restart's pods are
    // admitted by whichever operator endpoint answers; an unreachable one lets them start bare).
    eventually(
        "backend's pods injected again after the webhook came back",
        Duration::from_secs(180),
        || {
            node.kubectl(&["-n", ns, "rollout", "restart", "deployment/backend"])?;
            node.rollout(ns, "backend")?;
            let pods = node.pods(ns, "app=backend")?;
            let injected = pods.iter().all(|p| {
                node.get_json(ns, &["pod", p]).is_ok_and(|p| {
                    !p["metadata"]["annotations"]["sidecar.spur.dev/status"].is_null()
                })
            });
            Ok((!pods.is_empty() && injected).then_some(()))
        },
    )
    .unwrap();

    mark("the metrics check begins");
    // --- every metric name the alerts and dashboards read is exported -------------------------
    let frontend_pod = node.pods(ns, "app=frontend").unwrap()[0].clone();
    node_day2::metrics_the_alerts_read_are_exported(node, ns, &client, &frontend_pod);

    // --- helm upgrade with a changed value rolls the components ------------------------------
    // `helm upgrade` as a user runs it: the install's values, a new route server memory limit,
    // and `extra`.
    let upgrade = |extra: &[&str]| {
        let mut values = vec!["--set", "routeserver.resources.limits.memory=160Mi"];
        values.extend_from_slice(extra);
        node.helm(&helm_args(
            &[
                "upgrade",
                RELEASE,
                &chart,
                "--namespace",
                SPUR_NAMESPACE,
                "--wait",
                "--timeout",
                "5m",
            ],
            &values,
        ))
        .with_context(|| node.describe(SPUR_NAMESPACE))
        .unwrap();
    };
    let before = node
        .get_json(SPUR_NAMESPACE, &["deployment", "spur-routeserver"])
        .unwrap();
    upgrade(&[]);
    let after = node
        .get_json(SPUR_NAMESPACE, &["deployment", "spur-routeserver"])
        .unwrap();
    // The CRD hook ran before the install and this upgrade (templates/crds.yaml, under its
    // ClusterRole on this RBAC cluster): every CRD of the chart is its field manager's alone,
    // taken over from helm, which created them.
    for file in std::fs::read_dir(format!("{chart}/crds")).unwrap() {
        let file = file.unwrap().file_name().into_string().unwrap();
        let name = file.trim_end_matches(".yaml");
        // `kubectl get` leaves managedFields out unless asked.
        let crd: Value = serde_json::from_str(
            &node
                .kubectl(&["get", "crd", name, "-o", "json", "--show-managed-fields"])
                .unwrap(),
        )
        .unwrap();
        let managers: Vec<&str> = crd["metadata"]["managedFields"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no managedFields"))
            .iter()
            .filter(|m| m["subresource"].as_str().unwrap_or_default().is_empty())
            .filter_map(|m| m["manager"].as_str())
            .collect();
        assert_eq!(
            managers,
            [spur_operator::crds::FIELD_MANAGER],
            "{name}: not the CRD hook's alone"
        );
    }
    assert!(
        after["metadata"]["generation"].as_i64() > before["metadata"]["generation"].as_i64(),
        "the route server's Deployment rolled"
    );
    node.rollout(SPUR_NAMESPACE, "spur-routeserver").unwrap();
    assert_eq!(
        after["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "160Mi"
    );
    // ... and only those whose configuration changed: the operator's pods stay through an
    // upgrade of the route server alone; a changed injection config rolls them, and pods
    // created afterwards get it. (The upgrade above turned the agent and the hub off, whose
    // preview domain the operator is started with: it rolled the operator too.)
    node_day2::a_changed_injection_config_reaches_new_pods(node, ns, "frontend", upgrade);
    // --- a value behind a StatefulSet's immutable claim template changes in an upgrade --------
    node_day2::jobs_persistence_switches_in_an_upgrade(node, upgrade);
    // --- two jobs replicas on S3: the standby serves a running log, takes a job over ------------
    mark("two jobs replicas on S3");
    node_jobs_ha::two_replicas_on_s3(node, upgrade);
    // --- two hub replicas on PostgreSQL: the agent serves both, one goes, none fails ----------
    mark("two hub replicas on PostgreSQL");
    node_hub_ha::two_replicas_on_postgres(node, ns, upgrade);

    mark("upgrades end");

    // --- what each component used through the run, against its requests and limits ----------
    node_usage::within_limits(usage.finish().unwrap());

    // --- helm uninstall leaves nothing behind but the CRDs -----------------------------------
    drop(shop);
    node.helm(&[
        "uninstall",
        RELEASE,
        "--namespace",
        SPUR_NAMESPACE,
        "--wait",
        "--timeout",
        "3m",
    ])
    .unwrap();
    // Everything in the namespace, whoever made it: the chart's objects, and what the operator
    // and the tunnel proxy made for themselves (owned by their Deployments). What may stay: the
    // namespace's own defaults. The token namespace (the chart's) goes, with the tokens.
    let left = eventually(
        "helm uninstall to leave nothing in the namespace",
        Duration::from_secs(120),
        || {
            let all = node.kubectl(&[
                "get",
                "all,serviceaccounts,roles,rolebindings,configmaps,secrets,leases,endpointslices",
                "-n",
                SPUR_NAMESPACE,
                "-o",
                "name",
            ])?;
            let left: Vec<String> = all
                .lines()
                .filter(|l| !matches!(*l, "configmap/kube-root-ca.crt" | "serviceaccount/default"))
                // Workstation owner records (docs/local.md, "Workstation owners") are users'
                // claims, written by the operator and `spur local token`, not the chart's
                // objects: an uninstall leaves them. (A known gap: nothing removes them yet.)
                .filter(|l| !l.starts_with("configmap/spur-workstation-owner-"))
                .map(String::from)
                .collect();
            if left.is_empty() {
                Ok(Some(()))
            } else {
                Err(anyhow::anyhow!("left: {left:?}"))
            }
        },
    );
    left.unwrap();
    eventually(
        "the token namespace to go",
        Duration::from_secs(120),
        || {
            let (code, out) = node.kubectl_status(&[
                "get",
                "namespace",
                TOKEN_NAMESPACE,
                "-o",
                "jsonpath={.status.phase}",
            ])?;
            // Gone, or on its way (the namespace controller empties it first).
            Ok((code != Some(0) || out.trim() == "Terminating").then_some(()))
        },
    )
    .unwrap();
    let left = node
        .kubectl(&[
            "get",
            "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,validatingwebhookconfigurations",
            "-l",
            "app.kubernetes.io/part-of=spur",
            "-o",
            "name",
        ])
        .unwrap();
    assert_eq!(left.trim(), "", "cluster objects left by helm uninstall");
    let crds = node.kubectl(&["get", "crd", "-o", "name"]).unwrap();
    assert!(
        crds.contains("sandboxes.spur.dev"),
        "the CRDs stay (Helm's convention)"
    );
    // So does the jobs store's claim, with its logs (docs/quickstart.md says so).
    assert!(
        !node
            .is_gone(Some(SPUR_NAMESPACE), "pvc", "data-spur-jobs-0")
            .unwrap()
    );

    // --- docs/quickstart.md, as written, from here ------------------------------------------
    mark("the quickstart begins");
    node_quickstart::quickstart_on_the_node(node);
    mark("the user path ends (the node was up before it began)");
}

/// From the client pod, over TLS verified with the CA bundle the webhook copied into the
/// namespace: no token and a token for the API server's audience read nothing (401); a token
/// bound to the backend pod reads backend's rules (the fork's, just created) and neither
/// frontend's nor everything (403).
fn routeserver_refuses_strangers(node: &Node, ns: &str, client: &str, backend_pod: &str) {
    let bundle = node.get_json(ns, &["configmap", "spur-ca-bundle"]).unwrap()["data"]["ca.crt"]
        .as_str()
        .unwrap()
        .to_string();
    let status = |query: &str, token: &str| -> (u16, String) {
        let auth = if token.is_empty() {
            String::new()
        } else {
            format!("-H 'Authorization: Bearer {token}'")
        };
        let script = format!(
            "cat > /tmp/spur-ca.crt <<'EOF'\n{bundle}\nEOF\ncurl -sS --max-time 10 -o /tmp/rules.json -w '%{{http_code}}' --cacert /tmp/spur-ca.crt {auth} 'https://spur-routeserver.{SPUR_NAMESPACE}.svc:7778/api/v1/workloads/routing-rules{query}'; echo; cat /tmp/rules.json"
        );
        let out = node
            .kubectl(&["-n", ns, "exec", client, "--", "sh", "-c", &script])
            .unwrap();
        let (code, body) = out.split_once('\n').unwrap_or((&out, ""));
        (code.trim().parse().unwrap_or(0), body.to_string())
    };
    let api_audience = node
        .kubectl(&["-n", ns, "create", "token", "default", "--duration", "10m"])
        .unwrap()
        .trim()
        .to_string();
    let backend = routeserver_token(node, ns, backend_pod, "10m");
    let of =
        |name: &str| format!("?baselineKind=Deployment&baselineNamespace={ns}&baselineName={name}");
    assert_eq!(status("", "").0, 401);
    assert_eq!(status(&of("backend"), "").0, 401);
    assert_eq!(status(&of("backend"), &api_audience).0, 401);
    let (code, body) = status(&of("backend"), &backend);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"routingRules\":[{"), "{body}");
    assert_eq!(status(&of("frontend"), &backend).0, 403);
    assert_eq!(status("", &backend).0, 403);
}

/// A CA rotation requested through the CA Secret's annotation, under load from a pod that
/// trusts the CA through the namespace's bundle ConfigMap, mounted as the sidecars mount it: a
/// keyed request (to a fork), an unkeyed one (to the baseline) and a route-server read on a new
/// TLS connection, over and over, none of which may fail. Then the route server restarts: the
/// sidecars reconnect trusting the new CA (the kubelet refreshed their bundle) and a Sandbox's
/// deletion reaches them. Returns the route-server token it used (for the log scan).
fn certificates_rotate_under_load(
    node: &Node,
    ns: &str,
    client: &str,
    frontend: &str,
    backend_pod: &str,
) -> String {
    node.apply(&sandbox("rotation", ns, "backend", "rotation", None))
        .unwrap();
    let key = sandbox_ready(node, "rotation");
    let fork = fork_pod(node, ns, "rotation");
    until_answered_by(node, ns, client, frontend, &key, &fork).unwrap();
    node.client_pod_with(
        ns,
        "rotation-client",
        Some(("spur-ca-bundle", "/etc/spur-ca")),
    )
    .unwrap();
    let token = routeserver_token(node, ns, backend_pod, "30m");
    let exec = |script: &str| {
        node.kubectl(&[
            "-n",
            ns,
            "exec",
            "rotation-client",
            "--",
            "sh",
            "-c",
            script,
        ])
    };
    // Bounded by count, by time and by a stop file; every failure is a line of its log.
    let rules = format!(
        "https://spur-routeserver.{SPUR_NAMESPACE}.svc:7778/api/v1/workloads/routing-rules?baselineKind=Deployment&baselineNamespace={ns}&baselineName=backend"
    );
    let script = format!(
        r#"cat > /tmp/token <<'END'
{token}
END
cat > /tmp/load.sh <<'END'
end=$(( $(date +%s) + 600 )); i=0
while [ ! -e /tmp/stop ] && [ $i -lt 20000 ] && [ $(date +%s) -lt $end ]; do
  i=$((i+1))
  k=$(curl -sS --max-time 5 -H 'baggage: sd-routing-key={key}' -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$k" in *'"pod":"{fork}"'*' 200') ;; *) echo "keyed $i: $k" ;; esac
  u=$(curl -sS --max-time 5 -w ' %{{http_code}}' '{frontend}' 2>&1)
  case "$u" in *'"pod":"{backend_pod}"'*' 200') ;; *) echo "unkeyed $i: $u" ;; esac
  r=$(curl -sS -v --max-time 5 --cacert /etc/spur-ca/ca.crt -H "Authorization: Bearer $(cat /tmp/token)" -o /dev/null -w '%{{http_code}}' '{rules}' 2>/tmp/v)
  [ "$r" = 200 ] || echo "rules $i: $r $(grep -iE 'error|alert|fail' /tmp/v | head -3 | tr '\n' ' ')"
  grep 'start date' /tmp/v >> /tmp/served
  echo $i > /tmp/count
done
touch /tmp/finished
END
rm -f /tmp/stop /tmp/finished /tmp/served /tmp/count
nohup sh /tmp/load.sh > /tmp/load.log 2>&1 &
echo started"#
    );
    assert_eq!(exec(&script).unwrap().trim(), "started");

    let old_ca = secret_text(node, "spur-ca", "ca.crt");
    let count = || -> u64 {
        exec("cat /tmp/count 2>/dev/null || echo 0")
            .unwrap_or_default()
            .trim()
            .parse()
            .unwrap_or(0)
    };
    // Some load before the rotation starts.
    eventually("load to flow", Duration::from_secs(60), || {
        Ok((count() >= 20).then_some(()))
    })
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "annotate",
        "secret",
        "spur-ca",
        "--overwrite",
        &format!("spur.dev/rotate-requested-at={now}"),
    ])
    .unwrap();
    let new_ca = eventually(
        "the next CA to be promoted (40 s propagation)",
        Duration::from_secs(180),
        || {
            let ca = secret_text(node, "spur-ca", "ca.crt");
            Ok((ca != old_ca && ca.contains("BEGIN CERTIFICATE")).then_some(ca))
        },
    )
    .unwrap();
    // A new connection that trusts only the new CA reaches the route server: it serves a
    // certificate the new CA signed, picked up from its renewed Secret without a restart.
    let only_new = format!(
        "cat > /tmp/new-ca.crt <<'END'\n{}\nEND\ncurl -sS --max-time 5 -o /dev/null -w '%{{http_code}}' --cacert /tmp/new-ca.crt -H \"Authorization: Bearer $(cat /tmp/token)\" '{rules}' 2>&1; true",
        new_ca.trim()
    );
    eventually(
        "the route server to serve a certificate of the new CA",
        Duration::from_secs(120),
        || Ok((exec(&only_new)?.trim() == "200").then_some(())),
    )
    .unwrap();
    // The load goes on a little: connections verified against the bundle now holding both.
    let switched = count();
    eventually(
        "more load after the switch",
        Duration::from_secs(60),
        || Ok((count() >= switched + 20).then_some(())),
    )
    .unwrap();
    exec("touch /tmp/stop").unwrap();
    eventually("the load loop to stop", Duration::from_secs(30), || {
        Ok(exec("test -e /tmp/finished && echo yes")
            .unwrap_or_default()
            .contains("yes")
            .then_some(()))
    })
    .unwrap();
    let iterations = count();
    let failures = exec("cat /tmp/load.log").unwrap();
    let served = exec("sort -u /tmp/served").unwrap();
    eprintln!(
        "CA rotation under load: {iterations} iterations ({} requests), {} failed; {} route-server certificates served",
        iterations * 3,
        failures.lines().count(),
        served.lines().count()
    );
    assert_eq!(
        failures.trim(),
        "",
        "requests failed during the CA rotation"
    );
    assert!(
        served.lines().count() >= 2,
        "the load saw one certificate only: {served}"
    );

    // The route server restarts: every sidecar must reconnect, trusting the new CA from its
    // refreshed bundle, for the Sandbox's deletion to reach the frontend's sidecar.
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "rollout",
        "restart",
        "deployment/spur-routeserver",
    ])
    .unwrap();
    node.rollout(SPUR_NAMESPACE, "spur-routeserver").unwrap();
    node.kubectl(&[
        "delete",
        "sandbox",
        "rotation",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    eventually(
        "keyed requests back on the baseline after the sandbox went",
        Duration::from_secs(120),
        || {
            let a = try_get(node, ns, client, frontend, Some(&key))?;
            Ok((a.answered_by() == Some(backend_pod)).then_some(()))
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap();
    node.kubectl(&["-n", ns, "delete", "pod", "rotation-client", "--wait=false"])
        .unwrap();
    token
}

/// A token of `ns`'s default ServiceAccount for the route server's audience, bound to `pod`
/// (what the pod's sidecar presents).
fn routeserver_token(node: &Node, ns: &str, pod: &str, duration: &str) -> String {
    node.kubectl(&[
        "-n",
        ns,
        "create",
        "token",
        "default",
        "--duration",
        duration,
        "--audience",
        "spur-routeserver",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod,
    ])
    .unwrap()
    .trim()
    .to_string()
}

/// One key of a Secret of the release namespace, decoded.
fn secret_text(node: &Node, secret: &str, key: &str) -> String {
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "get",
        "secret",
        secret,
        "-o",
        &format!(
            "go-template={{{{with index .data \"{key}\"}}}}{{{{. | base64decode}}}}{{{{end}}}}"
        ),
    ])
    .unwrap_or_else(|e| panic!("secret {secret}, key {key}: {e:#}"))
}

/// Every log line of the chart's components and of the injected sidecars (all at debug level)
/// is free of the tokens the run used and of every private key the operator keeps.
fn secrets_never_logged(node: &Node, ns: &str, tokens: &[&str]) {
    let mut needles: Vec<String> = tokens
        .iter()
        .filter(|t| t.len() >= 16)
        .map(|t| t.to_string())
        .collect();
    let names = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "get",
            "secrets",
            "-l",
            "spur.dev/pki",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}{\"\\n\"}{end}",
        ])
        .unwrap();
    for secret in names.lines().filter(|l| !l.is_empty()) {
        for key in ["ca.key", "next.key", "tls.key"] {
            // The key's body lines: a line of base64 is unique to its key.
            needles.extend(
                secret_text(node, secret, key)
                    .lines()
                    .filter(|l| !l.starts_with("-----") && l.len() >= 40)
                    .map(String::from),
            );
        }
    }
    assert!(
        needles.len() > tokens.len(),
        "no private key found to look for"
    );
    let mut logs = String::new();
    for namespace in [SPUR_NAMESPACE, ns] {
        for pod in node.pods(namespace, "").unwrap() {
            logs.push_str(
                &node
                    .kubectl(&["-n", namespace, "logs", &pod, "--all-containers"])
                    .unwrap_or_default(),
            );
        }
    }
    assert!(
        logs.contains("DEBUG"),
        "the components do not log at debug level; the scan would prove little"
    );
    for needle in &needles {
        assert!(
            !logs.contains(needle.as_str()),
            "a secret ({}…) is in a component's log",
            &needle[..8]
        );
    }
    eprintln!(
        "secret scan: {} bytes of logs, {} secrets looked for, none found",
        logs.len(),
        needles.len()
    );
}

fn ensure_namespace(node: &Node, name: &str) {
    node.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n"
    ))
    .unwrap();
}

fn try_get(
    node: &Node,
    ns: &str,
    pod: &str,
    url: &str,
    key: Option<&str>,
) -> anyhow::Result<Answer> {
    let baggage = key.map(|k| format!("sd-routing-key={k}"));
    let headers: Vec<(&str, &str)> = baggage.iter().map(|b| ("baggage", b.as_str())).collect();
    let a = node.curl(ns, pod, url, &headers)?;
    if a.status != 200 {
        bail!("{url} answered {}: {}", a.status, a.body);
    }
    Ok(a)
}

fn get(node: &Node, ns: &str, pod: &str, url: &str, key: Option<&str>) -> Answer {
    try_get(node, ns, pod, url, key)
        .with_context(|| node.describe(ns))
        .unwrap()
}

fn sandbox(name: &str, ns: &str, workload: &str, marker: &str, team: Option<&str>) -> String {
    sandbox_with_env(name, ns, workload, ("SPUR_APP_MARKER", marker), team)
}

/// A Sandbox forking `workload` with the environment variable `env` set in the fork.
fn sandbox_with_env(
    name: &str,
    ns: &str,
    workload: &str,
    env: (&str, &str),
    team: Option<&str>,
) -> String {
    let (var, value) = env;
    let labels = team
        .map(|t| format!("\n  labels:\n    team: {t}"))
        .unwrap_or_default();
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: {name}
spec:
  description: node test{labels}
  forks:
    - forkOf: {{kind: Deployment, namespace: {ns}, name: {workload}}}
      customizations:
        env:
          - {{name: {var}, value: "{value}"}}
"#
    )
}

fn sandbox_with_ttl(name: &str, ns: &str, workload: &str, ttl: &str) -> String {
    format!(
        "{}  ttl: {{duration: {ttl}}}\n",
        sandbox(name, ns, workload, "ttl", None)
    )
}

fn routegroup(name: &str, _ns: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: RouteGroup
metadata:
  name: {name}
spec:
  match:
    label: {{key: team, value: {name}}}
"#
    )
}

/// Waits for the Sandbox's Ready condition and returns its routing key.
fn sandbox_ready(node: &Node, name: &str) -> String {
    eventually(
        &format!("Sandbox {name} to be Ready with a routing key"),
        Duration::from_secs(180),
        || {
            let s = node.get_json("default", &["sandbox", name])?;
            let ready = condition(&s, "Ready") == Some("True");
            Ok(ready
                .then(|| s["status"]["routingKey"].as_str().map(String::from))
                .flatten())
        },
    )
    .with_context(|| {
        node.kubectl(&["get", "sandbox", name, "-o", "yaml"])
            .unwrap_or_default()
    })
    .unwrap()
}

/// The one running fork pod of a sandbox.
fn fork_pod(node: &Node, ns: &str, sandbox: &str) -> String {
    eventually(
        &format!("the fork pod of {sandbox}"),
        Duration::from_secs(180),
        || {
            let pods = node.pods(ns, &format!("spur.dev/sandbox={sandbox}"))?;
            Ok(match pods.as_slice() {
                [one] => {
                    let p: Value = node.get_json(ns, &["pod", one])?;
                    let ready = condition(&p, "Ready") == Some("True");
                    ready.then(|| one.clone())
                }
                _ => None,
            })
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap()
}

/// `spur-hub serve` on a "laptop" network namespace (the test host's stand-in for a machine
/// outside the cluster); the chart's agent, enabled by `helm upgrade`, dials it with a cluster
/// token. A preview URL of a Sandbox endpoint (the frontend) answers from the backend's fork pod;
/// without an API key the answer is 401 and nothing reaches the cluster; a hub killed and started
/// again is reconnected to with no manual step; a deleted Sandbox's URL is a 404.
fn hub_previews_through_the_agent(node: &Node, ns: &str, backend_pod: &str) {
    let mut laptop = node.laptop(3).unwrap();
    let netns = laptop.netns.clone();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spur_hub = spur_bin("spur-hub");
    let db = d.join("hub.db");
    let hub_cli = |args: &[&str]| -> String {
        let out = std::process::Command::new(&spur_hub)
            .args(args)
            .arg("--db")
            .arg(&db)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "spur-hub {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let token = hub_cli(&["cluster", "add", "node"]);
    // A hub user who may see everything (issue 42, point 5: every key belongs to a user, and the
    // agent checks each read as the user's Kubernetes identity; system:masters may read all).
    hub_cli(&[
        "user",
        "add",
        "dev",
        "--cluster",
        "*",
        "--all-namespaces",
        "--kube-group",
        "system:masters",
    ]);
    let key = hub_cli(&["apikey", "add", "dev"]).trim().to_owned();
    let ca = d.join("ca.pem");
    std::fs::write(&ca, hub_cli(&["ca"])).unwrap();
    let db_arg = db.to_str().unwrap().to_owned();
    let laptop_ip = laptop.ip.clone();
    let hub_args = [
        "serve",
        "--db",
        &db_arg,
        "--tunnel-addr",
        "0.0.0.0:8443",
        "--preview-addr",
        "0.0.0.0:8444",
        "--preview-domain",
        "preview.test",
        "--name",
        &laptop_ip,
        "--metrics-addr",
        "127.0.0.1:9090",
    ];
    let hub_log = d.join("hub.log");
    let mut hub = laptop.spawn(&spur_hub, &hub_args, &[], &hub_log).unwrap();
    node.apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: spur-agent-token, namespace: {SPUR_NAMESPACE}}}\nstringData: {{token: {}}}\n",
        token.trim()
    ))
    .unwrap();
    let ca_arg = format!("agent.hubCA={}", ca.display());
    let hub_arg = format!("agent.hub={}:8443", laptop.ip);
    node.helm(&helm_args(
        &[
            "upgrade",
            RELEASE,
            &chart(),
            "--namespace",
            SPUR_NAMESPACE,
            "--reuse-values",
            "--wait",
            "--timeout",
            "5m",
        ],
        &[
            "--set",
            "agent.enabled=true",
            "--set",
            &hub_arg,
            "--set-file",
            &ca_arg,
            "--set",
            "agent.previewDomain=preview.test",
            // The web view's traffic tab, read through this agent.
            "--set",
            "agent.traffic.enabled=true",
            // The chart's own hub as well (not the one the agent dials): it starts from the
            // image, and is administered with `kubectl exec`.
            "--set",
            "hub.enabled=true",
            "--set",
            "hub.previewDomain=preview.test",
            "--set",
            "hub.persistence.enabled=false",
            "--set",
            "hub.serviceType=ClusterIP",
        ],
    ))
    .with_context(|| node.describe(SPUR_NAMESPACE))
    .unwrap();
    node.kubectl(&[
        "-n",
        SPUR_NAMESPACE,
        "rollout",
        "status",
        "statefulset/spur-hub",
        "--timeout=180s",
    ])
    .with_context(|| node.describe(SPUR_NAMESPACE))
    .unwrap();
    let in_cluster_token = node
        .kubectl(&[
            "-n",
            SPUR_NAMESPACE,
            "exec",
            "spur-hub-0",
            "--",
            "spur-hub",
            "cluster",
            "add",
            "incluster",
        ])
        .unwrap();
    assert!(
        in_cluster_token.trim().starts_with("spurc_"),
        "{in_cluster_token}"
    );
    // Ready means connected to the hub (the readiness probe is the tunnel's state).
    node.rollout(SPUR_NAMESPACE, "spur-agent")
        .with_context(|| std::fs::read_to_string(d.join("hub.log")).unwrap_or_default())
        .unwrap();

    node.apply(&format!(
        "{}  defaultRouteGroup:\n    endpoints:\n      - {{name: shop, target: \"http://frontend.{ns}.svc:8080\"}}\n",
        sandbox("backend-preview", ns, "backend", "preview", None)
    ))
    .unwrap();
    sandbox_ready(node, "backend-preview");
    let fork = fork_pod(node, ns, "backend-preview");
    // The operator publishes the preview URL in status (agent.previewDomain).
    let published = eventually("the preview URL in status", Duration::from_secs(60), || {
        let s = node.get_json("default", &["sandbox", "backend-preview"])?;
        Ok(s["status"]["endpoints"][0]["url"]
            .as_str()
            .map(String::from))
    })
    .unwrap();
    assert_eq!(published, "https://shop--backend-preview.preview.test/");
    let preview = |host: &str, headers: &[&str]| -> Answer {
        let mut c = std::process::Command::new("ip");
        c.args([
            "netns",
            "exec",
            &netns,
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
        ])
        .arg(&ca)
        .args([
            "--resolve",
            &format!("{host}:8444:127.0.0.1"),
            "-w",
            "\n%{http_code}",
        ]);
        for h in headers {
            c.args(["-H", h]);
        }
        let out = c.arg(format!("https://{host}:8444/")).output().unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        Answer {
            status: code.trim().parse().unwrap_or(0),
            json: serde_json::from_str(body).unwrap_or(Value::Null),
            body: body.to_owned(),
        }
    };
    let host = "shop--backend-preview.preview.test";
    let auth = format!("x-spur-api-key: {key}");
    let answered = |a: &Answer| a.status == 200 && a.answered_by() == Some(fork.as_str());
    let a = eventually(
        "the preview URL to answer from the fork",
        Duration::from_secs(90),
        || {
            let a = preview(host, &[&auth]);
            Ok(answered(&a).then_some(a))
        },
    )
    .with_context(|| std::fs::read_to_string(d.join("hub.log")).unwrap_or_default())
    .unwrap();
    assert_eq!(a.marker(), Some("preview"), "{a:?}");
    // Unauthenticated: 401 from the hub; nothing reached the cluster (the baseline still
    // answers keyless requests, and the fork saw no request without the key).
    let denied = preview(host, &[]);
    assert_eq!(denied.status, 401, "{denied:?}");
    assert!(
        !denied.body.contains(backend_pod) && !denied.body.contains(&fork),
        "{denied:?}"
    );

    // A namespace's own routing-key carriers, through sidecars and through a preview.
    let started = std::time::Instant::now();
    node_parity::carriers::configured_carriers_on_the_node(node, &preview, &auth);
    eprintln!("node carriers: {:.1?}", started.elapsed());

    // The web view's traffic tab (agent.traffic.enabled): the agent reads the cluster's traffic
    // store over TLS under the operator's CA bundle, with its own token, which RBAC
    // (spur-traffic-reader) lets read. This sandbox captures nothing, so the tab says so; a
    // refused read would say "Cannot read this sandbox's traffic" (and why).
    let tab = format!("https://{laptop_ip}:8444/traffic?cluster=node&sandbox=backend-preview");
    let page = eventually(
        "the traffic tab through the agent",
        Duration::from_secs(60),
        || {
            let out = std::process::Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &netns,
                    "curl",
                    "-sS",
                    "--max-time",
                    "10",
                    "--cacert",
                ])
                .arg(&ca)
                .args(["-H", &auth, &tab])
                .output()?;
            let body = String::from_utf8_lossy(&out.stdout).into_owned();
            anyhow::ensure!(
                body.contains("No captured exchange matches"),
                "the tab says: {body}"
            );
            Ok(Some(body))
        },
    )
    .with_context(|| std::fs::read_to_string(d.join("hub.log")).unwrap_or_default())
    .unwrap();
    assert!(
        page.contains("Traffic of sandbox backend-preview in node"),
        "{page}"
    );
    hub_users_of_another_namespace_read_nothing(&hub_cli, &netns, &ca, &tab, &page);

    // The hub dies and comes back: the agent reconnects, previews work again, no manual step.
    laptop.stop(hub);
    hub = laptop.spawn(&spur_hub, &hub_args, &[], &hub_log).unwrap();
    eventually(
        "previews after the hub restarted",
        Duration::from_secs(90),
        || {
            let a = preview(host, &[&auth]);
            Ok(answered(&a).then_some(()))
        },
    )
    .with_context(|| std::fs::read_to_string(d.join("hub.log")).unwrap_or_default())
    .unwrap();
    // Two agent replicas (agent.replicas), each with its own session to the hub. Each of the
    // two pods is deleted in turn (issue 47, chaos; so the one the hub prefers certainly is)
    // while previews are sent one after another: none fails (the deleted agent unbinds first
    // and the hub opens streams on the other replica's session), and the Deployment's new pod
    // dials the hub before the next deletion.
    let agents = node
        .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-agent")
        .unwrap();
    assert_eq!(agents.len(), 2, "{agents:?}");
    let ready_agents = || {
        node.get_json(SPUR_NAMESPACE, &["deployment", "spur-agent"])
            .ok()
            .and_then(|d| d["status"]["readyReplicas"].as_i64())
    };
    for pod in &agents {
        // Ready means connected to the hub (the hub restart above waited for one preview).
        eventually("two agents ready", Duration::from_secs(120), || {
            Ok((ready_agents() == Some(2)).then_some(()))
        })
        .with_context(|| node.describe(SPUR_NAMESPACE))
        .unwrap();
        std::thread::sleep(Duration::from_secs(2));
        let start = std::time::Instant::now();
        node.kubectl(&["-n", SPUR_NAMESPACE, "delete", "pod", pod, "--wait=false"])
            .unwrap();
        let (mut sent, mut before_gone, mut failed) = (0, 0, Vec::new());
        let mut gone = None;
        // Bounded: until the old pod is gone and a new one is ready, and at most 180 s.
        while start.elapsed() < Duration::from_secs(180) {
            let a = preview(host, &[&auth]);
            sent += 1;
            if gone.is_none() {
                before_gone += 1;
            }
            if !answered(&a) {
                failed.push(format!(
                    "{:.1} s: {} {}",
                    start.elapsed().as_secs_f64(),
                    a.status,
                    a.body
                ));
            }
            if sent % 5 == 0 {
                if gone.is_none()
                    && node
                        .is_gone(Some(SPUR_NAMESPACE), "pod", pod)
                        .unwrap_or(false)
                {
                    gone = Some(start.elapsed());
                }
                if gone.is_some() && ready_agents() == Some(2) {
                    break;
                }
            }
        }
        eprintln!(
            "chaos: agent pod {pod} deleted under preview load: {sent} previews ({before_gone} \
             before it was gone), {} failed; gone after {:.1?}, two agents ready again after \
             {:.1} s",
            failed.len(),
            gone,
            start.elapsed().as_secs_f64()
        );
        assert!(gone.is_some(), "agent pod {pod} was not gone within 180 s");
        assert!(before_gone >= 5, "too few previews while {pod} went");
        assert!(
            failed.is_empty(),
            "previews failed while agent pod {pod} went: {failed:#?}"
        );
    }
    node.rollout(SPUR_NAMESPACE, "spur-agent")
        .with_context(|| std::fs::read_to_string(d.join("hub.log")).unwrap_or_default())
        .unwrap();

    // The Sandbox goes: its URL is a 404.
    node.kubectl(&[
        "delete",
        "sandbox",
        "backend-preview",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    eventually(
        "the deleted sandbox's preview to 404",
        Duration::from_secs(60),
        || Ok((preview(host, &[&auth]).status == 404).then_some(())),
    )
    .unwrap();
    laptop.stop(hub);
    drop(laptop);
    // The token Secret is the user's, not the chart's: helm uninstall would leave it.
    node.kubectl(&["-n", SPUR_NAMESPACE, "delete", "secret", "spur-agent-token"])
        .unwrap();
}

/// Captured traffic is read through the hub as its user's Kubernetes identity (issue 42, point
/// 5). Two hub users whose Kubernetes identity is a user with rights in namespace `tenant-a` only
/// ask for the traffic tab `tab` of a sandbox forking another namespace, which `control` (the
/// same tab, read by a user who may) shows: one who may see every namespace of the cluster at the
/// hub is refused by the agent's SubjectAccessReview (the agent's own token could read it), one
/// scoped to `tenant-a` at the hub is told there is no such sandbox. Neither page shows what
/// the control's does.
fn hub_users_of_another_namespace_read_nothing(
    hub_cli: &dyn Fn(&[&str]) -> String,
    netns: &str,
    ca: &std::path::Path,
    tab: &str,
    control: &str,
) {
    const TENANT: &str = "mallory@tenant-a";
    hub_cli(&[
        "user",
        "add",
        "mallory",
        "--cluster",
        "node",
        "--all-namespaces",
        "--kube-user",
        TENANT,
    ]);
    hub_cli(&[
        "user",
        "add",
        "mallory-a",
        "--cluster",
        "node",
        "--namespace",
        "tenant-a",
        "--kube-user",
        TENANT,
    ]);
    let tab_as = |user: &str| -> String {
        let key = hub_cli(&["apikey", "add", user]).trim().to_owned();
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                netns,
                "curl",
                "-sS",
                "--max-time",
                "10",
                "--cacert",
            ])
            .arg(ca)
            .args(["-H", &format!("x-spur-api-key: {key}"), tab])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        control.contains("No captured exchange matches"),
        "{control}"
    );
    let refused = tab_as("mallory");
    assert!(
        refused.contains("Cannot read this sandbox's traffic")
            && refused.contains(&format!("{TENANT} may not get sandboxes/traffic")),
        "the agent's review refuses, naming the identity it checked: {refused}"
    );
    assert!(
        !refused.contains("No captured exchange matches"),
        "{refused}"
    );
    let hidden = tab_as("mallory-a");
    assert!(hidden.contains("that you may see"), "{hidden}");
    assert!(!hidden.contains("No captured exchange matches"), "{hidden}");
    eprintln!("hub traffic: users acting as {TENANT} read nothing of another namespace's sandbox");
}

/// `spur local connect` from a "laptop" network namespace to the tunnel-proxy pod (its ClusterIP
/// Service), with a workstation token from `spur local token`; a Sandbox with a local workload for
/// `backend`; a keyed request from the client pod reaches the process on the laptop. Returns the workstation token.
fn laptop_joins_through_the_tunnel_proxy(
    node: &Node,
    ns: &str,
    client: &str,
    frontend: &str,
    backend_baseline: &str,
) -> String {
    let workstation = node_local::Workstation::connect(node, 1, "alice", "alices-laptop", "laptop");
    let key =
        node_local::local_sandbox(node, "backend-local", "alice", "Deployment", ns, "backend");
    let answer = until_answered_by(node, ns, client, frontend, &key, "alices-laptop")
        .with_context(|| workstation.logs(node))
        .unwrap();
    assert_eq!(answer.marker(), Some("laptop"), "{answer:?}");
    let unkeyed = get(node, ns, client, frontend, None);
    assert_eq!(unkeyed.answered_by(), Some(backend_baseline), "{unkeyed:?}");
    // The tunnel proxy's pod is deleted under the connected workstation (issue 47, chaos): the
    // workstation reconnects to the new one by itself and its listener comes back.
    let proxy = node
        .pods(SPUR_NAMESPACE, "app.kubernetes.io/name=spur-tunnel-proxy")
        .unwrap();
    assert!(!proxy.is_empty(), "{}", node.describe(SPUR_NAMESPACE));
    let start = std::time::Instant::now();
    let mut delete = vec!["-n", SPUR_NAMESPACE, "delete", "pod"];
    delete.extend(proxy.iter().map(String::as_str));
    delete.extend(["--wait=true", "--timeout=120s"]);
    node.kubectl(&delete).unwrap();
    until_answered_by(node, ns, client, frontend, &key, "alices-laptop")
        .with_context(|| workstation.logs(node))
        .unwrap();
    eprintln!(
        "chaos: the workstation answered again {:.1} s after the tunnel proxy's pod was deleted",
        start.elapsed().as_secs_f64()
    );
    node.kubectl(&[
        "delete",
        "sandbox",
        "backend-local",
        "--wait=true",
        "--timeout=60s",
    ])
    .unwrap();
    workstation.token.clone()
}

/// Runs this checkout's `spur` on the host with the node's admin kubeconfig; its stdout.
fn node_spur(node: &Node, args: &[&str]) -> String {
    let out = std::process::Command::new(spur_bin("spur"))
        .args(args)
        .arg("--kubeconfig")
        .arg(&node.kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "spur {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn example(name: &str) -> String {
    let path = format!("{}/../docs/examples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Applies each file of docs/examples/ with what its comments say must exist first (namespace
/// `hotrod` with `route` and `frontend`), and checks the state its comments promise. The fork's
/// image is the one thing changed: the example's registry is not reachable here.
fn docs_examples_on_the_node(node: &Node) {
    let files: Vec<String> =
        std::fs::read_dir(format!("{}/../docs/examples", env!("CARGO_MANIFEST_DIR")))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
    let mut files = files;
    files.sort();
    assert_eq!(
        files,
        [
            "job.yaml",
            "jobrunnergroup.yaml",
            "quickstart-sandbox.yaml",
            "quickstart.yaml",
            "resourceplugin-postgres.yaml",
            "routegroup.yaml",
            "sandbox-local.yaml",
            "sandbox-resource.yaml",
            "sandbox.yaml"
        ],
        "a new example needs its check here (the resource examples: node_resources; the quickstart's: node_quickstart)"
    );
    node.apply(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: hotrod\n  labels:\n    sidecar.spur.dev/inject: \"true\"\n    spur.dev/enabled: \"true\"\n",
    )
    .unwrap();
    let route = demo_app("hotrod", "route", None).replace("- name: app\n", "- name: hotrod\n");
    node.apply(&route).unwrap();
    node.apply(&demo_app("hotrod", "frontend", Some("http://route:8080")))
        .unwrap();
    node.apply(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: route-pr-42\n  namespace: hotrod\ndata:\n  db-host: db.hotrod.svc\n",
    )
    .unwrap();
    node.rollout("hotrod", "route").unwrap();
    node.rollout("hotrod", "frontend").unwrap();

    let sandbox_yaml = example("sandbox.yaml").replace(
        "image: ghcr.io/acme/hotrod-route:pr-42",
        &format!("image: {}", spur_e2e::node::SPUR_IMAGE),
    );
    // Made with `spur sandbox apply --wait` in a terminal, as the docs tell a developer to.
    let key = node_cli::apply_ready_in_a_terminal(node, &sandbox_yaml, "route-pr-42");
    assert_eq!(sandbox_ready(node, "route-pr-42"), key, "the key in status");
    node_cli::route_explained(node, "route-pr-42", &key);
    let fork = fork_pod(node, "hotrod", "route-pr-42");
    let pod = node.get_json("hotrod", &["pod", &fork]).unwrap();
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["name"], "hotrod");
    assert_eq!(
        container["resources"]["limits"]["memory"], "256Mi",
        "the patch"
    );
    let env = container["env"].as_array().unwrap();
    let var = |n: &str| env.iter().find(|e| e["name"] == n).cloned();
    assert_eq!(var("ROUTE_CALC_DELAY").unwrap()["value"], "10ms");
    assert_eq!(
        var("DB_HOST").unwrap()["valueFrom"]["configMapKeyRef"]["name"],
        "route-pr-42"
    );
    let sbx = node
        .get_json("default", &["sandbox", "route-pr-42"])
        .unwrap();
    assert!(sbx["status"]["expiresAt"].is_string(), "{}", sbx["status"]);

    // The route group over the routing team's pull requests: its key reaches the fork.
    node.apply(&example("routegroup.yaml")).unwrap();
    let group_key = eventually("routing-team's key", Duration::from_secs(60), || {
        let g = node.get_json("default", &["routegroup", "routing-team"])?;
        let ready = condition(&g, "Ready") == Some("True");
        Ok(ready
            .then(|| g["status"]["routingKey"].as_str().map(String::from))
            .flatten())
    })
    .unwrap();
    let client = node.client_pod("hotrod").unwrap();
    for k in [&key, &group_key] {
        let a = until_answered_by(
            node,
            "hotrod",
            &client,
            "http://frontend.hotrod.svc:8080/",
            k,
            &fork,
        )
        .with_context(|| node.describe("hotrod"))
        .unwrap();
        assert_eq!(a.json["service"], "frontend");
    }

    // The runner group and the job: the job's request (the sandbox's key in baggage) is answered
    // by the fork, and its answer is kept as an artifact. The runners' image is the one thing
    // changed (no registry here).
    node.apply(&example("jobrunnergroup.yaml").replace(
        "image: docker.io/curlimages/curl:8.10.1",
        "image: localhost/spur-test-client:dev",
    ))
    .unwrap();
    let out = std::process::Command::new("timeout")
        .args(["-s", "KILL", "180"])
        .arg(spur_bin("spur"))
        .args(["job", "submit", "--attach", "-f"])
        .arg(format!(
            "{}/../docs/examples/job.yaml",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("SPUR_KUBECONFIG", &node.kubeconfig)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.describe("hotrod")
    );
    let answer = Answer {
        status: 200,
        json: serde_json::from_str(stdout.trim()).unwrap_or(Value::Null),
        body: stdout.to_string(),
    };
    assert_eq!(answer.answered_by(), Some(fork.as_str()), "{stdout}");
    // Found by its labels (Signadot's job `labels`), as `kubectl get jobs.spur.dev -l` finds it.
    let jobs = node
        .get_json("hotrod", &["jobs.spur.dev", "-l", "suite=smoke"])
        .unwrap();
    assert_eq!(jobs["items"].as_array().map(Vec::len), Some(1), "{jobs}");
    let none = node
        .get_json("hotrod", &["jobs.spur.dev", "-l", "suite=nightly"])
        .unwrap();
    assert_eq!(none["items"].as_array().map(Vec::len), Some(0), "{none}");
    let job = &jobs["items"][0];
    assert_eq!(
        job["status"]["artifacts"][0]["path"], "/tmp/answer.json",
        "{job}"
    );
    assert_eq!(job["status"]["artifacts"][0]["meta"]["kind"], "response");

    // The local sandbox, with no workstation connected: admitted, and not Ready, as its comments
    // say. Its workstation must have an owner first, the Sandbox's creator (the admin here): a
    // credential records it (docs/local.md, "Workstation owners").
    let admin = node_local::admin(node);
    node_spur(
        node,
        &[
            "local",
            "token",
            "--workstation",
            "alice",
            "--owner",
            &admin,
            "--owner-namespace",
            SPUR_NAMESPACE,
        ],
    );
    node.apply(&example("sandbox-local.yaml")).unwrap();
    eventually(
        "frontend-alice to say it is not Ready",
        Duration::from_secs(60),
        || {
            let s = node.get_json("default", &["sandbox", "frontend-alice"])?;
            let not_ready = condition(&s, "Ready") == Some("False");
            Ok((not_ready && s["status"]["local"][0]["connected"] != true).then_some(()))
        },
    )
    .unwrap();

    // A fork whose image does not exist: `--wait` says so with the kubelet's reason.
    node_cli::missing_image_fails(node);

    for (kind, name) in [
        ("routegroup", "routing-team"),
        ("sandbox", "frontend-alice"),
    ] {
        node.kubectl(&["delete", kind, name, "--wait=true", "--timeout=120s"])
            .unwrap();
    }
    node_cli::delete_gone(node, "route-pr-42");
    node.kubectl(&["delete", "namespace", "hotrod", "--wait=false"])
        .unwrap();
}

/// The status (`"True"`, `"False"`, ...) of condition `type_` of an object, if it has one.
fn condition<'a>(obj: &'a Value, type_: &str) -> Option<&'a str> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)?["status"]
        .as_str()
}

/// Sends requests with `key` from the `client` pod until one is answered by `pod` (new routes
/// take a moment to reach the sidecars), and returns that answer.
fn until_answered_by(
    node: &Node,
    ns: &str,
    client: &str,
    url: &str,
    key: &str,
    pod: &str,
) -> anyhow::Result<Answer> {
    eventually(
        &format!("a request with key {key} to be answered by {pod}"),
        Duration::from_secs(120),
        || {
            let a = try_get(node, ns, client, url, Some(key))?;
            Ok((a.answered_by() == Some(pod)).then_some(a))
        },
    )
}
