//! The sidecar's Kafka relay as a pod runs it: two network namespaces stand in for a baseline
//! pod and a fork pod of the consumer `shop/orders`, each with `spur-sidecar --intercept`
//! (spur-init's rules programmed by the binary as root, then no privileges) and
//! `SPUR_KAFKA_PORTS` set to the broker's port; the fork's with `SPUR_FORK_OF_SANDBOX`. The
//! clients (the Java client, kcat, franz-go) run unchanged inside the namespaces and connect to
//! the broker's own address; the rules redirect them to the relay, which connects on to the
//! broker as the proxy uid.
//!
//! Proven by which consumer printed which record: the baseline's consumer and the fork's, in the
//! same `group.id` at the same time, each receive exactly their records by routing key (the
//! route table is the sidecars' rules file), none twice; another sandbox's key, which routes
//! another service, stays with the baseline. And who may use the relay: nothing outside the pod
//! reaches it, and a connection made to it directly, not redirected, is closed.
//!
//! Needs root, `ip`, `nft`, java, kcat and franz-go's harness; the sidecar binary from
//! `SPUR_IMAGE_BINDIR` (tests/run.sh builds it) or next to this test's own target directory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use spur_e2e::kafka::Broker;
use spur_e2e::netns::TestNet;
use spur_kube_harness::process::{Process, Watchdog};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ADMIN_PORT: u16 = 15020;
const RELAY_PORT: u16 = 15007;

fn sidecar_bin() -> PathBuf {
    let bin = match std::env::var_os("SPUR_IMAGE_BINDIR") {
        Some(dir) => PathBuf::from(dir).join("spur-sidecar"),
        // target/debug/deps/<this test> → target/debug/spur-sidecar
        None => std::env::current_exe()
            .unwrap()
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .join("spur-sidecar"),
    };
    assert!(
        bin.exists(),
        "{} is missing: `cargo build --all-features --bin spur-sidecar` (tests/run.sh does, and sets SPUR_IMAGE_BINDIR)",
        bin.display()
    );
    bin
}

/// Rules of the Routes API shape: `sbx1` routes `shop/orders` to sandbox `sbx1`; `sbx2` routes
/// another service (`shop/payments`) to sandbox `sbx2`, so records keyed `sbx2` stay the orders
/// baseline's.
const RULES: &str = "\
- routingKey: sbx1
  baseline: {kind: Deployment, namespace: shop, name: orders}
  destinationSandbox: {name: sbx1}
  mappings:
    - workloadPort: 8080
      destinations: [{host: orders-sbx1.shop.svc, port: 8080}]
- routingKey: sbx2
  baseline: {kind: Deployment, namespace: shop, name: payments}
  destinationSandbox: {name: sbx2}
  mappings:
    - workloadPort: 8080
      destinations: [{host: payments-sbx2.shop.svc, port: 8080}]
";

/// `spur-sidecar --intercept` in `net`, relaying connections to `broker_port`, with the rules
/// of `dir/rules.yaml`.
fn sidecar(net: &TestNet, dir: &Path, fork: Option<&str>, broker_port: u16, log: &str) -> Process {
    let mut cmd = net.command(sidecar_bin());
    cmd.arg("--rules").arg(dir.join("rules.yaml"));
    sidecar_with(cmd, dir, fork, broker_port, log)
}

/// [`sidecar`] with `cmd` naming the rule source.
fn sidecar_with(
    mut cmd: std::process::Command,
    dir: &Path,
    fork: Option<&str>,
    broker_port: u16,
    log: &str,
) -> Process {
    cmd.args(["--transparent", "--baseline-namespace", "shop"])
        .args(["--baseline-name", "orders", "--rules-poll", "100ms"])
        .args(["--admin-addr", &format!("0.0.0.0:{ADMIN_PORT}")])
        .env("RUST_LOG", "info,spur_proxy=debug")
        .env("SPUR_INTERCEPT", "true")
        .env("SPUR_INIT_MODE", "nft")
        .env("SPUR_INIT_IPV6", "false")
        .env("SPUR_PROXY_UID", "15337")
        .env("SPUR_INBOUND_PORTS", "none")
        .env("SPUR_KAFKA_PORTS", broker_port.to_string());
    if let Some(sandbox) = fork {
        cmd.env("SPUR_FORK_OF_SANDBOX", sandbox);
    }
    Process::spawn("spur-sidecar", cmd, &dir.join(format!("{log}.log"))).unwrap()
}

/// GET `path` from the admin server of the sidecar in `net`: (status, body).
async fn admin_get(net: &TestNet, path: &str) -> anyhow::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect((net.ip, ADMIN_PORT)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: admin\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

async fn wait_ready(net: &TestNet, process: &mut Process) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = process.exited().unwrap() {
            panic!("the sidecar exited ({status}):\n{}", process.log_tail());
        }
        if matches!(admin_get(net, "/ready").await, Ok((200, _))) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sidecar was not ready in 20 s:\n{}",
            process.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A counter's value from Prometheus text (0 when absent).
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// The values a Java or franz-go consumer printed.
fn printed(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.strip_prefix("record "))
        .map(|l| l.splitn(3, ' ').nth(2).unwrap().to_string())
        .collect()
}

fn assert_share(got: &[String], want: &BTreeSet<String>, what: &str) {
    let set: BTreeSet<String> = got.iter().cloned().collect();
    let missing: Vec<_> = want.difference(&set).collect();
    let extra: Vec<_> = set.difference(want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: missing {missing:?}, not its own {extra:?}"
    );
    assert_eq!(got.len(), want.len(), "{what}: a record twice");
}

/// ApiVersions v0, correlation id 1, client id "x", framed.
const API_VERSIONS: &[u8] = &[0, 0, 0, 11, 0, 18, 0, 0, 0, 0, 0, 1, 0, 1, b'x'];

/// Connects from inside `net` (a thread joined to it) to the relay's port on loopback directly,
/// sends an ApiVersions request and returns what came back before the connection ended.
fn direct_to_relay(net: &TestNet) -> std::io::Result<Vec<u8>> {
    send_from(
        net,
        SocketAddr::from((Ipv4Addr::LOCALHOST, RELAY_PORT)),
        API_VERSIONS,
    )
}

/// Connects from inside `net` to `to`, sends `bytes` and returns what came back before the
/// connection ended (at most 5 s).
fn send_from(net: &TestNet, to: SocketAddr, bytes: &'static [u8]) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Write};
    let path = format!("/var/run/netns/{}", net.name());
    std::thread::spawn(move || {
        let f = std::fs::File::open(&path)?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        let mut s = std::net::TcpStream::connect(to)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(bytes)?;
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => Ok(got),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(got),
            Err(e) => Err(e),
        }
    })
    .join()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_behind_sidecars_receive_their_records_by_key() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "needs root (tests/run.sh runs as root)"
    );
    let (base_net, fork_net) = (TestNet::new().unwrap(), TestNet::new().unwrap());
    base_net.route_via_host().unwrap();
    fork_net.route_via_host().unwrap();
    // The broker on the baseline namespace's host end: both namespaces reach it through their
    // default route, as pods reach a broker on another node.
    let broker = Broker::start_on(base_net.host_ip).await.unwrap();
    let bs = broker.bootstrap();
    let port = broker.addr.port();

    let dir = tempfile::tempdir().unwrap();
    // The sidecars read the rules as the proxy uid, after dropping root.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("rules.yaml"), RULES).unwrap();
    let mut watchdog = Watchdog::spawn(dir.path()).unwrap();
    let mut base = sidecar(&base_net, dir.path(), None, port, "baseline");
    watchdog.watch(&base).unwrap();
    let mut fork = sidecar(&fork_net, dir.path(), Some("sbx1"), port, "fork");
    watchdog.watch(&fork).unwrap();
    wait_ready(&base_net, &mut base).await;
    wait_ready(&fork_net, &mut fork).await;

    let (b_ns, f_ns) = (Some(base_net.name()), Some(fork_net.name()));
    broker.probe(&["create", &bs, "orders", "3"]).await.unwrap();
    let (mut plain, mut keyed) = (BTreeSet::new(), BTreeSet::new());
    // Producers inside the pods go through the relays too; the transactional one inside the fork
    // (its transactional id renamed, so it cannot fence a baseline producer of the same id).
    for (ns, codec, prefix, n, key, txn) in [
        (None, "gzip", "p-host", 20, "-", None),
        (None, "zstd", "k-host", 8, "sbx1", None),
        (b_ns, "lz4", "p-base", 20, "-", None),
        (b_ns, "snappy", "k-base", 6, "sbx1", None),
        (f_ns, "none", "k-fork", 6, "sbx1", Some("orders-tx")),
    ] {
        let mut args = vec!["produce", &bs, "orders", codec, prefix];
        let n_s = n.to_string();
        args.extend([n_s.as_str(), key]);
        args.extend(txn);
        broker.probe_in(ns, &args).await.unwrap();
        let set = if key == "-" { &mut plain } else { &mut keyed };
        set.extend((0..n).map(|i| format!("{prefix}-{i}")));
    }
    let other: Vec<String> = (0..4).map(|i| format!("other-{i}")).collect();
    broker
        .kcat_produce(
            "orders",
            "lz4",
            &other,
            Some(("baggage", "sd-routing-key=sbx2")),
        )
        .await
        .unwrap();
    plain.extend(other);

    // The Java client, the same group.id in both pods at the same time.
    let (b_n, f_n) = (plain.len().to_string(), keyed.len().to_string());
    let b_args = ["consume", &bs, "orders", "orders-app", &b_n, "40000"];
    let f_args = ["consume", &bs, "orders", "orders-app", &f_n, "40000"];
    let (b, f) = tokio::join!(
        broker.probe_in(b_ns, &b_args),
        broker.probe_in(f_ns, &f_args)
    );
    assert_share(&printed(&b.unwrap()), &plain, "baseline pod, Java");
    assert_share(&printed(&f.unwrap()), &keyed, "fork pod, Java");

    // librdkafka's balanced consumer (reads to the end of each partition and exits: a record
    // too many would show).
    let broker_addr = SocketAddr::from((base_net.host_ip, port));
    let (b, f) = tokio::join!(
        broker.kcat_group_in(b_ns, broker_addr, "orders-kcat", "orders"),
        broker.kcat_group_in(f_ns, broker_addr, "orders-kcat", "orders")
    );
    assert_share(&b.unwrap(), &plain, "baseline pod, kcat");
    assert_share(&f.unwrap(), &keyed, "fork pod, kcat");

    // franz-go's group consumer.
    let b_args = ["consume", &bs, "orders", "orders-franz", &b_n, "40000"];
    let f_args = ["consume", &bs, "orders", "orders-franz", &f_n, "40000"];
    let (b, f) = tokio::join!(
        broker.franz_in(b_ns, &b_args),
        broker.franz_in(f_ns, &f_args)
    );
    assert_share(&printed(&b.unwrap()), &plain, "baseline pod, franz-go");
    assert_share(&printed(&f.unwrap()), &keyed, "fork pod, franz-go");

    // What the relays counted, on their admin servers.
    let (_, base_metrics) = admin_get(&base_net, "/metrics").await.unwrap();
    let (_, fork_metrics) = admin_get(&fork_net, "/metrics").await.unwrap();
    for (text, what) in [(&base_metrics, "baseline"), (&fork_metrics, "fork")] {
        for series in [
            "spur_kafka_records_total{topic=\"orders\",verdict=\"delivered\"}",
            "spur_kafka_records_total{topic=\"orders\",verdict=\"withheld\"}",
            "spur_kafka_batches_rewritten_total{topic=\"orders\"}",
            "spur_connections_total{protocol=\"kafka\"}",
        ] {
            assert!(metric(text, series) > 0.0, "{what}: {series} in\n{text}");
        }
        assert_eq!(
            metric(text, "spur_kafka_refused_connections_total"),
            0.0,
            "{what}: no connection refused"
        );
    }
    assert!(metric(&fork_metrics, "spur_kafka_ids_renamed_total") > 0.0);
    assert_eq!(metric(&base_metrics, "spur_kafka_ids_renamed_total"), 0.0);

    // Who may use the relay: nothing outside the pod reaches its port (loopback only) ...
    let outside = tokio::net::TcpStream::connect((base_net.ip, RELAY_PORT)).await;
    assert!(
        outside.is_err(),
        "the relay is reachable from outside its pod"
    );
    // ... and a connection made to it directly has no broker to go to: closed, unanswered.
    let got = direct_to_relay(&base_net).unwrap();
    assert!(got.is_empty(), "a direct connection was answered: {got:?}");
    assert!(
        std::fs::read_to_string(dir.path().join("baseline.log"))
            .unwrap()
            .contains("not redirected to it"),
        "{}",
        base.log_tail()
    );

    // Faults. A sidecar killed mid-stream and started again (as the kubelet restarts a
    // container): the consumer reconnects through the new one and receives every record that
    // is its own once. While it runs, a client of the same pod sends a frame too large to be
    // Kafka's: that connection alone is closed.
    broker
        .probe(&["create", &bs, "restart", "3"])
        .await
        .unwrap();
    broker
        .probe(&["produce", &bs, "restart", "lz4", "r1", "40", "-"])
        .await
        .unwrap();
    broker
        .probe(&["produce", &bs, "restart", "lz4", "k1", "20", "sbx1"])
        .await
        .unwrap();
    let want: BTreeSet<String> = (0..40)
        .map(|i| format!("r1-{i}"))
        .chain((0..40).map(|i| format!("r2-{i}")))
        .collect();
    let args = ["consume", &bs, "restart", "restart-app", "80", "60000"];
    let consume = broker.probe_in(b_ns, &args);
    let faults = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(base);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut again = sidecar(&base_net, dir.path(), None, port, "baseline-again");
        watchdog.watch(&again).unwrap();
        wait_ready(&base_net, &mut again).await;
        // 2 GiB declared: above any frame size the relay accepts.
        const HUGE: &[u8] = &[0x7f, 0xff, 0xff, 0xff, 0, 18, 0, 0];
        let got = send_from(&base_net, broker_addr, HUGE).unwrap();
        assert!(got.is_empty(), "an oversized frame was answered: {got:?}");
        broker
            .probe(&["produce", &bs, "restart", "none", "r2", "40", "-"])
            .await
            .unwrap();
        again
    };
    let (out, again) = tokio::join!(consume, faults);
    assert_share(
        &printed(&out.unwrap()),
        &want,
        "baseline pod across a sidecar restart",
    );
    let (_, text) = admin_get(&base_net, "/metrics").await.unwrap();
    assert_eq!(
        metric(&text, "spur_kafka_refused_connections_total"),
        1.0,
        "the oversized frame's connection, and only it\n{}",
        again.log_tail()
    );
    // Counted under the topic's name, or under `_unknown` when the client fetched by topic id
    // with the metadata it had before the restart (no Metadata response through the new
    // sidecar to learn the name from: docs/async.md, metrics).
    let delivered = ["restart", "_unknown"]
        .iter()
        .map(|t| {
            metric(
                &text,
                &format!("spur_kafka_records_total{{topic=\"{t}\",verdict=\"delivered\"}}"),
            )
        })
        .sum::<f64>();
    assert!(
        delivered >= 40.0 && metric(&text, "spur_connections_total{protocol=\"kafka\"}") >= 2.0,
        "the consumer went on through the restarted sidecar:\n{text}"
    );
    drop(broker);
}

/// A route that appears and goes while records stream: the sidecars take their routes from a
/// route server (in this process, serving a rule directory) and decide by its route history, so
/// a record belongs to the fork exactly when it carries the key and its timestamp falls inside
/// the route's span, whenever each relay sees it. Every record is consumed by one pod: the one
/// the span says, not whichever relay heard of the change first. Then the route server goes
/// away: the relays hold Fetch responses for at most their bound and go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_comes_and_goes_mid_stream_gives_every_record_one_consumer() {
    use spur_routeserver::{RouteServer, RouteServerConfig};
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "needs root (tests/run.sh runs as root)"
    );
    let (base_net, fork_net) = (TestNet::new().unwrap(), TestNet::new().unwrap());
    base_net.route_via_host().unwrap();
    fork_net.route_via_host().unwrap();
    let broker = Broker::start_on(base_net.host_ip).await.unwrap();
    let (bs, port) = (broker.bootstrap(), broker.addr.port());

    let dir = tempfile::tempdir().unwrap();
    let rules = tempfile::tempdir().unwrap();
    let server = RouteServer::start(RouteServerConfig {
        grpc_addr: SocketAddr::from((base_net.host_ip, 0)),
        http_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        poll_interval: Duration::from_millis(50),
        ..RouteServerConfig::new(rules.path())
    })
    .await
    .unwrap();
    let mut watchdog = Watchdog::spawn(dir.path()).unwrap();
    let with_server = |net: &TestNet| {
        let mut cmd = net.command(sidecar_bin());
        cmd.args(["--routeserver", &server.grpc_addr.to_string()]);
        cmd
    };
    let mut base = sidecar_with(with_server(&base_net), dir.path(), None, port, "baseline");
    watchdog.watch(&base).unwrap();
    let mut fork = sidecar_with(
        with_server(&fork_net),
        dir.path(),
        Some("sbx1"),
        port,
        "fork",
    );
    watchdog.watch(&fork).unwrap();
    wait_ready(&base_net, &mut base).await;
    wait_ready(&fork_net, &mut fork).await;

    broker.probe(&["create", &bs, "live", "3"]).await.unwrap();
    // Both consumers in the same group, from before the first record to 4 s after their last.
    let (b_ns, f_ns) = (Some(base_net.name()), Some(fork_net.name()));
    let consume = [
        "consume", &bs, "live", "live-app", "100000", "90000", "4000",
    ];
    // One record every 20 ms, every second one keyed sbx1, from the host. The route appears
    // after the 100th record is acked and goes after the 250th: the spans start 2 s (about 90
    // records) later, so keyed records fall before, inside and after the span.
    let stream = ["stream", &bs, "live", "s", "500", "sbx1/2", "20"];
    let produce = async {
        use tokio::io::AsyncBufReadExt as _;
        // The consumers join first (the Java client takes a few seconds to start).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut child = broker.probe_spawn(&stream).unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut sent = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            sent.push(line);
            match sent.len() {
                100 => std::fs::write(rules.path().join("rules.yaml"), RULES).unwrap(),
                250 => std::fs::remove_file(rules.path().join("rules.yaml")).unwrap(),
                _ => {}
            }
        }
        assert!(child.wait().await.unwrap().success());
        sent
    };
    let (b, f, sent) = tokio::join!(
        broker.probe_in(b_ns, &consume),
        broker.probe_in(f_ns, &consume),
        produce
    );
    let orders = spur_routing::BaselineWorkload {
        kind: "Deployment".into(),
        namespace: "shop".into(),
        name: "orders".into(),
    };
    let spans = server.index().history().current().spans(&orders);
    assert_eq!(spans.len(), 1, "one span, opened and closed: {spans:?}");
    let (since, until) = (spans[0].since_ms, spans[0].until_ms.unwrap());
    assert_eq!(spans[0].sandbox, "sbx1");
    let (mut keyed, mut plain) = (BTreeSet::new(), BTreeSet::new());
    let (mut before, mut after) = (0, 0);
    for line in &sent {
        let Some(rest) = line.strip_prefix("sent ") else {
            continue;
        };
        let (value, ts) = rest.split_once(' ').unwrap();
        let (i, ts): (u32, i64) = (value[2..].parse().unwrap(), ts.parse().unwrap());
        let is_keyed = i % 2 == 0;
        if is_keyed && (since..until).contains(&ts) {
            keyed.insert(value.to_owned());
        } else {
            plain.insert(value.to_owned());
            before += usize::from(is_keyed && ts < since);
            after += usize::from(is_keyed && ts >= until);
        }
    }
    assert_eq!(keyed.len() + plain.len(), 500);
    assert!(
        keyed.len() > 20 && before > 20 && after > 20,
        "keyed records inside the span {}, before it {before}, after it {after}",
        keyed.len()
    );
    assert_share(
        &printed(&b.unwrap()),
        &plain,
        "baseline pod, by the history",
    );
    assert_share(&printed(&f.unwrap()), &keyed, "fork pod, by the history");

    // The route server goes away. Past the grace its watermark has stopped, so the relays hold
    // Fetch responses, at most HOLD_MAX after it, then decide with the history they have.
    server.shutdown().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker
        .probe(&["produce", &bs, "live", "none", "late", "6", "sbx1/2"])
        .await
        .unwrap();
    let args = [
        "consume", &bs, "live", "late-app", "100000", "60000", "4000",
    ];
    let got: BTreeSet<String> = printed(&broker.probe_in(b_ns, &args).await.unwrap())
        .into_iter()
        .filter(|v| v.starts_with("late-"))
        .collect();
    let want: BTreeSet<String> = ["late-0", "late-1", "late-2", "late-3", "late-4", "late-5"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(got, want, "no route after the span: the baseline's");
    let (_, text) = admin_get(&base_net, "/metrics").await.unwrap();
    assert!(
        metric(&text, "spur_kafka_hold_expired_total") >= 1.0
            && metric(&text, "spur_routeserver_history_connected") == 0.0,
        "the relay went on without the route server, and said so:\n{text}"
    );
    assert!(
        std::fs::read_to_string(dir.path().join("baseline.log"))
            .unwrap()
            .contains("watermark stopped"),
        "{}",
        base.log_tail()
    );
    drop((base, fork, broker));
}

/// Faults while records stream through the relays, with routes from a route server: the
/// broker is killed and started again (every relayed connection breaks; the clients reconnect
/// through the relays), and later a second baseline pod's consumer joins the group (a
/// rebalance moves partitions between relays mid-stream). The consumers commit each poll before
/// printing it, so Kafka's own at-least-once delivery adds no double: every unkeyed record is
/// printed by exactly one of the two baseline pods and every keyed one by the fork, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_and_a_rebalance_mid_stream_lose_no_record_and_double_none() {
    use spur_e2e::kafka::run_probe;
    use spur_routeserver::{RouteServer, RouteServerConfig};
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "needs root (tests/run.sh runs as root)"
    );
    let nets = [(); 3].map(|()| TestNet::new().unwrap());
    for n in &nets {
        n.route_via_host().unwrap();
    }
    let [a_net, b_net, fork_net] = &nets;
    let mut broker = Broker::start_on(a_net.host_ip).await.unwrap();
    let (bs, port) = (broker.bootstrap(), broker.addr.port());

    let dir = tempfile::tempdir().unwrap();
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("rules.yaml"), RULES).unwrap();
    let server = RouteServer::start(RouteServerConfig {
        grpc_addr: SocketAddr::from((a_net.host_ip, 0)),
        http_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        ..RouteServerConfig::new(rules.path())
    })
    .await
    .unwrap();
    let mut watchdog = Watchdog::spawn(dir.path()).unwrap();
    let mut sidecars = Vec::new();
    for (net, fork, log) in [
        (a_net, None, "a"),
        (b_net, None, "b"),
        (fork_net, Some("sbx1"), "fork"),
    ] {
        let mut cmd = net.command(sidecar_bin());
        cmd.args(["--routeserver", &server.grpc_addr.to_string()]);
        let mut s = sidecar_with(cmd, dir.path(), fork, port, log);
        watchdog.watch(&s).unwrap();
        wait_ready(net, &mut s).await;
        sidecars.push(s);
    }
    broker.probe(&["create", &bs, "faults", "3"]).await.unwrap();

    // Consumers end 20 s after their last record (the restart pauses the stream for less).
    let consume = [
        "consume",
        &bs,
        "faults",
        "faults-app",
        "100000",
        "100000",
        "20000",
        "sync",
    ];
    let a = run_probe(broker.probe_command(Some(a_net.name()), &consume), &consume);
    let fork = run_probe(
        broker.probe_command(Some(fork_net.name()), &consume),
        &consume,
    );
    let b_cmd = broker.probe_command(Some(b_net.name()), &consume);
    let (join_b, joined) = tokio::sync::oneshot::channel::<()>();
    let b = async {
        if joined.await.is_err() {
            return Ok(String::new());
        }
        run_probe(b_cmd, &consume).await
    };
    // 800 records, every third keyed sbx1, one each 20 ms. The broker is killed and started
    // again after the 150th; the second baseline consumer starts after the 250th (it joins a
    // few seconds later, with hundreds of records still to come).
    let stream = ["stream", &bs, "faults", "f", "800", "sbx1/3", "20"];
    let mut child = broker.probe_spawn(&stream).unwrap();
    let produce = async {
        use tokio::io::AsyncBufReadExt as _;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut sent, mut join_b) = (0, Some(join_b));
        while let Some(line) = lines.next_line().await.unwrap() {
            if !line.starts_with("sent ") {
                continue;
            }
            sent += 1;
            if sent == 150 {
                broker.restart().await.unwrap();
            }
            if sent == 250 {
                let _ = join_b.take().map(|tx| tx.send(()));
            }
        }
        assert!(child.wait().await.unwrap().success());
        sent
    };
    let (a, b, fork, sent) = tokio::join!(a, b, fork, produce);
    assert_eq!(sent, 800);
    let keyed: BTreeSet<String> = (0..800).step_by(3).map(|i| format!("f-{i}")).collect();
    let plain: BTreeSet<String> = (0..800)
        .filter(|i| i % 3 != 0)
        .map(|i| format!("f-{i}"))
        .collect();
    let (a, b) = (printed(&a.unwrap()), printed(&b.unwrap()));
    assert!(
        !b.is_empty(),
        "the rebalance gave the second pod partitions"
    );
    let both: Vec<String> = a.iter().chain(&b).cloned().collect();
    assert_share(&both, &plain, "baseline pods A and B across the faults");
    assert_share(
        &printed(&fork.unwrap()),
        &keyed,
        "fork pod across the faults",
    );
    drop((sidecars, broker, server));
}
