//! The operator child's reconcile passes, as it reports them, and waiting for it to settle.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::QUIET;
use crate::component::{Component, Usage};

/// The operator's pass counts as its child reports them, and when they last changed.
pub(crate) struct Passes {
    kinds: BTreeMap<String, (u64, u64)>,
    failures: u64,
    pub(crate) scrape: Duration,
    last_change: Instant,
}

impl Passes {
    pub(crate) fn new(since: Instant) -> Self {
        Passes {
            kinds: BTreeMap::new(),
            failures: 0,
            scrape: Duration::ZERO,
            last_change: since,
        }
    }

    fn update(&mut self, at: Instant, line: &str) {
        let Some(rest) = line.strip_prefix("passes ") else {
            return;
        };
        let mut words = rest.split_whitespace();
        if let Some(us) = words.next().and_then(|w| w.parse().ok()) {
            self.scrape = Duration::from_micros(us);
        }
        let mut kinds = BTreeMap::new();
        for word in words {
            let Some((kind, counts)) = word.split_once('=') else {
                continue;
            };
            if kind == "failures" {
                self.failures = counts.parse().unwrap_or(0);
            } else if let Some((s, e)) = counts.split_once('/') {
                kinds.insert(
                    kind.to_string(),
                    (s.parse().unwrap_or(0), e.parse().unwrap_or(0)),
                );
            }
        }
        if kinds != self.kinds {
            self.kinds = kinds;
            self.last_change = at;
        }
    }

    fn ended(&self, kind: &str) -> u64 {
        self.kinds.get(kind).map_or(0, |c| c.1)
    }

    /// At least one ended pass per object of the three kinds a sandbox makes (N Sandboxes,
    /// 2N ForkedWorkloads, N RoutingConfigs), and none running.
    fn covers(&self, n: u64) -> bool {
        self.ended("Sandbox") >= n
            && self.ended("ForkedWorkload") >= 2 * n
            && self.ended("RoutingConfig") >= n
            && self.kinds.values().all(|(s, e)| s == e)
    }

    pub(crate) fn summary(&self) -> String {
        let mut out: Vec<String> = self
            .kinds
            .iter()
            .map(|(k, (_, e))| format!("{k} {e}"))
            .collect();
        out.push(format!("failures {}", self.failures));
        out.join(", ")
    }
}

/// The operator's usage, the time its metric reads took taken off its CPU time (as of its last
/// report, at most a second old).
pub(crate) fn op_usage(op: &mut Component, passes: &mut Passes) -> Usage {
    while let Ok((t, line)) = op.lines.try_recv() {
        passes.update(t, &line);
    }
    let mut usage = op.usage();
    usage.cpu -= passes.scrape.as_secs_f64();
    usage
}

/// Waits until the operator's passes cover `n` sandboxes' objects and none started or ended for
/// `QUIET`; returns when the last pass ended.
pub(crate) async fn settle(
    op: &mut Component,
    passes: &mut Passes,
    n: u64,
    deadline: Instant,
    what: &str,
) -> Result<Instant> {
    loop {
        let covered = passes.covers(n);
        let now = Instant::now();
        if covered && now >= passes.last_change + QUIET {
            return Ok(passes.last_change);
        }
        if now > deadline {
            bail!(
                "{what}: the operator did not settle (passes ending for all of {n} Sandboxes, {} ForkedWorkloads and {n} RoutingConfigs, none running, then none for {QUIET:?}); passes so far (started/ended): {:?}",
                2 * n,
                passes.kinds
            );
        }
        let until = if covered {
            (passes.last_change + QUIET).min(deadline)
        } else {
            deadline
        };
        if let Some((t, line)) = op.next_line(until).await? {
            passes.update(t, &line);
        }
    }
}
