//! A laptop joins a sandbox, with the shipped binaries: `spur-operator`, `spur-routeserver
//! --kubernetes` and `spur-tunnel-proxy` run in the test's network namespace (the "cluster",
//! with a real kube-apiserver), `spur local connect` runs in a "laptop" network namespace the
//! test creates, joined by a veth pair. A real sidecar routes a keyed request to the laptop.
//!
//! Checked: the laptop reaches a cluster Service by its cluster DNS name (hosts-file mode);
//! a keyed request inside the cluster reaches the laptop's process; the tunnel survives a 5 s
//! cut of the link and both directions work again; an unknown and an expired token are refused
//! and audited. Needs root, `ip` and curl (tests/run.sh installs them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/roles.rs"]
mod roles;
use roles::role_bin;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use spur_api::{Sandbox, names};
use spur_kube_harness::KubeApi;
use tokio::io::AsyncReadExt;

const WAIT: Duration = Duration::from_secs(40);
const ROOT_IP: &str = "10.78.0.1";
const LAPTOP_IP: &str = "10.78.0.2";

use spur_kube_harness::free_port;

fn sh(args: &[&str]) {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e} (needs root and iproute2)"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The laptop namespace, its veth pair to the test's namespace and its hosts file; removed on
/// drop.
struct Laptop {
    ns: String,
    root_dev: String,
}

impl Laptop {
    fn new() -> Laptop {
        let id = std::process::id() % 100_000;
        let l = Laptop {
            ns: format!("spurlap{id}"),
            root_dev: format!("slr{id}"),
        };
        let lap_dev = format!("sll{id}");
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &l.ns])
            .status();
        sh(&["ip", "netns", "add", &l.ns]);
        sh(&[
            "ip",
            "link",
            "add",
            &l.root_dev,
            "type",
            "veth",
            "peer",
            "name",
            &lap_dev,
            "netns",
            &l.ns,
        ]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{ROOT_IP}/30"),
            "dev",
            &l.root_dev,
        ]);
        sh(&["ip", "link", "set", &l.root_dev, "up"]);
        sh(&[
            "ip",
            "-n",
            &l.ns,
            "addr",
            "add",
            &format!("{LAPTOP_IP}/30"),
            "dev",
            &lap_dev,
        ]);
        sh(&["ip", "-n", &l.ns, "link", "set", &lap_dev, "up"]);
        sh(&["ip", "-n", &l.ns, "link", "set", "lo", "up"]);
        // `ip netns exec` bind-mounts this over /etc/hosts: the CLI's hosts-file mode writes here.
        std::fs::create_dir_all(l.etc()).unwrap();
        std::fs::write(l.etc().join("hosts"), "127.0.0.1 localhost\n").unwrap();
        l
    }

    fn etc(&self) -> PathBuf {
        Path::new("/etc/netns").join(&self.ns)
    }

    fn link(&self, up: bool) {
        sh(&[
            "ip",
            "link",
            "set",
            &self.root_dev,
            if up { "up" } else { "down" },
        ]);
    }

    /// A command run inside the laptop namespace.
    fn command(&self, program: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// `spur local connect` to the test's tunnel proxy, inside the laptop namespace, with no
    /// DNS responder or SOCKS proxy and no credentials yet.
    fn connect(&self, state_dir: &Path) -> tokio::process::Command {
        let mut c = self.command(env!("CARGO_BIN_EXE_spur"));
        c.args(["local", "connect", "--server", ROOT_IP])
            .args(["--quic-port", "8443", "--h2-port", "8443"])
            .args([
                "--server-name",
                "tunnel.spur.test",
                "--no-dns",
                "--no-socks",
            ])
            .arg("--state-dir")
            .arg(state_dir)
            .env_remove("SPUR_TUNNEL_TOKEN")
            .stdout(Stdio::null())
            .kill_on_drop(true);
        c
    }

    /// A TCP listener inside the laptop namespace.
    fn listen(&self, port: u16) -> tokio::net::TcpListener {
        let path = format!("/var/run/netns/{}", self.ns);
        let l = std::thread::spawn(move || {
            let f = std::fs::File::open(&path).unwrap();
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            std::net::TcpListener::bind(("127.0.0.1", port)).unwrap()
        })
        .join()
        .unwrap();
        l.set_nonblocking(true).unwrap();
        tokio::net::TcpListener::from_std(l).unwrap()
    }

    async fn curl(&self, url: &str) -> (bool, String) {
        let out = self
            .command("curl")
            .args(["-sS", "--max-time", "10", "-D", "-", url])
            .output()
            .await
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }
}

impl Drop for Laptop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.root_dev])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
        let _ = std::fs::remove_dir_all(self.etc());
    }
}

/// On a failing test (dropped while panicking), prints the roles' logs: a wait that times out
/// on a cold CI machine says why only there.
struct LogsOnFailure(Vec<PathBuf>);

impl Drop for LogsOnFailure {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for log in &self.0 {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(150)..];
            eprintln!("---- {} (last {} lines) ----", log.display(), tail.len());
            for l in tail {
                eprintln!("{l}");
            }
        }
    }
}

async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = tokio::time::Instant::now();
    let deadline = started + WAIT;
    loop {
        if let Some(v) = check().await {
            eprintln!("{what}: after {:?}", started.elapsed());
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn served_by(curl_output: &str) -> Option<String> {
    curl_output
        .lines()
        .find_map(|l| l.strip_prefix("x-served-by: "))
        .map(|s| s.trim().to_string())
}

/// Role binary `bin` (e.g. `spur-operator`) with `args`, logging to `log`.
fn spawn_role(bin: &str, args: &[&str], log: &Path) -> tokio::process::Child {
    let file = std::fs::File::create(log).unwrap();
    tokio::process::Command::new(role_bin(bin))
        .args(args)
        .env("SPUR_LOG", "info")
        .stdout(Stdio::null())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// SIGTERM, then the exit status.
async fn stop(child: &mut tokio::process::Child) -> std::process::ExitStatus {
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap()
}

/// Runs a `spur local connect` that must be refused: it exits, unsuccessfully, with `why` on
/// stderr.
async fn assert_refused(connect: &mut tokio::process::Command, who: &str, why: &str) {
    let out = tokio::time::timeout(WAIT, connect.output())
        .await
        .expect("a refused connect exits")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(why), "{who}: {err}");
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn laptop_in_a_network_namespace_joins_a_sandbox_through_the_tunnel() {
    assert!(
        is_root(),
        "this test builds network namespaces: run it as root"
    );
    let api = KubeApi::start().await.unwrap();
    let crds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/spur/crds");
    for entry in std::fs::read_dir(&crds).unwrap() {
        api.install_crd_file(&entry.unwrap().path()).await.unwrap();
    }
    let dir = api.dir().join("local-test");
    std::fs::create_dir_all(&dir).unwrap();
    let _logs = LogsOnFailure(
        ["operator.log", "routeserver.log", "tunnel-proxy.log"]
            .iter()
            .map(|f| dir.join(f))
            .collect(),
    );
    let kubeconfig = dir.join("kubeconfig.yaml");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let kubeconfig = kubeconfig.to_str().unwrap().to_string();
    let client = api.client();
    for ns in ["shop", "spur-system"] {
        let n: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &n)
            .await
            .unwrap();
    }
    let laptop = Laptop::new();
    let apps = spur_demo_apps::CancellationToken::new();

    // The cluster's baseline app, and the developer's process on the laptop.
    let baseline = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let baseline_addr = baseline.local_addr().unwrap();
    tokio::spawn(spur_demo_apps::serve_http(
        baseline,
        "api-baseline".into(),
        apps.clone(),
    ));
    tokio::spawn(spur_demo_apps::serve_http(
        laptop.listen(3000),
        "laptop-app".into(),
        apps.clone(),
    ));

    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": "shop"},
        "spec": {"selector": {"matchLabels": {"app": "api"}},
                 "template": {"metadata": {"labels": {"app": "api"}},
                              "spec": {"containers": [{"name": "api", "image": "api:1", "ports": [{"name": "http", "containerPort": baseline_addr.port()}]}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "api", "namespace": "shop"},
        "spec": {"selector": {"app": "api"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), "shop")
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();

    // Workstation tokens, made with `spur local token`: alice's, and bob's, which expires a
    // second later.
    let token_for = |who: &'static str, ttl: Option<&'static str>| {
        let kubeconfig = kubeconfig.clone();
        async move {
            let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"));
            c.args([
                "local",
                "token",
                "--workstation",
                who,
                "--owner",
                who,
                "--namespace",
                "spur-system",
            ])
            .args(["--kubeconfig", &kubeconfig]);
            if let Some(t) = ttl {
                c.args(["--ttl", t]);
            }
            let out = c.output().await.unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        }
    };
    let alice = token_for("alice", None).await;
    let bob = token_for("bob", Some("1s")).await;
    assert_eq!((alice.len(), bob.len()), (64, 64));
    let stored = Api::<Secret>::namespaced(client.clone(), "spur-system")
        .get("spur-workstation-alice")
        .await
        .unwrap();
    assert_eq!(stored.data.unwrap()["token"].0, alice.as_bytes());
    let bad = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"))
        .args([
            "local",
            "token",
            "--workstation",
            "Not_A_Label",
            "--owner",
            "alice",
            "--kubeconfig",
            &kubeconfig,
        ])
        .output()
        .await
        .unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("DNS label"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for (name, token) in [
        ("alice", &alice),
        ("bob", &bob),
        ("nobody", &"0".repeat(64)),
    ] {
        std::fs::write(dir.join(format!("{name}.token")), token).unwrap();
    }

    let (grpc, http, op_metrics, tp_metrics) = (free_port(), free_port(), free_port(), free_port());
    let _operator = spawn_role(
        "spur-operator",
        &[
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            "spur-system",
            "--metrics-addr",
            &format!("127.0.0.1:{op_metrics}"),
            "--webhook-addr",
            "127.0.0.1:0",
            "--no-leader-elect",
            // The tunnel proxy's serving certificate, from the operator's CA, for the name
            // the laptop dials.
            "--tunnel-proxy-secret",
            "spur-tunnel-proxy-tls",
            "--tunnel-proxy-cert-name",
            "tunnel.spur.test",
            // And the route server's, for the address the sidecar below dials.
            "--routeserver-secret",
            "spur-routeserver-tls",
            "--routeserver-cert-name",
            "127.0.0.1",
        ],
        &dir.join("operator.log"),
    );
    // The chart mounts that Secret into the tunnel proxy: tls.crt, tls.key, and ca.crt, the
    // CA bundle, which is also the client CA of workstation certificates.
    let tls = eventually(
        "the tunnel proxy's certificate from the operator",
        || async {
            Api::<Secret>::namespaced(client.clone(), "spur-system")
                .get_opt("spur-tunnel-proxy-tls")
                .await
                .ok()??
                .data
        },
    )
    .await;
    for file in ["tls.crt", "tls.key", "ca.crt"] {
        std::fs::write(dir.join(file), &tls[file].0).unwrap();
    }
    let rs_tls = eventually(
        "the route server's certificate from the operator",
        || async {
            Api::<Secret>::namespaced(client.clone(), "spur-system")
                .get_opt("spur-routeserver-tls")
                .await
                .ok()??
                .data
        },
    )
    .await;
    for file in ["tls.crt", "tls.key", "ca.crt"] {
        std::fs::write(dir.join(format!("routeserver-{file}")), &rs_tls[file].0).unwrap();
    }
    let _routeserver = spawn_role(
        "spur-routeserver",
        &[
            "--kubernetes",
            "--kubeconfig",
            &kubeconfig,
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--http-addr",
            &format!("127.0.0.1:{http}"),
            "--tls-cert",
            &dir.join("routeserver-tls.crt").display().to_string(),
            "--tls-key",
            &dir.join("routeserver-tls.key").display().to_string(),
        ],
        &dir.join("routeserver.log"),
    );
    // The sidecar below reads rules as a ServiceAccount allowed to list RoutingConfigs, with a
    // token for the route server's audience (a pod-bound token is the node test's business).
    let reader_role: k8s_openapi::api::rbac::v1::ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "rules-reader"},
        "rules": [{"apiGroups": ["spur.dev"], "resources": ["routingconfigs"], "verbs": ["list"]}]
    }))
    .unwrap();
    let reader_binding: k8s_openapi::api::rbac::v1::ClusterRoleBinding =
        serde_json::from_value(json!({
            "metadata": {"name": "rules-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "rules-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "shop"}]
        }))
        .unwrap();
    Api::all(client.clone())
        .create(&PostParams::default(), &reader_role)
        .await
        .unwrap();
    Api::all(client.clone())
        .create(&PostParams::default(), &reader_binding)
        .await
        .unwrap();
    let reader_token = api
        .token_request(
            "shop",
            "reader",
            k8s_openapi::api::authentication::v1::TokenRequestSpec {
                audiences: vec!["spur-routeserver".into()],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    std::fs::write(dir.join("reader.token"), &reader_token).unwrap();
    let tp_log = dir.join("tunnel-proxy.log");
    let mut tunnel_proxy = spawn_role(
        "spur-tunnel-proxy",
        &[
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            "spur-system",
            "--pod-name",
            "spur-tunnel-proxy-0",
            // EndpointSlices want a routable pod IP; connections to the reverse listeners
            // come from loopback in this test, where kube-proxy would translate.
            "--pod-ip",
            "192.0.2.10",
            "--quic-addr",
            &format!("{ROOT_IP}:8443"),
            "--h2-addr",
            &format!("{ROOT_IP}:8443"),
            "--socks-addr",
            "",
            "--tls-cert",
            dir.join("tls.crt").to_str().unwrap(),
            "--tls-key",
            dir.join("tls.key").to_str().unwrap(),
            "--client-ca",
            dir.join("ca.crt").to_str().unwrap(),
            "--lease-duration",
            "6",
            // Cluster DNS stand-in for the Service the laptop calls.
            "--resolve",
            &format!("api.shop.svc:80={baseline_addr}"),
            // The test's "cluster" is loopback.
            "--allow-loopback-destinations",
            // The sidecar reaches the reverse listener from loopback.
            "--reverse-allow-cidrs",
            "127.0.0.0/8",
            "--metrics-addr",
            &format!("127.0.0.1:{tp_metrics}"),
        ],
        &tp_log,
    );

    // The sandbox: the laptop stands in for shop/api's container port (the baseline app's
    // port here: an explicit-mode sidecar looks rules up by its app's port).
    // Created by alice, who owns the workstation (the operator binds a Sandbox's local workloads
    // only while its creator owns the workstation; the webhook that stamps the creator does not
    // run here).
    let sb: Sandbox = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "dev", "annotations": {"spur.dev/created-by": "alice"}},
        "spec": {"workstation": "alice",
                 "local": [{"name": "api", "from": {"kind": "Deployment", "namespace": "shop", "name": "api"},
                            "mappings": [{"port": baseline_addr.port(), "toLocal": "127.0.0.1:3000"}]}]}
    }))
    .unwrap();
    Api::<Sandbox>::all(client.clone())
        .create(&PostParams::default(), &sb)
        .await
        .unwrap();

    let connect = |token: &str, state: &str| {
        let mut c = laptop.connect(&dir.join(state));
        c.arg("--token-file")
            .arg(dir.join(format!("{token}.token")))
            .arg("--ca-file")
            .arg(dir.join("ca.crt"))
            .args(["--hosts-file", "/etc/hosts", "-n", "shop"])
            .stderr(Stdio::piped());
        c
    };

    // Refused: an unknown and an expired token; both exit with the reason, both are audited.
    for (who, why) in [("nobody", "unknown token"), ("bob", "expired")] {
        assert_refused(&mut connect(who, &format!("state-{who}")), who, why).await;
    }
    let log = std::fs::read_to_string(&tp_log).unwrap();
    let refusals: Vec<&str> = log.lines().filter(|l| l.contains("refused:")).collect();
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("unknown token") && l.contains(LAPTOP_IP)),
        "{log}"
    );
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("expired") && l.contains("bob")),
        "{log}"
    );
    assert!(
        !log.contains(&alice) && !log.contains(&bob),
        "a token was logged"
    );

    // Carol has no token: `spur local cert` files a CertificateSigningRequest, an
    // administrator approves it, the operator signs it, and the laptop connects with the
    // certificate and the CA bundle the command wrote.
    let carol_state = dir.join("state-carol");
    let cert_cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"))
        .args([
            "local",
            "cert",
            "--workstation",
            "carol",
            "--lifetime",
            "1h",
        ])
        .args([
            "--namespace",
            "spur-system",
            "--wait",
            "60s",
            "--kubeconfig",
            &kubeconfig,
        ])
        .arg("--state-dir")
        .arg(&carol_state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let csr_name = eventually("carol's certificate request", || async {
        let list = csrs
            .list(&kube::api::ListParams::default().labels("spur.dev/workstation=carol"))
            .await
            .ok()?;
        list.items.first()?.metadata.name.clone()
    })
    .await;
    let csr = csrs.get(&csr_name).await.unwrap();
    assert_eq!(csr.spec.signer_name, "spur.dev/workstation");
    assert_eq!(csr.spec.expiration_seconds, Some(3600));
    // What `kubectl certificate approve` does.
    csrs.patch_approval(
        &csr_name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"conditions": [{
            "type": "Approved", "status": "True", "reason": "Test", "message": "carol's laptop"
        }]}})),
    )
    .await
    .unwrap();
    let out = tokio::time::timeout(WAIT, cert_cmd.wait_with_output())
        .await
        .expect("spur local cert finishes once the request is signed")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("kubectl certificate approve"), "{err}");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(carol_state.join("client.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert_eq!(
        std::fs::read(carol_state.join("ca.crt")).unwrap(),
        tls["ca.crt"].0,
        "the published CA bundle"
    );
    let mut carol_cli = laptop.connect(&carol_state);
    carol_cli.stderr(Stdio::null());
    let mut carol_cli = carol_cli.spawn().unwrap();
    eventually("carol connected with her certificate", || async {
        let log = std::fs::read_to_string(&tp_log).unwrap();
        log.lines()
            .any(|l| l.contains("workstation connected") && l.contains("workstation=carol"))
            .then_some(())
    })
    .await;
    let status = stop(&mut carol_cli).await;
    assert!(status.success(), "{status}");

    // A certificate from another CA fails the TLS handshake: refused and audited. An expired
    // one is refused by the CLI before it dials.
    let mut foreign_ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    foreign_ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let issuer = rcgen::Issuer::new(foreign_ca, rcgen::KeyPair::generate().unwrap());
    for (who, lifetime, why) in [("mallory", 3600i64, "refused"), ("old", -60, "expired")] {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, who);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let t = std::time::SystemTime::now();
        p.not_before = (t - Duration::from_secs(7200)).into();
        p.not_after = if lifetime > 0 {
            (t + Duration::from_secs(lifetime.unsigned_abs())).into()
        } else {
            (t - Duration::from_secs(lifetime.unsigned_abs())).into()
        };
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{who}.crt")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{who}.key")), key.serialize_pem()).unwrap();
        let mut c = laptop.connect(&dir.join(format!("state-{who}")));
        c.args(["--transport", "h2", "--ca-file"])
            .arg(dir.join("ca.crt"))
            .arg("--cert-file")
            .arg(dir.join(format!("{who}.crt")))
            .arg("--key-file")
            .arg(dir.join(format!("{who}.key")))
            .stderr(Stdio::piped());
        assert_refused(&mut c, who, why).await;
    }
    let log = std::fs::read_to_string(&tp_log).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains("refused: h2: TLS handshake failed") && l.contains(LAPTOP_IP)),
        "{log}"
    );

    // Alice connects.
    let mut alice_cli = connect("alice", "state-alice").spawn().unwrap();
    let mut cli_err = alice_cli.stderr.take().unwrap();

    // Laptop → cluster by the cluster DNS name (hosts-file mode, through the tunnel).
    let (ok, out) = eventually("api.shop.svc from the laptop", || async {
        let (ok, out) = laptop.curl("http://api.shop.svc/").await;
        ok.then_some((ok, out))
    })
    .await;
    assert!(ok);
    assert_eq!(served_by(&out).as_deref(), Some("api-baseline"), "{out}");

    // Cluster → laptop: the ExternalWorkload gets an endpoint at the tunnel proxy; a sidecar
    // in front of the baseline routes the sandbox's key there.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
    let svc_name = names::sandbox_service_name("dev", "api");
    let reverse_port = |slices: Api<EndpointSlice>, svc_name: String| async move {
        let s = slices.get_opt(&svc_name).await.ok()??;
        s.endpoints.first()?;
        s.ports?.first()?.port
    };
    let port = eventually("an endpoint at the tunnel proxy", || {
        reverse_port(slices.clone(), svc_name.clone())
    })
    .await;
    let key = eventually("the routing key", || async {
        Api::<Sandbox>::all(client.clone())
            .get("dev")
            .await
            .ok()?
            .status?
            .routing_key
    })
    .await;
    let sidecar = spur_sidecar::Sidecar::start(spur_sidecar::SidecarConfig {
        inject_key_file: None,
        kafka: None,
        capture: None,
        inbound_addr: "127.0.0.1:0".parse().unwrap(),
        inbound: spur_proxy::Inbound::Explicit { app: baseline_addr },
        baseline: spur_routing::BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: "api".into(),
        },
        rules: None,
        rules_poll: Duration::from_millis(100),
        routeserver: Some(spur_sidecar::RouteServerConn {
            addr: format!("127.0.0.1:{grpc}"),
            ca: Some(dir.join("routeserver-ca.crt")),
            token: Some(dir.join("reader.token")),
        }),
        admin_addr: None,
        extract: spur_routing::ExtractConfig::default(),
        proxy: spur_proxy::ProxyConfig {
            resolve: [(
                format!("{svc_name}.shop.svc:80"),
                SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap())),
            )]
            .into_iter()
            .collect(),
            ..spur_proxy::ProxyConfig::default()
        },
    })
    .await
    .unwrap();
    let keyed = |sidecar: SocketAddr, key: String| async move {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", "-D", "-", "-H"])
            .arg(format!("baggage: sd-routing-key={key}"))
            .arg(format!("http://{sidecar}/"))
            .output()
            .await
            .ok()?;
        served_by(&String::from_utf8_lossy(&out.stdout))
    };
    let at = sidecar.inbound_addr;

    eventually("a keyed request reaching the laptop", || {
        let k = key.clone();
        async move { (keyed(at, k).await.as_deref() == Some("laptop-app")).then_some(()) }
    })
    .await;
    // Unkeyed traffic stays with the baseline.
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "-D", "-"])
        .arg(format!("http://{at}/"))
        .output()
        .await
        .unwrap();
    assert_eq!(
        served_by(&String::from_utf8_lossy(&out.stdout)).as_deref(),
        Some("api-baseline")
    );

    // Cut the link for 5 s: the session survives (keepalive timeout 20 s) or reconnects, and
    // both directions work again.
    laptop.link(false);
    tokio::time::sleep(Duration::from_secs(5)).await;
    laptop.link(true);
    let (ok, out) = eventually("api.shop.svc again after the cut", || async {
        let (ok, out) = laptop.curl("http://api.shop.svc/").await;
        ok.then_some((ok, out))
    })
    .await;
    assert!(
        ok && served_by(&out).as_deref() == Some("api-baseline"),
        "{out}"
    );
    let port_after = eventually("the endpoint after the cut", || {
        reverse_port(slices.clone(), svc_name.clone())
    })
    .await;
    let got = if port_after == port {
        eventually("a keyed request after the cut", || {
            let k = key.clone();
            async move { (keyed(at, k).await.as_deref() == Some("laptop-app")).then_some(()) }
        })
        .await;
        "laptop-app".to_string()
    } else {
        // The session was re-established with a new listener: reach it the way kube-proxy
        // would, through the EndpointSlice's current port.
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", "-D", "-"])
            .arg(format!("http://127.0.0.1:{port_after}/"))
            .output()
            .await
            .unwrap();
        served_by(&String::from_utf8_lossy(&out.stdout)).unwrap_or_default()
    };
    assert_eq!(got, "laptop-app");

    // A clean disconnect: SIGTERM, the hosts block goes, the endpoint is withdrawn.
    let status = stop(&mut alice_cli).await;
    let mut progress = String::new();
    let _ = cli_err.read_to_string(&mut progress).await;
    assert!(status.success(), "{status}: {progress}");
    assert!(progress.contains("connected"), "{progress}");
    let hosts = std::fs::read_to_string(laptop.etc().join("hosts")).unwrap();
    assert_eq!(hosts, "127.0.0.1 localhost\n");
    eventually("the endpoint withdrawn", || {
        let slices = slices.clone();
        let svc_name = svc_name.clone();
        async move {
            let s = slices.get_opt(&svc_name).await.ok()??;
            s.endpoints.is_empty().then_some(())
        }
    })
    .await;

    sidecar.shutdown().await;
    // Every forwarded and reverse connection has an audit line with who, from, to and bytes,
    // written when it closes (the sidecar's pooled connections close with it).
    let lines = eventually("audit lines for both directions", || async {
        let log = std::fs::read_to_string(&tp_log).unwrap();
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains(" connection ") && l.contains("who=\"alice\""))
            .map(String::from)
            .collect();
        let forward = lines
            .iter()
            .any(|l| l.contains("kind=\"forward\"") && l.contains("to=\"api.shop.svc:80\""));
        let reverse = lines
            .iter()
            .any(|l| l.contains("kind=\"reverse\"") && l.contains("outcome=\"ok\""));
        (forward && reverse).then_some(lines)
    })
    .await;
    assert!(
        lines.iter().all(|l| l.contains("bytes_to_cluster=")
            && l.contains("duration_ms=")
            && l.contains("from=")),
        "{lines:?}"
    );
    let status = stop(&mut tunnel_proxy).await;
    assert!(status.success(), "tunnel proxy exit {status}");
    apps.cancel();
}
