//! `spur sandbox apply` and `spur routegroup apply`: a file's Sandbox or RouteGroup documents,
//! checked here first (kind, scope, name, and the validation the operator and the webhook run,
//! so a mistake is named before anything is sent), then server-side applied with the user's
//! own credentials: the API server's RBAC and Spur's admission webhooks judge the user, never a
//! component. An admission refusal comes back as the API server's message, which names the
//! field.

use std::fmt::Debug;

use anyhow::{Context as _, Result, bail};
use kube::api::{Patch, PatchParams};
use kube::core::ClusterResourceScope;
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use spur_api::{RouteGroup, Sandbox};

/// The field manager of the user's applies (what `kubectl get --show-managed-fields` shows).
pub(crate) const FIELD_MANAGER: &str = "spur";

/// A cluster-scoped object people own and `spur` applies: a Sandbox or a RouteGroup.
pub(crate) trait Owned:
    Resource<DynamicType = (), Scope = ClusterResourceScope>
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// What a person calls it, and several of it.
    const NOUN: &'static str;
    const PLURAL: &'static str;
    /// The command that manages it (`spur sandbox`, `spur routegroup`).
    const COMMAND: &'static str;
    /// The validation the operator runs on it.
    fn check(&self) -> Result<(), String>;
}

impl Owned for Sandbox {
    const NOUN: &'static str = "sandbox";
    const PLURAL: &'static str = "sandboxes";
    const COMMAND: &'static str = "spur sandbox";
    fn check(&self) -> Result<(), String> {
        self.validate().map_err(|e| e.to_string())
    }
}

impl Owned for RouteGroup {
    const NOUN: &'static str = "route group";
    const PLURAL: &'static str = "route groups";
    const COMMAND: &'static str = "spur routegroup";
    fn check(&self) -> Result<(), String> {
        self.validate().map_err(|e| e.to_string())
    }
}

/// Largest file `apply` reads: far above any sandbox, far below what could hurt.
const MAX_FILE: u64 = 4 << 20;

/// Reads `path` (`-` for stdin).
pub(crate) fn read_file(path: &std::path::Path) -> Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .take(MAX_FILE + 1)
            .read_to_string(&mut text)
            .context("reading standard input")?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_FILE + 1).read_to_string(&mut text))
            .with_context(|| format!("reading {}", path.display()))?;
    }
    if text.len() as u64 > MAX_FILE {
        bail!("{}: larger than {MAX_FILE} bytes", path.display());
    }
    Ok(text)
}

/// One document of a file: as typed (for the checks here) and as written (what is sent, so the
/// API server's strict field validation sees a misspelt field that the typed form would drop).
#[derive(Clone, Debug)]
pub(crate) struct Doc<K> {
    pub obj: K,
    pub raw: serde_json::Value,
}

/// The `K` documents of a YAML stream (empty documents skipped), each checked. Any document of
/// another kind, a namespaced one, or one that fails validation refuses the whole file: nothing
/// is applied from a file with a mistake in it.
pub(crate) fn documents<K: Owned>(file: &str, text: &str) -> Result<Vec<Doc<K>>> {
    use serde::Deserialize as _;
    let kind = K::kind(&());
    let mut out = Vec::new();
    // First pass: the shape every document must have, with a message a person can act on. A
    // `v1` List (what `list -o yaml` prints) stands for its items.
    let mut wanted: Vec<Wanted> = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let n = i + 1;
        let v = serde_json::Value::deserialize(doc)
            .with_context(|| format!("{file}: document {n} is not valid YAML"))?;
        if v.is_null() {
            wanted.push(Wanted::Skip);
        } else if v["kind"] == "List" && v["apiVersion"] == "v1" {
            let items = v["items"].as_array().cloned().unwrap_or_default();
            for (j, item) in items.iter().enumerate() {
                shape::<K>(file, &format!("document {n} item {}", j + 1), item)?;
            }
            wanted.push(Wanted::List(items));
        } else {
            shape::<K>(file, &format!("document {n}"), &v)?;
            wanted.push(Wanted::One(v));
        }
    }
    // Second pass: the typed objects, whose errors name the field (and, for a document, the
    // line).
    let check = |obj: &K, at: &str| {
        let name = obj.meta().name.clone().unwrap_or_default();
        obj.check()
            .map_err(|e| anyhow::anyhow!("{file}: {at} ({kind} {name}): {e}"))
    };
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let n = i + 1;
        match wanted
            .get_mut(i)
            .map(|w| std::mem::replace(w, Wanted::Skip))
        {
            Some(Wanted::One(raw)) => {
                let obj = K::deserialize(doc)
                    .map_err(|e| anyhow::anyhow!("{file}: document {n}: {e}"))?;
                check(&obj, &format!("document {n}"))?;
                out.push(Doc { obj, raw });
            }
            Some(Wanted::List(items)) => {
                for (j, raw) in items.into_iter().enumerate() {
                    let at = format!("document {n} item {}", j + 1);
                    let obj: K = serde_json::from_value(raw.clone())
                        .map_err(|e| anyhow::anyhow!("{file}: {at}: {e}"))?;
                    check(&obj, &at)?;
                    out.push(Doc { obj, raw });
                }
            }
            _ => {}
        }
    }
    if out.is_empty() {
        bail!("{file}: no {kind} document in it");
    }
    let mut names: Vec<&str> = out
        .iter()
        .filter_map(|d| d.obj.meta().name.as_deref())
        .collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        bail!("{file}: {kind} {} appears twice", w[0]);
    }
    Ok(out)
}

/// A document of the first pass.
enum Wanted {
    Skip,
    One(serde_json::Value),
    List(Vec<serde_json::Value>),
}

/// The shape `K` documents must have: kind, apiVersion, a name, no namespace.
fn shape<K: Owned>(file: &str, at: &str, v: &serde_json::Value) -> Result<()> {
    let (api_version, kind) = (K::api_version(&()), K::kind(&()));
    let (av, k) = (v["apiVersion"].as_str(), v["kind"].as_str());
    if av != Some(api_version.as_ref()) || k != Some(kind.as_ref()) {
        let what = match (k, av) {
            (Some(k), Some(av)) => format!("{k} ({av})"),
            (Some(k), None) => format!("{k} without an apiVersion"),
            (None, _) => "without a kind".to_string(),
        };
        bail!(
            "{file}: {at} is {what}; `{} apply` takes {kind} ({api_version}) documents",
            K::COMMAND
        );
    }
    if v["metadata"]["name"].as_str().is_none_or(str::is_empty) {
        bail!("{file}: {at}: metadata.name is required");
    }
    if !v["metadata"]["namespace"].is_null() {
        bail!("{file}: {at}: a {kind} is cluster-scoped; remove metadata.namespace");
    }
    Ok(())
}

/// What an apply did, in kubectl's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Created,
    Configured,
    Unchanged,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Configured => "configured",
            Outcome::Unchanged => "unchanged",
        }
    }
}

/// Server-side applies a document as written (never its status); with `dry_run`, only through
/// the API server's checks.
pub(crate) async fn apply<K: Owned>(
    api: &Api<K>,
    doc: &Doc<K>,
    force: bool,
    dry_run: bool,
) -> Result<(K, Outcome)> {
    let name = doc.obj.meta().name.clone().unwrap_or_default();
    let kind = K::kind(&());
    let before = api
        .get_opt(&name)
        .await
        .map_err(|e| crate::sandbox::api_error(e, &format!("reading {kind} {name}")))?;
    let mut body = doc.raw.clone();
    if let Some(o) = body.as_object_mut() {
        o.remove("status");
    }
    // What a server wrote, so the output of `get -o yaml` applies as a file.
    if let Some(m) = body["metadata"].as_object_mut() {
        for field in [
            "managedFields",
            "resourceVersion",
            "uid",
            "generation",
            "creationTimestamp",
        ] {
            m.remove(field);
        }
    }
    let mut params = PatchParams::apply(FIELD_MANAGER).validation_strict();
    if force {
        params = params.force();
    }
    if dry_run {
        params = params.dry_run();
    }
    let after = match api.patch(&name, &params, &Patch::Apply(&body)).await {
        Ok(after) => after,
        Err(kube::Error::Api(e)) if e.code == 409 => bail!(
            "applying {kind} {name}: another manager owns fields this file sets ({}); apply with --force-conflicts to take them over",
            e.message
        ),
        Err(e) => {
            return Err(crate::sandbox::api_error(
                e,
                &format!("applying {kind} {name}"),
            ));
        }
    };
    let outcome = match &before {
        None => Outcome::Created,
        // Not the resourceVersion: the operator writes status and finalizers in between.
        Some(b)
            if b.meta().generation == after.meta().generation
                && b.meta().labels == after.meta().labels
                && b.meta().annotations == after.meta().annotations =>
        {
            Outcome::Unchanged
        }
        Some(_) => Outcome::Configured,
    };
    Ok((after, outcome))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_checked_before_anything_is_sent() {
        let sb = "apiVersion: spur.dev/v1alpha1\nkind: Sandbox\nmetadata: {name: a}\nspec:\n  forks: [{forkOf: {kind: Deployment, namespace: shop, name: api}}]\n";
        let two = format!("---\n{sb}---\n{}", sb.replace("name: a}", "name: b}"));
        let got: Vec<Doc<Sandbox>> = documents("f.yaml", &two).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].obj.metadata.name.as_deref(), Some("b"));
        assert_eq!(got[1].raw["metadata"]["name"], "b");

        let err = |text: &str| {
            documents::<Sandbox>("f.yaml", text)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"),
            "f.yaml: document 1 is ConfigMap (v1); `spur sandbox apply` takes Sandbox (spur.dev/v1alpha1) documents"
        );
        assert!(
            err(&sb.replace(
                "metadata: {name: a}",
                "metadata: {name: a, namespace: shop}"
            ))
            .contains("cluster-scoped; remove metadata.namespace")
        );
        assert!(
            err(&sb.replace("{name: a}", "{labels: {}}")).contains("metadata.name is required")
        );
        // A typed error names the field (and serde_yaml_ng the line).
        let missing = err(&sb.replace(", name: api", ""));
        assert!(
            missing.contains("spec.forks[0].forkOf") && missing.contains("name"),
            "{missing}"
        );
        // The operator's own validation, before any request.
        let invalid = err(&sb.replace("name: a}", "name: A_b}"));
        assert!(invalid.contains("metadata.name"), "{invalid}");
        assert!(err(&format!("{sb}---\n{sb}")).contains("Sandbox a appears twice"));
        assert_eq!(err("---\n"), "f.yaml: no Sandbox document in it");
        assert!(err("a: [").contains("document 1 is not valid YAML"));
        // What `list -o yaml` prints applies: a v1 List stands for its items.
        let list = format!(
            "apiVersion: v1\nkind: List\nitems:\n- {}",
            sb.trim_end().replace('\n', "\n  ")
        );
        let got: Vec<Doc<Sandbox>> = documents("l.yaml", &list).unwrap();
        assert_eq!(got[0].obj.metadata.name.as_deref(), Some("a"));
        let bad_item = list.replace("kind: Sandbox", "kind: RouteGroup");
        assert!(err(&bad_item).contains("document 1 item 1 is RouteGroup"));
        // A route group file is not a sandbox file.
        let rg = "apiVersion: spur.dev/v1alpha1\nkind: RouteGroup\nmetadata: {name: g}\nspec:\n  match: {label: {key: team, value: x}}\n";
        assert!(err(rg).contains("document 1 is RouteGroup"));
        assert_eq!(documents::<RouteGroup>("g.yaml", rg).unwrap().len(), 1);
    }
}
