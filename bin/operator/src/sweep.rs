//! `spur-operator sweep-access`: one pass of the second access sweeper (docs/access.md,
//! "Expiry"), which the chart's CronJob spur-access-sweeper runs under its own ServiceAccount.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};

/// Ends the grants whose time is up and says what it did, one line per grant object.
pub(crate) async fn sweep_access(kubeconfig: Option<PathBuf>) -> Result<ExitCode> {
    let client = spur_bin_support::kube_client(kubeconfig.as_deref()).await?;
    let swept = spur_operator::access::sweep::sweep(&client).await.context(
        "sweeping expired access grants (the sweeper needs the chart's \
             spur-access-sweeper rules: list and delete Roles and RoleBindings, read \
             access requests)",
    )?;
    for e in &swept.ended {
        println!("ended {} {}/{}: {}", e.kind, e.namespace, e.name, e.why);
    }
    println!(
        "{} grant objects ended, {} in effect",
        swept.ended.len(),
        swept.kept
    );
    Ok(ExitCode::SUCCESS)
}
