//! Rule stores feed the index with complete rule sets. The standalone store is a directory of
//! rule files; the Kubernetes store (RoutingConfig status) is another implementation.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use spur_routing::RoutingRule;
use spur_routing::rules::{parse_document, validate_rules};
use tokio_util::sync::CancellationToken;

use crate::index::{Index, RuleKey};
use crate::metrics::Metrics;

/// Largest rule file read; a bigger one is reported and ignored.
const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// A source of complete rule sets.
pub trait RuleStore: Send + 'static {
    /// Loads the first complete rule set into `index`. The route server calls it before it
    /// serves anything, so no watcher ever sees a partial or empty set that merely means
    /// "not loaded yet".
    fn initial(
        &mut self,
        index: &Index,
        metrics: &Metrics,
    ) -> impl Future<Output = Result<(), crate::Error>> + Send;

    /// Publishes into `index` until `stop` is cancelled.
    fn run(
        self,
        index: Index,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + Send;
}

#[derive(Default)]
struct FileState {
    bytes: Vec<u8>,
    /// The last valid content of this file; kept while the file is invalid.
    good: Option<Vec<RoutingRule>>,
    error: Option<String>,
}

/// A directory of rule files (`*.yaml`, `*.yml`, `*.json`; hidden files are skipped), polled.
///
/// Each file is validated on its own. An invalid file is reported (log, metric, `/healthz`) and
/// its last valid content stays in force, so a typo never withdraws routes; a file that was never
/// valid contributes nothing. When two files define the same (baseline, routing key), the file
/// whose name sorts first wins and the conflict is reported.
pub struct DirStore {
    dir: PathBuf,
    interval: Duration,
    files: BTreeMap<PathBuf, FileState>,
    dir_error: Option<String>,
}

impl DirStore {
    pub fn new(dir: impl Into<PathBuf>, interval: Duration) -> Self {
        DirStore {
            dir: dir.into(),
            interval: interval.max(Duration::from_millis(5)),
            files: BTreeMap::new(),
            dir_error: None,
        }
    }

    fn list(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !name.starts_with('.') && matches!(ext, "yaml" | "yml" | "json") && path.is_file() {
                out.push(path);
            }
        }
        Ok(out)
    }

    /// One pass: re-read changed files, merge, publish. Returns the problems found.
    pub fn poll_once(&mut self, index: &Index, metrics: &Metrics) -> Vec<String> {
        let listed = self.list();
        let recovered = listed.is_ok() && self.dir_error.take().is_some();
        let paths = match listed {
            Ok(p) => p,
            Err(e) => {
                let msg = format!("cannot read rules directory {}: {e}", self.dir.display());
                if self.dir_error.as_deref() != Some(&msg) {
                    tracing::warn!("{msg}; keeping the rules in force");
                    metrics.file_errors.inc();
                    self.dir_error = Some(msg.clone());
                }
                // An unreadable directory withdraws nothing.
                index.set_problems(vec![msg.clone()]);
                return vec![msg];
            }
        };
        // Merging and publishing cost O(rules): do it only when some file changed.
        let before = self.files.len();
        self.files.retain(|p, _| paths.contains(p));
        let mut changed = self.files.len() != before || recovered;
        for path in paths {
            let state = self.files.entry(path.clone()).or_default();
            let bytes = match read_bounded(&path) {
                Ok(b) => b,
                Err(e) => {
                    let msg = format!("{}: {e}", path.display());
                    if state.error.as_deref() != Some(&msg) {
                        tracing::warn!("{msg}");
                        metrics.file_errors.inc();
                    }
                    changed |= state.error.as_deref() != Some(&msg);
                    state.error = Some(msg);
                    continue;
                }
            };
            if bytes == state.bytes && (state.good.is_some() || state.error.is_some()) {
                continue;
            }
            changed = true;
            let parsed = parse_document(&bytes).and_then(validate_rules);
            state.bytes = bytes;
            match parsed {
                Ok(rules) => {
                    state.good = Some(rules);
                    state.error = None;
                }
                Err(e) => {
                    let msg = format!("{}: {e}", path.display());
                    tracing::warn!(
                        "invalid rule file ignored (its last valid content stays in force): {msg}"
                    );
                    metrics.file_errors.inc();
                    state.error = Some(msg);
                }
            }
        }
        if !changed && index.current().version > 0 {
            return index.problems().as_ref().clone();
        }
        let mut problems: Vec<String> = self
            .files
            .values()
            .filter_map(|s| s.error.clone())
            .collect();
        let mut owner: HashMap<RuleKey, &Path> = HashMap::new();
        let mut merged = Vec::new();
        for (path, state) in &self.files {
            for rule in state.good.iter().flatten() {
                let key = RuleKey {
                    baseline: rule.baseline.clone(),
                    routing_key: rule.routing_key.clone(),
                };
                if let Some(first) = owner.get(&key) {
                    problems.push(format!(
                        "{}: rule for routing key {:?} and baseline {} ignored: already defined in {}",
                        path.display(),
                        rule.routing_key,
                        rule.baseline,
                        first.display()
                    ));
                    continue;
                }
                owner.insert(key, path);
                merged.push(rule.clone());
            }
        }
        let invalid = self.files.values().filter(|s| s.error.is_some()).count();
        metrics.set_files(self.files.len() - invalid, invalid);
        index.replace_all(merged);
        metrics.set_problems(problems.len());
        index.set_problems(problems.clone());
        problems
    }
}

impl RuleStore for DirStore {
    async fn initial(&mut self, index: &Index, metrics: &Metrics) -> Result<(), crate::Error> {
        if !self.dir.is_dir() {
            return Err(crate::Error::RulesDir {
                path: self.dir.display().to_string(),
                reason: "not a directory".into(),
            });
        }
        // Invalid files are reported, not fatal: the server starts with the valid ones.
        self.poll_once(index, metrics);
        Ok(())
    }

    async fn run(mut self, index: Index, metrics: Metrics, stop: CancellationToken) {
        loop {
            self.poll_once(&index, &metrics);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let len = std::fs::metadata(path)?.len();
    if len > MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "file is larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    std::fs::read(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_yaml(key: &str, name: &str, port: u16) -> String {
        format!(
            "- routingKey: {key}\n  baseline: {{kind: Deployment, namespace: ns, name: {name}}}\n  destinationSandbox: {{name: sb}}\n  mappings: [{{workloadPort: 80, destinations: [{{host: h, port: {port}}}]}}]\n"
        )
    }

    #[test]
    fn invalid_files_keep_their_last_good_content_and_conflicts_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::new();
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let mut store = DirStore::new(dir.path(), Duration::from_millis(10));
        std::fs::write(dir.path().join("a.yaml"), rule_yaml("k1", "web", 1)).unwrap();
        std::fs::write(dir.path().join("b.yml"), rule_yaml("k2", "web", 1)).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        std::fs::write(dir.path().join(".hidden.yaml"), "garbage: [").unwrap();
        assert!(store.poll_once(&index, &metrics).is_empty());
        assert_eq!(index.current().rules.len(), 2);

        std::fs::write(dir.path().join("b.yml"), "- routingKey: [broken").unwrap();
        let problems = store.poll_once(&index, &metrics);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("b.yml"));
        assert_eq!(
            index.current().rules.len(),
            2,
            "last good content of b.yml stays"
        );

        std::fs::write(dir.path().join("c.json"), "[{\"routingKey\":\"x\"}]").unwrap();
        let problems = store.poll_once(&index, &metrics);
        assert_eq!(
            problems.len(),
            2,
            "a never-valid file is reported: {problems:?}"
        );
        assert_eq!(index.current().rules.len(), 2);

        std::fs::write(dir.path().join("b.yml"), rule_yaml("k1", "web", 9)).unwrap();
        std::fs::remove_file(dir.path().join("c.json")).unwrap();
        let problems = store.poll_once(&index, &metrics);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("already defined in") && problems[0].contains("a.yaml"));
        let snap = index.current();
        assert_eq!(snap.rules.len(), 1);
        assert_eq!(
            snap.rules.values().next().unwrap().rule.mappings[0].destinations[0].port,
            1,
            "a.yaml wins"
        );

        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        assert!(store.poll_once(&index, &metrics).is_empty());
        assert_eq!(
            index.current().rules.values().next().unwrap().rule.mappings[0].destinations[0].port,
            9
        );
    }
}
