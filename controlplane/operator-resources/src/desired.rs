//! The objects a Resource (and a Sandbox's side of resources) should have, as pure functions.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use serde_json::{Value, json};
use spur_api::keys::labels;
use spur_api::resources::{ResourceOlm, io_key};
use spur_api::{ObjectLifecycleMethods, OlmSpec, Resource, ResourceSpec, Sandbox, names};

pub(super) fn labels(sandbox: &str, resource: &str, key: Option<&str>) -> BTreeMap<String, String> {
    let mut l = BTreeMap::from([
        (
            labels::MANAGED_BY.to_owned(),
            labels::MANAGED_BY_VALUE.to_owned(),
        ),
        (labels::SANDBOX.to_owned(), sandbox.to_owned()),
        (labels::RESOURCE.to_owned(), resource.to_owned()),
    ]);
    if let Some(k) = key {
        l.insert(labels::ROUTING_KEY.to_owned(), k.to_owned());
    }
    l
}

/// The namespaces a sandbox's resources publish their outputs to: those of its forks, and those
/// of its local workloads' baselines whose env or files name a resource output (`spur local env`
/// reads them there, with its user's rights).
pub(super) fn output_namespaces(sb: &Sandbox) -> Vec<String> {
    let uses_resources = |l: &spur_api::sandbox::Local| {
        l.env
            .iter()
            .any(|e| e.value_from.as_ref().is_some_and(|v| v.resource.is_some()))
            || l.files
                .iter()
                .any(|f| f.value_from.as_ref().is_some_and(|v| v.resource.is_some()))
    };
    let mut out: Vec<String> = sb
        .spec
        .forks
        .iter()
        .map(|f| f.fork_of.namespace.clone())
        .chain(
            sb.spec
                .local
                .iter()
                .filter(|l| uses_resources(l))
                .map(|l| l.from.namespace.clone()),
        )
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The Resource `rname` of sandbox `sb` for its resource `resource`, compiled from `plugin`.
pub(super) struct NewResource<'a> {
    pub(super) rname: &'a str,
    pub(super) resource: &'a str,
    pub(super) plugin: String,
    pub(super) key: &'a str,
    pub(super) owner: &'a [OwnerReference],
    pub(super) output_namespaces: Vec<String>,
    pub(super) olm: ResourceOlm,
}

pub(super) fn resource(sb: &Sandbox, n: NewResource<'_>) -> Resource {
    let name = sb.name_any();
    let mut res = Resource::new(
        n.rname,
        ResourceSpec {
            sandbox: name.clone(),
            name: n.resource.to_owned(),
            plugin: n.plugin,
            routing_key: n.key.to_owned(),
            output_namespaces: n.output_namespaces,
            olm: n.olm,
        },
    );
    res.metadata.labels = Some(labels(&name, n.rname, Some(n.key)));
    res.metadata.owner_references = Some(n.owner.to_vec());
    res
}

/// The Resource's io context Secret (empty: the steps fill it).
pub(super) fn io_context(
    resource: &str,
    namespace: &str,
    labels_map: &BTreeMap<String, String>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(names::io_context_secret_name(resource)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels_map.clone()),
            // No owner: the garbage collector must not remove it while the delete steps
            // still need its values (a foreground deletion would); this Resource's
            // finalizer deletes it once they have run.
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        ..Secret::default()
    }
}

/// The Resource's ObjectLifecycleMethods: its compiled workflows, owned by it.
pub(super) fn olm(
    res: &Resource,
    labels_map: &BTreeMap<String, String>,
    owner: &[OwnerReference],
) -> ObjectLifecycleMethods {
    let name = res.name_any();
    let mut o = ObjectLifecycleMethods::new(
        &name,
        OlmSpec {
            io_context_name: name.clone(),
            pre_start: res.spec.olm.pre_start.clone(),
            post_stop: res.spec.olm.post_stop.clone(),
        },
    );
    o.metadata.labels = Some(labels_map.clone());
    o.metadata.owner_references = Some(owner.to_vec());
    o
}

/// The create workflow's declared outputs found in the io context's `data`.
pub(super) fn outputs(
    res: &Resource,
    data: &BTreeMap<String, ByteString>,
) -> BTreeMap<String, ByteString> {
    res.spec
        .olm
        .pre_start
        .iter()
        .flat_map(|u| u.outputs.iter().map(|o| io_key(&u.name, &o.name)))
        .filter_map(|k| data.get(&k).map(|v| (k, v.clone())))
        .collect()
}

/// The output Secret `<resource>` in namespace `ns`, as a server-side apply body.
pub(super) fn output_secret(
    res: &Resource,
    ns: &str,
    labels_map: &BTreeMap<String, String>,
    owner: &[OwnerReference],
    outputs: &BTreeMap<String, ByteString>,
) -> Value {
    let metadata = ObjectMeta {
        name: Some(res.name_any()),
        namespace: Some(ns.to_owned()),
        labels: Some(labels_map.clone()),
        owner_references: Some(owner.to_vec()),
        ..ObjectMeta::default()
    };
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": outputs,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::status::tests::resource as a_resource;

    fn owner() -> Vec<OwnerReference> {
        serde_json::from_value(json!([{
            "apiVersion": "spur.dev/v1alpha1", "kind": "Resource", "name": "sb-db",
            "uid": "res-uid", "controller": true
        }]))
        .unwrap()
    }

    #[test]
    fn only_declared_outputs_are_published_to_each_namespace() {
        let res = a_resource(json!({}));
        let data = BTreeMap::from([
            (
                "create.dsn".to_string(),
                ByteString(b"postgres://".to_vec()),
            ),
            (
                "create.secret-scratch".to_string(),
                ByteString(b"x".to_vec()),
            ),
        ]);
        let out = outputs(&res, &data);
        // `create.user` is declared but was never written; the scratch key is not declared.
        assert_eq!(out.keys().collect::<Vec<_>>(), ["create.dsn"]);
        let l = labels("sb", "sb-db", Some("k1"));
        let body = output_secret(&res, "a", &l, &owner(), &out);
        assert_eq!(body["metadata"]["name"], "sb-db");
        assert_eq!(body["metadata"]["namespace"], "a");
        assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "res-uid");
        assert_eq!(body["metadata"]["labels"][labels::ROUTING_KEY], "k1");
        assert_eq!(body["type"], "Opaque");
        assert_eq!(body["data"]["create.dsn"], "cG9zdGdyZXM6Ly8=");
    }

    #[test]
    fn the_io_context_has_no_owner_and_the_olm_has_the_resources_workflows() {
        let res = a_resource(json!({}));
        let l = labels("sb", "sb-db", Some("k1"));
        let s = io_context("sb-db", "spur-io-contexts", &l);
        assert_eq!(s.metadata.owner_references, None);
        assert_eq!(s.metadata.namespace.as_deref(), Some("spur-io-contexts"));
        assert_eq!(
            s.metadata.name.as_deref(),
            Some(names::io_context_secret_name("sb-db").as_str())
        );
        let o = olm(&res, &l, &owner());
        assert_eq!(o.name_any(), "sb-db");
        assert_eq!(o.spec.io_context_name, "sb-db");
        assert_eq!(o.spec.pre_start.len(), 1);
        assert_eq!(o.metadata.owner_references.unwrap()[0].uid, "res-uid");
        assert_eq!(o.metadata.labels.unwrap()[labels::SANDBOX], "sb");
    }

    #[test]
    fn a_sandboxs_outputs_go_to_its_forks_namespaces_once_each() {
        let sb: Sandbox = serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "sb"},
            "spec": {"forks": [
                {"forkOf": {"kind": "Deployment", "name": "a", "namespace": "shop"}},
                {"forkOf": {"kind": "Deployment", "name": "b", "namespace": "pay"}},
                {"forkOf": {"kind": "Deployment", "name": "c", "namespace": "shop"}}
            ]}
        }))
        .unwrap();
        assert_eq!(output_namespaces(&sb), ["pay", "shop"]);
        // A local workload's baseline namespace too, when its env or files read an output.
        let mut with_local = sb.clone();
        with_local.spec.local = serde_json::from_value(json!([
            {"name": "l1", "from": {"kind": "Deployment", "name": "d", "namespace": "dev"},
             "mappings": [{"port": 80, "toLocal": "localhost:80"}],
             "files": [{"path": "/etc/db", "valueFrom": {"resource": {"name": "db", "outputKey": "p.url"}}}]},
            {"name": "l2", "from": {"kind": "Deployment", "name": "e", "namespace": "quiet"},
             "mappings": [{"port": 80, "toLocal": "localhost:81"}],
             "env": [{"name": "A", "value": "1"}]}
        ]))
        .unwrap();
        assert_eq!(output_namespaces(&with_local), ["dev", "pay", "shop"]);
        let res = resource(
            &sb,
            NewResource {
                rname: "sb-db",
                resource: "db",
                plugin: "postgres".into(),
                key: "k1",
                owner: &owner(),
                output_namespaces: output_namespaces(&sb),
                olm: a_resource(json!({})).spec.olm,
            },
        );
        assert_eq!(res.spec.sandbox, "sb");
        assert_eq!(res.spec.output_namespaces, ["pay", "shop"]);
        let l = res.metadata.labels.unwrap();
        assert_eq!(l[labels::RESOURCE], "sb-db");
        assert_eq!(l[labels::ROUTING_KEY], "k1");
    }
}
