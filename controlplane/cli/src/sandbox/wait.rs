//! `--wait`: follows a sandbox or route group until it is ready, has failed or the time is up,
//! printing each step the moment it is seen, with the time since the command started; and
//! follows a deletion until the object and its forks are gone. Everything is read with the
//! user's credentials; what they may not read is said once and left out.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use spur_api::keys::labels;
use spur_api::{ForkedWorkload, RouteGroup, Sandbox, names};

use super::apply::Owned;
use super::progress::{self, Failure, ForkView, Snapshot, Stage, Verdict};

/// How often the objects are read again while waiting.
const POLL: Duration = Duration::from_millis(500);

/// How long a fork pod's trouble (a pull or a container config the kubelet retries) must last
/// before the wait calls it a failure.
pub(crate) const TROUBLE_GRACE: Duration = Duration::from_secs(20);

/// How a wait ended.
pub(crate) enum Waited<K> {
    Ready(K),
    Failed(Failure),
    /// The time ran out; what it was still waiting for.
    TimedOut(String),
    /// Ctrl-C.
    Interrupted,
}

/// Prints steps as they are reached: `[  3.2s] hotrod/route: pod ready`.
pub(crate) struct Printer<W> {
    start: Instant,
    out: W,
    /// Prepended to every item when one command waits for several objects.
    prefix: String,
    printed: BTreeMap<String, Vec<String>>,
}

impl<W: Write> Printer<W> {
    pub(crate) fn new(start: Instant, out: W) -> Self {
        Printer {
            start,
            out,
            prefix: String::new(),
            printed: BTreeMap::new(),
        }
    }

    pub(crate) fn prefix(&mut self, prefix: String) {
        self.prefix = prefix;
    }

    pub(crate) fn line(&mut self, item: &str, text: &str) {
        let secs = self.start.elapsed().as_secs_f64();
        // A closed stdout (`| head`) must not stop the wait; the exit code still tells.
        let _ = writeln!(self.out, "[{secs:>6.1}s] {}{item}: {text}", self.prefix);
        let _ = self.out.flush();
    }

    /// Prints the steps not printed yet. Steps only grow at the end; when an earlier one
    /// changed (a pod replaced), everything from the change on is printed again.
    pub(crate) fn show(&mut self, stages: &[Stage]) {
        for stage in stages {
            let key = format!("{}{}", self.prefix, stage.item);
            let old = self.printed.get(&key).cloned().unwrap_or_default();
            let same = old
                .iter()
                .zip(&stage.steps)
                .take_while(|(a, b)| a == b)
                .count();
            if same == stage.steps.len() && same == old.len() {
                continue;
            }
            for step in &stage.steps[same..] {
                self.line(&stage.item, step);
            }
            self.printed.insert(key, stage.steps.clone());
        }
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A short form of an API error for a progress line.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!("forbidden to you: {}", s.message),
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

/// Reads a sandbox's forks and their pods.
async fn snapshot(client: &Client, sandbox: Sandbox) -> Snapshot {
    let name = sandbox.metadata.name.clone().unwrap_or_default();
    let mut forks = Vec::with_capacity(sandbox.spec.forks.len());
    for f in &sandbox.spec.forks {
        let ns = &f.fork_of.namespace;
        let fw_name = names::fork_name(&name, &f.fork_of);
        let forked = Api::<ForkedWorkload>::namespaced(client.clone(), ns)
            .get_opt(&fw_name)
            .await
            .map_err(|e| short(&e));
        let fork_deployment = match &forked {
            Ok(Some(fw)) => fw.status.as_ref().and_then(|st| st.fork.clone()),
            _ => None,
        };
        let deployment = match fork_deployment {
            Some(name) => Api::<Deployment>::namespaced(client.clone(), ns)
                .get_opt(&name)
                .await
                .map_err(|e| short(&e)),
            None => Ok(None),
        };
        let pods = Api::<Pod>::namespaced(client.clone(), ns)
            .list(&ListParams::default().labels(&format!("{}={fw_name}", labels::FORK)))
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .collect()
            })
            .map_err(|e| short(&e));
        forks.push(ForkView {
            forked,
            deployment,
            pods,
        });
    }
    Snapshot { sandbox, forks }
}

/// What one look at the cluster found.
enum Step<K> {
    Done(K),
    Failed(Failure),
    /// A failure the kubelet retries: final once it lasted [`TROUBLE_GRACE`].
    Troubled(Failure),
    Waiting(String),
}

/// Looks every [`POLL`] until `look` says done or failed, `deadline` passes (a look that hangs
/// included), or Ctrl-C.
async fn follow<K, W, F, Fut>(deadline: Instant, printer: &mut Printer<W>, look: F) -> Waited<K>
where
    W: Write,
    F: Fn() -> Fut,
    Fut: Future<Output = (Vec<Stage>, Step<K>)>,
{
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let mut waiting = "nothing read yet".to_string();
    // The object in trouble and since when (the reason may alternate, as ErrImagePull and
    // ImagePullBackOff do).
    let mut troubled: Option<(String, Instant)> = None;
    loop {
        let (stages, step) = tokio::select! {
            r = tokio::time::timeout_at(deadline.into(), look()) => match r {
                Ok(r) => r,
                Err(_) => return Waited::TimedOut(waiting),
            },
            _ = &mut ctrl_c => return Waited::Interrupted,
        };
        printer.show(&stages);
        waiting = match step {
            Step::Done(k) => return Waited::Ready(k),
            Step::Failed(f) => return Waited::Failed(f),
            Step::Troubled(f) => {
                let since = match &troubled {
                    Some((object, since)) if *object == f.object => *since,
                    _ => {
                        printer.line(
                            &f.object,
                            &format!(
                                "{}: {} (the kubelet retries; a failure if it lasts {}s)",
                                f.reason,
                                f.message,
                                TROUBLE_GRACE.as_secs()
                            ),
                        );
                        let now = Instant::now();
                        troubled = Some((f.object.clone(), now));
                        now
                    }
                };
                if since.elapsed() >= TROUBLE_GRACE {
                    return Waited::Failed(f);
                }
                format!("{}: {}", f.reason, f.message)
            }
            Step::Waiting(w) => {
                troubled = None;
                w
            }
        };
        if Instant::now() >= deadline {
            return Waited::TimedOut(waiting);
        }
        tokio::select! {
            () = tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))) => {}
            _ = &mut ctrl_c => return Waited::Interrupted,
        }
    }
}

/// A failed read, as a stage of its own (it goes away once reads work again).
fn unreadable<K>(what: &str, e: &kube::Error) -> (Vec<Stage>, Step<K>) {
    let text = format!("cannot read {what}: {}; retrying", short(e));
    (
        vec![Stage {
            item: "api server".into(),
            steps: vec![text.clone()],
        }],
        Step::Waiting(text),
    )
}

fn deleted<K>(kind: &str, name: &str) -> (Vec<Stage>, Step<K>) {
    (
        Vec::new(),
        Step::Failed(Failure {
            reason: "NotFound".into(),
            message: format!("the {kind} was deleted while waiting for it"),
            object: format!("{kind} {name}"),
        }),
    )
}

/// Until the Sandbox `name` is ready or has failed, or `timeout` passes.
pub(crate) async fn sandbox_ready<W: Write>(
    client: &Client,
    name: &str,
    deadline: Instant,
    printer: &mut Printer<W>,
) -> Waited<Sandbox> {
    let api = Api::<Sandbox>::all(client.clone());
    follow(deadline, printer, || async {
        let sb = match api.get_opt(name).await {
            Ok(Some(sb)) => sb,
            Ok(None) => return deleted("Sandbox", name),
            Err(e) => return unreadable("the sandbox", &e),
        };
        let snap = snapshot(client, sb).await;
        let stages = progress::stages(&snap);
        let step = match progress::verdict(&snap) {
            Verdict::Ready => Step::Done(snap.sandbox),
            Verdict::Failed(f) => Step::Failed(f),
            Verdict::Troubled(f) => Step::Troubled(f),
            Verdict::Waiting(w) => Step::Waiting(w),
        };
        (stages, step)
    })
    .await
}

/// Until the RouteGroup `name` is ready or invalid, or `timeout` passes.
pub(crate) async fn route_group_ready<W: Write>(
    client: &Client,
    name: &str,
    deadline: Instant,
    printer: &mut Printer<W>,
) -> Waited<RouteGroup> {
    let api = Api::<RouteGroup>::all(client.clone());
    follow(deadline, printer, || async {
        let rg = match api.get_opt(name).await {
            Ok(Some(rg)) => rg,
            Ok(None) => return deleted("RouteGroup", name),
            Err(e) => return unreadable("the route group", &e),
        };
        let (stage, verdict) = progress::route_group(&rg);
        let step = match verdict {
            Verdict::Ready => Step::Done(rg),
            Verdict::Failed(f) => Step::Failed(f),
            Verdict::Troubled(f) => Step::Troubled(f),
            Verdict::Waiting(w) => Step::Waiting(w),
        };
        (vec![stage], step)
    })
    .await
}

/// Until `name` and the ForkedWorkloads it had (`children`: namespace and name) are gone.
pub(crate) async fn gone<K: Owned, W: Write>(
    client: &Client,
    name: &str,
    children: &[(String, String)],
    deadline: Instant,
    printer: &mut Printer<W>,
) -> Waited<()> {
    let api = Api::<K>::all(client.clone());
    let kind = K::kind(&()).to_string();
    follow(deadline, printer, || async {
        let mut stages = Vec::new();
        let mut left = Vec::new();
        for (ns, fw) in children {
            let item = format!("ForkedWorkload {ns}/{fw}");
            let mut steps = vec!["being removed".to_string()];
            match Api::<ForkedWorkload>::namespaced(client.clone(), ns)
                .get_opt(fw)
                .await
            {
                Ok(None) => steps.push("removed".into()),
                Ok(Some(_)) => left.push(item.clone()),
                // Not the user's to read: the sandbox's own removal below still decides.
                Err(e) => steps.push(format!("cannot tell ({})", short(&e))),
            }
            stages.push(Stage { item, steps });
        }
        let mut steps = vec!["deleting".to_string()];
        let present = match api.get_opt(name).await {
            Ok(present) => present.is_some(),
            Err(e) => return unreadable(&format!("{kind} {name}"), &e),
        };
        if !present {
            steps.push("deleted".into());
        }
        stages.push(Stage {
            item: kind.to_lowercase(),
            steps,
        });
        let step = if !present && left.is_empty() {
            Step::Done(())
        } else {
            let mut waiting = left;
            if present {
                waiting.push(format!("{kind} {name}"));
            }
            Step::Waiting(format!("still there: {}", waiting.join(", ")))
        };
        (stages, step)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(item: &str, steps: &[&str]) -> Stage {
        Stage {
            item: item.into(),
            steps: steps.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn each_step_is_printed_once_and_a_changed_one_again_from_there() {
        let mut p = Printer::new(Instant::now(), Vec::new());
        p.show(&[stage("a", &["one"]), stage("b", &["x"])]);
        // Two steps passed between looks: both printed, in order.
        p.show(&[stage("a", &["one", "two", "three"]), stage("b", &["x"])]);
        // A pod replaced: from the changed step on.
        p.show(&[stage("a", &["one", "two'", "three"]), stage("b", &["x"])]);
        p.prefix("sb2 ".into());
        p.show(&[stage("a", &["one"])]);
        let text = String::from_utf8(p.out).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .map(|l| &l[l.find(']').unwrap() + 2..])
            .collect();
        assert_eq!(
            lines,
            [
                "a: one",
                "b: x",
                "a: two",
                "a: three",
                "a: two'",
                "a: three",
                "sb2 a: one"
            ]
        );
        assert!(text.starts_with("[   0.0s] "), "{text}");
    }
}
