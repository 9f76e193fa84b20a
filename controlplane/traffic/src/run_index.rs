//! The settings index's side of run captures: starting, ending and sweeping them, where the
//! sidecars' settings are sent out again (the runs themselves are `runs`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::Error;
use crate::runs::{DEFAULT_RUN_SECONDS, Delegated, MAX_RUN_SECONDS, Run, SandboxEntry};
use crate::settings::{CAPTURE_GRACE, SettingsIndex};

/// What the caller makes of a run: random values (this module does not make them) and who
/// it is for.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub id: String,
    pub reference_key: String,
    /// Who asked, or whom it is for (the per-user bound).
    pub started_by: String,
    pub delegated: Option<Delegated>,
}

/// Microseconds since the Unix epoch (0 before it).
pub(crate) fn unix_micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
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
    /// key and `new.reference_key` at every baseline of the namespaces it forks from, which
    /// must still be `checked` (what the caller's rights were checked for: ABORTED otherwise).
    /// The watchers there are sent their new settings before this returns.
    pub fn start_run(
        &self,
        sandbox: &str,
        checked: &SandboxEntry,
        seconds: u32,
        new: NewRun,
    ) -> Result<StartedRun, Error> {
        let NewRun {
            id,
            reference_key,
            started_by,
            delegated,
        } = new;
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
            started_by,
            since_unix_micros: unix_micros(SystemTime::now()),
            delegated,
        };
        if let Some(old) = state.runs.start(id.clone(), run.clone(), now)? {
            tracing::info!(sandbox, replaced = %old, "a run capture for the same job replaces the live one");
        }
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

    /// Run `id`, live or ended less than [`CAPTURE_GRACE`] ago, and whether it is live.
    pub fn find_run(&self, id: &str) -> Option<(Run, bool)> {
        self.state()
            .runs
            .find(id, Instant::now(), CAPTURE_GRACE)
            .map(|(run, live)| (run.clone(), live))
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

    fn new(id: &str, reference_key: &str) -> NewRun {
        NewRun {
            id: id.into(),
            reference_key: reference_key.into(),
            started_by: "ann".into(),
            delegated: None,
        }
    }

    #[tokio::test]
    async fn the_index_sends_a_runs_keys_to_the_sidecars_of_its_namespaces_only() {
        use crate::settings::{Baseline, SandboxSettings, SettingsFile, WorkloadRef};
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
            .start_run("sb", &index.sandbox("sb").unwrap(), 60, new("id1", "ref1"))
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
        let (ended, live) = index.find_run("id1").unwrap();
        assert!(!live);
        assert_eq!(ended.reference_key, "ref1");
        assert!(ended.since_unix_micros > 0);

        let e = index
            .start_run("nope", &SandboxEntry::default(), 60, new("id2", "ref2"))
            .unwrap_err();
        assert!(matches!(e, crate::Error::NotFound(_)), "{e}");
        let e = index
            .start_run(
                "sb",
                &index.sandbox("sb").unwrap(),
                MAX_RUN_SECONDS + 1,
                new("id3", "ref3"),
            )
            .unwrap_err();
        assert!(matches!(e, crate::Error::Invalid(_)), "{e}");
    }
}
