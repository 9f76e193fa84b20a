//! `spur-operator`: the controllers (on the elected leader; docs/operator.md lists them: the
//! Sandbox and its workloads', RouteGroup, RoutingConfig, EnvoyConfig and ListenerSet always; the
//! namespace enroller with `--enroll-binding` (the chart always passes it); with
//! `--resources-namespace` the resource ones, with `--access` the access ones, with
//! `--mesh-istio` / `--mesh-gateway-api` the mesh ones), the certificate
//! manager and the workstation certificate signer (on the leader), the admission webhooks (on
//! every replica), with `/metrics`, `/healthz` and `/readyz` on a small HTTP port.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Args, Parser};
use prometheus_client::registry::Registry;
use spur_bin_support::Runtime;
use tokio_util::sync::CancellationToken;

mod sweep;
mod upgrade;

/// Run the Kubernetes controllers (Sandboxes and their workloads, route groups, Envoy and L4
/// configuration, resources, access, mesh routes; docs/operator.md), the certificate manager and
/// the admission webhooks.
#[derive(Parser)]
#[command(name = "spur-operator", version)]
struct OperatorArgs {
    /// Without a command, run the controllers and the webhook.
    #[command(subcommand)]
    command: Option<OperatorCommand>,
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Address of /metrics and /healthz.
    #[arg(long, env = "SPUR_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Name of this replica in events and as lease holder (default: $POD_NAME, else the host
    /// name and process id).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
    /// The hub's preview domain (docs/hub.md): endpoints of Sandboxes and RouteGroups get
    /// their preview URLs in status. Empty: none.
    #[arg(long, env = "SPUR_PREVIEW_DOMAIN")]
    preview_domain: Option<String>,
    /// This cluster's name at the hub (`spur-hub cluster add NAME`), which qualifies preview
    /// URLs when the hub serves several clusters.
    #[arg(long, env = "SPUR_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// Run the controllers without holding the lease (only for a single replica).
    #[arg(long, env = "SPUR_NO_LEADER_ELECT")]
    no_leader_elect: bool,
    /// The operator's namespace: its leader-election Lease and its CA and webhook Secrets.
    #[arg(
        long = "namespace",
        visible_alias = "lease-namespace",
        env = "POD_NAMESPACE",
        default_value = "default"
    )]
    namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, env = "SPUR_LEASE_NAME", default_value = "spur-operator")]
    lease_name: String,
    /// The operator's own Deployment (in --namespace): made the owner of the Secrets,
    /// ConfigMap and Lease the operator creates there, so that deleting the installation
    /// deletes them. The chart sets it.
    #[arg(long, env = "SPUR_OWNER_DEPLOYMENT")]
    owner_deployment: Option<String>,
    /// A PodSpec field a fork patch may change besides the defaults (repeatable; e.g.
    /// serviceAccountName; hostPath allows hostPath volumes). docs/operator.md, "Fork policy".
    #[arg(
        long = "fork-allow-pod-field",
        env = "SPUR_FORK_ALLOW_POD_FIELDS",
        value_delimiter = ','
    )]
    fork_allow_pod_fields: Vec<String>,
    /// A container field a fork patch may change besides the defaults (repeatable; e.g.
    /// securityContext).
    #[arg(
        long = "fork-allow-container-field",
        env = "SPUR_FORK_ALLOW_CONTAINER_FIELDS",
        value_delimiter = ','
    )]
    fork_allow_container_fields: Vec<String>,
    /// Seconds the lease stays valid without renewal; a crashed leader is replaced after it.
    #[arg(long, env = "SPUR_LEASE_DURATION", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=3600))]
    lease_duration: u64,
    #[command(flatten)]
    webhook: WebhookArgs,
    #[command(flatten)]
    resources: ResourcesArgs,
    #[command(flatten)]
    mesh: MeshArgs,
    /// Run the just-in-time access controllers (docs/access.md): Exec/PodAccessTemplates and
    /// requests. Needs the chart's access rights (`access.enabled`).
    #[arg(long, env = "SPUR_ACCESS")]
    access: bool,
    /// Run SmartTests automatically against the sandboxes they cover (docs/smart-tests.md,
    /// "Automatic runs"), as Jobs. Needs the chart's smart-test rights and the jobs component.
    #[arg(long, env = "SPUR_SMART_TESTS")]
    smart_tests: bool,
    /// The traffic store SmartTests with `calls: true` capture their runs through
    /// (https://HOST:PORT; docs/smart-tests.md, "Downstream calls"). Without it such tests are
    /// not run, and their row says why.
    #[arg(long, env = "SPUR_SMART_TEST_TRAFFIC_SERVER", requires_all = ["smart_tests", "smart_test_traffic_token_file"])]
    smart_test_traffic_server: Option<String>,
    /// The CA bundle (PEM) of --smart-test-traffic-server: re-read for every call, and given to
    /// the runs' Jobs.
    #[arg(
        long,
        env = "SPUR_SMART_TEST_TRAFFIC_CA",
        requires = "smart_test_traffic_server"
    )]
    smart_test_traffic_ca: Option<PathBuf>,
    /// The operator's token for the traffic store's audience (a projected ServiceAccount token,
    /// re-read for every call).
    #[arg(
        long,
        env = "SPUR_SMART_TEST_TRAFFIC_TOKEN_FILE",
        requires = "smart_test_traffic_server"
    )]
    smart_test_traffic_token_file: Option<PathBuf>,
    /// The tunnel proxy's token namespace: tunnel grants (TunnelAccessRequests) write their
    /// token Secrets there. Without it, tunnel grants are refused with a condition.
    #[arg(long, env = "SPUR_ACCESS_TOKEN_NAMESPACE")]
    access_token_namespace: Option<String>,
    /// In every namespace labelled spur.dev/enabled=true, bind ClusterRole <role> to the
    /// ServiceAccount <account> of the operator's namespace (`<role>:<account>`, repeatable;
    /// docs/install.md, "Namespaces Spur may write in"). None: no namespace is enrolled.
    #[arg(long = "enroll-binding", value_name = "ROLE:ACCOUNT")]
    enroll_bindings: Vec<spur_operator::enroll::EnrollBinding>,
}

#[derive(clap::Subcommand)]
enum OperatorCommand {
    /// One pass of the second access sweeper (docs/access.md, "Expiry"): delete the Roles and
    /// RoleBindings of every grant whose time is up, or whose request is gone or revoked, in
    /// all namespaces, then exit. The chart's CronJob spur-access-sweeper runs it, so that
    /// grants end even while the operator is down.
    SweepAccess,
    /// What the chart's pre-upgrade hook runs before `helm upgrade` changes anything
    /// (docs/install.md, "Upgrading"): each StatefulSet named whose claim template would change
    /// (persistence turned on or off, a new size) is deleted with its pod, its claims kept, so
    /// that helm creates it anew; a larger size is first asked of the existing claim; another
    /// StorageClass for an existing claim is refused, saying what to do.
    PrepareUpgrade {
        /// The namespace of the StatefulSets (the release's).
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// One StatefulSet's claim as the new chart renders it, JSON: {"name", "value" (the
        /// chart value, for messages), "claim", "enabled", "size", "storageClassName"}
        /// (repeatable).
        #[arg(long = "statefulset", value_name = "JSON")]
        statefulsets: Vec<String>,
    },
    /// What the chart's CRD hook runs before `helm install` or `helm upgrade` changes anything
    /// (docs/install.md, "Upgrading"; helm never upgrades a chart's CRDs): applies the CRDs this
    /// binary was built with (server-side), takes them over from other field managers, waits
    /// until each is served, and migrates the objects of any CRD
    /// whose stored versions include one other than its storage version, so that a later
    /// release may drop that version. A CRD that drops a version objects may still be stored
    /// in is refused before anything changed.
    ApplyCrds,
}

/// Mesh modes (docs/mesh.md): routing keys' routes written into Istio VirtualServices and/or
/// Gateway API HTTPRoutes, for clusters that route with a mesh instead of Spur's sidecar.
#[derive(Args)]
struct MeshArgs {
    /// Keep routes for each sandboxed Service in the Istio VirtualServices that name it
    /// (IstioRoutes; needs Istio's CRDs and the chart's mesh.istio rights).
    #[arg(long, env = "SPUR_MESH_ISTIO")]
    mesh_istio: bool,
    /// Keep derived HTTPRoutes beside the Gateway API HTTPRoutes that send to each sandboxed
    /// Service (GatewayAPIRoutes; needs Gateway API's CRDs and the chart's mesh.gatewayAPI
    /// rights).
    #[arg(long, env = "SPUR_MESH_GATEWAY_API")]
    mesh_gateway_api: bool,
    /// The cluster's DNS domain, for the sandbox Service names written into VirtualServices.
    #[arg(
        long,
        env = "SPUR_MESH_CLUSTER_DOMAIN",
        default_value = "cluster.local"
    )]
    mesh_cluster_domain: String,
}

impl MeshArgs {
    /// The mesh routes match the carriers of the injection config too.
    fn config(
        &self,
        injection: &spur_operator::InjectionConfig,
    ) -> Result<spur_operator::MeshConfig> {
        let cfg = spur_operator::MeshConfig {
            istio: self.mesh_istio,
            gateway_api: self.mesh_gateway_api,
            cluster_domain: self.mesh_cluster_domain.clone(),
            routing_keys: injection.routing_keys.clone(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Sandbox resources (docs/resources.md).
#[derive(Args)]
struct ResourcesArgs {
    /// Namespace the steps of sandbox resources run in (a namespace of their own, with no
    /// Spur secrets). Empty: sandbox resources are not enabled.
    #[arg(long, env = "SPUR_RESOURCES_NAMESPACE", default_value = "")]
    resources_namespace: String,
    /// ServiceAccount of step pods (it needs no RBAC rights).
    #[arg(
        long,
        env = "SPUR_RESOURCES_SERVICE_ACCOUNT",
        default_value = "spur-resource-runner"
    )]
    resources_service_account: String,
    /// Spur's image (with spur-io), for the step pods' init container.
    #[arg(long, env = "SPUR_RESOURCES_IO_IMAGE", default_value = "")]
    resources_io_image: String,
    #[arg(long, env = "SPUR_RESOURCES_IO_PULL_POLICY")]
    resources_io_pull_policy: Option<String>,
    /// The io context server's URL (default: https://spur-ics.<namespace>.svc:8443).
    #[arg(long, env = "SPUR_RESOURCES_ICS_URL")]
    resources_ics_url: Option<String>,
    /// The namespace of the io context Secrets (nothing else lives there).
    #[arg(
        long,
        env = "SPUR_RESOURCES_CONTEXT_NAMESPACE",
        default_value = "spur-io-contexts"
    )]
    resources_context_namespace: String,
    /// The CA bundle ConfigMap (key ca.crt) the step pods trust the io context server with.
    #[arg(
        long,
        env = "SPUR_RESOURCES_CA_CONFIG_MAP",
        default_value = "spur-ca-bundle"
    )]
    resources_ca_config_map: String,
    /// First wait after a failed delete step (doubles per attempt).
    #[arg(long, env = "SPUR_RESOURCES_RETRY_BASE", default_value = "10s", value_parser = spur_runtime::parse_duration)]
    resources_retry_base: Duration,
    /// Longest wait between attempts of a failing delete step.
    #[arg(long, env = "SPUR_RESOURCES_RETRY_MAX", default_value = "5m", value_parser = spur_runtime::parse_duration)]
    resources_retry_max: Duration,
    /// Also issue the io context server's serving certificate into this kubernetes.io/tls
    /// Secret (empty: provided some other way, or no io context server).
    #[arg(long, env = "SPUR_ICS_SECRET", default_value = "")]
    ics_secret: String,
}

impl ResourcesArgs {
    fn config(&self, namespace: &str) -> Result<Option<spur_operator::ResourceConfig>> {
        if self.resources_namespace.is_empty() {
            return Ok(None);
        }
        let cfg = spur_operator::ResourceConfig {
            namespace: self.resources_namespace.clone(),
            service_account: self.resources_service_account.clone(),
            io_image: self.resources_io_image.clone(),
            io_pull_policy: self
                .resources_io_pull_policy
                .clone()
                .filter(|p| !p.is_empty()),
            ics_url: self
                .resources_ics_url
                .clone()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| format!("https://spur-ics.{namespace}.svc:8443")),
            ics_namespace: self.resources_context_namespace.clone(),
            ca_config_map: self.resources_ca_config_map.clone(),
            operator_namespace: namespace.to_string(),
            retry_base: self.resources_retry_base,
            retry_max: self.resources_retry_max,
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

#[derive(Args)]
struct WebhookArgs {
    /// Address of the sidecar-injection webhook (HTTPS, POST /mutate-v1-pod).
    #[arg(long, env = "SPUR_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    webhook_addr: SocketAddr,
    /// Run neither the webhook nor the certificate manager.
    #[arg(long, env = "SPUR_NO_WEBHOOK")]
    no_webhook: bool,
    /// Injection settings (YAML: images, route server, ports, uid, resources); see
    /// docs/injection.md. Defaults apply to anything left out.
    #[arg(long, env = "SPUR_INJECTION_CONFIG")]
    injection_config: Option<PathBuf>,
    /// Service in front of the webhook; its cluster DNS names go into the serving certificate.
    #[arg(long, env = "SPUR_WEBHOOK_SERVICE", default_value = "spur-webhook")]
    webhook_service: String,
    /// Extra names (DNS or IP) for the serving certificate (repeatable).
    #[arg(
        long = "webhook-cert-name",
        env = "SPUR_WEBHOOK_CERT_NAMES",
        value_delimiter = ','
    )]
    webhook_cert_names: Vec<String>,
    /// The MutatingWebhookConfiguration whose caBundle the operator keeps current.
    #[arg(
        long,
        env = "SPUR_WEBHOOK_CONFIGURATION",
        default_value = "spur-sidecar-injector"
    )]
    webhook_configuration: String,
    /// The ValidatingWebhookConfiguration (EnvoyConfig validation) whose caBundle the operator
    /// keeps current too; empty: none.
    #[arg(
        long,
        env = "SPUR_ENVOYCONFIG_WEBHOOK_CONFIGURATION",
        default_value = "spur-envoyconfig-validator"
    )]
    envoyconfig_webhook_configuration: String,
    /// Secret holding the operator's CA.
    #[arg(long, env = "SPUR_CA_SECRET", default_value = "spur-ca")]
    ca_secret: String,
    /// Secret holding the webhook's serving certificate.
    #[arg(long, env = "SPUR_WEBHOOK_SECRET", default_value = "spur-webhook-tls")]
    serving_secret: String,
    /// Lifetime of the CA (renewed at 80 %).
    #[arg(long, env = "SPUR_CA_LIFETIME", default_value = "8760h", value_parser = spur_runtime::parse_duration)]
    ca_lifetime: Duration,
    /// Lifetime of the serving certificate (renewed at 80 %).
    #[arg(long, env = "SPUR_SERVING_CERT_LIFETIME", default_value = "720h", value_parser = spur_runtime::parse_duration)]
    serving_cert_lifetime: Duration,
    /// How long a new CA is trusted (in the caBundle and the sidecars' CA bundle ConfigMaps)
    /// before it signs serving certificates: longer than the kubelet takes to refresh a
    /// mounted ConfigMap.
    #[arg(long, env = "SPUR_CA_PROPAGATION", default_value = "180s", value_parser = spur_runtime::parse_duration)]
    ca_propagation: Duration,
    /// Also issue the tunnel proxy's serving certificate into this kubernetes.io/tls Secret
    /// (empty: the Secret is provided some other way, e.g. by cert-manager).
    #[arg(long, env = "SPUR_TUNNEL_PROXY_SECRET", default_value = "")]
    tunnel_proxy_secret: String,
    /// Names (DNS or IP) the tunnel proxy's certificate carries besides its Service's cluster
    /// names: the address workstations connect to (repeatable).
    #[arg(
        long = "tunnel-proxy-cert-name",
        env = "SPUR_TUNNEL_PROXY_CERT_NAMES",
        value_delimiter = ','
    )]
    tunnel_proxy_cert_names: Vec<String>,
    /// Also issue the route server's serving certificate into this kubernetes.io/tls Secret
    /// (empty: the Secret is provided some other way).
    #[arg(long, env = "SPUR_ROUTESERVER_SECRET", default_value = "")]
    routeserver_secret: String,
    /// Also issue the traffic store's serving certificate (Service `spur-traffic`) into this
    /// kubernetes.io/tls Secret (empty: no traffic store, or provided some other way).
    #[arg(long, env = "SPUR_TRAFFIC_SECRET", default_value = "")]
    traffic_secret: String,
    /// Names (DNS or IP) the route server's certificate carries besides its Service's cluster
    /// names (repeatable).
    #[arg(
        long = "routeserver-cert-name",
        env = "SPUR_ROUTESERVER_CERT_NAMES",
        value_delimiter = ','
    )]
    routeserver_cert_names: Vec<String>,
    /// ConfigMap in which the CA bundle is published for workstations (`spur local cert`
    /// reads it); empty: not published.
    #[arg(
        long,
        env = "SPUR_CA_BUNDLE_CONFIG_MAP",
        default_value = "spur-ca-bundle"
    )]
    ca_bundle_config_map: String,
    /// Namespaces that get a copy of the route server's CA bundle ConfigMap (the injection
    /// config's routeserverCaConfigMap) without an injected pod: the chart's L4 gateway
    /// namespaces (repeatable). The copy is created when missing and kept current.
    #[arg(
        long = "ca-bundle-namespace",
        env = "SPUR_CA_BUNDLE_NAMESPACES",
        value_delimiter = ','
    )]
    ca_bundle_namespaces: Vec<String>,
    /// Lifetime of a workstation client certificate whose request asks for none.
    #[arg(long, env = "SPUR_WORKSTATION_CERT_LIFETIME", default_value = "24h", value_parser = spur_runtime::parse_duration)]
    workstation_cert_lifetime: Duration,
    /// The longest a workstation client certificate is issued for (there is no revocation:
    /// a short maximum bounds how long a lost laptop's certificate works).
    #[arg(long, env = "SPUR_WORKSTATION_CERT_MAX_LIFETIME", default_value = "168h", value_parser = spur_runtime::parse_duration)]
    workstation_cert_max_lifetime: Duration,
    /// The route server's xDS address as clients dial it (`host:port`): namespaces labelled
    /// `spur.dev/xds=enabled` get a client certificate and a grpc-go bootstrap for it in
    /// Secret --xds-client-secret (docs/xds.md). Empty: none are issued.
    #[arg(long, env = "SPUR_XDS_SERVER_URI", default_value = "")]
    xds_server_uri: String,
    /// The Secret an opted-in namespace gets its xDS client credentials in.
    #[arg(long, env = "SPUR_XDS_CLIENT_SECRET", default_value = "spur-xds")]
    xds_client_secret: String,
    /// Lifetime of an xDS client certificate (renewed at 80 %).
    #[arg(long, env = "SPUR_XDS_CLIENT_CERT_LIFETIME", default_value = "24h", value_parser = spur_runtime::parse_duration)]
    xds_client_cert_lifetime: Duration,
}

impl WebhookArgs {
    /// The injection config (`--injection-config`, else the defaults), validated.
    fn injection(&self, namespace: &str) -> Result<spur_operator::InjectionConfig> {
        let mut injection: spur_operator::InjectionConfig = match &self.injection_config {
            None => spur_operator::InjectionConfig::default(),
            Some(path) => {
                let bytes = std::fs::read(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                serde_yaml_ng::from_slice(&bytes)
                    .with_context(|| format!("invalid injection config {}", path.display()))?
            }
        };
        if !injection.system_namespaces.iter().any(|n| n == namespace) {
            injection.system_namespaces.push(namespace.to_string());
        }
        injection.validate()?;
        Ok(injection)
    }

    fn configs(
        &self,
        namespace: &str,
        ics_secret: &str,
    ) -> Result<(spur_operator::PkiConfig, spur_operator::WebhookConfig)> {
        let mut pki = spur_operator::PkiConfig::new(namespace, &self.webhook_service);
        pki.ca_secret.clone_from(&self.ca_secret);
        pki.serving_secret.clone_from(&self.serving_secret);
        pki.webhook_configuration
            .clone_from(&self.webhook_configuration);
        pki.validating_webhook_configuration = (!self.envoyconfig_webhook_configuration.is_empty())
            .then(|| self.envoyconfig_webhook_configuration.clone());
        pki.serving_names.extend(
            self.webhook_cert_names
                .iter()
                .filter(|n| !n.is_empty())
                .cloned(),
        );
        pki.ca_lifetime = self.ca_lifetime;
        pki.serving_lifetime = self.serving_cert_lifetime;
        pki.propagation = self.ca_propagation;
        if !self.tunnel_proxy_secret.is_empty() {
            let mut tunnel =
                spur_operator::ServingCert::tunnel_proxy(namespace, &self.tunnel_proxy_cert_names);
            tunnel.secret.clone_from(&self.tunnel_proxy_secret);
            pki.tunnel_proxy = Some(tunnel);
        }
        if !ics_secret.is_empty() {
            let mut ics = spur_operator::ServingCert::ics(namespace);
            ics.secret = ics_secret.to_string();
            pki.ics = Some(ics);
        }
        if !self.traffic_secret.is_empty() {
            let mut traffic = spur_operator::ServingCert::traffic(namespace);
            traffic.secret.clone_from(&self.traffic_secret);
            pki.traffic = Some(traffic);
        }
        if !self.routeserver_secret.is_empty() {
            let mut rs =
                spur_operator::ServingCert::routeserver(namespace, &self.routeserver_cert_names);
            rs.secret.clone_from(&self.routeserver_secret);
            pki.routeserver = Some(rs);
        }
        pki.bundle_config_map =
            (!self.ca_bundle_config_map.is_empty()).then(|| self.ca_bundle_config_map.clone());
        pki.bundle_namespaces = self
            .ca_bundle_namespaces
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        pki.workstation_cert_lifetime = self.workstation_cert_lifetime;
        pki.workstation_cert_max_lifetime = self.workstation_cert_max_lifetime;
        if !self.xds_server_uri.is_empty() {
            pki.xds_clients = Some(spur_operator::XdsClientConfig {
                secret: self.xds_client_secret.clone(),
                server_uri: self.xds_server_uri.clone(),
                lifetime: self.xds_client_cert_lifetime,
            });
        }
        pki.validate()?;
        let injection = self.injection(namespace)?;
        pki.namespace_bundle = (!injection.routeserver_ca_config_map.is_empty())
            .then(|| injection.routeserver_ca_config_map.clone());
        if pki.namespace_bundle.is_none() && !pki.bundle_namespaces.is_empty() {
            anyhow::bail!(
                "--ca-bundle-namespace needs the injection config's routeserverCaConfigMap (the ConfigMap to copy)"
            );
        }
        let webhook = spur_operator::WebhookConfig {
            addr: self.webhook_addr,
            namespace: namespace.to_string(),
            serving_secret: self.serving_secret.clone(),
            injection,
        };
        Ok((pki, webhook))
    }
}

/// The features the flags turn on, added to `ctx`.
fn with_features(
    mut ctx: spur_operator::Context,
    args: &OperatorArgs,
    resources: Option<spur_operator::ResourceConfig>,
) -> Result<spur_operator::Context> {
    if let Some(domain) = args.preview_domain.clone().filter(|d| !d.is_empty()) {
        ctx = ctx.with_previews(spur_operator::Previews {
            domain,
            cluster: args.cluster_name.clone().filter(|c| !c.is_empty()),
        });
    }
    if args.access {
        ctx = ctx.with_access();
    }
    if args.smart_tests {
        ctx = ctx.with_smart_tests();
    }
    if let (Some(server), Some(token_file)) = (
        args.smart_test_traffic_server.clone(),
        args.smart_test_traffic_token_file.clone(),
    ) {
        let store = spur_operator::smarttests::store::StoreConfig {
            server,
            ca_file: args.smart_test_traffic_ca.clone(),
            token_file,
        };
        store
            .validate()
            .map_err(|e| anyhow::anyhow!("--smart-test-traffic-server: {e}"))?;
        ctx = ctx.with_smart_test_calls(store);
    }
    if let Some(ns) = args
        .access_token_namespace
        .clone()
        .filter(|n| !n.is_empty())
    {
        ctx = ctx.with_access_tokens(ns);
    }
    if let Some(r) = resources {
        ctx = ctx.with_resources(r);
    }
    if !args.enroll_bindings.is_empty() {
        ctx = ctx.with_enrollment(spur_operator::enroll::EnrollConfig {
            namespace: args.namespace.clone(),
            bindings: args.enroll_bindings.clone(),
        });
    }
    Ok(ctx)
}

async fn run(args: OperatorArgs) -> Result<ExitCode> {
    // Before anything listens: a SIGTERM from then on shuts down cleanly.
    let shutdown = spur_runtime::shutdown_signal();
    // Configuration errors first, before anything connects.
    let fork_policy = spur_operator::ForkPolicy::with_extra(
        &args.fork_allow_pod_fields,
        &args.fork_allow_container_fields,
    )?;
    let mut configs = if args.webhook.no_webhook {
        None
    } else {
        Some(
            args.webhook
                .configs(&args.namespace, &args.resources.ics_secret)?,
        )
    };
    let resources = args.resources.config(&args.namespace)?;
    // Read even without the webhook (another replica's may inject with the same config): a
    // fork relays Kafka by default when it sets Kafka ports, and the mesh routes match the
    // routing-key carriers the injected sidecars read.
    let injection = match &configs {
        Some((_, webhook)) => webhook.injection.clone(),
        None => args.webhook.injection(&args.namespace)?,
    };
    let kafka_by_default = !injection.kafka_ports.is_empty();
    let mesh = args.mesh.config(&injection)?;
    let client = spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?;
    // Fail fast with a clear message when the API server is unreachable or refuses us.
    client
        .apiserver_version()
        .await
        .context("cannot reach the Kubernetes API server")?;
    let owner = match args.owner_deployment.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(name) => Some(
            spur_operator::owner::deployment_owner(client.clone(), &args.namespace, name)
                .await
                .context("cannot look up the operator's own Deployment")?,
        ),
    };
    if let Some((pki, _)) = configs.as_mut() {
        pki.owner = owner.clone();
    }
    let mut registry = Registry::with_prefix("spur_operator");
    let metrics = spur_operator::Metrics::register(&mut registry);
    let instance = args
        .instance
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "spur-operator".into());
            format!("{host}-{}", std::process::id())
        });
    let ctx = spur_operator::Context::new(client.clone(), Some(instance.clone()), metrics.clone())
        .with_fork_policy(fork_policy)
        .with_kafka_by_default(kafka_by_default)
        .with_mesh(mesh);
    let mut ctx = with_features(ctx, &args, resources)?;
    let stop = CancellationToken::new();
    let mut webhook = None;
    if let Some((pki, webhook_cfg)) = configs {
        ctx = ctx.with_pki(pki);
        webhook = Some(
            spur_operator::Webhook::start(client.clone(), webhook_cfg, metrics, stop.clone())
                .await?,
        );
    }
    let ctx = Arc::new(ctx);
    // Ready once the webhook can answer the API server (it has a serving certificate).
    let ready: Arc<dyn Fn() -> bool + Send + Sync> = match &webhook {
        Some(w) => Arc::new(w.readiness()),
        None => Arc::new(|| true),
    };

    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let stop_controllers = stop.clone();
    let http_stop = stop.clone();
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        Some((ready, "waiting for the webhook serving certificate\n")),
        http_stop,
    ));
    let election = (!args.no_leader_elect).then(|| spur_operator::LeaderElection {
        namespace: args.namespace.clone(),
        lease: args.lease_name.clone(),
        identity: instance,
        duration_secs: args.lease_duration,
        grace_secs: (args.lease_duration / 3).max(1),
        owner,
    });
    let controllers = tokio::spawn(spur_operator::run_as(
        client,
        ctx,
        stop_controllers,
        election,
    ));
    tracing::info!(metrics = %args.metrics_addr, webhook = ?webhook.as_ref().map(|w| w.local_addr()), "operator started");
    let mut controllers = controllers;
    let early = tokio::select! {
        () = shutdown => None,
        r = &mut controllers => Some(r),
    };
    tracing::info!("shutting down: finishing in-flight reconciles");
    stop.cancel();
    let result = match early {
        Some(r) => r,
        None => controllers.await,
    };
    result
        .context("controllers panicked")?
        .context("the controllers stopped")?;
    if let Some(w) = webhook {
        w.stopped().await;
    }
    http.await.context("metrics server panicked")??;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = OperatorArgs::parse();
    match args.command {
        Some(OperatorCommand::SweepAccess) => spur_bin_support::run(
            "spur-operator",
            "info",
            Runtime::MultiThread,
            sweep::sweep_access(args.kubeconfig),
        ),
        Some(OperatorCommand::PrepareUpgrade {
            namespace,
            statefulsets,
        }) => spur_bin_support::run(
            "spur-operator",
            "info",
            Runtime::MultiThread,
            upgrade::prepare_upgrade(args.kubeconfig, namespace, statefulsets),
        ),
        Some(OperatorCommand::ApplyCrds) => spur_bin_support::run(
            "spur-operator",
            "info",
            Runtime::MultiThread,
            upgrade::apply_crds(args.kubeconfig),
        ),
        None => spur_bin_support::run("spur-operator", "info", Runtime::MultiThread, run(args)),
    }
}
