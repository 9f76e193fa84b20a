//! What Spur's binaries share around their own code: `main`'s runtime, logging and error exit
//! ([`run`]), and the Kubernetes client their `--kubeconfig` flags name ([`kube_client`],
//! feature `kube`). Each binary keeps its own flags and its own choice of runtime and log level.

use std::future::Future;
use std::process::ExitCode;

/// The Tokio runtime a binary runs on.
#[derive(Clone, Copy, Debug)]
pub enum Runtime {
    /// One thread: for tunnels, whose QUIC driver, endpoint and stream copies hand each packet
    /// to one another. On one thread those hand-offs are plain function calls; across a
    /// work-stealing pool they are cross-core wake-ups. On the tunnel benchmark one thread moved
    /// more per CPU second at both ends (docs/local.md).
    CurrentThread,
    /// A thread per core: the other servers.
    MultiThread,
}

/// Sets up logging (`SPUR_LOG` or `RUST_LOG`, else `log_default`), runs `main` on `runtime` and
/// turns an error into a line on stderr, prefixed with `name`, and a failing exit code.
pub fn run<F>(name: &str, log_default: &str, runtime: Runtime, main: F) -> ExitCode
where
    F: Future<Output = anyhow::Result<ExitCode>>,
{
    spur_runtime::init_tracing(log_default);
    let mut builder = match runtime {
        Runtime::CurrentThread => tokio::runtime::Builder::new_current_thread(),
        Runtime::MultiThread => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(main) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A Kubernetes client from `kubeconfig`, or else $KUBECONFIG, ~/.kube/config or the in-cluster
/// service account (kube's inference order: a kubeconfig first).
#[cfg(feature = "kube")]
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    use anyhow::Context;
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster, $KUBECONFIG or ~/.kube/config)")?,
    };
    kube::Client::try_from(config).context("cannot build a Kubernetes client")
}
