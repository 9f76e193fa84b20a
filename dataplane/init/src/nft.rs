//! Native nftables rules: one `nft -f -` transaction per run.
//!
//! Everything lives in spur-init's own table [`TABLE`] (family `inet` with IPv6, `ip` without).
//! Each run first deletes both possible tables and then declares the new one, in one transaction:
//! the kernel switches from the old ruleset to the new one atomically, and a second run leaves the
//! same ruleset. `add table` before `delete table` makes the delete succeed when the table does
//! not exist yet.

use crate::Rules;

/// The name of spur-init's table.
pub const TABLE: &str = "spur";

/// The script that replaces spur-init's table with one implementing `rules`.
pub fn apply_script(rules: &Rules, ipv6: bool) -> String {
    let family = if ipv6 { "inet" } else { "ip" };
    let proxy = rules.proxy_port;
    let inbound = match rules.listed_ports() {
        None => format!(
            "\t\ttcp dport {} return\n\t\tmeta l4proto tcp redirect to :{proxy}\n",
            set(rules.exclude.iter().copied())
        ),
        Some(ports) if ports.is_empty() => String::new(),
        Some(ports) => format!(
            "\t\ttcp dport {} redirect to :{proxy}\n",
            set(ports.into_iter())
        ),
    };
    let mut hairpin = format!(
        "\t\tmeta skuid {} return\n\t\toifname \"lo\" ip daddr != 127.0.0.1 jump inbound\n",
        rules.proxy_uid
    );
    if ipv6 {
        hairpin.push_str("\t\toifname \"lo\" ip6 daddr != ::1 jump inbound\n");
    }
    if !rules.kafka_ports.is_empty() {
        // The pod's connections to Kafka brokers, to the sidecar's Kafka relay.
        hairpin.push_str(&format!(
            "\t\ttcp dport {} redirect to :{}\n",
            set(rules.kafka_ports.iter().copied()),
            rules.kafka_proxy_port
        ));
    }
    if let Some(port) = rules.outbound_port {
        // Everything else the pod sends over TCP, loopback aside, to the outbound proxy.
        hairpin.push_str(&format!(
            "\t\toifname \"lo\" return\n\t\tmeta l4proto tcp redirect to :{port}\n"
        ));
    }
    // Chains declared before the rules that jump to them; `priority -100` is dstnat (the name is
    // only accepted for prerouting by older nft).
    format!(
        "{cleanup}table {family} {TABLE} {{
\tchain inbound {{
{inbound}\t}}
\tchain hairpin {{
{hairpin}\t}}
\tchain prerouting {{
\t\ttype nat hook prerouting priority -100; policy accept;
\t\tmeta l4proto tcp jump inbound
\t}}
\tchain output {{
\t\ttype nat hook output priority -100; policy accept;
\t\tmeta l4proto tcp jump hairpin
\t}}
}}
",
        cleanup = cleanup_script(),
    )
}

/// The script that removes spur-init's table in either family, whether or not it exists.
pub fn cleanup_script() -> String {
    ["ip", "inet"]
        .map(|family| format!("add table {family} {TABLE}\ndelete table {family} {TABLE}\n"))
        .concat()
}

/// `p` for one port, `{ p1, p2 }` for several.
fn set(ports: impl Iterator<Item = u16>) -> String {
    let ports: Vec<String> = ports.map(|p| p.to_string()).collect();
    match ports.as_slice() {
        [one] => one.clone(),
        _ => format!("{{ {} }}", ports.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::Ports;

    fn rules(inbound: Ports, exclude: &[u16]) -> Rules {
        Rules {
            proxy_port: 15006,
            proxy_uid: 15337,
            inbound,
            exclude: exclude.iter().copied().collect(),
            outbound_port: None,
            kafka_ports: BTreeSet::new(),
            kafka_proxy_port: 15007,
        }
    }

    #[test]
    fn kafka_broker_ports_go_to_the_kafka_relay() {
        let mut r = rules(Ports::All, &[15006]);
        r.kafka_ports = BTreeSet::from([9092]);
        let script = apply_script(&r, false);
        assert!(
            script.contains("\t\tmeta skuid 15337 return\n\t\toifname \"lo\" ip daddr != 127.0.0.1 jump inbound\n\t\ttcp dport 9092 redirect to :15007\n\t}"),
            "{script}"
        );
        r.kafka_ports.insert(19092);
        assert!(
            apply_script(&r, false).contains("\t\ttcp dport { 9092, 19092 } redirect to :15007\n"),
            "{script}"
        );
    }

    #[test]
    fn outbound_only_for_a_job_runner() {
        let mut r = rules(Ports::Only(BTreeSet::new()), &[15001]);
        r.outbound_port = Some(15001);
        let script = apply_script(&r, false);
        assert!(script.contains("\tchain inbound {\n\t}\n"), "{script}");
        assert!(
            script.contains("\t\tmeta skuid 15337 return\n\t\toifname \"lo\" ip daddr != 127.0.0.1 jump inbound\n\t\toifname \"lo\" return\n\t\tmeta l4proto tcp redirect to :15001\n"),
            "{script}"
        );
    }

    #[test]
    fn all_ports_dual_stack() {
        let script = apply_script(&rules(Ports::All, &[15006, 15020, 7071]), true);
        assert_eq!(
            script,
            "add table ip spur
delete table ip spur
add table inet spur
delete table inet spur
table inet spur {
\tchain inbound {
\t\ttcp dport { 7071, 15006, 15020 } return
\t\tmeta l4proto tcp redirect to :15006
\t}
\tchain hairpin {
\t\tmeta skuid 15337 return
\t\toifname \"lo\" ip daddr != 127.0.0.1 jump inbound
\t\toifname \"lo\" ip6 daddr != ::1 jump inbound
\t}
\tchain prerouting {
\t\ttype nat hook prerouting priority -100; policy accept;
\t\tmeta l4proto tcp jump inbound
\t}
\tchain output {
\t\ttype nat hook output priority -100; policy accept;
\t\tmeta l4proto tcp jump hairpin
\t}
}
"
        );
    }

    #[test]
    fn listed_ports_ipv4_only() {
        let only = Ports::Only(BTreeSet::from([8080, 15006]));
        let script = apply_script(&rules(only, &[15006]), false);
        assert!(script.contains("table ip spur {\n"), "{script}");
        assert!(script.contains("\t\ttcp dport 8080 redirect to :15006\n"));
        assert!(!script.contains("ip6") && !script.contains("return\n\t\tmeta l4proto"));

        // Every listed port excluded: the chain is empty, the hooks stay.
        let only = Ports::Only(BTreeSet::from([15006]));
        let script = apply_script(&rules(only, &[15006]), false);
        assert!(script.contains("\tchain inbound {\n\t}\n"), "{script}");
    }

    #[test]
    fn cleanup_deletes_both_families() {
        assert_eq!(
            cleanup_script(),
            "add table ip spur\ndelete table ip spur\nadd table inet spur\ndelete table inet spur\n"
        );
    }
}
