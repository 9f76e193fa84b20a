//! Leader election (spur_controller::leader) against a real kube-apiserver: a leader cut off
//! from the API server ends its term before its lease expires, so the standby that takes the
//! lease then never runs beside it (kube-lease-manager alone keeps saying "leader" while it
//! cannot renew); a healed former leader stays a standby; a graceful stop hands over at once.
//! And the jobs component under the chart's RBAC: of two replicas one leads, its
//! `spur_jobs_leader` says so, the Lease names it and is owned by the StatefulSet, and the other
//! takes over when it stops.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use spur_controller::leader::{Election, run_elected};
use spur_e2e::kube::{self as kt, SYSTEM_NAMESPACE};
use spur_kube_harness::KubeApi;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A TCP relay on loopback in front of the API server that the test can cut (every connection
/// closed, new ones refused) and heal: a network partition of one client.
struct Relay {
    addr: std::net::SocketAddr,
    cut: watch::Sender<bool>,
    stop: CancellationToken,
}

impl Relay {
    async fn start(upstream: std::net::SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let stop = CancellationToken::new();
        let (cut_tx, stop_rx) = (cut.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (mut down, _) = tokio::select! {
                    () = stop_rx.cancelled() => return,
                    r = listener.accept() => r.unwrap(),
                };
                let mut is_cut = cut_tx.subscribe();
                if *is_cut.borrow() {
                    continue;
                }
                let stop = stop_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = is_cut.wait_for(|c| *c) => {}
                        () = stop.cancelled() => {}
                    }
                });
            }
        });
        Relay { addr, cut, stop }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One term: who ran it, from when to when.
#[derive(Debug, Clone)]
struct Term {
    who: &'static str,
    start: Instant,
    end: Option<Instant>,
}

type Terms = Arc<Mutex<Vec<Term>>>;

/// An elector that records its terms in `terms` (start when the term starts, end when its token
/// is cancelled: the moment it must stop acting).
fn elect(
    client: kube::Client,
    who: &'static str,
    terms: &Terms,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let election = Election::new(SYSTEM_NAMESPACE, "leader-test", who, 4, "leader-test");
    let (terms, stop) = (terms.clone(), stop.clone());
    tokio::spawn(async move {
        let record = terms.clone();
        run_elected(
            client,
            election,
            stop,
            |_| {},
            move |token: CancellationToken| {
                let terms = record.clone();
                async move {
                    let i = {
                        let mut t = terms.lock().unwrap();
                        t.push(Term {
                            who,
                            start: Instant::now(),
                            end: None,
                        });
                        t.len() - 1
                    };
                    token.cancelled().await;
                    terms.lock().unwrap()[i].end = Some(Instant::now());
                }
            },
        )
        .await
        .unwrap();
    })
}

fn leading(terms: &Terms) -> Vec<&'static str> {
    terms
        .lock()
        .unwrap()
        .iter()
        .filter(|t| t.end.is_none())
        .map(|t| t.who)
        .collect()
}

/// No two terms overlap: each ends before the next one starts.
fn assert_no_overlap(terms: &Terms) {
    let mut t = terms.lock().unwrap().clone();
    t.sort_by_key(|t| t.start);
    for pair in t.windows(2) {
        let end = pair[0].end.expect("a term before another ended");
        assert!(
            end <= pair[1].start,
            "two leaders at once: {:?} ran until {:?} after {:?} started",
            pair[0].who,
            end - pair[1].start,
            pair[1].who
        );
    }
}

async fn until_leading(terms: &Terms, who: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while leading(terms) != [who] {
        assert!(
            Instant::now() < deadline,
            "{who} does not lead within {within:?}: {:?}",
            terms.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_stops_before_a_standby_takes_over() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    let admin = api.client();
    kt::ensure_namespace_unenrolled(&admin, SYSTEM_NAMESPACE)
        .await
        .unwrap();
    let upstream: std::net::SocketAddr = api
        .url()
        .trim_start_matches("https://")
        .parse()
        .expect("the API server listens on an IP address");
    let relay = Relay::start(upstream).await;
    let mut cfg = api.config();
    cfg.cluster_url = format!("https://{}", relay.addr).parse().unwrap();
    let behind_relay = kube::Client::try_from(cfg).unwrap();

    let terms: Terms = Arc::default();
    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    let a = elect(behind_relay, "a", &terms, &stop_a);
    until_leading(&terms, "a", Duration::from_secs(20)).await;
    let b = elect(admin.clone(), "b", &terms, &stop_b);
    // A renews: b stays a standby over more than one lease duration.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(leading(&terms), ["a"], "{:?}", terms.lock().unwrap());

    // Cut a off: its renewals fail, and its term must end before b takes the lease.
    let cut_at = Instant::now();
    relay.set_cut(true);
    until_leading(&terms, "b", Duration::from_secs(20)).await;
    let fenced = {
        let t = terms.lock().unwrap();
        t[0].end.expect("a's term ended") - cut_at
    };
    assert_no_overlap(&terms);
    // The lease (4 s) expires at most 4 s after the cut; the term ends half the grace before.
    assert!(
        fenced <= Duration::from_millis(3_600),
        "a's term ended {fenced:?} after the cut"
    );

    // Healed, a sees b's lease and stays a standby.
    relay.set_cut(false);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(leading(&terms), ["b"], "{:?}", terms.lock().unwrap());

    // b stops gracefully: it releases the lease and a takes over.
    stop_b.cancel();
    b.await.unwrap();
    until_leading(&terms, "a", Duration::from_secs(15)).await;
    assert_no_overlap(&terms);
    let whos: Vec<_> = terms.lock().unwrap().iter().map(|t| t.who).collect();
    assert_eq!(whos, ["a", "b", "a"]);
    stop_a.cancel();
    a.await.unwrap();
    assert!(leading(&terms).is_empty());
    // The lease is free for the next one at once.
    let lease = Api::<Lease>::namespaced(admin, SYSTEM_NAMESPACE)
        .get("leader-test")
        .await
        .unwrap();
    assert_eq!(lease.spec.and_then(|s| s.holder_identity), None);
    println!("a partitioned leader's term ended {fenced:?} after the cut; b took over after");
}

/// The `spur_jobs_leader` sample of `registry`'s text.
fn leader_sample(registry: &prometheus_client::registry::Registry) -> i64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    spur_e2e::sample(&text, "spur_jobs_leader") as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_component_leads_alone_under_the_chart_rbac() {
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let admin = api.client();
    let jobs = kt::jobs_client(&api).await.unwrap();
    // The StatefulSet the chart runs the component as: it owns the Lease.
    let sts: StatefulSet = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "spur-jobs", "namespace": SYSTEM_NAMESPACE},
        "spec": {
            "serviceName": "spur-jobs",
            "selector": {"matchLabels": {"app": "spur-jobs"}},
            "template": {
                "metadata": {"labels": {"app": "spur-jobs"}},
                "spec": {"containers": [{"name": "jobs", "image": "spur"}]}
            }
        }
    }))
    .unwrap();
    let sts = Api::<StatefulSet>::namespaced(admin.clone(), SYSTEM_NAMESPACE)
        .create(&PostParams::default(), &sts)
        .await
        .unwrap();
    let store = tempfile::tempdir().unwrap();

    // Two replicas, as two components in this process.
    let mut replicas = Vec::new();
    for who in ["jobs-a", "jobs-b"] {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = spur_jobs::Metrics::register(&mut registry);
        let cfg = spur_jobs::Config {
            namespace: SYSTEM_NAMESPACE.into(),
            executor_image: "spur".into(),
            executor_pull_policy: None,
            store_dir: store.path().join(who),
            objects: spur_jobs::objects::Objects::Local,
            max_log_bytes: 1 << 20,
            max_artifact_bytes: 1 << 20,
            max_namespace_bytes: 1 << 24,
            retention: Duration::from_secs(3600),
            max_attempts: 3,
            owner_statefulset: Some("spur-jobs".into()),
            routing_headers: Vec::new(),
        };
        let (ctx, wakeups) = spur_jobs::Context::new(jobs.clone(), cfg, metrics)
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let election = Election::new(SYSTEM_NAMESPACE, "spur-jobs", who, 4, "ignored");
        let task = tokio::spawn(spur_jobs::run_as(
            ctx,
            wakeups,
            stop.clone(),
            Some(election),
        ));
        replicas.push((who, registry, stop, task));
        if replicas.len() == 1 {
            kt::eventually("the first replica to lead", || async {
                (leader_sample(&replicas[0].1) == 1).then_some(())
            })
            .await;
        }
    }
    let leases = Api::<Lease>::namespaced(admin.clone(), SYSTEM_NAMESPACE);
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    // The standby stays one for over a lease duration.
    for _ in 0..12 {
        let samples: Vec<i64> = replicas.iter().map(|r| leader_sample(&r.1)).collect();
        assert_eq!(samples, [1, 0], "spur_jobs_leader of jobs-a, jobs-b");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let lease = leases.get("spur-jobs").await.unwrap();
    assert_eq!(holder(&lease).as_deref(), Some("jobs-a"));
    assert!(
        lease
            .metadata
            .owner_references
            .unwrap_or_default()
            .iter()
            .any(|o| Some(&o.uid) == sts.metadata.uid.as_ref()),
        "the StatefulSet owns the jobs Lease"
    );

    // The leader stops (its pod is deleted): the standby leads at once, never beside it.
    let (_, first_registry, first_stop, first_task) = replicas.remove(0);
    let stopped = Instant::now();
    first_stop.cancel();
    first_task.await.unwrap().unwrap();
    assert_eq!(leader_sample(&first_registry), 0);
    kt::eventually("jobs-b to lead", || async {
        (leader_sample(&replicas[0].1) == 1).then_some(())
    })
    .await;
    let handover = stopped.elapsed();
    assert_eq!(
        holder(&leases.get("spur-jobs").await.unwrap()).as_deref(),
        Some("jobs-b")
    );
    // Released on a graceful stop and read by the standby within half a second: well within
    // the lease duration (4 s) a crash would take.
    assert!(
        handover < Duration::from_secs(3),
        "hand-over took {handover:?}"
    );
    let (_, _, stop, task) = replicas.remove(0);
    stop.cancel();
    task.await.unwrap().unwrap();
    println!("jobs: hand-over to the standby took {handover:?}");
}

/// Replicas of one StatefulSet starting together (an upgrade from one replica to two) each add
/// the StatefulSet to the owners of a CA Secret an earlier release made without one: the patches
/// race, and a replica that loses the race must find the owner there and start, not fail with a
/// conflict (and crash-loop once) or drop an owner another added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_share_the_jobs_ca_and_its_owner() {
    use k8s_openapi::api::core::v1::Secret;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    kt::capture_logs();
    let api = KubeApi::start().await.unwrap();
    kt::install_crds(&api).await.unwrap();
    let jobs = kt::jobs_client(&api).await.unwrap();
    let first = spur_jobs::pki::JobsPki::load_or_create(&jobs, SYSTEM_NAMESPACE, None)
        .await
        .unwrap();
    let owner = OwnerReference {
        api_version: "apps/v1".into(),
        kind: "StatefulSet".into(),
        name: "spur-jobs".into(),
        uid: "6d1f3c0e-5b1a-4f7e-9a53-0c2b8f1e7d42".into(),
        ..Default::default()
    };
    let starts = (0..6).map(|_| {
        let (jobs, owner) = (jobs.clone(), owner.clone());
        tokio::spawn(async move {
            spur_jobs::pki::JobsPki::load_or_create(&jobs, SYSTEM_NAMESPACE, Some(&owner)).await
        })
    });
    for start in futures_util::future::join_all(starts).await {
        let pki = start.unwrap().expect("a replica starting beside others");
        assert_eq!(pki.ca_pem(), first.ca_pem(), "one CA for every replica");
    }
    let secrets = Api::<Secret>::namespaced(api.client(), SYSTEM_NAMESPACE);
    let mut found = 0;
    for s in secrets.list(&Default::default()).await.unwrap() {
        let owners = s.metadata.owner_references.unwrap_or_default();
        if owners.iter().any(|o| o.uid == owner.uid) {
            found += 1;
            assert_eq!(owners.len(), 1, "{owners:?}");
        }
    }
    assert_eq!(found, 1, "the CA Secret, owned once by the StatefulSet");
}
