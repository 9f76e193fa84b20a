//! What a run is: which SmartTests a Sandbox's generation calls for, the Job each one runs as,
//! and the questions asked of the test's creator first. Pure: the reconcile applies them.

use std::collections::BTreeMap;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use spur_api::Sandbox;
use spur_api::jobs::{InjectRoutingKey, Job, JobSpec, RoutingContext, SCRIPT_MAX};
use spur_api::keys::labels::{MANAGED_BY, MANAGED_BY_VALUE, SANDBOX};
use spur_api::smarttest::{
    CREATED_BY_GROUPS_ANNOTATION, RUN_CAPTURE_ENV, RUN_SANDBOX_GENERATION, RUN_TEST_GENERATION,
    RUN_TEST_LABEL, RunCaptureEnv, SmartTest, TESTS_CONDITION,
};
use spur_api::workstation::CREATED_BY_ANNOTATION;

/// Where a run's summary is written in the runner container: one file per Job, so a reused
/// runner pod never hands a run the summary of the run before it.
pub fn result_path(job: &str) -> String {
    format!("/tmp/spur-smarttest-{job}.json")
}

/// The generation of `sb` that runs are due for: its current one, once the Sandbox controller
/// has seen it and says Ready. `None` while it converges (or is going away).
pub fn ready_generation(sb: &Sandbox) -> Option<i64> {
    let st = sb.status.as_ref()?;
    let generation = sb.meta().generation?;
    let ready = st
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    (ready && st.observed_generation == Some(generation) && sb.meta().deletion_timestamp.is_none())
        .then_some(generation)
}

/// The name of the Job that runs `test` against generation `generation` of `sb`: the test's
/// name and a digest of both objects' identities and generations, so a new generation of either
/// is a new run and a re-created object is never mistaken for the old one. SHA-256, not the
/// standard library's hasher (whose output may change with the compiler): an operator built
/// by another release names the same run the same and does not run it again.
pub fn job_name(test: &SmartTest, sb: &Sandbox, generation: i64) -> String {
    let identity = format!(
        "{}/{generation}/{}/{}",
        sb.uid().unwrap_or_default(),
        test.uid().unwrap_or_default(),
        test.meta().generation.unwrap_or(0)
    );
    let digest = spur_api::digest::sha256_hex(identity.as_bytes());
    let mut base = test.name_any();
    // 40 + '-' + 10 hex digits: within a DNS label's 63.
    base.truncate(40);
    let base = base.trim_end_matches('-');
    format!("{base}-{}", &digest[..10])
}

/// The script a run's Job runs: the test's steps as JSON on standard input of `spur test run`,
/// with the sandbox's key from the job's environment, and the summary written where the Job's
/// `resultPath` reads it. Script steps run (`--allow-scripts`): the runner pod is where the
/// test's creator (whose right to create Jobs there was checked) meant them to run. The steps are one line of JSON (strings keep their newlines escaped),
/// so no line of them can end the here-document.
pub fn script(
    test: &SmartTest,
    job: &str,
    capture: Option<&GivenCapture>,
) -> Result<String, String> {
    let steps = serde_json::to_string(&test.spec.test())
        .map_err(|e| format!("the steps cannot be written as JSON: {e}"))?;
    // Only a test that has script steps needs the flag: a runner image with an older `spur`,
    // which does not know it, still runs every other test.
    let scripts = test.spec.steps.iter().any(|s| s.script.is_some());
    let result = result_path(job);
    let (setup, calls) = match capture {
        Some(c) => c.script_parts(job)?,
        None => (String::new(), String::new()),
    };
    let text = format!(
        "#!/bin/sh\n\
         # SmartTest {ns}/{name} (generation {generation}), an automatic run (docs/smart-tests.md).\n\
         rm -f '{result}'\n\
         {setup}\
         exec spur test run -f - --key \"$SPUR_ROUTING_KEY\"{allow}{calls} --summary-file '{result}' <<'SPUR_SMART_TEST_END'\n\
         {steps}\n\
         SPUR_SMART_TEST_END\n",
        ns = test.namespace().unwrap_or_default(),
        name = test.name_any(),
        generation = test.meta().generation.unwrap_or_default(),
        allow = if scripts { " --allow-scripts" } else { "" },
    );
    if text.len() > SCRIPT_MAX {
        return Err(format!(
            "its steps are {} bytes as JSON, more than a Job's script may hold ({} KiB): a test this large (descriptor sets?) runs only by hand, with spur test run",
            steps.len(),
            SCRIPT_MAX / 1024
        ));
    }
    Ok(text)
}

/// A run capture the operator started at the traffic store for a run of a test with `calls`
/// (for its creator): what the run's Job is given to read it back with.
#[derive(Clone)]
pub struct GivenCapture {
    pub run: RunCaptureEnv,
    /// The run's own token (ReadRun and EndRunCapture of this run only).
    pub token: String,
    /// The store, `https://HOST:PORT` (or `http://` behind the store's plaintext opt-in).
    pub server: String,
    /// The CA bundle (PEM) the store's certificate chains to, for https.
    pub ca_pem: Option<String>,
}

/// Never the token.
impl std::fmt::Debug for GivenCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GivenCapture")
            .field("run", &self.run.id)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl GivenCapture {
    /// The script's lines before `spur test run` (the store's CA bundle written to a file, the
    /// capture and the token exported where `spur` reads them; `SPUR_*` names, which `spur`
    /// keeps from the steps' scripts), and the flags after it.
    fn script_parts(&self, job: &str) -> Result<(String, String), String> {
        let json = serde_json::to_string(&self.run)
            .map_err(|e| format!("the run capture cannot be written as JSON: {e}"))?;
        if self.token.is_empty() || !self.token.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err("the traffic store gave the run capture no usable token".into());
        }
        let mut setup = format!(
            "export {env}={json}\nexport SPUR_TRAFFIC_TOKEN='{token}'\n",
            env = RUN_CAPTURE_ENV,
            json = sh_quote(&json),
            token = self.token,
        );
        let mut flags = format!(
            " --run-capture-env {RUN_CAPTURE_ENV} --server {}",
            sh_quote(&self.server)
        );
        if let Some(pem) = &self.ca_pem {
            if pem.lines().any(|l| l.trim() == "SPUR_CA_END") {
                return Err(
                    "the traffic store's CA bundle cannot be written into the script".into(),
                );
            }
            let path = format!("/tmp/spur-traffic-ca-{job}.crt");
            setup.push_str(&format!(
                "cat > '{path}' <<'SPUR_CA_END'\n{}\nSPUR_CA_END\n",
                pem.trim_end()
            ));
            flags.push_str(&format!(" --ca '{path}'"));
        }
        Ok((setup, flags))
    }
}

/// `value` in single quotes for sh.
fn sh_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// How long a run of `test` captures, at most: four times each step's timeout (a step is sent
/// three or four times), a minute, and [`QUEUE_SLACK`] for the Job to reach a runner pod;
/// within the store's 30 minutes.
pub fn capture_seconds(test: &SmartTest) -> u32 {
    use spur_smarttest::spec::{DEFAULT_SCRIPT_TIMEOUT, DEFAULT_TIMEOUT};
    let steps: u64 = test
        .spec
        .steps
        .iter()
        .map(|s| {
            let default = if s.script.is_some() {
                DEFAULT_SCRIPT_TIMEOUT
            } else {
                DEFAULT_TIMEOUT
            };
            4 * s.timeout_seconds.map_or(default.as_secs(), u64::from)
        })
        .sum();
    let wanted = steps + 60 + QUEUE_SLACK.as_secs();
    u32::try_from(wanted)
        .unwrap_or(u32::MAX)
        .min(MAX_CAPTURE_SECONDS)
}

/// What [`capture_seconds`] allows a Job to wait for a runner pod.
pub const QUEUE_SLACK: std::time::Duration = std::time::Duration::from_secs(300);
/// The longest run capture the traffic store grants.
pub const MAX_CAPTURE_SECONDS: u32 = 1800;

fn owner_of<K: Resource<DynamicType = ()>>(obj: &K, controller: bool) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: K::api_version(&()).into_owned(),
        kind: K::kind(&()).into_owned(),
        name: obj.meta().name.clone()?,
        uid: obj.meta().uid.clone()?,
        controller: controller.then_some(true),
        block_owner_deletion: None,
    })
}

/// The Job that runs `test` against generation `generation` of `sb`, in the test's namespace:
/// owned by the test (its controller) and by the Sandbox, so deleting either deletes its runs.
/// `Err` says why the test cannot run automatically.
pub fn run_job(
    test: &SmartTest,
    sb: &Sandbox,
    generation: i64,
    capture: Option<&GivenCapture>,
) -> Result<Job, String> {
    let name = job_name(test, sb, generation);
    let script = script(test, &name, capture)?;
    let (Some(test_owner), Some(sb_owner)) = (owner_of(test, true), owner_of(sb, false)) else {
        return Err("the SmartTest or the Sandbox has no uid yet".into());
    };
    let labels = BTreeMap::from([
        (RUN_TEST_LABEL.to_owned(), test.name_any()),
        (SANDBOX.to_owned(), sb.name_any()),
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
    ]);
    let annotations = BTreeMap::from([
        (RUN_SANDBOX_GENERATION.to_owned(), generation.to_string()),
        (
            RUN_TEST_GENERATION.to_owned(),
            test.meta().generation.unwrap_or_default().to_string(),
        ),
    ]);
    Ok(Job {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: test.namespace(),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![test_owner, sb_owner]),
            ..Default::default()
        },
        spec: JobSpec {
            runner_group: test.spec.runner_group().to_owned(),
            script: Some(script),
            command: None,
            env: Vec::new(),
            routing_context: Some(RoutingContext {
                sandbox: Some(sb.name_any()),
                route_group: None,
            }),
            timeout: None,
            artifacts: Vec::new(),
            canceled: false,
            // The run sends the key itself, and must not send it to the baseline.
            inject_routing_key: InjectRoutingKey::Disabled,
            result_path: Some(result_path(&name)),
        },
        status: None,
    })
}

/// One question for the API server's authorizer about a test's creator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: Option<&'static str>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl Question {
    /// `create jobs.spur.dev in shop`, for a refusal's message.
    pub fn describe(&self) -> String {
        let resource = match self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.to_owned(),
        };
        let resource = if self.group.is_empty() {
            resource
        } else {
            format!("{resource}.{}", self.group)
        };
        let name = self
            .name
            .as_deref()
            .map(|n| format!(" {n}"))
            .unwrap_or_default();
        match &self.namespace {
            Some(ns) => format!("{} {resource}{name} in {ns}", self.verb),
            None => format!("{} {resource}{name}", self.verb),
        }
    }

    /// The SubjectAccessReview that asks it for `user` with `groups`.
    pub fn review(&self, user: &str, groups: &[String]) -> SubjectAccessReview {
        SubjectAccessReview {
            metadata: ObjectMeta::default(),
            spec: SubjectAccessReviewSpec {
                user: Some(user.to_owned()),
                groups: (!groups.is_empty()).then(|| groups.to_vec()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(self.verb.into()),
                    group: Some(self.group.into()),
                    resource: Some(self.resource.into()),
                    subresource: self.subresource.map(Into::into),
                    namespace: self.namespace.clone(),
                    name: self.name.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            status: None,
        }
    }
}

/// What the creator of a test in `namespace` must be allowed for it to run against `sb`: a
/// test runs only in sandboxes its creator could have created (docs/operator.md, "Who may fork
/// what": Deployments and Services in every namespace the sandbox touches), with a key its
/// creator could read (`get` on the Sandbox, as `spur test run --sandbox` needs by hand), as a
/// Job its creator could have submitted. A test with `calls` also needs what `spur test run
/// --calls` needs: `update` on the sandbox's `sandboxes/capture` and `get` on its
/// `sandboxes/traffic` (the traffic store asks again, of the same user, when the run starts).
pub fn questions(namespace: &str, sb: &Sandbox, calls: bool) -> Vec<Question> {
    let mut out = vec![
        Question {
            verb: "create",
            group: "spur.dev",
            resource: "jobs",
            subresource: None,
            namespace: Some(namespace.to_owned()),
            name: None,
        },
        Question {
            verb: "get",
            group: "spur.dev",
            resource: "sandboxes",
            subresource: None,
            namespace: None,
            name: Some(sb.name_any()),
        },
    ];
    let mut namespaces: Vec<&str> = sb
        .spec
        .forks
        .iter()
        .map(|f| f.fork_of.namespace.as_str())
        .chain(sb.spec.local.iter().map(|l| l.from.namespace.as_str()))
        .chain(
            sb.spec
                .virtual_workloads
                .iter()
                .map(|v| v.workload.namespace.as_str()),
        )
        .collect();
    namespaces.sort_unstable();
    namespaces.dedup();
    if calls {
        for (verb, subresource) in [("update", "capture"), ("get", "traffic")] {
            out.push(Question {
                verb,
                group: "spur.dev",
                resource: "sandboxes",
                subresource: Some(subresource),
                namespace: None,
                name: Some(sb.name_any()),
            });
        }
    }
    for ns in namespaces {
        for (group, resource) in [("apps", "deployments"), ("", "services")] {
            out.push(Question {
                verb: "create",
                group,
                resource,
                subresource: None,
                namespace: Some(ns.to_owned()),
                name: None,
            });
        }
    }
    out
}

/// A test's creator as stamped at admission: the user and their groups. `Err` says why there is
/// none to ask about.
pub fn creator(test: &SmartTest) -> Result<(String, Vec<String>), String> {
    let a = test.annotations();
    let Some(user) = a.get(CREATED_BY_ANNOTATION) else {
        return Err(format!(
            "it has no {CREATED_BY_ANNOTATION} (created without the webhook smarttest-creator.spur.dev, or before Spur recorded creators): re-create it"
        ));
    };
    let groups = match a.get(CREATED_BY_GROUPS_ANNOTATION) {
        Some(g) => serde_json::from_str(g).map_err(|e| {
            format!("its {CREATED_BY_GROUPS_ANNOTATION} is not a list of names: {e}")
        })?,
        None => Vec::new(),
    };
    Ok((user.clone(), groups))
}

/// The Tests condition as it stands on `sb`, if any.
pub fn current_condition(
    sb: &Sandbox,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    sb.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == TESTS_CONDITION)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn sandbox(generation: i64, observed: i64, ready: &str) -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "pr-42", "uid": "sb-uid", "generation": generation},
            "spec": {"forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"}}]},
            "status": {"observedGeneration": observed,
                       "conditions": [{"type": "Ready", "status": ready, "reason": "R", "message": "",
                                       "lastTransitionTime": "2026-12-05T00:00:00Z"}],
                       "forks": [{"forkOf": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                                  "forkedWorkload": "fw", "services": [], "ready": true}]}
        }))
        .unwrap()
    }

    pub(crate) fn test(name: &str, generation: i64) -> SmartTest {
        serde_json::from_value(json!({
            "apiVersion": "spur.dev/v1alpha1", "kind": "SmartTest",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("{name}-uid"), "generation": generation},
            "spec": {"steps": [{"name": "a", "http": {"url": "http://api.shop/x\n'EOF"}}], "services": ["api"]}
        }))
        .unwrap()
    }

    #[test]
    fn runs_are_due_for_a_ready_sandbox_at_its_current_generation() {
        assert_eq!(ready_generation(&sandbox(3, 3, "True")), Some(3));
        assert_eq!(
            ready_generation(&sandbox(3, 2, "True")),
            None,
            "not seen yet"
        );
        assert_eq!(ready_generation(&sandbox(3, 3, "False")), None);
    }

    #[test]
    fn a_run_is_a_job_per_generation_of_either_object() {
        let sb = sandbox(3, 3, "True");
        let t = test("list-items", 1);
        let job = run_job(&t, &sb, 3, None).unwrap();
        let name = job.name_any();
        assert!(
            name.starts_with("list-items-") && name.len() <= 63,
            "{name}"
        );
        assert_eq!(job.namespace().as_deref(), Some("shop"));
        assert_eq!(job.spec.runner_group, "smart-tests");
        assert_eq!(job.spec.inject_routing_key, InjectRoutingKey::Disabled);
        assert_eq!(
            job.spec
                .routing_context
                .as_ref()
                .unwrap()
                .sandbox
                .as_deref(),
            Some("pr-42")
        );
        assert_eq!(
            job.spec.result_path.as_deref(),
            Some(format!("/tmp/spur-smarttest-{name}.json").as_str())
        );
        let owners = job.owner_references();
        assert_eq!(owners[0].kind, "SmartTest");
        assert_eq!(owners[0].controller, Some(true));
        assert_eq!(
            (owners[1].kind.as_str(), owners[1].uid.as_str()),
            ("Sandbox", "sb-uid")
        );
        job.spec.validate().unwrap();
        // The steps' newline and quote stay inside the one line of JSON.
        let script = job.spec.script.as_deref().unwrap();
        let body: Vec<&str> = script.lines().collect();
        assert_eq!(body[body.len() - 1], "SPUR_SMART_TEST_END");
        let steps: serde_json::Value = serde_json::from_str(body[body.len() - 2]).unwrap();
        assert_eq!(steps["steps"][0]["http"]["url"], "http://api.shop/x\n'EOF");
        assert!(
            !script.contains("--allow-scripts"),
            "a test without script steps runs on a runner's older spur too"
        );
        let mut with_script = t.clone();
        with_script.spec.steps[0].http = None;
        with_script.spec.steps[0].script = Some(spur_smarttest::script::ScriptStep {
            command: vec!["k6".into(), "run".into(), "t.js".into()],
            env: Vec::new(),
        });
        let job = run_job(&with_script, &sb, 3, None).unwrap();
        let script = job.spec.script.as_deref().unwrap();
        assert!(
            script.contains("--key \"$SPUR_ROUTING_KEY\" --allow-scripts --summary-file"),
            "{script}"
        );

        assert_eq!(job_name(&t, &sb, 3), name, "stable");
        // Pinned: the same run has the same name in every build of the operator.
        assert_eq!(name, "list-items-9cfd2eff71");
        assert_ne!(job_name(&t, &sb, 4), name, "a new sandbox generation");
        assert_ne!(
            job_name(&test("list-items", 2), &sb, 3),
            name,
            "a new test generation"
        );
        let long = test(&"x".repeat(63), 1);
        assert!(job_name(&long, &sb, 3).len() <= 63);
    }

    #[test]
    fn a_test_too_large_for_a_script_is_refused_with_the_reason() {
        let mut t = test("big", 1);
        t.spec.steps[0].name = "a".into();
        let big = "x".repeat(SCRIPT_MAX);
        t.spec.steps[0].http.as_mut().unwrap().url = format!("http://api/{big}");
        let err = run_job(&t, &sandbox(1, 1, "True"), 1, None).unwrap_err();
        assert!(err.contains("more than a Job's script may hold"), "{err}");
    }

    #[test]
    fn the_creator_is_asked_for_the_job_the_key_and_every_namespace() {
        let qs = questions("shop", &sandbox(1, 1, "True"), false);
        let asked: Vec<String> = qs.iter().map(Question::describe).collect();
        assert_eq!(
            asked,
            [
                "create jobs.spur.dev in shop",
                "get sandboxes.spur.dev pr-42",
                "create deployments.apps in shop",
                "create services in shop",
            ]
        );
        let r = qs[1].review("ann", &["shop-devs".to_owned()]);
        assert_eq!(r.spec.user.as_deref(), Some("ann"));
        assert_eq!(r.spec.groups, Some(vec!["shop-devs".to_owned()]));
        let attrs = r.spec.resource_attributes.unwrap();
        assert_eq!(attrs.name.as_deref(), Some("pr-42"));
        assert_eq!(attrs.namespace, None);

        // A test comparing calls: also what `spur test run --calls` needs.
        let qs = questions("shop", &sandbox(1, 1, "True"), true);
        let asked: Vec<String> = qs.iter().map(Question::describe).collect();
        assert_eq!(
            asked[2..4],
            [
                "update sandboxes/capture.spur.dev pr-42",
                "get sandboxes/traffic.spur.dev pr-42",
            ]
        );
        let attrs = qs[2].review("ann", &[]).spec.resource_attributes.unwrap();
        assert_eq!(attrs.resource.as_deref(), Some("sandboxes"));
        assert_eq!(attrs.subresource.as_deref(), Some("capture"));
    }

    #[test]
    fn a_run_that_compares_calls_is_given_the_capture_and_its_token_in_its_script() {
        let sb = sandbox(3, 3, "True");
        let mut t = test("list-items", 1);
        t.spec.calls = true;
        let given = GivenCapture {
            run: RunCaptureEnv {
                id: "run1".into(),
                routing_key: "key1".into(),
                reference_key: "spur-run-ref".into(),
                marker_tag: "00ff".into(),
                namespaces: vec!["shop".into()],
                watching_baselines: 2,
                until_unix_micros: 7,
            },
            token: "abc123".into(),
            server: "https://spur-traffic.spur-system.svc:7778".into(),
            ca_pem: Some("-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n".into()),
        };
        let job = run_job(&t, &sb, 3, Some(&given)).unwrap();
        let script = job.spec.script.unwrap();
        let name = job.metadata.name.unwrap();
        assert!(
            script.contains(&format!("export {RUN_CAPTURE_ENV}='{{\"id\":\"run1\"")),
            "{script}"
        );
        assert!(
            script.contains("export SPUR_TRAFFIC_TOKEN='abc123'\n"),
            "{script}"
        );
        assert!(
            script.contains(&format!(
                "cat > '/tmp/spur-traffic-ca-{name}.crt' <<'SPUR_CA_END'\n-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\nSPUR_CA_END\n"
            )),
            "{script}"
        );
        assert!(
            script.contains(&format!(
                " --run-capture-env {RUN_CAPTURE_ENV} --server 'https://spur-traffic.spur-system.svc:7778' --ca '/tmp/spur-traffic-ca-{name}.crt' --summary-file"
            )),
            "{script}"
        );
        assert!(!format!("{given:?}").contains("abc123"));
        // A token or a CA bundle that could break out of the script is refused.
        let bad = GivenCapture {
            token: "abc'; rm -rf /".into(),
            ..given.clone()
        };
        assert!(run_job(&t, &sb, 3, Some(&bad)).is_err());
        let bad = GivenCapture {
            ca_pem: Some("x\nSPUR_CA_END\nrm -rf /\n".into()),
            ..given
        };
        assert!(run_job(&t, &sb, 3, Some(&bad)).is_err());
        // Without calls: no capture in the script.
        t.spec.calls = false;
        let plain = run_job(&t, &sb, 3, None).unwrap().spec.script.unwrap();
        assert!(!plain.contains("run-capture"), "{plain}");
    }

    #[test]
    fn a_capture_lasts_the_runs_worst_case_and_a_queue_at_most_half_an_hour() {
        let t = test("list-items", 1);
        // One step of 10 s: 40 s, a minute and five for the queue.
        assert_eq!(capture_seconds(&t), 40 + 60 + 300);
        let mut long = t.clone();
        long.spec.steps[0].timeout_seconds = Some(600);
        long.spec.steps.push(long.spec.steps[0].clone());
        assert_eq!(capture_seconds(&long), MAX_CAPTURE_SECONDS);
    }
}
