//! A person upgrading runs `spur routeserver ...` as before: the command is gone from `spur`
//! (each server role is a binary of its own), and the error names the binary to run instead,
//! with the same arguments; the roles are not listed in `spur --help`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

const SPUR: &str = env!("CARGO_BIN_EXE_spur");

#[test]
fn an_old_role_command_names_its_new_binary() {
    for (old, new) in [
        (
            &["routeserver", "--kubernetes"][..],
            "spur-routeserver --kubernetes",
        ),
        (
            &["gateway", "--config", "l4.yaml"],
            "spur-gateway --config l4.yaml",
        ),
        (&["operator"], "spur-operator"),
        (&["tunnel-proxy", "--help"], "spur-tunnel-proxy --help"),
        (
            &["hub", "cluster", "add", "east"],
            "spur-hub cluster add east",
        ),
        (&["agent"], "spur-agent"),
        (&["jobs", "serve"], "spur-jobs serve"),
        (&["ics", "serve"], "spur-ics serve"),
        (&["traffic-store", "serve"], "spur-traffic-store serve"),
        // The access sweeper is the operator's now; no cluster is asked first.
        (
            &["access", "--kubeconfig", "/nonexistent", "sweep"],
            "spur-operator sweep-access",
        ),
    ] {
        let out = Command::new(SPUR).args(old).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "spur {old:?}: {stderr}");
        assert!(
            stderr.contains(&format!("run `{new}`")),
            "spur {old:?}: {stderr}"
        );
    }
    let help = Command::new(SPUR).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("demo") && help.contains("local"), "{help}");
    for role in [
        "routeserver",
        "operator",
        "tunnel-proxy",
        "traffic-store",
        "agent",
    ] {
        assert!(!help.contains(role), "spur --help lists {role}: {help}");
    }
}
