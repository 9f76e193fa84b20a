//! A child process of the bench (an operator or a route server) and its CPU time and memory.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use spur_perf::kube_bench::{cpu_seconds, rss_mib};
use tokio::sync::mpsc;

use crate::{START_WAIT, STOP_WAIT};

/// A child process: killed (SIGKILL) on drop unless already stopped; its stdout lines arrive on
/// `lines`, stamped when read.
pub(crate) struct Component {
    role: &'static str,
    child: Child,
    pub(crate) lines: mpsc::UnboundedReceiver<(Instant, String)>,
    pub(crate) started: Instant,
}

impl Component {
    pub(crate) fn spawn(role: &'static str, args: &[&str]) -> Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--role")
            .arg(role)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for var in ["http_proxy", "https_proxy", "all_proxy"] {
            cmd.env_remove(var.to_ascii_uppercase()).env_remove(var);
        }
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the {role} process"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send((Instant::now(), line)).is_err() {
                    return;
                }
            }
        });
        Ok(Component {
            role,
            child,
            lines,
            started,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage::of(self.pid())
    }

    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the {} process exited: {status}", self.role);
        }
        Ok(())
    }

    /// The next stdout line, or None at `until`.
    pub(crate) async fn next_line(&mut self, until: Instant) -> Result<Option<(Instant, String)>> {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.lines.recv()).await {
            Err(_) => Ok(None),
            Ok(Some(line)) => Ok(Some(line)),
            Ok(None) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                bail!(
                    "the {} process closed its stdout (exit status: {:?})",
                    self.role,
                    self.child.try_wait()?
                )
            }
        }
    }

    /// Waits for the first line starting with `prefix`; returns the rest of it.
    pub(crate) async fn expect_line(&mut self, prefix: &str) -> Result<(Instant, String)> {
        let deadline = Instant::now() + START_WAIT;
        loop {
            match self.next_line(deadline).await? {
                Some((t, line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok((t, rest.trim().to_string()));
                    }
                }
                None => bail!(
                    "the {} process printed no `{prefix}` line within {START_WAIT:?}",
                    self.role
                ),
            }
        }
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `STOP_WAIT`); returns how long it took.
    pub(crate) async fn stop(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid())?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        while self.child.try_wait()?.is_none() {
            if t0.elapsed() > STOP_WAIT {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!(
                    "the {} process ignored SIGTERM for {STOP_WAIT:?}",
                    self.role
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(t0.elapsed())
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Usage {
    /// utime + stime, seconds.
    pub(crate) cpu: f64,
    pub(crate) rss_mib: f64,
}

impl Usage {
    fn of(pid: u32) -> Self {
        Usage {
            cpu: cpu_seconds(pid),
            rss_mib: rss_mib(pid),
        }
    }
}
