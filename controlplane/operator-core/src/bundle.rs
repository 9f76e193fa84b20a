//! The CA bundle copies the operator keeps in application namespaces, and the label every
//! PKI object of the operator carries: shared by the certificate manager, the injection
//! webhook (which puts a copy into a namespace it injects into) and sandbox resources.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// Label on the operator's PKI objects (value `ca`, `serving`, `bundle`, …); the certificate
/// manager watches it.
pub const PKI_LABEL: &str = "spur.dev/pki";

/// `spur.dev/pki` value of the bundle copies in application namespaces.
pub const NAMESPACE_BUNDLE_ROLE: &str = "namespace-bundle";

/// The CA bundle ConfigMap the webhook puts into a namespace it injects into, for the
/// sidecars' route-server connection. It outlives an uninstall (an owner in another namespace
/// is not allowed); `kubectl delete cm -A -l spur.dev/pki=namespace-bundle` removes them all.
pub fn namespace_bundle(namespace: &str, name: &str, bundle: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (PKI_LABEL.to_string(), NAMESPACE_BUNDLE_ROLE.to_string()),
                (
                    spur_api::keys::labels::MANAGED_BY.to_string(),
                    spur_api::keys::labels::MANAGED_BY_VALUE.to_string(),
                ),
            ])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("ca.crt".to_string(), bundle.to_string())])),
        ..Default::default()
    }
}
