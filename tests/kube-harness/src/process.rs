//! The children (etcd, kube-apiserver; the Kafka broker of tests/src/kafka.rs) and the watchdog that keeps them from outliving the test.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

use anyhow::Context as _;

/// Lines of a child's log quoted in an error.
const LOG_TAIL_LINES: usize = 40;

/// The watchdog, run by `sh`: collects the pids written to its stdin, and when stdin closes kills
/// them and removes the harness directory. Only the test process holds the write end (std opens
/// pipes close-on-exec, so no other child inherits it), so EOF means the test process is gone
/// however it went: an exit that skips destructors, SIGKILL, a runner's timeout, Ctrl-C. It ignores
/// the signals a terminal or runner sends alongside, and has its own process group so group-wide
/// kills miss it, to outlive the test process long enough to clean up. PR_SET_PDEATHSIG would kill
/// the children without a watchdog, but needs `unsafe` (pre_exec), which the workspace forbids.
const WATCHDOG: &str = r#"trap '' HUP INT TERM
pids=
while read -r pid; do pids="$pids $pid"; done
[ -z "$pids" ] || kill -KILL $pids 2>/dev/null
rm -rf -- "$1"
"#;

pub struct Watchdog {
    sh: Child,
}

impl Watchdog {
    /// Starts a watchdog that removes `dir` once the test process is gone.
    pub fn spawn(dir: &Path) -> anyhow::Result<Self> {
        let sh = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("spur-kube-watchdog")
            .arg(dir)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the watchdog (sh)")?;
        Ok(Self { sh })
    }

    /// Adds `process` to what the watchdog kills.
    pub fn watch(&mut self, process: &Process) -> anyhow::Result<()> {
        let stdin = self
            .sh
            .stdin
            .as_mut()
            .context("the watchdog has no stdin")?;
        writeln!(stdin, "{}", process.pid())
            .with_context(|| format!("handing {} to the watchdog", process.name()))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // SIGKILL, which it cannot ignore, lands before its stdin closes (wait() closes it), so it
        // never acts: the harness is tearing down itself, and once the children are reaped their
        // pids may belong to unrelated processes.
        let _ = self.sh.kill();
        let _ = self.sh.wait();
    }
}

pub struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Starts `cmd` with stdout and stderr going to `log`, without any proxy settings: everything
    /// the harness starts talks to 127.0.0.1, including kube-apiserver calling webhooks there.
    pub fn spawn(name: &'static str, mut cmd: Command, log: &Path) -> anyhow::Result<Self> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("duplicating a log file handle")?;
        for var in [
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
            "http_proxy",
            "https_proxy",
            "all_proxy",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("NO_PROXY", "127.0.0.1,localhost")
            .env("no_proxy", "127.0.0.1,localhost")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Self {
            name,
            child,
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// SIGKILL, and waits for it to go (a crash, for fault tests).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The exit status if the child has already exited.
    pub fn exited(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        self.child
            .try_wait()
            .with_context(|| format!("checking whether {} is still running", self.name))
    }

    /// Whether the child's log mentions `needle`: how a lost race for a port is told apart from
    /// other start failures.
    pub fn log_contains(&self, needle: &str) -> bool {
        std::fs::read(&self.log)
            .map(|log| String::from_utf8_lossy(&log).contains(needle))
            .unwrap_or(false)
    }

    /// The end of the child's log, for error messages.
    pub fn log_tail(&self) -> String {
        match std::fs::read(&self.log) {
            Ok(log) => {
                let log = String::from_utf8_lossy(&log);
                let lines: Vec<&str> = log.lines().collect();
                let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
                format!(
                    "--- last {} lines of {} output ---\n{}",
                    tail.len(),
                    self.name,
                    tail.join("\n")
                )
            }
            Err(e) => format!("--- no output of {}: {e} ---", self.name),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // SIGKILL: the data dir is deleted right after, so a graceful shutdown would only cost time.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
