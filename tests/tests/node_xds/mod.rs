//! Proxyless gRPC on the node (docs/xds.md): a namespace labelled `spur.dev/xds=enabled` gets
//! its client Secret from the operator; grpc-go's own xDS client (tests/go-xds), run in a pod
//! with that Secret mounted and `GRPC_XDS_BOOTSTRAP` pointing at it, dials
//! `xds:///grpc-api.<ns>:8080` through the chart's route server over mutual TLS: without a key
//! the baseline pod answers, with a Sandbox's key (in baggage, or an OpenTracing header) the
//! fork pod answers, and once the Sandbox is deleted its key reaches the baseline again.

use std::time::Duration;

use anyhow::{Context, bail};
use spur_e2e::node::{CLIENT_IMAGE, Node, SPUR_IMAGE, eventually};

/// The demo gRPC server answering with its pod's name, and its Service.
fn grpc_app(ns: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: grpc-api
  namespace: {ns}
spec:
  replicas: 1
  selector:
    matchLabels: {{app: grpc-api}}
  template:
    metadata:
      labels: {{app: grpc-api}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
        - name: app
          image: {SPUR_IMAGE}
          imagePullPolicy: IfNotPresent
          args: [demo, serve, --kind, grpc, --name, $(POD_NAME), --listen, "0.0.0.0:8080"]
          env:
            - name: POD_NAME
              valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}
          ports:
            - {{name: grpc, containerPort: 8080}}
          readinessProbe:
            tcpSocket: {{port: grpc}}
            periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: grpc-api
  namespace: {ns}
spec:
  selector: {{app: grpc-api}}
  ports:
    - {{name: grpc, port: 8080, targetPort: grpc, appProtocol: grpc}}
"#
    )
}

/// A client pod with the namespace's xDS Secret mounted where its bootstrap expects it.
fn xds_client_pod(ns: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: xds-client
  namespace: {ns}
  annotations: {{sidecar.spur.dev/inject: "false"}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: {CLIENT_IMAGE}
      imagePullPolicy: Never
      env:
        - {{name: GRPC_XDS_BOOTSTRAP, value: /etc/spur/xds/bootstrap.json}}
      volumeMounts:
        - {{name: spur-xds, mountPath: /etc/spur/xds, readOnly: true}}
  volumes:
    - name: spur-xds
      secret: {{secretName: spur-xds}}
"#
    )
}

fn sandbox(ns: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata:
  name: grpc-xds
spec:
  description: proxyless gRPC through xDS
  forks:
    - forkOf: {{kind: Deployment, namespace: {ns}, name: grpc-api}}
"#
    )
}

/// One call per metadata set, by a fresh grpc-go xDS client in the client pod: who answered.
fn calls(node: &Node, ns: &str, metadata: &[&str]) -> anyhow::Result<Vec<String>> {
    let mut input = String::new();
    for m in metadata {
        input.push_str(format!("call {m}").trim_end());
        input.push('\n');
    }
    input.push_str("quit\n");
    let target = format!("xds:///grpc-api.{ns}:8080");
    let out = node.kubectl_input(
        &[
            "-n",
            ns,
            "exec",
            "-i",
            "xds-client",
            "--",
            "/tmp/xds-client",
            "-target",
            &target,
            "-timeout",
            "10s",
        ],
        &input,
    )?;
    let mut lines = out.lines();
    if lines.next() != Some("ready") {
        bail!("xds-client did not start: {out}");
    }
    lines
        .map(|l| {
            l.strip_prefix("ok served_by=")
                .and_then(|r| r.split(' ').next())
                .map(String::from)
                .with_context(|| format!("call failed: {l}"))
        })
        .collect()
}

pub(crate) fn proxyless_grpc_on_the_node(node: &Node) {
    let ns = node
        .namespace(
            "xds",
            &[("spur.dev/xds", "enabled"), ("spur.dev/enabled", "true")],
        )
        .unwrap();
    let ns = ns.name.as_str();
    node.apply(&grpc_app(ns)).unwrap();
    node.rollout(ns, "grpc-api").unwrap();
    let baseline = node.pods(ns, "app=grpc-api").unwrap();
    let [baseline] = baseline.as_slice() else {
        panic!("one baseline pod expected: {baseline:?}");
    };
    // The operator's Secret, then the client pod that mounts it.
    eventually(
        "the namespace's xDS client Secret",
        Duration::from_secs(60),
        || {
            let s = node.get_json(ns, &["secret", "spur-xds"]).ok();
            Ok(s.and_then(|s| s["data"]["bootstrap.json"].as_str().map(drop)))
        },
    )
    .unwrap();
    node.apply(&xds_client_pod(ns)).unwrap();
    node.kubectl(&[
        "-n",
        ns,
        "wait",
        "--for=condition=Ready",
        "pod/xds-client",
        "--timeout=120s",
    ])
    .with_context(|| node.describe(ns))
    .unwrap();
    let bin = spur_e2e::go_bin_dir().join("xds-client");
    node.kubectl(&[
        "-n",
        ns,
        "cp",
        &bin.display().to_string(),
        "xds-client:/tmp/xds-client",
    ])
    .unwrap();

    let answered = eventually(
        "the baseline answering through xDS",
        Duration::from_secs(60),
        || Ok(calls(node, ns, &[""]).ok()),
    )
    .unwrap();
    assert_eq!(answered, vec![baseline.clone()]);

    node.apply(&sandbox(ns)).unwrap();
    let key = super::sandbox_ready(node, "grpc-xds");
    let fork = super::fork_pod(node, ns, "grpc-xds");
    let keyed = [
        format!("baggage=sd-routing-key={key}"),
        format!("ot-baggage-sd-routing-key={key}"),
        String::new(),
    ];
    let keyed: Vec<&str> = keyed.iter().map(String::as_str).collect();
    eventually(
        "the sandbox's key reaching the fork through xDS",
        Duration::from_secs(60),
        || {
            let got = calls(node, ns, &keyed)?;
            Ok((got == [fork.as_str(), fork.as_str(), baseline.as_str()]).then_some(()))
        },
    )
    .with_context(|| format!("fork {fork}, baseline {baseline}"))
    .unwrap();

    node.kubectl(&[
        "delete",
        "sandbox",
        "grpc-xds",
        "--wait=true",
        "--timeout=120s",
    ])
    .unwrap();
    eventually(
        "the deleted sandbox's key reaching the baseline",
        Duration::from_secs(60),
        || {
            let got = calls(node, ns, &keyed[..1])?;
            Ok((got == [baseline.as_str()]).then_some(()))
        },
    )
    .unwrap();
    eprintln!("proxyless gRPC through xDS: key {key} reached fork {fork}, others {baseline}");

    another_namespace_cannot_take_over_its_xds_clients(node, ns, baseline);
}

/// An EnvoyConfig for `node_id` in namespace `ns` whose listener for `grpc-api.<target_ns>:8080`
/// leads to a cluster whose one endpoint refuses connections: served to a client, its calls fail.
fn dead_end_config(ns: &str, name: &str, node_id: &str, target_ns: &str) -> String {
    let listener_name = format!("grpc-api.{target_ns}:8080");
    let listener = serde_json::json!({
        "name": listener_name,
        "api_listener": {"api_listener": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "rds": {"config_source": {"ads": {}, "resource_api_version": "V3"},
                    "route_config_name": "dead-end"},
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }},
    });
    let route = serde_json::json!({
        "name": "dead-end",
        "virtual_hosts": [{"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": ""}, "route": {"cluster": "dead-end"}}]}],
    });
    let cluster = serde_json::json!({
        "name": "dead-end", "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
    });
    let endpoints = serde_json::json!({
        "cluster_name": "dead-end",
        "endpoints": [{"locality": {}, "lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": 1}}}}]}],
    });
    let config = serde_json::json!({
        "apiVersion": "spur.dev/v1alpha1",
        "kind": "EnvoyConfig",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeID": node_id, "resources": [
            {"type": "listener", "value": listener.to_string()},
            {"type": "route", "value": route.to_string()},
            {"type": "cluster", "value": cluster.to_string()},
            {"type": "endpoint", "value": endpoints.to_string()},
        ]},
    });
    config.to_string()
}

/// Waits until EnvoyConfig `ns/name` is published (`InSync` true).
fn until_published(node: &Node, ns: &str, name: &str) {
    eventually(
        &format!("EnvoyConfig {ns}/{name} published"),
        Duration::from_secs(60),
        || {
            let c = node.get_json(ns, &["envoyconfig", name])?;
            let in_sync = c["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "InSync" && c["status"] == "True");
            Ok(in_sync.then_some(()))
        },
    )
    .with_context(|| node.describe(ns))
    .unwrap();
}

/// Node ids are not a tenancy boundary, namespaces are (issue 42, point 4): a user who may write
/// EnvoyConfigs only in their own namespace gives the node id of `ns`'s xDS clients a listener
/// for `grpc-api` that leads nowhere; `ns`'s clients keep reaching the baseline. The control: the
/// same config written in `ns` itself (by the admin) does take those clients over, so the first
/// result is the route server's namespace check and not a config that would never apply; and
/// since the route server serves whole snapshots, once the control is in force the tenant's
/// older config is loaded too.
fn another_namespace_cannot_take_over_its_xds_clients(node: &Node, ns: &str, baseline: &str) {
    let tenant_ns = node
        .namespace("xds-tenant", &[("spur.dev/enabled", "true")])
        .unwrap();
    let tenant_ns = tenant_ns.name.as_str();
    const TENANT: &str = "eve@xds-tenant";
    node.apply(&format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: envoy-writer, namespace: {tenant_ns}}}
rules:
  - apiGroups: [spur.dev]
    resources: [envoyconfigs]
    verbs: [create, get, list, update, patch, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: eve-envoy-writer, namespace: {tenant_ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: envoy-writer}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: "{TENANT}"}}]
"#
    ))
    .unwrap();
    let node_id = format!("{ns}/spur-xds-client");
    let as_tenant = format!("--as={TENANT}");
    // The tenant cannot write in `ns` (RBAC), but may name `ns`'s node id in their own.
    let (code, out) = node
        .kubectl_status(&[
            "auth",
            "can-i",
            "create",
            "envoyconfigs",
            "-n",
            ns,
            &as_tenant,
        ])
        .unwrap();
    assert_ne!(
        code,
        Some(0),
        "the tenant may not write EnvoyConfigs in {ns}: {out}"
    );
    eventually(
        "the tenant's EnvoyConfig naming another namespace's node id",
        Duration::from_secs(60),
        || {
            node.kubectl_stdin(
                &["apply", &as_tenant],
                &dead_end_config(tenant_ns, "takeover", &node_id, ns),
            )
            .map(Some)
        },
    )
    .unwrap();
    until_published(node, tenant_ns, "takeover");

    // The control, in `ns` itself: its clients' calls now fail.
    node.apply(&dead_end_config(ns, "own-dead-end", &node_id, ns))
        .unwrap();
    until_published(node, ns, "own-dead-end");
    eventually(
        "the namespace's own EnvoyConfig taking its clients over",
        Duration::from_secs(60),
        || Ok(calls(node, ns, &[""]).is_err().then_some(())),
    )
    .unwrap();
    node.kubectl(&[
        "-n",
        ns,
        "delete",
        "envoyconfig",
        "own-dead-end",
        "--wait=true",
    ])
    .unwrap();

    // With the tenant's config still published, `ns`'s clients reach the baseline again and
    // keep doing so.
    eventually(
        "the baseline again once the namespace's own config is gone",
        Duration::from_secs(60),
        || {
            Ok(calls(node, ns, &[""])
                .ok()
                .filter(|got| got == &[baseline])
                .map(drop))
        },
    )
    .unwrap();
    until_published(node, tenant_ns, "takeover");
    for _ in 0..3 {
        assert_eq!(
            calls(node, ns, &["", ""]).unwrap(),
            [baseline, baseline],
            "the tenant's EnvoyConfig (namespace {tenant_ns}, node id {node_id}) reached {ns}'s clients"
        );
        std::thread::sleep(Duration::from_secs(2));
    }
    eprintln!(
        "xDS tenancy: an EnvoyConfig of {tenant_ns} for node id {node_id} did not reach {ns}'s clients"
    );
}
