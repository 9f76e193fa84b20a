//! `spur local cert`: a workstation's client certificate from the operator's CA. The key is
//! made here and never leaves this machine; the cluster signs a CertificateSigningRequest an
//! administrator approves. Also used by `spur sandbox apply --local` when the workstation has
//! no credential yet.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use clap::Args;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use super::{StateDir, check_workstation, say};

/// Files `spur local cert` writes into the state directory.
pub(crate) const CLIENT_CERT: &str = "client.crt";
pub(crate) const CLIENT_KEY: &str = "client.key";
pub(crate) const CLIENT_CA: &str = "ca.crt";

/// The ConfigMap of the operator's CA bundle, readable by every authenticated user.
const CA_BUNDLE: &str = "spur-ca-bundle";

#[derive(Args)]
pub(crate) struct CertArgs {
    /// The workstation the certificate names (a DNS label: Sandboxes name it in
    /// `spec.workstation`).
    #[arg(long)]
    workstation: String,
    /// How long the certificate is valid (the operator caps it, 7 days by default).
    #[arg(long, default_value = "24h", value_parser = spur_runtime::parse_duration)]
    lifetime: Duration,
    /// How long to wait for the request to be approved and signed.
    #[arg(long, default_value = "15m", value_parser = crate::sandbox::parse_wait)]
    wait: Duration,
    /// The operator's namespace (where the CA bundle ConfigMap `spur-ca-bundle` is).
    #[arg(long, default_value = "spur-system")]
    namespace: String,
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the in-cluster config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    state: StateDir,
}

/// What to ask for.
pub(crate) struct Request<'a> {
    pub workstation: &'a str,
    pub lifetime: Duration,
    pub wait: Duration,
    /// The operator's namespace (the CA bundle's).
    pub namespace: &'a str,
}

/// A certificate in the state directory: whom it names and until when.
pub(crate) struct Held {
    pub workstation: String,
    pub expires_at: Option<SystemTime>,
}

/// Whom the certificate in `file` names and until when.
pub(crate) fn identity(file: &Path) -> Result<Held> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::from_pem_file(file)
        .map_err(anyhow::Error::from)
        .and_then(|der| Ok(spur_tunnel::identity_from_cert(&der)?))
        .map(|id| Held {
            workstation: id.name,
            expires_at: id.expires_at,
        })
        .with_context(|| format!("cannot read the client certificate {}", file.display()))
}

/// The state directory's certificate, if there is one (`Err`: one that cannot be read or has
/// no key beside it).
pub(crate) fn held(dir: &Path) -> Option<Result<Held>> {
    let (cert, key) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
    match (cert.exists(), key.exists()) {
        (false, false) => None,
        (true, true) => Some(identity(&cert)),
        (true, false) => Some(Err(anyhow::anyhow!(
            "{} has no key {} beside it",
            cert.display(),
            key.display()
        ))),
        (false, true) => Some(Err(anyhow::anyhow!(
            "{} has no certificate {} beside it",
            key.display(),
            cert.display()
        ))),
    }
}

pub(crate) async fn cert_cmd(a: CertArgs) -> Result<ExitCode> {
    check_workstation(&a.workstation)?;
    if !(600..=i32::MAX as u64).contains(&a.lifetime.as_secs()) {
        bail!("--lifetime must be between 10m and about 68 years");
    }
    let dir = a.state.resolve()?;
    let client = crate::kube_client(a.kubeconfig.as_deref()).await?;
    let req = Request {
        workstation: &a.workstation,
        lifetime: a.lifetime,
        wait: a.wait,
        namespace: &a.namespace,
    };
    let held = obtain(&client, &req, &dir, |name| {
        say(format_args!(
            "certificate request {name} for workstation {} filed; waiting for approval (an administrator runs: kubectl certificate approve {name})",
            a.workstation
        ));
    })
    .await?;
    let until = held
        .expires_at
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or_else(|| "-".into(), |d| d.as_secs().to_string());
    say(format_args!(
        "certificate for workstation {} (valid until Unix time {until}) written to {}; spur local connect uses it",
        held.workstation,
        dir.display()
    ));
    Ok(ExitCode::SUCCESS)
}

/// Makes a key, files a CertificateSigningRequest for it (`filed` gets its name), waits for the
/// signed certificate and writes it with the key and the CA bundle into `dir`.
pub(crate) async fn obtain(
    client: &Client,
    req: &Request<'_>,
    dir: &Path,
    filed: impl FnOnce(&str),
) -> Result<Held> {
    let expiration = i32::try_from(req.lifetime.as_secs())
        .ok()
        .filter(|s| *s >= 600)
        .context("the certificate's lifetime must be between 10m and about 68 years")?;
    let key = rcgen::KeyPair::generate().context("cannot make a key")?;
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, req.workstation);
    let request = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .context("cannot make the certificate signing request")?;

    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let csr: CertificateSigningRequest = serde_json::from_value(serde_json::json!({
        "metadata": {
            "generateName": format!("spur-workstation-{}-", req.workstation),
            "labels": {(spur_api::tunnel::WORKSTATION_LABEL): req.workstation},
        },
        "spec": {
            "request": k8s_openapi::ByteString(request.into_bytes()),
            "signerName": spur_api::workstation::WORKSTATION_SIGNER,
            "usages": ["client auth", "digital signature"],
            "expirationSeconds": expiration,
        },
    }))?;
    let created = csrs
        .create(&kube::api::PostParams::default(), &csr)
        .await
        .context("cannot create the CertificateSigningRequest")?;
    let name = created.metadata.name.clone().unwrap_or_default();
    filed(&name);
    let deadline = tokio::time::Instant::now() + req.wait;
    let cert = loop {
        let csr = csrs
            .get(&name)
            .await
            .with_context(|| format!("cannot read CertificateSigningRequest {name}"))?;
        let status = csr.status.unwrap_or_default();
        if let Some(c) = status.certificate.filter(|c| !c.0.is_empty()) {
            break String::from_utf8(c.0).context("the issued certificate is not PEM text")?;
        }
        if let Some(c) = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True")
        {
            bail!(
                "certificate request {name} {}: {}",
                c.type_.to_lowercase(),
                c.message.or(c.reason).unwrap_or_default()
            );
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "certificate request {name} was not signed within {}s; it stays pending (delete it with kubectl delete csr {name}) and its key is gone: ask again",
                req.wait.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    use rustls::pki_types::pem::PemObject as _;
    let identity = rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes())
        .map_err(anyhow::Error::from)
        .and_then(|der| Ok(spur_tunnel::identity_from_cert(&der)?))
        .context("the issued certificate cannot be read")?;

    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_private(&dir.join(CLIENT_KEY), key.serialize_pem().as_bytes())?;
    std::fs::write(dir.join(CLIENT_CERT), &cert)
        .with_context(|| format!("cannot write {}", dir.join(CLIENT_CERT).display()))?;
    if let Err(why) = save_ca_bundle(client, req.namespace, dir).await {
        say(format_args!(
            "{why}: pass the tunnel proxy's CA to spur local connect with --ca-file"
        ));
    }
    Ok(Held {
        workstation: identity.name,
        expires_at: identity.expires_at,
    })
}

/// Writes the operator's CA bundle (ConfigMap `spur-ca-bundle` of `namespace`) to `dir`'s
/// ca.crt; `Err` says why it could not.
pub(crate) async fn save_ca_bundle(
    client: &Client,
    namespace: &str,
    dir: &Path,
) -> Result<PathBuf, String> {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get_opt(CA_BUNDLE)
        .await
        .map_err(|e| format!("cannot read ConfigMap {namespace}/{CA_BUNDLE} ({e})"))?
        .ok_or_else(|| format!("no ConfigMap {namespace}/{CA_BUNDLE}"))?;
    let pem = cm
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .ok_or_else(|| format!("ConfigMap {namespace}/{CA_BUNDLE} has no ca.crt"))?;
    let path = dir.join(CLIENT_CA);
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&path, pem))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// Writes a file only its owner can read (a private key).
fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}
