//! `--intercept`: the sidecar programs its pod's interception rules itself, then gives up root
//! before it opens a socket.
//!
//! An init container that programs the rules costs a pod about a second of start-up: the kubelet
//! notices that an init container has exited only at its next pod-lifecycle relist (once a
//! second). Started as root with `NET_ADMIN`, `NET_RAW`, `SETUID` and `SETGID`, the sidecar runs
//! the same rule code as `spur-init` ([`spur_init::run`]) and then switches to the proxy's uid and
//! gid, which empties its permitted and effective capability sets for good. Only then does it
//! read anything from the network. [`drop_privileges`] checks the result from
//! `/proc/self/status` and refuses to go on if any capability or root id is left.

use std::net::SocketAddr;

use clap::Parser;
use nix::unistd::{Gid, Uid};
use spur_init::InitArgs;

use crate::Error;

/// The rule settings `--intercept` reads: `spur-init`'s own variables (`SPUR_INIT_MODE`,
/// `SPUR_PROXY_UID`, `SPUR_INBOUND_PORTS`, `SPUR_EXCLUDE_INBOUND_PORTS`, `SPUR_INIT_IPV6`).
#[derive(Parser)]
#[command(name = "spur-sidecar")]
struct InitEnv {
    #[command(flatten)]
    init: InitArgs,
}

/// The rules for a sidecar listening on `inbound` (its port is where connections are redirected)
/// with its admin server on `admin` (never redirected), from spur-init's variables.
/// With `outbound` (the sidecar's outbound mode), nothing inbound is redirected and the pod's
/// own outbound TCP goes to `inbound`'s port instead. With `kafka`, the pod's connections to its
/// broker ports go to the Kafka relay's port.
pub fn rules_from_env(
    inbound: SocketAddr,
    admin: SocketAddr,
    outbound: bool,
    kafka: Option<&crate::kafka::KafkaConfig>,
) -> Result<(spur_init::Config, u32), Error> {
    let mut args = InitEnv::try_parse_from(["spur-sidecar"])
        .map_err(|e| Error::Config(format!("--intercept: {e}")))?
        .init;
    args.proxy_port = inbound.port();
    if outbound {
        args.inbound_ports = "none".into();
        args.outbound_port = Some(inbound.port());
    }
    args.exclude_inbound_ports = format!("{},{}", args.exclude_inbound_ports, admin.port());
    // The sidecar's own flags win over the variables spur-init reads (they are the same ones
    // unless a flag was given).
    match kafka {
        Some(k) => {
            args.kafka_ports = k
                .ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(",");
            args.kafka_proxy_port = k.listen_port;
        }
        None => args.kafka_ports.clear(),
    }
    let uid = args.proxy_uid;
    if uid == 0 {
        return Err(Error::Config(
            "--intercept: SPUR_PROXY_UID must be a non-root uid (the sidecar runs as it once the rules are in place)".into(),
        ));
    }
    let config = spur_init::Config::try_from(args).map_err(|e| Error::Config(e.to_string()))?;
    Ok((config, uid))
}

/// Programs the rules, then drops to `uid` (see the module docs). Call it before any other
/// thread exists: the ids of a process are changed thread by thread underneath.
pub fn intercept_then_drop(rules: &spur_init::Config, uid: u32) -> Result<(), Error> {
    if !Uid::effective().is_root() {
        return Err(Error::Privileges(format!(
            "--intercept needs the sidecar to start as root (securityContext runAsUser: 0, with \
             capabilities NET_ADMIN, NET_RAW, SETUID and SETGID); it runs as uid {} (after the \
             rules are in place it runs as uid {uid} without capabilities)",
            Uid::effective()
        )));
    }
    spur_init::run(rules).map_err(Error::Intercept)?;
    drop_privileges(uid)
}

/// Switches every id to `uid` (gid the same number), clears the supplementary groups and sets
/// no_new_privs, then verifies from `/proc/self/status` that no capability is left.
pub fn drop_privileges(uid: u32) -> Result<(), Error> {
    let fail = |what: &str, e: nix::Error| {
        Error::Privileges(format!(
            "cannot {what} (the container needs capabilities SETUID and SETGID): {e}"
        ))
    };
    let (u, g) = (Uid::from_raw(uid), Gid::from_raw(uid));
    nix::unistd::setgroups(&[]).map_err(|e| fail("clear the supplementary groups", e))?;
    nix::unistd::setresgid(g, g, g).map_err(|e| fail(&format!("switch to gid {uid}"), e))?;
    nix::unistd::setresuid(u, u, u).map_err(|e| fail(&format!("switch to uid {uid}"), e))?;
    nix::sys::prctl::set_no_new_privs().map_err(|e| fail("set no_new_privs", e))?;
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| Error::Privileges(format!("cannot read /proc/self/status: {e}")))?;
    check_dropped(&status, uid)
}

/// `Ok` when `status` (a `/proc/<pid>/status` text) shows every uid and gid equal to `uid` and
/// empty permitted, effective and ambient capability sets.
pub fn check_dropped(status: &str, uid: u32) -> Result<(), Error> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .ok_or_else(|| Error::Privileges(format!("no {name} line in /proc/self/status")))
    };
    for ids in ["Uid:", "Gid:"] {
        let line = field(ids)?;
        if !line.split_whitespace().all(|id| id == uid.to_string()) {
            return Err(Error::Privileges(format!(
                "after dropping privileges {ids} is {line:?}, expected {uid} throughout"
            )));
        }
    }
    for caps in ["CapPrm:", "CapEff:", "CapAmb:"] {
        let hex = field(caps)?;
        if u64::from_str_radix(hex, 16) != Ok(0) {
            return Err(Error::Privileges(format!(
                "after dropping privileges {caps} is {hex}, expected no capabilities"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const DROPPED: &str = "Name:\tspur-sidecar\nUid:\t15337\t15337\t15337\t15337\nGid:\t15337\t15337\t15337\t15337\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t00000000000034c0\nCapAmb:\t0000000000000000\n";

    #[test]
    fn only_a_complete_drop_passes() {
        check_dropped(DROPPED, 15337).unwrap();
        let root_left = DROPPED.replace("Uid:\t15337\t15337\t15337", "Uid:\t15337\t0\t15337");
        assert!(check_dropped(&root_left, 15337).is_err());
        let caps_left = DROPPED.replace("CapEff:\t0000000000000000", "CapEff:\t0000000000001000");
        let e = check_dropped(&caps_left, 15337).unwrap_err().to_string();
        assert!(e.contains("CapEff"), "{e}");
        assert!(check_dropped("Name:\tx\n", 15337).is_err());
    }
}
