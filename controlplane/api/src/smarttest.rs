//! `SmartTest`: a test kept in the cluster, as HTTP and gRPC requests with optional checks (the
//! steps of `spur_smarttest::spec`), which `spur test run NAME --sandbox S` sends to a sandbox
//! and twice to its baseline (docs/smart-tests.md). Namespaced: who may read it is who may read
//! the namespace's objects (`view`); who may write it, `edit`.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use spur_smarttest::spec::{MAX_STEPS, Step, TestSpec};

use crate::error::{Error, FieldError, FieldErrors};
use crate::sandbox::Sandbox;
use crate::validation::{Checker, DNS_LABEL_MAX, DNS_LABEL_PATTERN};

/// Most Services one SmartTest names.
pub const MAX_SERVICES: usize = 32;

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
// Not `deny_unknown_fields`: an object read from a cluster whose CRD is newer than this build may
// carry fields this one does not know (the apiserver keeps what its schema has), and reading it
// must not fail; a file's typo is refused by [`SmartTestSpec::from_file_value`] instead.
#[serde(rename_all = "camelCase")]
pub struct SmartTestSpec {
    /// The requests, in the order they are sent; unique names.
    #[schemars(length(min = 1, max = MAX_STEPS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub steps: Vec<Step>,
    /// The Services of this namespace the test exercises: a sandbox that forks a workload
    /// behind one of them is one the test covers (`spur test list --sandbox`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_SERVICES),
        inner(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub services: Vec<String>,
    /// The JobRunnerGroup of this namespace whose pods run the test automatically, when a
    /// sandbox it covers becomes Ready or changes (its image must have `spur`); default
    /// `smart-tests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub runner_group: Option<String>,
    /// Automatic runs also compare the calls each request causes downstream, as `spur test
    /// run --calls` does: the operator has the traffic store capture the run for the test's
    /// creator, who must be allowed what `--calls` needs (docs/smart-tests.md, "Downstream
    /// calls").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub calls: bool,
}

/// Where a run capture started for a run by someone else (an operator) is given to it: the
/// environment variable holding it ([`RunCaptureEnv`] as JSON), which `spur test run
/// --run-capture-env` reads; its token is in `SPUR_TRAFFIC_TOKEN`, where `spur`'s store
/// connection takes it.
pub const RUN_CAPTURE_ENV: &str = "SPUR_RUN_CAPTURE";

/// A run capture started for an automatic run, as its Job is given it (the store's
/// `RunCapture` without the token).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunCaptureEnv {
    pub id: String,
    pub routing_key: String,
    pub reference_key: String,
    pub marker_tag: String,
    pub namespaces: Vec<String>,
    pub watching_baselines: u32,
    pub until_unix_micros: i64,
}

/// The condition automatic runs keep on a Sandbox: the outcome of the SmartTests that cover it
/// (written by the operator's smart-test controller under its own field manager, so the Sandbox
/// controller's status writes leave it alone).
pub const TESTS_CONDITION: &str = "Tests";
/// On a SmartTest: its creator's groups (a JSON list of strings), stamped at admission beside
/// `spur.dev/created-by`, as the API server authenticated them: the SubjectAccessReviews of its
/// automatic runs ask about the user with these groups.
pub const CREATED_BY_GROUPS_ANNOTATION: &str = "spur.dev/created-by-groups";
/// Most bytes of [`CREATED_BY_GROUPS_ANNOTATION`].
pub const CREATOR_GROUPS_MAX: usize = 16 * 1024;
/// The runner group of automatic runs when a SmartTest names none.
pub const DEFAULT_RUNNER_GROUP: &str = "smart-tests";
/// On an automatic run's Job: the SmartTest it runs (its name; the Job is in its namespace).
pub const RUN_TEST_LABEL: &str = "spur.dev/smarttest";
/// On an automatic run's Job: the generation of the Sandbox it ran against.
pub const RUN_SANDBOX_GENERATION: &str = "spur.dev/sandbox-generation";
/// On an automatic run's Job: the generation of the SmartTest it ran.
pub const RUN_TEST_GENERATION: &str = "spur.dev/smarttest-generation";

impl SmartTestSpec {
    /// A spec a person wrote (a manifest's `spec`): a field this build does not know, at any
    /// depth, is refused, naming where, so a typo (`service:`) is not silently dropped.
    pub fn from_file_value(spec: serde_json::Value) -> Result<Self, serde_json::Error> {
        use serde::de::Error as _;
        if let Some(first) = spur_smarttest::strict::unknown_fields::<Self>(&spec).first() {
            return Err(serde_json::Error::custom(format!(
                "unknown field `{first}`"
            )));
        }
        serde_json::from_value(spec)
    }

    /// The test, as the runner takes it.
    pub fn test(&self) -> TestSpec {
        TestSpec {
            steps: self.steps.clone(),
        }
    }

    /// Whether the runner can run it (what the schema cannot say: URLs, header names, paths),
    /// and its services are names of Services, each once.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        if self.services.len() > MAX_SERVICES {
            c.fail(
                "spec.services",
                format!("must have at most {MAX_SERVICES} items"),
            );
        }
        for (i, name) in self.services.iter().enumerate() {
            c.dns_label(|| format!("spec.services[{i}]"), name);
            if self.services[..i].contains(name) {
                c.fail(format!("spec.services[{i}]"), "duplicate name");
            }
        }
        if let Some(g) = &self.runner_group {
            c.dns_label(|| "spec.runnerGroup".into(), g);
        }
        c.finish("SmartTest")?;
        // Every variant, named: a new one makes this a compile error, not a silent pass.
        let message = match self.test().validate() {
            Ok(_) => return Ok(()),
            Err(
                spur_smarttest::Error::Spec(m)
                | spur_smarttest::Error::Reflection(m)
                | spur_smarttest::Error::Run(m),
            ) => m,
        };
        Err(Error::Invalid {
            kind: "SmartTest",
            problems: FieldErrors(vec![FieldError {
                path: "spec".into(),
                message,
            }]),
        })
    }

    /// The runner group of its automatic runs.
    pub fn runner_group(&self) -> &str {
        self.runner_group.as_deref().unwrap_or(DEFAULT_RUNNER_GROUP)
    }

    /// Which of the test's services (in `namespace`, the test's own) the sandbox forks a
    /// workload behind, as the sandbox's status lists them (`status.forks[].services`): the test
    /// covers the sandbox when there is one. Local and virtual workloads are not counted.
    pub fn covers(&self, namespace: &str, sandbox: &Sandbox) -> Vec<String> {
        let Some(st) = &sandbox.status else {
            return Vec::new();
        };
        let mut out: Vec<String> = st
            .forks
            .iter()
            .filter(|f| f.fork_of.namespace == namespace)
            .flat_map(|f| &f.services)
            .map(|m| m.baseline_service.clone())
            .filter(|svc| self.services.contains(svc))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// What makes a Job an automatic run of a sandbox: its test's name (label) and uid (controller
/// owner).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run<'a> {
    pub test: &'a str,
    pub test_uid: &'a str,
}

/// The run `job` is of `sb`, if it is one: a Job whose controller is a SmartTest and which is
/// owned by this Sandbox (by uid, so the runs of an earlier Sandbox of the same name are not
/// this one's). The labels alone would let anyone who may submit Jobs in any namespace pass one
/// off as a run of another team's sandbox; matched against a test by namespace and uid (the
/// operator does), a forged run can only claim a test of its own namespace.
pub fn run_of<'a>(job: &'a crate::jobs::Job, sb: &Sandbox) -> Option<Run<'a>> {
    use kube::ResourceExt as _;
    let owners = job.owner_references();
    let owned = owners
        .iter()
        .any(|o| o.kind == "Sandbox" && Some(&o.uid) == sb.metadata.uid.as_ref());
    let test_uid = owners
        .iter()
        .find(|o| o.kind == "SmartTest" && o.controller == Some(true))
        .map(|o| o.uid.as_str())?;
    let test = job.labels().get(RUN_TEST_LABEL)?;
    (owned && job.labels().get(crate::keys::labels::SANDBOX) == sb.metadata.name.as_ref())
        .then_some(Run { test, test_uid })
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
        let twice: SmartTestSpec = serde_json::from_value(serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "http://api/"}}],
            "services": ["api", "Bad_Name", "api"]
        }))
        .unwrap();
        let e = twice.validate().unwrap_err().to_string();
        assert!(
            e.contains("spec.services[1]") && e.contains("spec.services[2]: duplicate name"),
            "{e}"
        );
        // A file's typo is refused, not dropped.
        let typo = serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "http://api/"}}],
            "service": ["api"]
        });
        assert!(
            SmartTestSpec::from_file_value(typo.clone())
                .unwrap_err()
                .to_string()
                .contains("unknown field `service`")
        );
        // An object of a newer cluster's CRD is read, its new fields left aside, at any depth
        // (a new kind of step, a new field of a check).
        let newer = serde_json::from_value::<SmartTestSpec>(typo).unwrap();
        assert!(newer.services.is_empty());
        let newer_step = serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "http://api/", "http3": true},
                       "browser": {"page": "/"}, "checks": [{"status": 200, "within": "1s"}]}]
        });
        let read = serde_json::from_value::<SmartTestSpec>(newer_step.clone()).unwrap();
        assert_eq!(read.steps[0].checks[0].status, Some(200));
        let e = SmartTestSpec::from_file_value(newer_step)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `steps[0].browser`"), "{e}");
    }

    #[test]
    fn a_test_covers_a_sandbox_that_forks_a_workload_behind_one_of_its_services() {
        let spec: SmartTestSpec = serde_json::from_value(serde_json::json!({
            "steps": [{"name": "a", "http": {"url": "http://api/"}}],
            "services": ["api", "grpc-api"]
        }))
        .unwrap();
        let sandbox = |forks: serde_json::Value| -> Sandbox {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
                "metadata": {"name": "s"},
                "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"}}]},
                "status": {"forks": forks}
            }))
            .unwrap()
        };
        let fork = |ns: &str, services: &[&str]| {
            serde_json::json!({
                "forkOf": {"kind": "Deployment", "namespace": ns, "name": "w"},
                "forkedWorkload": "fw",
                "services": services.iter().map(|s| serde_json::json!(
                    {"baselineService": s, "sandboxService": format!("{s}-sb")})).collect::<Vec<_>>()
            })
        };
        let both = sandbox(serde_json::json!([
            fork("shop", &["grpc-api", "api", "other"]),
            fork("shop", &["api"])
        ]));
        assert_eq!(spec.covers("shop", &both), ["api", "grpc-api"]);
        // The same Service name in another namespace is another Service.
        assert!(spec.covers("team-b", &both).is_empty());
        let elsewhere = sandbox(serde_json::json!([fork("team-b", &["api"])]));
        assert!(spec.covers("shop", &elsewhere).is_empty());
        let unrelated = sandbox(serde_json::json!([fork("shop", &["other"])]));
        assert!(spec.covers("shop", &unrelated).is_empty());
        let mut no_status = both.clone();
        no_status.status = None;
        assert!(spec.covers("shop", &no_status).is_empty());
    }
}
