//! The benchmark: set-up, then the phases (idle, create, operator restarts, route server restart),
//! each adding rows to the report.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use futures_util::StreamExt;
use kube::Api;
use kube::api::{Patch, PatchParams};
use prometheus_client::registry::Registry;
use serde_json::json;
use spur_api::Sandbox;
use spur_discovery::{Publisher, RouteServerConn, RouteServerSource};
use spur_kube_harness::KubeApi;
use spur_perf::kube_bench::{create_sandboxes, fake_kubelet, install_crds, setup_baselines};
use spur_routing::SharedTable;
use tokio_util::sync::CancellationToken;

use crate::component::Component;
use crate::passes::{Passes, op_usage, settle};
use crate::report::{Report, render, secs, since};
use crate::waits::{Watcher, baseline, converged, wait_sandboxes, wait_watchers};
use crate::{BASELINES, CLIENTS, IDLE, POLL, START_WAIT};

pub(crate) async fn run(n: usize, w: usize, write: bool) -> Result<()> {
    let started = Instant::now();
    let phase_wait = Duration::from_secs(120) + Duration::from_millis(600 * n as u64);
    let api = KubeApi::start().await?;
    install_crds(&api).await?;
    let client = api.client();
    let version = client.apiserver_version().await?.git_version;
    setup_baselines(&client, &BASELINES).await?;
    let kubeconfig = api.dir().join("bench-kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let kubeconfig = kubeconfig.to_str().context("kubeconfig path")?.to_string();

    let stop = CancellationToken::new();
    let kubelet = tokio::spawn(fake_kubelet(client.clone(), stop.clone()));
    let mut op = Component::spawn("operator", &[&kubeconfig])?;
    let mut passes = Passes::new(op.started);
    let mut rs = Component::spawn("routeserver", &[&kubeconfig])?;
    let (_, grpc) = rs.expect_line("grpc ").await?;

    let mut watchers = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..w {
        let table = SharedTable::new();
        let mut registry = Registry::default();
        let publisher = Publisher::new(table.clone(), &mut registry);
        let source = RouteServerSource::new(
            RouteServerConn::plain(grpc.clone()),
            baseline(i),
            publisher,
            &mut registry,
        )?;
        tasks.push(tokio::spawn(source.run(stop.clone())));
        watchers.push(Watcher {
            baseline: baseline(i),
            table,
            registry,
        });
    }
    wait_watchers(
        &watchers,
        &[],
        true,
        &mut [&mut op, &mut rs],
        Instant::now() + START_WAIT,
        "start-up",
    )
    .await?;
    let setup = started.elapsed();
    let mut report = Report::default();
    let per = |x: f64| x / n as f64;

    // (1) Idle, once the operator has settled from its start-up.
    settle(
        &mut op,
        &mut passes,
        0,
        Instant::now() + START_WAIT,
        "operator start-up",
    )
    .await?;
    let (op0, rs0) = (op_usage(&mut op, &mut passes), rs.usage());
    tokio::time::sleep(IDLE).await;
    let (op_idle, rs_idle) = (op_usage(&mut op, &mut passes), rs.usage());
    for (name, before, after) in [("operator", op0, op_idle), ("route server", rs0, rs_idle)] {
        report.row(
            "1 idle",
            &format!("{name}: resident memory / CPU over {} s", IDLE.as_secs()),
            format!(
                "{:.1} MiB / {:.0} ms",
                after.rss_mib,
                (after.cpu - before.cpu) * 1000.0
            ),
        );
    }

    // (2) N sandboxes, 2 forks each.
    let sandboxes: Api<Sandbox> = Api::all(client.clone());
    let t0 = Instant::now();
    let deadline = t0 + phase_wait;
    let names = (0..n).map(|i| format!("sb-{i:04}"));
    let creates = create_sandboxes(&sandboxes, names, &BASELINES, CLIENTS);
    let keys = tokio::time::timeout(phase_wait, creates)
        .await
        .with_context(|| format!("creating {n} sandboxes took over {phase_wait:?}"))??;
    let created = Instant::now();
    let (first_full, last_full) = wait_watchers(
        &watchers,
        &keys,
        false,
        &mut [&mut op, &mut rs],
        deadline,
        "after the creates",
    )
    .await?;
    let all_ready = wait_sandboxes(&client, n, deadline, "Ready after create", converged).await?;
    let settled = settle(
        &mut op,
        &mut passes,
        n as u64,
        deadline,
        "after the creates",
    )
    .await?;
    let (op2, rs2) = (op_usage(&mut op, &mut passes), rs.usage());
    let op_cpu2 = op2.cpu - op_idle.cpu;
    let p = "2 create";
    report.row(
        p,
        &format!("{n} sandboxes created by {CLIENTS} clients: create calls done"),
        since(t0, created),
    );
    report.row(
        p,
        &format!("Every watcher holds all {n} rules of its baseline (first / last watcher), from the first create"),
        format!("{} / {}", since(t0, first_full), since(t0, last_full)),
    );
    report.row(
        p,
        "From the last create call done to the last watcher holding the full table",
        since(created, last_full),
    );
    report.row(
        p,
        "Every sandbox Ready at its generation / operator settled (last pass ended), from the first create",
        format!("{} / {}", since(t0, all_ready), since(t0, settled)),
    );
    report.row(
        p,
        "Operator passes (ended) over start-up and creates",
        passes.summary(),
    );
    report.row(
        p,
        "Operator CPU per sandbox (first create → settled; its metric reads taken off)",
        format!("{:.1} ms", per(op_cpu2) * 1000.0),
    );
    report.row(
        p,
        "Operator resident memory after / growth per sandbox over idle",
        format!(
            "{:.1} MiB / {:.1} KiB",
            op2.rss_mib,
            per(op2.rss_mib - op_idle.rss_mib) * 1024.0
        ),
    );
    report.row(
        p,
        "Operator's own metric reads so far (bench instrumentation, taken off its CPU figures)",
        format!("{:.0} ms", passes.scrape.as_secs_f64() * 1000.0),
    );
    report.row(
        p,
        "Route server CPU per sandbox (first create → operator settled)",
        format!("{:.2} ms", per(rs2.cpu - rs_idle.cpu) * 1000.0),
    );
    report.row(
        p,
        "Route server resident memory after / growth per sandbox over idle",
        format!(
            "{:.1} MiB / {:.1} KiB",
            rs2.rss_mib,
            per(rs2.rss_mib - rs_idle.rss_mib) * 1024.0
        ),
    );

    // (3a) Operator restart, nothing changed meanwhile.
    let p = "3a operator restart";
    let exit = op.stop().await?;
    op = Component::spawn("operator", &[&kubeconfig])?;
    passes = Passes::new(op.started);
    let deadline = Instant::now() + phase_wait;
    let first_pass = settle(&mut op, &mut passes, n as u64, deadline, "operator restart").await?;
    let op3 = op_usage(&mut op, &mut passes);
    wait_sandboxes(&client, n, deadline, "Ready after the restart", converged).await?;
    report.row(p, "Old operator: SIGTERM → exited", secs(exit));
    report.row(
        p,
        "New operator: start → first full pass over every object ended (last pass of the settling)",
        since(op.started, first_pass),
    );
    report.row(p, "New operator's passes", passes.summary());
    report.row(
        p,
        "New operator: CPU from start to settled, in all / per sandbox",
        format!("{:.2} s / {:.1} ms", op3.cpu, per(op3.cpu) * 1000.0),
    );
    report.row(
        p,
        "New operator: resident memory after its first pass / per sandbox over the first operator's idle",
        format!(
            "{:.1} MiB / {:.1} KiB",
            op3.rss_mib,
            per(op3.rss_mib - op_idle.rss_mib) * 1024.0
        ),
    );

    // (3b) Operator restart with every sandbox's spec changed while none runs: a per-object mark
    // that the new operator's pass reached each sandbox (its status shows the new generation).
    let p = "3b restart + change";
    let exit = op.stop().await?;
    let t_bump = Instant::now();
    let bump = Patch::Merge(json!({"spec": {"description": "changed while no operator ran"}}));
    let bumps = futures_util::stream::iter(0..n)
        .map(|i| {
            let (sandboxes, bump) = (sandboxes.clone(), &bump);
            async move {
                sandboxes
                    .patch(&format!("sb-{i:04}"), &PatchParams::default(), bump)
                    .await
            }
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>();
    tokio::time::timeout(phase_wait, bumps)
        .await
        .context("changing the sandboxes took too long")?
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let bumped = t_bump.elapsed();
    op = Component::spawn("operator", &[&kubeconfig])?;
    passes = Passes::new(op.started);
    let deadline = Instant::now() + phase_wait;
    let all_observed = wait_sandboxes(
        &client,
        n,
        deadline,
        "new generation observed after the restart",
        converged,
    )
    .await?;
    let settled = settle(&mut op, &mut passes, n as u64, deadline, "restart + change").await?;
    let op3b = op_usage(&mut op, &mut passes);
    report.row(
        p,
        "Old operator: SIGTERM → exited / spec change of every sandbox while none ran",
        format!("{} / {}", secs(exit), secs(bumped)),
    );
    report.row(
        p,
        "New operator: start → every sandbox's status at its new generation and Ready / settled",
        format!(
            "{} / {}",
            since(op.started, all_observed),
            since(op.started, settled)
        ),
    );
    report.row(p, "New operator's passes", passes.summary());
    report.row(
        p,
        "New operator: CPU from start to settled, in all / per sandbox; resident memory",
        format!(
            "{:.2} s / {:.1} ms; {:.1} MiB",
            op3b.cpu,
            per(op3b.cpu) * 1000.0,
            op3b.rss_mib
        ),
    );

    // (4) Route server restart: the watchers keep their last table and reconnect by themselves.
    let p = "4 route server restart";
    let exit = rs.stop().await?;
    let deadline = Instant::now() + START_WAIT;
    while watchers.iter().any(Watcher::connected) {
        if Instant::now() > deadline {
            bail!("watchers still connected {START_WAIT:?} after the route server exited");
        }
        tokio::time::sleep(POLL).await;
    }
    rs = Component::spawn("routeserver", &[&kubeconfig, &grpc])?;
    let (serving, _) = rs.expect_line("grpc ").await?;
    let deadline = rs.started + phase_wait;
    let (first_sync, last_sync) = wait_watchers(
        &watchers,
        &keys,
        true,
        &mut [&mut op, &mut rs],
        deadline,
        "after the route server restart",
    )
    .await?;
    let rs4 = rs.usage();
    report.row(p, "Old route server: SIGTERM → exited", secs(exit));
    report.row(
        p,
        "New route server: start → serving (first complete rule set from the API server)",
        since(rs.started, serving),
    );
    report.row(
        p,
        "New route server: start → every watcher resynced and holding the full table (first / last)",
        format!(
            "{} / {}",
            since(rs.started, first_sync),
            since(rs.started, last_sync)
        ),
    );
    report.row(
        p,
        "New route server: CPU from start to the last watcher resynced / resident memory / per sandbox over the first one's idle",
        format!(
            "{:.0} ms / {:.1} MiB / {:.1} KiB",
            rs4.cpu * 1000.0,
            rs4.rss_mib,
            per(rs4.rss_mib - rs_idle.rss_mib) * 1024.0
        ),
    );

    stop.cancel();
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), kubelet).await;
    let (op_exit, rs_exit) = (op.stop().await, rs.stop().await);
    op_exit?;
    rs_exit?;
    drop(api);

    let out = render(&report, n, w, &version, setup)?;
    if write {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/sandbox_scale.md");
        std::fs::write(&path, &out).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    } else {
        println!("\n{out}");
    }
    Ok(())
}
