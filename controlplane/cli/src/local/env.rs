//! `spur local env`: the environment and files a local workload's process gets on the
//! workstation (Signadot's `sandbox get-env` and `get-files`): the baseline container's resolved
//! environment and its mounted ConfigMaps and Secrets, then the Sandbox's `spec.local[].env` and
//! `.files` on top (docs/local.md, "Environment and files").
//!
//! Everything is read here, with the kubeconfig's user's own rights: a Secret reaches the
//! workstation only if its user may `get` it. No component reads a Secret on the workstation's
//! behalf, and nothing is written until every value resolved.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, ValueEnum};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, KeyToPath, PodTemplateSpec, Secret, Volume,
};
use kube::api::{Api, ApiResource, DynamicObject};
use spur_api::common::{WorkloadKind, WorkloadRef};
use spur_api::sandbox::{EnvOperation, Local};
use spur_api::validation::is_file_path;
use spur_api::{Sandbox, names};

use super::say;

#[derive(Args)]
pub(super) struct EnvArgs {
    /// The Sandbox whose local workload it is.
    #[arg(long)]
    sandbox: String,
    /// The local workload (`spec.local[].name`); may be left out when the Sandbox has one.
    #[arg(long)]
    local: Option<String>,
    /// How the environment is printed on stdout.
    #[arg(long, value_enum, default_value = "dotenv")]
    output: Format,
    /// Also write the files under this directory (created, mode 0700): each at the path the
    /// baseline's container sees it, e.g. DIR/etc/app/config.yaml. Secrets' files get mode 0600.
    #[arg(long)]
    files: Option<PathBuf>,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    /// Every read is this user's: a Secret they may not read stops the command.
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// `NAME="value"` lines (`\n`, `"`, `\` and `$` escaped), for dotenv loaders.
    Dotenv,
    /// `export NAME='value'` lines, for `eval` in a POSIX shell.
    Shell,
    /// One JSON object, name to value.
    Json,
}

/// One file for the workstation.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct File {
    /// Relative to the files directory (the container's path without its leading `/`).
    pub(super) path: String,
    pub(super) content: Vec<u8>,
    /// From a Secret (or a resource output, which is one): written 0600.
    pub(super) secret: bool,
}

/// A ConfigMap's (`data` and `binaryData`) or a Secret's data.
pub(super) type Data = BTreeMap<String, Vec<u8>>;

/// ConfigMaps and Secrets of one namespace, read as the caller (each at most once).
pub(super) trait Objects {
    /// The object's data, `None` when it does not exist.
    async fn get(&mut self, kind: Kind, name: &str) -> Result<Option<Data>>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Kind {
    ConfigMap,
    Secret,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::ConfigMap => "ConfigMap",
            Kind::Secret => "Secret",
        }
    }
}

/// [`Objects`] from the API server.
struct Kube {
    client: kube::Client,
    namespace: String,
    cache: HashMap<(Kind, String), Option<Data>>,
}

impl Objects for Kube {
    async fn get(&mut self, kind: Kind, name: &str) -> Result<Option<Data>> {
        if let Some(hit) = self.cache.get(&(kind, name.to_owned())) {
            return Ok(hit.clone());
        }
        let ns = &self.namespace;
        let what = || format!("cannot read {} {ns}/{name}", kind.name());
        let data = match kind {
            Kind::ConfigMap => Api::<ConfigMap>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await
                .with_context(what)?
                .map(|cm| {
                    let mut out: Data = cm
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.into_bytes()))
                        .collect();
                    out.extend(
                        cm.binary_data
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, v.0)),
                    );
                    out
                }),
            Kind::Secret => Api::<Secret>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await
                .with_context(what)?
                .map(|s| {
                    s.data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect()
                }),
        };
        self.cache.insert((kind, name.to_owned()), data.clone());
        Ok(data)
    }
}

pub(super) async fn env_cmd(a: EnvArgs) -> Result<ExitCode> {
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let sandbox = Api::<Sandbox>::all(client.clone())
        .get_opt(&a.sandbox)
        .await
        .with_context(|| format!("cannot read Sandbox {}", a.sandbox))?
        .ok_or_else(|| anyhow!("no Sandbox {}", a.sandbox))?;
    let local = pick_local(&sandbox.spec.local, a.local.as_deref(), &a.sandbox)?;
    let template = baseline_template(&client, &local.from).await?;
    let mut objects = Kube {
        client,
        namespace: local.from.namespace.clone(),
        cache: HashMap::new(),
    };
    let resolved = resolve(&template, local, &a.sandbox, &mut objects).await?;
    for note in &resolved.notes {
        say(note);
    }
    if let Some(dir) = &a.files {
        write_files(dir, &resolved.files)?;
        say(format!(
            "{} file(s) written under {}",
            resolved.files.len(),
            dir.display()
        ));
    }
    let text = match a.output {
        Format::Dotenv => dotenv(&resolved.env),
        Format::Shell => shell(&resolved.env),
        Format::Json => {
            let map: serde_json::Map<String, serde_json::Value> = resolved
                .env
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            format!("{}\n", serde_json::Value::Object(map))
        }
    };
    std::io::stdout().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

fn pick_local<'a>(locals: &'a [Local], name: Option<&str>, sandbox: &str) -> Result<&'a Local> {
    match (name, locals) {
        (Some(n), _) => locals
            .iter()
            .find(|l| l.name == n)
            .ok_or_else(|| anyhow!("Sandbox {sandbox} has no local workload {n:?}")),
        (None, [one]) => Ok(one),
        (None, []) => bail!("Sandbox {sandbox} has no local workloads"),
        (None, _) => bail!(
            "Sandbox {sandbox} has {} local workloads: name one with --local ({})",
            locals.len(),
            locals
                .iter()
                .map(|l| l.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The pod template of the baseline: a Deployment's, or an Argo Rollout's (its own, or that of
/// the Deployment its `workloadRef` names).
async fn baseline_template(client: &kube::Client, from: &WorkloadRef) -> Result<PodTemplateSpec> {
    let (ns, name) = (&from.namespace, &from.name);
    let deployment = |name: String| async move {
        Api::<Deployment>::namespaced(client.clone(), ns)
            .get_opt(&name)
            .await
            .with_context(|| format!("cannot read Deployment {ns}/{name}"))?
            .and_then(|d| d.spec)
            .map(|s| s.template)
            .ok_or_else(|| anyhow!("no Deployment {ns}/{name}"))
    };
    match from.kind {
        WorkloadKind::Deployment => deployment(name.clone()).await,
        WorkloadKind::Rollout => {
            let rollouts = Api::<DynamicObject>::namespaced_with(
                client.clone(),
                ns,
                &ApiResource {
                    group: "argoproj.io".into(),
                    version: "v1alpha1".into(),
                    api_version: "argoproj.io/v1alpha1".into(),
                    kind: "Rollout".into(),
                    plural: "rollouts".into(),
                },
            );
            let rollout = rollouts
                .get_opt(name)
                .await
                .with_context(|| format!("cannot read Rollout {ns}/{name}"))?
                .ok_or_else(|| anyhow!("no Rollout {ns}/{name}"))?;
            let spec = &rollout.data["spec"];
            if let Some(t) = spec.get("template").filter(|t| !t.is_null()) {
                return serde_json::from_value(t.clone())
                    .with_context(|| format!("Rollout {ns}/{name}: its pod template"));
            }
            match spec["workloadRef"]["name"].as_str() {
                Some(d) if spec["workloadRef"]["kind"] == "Deployment" => {
                    deployment(d.to_owned()).await
                }
                _ => {
                    bail!("Rollout {ns}/{name} has neither a template nor a Deployment workloadRef")
                }
            }
        }
    }
}

/// What the workstation gets.
#[derive(Debug, Default)]
pub(super) struct Resolved {
    /// In the order set (the baseline's first, then the Sandbox's).
    pub(super) env: Vec<(String, String)>,
    pub(super) files: Vec<File>,
    /// What could not be carried over, and why (printed on stderr).
    pub(super) notes: Vec<String>,
}

/// The environment and files of `local`, from its baseline's `template` and the Sandbox's
/// overrides, every value read through `objects` (the baseline's namespace).
pub(super) async fn resolve(
    template: &PodTemplateSpec,
    local: &Local,
    sandbox: &str,
    objects: &mut impl Objects,
) -> Result<Resolved> {
    let pod = template
        .spec
        .as_ref()
        .ok_or_else(|| anyhow!("the baseline's pod template has no spec"))?;
    let container = match &local.container {
        Some(n) => pod
            .containers
            .iter()
            .find(|c| &c.name == n)
            .ok_or_else(|| anyhow!("the baseline has no container {n:?}"))?,
        None => pod
            .containers
            .first()
            .ok_or_else(|| anyhow!("the baseline has no container"))?,
    };
    let mut out = Resolved::default();
    let mut env = Env::default();
    baseline_env(
        container,
        template,
        &local.from.namespace,
        objects,
        &mut env,
        &mut out.notes,
    )
    .await?;
    for e in &local.env {
        match e.operation {
            EnvOperation::Delete => env.remove(&e.name),
            EnvOperation::Upsert => {
                let value = match (&e.value, &e.value_from) {
                    (Some(v), _) => expand(v, &env),
                    (None, Some(vf)) => {
                        let Some((kind, name, key, optional)) = source(
                            vf.config_map.as_ref(),
                            vf.secret.as_ref(),
                            vf.resource.as_ref(),
                            sandbox,
                        ) else {
                            bail!(
                                "spec.local[{}].env {}: valueFrom.fork is not supported for local workloads",
                                local.name,
                                e.name
                            );
                        };
                        let what = format!("spec.local env {}", e.name);
                        match lookup(objects, kind, &name, &key, optional, &what).await? {
                            Some(bytes) => utf8(bytes, &e.name)?,
                            None => continue,
                        }
                    }
                    (None, None) => continue,
                };
                env.set(&e.name, value);
            }
        }
    }
    out.env = env.vars;
    out.files = files(
        container,
        &pod.volumes.clone().unwrap_or_default(),
        local,
        sandbox,
        objects,
        &mut out.notes,
    )
    .await?;
    Ok(out)
}

/// Variables in the order first set; setting one again keeps its place.
#[derive(Default)]
struct Env {
    vars: Vec<(String, String)>,
}

impl Env {
    fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn set(&mut self, name: &str, value: String) {
        match self.vars.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value,
            None => self.vars.push((name.to_owned(), value)),
        }
    }

    fn remove(&mut self, name: &str) {
        self.vars.retain(|(n, _)| n != name);
    }
}

/// The container's environment as the kubelet would set it: `envFrom` sources in order, then
/// `env` in order, `$(VAR)` references expanded against what is set so far.
async fn baseline_env(
    c: &Container,
    template: &PodTemplateSpec,
    ns: &str,
    objects: &mut impl Objects,
    env: &mut Env,
    notes: &mut Vec<String>,
) -> Result<()> {
    for src in c.env_from.iter().flatten() {
        let prefix = src.prefix.clone().unwrap_or_default();
        let (kind, name, optional) = match (&src.config_map_ref, &src.secret_ref) {
            (Some(r), _) => (Kind::ConfigMap, r.name.clone(), r.optional.unwrap_or(false)),
            (_, Some(r)) => (Kind::Secret, r.name.clone(), r.optional.unwrap_or(false)),
            _ => continue,
        };
        match objects.get(kind, &name).await? {
            Some(data) => {
                for (k, v) in data {
                    let var = format!("{prefix}{k}");
                    // The kubelet skips keys that are no variable names; so does this.
                    if spur_api::validation::is_env_name(&var) {
                        env.set(&var, utf8(v, &var)?);
                    }
                }
            }
            None if optional => {}
            None => bail!(
                "{} {ns}/{name} (the baseline's envFrom) does not exist",
                kind.name()
            ),
        }
    }
    for e in c.env.iter().flatten() {
        let Some(vf) = &e.value_from else {
            env.set(&e.name, expand(e.value.as_deref().unwrap_or_default(), env));
            continue;
        };
        let what = format!("the baseline's env {}", e.name);
        let keyed = match (&vf.config_map_key_ref, &vf.secret_key_ref) {
            (Some(r), _) => Some((Kind::ConfigMap, &r.name, &r.key, r.optional)),
            (None, Some(r)) => Some((Kind::Secret, &r.name, &r.key, r.optional)),
            (None, None) => None,
        };
        let value = if let Some((kind, name, key, optional)) = keyed {
            lookup(objects, kind, name, key, optional.unwrap_or(false), &what).await?
        } else if let Some(f) = &vf.field_ref {
            match pod_field(&f.field_path, template, ns) {
                Some(v) => Some(v.into_bytes()),
                None => {
                    notes.push(format!(
                        "{} not set: it is the pod's {} (the workstation is no pod)",
                        e.name, f.field_path
                    ));
                    None
                }
            }
        } else {
            notes.push(format!(
                "{} not set: a container resource (resourceFieldRef) has no meaning on the workstation",
                e.name
            ));
            None
        };
        if let Some(v) = value {
            env.set(&e.name, utf8(v, &e.name)?);
        }
    }
    Ok(())
}

/// The pod fields a workstation process can be given: the namespace, the template's labels and
/// annotations, the service account's name.
fn pod_field(path: &str, template: &PodTemplateSpec, ns: &str) -> Option<String> {
    let meta = template.metadata.as_ref();
    let keyed = |prefix: &str| {
        path.strip_prefix(prefix)?
            .strip_suffix("']")
            .map(str::to_owned)
    };
    if path == "metadata.namespace" {
        return Some(ns.to_owned());
    }
    if path == "spec.serviceAccountName" {
        return Some(
            template
                .spec
                .as_ref()?
                .service_account_name
                .clone()
                .unwrap_or_else(|| "default".into()),
        );
    }
    if let Some(k) = keyed("metadata.labels['") {
        return meta?.labels.as_ref()?.get(&k).cloned();
    }
    if let Some(k) = keyed("metadata.annotations['") {
        return meta?.annotations.as_ref()?.get(&k).cloned();
    }
    None
}

/// Where a Sandbox's env or file value comes from: `(kind, name, key, optional)` of a ConfigMap
/// or Secret of the baseline's namespace (a resource output is a key of the Secret the operator
/// writes there); `None` without a source.
fn source(
    config_map: Option<&spur_api::sandbox::KeyRef>,
    secret: Option<&spur_api::sandbox::KeyRef>,
    resource: Option<&spur_api::sandbox::ResourceOutputRef>,
    sandbox: &str,
) -> Option<(Kind, String, String, bool)> {
    if let Some(r) = config_map {
        return Some((Kind::ConfigMap, r.name.clone(), r.key.clone(), r.optional));
    }
    if let Some(r) = secret {
        return Some((Kind::Secret, r.name.clone(), r.key.clone(), r.optional));
    }
    resource.map(|r| {
        let name = names::resource_name(sandbox, &r.name);
        (Kind::Secret, name, r.output_key.clone(), false)
    })
}

/// `key` of ConfigMap or Secret `name`: `None` when it is missing and `optional`, an error when
/// it is missing otherwise (`what` says which variable or file wanted it).
async fn lookup(
    objects: &mut impl Objects,
    kind: Kind,
    name: &str,
    key: &str,
    optional: bool,
    what: &str,
) -> Result<Option<Vec<u8>>> {
    let found = objects
        .get(kind, name)
        .await
        .with_context(|| format!("for {what}"))?
        .and_then(|mut d| d.remove(key));
    match found {
        Some(v) => Ok(Some(v)),
        None if optional => Ok(None),
        None => bail!(
            "{what}: {} {name} has no key {key:?} (or does not exist)",
            kind.name()
        ),
    }
}

fn utf8(bytes: Vec<u8>, name: &str) -> Result<String> {
    String::from_utf8(bytes).map_err(|_| anyhow!("{name}: the value is not UTF-8 text"))
}

/// Kubernetes' `$(VAR)` expansion: a defined variable's value; an undefined reference is left
/// as written; `$$` is one `$`.
fn expand(s: &str, env: &Env) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(')
            && let Some(end) = body.find(')')
        {
            let name = &body[..end];
            match env.get(name) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The container's mounted ConfigMaps and Secrets (whole volumes, their `items`, `subPath`
/// mounts, projected volumes' ConfigMap and Secret sources), then `local.files`, a later file
/// replacing an earlier one at the same path.
async fn files(
    c: &Container,
    volumes: &[Volume],
    local: &Local,
    sandbox: &str,
    objects: &mut impl Objects,
    notes: &mut Vec<String>,
) -> Result<Vec<File>> {
    let mut out: Vec<File> = Vec::new();
    let mut put = |f: File| match out.iter_mut().find(|o| o.path == f.path) {
        Some(o) => *o = f,
        None => out.push(f),
    };
    for m in c.volume_mounts.iter().flatten() {
        let Some(v) = volumes.iter().find(|v| v.name == m.name) else {
            continue;
        };
        if m.sub_path_expr.as_deref().is_some_and(|e| !e.is_empty()) {
            notes.push(format!(
                "{} (subPathExpr of volume {}) depends on the pod: not copied",
                m.mount_path, v.name
            ));
            continue;
        }
        // (kind, name, items, optional) of each source of the volume.
        let mut sources: Vec<(Kind, String, Vec<KeyToPath>, bool)> = Vec::new();
        if let Some(cm) = &v.config_map {
            sources.push((
                Kind::ConfigMap,
                cm.name.clone(),
                cm.items.clone().unwrap_or_default(),
                cm.optional.unwrap_or(false),
            ));
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            sources.push((
                Kind::Secret,
                name,
                s.items.clone().unwrap_or_default(),
                s.optional.unwrap_or(false),
            ));
        } else if let Some(p) = &v.projected {
            for src in p.sources.iter().flatten() {
                if let Some(cm) = &src.config_map {
                    sources.push((
                        Kind::ConfigMap,
                        cm.name.clone(),
                        cm.items.clone().unwrap_or_default(),
                        cm.optional.unwrap_or(false),
                    ));
                } else if let Some(s) = &src.secret {
                    sources.push((
                        Kind::Secret,
                        s.name.clone(),
                        s.items.clone().unwrap_or_default(),
                        s.optional.unwrap_or(false),
                    ));
                } else {
                    notes.push(format!(
                        "volume {} at {}: only its ConfigMap and Secret sources are copied",
                        v.name, m.mount_path
                    ));
                }
            }
        } else {
            notes.push(format!(
                "volume {} at {} is not copied (only ConfigMap, Secret and projected volumes are)",
                v.name, m.mount_path
            ));
            continue;
        }
        // The volume's files, relative to its root.
        let mut in_volume: Vec<(String, Vec<u8>, bool)> = Vec::new();
        for (kind, name, items, optional) in sources {
            let Some(data) = objects
                .get(kind, &name)
                .await
                .with_context(|| format!("for volume {} mounted at {}", v.name, m.mount_path))?
            else {
                if optional {
                    continue;
                }
                bail!(
                    "{} {name} (volume {} mounted at {}) does not exist",
                    kind.name(),
                    v.name,
                    m.mount_path
                );
            };
            let secret = kind == Kind::Secret;
            if items.is_empty() {
                in_volume.extend(data.into_iter().map(|(k, b)| (k, b, secret)));
            } else {
                for it in items {
                    match data.get(&it.key) {
                        Some(b) => in_volume.push((it.path.clone(), b.clone(), secret)),
                        None if optional => {}
                        None => bail!(
                            "{} {name} (volume {}) has no key {:?}",
                            kind.name(),
                            v.name,
                            it.key
                        ),
                    }
                }
            }
        }
        // As the kubelet reads it: `/etc/app/` and `//etc/app` are `/etc/app`.
        let mount = m
            .mount_path
            .split('/')
            .filter(|c| !c.is_empty())
            .collect::<Vec<_>>()
            .join("/");
        match m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            Some(sub) => {
                if let Some((_, content, secret)) = in_volume.into_iter().find(|(p, _, _)| p == sub)
                {
                    put(file(mount.clone(), content, secret)?);
                } else {
                    notes.push(format!(
                        "{} (subPath {sub} of volume {}) is not a file of it: not copied",
                        m.mount_path, v.name
                    ));
                }
            }
            None => {
                for (p, content, secret) in in_volume {
                    let path = if mount.is_empty() {
                        p
                    } else {
                        format!("{mount}/{p}")
                    };
                    put(file(path, content, secret)?);
                }
            }
        }
    }
    for (i, f) in local.files.iter().enumerate() {
        let (content, secret) = match (&f.value, &f.value_from) {
            (Some(v), _) => (v.clone().into_bytes(), false),
            (None, Some(vf)) => {
                let Some((kind, name, key, optional)) = source(
                    vf.config_map.as_ref(),
                    vf.secret.as_ref(),
                    vf.resource.as_ref(),
                    sandbox,
                ) else {
                    bail!("spec.local files[{i}]: valueFrom names no source");
                };
                let what = format!("spec.local file {}", f.path);
                match lookup(objects, kind, &name, &key, optional, &what).await? {
                    Some(b) => (b, kind == Kind::Secret),
                    None => continue,
                }
            }
            (None, None) => bail!("spec.local files[{i}]: neither value nor valueFrom"),
        };
        put(file(
            f.path.trim_start_matches('/').to_owned(),
            content,
            secret,
        )?);
    }
    Ok(out)
}

/// A file at `path`, refused when the path could leave the files directory (the API server
/// checks a Sandbox's paths, but a baseline's mount paths and items are another's writing).
fn file(path: String, content: Vec<u8>, secret: bool) -> Result<File> {
    if path.starts_with('/') || !is_file_path(&path) {
        bail!("refusing to write {path:?}: not a plain relative path");
    }
    Ok(File {
        path,
        content,
        secret,
    })
}

mod write;
use write::{dotenv, shell, write_files};

#[cfg(test)]
mod tests;
