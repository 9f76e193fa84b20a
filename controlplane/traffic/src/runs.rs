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

/// Runs capturing at once, per sandbox, per user and in all: a run is one test at a time, and
/// one user (their runs on many sandboxes) cannot take every slot from the others.
pub const MAX_RUNS_PER_SANDBOX: usize = 4;
pub const MAX_RUNS_PER_USER: usize = 8;
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
    /// Who started it (the API server's username; empty for the static token, whose runs the
    /// per-user bound does not count: it is one operator's, not a tenant's). For a run started
    /// for a user, that user.
    pub started_by: String,
    /// When it started, microseconds since the Unix epoch (the store's clock).
    pub since_unix_micros: i64,
    /// Set when a component started it for a user: it is read back with its own token.
    pub delegated: Option<Delegated>,
}

/// What a run started for a user (`run_for`) is read back and ended with.
#[derive(Clone, PartialEq, Eq)]
pub struct Delegated {
    /// The bearer token of ReadRun and EndRunCapture for this run alone.
    pub token: String,
    /// The tag its requests' markers start with (`spur-test-step=<tag>.<step>.<pass>`).
    pub tag: String,
    /// The caller's job it is for (`namespace/name`; empty: none). A run started for the same
    /// job, sandbox and user by the same caller replaces this one; the delegate ends it only by
    /// naming it.
    pub job: String,
    /// Who started it for the user: the delegate's username (empty for the static token).
    pub by: String,
}

/// Never the token: a run may be logged.
impl std::fmt::Debug for Delegated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delegated")
            .field("token", &"<redacted>")
            .field("tag", &self.tag)
            .field("job", &self.job)
            .field("by", &self.by)
            .finish()
    }
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
    /// Ended or expired runs by id and when: exchanges captured just before still count, and
    /// a run started for a user is still read back.
    ended: Vec<(String, Run, Instant)>,
}

impl Runs {
    /// Adds `run` under `id`, unless that would pass a bound. A run for a job
    /// (`Delegated::job`) ends the live run of the same job, sandbox, user and caller first,
    /// and returns its id: that caller asks again only when it has no job using it (it lost the
    /// answer, or stopped before it made the job, or the job was deleted), and a new job must
    /// not read the old one's exchanges.
    pub(crate) fn start(
        &mut self,
        id: String,
        run: Run,
        now: Instant,
    ) -> Result<Option<String>, Error> {
        self.sweep(now, Duration::ZERO);
        let replaced = self.of_job(&run);
        if let Some(old) = &replaced {
            self.end(old, now);
        }
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
        let theirs = self
            .live
            .values()
            .filter(|r| !run.started_by.is_empty() && r.started_by == run.started_by)
            .count();
        if theirs >= MAX_RUNS_PER_USER {
            return Err(Error::Exhausted(format!(
                "{} has {MAX_RUNS_PER_USER} runs capturing already; retry when one ends",
                run.started_by
            )));
        }
        self.live.insert(id, run);
        Ok(replaced)
    }

    /// The id of the live run of `run`'s job, sandbox, user and caller.
    fn of_job(&self, run: &Run) -> Option<String> {
        let new = run.delegated.as_ref().filter(|d| !d.job.is_empty())?;
        self.live
            .iter()
            .find(|(_, r)| {
                r.sandbox == run.sandbox
                    && r.started_by == run.started_by
                    && r.delegated
                        .as_ref()
                        .is_some_and(|d| d.job == new.job && d.by == new.by)
            })
            .map(|(id, _)| id.clone())
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Run> {
        self.live.get(id)
    }

    /// Run `id`, live or ended less than `grace` ago, and whether it is live.
    pub(crate) fn find(&self, id: &str, now: Instant, grace: Duration) -> Option<(&Run, bool)> {
        if let Some(run) = self.live.get(id) {
            return Some((run, true));
        }
        self.ended
            .iter()
            .rev()
            .find(|(i, _, at)| i == id && now.saturating_duration_since(*at) < grace)
            .map(|(_, run, _)| (run, false))
    }

    /// Ends run `id`; whether it was live.
    pub(crate) fn end(&mut self, id: &str, now: Instant) -> bool {
        let Some(run) = self.live.remove(id) else {
            return false;
        };
        self.remember(id.to_owned(), run, now);
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
                self.remember(id.clone(), run, now);
            }
        }
        if !grace.is_zero() {
            self.ended
                .retain(|(_, _, at)| now.saturating_duration_since(*at) < grace);
        }
        !expired.is_empty()
    }

    fn remember(&mut self, id: String, run: Run, now: Instant) {
        if self.ended.len() >= MAX_ENDED {
            self.ended.remove(0);
        }
        self.ended.push((id, run, now));
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
            || self.ended.iter().any(|(_, r, at)| {
                now.saturating_duration_since(*at) < grace
                    && r.takes(namespace, sandbox, routing_key)
            })
    }

    pub(crate) fn live(&self) -> usize {
        self.live.len()
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
            started_by: String::new(),
            since_unix_micros: 0,
            delegated: None,
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
        // Found, as ended, as long as its exchanges count.
        let found = |at: u64| {
            runs.find("r1", now + Duration::from_secs(at), grace)
                .map(|(r, live)| (r.sandbox.clone(), live))
        };
        assert_eq!(found(29), Some(("sb".into(), false)));
        assert_eq!(found(31), None);
        assert!(runs.find("r2", now, grace).is_none());
    }

    #[test]
    fn a_delegated_runs_token_is_never_printed() {
        let d = Delegated {
            token: "secret-token".into(),
            tag: "t1".into(),
            job: "team-a/run-1".into(),
            by: "system:serviceaccount:spur-system:spur-operator".into(),
        };
        let printed = format!("{d:?}");
        assert!(!printed.contains("secret-token"), "{printed}");
        assert!(printed.contains("t1"), "{printed}");
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

    #[test]
    fn one_user_holds_at_most_their_share_of_the_runs() {
        let now = Instant::now();
        let until = now + Duration::from_secs(10);
        let by = |user: &str, sandbox: String| Run {
            started_by: user.into(),
            ..run(&sandbox, &["x"], until)
        };
        let mut runs = Runs::default();
        for i in 0..MAX_RUNS_PER_USER {
            runs.start(format!("a{i}"), by("ann", format!("sb{i}")), now)
                .unwrap();
        }
        let Err(Error::Exhausted(why)) = runs.start("a-more".into(), by("ann", "sb-x".into()), now)
        else {
            panic!("ann took a ninth run");
        };
        assert!(why.contains("ann has 8 runs"), "{why}");
        // Another user, and the static token (no user), still get theirs.
        runs.start("b".into(), by("bob", "sb-x".into()), now)
            .unwrap();
        runs.start("op".into(), by("", "sb-y".into()), now).unwrap();
        assert!(runs.end("a0", now));
        runs.start("a-again".into(), by("ann", "sb-x".into()), now)
            .unwrap();
    }

    #[test]
    fn a_run_for_a_job_replaces_the_live_run_its_caller_started_for_that_job() {
        let now = Instant::now();
        let until = now + Duration::from_secs(60);
        let for_job = |job: &str, user: &str, by: &str| Run {
            started_by: user.into(),
            delegated: Some(Delegated {
                token: "t".into(),
                tag: "g".into(),
                job: job.into(),
                by: by.into(),
            }),
            ..run("sb", &["x"], until)
        };
        let mut runs = Runs::default();
        let first = for_job("team-a/run-1", "ann", "op");
        assert_eq!(runs.start("r1".into(), first.clone(), now).unwrap(), None);
        // Asked again for the same job: the first run ends (its exchanges still count for the
        // grace), the new one takes its place, and the bounds count one.
        assert_eq!(
            runs.start("r2".into(), first.clone(), now).unwrap(),
            Some("r1".into())
        );
        assert!(runs.get("r1").is_none() && runs.get("r2").is_some());
        assert_eq!(
            runs.find("r1", now, Duration::from_secs(30))
                .map(|(_, l)| l),
            Some(false)
        );
        assert_eq!(runs.live(), 1);
        for i in 0..MAX_RUNS_PER_SANDBOX {
            runs.start(format!("again-{i}"), first.clone(), now)
                .unwrap();
        }
        assert_eq!(runs.live(), 1, "one job holds one slot");
        // Another job, user or caller, or no job at all: a run of its own beside it.
        for (i, (job, user, by)) in [
            ("team-a/run-2", "ann", "op"),
            ("team-a/run-1", "bob", "op"),
            ("team-a/run-1", "ann", "another-delegate"),
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(
                runs.start(format!("o{i}"), for_job(job, user, by), now)
                    .unwrap(),
                None,
                "{job} {user} {by}"
            );
        }
        assert_eq!(runs.live(), 4);
    }
}
