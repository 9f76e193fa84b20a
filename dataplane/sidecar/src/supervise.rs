//! `--supervise`: the sidecar keeps its listening sockets across a crash of the process that
//! serves them.
//!
//! Without it, a sidecar that dies (killed by the kernel's OOM killer, a panic with
//! `panic=abort`, a signal) takes its listening sockets with it: until the kubelet has started
//! the container again, connections the interception rules redirect to it are refused, and every
//! request to the pod fails. With it, `spur-sidecar` binds the inbound and admin listeners itself
//! and runs the sidecar in a worker process that inherits them (the systemd socket-passing
//! convention, `LISTEN_FDS`); when the worker dies the supervisor starts another on the same
//! sockets, so connections that arrive meanwhile wait in the listen queue instead of being
//! refused, and a restarted worker holds them there until it has its routing table
//! ([`crate::Handover::table_wait`]). Only the requests in flight in the dead worker are lost.
//!
//! The supervisor forwards SIGTERM and SIGINT to the worker and exits with the worker's code once
//! it has drained. A worker that exits with a configuration error (2) or an interception error
//! (3) is not started again, and neither is one that keeps dying within seconds of starting
//! ([`Restarts`]): the supervisor then exits with it, so the kubelet restarts the container and
//! shows the crash loop.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use tokio::signal::unix::{SignalKind, signal};

use crate::Handover;

/// Set by the supervisor in its worker's environment: how many times it started a worker before
/// this one. Its presence makes `spur-sidecar` a worker (no interception step, no supervision).
pub const WORKER_ENV: &str = "SPUR_SIDECAR_WORKER";

/// Set by the supervisor in its worker's environment: the supervisor's pid. The worker asks to
/// be stopped when its parent dies (`PR_SET_PDEATHSIG`), but a parent that died before that
/// request leaves it running unsupervised: it compares its parent with this, once asked.
pub const SUPERVISOR_ENV: &str = "SPUR_SIDECAR_SUPERVISOR";

/// Whether a worker's supervisor died before the worker asked to be stopped with it: the pid
/// it was started with (`SUPERVISOR_ENV`) is not its parent's any more. Without the variable
/// (or with one that is not a pid) nothing can be told, and the worker carries on.
pub fn supervisor_gone(expected: Option<&std::ffi::OsStr>, parent: i32) -> bool {
    expected
        .and_then(|v| v.to_str())
        .and_then(|v| v.parse::<i32>().ok())
        .is_some_and(|pid| pid != parent)
}

/// A worker that lived at least this long counts as healthy: the next death restarts at once.
const HEALTHY_AFTER: Duration = Duration::from_secs(30);
/// Quick deaths in a row after which the supervisor gives up (and exits with the worker).
const MAX_QUICK_DEATHS: u32 = 8;
/// The longest wait before a worker is started again.
const MAX_DELAY: Duration = Duration::from_secs(2);

/// What to do after a worker died on its own (not asked to stop).
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Start another after this delay.
    Restart(Duration),
    /// Exit with this code.
    Exit(u8),
}

/// The restart policy: at once after a worker that lived [`HEALTHY_AFTER`], then with a delay
/// that doubles from 100 ms up to [`MAX_DELAY`]; never after a configuration or interception
/// error; given up after [`MAX_QUICK_DEATHS`] quick deaths in a row.
#[derive(Debug, Default)]
pub struct Restarts {
    quick: u32,
    /// Workers started after the first.
    pub total: u32,
}

impl Restarts {
    /// Decides after a worker that lived `lived` ended with `code` (`None`: killed by a signal).
    pub fn after(&mut self, lived: Duration, code: Option<i32>) -> Next {
        if let Some(c @ (2 | 3)) = code {
            return Next::Exit(u8::try_from(c).unwrap_or(1));
        }
        if lived >= HEALTHY_AFTER {
            self.quick = 0;
        }
        self.quick += 1;
        if self.quick > MAX_QUICK_DEATHS {
            return Next::Exit(code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1));
        }
        self.total += 1;
        let delay = match self.quick {
            1 => Duration::ZERO,
            n => (Duration::from_millis(100) * 2u32.pow(n - 2)).min(MAX_DELAY),
        };
        Next::Restart(delay)
    }
}

/// The listeners the supervisor holds, on consecutive descriptors (the socket-passing
/// convention hands over a range).
#[derive(Debug)]
pub struct Held {
    inbound: std::net::TcpListener,
    admin: Option<std::net::TcpListener>,
}

impl Held {
    /// Binds the inbound and the admin address (as the sidecar itself would).
    pub fn bind(inbound: SocketAddr, admin: Option<SocketAddr>) -> Result<Self, crate::Error> {
        let bind = |addr, what| {
            std::net::TcpListener::bind(addr).map_err(|source| crate::Error::Bind {
                what,
                addr,
                source,
            })
        };
        let inbound = bind(inbound, "inbound listener")?;
        let held = match admin.map(|a| bind(a, "admin server")).transpose()? {
            None => Held {
                inbound,
                admin: None,
            },
            Some(admin) => consecutive(inbound, admin)?,
        };
        // Inherited by every worker: they stay open here while none runs.
        for fd in std::iter::once(&held.inbound).chain(held.admin.as_ref()) {
            nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
            )
            .map_err(|e| {
                crate::Error::Config(format!("--supervise: cannot pass a listener on: {e}"))
            })?;
        }
        Ok(held)
    }
}

/// The two listeners on consecutive descriptors: duplicates taken until the admin one follows
/// the inbound one (a descriptor still open below, from whatever ran before, leaves a hole; each
/// try fills the lowest one).
fn consecutive(
    inbound: std::net::TcpListener,
    admin: std::net::TcpListener,
) -> Result<Held, crate::Error> {
    let failed = |e: nix::Error| {
        crate::Error::Config(format!("--supervise: cannot duplicate a listener: {e}"))
    };
    if admin.as_raw_fd() == inbound.as_raw_fd() + 1 {
        return Ok(Held {
            inbound,
            admin: Some(admin),
        });
    }
    let mut fillers = Vec::new();
    for _ in 0..64 {
        let i = nix::unistd::dup(&inbound).map_err(failed)?;
        let a = nix::unistd::dup(&admin).map_err(failed)?;
        if a.as_raw_fd() == i.as_raw_fd() + 1 {
            return Ok(Held {
                inbound: i.into(),
                admin: Some(a.into()),
            });
        }
        // `i` filled a hole: kept open until the end so the next try starts above it.
        fillers.push(i);
    }
    Err(crate::Error::Config(format!(
        "--supervise: no two consecutive free descriptors for the listeners (inbound {}, admin {})",
        inbound.as_raw_fd(),
        admin.as_raw_fd()
    )))
}

/// In a worker: the listeners its supervisor passed (`LISTEN_FDS`, `LISTEN_FDS_FIRST_FD`), and
/// the restarted worker's wait for its first table. Call before any other thread starts (it
/// clears the variables).
pub fn handover(
    restarts: u32,
    admin: bool,
    table_wait: Duration,
) -> Result<Handover, crate::Error> {
    let mut fds = listenfd::ListenFd::from_env();
    let take = |fds: &mut listenfd::ListenFd, i, what| match fds.take_tcp_listener(i) {
        Ok(Some(l)) => Ok(l),
        Ok(None) => Err(crate::Error::Config(format!(
            "{WORKER_ENV} is set but the supervisor passed no {what} (LISTEN_FDS)"
        ))),
        Err(e) => Err(crate::Error::Config(format!(
            "the {what} the supervisor passed: {e}"
        ))),
    };
    let inbound = take(&mut fds, 0, "inbound listener")?;
    let admin = if admin {
        Some(take(&mut fds, 1, "admin listener")?)
    } else {
        None
    };
    Ok(Handover {
        inbound: Some(inbound),
        admin,
        table_wait: if restarts > 0 {
            table_wait
        } else {
            Duration::ZERO
        },
        restarts,
    })
}

/// Runs workers (this program with `args`, see [`WORKER_ENV`]) on `held` until one drains after
/// a signal or the policy gives up; returns the exit code.
pub async fn run(held: Held, program: std::path::PathBuf, args: Vec<OsString>) -> u8 {
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("spur-sidecar: --supervise: cannot handle signals: {e}");
            return 1;
        }
    };
    let count = 1 + usize::from(held.admin.is_some());
    let first_fd = held.inbound.as_raw_fd();
    // Closed here once a stop signal came: the worker's drain then refuses new connections, as
    // an unsupervised sidecar's does, instead of leaving them queued until the end.
    let mut held = Some(held);
    let mut policy = Restarts::default();
    loop {
        let started = Instant::now();
        let mut worker = match tokio::process::Command::new(&program)
            .args(&args)
            .env(WORKER_ENV, policy.total.to_string())
            .env(SUPERVISOR_ENV, std::process::id().to_string())
            .env("LISTEN_FDS", count.to_string())
            .env("LISTEN_FDS_FIRST_FD", first_fd.to_string())
            .env_remove("LISTEN_PID")
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("spur-sidecar: --supervise: cannot start the worker: {e}");
                return 1;
            }
        };
        let pid = worker.id().and_then(|p| i32::try_from(p).ok());
        tracing::info!(pid, restarts = policy.total, "sidecar worker started");
        let status: std::io::Result<ExitStatus> = loop {
            // Signals first: a stop that came while the worker exited is still passed on, and
            // ends the supervisor instead of starting another worker.
            tokio::select! {
                biased;
                _ = term.recv() => forward(pid, nix::sys::signal::Signal::SIGTERM, &mut held),
                _ = int.recv() => forward(pid, nix::sys::signal::Signal::SIGINT, &mut held),
                status = worker.wait() => break status,
            }
        };
        let (code, signal) = match status {
            Ok(s) => (s.code(), s.signal()),
            Err(e) => {
                eprintln!("spur-sidecar: --supervise: lost the worker: {e}");
                return 1;
            }
        };
        if held.is_none() {
            // A worker stopped by the signal passed on before it could handle it (it was just
            // starting) stopped as asked.
            if signal.is_some_and(|s| {
                s == nix::sys::signal::Signal::SIGTERM as i32
                    || s == nix::sys::signal::Signal::SIGINT as i32
            }) {
                return 0;
            }
            return code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1);
        }
        let lived = started.elapsed();
        match policy.after(lived, code) {
            Next::Exit(c) => {
                tracing::error!(?code, ?lived, "sidecar worker died; not starting it again");
                return c;
            }
            Next::Restart(delay) => {
                tracing::error!(
                    ?code,
                    ?lived,
                    ?delay,
                    "sidecar worker died; starting another on the same listeners"
                );
                // A signal during the delay ends the supervisor: there is no worker to drain.
                tokio::select! {
                    biased;
                    _ = term.recv() => return 0,
                    _ = int.recv() => return 0,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Passes a stop signal on to the worker, and lets the listeners go.
fn forward(pid: Option<i32>, sig: nix::sys::signal::Signal, held: &mut Option<Held>) {
    *held = None;
    if let Some(pid) = pid
        && let Err(e) = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)
    {
        tracing::warn!(pid, error = %e, "cannot pass {sig} on to the sidecar worker");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_tells_its_supervisor_is_gone_by_its_parent() {
        use std::ffi::OsStr;
        assert!(!supervisor_gone(Some(OsStr::new("42")), 42));
        assert!(supervisor_gone(Some(OsStr::new("42")), 1));
        // Nothing to compare with: carry on.
        assert!(!supervisor_gone(None, 1));
        assert!(!supervisor_gone(Some(OsStr::new("x")), 1));
    }

    #[test]
    fn restarts_at_once_then_backs_off_then_gives_up() {
        let mut p = Restarts::default();
        let quick = Duration::from_secs(1);
        let delays: Vec<Next> = (0..MAX_QUICK_DEATHS)
            .map(|_| p.after(quick, None))
            .collect();
        let ms = |m| Next::Restart(Duration::from_millis(m));
        assert_eq!(
            delays,
            [
                ms(0),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000),
                ms(2000)
            ]
        );
        assert_eq!(p.after(quick, Some(101)), Next::Exit(101));
        assert_eq!(p.total, MAX_QUICK_DEATHS);
        // Killed by a signal, given up: the container exits 1.
        assert_eq!(p.after(quick, None), Next::Exit(1));
    }

    #[test]
    fn a_healthy_worker_is_restarted_at_once() {
        let mut p = Restarts::default();
        for _ in 0..20 {
            assert_eq!(p.after(HEALTHY_AFTER, None), Next::Restart(Duration::ZERO));
        }
        assert_eq!(p.total, 20);
    }

    #[test]
    fn listeners_are_moved_past_a_hole() {
        let inbound = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let hole = std::fs::File::open("/dev/null").unwrap();
        let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (i, a) = (inbound.local_addr().unwrap(), admin.local_addr().unwrap());
        let held = consecutive(inbound, admin).unwrap();
        let held_admin = held.admin.as_ref().unwrap();
        assert_eq!(held_admin.as_raw_fd(), held.inbound.as_raw_fd() + 1);
        // The same sockets, still listening.
        assert_eq!(held.inbound.local_addr().unwrap(), i);
        assert_eq!(held_admin.local_addr().unwrap(), a);
        std::net::TcpStream::connect(a).unwrap();
        drop(hole);
    }

    #[test]
    fn configuration_errors_are_not_retried() {
        assert_eq!(
            Restarts::default().after(HEALTHY_AFTER, Some(2)),
            Next::Exit(2)
        );
        assert_eq!(
            Restarts::default().after(HEALTHY_AFTER, Some(3)),
            Next::Exit(3)
        );
    }
}
