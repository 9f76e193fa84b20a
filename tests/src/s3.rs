//! A real S3-compatible server on loopback for the jobs store's S3 backend: SeaweedFS' `weed
//! server` (master, volume, filer and S3 gateway in one process), built from its Go module by
//! `tests/s3/build.sh` (`SPUR_WEED_BIN`, which tests/run.sh exports, or built here once per
//! process into the cache checkouts share, `~/.cache/spur/seaweedfs`).
//!
//! Each [`S3Server`] has its own data directory and ports, all on 127.0.0.1 (or, for the node
//! tier, on the node's address inside its network namespace, where its pods reach it); its S3
//! endpoint serves only TLS, with a certificate of a CA the test made, and only signature-v4
//! requests of its one identity. A watchdog kills it if the test process dies without dropping it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use spur_kube_harness::process::{Process, Watchdog};

use crate::free_port;

/// The one identity the server accepts.
pub const ACCESS_KEY: &str = "spurtestaccess";
/// Its secret: long enough to be recognisable in an error message or a log, where it must not be.
pub const SECRET_KEY: &str = "spur-test-secret-0123456789abcdef";

/// The `weed` binary (`SPUR_WEED_BIN`, else `tests/s3/build.sh` once per process).
pub fn weed_bin() -> &'static Path {
    static BUILT: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let built = BUILT.get_or_init(|| {
        if let Some(bin) = std::env::var_os("SPUR_WEED_BIN") {
            return Ok(PathBuf::from(bin));
        }
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .ok_or("neither XDG_CACHE_HOME nor HOME is set")?;
        let out = Command::new("bash")
            .arg(crate::repo_root().join("tests/s3/build.sh"))
            .arg(cache.join("spur").join("seaweedfs"))
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("cannot run tests/s3/build.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "tests/s3/build.sh failed ({}); Go and access to the Go module proxy are \
                 required for the S3 store tests:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .map(|l| PathBuf::from(l.trim()))
            .ok_or_else(|| "tests/s3/build.sh printed no path".to_owned())
    });
    match built {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}

/// A running SeaweedFS with its S3 gateway; killed (and its data removed) on drop.
pub struct S3Server {
    /// `https://<address>:<port>`.
    pub endpoint: String,
    /// The network namespace it runs in (None: the test's own).
    netns: Option<String>,
    /// The PEM CA the endpoint's certificate is signed by.
    pub ca_file: PathBuf,
    /// A PEM CA that signed nothing the server presents.
    pub other_ca_file: PathBuf,
    ports: Vec<u16>,
    process: Process,
    _watchdog: Watchdog,
    /// Removed after the process is killed (fields drop after `Drop::drop`).
    _dir: tempfile::TempDir,
}

impl S3Server {
    /// Starts the server on 127.0.0.1; returns once a signed ListBuckets over TLS answers 200.
    pub async fn start() -> anyhow::Result<S3Server> {
        Self::start_at("127.0.0.1", None).await
    }

    /// Starts the server on `ip` inside network namespace `netns` (`ip netns exec`): the node
    /// tier's, on the node's address, for its pods.
    pub async fn start_in(netns: &str, ip: &str) -> anyhow::Result<S3Server> {
        Self::start_at(ip, Some(netns)).await
    }

    async fn start_at(ip: &str, netns: Option<&str>) -> anyhow::Result<S3Server> {
        let mut last = None;
        // A port taken between choosing it and weed binding it: try again with others.
        for _ in 0..3 {
            match Self::try_start(ip, netns).await {
                Ok(s) => return Ok(s),
                Err(e) if format!("{e:#}").contains("address already in use") => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("weed did not start")))
    }

    async fn try_start(ip: &str, netns: Option<&str>) -> anyhow::Result<S3Server> {
        let weed = weed_bin();
        let dir = tempfile::tempdir()?;
        let (ca_file, other_ca_file) = pki(dir.path(), ip)?;
        let config = dir.path().join("s3.json");
        std::fs::write(
            &config,
            serde_json::to_vec(&serde_json::json!({
                "identities": [{
                    "name": "spur-test",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }]
            }))?,
        )?;
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data)?;
        let ports: Vec<u16> = (0..8).map(|_| free_port()).collect();
        let p = |i: usize| ports[i].to_string();
        // `ip netns exec` execs weed: the process watched and killed is weed itself.
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(weed);
                c
            }
            None => Command::new(weed),
        };
        cmd.args(["-logtostderr=true", "server"])
            .arg(format!("-ip={ip}"))
            .arg(format!("-ip.bind={ip}"))
            .arg(format!("-dir={}", data.display()))
            .args([
                format!("-master.port={}", p(0)),
                format!("-master.port.grpc={}", p(1)),
                "-master.telemetry=false".into(),
                format!("-volume.port={}", p(2)),
                format!("-volume.port.grpc={}", p(3)),
                "-volume.preStopSeconds=0".into(),
                format!("-filer.port={}", p(4)),
                format!("-filer.port.grpc={}", p(5)),
                format!(
                    "-filer.localSocket={}",
                    dir.path().join("filer.sock").display()
                ),
                "-s3".into(),
                format!("-s3.port={}", p(6)),
                format!("-s3.port.grpc={}", p(7)),
                "-s3.port.iceberg=0".into(),
                "-s3.port.lance=0".into(),
                format!("-s3.localSocket={}", dir.path().join("s3.sock").display()),
                format!("-s3.config={}", config.display()),
                format!("-s3.cert.file={}", dir.path().join("server.crt").display()),
                format!("-s3.key.file={}", dir.path().join("server.key").display()),
            ])
            .env("HOME", dir.path());
        let mut watchdog = Watchdog::spawn(dir.path())?;
        let process = Process::spawn("weed", cmd, &dir.path().join("weed.log"))?;
        watchdog.watch(&process)?;
        let mut server = S3Server {
            endpoint: format!("https://{ip}:{}", ports[6]),
            netns: netns.map(str::to_owned),
            ca_file,
            other_ca_file,
            ports,
            process,
            _watchdog: watchdog,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = server.process.exited()? {
                bail!("weed exited ({status}):\n{}", server.process.log_tail());
            }
            if server.signed("GET", "/").is_ok_and(|code| code == 200) {
                return Ok(server);
            }
            if Instant::now() > deadline {
                bail!(
                    "weed's S3 gateway did not answer in 60 s:\n{}",
                    server.process.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A signed request (curl's signature v4) with an empty body; its HTTP status.
    fn signed(&self, method: &str, path: &str) -> anyhow::Result<u16> {
        let mut curl = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "curl"]);
                c
            }
            None => Command::new("curl"),
        };
        let out = curl
            // The server is on loopback or the node: never through a proxy of the environment.
            .env("NO_PROXY", "*")
            .env("no_proxy", "*")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "10",
            ])
            .arg("--cacert")
            .arg(&self.ca_file)
            .args(["--aws-sigv4", "aws:amz:us-east-1:s3", "--user"])
            .arg(format!("{ACCESS_KEY}:{SECRET_KEY}"))
            .args(["-X", method])
            .arg(format!("{}{path}", self.endpoint))
            .output()
            .context("running curl (tests/run.sh installs it)")?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .with_context(|| format!("curl printed no status: {:?}", out))
    }

    /// Creates a bucket.
    pub fn create_bucket(&self, name: &str) -> anyhow::Result<()> {
        let code = self.signed("PUT", &format!("/{name}"))?;
        anyhow::ensure!(
            code == 200,
            "creating bucket {name}: HTTP {code}\n{}",
            self.process.log_tail()
        );
        Ok(())
    }

    /// The end of the server's log, for assertion messages.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.process.kill();
        // weed puts its gRPC sockets in /tmp whatever its flags say; a SIGKILL leaves them.
        for port in &self.ports {
            for role in ["master", "volume", "filer", "s3"] {
                let _ = std::fs::remove_file(format!("/tmp/seaweedfs-{role}-grpc-{port}.sock"));
            }
        }
    }
}

/// A CA and a server certificate for `ip` (`server.crt`, `server.key`) in `dir`, and a
/// second CA that signed nothing; returns the two CA files.
fn pki(dir: &Path, ip: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let ca = |name: &str| -> anyhow::Result<(rcgen::Issuer<'static, rcgen::KeyPair>, PathBuf)> {
        let key = rcgen::KeyPair::generate()?;
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        let cert = p.self_signed(&key)?;
        let file = dir.join(format!("{name}.crt"));
        std::fs::write(&file, cert.pem())?;
        Ok((rcgen::Issuer::new(p, key), file))
    };
    let (issuer, ca_file) = ca("s3-ca")?;
    let (_, other) = ca("other-ca")?;
    let key = rcgen::KeyPair::generate()?;
    let mut p = rcgen::CertificateParams::new(vec![ip.to_owned()])?;
    p.distinguished_name.push(rcgen::DnType::CommonName, ip);
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = p.signed_by(&key, &issuer)?;
    std::fs::write(dir.join("server.key"), key.serialize_pem())?;
    std::fs::write(dir.join("server.crt"), cert.pem())?;
    Ok((ca_file, other))
}
