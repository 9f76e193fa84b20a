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
    /// The routing key an object serves; keys are valid label values by construction.
    pub const ROUTING_KEY: &str = "spur.dev/routing-key";
    /// On forked objects: `names::label_value` of the baseline's name, to list the forks of a
    /// baseline within its namespace.
    pub const FORK_OF: &str = "spur.dev/fork-of";
    /// On a fork's pod template and the Services selecting it: the fork's name
    /// (`names::fork_name`), unique per fork, so sandbox Services select exactly its pods.
    pub const FORK: &str = "spur.dev/fork";
    /// Standard `app.kubernetes.io/managed-by`, set to [`MANAGED_BY_VALUE`].
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "spur";
}

pub mod annotations {
    /// On forked objects: the baseline as `Kind/namespace/name`, for people reading the object.
    pub const BASELINE: &str = "spur.dev/baseline";
}
