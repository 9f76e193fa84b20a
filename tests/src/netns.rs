//! A network namespace of one test, joined to the host by a veth pair, for what loopback cannot
//! stand in for: an address the API server accepts in an EndpointSlice (it refuses loopback)
//! that traffic reaches only through the test's own veth, into the test's own namespace.
//!
//! Needs root (`ip netns`, `setns`). Everything is removed on drop; a run that was killed
//! leaves its namespace behind, named with its pid, and the next run removes it.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

const PREFIX: &str = "spurt";

/// One namespace: the host side of its veth is `.1` of a /30 in 10.253.0.0/16, the namespace
/// side `.2`.
pub struct TestNet {
    ns: String,
    host_dev: String,
    /// The namespace's address: bind there (with [`TestNet::listen`]) to be reached from the host.
    pub ip: Ipv4Addr,
    /// The host's end of the veth: what the namespace reaches the host at.
    pub host_ip: Ipv4Addr,
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {args:?}"))?;
    if !out.status.success() {
        bail!(
            "{args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Removes the namespaces of runs whose process is gone.
fn remove_stale() {
    let Ok(list) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&list.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|r| r.split('x').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            // Deleting the namespace deletes its end of the veth, and so the host end.
            let _ = sh(&["ip", "netns", "del", name]);
        }
    }
}

impl TestNet {
    pub fn new() -> Result<TestNet> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        remove_stale();
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        if n >= 64 {
            bail!("more than 64 test network namespaces in one process");
        }
        // A /30 per (process, namespace): 64 namespaces of 256 processes.
        let block = (pid % 256) * 64 + n;
        let (hi, lo) = ((block * 4) / 256, (block * 4) % 256);
        let host_ip = Ipv4Addr::new(10, 253, hi as u8, lo as u8 + 1);
        let ip = Ipv4Addr::new(10, 253, hi as u8, lo as u8 + 2);
        let net = TestNet {
            ns: format!("{PREFIX}{pid}x{n}"),
            // Interface names: at most 15 bytes.
            host_dev: format!("st{}h{n}", pid % 1_000_000),
            ip,
            host_ip,
        };
        let inner_dev = format!("st{}n{n}", pid % 1_000_000);
        sh(&["ip", "netns", "add", &net.ns])?;
        // From here on, drop removes what was made.
        sh(&[
            "ip",
            "link",
            "add",
            &net.host_dev,
            "type",
            "veth",
            "peer",
            "name",
            &inner_dev,
            "netns",
            &net.ns,
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &net.host_dev,
        ])?;
        sh(&["ip", "link", "set", &net.host_dev, "up"])?;
        sh(&[
            "ip",
            "-n",
            &net.ns,
            "addr",
            "add",
            &format!("{ip}/30"),
            "dev",
            &inner_dev,
        ])?;
        sh(&["ip", "-n", &net.ns, "link", "set", &inner_dev, "up"])?;
        sh(&["ip", "-n", &net.ns, "link", "set", "lo", "up"])?;
        Ok(net)
    }

    /// The namespace's name, for `ip netns exec`.
    pub fn name(&self) -> &str {
        &self.ns
    }

    /// Routes everything the namespace sends through the host's end of its veth, so it reaches
    /// every address of the host (another namespace's host end too), as a pod reaches a Service
    /// on another node. Tests send only to the host's own addresses.
    pub fn route_via_host(&self) -> Result<()> {
        sh(&[
            "ip",
            "-n",
            &self.ns,
            "route",
            "add",
            "default",
            "via",
            &self.host_ip.to_string(),
        ])
    }

    /// `program` run inside the namespace (`ip netns exec`, which execs it: the child's pid is
    /// the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(program);
        c
    }

    /// A TCP listener on the namespace's address (port chosen by the kernel), created from a
    /// thread that joined the namespace: the socket stays there, the test process does not.
    pub fn listen(&self) -> Result<TcpListener> {
        let path = format!("/var/run/netns/{}", self.ns);
        let ip = self.ip;
        std::thread::scope(|s| {
            s.spawn(|| -> Result<TcpListener> {
                let f = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
                nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("joining {path}"))?;
                let l = TcpListener::bind(SocketAddr::from((ip, 0)))
                    .with_context(|| format!("binding {ip} in {path}"))?;
                l.set_nonblocking(true)?;
                Ok(l)
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the thread joining {path} panicked"))?
        })
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        if let Err(e) = sh(&["ip", "netns", "del", &self.ns]) {
            eprintln!("cannot remove test network namespace {}: {e}", self.ns);
        }
    }
}
