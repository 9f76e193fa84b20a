//! Test support: a real kube-apiserver and etcd on 127.0.0.1, started per test with token auth and
//! a serving certificate made here, handing out `kube::Client`s; torn down on drop. Also a real
//! PostgreSQL server ([`postgres`]).
//!
//! The binaries come from `tests/kube/build.sh` (kube-apiserver and etcd built from Go modules
//! into a cache directory, see `tests/kube/README.md`): [`KubeApi::start`] uses
//! `$SPUR_KUBE_BINDIR` when it holds both, else runs the script, which reuses its cache or builds.
//! A test that cannot get the binaries fails with the reason; it is never skipped.
//!
//! There is no kube-controller-manager, scheduler or kubelet: no garbage collection, no default
//! ServiceAccount per namespace ([`KubeApi::service_account_token`] creates the ones a test needs),
//! Pods stay Pending, Namespaces never finish deleting. Tests set the status a kubelet or
//! controller would.

mod pki;
pub mod postgres;
pub mod process;

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Api, Client, Config};
use serde::Deserialize as _;
use tempfile::TempDir;
use tokio::time::{Instant, sleep, timeout};

use crate::pki::Pki;
use crate::process::{Process, Watchdog};

/// Environment variable naming the directory that holds `kube-apiserver` and `etcd`.
pub const BINDIR_ENV: &str = "SPUR_KUBE_BINDIR";

/// Bound on etcd accepting connections. Generous: two cores may be busy with other tests.
const ETCD_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on kube-apiserver answering `/readyz` and creating the `default` namespace.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on one `/readyz` probe, so a server that accepts but never answers cannot stall the wait.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on a CRD becoming Established.
const CRD_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);
/// Starts attempted when a child loses its port to another process between our probe and its bind.
const PORT_ATTEMPTS: usize = 3;
const FIELD_MANAGER: &str = "spur-kube-harness";
const ADMIN_USER: &str = "spur-harness-admin";

/// A running kube-apiserver with its etcd, both on free 127.0.0.1 ports.
///
/// Dropping it kills kube-apiserver, then etcd, and removes their directory (data, certificates,
/// logs). That also happens when a test panics; if the test process dies without unwinding, a
/// watchdog process does it (see `process.rs`).
pub struct KubeApi {
    // Field order is teardown order. The watchdog goes first: were the test process to die after
    // the children are reaped, a live watchdog would kill their pids, which may have been reused.
    // kube-apiserver stops before the etcd it writes to; the directory goes last.
    _watchdog: Watchdog,
    apiserver: Process,
    etcd: Process,
    client: Client,
    config: Config,
    url: String,
    etcd_url: String,
    ca_pem: String,
    token: String,
    dir: TempDir,
}

enum StartError {
    /// A child lost the race for its port; worth another attempt on fresh ports.
    PortTaken(anyhow::Error),
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for StartError {
    fn from(e: anyhow::Error) -> Self {
        Self::Failed(e)
    }
}

impl KubeApi {
    /// Finds (or builds) the binaries, then starts etcd and kube-apiserver and waits until the
    /// API server is ready and has created the `default` namespace.
    pub async fn start() -> anyhow::Result<Self> {
        // kube's TLS stack takes the process-wide rustls provider; pick ring explicitly in case
        // the test binary links more than one provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bin_dir = binaries_dir().await?;
        let started = std::time::Instant::now();
        let mut lost_races = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            match Self::start_once(&bin_dir).await {
                Ok(api) => {
                    tracing::info!(
                        url = %api.url,
                        elapsed = ?started.elapsed(),
                        "kube-apiserver ready"
                    );
                    return Ok(api);
                }
                Err(StartError::PortTaken(e)) => {
                    tracing::warn!("lost a port race, retrying on fresh ports: {e:#}");
                    lost_races.push(e);
                }
                Err(StartError::Failed(e)) => return Err(e),
            }
        }
        Err(anyhow!(
            "kube-apiserver/etcd lost the race for their ports {PORT_ATTEMPTS} times:\n{}",
            lost_races
                .iter()
                .map(|e| format!("{e:#}"))
                .collect::<Vec<_>>()
                .join("\n")
        ))
    }

    async fn start_once(bin_dir: &Path) -> Result<Self, StartError> {
        let dir = tempfile::Builder::new()
            .prefix("spur-kube-")
            .tempdir()
            .context("creating a temporary directory")?;
        let path = dir.path();
        let mut watchdog = Watchdog::spawn(path)?;
        let pki = Pki::generate()?;
        let token = random_token()?;
        let files = [
            ("ca.crt", pki.ca_pem.as_str()),
            ("serving.crt", pki.serving_cert_pem.as_str()),
            ("serving.key", pki.serving_key_pem.as_str()),
            ("sa.key", pki.sa_key_pem.as_str()),
            ("sa.pub", pki.sa_public_pem.as_str()),
        ];
        for (name, content) in files {
            std::fs::write(path.join(name), content)
                .with_context(|| format!("writing {}", path.join(name).display()))?;
        }
        // Format: token,user,uid,"group1,group2". system:masters bypasses RBAC entirely.
        std::fs::write(
            path.join("tokens.csv"),
            format!("{token},{ADMIN_USER},{ADMIN_USER},\"system:masters\"\n"),
        )
        .context("writing tokens.csv")?;

        let [etcd_port, peer_port, api_port] = free_ports()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd = Command::new(bin_dir.join("etcd"));
        etcd.arg("--name=spur-harness")
            .arg(format!("--data-dir={}", path.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=spur-harness={peer_url}"))
            // Durability is worthless for a store deleted after the test; fsync is most of
            // etcd's write latency.
            .arg("--unsafe-no-fsync=true")
            .arg("--log-level=warn");
        let mut etcd = Process::spawn("etcd", etcd, &path.join("etcd.log"))?;
        watchdog.watch(&etcd)?;
        wait_listening(&mut etcd, etcd_port).await?;

        let url = format!("https://127.0.0.1:{api_port}");
        let pki_dir = path.display();
        let mut apiserver = Command::new(bin_dir.join("kube-apiserver"));
        apiserver
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg("--bind-address=127.0.0.1")
            // Without it kube-apiserver looks for a default route and fails on hosts without one.
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={api_port}"))
            // Never used (both files below exist), but the default is under /var/run.
            .arg(format!("--cert-dir={pki_dir}"))
            .arg(format!("--tls-cert-file={pki_dir}/serving.crt"))
            .arg(format!("--tls-private-key-file={pki_dir}/serving.key"))
            // A cluster-sized range (kube-apiserver's default /24 holds only 254 Services;
            // the control-plane benchmark creates a sandbox Service per sandbox).
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            // The default reconciler publishes the advertise address as the `kubernetes`
            // Service's endpoint, and Endpoints validation rejects loopback: an error every 10 s.
            .arg("--endpoint-reconciler-type=none")
            .arg(format!("--service-account-issuer={url}"))
            .arg(format!("--service-account-key-file={pki_dir}/sa.pub"))
            .arg(format!(
                "--service-account-signing-key-file={pki_dir}/sa.key"
            ))
            .arg("--authorization-mode=RBAC")
            .arg(format!("--token-auth-file={pki_dir}/tokens.csv"))
            // The ServiceAccount admission plugin rejects Pods until a controller-manager (absent
            // here) has created the namespace's default ServiceAccount.
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg("--allow-privileged=true");
        let mut apiserver = Process::spawn(
            "kube-apiserver",
            apiserver,
            &path.join("kube-apiserver.log"),
        )?;
        watchdog.watch(&apiserver)?;

        let config = config_for(&url, &pki.ca_pem, &token).await?;
        let client = Client::try_from(config.clone()).context("building the kube client")?;
        wait_ready(&mut apiserver, &mut etcd, &client).await?;

        Ok(Self {
            _watchdog: watchdog,
            apiserver,
            etcd,
            client,
            config,
            url,
            etcd_url,
            ca_pem: pki.ca_pem,
            token,
            dir,
        })
    }

    /// A client authenticated as a `system:masters` user (RBAC does not apply to it).
    ///
    /// It is bound to the tokio runtime [`start`](Self::start) ran on; build one from
    /// [`config`](Self::config) for another runtime.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The configuration behind [`client`](Self::client).
    pub fn config(&self) -> Config {
        self.config.clone()
    }

    /// A client that presents `token` instead of the admin token: a ServiceAccount's (see
    /// [`service_account_token`](Self::service_account_token)) or a wrong one.
    pub async fn client_with_token(&self, token: &str) -> anyhow::Result<Client> {
        let config = config_for(&self.url, &self.ca_pem, token).await?;
        Client::try_from(config).context("building the kube client")
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA that signed the serving certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The admin bearer token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// `http://127.0.0.1:<port>` of etcd.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// For tests of the teardown itself.
    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.pid()
    }

    /// For tests of the teardown itself.
    pub fn etcd_pid(&self) -> u32 {
        self.etcd.pid()
    }

    /// The directory holding the logs (`kube-apiserver.log`, `etcd.log`), certificates and etcd
    /// data; removed on drop.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a kubeconfig for the admin user, for a child process (`--kubeconfig`).
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        self.write_kubeconfig_with_token(path, &self.token)
    }

    /// Writes a kubeconfig that presents `token`.
    pub fn write_kubeconfig_with_token(&self, path: &Path, token: &str) -> anyhow::Result<()> {
        let yaml = serde_yaml_ng::to_string(&kubeconfig(&self.url, &self.ca_pem, token)?)
            .context("serializing the kubeconfig")?;
        std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))
    }

    /// A token for ServiceAccount `namespace/name` (TokenRequest, valid for an hour), creating
    /// the namespace and the ServiceAccount when missing. Requests made with it are subject to
    /// RBAC like a real workload's: bind it to the Roles under test.
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<String> {
        self.token_request(
            namespace,
            name,
            TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            },
        )
        .await
    }

    /// A token for ServiceAccount `namespace/name` as `spec` asks (audiences, a bound pod),
    /// creating the namespace and the ServiceAccount when missing.
    pub async fn token_request(
        &self,
        namespace: &str,
        name: &str,
        spec: TokenRequestSpec,
    ) -> anyhow::Result<String> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        create_if_missing(&namespaces, named(None, namespace)).await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        create_if_missing(&accounts, named(Some(namespace), name)).await?;
        let request = TokenRequest {
            spec,
            ..TokenRequest::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?;
        answer.status.map(|status| status.token).with_context(|| {
            format!("the TokenRequest for {namespace}/{name} came back without a token")
        })
    }

    /// Installs (server-side applies) the CRDs and waits until each is Established, so the next
    /// request can use the new resources.
    pub async fn install_crds(&self, crds: &[CustomResourceDefinition]) -> anyhow::Result<()> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        let mut names = Vec::with_capacity(crds.len());
        for crd in crds {
            let name = crd
                .metadata
                .name
                .as_deref()
                .context("a CustomResourceDefinition without metadata.name")?;
            api.patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(crd),
            )
            .await
            .with_context(|| format!("applying CRD {name}"))?;
            names.push(name);
        }
        for name in names {
            timeout(
                CRD_TIMEOUT,
                await_condition(api.clone(), name, conditions::is_crd_established()),
            )
            .await
            .map_err(|_| anyhow!("CRD {name} not Established within {CRD_TIMEOUT:?}"))?
            .with_context(|| format!("waiting for CRD {name} to be Established"))?;
        }
        Ok(())
    }

    /// [`install_crds`](Self::install_crds) for YAML holding one or more CRD documents (`---`).
    pub async fn install_crd_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        let mut crds = Vec::new();
        for (index, document) in serde_yaml_ng::Deserializer::from_str(yaml).enumerate() {
            let value = serde_yaml_ng::Value::deserialize(document)
                .with_context(|| format!("parsing YAML document {index}"))?;
            if value.is_null() {
                continue;
            }
            crds.push(
                serde_yaml_ng::from_value::<CustomResourceDefinition>(value)
                    .with_context(|| format!("YAML document {index} is not a CRD"))?,
            );
        }
        if crds.is_empty() {
            bail!("no CRD in the YAML");
        }
        self.install_crds(&crds).await
    }

    /// [`install_crd_yaml`](Self::install_crd_yaml) for a file (for example one under `charts/`).
    pub async fn install_crd_file(&self, path: &Path) -> anyhow::Result<()> {
        let yaml = tokio::fs::read_to_string(path)
            .await
            .with_context(|| format!("reading {}", path.display()))?;
        self.install_crd_yaml(&yaml)
            .await
            .with_context(|| format!("installing the CRDs in {}", path.display()))
    }
}

/// The directory `tests/kube/build.sh` fills (located, or built, once per process): besides
/// `kube-apiserver` and `etcd` it holds what else the script provides, e.g. `mesh-crds/`.
pub async fn bin_dir() -> anyhow::Result<PathBuf> {
    binaries_dir().await
}

/// The directory holding `kube-apiserver` and `etcd`, located (or built) once per process.
async fn binaries_dir() -> anyhow::Result<PathBuf> {
    static DIR: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    DIR.get_or_try_init(locate_binaries).await.cloned()
}

async fn locate_binaries() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BINDIR_ENV).map(PathBuf::from)
        && has_binaries(&dir)
    {
        return Ok(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the harness crate has no parent directory")?
        .join("kube/build.sh");
    tracing::info!("running {}", script.display());
    // stderr is inherited: a cold build takes minutes and reports its progress there.
    let out = tokio::process::Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        // Not `output()`: tokio's pipes stderr regardless of the setting above.
        .spawn()
        .with_context(|| format!("running {}", script.display()))?
        .wait_with_output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}), see its output above. It needs Go (tests/kube/README.md) and, for the \
             first build, the Go module proxy; or set {BINDIR_ENV} to a directory holding \
             kube-apiserver and etcd",
            script.display(),
            out.status
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout
        .lines()
        .map(str::trim)
        .rfind(|line| !line.is_empty())
        .map(PathBuf::from)
        .with_context(|| format!("{} printed no directory", script.display()))?;
    if !has_binaries(&dir) {
        bail!(
            "{} reported {}, which lacks kube-apiserver or etcd",
            script.display(),
            dir.display()
        );
    }
    Ok(dir)
}

fn has_binaries(dir: &Path) -> bool {
    dir.join("kube-apiserver").is_file() && dir.join("etcd").is_file()
}

/// A port free for TCP and UDP on every address when asked, and chosen below the kernel's
/// ephemeral range: a socket bound to port 0 (a client's, a resolver's, another test's) is never
/// given it, so it stays free until the server the test starts binds it. Each call in a process
/// gives another port. (A port of the ephemeral range, released and bound again seconds later
/// by a gateway, was taken by a concurrent test's UDP client in CI.)
pub fn free_port() -> u16 {
    use std::net::{Ipv4Addr, TcpListener, UdpSocket};
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .filter(|&first| first > LOW + 1_000)
        .unwrap_or(32_768);
    let span = high - LOW;
    // Processes running side by side start at different places of the span.
    let seed = std::process::id().wrapping_mul(7_919)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + seed.wrapping_add(n.wrapping_mul(7)) % span) as u16;
        let free = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
            && UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok();
        if free {
            return port;
        }
    }
    panic!("no free port between {LOW} and {high}")
}

/// Distinct free loopback ports: all listeners are held at once, then closed so the children can
/// bind. Another process may take one in between; `start` retries when that happens.
fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<Result<Vec<_>, _>>()
        .context("binding 127.0.0.1:0")?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener
            .local_addr()
            .context("reading a bound port")?
            .port();
    }
    Ok(ports)
}

/// 128 random bits, hex: the admin token.
fn random_token() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn exit_error(process: &Process, status: ExitStatus) -> StartError {
    let error = anyhow!(
        "{} exited during startup ({status})\n{}",
        process.name(),
        process.log_tail()
    );
    if process.log_contains("address already in use") {
        StartError::PortTaken(error)
    } else {
        StartError::Failed(error)
    }
}

fn check_running(process: &mut Process) -> Result<(), StartError> {
    match process.exited()? {
        Some(status) => Err(exit_error(process, status)),
        None => Ok(()),
    }
}

async fn wait_listening(etcd: &mut Process, port: u16) -> Result<(), StartError> {
    let deadline = Instant::now() + ETCD_TIMEOUT;
    loop {
        check_running(etcd)?;
        if tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StartError::Failed(anyhow!(
                "etcd not listening on 127.0.0.1:{port} within {ETCD_TIMEOUT:?}\n{}",
                etcd.log_tail()
            )));
        }
        sleep(POLL).await;
    }
}

async fn wait_ready(
    apiserver: &mut Process,
    etcd: &mut Process,
    client: &Client,
) -> Result<(), StartError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut ready = false;
    let mut last;
    loop {
        // etcd is checked too: if it lost its port, kube-apiserver just retries forever.
        check_running(apiserver)?;
        check_running(etcd)?;
        if ready {
            // The `default` namespace is created by a controller inside kube-apiserver shortly
            // after /readyz turns ok; tests creating objects there would race it.
            match timeout(PROBE_TIMEOUT, namespaces.get_opt("default")).await {
                Ok(Ok(Some(_))) => return Ok(()),
                Ok(Ok(None)) => last = "namespace default does not exist yet".to_owned(),
                Ok(Err(e)) => last = format!("GET namespace default: {e}"),
                Err(_) => last = "GET namespace default timed out".to_owned(),
            }
        } else {
            let request = http::Request::get("/readyz")
                .body(Vec::new())
                .context("building the /readyz request")?;
            match timeout(PROBE_TIMEOUT, client.request_text(request)).await {
                Ok(Ok(_)) => {
                    ready = true;
                    continue;
                }
                Ok(Err(e)) => last = format!("/readyz: {e}"),
                Err(_) => last = "/readyz timed out".to_owned(),
            }
        }
        if Instant::now() >= deadline {
            return Err(StartError::Failed(anyhow!(
                "kube-apiserver not ready within {READY_TIMEOUT:?} (last: {last})\n{}\n{}",
                apiserver.log_tail(),
                etcd.log_tail()
            )));
        }
        sleep(POLL).await;
    }
}

/// The kubeconfig every client of this harness uses, in-process or in a child.
fn kubeconfig(url: &str, ca_pem: &str, token: &str) -> anyhow::Result<serde_json::Value> {
    // ByteString serializes as base64, the encoding of *-data fields.
    let ca_data =
        serde_json::to_value(ByteString(ca_pem.as_bytes().to_vec())).context("encoding the CA")?;
    Ok(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "spur-harness",
            "cluster": { "server": url, "certificate-authority-data": ca_data },
        }],
        "users": [{ "name": "spur-harness", "user": { "token": token } }],
        "contexts": [{
            "name": "spur-harness",
            "context": { "cluster": "spur-harness", "user": "spur-harness" },
        }],
        "current-context": "spur-harness",
    }))
}

async fn config_for(url: &str, ca_pem: &str, token: &str) -> anyhow::Result<Config> {
    let kubeconfig: Kubeconfig = serde_json::from_value(kubeconfig(url, ca_pem, token)?)
        .context("building the kubeconfig")?;
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .context("loading the kubeconfig")?;
    // The server is on loopback; an HTTPS_PROXY in the test's environment must not apply.
    config.proxy_url = None;
    Ok(config)
}

fn named<K: kube::Resource<DynamicType = ()> + Default>(namespace: Option<&str>, name: &str) -> K {
    let mut object = K::default();
    *object.meta_mut() = ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        ..ObjectMeta::default()
    };
    object
}

async fn create_if_missing<K>(api: &Api<K>, object: K) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
{
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
        Err(e) => Err(e).with_context(|| {
            format!(
                "creating {} {}",
                K::kind(&()),
                object.meta().name.as_deref().unwrap_or_default()
            )
        }),
    }
}
