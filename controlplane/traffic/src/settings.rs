//! The capture settings each baseline's sidecar follows: which routing keys to capture, which
//! headers to redact, how many body bytes to keep.
//!
//! [`SettingsIndex`] holds the current settings per baseline and wakes only the watchers whose
//! baseline's settings changed. It is fed either by the caller (the operator, from Sandbox
//! objects) or from a [`SettingsFile`] that [`poll_file`] re-reads, keeping the last good one
//! when an edit does not validate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use spur_proto::traffic::{CaptureKey, CaptureSettings, Workload};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::runs::{Runs, SandboxEntry};

/// Headers whose values never leave a sidecar, whatever the settings say. Public so that the
/// sidecar redacts the same list even before its first settings arrive.
pub const ALWAYS_REDACTED: [&str; 4] = [
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
];
/// Body bytes kept per direction unless the settings say otherwise.
pub const DEFAULT_MAX_BODY_BYTES: u32 = 16 * 1024;
/// The most body bytes per direction settings may ask for: a push carries up to 1024 exchanges.
pub const MAX_BODY_BYTES: u32 = 1024 * 1024;
/// Longest routing key: what a header value reasonably carries.
pub const MAX_ROUTING_KEY: usize = 128;
/// Largest settings file read.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Longest name (sandbox, workload kind, namespace, name): a DNS subdomain.
const MAX_NAME: usize = 253;
/// Watched baselines kept without a watcher before they are swept.
const SWEEP_ABOVE: usize = 1024;
/// How long a sandbox's key still counts as captured at a baseline after the settings dropped
/// it: exchanges a sidecar captured just before (queued, or pushed while the store restarted)
/// are still taken.
pub const CAPTURE_GRACE: Duration = Duration::from_secs(30);

/// A baseline workload: the key of the settings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Baseline {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl Baseline {
    pub fn new(
        kind: impl Into<String>,
        namespace: impl Into<String>,
        name: impl Into<String>,
    ) -> Self {
        Baseline {
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl TryFrom<&Workload> for Baseline {
    type Error = Error;

    fn try_from(w: &Workload) -> Result<Self, Error> {
        for (field, value) in [
            ("kind", &w.kind),
            ("namespace", &w.namespace),
            ("name", &w.name),
        ] {
            check_name(&format!("baseline.{field}"), value).map_err(Error::Invalid)?;
        }
        Ok(Baseline::new(&w.kind, &w.namespace, &w.name))
    }
}

/// Settings for every baseline: `baselines` for those that capture, `default` (no keys) for
/// the rest; and every sandbox with a routing key, capturing or not, for run captures.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingsMap {
    pub default: CaptureSettings,
    pub baselines: HashMap<Baseline, CaptureSettings>,
    pub sandboxes: HashMap<String, SandboxEntry>,
}

impl Default for SettingsMap {
    /// Nothing is captured; the always-redacted headers and the default body limit.
    fn default() -> Self {
        SettingsMap {
            default: CaptureSettings {
                keys: Vec::new(),
                redact_headers: ALWAYS_REDACTED.iter().map(|h| h.to_string()).collect(),
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            },
            baselines: HashMap::new(),
            sandboxes: HashMap::new(),
        }
    }
}

impl SettingsMap {
    /// The settings `baseline`'s sidecar follows.
    pub fn get(&self, baseline: &Baseline) -> &CaptureSettings {
        self.baselines.get(baseline).unwrap_or(&self.default)
    }
}

/// The current settings per baseline, shared by the gRPC service and whatever feeds it. Cheap
/// to clone.
#[derive(Clone)]
pub struct SettingsIndex {
    inner: Arc<Mutex<State>>,
    /// Whether settings have arrived, for those that wait for them ([`SettingsIndex::loaded`]);
    /// set under the state's lock, after the settings.
    loaded: Arc<watch::Sender<bool>>,
}

impl Default for SettingsIndex {
    fn default() -> Self {
        SettingsIndex::new(SettingsMap::default())
    }
}

pub(crate) struct State {
    pub(crate) map: SettingsMap,
    /// One channel per baseline someone watches (or has watched: swept when unwatched).
    pub(crate) watchers: HashMap<Baseline, watch::Sender<CaptureSettings>>,
    /// (baseline, sandbox, routing key) captures the settings dropped, and when: they still
    /// count for [`CAPTURE_GRACE`].
    dropped: HashMap<(Baseline, String, String), Instant>,
    /// Smart-test runs capturing whole namespaces for a while.
    pub(crate) runs: Runs,
}

impl State {
    fn with(map: SettingsMap) -> Self {
        State {
            map,
            watchers: HashMap::new(),
            dropped: HashMap::new(),
            runs: Runs::default(),
        }
    }

    /// What `baseline`'s sidecar follows: its sandboxes' keys and those of the runs capturing
    /// in its namespace, sorted and without repeats (so equal inputs give equal settings).
    fn effective(&self, baseline: &Baseline) -> CaptureSettings {
        let mut settings = self.map.get(baseline).clone();
        let before = settings.keys.len();
        settings.keys.extend(self.runs.keys_in(&baseline.namespace));
        if settings.keys.len() != before {
            settings
                .keys
                .sort_by(|a, b| (&a.routing_key, &a.sandbox).cmp(&(&b.routing_key, &b.sandbox)));
            settings.keys.dedup();
        }
        settings
    }

    /// Sends each watcher its settings if they changed.
    pub(crate) fn refresh(&mut self) {
        self.watchers.retain(|_, tx| tx.receiver_count() > 0);
        for (baseline, tx) in &self.watchers {
            let next = self.effective(baseline);
            tx.send_if_modified(|current| {
                if *current == next {
                    return false;
                }
                *current = next;
                true
            });
        }
    }
}

impl std::fmt::Debug for SettingsIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("SettingsIndex")
            .field("baselines", &state.map.baselines.len())
            .field("watched", &state.watchers.len())
            .field("runs", &state.runs.live())
            .finish()
    }
}

impl SettingsIndex {
    fn with(map: SettingsMap, loaded: bool) -> Self {
        SettingsIndex {
            inner: Arc::new(Mutex::new(State::with(map))),
            loaded: Arc::new(watch::channel(loaded).0),
        }
    }

    pub fn new(map: SettingsMap) -> Self {
        SettingsIndex::with(map, true)
    }

    /// An index whose settings are not known yet (the cluster's Sandboxes not listed): until
    /// the first [`SettingsIndex::replace`], [`SettingsIndex::is_loaded`] is false, and what
    /// serves sidecars waits ([`SettingsIndex::loaded`]): a settings stream sends nothing (the
    /// default settings would turn a running sidecar's capture off until the list), a push is
    /// held, then answered "retry" rather than refused as not captured.
    pub fn pending() -> Self {
        SettingsIndex::with(SettingsMap::default(), false)
    }

    /// Whether settings have arrived (always, unless made with [`SettingsIndex::pending`]).
    pub fn is_loaded(&self) -> bool {
        *self.loaded.borrow()
    }

    /// Returns once settings have arrived (at once unless made with
    /// [`SettingsIndex::pending`]).
    pub async fn loaded(&self) {
        let mut rx = self.loaded.subscribe();
        // The sender lives as long as `self`: an error cannot happen while we hold it.
        let _ = rx.wait_for(|loaded| *loaded).await;
    }

    /// Whether `baseline`'s sidecar captures `routing_key` for `sandbox`: the settings say so,
    /// or said so less than [`CAPTURE_GRACE`] ago.
    pub fn captures(&self, baseline: &Baseline, sandbox: &str, routing_key: &str) -> bool {
        let state = self.state();
        let now_listed = state.map.baselines.get(baseline).is_some_and(|s| {
            s.keys
                .iter()
                .any(|k| k.sandbox == sandbox && k.routing_key == routing_key)
        });
        now_listed
            || state
                .dropped
                .get(&(
                    baseline.clone(),
                    sandbox.to_string(),
                    routing_key.to_string(),
                ))
                .is_some_and(|at| at.elapsed() < CAPTURE_GRACE)
            || state.runs.captures(
                &baseline.namespace,
                sandbox,
                routing_key,
                Instant::now(),
                CAPTURE_GRACE,
            )
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock with the state half-changed.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The settings `baseline`'s sidecar follows now.
    pub fn current(&self, baseline: &Baseline) -> CaptureSettings {
        self.state().effective(baseline)
    }

    /// The settings for `baseline`: the receiver holds the current ones and sees each change.
    pub fn watch(&self, baseline: &Baseline) -> watch::Receiver<CaptureSettings> {
        let mut state = self.state();
        if state.watchers.len() > SWEEP_ABOVE {
            state.watchers.retain(|_, tx| tx.receiver_count() > 0);
        }
        if let Some(tx) = state.watchers.get(baseline) {
            return tx.subscribe();
        }
        let (tx, rx) = watch::channel(state.effective(baseline));
        state.watchers.insert(baseline.clone(), tx);
        rx
    }

    /// Replaces every baseline's settings; wakes only the watchers whose settings changed.
    pub fn replace(&self, map: SettingsMap) {
        let mut state = self.state();
        let now = Instant::now();
        state.dropped.retain(|_, at| at.elapsed() < CAPTURE_GRACE);
        let mut dropped = Vec::new();
        for (baseline, settings) in &state.map.baselines {
            let next = map.get(baseline);
            for k in &settings.keys {
                if !next.keys.contains(k) {
                    dropped.push((baseline.clone(), k.sandbox.clone(), k.routing_key.clone()));
                }
            }
        }
        state.dropped.extend(dropped.into_iter().map(|d| (d, now)));
        state.map = map;
        state.refresh();
        // After the settings, still under the lock: whoever wakes on it reads them.
        self.loaded.send_replace(true);
    }
}

// === impl SettingsFile ===

/// The settings file (YAML or JSON), for a standalone store or one not fed by the operator:
///
/// ```yaml
/// redactHeaders: [x-api-key]      # added to ALWAYS_REDACTED
/// maxBodyBytes: 16384             # default 16384, at most 1 MiB
/// sandboxes:
///   - name: sb1
///     routingKey: k1
///     workloads: [{kind: Deployment, namespace: default, name: backend}]
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettingsFile {
    #[serde(default)]
    pub redact_headers: Vec<String>,
    #[serde(default)]
    pub max_body_bytes: Option<u32>,
    #[serde(default)]
    pub sandboxes: Vec<SandboxSettings>,
}

/// One sandbox: its routing key and the baselines whose traffic with that key is captured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSettings {
    pub name: String,
    pub routing_key: String,
    pub workloads: Vec<WorkloadRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadRef {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl SettingsFile {
    /// Parses and validates a file's content (YAML, of which JSON is a subset).
    pub fn parse(bytes: &[u8]) -> Result<SettingsFile, Error> {
        // A writer that truncates before writing shows an empty file for a moment: that is
        // not "capture nothing".
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(Error::Settings("the file is empty".into()));
        }
        let file: SettingsFile =
            serde_yaml_ng::from_slice(bytes).map_err(|e| Error::Settings(e.to_string()))?;
        file.validate()?;
        Ok(file)
    }

    /// Reads, parses and validates the file at `path`.
    pub fn read(path: &Path) -> Result<SettingsFile, Error> {
        let bytes = read_bounded(path)?;
        SettingsFile::parse(&bytes).map_err(|e| in_file(path, e))
    }

    /// Checks what [`SettingsFile::compile`] relies on; every error names the field.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Settings(m));
        for (i, h) in self.redact_headers.iter().enumerate() {
            if !is_header_name(h) {
                return bad(format!(
                    "redactHeaders[{i}]: {h:?} is not a lowercase header name"
                ));
            }
        }
        if let Some(n) = self.max_body_bytes
            && n > MAX_BODY_BYTES
        {
            return bad(format!("maxBodyBytes: {n} is more than {MAX_BODY_BYTES}"));
        }
        let mut names = BTreeSet::new();
        let mut keys: BTreeMap<&str, &str> = BTreeMap::new();
        for (i, sb) in self.sandboxes.iter().enumerate() {
            let at = format!("sandboxes[{i}]");
            check_name(&format!("{at}.name"), &sb.name).map_err(Error::Settings)?;
            if !names.insert(sb.name.as_str()) {
                return bad(format!("{at}.name: sandbox {} is listed twice", sb.name));
            }
            if !is_routing_key(&sb.routing_key) {
                return bad(format!(
                    "{at}.routingKey: must be 1 to {MAX_ROUTING_KEY} characters of \
                     [A-Za-z0-9._-]"
                ));
            }
            if let Some(other) = keys.insert(&sb.routing_key, &sb.name) {
                return bad(format!(
                    "{at}.routingKey: {} is also sandbox {other}'s",
                    sb.routing_key
                ));
            }
            for (j, w) in sb.workloads.iter().enumerate() {
                for (field, value) in [
                    ("kind", &w.kind),
                    ("namespace", &w.namespace),
                    ("name", &w.name),
                ] {
                    check_name(&format!("{at}.workloads[{j}].{field}"), value)
                        .map_err(Error::Settings)?;
                }
            }
        }
        Ok(())
    }

    /// The settings per baseline: a baseline listed under several sandboxes captures all their
    /// keys. Keys and headers come out sorted, so equal files compile to equal maps (and an
    /// unchanged baseline wakes no watcher).
    pub fn compile(&self) -> SettingsMap {
        let mut redact: Vec<String> = ALWAYS_REDACTED.iter().map(|h| h.to_string()).collect();
        let extra: BTreeSet<&String> = self
            .redact_headers
            .iter()
            .filter(|h| !ALWAYS_REDACTED.contains(&h.as_str()))
            .collect();
        redact.extend(extra.into_iter().cloned());
        let max_body_bytes = self.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        let mut keys: HashMap<Baseline, BTreeSet<(&str, &str)>> = HashMap::new();
        for sb in &self.sandboxes {
            for w in &sb.workloads {
                keys.entry(Baseline::new(&w.kind, &w.namespace, &w.name))
                    .or_default()
                    .insert((&sb.routing_key, &sb.name));
            }
        }
        let settings = |keys: Vec<CaptureKey>| CaptureSettings {
            keys,
            redact_headers: redact.clone(),
            max_body_bytes,
        };
        let baselines = keys
            .into_iter()
            .map(|(b, ks)| {
                let ks = ks
                    .into_iter()
                    .map(|(routing_key, sandbox)| CaptureKey {
                        routing_key: routing_key.to_string(),
                        sandbox: sandbox.to_string(),
                    })
                    .collect();
                (b, settings(ks))
            })
            .collect();
        let sandboxes = self
            .sandboxes
            .iter()
            .map(|sb| {
                let entry = SandboxEntry {
                    routing_key: sb.routing_key.clone(),
                    namespaces: sb.workloads.iter().map(|w| w.namespace.clone()).collect(),
                };
                (sb.name.clone(), entry)
            })
            .collect();
        SettingsMap {
            default: settings(Vec::new()),
            baselines,
            sandboxes,
        }
    }
}

/// Re-reads `path` every `every` until `stop`, replacing `index`'s settings when the file's
/// content changes and validates. An invalid edit keeps the last good settings and is logged
/// once (until the content changes again). `loaded` is the content `index` holds now.
pub async fn poll_file(
    path: PathBuf,
    index: SettingsIndex,
    every: Duration,
    loaded: Vec<u8>,
    stop: CancellationToken,
) {
    let mut seen = loaded;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let read = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || read_bounded(&path)).await
        };
        let bytes = match read {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                // An unreadable file (being replaced, say) is a change worth one line too.
                if !seen.is_empty() {
                    tracing::warn!(error = %e, "cannot read the capture settings; keeping the last good ones");
                    seen = Vec::new();
                }
                continue;
            }
            Err(_) => continue,
        };
        if bytes == seen {
            continue;
        }
        match SettingsFile::parse(&bytes) {
            Ok(file) => {
                index.replace(file.compile());
                tracing::info!(path = %path.display(), sandboxes = file.sandboxes.len(), "capture settings loaded");
            }
            Err(e) => {
                tracing::warn!(error = %in_file(&path, e), "invalid capture settings; keeping the last good ones");
            }
        }
        seen = bytes;
    }
}

/// The file at `path`, refused past [`MAX_FILE_BYTES`].
pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| Error::Settings(format!("{}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::Settings(format!("{}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::Settings(format!(
            "{}: larger than {MAX_FILE_BYTES} bytes",
            path.display()
        )));
    }
    Ok(bytes)
}

fn in_file(path: &Path, e: Error) -> Error {
    match e {
        Error::Settings(m) if !m.starts_with(&path.display().to_string()) => {
            Error::Settings(format!("{}: {m}", path.display()))
        }
        e => e,
    }
}

fn check_name(at: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{at}: must not be empty"));
    }
    if value.len() > MAX_NAME || value.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!(
            "{at}: {value:?} is not a name (at most {MAX_NAME} characters, no spaces)"
        ));
    }
    Ok(())
}

/// 1 to [`MAX_ROUTING_KEY`] characters of `[A-Za-z0-9._-]`.
pub fn is_routing_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_ROUTING_KEY
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// An HTTP header name (RFC 9110 token) in lowercase, as h2 sends them, of at most 64 bytes:
/// what a Sandbox's `spec.capture.redactHeaders` accepts.
pub fn is_header_name(name: &str) -> bool {
    spur_api::sandbox::is_header_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "
redactHeaders: [x-api-key, cookie]
maxBodyBytes: 4096
sandboxes:
  - name: sb1
    routingKey: k1
    workloads: [{kind: Deployment, namespace: default, name: backend}]
  - name: sb2
    routingKey: k2
    workloads:
      - {kind: Deployment, namespace: default, name: backend}
      - {kind: Deployment, namespace: other, name: web}
";

    fn backend() -> Baseline {
        Baseline::new("Deployment", "default", "backend")
    }

    #[test]
    fn a_file_compiles_to_settings_per_baseline() {
        let map = SettingsFile::parse(EXAMPLE.as_bytes()).unwrap().compile();
        let s = map.get(&backend());
        let keys: Vec<_> = s
            .keys
            .iter()
            .map(|k| (k.routing_key.as_str(), k.sandbox.as_str()))
            .collect();
        assert_eq!(keys, [("k1", "sb1"), ("k2", "sb2")]);
        assert_eq!(
            s.redact_headers,
            [
                "authorization",
                "proxy-authorization",
                "cookie",
                "set-cookie",
                "x-api-key"
            ]
        );
        assert_eq!(s.max_body_bytes, 4096);
        let web = map.get(&Baseline::new("Deployment", "other", "web"));
        assert_eq!(web.keys.len(), 1);
        assert_eq!(web.keys[0].sandbox, "sb2");
        let unlisted = map.get(&Baseline::new("Deployment", "default", "nobody"));
        assert!(unlisted.keys.is_empty());
        assert_eq!(unlisted.redact_headers.len(), 5);
    }

    #[test]
    fn json_and_defaults() {
        let file = SettingsFile::parse(br#"{"sandboxes": []}"#).unwrap();
        let map = file.compile();
        assert_eq!(map.default.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(map.default.redact_headers, ALWAYS_REDACTED);
        assert_eq!(SettingsFile::parse(b"{}").unwrap().compile(), map);
        assert!(SettingsFile::parse(b" \n").is_err());
    }

    #[test]
    fn invalid_files_are_refused_with_the_field() {
        let long = "k".repeat(MAX_ROUTING_KEY + 1);
        let sb = |name: &str, key: &str| {
            format!(
                "sandboxes: [{{name: '{name}', routingKey: '{key}', \
                 workloads: [{{kind: Deployment, namespace: default, name: backend}}]}}]"
            )
        };
        for (file, field) in [
            ("redactHeaders: [X-Api-Key]".to_string(), "redactHeaders[0]"),
            ("redactHeaders: ['a b']".to_string(), "redactHeaders[0]"),
            ("maxBodyBytes: 1048577".to_string(), "maxBodyBytes"),
            (sb("", "k1"), "sandboxes[0].name"),
            (sb("sb", ""), "sandboxes[0].routingKey"),
            (sb("sb", "k/1"), "sandboxes[0].routingKey"),
            (sb("sb", &long), "sandboxes[0].routingKey"),
            (
                "sandboxes: [{name: a, routingKey: k, workloads: [{kind: '', namespace: n, name: x}]}]"
                    .to_string(),
                "sandboxes[0].workloads[0].kind",
            ),
            (
                "sandboxes: [{name: a, routingKey: k, workloads: []}, {name: b, routingKey: k, workloads: []}]"
                    .to_string(),
                "sandboxes[1].routingKey",
            ),
            (
                "sandboxes: [{name: a, routingKey: k, workloads: []}, {name: a, routingKey: j, workloads: []}]"
                    .to_string(),
                "sandboxes[1].name",
            ),
            ("unknownField: 1".to_string(), "unknown field"),
        ] {
            let err = SettingsFile::parse(file.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(field), "{file}: {err}");
        }
        assert!(SettingsFile::parse(sb("sb", "a.B_c-9").as_bytes()).is_ok());
        assert!(SettingsFile::parse(sb("sb", &"k".repeat(MAX_ROUTING_KEY)).as_bytes()).is_ok());
    }

    #[test]
    fn a_capture_counts_while_listed_and_for_a_grace_after() {
        let index = SettingsIndex::pending();
        assert!(!index.is_loaded());
        index.replace(SettingsFile::parse(EXAMPLE.as_bytes()).unwrap().compile());
        assert!(index.is_loaded());
        assert!(index.captures(&backend(), "sb1", "k1"));
        // Another sandbox's key, a sandbox with another's key, a baseline sb1 does not fork.
        assert!(!index.captures(&backend(), "sb1", "k2"));
        assert!(!index.captures(&backend(), "sb3", "k1"));
        let web = Baseline::new("Deployment", "other", "web");
        assert!(!index.captures(&web, "sb1", "k1"));
        assert!(index.captures(&web, "sb2", "k2"));
        // sb1 stops capturing: still counted for the grace (exchanges already captured).
        let edited = EXAMPLE.replace("routingKey: k1", "routingKey: k3");
        index.replace(SettingsFile::parse(edited.as_bytes()).unwrap().compile());
        assert!(index.captures(&backend(), "sb1", "k1"));
        assert!(index.captures(&backend(), "sb1", "k3"));
        let mut state = index.state();
        for at in state.dropped.values_mut() {
            *at = at
                .checked_sub(CAPTURE_GRACE)
                .expect("the clock is past the grace");
        }
        drop(state);
        assert!(!index.captures(&backend(), "sb1", "k1"));
        assert!(SettingsIndex::default().is_loaded());
    }

    #[tokio::test]
    async fn loaded_waits_for_the_first_settings() {
        let index = SettingsIndex::pending();
        let waiting = tokio::spawn({
            let index = index.clone();
            async move { index.loaded().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "loaded before any settings");
        index.replace(SettingsMap::default());
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("loaded once the settings arrived")
            .unwrap();
        // Already loaded: at once.
        index.loaded().await;
        SettingsIndex::default().loaded().await;
    }

    #[tokio::test]
    async fn replace_wakes_only_changed_baselines() {
        let index = SettingsIndex::default();
        let other = Baseline::new("Deployment", "default", "other");
        let mut rx_backend = index.watch(&backend());
        let mut rx_other = index.watch(&other);
        assert!(rx_backend.borrow_and_update().keys.is_empty());
        rx_other.borrow_and_update();

        let map = SettingsFile::parse(EXAMPLE.as_bytes()).unwrap().compile();
        index.replace(map.clone());
        assert!(rx_backend.has_changed().unwrap());
        assert_eq!(rx_backend.borrow_and_update().keys.len(), 2);
        // `other` is unlisted before and after; but the default changed (maxBodyBytes 4096).
        assert!(rx_other.has_changed().unwrap());
        rx_other.borrow_and_update();

        // The same content again: nobody wakes.
        index.replace(SettingsFile::parse(EXAMPLE.as_bytes()).unwrap().compile());
        assert!(!rx_backend.has_changed().unwrap());
        assert!(!rx_other.has_changed().unwrap());

        // sb1's key changes: backend wakes, other (still unlisted, same default) does not.
        let edited = EXAMPLE.replace("routingKey: k1", "routingKey: k3");
        index.replace(SettingsFile::parse(edited.as_bytes()).unwrap().compile());
        assert!(rx_backend.has_changed().unwrap());
        assert!(!rx_other.has_changed().unwrap());
        assert_eq!(index.current(&backend()), *rx_backend.borrow());
    }
}
