//! What the hub and the agent say on a tunnel stream before its bytes flow. The agent registers
//! one reverse listener, [`AGENT_BIND`]; every stream the hub opens on it starts with an
//! [`Open`] frame from the hub and an [`Answer`] frame from the agent (`spur_tunnel`'s framing:
//! length-prefixed JSON). Raw bytes follow an `ok`.

use serde::{Deserialize, Serialize};

/// An agent's answer to [`Open::Kube`] when it runs without Kubernetes access (`--no-kube`).
pub const NO_KUBE: &str = "this agent runs without Kubernetes access";

/// The agent's reverse listener.
pub const AGENT_BIND: &str = "spur-agent";
/// Longest frame either side accepts (an `Open` carrying a user with 32 long group names fits).
pub const MAX_FRAME: usize = 16 * 1024;

/// Hub → agent: what the stream is for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Open {
    /// Connect to `host:port` inside the cluster (a preview endpoint's target).
    Tcp { host: String, port: u16 },
    /// HTTP/1.1 to the cluster's Kubernetes API, limited to what the agent's scope allows
    /// (reads of Spur's own resources), with the agent's credentials: the hub's own catalog,
    /// which resolves previews and tells the web view when to refresh. It is never shown to a
    /// user as read: what a user sees is read through [`Open::Read`].
    Kube,
    /// HTTP/1.1 lists of Spur's objects for one user (`GET` of one of [`READ_PATHS`]): the agent
    /// reads them with its own credentials and returns only the objects whose every namespace
    /// `as_user` may `list` that resource in (SubjectAccessReviews). Refused without a user.
    Read {
        #[serde(default, rename = "as")]
        as_user: KubeIdentity,
    },
    /// HTTP/1.1 to the agent's reader of the cluster's traffic store (`GET /exchanges?…`, see
    /// [`TRAFFIC_PATH`]) for one user: the agent reads only a sandbox `as_user` may `get`
    /// `sandboxes/traffic` of (SubjectAccessReviews), with its own credentials; refused
    /// without a user, or unless the agent was given a store (`spur-agent --traffic-server`).
    Traffic {
        #[serde(default, rename = "as")]
        as_user: KubeIdentity,
    },
}

/// The lists an [`Open::Read`] stream serves.
pub const READ_PATHS: [&str; 4] = [
    "/apis/spur.dev/v1alpha1/sandboxes",
    "/apis/spur.dev/v1alpha1/routegroups",
    "/apis/spur.dev/v1alpha1/routingconfigs",
    "/apis/spur.dev/v1alpha1/jobs",
];

/// The one path an [`Open::Traffic`] stream serves. Query parameters: `sandbox` (required),
/// `limit` (at most [`MAX_TRAFFIC_LIMIT`]), `path` (a prefix), `status`, `method`. The answer
/// is a protobuf `spur.traffic.v1.QueryReply`, newest exchange first.
pub const TRAFFIC_PATH: &str = "/exchanges";
/// Most exchanges one traffic read returns.
pub const MAX_TRAFFIC_LIMIT: u32 = 200;
/// Body bytes per direction in a traffic answer: the agent cuts longer ones (marking them
/// truncated), so a page of 200 exchanges stays small; the CLI reads the store for the rest.
pub const TRAFFIC_BODY_BYTES: usize = 4096;
/// Traffic reads one agent serves at once; more are refused with a 429.
pub const MAX_TRAFFIC_READS: usize = 4;
/// The content type of a traffic answer.
pub const TRAFFIC_CONTENT_TYPE: &str =
    "application/x-protobuf; messageType=spur.traffic.v1.QueryReply";

/// Agent → hub: the answer to an [`Open`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Answer {
    Ok,
    Error { reason: String },
}

/// The agent's bind metadata: who it is, for the hub's view and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub version: String,
}

/// The Kubernetes identity a request to an agent acts for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KubeIdentity {
    /// The Kubernetes user name (never empty on a request the agent serves).
    pub user: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
}
