//! A real PostgreSQL server for tests (Debian's postgresql-15 binaries, started on loopback in a
//! temporary directory), optionally serving TLS. Tests that use it fail, rather than skip, when
//! `initdb`/`postgres` are missing: tests/run.sh installs postgresql-15.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, User, geteuid};
use tokio::process::{Child, Command};

pub const PASSWORD: &str = "pw-never-logged-7f3a9";

pub use crate::free_port;

/// The directory with `initdb` and `postgres`: Debian's (newest version first), else `PATH`'s.
pub fn pg_bindir() -> PathBuf {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            Some((version, e.path().join("bin")))
        })
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    let path = std::env::var_os("PATH").unwrap_or_default();
    dirs.into_iter()
        .map(|(_, d)| d)
        .chain(std::env::split_paths(&path))
        .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
        .expect(
            "initdb and postgres are required (the test script installs them: \
             apt-get install -y postgresql-15)",
        )
}

/// PostgreSQL refuses to run as root: as root, the server runs as `postgres` (Debian's package
/// makes that user) or else `nobody`.
fn server_ids() -> Option<(u32, u32)> {
    if !geteuid().is_root() {
        return None;
    }
    let user = ["postgres", "nobody"]
        .into_iter()
        .find_map(|name| User::from_name(name).ok().flatten())
        .expect("no postgres or nobody user to run the server as");
    Some((user.uid.as_raw(), user.gid.as_raw()))
}

fn as_server_user(cmd: &mut Command, ids: Option<(u32, u32)>) -> &mut Command {
    if let Some((uid, gid)) = ids {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

/// A server in a temporary directory, listening on 127.0.0.1 (or one given address); killed
/// when dropped.
pub struct Postgres {
    child: Child,
    /// The address it listens on (127.0.0.1, or the one given to [`Postgres::start_in`]).
    pub host: String,
    pub port: u16,
    /// `postgres` and its arguments, for [`Postgres::restart`].
    command: Vec<std::ffi::OsString>,
    ids: Option<(u32, u32)>,
    _dir: tempfile::TempDir,
}

/// A serving certificate and key (PEM) for the server's TLS.
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Postgres {
    pub async fn start() -> Postgres {
        Self::start_with(None).await
    }

    /// A server that also accepts TLS with `tls` (plaintext too: `pg_hba` decides nothing here;
    /// clients choose).
    pub async fn start_with(tls: Option<ServerTls>) -> Postgres {
        Self::start_at("127.0.0.1", None, tls).await
    }

    /// A server on `ip` inside network namespace `netns` (`ip netns exec`, then `setpriv` to
    /// the server's user when the test is root): the node tier's, on the node's address.
    pub async fn start_in(netns: &str, ip: &str, tls: Option<ServerTls>) -> Postgres {
        Self::start_at(ip, Some(netns), tls).await
    }

    async fn start_at(ip: &str, netns: Option<&str>, tls: Option<ServerTls>) -> Postgres {
        let bin = pg_bindir();
        let ids = server_ids();
        let dir = tempfile::tempdir().unwrap();
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, format!("{PASSWORD}\n")).unwrap();
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
            std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).unwrap();
        }
        let data = dir.path().join("data");
        let out = as_server_user(&mut Command::new(bin.join("initdb")), ids)
            .arg("--pgdata")
            .arg(&data)
            .args(["--username=postgres", "--encoding=UTF8", "--locale=C"])
            .args(["--auth=scram-sha-256", "--no-sync"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if ip != "127.0.0.1" {
            // initdb's pg_hba.conf lets loopback in only: pods and the host come from elsewhere.
            use std::io::Write as _;
            std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("pg_hba.conf"))
                .unwrap()
                .write_all(b"host all all 0.0.0.0/0 scram-sha-256\n")
                .unwrap();
        }
        let mut tls_args = Vec::new();
        if let Some(tls) = tls {
            let (cert, key) = (dir.path().join("server.crt"), dir.path().join("server.key"));
            std::fs::write(&cert, tls.cert_pem).unwrap();
            std::fs::write(&key, tls.key_pem).unwrap();
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            if let Some((uid, gid)) = ids {
                std::os::unix::fs::chown(&cert, Some(uid), Some(gid)).unwrap();
                std::os::unix::fs::chown(&key, Some(uid), Some(gid)).unwrap();
            }
            tls_args = vec![
                "-c".to_string(),
                "ssl=on".into(),
                "-c".into(),
                format!("ssl_cert_file={}", cert.display()),
                "-c".into(),
                format!("ssl_key_file={}", key.display()),
            ];
        }
        let port = free_port();
        let mut command: Vec<std::ffi::OsString> = Vec::new();
        // In a namespace, `ip netns exec` needs root: the user changes after it (setpriv).
        let spawn_ids = match netns {
            Some(ns) => {
                command.extend(["ip", "netns", "exec", ns].map(Into::into));
                if let Some((uid, gid)) = ids {
                    command.push("setpriv".into());
                    command.push(format!("--reuid={uid}").into());
                    command.push(format!("--regid={gid}").into());
                    command.push("--clear-groups".into());
                }
                None
            }
            None => ids,
        };
        command.push(bin.join("postgres").into());
        command.push("-D".into());
        command.push(data.into());
        for a in ["-h", ip, "-p", &port.to_string(), "-k"] {
            command.push(a.into());
        }
        command.push(dir.path().into());
        command.push("-c".into());
        command.push("fsync=off".into());
        command.extend(tls_args.into_iter().map(Into::into));
        let child = spawn(&command, spawn_ids);
        Postgres {
            child,
            host: ip.to_owned(),
            port,
            command,
            ids: spawn_ids,
            _dir: dir,
        }
    }

    /// A superuser session, once the server accepts one.
    pub async fn admin(&self) -> tokio_postgres::Client {
        let url = format!(
            "postgres://postgres:{PASSWORD}@{}:{}/postgres",
            self.host, self.port
        );
        for _ in 0..300 {
            if let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                return client;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "PostgreSQL on {}:{} never accepted a session",
            self.host, self.port
        );
    }

    /// Stops the server (fast shutdown) and starts it again on the same data and port: clients
    /// lose their connections.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.child = spawn(&self.command, self.ids);
    }

    /// Stops the server's processes (SIGSTOP to the postmaster and every backend): it keeps its
    /// connections open and answers nothing, as a server behind a partition does.
    pub fn pause(&self) {
        for pid in self.processes() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
        }
    }

    /// Lets a paused server go on.
    pub fn resume(&self) {
        for pid in self.processes() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
    }

    /// The postmaster and its descendants.
    fn processes(&self) -> Vec<i32> {
        let Some(root) = self.child.id().and_then(|p| i32::try_from(p).ok()) else {
            return Vec::new();
        };
        let parents: Vec<(i32, i32)> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                // The parent is the second field after the command's closing parenthesis.
                let ppid = stat
                    .rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()?;
                Some((pid, ppid))
            })
            .collect();
        let mut found = vec![root];
        let mut i = 0;
        while i < found.len() {
            let parent = found[i];
            found.extend(
                parents
                    .iter()
                    .filter(|(_, pp)| *pp == parent)
                    .map(|(p, _)| *p),
            );
            i += 1;
        }
        found
    }

    /// Fast shutdown (SIGINT), as a container runtime asks the image's server for.
    pub async fn stop(&mut self) {
        signal(&self.child, Signal::SIGINT);
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("postgres did not stop on SIGINT")
            .unwrap();
    }
}

fn spawn(command: &[std::ffi::OsString], ids: Option<(u32, u32)>) -> Child {
    as_server_user(&mut Command::new(&command[0]), ids)
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

impl Drop for Postgres {
    /// A test that fails half-way still takes the server down: an immediate shutdown (SIGQUIT:
    /// the postmaster ends its backends too), then the SIGKILL of `kill_on_drop`.
    fn drop(&mut self) {
        if let (Ok(None), Some(pid)) = (self.child.try_wait(), self.child.id())
            && let Ok(pid) = i32::try_from(pid)
        {
            let _ = kill(Pid::from_raw(pid), Signal::SIGQUIT);
            for _ in 0..50 {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

pub fn signal(child: &Child, sig: Signal) {
    let pid = Pid::from_raw(child.id().unwrap().try_into().unwrap());
    kill(pid, sig).unwrap();
}
