//! The peers under comparison and how each one is started, checked and stopped.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::load::pinned;
use super::proc::{Child, StdoutMode, children_of};

pub const NGINX_TEMPLATE: &str = include_str!("../../configs/nginx.conf.tmpl");
pub const HAPROXY_TEMPLATE: &str = include_str!("../../configs/haproxy.cfg.tmpl");
pub const SPUR_RULES_TEMPLATE: &str = include_str!("../../configs/spur-rules.yaml.tmpl");

/// Routing-key header for the keyed spur peer.
pub const KEY_HEADER: (&str, &str) = ("baggage", "sd-routing-key=k1");

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PeerKind {
    Direct,
    Spur,
    SpurKeyed,
    Nginx,
    Haproxy,
}

impl PeerKind {
    pub const ALL: [PeerKind; 5] = [
        PeerKind::Direct,
        PeerKind::Spur,
        PeerKind::SpurKeyed,
        PeerKind::Nginx,
        PeerKind::Haproxy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Direct => "direct",
            PeerKind::Spur => "spur",
            PeerKind::SpurKeyed => "spur-keyed",
            PeerKind::Nginx => "nginx",
            PeerKind::Haproxy => "haproxy",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .with_context(|| {
                format!("unknown peer {s:?} (direct, spur, spur-keyed, nginx, haproxy)")
            })
    }

    /// Extra request header this peer's traffic carries.
    pub fn header(self) -> Option<(&'static str, &'static str)> {
        (self == PeerKind::SpurKeyed).then_some(KEY_HEADER)
    }

    pub fn is_proxy(self) -> bool {
        self != PeerKind::Direct
    }
}

/// Everything peers need to start.
pub struct PeerEnv {
    pub bin_dir: PathBuf,
    pub work_dir: PathBuf,
    /// Core for the proxy under test, None when not pinning.
    pub proxy_core: Option<u32>,
    pub upstream: SocketAddr,
    pub sandbox: SocketAddr,
    /// Largest number of requests in flight in any run (sizes nginx's idle upstream pool).
    pub max_concurrency: usize,
    pub nginx_version: Option<(u32, u32, u32)>,
}

/// A started peer.
pub struct RunningPeer {
    pub kind: PeerKind,
    /// Where HTTP/1.1 traffic goes.
    pub h1: SocketAddr,
    /// Where h2c and gRPC traffic goes.
    pub h2: SocketAddr,
    /// Processes whose CPU time is counted (all of the peer's processes).
    pub cpu_pids: Vec<u32>,
    /// The process whose memory is reported (the request-serving one: nginx's worker).
    pub rss_pid: Option<u32>,
    /// Other processes of the peer (nginx's master), memory reported separately.
    pub other_pids: Vec<u32>,
    /// The port the upstream reports in `x-upstream` for this peer's traffic.
    pub expect_port: u16,
    pub log: PathBuf,
    procs: Vec<Child>,
}

impl RunningPeer {
    /// Fails if one of the peer's processes has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.procs {
            if let Some(st) = p.exited() {
                bail!("{} exited ({st}); log: {}", p.name(), log_tail(&self.log));
            }
        }
        Ok(())
    }

    pub fn stop(&mut self) {
        for p in &mut self.procs {
            p.stop();
        }
    }
}

/// A free 127.0.0.1 port (bound, then released).
pub fn free_port() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// Replaces `{{KEY}}` placeholders; fails if any is left.
pub fn render(template: &str, vars: &[(&str, String)]) -> Result<String> {
    let mut s = template.to_string();
    for (k, v) in vars {
        s = s.replace(&format!("{{{{{k}}}}}"), v);
    }
    if let Some(i) = s.find("{{") {
        let end = s[i..].find("}}").map_or(s.len(), |e| i + e + 2);
        bail!("unfilled placeholder {}", &s[i..end]);
    }
    Ok(s)
}

/// The last lines of a log file, for error messages.
pub fn log_tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    let start = lines.len().saturating_sub(8);
    lines[start..].join(" | ")
}

/// Waits until `addr` accepts TCP connections, checking that the processes stay up.
fn wait_listening(
    addr: SocketAddr,
    procs: &mut [Child],
    log: &Path,
    limit: Duration,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        for p in procs.iter_mut() {
            if let Some(st) = p.exited() {
                bail!(
                    "{} exited ({st}) before listening on {addr}: {}",
                    p.name(),
                    log_tail(log)
                );
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "nothing listening on {addr} after {limit:?}: {}",
                log_tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// GET `path` on `addr` over HTTP/1.1 (Connection: close); the status code.
pub fn http_status(addr: SocketAddr, path: &str, timeout: Duration) -> Result<u16> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf)?;
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad HTTP reply from {addr}: {head:?}"))
}

/// `nginx -v` → (major, minor, patch).
pub fn parse_nginx_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text.split("nginx/").nth(1)?.split_whitespace().next()?;
    let mut it = v.split('.').map(|n| n.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// Starts `kind` in its own fresh processes. `Direct` starts nothing.
pub fn start(kind: PeerKind, env: &PeerEnv, index: usize) -> Result<RunningPeer> {
    let log = env.work_dir.join(format!("{}-{index}.log", kind.name()));
    let upstream_port = env.upstream.port();
    match kind {
        PeerKind::Direct => Ok(RunningPeer {
            kind,
            h1: env.upstream,
            h2: env.upstream,
            cpu_pids: Vec::new(),
            rss_pid: None,
            other_pids: Vec::new(),
            expect_port: upstream_port,
            log,
            procs: Vec::new(),
        }),
        PeerKind::Spur | PeerKind::SpurKeyed => {
            let listen = free_port()?;
            let admin = free_port()?;
            let rules = env.work_dir.join(format!("spur-rules-{index}.yaml"));
            std::fs::write(
                &rules,
                render(
                    SPUR_RULES_TEMPLATE,
                    &[
                        ("UPSTREAM_PORT", upstream_port.to_string()),
                        ("SANDBOX_PORT", env.sandbox.port().to_string()),
                    ],
                )?,
            )?;
            let mut cmd = pinned(env.proxy_core, &env.bin_dir.join("spur-sidecar"));
            cmd.args(["--inbound-addr", &listen.to_string()])
                .args(["--app-addr", &env.upstream.to_string()])
                .args(["--baseline-namespace", "bench", "--baseline-name", "app"])
                .arg("--rules")
                .arg(&rules)
                .args(["--admin-addr", &admin.to_string()])
                .env("SPUR_LOG", "warn");
            let mut procs = vec![Child::spawn("spur-sidecar", cmd, StdoutMode::Null, &log)?];
            // Ready once the rules are loaded.
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                if let Some(st) = procs[0].exited() {
                    bail!("spur-sidecar exited ({st}): {}", log_tail(&log));
                }
                if http_status(admin, "/ready", Duration::from_millis(500)).ok() == Some(200) {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!("spur-sidecar not ready after 15 s: {}", log_tail(&log));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            wait_listening(listen, &mut procs, &log, Duration::from_secs(5))?;
            let pid = procs[0].pid();
            Ok(RunningPeer {
                kind,
                h1: listen,
                h2: listen,
                cpu_pids: vec![pid],
                rss_pid: Some(pid),
                other_pids: Vec::new(),
                expect_port: if kind == PeerKind::SpurKeyed {
                    env.sandbox.port()
                } else {
                    upstream_port
                },
                log,
                procs,
            })
        }
        PeerKind::Nginx => {
            let h1 = free_port()?;
            let h2 = free_port()?;
            let prefix = env.work_dir.join(format!("nginx-{index}"));
            std::fs::create_dir_all(&prefix)?;
            let new_syntax = env.nginx_version.is_some_and(|v| v >= (1, 25, 1));
            let h2_listen = if new_syntax {
                format!("listen {h2} backlog=4096;\n        http2 on;")
            } else {
                format!("listen {h2} http2 backlog=4096;")
            };
            let conf = render(
                NGINX_TEMPLATE,
                &[
                    ("PREFIX", prefix.display().to_string()),
                    ("UPSTREAM", env.upstream.to_string()),
                    ("KEEPALIVE", env.max_concurrency.max(64).to_string()),
                    ("MAX_CONCURRENCY", env.max_concurrency.to_string()),
                    ("LISTEN_H1", h1.to_string()),
                    ("H2_LISTEN_DIRECTIVES", h2_listen),
                ],
            )?;
            let conf_path = prefix.join("nginx.conf");
            std::fs::write(&conf_path, conf)?;
            let nginx = super::load::which("nginx").context("nginx not installed")?;
            let mut cmd = pinned(env.proxy_core, &nginx);
            cmd.arg("-p")
                .arg(&prefix)
                .arg("-c")
                .arg(&conf_path)
                .args(["-g", "daemon off;"]);
            let mut procs = vec![Child::spawn("nginx", cmd, StdoutMode::Null, &log)?];
            wait_listening(h1, &mut procs, &log, Duration::from_secs(10))?;
            wait_listening(h2, &mut procs, &log, Duration::from_secs(10))?;
            let master = procs[0].pid();
            let deadline = Instant::now() + Duration::from_secs(5);
            let workers = loop {
                let w = children_of(master);
                if !w.is_empty() {
                    break w;
                }
                if Instant::now() >= deadline {
                    bail!("nginx master {master} has no worker process");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if workers.len() != 1 {
                bail!("nginx: expected one worker, found {workers:?}");
            }
            Ok(RunningPeer {
                kind,
                h1,
                h2,
                cpu_pids: vec![master, workers[0]],
                rss_pid: Some(workers[0]),
                other_pids: vec![master],
                expect_port: upstream_port,
                log,
                procs,
            })
        }
        PeerKind::Haproxy => {
            let h1 = free_port()?;
            let h2 = free_port()?;
            let cfg = render(
                HAPROXY_TEMPLATE,
                &[
                    ("UPSTREAM", env.upstream.to_string()),
                    ("LISTEN_H1", h1.to_string()),
                    ("LISTEN_H2", h2.to_string()),
                ],
            )?;
            let cfg_path = env.work_dir.join(format!("haproxy-{index}.cfg"));
            std::fs::write(&cfg_path, cfg)?;
            let haproxy = super::load::which("haproxy").context("haproxy not installed")?;
            let mut cmd = pinned(env.proxy_core, &haproxy);
            cmd.arg("-db").arg("-f").arg(&cfg_path);
            let mut procs = vec![Child::spawn("haproxy", cmd, StdoutMode::Null, &log)?];
            wait_listening(h1, &mut procs, &log, Duration::from_secs(10))?;
            wait_listening(h2, &mut procs, &log, Duration::from_secs(10))?;
            let pid = procs[0].pid();
            let kids = children_of(pid);
            if !kids.is_empty() {
                bail!("haproxy -db forked {kids:?}; expected a single process");
            }
            Ok(RunningPeer {
                kind,
                h1,
                h2,
                cpu_pids: vec![pid],
                rss_pid: Some(pid),
                other_pids: Vec::new(),
                expect_port: upstream_port,
                log,
                procs,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_render() {
        fn vars(extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
            let mut v = vec![
                ("PREFIX", "/tmp/x".to_string()),
                ("UPSTREAM", "127.0.0.1:1".to_string()),
                ("UPSTREAM_PORT", "1".to_string()),
                ("SANDBOX_PORT", "2".to_string()),
                ("KEEPALIVE", "64".to_string()),
                ("MAX_CONCURRENCY", "128".to_string()),
                ("LISTEN_H1", "127.0.0.1:3".to_string()),
                ("LISTEN_H2", "127.0.0.1:4".to_string()),
            ];
            v.extend(extra.iter().cloned());
            v
        }
        render(
            NGINX_TEMPLATE,
            &vars(&[("H2_LISTEN_DIRECTIVES", "listen 127.0.0.1:4 http2;".into())]),
        )
        .unwrap();
        render(HAPROXY_TEMPLATE, &vars(&[])).unwrap();
        render(SPUR_RULES_TEMPLATE, &vars(&[])).unwrap();
        assert!(render("{{NOPE}}", &[]).is_err());
    }

    #[test]
    fn nginx_version() {
        assert_eq!(
            parse_nginx_version("nginx version: nginx/1.22.1\n"),
            Some((1, 22, 1))
        );
    }
}
