//! UDP listeners from a ListenerSet on the node (docs/l4.md): a `spur gateway` pod gets its
//! listener from the chart's route server (authenticated by its projected token), the operator
//! keeps the Service clients dial and resolves the worker pods through a headless Service, and
//! UDP sessions from a client pod's network namespace, each from a new source port, land on
//! the worker their first bytes hash to: spread evenly over three workers, the same worker on
//! every try, and only about a quarter moving when a fourth worker starts.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use spur_e2e::node::{Node, SPUR_IMAGE, eventually, spur_bin};

const SESSIONS: u32 = 1000;

fn workloads(ns: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: spur-gateway, namespace: {ns}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: spur-gateway, namespace: {ns}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: spur-gateway}}}}
  template:
    metadata:
      labels: {{app: spur-gateway}}
      annotations: {{sidecar.spur.dev/inject: "false"}}
    spec:
      serviceAccountName: spur-gateway
      terminationGracePeriodSeconds: 5
      containers:
        - name: gateway
          image: {SPUR_IMAGE}
          imagePullPolicy: IfNotPresent
          args: [gateway]
          env:
            - {{name: SPUR_ROUTE_SERVER, value: "spur-routeserver.{spur}.svc:7777"}}
            - {{name: SPUR_ROUTE_SERVER_CA, value: /var/run/spur/routeserver-ca/ca.crt}}
            - {{name: SPUR_TOKEN_FILE, value: /var/run/spur/routeserver-token/token}}
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
            - name: POD_NAMESPACE
              valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}
          ports:
            - {{name: admin, containerPort: 15021}}
          readinessProbe:
            httpGet: {{path: /ready, port: admin}}
            periodSeconds: 1
          securityContext:
            runAsNonRoot: true
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {{drop: [ALL]}}
          volumeMounts:
            - {{name: routeserver-ca, mountPath: /var/run/spur/routeserver-ca, readOnly: true}}
            - {{name: routeserver-token, mountPath: /var/run/spur/routeserver-token, readOnly: true}}
      volumes:
        - name: routeserver-ca
          configMap: {{name: spur-ca-bundle, items: [{{key: ca.crt, path: ca.crt}}]}}
        - name: routeserver-token
          projected:
            sources: [{{serviceAccountToken: {{audience: spur-routeserver, expirationSeconds: 3600, path: token}}}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: udp-worker, namespace: {ns}}}
spec:
  replicas: 3
  selector: {{matchLabels: {{app: udp-worker}}}}
  template:
    metadata:
      labels: {{app: udp-worker}}
      annotations: {{sidecar.spur.dev/inject: "false"}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: worker
          image: {SPUR_IMAGE}
          imagePullPolicy: IfNotPresent
          args: [demo, serve, --kind, udp, --name, $(POD_NAME), --listen, "0.0.0.0:5004"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          readinessProbe:
            tcpSocket: {{port: 5004}}
            periodSeconds: 1
---
apiVersion: spur.dev/v1alpha1
kind: ListenerSet
metadata: {{name: media, namespace: {ns}}}
spec:
  selector: {{matchLabels: {{app: spur-gateway}}}}
  listeners:
    - name: rtp
      protocol: udp
      port: 5004
      cluster:
        name: workers
        endpoints:
          - {{selector: {{matchLabels: {{app: udp-worker}}}}, port: 5004, healthCheckPort: 5004}}
        lb: maglev
        hashKey: {{firstBytes: {{offset: 0, length: 8}}}}
        healthCheck: {{protocol: tcp, interval: 1s, timeout: 500ms}}
        # Short, so the probe's batches (with pauses longer than two of these) never meet a
        # session of an earlier batch on a source port the system hands out again.
        idleTimeout: 1s
"#,
        spur = super::SPUR_NAMESPACE,
    )
}

/// Who answered each of `SESSIONS` sessions, by session number, sent from the client pod's
/// network namespace with this checkout's `spur` (the image's build).
fn probe(node: &Node, ns: &str, target: &str) -> anyhow::Result<BTreeMap<u32, String>> {
    let spur = spur_bin("spur");
    let sessions = SESSIONS.to_string();
    let out = node.in_pod_netns(
        ns,
        "client",
        "client",
        &[
            &spur.display().to_string(),
            "demo",
            "udp-probe",
            "--target",
            target,
            "--sessions",
            &sessions,
            "--timeout",
            "2s",
            "--batch",
            "200",
            "--pause",
            "2500ms",
        ],
    )?;
    let mut answers = BTreeMap::new();
    for line in out.lines() {
        let Some((n, who)) = line.split_once(' ') else {
            bail!("probe said {line:?}");
        };
        if who.starts_with("error") {
            bail!("session {n}: {who}");
        }
        answers.insert(n.parse()?, who.to_owned());
    }
    if answers.len() != SESSIONS as usize {
        bail!("{} answers of {SESSIONS}:\n{out}", answers.len());
    }
    Ok(answers)
}

fn spread(answers: &BTreeMap<u32, String>) -> BTreeMap<String, u32> {
    let mut by: BTreeMap<String, u32> = BTreeMap::new();
    for who in answers.values() {
        *by.entry(who.clone()).or_default() += 1;
    }
    by
}

pub(crate) fn udp_listeners_on_the_node(node: &Node) {
    let ns = node.namespace("l4", &[]).unwrap();
    let ns = ns.name.as_str();
    // The route server's CA bundle, as the injection webhook would have copied it here.
    let bundle = node
        .get_json(super::SPUR_NAMESPACE, &["configmap", "spur-ca-bundle"])
        .unwrap();
    let ca = bundle["data"]["ca.crt"].as_str().unwrap().to_owned();
    node.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: spur-ca-bundle, namespace: {ns}}}\ndata:\n  ca.crt: {}\n",
        serde_json::Value::String(ca)
    ))
    .unwrap();
    node.apply(&workloads(ns)).unwrap();
    node.rollout(ns, "udp-worker").unwrap();
    node.rollout(ns, "spur-gateway")
        .with_context(|| node.describe(ns))
        .unwrap();
    let workers = node.pods(ns, "app=udp-worker").unwrap();
    assert_eq!(workers.len(), 3, "{workers:?}");
    node.client_pod(ns).unwrap();

    // The operator's Service for the listener, and the gateway's health report in status.
    let service = node.get_json(ns, &["service", "media"]).unwrap();
    let ip = service["spec"]["clusterIP"].as_str().unwrap().to_owned();
    assert_eq!(
        service["spec"]["ports"][0]["protocol"], "UDP",
        "{service:#}"
    );
    let target = format!("{ip}:5004");
    eventually(
        "every worker healthy in the gateway's report",
        Duration::from_secs(60),
        || {
            let Ok(set) = node.get_json(ns, &["listenerset", "media"]) else {
                return Ok(None);
            };
            let healthy = set["status"]["gateways"][0]["endpoints"]
                .as_array()
                .map_or(0, |e| e.iter().filter(|e| e["healthy"] == true).count());
            Ok((healthy == 3).then_some(()))
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap();

    // 1000 sessions: spread within ±15 % of a third each, and each session (a new source port
    // every time) answered by the same worker again.
    let first = eventually("1000 sessions answered", Duration::from_secs(90), || {
        probe(node, ns, &target).map(Some)
    })
    .unwrap();
    let by = spread(&first);
    assert_eq!(by.len(), 3, "{by:?}");
    for (who, n) in &by {
        assert!(
            (283..=383).contains(n),
            "{who} got {n} of {SESSIONS} sessions: {by:?}"
        );
    }
    std::thread::sleep(Duration::from_millis(2500));
    let again = probe(node, ns, &target).unwrap();
    assert_eq!(again, first, "a session's worker changed between tries");

    // A fourth worker: about a quarter of the sessions move (Maglev's table moves a few more
    // than the ideal 1/4 between old workers).
    node.kubectl(&["-n", ns, "scale", "deployment/udp-worker", "--replicas=4"])
        .unwrap();
    node.rollout(ns, "udp-worker").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    let after = eventually(
        "sessions reaching the fourth worker",
        Duration::from_secs(90),
        || {
            let got = probe(node, ns, &target)?;
            Ok((spread(&got).len() == 4).then_some(got))
        },
    )
    .unwrap();
    let moved = first
        .iter()
        .filter(|(n, who)| after.get(n) != Some(*who))
        .count();
    assert!(
        moved <= 300,
        "{moved} of {SESSIONS} sessions moved from 3 to 4 workers: {:?}",
        spread(&after)
    );
}
