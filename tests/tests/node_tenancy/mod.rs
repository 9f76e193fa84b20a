//! Tenancy on the node (issue 42): a user whose rights are those of the built-in `edit` role in
//! namespace `tenant-a` only (plus creating Sandboxes, which are cluster-scoped) tries to reach
//! through Spur into what is not theirs, against the chart as installed (its webhooks, admission
//! policies and RBAC), and fails each time, while the same request aimed at their own namespace
//! is admitted (a server-side dry run), so the refusals are Spur's checks and not a lack of
//! rights.
//!
//! Elsewhere on the node: another namespace's EnvoyConfig naming a namespace's xDS node id
//! does not reach its grpc-go clients (node_xds), and hub users acting as this tenant read no
//! captured traffic of another namespace through the hub (node.rs,
//! `hub_users_of_another_namespace_read_nothing`). The apiserver tier goes deeper: xDS keyed by
//! namespace (kube_xds.rs, kube_envoyconfig.rs), traffic reads per user (kube_traffic.rs,
//! kube_hub_scopes.rs).

use spur_e2e::node::Node;

/// The tenant's namespace and username.
const TENANT_NS: &str = "tenant-a";
const TENANT: &str = "mallory@tenant-a";

/// Creates the tenant: `edit` in [`TENANT_NS`], Sandboxes and RouteGroups cluster-wide.
fn tenant(node: &Node) {
    node.apply(&format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {TENANT_NS}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: mallory-edit, namespace: {TENANT_NS}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: edit}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: "{TENANT}"}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: tenant-sandboxes}}
rules:
  - apiGroups: [spur.dev]
    resources: [sandboxes, routegroups]
    # patch: `spur sandbox apply` is a server-side apply.
    verbs: [create, get, list, delete, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: tenant-sandboxes}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: tenant-sandboxes}}
subjects: [{{apiGroup: rbac.authorization.k8s.io, kind: User, name: "{TENANT}"}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: app, namespace: {TENANT_NS}}}
spec:
  replicas: 0
  selector: {{matchLabels: {{app: app}}}}
  template:
    metadata: {{labels: {{app: app}}}}
    spec:
      containers: [{{name: app, image: "tenant/app:1"}}]
---
apiVersion: v1
kind: Service
metadata: {{name: app, namespace: {TENANT_NS}}}
spec:
  selector: {{app: app}}
  ports: [{{port: 80}}]
"#
    ))
    .unwrap();
}

/// A Sandbox of the tenant: a fork of `tenant-a/app` plus `extra` spec fields (YAML flow).
fn tenant_sandbox(name: &str, extra: &str) -> String {
    format!(
        r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata: {{name: {name}}}
spec:
  forks: [{{forkOf: {{kind: Deployment, namespace: {TENANT_NS}, name: app}}}}]
  {extra}
"#
    )
}

/// The admin's kubeconfig acting as the tenant (impersonation, as `kubectl --as` does).
fn tenant_kubeconfig(node: &Node) -> tempfile::NamedTempFile {
    let text = std::fs::read_to_string(&node.kubeconfig).unwrap();
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    for user in config["users"].as_array_mut().unwrap() {
        user["user"]["as"] = TENANT.into();
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), serde_yaml_ng::to_string(&config).unwrap()).unwrap();
    file
}

/// Creates `yaml` as the tenant; `Ok` if admitted, the refusal's text if not.
fn as_tenant(node: &Node, yaml: &str, dry_run: bool) -> Result<(), String> {
    let user = format!("--as={TENANT}");
    let mut args = vec!["create", user.as_str()];
    if dry_run {
        args.push("--dry-run=server");
    }
    node.kubectl_stdin(&args, yaml)
        .map(|_| ())
        .map_err(|e| format!("{e:#}"))
}

/// The tenant's attempts. `workstation` is another user's (the admin's) workstation, `other_ns`
/// a namespace with a Service `other_svc` the tenant has no rights in.
pub(crate) fn a_tenant_cannot_reach_through(
    node: &Node,
    workstation: &str,
    other_ns: &str,
    other_svc: &str,
) {
    tenant(node);
    let refused =
        |what: &str, yaml: &str, expect: &str| {
            // The RBAC objects just made may take a moment to be in force; a refusal for the
            // expected reason is final.
            let message =
                spur_e2e::node::eventually(what, std::time::Duration::from_secs(60), || {
                    match as_tenant(node, yaml, false) {
                        Ok(()) => anyhow::bail!("{what}: admitted"),
                        Err(m) if m.contains(expect) => Ok(Some(m)),
                        Err(m) => anyhow::bail!("{what}: refused for another reason: {m}"),
                    }
                })
                .unwrap();
            eprintln!(
                "tenant refused as expected ({what}): {}",
                message.lines().last().unwrap_or("")
            );
        };

    // The control: a Sandbox with a preview of the tenant's own Service is admitted.
    spur_e2e::node::eventually(
        "the tenant's own preview to be admitted (dry run)",
        std::time::Duration::from_secs(60),
        || {
            as_tenant(
                node,
                &tenant_sandbox(
                    "tenant-own",
                    &format!(
                        "defaultRouteGroup: {{endpoints: [{{name: web, target: \"http://app.{TENANT_NS}.svc:80\"}}]}}"
                    ),
                ),
                true,
            )
            .map(Some)
            .map_err(|m| anyhow::anyhow!("{m}"))
        },
    )
    .unwrap();

    // 1. Another user's workstation: no Sandbox of the tenant may name it, so no key of theirs
    //    and no `toLocal` of theirs ever reaches that laptop.
    refused(
        "a Sandbox naming another user's workstation",
        &format!(
            r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata: {{name: tenant-ws}}
spec:
  workstation: {workstation}
  local:
    - name: grab
      from: {{kind: Deployment, namespace: {TENANT_NS}, name: app}}
      mappings: [{{port: 80, toLocal: "169.254.169.254:80"}}]
"#
        ),
        "belongs to another user",
    );

    // 2. A preview of a namespace the tenant cannot reach.
    refused(
        "a preview of another namespace's Service",
        &tenant_sandbox(
            "tenant-preview",
            &format!(
                "defaultRouteGroup: {{endpoints: [{{name: web, target: \"http://{other_svc}.{other_ns}.svc:80\"}}]}}"
            ),
        ),
        "services/proxy",
    );
    // 3. A preview through another registered cluster.
    refused(
        "a preview through a cluster the tenant may not use",
        &tenant_sandbox(
            "tenant-cluster",
            &format!(
                "defaultRouteGroup: {{endpoints: [{{name: web, cluster: elsewhere, target: \"http://app.{TENANT_NS}.svc:80\"}}]}}"
            ),
        ),
        "clusters.spur.dev",
    );
    // 4. A public preview needs its own right.
    refused(
        "a public preview",
        &tenant_sandbox(
            "tenant-public",
            &format!(
                "defaultRouteGroup: {{endpoints: [{{name: web, public: true, target: \"http://app.{TENANT_NS}.svc:80\"}}]}}"
            ),
        ),
        "public",
    );
    // 5. Another namespace's Envoy: its EnvoyConfigs are out of reach (and a config of the
    //    tenant's own namespace is served only to Envoys with a certificate of that namespace,
    //    whatever node id it names: tests/tests/kube_xds.rs).
    refused(
        "an EnvoyConfig in another namespace",
        &format!(
            r#"apiVersion: spur.dev/v1alpha1
kind: EnvoyConfig
metadata: {{name: takeover, namespace: {other_ns}}}
spec: {{nodeID: edge-1, serialization: yaml, envoyResources: {{}}}}
"#
        ),
        "forbidden",
    );
    // 6. A fork of another namespace's workload (the creator-rights policy).
    refused(
        "a fork of another namespace's workload",
        &format!(
            r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata: {{name: tenant-fork}}
spec:
  forks: [{{forkOf: {{kind: Deployment, namespace: {other_ns}, name: {other_svc}}}}}]
"#
        ),
        other_ns,
    );
    // 7. The same fork through `spur sandbox apply`, which acts with the tenant's own
    //    credentials: the same refusal, printed, exit 1.
    let kubeconfig = tenant_kubeconfig(node);
    let ran = crate::node_cli::spur_with(
        kubeconfig.path(),
        &["sandbox", "apply", "-f", "-", "--wait"],
        &format!(
            r#"apiVersion: spur.dev/v1alpha1
kind: Sandbox
metadata: {{name: tenant-cli-fork}}
spec:
  forks: [{{forkOf: {{kind: Deployment, namespace: {other_ns}, name: {other_svc}}}}}]
"#
        ),
        std::time::Duration::from_secs(60),
    );
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("applying Sandbox tenant-cli-fork") && ran.stderr.contains(other_ns),
        "{}",
        ran.stderr
    );
    // 8. `spur route explain` reads another namespace's Service and pods only with rights the
    //    tenant does not have: refused, nothing of it shown.
    let ran = crate::node_cli::spur_with(
        kubeconfig.path(),
        &[
            "route",
            "explain",
            "--key",
            "k",
            &format!("{other_svc}.{other_ns}"),
        ],
        "",
        std::time::Duration::from_secs(60),
    );
    assert_eq!(ran.code, Some(1), "{}", ran.stdout);
    assert!(
        ran.stderr.contains("forbidden") && !ran.stdout.contains("Baseline pods"),
        "{}{}",
        ran.stdout,
        ran.stderr
    );
    // 9. `spur doctor propagation` reads the sidecars and sends through the API server's
    //    service proxy with the tenant's own rights, checked before anything is sent: refused
    //    (listing the namespace's pods), nothing sent or shown.
    let ran = crate::node_cli::spur_with(
        kubeconfig.path(),
        &[
            "doctor",
            "propagation",
            "--key",
            "k",
            &format!("svc/{other_svc}.{other_ns}:8080/"),
        ],
        "",
        std::time::Duration::from_secs(60),
    );
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stderr.contains(&format!(
            "listing the pods of namespace {other_ns}: forbidden"
        )) && ran.stdout.is_empty(),
        "{}{}",
        ran.stdout,
        ran.stderr
    );
    // 10. `spur sandbox apply --local` for the admin's workstation: no certificate, no
    //     Sandbox.
    crate::node_local::apply_local::another_users_workstation_is_refused(
        node,
        TENANT,
        kubeconfig.path(),
        other_ns,
    );
    // Nothing of the tenant's was created.
    let left = node.kubectl(&["get", "sandboxes", "-o", "name"]).unwrap();
    assert!(!left.contains("tenant-"), "{left}");
    node.kubectl(&["delete", "namespace", TENANT_NS, "--wait=false"])
        .unwrap();
    node.kubectl(&[
        "delete",
        "clusterrolebinding,clusterrole",
        "tenant-sandboxes",
        "--ignore-not-found",
    ])
    .unwrap();
}
