//! The DevMesh init step: programs the pod's nat rules that send inbound TCP to the sidecar
//! (iptables-legacy or native nftables), and removes them again.
//!
//! Rule generation ([`iptables`], [`nft`]) is pure and unit-tested. [`run`] checks capabilities
//! before it touches anything, picks the backend, reads the current state where it needs to, and
//! feeds each generated script to the real tool as one transaction. [`plan`] returns the same
//! scripts without changing anything (`--dry-run`). The rules themselves are described in
//! docs/interception.md.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use clap::{Args, ValueEnum};

mod caps;
mod exec;
pub mod iptables;
pub mod nft;

pub use caps::{CAP_NET_ADMIN, CAP_NET_RAW, Capabilities, Capability};

/// Exit codes of the `spur-init` binary (0 is success, including a cleanup with nothing to
/// remove and a dry run).
pub mod exit {
    /// A rule tool failed, timed out or could not be started.
    pub const TOOL_FAILED: u8 = 1;
    /// Invalid flags or environment variables (clap's own usage errors exit with 2 as well).
    pub const INVALID_ARGUMENTS: u8 = 2;
    /// A required capability is missing from the effective set.
    pub const MISSING_CAPABILITY: u8 = 3;
    /// A required tool (`nft`, `iptables-legacy-restore`, ...) is not installed.
    pub const TOOL_NOT_FOUND: u8 = 4;
}

/// The grant that fixes a missing capability, quoted in the error message.
const GRANT_HINT: &str = "run spur-init as root with the capabilities granted to the init \
container: securityContext.capabilities.add: [NET_ADMIN, NET_RAW]";

/// Everything that can go wrong; [`Error::exit_code`] maps each to the documented exit code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {flag} {value:?}: {reason}")]
    InvalidArgument {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "missing capability {} (effective set {effective:#x}), needed {purpose}; {GRANT_HINT}",
        cap.name
    )]
    MissingCapability {
        cap: Capability,
        purpose: &'static str,
        effective: u64,
    },
    #[error("cannot read the effective capabilities: {0}")]
    Capabilities(String),
    #[error("{tool} not found in PATH; {hint}")]
    ToolNotFound { tool: String, hint: &'static str },
    #[error("`{command}` failed ({status}): {stderr}")]
    ToolFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {seconds}s and was killed")]
    ToolTimeout { command: String, seconds: u64 },
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
}

impl Error {
    /// The process exit code for this error (see [`exit`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::InvalidArgument { .. } => exit::INVALID_ARGUMENTS,
            Error::MissingCapability { .. } | Error::Capabilities(_) => exit::MISSING_CAPABILITY,
            Error::ToolNotFound { .. } => exit::TOOL_NOT_FOUND,
            Error::ToolFailed { .. } | Error::ToolTimeout { .. } | Error::Spawn { .. } => {
                exit::TOOL_FAILED
            }
        }
    }
}

/// Which rule backend to program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// nftables when `nft` works here, else iptables-legacy.
    Auto,
    /// iptables-legacy (`iptables-legacy-restore`, `ip6tables-legacy-restore`).
    Iptables,
    /// Native nftables (`nft -f -`), in its own table `spur`.
    Nft,
}

/// Whether IPv6 rules are programmed too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Ipv6 {
    /// When the kernel has IPv6 (`/proc/net/if_inet6` exists).
    Auto,
    True,
    False,
}

/// A concrete backend, after `auto` was resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    IptablesLegacy,
    Nft,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::IptablesLegacy => "iptables-legacy",
            Backend::Nft => "nft",
        })
    }
}

/// Command-line flags of `spur-init` (each also settable through the `SPUR_*` variable shown).
/// The sidecar injector generates exactly these; keep them stable.
#[derive(Debug, Clone, Args)]
pub struct InitArgs {
    /// Rule backend: nft (native nftables), iptables (iptables-legacy) or auto (nft when the
    /// `nft` binary works here, else iptables-legacy).
    #[arg(long, env = "SPUR_INIT_MODE", value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// Port the sidecar accepts redirected connections on.
    #[arg(long, env = "SPUR_PROXY_PORT", default_value_t = 15006)]
    pub proxy_port: u16,
    /// The sidecar's uid: its own connections are never redirected.
    #[arg(long, env = "SPUR_PROXY_UID", default_value_t = 15337)]
    pub proxy_uid: u32,
    /// Inbound TCP ports to redirect: `*` for all, a comma-separated list, or `none`.
    #[arg(long, env = "SPUR_INBOUND_PORTS", default_value = "*")]
    pub inbound_ports: String,
    /// Also redirect the pod's own outbound TCP (all but the proxy uid's and loopback's) to
    /// this port: the outbound sidecar of job runner pods, which adds the routing key.
    #[arg(long, env = "SPUR_OUTBOUND_PORT")]
    pub outbound_port: Option<u16>,
    /// Inbound TCP ports never redirected (comma-separated; may be empty). The proxy port is
    /// always excluded.
    #[arg(long, env = "SPUR_EXCLUDE_INBOUND_PORTS", default_value = "15020")]
    pub exclude_inbound_ports: String,
    /// Kafka broker ports (comma-separated; empty: none): the pod's own connections to these
    /// ports, whatever the address, go to --kafka-proxy-port, where the sidecar relays them to
    /// their original destination and filters records by routing key (docs/async.md). Empty
    /// adds no rule, so a pod that uses no Kafka pays nothing.
    #[arg(long, env = "SPUR_KAFKA_PORTS", default_value = "")]
    pub kafka_ports: String,
    /// Port of the sidecar's Kafka relay (it listens on loopback only).
    #[arg(long, env = "SPUR_KAFKA_PROXY_PORT", default_value_t = 15007)]
    pub kafka_proxy_port: u16,
    /// Program IPv6 rules too: auto (when the kernel has IPv6), true or false.
    #[arg(long, env = "SPUR_INIT_IPV6", value_enum, default_value_t = Ipv6::Auto)]
    pub ipv6: Ipv6,
    /// Remove everything spur-init installed (succeeds when nothing is installed).
    #[arg(long)]
    pub cleanup: bool,
    /// Print the rules that would be applied and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Inbound ports to redirect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ports {
    All,
    Only(BTreeSet<u16>),
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ports::All => f.write_str("*"),
            Ports::Only(ports) => f.write_str(&join_ports(ports)),
        }
    }
}

fn join_ports(ports: &BTreeSet<u16>) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What the rules do, independent of the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    pub proxy_port: u16,
    pub proxy_uid: u32,
    pub inbound: Ports,
    /// Never redirected; always contains `proxy_port`.
    pub exclude: BTreeSet<u16>,
    /// Where the pod's own outbound TCP goes (none: it is not redirected).
    pub outbound_port: Option<u16>,
    /// The pod's own connections to these ports (Kafka brokers) go to `kafka_proxy_port`.
    pub kafka_ports: BTreeSet<u16>,
    pub kafka_proxy_port: u16,
}

impl Rules {
    /// With an explicit port list: the ports that are redirected (the list minus exclusions).
    /// `None` for `*`, where excluded ports return early and everything else is redirected.
    pub fn listed_ports(&self) -> Option<Vec<u16>> {
        match &self.inbound {
            Ports::All => None,
            Ports::Only(ports) => Some(ports.difference(&self.exclude).copied().collect()),
        }
    }
}

/// Install the rules, or remove them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Apply,
    Cleanup,
}

/// A validated `spur-init` invocation.
#[derive(Debug, Clone)]
pub struct Config {
    pub mode: Mode,
    pub ipv6: Ipv6,
    pub action: Action,
    pub dry_run: bool,
    pub rules: Rules,
}

impl TryFrom<InitArgs> for Config {
    type Error = Error;

    fn try_from(a: InitArgs) -> Result<Self, Error> {
        if a.proxy_port == 0 {
            return Err(Error::InvalidArgument {
                flag: "--proxy-port",
                value: "0".into(),
                reason: "must be 1-65535".into(),
            });
        }
        if a.outbound_port == Some(0) {
            return Err(Error::InvalidArgument {
                flag: "--outbound-port",
                value: "0".into(),
                reason: "must be 1-65535".into(),
            });
        }
        let inbound = if a.inbound_ports.trim() == "*" {
            Ports::All
        } else if a.inbound_ports.trim() == "none" {
            Ports::Only(BTreeSet::new())
        } else {
            let ports = parse_ports("--inbound-ports", &a.inbound_ports)?;
            if ports.is_empty() {
                return Err(Error::InvalidArgument {
                    flag: "--inbound-ports",
                    value: a.inbound_ports,
                    reason: "expected `*`, `none` or a comma-separated list of ports".into(),
                });
            }
            Ports::Only(ports)
        };
        let mut exclude = parse_ports("--exclude-inbound-ports", &a.exclude_inbound_ports)?;
        exclude.insert(a.proxy_port);
        let kafka_ports = parse_ports("--kafka-ports", &a.kafka_ports)?;
        if !kafka_ports.is_empty() {
            let invalid = |reason: &str| Error::InvalidArgument {
                flag: "--kafka-proxy-port",
                value: a.kafka_proxy_port.to_string(),
                reason: reason.into(),
            };
            if a.kafka_proxy_port == 0 {
                return Err(invalid("must be 1-65535"));
            }
            if a.kafka_proxy_port == a.proxy_port || Some(a.kafka_proxy_port) == a.outbound_port {
                return Err(invalid(
                    "must differ from --proxy-port and --outbound-port: the Kafka relay is a listener of its own",
                ));
            }
            if kafka_ports.contains(&a.kafka_proxy_port) {
                return Err(invalid(
                    "is one of --kafka-ports: the relay's own port cannot be a broker port",
                ));
            }
        }
        Ok(Config {
            mode: a.mode,
            ipv6: a.ipv6,
            action: if a.cleanup {
                Action::Cleanup
            } else {
                Action::Apply
            },
            dry_run: a.dry_run,
            rules: Rules {
                proxy_port: a.proxy_port,
                proxy_uid: a.proxy_uid,
                inbound,
                exclude,
                outbound_port: a.outbound_port,
                kafka_ports,
                kafka_proxy_port: a.kafka_proxy_port,
            },
        })
    }
}

/// A comma-separated port list; blanks around entries and empty entries are ignored. `flag`
/// names the setting in the error. (The sidecar parses its Kafka ports, which are spur-init's
/// too, with this.)
pub fn parse_ports(flag: &'static str, value: &str) -> Result<BTreeSet<u16>, Error> {
    let invalid = |reason: String| Error::InvalidArgument {
        flag,
        value: value.to_owned(),
        reason,
    };
    let mut ports = BTreeSet::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.parse::<u16>() {
            Ok(0) => return Err(invalid("port 0 is not a port".into())),
            Ok(p) => {
                ports.insert(p);
            }
            Err(_) => {
                return Err(invalid(format!(
                    "{item:?} is not a port (1-65535; ranges are not supported)"
                )));
            }
        }
    }
    Ok(ports)
}

/// One tool invocation with its input script, as `--dry-run` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub program: &'static str,
    pub args: &'static [&'static str],
    pub input: String,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "# {} {}", self.program, self.args.join(" "))?;
        f.write_str(&self.input)
    }
}

/// Arguments of every `nft` transaction: the script comes on stdin.
const NFT_ARGS: &[&str] = &["-f", "-"];
/// Arguments of every restore: only touch what the script names, and wait for the xtables lock
/// another process (kube-proxy, a CNI plugin) may hold instead of failing at once.
const RESTORE_ARGS: &[&str] = &["--noflush", "--wait=10"];

/// The scripts `config` would feed to the tools, without reading or changing any state. For
/// iptables-legacy, jump rules are listed unconditionally (a real run adds only missing ones) and
/// a cleanup lists every rule spur-init may have installed (a real run removes only those present).
pub fn plan(config: &Config) -> Vec<Step> {
    let ipv6 = ipv6_enabled(config.ipv6);
    let backends = match config.action {
        Action::Apply => vec![choose_backend(config.mode)],
        Action::Cleanup => cleanup_backends(config.mode),
    };
    let mut steps = Vec::new();
    for backend in backends {
        match (backend, config.action) {
            (Backend::Nft, Action::Apply) => {
                steps.push(nft_step(nft::apply_script(&config.rules, ipv6)))
            }
            (Backend::Nft, Action::Cleanup) => steps.push(nft_step(nft::cleanup_script())),
            (Backend::IptablesLegacy, action) => {
                for &family in iptables::families(ipv6) {
                    let input = match action {
                        Action::Apply => iptables::apply_script(family, &config.rules, None),
                        Action::Cleanup => iptables::cleanup_script(None).unwrap_or_default(),
                    };
                    steps.push(Step {
                        program: family.restore_tool(),
                        args: RESTORE_ARGS,
                        input,
                    });
                }
            }
        }
    }
    steps
}

/// Applies or removes the rules. Checks the effective capabilities first, so a missing grant
/// fails before anything is changed.
pub fn run(config: &Config) -> Result<(), Error> {
    let caps = Capabilities::current()?;
    caps.require(CAP_NET_ADMIN, "to change the pod's nat rules")?;
    let ipv6 = ipv6_enabled(config.ipv6);
    match config.action {
        Action::Apply => apply(config, caps, ipv6),
        Action::Cleanup => cleanup(config.mode, caps, ipv6),
    }
}

const RAW_SOCKET: &str = "by iptables-legacy (it opens a raw socket)";

fn apply(config: &Config, caps: Capabilities, ipv6: bool) -> Result<(), Error> {
    let rules = &config.rules;
    let backend = choose_backend(config.mode);
    match backend {
        Backend::Nft => {
            exec::run("nft", NFT_ARGS, Some(&nft::apply_script(rules, ipv6)))?;
        }
        Backend::IptablesLegacy => {
            caps.require(CAP_NET_RAW, RAW_SOCKET)?;
            for &family in iptables::families(ipv6) {
                let current = exec::run(family.save_tool(), &["-t", "nat"], None)?;
                let script = iptables::apply_script(family, rules, Some(&current));
                exec::run(family.restore_tool(), RESTORE_ARGS, Some(&script))?;
            }
        }
    }
    tracing::info!(
        %backend,
        ipv6,
        proxy_port = rules.proxy_port,
        proxy_uid = rules.proxy_uid,
        inbound = %rules.inbound,
        exclude = %join_ports(&rules.exclude),
        kafka_ports = %join_ports(&rules.kafka_ports),
        "interception installed"
    );
    Ok(())
}

fn cleanup(mode: Mode, caps: Capabilities, ipv6: bool) -> Result<(), Error> {
    for backend in cleanup_backends(mode) {
        match backend {
            Backend::Nft => {
                exec::run("nft", NFT_ARGS, Some(&nft::cleanup_script()))?;
                tracing::info!(%backend, "table spur removed (if it existed)");
            }
            Backend::IptablesLegacy if mode == Mode::Auto && !caps.has(CAP_NET_RAW) => {
                tracing::warn!("CAP_NET_RAW is missing: iptables-legacy rules, if any, stay");
            }
            Backend::IptablesLegacy => {
                caps.require(CAP_NET_RAW, RAW_SOCKET)?;
                for &family in iptables::families(ipv6) {
                    let current = exec::run(family.save_tool(), &["-t", "nat"], None)?;
                    let Some(script) = iptables::cleanup_script(Some(&current)) else {
                        tracing::info!(%backend, ?family, "nothing installed");
                        continue;
                    };
                    exec::run(family.restore_tool(), RESTORE_ARGS, Some(&script))?;
                    tracing::info!(%backend, ?family, "inbound interception removed");
                }
            }
        }
    }
    Ok(())
}

fn nft_step(input: String) -> Step {
    Step {
        program: "nft",
        args: NFT_ARGS,
        input,
    }
}

fn ipv6_enabled(ipv6: Ipv6) -> bool {
    match ipv6 {
        Ipv6::True => true,
        Ipv6::False => false,
        Ipv6::Auto => Path::new("/proc/net/if_inet6").exists(),
    }
}

/// `nft` works here: it is installed and the kernel answers it.
fn nft_works() -> Result<(), Error> {
    exec::run("nft", &["list", "tables"], None).map(drop)
}

fn choose_backend(mode: Mode) -> Backend {
    match mode {
        Mode::Nft => Backend::Nft,
        Mode::Iptables => Backend::IptablesLegacy,
        Mode::Auto => match nft_works() {
            Ok(()) => {
                tracing::info!(backend = "nft", "mode auto: nft works here");
                Backend::Nft
            }
            Err(e) => {
                let reason = e.to_string();
                tracing::info!(backend = "iptables-legacy", %reason, "mode auto: nft unusable");
                Backend::IptablesLegacy
            }
        },
    }
}

/// A cleanup in mode auto removes whatever either backend may have installed.
fn cleanup_backends(mode: Mode) -> Vec<Backend> {
    match mode {
        Mode::Nft => vec![Backend::Nft],
        Mode::Iptables => vec![Backend::IptablesLegacy],
        Mode::Auto => {
            let mut backends = Vec::new();
            match nft_works() {
                Ok(()) => backends.push(Backend::Nft),
                Err(e) => tracing::info!(reason = %e, "cleanup: skipping nft"),
            }
            if exec::installed(iptables::Family::V4.save_tool()) {
                backends.push(Backend::IptablesLegacy);
            } else {
                tracing::info!("cleanup: skipping iptables-legacy (not installed)");
            }
            backends
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn args(inbound: &str, exclude: &str) -> InitArgs {
        InitArgs {
            mode: Mode::Auto,
            proxy_port: 15006,
            proxy_uid: 15337,
            inbound_ports: inbound.into(),
            exclude_inbound_ports: exclude.into(),
            outbound_port: None,
            kafka_ports: String::new(),
            kafka_proxy_port: 15007,
            ipv6: Ipv6::Auto,
            cleanup: false,
            dry_run: false,
        }
    }

    #[test]
    fn kafka_ports_and_their_relay_port() {
        let c = Config::try_from(args("*", "")).unwrap();
        assert!(c.rules.kafka_ports.is_empty(), "none unless asked for");
        let mut a = args("*", "");
        a.kafka_ports = "9092, 9093".into();
        let c = Config::try_from(a).unwrap();
        assert_eq!(c.rules.kafka_ports, BTreeSet::from([9092, 9093]));
        assert_eq!(c.rules.kafka_proxy_port, 15007);
        for (ports, relay, why) in [
            ("9092", 15006, "must differ from --proxy-port"),
            ("9092", 0, "must be 1-65535"),
            ("9092,15007", 15007, "is one of --kafka-ports"),
        ] {
            let mut a = args("*", "");
            a.kafka_ports = ports.into();
            a.kafka_proxy_port = relay;
            let e = Config::try_from(a).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        let mut bad = args("*", "");
        bad.kafka_ports = "9092-9094".into();
        let e = Config::try_from(bad).unwrap_err().to_string();
        assert!(e.contains("--kafka-ports"), "{e}");
    }

    #[test]
    fn no_inbound_and_an_outbound_port() {
        let mut a = args("none", "");
        a.outbound_port = Some(15001);
        let c = Config::try_from(a).unwrap();
        assert_eq!(c.rules.inbound, Ports::Only(BTreeSet::new()));
        assert_eq!(c.rules.outbound_port, Some(15001));
        let mut zero = args("*", "");
        zero.outbound_port = Some(0);
        assert!(Config::try_from(zero).is_err());
    }

    #[test]
    fn port_lists_are_validated_once() {
        let c = Config::try_from(args("*", "15020, 7071,")).unwrap();
        assert_eq!(c.rules.inbound, Ports::All);
        assert_eq!(
            c.rules.exclude,
            BTreeSet::from([7071, 15006, 15020]),
            "the proxy port is always excluded"
        );
        assert_eq!(c.rules.listed_ports(), None);

        let c = Config::try_from(args("8080,15006,7070,15020", "15020")).unwrap();
        assert_eq!(c.rules.listed_ports(), Some(vec![7070, 8080]));

        let c = Config::try_from(args("*", "")).unwrap();
        assert_eq!(c.rules.exclude, BTreeSet::from([15006]));

        for (inbound, exclude) in [("", ""), (" , ", ""), ("80-90", ""), ("*", "x"), ("0", "")] {
            let e = Config::try_from(args(inbound, exclude)).unwrap_err();
            assert_eq!(e.exit_code(), exit::INVALID_ARGUMENTS, "{e}");
        }
        let mut a = args("*", "");
        a.proxy_port = 0;
        assert!(Config::try_from(a).is_err());
    }

    #[test]
    fn a_dry_run_with_an_explicit_mode_touches_nothing() {
        let mut a = args("*", "15020");
        a.mode = Mode::Nft;
        a.ipv6 = Ipv6::False;
        let steps = plan(&Config::try_from(a.clone()).unwrap());
        assert_eq!(steps.len(), 1);
        assert!(steps[0].to_string().starts_with("# nft -f -\n"));

        a.mode = Mode::Iptables;
        a.ipv6 = Ipv6::True;
        let steps = plan(&Config::try_from(a.clone()).unwrap());
        let programs: Vec<_> = steps.iter().map(|s| s.program).collect();
        assert_eq!(
            programs,
            ["iptables-legacy-restore", "ip6tables-legacy-restore"]
        );
        assert!(steps[1].input.contains("! -d ::1/128 -o lo"));

        a.cleanup = true;
        let steps = plan(&Config::try_from(a).unwrap());
        assert!(steps[0].input.contains("-X SPUR_INBOUND"));
    }

    #[test]
    fn errors_map_to_documented_exit_codes() {
        let missing = Error::MissingCapability {
            cap: CAP_NET_ADMIN,
            purpose: "to change the pod's nat rules",
            effective: 0,
        };
        assert_eq!(missing.exit_code(), 3);
        let text = missing.to_string();
        assert!(
            text.contains("CAP_NET_ADMIN") && text.contains("NET_ADMIN, NET_RAW"),
            "{text}"
        );
        let not_found = Error::ToolNotFound {
            tool: "nft".into(),
            hint: "",
        };
        assert_eq!(not_found.exit_code(), 4);
    }
}
