//! One attempt: the job's process (a script or a command) in its own process group, its output
//! spooled to a file, its time limit, and the killing of everything it started.
//!
//! The executor is a child subreaper, so every process the job leaves behind (daemons, a
//! `setsid` grandchild) is re-parented to it and found again: when the attempt ends, whatever
//! descends from the executor is killed. No process of one job outlives it to watch the next.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the operator asked for.
#[derive(Debug, Clone)]
pub struct Program {
    pub attempt_uid: String,
    pub run: Run,
    pub env: Vec<(String, String)>,
    pub timeout: Option<Duration>,
    pub artifact_paths: Vec<String>,
    /// For the pod's outbound sidecar (see [`Limits::routing_key_file`]).
    pub inject_key: Option<String>,
    /// The file the job writes its result to, read once it has ended.
    pub result_path: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Run {
    Script(String),
    Command(Vec<String>),
}

/// How an attempt ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct End {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub canceled: bool,
    pub start_error: String,
    pub finished_at_ms: i64,
    /// The result file's content, or why there is none (when the program named one).
    pub result: Option<Result<Vec<u8>, String>>,
}

/// What readers of the attempt watch.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    pub log_bytes: u64,
    pub truncated: bool,
    pub end: Option<End>,
}

/// A started attempt.
pub struct Attempt {
    pub program: Program,
    pub dir: PathBuf,
    pub started_at_ms: i64,
    progress: watch::Receiver<Progress>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("uid", &self.program.attempt_uid)
            .finish_non_exhaustive()
    }
}

/// Limits and paths every attempt shares.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Output beyond this is dropped (with a note in the log).
    pub max_log_bytes: u64,
    /// Between SIGTERM and SIGKILL when an attempt is canceled or times out.
    pub kill_grace: Duration,
    /// The file the pod's outbound sidecar reads the routing key to add from: it holds an
    /// attempt's key while that attempt runs (when it asked for injection), and nothing
    /// otherwise.
    pub routing_key_file: Option<PathBuf>,
}

/// Replaces the key file's content atomically (the sidecar never reads half a key).
pub fn write_key_file(path: &Path, key: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, key)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    std::fs::rename(&tmp, path)
}

impl Attempt {
    /// Starts `program` in `dir` (created). Never fails: a process that cannot start ends the
    /// attempt at once with `start_error`.
    pub fn start(program: Program, dir: PathBuf, limits: Limits) -> Arc<Attempt> {
        let (tx, rx) = watch::channel(Progress::default());
        let cancel = CancellationToken::new();
        let attempt = Arc::new(Attempt {
            program: program.clone(),
            dir: dir.clone(),
            started_at_ms: now_ms(),
            progress: rx,
            cancel: cancel.clone(),
        });
        tokio::spawn(run(program, dir, limits, tx, cancel));
        attempt
    }

    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.clone()
    }

    pub fn snapshot(&self) -> Progress {
        self.progress.borrow().clone()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("log")
    }

    /// Asks the attempt to end (SIGTERM, then SIGKILL after the grace period).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Waits until the attempt has ended.
    pub async fn ended(&self) -> End {
        let mut rx = self.progress.clone();
        loop {
            if let Some(end) = rx.borrow_and_update().end.clone() {
                return end;
            }
            if rx.changed().await.is_err() {
                // The runner task is gone without an end: cannot happen short of a panic.
                return End {
                    start_error: "the executor lost track of the process".into(),
                    finished_at_ms: now_ms(),
                    ..End::default()
                };
            }
        }
    }
}

async fn run(
    program: Program,
    dir: PathBuf,
    limits: Limits,
    tx: watch::Sender<Progress>,
    cancel: CancellationToken,
) {
    let key_file = limits.routing_key_file.clone();
    if let Some(path) = &key_file {
        let key = program.inject_key.as_deref().unwrap_or("");
        if let Err(e) = write_key_file(path, key) {
            // Without the key the job's requests would reach the baselines: do not run it.
            let msg = format!("cannot write the routing key file {}: {e}", path.display());
            let _ = tokio::fs::create_dir_all(&dir).await;
            let _ = append_note(&dir.join("log"), &format!("[spur] {msg}\n")).await;
            tx.send_modify(|p| {
                p.log_bytes = file_len(&dir.join("log"));
                p.end = Some(End {
                    start_error: msg,
                    finished_at_ms: now_ms(),
                    ..End::default()
                });
            });
            return;
        }
    }
    let end = match spawn(&program, &dir).await {
        Err(e) => {
            let _ = append_note(
                &dir.join("log"),
                &format!("[spur] cannot start the job: {e}\n"),
            )
            .await;
            tx.send_modify(|p| p.log_bytes = file_len(&dir.join("log")));
            End {
                start_error: e,
                finished_at_ms: now_ms(),
                ..End::default()
            }
        }
        Ok((mut child, reader)) => {
            let pgid = child.id().map(|p| p as i32);
            let copy = tokio::spawn(copy_output(
                reader,
                dir.join("log"),
                limits.max_log_bytes,
                tx.clone(),
            ));
            let deadline = async {
                match program.timeout {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            let (status, timed_out, canceled) = tokio::select! {
                s = child.wait() => (s, false, false),
                () = deadline => {
                    terminate(pgid, &mut child, limits.kill_grace).await
                        .map_or_else(|e| (Err(e), true, false), |s| (Ok(s), true, false))
                }
                () = cancel.cancelled() => {
                    terminate(pgid, &mut child, limits.kill_grace).await
                        .map_or_else(|e| (Err(e), false, true), |s| (Ok(s), false, true))
                }
            };
            // Whatever the job left running goes with it (and closes the output pipe).
            kill_descendants(pgid, Signal::SIGKILL);
            reap_orphans();
            // The output pipe closes once every holder is dead; a holder that survived SIGKILL
            // (uninterruptible sleep) must not hold the attempt open.
            let _ = tokio::time::timeout(Duration::from_secs(5), copy).await;
            reap_orphans();
            let mut end = End {
                timed_out,
                canceled,
                finished_at_ms: now_ms(),
                ..End::default()
            };
            match status {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    end.exit_code = s.code();
                    end.signal = s.signal();
                }
                Err(e) => end.start_error = format!("waiting for the job's process: {e}"),
            }
            // Read only now: every process of the job is gone, so none changes the file
            // under the read (artifacts::read_result).
            if let Some(path) = program.result_path.clone() {
                end.result = Some(
                    tokio::task::spawn_blocking(move || crate::artifacts::read_result(&path))
                        .await
                        .unwrap_or_else(|e| Err(format!("reading the result: {e}"))),
                );
            }
            end
        }
    };
    if let Some(path) = &key_file
        && let Err(e) = write_key_file(path, "")
    {
        tracing::warn!(file = %path.display(), error = %e, "cannot empty the routing key file");
    }
    tx.send_modify(|p| p.end = Some(end));
}

/// Starts the process with stdout and stderr on one pipe (so the log keeps their order).
async fn spawn(
    program: &Program,
    dir: &Path,
) -> Result<(tokio::process::Child, tokio::net::unix::pipe::Receiver), String> {
    let workdir = dir.join("workdir");
    tokio::fs::create_dir_all(&workdir)
        .await
        .map_err(|e| format!("{}: {e}", workdir.display()))?;
    tokio::fs::write(dir.join("log"), b"")
        .await
        .map_err(|e| format!("{}: {e}", dir.join("log").display()))?;
    let mut cmd = match &program.run {
        Run::Script(text) => {
            let path = dir.join("script");
            tokio::fs::write(&path, text)
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?;
            tokio::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if text.starts_with("#!") {
                tokio::process::Command::new(&path)
            } else {
                let mut c = tokio::process::Command::new("/bin/sh");
                c.arg(&path);
                c
            }
        }
        Run::Command(args) => {
            let (first, rest) = args
                .split_first()
                .ok_or_else(|| "empty command".to_owned())?;
            let mut c = tokio::process::Command::new(first);
            c.args(rest);
            c
        }
    };
    let (reader, writer) = std::io::pipe().map_err(|e| format!("pipe: {e}"))?;
    let err_writer = writer.try_clone().map_err(|e| format!("pipe: {e}"))?;
    cmd.envs(program.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::from(err_writer))
        .process_group(0)
        .kill_on_drop(false);
    let child = cmd.spawn().map_err(|e| match &program.run {
        Run::Command(args) => format!("{}: {e}", args.first().map_or("", String::as_str)),
        Run::Script(_) => format!("script: {e}"),
    })?;
    // Our copies of the write end go with `cmd`: EOF comes when the job's processes close theirs.
    drop(cmd);
    let reader = tokio::net::unix::pipe::Receiver::from_owned_fd(reader.into())
        .map_err(|e| format!("pipe: {e}"))?;
    Ok((child, reader))
}

/// SIGTERM to the process group and the job's other descendants, SIGKILL after `grace`.
async fn terminate(
    pgid: Option<i32>,
    child: &mut tokio::process::Child,
    grace: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    kill_descendants(pgid, Signal::SIGTERM);
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(s) => s,
        Err(_) => {
            kill_descendants(pgid, Signal::SIGKILL);
            child.wait().await
        }
    }
}

/// Signals the job's process group and every other descendant of the executor (re-parented
/// orphans included, the executor being a subreaper).
fn kill_descendants(pgid: Option<i32>, signal: Signal) {
    if let Some(pgid) = pgid {
        let _ = killpg(Pid::from_raw(pgid), signal);
    }
    let me = std::process::id() as i32;
    for pid in descendants(me) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// Every process below `root` in the process tree, from /proc.
fn descendants(root: i32) -> Vec<i32> {
    let parents = process_parents();
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (&pid, &(ppid, _)) in &parents {
        children.entry(ppid).or_default().push(pid);
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(cs) = children.get(&p) {
            for &c in cs {
                if c != root && !out.contains(&c) {
                    out.push(c);
                    stack.push(c);
                }
            }
        }
    }
    out
}

/// pid → (ppid, state) of every process visible in /proc.
fn process_parents() -> HashMap<i32, (i32, char)> {
    let mut map = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return map;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid …": comm may contain spaces and parentheses.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = after.split_whitespace();
        let state = fields.next().and_then(|s| s.chars().next()).unwrap_or('?');
        if let Some(ppid) = fields.next().and_then(|s| s.parse().ok()) {
            map.insert(pid, (ppid, state));
        }
    }
    map
}

/// Reaps zombies re-parented to the executor (it is a subreaper, or PID 1 of the container).
/// Only zombies: a live child is the running job's, which tokio waits for.
pub fn reap_orphans() {
    let me = std::process::id() as i32;
    for (pid, (ppid, state)) in process_parents() {
        if ppid == me && state == 'Z' {
            let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        }
    }
}

/// Copies the job's output into the log file, up to `max` bytes.
async fn copy_output(
    mut reader: tokio::net::unix::pipe::Receiver,
    path: PathBuf,
    max: u64,
    tx: watch::Sender<Progress>,
) {
    let Ok(mut file) = tokio::fs::OpenOptions::new().append(true).open(&path).await else {
        // Nowhere to write: drain so the job never blocks on a full pipe.
        let mut sink = tokio::io::sink();
        let _ = tokio::io::copy(&mut reader, &mut sink).await;
        return;
    };
    let mut written: u64 = 0;
    let mut truncated = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if truncated {
            continue;
        }
        let room = max.saturating_sub(written);
        let take = (n as u64).min(room) as usize;
        if take > 0 && file.write_all(&buf[..take]).await.is_err() {
            truncated = true;
        }
        written += take as u64;
        if take < n {
            truncated = true;
            let note = format!("\n[spur] output beyond {max} bytes was dropped\n");
            if file.write_all(note.as_bytes()).await.is_ok() {
                written += note.len() as u64;
            }
        }
        let _ = file.flush().await;
        tx.send_modify(|p| {
            p.log_bytes = written;
            p.truncated = truncated;
        });
    }
    let _ = file.flush().await;
    tx.send_modify(|p| {
        p.log_bytes = written;
        p.truncated = truncated;
    });
}

async fn append_note(path: &Path, note: &str) -> std::io::Result<()> {
    let mut f = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await?;
    f.write_all(note.as_bytes()).await?;
    f.flush().await
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
