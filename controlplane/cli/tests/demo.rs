//! `spur demo` runs the standalone demo of `spur-demo` (tested in full there): the CLI's wrapper
//! brings it up and its check passes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

#[tokio::test]
async fn spur_demo_check_passes() {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_spur"))
            .args(["demo", "--check", "--port-base", "0"])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("demo check passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
