//! Sandbox resources: `ResourcePlugin` (how to create and delete something stateful, such as a
//! database, as ordered steps run in pods), `Resource` (one plugin instance for one sandbox)
//! and `ObjectLifecycleMethods` (the workflow engine a Resource drives: its `preStart` work
//! units run before the sandbox's forks start, its `postStop` units after the sandbox is gone).
//!
//! ```text
//! Sandbox.spec.resources[] ──► Resource (cluster) ──► ObjectLifecycleMethods (cluster) ──► work-unit pods
//!        ▲                          │                        (spur-io in each pod ◄──► io context server)
//!        └── forks start once ──────┘ outputs copied into Secret <sandbox>-<resource> in each fork namespace
//! ```
//!
//! Values a step produces (a DSN, a password) live in the io context Secret and in the output
//! Secrets only: never in a spec or status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::validation::*;

/// Object names of plugins: `<plugin>` (version 0.0.0) or `<plugin>.<major>.<minor>.<patch>`,
/// so that a (plugin, version) pair is one object by construction.
pub const PLUGIN_OBJECT_NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8})[.](0|[1-9][0-9]{0,8}))?$";
/// Longest plugin object name.
pub const PLUGIN_OBJECT_NAME_MAX: usize = 100;
/// Step and work-unit names: short DNS labels (they end up in pod names).
pub const STEP_NAME_MAX: usize = 30;
/// Input and output names, as Signadot writes them.
pub const IO_NAME_PATTERN: &str = "^[a-zA-Z]([a-zA-Z0-9-]*[a-zA-Z0-9])?$";
pub const IO_NAME_MAX: usize = 63;
/// Most steps per workflow.
pub const MAX_STEPS: usize = 16;
/// Most inputs, or outputs, per step.
pub const MAX_IO: usize = 32;
/// Largest step script (bytes).
pub const STEP_SCRIPT_MAX: usize = 64 * 1024;
/// Longest path of an injected input or an exported output.
pub const IO_PATH_MAX: usize = 1024;
/// Largest value of one output (bytes): outputs are small strings (a host, a DSN), and all of
/// a resource's values share one Secret (1 MiB).
pub const OUTPUT_VALUE_MAX: usize = 64 * 1024;
/// Kept bytes of a failed step's log, for status.
pub const LOG_TAIL_MAX: usize = 2048;

/// Names work-unit pods reserve: a plugin's pod template overlay may not use them.
pub mod reserved {
    /// The emptyDir holding the spur-io binary and the step's inputs.
    pub const IO_VOLUME: &str = "spur-io";
    /// The projected ServiceAccount token (audience: the io context server).
    pub const TOKEN_VOLUME: &str = "spur-io-token";
    /// The io context server's CA bundle.
    pub const CA_VOLUME: &str = "spur-io-ca";
    /// The init container that copies spur-io in and fetches the inputs.
    pub const INIT_CONTAINER: &str = "spur-io-init";
    /// The step's container.
    pub const STEP_CONTAINER: &str = "step";
}

/// Environment every step gets (names starting with `SPUR_` are the operator's).
pub mod env {
    /// The sandbox the resource belongs to.
    pub const SANDBOX_NAME: &str = "SPUR_SANDBOX_NAME";
    /// The sandbox's routing key: a good unique suffix for database and user names.
    pub const ROUTING_KEY: &str = "SPUR_ROUTING_KEY";
    /// The resource's name in the sandbox.
    pub const RESOURCE_NAME: &str = "SPUR_RESOURCE_NAME";
    /// The step's name.
    pub const STEP_NAME: &str = "SPUR_STEP_NAME";
}

mod olm;
mod plugin;
mod resource;

pub use olm::*;
pub use plugin::*;
pub use resource::*;

#[cfg(test)]
mod tests;
