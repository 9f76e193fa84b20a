//! What the containers of the node use over a whole test run, read from their cgroups (v1) on
//! the host: peak memory (the kubelet's working set, usage minus inactive file pages, and RSS)
//! and CPU (`cpuacct.usage`), per container, grouped by component. The chart's requests and
//! limits are set from these figures (perf/results/requests-limits.md) and the node test checks
//! no component came near its memory limit.
//!
//! The disk the node lives on is read at each sample too: the least free space of the run is in
//! the report (CI's machine once filled it, and the kubelet stopped scheduling pods).
//!
//! A thread walks the node's pod cgroups every [`SAMPLE_EVERY`] and asks the API server which
//! pod and container each cgroup is every [`NAMES_EVERY`]: a container that lived less than that
//! may go unnamed (chaos deletes some at once) and is left out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::node::Node;

/// How often the cgroups are read.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How often pod names are read from the API server.
pub const NAMES_EVERY: Duration = Duration::from_secs(10);
/// The window CPU peaks are measured over.
pub const CPU_WINDOW: Duration = Duration::from_secs(10);
const CGROUP_FS: &str = "/sys/fs/cgroup";
const MIB: f64 = 1048576.0;

/// One container, as the API server names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Component {
    pub namespace: String,
    /// The pod's `app.kubernetes.io/name` label, else its `app` label, else its name.
    pub app: String,
    pub container: String,
}

/// A container's requests and limits, as its pod spec has them (bytes, millicores).
#[derive(Clone, Copy, Debug, Default)]
pub struct Resources {
    pub cpu_request_m: Option<u64>,
    pub memory_request: Option<u64>,
    pub memory_limit: Option<u64>,
}

/// One container instance (a cgroup) followed through its life.
#[derive(Debug)]
struct Track {
    first: (Instant, u64),
    last: (Instant, u64),
    /// The start of the current CPU window.
    window: (Instant, u64),
    peak_window_cores: f64,
    peak_working_set: u64,
    peak_rss: u64,
    /// `memory.max_usage_in_bytes` at the last read: usage with page cache, the OOM killer's.
    max_usage: u64,
}

/// What a component's containers used, over every instance of it seen.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub instances: usize,
    pub peak_working_set: u64,
    pub peak_rss: u64,
    pub max_usage: u64,
    /// CPU seconds used, all instances together.
    pub cpu_s: f64,
    /// The busiest [`CPU_WINDOW`] of any instance, in cores.
    pub peak_window_cores: f64,
    /// Seconds of life observed, all instances together.
    pub observed_s: f64,
    pub resources: Resources,
    /// Instances the kubelet reported killed for memory (`OOMKilled`).
    pub oom_killed: usize,
}

/// Free space on the node's filesystem at one moment.
#[derive(Clone, Copy, Debug)]
pub struct DiskFree {
    /// Bytes anyone may still write (statfs' `f_bavail`).
    pub available: u64,
    /// `f_bfree`: the blocks reserved for root included (on CI's kind of machine not space
    /// anyone can use: a build died with SIGBUS at `f_bavail` 0).
    pub free_to_root: u64,
    /// How far into the run.
    pub at: Duration,
}

/// The figures of a run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub components: BTreeMap<Component, Figures>,
    pub samples: usize,
    pub duration: Duration,
    /// The node's filesystem when the space left to unprivileged users (what the kubelet's
    /// `nodefs.available` reads) was least.
    pub least_disk_free: Option<DiskFree>,
}

#[derive(Default)]
struct State {
    tracks: HashMap<String, Track>,
    names: HashMap<String, Component>,
    resources: HashMap<Component, Resources>,
    /// Container ids the kubelet reported `OOMKilled`.
    oom_killed: HashSet<String>,
    samples: usize,
    least_disk_free: Option<DiskFree>,
}

/// The sampling thread; [`Sampler::finish`] stops it and returns the report.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<anyhow::Result<Report>>>,
}

impl Sampler {
    /// Starts sampling the node's pods. Fails at once when the host has no cgroup v1 memory
    /// hierarchy for the node.
    pub fn start(node: &'static Node) -> anyhow::Result<Sampler> {
        let root = Path::new(CGROUP_FS).join("memory").join(&node.cgroup);
        if !root.join("kubepods").is_dir() {
            bail!(
                "no pod cgroups at {}: the node tier reads cgroup v1 (memory, cpuacct)",
                root.join("kubepods").display()
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("usage-sampler".into())
            .spawn(move || run(node, &flag))
            .context("starting the usage sampler")?;
        Ok(Sampler {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops sampling (after one last read) and returns what was seen.
    pub fn finish(mut self) -> anyhow::Result<Report> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(report)) => report,
            Some(Err(_)) => bail!("the usage sampler panicked"),
            None => bail!("the usage sampler was already finished"),
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn run(node: &Node, stop: &AtomicBool) -> anyhow::Result<Report> {
    let started = Instant::now();
    let disk = |state: &mut State| {
        if let Ok(fs) = nix::sys::statvfs::statvfs(&node.root) {
            let now = DiskFree {
                available: fs.blocks_available().saturating_mul(fs.fragment_size()),
                free_to_root: fs.blocks_free().saturating_mul(fs.fragment_size()),
                at: started.elapsed(),
            };
            if state
                .least_disk_free
                .is_none_or(|least| now.available < least.available)
            {
                state.least_disk_free = Some(now);
            }
        }
    };
    let mut state = State::default();
    let mut named = Instant::now() - NAMES_EVERY;
    loop {
        let last = stop.load(Ordering::Relaxed);
        if last || named.elapsed() >= NAMES_EVERY {
            // A failed read (the API server restarting) is retried at the next turn.
            if let Some(pods) = node
                .kubectl(&["get", "pods", "--all-namespaces", "-o", "json"])
                .ok()
                .and_then(|out| serde_json::from_str::<Value>(&out).ok())
            {
                name_containers(&pods, &mut state);
            }
            named = Instant::now();
        }
        sample(node, &mut state);
        disk(&mut state);
        if last {
            break;
        }
        // Short sleeps, so that finish() does not wait a whole period.
        let until = Instant::now() + SAMPLE_EVERY;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(report(state, started.elapsed()))
}

fn quantity_millis(q: &Value) -> Option<u64> {
    let s = q.as_str()?;
    if let Some(m) = s.strip_suffix('m') {
        return m.parse().ok();
    }
    s.parse::<f64>().ok().map(|c| (c * 1000.0).round() as u64)
}

/// A memory quantity, through the operator's parser (`64Mi`, `1G`, bytes).
fn quantity_bytes(q: &Value) -> Option<u64> {
    spur_operator::upgrade::bytes(q.as_str()?)
        .ok()
        .and_then(|b| u64::try_from(b).ok())
}

fn name_containers(pods: &Value, state: &mut State) {
    for pod in pods["items"].as_array().into_iter().flatten() {
        let meta = &pod["metadata"];
        let labels = &meta["labels"];
        let app = labels["app.kubernetes.io/name"]
            .as_str()
            .or_else(|| labels["app"].as_str())
            .or_else(|| meta["name"].as_str())
            .unwrap_or_default();
        let namespace = meta["namespace"].as_str().unwrap_or_default();
        let specs: Vec<&Value> = ["initContainers", "containers"]
            .iter()
            .flat_map(|k| pod["spec"][*k].as_array().into_iter().flatten())
            .collect();
        let statuses = ["initContainerStatuses", "containerStatuses"]
            .iter()
            .flat_map(|k| pod["status"][*k].as_array().into_iter().flatten());
        for status in statuses {
            let Some(name) = status["name"].as_str() else {
                continue;
            };
            let component = Component {
                namespace: namespace.to_owned(),
                app: app.to_owned(),
                container: name.to_owned(),
            };
            if let Some(spec) = specs.iter().find(|s| s["name"] == name) {
                let r = &spec["resources"];
                state.resources.insert(
                    component.clone(),
                    Resources {
                        cpu_request_m: quantity_millis(&r["requests"]["cpu"]),
                        memory_request: quantity_bytes(&r["requests"]["memory"]),
                        memory_limit: quantity_bytes(&r["limits"]["memory"]),
                    },
                );
            }
            for id in [
                &status["containerID"],
                &status["lastState"]["terminated"]["containerID"],
            ] {
                if let Some(id) = id.as_str().map(bare_id) {
                    state.names.insert(id.to_owned(), component.clone());
                }
            }
            let terminated = &status["lastState"]["terminated"];
            if terminated["reason"] == "OOMKilled"
                && let Some(id) = terminated["containerID"].as_str()
            {
                state.oom_killed.insert(bare_id(id).to_owned());
            }
        }
    }
}

fn bare_id(id: &str) -> &str {
    id.split_once("://").map_or(id, |(_, id)| id)
}

/// Every container cgroup under the node's `kubepods`: (container id, path relative to a
/// hierarchy's root).
fn container_cgroups(node: &Node) -> Vec<(String, PathBuf)> {
    let base = PathBuf::from(&node.cgroup).join("kubepods");
    let memory = Path::new(CGROUP_FS).join("memory");
    let mut pods = Vec::new();
    for dir in [
        base.clone(),
        base.join("burstable"),
        base.join("besteffort"),
    ] {
        let Ok(entries) = std::fs::read_dir(memory.join(&dir)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("pod") && e.path().is_dir() {
                pods.push(dir.join(name));
            }
        }
    }
    let mut out = Vec::new();
    for pod in pods {
        let Ok(entries) = std::fs::read_dir(memory.join(&pod)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()) {
                out.push((name.clone(), pod.join(name)));
            }
        }
    }
    out
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn sample(node: &Node, state: &mut State) {
    state.samples += 1;
    let now = Instant::now();
    for (id, rel) in container_cgroups(node) {
        let memory = Path::new(CGROUP_FS).join("memory").join(&rel);
        // Read the CPU first: a cgroup removed between the reads is skipped whole.
        let Some(cpu) = read_u64(
            &Path::new(CGROUP_FS)
                .join("cpuacct")
                .join(&rel)
                .join("cpuacct.usage"),
        ) else {
            continue;
        };
        let (Some(usage), Some(max_usage), Ok(stat)) = (
            read_u64(&memory.join("memory.usage_in_bytes")),
            read_u64(&memory.join("memory.max_usage_in_bytes")),
            std::fs::read_to_string(memory.join("memory.stat")),
        ) else {
            continue;
        };
        let stat_of = |key: &str| {
            stat.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(0u64)
        };
        let working_set = usage.saturating_sub(stat_of("total_inactive_file"));
        let rss = stat_of("total_rss") + stat_of("total_rss_huge");
        let t = state.tracks.entry(id).or_insert(Track {
            first: (now, cpu),
            last: (now, cpu),
            window: (now, cpu),
            peak_window_cores: 0.0,
            peak_working_set: 0,
            peak_rss: 0,
            max_usage: 0,
        });
        t.last = (now, cpu);
        let window = now.duration_since(t.window.0);
        if window >= CPU_WINDOW {
            let cores = cpu.saturating_sub(t.window.1) as f64 / 1e9 / window.as_secs_f64();
            t.peak_window_cores = t.peak_window_cores.max(cores);
            t.window = (now, cpu);
        }
        t.peak_working_set = t.peak_working_set.max(working_set);
        t.peak_rss = t.peak_rss.max(rss);
        t.max_usage = t.max_usage.max(max_usage);
    }
}

fn report(state: State, duration: Duration) -> Report {
    let mut components: BTreeMap<Component, Figures> = BTreeMap::new();
    for (id, t) in &state.tracks {
        let Some(component) = state.names.get(id) else {
            continue;
        };
        let one = Figures {
            instances: 1,
            peak_working_set: t.peak_working_set,
            peak_rss: t.peak_rss,
            max_usage: t.max_usage,
            cpu_s: t.last.1.saturating_sub(t.first.1) as f64 / 1e9,
            peak_window_cores: t.peak_window_cores,
            observed_s: t.last.0.duration_since(t.first.0).as_secs_f64(),
            resources: state.resources.get(component).copied().unwrap_or_default(),
            oom_killed: usize::from(state.oom_killed.contains(id)),
        };
        components.entry(component.clone()).or_default().merge(&one);
    }
    Report {
        components,
        samples: state.samples,
        duration,
        least_disk_free: state.least_disk_free,
    }
}

impl Figures {
    /// CPU over the instances' combined lifetime: the mean use of one container, in cores.
    pub fn mean_cores(&self) -> f64 {
        if self.observed_s > 0.0 {
            self.cpu_s / self.observed_s
        } else {
            0.0
        }
    }

    /// Adds other instances to these (peaks are the larger, times and counts add up).
    fn merge(&mut self, other: &Figures) {
        self.instances += other.instances;
        self.peak_working_set = self.peak_working_set.max(other.peak_working_set);
        self.peak_rss = self.peak_rss.max(other.peak_rss);
        self.max_usage = self.max_usage.max(other.max_usage);
        self.cpu_s += other.cpu_s;
        self.peak_window_cores = self.peak_window_cores.max(other.peak_window_cores);
        self.observed_s += other.observed_s;
        self.oom_killed += other.oom_killed;
        if self.resources.memory_limit.is_none() {
            self.resources = other.resources;
        }
    }
}

impl Report {
    /// The components of `namespace`, each on its own, and every container named `container`
    /// elsewhere as one (namespace `*`, app `(injected)`).
    pub fn select(&self, namespace: &str, container: &str) -> Vec<(Component, Figures)> {
        let mut rows: Vec<(Component, Figures)> = self
            .components
            .iter()
            .filter(|(c, _)| c.namespace == namespace)
            .map(|(c, f)| (c.clone(), f.clone()))
            .collect();
        let mut merged: Option<Figures> = None;
        for (_, f) in self
            .components
            .iter()
            .filter(|(c, _)| c.namespace != namespace && c.container == container)
        {
            merged.get_or_insert_with(Figures::default).merge(f);
        }
        if let Some(f) = merged {
            let c = Component {
                namespace: "*".into(),
                app: "(injected)".into(),
                container: container.into(),
            };
            rows.push((c, f));
        }
        rows
    }

    /// A Markdown table of `rows`.
    pub fn table(rows: &[(Component, Figures)]) -> String {
        let mib = |b: u64| format!("{:.1}", b as f64 / MIB);
        let opt_mib = |b: Option<u64>| b.map_or("-".to_owned(), mib);
        let mut out = String::from(
            "| Namespace/app | Container | Instances | Observed | Peak working set (MiB) | Peak RSS (MiB) | Max usage incl. cache (MiB) | Mean CPU (m) | Busiest 10 s (m) | Request CPU (m) | Request / limit memory (MiB) |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for (c, f) in rows {
            let _ = writeln!(
                out,
                "| {}/{} | {} | {} | {:.0} s | {} | {} | {} | {:.1} | {:.0} | {} | {} / {} |",
                c.namespace,
                c.app,
                c.container,
                f.instances,
                f.observed_s,
                mib(f.peak_working_set),
                mib(f.peak_rss),
                mib(f.max_usage),
                f.mean_cores() * 1000.0,
                f.peak_window_cores * 1000.0,
                f.resources
                    .cpu_request_m
                    .map_or("-".to_owned(), |m| m.to_string()),
                opt_mib(f.resources.memory_request),
                opt_mib(f.resources.memory_limit),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(quantity_millis(&Value::from("50m")), Some(50));
        assert_eq!(quantity_millis(&Value::from("1")), Some(1000));
        assert_eq!(quantity_millis(&Value::from("0.5")), Some(500));
        assert_eq!(quantity_bytes(&Value::from("64Mi")), Some(64 << 20));
        assert_eq!(quantity_bytes(&Value::from("1G")), Some(1_000_000_000));
        assert_eq!(quantity_bytes(&Value::from("1024")), Some(1024));
        assert_eq!(quantity_bytes(&Value::from("x")), None);
        assert_eq!(quantity_bytes(&Value::Null), None);
    }
}
