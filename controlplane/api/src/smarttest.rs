//! `SmartTest`: a test kept in the cluster, as HTTP and gRPC requests with optional checks (the
//! steps of `spur_smarttest::spec`), which `spur test run NAME --sandbox S` sends to a sandbox
//! and twice to its baseline (docs/smart-tests.md). Namespaced: who may read it is who may read
//! the namespace's objects (`view`); who may write it, `edit`.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use spur_smarttest::spec::{MAX_STEPS, Step, TestSpec};

use crate::error::{Error, FieldError, FieldErrors};

/// Desired state of a smart test: its steps.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "SmartTest",
    plural = "smarttests",
    shortname = "stest",
    category = "spur",
    namespaced,
    derive = "PartialEq",
    doc = "A smart test: HTTP and gRPC requests with optional checks, sent to a sandbox and twice to its baseline; what the baseline's two answers disagree on is noise, what the sandbox changes beyond it are findings (docs/smart-tests.md).",
    printcolumn(
        name = "Steps",
        type_ = "integer",
        json_path = ".spec.steps[*].name",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct SmartTestSpec {
    /// The requests, in the order they are sent; unique names.
    #[schemars(length(min = 1, max = MAX_STEPS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub steps: Vec<Step>,
}

impl SmartTestSpec {
    /// The test, as the runner takes it.
    pub fn test(&self) -> TestSpec {
        TestSpec {
            steps: self.steps.clone(),
        }
    }

    /// Whether the runner can run it (what the schema cannot say: URLs, header names, paths).
    pub fn validate(&self) -> Result<(), Error> {
        // The one variant there is; a new one makes this a compile error, not a silent pass.
        let spur_smarttest::Error::Spec(message) = match self.test().validate() {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        Err(Error::Invalid {
            kind: "SmartTest",
            problems: FieldErrors(vec![FieldError {
                path: "spec".into(),
                message,
            }]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runner_rules_apply_to_the_resource() {
        let spec: SmartTestSpec = serde_json::from_value(serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "https://api/"}}]
        }))
        .unwrap();
        let e = spec.validate().unwrap_err().to_string();
        assert!(
            e.contains("invalid SmartTest") && e.contains("steps[0] (a): http.url"),
            "{e}"
        );
        let ok: SmartTestSpec = serde_json::from_value(serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "http://api/"}, "checks": [{"status": 200}]}]
        }))
        .unwrap();
        ok.validate().unwrap();
    }
}
