//! What the xDS tests share: a test PKI (CA, server and client certificates as files),
//! grpc-go's xDS client driven line by line (tests/go-xds), demo gRPC backends in a test network
//! namespace, and a raw ADS client over mutual TLS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use serde_json::json;
use spur_routeserver::XdsTls;
use spur_serving::ServingTls;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_util::sync::CancellationToken;

use crate::netns::TestNet;

/// A CA, a server certificate for `localhost` and a client certificate, as files.
pub struct Pki {
    dir: tempfile::TempDir,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

#[allow(clippy::new_without_default)] // each one makes a new CA: not a default value
impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "spur test CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        std::fs::write(dir.path().join("ca.crt"), ca_cert.pem()).unwrap();
        let pki = Pki { dir, issuer };
        pki.reissue_server();
        pki.leaf(
            "client",
            "system:spur:xds:test",
            vec![],
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        // The same CA signs workstations' certificates: not an xDS client.
        pki.leaf(
            "workstation",
            "alice",
            vec![],
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        pki
    }

    /// A certificate of this CA as `<name>.crt` and `<name>.key`; returns its DER.
    fn leaf(
        &self,
        name: &str,
        cn: &str,
        sans: Vec<String>,
        usage: rcgen::ExtendedKeyUsagePurpose,
    ) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        // The key first: a reader that sees the new certificate finds its key.
        std::fs::write(self.path(&format!("{name}.key")), key.serialize_pem()).unwrap();
        std::fs::write(self.path(&format!("{name}.crt")), cert.pem()).unwrap();
        cert.der().to_vec()
    }

    /// An xDS client certificate of `namespace` (`system:spur:xds:<namespace>`, as the
    /// operator issues them) as `<stem>.crt` and `<stem>.key`.
    pub fn xds_client(&self, stem: &str, namespace: &str) {
        self.leaf(
            stem,
            &format!("system:spur:xds:{namespace}"),
            vec![],
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
    }

    /// A new server certificate for `localhost` (`server.crt`, `server.key`), as a renewal
    /// writes it; returns its DER.
    pub fn reissue_server(&self) -> Vec<u8> {
        self.leaf(
            "server",
            "server",
            vec!["localhost".into()],
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// The certificate the server at `addr` presents to a new TLS connection now (DER).
    pub async fn presented(&self, addr: SocketAddr) -> Vec<u8> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(self.path("ca.crt")).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let chain = CertificateDer::pem_file_iter(self.path("client.crt"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(self.path("client.key")).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", addr.port()))
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    /// Another CA and a client certificate from it (`ca2.crt`, `client2.crt`, `client2.key`).
    pub fn second_ca(&self) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "spur test CA 2");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        std::fs::write(self.path("ca2.crt"), ca_cert.pem()).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "system:spur:xds:test2");
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(self.path("client2.crt"), cert.pem()).unwrap();
        std::fs::write(self.path("client2.key"), key.serialize_pem()).unwrap();
    }

    pub fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }

    pub fn xds_tls(&self) -> XdsTls {
        XdsTls {
            serving: ServingTls {
                reload_every: Duration::from_millis(100),
                ..ServingTls::new(self.path("server.crt"), self.path("server.key"))
            },
            client_ca: self.path("ca.crt"),
            client_cn_prefix: Some(spur_routeserver::xds::CLIENT_CN_PREFIX.into()),
        }
    }

    /// grpc-go's bootstrap: mutual TLS to the xDS port, as `node_id`.
    pub fn bootstrap(&self, xds: SocketAddr, node_id: &str) -> PathBuf {
        let p = |f: &str| self.path(f).display().to_string();
        let doc = json!({
            "xds_servers": [{
                "server_uri": format!("localhost:{}", xds.port()),
                "channel_creds": [{"type": "tls", "config": {
                    "ca_certificate_file": p("ca.crt"),
                    "certificate_file": p("client.crt"),
                    "private_key_file": p("client.key"),
                    "refresh_interval": "1s",
                }}],
                "server_features": ["xds_v3"],
            }],
            "node": {"id": node_id, "cluster": "spur-tests"},
        });
        let path = self.path(&format!("bootstrap-{node_id}.json"));
        std::fs::write(&path, doc.to_string()).unwrap();
        path
    }
}

/// One grpc-go xDS client process (tests/go-xds): a line per call on stdin, its answer on stdout.
pub struct GoClient {
    _child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl GoClient {
    pub async fn start(target: &str, bootstrap: &Path) -> GoClient {
        let mut child = tokio::process::Command::new(crate::go_bin_dir().join("xds-client"))
            .arg("-target")
            .arg(target)
            .arg("-bootstrap")
            .arg(bootstrap)
            .arg("-timeout")
            .arg("3s")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("xds-client did not start within 30 s")
            .unwrap();
        assert_eq!(first.as_deref(), Some("ready"));
        GoClient {
            _child: child,
            stdin,
            lines,
        }
    }

    /// One unary call with `metadata`: the answering server's name, or the error line.
    pub async fn call(&mut self, metadata: &[(&str, &str)]) -> Result<String, String> {
        let mut line = String::from("call");
        for (k, v) in metadata {
            line.push_str(&format!(" {k}={v}"));
        }
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let out = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .expect("xds-client did not answer a call within 10 s")
            .unwrap()
            .expect("xds-client exited");
        match out.strip_prefix("ok served_by=") {
            Some(rest) => Ok(rest.split(' ').next().unwrap_or_default().to_owned()),
            None => Err(out),
        }
    }

    /// Calls until one is answered by `want`.
    pub async fn eventually_served_by(
        &mut self,
        what: &str,
        metadata: &[(&str, &str)],
        want: &str,
    ) {
        let deadline = tokio::time::Instant::now() + crate::kube::WAIT;
        loop {
            let got = self.call(metadata).await;
            if got.as_deref() == Ok(want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: last answer {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The demo gRPC server `name` (it answers with its name), in the test's network namespace.
pub fn grpc_app(net: &TestNet, name: &str, stop: &CancellationToken) -> SocketAddr {
    let l = tokio::net::TcpListener::from_std(net.listen().unwrap()).unwrap();
    let addr = l.local_addr().unwrap();
    let (name, stop) = (name.to_owned(), stop.clone());
    tokio::spawn(async move {
        if let Err(e) = spur_demo_apps::serve_grpc(l, name, stop).await {
            eprintln!("demo gRPC server failed: {e}");
        }
    });
    addr
}

pub async fn next(responses: &mut tonic::Streaming<DiscoveryResponse>) -> DiscoveryResponse {
    tokio::time::timeout(Duration::from_secs(10), responses.message())
        .await
        .expect("no DiscoveryResponse within 10 s")
        .unwrap()
        .unwrap()
}

/// An ADS client over TLS trusting the test CAs, with client certificate `cert` if any.
pub async fn ads_client(
    addr: SocketAddr,
    pki: &Pki,
    cert: Option<&str>,
) -> Result<AggregatedDiscoveryServiceClient<tonic::transport::Channel>, tonic::transport::Error> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(pki.path("ca.crt")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut config = match cert {
        Some(stem) => {
            let chain = CertificateDer::pem_file_iter(pki.path(&format!("{stem}.crt")))
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_file(pki.path(&format!("{stem}.key"))).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
    let port = addr.port();
    let connector = tower::service_fn(move |_: http::Uri| {
        let tls = tls.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let s = tls.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
        }
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://localhost:{port}"))
        .unwrap()
        .connect_with_connector(connector)
        .await?;
    Ok(AggregatedDiscoveryServiceClient::new(channel))
}
