//! Helpers for the tests on a real kube-apiserver: clients that run under exactly the chart's
//! RBAC rules, so a permission the chart lacks fails the suite.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;
use spur_kube_harness::KubeApi;

/// Everything the components logged in this test process (see [`capture_logs`]).
static LOGS: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

/// A writer appending to [`LOGS`].
struct Captured;

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut logs) = LOGS.lock() {
            logs.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends the components' logs (`RUST_LOG`; default: every `spur*` target at debug, the rest at
/// warn) to the test harness, which shows a test's logs only when it fails, and keeps a copy
/// that [`assert_no_secret_logged`] scans: secrets must not appear even at debug level.
pub fn capture_logs() {
    use tracing_subscriber::fmt::writer::MakeWriterExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,spur=debug"));
    let writer = tracing_subscriber::fmt::TestWriter::new().and(|| Captured);
    // Only the first test of a binary installs it; the others share it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(writer)
        .try_init();
}

/// Fails if anything logged so far in this process contains one of `secrets` (tokens, keys) or
/// any PEM block, private or not (certificates are not secret, but no log line needs one).
pub fn assert_no_secret_logged(secrets: &[&str]) {
    let logs = LOGS.lock().map(|l| l.clone()).unwrap_or_default();
    let logs = String::from_utf8_lossy(&logs);
    assert!(
        !logs.is_empty(),
        "no logs were captured: is capture_logs() called?"
    );
    for (i, secret) in secrets.iter().enumerate() {
        assert!(secret.len() >= 16, "secret {i} is too short to search for");
        assert!(!logs.contains(secret), "secret {i} appears in the logs");
    }
    for marker in ["-----BEGIN", "PRIVATE KEY"] {
        let line = logs.lines().find(|l| l.contains(marker));
        assert!(line.is_none(), "{marker} in the logs: {line:?}");
    }
}

/// The lines logged so far in this process (see [`capture_logs`]) that contain `needle`.
pub fn logged_lines(needle: &str) -> Vec<String> {
    let logs = LOGS.lock().map(|l| l.clone()).unwrap_or_default();
    String::from_utf8_lossy(&logs)
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// How long [`eventually`] waits: generous, the machine is small and shared.
pub const WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Polls `check` every 50 ms until it returns `Some`, for at most [`WAIT`]; panics naming
/// `what` when it runs out.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The namespace the chart is installed into in these tests.
pub const SYSTEM_NAMESPACE: &str = "spur-system";

/// `charts/spur/<rel>`.
pub fn chart_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/spur")
        .join(rel)
}

fn rules(file: &str) -> anyhow::Result<Vec<PolicyRule>> {
    let path = chart_path(&format!("files/{file}"));
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(serde_yaml_ng::from_str(&text)?)
}

/// The document of chart template `file` that contains `marker`, rendered as Helm would for
/// release namespace [`SYSTEM_NAMESPACE`] with every optional part on: the few template
/// expressions it may hold are `.Release.Namespace`, `{{ .Values.x.y }}` (the default from
/// `values.yaml`), the labels include, and `if`/`end` lines (dropped, so what they guard
/// stays). Anything else fails the test.
pub fn chart_document(file: &str, marker: &str) -> String {
    let path = chart_path(file);
    let template =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = template
        .split("\n---\n")
        .find(|d| d.contains(marker))
        .unwrap_or_else(|| panic!("{file} has no {marker}"));
    let doc: String = doc
        .lines()
        .filter(|l| !l.contains("include \"spur.labels\""))
        .filter(|l| {
            let t = l.trim();
            !(t.starts_with("{{- if .Values.") || t == "{{- end }}")
        })
        .map(|l| {
            let l = l
                .replace(
                    "{{ .Release.Namespace | quote }}",
                    &format!("\"{SYSTEM_NAMESPACE}\""),
                )
                .replace("{{ .Release.Namespace }}", SYSTEM_NAMESPACE);
            with_default_values(&l)
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !doc.contains("{{"),
        "unhandled template expression in:\n{doc}"
    );
    doc
}

/// `line` with each `{{ .Values.a.b }}` replaced by that value of the chart's `values.yaml`.
fn with_default_values(line: &str) -> String {
    let mut out = line.to_owned();
    while let Some(start) = out.find("{{ .Values.") {
        let Some(len) = out[start..].find(" }}") else {
            break;
        };
        let path = out[start + "{{ .Values.".len()..start + len].to_owned();
        let values: serde_yaml_ng::Value = serde_yaml_ng::from_str(
            &std::fs::read_to_string(chart_path("values.yaml")).unwrap_or_default(),
        )
        .unwrap_or_default();
        let value = path
            .split('.')
            .try_fold(&values, |v, k| v.get(k))
            .unwrap_or_else(|| panic!("values.yaml has no {path}"));
        let text = match value {
            serde_yaml_ng::Value::String(s) => s.clone(),
            other => serde_yaml_ng::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_owned(),
        };
        out.replace_range(start..start + len + " }}".len(), &text);
    }
    out
}

/// Installs every CRD of the chart.
pub async fn install_crds(api: &KubeApi) -> anyhow::Result<()> {
    let mut files: Vec<_> = std::fs::read_dir(chart_path("crds"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    // Every kind the API crate generates (a file left behind or missing fails here).
    let kinds = spur_api::crdgen::crds().len();
    anyhow::ensure!(
        files.len() == kinds,
        "expected {kinds} CRDs, found {files:?}"
    );
    for f in files {
        api.install_crd_file(&f).await?;
    }
    Ok(())
}

/// Creates `namespace` unless it exists.
pub async fn ensure_namespace(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(namespace).await?.is_none() {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
        api.create(&PostParams::default(), &ns).await?;
    }
    Ok(())
}

/// The operator's client: ServiceAccount `spur-operator` with exactly the chart's operator
/// rules (`operator-rules.yaml`, and `operator-lease-rules.yaml` in its namespace).
pub async fn operator_client(api: &KubeApi) -> anyhow::Result<Client> {
    chart_client(
        api,
        "spur-operator",
        "operator-rules.yaml",
        Some("operator-lease-rules.yaml"),
    )
    .await
}

/// A client for ServiceAccount `spur-system/<name>`, bound to a ClusterRole with the rules in
/// `charts/spur/files/<cluster_rules>` and, if given, a Role in spur-system with those in
/// `charts/spur/files/<namespace_rules>` — the bindings the chart installs.
pub async fn chart_client(
    api: &KubeApi,
    name: &str,
    cluster_rules: &str,
    namespace_rules: Option<&str>,
) -> anyhow::Result<Client> {
    let admin = api.client();
    ensure_namespace(&admin, SYSTEM_NAMESPACE).await?;
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        rules: Some(rules(cluster_rules)?),
        ..ClusterRole::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": SYSTEM_NAMESPACE}]
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    if let Some(file) = namespace_rules {
        bind_role(
            api,
            name,
            &format!("{name}-namespace"),
            SYSTEM_NAMESPACE,
            file,
        )
        .await?;
    }
    let token = api.service_account_token(SYSTEM_NAMESPACE, name).await?;
    api.client_with_token(&token).await
}

/// Adds the rules in `charts/spur/files/<file>` to what the ServiceAccount `name` of
/// [`SYSTEM_NAMESPACE`] may do cluster-wide, as the chart does when a value appends them to a
/// component's ClusterRole (e.g. `mesh.istio.enabled`).
pub async fn grant_cluster(api: &KubeApi, name: &str, file: &str) -> anyhow::Result<()> {
    let admin = api.client();
    let role_name = format!("{name}-{}", file.trim_end_matches(".yaml"));
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(role_name.clone()),
            ..ObjectMeta::default()
        },
        rules: Some(rules(file)?),
        ..ClusterRole::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": SYSTEM_NAMESPACE}]
    }))?;
    Api::<ClusterRoleBinding>::all(admin)
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// Grants the ServiceAccount `name` (of [`SYSTEM_NAMESPACE`], as [`chart_client`] makes it) the
/// chart's Role rules in `file` within `namespace` (created if missing), as the chart's Role and
/// RoleBinding there do.
pub async fn grant_in_namespace(
    api: &KubeApi,
    name: &str,
    namespace: &str,
    file: &str,
) -> anyhow::Result<()> {
    ensure_namespace(&api.client(), namespace).await?;
    bind_role(api, name, name, namespace, file).await
}

/// A Role `role` in `namespace` with the rules of the chart's `file`, bound to the
/// ServiceAccount `account` of [`SYSTEM_NAMESPACE`].
async fn bind_role(
    api: &KubeApi,
    account: &str,
    role: &str,
    namespace: &str,
    file: &str,
) -> anyhow::Result<()> {
    let admin = api.client();
    let object = Role {
        metadata: ObjectMeta {
            name: Some(role.into()),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        rules: Some(rules(file)?),
    };
    Api::<Role>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &object)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": role, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": SYSTEM_NAMESPACE}]
    }))?;
    Api::<RoleBinding>::namespaced(admin, namespace)
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// A ClusterRole `name` with `rules` (JSON), bound to ServiceAccount [`SYSTEM_NAMESPACE`]/`dev`:
/// the developer of the admission-policy tests.
pub async fn grant_dev(admin: &Client, name: &str, rules: serde_json::Value) -> anyhow::Result<()> {
    let role: ClusterRole =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules}))?;
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": SYSTEM_NAMESPACE}]
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &crb)
        .await?;
    Ok(())
}

/// The rules of `charts/spur/files/<file>`, as JSON for [`grant_dev`].
pub fn chart_rules(file: &str) -> anyhow::Result<serde_json::Value> {
    let path = chart_path(&format!("files/{file}"));
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(serde_yaml_ng::from_str(&text)?)
}
