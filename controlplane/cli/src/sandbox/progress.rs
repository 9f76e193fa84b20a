//! What `spur sandbox apply --wait` shows: where each fork, local workload, virtual workload and
//! resource of a sandbox stands, read from the Sandbox, its ForkedWorkloads and their pods, and
//! whether the sandbox is ready, failed or still on its way. Pure functions of one
//! [`Snapshot`], so every stage and every failure is unit-tested without a cluster.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use spur_api::conditions::{READY, find_condition, reasons};
use spur_api::{ForkedWorkload, RouteGroup, Sandbox, SidecarCoverage};

/// What the command could read of a sandbox at one moment, with the user's own rights.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    pub sandbox: Sandbox,
    /// One per `spec.forks[]`, in order.
    pub forks: Vec<ForkView>,
}

/// A fork's objects. `Err` carries why they could not be read (e.g. no right to list pods in
/// the baseline's namespace): progress then shows less, and the Sandbox's status still decides.
#[derive(Clone, Debug)]
pub(crate) struct ForkView {
    /// Its ForkedWorkload; `None` until the operator has made it.
    pub forked: Result<Option<ForkedWorkload>, String>,
    /// The fork Deployment, once named.
    pub deployment: Result<Option<Deployment>, String>,
    /// The fork's pods (label `spur.dev/fork`), not yet deleted.
    pub pods: Result<Vec<Pod>, String>,
}

/// One item's place: the item (`hotrod/route`, `local web`, …) and what it has reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stage {
    pub item: String,
    /// Steps reached so far, in order; the last is where it stands. A step is only ever added
    /// at the end, so a printer shows every step, including those passed between two looks.
    pub steps: Vec<String>,
}

/// Why a sandbox will not become ready without a change: the condition's reason and message
/// and the object to look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    pub reason: String,
    pub message: String,
    pub object: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Still on its way: what it waits for (the Ready condition's message).
    Waiting(String),
    Ready,
    Failed(Failure),
    /// A fork pod the kubelet cannot start yet and retries: a failure if it lasts.
    Troubled(Failure),
}

/// Kubelet reasons of a waiting container that waiting does not end: a name that is no image
/// reference, a pull the pod's policy forbids, a container that keeps crashing.
const CONTAINER_FAILURES: [&str; 3] = ["InvalidImageName", "ErrImageNeverPull", "CrashLoopBackOff"];

/// Kubelet reasons the kubelet retries and that often last, but not always: a registry that
/// answers the next time, a ConfigMap cache that syncs ("failed to sync configmap cache"), a
/// ConfigMap or Secret created a moment later. The wait reports them as failures only once they
/// have lasted a while ([`Verdict::Troubled`]).
const CONTAINER_TROUBLES: [&str; 6] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "PostStartHookError",
];

/// The Ready condition of an object, if it describes `generation`.
fn current_ready(conditions: &[Condition], generation: Option<i64>) -> Option<&Condition> {
    find_condition(conditions, READY).filter(|c| c.observed_generation == generation)
}

/// Where each part of the sandbox stands.
pub(crate) fn stages(s: &Snapshot) -> Vec<Stage> {
    let sb = &s.sandbox;
    let st = sb.status.clone().unwrap_or_default();
    let mut out = Vec::new();
    let mut steps = vec!["applied".to_string()];
    if let Some(key) = &st.routing_key {
        steps.push(format!("routing key {key}"));
    }
    out.push(Stage {
        item: "sandbox".into(),
        steps,
    });
    for r in &sb.spec.resources {
        let mut steps = vec!["waiting for the operator".to_string()];
        if let Some(e) = st.resources.iter().find(|e| e.name == r.name) {
            steps.push(match &e.message {
                Some(m) => format!("{}: {m}", e.phase),
                None => e.phase.clone(),
            });
        }
        out.push(Stage {
            item: format!("resource {}", r.name),
            steps,
        });
    }
    for (i, f) in sb.spec.forks.iter().enumerate() {
        let b = &f.fork_of;
        let entry = st.forks.iter().find(|e| e.fork_of == *b);
        out.push(Stage {
            item: format!("{}/{}", b.namespace, b.name),
            steps: fork_steps(&b.namespace, s.forks.get(i), entry),
        });
    }
    for l in &sb.spec.local {
        let mut steps = vec![format!(
            "waiting for a workstation (spur local connect; docs/local.md)"
        )];
        if let Some(e) = st.local.iter().find(|e| e.name == l.name) {
            if e.connected {
                steps.push("workstation connected".into());
            }
            if e.ready {
                steps.push("keyed requests reach the workstation".into());
            }
        }
        out.push(Stage {
            item: format!("local {}", l.name),
            steps,
        });
    }
    for v in &sb.spec.virtual_workloads {
        let mut steps = vec!["waiting for the operator".to_string()];
        if let Some(e) = st.virtual_workloads.iter().find(|e| e.name == v.name)
            && e.ready
        {
            steps.push(format!(
                "baseline routed{}",
                sidecars(e.baseline_sidecars.as_ref())
            ));
        }
        out.push(Stage {
            item: format!("virtual {}", v.name),
            steps,
        });
    }
    out
}

/// A fork's steps: its ForkedWorkload, Deployment, pod scheduled, images pulled, ready, routed.
fn fork_steps(
    ns: &str,
    view: Option<&ForkView>,
    entry: Option<&spur_api::sandbox::ForkStatus>,
) -> Vec<String> {
    let mut steps = vec!["waiting for the operator".to_string()];
    if let Some(Err(why)) = view.map(|v| &v.forked) {
        steps.push(format!("(its ForkedWorkload is not readable: {why})"));
    }
    // Its name from the object, else from the Sandbox's status (readable where it is not).
    let fw = match view.map(|v| &v.forked) {
        Some(Ok(Some(fw))) => Some(fw.metadata.name.clone().unwrap_or_default()),
        _ => entry.map(|e| e.forked_workload.clone()),
    };
    let Some(fw) = fw else { return steps };
    steps.push(format!("ForkedWorkload {ns}/{fw} created"));
    let deployment = view
        .and_then(|v| v.forked.as_ref().ok()?.as_ref())
        .and_then(|fw| fw.status.as_ref()?.fork.clone())
        .or_else(|| entry.and_then(|e| e.fork.clone()));
    let Some(deployment) = deployment else {
        return steps;
    };
    steps.push(format!("Deployment {ns}/{deployment} created"));
    match view.map(|v| &v.pods) {
        Some(Ok(pods)) if !current_pods(pods).is_empty() => {
            steps.extend(pod_steps(&current_pods(pods)));
        }
        Some(Err(why)) => steps.push(format!("(its pods are not readable: {why})")),
        _ => {}
    }
    if let Some(e) = entry.filter(|e| e.ready) {
        steps.push(format!(
            "routes published{}",
            sidecars(e.baseline_sidecars.as_ref())
        ));
    }
    steps
}

/// The pods that decide: those of the newest pod template (`pod-template-hash`; during a
/// rolling update the old ones are going), without finished ones (an evicted pod stays until
/// it is collected) unless nothing else is left.
fn current_pods(pods: &[Pod]) -> Vec<&Pod> {
    let finished = |p: &Pod| {
        matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        )
    };
    let live: Vec<&Pod> = pods.iter().filter(|p| !finished(p)).collect();
    let pods: Vec<&Pod> = if live.is_empty() {
        pods.iter().collect()
    } else {
        live
    };
    let hash = |p: &Pod| {
        p.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("pod-template-hash").cloned())
    };
    let newest = pods
        .iter()
        .max_by_key(|p| {
            (
                p.metadata.creation_timestamp.clone(),
                p.metadata.name.clone(),
            )
        })
        .and_then(|p| hash(p));
    let mut current: Vec<&Pod> = pods
        .into_iter()
        .filter(|p| newest.is_none() || hash(p) == newest)
        .collect();
    current.sort_by_key(|p| p.metadata.name.clone());
    current
}

/// The steps every current pod of the fork has reached (the least advanced pod decides).
fn pod_steps(pods: &[&Pod]) -> Vec<String> {
    let n = pods.len();
    // Every step below counts all pods, so its text does not change while pods progress.
    let all = if n == 1 {
        String::new()
    } else {
        format!(" ({n} pods)")
    };
    let scheduled: Vec<&&Pod> = pods
        .iter()
        .filter(|p| condition_true(p, "PodScheduled"))
        .collect();
    let pulled = pods.iter().filter(|p| images_pulled(p)).count();
    let ready = pods.iter().filter(|p| condition_true(p, READY)).count();
    let first = pods.first().map(|p| pod_name(p)).unwrap_or_default();
    let mut steps = vec![format!("pod {first} created{all}")];
    if scheduled.len() < n {
        // Why not (Unschedulable: 0/1 nodes are available …) is worth showing while it lasts.
        if let Some(why) = pods.iter().find_map(|p| {
            let c = p
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
            Some(format!(
                "{}: {}",
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default()
            ))
        }) {
            steps.push(format!("not scheduled yet ({why})"));
        }
        return steps;
    }
    let node = scheduled
        .first()
        .and_then(|p| p.spec.as_ref()?.node_name.clone())
        .map(|n| format!(" on {n}"))
        .unwrap_or_default();
    steps.push(format!("scheduled{node}{all}"));
    if pulled < n {
        return steps;
    }
    steps.push(format!("images pulled{all}"));
    if ready < n {
        return steps;
    }
    steps.push(format!("pod ready{all}"));
    steps
}

fn pod_name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn condition_true(p: &Pod, type_: &str) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

fn containers(p: &Pod) -> impl Iterator<Item = &ContainerStatus> {
    let st = p.status.as_ref();
    st.and_then(|s| s.init_container_statuses.as_ref())
        .into_iter()
        .flatten()
        .chain(
            st.and_then(|s| s.container_statuses.as_ref())
                .into_iter()
                .flatten(),
        )
}

/// Every container of the pod has its image: the kubelet sets `imageID` once it has pulled
/// it, and a running or finished container had it.
fn images_pulled(p: &Pod) -> bool {
    let st = p.status.as_ref();
    let expected = p.spec.as_ref().map_or(0, |s| s.containers.len());
    let app = st
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, Vec::len);
    app >= expected
        && expected > 0
        && containers(p).all(|c| {
            !c.image_id.is_empty()
                || c.state
                    .as_ref()
                    .is_some_and(|s| s.running.is_some() || s.terminated.is_some())
        })
}

fn sidecars(c: Option<&SidecarCoverage>) -> String {
    match c {
        Some(c) if c.all_ready => format!(
            "; {} of {} baseline pods have a ready sidecar",
            c.ready, c.pods
        ),
        Some(c) if c.pods == 0 => "; the baseline has no running pod".into(),
        Some(c) => format!(
            "; only {} of {} baseline pods have a ready sidecar: keyed requests reaching the others are not routed",
            c.ready, c.pods
        ),
        None => String::new(),
    }
}

/// Ready, failed, or still waiting (and for what).
pub(crate) fn verdict(s: &Snapshot) -> Verdict {
    let sb = &s.sandbox;
    let name = sb.metadata.name.clone().unwrap_or_default();
    if sb.metadata.deletion_timestamp.is_some() {
        return Verdict::Failed(Failure {
            reason: "Deleting".into(),
            message: "the sandbox is being deleted".into(),
            object: format!("Sandbox {name}"),
        });
    }
    let generation = sb.metadata.generation;
    let st = sb.status.clone().unwrap_or_default();
    if st.observed_generation != generation {
        return Verdict::Waiting("the operator has not looked at this version yet".into());
    }
    let ready = current_ready(&st.conditions, generation);
    if let Some(c) = ready
        && c.status == "False"
        && reasons::sandbox_failed(&c.reason)
    {
        return Verdict::Failed(Failure {
            reason: c.reason.clone(),
            message: c.message.clone(),
            object: format!("Sandbox {name}"),
        });
    }
    // A fork that cannot be built, a rollout past its deadline, or a pod of the applied
    // version that cannot start: whether or not the Sandbox is Ready (a fork patched to
    // RollingUpdate keeps its old pod serving, so it stays Ready while the new one fails).
    for (f, view) in sb.spec.forks.iter().zip(&s.forks) {
        if let Some(verdict) = fork_failure(&f.fork_of.namespace, view) {
            return verdict;
        }
    }
    if let Some(c) = ready
        && c.status == "True"
    {
        // The Sandbox is ready when its forks' routes are: after a change, also wait for
        // each fork readable here to run the new version.
        return match rolling_out(s) {
            Some(w) => Verdict::Waiting(w),
            None => Verdict::Ready,
        };
    }
    Verdict::Waiting(
        ready
            .map(|c| c.message.clone())
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "waiting for the operator".into()),
    )
}

/// A fork's failure or trouble, if it has one: its ForkedWorkload's (of its generation), its
/// Deployment's rollout past the progress deadline, its current pods'.
fn fork_failure(ns: &str, view: &ForkView) -> Option<Verdict> {
    if let Ok(Some(fw)) = &view.forked {
        let fst = fw.status.clone().unwrap_or_default();
        if let Some(c) = current_ready(&fst.conditions, fw.metadata.generation)
            && c.status == "False"
            && c.reason != reasons::FORK_NOT_READY
        {
            return Some(Verdict::Failed(Failure {
                reason: c.reason.clone(),
                message: c.message.clone(),
                object: format!(
                    "ForkedWorkload {ns}/{}",
                    fw.metadata.name.clone().unwrap_or_default()
                ),
            }));
        }
    }
    if let Ok(Some(d)) = &view.deployment
        && let Some(c) = d
            .status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Progressing"))
        && c.status == "False"
    {
        return Some(Verdict::Failed(Failure {
            reason: c.reason.clone().unwrap_or_else(|| "NotProgressing".into()),
            message: c.message.clone().unwrap_or_default(),
            object: format!(
                "Deployment {ns}/{}",
                d.metadata.name.clone().unwrap_or_default()
            ),
        }));
    }
    match &view.pods {
        Ok(pods) => current_pods(pods)
            .into_iter()
            .find_map(|p| pod_failure(ns, p)),
        Err(_) => None,
    }
}

/// Why a ready sandbox's forks do not run the applied version yet: a ForkedWorkload whose
/// Ready condition is of an older generation, or a fork Deployment still rolling out (as
/// `kubectl rollout status` judges it). Objects the user cannot read are not waited for.
fn rolling_out(s: &Snapshot) -> Option<String> {
    for view in &s.forks {
        if let Ok(Some(fw)) = &view.forked {
            let fst = fw.status.clone().unwrap_or_default();
            let current = current_ready(&fst.conditions, fw.metadata.generation)
                .is_some_and(|c| c.status == "True");
            if !current {
                return Some(format!(
                    "waiting for ForkedWorkload {} to take the change",
                    fw.metadata.name.clone().unwrap_or_default()
                ));
            }
        }
        if let Ok(Some(d)) = &view.deployment {
            let name = d.metadata.name.clone().unwrap_or_default();
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let st = d.status.clone().unwrap_or_default();
            let updated = st.updated_replicas.unwrap_or(0);
            let done = st.observed_generation >= d.metadata.generation
                && updated >= want
                && st.replicas.unwrap_or(0) <= updated
                && st.available_replicas.unwrap_or(0) >= updated;
            if !done {
                return Some(format!(
                    "waiting for Deployment {name} to roll out ({updated} of {want} updated, {} available, {} in all)",
                    st.available_replicas.unwrap_or(0),
                    st.replicas.unwrap_or(0)
                ));
            }
        }
    }
    None
}

/// A fork pod that will not start by waiting, or that has trouble starting: the kubelet's
/// reason and message.
fn pod_failure(ns: &str, p: &Pod) -> Option<Verdict> {
    let pod = pod_name(p);
    if let Some(st) = &p.status
        && st.phase.as_deref() == Some("Failed")
    {
        return Some(Verdict::Failed(Failure {
            reason: st.reason.clone().unwrap_or_else(|| "PodFailed".into()),
            message: st.message.clone().unwrap_or_default(),
            object: format!("pod {ns}/{pod}"),
        }));
    }
    containers(p).find_map(|c| {
        let w = c.state.as_ref()?.waiting.as_ref()?;
        let reason = w.reason.as_deref()?;
        let failure = || Failure {
            reason: reason.to_string(),
            message: w.message.clone().unwrap_or_default(),
            object: format!("pod {ns}/{pod}, container {}", c.name),
        };
        if CONTAINER_FAILURES.contains(&reason) {
            Some(Verdict::Failed(failure()))
        } else if CONTAINER_TROUBLES.contains(&reason) {
            Some(Verdict::Troubled(failure()))
        } else {
            None
        }
    })
}

/// A route group's one stage and its verdict: which sandboxes it matches and how many are ready.
pub(crate) fn route_group(rg: &RouteGroup) -> (Stage, Verdict) {
    let st = rg.status.clone().unwrap_or_default();
    let name = rg.metadata.name.clone().unwrap_or_default();
    let mut steps = vec!["applied".to_string()];
    if let Some(key) = &st.routing_key {
        steps.push(format!("routing key {key}"));
    }
    if !st.matched_sandboxes.is_empty() {
        steps.push(format!(
            "matches {} ({} ready)",
            st.matched_sandboxes.join(", "),
            st.ready_sandboxes
        ));
    }
    let stage = Stage {
        item: "route group".into(),
        steps,
    };
    let verdict = if st.observed_generation != rg.metadata.generation {
        Verdict::Waiting("the operator has not looked at this version yet".into())
    } else {
        match current_ready(&st.conditions, rg.metadata.generation) {
            Some(c) if c.status == "True" => Verdict::Ready,
            Some(c) if c.reason == reasons::INVALID => Verdict::Failed(Failure {
                reason: c.reason.clone(),
                message: c.message.clone(),
                object: format!("RouteGroup {name}"),
            }),
            Some(c) => Verdict::Waiting(c.message.clone()),
            None => Verdict::Waiting("waiting for the operator".into()),
        }
    };
    (stage, verdict)
}

#[cfg(test)]
mod tests;
