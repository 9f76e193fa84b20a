//! The README's first command: `spur-demo` brings the demo up and the commands it prints show
//! keyed requests reaching the fork and the rest reaching the baseline.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test]
async fn demo_check_passes() {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-demo"))
            .args(["--check", "--port-base", "0"])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("demo check passed"), "{stdout}");
    assert_eq!(
        stdout.matches("\nok ").count() + usize::from(stdout.starts_with("ok ")),
        11,
        "{stdout}"
    );
}

/// Runs every command the demo prints and checks each lands where its section says.
#[tokio::test]
async fn printed_commands_show_the_routing() {
    assert!(
        std::process::Command::new("curl")
            .arg("--version")
            .output()
            .is_ok(),
        "curl is required (the test script installs it: apt-get install -y curl)"
    );
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-demo"))
        .args(["--port-base", "0"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut commands: Vec<(String, String)> = Vec::new();
    let mut section = String::new();
    let read = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if !line.starts_with(' ') && line.ends_with(':') {
                section = line.clone();
            } else if let Some(cmd) = line.strip_prefix("  ")
                && (cmd.starts_with("curl ") || cmd.contains(" call --addr "))
            {
                commands.push((section.clone(), cmd.to_string()));
            }
            if line.contains("/metrics") {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("demo printed no instructions");
    let mut checked = 0;
    for (section, cmd) in &commands {
        let want = if section.contains("reach the fork") {
            "fork"
        } else if section.contains("baseline") {
            "baseline"
        } else {
            continue;
        };
        let out = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{cmd}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let other = if want == "fork" { "baseline" } else { "fork" };
        assert!(
            stdout.contains(&format!("from {want}")),
            "{cmd} printed {stdout:?}, expected {want}"
        );
        assert!(
            !stdout.contains(&format!("from {other}")),
            "{cmd} printed {stdout:?}"
        );
        checked += 1;
    }
    assert!(
        checked >= 9,
        "only {checked} commands checked: {commands:?}"
    );
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "demo exited with {exit}");
}

/// `--kafka` with no broker there: the demo names the address and what to check, and exits
/// non-zero instead of waiting (no JVM needed: nothing listens on the port).
#[tokio::test]
async fn a_broker_that_is_not_there_is_named() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = free.local_addr().unwrap().to_string();
    drop(free);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_spur-demo"))
            .args(["--check", "--port-base", "0", "--kafka", &addr])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&addr) && stderr.contains("is it running?"),
        "{stderr}"
    );
}
