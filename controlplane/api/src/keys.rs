//! Label, annotation and other well-known keys the controllers put on the objects they create.
//! Selection goes through these labels and owner references, never through names.

/// The API group of every Spur resource.
pub const GROUP: &str = "spur.dev";
/// The API version of every Spur resource.
pub const VERSION: &str = "v1alpha1";

pub mod labels {
    /// The sandbox an object belongs to; the value is the sandbox name (always a valid label
    /// value: sandbox names are DNS labels).
    pub const SANDBOX: &str = "spur.dev/sandbox";
    /// The route group an object belongs to (a RoutingConfig); the value is its name.
    pub const ROUTE_GROUP: &str = "spur.dev/route-group";
    /// On IstioRoutes and GatewayAPIRoutes: the RoutingConfig that made them (its name).
    pub const ROUTING_CONFIG: &str = "spur.dev/routing-config";
    /// On derived HTTPRoutes: the GatewayAPIRoute that made them (its name).
    pub const GATEWAY_API_ROUTE: &str = "spur.dev/gateway-api-route";
    /// The routing key an object serves; keys are valid label values by construction.
    pub const ROUTING_KEY: &str = "spur.dev/routing-key";
    /// On forked objects: `names::label_value` of the baseline's name, to list the forks of a
    /// baseline within its namespace.
    pub const FORK_OF: &str = "spur.dev/fork-of";
    /// On a fork's pod template and the Services selecting it: the fork's name
    /// (`names::fork_name`), unique per fork, so sandbox Services select exactly its pods.
    pub const FORK: &str = "spur.dev/fork";
    /// On the Services and EndpointSlices of an ExternalWorkload: its name.
    pub const EXTERNAL_WORKLOAD: &str = "spur.dev/external-workload";
    /// On a sandbox resource's objects (its ObjectLifecycleMethods, work-unit pods, io context
    /// and output Secrets): the Resource's name.
    pub const RESOURCE: &str = "spur.dev/resource";
    /// On work-unit pods: their ObjectLifecycleMethods' name.
    pub const OLM: &str = "spur.dev/olm";
    /// On work-unit pods: the unit's name.
    pub const WORK_UNIT: &str = "spur.dev/work-unit";
    /// Standard `app.kubernetes.io/managed-by`, set to [`MANAGED_BY_VALUE`].
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "spur";
}

pub mod annotations {
    /// On forked objects: the baseline as `Kind/namespace/name`, for people reading the object.
    pub const BASELINE: &str = "spur.dev/baseline";
    /// On every object the operator applies: a digest of what it applied, so a pass that
    /// would apply the same again can skip the request.
    pub const DESIRED: &str = "spur.dev/desired";
    /// On a Sandbox's RoutingConfig, once the Sandbox is being deleted: when its routes' spans
    /// end (milliseconds since the Unix epoch). Written once, only by the operator, so that every
    /// operator replica and restart writes the same `untilMs` (docs/async.md).
    pub const ROUTES_END_MS: &str = "spur.dev/routes-end-ms";
}

/// Sidecar injection: how users opt pods in and out, and what the webhook records on each pod.
pub mod injection {
    /// Pod-template annotation (`"true"`/`"false"`) or namespace label (same values) that opts
    /// pods in or out. An opted-out namespace wins over a pod that opts in.
    pub const INJECT: &str = "sidecar.spur.dev/inject";
    /// Set by the webhook on every pod it sees: `injected` or `skipped`.
    pub const STATUS: &str = "sidecar.spur.dev/status";
    /// Set with `status: skipped`: why the pod was left without a sidecar.
    pub const REASON: &str = "sidecar.spur.dev/reason";
    /// Set with `status: injected`: the baseline as `Kind/namespace/name`.
    pub const BASELINE: &str = "sidecar.spur.dev/baseline";
    /// Pod-template annotation: comma-separated inbound ports the sidecar never sees.
    pub const EXCLUDE_INBOUND_PORTS: &str = "sidecar.spur.dev/exclude-inbound-ports";
    /// Pod-template annotation: comma-separated inbound ports to intercept (default `*`, all).
    pub const INBOUND_PORTS: &str = "sidecar.spur.dev/inbound-ports";
    /// Namespace annotation: comma-separated headers whose whole value is a routing key, read by
    /// the sidecars injected in that namespace besides the cluster's `routingKeys.customHeaders`.
    pub const ROUTING_HEADERS: &str = "sidecar.spur.dev/routing-headers";
    /// Namespace annotation: the query parameter carrying a routing key for the sidecars
    /// injected in that namespace, in place of the cluster's `routingKeys.queryParam`.
    pub const QUERY_PARAM: &str = "sidecar.spur.dev/query-param";
    /// Pod-template annotation: comma-separated Kafka broker ports whose connections the sidecar
    /// relays by routing key (docs/async.md), or `none`. Default: the operator's `kafkaPorts`.
    pub const KAFKA_PORTS: &str = "sidecar.spur.dev/kafka-ports";

    /// What a pod template's [`KAFKA_PORTS`] says. One reading for the webhook (which injects
    /// the relay) and the operator (which gives the forks that have one route-history spans),
    /// so the two agree on which pods relay Kafka.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum KafkaPorts<'a> {
        /// `none`: no relay, whatever the cluster's `kafkaPorts`.
        Off,
        /// Absent or empty: the cluster's `kafkaPorts` decide.
        Default,
        /// The ports as written (trimmed; the webhook parses and checks them).
        Listed(&'a str),
    }

    /// Reads [`KAFKA_PORTS`] from a pod template's annotations.
    pub fn kafka_ports(annotations: &std::collections::BTreeMap<String, String>) -> KafkaPorts<'_> {
        match annotations.get(KAFKA_PORTS).map(|s| s.trim()) {
            Some("none") => KafkaPorts::Off,
            None | Some("") => KafkaPorts::Default,
            Some(listed) => KafkaPorts::Listed(listed),
        }
    }
    /// Pod-template annotation: who programs the interception rules, `sidecar` (the sidecar
    /// itself, before it serves) or `initContainer` (`spur-init`). Default: the operator's
    /// `interception` setting.
    pub const INTERCEPTION: &str = "sidecar.spur.dev/interception";
    /// Pod-template annotation: `regular` (first app container) or `native` (a native sidecar
    /// among the init containers). Default: the operator's `placement` setting.
    pub const PLACEMENT: &str = "sidecar.spur.dev/placement";
    /// Name of the injected sidecar container (first of the app containers, or a native
    /// sidecar: an init container with `restartPolicy: Always`).
    pub const SIDECAR_CONTAINER: &str = "spur-sidecar";
    /// Name of the injected init container that programs the interception rules.
    pub const INIT_CONTAINER: &str = "spur-init";
    /// Injected pod volume with the route server's CA bundle (a ConfigMap the operator keeps
    /// in the pod's namespace).
    pub const ROUTESERVER_CA_VOLUME: &str = "spur-routeserver-ca";
    /// Injected pod volume with the sidecar's projected token for the route server.
    pub const ROUTESERVER_TOKEN_VOLUME: &str = "spur-routeserver-token";
    /// Injected pod volume with the sidecar's projected token for the traffic store.
    pub const TRAFFIC_TOKEN_VOLUME: &str = "spur-traffic-token";
}

/// The environment variable names Signadot's operator sets, which applications, job scripts
/// and resource plugins written for Signadot read. Spur sets them beside its own `SPUR_*` names
/// (docs/from-signadot.md); one list, so forks, jobs and plugins cannot drift apart.
pub mod signadot_env {
    /// Forks (Signadot's downward API), jobs, plugin steps: the sandbox's name.
    pub const SANDBOX_NAME: &str = "SIGNADOT_SANDBOX_NAME";
    /// Forks (Signadot's downward API) and plugin steps: the sandbox's routing key.
    pub const SANDBOX_ROUTING_KEY: &str = "SIGNADOT_SANDBOX_ROUTING_KEY";
    /// Jobs (the routing context's key) and forks: the routing key.
    pub const ROUTING_KEY: &str = "SIGNADOT_ROUTING_KEY";
    /// Plugin steps: the sandbox's id, which in a cluster is its routing key.
    pub const SANDBOX_ID: &str = "SIGNADOT_SANDBOX_ID";
    /// Plugin steps: the resource's name in the sandbox.
    pub const RESOURCE_NAME: &str = "SIGNADOT_RESOURCE_NAME";
}
