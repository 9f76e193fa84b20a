//! What the issuer writes into an opted-in namespace: its Secret (credentials and bootstrap,
//! or empty after opting out), as pure functions of the configuration and the credentials.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::ObjectMeta;
use serde_json::json;
use spur_serving::pki::Pair;

use super::{MOUNT_PATH, XdsClientConfig};
use crate::pki_config::PKI_LABEL;

/// The Secret of `ns`: the client certificate and key, the CA bundle and the bootstrap, or
/// (`creds` None, the namespace opted out) no data at all.
pub(super) fn secret(cfg: &XdsClientConfig, ns: &str, creds: Option<(&Pair, &str)>) -> Secret {
    let mut data = BTreeMap::new();
    if let Some((pair, bundle)) = creds {
        let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
        data.insert("tls.crt".to_string(), bytes(&pair.cert));
        data.insert("tls.key".to_string(), bytes(&pair.key));
        data.insert("ca.crt".to_string(), bytes(bundle));
        data.insert(
            "bootstrap.json".to_string(),
            bytes(&bootstrap(&cfg.server_uri, ns)),
        );
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(cfg.secret.clone()),
            namespace: Some(ns.to_string()),
            labels: Some(BTreeMap::from([(
                PKI_LABEL.to_string(),
                "xds-client".to_string(),
            )])),
            ..Default::default()
        },
        // Not `kubernetes.io/tls`: that type must hold a key, and opting out empties it.
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    }
}

/// grpc-go's bootstrap for a client in `namespace`: mutual TLS to `server_uri` with the files
/// of the Secret mounted at [`MOUNT_PATH`], re-read every minute (renewals).
pub fn bootstrap(server_uri: &str, namespace: &str) -> String {
    let file = |f: &str| format!("{MOUNT_PATH}/{f}");
    json!({
        "xds_servers": [{
            "server_uri": server_uri,
            "channel_creds": [{"type": "tls", "config": {
                "ca_certificate_file": file("ca.crt"),
                "certificate_file": file("tls.crt"),
                "private_key_file": file("tls.key"),
                "refresh_interval": "60s",
            }}],
            "server_features": ["xds_v3"],
        }],
        "node": {"id": format!("{namespace}/spur-xds-client"), "cluster": namespace},
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> XdsClientConfig {
        XdsClientConfig::new("routeserver.spur-system.svc:18000")
    }

    fn text(s: &Secret, key: &str) -> String {
        let data = s.data.as_ref().and_then(|d| d.get(key));
        String::from_utf8(data.map(|b| b.0.clone()).unwrap_or_default()).unwrap_or_default()
    }

    #[test]
    fn secret_with_credentials_holds_cert_key_bundle_and_bootstrap() {
        let pair = Pair {
            cert: "CERT".into(),
            key: "KEY".into(),
        };
        let s = secret(&cfg(), "team-a", Some((&pair, "BUNDLE")));
        assert_eq!(s.metadata.name.as_deref(), Some("spur-xds"));
        assert_eq!(s.metadata.namespace.as_deref(), Some("team-a"));
        assert_eq!(
            s.metadata.labels,
            Some(BTreeMap::from([(
                "spur.dev/pki".to_string(),
                "xds-client".to_string()
            )]))
        );
        assert_eq!(s.type_.as_deref(), Some("Opaque"));
        let keys: Vec<_> = s.data.iter().flat_map(|d| d.keys().cloned()).collect();
        assert_eq!(keys, ["bootstrap.json", "ca.crt", "tls.crt", "tls.key"]);
        assert_eq!(text(&s, "tls.crt"), "CERT");
        assert_eq!(text(&s, "tls.key"), "KEY");
        assert_eq!(text(&s, "ca.crt"), "BUNDLE");
        assert_eq!(
            text(&s, "bootstrap.json"),
            bootstrap("routeserver.spur-system.svc:18000", "team-a")
        );
    }

    #[test]
    fn secret_without_credentials_is_emptied_not_dropped() {
        let mut c = cfg();
        c.secret = "my-xds".into();
        let s = secret(&c, "team-b", None);
        assert_eq!(s.metadata.name.as_deref(), Some("my-xds"));
        assert_eq!(s.metadata.namespace.as_deref(), Some("team-b"));
        assert_eq!(s.type_.as_deref(), Some("Opaque"));
        // Present and empty, so server-side apply removes the keys it wrote before.
        assert_eq!(s.data, Some(BTreeMap::new()));
    }

    #[test]
    fn bootstrap_points_at_the_server_and_the_mounted_files() {
        let b: serde_json::Value =
            serde_json::from_str(&bootstrap("rs:18000", "team-a")).unwrap_or_default();
        let server = &b["xds_servers"][0];
        assert_eq!(server["server_uri"], "rs:18000");
        let tls = &server["channel_creds"][0]["config"];
        assert_eq!(tls["certificate_file"], "/etc/spur/xds/tls.crt");
        assert_eq!(tls["private_key_file"], "/etc/spur/xds/tls.key");
        assert_eq!(tls["ca_certificate_file"], "/etc/spur/xds/ca.crt");
        assert_eq!(b["node"]["id"], "team-a/spur-xds-client");
        assert_eq!(b["node"]["cluster"], "team-a");
    }
}
