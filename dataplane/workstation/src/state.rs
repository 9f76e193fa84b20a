//! The state file of a running `spur local connect` (`<state-dir>/connect.json`): what
//! `spur local status` prints and where `spur local disconnect` finds the process. Written
//! atomically on every change, removed on a clean exit.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::Error;

pub const FILE_NAME: &str = "connect.json";

/// Everything `spur local status` shows.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    /// The program name of that process (`argv[0]`'s file name), checked before signalling it.
    #[serde(default)]
    pub command: String,
    pub server: String,
    /// Unix seconds.
    pub started_at: u64,
    pub tunnel: TunnelStatus,
    pub workstation: Option<String>,
    pub proxy_pod: Option<String>,
    pub cluster_domain: Option<String>,
    pub socks_addr: Option<SocketAddr>,
    pub dns_addr: Option<SocketAddr>,
    pub hosts_file: Option<PathBuf>,
    pub services: ServicesStatus,
    pub workloads: Vec<WorkloadStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelStatus {
    /// `connecting`, `connected`, `disconnected` or `closed`.
    pub state: String,
    pub transport: Option<String>,
    /// Why the tunnel is down, or the attempt number while connecting.
    pub detail: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicesStatus {
    /// Services with a loopback address and DNS names.
    pub names: usize,
    /// Service ports listened on.
    pub listeners: usize,
    /// Service ports that could not be listened on (first few, with the reason).
    pub listen_errors: Vec<String>,
    pub listen_error_count: usize,
    /// Services left out (beyond the listener cap).
    pub skipped: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadStatus {
    pub sandbox: String,
    pub name: String,
    pub namespace: String,
    pub external_workload: String,
    pub routing_key: String,
    pub mappings: Vec<MappingStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MappingStatus {
    pub port: u32,
    pub to_local: String,
    pub bind_id: String,
    /// `pending`, `active`, `rejected` or `invalid`.
    pub bind: String,
    /// Why the bind is rejected or invalid.
    pub detail: Option<String>,
    /// The last failure to reach `to_local`, cleared by the next success.
    pub local_error: Option<String>,
}

impl Status {
    pub fn connected(&self) -> bool {
        self.tunnel.state == "connected"
    }

    /// The state file's JSON, for `spur local status --json`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|_| "{}".into())
    }
}

pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The state file in `dir`, if there is one.
pub fn read(dir: &Path) -> Result<Option<Status>, Error> {
    let p = path(dir);
    match std::fs::read(&p) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Invalid {
                path: p,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::File {
            what: "cannot read state file",
            path: p,
            source,
        }),
    }
}

/// Writes the state file atomically (temporary file + rename), creating `dir` (mode 0700).
pub fn write(dir: &Path, status: &Status) -> Result<(), Error> {
    let err = |what: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| Error::File { what, path, source }
    };
    create_dir(dir)?;
    let p = path(dir);
    let tmp = dir.join(format!(".{FILE_NAME}.{}", std::process::id()));
    let json =
        serde_json::to_vec_pretty(status).map_err(|e| Error::Config(format!("state file: {e}")))?;
    std::fs::write(&tmp, json).map_err(err("cannot write state file", &tmp))?;
    std::fs::rename(&tmp, &p).map_err(err("cannot write state file", &p))
}

/// Removes the state file if it is still this process's.
pub fn remove(dir: &Path) {
    if let Ok(Some(s)) = read(dir)
        && s.pid != std::process::id()
    {
        return;
    }
    let _ = std::fs::remove_file(path(dir));
}

fn create_dir(dir: &Path) -> Result<(), Error> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir).map_err(|source| Error::File {
        what: "cannot create state directory",
        path: dir.to_owned(),
        source,
    })
}

/// Whether `status` describes a live `spur local connect`: its pid exists and (on Linux,
/// where it can be checked) runs the program recorded in the file, so a pid reused after a
/// crash is not mistaken for it.
pub fn is_running(status: &Status) -> bool {
    let Ok(pid) = i32::try_from(status.pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    let pid = nix::unistd::Pid::from_raw(pid);
    match nix::sys::signal::kill(pid, None) {
        Ok(()) | Err(nix::errno::Errno::EPERM) => {}
        Err(_) => return false,
    }
    if cfg!(target_os = "linux")
        && !status.command.is_empty()
        && let Ok(cmdline) = std::fs::read(format!("/proc/{}/cmdline", status.pid))
    {
        let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        let argv0 = String::from_utf8_lossy(argv0);
        let name = Path::new(argv0.as_ref())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return name == status.command;
    }
    true
}

/// This process's program name, for [`Status::command`].
pub fn own_command() -> String {
    std::env::args_os()
        .next()
        .and_then(|a| {
            Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_default()
}

/// What [`terminate`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Terminated {
    /// No state file.
    NotRunning,
    /// A state file whose process is gone; the file was removed.
    Stale { pid: u32 },
    /// The process exited after SIGTERM.
    Stopped { pid: u32 },
}

/// Sends SIGTERM to the `spur local connect` recorded in `dir` and waits up to `wait` for it to
/// exit (it removes its state file on the way out).
pub async fn terminate(dir: &Path, wait: Duration) -> Result<Terminated, Error> {
    let Some(status) = read(dir)? else {
        return Ok(Terminated::NotRunning);
    };
    if !is_running(&status) {
        let _ = std::fs::remove_file(path(dir));
        return Ok(Terminated::Stale { pid: status.pid });
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(status.pid).unwrap_or(0));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
        .map_err(|e| Error::Io(std::io::Error::from(e)))?;
    let deadline = tokio::time::Instant::now() + wait;
    while tokio::time::Instant::now() < deadline {
        if !is_running(&status) {
            return Ok(Terminated::Stopped { pid: status.pid });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "pid {} did not exit within {wait:?} after SIGTERM",
            status.pid
        ),
    )))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn terminate_stops_a_process_and_clears_stale_files() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            terminate(dir.path(), Duration::from_secs(1)).await.unwrap(),
            Terminated::NotRunning
        );
        let mut child = tokio::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        let status = Status {
            pid,
            command: "sleep".into(),
            ..Status::default()
        };
        write(dir.path(), &status).unwrap();
        assert_eq!(read(dir.path()).unwrap().unwrap(), status);
        // Right after fork the child still runs the test binary, until it execs `sleep`.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !is_running(&status) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(is_running(&status));
        // A live pid running another program is not ours.
        assert!(!is_running(&Status {
            command: "not-sleep".into(),
            ..status.clone()
        }));
        let reaper = tokio::spawn(async move { child.wait().await });
        assert_eq!(
            terminate(dir.path(), Duration::from_secs(5)).await.unwrap(),
            Terminated::Stopped { pid }
        );
        reaper.await.unwrap().unwrap();
        assert_eq!(
            terminate(dir.path(), Duration::from_secs(1)).await.unwrap(),
            Terminated::Stale { pid }
        );
        assert!(read(dir.path()).unwrap().is_none());
    }
}
