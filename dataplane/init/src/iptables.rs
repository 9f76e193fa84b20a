//! iptables-legacy rules: `iptables-restore --noflush` scripts for the nat table.
//!
//! spur-init owns two chains, [`INBOUND_CHAIN`] and [`OUTPUT_CHAIN`]; naming them in a restore
//! script with `--noflush` creates or flushes them, so every run rebuilds their contents from
//! scratch. The two jumps into them from the built-in chains are added only when the current
//! ruleset (`iptables-save -t nat`) lacks them, so a second run leaves the same ruleset. Rules are
//! written exactly as `iptables-save` prints them, which is what makes that check a line match.

use crate::{Ports, Rules};

/// Inbound TCP to redirected ports: excluded ports return, the rest go to the proxy port.
pub const INBOUND_CHAIN: &str = "SPUR_INBOUND";
/// Locally generated TCP: the pod calling its own address over `lo` is treated as inbound,
/// except connections of the proxy's uid.
pub const OUTPUT_CHAIN: &str = "SPUR_OUTPUT";

/// The jumps from the built-in chains into ours.
const JUMPS: [&str; 2] = [
    "-A PREROUTING -p tcp -j SPUR_INBOUND",
    "-A OUTPUT -p tcp -j SPUR_OUTPUT",
];

/// An address family; each has its own tools and its own nat table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn save_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables-legacy-save",
            Family::V6 => "ip6tables-legacy-save",
        }
    }

    pub fn restore_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables-legacy-restore",
            Family::V6 => "ip6tables-legacy-restore",
        }
    }

    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }
}

/// The families to program: IPv4, plus IPv6 when enabled.
pub fn families(ipv6: bool) -> &'static [Family] {
    if ipv6 {
        &[Family::V4, Family::V6]
    } else {
        &[Family::V4]
    }
}

/// The restore script that installs `rules` for `family`. `current` is the output of
/// `iptables-save -t nat`; the jumps it already has are not added again. `None` lists every jump
/// (a dry run, which reads nothing).
pub fn apply_script(family: Family, rules: &Rules, current: Option<&str>) -> String {
    let mut lines = vec![
        "*nat".to_owned(),
        format!(":{INBOUND_CHAIN} - [0:0]"),
        format!(":{OUTPUT_CHAIN} - [0:0]"),
    ];
    let proxy = rules.proxy_port;
    match &rules.inbound {
        Ports::All => {
            for port in &rules.exclude {
                lines.push(format!(
                    "-A {INBOUND_CHAIN} -p tcp -m tcp --dport {port} -j RETURN"
                ));
            }
            lines.push(format!(
                "-A {INBOUND_CHAIN} -p tcp -j REDIRECT --to-ports {proxy}"
            ));
        }
        Ports::Only(_) => {
            for port in rules.listed_ports().unwrap_or_default() {
                lines.push(format!(
                    "-A {INBOUND_CHAIN} -p tcp -m tcp --dport {port} -j REDIRECT --to-ports {proxy}"
                ));
            }
        }
    }
    lines.push(format!(
        "-A {OUTPUT_CHAIN} -m owner --uid-owner {} -j RETURN",
        rules.proxy_uid
    ));
    lines.push(format!(
        "-A {OUTPUT_CHAIN} ! -d {} -o lo -j {INBOUND_CHAIN}",
        family.loopback()
    ));
    for port in &rules.kafka_ports {
        // The pod's connections to Kafka brokers, to the sidecar's Kafka relay.
        lines.push(format!(
            "-A {OUTPUT_CHAIN} -p tcp -m tcp --dport {port} -j REDIRECT --to-ports {}",
            rules.kafka_proxy_port
        ));
    }
    if let Some(port) = rules.outbound_port {
        // Everything else the pod sends over TCP, loopback aside, to the outbound proxy.
        lines.push(format!("-A {OUTPUT_CHAIN} -o lo -j RETURN"));
        lines.push(format!(
            "-A {OUTPUT_CHAIN} -p tcp -j REDIRECT --to-ports {port}"
        ));
    }
    for jump in JUMPS {
        if !current.is_some_and(|c| c.lines().any(|l| l.trim_end() == jump)) {
            lines.push(jump.to_owned());
        }
    }
    lines.push("COMMIT".to_owned());
    lines.join("\n") + "\n"
}

/// The restore script that removes everything spur-init installed from the ruleset `current`
/// (`iptables-save -t nat` output): every rule of a built-in chain that jumps to one of our
/// chains, then the chains. `None` if there is nothing to remove. Without `current` (a dry run)
/// it lists what a default installation has.
pub fn cleanup_script(current: Option<&str>) -> Option<String> {
    let ours = [INBOUND_CHAIN, OUTPUT_CHAIN];
    let (deletes, chains): (Vec<String>, Vec<&str>) = match current {
        None => (
            JUMPS.iter().map(|j| j.replacen("-A", "-D", 1)).collect(),
            ours.to_vec(),
        ),
        Some(save) => {
            let deletes = save
                .lines()
                .filter_map(|l| l.trim_end().strip_prefix("-A "))
                .filter(|rule| {
                    let mut words = rule.split_whitespace();
                    let chain = words.next().unwrap_or_default();
                    let mut target = None;
                    while let Some(w) = words.next() {
                        if w == "-j" || w == "-g" {
                            target = words.next();
                        }
                    }
                    !ours.contains(&chain) && target.is_some_and(|t| ours.contains(&t))
                })
                .map(|rule| format!("-D {rule}"))
                .collect();
            let chains = ours
                .into_iter()
                .filter(|c| save.lines().any(|l| l.starts_with(&format!(":{c} "))))
                .collect();
            (deletes, chains)
        }
    };
    if deletes.is_empty() && chains.is_empty() {
        return None;
    }
    let mut lines = vec!["*nat".to_owned()];
    lines.extend(deletes);
    // Flush both before deleting either: SPUR_OUTPUT refers to SPUR_INBOUND.
    lines.extend(chains.iter().map(|c| format!("-F {c}")));
    lines.extend(chains.iter().map(|c| format!("-X {c}")));
    lines.push("COMMIT".to_owned());
    Some(lines.join("\n") + "\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeSet;

    use super::*;

    fn rules(inbound: Ports) -> Rules {
        Rules {
            proxy_port: 15006,
            proxy_uid: 15337,
            inbound,
            exclude: BTreeSet::from([15006, 15020, 7071]),
            outbound_port: None,
            kafka_ports: BTreeSet::new(),
            kafka_proxy_port: 15007,
        }
    }

    #[test]
    fn kafka_broker_ports_go_to_the_kafka_relay() {
        let mut r = rules(Ports::All);
        r.kafka_ports = BTreeSet::from([9093, 9092]);
        let script = apply_script(Family::V4, &r, Some(EMPTY_NAT));
        let output: Vec<&str> = script
            .lines()
            .filter(|l| l.starts_with("-A SPUR_OUTPUT"))
            .collect();
        assert_eq!(
            output,
            [
                "-A SPUR_OUTPUT -m owner --uid-owner 15337 -j RETURN",
                "-A SPUR_OUTPUT ! -d 127.0.0.1/32 -o lo -j SPUR_INBOUND",
                "-A SPUR_OUTPUT -p tcp -m tcp --dport 9092 -j REDIRECT --to-ports 15007",
                "-A SPUR_OUTPUT -p tcp -m tcp --dport 9093 -j REDIRECT --to-ports 15007",
            ],
            "after the sidecar's own connections return: its connections to the broker stay direct"
        );
    }

    #[test]
    fn outbound_only_for_a_job_runner() {
        let mut r = rules(Ports::Only(BTreeSet::new()));
        r.proxy_port = 15001;
        r.outbound_port = Some(15001);
        let script = apply_script(Family::V4, &r, Some(EMPTY_NAT));
        assert_eq!(
            script,
            "*nat
:SPUR_INBOUND - [0:0]
:SPUR_OUTPUT - [0:0]
-A SPUR_OUTPUT -m owner --uid-owner 15337 -j RETURN
-A SPUR_OUTPUT ! -d 127.0.0.1/32 -o lo -j SPUR_INBOUND
-A SPUR_OUTPUT -o lo -j RETURN
-A SPUR_OUTPUT -p tcp -j REDIRECT --to-ports 15001
-A PREROUTING -p tcp -j SPUR_INBOUND
-A OUTPUT -p tcp -j SPUR_OUTPUT
COMMIT
"
        );
    }

    const EMPTY_NAT: &str = "# Generated by iptables-save v1.8.9 on Sat Nov 21 13:44:09 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
# Completed on Sat Nov 21 13:44:09 2026
";

    #[test]
    fn all_ports_with_exclusions_on_a_fresh_table() {
        let script = apply_script(Family::V4, &rules(Ports::All), Some(EMPTY_NAT));
        assert_eq!(
            script,
            "*nat
:SPUR_INBOUND - [0:0]
:SPUR_OUTPUT - [0:0]
-A SPUR_INBOUND -p tcp -m tcp --dport 7071 -j RETURN
-A SPUR_INBOUND -p tcp -m tcp --dport 15006 -j RETURN
-A SPUR_INBOUND -p tcp -m tcp --dport 15020 -j RETURN
-A SPUR_INBOUND -p tcp -j REDIRECT --to-ports 15006
-A SPUR_OUTPUT -m owner --uid-owner 15337 -j RETURN
-A SPUR_OUTPUT ! -d 127.0.0.1/32 -o lo -j SPUR_INBOUND
-A PREROUTING -p tcp -j SPUR_INBOUND
-A OUTPUT -p tcp -j SPUR_OUTPUT
COMMIT
"
        );
    }

    #[test]
    fn listed_ports_ipv6_and_jumps_already_present() {
        let installed = "*nat
:PREROUTING ACCEPT [3:180]
:OUTPUT ACCEPT [0:0]
:SPUR_INBOUND - [0:0]
:SPUR_OUTPUT - [0:0]
-A PREROUTING -p tcp -j SPUR_INBOUND
-A OUTPUT -p tcp -j SPUR_OUTPUT
COMMIT
";
        let only = Ports::Only(BTreeSet::from([8080, 7070, 7071, 15006]));
        let script = apply_script(Family::V6, &rules(only), Some(installed));
        assert_eq!(
            script,
            "*nat
:SPUR_INBOUND - [0:0]
:SPUR_OUTPUT - [0:0]
-A SPUR_INBOUND -p tcp -m tcp --dport 7070 -j REDIRECT --to-ports 15006
-A SPUR_INBOUND -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 15006
-A SPUR_OUTPUT -m owner --uid-owner 15337 -j RETURN
-A SPUR_OUTPUT ! -d ::1/128 -o lo -j SPUR_INBOUND
COMMIT
"
        );
        // Only the missing jump is added.
        let half = installed.replace("-A OUTPUT -p tcp -j SPUR_OUTPUT\n", "");
        let script = apply_script(Family::V4, &rules(Ports::All), Some(&half));
        assert!(!script.contains("-A PREROUTING"));
        assert!(script.contains("-A OUTPUT -p tcp -j SPUR_OUTPUT\n"));
        // A dry run lists both.
        let script = apply_script(Family::V4, &rules(Ports::All), None);
        assert!(script.contains("-A PREROUTING") && script.contains("-A OUTPUT"));
    }

    #[test]
    fn cleanup_removes_exactly_what_is_there() {
        assert_eq!(cleanup_script(Some(EMPTY_NAT)), None);

        let installed = "*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:OTHER - [0:0]
:SPUR_INBOUND - [0:0]
:SPUR_OUTPUT - [0:0]
-A PREROUTING -p tcp -j SPUR_INBOUND
-A PREROUTING -p tcp -j OTHER
-A PREROUTING -s 10.0.0.0/8 -p tcp -j SPUR_INBOUND
-A OUTPUT -p tcp -j SPUR_OUTPUT
-A SPUR_INBOUND -p tcp -j REDIRECT --to-ports 15006
-A SPUR_OUTPUT ! -d 127.0.0.1/32 -o lo -j SPUR_INBOUND
COMMIT
";
        assert_eq!(
            cleanup_script(Some(installed)).unwrap(),
            "*nat
-D PREROUTING -p tcp -j SPUR_INBOUND
-D PREROUTING -s 10.0.0.0/8 -p tcp -j SPUR_INBOUND
-D OUTPUT -p tcp -j SPUR_OUTPUT
-F SPUR_INBOUND
-F SPUR_OUTPUT
-X SPUR_INBOUND
-X SPUR_OUTPUT
COMMIT
"
        );

        // A half-removed installation: only the chain is left.
        let chain_only = "*nat\n:OUTPUT ACCEPT [0:0]\n:SPUR_OUTPUT - [0:0]\nCOMMIT\n";
        assert_eq!(
            cleanup_script(Some(chain_only)).unwrap(),
            "*nat\n-F SPUR_OUTPUT\n-X SPUR_OUTPUT\nCOMMIT\n"
        );
        assert!(
            cleanup_script(None)
                .unwrap()
                .contains("-D OUTPUT -p tcp -j SPUR_OUTPUT\n")
        );
    }
}
