//! The standalone demo (`spur-demo`, also `spur demo`): two example services (HTTP "web" and
//! gRPC "greeter"), each with a baseline and a fork, each baseline fronted by a real Spur
//! sidecar, and one rule file that sends routing key `demo` to the forks. Everything on
//! loopback, no cluster. With `--kafka BROKER`, also records: see [`kafka`]. Also the small tools around the example apps (`serve`, `call`,
//! `probe`) that the node tier's images run.
//!
//! Its own crate so that the README's first command compiles only what the demo runs: the
//! route server without its Kubernetes side, the sidecar and the example apps. It is the body
//! of two binaries, so it reports errors the way they do (`anyhow`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use spur_demo_apps::{
    CancellationToken, grpc_client, serve_grpc, serve_http, serve_http_producing,
};
use spur_proxy::{Inbound, ProxyConfig};
use spur_routeserver::{RouteServer, RouteServerConfig};
use spur_routing::{BaselineWorkload, ExtractConfig};
use spur_runtime::shutdown_signal;
use spur_sidecar::{Sidecar, SidecarConfig};
use tokio::net::TcpListener;

pub mod kafka;
mod probe;

use probe::Probe;
pub use probe::ProbeProtocol;

/// The routing key the demo's rules use.
pub const DEMO_KEY: &str = "demo";
const NAMESPACE: &str = "demo";

/// The standalone demo's options.
#[derive(Args)]
pub struct Options {
    /// First port of the demo's block: sidecars on BASE and BASE+1 (with --kafka, the worker's
    /// on BASE+2 and BASE+3), their admin servers on BASE+10.., the route server on BASE+20
    /// (gRPC) and BASE+21 (REST), the worker's Kafka relays on BASE+30 and BASE+31, baselines on
    /// BASE+100.., forks on BASE+200... 0 picks free ports.
    #[arg(long, default_value_t = 18080)]
    pub port_base: u16,
    /// The route server's rule directory; the demo writes `rules.yaml` into it (default: a
    /// fresh temporary directory).
    #[arg(long)]
    pub rules_dir: Option<PathBuf>,
    /// Bring the demo up, make the requests it would suggest, report, and exit (0 when every
    /// request landed where it should).
    #[arg(long)]
    pub check: bool,
    /// A Kafka broker (HOST:PORT, a cluster of one broker) for the records part: the web app
    /// writes a record per `POST /order`, and a worker service, forked like the others,
    /// consumes them through its sidecars' Kafka relays. Without it, no Kafka.
    #[arg(long, value_name = "HOST:PORT")]
    pub kafka: Option<String>,
}

/// The tools around the example apps.
#[derive(Subcommand)]
pub enum DemoCommand {
    /// Run one example app on its own (e.g. to put a standalone spur-sidecar in front of it):
    /// HTTP (/, /headers, /echo, /slow, /stream, /ws), gRPC (spur.demo.v1.Demo), TCP echo, or
    /// UDP echo (each reply is the name, a space and the datagram; with a TCP echo on the same
    /// port for probes).
    Serve {
        /// http, grpc, tcp or udp.
        #[arg(long, default_value = "http")]
        kind: String,
        /// The name the app answers with ("hello from NAME", x-served-by).
        #[arg(long, default_value = "app")]
        name: String,
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
    },
    /// Call the demo's gRPC greeter (spur.demo.v1.Demo/Hello, then a Chat stream) through a sidecar.
    Call {
        /// The greeter sidecar's address.
        #[arg(long)]
        addr: SocketAddr,
        /// Routing key to send in `baggage` (omit for an unkeyed request).
        #[arg(long)]
        key: Option<String>,
    },
    /// Send sessions to a listener of echo servers (`serve --kind udp` or `--kind tcp`): each
    /// from a new socket (a new source port), its payload `s<7-digit number>` (padded with
    /// dots or cut to --size bytes). Prints `<number> <who answered>` per session, or
    /// `<number> error <why>`, and fails when any session failed. For checking a ListenerSet's
    /// spread, affinity and framing (docs/l4.md). A TCP session writes its payload, half-closes
    /// and reads to the end: the echo, then the worker's `bye from <name>` that it sends only
    /// after it has seen the half-close.
    #[command(alias = "udp-probe")]
    Probe {
        #[arg(long)]
        target: SocketAddr,
        /// udp or tcp.
        #[arg(long, default_value = "udp")]
        protocol: ProbeProtocol,
        #[arg(long, default_value_t = 100)]
        sessions: u32,
        /// The first session number.
        #[arg(long, default_value_t = 0)]
        first: u32,
        /// Payload size in bytes (UDP: at most 65 507, the largest IPv4 datagram); default the
        /// 8-byte session id alone.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=65_507))]
        size: Option<u32>,
        /// How long to wait for each reply.
        #[arg(long, default_value = "2s", value_parser = spur_runtime::parse_duration)]
        timeout: Duration,
        /// Sessions whose sockets are open at once (distinct source ports).
        #[arg(long, default_value_t = 100)]
        batch: u32,
        /// A pause between batches: longer than the listener's idle timeout, so a source port
        /// the system hands out again starts a new session.
        #[arg(long, default_value = "0s", value_parser = spur_runtime::parse_duration)]
        pause: Duration,
    },
}

struct Service {
    label: &'static str,
    baseline: SocketAddr,
    fork: SocketAddr,
    sidecar: Sidecar,
}

struct Demo {
    web: Service,
    greeter: Service,
    /// With --kafka: the worker and its consumers.
    workers: Option<kafka::Workers>,
    /// The rule file the route server serves (and the user edits).
    rules: PathBuf,
    routeserver: RouteServer,
    apps: CancellationToken,
}

/// Runs one of the tools.
pub async fn run_command(command: DemoCommand) -> Result<ExitCode> {
    match command {
        DemoCommand::Call { addr, key } => call(addr, key.as_deref()).await,
        DemoCommand::Serve { kind, name, listen } => serve(&kind, name, listen).await,
        DemoCommand::Probe {
            target,
            protocol,
            sessions,
            first,
            size,
            timeout,
            batch,
            pause,
        } => {
            let probe = Probe {
                target,
                protocol,
                size,
                timeout,
            };
            probe.run(first, sessions, batch, pause).await
        }
    }
}

/// Runs the demo until SIGINT or SIGTERM (or, with `--check`, checks it and exits).
/// `invoke` is how the printed instructions run a tool (the binary, and `demo` for `spur`).
pub async fn run(options: Options, invoke: &str) -> Result<ExitCode> {
    let broker = match &options.kafka {
        Some(hostport) => Some(resolve(hostport).await?),
        None => None,
    };
    let demo = start(options.port_base, options.rules_dir, broker, !options.check).await?;
    if options.check {
        let ok = check(&demo).await;
        stop(demo).await;
        return Ok(if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    print_instructions(&demo, invoke);
    shutdown_signal().await;
    println!("\nstopping…");
    stop(demo).await;
    Ok(ExitCode::SUCCESS)
}

/// `--kafka`'s HOST:PORT, resolved once (the first address).
async fn resolve(hostport: &str) -> Result<SocketAddr> {
    tokio::net::lookup_host(hostport)
        .await
        .with_context(|| format!("--kafka {hostport:?}: not a HOST:PORT that resolves"))?
        .next()
        .with_context(|| format!("--kafka {hostport:?}: resolves to no address"))
}

fn port(base: u16, offset: u16) -> Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    base.checked_add(offset)
        .context("--port-base too high: the demo needs BASE+211 to be a valid port")
}

async fn bind(base: u16, offset: u16, what: &str) -> Result<TcpListener> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port(base, offset)?));
    TcpListener::bind(addr).await.with_context(|| {
        format!("cannot bind {what} on {addr} (is another demo running? try --port-base)")
    })
}

/// (baseline, fork) addresses of one demo service.
type Pair = (SocketAddr, SocketAddr);

fn rules_yaml(web: Pair, greeter: Pair, worker: Option<Pair>) -> String {
    let rule = |name: &str, (baseline, fork): Pair| {
        format!(
            "- routingKey: {DEMO_KEY}\n  baseline: {{kind: Deployment, namespace: {NAMESPACE}, name: {name}}}\n  destinationSandbox: {{name: demo-sandbox}}\n  mappings:\n    - workloadPort: {}\n      destinations: [{{host: 127.0.0.1, port: {}}}]\n",
            baseline.port(),
            fork.port()
        )
    };
    format!(
        "# Spur demo routing rules: requests carrying routing key `{DEMO_KEY}` go to the forks.\n# Edit and save; the sidecars pick changes up within a second.\n{}{}{}",
        rule("web", web),
        rule("greeter", greeter),
        // The worker's rule also decides its Kafka records, by the same key: nothing in it is
        // Kafka-specific.
        worker.map_or(String::new(), |w| rule("worker", w))
    )
}

async fn start(
    base: u16,
    rules_dir: Option<PathBuf>,
    broker: Option<SocketAddr>,
    print: bool,
) -> Result<Demo> {
    if let Some(broker) = broker {
        kafka::create_topic(broker).await?;
    }
    let apps = CancellationToken::new();
    let mut addrs = Vec::new();
    let mut services = vec![
        (100, "baseline", false),
        (200, "fork", false),
        (101, "baseline", true),
        (201, "fork", true),
    ];
    if broker.is_some() {
        services.extend([(102, "baseline", false), (202, "fork", false)]);
    }
    for (offset, name, grpc) in services {
        let l = bind(base, offset, if grpc { "gRPC app" } else { "HTTP app" }).await?;
        addrs.push(l.local_addr()?);
        let token = apps.clone();
        let name = name.to_string();
        // The web app (and only it) writes a record per order.
        let producer = broker
            .filter(|_| offset % 100 == 0)
            .map(|b| spur_demo_apps::kafka::Producer::new(b, kafka::TOPIC));
        tokio::spawn(async move {
            let res = if grpc {
                serve_grpc(l, name, token).await
            } else {
                serve_http_producing(l, name, producer, token).await
            };
            if let Err(e) = res {
                tracing::error!(error = %e, "demo app failed");
            }
        });
    }
    let web: Pair = (addrs[0], addrs[1]);
    let greeter: Pair = (addrs[2], addrs[3]);
    let worker: Option<Pair> = broker.map(|_| (addrs[4], addrs[5]));
    let dir = rules_dir
        .unwrap_or_else(|| std::env::temp_dir().join(format!("spur-demo-{}", std::process::id())));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let rules = dir.join("rules.yaml");
    std::fs::write(&rules, rules_yaml(web, greeter, worker))
        .with_context(|| format!("cannot write {}", rules.display()))?;
    let routeserver = RouteServer::start(RouteServerConfig {
        poll_interval: Duration::from_millis(200),
        grpc_addr: SocketAddr::from(([127, 0, 0, 1], port(base, 20)?)),
        http_addr: SocketAddr::from(([127, 0, 0, 1], port(base, 21)?)),
        ..RouteServerConfig::new(&dir)
    })
    .await
    .context("cannot start the route server (is another demo running? try --port-base)")?;
    let grpc = routeserver.grpc_addr.to_string();
    let web_sidecar = sidecar("web", base, 0, web.0, &grpc, None).await?;
    let greeter_sidecar = sidecar("greeter", base, 1, greeter.0, &grpc, None).await?;
    for s in [&web_sidecar, &greeter_sidecar] {
        wait_synced(s).await?;
    }
    let workers = match (broker, worker) {
        (Some(broker), Some((baseline, fork))) => {
            let relay = |offset, fork| -> Result<_> {
                Ok(Some(kafka::relay_config(broker, port(base, offset)?, fork)))
            };
            // The fork's sidecar fronts the same baseline workload, as a fork's does in the
            // cluster; only its relay's role differs.
            let b = sidecar("worker", base, 2, baseline, &grpc, relay(30, false)?).await?;
            let f = sidecar("worker", base, 3, fork, &grpc, relay(31, true)?).await?;
            for s in [&b, &f] {
                wait_synced(s).await?;
            }
            Some(kafka::Workers::start(broker, b, f, print).await?)
        }
        _ => None,
    };
    Ok(Demo {
        workers,
        web: Service {
            label: "web (HTTP)",
            baseline: web.0,
            fork: web.1,
            sidecar: web_sidecar,
        },
        greeter: Service {
            label: "greeter (gRPC)",
            baseline: greeter.0,
            fork: greeter.1,
            sidecar: greeter_sidecar,
        },
        rules,
        routeserver,
        apps,
    })
}

/// A sidecar publishes its first table once its watch stream is synced.
async fn wait_synced(sidecar: &Sidecar) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sidecar.table().load().version == 0 {
        if tokio::time::Instant::now() > deadline {
            bail!("a sidecar did not sync with the route server within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

async fn sidecar(
    name: &str,
    base: u16,
    index: u16,
    app: SocketAddr,
    routeserver: &str,
    kafka: Option<spur_sidecar::kafka::KafkaConfig>,
) -> Result<Sidecar> {
    let config = SidecarConfig {
        inject_key_file: None,
        kafka,
        capture: None,
        inbound_addr: SocketAddr::from(([127, 0, 0, 1], port(base, index)?)),
        inbound: Inbound::Explicit { app },
        baseline: BaselineWorkload {
            kind: "Deployment".into(),
            namespace: NAMESPACE.into(),
            name: name.into(),
        },
        rules: None,
        rules_poll: Duration::from_millis(500),
        // The demo's route server listens on loopback only: plaintext, no token.
        routeserver: Some(spur_sidecar::RouteServerConn::plain(
            routeserver.to_string(),
        )),
        admin_addr: Some(SocketAddr::from(([127, 0, 0, 1], port(base, 10 + index)?))),
        extract: ExtractConfig {
            custom_headers: vec!["x-routing-key".into()],
            query_param: Some("sd-routing-key".into()),
        },
        proxy: ProxyConfig {
            drain_grace: Duration::from_secs(5),
            ..ProxyConfig::default()
        },
    };
    Sidecar::start(config).await.with_context(|| {
        format!("cannot start the {name} sidecar (is another demo running? try --port-base)")
    })
}

async fn stop(demo: Demo) {
    if let Some(w) = demo.workers {
        w.stop().await;
    }
    demo.web.sidecar.shutdown().await;
    demo.greeter.sidecar.shutdown().await;
    demo.routeserver.shutdown().await;
    demo.apps.cancel();
}

fn print_instructions(demo: &Demo, invoke: &str) {
    let web = demo.web.sidecar.inbound_addr;
    let greeter = demo.greeter.sidecar.inbound_addr;
    let admin = demo
        .web
        .sidecar
        .admin_addr
        .map_or_else(|| "?".into(), |a| a.to_string());
    println!("Spur demo is running. Ctrl-C stops it.\n");
    for s in [&demo.web, &demo.greeter] {
        println!(
            "  {:<15} sidecar {}  ->  baseline {}  |  key {DEMO_KEY:?}: fork {}",
            s.label, s.sidecar.inbound_addr, s.baseline, s.fork
        );
    }
    println!(
        "  route server    gRPC {}  REST http://{}  rules {}\n                  (edit and save the rules: traffic re-routes within a second)\n",
        demo.routeserver.grpc_addr,
        demo.routeserver.http_addr,
        demo.rules.display()
    );
    println!("Unkeyed requests reach the baseline:");
    println!("  curl -s http://{web}/");
    println!("  {invoke} call --addr {greeter}");
    println!("\nRequests carrying the routing key reach the fork:");
    println!("  curl -s -H 'baggage: sd-routing-key={DEMO_KEY}' http://{web}/");
    println!(
        "  curl -s -H 'tracestate: sd-routing-key={DEMO_KEY}' --http2-prior-knowledge http://{web}/"
    );
    println!("  curl -s -H 'uberctx-sd-routing-key: {DEMO_KEY}' http://{web}/");
    println!(
        "  curl -s -H 'x-routing-key: {DEMO_KEY}' http://{web}/        # a configured custom header"
    );
    println!(
        "  curl -s 'http://{web}/?sd-routing-key={DEMO_KEY}'           # query parameter, stripped"
    );
    println!("  {invoke} call --addr {greeter} --key {DEMO_KEY}");
    println!("\nAn unknown key falls back to the baseline:");
    println!("  curl -s -H 'baggage: sd-routing-key=nosuchkey' http://{web}/");
    println!("\nInspect the route server and the web sidecar:");
    println!(
        "  curl -s http://{}/api/v1/workloads/routing-rules",
        demo.routeserver.http_addr
    );
    println!("  curl -s http://{admin}/config_dump");
    println!("  curl -s http://{admin}/metrics | grep spur_requests");
    if let Some(w) = &demo.workers {
        let admin = |s: &Sidecar| s.admin_addr.map_or_else(|| "?".into(), |a| a.to_string());
        println!(
            "\nKafka (broker {}, topic {}): the web app writes a record per POST /order, with the\nrequest's baggage and tracestate (as OpenTelemetry propagates them); the worker's baseline and\nfork read the topic through their sidecars' Kafka relays ({} and {}). Each record handled is\nprinted here.",
            w.broker,
            kafka::TOPIC,
            w.baseline
                .kafka_addr
                .map_or_else(|| "?".into(), |a| a.to_string()),
            w.fork
                .kafka_addr
                .map_or_else(|| "?".into(), |a| a.to_string()),
        );
        println!("\nRecords of unkeyed requests reach the worker's baseline:");
        println!("  curl -s -X POST http://{web}/order");
        println!("\nRecords of keyed requests reach the worker's fork:");
        println!("  curl -s -X POST -H 'baggage: sd-routing-key={DEMO_KEY}' http://{web}/order");
        println!("\nWhat each worker relay delivered and withheld:");
        println!(
            "  curl -s http://{}/metrics | grep spur_kafka_records",
            admin(&w.baseline)
        );
        println!(
            "  curl -s http://{}/metrics | grep spur_kafka_records",
            admin(&w.fork)
        );
    }
}

/// One request through a sidecar and the upstream that answered it.
async fn http_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    h2: bool,
) -> Result<String> {
    let headers = http_request(http::Method::GET, addr, path, headers, h2).await?;
    Ok(headers
        .get(spur_demo_apps::SERVED_BY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_default())
}

/// One request; the response's headers, after its body, when its status is a success.
async fn http_request(
    method: http::Method,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    h2: bool,
) -> Result<http::HeaderMap> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Empty::<Bytes>::new())?;
    let resp = if h2 {
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(tcp),
        )
        .await?;
        tokio::spawn(conn);
        send.send_request(req).await?
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let (mut parts, body) = req.into_parts();
        parts.uri = path.parse()?;
        parts.headers.insert(
            http::header::HOST,
            http::HeaderValue::from_str(&addr.to_string())?,
        );
        send.send_request(http::Request::from_parts(parts, body))
            .await?
    };
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    if !parts.status.is_success() {
        bail!(
            "status {}: {}",
            parts.status,
            String::from_utf8_lossy(&body).trim()
        );
    }
    Ok(parts.headers)
}

async fn check(demo: &Demo) -> bool {
    let web = demo.web.sidecar.inbound_addr;
    let greeter = demo.greeter.sidecar.inbound_addr;
    let baggage = format!("sd-routing-key={DEMO_KEY}");
    let query = format!("/?sd-routing-key={DEMO_KEY}");
    let cases: Vec<(&str, &str, Result<String>)> = vec![
        (
            "HTTP/1.1, no key",
            "baseline",
            http_get(web, "/", &[], false).await,
        ),
        (
            "HTTP/1.1, baggage",
            "fork",
            http_get(web, "/", &[("baggage", &baggage)], false).await,
        ),
        (
            "HTTP/2, tracestate",
            "fork",
            http_get(web, "/", &[("tracestate", &baggage)], true).await,
        ),
        (
            "HTTP/1.1, uberctx header",
            "fork",
            http_get(web, "/", &[("uberctx-sd-routing-key", DEMO_KEY)], false).await,
        ),
        (
            "HTTP/1.1, custom header",
            "fork",
            http_get(web, "/", &[("x-routing-key", DEMO_KEY)], false).await,
        ),
        (
            "HTTP/1.1, query parameter",
            "fork",
            http_get(web, &query, &[], false).await,
        ),
        (
            "HTTP/1.1, unknown key",
            "baseline",
            http_get(web, "/", &[("baggage", "sd-routing-key=nosuchkey")], false).await,
        ),
        (
            "gRPC, no key",
            "baseline",
            grpc_served_by(greeter, None).await,
        ),
        (
            "gRPC, baggage",
            "fork",
            grpc_served_by(greeter, Some(DEMO_KEY)).await,
        ),
    ];
    let mut ok = report(cases);
    if let Some(w) = &demo.workers {
        ok &= check_kafka(w, web).await;
    }
    // Editing the rule file re-routes live traffic, nothing restarts.
    ok &= live_edit(demo).await;
    println!(
        "{}",
        if ok {
            "demo check passed"
        } else {
            "demo check FAILED"
        }
    );
    ok
}

/// An unkeyed and a keyed `POST /order` through the web sidecar: which worker handled each
/// request's record (exactly one, the baseline and the fork respectively).
async fn check_kafka(workers: &kafka::Workers, web: SocketAddr) -> bool {
    let baggage = format!("sd-routing-key={DEMO_KEY}");
    let mut cases = Vec::new();
    for (what, want, headers) in [
        ("Kafka, record, no key", "baseline", vec![]),
        (
            "Kafka, record, baggage",
            "fork",
            vec![("baggage", baggage.as_str())],
        ),
    ] {
        let got = async {
            let response = http_request(http::Method::POST, web, "/order", &headers, false).await?;
            let record = response
                .get("x-record")
                .and_then(|v| v.to_str().ok())
                .context("the web app named no record (x-record)")?;
            let sides = workers.handled_by(record, Duration::from_secs(15)).await;
            if sides.is_empty() {
                bail!("{record} was handled by no worker within 15 s");
            }
            Ok(sides.join(" and "))
        }
        .await;
        cases.push((what, want, got));
    }
    report(cases)
}

/// Removes the web rule from the served file, waits for keyed web traffic to fall back to the
/// baseline, restores the file and waits for the fork again.
async fn live_edit(demo: &Demo) -> bool {
    let web = demo.web.sidecar.inbound_addr;
    let baggage = format!("sd-routing-key={DEMO_KEY}");
    let Ok(original) = std::fs::read_to_string(&demo.rules) else {
        return false;
    };
    let without_web = rules_yaml_only_greeter(&original);
    let mut ok = true;
    for (what, content, want) in [
        (
            "live edit: web rule removed",
            without_web.as_str(),
            "baseline",
        ),
        ("live edit: web rule restored", original.as_str(), "fork"),
    ] {
        let written = std::fs::write(&demo.rules, content).is_ok();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut got = String::new();
        while written && tokio::time::Instant::now() < deadline {
            got = http_get(web, "/", &[("baggage", &baggage)], false)
                .await
                .unwrap_or_default();
            if got == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        ok &= report(vec![(what, want, Ok(got))]);
    }
    ok
}

/// The demo's rule file without its first rule (the web one).
fn rules_yaml_only_greeter(original: &str) -> String {
    let mut rules = original
        .split("\n- ")
        .map(str::to_owned)
        .collect::<Vec<_>>();
    if rules.len() >= 3 {
        rules.remove(1);
    }
    rules.join("\n- ")
}

fn report(cases: Vec<(&str, &str, Result<String>)>) -> bool {
    let mut ok = true;
    for (what, want, got) in cases {
        let line = match got {
            Ok(by) if by == want => format!("ok    {what:<28} -> {by}"),
            Ok(by) => {
                ok = false;
                format!("FAIL  {what:<28} -> {by} (expected {want})")
            }
            Err(e) => {
                ok = false;
                format!("FAIL  {what:<28} -> error: {e:#}")
            }
        };
        println!("{line}");
    }
    ok
}

async fn serve(kind: &str, name: String, listen: SocketAddr) -> Result<ExitCode> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot bind {listen}"))?;
    let token = CancellationToken::new();
    let app = {
        let token = token.clone();
        match kind {
            "http" => tokio::spawn(serve_http(listener, name, token)),
            "grpc" => tokio::spawn(serve_grpc(listener, name, token)),
            "tcp" => tokio::spawn(spur_demo_apps::serve_tcp_echo(listener, name, token)),
            // A UDP echo, with the TCP echo on the same port number for probes and a
            // ListenerSet's tcp health checks (UDP has no connection to check).
            "udp" => {
                let socket = tokio::net::UdpSocket::bind(listen)
                    .await
                    .with_context(|| format!("cannot bind UDP {listen}"))?;
                tokio::spawn(async move {
                    let (udp, tcp) = tokio::join!(
                        spur_demo_apps::serve_udp_echo(socket, name.clone(), token.clone()),
                        spur_demo_apps::serve_tcp_echo(listener, name, token),
                    );
                    udp.and(tcp)
                })
            }
            other => bail!("unknown app kind {other:?}: use http, grpc, tcp or udp"),
        }
    };
    println!("serving {kind} on {listen}");
    shutdown_signal().await;
    token.cancel();
    app.await?.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(ExitCode::SUCCESS)
}

/// The `baggage` value carrying `key`, if any.
fn baggage_for(key: Option<&str>) -> Option<String> {
    key.map(|k| format!("sd-routing-key={k}"))
}

fn metadata(baggage: &Option<String>) -> Vec<(&str, &str)> {
    baggage.iter().map(|b| ("baggage", b.as_str())).collect()
}

async fn grpc_served_by(addr: SocketAddr, key: Option<&str>) -> Result<String> {
    let baggage = baggage_for(key);
    let (reply, _) = grpc_client::hello(addr, "spur", &metadata(&baggage))
        .await
        .map_err(|s| anyhow::anyhow!("{s}"))?;
    Ok(reply.served_by)
}

async fn call(addr: SocketAddr, key: Option<&str>) -> Result<ExitCode> {
    let baggage = baggage_for(key);
    let metadata = metadata(&baggage);
    let (reply, trailer) = grpc_client::hello(addr, "spur", &metadata)
        .await
        .map_err(|s| anyhow::anyhow!("Hello failed: {s}"))?;
    println!(
        "Hello: {} (served by {}, trailer x-served-by: {})",
        reply.message,
        reply.served_by,
        trailer.unwrap_or_default()
    );
    let (replies, trailer) = grpc_client::chat(addr, vec!["one".into(), "two".into()], &metadata)
        .await
        .map_err(|s| anyhow::anyhow!("Chat failed: {s}"))?;
    for r in replies {
        println!("Chat:  {}", r.message);
    }
    println!("Chat trailer x-served-by: {}", trailer.unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}
