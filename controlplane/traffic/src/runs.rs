//! Run captures: for a smart test's run, a sandbox's routing key and a reference key (for the
//! run's baseline requests) captured at every baseline of the namespaces the sandbox forks
//! from, for a bounded time (docs/smart-tests.md, "Downstream calls").
//!
//! Standing capture (a Sandbox's `spec.capture`) records a sandbox's key only at the baselines
//! it forks, which sees the requests that reach a fork but not the calls the fork makes. A run
//! capture widens that, briefly, to whole namespaces: the fork's calls carry the key to the
//! baselines it calls, whose sidecars then record them; the same requests sent to the baseline
//! with the reference key record what the baseline calls instead.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use spur_proto::traffic::CaptureKey;

use crate::Error;
use crate::settings::{CAPTURE_GRACE, SettingsIndex};

/// Runs capturing at once, per sandbox and in all: a run is one test at a time.
pub const MAX_RUNS_PER_SANDBOX: usize = 4;
pub const MAX_RUNS: usize = 64;
/// The longest and the default duration a run asks for.
pub const MAX_RUN_SECONDS: u32 = 1800;
pub const DEFAULT_RUN_SECONDS: u32 = 600;
/// Ended runs remembered (for late pushes within the grace) at most.
const MAX_ENDED: usize = 1024;

/// What one sandbox is, as runs need it: its key and where it forks from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SandboxEntry {
    pub routing_key: String,
    /// Namespaces of its forks, local and virtual workloads.
    pub namespaces: BTreeSet<String>,
}

/// One run capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub sandbox: String,
    pub routing_key: String,
    pub reference_key: String,
    pub namespaces: BTreeSet<String>,
    pub until: Instant,
}

impl Run {
    /// The keys it captures, as settings carry them.
    pub fn keys(&self) -> [CaptureKey; 2] {
        [&self.routing_key, &self.reference_key].map(|k| CaptureKey {
            routing_key: k.clone(),
            sandbox: self.sandbox.clone(),
        })
    }

    fn takes(&self, namespace: &str, sandbox: &str, routing_key: &str) -> bool {
        self.sandbox == sandbox
            && (self.routing_key == routing_key || self.reference_key == routing_key)
            && self.namespaces.contains(namespace)
    }
}

/// The live runs by id, and those ended less than the grace ago.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    live: HashMap<String, Run>,
    /// Ended or expired runs and when: exchanges captured just before still count.
    ended: Vec<(Run, Instant)>,
}

impl Runs {
    /// Adds `run` under `id`, unless that would pass a bound.
    pub(crate) fn start(&mut self, id: String, run: Run, now: Instant) -> Result<(), Error> {
        self.sweep(now, Duration::ZERO);
        if self.live.len() >= MAX_RUNS {
            return Err(Error::Exhausted(format!(
                "{MAX_RUNS} runs are capturing already; retry when one ends"
            )));
        }
        let same = self
            .live
            .values()
            .filter(|r| r.sandbox == run.sandbox)
            .count();
        if same >= MAX_RUNS_PER_SANDBOX {
            return Err(Error::Exhausted(format!(
                "sandbox {} has {MAX_RUNS_PER_SANDBOX} runs capturing already; retry when one ends",
                run.sandbox
            )));
        }
        self.live.insert(id, run);
        Ok(())
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Run> {
        self.live.get(id)
    }

    /// Ends run `id`; whether it was live.
    pub(crate) fn end(&mut self, id: &str, now: Instant) -> bool {
        let Some(run) = self.live.remove(id) else {
            return false;
        };
        self.remember(run, now);
        true
    }

    /// Ends the runs past their time and forgets ended ones older than `grace`; whether a live
    /// run ended.
    pub(crate) fn sweep(&mut self, now: Instant, grace: Duration) -> bool {
        let expired: Vec<String> = self
            .live
            .iter()
            .filter(|(_, r)| r.until <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            if let Some(run) = self.live.remove(id) {
                self.remember(run, now);
            }
        }
        if !grace.is_zero() {
            self.ended
                .retain(|(_, at)| now.saturating_duration_since(*at) < grace);
        }
        !expired.is_empty()
    }

    fn remember(&mut self, run: Run, now: Instant) {
        if self.ended.len() >= MAX_ENDED {
            self.ended.remove(0);
        }
        self.ended.push((run, now));
    }

    /// The keys live runs capture at baselines of `namespace`.
    pub(crate) fn keys_in<'a>(
        &'a self,
        namespace: &'a str,
    ) -> impl Iterator<Item = CaptureKey> + 'a {
        self.live
            .values()
            .filter(move |r| r.namespaces.contains(namespace))
            .flat_map(Run::keys)
    }

    /// Whether a live run, or one ended less than `grace` ago, captures `routing_key` for
    /// `sandbox` at baselines of `namespace`.
    pub(crate) fn captures(
        &self,
        namespace: &str,
        sandbox: &str,
        routing_key: &str,
        now: Instant,
        grace: Duration,
    ) -> bool {
        self.live
            .values()
            .any(|r| r.takes(namespace, sandbox, routing_key))
            || self.ended.iter().any(|(r, at)| {
                now.saturating_duration_since(*at) < grace
                    && r.takes(namespace, sandbox, routing_key)
            })
    }

    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }
}

/// A run capture as started: its id and what it captures where.
#[derive(Debug, Clone)]
pub struct StartedRun {
    pub id: String,
    pub run: Run,
    /// Baselines in its namespaces with a watching sidecar.
    pub watching: usize,
}

impl SettingsIndex {
    /// The sandbox named `sandbox` as the settings know it (every sandbox with a routing key).
    pub fn sandbox(&self, sandbox: &str) -> Option<SandboxEntry> {
        self.state().map.sandboxes.get(sandbox).cloned()
    }

    /// Starts capturing for a smart-test run of `sandbox` for `seconds` (0: the default): its
    /// key and `reference_key` at every baseline of the namespaces it forks from, which must
    /// still be `checked` (what the caller's rights were checked for: ABORTED otherwise). The
    /// watchers there are sent their new settings before this returns. `id` and
    /// `reference_key` are the caller's (random: this module does not make them).
    pub fn start_run(
        &self,
        sandbox: &str,
        checked: &SandboxEntry,
        seconds: u32,
        id: String,
        reference_key: String,
    ) -> Result<StartedRun, Error> {
        if seconds > MAX_RUN_SECONDS {
            return Err(Error::Invalid(format!(
                "seconds: {seconds} is more than {MAX_RUN_SECONDS}"
            )));
        }
        let seconds = if seconds == 0 {
            DEFAULT_RUN_SECONDS
        } else {
            seconds
        };
        let mut state = self.state();
        let entry = state.map.sandboxes.get(sandbox).cloned().ok_or_else(|| {
            Error::NotFound(format!(
                "sandbox {sandbox} has no routing key yet (or does not exist)"
            ))
        })?;
        if entry != *checked {
            return Err(Error::Changed(format!(
                "sandbox {sandbox} changed while its run capture was being checked; retry"
            )));
        }
        if entry.namespaces.is_empty() {
            return Err(Error::Invalid(format!(
                "sandbox {sandbox} forks no workload: there is nowhere to capture"
            )));
        }
        let now = Instant::now();
        let run = Run {
            sandbox: sandbox.to_string(),
            routing_key: entry.routing_key,
            reference_key,
            namespaces: entry.namespaces,
            until: now + Duration::from_secs(u64::from(seconds)),
        };
        state.runs.start(id.clone(), run.clone(), now)?;
        state.refresh();
        let watching = state
            .watchers
            .keys()
            .filter(|b| run.namespaces.contains(&b.namespace))
            .count();
        Ok(StartedRun { id, run, watching })
    }

    /// The live run `id`.
    pub fn run(&self, id: &str) -> Option<Run> {
        self.state().runs.get(id).cloned()
    }

    /// Ends run `id`; whether it was live. Its exchanges still count for [`CAPTURE_GRACE`].
    pub fn end_run(&self, id: &str) -> bool {
        let mut state = self.state();
        let ended = state.runs.end(id, Instant::now());
        if ended {
            state.refresh();
        }
        ended
    }

    /// Ends the runs past their time (and forgets ended ones past the grace); how many live.
    pub fn sweep_runs(&self) -> usize {
        let mut state = self.state();
        if state.runs.sweep(Instant::now(), CAPTURE_GRACE) {
            state.refresh();
        }
        state.runs.live()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(sandbox: &str, ns: &[&str], until: Instant) -> Run {
        Run {
            sandbox: sandbox.into(),
            routing_key: format!("{sandbox}-key"),
            reference_key: format!("{sandbox}-ref"),
            namespaces: ns.iter().map(|n| n.to_string()).collect(),
            until,
        }
    }

    #[test]
    fn a_run_captures_both_keys_in_its_namespaces_until_it_ends_and_a_grace_after() {
        let now = Instant::now();
        let grace = Duration::from_secs(30);
        let mut runs = Runs::default();
        runs.start(
            "r1".into(),
            run("sb", &["shop"], now + Duration::from_secs(60)),
            now,
        )
        .unwrap();
        let keys: Vec<String> = runs.keys_in("shop").map(|k| k.routing_key).collect();
        assert_eq!(keys, ["sb-key", "sb-ref"]);
        assert_eq!(runs.keys_in("other").count(), 0);
        assert!(runs.captures("shop", "sb", "sb-ref", now, grace));
        assert!(!runs.captures("shop", "other-sb", "sb-ref", now, grace));
        assert!(!runs.captures("other", "sb", "sb-key", now, grace));
        assert!(!runs.captures("shop", "sb", "elsewhere", now, grace));

        assert!(runs.end("r1", now));
        assert!(!runs.end("r1", now), "ended once");
        assert_eq!(runs.keys_in("shop").count(), 0);
        assert!(runs.captures("shop", "sb", "sb-key", now + Duration::from_secs(29), grace));
        assert!(!runs.captures("shop", "sb", "sb-key", now + Duration::from_secs(31), grace));
    }

    #[test]
    fn runs_expire_and_are_bounded_per_sandbox_and_in_all() {
        let now = Instant::now();
        let mut runs = Runs::default();
        let until = now + Duration::from_secs(10);
        for i in 0..MAX_RUNS_PER_SANDBOX {
            runs.start(format!("a{i}"), run("a", &["x"], until), now)
                .unwrap();
        }
        let Err(Error::Exhausted(why)) = runs.start("a-more".into(), run("a", &["x"], until), now)
        else {
            panic!("a fifth run of one sandbox started");
        };
        assert!(why.contains("sandbox a has 4 runs"), "{why}");
        for i in MAX_RUNS_PER_SANDBOX..MAX_RUNS {
            runs.start(format!("b{i}"), run(&format!("b{i}"), &["x"], until), now)
                .unwrap();
        }
        assert!(
            runs.start("c".into(), run("c", &["x"], until), now)
                .is_err()
        );
        assert!(!runs.sweep(now + Duration::from_secs(9), Duration::from_secs(30)));
        assert!(runs.sweep(now + Duration::from_secs(10), Duration::from_secs(30)));
        assert_eq!(runs.live(), 0);
        runs.start(
            "c".into(),
            run("c", &["x"], until + Duration::from_secs(60)),
            now,
        )
        .unwrap();
        assert_eq!(runs.keys_in("x").count(), 2);
    }

    #[tokio::test]
    async fn the_index_sends_a_runs_keys_to_the_sidecars_of_its_namespaces_only() {
        use crate::settings::{
            Baseline, SandboxSettings, SettingsFile, SettingsIndex, WorkloadRef,
        };
        let file = SettingsFile {
            sandboxes: vec![SandboxSettings {
                name: "sb".into(),
                routing_key: "k1".into(),
                workloads: vec![WorkloadRef {
                    kind: "Deployment".into(),
                    namespace: "shop".into(),
                    name: "front".into(),
                }],
            }],
            ..SettingsFile::default()
        };
        let index = SettingsIndex::new(file.compile());
        let front = Baseline::new("Deployment", "shop", "front");
        let catalog = Baseline::new("Deployment", "shop", "catalog");
        let other = Baseline::new("Deployment", "other", "catalog");
        let mut at_catalog = index.watch(&catalog);
        let at_other = index.watch(&other);
        let at_front = index.watch(&front);
        assert!(at_catalog.borrow_and_update().keys.is_empty());
        assert!(!index.captures(&catalog, "sb", "k1"));

        let started = index
            .start_run(
                "sb",
                &index.sandbox("sb").unwrap(),
                60,
                "id1".into(),
                "ref1".into(),
            )
            .unwrap();
        assert_eq!(started.watching, 2, "front and catalog watch in shop");
        assert_eq!(started.run.routing_key, "k1");
        assert!(at_catalog.has_changed().unwrap());
        let keys: Vec<String> = at_catalog
            .borrow_and_update()
            .keys
            .iter()
            .map(|k| format!("{}={}", k.sandbox, k.routing_key))
            .collect();
        assert_eq!(keys, ["sb=k1", "sb=ref1"]);
        // The forked baseline already captured k1: listed once.
        assert_eq!(at_front.borrow().keys.len(), 2);
        assert!(!at_other.has_changed().unwrap());
        assert!(index.captures(&catalog, "sb", "ref1"));
        assert!(!index.captures(&other, "sb", "ref1"));

        // New sandbox settings keep the run's keys.
        index.replace(file.compile());
        assert_eq!(index.current(&catalog).keys.len(), 2);

        assert!(index.end_run("id1"));
        assert!(index.current(&catalog).keys.is_empty());
        assert!(at_catalog.has_changed().unwrap());
        assert!(index.captures(&catalog, "sb", "ref1"), "within the grace");
        assert!(!at_other.has_changed().unwrap());

        let e = index
            .start_run(
                "nope",
                &SandboxEntry::default(),
                60,
                "id2".into(),
                "ref2".into(),
            )
            .unwrap_err();
        assert!(matches!(e, crate::Error::NotFound(_)), "{e}");
        let e = index
            .start_run(
                "sb",
                &index.sandbox("sb").unwrap(),
                MAX_RUN_SECONDS + 1,
                "id3".into(),
                "ref3".into(),
            )
            .unwrap_err();
        assert!(matches!(e, crate::Error::Invalid(_)), "{e}");
    }
}
