//! A directory-free, single-file rule source, polled for changes.
//!
//! Polling (default every second) rather than inotify: it sees atomic renames, editors that
//! replace files, and Kubernetes ConfigMap symlink swaps alike, and costs one small read per
//! interval.

use std::path::{Path, PathBuf};
use std::time::Duration;

use spur_routing::RoutingRule;
use spur_routing::rules::{parse_document, validate_rules};
use tokio_util::sync::CancellationToken;

use crate::{Error, Publisher};

/// Largest rule file accepted; protects the sidecar from a runaway file.
const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// Parses and validates a rule file's bytes (YAML, which includes JSON). An empty file is an
/// empty rule set.
pub fn parse_rules(path: &str, bytes: &[u8]) -> Result<Vec<RoutingRule>, Error> {
    let specs = parse_document(bytes).map_err(|e| Error::Parse {
        path: path.to_string(),
        reason: e.to_string(),
    })?;
    validate_rules(specs).map_err(|source| Error::Invalid {
        path: path.to_string(),
        source,
    })
}

/// Watches one rule file and publishes every valid version of it.
pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    publisher: Publisher,
    last: Option<Vec<u8>>,
}

impl FileSource {
    pub fn new(path: impl Into<PathBuf>, interval: Duration, publisher: Publisher) -> Self {
        FileSource {
            path: path.into(),
            interval: interval.max(Duration::from_millis(10)),
            publisher,
            last: None,
        }
    }

    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Reads the file once; publishes it if it changed and is valid. Returns the published
    /// version, `Ok(None)` if unchanged, or the error (already reported).
    pub async fn poll_once(&mut self) -> Result<Option<u64>, Error> {
        let res = read_bounded(&self.path).await;
        let bytes = match res {
            Ok(b) => b,
            Err(e) => {
                // Report a missing or unreadable file once per distinct state, not every tick.
                if self.last.as_deref() != Some(b"\0unreadable") {
                    self.publisher.reject(&e);
                    self.last = Some(b"\0unreadable".to_vec());
                }
                return Err(e);
            }
        };
        if self.last.as_deref() == Some(bytes.as_slice()) {
            return Ok(None);
        }
        let parsed = parse_rules(&self.path.display().to_string(), &bytes);
        self.last = Some(bytes);
        match parsed {
            Ok(rules) => {
                let n = rules.len();
                let version = self.publisher.publish(rules);
                tracing::info!(path = %self.path.display(), rules = n, version, "routing table published");
                Ok(Some(version))
            }
            Err(e) => {
                self.publisher.reject(&e);
                Err(e)
            }
        }
    }

    /// Polls until `stop` is cancelled.
    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            let _ = self.poll_once().await;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

async fn read_bounded(path: &Path) -> Result<Vec<u8>, Error> {
    let err = |source| Error::Read {
        path: path.display().to_string(),
        source,
    };
    let meta = tokio::fs::metadata(path).await.map_err(err)?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(err(std::io::Error::other(format!(
            "file is larger than {MAX_FILE_BYTES} bytes"
        ))));
    }
    tokio::fs::read(path).await.map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;
    use spur_routing::SharedTable;

    const RULES: &str = r#"
- routingKey: dev1
  baseline: {kind: Deployment, namespace: demo, name: web}
  destinationSandbox: {name: sb1}
  mappings:
    - workloadPort: 8080
      destinations: [{host: 127.0.0.1, port: 9180}]
"#;

    #[test]
    fn parses_list_object_and_empty() {
        assert_eq!(parse_rules("x", RULES.as_bytes()).unwrap().len(), 1);
        let json = r#"{"routingRules":[{"routingKey":"k","baseline":{"kind":"Deployment","namespace":"n","name":"w"},"destinationSandbox":{"name":"s"},"mappings":[]}]}"#;
        assert_eq!(parse_rules("x", json.as_bytes()).unwrap().len(), 1);
        assert!(parse_rules("x", b"  \n").unwrap().is_empty());
        let err = parse_rules("f.yaml", b"- routingKey: [")
            .unwrap_err()
            .to_string();
        assert!(err.contains("f.yaml"), "{err}");
        let err = parse_rules("f.yaml", RULES.replace("8080", "0").as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains("workloadPort 0"), "{err}");
    }

    #[tokio::test]
    async fn keeps_last_good_table_and_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.yaml");
        std::fs::write(&path, RULES).unwrap();
        let table = SharedTable::new();
        let mut registry = Registry::default();
        let publisher = Publisher::new(table.clone(), &mut registry);
        let mut changes = publisher.subscribe();
        let mut src = FileSource::new(&path, Duration::from_millis(10), publisher);

        assert_eq!(src.poll_once().await.unwrap(), Some(1));
        assert!(changes.has_changed().unwrap());
        assert_eq!(*changes.borrow_and_update(), 1);
        assert_eq!(
            src.poll_once().await.unwrap(),
            None,
            "unchanged file is not republished"
        );

        std::fs::write(&path, "not: [valid").unwrap();
        assert!(src.poll_once().await.is_err());
        assert_eq!(table.load().version, 1, "last good table stays");
        assert_eq!(table.load().table.len(), 1);

        std::fs::remove_file(&path).unwrap();
        assert!(src.poll_once().await.is_err());
        assert_eq!(table.load().table.len(), 1);

        std::fs::write(&path, RULES.replace("dev1", "dev2")).unwrap();
        assert_eq!(src.poll_once().await.unwrap(), Some(2));
        assert_eq!(table.load().table.rules()[0].routing_key, "dev2");

        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("route_table_updates_total{result=\"rejected\"} 2"),
            "{out}"
        );
        assert!(out.contains("route_table_version 2"), "{out}");
    }
}
