//! What the operator's PKI is configured with (the certificate manager's [`crate::certs`],
//! the xDS client issuer's [`crate::xds_clients`], the workstation CSR signer's
//! [`crate::workstations`]), and the CA they all sign with, read from its Secret.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Api;
use spur_serving::pki::Pair;

use spur_operator_core::Error;

pub use spur_operator_core::bundle::PKI_LABEL;

/// What the certificate manager maintains.
#[derive(Debug, Clone)]
pub struct PkiConfig {
    /// The operator's namespace: both Secrets live here.
    pub namespace: String,
    pub ca_secret: String,
    pub serving_secret: String,
    /// Name of the MutatingWebhookConfiguration whose `caBundle` is kept current.
    pub webhook_configuration: String,
    /// Name of the ValidatingWebhookConfiguration (EnvoyConfig validation) whose `caBundle` is
    /// kept current too. None: there is none.
    pub validating_webhook_configuration: Option<String>,
    /// Subject alternative names of the serving certificate (DNS names or IP addresses).
    pub serving_names: Vec<String>,
    pub ca_lifetime: Duration,
    pub serving_lifetime: Duration,
    /// How long a new CA sits in the webhook configuration's bundle before it signs anything:
    /// the time API servers take to pick up the change.
    pub propagation: Duration,
    /// The tunnel proxy's serving certificate, issued like the webhook's (None: the tunnel
    /// proxy's Secret comes from elsewhere, or there is no tunnel proxy).
    pub tunnel_proxy: Option<ServingCert>,
    /// The route server's serving certificate, issued like the webhook's (None: provided some
    /// other way).
    pub routeserver: Option<ServingCert>,
    /// The io context server's serving certificate (sandbox resources), issued like the
    /// webhook's (None: no io context server, or provided some other way).
    pub ics: Option<ServingCert>,
    /// The traffic store's serving certificate (traffic capture), issued like the webhook's
    /// (None: no traffic store, or provided some other way).
    pub traffic: Option<ServingCert>,
    /// A ConfigMap (key `ca.crt`) with the CA bundle, for workstations to trust the tunnel proxy:
    /// public, unlike the Secrets. None: not published.
    pub bundle_config_map: Option<String>,
    /// Lifetime of a workstation client certificate whose request does not ask for one.
    pub workstation_cert_lifetime: Duration,
    /// The longest a workstation client certificate is issued for, whatever it asks.
    pub workstation_cert_max_lifetime: Duration,
    /// Name of the CA bundle ConfigMap the webhook copies into the namespaces it injects into
    /// (the injection config's `routeserverCaConfigMap`); the manager keeps the copies current.
    /// None: no copies.
    pub namespace_bundle: Option<String>,
    /// Namespaces that hold a copy of `namespace_bundle` whether or not the webhook injected
    /// into them: the chart's L4 gateway namespaces (docs/l4.md). The manager creates the copy
    /// when it is missing (at once when such a namespace is created) and keeps it current; a
    /// ConfigMap of that name it did not make is left alone. The operator's own namespace is
    /// skipped (it holds the published bundle, `bundle_config_map`).
    pub bundle_namespaces: Vec<String>,
    /// xDS client credentials for opted-in namespaces ([`crate::xds_clients`]).
    pub xds_clients: Option<XdsClientConfig>,
    /// The operator's Deployment: it owns the Secrets and the ConfigMap, so they go with the
    /// installation (crate::owner). None: they are nobody's (and outlive an uninstall).
    pub owner: Option<OwnerReference>,
}

/// A serving certificate the manager keeps current besides the webhook's.
#[derive(Debug, Clone)]
pub struct ServingCert {
    /// A `kubernetes.io/tls` Secret in the operator's namespace: `tls.crt`, `tls.key`, and
    /// `ca.crt` (the CA bundle).
    pub secret: String,
    /// Subject alternative names (DNS names or IP addresses).
    pub names: Vec<String>,
}

impl ServingCert {
    /// The chart's route server: Service `spur-routeserver` in `namespace`, Secret
    /// `spur-routeserver-tls`, plus `extra` names.
    pub fn routeserver(namespace: &str, extra: &[String]) -> Self {
        let mut names = vec![
            format!("spur-routeserver.{namespace}.svc"),
            format!("spur-routeserver.{namespace}.svc.cluster.local"),
        ];
        names.extend(extra.iter().filter(|n| !n.is_empty()).cloned());
        ServingCert {
            secret: "spur-routeserver-tls".into(),
            names,
        }
    }

    /// The chart's io context server: Service `spur-ics` in `namespace`, Secret `spur-ics-tls`.
    pub fn ics(namespace: &str) -> Self {
        ServingCert {
            secret: "spur-ics-tls".into(),
            names: vec![
                format!("spur-ics.{namespace}.svc"),
                format!("spur-ics.{namespace}.svc.cluster.local"),
            ],
        }
    }

    /// The chart's traffic store: Service `spur-traffic` in `namespace`, Secret
    /// `spur-traffic-tls`.
    pub fn traffic(namespace: &str) -> Self {
        ServingCert {
            secret: "spur-traffic-tls".into(),
            names: vec![
                format!("spur-traffic.{namespace}.svc"),
                format!("spur-traffic.{namespace}.svc.cluster.local"),
            ],
        }
    }

    /// The chart's tunnel proxy: Service `spur-tunnel-proxy` in `namespace`, Secret
    /// `spur-tunnel-proxy-tls`, plus `extra` names (its load balancer's name or address).
    pub fn tunnel_proxy(namespace: &str, extra: &[String]) -> Self {
        let mut names = vec![
            format!("spur-tunnel-proxy.{namespace}.svc"),
            format!("spur-tunnel-proxy.{namespace}.svc.cluster.local"),
        ];
        names.extend(extra.iter().filter(|n| !n.is_empty()).cloned());
        ServingCert {
            secret: "spur-tunnel-proxy-tls".into(),
            names,
        }
    }
}

impl PkiConfig {
    /// Defaults for the chart's names: Service `service` in `namespace`.
    pub fn new(namespace: &str, service: &str) -> Self {
        PkiConfig {
            namespace: namespace.into(),
            ca_secret: "spur-ca".into(),
            serving_secret: "spur-webhook-tls".into(),
            webhook_configuration: "spur-sidecar-injector".into(),
            validating_webhook_configuration: Some("spur-envoyconfig-validator".into()),
            serving_names: vec![
                format!("{service}.{namespace}.svc"),
                format!("{service}.{namespace}.svc.cluster.local"),
            ],
            ca_lifetime: Duration::from_secs(365 * 24 * 3600),
            serving_lifetime: Duration::from_secs(30 * 24 * 3600),
            // API servers pick up a webhook configuration within seconds, but the sidecars
            // read the bundle from a ConfigMap volume, which the kubelet refreshes only at its
            // sync period plus cache TTL (about a minute each by default).
            propagation: Duration::from_secs(180),
            tunnel_proxy: None,
            routeserver: None,
            ics: None,
            traffic: None,
            bundle_config_map: Some("spur-ca-bundle".into()),
            workstation_cert_lifetime: Duration::from_secs(24 * 3600),
            workstation_cert_max_lifetime: Duration::from_secs(7 * 24 * 3600),
            namespace_bundle: None,
            bundle_namespaces: Vec::new(),
            xds_clients: None,
            owner: None,
        }
    }

    pub fn validate(&self) -> Result<(), Error> {
        if self.serving_names.is_empty() {
            return Err(Error::Config(
                "the serving certificate needs at least one name".into(),
            ));
        }
        if self.serving_lifetime < Duration::from_secs(5) {
            return Err(Error::Config(
                "the serving certificate lifetime must be at least 5s".into(),
            ));
        }
        for (what, t) in [
            ("tunnel proxy", &self.tunnel_proxy),
            ("route server", &self.routeserver),
            ("io context server", &self.ics),
            ("traffic store", &self.traffic),
        ] {
            if let Some(t) = t
                && (t.names.is_empty() || t.secret.is_empty() || t.secret == self.serving_secret)
            {
                return Err(Error::Config(format!(
                    "the {what}'s certificate needs its own Secret and at least one name"
                )));
            }
        }
        let secrets: Vec<&str> = [
            &self.tunnel_proxy,
            &self.routeserver,
            &self.ics,
            &self.traffic,
        ]
        .into_iter()
        .flatten()
        .map(|t| t.secret.as_str())
        .collect();
        if (1..secrets.len()).any(|i| secrets[..i].contains(&secrets[i])) {
            return Err(Error::Config(
                "the tunnel proxy, the route server, the io context server and the traffic store need different Secrets"
                    .into(),
            ));
        }
        // Kubernetes accepts no request for less than ten minutes (expirationSeconds >= 600).
        if self.workstation_cert_lifetime < Duration::from_secs(600)
            || self.workstation_cert_max_lifetime < self.workstation_cert_lifetime
        {
            return Err(Error::Config(format!(
                "workstation certificates: the default lifetime ({:?}) must be at least 10m and at most the maximum ({:?})",
                self.workstation_cert_lifetime, self.workstation_cert_max_lifetime
            )));
        }
        if let Some(ns) = self
            .bundle_namespaces
            .iter()
            .find(|n| !spur_api::validation::is_dns_label(n))
        {
            return Err(Error::Config(format!(
                "CA bundle namespace {ns:?} is not a namespace name (a DNS-1123 label)"
            )));
        }
        if let Some(x) = &self.xds_clients {
            let port_ok = x
                .server_uri
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !port_ok {
                return Err(Error::Config(format!(
                    "the xDS server address {:?} must be host:port",
                    x.server_uri
                )));
            }
            if x.lifetime < Duration::from_secs(60) || x.secret.is_empty() {
                return Err(Error::Config(format!(
                    "xDS client certificates need a Secret name and a lifetime of at least 1m (got {:?})",
                    x.lifetime
                )));
            }
        }
        // The CA must outlive several serving certificates and its own rotation.
        if self.ca_lifetime < self.serving_lifetime * 2
            || self.ca_lifetime / 5 <= self.propagation + Duration::from_secs(1)
        {
            return Err(Error::Config(format!(
                "the CA lifetime ({:?}) must be at least twice the serving lifetime ({:?}) and its last fifth longer than the propagation delay ({:?})",
                self.ca_lifetime, self.serving_lifetime, self.propagation
            )));
        }
        Ok(())
    }
}

/// What the issuer writes.
#[derive(Debug, Clone)]
pub struct XdsClientConfig {
    /// The Secret's name in each opted-in namespace.
    pub secret: String,
    /// The route server's xDS address as clients dial it (`host:port`), put in the bootstrap;
    /// the route server's certificate must name the host.
    pub server_uri: String,
    pub lifetime: Duration,
}

impl XdsClientConfig {
    pub fn new(server_uri: impl Into<String>) -> Self {
        XdsClientConfig {
            secret: "spur-xds".into(),
            server_uri: server_uri.into(),
            lifetime: Duration::from_secs(24 * 3600),
        }
    }
}

/// The CA that signs now (`ca.crt`/`ca.key` of Secret `name`), and the bundle of every CA to
/// trust (`bundle.crt`, else that CA alone). Pending until the certificate manager made it.
pub(crate) async fn signing_ca(secrets: &Api<Secret>, name: &str) -> Result<(Pair, String), Error> {
    let secret = secrets
        .get_opt(name)
        .await?
        .ok_or_else(|| Error::Pending(format!("the CA Secret {name}")))?;
    let data = secret.data.unwrap_or_default();
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.trim().is_empty())
    };
    match (text("ca.crt"), text("ca.key")) {
        (Some(cert), Some(key)) => {
            let bundle = text("bundle.crt").unwrap_or_else(|| cert.clone());
            Ok((Pair { cert, key }, bundle))
        }
        _ => Err(Error::Pending(format!("a CA in Secret {name}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rejects_bundle_namespaces_that_are_no_namespace_names() {
        let mut c = PkiConfig::new("spur", "spur-webhook");
        c.bundle_namespaces = vec!["voip".into(), "edge-1".into()];
        c.validate().unwrap();
        for bad in ["Voip", "-edge", "a.b", "", &"x".repeat(64)] {
            c.bundle_namespaces = vec!["voip".into(), bad.to_string()];
            assert!(c.validate().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn config_rejects_lifetimes_that_cannot_rotate() {
        let mut c = PkiConfig::new("spur", "spur-webhook");
        c.validate().unwrap();
        c.ca_lifetime = Duration::from_secs(40);
        c.serving_lifetime = Duration::from_secs(10);
        c.propagation = Duration::from_secs(2);
        c.validate().unwrap();
        c.propagation = Duration::from_secs(8);
        assert!(c.validate().is_err());
        c.propagation = Duration::from_secs(2);
        c.serving_lifetime = Duration::from_secs(30);
        assert!(c.validate().is_err());
        c.serving_names.clear();
        assert!(c.validate().is_err());
    }
}
