//! A baseline sidecar's routing table watched from the host through the chaos run: its admin
//! port's `/config_dump` is served to loopback clients only, so it is read from inside the
//! pod's network namespace (`nsenter`), a few times a second. Only changes are kept: the table's
//! version, its rules' keys and whether the watched key is among them, each with the wall-clock time
//! (the load log's), so a keyed request answered by the baseline can be set beside what the
//! sidecar's table held at that moment.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;
use spur_e2e::node::Node;

/// How often the table is read.
const EVERY: Duration = Duration::from_millis(200);
/// Bounds the record: a sidecar that changes its table more often than this is itself news.
const MAX_LINES: usize = 2_000;

/// The running watch; [`TableWatch::stop`] ends it and returns what it saw.
pub(crate) struct TableWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<String>>,
}

impl TableWatch {
    /// Starts watching the sidecar of `pod` (its container `container` gives the netns) for
    /// `key`.
    pub(crate) fn start(node: &Node, ns: &str, pod: &str, container: &str, key: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let pid = netns_pid(node, ns, pod, container);
        let key = key.to_owned();
        let thread = std::thread::spawn(move || {
            let mut seen: Vec<String> = Vec::new();
            let mut last = String::new();
            while !flag.load(Ordering::Relaxed) && seen.len() < MAX_LINES {
                let state = match &pid {
                    Ok(pid) => read(pid, &key),
                    Err(e) => format!("no pid to read the table from: {e}"),
                };
                if state != last {
                    seen.push(format!("{} {state}", super::now()));
                    last = state;
                }
                std::thread::sleep(EVERY);
            }
            seen
        });
        TableWatch { stop, thread }
    }

    /// Ends the watch: the table's changes, one line each.
    pub(crate) fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .unwrap_or_else(|_| vec!["the table watch panicked".into()])
    }
}

/// The host pid of the pod's container (any container of a pod is in its network namespace).
fn netns_pid(node: &Node, ns: &str, pod: &str, container: &str) -> anyhow::Result<String> {
    let p = node.get_json(ns, &["pod", pod])?;
    let id = p["status"]["containerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == container)
        .and_then(|s| s["containerID"].as_str())
        .ok_or_else(|| anyhow::anyhow!("pod {pod} has no running container {container}"))?;
    node.task_pid(id)
}

/// One reading: the table's version, its rules and whether `key` is among them (or why the
/// table could not be read).
fn read(pid: &str, key: &str) -> String {
    let out = Command::new("nsenter")
        .args(["-t", pid, "-n", "curl", "-sS", "--max-time", "2"])
        .arg("http://127.0.0.1:15020/config_dump")
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o.stdout,
        Ok(o) => return format!("unreadable: {}", String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => return format!("unreadable: {e}"),
    };
    let dump: Value = match serde_json::from_slice(&out) {
        Ok(v) => v,
        Err(e) => return format!("not JSON ({e}): {}", String::from_utf8_lossy(&out)),
    };
    let rules = dump["routingRules"].as_array().cloned().unwrap_or_default();
    let holds = rules.iter().any(|r| r["routingKey"] == key);
    let mut keys: Vec<&str> = rules
        .iter()
        .filter_map(|r| r["routingKey"].as_str())
        .collect();
    keys.sort_unstable();
    format!(
        "table version {}, {} rules, {} the key: {}",
        dump["tableVersion"],
        rules.len(),
        if holds { "holds" } else { "WITHOUT" },
        keys.join(" ")
    )
}
