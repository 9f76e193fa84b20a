//! `spur-io`: the io helper in every step pod of a sandbox resource's workflow, so plugin
//! authors can use stock images.
//!
//! - `spur-io init` runs in the pod's init container (Spur's image): it copies itself into the
//!   shared `/spur-io` volume, writes the step's script there, and fetches the step's inputs
//!   from the io context server into `/spur-io/in/<input>`.
//! - `spur-io run` is the step container's command: it puts each input where the step wants it
//!   (an env var or a file), runs the script, then reads the declared output files and sends
//!   them to the io context server, including when the script failed (so both the partial
//!   outputs and the failure are recorded). It exits with the script's code, or 1 when the
//!   script succeeded but an output is missing or could not be stored.
//!
//! Both authenticate with the pod's projected ServiceAccount token (audience `spur-io`), re-read
//! from its file for every call since the kubelet rotates it. Values are never printed.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use spur_proto::io::io_context_client::IoContextClient;
use spur_proto::io::{Outputs, UnitRef, Value};
use tonic::transport::{Channel, Endpoint};

/// Largest output value (the io context server refuses more).
const OUTPUT_VALUE_MAX: usize = 64 * 1024;
/// How long calls are retried while the server is unreachable or the operator has not yet
/// recorded this pod: long enough to ride out an io context server being installed, upgraded
/// or waiting for its certificate (a create step whose inputs never come fails for good).
const RETRY_FOR: Duration = Duration::from_secs(600);
/// Prefix of the helper's own env vars: removed from the step's environment.
const OWN_ENV_PREFIX: &str = "SPUR_IO_";

#[derive(Parser)]
#[command(
    name = "spur-io",
    version,
    about = "The io helper of Spur's resource step pods"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Init container: copy spur-io and the script into the shared volume, fetch the inputs.
    Init(InitArgs),
    /// Step container: inject the inputs, run the script, send the outputs.
    Run(RunArgs),
}

/// Which unit this pod is, and how to reach the server.
#[derive(Args, Clone)]
struct Common {
    /// `https://host:port` of the io context server.
    #[arg(long, env = "SPUR_IO_SERVER")]
    server: String,
    /// CA bundle the server's certificate must chain to.
    #[arg(long, env = "SPUR_IO_CA_FILE")]
    ca_file: PathBuf,
    /// The pod's projected token (audience spur-io).
    #[arg(long, env = "SPUR_IO_TOKEN_FILE")]
    token_file: PathBuf,
    /// The ObjectLifecycleMethods object.
    #[arg(long, env = "SPUR_IO_OLM")]
    olm: String,
    /// `preStart` or `postStop`.
    #[arg(long, env = "SPUR_IO_WORKFLOW")]
    workflow: String,
    #[arg(long, env = "SPUR_IO_UNIT")]
    unit: String,
    /// The shared volume.
    #[arg(long, env = "SPUR_IO_DIR", default_value = "/spur-io")]
    dir: PathBuf,
}

#[derive(Args)]
struct InitArgs {
    #[command(flatten)]
    common: Common,
    /// The step's script (written to <dir>/script, executable).
    #[arg(long, env = "SPUR_IO_SCRIPT")]
    script: Option<String>,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// `NAME=input`: the input's value as env var NAME.
    #[arg(long = "env", value_parser = pair)]
    envs: Vec<(String, String)>,
    /// `PATH=input`: the input's value in file PATH (mode 0600).
    #[arg(long = "file", value_parser = pair)]
    files: Vec<(String, String)>,
    /// `output=PATH`: the contents of PATH, when the script ends, as that output.
    #[arg(long = "export", value_parser = pair)]
    exports: Vec<(String, String)>,
    /// The command to run instead of `<dir>/script`.
    #[arg(last = true)]
    command: Vec<String>,
}

fn pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_owned(), b.to_owned())),
        _ => Err(format!("{s:?}: expected A=B")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("spur-io: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Init(a) => init(a).await.map(|()| 0u8),
            Command::Run(a) => run(a).await,
        }
    });
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("spur-io: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

// === init ===

async fn init(a: InitArgs) -> Result<()> {
    let c = &a.common;
    let bin = c.dir.join("bin");
    let inputs = c.dir.join("in");
    for d in [&bin, &inputs] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("chmod {}", d.display()))?;
    }
    let me = std::env::current_exe().context("finding spur-io's own executable")?;
    let target = bin.join("spur-io");
    std::fs::copy(&me, &target)
        .with_context(|| format!("copying {} to {}", me.display(), target.display()))?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
    if let Some(script) = &a.script {
        write_file(&c.dir.join("script"), script.as_bytes(), 0o755)?;
    }
    let client = Client::connect(c)?;
    let got = retry("GetInputs", || {
        let mut client = client.clone();
        let req = client.request(unit_ref(c));
        async move { client.grpc.get_inputs(req?).await }
    })
    .await?
    .into_inner();
    for v in &got.inputs {
        if !is_safe_name(&v.name) {
            bail!(
                "the server sent an input with an unusable name {:?}",
                v.name
            );
        }
        write_file(&inputs.join(&v.name), &v.value, 0o644)?;
    }
    eprintln!(
        "spur-io: {} input(s) of {}/{} ready",
        got.inputs.len(),
        c.workflow,
        c.unit
    );
    Ok(())
}

/// Input names are `[a-zA-Z][a-zA-Z0-9-]*`: never a path.
fn is_safe_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && s.as_bytes()[0].is_ascii_alphabetic()
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    use std::io::Write as _;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(data)
        .with_context(|| format!("writing {}", path.display()))?;
    // The umask may have narrowed the mode.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

// === run ===

async fn run(a: RunArgs) -> Result<u8> {
    let c = &a.common;
    let inputs = c.dir.join("in");
    let read_input = |name: &str| -> Result<Vec<u8>> {
        if !is_safe_name(name) {
            bail!("{name:?} is not an input name");
        }
        std::fs::read(inputs.join(name))
            .with_context(|| format!("input {name} was not fetched (did spur-io init run?)"))
    };
    let mut cmd = if a.command.is_empty() {
        let script = c.dir.join("script");
        let head = std::fs::read(&script)
            .with_context(|| format!("reading the step's script {}", script.display()))?;
        if head.starts_with(b"#!") {
            tokio::process::Command::new(&script)
        } else {
            let mut sh = tokio::process::Command::new("/bin/sh");
            sh.arg(&script);
            sh
        }
    } else {
        let mut cmd = tokio::process::Command::new(&a.command[0]);
        cmd.args(&a.command[1..]);
        cmd
    };
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with(OWN_ENV_PREFIX) {
            cmd.env_remove(k);
        }
    }
    for (env, input) in &a.envs {
        let v = read_input(input)?;
        if v.contains(&0) {
            bail!("input {input} holds a NUL byte: it cannot be env var {env} (use a file)");
        }
        cmd.env(env, OsString::from_vec(v));
    }
    for (path, input) in &a.files {
        write_file(Path::new(path), &read_input(input)?, 0o600)?;
    }
    // Injected where the step wants them: the copies in the shared volume go (only the step's
    // own env and files hold the values from here on).
    for (_, input) in a.envs.iter().chain(&a.files) {
        let _ = std::fs::remove_file(inputs.join(input));
    }

    // Handlers before the child exists, so a SIGTERM arriving meanwhile is not lost; the
    // script gets a process group of its own, so the whole tree hears it.
    use tokio::signal::unix::{SignalKind, signal};
    let signals = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    cmd.process_group(0);
    let mut child = cmd
        .spawn()
        .with_context(|| "starting the step's script".to_string())?;
    let pid = child.id();
    let status = wait_forwarding_signals(&mut child, pid, signals).await?;
    let exit_code = status_code(&status);

    let (outputs, problems) = collect(&a.exports);
    let message = problems.join("; ");
    for p in &problems {
        eprintln!("spur-io: {p}");
    }
    let sent = match Client::connect(c) {
        Err(e) => Err(e),
        Ok(client) => {
            retry("PutOutputs", || {
                let mut client = client.clone();
                let req = client.request(Outputs {
                    unit: Some(unit_ref(c)),
                    outputs: outputs.clone(),
                    exit_code,
                    message: message.clone(),
                });
                async move { client.grpc.put_outputs(req?).await }
            })
            .await
        }
    };
    let stored_ok = match sent {
        Ok(_) => {
            eprintln!(
                "spur-io: stored {} output(s) of {}/{} (script exit code {exit_code})",
                outputs.len(),
                c.workflow,
                c.unit
            );
            true
        }
        Err(e) => {
            eprintln!("spur-io: error: the outputs could not be stored: {e:#}");
            false
        }
    };
    Ok(match u8::try_from(exit_code) {
        Ok(0) if problems.is_empty() && stored_ok => 0,
        Ok(0) => 1,
        Ok(code) => code,
        // Killed by a signal.
        Err(_) => 1,
    })
}

/// Waits for the script, passing SIGTERM and SIGINT on to its process group (a pod being
/// deleted).
async fn wait_forwarding_signals(
    child: &mut tokio::process::Child,
    pid: Option<u32>,
    (mut term, mut int): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
) -> Result<std::process::ExitStatus> {
    loop {
        let sig = tokio::select! {
            s = child.wait() => return s.context("waiting for the step's script"),
            _ = term.recv() => nix::sys::signal::Signal::SIGTERM,
            _ = int.recv() => nix::sys::signal::Signal::SIGINT,
        };
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            // The group the child leads (process_group(0)): the script and what it started.
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), sig);
        }
    }
}

fn status_code(s: &std::process::ExitStatus) -> i32 {
    s.code().unwrap_or(-1)
}

/// Reads every declared output file; what cannot be read is reported, not sent.
fn collect(exports: &[(String, String)]) -> (Vec<Value>, Vec<String>) {
    use std::io::Read as _;
    let mut values = Vec::new();
    let mut problems = Vec::new();
    for (name, path) in exports {
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) => {
                problems.push(format!("output {name}: {path}: {e}"));
                continue;
            }
        };
        let mut buf = Vec::new();
        match file.take(OUTPUT_VALUE_MAX as u64 + 1).read_to_end(&mut buf) {
            Ok(n) if n > OUTPUT_VALUE_MAX => problems.push(format!(
                "output {name}: {path} is larger than {OUTPUT_VALUE_MAX} bytes"
            )),
            Ok(_) => values.push(Value {
                name: name.clone(),
                value: buf,
            }),
            Err(e) => problems.push(format!("output {name}: {path}: {e}")),
        }
    }
    (values, problems)
}

// === the client ===

fn unit_ref(c: &Common) -> UnitRef {
    UnitRef {
        olm: c.olm.clone(),
        workflow: c.workflow.clone(),
        unit: c.unit.clone(),
    }
}

#[derive(Clone)]
struct Client {
    grpc: IoContextClient<Channel>,
    token_file: PathBuf,
}

impl Client {
    fn connect(c: &Common) -> Result<Client> {
        let uri: http::Uri = c
            .server
            .parse()
            .with_context(|| format!("--server {:?}", c.server))?;
        if uri.scheme_str() != Some("https") {
            bail!("--server must be https://host:port");
        }
        let host = uri
            .host()
            .ok_or_else(|| anyhow!("--server has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        let ca = std::fs::read(&c.ca_file)
            .with_context(|| format!("reading the CA bundle {}", c.ca_file.display()))?;
        let tls = client_config(&ca)?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| anyhow!("{host}: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(tls);
        let endpoint = Endpoint::from_shared(format!("http://{host}:{port}"))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30));
        let channel =
            endpoint.connect_with_connector_lazy(tower::service_fn(move |_: http::Uri| {
                let connector = connector.clone();
                let name = name.clone();
                let host = host.clone();
                async move {
                    let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
                    tcp.set_nodelay(true)?;
                    let tls = connector.connect(name, tcp).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
                }
            }));
        Ok(Client {
            grpc: IoContextClient::new(channel),
            token_file: c.token_file.clone(),
        })
    }

    /// A request carrying the token as it is now on disk.
    fn request<T>(&mut self, msg: T) -> Result<tonic::Request<T>, tonic::Status> {
        let token = std::fs::read_to_string(&self.token_file).map_err(|e| {
            tonic::Status::unauthenticated(format!(
                "cannot read the token {}: {e}",
                self.token_file.display()
            ))
        })?;
        let mut req = tonic::Request::new(msg);
        let value = format!("Bearer {}", token.trim())
            .parse()
            .map_err(|_| tonic::Status::unauthenticated("the token is not a valid header value"))?;
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }
}

fn client_config(ca_pem: &[u8]) -> Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(c.map_err(|e| anyhow!("CA bundle: {e}"))?)?;
    }
    if roots.is_empty() {
        bail!("the CA bundle holds no certificate");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// Retries `call` while the answer is worth waiting out (UNAVAILABLE: the server is not
/// reachable yet, or the operator has not recorded this pod yet), up to [`RETRY_FOR`].
async fn retry<T, F, Fut>(what: &str, mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let deadline = tokio::time::Instant::now() + RETRY_FOR;
    let mut delay = Duration::from_millis(100);
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                ) && tokio::time::Instant::now() + delay < deadline =>
            {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(s) => bail!("{what}: {:?}: {}", s.code(), s.message()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_names() {
        assert_eq!(pair("A=b"), Ok(("A".into(), "b".into())));
        assert_eq!(pair("/tmp/x=a=b"), Ok(("/tmp/x".into(), "a=b".into())));
        assert!(pair("=b").is_err());
        assert!(pair("a").is_err());
        assert!(is_safe_name("db-name"));
        for bad in ["", "../x", "a/b", "-a", ".x"] {
            assert!(!is_safe_name(bad), "{bad}");
        }
    }

    #[test]
    fn outputs_are_collected_and_problems_reported() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("dsn");
        std::fs::write(&ok, b"postgres://x").unwrap();
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; OUTPUT_VALUE_MAX + 1]).unwrap();
        let missing = dir.path().join("missing");
        let path = |p: &Path| p.to_string_lossy().into_owned();
        let (values, problems) = collect(&[
            ("dsn".into(), path(&ok)),
            ("big".into(), path(&big)),
            ("gone".into(), path(&missing)),
        ]);
        assert_eq!(values.len(), 1);
        assert_eq!(values[0].value, b"postgres://x");
        assert_eq!(problems.len(), 2);
        assert!(problems[0].contains("larger than"), "{problems:?}");
        assert!(problems[1].contains("gone"), "{problems:?}");
    }

    #[test]
    fn files_are_written_with_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b/input");
        write_file(&p, b"v1", 0o600).unwrap();
        write_file(&p, b"v2", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"v2");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
