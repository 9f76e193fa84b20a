//! The child processes: this binary re-executed with `--role operator|routeserver`, so that the
//! operator's and the route server's CPU time and memory are their own.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kube::Client;
use prometheus_client::registry::Registry;
use spur_routeserver::{KubeStore, RouteServer, RouteServerConfig};
use tokio_util::sync::CancellationToken;

use crate::SCRAPE;

/// `--role operator <kubeconfig>` or `--role routeserver <kubeconfig> [<gRPC addr>]`. Both stop
/// on SIGTERM, and when stdin closes (the parent is gone, however it went).
pub(crate) fn child_main(args: &[String]) -> Result<()> {
    let [role, kubeconfig, rest @ ..] = args else {
        bail!("usage: sandbox_scale --role operator|routeserver <kubeconfig> [<gRPC addr>]");
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
        let config =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await?;
        let client = Client::try_from(config)?;
        let stop = CancellationToken::new();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let on_term = stop.clone();
        tokio::spawn(async move {
            term.recv().await;
            on_term.cancel();
        });
        let on_eof = stop.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            on_eof.cancel();
        });
        match role.as_str() {
            "operator" => operator(client, stop).await,
            "routeserver" => routeserver(client, rest.first(), stop).await,
            other => bail!("unknown role {other}"),
        }
    })
}

/// The operator's controllers, as `sandbox_latency` runs them (no leader election). Prints
/// `passes <scrape µs> <kind>=<started>/<ended>… failures=<n>` whenever a pass starts or ends
/// (read off its own metrics every `SCRAPE`), and at least once a second; `<scrape µs>` is the
/// time spent on those reads, which the parent takes off the operator's CPU time.
async fn operator(client: Client, stop: CancellationToken) -> Result<()> {
    let mut registry = Registry::default();
    let metrics = spur_operator::Metrics::register(&mut registry);
    let ctx = Arc::new(spur_operator::Context::new(
        client.clone(),
        Some("bench".into()),
        metrics,
    ));
    let report_stop = stop.clone();
    let reporter = tokio::spawn(async move {
        let (mut last, mut printed, mut scrape) = (String::new(), Instant::now(), Duration::ZERO);
        loop {
            let t = Instant::now();
            let mut text = String::new();
            let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
            let counts = pass_counts(&text);
            scrape += t.elapsed();
            if counts != last || printed.elapsed() >= Duration::from_secs(1) {
                println!("passes {} {counts}", scrape.as_micros());
                (last, printed) = (counts, Instant::now());
            }
            tokio::select! {
                () = report_stop.cancelled() => return,
                () = tokio::time::sleep(SCRAPE) => {}
            }
        }
    });
    spur_operator::run(client, ctx, stop).await;
    reporter.abort();
    Ok(())
}

/// `<kind>=<started>/<ended> … failures=<n>` from the operator's metrics text.
fn pass_counts(text: &str) -> String {
    let mut kinds: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut failures = 0;
    for line in text.lines() {
        let value = |v: &str| v.trim().parse::<f64>().map_or(0, |v| v as u64);
        if let Some(rest) = line.strip_prefix("reconciles_total{kind=\"")
            && let Some((kind, v)) = rest.split_once("\"} ")
        {
            kinds.entry(kind).or_default().0 = value(v);
        } else if let Some(rest) = line.strip_prefix("reconcile_duration_seconds_count{kind=\"")
            && let Some((kind, v)) = rest.split_once("\"} ")
        {
            kinds.entry(kind).or_default().1 = value(v);
        } else if let Some(v) = line.strip_prefix("reconcile_failures_total ") {
            failures = value(v);
        }
    }
    let mut out = String::new();
    for (kind, (started, ended)) in kinds {
        let _ = write!(out, "{kind}={started}/{ended} ");
    }
    let _ = write!(out, "failures={failures}");
    out
}

/// The route server with the Kubernetes store; prints `grpc <addr>` once it serves (after its
/// first complete rule set).
async fn routeserver(client: Client, grpc: Option<&String>, stop: CancellationToken) -> Result<()> {
    let grpc_addr = match grpc {
        Some(a) => a.parse()?,
        None => "127.0.0.1:0".parse()?,
    };
    let server = RouteServer::start_with(
        RouteServerConfig {
            grpc_addr,
            http_addr: "127.0.0.1:0".parse()?,
            ..RouteServerConfig::new("")
        },
        KubeStore::new(client),
    )
    .await?;
    println!("grpc {}", server.grpc_addr);
    stop.cancelled().await;
    server.shutdown().await;
    Ok(())
}
