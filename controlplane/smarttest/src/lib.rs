//! Smart tests: a test written once as HTTP and gRPC requests or commands (with optional checks)
//! is sent to (run against) a sandbox and, twice, to its baseline; what the baseline's own two answers disagree on is noise,
//! and what is left of the sandbox's differences are findings, ranked and grouped per endpoint
//! (`spur_traffic_diff::findings`). The spec types here are the `SmartTest` resource's spec and
//! the file `spur test run -f` reads; the runner (feature `run`, on by default) sends them. No
//! Kubernetes client: the job executor in runner pods can link this too.

#[cfg(feature = "run")]
pub mod calls;
#[cfg(feature = "run")]
pub mod exec;
pub(crate) mod grpc;
pub mod marker;
pub mod path;
#[cfg(feature = "run")]
pub mod reflect;
#[cfg(feature = "run")]
mod render;
#[cfg(feature = "run")]
pub mod run;
mod schema;
pub mod script;
#[cfg(feature = "run")]
pub mod send;
pub mod spec;
pub mod strict;
pub mod summary;

#[cfg(feature = "run")]
pub use run::{RunReport, run};
pub use spec::{Prepared, TestSpec};

/// What goes wrong before anything is sent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The test is not one that can be run; the message names the step and the field.
    #[error("invalid test: {0}")]
    Spec(String),
    /// A step's types could not be learned by gRPC reflection; the message names the step.
    #[error("{0}")]
    Reflection(String),
    /// The run could not be prepared.
    #[error("{0}")]
    Run(String),
}
