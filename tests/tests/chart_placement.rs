//! Every component the chart runs with more than one replica survives a node drain and a node's
//! loss (issue 47, point 2): a PodDisruptionBudget lets a drain take one replica at a time, and
//! the replicas spread over nodes (a preferred pod anti-affinity, or a user's own constraints).
//! Checked over every Deployment and StatefulSet the chart renders, with the defaults and with
//! everything optional turned on, so a component added later is held to it too; a component
//! scaled to one replica has no budget (it would block every drain and protect nothing), and a
//! user's own constraints replace the chart's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use spur_e2e::kube::helm_template;

/// Everything optional that runs pods of its own.
const ALL_ON: &[&str] = &[
    "--set",
    "agent.enabled=true",
    "--set",
    "agent.hub=hub.example:7443",
    "--set",
    "agent.hubCA=not-checked-by-the-chart",
    "--set",
    "hub.enabled=true",
    "--set",
    "hub.previewDomain=preview.example",
    "--set",
    "gateway.enabled=true",
    "--set",
    "jobs.enabled=true",
    "--set",
    "traffic.enabled=true",
    "--set",
    "resources.ics.replicas=2",
    "--set",
    "jobs.replicas=2",
    "--set",
    "jobs.s3.bucket=spur-jobs",
    "--set",
    "hub.replicas=2",
    "--set",
    "hub.database.url=postgres://hub@db.example:5432/hub",
    "--set",
    "hub.database.passwordSecret=hub-db",
];

fn workloads(objects: &[Value]) -> impl Iterator<Item = &Value> {
    objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
}

/// The budgets whose selector picks `workload`'s pods.
fn budgets<'a>(objects: &'a [Value], workload: &Value) -> Vec<&'a Value> {
    let labels = &workload["spec"]["template"]["metadata"]["labels"];
    objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
        .filter(|o| o["metadata"]["namespace"] == workload["metadata"]["namespace"])
        .filter(|o| {
            o["spec"]["selector"]["matchLabels"]
                .as_object()
                .is_some_and(|m| m.iter().all(|(k, v)| labels[k] == *v))
        })
        .collect()
}

/// Whether the pods spread over nodes: a topology spread constraint or a pod anti-affinity on
/// the hostname, selecting the workload's own pods.
fn spreads_over_nodes(workload: &Value) -> bool {
    let spec = &workload["spec"]["template"]["spec"];
    let name = &workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"];
    let on_nodes = |t: &Value| {
        t["topologyKey"] == "kubernetes.io/hostname"
            && t["labelSelector"]["matchLabels"]["app.kubernetes.io/name"] == *name
    };
    let spread = spec["topologySpreadConstraints"]
        .as_array()
        .is_some_and(|c| c.iter().any(on_nodes));
    let anti = &spec["affinity"]["podAntiAffinity"];
    let required = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .is_some_and(|c| c.iter().any(on_nodes));
    let preferred = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .is_some_and(|c| c.iter().any(|p| on_nodes(&p["podAffinityTerm"])));
    spread || required || preferred
}

fn id(w: &Value) -> String {
    format!(
        "{} {}/{}",
        w["kind"].as_str().unwrap_or(""),
        w["metadata"]["namespace"].as_str().unwrap_or(""),
        w["metadata"]["name"].as_str().unwrap_or("")
    )
}

#[tokio::test]
async fn every_replicated_component_has_a_budget_and_spreads_over_nodes() {
    for args in [&[][..], ALL_ON] {
        let objects = helm_template(args).await.unwrap();
        let mut replicated = Vec::new();
        for w in workloads(&objects) {
            let replicas = w["spec"]["replicas"].as_i64().unwrap_or(1);
            let found = budgets(&objects, w);
            if replicas > 1 {
                replicated.push(id(w));
                assert_eq!(
                    found.len(),
                    1,
                    "{} ({replicas} replicas): budgets {found:?}",
                    id(w)
                );
                assert_eq!(found[0]["spec"]["maxUnavailable"], 1, "{}", id(w));
                assert!(
                    spreads_over_nodes(w),
                    "{} ({replicas} replicas) does not spread over nodes: {}",
                    id(w),
                    w["spec"]["template"]["spec"]
                );
            } else {
                assert!(
                    found.is_empty(),
                    "{} (one replica) has a budget, which would block drains: {found:?}",
                    id(w)
                );
            }
        }
        // The defaults run these with two replicas each; the check above is not vacuous.
        let mut expected = vec!["spur-operator", "spur-routeserver", "spur-tunnel-proxy"];
        if args == ALL_ON {
            expected.extend([
                "spur-gateway",
                "spur-ics",
                "spur-agent",
                "spur-jobs",
                "spur-hub",
            ]);
        }
        for name in expected {
            assert!(
                replicated.iter().any(|r| r.ends_with(&format!("/{name}"))),
                "{name} not replicated ({args:?}): {replicated:?}"
            );
        }
    }
}

#[tokio::test]
async fn one_replica_has_no_budget_and_a_users_placement_replaces_the_charts() {
    let objects = helm_template(&[
        "--set",
        "operator.replicas=1",
        "--set",
        "routeserver.topologySpreadConstraints[0].maxSkew=1",
        "--set",
        "routeserver.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "--set",
        "routeserver.topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
        "--set",
        "routeserver.topologySpreadConstraints[0].labelSelector.matchLabels.app\\.kubernetes\\.io/name=spur-routeserver",
        "--set",
        "routeserver.nodeSelector.pool=system",
        "--set",
        "routeserver.tolerations[0].key=dedicated",
        "--set",
        "routeserver.tolerations[0].operator=Exists",
    ])
    .await
    .unwrap();
    let find = |name: &str| {
        workloads(&objects)
            .find(|w| w["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert!(budgets(&objects, find("spur-operator")).is_empty());
    let rs = &find("spur-routeserver")["spec"]["template"]["spec"];
    let constraints = rs["topologySpreadConstraints"].as_array().unwrap();
    assert_eq!(constraints.len(), 1, "{constraints:?}");
    assert_eq!(constraints[0]["whenUnsatisfiable"], "DoNotSchedule");
    assert_eq!(rs["nodeSelector"]["pool"], "system");
    assert_eq!(rs["tolerations"][0]["key"], "dedicated");
    // The others keep the chart's placement: a preferred anti-affinity over nodes, and no
    // constraints of their own, so the scheduler's default spread (nodes and zones) applies.
    let tp = &find("spur-tunnel-proxy")["spec"]["template"]["spec"];
    assert!(tp.get("topologySpreadConstraints").is_none(), "{tp}");
    assert!(tp.get("nodeSelector").is_none(), "{tp}");
    assert!(spreads_over_nodes(find("spur-tunnel-proxy")), "{tp}");
    // A user's affinity replaces the chart's.
    let objects = helm_template(&[
        "--set",
        "tunnelProxy.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
        "--set",
        "tunnelProxy.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    ])
    .await
    .unwrap();
    let tp = workloads(&objects)
        .find(|w| w["metadata"]["name"] == "spur-tunnel-proxy")
        .unwrap();
    let affinity = &tp["spec"]["template"]["spec"]["affinity"];
    assert!(affinity.get("podAntiAffinity").is_none(), "{affinity}");
    assert!(affinity.get("nodeAffinity").is_some(), "{affinity}");
}

/// Two jobs replicas each have their own volume: without a bucket every replica but the leader
/// would serve no sealed log, so the chart refuses it, saying what to set.
#[tokio::test]
async fn two_jobs_replicas_need_a_bucket() {
    let err = helm_template(&["--set", "jobs.replicas=2"])
        .await
        .expect_err("jobs.replicas=2 without jobs.s3.bucket rendered");
    assert!(
        format!("{err:#}").contains("needs jobs.s3.bucket"),
        "{err:#}"
    );
    let err = helm_template(&["--set", "jobs.replicas=0"])
        .await
        .expect_err("jobs.replicas=0 rendered");
    assert!(format!("{err:#}").contains("replicas"), "{err:#}");
}

/// Hub replicas share their registry in PostgreSQL (issue 47, point 2): more than one needs a
/// database; with one, the hub reads it from the env (so `kubectl exec … spur-hub cluster add`
/// does too), its password from the Secret as a file, its CA from the chart's ConfigMap, and
/// keeps no claim; the headless Service lists every replica for agents.
#[tokio::test]
async fn hub_replicas_share_a_database() {
    let err = helm_template(&[
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=preview.example",
        "--set",
        "hub.replicas=2",
    ])
    .await
    .expect_err("two hub replicas on SQLite rendered");
    assert!(
        format!("{err:#}").contains("needs hub.database.url"),
        "{err:#}"
    );
    let err = helm_template(&[
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=preview.example",
        "--set",
        "hub.database.url=postgres://db.example/hub",
    ])
    .await
    .expect_err("a database without a password rendered");
    assert!(format!("{err:#}").contains("passwordSecret"), "{err:#}");
    let err = helm_template(&[
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=preview.example",
        "--set",
        "hub.database.url=postgres://hub:s3cret@db.example/hub",
        "--set",
        "hub.database.passwordSecret=hub-db",
    ])
    .await
    .expect_err("a password in the URL rendered into the pod spec");
    assert!(format!("{err:#}").contains("holds a password"), "{err:#}");

    let objects = helm_template(&[
        "--set",
        "hub.enabled=true",
        "--set",
        "hub.previewDomain=preview.example",
        "--set",
        "hub.replicas=3",
        "--set",
        "hub.database.url=postgres://hub@db.example:5432/hub",
        "--set",
        "hub.database.passwordSecret=hub-db",
        "--set",
        "hub.database.ca=-----BEGIN CERTIFICATE-----",
    ])
    .await
    .unwrap();
    let hub = workloads(&objects)
        .find(|w| w["metadata"]["name"] == "spur-hub")
        .unwrap();
    assert_eq!(hub["spec"]["replicas"], 3);
    assert!(hub["spec"].get("volumeClaimTemplates").is_none(), "{hub}");
    let pod = &hub["spec"]["template"]["spec"];
    let env = &pod["containers"][0]["env"];
    let var = |name: &str| {
        env.as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        var("SPUR_HUB_DATABASE_URL").unwrap(),
        "postgres://hub@db.example:5432/hub"
    );
    assert_eq!(
        var("SPUR_HUB_DATABASE_PASSWORD_FILE").unwrap(),
        "/etc/spur/hub-database/password"
    );
    assert_eq!(
        var("SPUR_HUB_DATABASE_CA").unwrap(),
        "/etc/spur/hub-database-ca/ca.crt"
    );
    assert!(var("SPUR_HUB_DATABASE_INSECURE_PLAINTEXT").is_none());
    let volumes = pod["volumes"].as_array().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v["secret"]["secretName"] == "hub-db"),
        "{volumes:?}"
    );
    assert!(
        volumes
            .iter()
            .any(|v| v["configMap"]["name"] == "spur-hub-database-ca"),
        "{volumes:?}"
    );
    let headless = objects
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "spur-hub-replicas")
        .expect("no spur-hub-replicas Service");
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(budgets(&objects, hub).len(), 1);
}
