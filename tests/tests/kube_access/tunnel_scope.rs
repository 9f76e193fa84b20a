//! A tunnel grant reaches only its namespace (issue 42, point 7): a TunnelAccessTemplate is a
//! namespace admin's, so the sessions of a grant it makes dial only that namespace's Services
//! and pods, through forward streams and SOCKS5 alike. A real tunnel proxy under the chart's
//! RBAC, the operator's real grant, a real tunnel client; the "pods" are listeners on loopback
//! addresses written into the pods' status.

use super::*;
use k8s_openapi::api::core::v1::{Secret, Service};
use spur_tunnel::{ClientConfig, ClientTls, SessionState, Token, TransportPolicy, TunnelClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const OTHERS: &str = "others";
/// What a refusal by the narrowing says (and what a failed connect never says).
const NARROWED: &str = "not a Service or pod address of namespace shop";

/// A Service `name` of `namespace`; returns its cluster IP.
async fn service(admin: &Client, namespace: &str, name: &str) -> String {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"ports": [{"port": 80}]}
    }))
    .unwrap();
    let svc = Api::<Service>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    svc.spec.unwrap().cluster_ip.unwrap()
}

/// A running pod `name` of `namespace` at `ip`, and a listener there that says `name`.
async fn pod_at(admin: &Client, namespace: &str, name: &str, ip: &str) -> u16 {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "app", "image": "spur:test"}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let said = name.to_string();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let _ = tcp.write_all(said.as_bytes()).await;
        }
    });
    port
}

/// What a stream to `host:port` reads, or why it was not opened.
async fn read_through(c: &TunnelClient, host: &str, port: u16) -> Result<String, String> {
    let mut s = c.open(host, port).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut out)).await;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// curl through the proxy's SOCKS5 listener as `user`; its stdout, or its stderr.
async fn curl_socks(socks: std::net::SocketAddr, user: &str, to: &str) -> Result<String, String> {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--socks5-hostname"])
        .arg(socks.to_string())
        .arg("--proxy-user")
        .arg(user)
        .arg(format!("telnet://{to}"))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if stdout.is_empty() {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    } else {
        Ok(stdout)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_grant_reaches_only_its_namespace() {
    let setup = Setup::start().await;
    let admin = setup.api.client();
    ensure_namespace(&admin, OTHERS).await.unwrap();

    // Alice's grant of namespace shop, for workstation alice-laptop.
    let template: TunnelAccessTemplate = serde_json::from_value(json!({
        "apiVersion": "spur.dev/v1alpha1", "kind": "TunnelAccessTemplate",
        "metadata": {"name": "laptops", "namespace": NS},
        "spec": {"accessConfig": {"allowedGroups": [DEVS_GROUP], "defaultDuration": "1h", "maxDuration": "1h"}}
    }))
    .unwrap();
    Api::<TunnelAccessTemplate>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &template)
        .await
        .unwrap();
    let alice = setup.user(DEVS, "alice").await;
    let grant = spur_tunnelproxy::tokens::generate_token().unwrap();
    Api::<TunnelAccessRequest>::namespaced(alice, NS)
        .create(
            &PostParams::default(),
            &tunnel_request("alice-tunnel", "laptops", "alice-laptop", &grant),
        )
        .await
        .unwrap();
    let requests: Api<TunnelAccessRequest> = Api::namespaced(admin.clone(), NS);
    eventually("alice's tunnel grant is ready", || {
        let requests = requests.clone();
        async move {
            let r = requests.get("alice-tunnel").await.ok()?;
            r.status.as_ref()?.ready.then_some(())
        }
    })
    .await;
    // A workstation token (not a grant), which keeps the proxy's rules alone.
    let plain = spur_tunnelproxy::tokens::generate_token().unwrap();
    Api::<Secret>::namespaced(admin.clone(), TOKEN_NS)
        .create(
            &PostParams::default(),
            &spur_tunnelproxy::tokens::token_secret(TOKEN_NS, "ops-box", &plain, None).unwrap(),
        )
        .await
        .unwrap();

    // Services and pods of shop and of others.
    let shop_svc = service(&admin, NS, "api").await;
    let others_svc = service(&admin, OTHERS, "api").await;
    let shop_port = pod_at(&admin, NS, "web", "127.0.0.2").await;
    let others_port = pod_at(&admin, OTHERS, "db", "127.0.0.3").await;

    // The tunnel proxy, under the chart's RBAC; its test "cluster" is loopback.
    let tp = spur_e2e::kube::chart_client(
        &setup.api,
        "spur-tunnel-proxy",
        "tunnelproxy-rules.yaml",
        Some("tunnelproxy-namespace-rules.yaml"),
    )
    .await
    .unwrap();
    spur_e2e::kube::grant_in_namespace(
        &setup.api,
        "spur-tunnel-proxy",
        TOKEN_NS,
        "tunnelproxy-token-rules.yaml",
    )
    .await
    .unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["tunnel.spur.test".into()]).unwrap();
    let cert_der = cert.cert.der().clone();
    let key_der =
        rustls::pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
    let stop = setup.stop.child_token();
    let proxy = spur_tunnelproxy::run(
        tp,
        spur_tunnelproxy::TunnelProxyConfig {
            namespace: SYSTEM_NAMESPACE.into(),
            token_namespace: TOKEN_NS.into(),
            pod_name: "spur-tunnel-proxy-0".into(),
            pod_ip: "192.0.2.10".parse().unwrap(),
            pod_uid: None,
            quic_addr: None,
            h2_addr: Some("127.0.0.1:0".parse().unwrap()),
            socks_addr: Some("127.0.0.1:0".parse().unwrap()),
            reverse_bind: "127.0.0.1".parse().unwrap(),
            reverse_ports: None,
            reverse_sources: Default::default(),
            tls: spur_tunnel::ServerTls {
                cert: spur_tunnel::ServerCert::Static {
                    chain: vec![cert_der.clone()],
                    key: key_der,
                },
                client_ca: Vec::new(),
                require_client_cert: false,
            },
            lease_duration: Duration::from_secs(6),
            cluster_domain: "cluster.local".into(),
            // Cluster IPs route nowhere here: a dial that passes the check fails soon.
            dial_timeout: Duration::from_secs(2),
            resolve: Default::default(),
            destinations: spur_tunnelproxy::Destinations::default().allowing_loopback(),
        },
        tokio::runtime::Handle::current(),
        &mut Registry::default(),
        stop.clone(),
    )
    .await
    .unwrap();
    let (h2, socks) = (proxy.h2_addr.unwrap(), proxy.socks_addr.unwrap());
    let connect = |token: &str| {
        let mut cfg = ClientConfig::new(
            "tunnel.spur.test",
            ClientTls {
                roots: vec![cert_der.clone()],
                client_cert: None,
            },
        );
        cfg.h2_addr = Some(h2.to_string());
        cfg.transports = TransportPolicy::H2Only;
        cfg.token = Some(Token::new(token));
        cfg.client_name = "laptop".into();
        let c = TunnelClient::start(cfg, &mut Registry::default()).unwrap();
        async move {
            let mut st = c.state();
            tokio::time::timeout(WAIT, async {
                loop {
                    match st.borrow_and_update().clone() {
                        SessionState::Connected { .. } => return,
                        SessionState::Closed { reason } => panic!("refused: {reason}"),
                        _ => {}
                    }
                    st.changed().await.unwrap();
                }
            })
            .await
            .unwrap();
            c
        }
    };

    // The grant's session: shop's pod answers; others' pod and Service are refused with the
    // narrowing's reason, in every form of their address, naming only the grant's namespace.
    let granted = connect(&grant).await;
    assert_eq!(
        read_through(&granted, "127.0.0.2", shop_port).await,
        Ok("web".into())
    );
    for (host, port) in [
        ("127.0.0.3", others_port),
        ("::ffff:127.0.0.3", others_port),
        (others_svc.as_str(), 80),
    ] {
        let why = read_through(&granted, host, port).await.unwrap_err();
        assert!(why.contains(NARROWED), "{host}: {why}");
        assert!(
            !why.contains(OTHERS),
            "{host}: {why} names the other namespace"
        );
    }
    // Shop's Service passes the check: the dial itself fails (cluster IPs route nowhere in
    // this tier), and says so rather than the narrowing's refusal.
    match read_through(&granted, &shop_svc, 80).await {
        Ok(_) => {}
        Err(why) => assert!(
            !why.contains(NARROWED) && !why.contains("not allowed"),
            "shop's Service {shop_svc} was refused by policy: {why}"
        ),
    }

    // The tunnel API lists the grant's session only its namespace's Services: the names of
    // the others are not its business either.
    let granted = std::sync::Arc::new(granted);
    let listed = |c: std::sync::Arc<TunnelClient>| async move {
        let mut api = spur_workstation::connect_api(c, WAIT).await.unwrap();
        let mut names: Vec<String> = api
            .list_services(spur_proto::tunnel::ListServicesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .services
            .into_iter()
            .map(|s| format!("{}/{}", s.namespace, s.name))
            .collect();
        names.sort();
        names
    };
    let seen = listed(granted.clone()).await;
    assert!(
        !seen.is_empty() && seen.iter().all(|n| n.starts_with(&format!("{NS}/"))),
        "the grant's session lists {seen:?}"
    );

    // A workstation token's session keeps the proxy's rules alone (and lists every Service).
    let workstation = std::sync::Arc::new(connect(&plain).await);
    let all = listed(workstation.clone()).await;
    assert!(
        all.iter().any(|n| n.starts_with(&format!("{OTHERS}/"))),
        "a workstation token's session lists {all:?}"
    );
    assert_eq!(
        read_through(&workstation, "127.0.0.3", others_port).await,
        Ok("db".into())
    );

    // SOCKS5: the grant's token counts only as alice-laptop@shop, and is narrowed the same.
    let as_grant = format!("alice-laptop@{NS}:{grant}");
    assert_eq!(
        curl_socks(socks, &as_grant, &format!("127.0.0.2:{shop_port}")).await,
        Ok("web".into())
    );
    assert!(
        curl_socks(socks, &as_grant, &format!("127.0.0.3:{others_port}"))
            .await
            .is_err()
    );
    let unnarrowed = format!("alice-laptop:{grant}");
    let why = curl_socks(socks, &unnarrowed, &format!("127.0.0.3:{others_port}"))
        .await
        .unwrap_err();
    assert!(why.contains("rejected"), "{why}");
    assert_eq!(
        curl_socks(
            socks,
            &format!("ops-box:{plain}"),
            &format!("127.0.0.3:{others_port}")
        )
        .await,
        Ok("db".into())
    );
    // HTTP CONNECT carries no credentials: refused, for everyone.
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "-p", "-x"])
        .arg(format!("http://{socks}"))
        .arg(format!("telnet://127.0.0.3:{others_port}"))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(
        out.stdout.is_empty(),
        "CONNECT went through without credentials"
    );

    stop.cancel();
    spur_e2e::kube::assert_no_secret_logged(&[&grant, &plain]);
}
