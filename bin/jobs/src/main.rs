//! `spur-jobs serve`: the jobs component (docs/jobs.md): the Job and JobRunnerGroup
//! controllers, the log and artifact store, and the aggregated API `jobs.spur.dev` that serves
//! logs and artifacts through the Kubernetes API server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use prometheus_client::registry::Registry;
use spur_bin_support::Runtime;
use tokio_util::sync::CancellationToken;

/// The jobs component: Job and JobRunnerGroup controllers, log and artifact store, aggregated
/// API (docs/jobs.md).
#[derive(Parser)]
#[command(name = "spur-jobs", version)]
struct JobsArgs {
    #[command(subcommand)]
    command: JobsCommand,
}

#[derive(Subcommand)]
enum JobsCommand {
    /// Run the Job and JobRunnerGroup controllers, the log and artifact store and the
    /// aggregated API that serves them.
    Serve(Box<ServeArgs>),
}

/// Sealed logs and artifacts in an S3 (or S3-compatible) bucket instead of the volume. The
/// credentials come from the environment only (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, or a web identity token, container or instance role).
#[derive(Args)]
struct S3Args {
    /// The bucket (it must exist; the component never creates or deletes one).
    #[arg(long, env = "SPUR_JOBS_S3_BUCKET")]
    s3_bucket: Option<String>,
    /// Keys go under this prefix, so installations can share a bucket.
    #[arg(
        long,
        env = "SPUR_JOBS_S3_PREFIX",
        default_value = "",
        requires = "s3_bucket"
    )]
    s3_prefix: String,
    /// The server's URL, https://host[:port] (default: AWS S3 of the region).
    #[arg(long, env = "SPUR_JOBS_S3_ENDPOINT", requires = "s3_bucket")]
    s3_endpoint: Option<String>,
    /// The region (default: AWS_REGION, else us-east-1).
    #[arg(long, env = "SPUR_JOBS_S3_REGION", requires = "s3_bucket")]
    s3_region: Option<String>,
    /// Allow an http:// endpoint (requests and their signatures in plaintext).
    #[arg(long, requires = "s3_bucket")]
    s3_allow_http: bool,
    /// Virtual-hosted-style addressing (bucket.host), as AWS wants; default path style.
    #[arg(long, requires = "s3_bucket")]
    s3_virtual_hosted: bool,
    /// PEM CA certificates the endpoint's certificate is checked against, besides the system's.
    #[arg(long, env = "SPUR_JOBS_S3_CA_FILE", requires = "s3_bucket")]
    s3_ca_file: Option<PathBuf>,
}

impl S3Args {
    fn objects(&self) -> spur_jobs::objects::Objects {
        use spur_jobs::objects::{Objects, S3};
        match &self.s3_bucket {
            None => Objects::Local,
            Some(bucket) => Objects::S3(S3 {
                bucket: bucket.clone(),
                prefix: self.s3_prefix.clone(),
                endpoint: self.s3_endpoint.clone().filter(|s| !s.is_empty()),
                region: self.s3_region.clone().filter(|s| !s.is_empty()),
                allow_http: self.s3_allow_http,
                virtual_hosted: self.s3_virtual_hosted,
                ca_file: self.s3_ca_file.clone(),
                credentials: None,
            }),
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    /// The component's namespace (the jobs CA Secret lives there).
    #[arg(long, env = "POD_NAMESPACE", default_value = "spur-system")]
    namespace: String,
    /// The Service in front of the aggregated API (its certificate names it).
    #[arg(long, default_value = "spur-jobs")]
    service: String,
    /// Image of the runner pods' init container (Spur's image, with spur-job-executor).
    #[arg(long)]
    executor_image: String,
    /// Its imagePullPolicy.
    #[arg(long)]
    executor_pull_policy: Option<String>,
    /// The component's volume: running attempts' log spools, and sealed logs and artifacts
    /// unless --s3-bucket keeps those in a bucket.
    #[arg(long, default_value = "/var/lib/spur-jobs")]
    store_dir: PathBuf,
    #[command(flatten)]
    s3: S3Args,
    /// Output beyond this many bytes per attempt is dropped.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    max_log_bytes: u64,
    /// Artifacts beyond this many bytes per attempt are not kept.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    max_artifact_bytes: u64,
    /// What one namespace's jobs may keep in the store, logs and artifacts of all its jobs
    /// together; output and artifacts past it are not kept (the attempt's status says so).
    #[arg(long, default_value_t = 1024 * 1024 * 1024)]
    max_namespace_bytes: u64,
    /// Finished jobs, with their logs and artifacts, are deleted this long after they end.
    #[arg(long, default_value = "168h", value_parser = spur_runtime::parse_duration)]
    retention: Duration,
    /// Attempts a job gets when its runner pods are lost.
    #[arg(long, default_value_t = 3)]
    max_attempts: i32,
    /// The component's own StatefulSet: it owns the jobs CA Secret, so uninstalling removes it.
    #[arg(long)]
    owner_statefulset: Option<String>,
    /// A custom header `Auto` jobs' requests carry their routing key in, besides the standard
    /// carriers (repeatable; comma-separated in the env var): the cluster's custom carriers.
    #[arg(
        long = "routing-header",
        env = "SPUR_ROUTING_HEADERS",
        value_delimiter = ','
    )]
    routing_headers: Vec<String>,
    /// The aggregated API's address.
    #[arg(long, default_value = "0.0.0.0:8443")]
    api_addr: SocketAddr,
    /// Serve no aggregated API (logs and artifacts are kept but not served).
    #[arg(long)]
    no_api: bool,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// Run the controllers without holding the lease (only for a single replica).
    #[arg(long, env = "SPUR_NO_LEADER_ELECT")]
    no_leader_elect: bool,
    /// Name of the leader-election Lease (in --namespace).
    #[arg(long, env = "SPUR_LEASE_NAME", default_value = "spur-jobs")]
    lease_name: String,
    /// Seconds the lease stays valid without renewal; a crashed leader is replaced after it.
    #[arg(long, env = "SPUR_LEASE_DURATION", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=3600))]
    lease_duration: u64,
    /// This replica's name, its identity in the lease (the chart sets the pod's name; default:
    /// the host name and process id).
    #[arg(long, env = "POD_NAME")]
    instance: Option<String>,
    /// Kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "SPUR_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
}

async fn jobs(args: JobsArgs) -> Result<ExitCode> {
    let JobsCommand::Serve(args) = args.command;
    let shutdown = spur_runtime::shutdown_signal();
    let client = spur_bin_support::kube_client(args.kubeconfig.as_deref()).await?;
    client
        .apiserver_version()
        .await
        .context("cannot reach the Kubernetes API server")?;
    let mut registry = Registry::default();
    let metrics = spur_jobs::Metrics::register(&mut registry);
    let stop = CancellationToken::new();
    let cfg = spur_jobs::Config {
        namespace: args.namespace.clone(),
        executor_image: args.executor_image.clone(),
        executor_pull_policy: args.executor_pull_policy.clone().filter(|s| !s.is_empty()),
        store_dir: args.store_dir.clone(),
        objects: args.s3.objects(),
        max_log_bytes: args.max_log_bytes,
        max_artifact_bytes: args.max_artifact_bytes,
        max_namespace_bytes: args.max_namespace_bytes,
        retention: args.retention,
        max_attempts: args.max_attempts,
        owner_statefulset: args.owner_statefulset.clone(),
        routing_headers: args.routing_headers.clone(),
    };
    let cfg_objects = cfg.objects.describe(&cfg.store_dir);
    let (ctx, wakeups) = spur_jobs::Context::new(client.clone(), cfg, metrics)
        .await
        .context("starting the jobs component")?;

    let api = if args.no_api {
        None
    } else {
        let fp = spur_jobs::api::FrontProxy::load(&client)
            .await
            .context("reading the API server's front-proxy CA (kube-system/extension-apiserver-authentication)")?;
        let names = spur_jobs::api::service_names(&args.service, &args.namespace);
        let serving = ctx.pki.serving(&names)?;
        let tls = spur_jobs::api::tls_config(&serving.cert, &serving.key, &fp)?;
        spur_jobs::api::sync_api_service(&client, ctx.pki.ca_pem()).await?;
        let listener = tokio::net::TcpListener::bind(args.api_addr)
            .await
            .with_context(|| format!("cannot bind the API address {}", args.api_addr))?;
        Some(tokio::spawn(spur_jobs::api::serve(
            ctx.clone(),
            listener,
            tls,
            fp,
            stop.clone(),
        )))
    };
    let listener = spur_serving::health::bind_health(args.metrics_addr).await?;
    let http = tokio::spawn(spur_serving::health::serve_health(
        listener,
        registry,
        None,
        stop.clone(),
    ));
    let election = (!args.no_leader_elect).then(|| {
        let identity = args
            .instance
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| {
                let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "spur-jobs".into());
                format!("{host}-{}", std::process::id())
            });
        spur_jobs::Election::new(
            &args.namespace,
            &args.lease_name,
            identity,
            args.lease_duration,
            "spur-jobs-lease",
        )
    });
    let controllers = tokio::spawn(spur_jobs::run_as(ctx, wakeups, stop.clone(), election));
    tracing::info!(api = %args.api_addr, metrics = %args.metrics_addr, volume = %args.store_dir.display(), objects = %cfg_objects, "jobs component started");
    let mut controllers = controllers;
    // The controllers end early only when the election cannot start or its lease manager
    // stops: the component then exits with that error rather than serve without them.
    let early = tokio::select! {
        () = shutdown => None,
        r = &mut controllers => Some(r),
    };
    tracing::info!(
        "shutting down (running attempts go on in their pods and are resumed on the next start)"
    );
    stop.cancel();
    let ended = match early {
        Some(r) => Some(r),
        None => tokio::time::timeout(Duration::from_secs(15), controllers)
            .await
            .ok(),
    };
    if let Some(api) = api {
        let _ = api.await;
    }
    http.await.context("metrics server panicked")??;
    if let Some(r) = ended {
        r.context("controllers panicked")?
            .context("the controllers stopped")?;
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = JobsArgs::parse();
    spur_bin_support::run("spur-jobs", "info", Runtime::MultiThread, jobs(args))
}
