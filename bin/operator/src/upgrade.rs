//! `spur-operator prepare-upgrade` and `spur-operator apply-crds`: what the chart's hooks run
//! before `helm upgrade` (and, for the CRDs, `helm install`) changes anything
//! (`spur_operator::upgrade` and `spur_operator::crds` say what and why).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use spur_operator::crds;
use spur_operator::upgrade::{Desired, prepare};

/// Prepares the StatefulSets described by `wanted` (`--statefulset`, JSON each) in
/// `namespace`, one line per StatefulSet on stdout.
pub(crate) async fn prepare_upgrade(
    kubeconfig: Option<PathBuf>,
    namespace: String,
    wanted: Vec<String>,
) -> Result<ExitCode> {
    let wanted = wanted
        .iter()
        .map(|w| Desired::parse(w))
        .collect::<Result<Vec<_>, _>>()?;
    let client = spur_bin_support::kube_client(kubeconfig.as_deref()).await?;
    let lines = prepare(&client, &namespace, &wanted)
        .await
        .context("preparing the upgrade (nothing was changed unless a line above says so)")?;
    for line in lines {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Applies the CRDs this binary was built with and migrates stored versions, one line per CRD
/// on stdout.
pub(crate) async fn apply_crds(kubeconfig: Option<PathBuf>) -> Result<ExitCode> {
    let client = spur_bin_support::kube_client(kubeconfig.as_deref()).await?;
    crds::apply(&client, &spur_api::crdgen::crds(), |line| {
        println!("{line}")
    })
    .await
    .context("applying the CRDs (the lines above say what was done before this)")?;
    Ok(ExitCode::SUCCESS)
}
