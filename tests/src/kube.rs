//! Helpers for the tests on a real kube-apiserver: clients that run under exactly the chart's
//! RBAC rules, so a permission the chart lacks fails the suite.

pub mod control_plane;

use std::path::{Path, PathBuf};

use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
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

/// The label a cluster administrator puts on a namespace to let Spur write in it (the operator's
/// enroller then binds the chart's enrolled ClusterRoles there).
pub const ENABLED_LABEL: &str = spur_operator::enroll::ENABLED_LABEL;

/// Creates `namespace` unless it exists, labelled `spur.dev/enabled=true` (an existing one gets
/// the label): Spur may write in it. Once [`operator_client`] runs the enroller, waits until the
/// operator's rights there are in force. `client` is an administrator's.
pub async fn ensure_namespace(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let labels = json!({(ENABLED_LABEL): spur_operator::enroll::ENABLED_VALUE});
    match api.get_opt(namespace).await? {
        None => {
            let ns: Namespace =
                serde_json::from_value(json!({"metadata": {"name": namespace, "labels": labels}}))?;
            api.create(&PostParams::default(), &ns).await?;
        }
        Some(ns) if !spur_operator::enroll::enrolled(&ns) => {
            api.patch(
                namespace,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await?;
        }
        Some(_) => {}
    }
    let roles: Api<ClusterRole> = Api::all(client.clone());
    if roles.get_opt(OPERATOR_ENROLLED).await?.is_some() {
        wait_enrolled(client, namespace).await?;
    }
    Ok(())
}

/// Creates `namespace` unless it exists, without the label: Spur may not write in it.
pub async fn ensure_namespace_unenrolled(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(namespace).await?.is_none() {
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
        api.create(&PostParams::default(), &ns).await?;
    }
    Ok(())
}

/// Waits (at most [`WAIT`]) until the API server lets the operator's ServiceAccount create
/// Deployments and the jobs component's create pods in `namespace`: the enroller's RoleBindings
/// are there and in force.
pub async fn wait_enrolled(admin: &Client, namespace: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if may(
            admin,
            "spur-operator",
            "apps",
            "deployments",
            "create",
            namespace,
        )
        .await?
            && may(admin, "spur-jobs", "", "pods", "create", namespace).await?
        {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "namespace {namespace} was not enrolled in time: is the enroller running (operator_client)?"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Whether ServiceAccount [`SYSTEM_NAMESPACE`]/`account` may `verb` `resource` of `group` in
/// `namespace`, as the API server's authorizer (RBAC) answers a SubjectAccessReview.
pub async fn may(
    admin: &Client,
    account: &str,
    group: &str,
    resource: &str,
    verb: &str,
    namespace: &str,
) -> anyhow::Result<bool> {
    let review: SubjectAccessReview = serde_json::from_value(json!({
        "spec": {
            "user": format!("system:serviceaccount:{SYSTEM_NAMESPACE}:{account}"),
            "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{SYSTEM_NAMESPACE}"), "system:authenticated"],
            "resourceAttributes": {"group": group, "resource": resource, "verb": verb, "namespace": namespace}
        }
    }))?;
    let answer = Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// The chart's ClusterRole holding the operator's writes in enrolled namespaces.
pub const OPERATOR_ENROLLED: &str = "spur-operator-enrolled";
/// The chart's ClusterRole holding the jobs component's writes in enrolled namespaces.
pub const JOBS_ENROLLED: &str = "spur-jobs-enrolled";

/// The operator's client: ServiceAccount `spur-operator` with exactly the chart's operator
/// rules (`operator-rules.yaml`, and `operator-lease-rules.yaml` in its namespace), and the
/// chart's enrolled ClusterRoles (`spur-operator-enrolled` with access on, as by default, and
/// `spur-jobs-enrolled`), bound in each namespace labelled `spur.dev/enabled=true` by the
/// operator's enroller, which runs under this client for the rest of the test (as it runs in
/// the operator, with `--enroll-binding` for both). Returns once every labelled namespace is
/// enrolled; [`ensure_namespace`] waits for later ones.
pub async fn operator_client(api: &KubeApi) -> anyhow::Result<Client> {
    let admin = api.client();
    let mut operator_rules = rules("operator-enrolled-rules.yaml")?;
    operator_rules.extend(rules("operator-access-enrolled-rules.yaml")?);
    operator_rules.extend(rules("operator-smarttests-enrolled-rules.yaml")?);
    for (name, rules) in [
        (OPERATOR_ENROLLED, operator_rules),
        (JOBS_ENROLLED, rules("jobs-enrolled-rules.yaml")?),
    ] {
        let role = ClusterRole {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            rules: Some(rules),
            ..ClusterRole::default()
        };
        Api::<ClusterRole>::all(admin.clone())
            .create(&PostParams::default(), &role)
            .await?;
    }
    let client = chart_client(
        api,
        "spur-operator",
        "operator-rules.yaml",
        Some("operator-lease-rules.yaml"),
    )
    .await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = spur_operator::Metrics::register(&mut registry);
    let ctx = spur_operator::Context::new(client.clone(), Some("enroller".into()), metrics);
    let cfg = enroll_config();
    tokio::spawn(spur_operator::enroll::run(
        ctx.shared(),
        cfg,
        tokio_util::sync::CancellationToken::new(),
    ));
    let labelled = Api::<Namespace>::all(admin.clone())
        .list(&ListParams::default().labels(&format!(
            "{ENABLED_LABEL}={}",
            spur_operator::enroll::ENABLED_VALUE
        )))
        .await?;
    for ns in labelled.items {
        wait_enrolled(&admin, &ns.name_any()).await?;
    }
    Ok(client)
}

/// The enroller's configuration as the chart passes it (`--enroll-binding` for the operator and
/// the jobs component).
pub fn enroll_config() -> spur_operator::enroll::EnrollConfig {
    spur_operator::enroll::EnrollConfig {
        namespace: SYSTEM_NAMESPACE.into(),
        bindings: vec![
            spur_operator::enroll::EnrollBinding {
                cluster_role: OPERATOR_ENROLLED.into(),
                service_account: "spur-operator".into(),
            },
            spur_operator::enroll::EnrollBinding {
                cluster_role: JOBS_ENROLLED.into(),
                service_account: "spur-jobs".into(),
            },
        ],
    }
}

/// The jobs component's client: ServiceAccount `spur-system/spur-jobs` with the chart's
/// ClusterRole and its Role in the release namespace ([`chart_client`]).
pub async fn jobs_client(api: &KubeApi) -> anyhow::Result<Client> {
    chart_client(
        api,
        "spur-jobs",
        "jobs-rules.yaml",
        Some("jobs-namespace-rules.yaml"),
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
    // The release namespace: the chart's Roles say what each component does there.
    ensure_namespace_unenrolled(&admin, SYSTEM_NAMESPACE).await?;
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
/// chart's Role rules in `file` within `namespace` (created if missing, unlabelled: a chart's
/// namespace), as the chart's Role and RoleBinding there do.
pub async fn grant_in_namespace(
    api: &KubeApi,
    name: &str,
    namespace: &str,
    file: &str,
) -> anyhow::Result<()> {
    ensure_namespace_unenrolled(&api.client(), namespace).await?;
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

/// `helm template spur charts/spur -n` [`SYSTEM_NAMESPACE`] `<args>`: every object the chart
/// renders, as JSON.
pub async fn helm_template(args: &[&str]) -> anyhow::Result<Vec<serde_json::Value>> {
    let helm = spur_kube_harness::bin_dir().await?.join("helm");
    let home = tempfile::tempdir()?;
    let out = tokio::process::Command::new(&helm)
        .args(["template", "spur"])
        .arg(chart_path(""))
        .args(["--namespace", SYSTEM_NAMESPACE])
        .args(args)
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("running {}: {e}", helm.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    // helm writes each document after a line `---`.
    let mut objects = Vec::new();
    for doc in text.split("\n---\n") {
        let v: serde_json::Value = serde_yaml_ng::from_str(doc)?;
        if !v.is_null() {
            objects.push(v);
        }
    }
    Ok(objects)
}

/// Creates the ValidatingAdmissionPolicy `name` and its binding of that name from `objects`
/// (what [`helm_template`] rendered). The API server enforces it a moment later (its policy
/// informer): a test probes for that with a write the policy refuses.
pub async fn install_rendered_policy(
    admin: &Client,
    objects: &[serde_json::Value],
    name: &str,
) -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let find = |kind: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("the chart renders no {kind} {name}"))
    };
    let policy: ValidatingAdmissionPolicy =
        serde_json::from_value(find("ValidatingAdmissionPolicy")?)?;
    Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .create(&PostParams::default(), &policy)
        .await?;
    let binding: ValidatingAdmissionPolicyBinding =
        serde_json::from_value(find("ValidatingAdmissionPolicyBinding")?)?;
    Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

/// A token of ServiceAccount `name` of `namespace` for the traffic store's audience, for an
/// hour (what a reader, the hub agent or the operator presents to the store).
pub async fn traffic_token(api: &KubeApi, namespace: &str, name: &str) -> anyhow::Result<String> {
    api.token_request(
        namespace,
        name,
        k8s_openapi::api::authentication::v1::TokenRequestSpec {
            audiences: vec![spur_traffic::AUDIENCE.into()],
            expiration_seconds: Some(3600),
            ..Default::default()
        },
    )
    .await
}

/// A traffic store on loopback reviewing tokens with `api`, under the chart's rights
/// (`traffic-rules.yaml`), until `stop`: `capture` is the cluster's capture settings, `recheck`
/// how often open streams are checked again, and its Sandbox watch starts `list_after` the
/// server (as when the API server is slow to answer a store that just started).
pub async fn traffic_store(
    api: &KubeApi,
    capture: spur_traffic::ClusterCapture,
    recheck: std::time::Duration,
    list_after: std::time::Duration,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    let client = chart_client(api, "spur-traffic", "traffic-rules.yaml", None).await?;
    let index = spur_traffic::SettingsIndex::pending();
    let watch = spur_traffic::watch_sandboxes(client.clone(), index.clone(), capture, stop.clone());
    tokio::spawn(async move {
        tokio::time::sleep(list_after).await;
        watch.await
    });
    let mut registry = prometheus_client::registry::Registry::default();
    let server = spur_traffic::Server::bind(
        spur_traffic::TrafficServerConfig {
            listen: "127.0.0.1:0".parse()?,
            db: None,
            limits: spur_traffic::Limits::default(),
            tls: None,
            settings: spur_traffic::SettingsSource::External,
            auth: spur_traffic::Authorizer::kube_with_recheck(client, recheck),
        },
        index,
        &mut registry,
    )
    .await?;
    let addr = server.local_addr();
    tokio::spawn(async move {
        if let Err(e) = server.run(stop).await {
            panic!("the traffic store failed: {e}");
        }
    });
    Ok(addr)
}
