//! The sidecar's Kafka relay (issue 44, `docs/async.md`): the pod's own connections to Kafka
//! brokers are redirected to it by the interception rules (`SPUR_KAFKA_PORTS`), and it relays
//! each to its original destination, so that the app's consumer receives only the records that
//! are its to handle.
//!
//! Who decides: the routes of the sidecar's baseline workload, the same the sidecar routes HTTP
//! with. A record's routing key (its headers, with the HTTP carriers and parser) that routes
//! this baseline, on any port, to a sandbox makes the record that sandbox's:
//! - in a baseline pod, such a record is withheld (the fork handles it); every other record is
//!   delivered;
//! - in a fork pod (`--fork-of-sandbox S`), only records whose key routes this baseline to `S`
//!   are delivered, and the app's consumer group and transactional ids are renamed per sandbox,
//!   so the fork never joins the baseline's group.
//!
//! When: with rules from the route server, by the **route history** at the record's timestamp
//! ([`Decider::History`]): the baseline's relay and the fork's decide alike whenever each relays
//! the record, so a route that appears or goes mid-stream gives no record two consumers or none.
//! A Fetch response is held until the history's watermark is past the moment it was read (at
//! most [`HOLD_MAX`]; then the records are decided with what is known, and counted). With rules
//! from a file there is no history: the table in force when the record is relayed decides
//! ([`Decider::Table`]).
//!
//! Explicit mode (`--kafka-broker`, no interception, no root): the app bootstraps to the relay's
//! port on 127.0.0.1, and the relay advertises itself in Metadata in place of the one broker it
//! fronts. For a cluster of one broker only (a workstation, the standalone demo): a client told
//! the addresses of other brokers would go around the relay, so a Metadata response that names
//! several is refused with that reason. Its listener is on 127.0.0.1 too, so only the host's
//! (the pod's) own processes reach it, and it relays only to the broker it was given, which they
//! can reach without it: it adds no reach either.
//!
//! Who can use it: only the pod's own processes. The listeners are on loopback, and a connection
//! that was not redirected there (so has no broker as its original destination) is closed. The
//! relay connects to the broker the app chose, as the app would have: it adds no reach.
//!
//! Until the first routing table (or route history) is in, connections wait in the listen queue,
//! unanswered: a baseline that relayed before knowing the routes would deliver records that are
//! a fork's.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use spur_discovery::SharedHistory;
use spur_kafka::{Limits, Role, SessionConfig, SessionStats};
use spur_proxy::kafka::{Hold, KafkaRelay, KafkaUpstream, Keep, OnStats};
use spur_routing::{BaselineWorkload, Candidates, History, KeyExtractor, SharedTable};
use tokio::net::TcpListener;

use crate::Error;

/// Flags of the Kafka relay (part of [`crate::SidecarArgs`]).
#[derive(Debug, Clone, Default, Args)]
pub struct KafkaArgs {
    /// Kafka broker ports, comma-separated: the pod's own connections to them are relayed by
    /// routing key (spur-init's rules read the same variable). Empty: no Kafka relay, no rule.
    #[arg(long, env = "SPUR_KAFKA_PORTS", default_value = "")]
    pub kafka_ports: String,
    /// Explicit mode, in place of --kafka-ports: the app bootstraps to 127.0.0.1:--kafka-proxy-port
    /// and every connection is relayed to this broker (HOST:PORT, resolved once at start), which
    /// must be the cluster's only broker. No interception rules, no root.
    #[arg(long, env = "SPUR_KAFKA_BROKER")]
    pub kafka_broker: Option<String>,
    /// Port the Kafka relay listens on, on 127.0.0.1 and ::1 (the interception rules redirect
    /// to it); in explicit mode on 127.0.0.1 only (the address it advertises).
    #[arg(long, env = "SPUR_KAFKA_PROXY_PORT", default_value_t = 15007)]
    pub kafka_proxy_port: u16,
    /// This pod is a fork in this sandbox: its consumer receives only the records routed to the
    /// sandbox, under a consumer group of the sandbox's own. Without it: a baseline pod.
    #[arg(long, env = "SPUR_FORK_OF_SANDBOX")]
    pub fork_of_sandbox: Option<String>,
}

/// A validated Kafka relay configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// Broker ports whose connections are redirected here (empty in explicit mode).
    pub ports: BTreeSet<u16>,
    /// Explicit mode: the one broker every connection goes to.
    pub broker: Option<SocketAddr>,
    /// The relay's port, on loopback.
    pub listen_port: u16,
    pub role: Role,
}

impl KafkaArgs {
    /// `None` when no broker port is set (no relay). `transparent`: the sidecar reads original
    /// destinations, which the relay needs.
    pub fn validate(self, transparent: bool) -> Result<Option<KafkaConfig>, Error> {
        let ports = spur_init::parse_ports("--kafka-ports", &self.kafka_ports)
            .map_err(|e| Error::Config(e.to_string()))?;
        let broker = match self.kafka_broker.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(_) if !ports.is_empty() => {
                return Err(Error::Config(
                    "--kafka-broker (explicit mode) and --kafka-ports (interception) are two ways to relay Kafka: give one".into(),
                ));
            }
            Some(hostport) => Some(resolve_broker(hostport)?),
        };
        if ports.is_empty() && broker.is_none() {
            if self.fork_of_sandbox.is_some() {
                return Err(Error::Config(
                    "--fork-of-sandbox applies to the Kafka relay only: it needs --kafka-ports or --kafka-broker"
                        .into(),
                ));
            }
            return Ok(None);
        }
        if broker.is_none() && !transparent {
            return Err(Error::Config(
                "--kafka-ports relays connections redirected by the interception rules: it needs --transparent".into(),
            ));
        }
        if self.kafka_proxy_port == 0 {
            return Err(Error::Config("--kafka-proxy-port must be 1-65535".into()));
        }
        if ports.contains(&self.kafka_proxy_port) {
            return Err(Error::Config(format!(
                "--kafka-proxy-port {} is also one of --kafka-ports: the relay's own port cannot be a broker port",
                self.kafka_proxy_port
            )));
        }
        let role = match self.fork_of_sandbox {
            None => Role::Baseline,
            Some(sandbox) => {
                if spur_routing::rules::check_dns_label(&sandbox, 63).is_err() {
                    return Err(Error::Config(format!(
                        "--fork-of-sandbox {sandbox:?} must be a sandbox name (1-63 of [a-z0-9-], starting and ending alphanumeric)"
                    )));
                }
                Role::Fork { sandbox }
            }
        };
        Ok(Some(KafkaConfig {
            ports,
            broker,
            listen_port: self.kafka_proxy_port,
            role,
        }))
    }
}

/// The broker of explicit mode: `HOST:PORT`, resolved now (the first address), so a typo fails
/// the start rather than every connection.
fn resolve_broker(hostport: &str) -> Result<SocketAddr, Error> {
    use std::net::ToSocketAddrs;
    let bad = |why: String| Error::Config(format!("--kafka-broker {hostport:?}: {why}"));
    let mut addrs = hostport
        .to_socket_addrs()
        .map_err(|e| bad(format!("not a reachable HOST:PORT ({e})")))?;
    let addr = addrs
        .next()
        .ok_or_else(|| bad("resolves to no address".into()))?;
    if addr.port() == 0 {
        return Err(bad("port 0 is not a port".into()));
    }
    Ok(addr)
}

/// Longest a Fetch response is held for the route history's watermark: well under the
/// clients' request timeout (30 s by default in Java, librdkafka and franz-go), so a route
/// server that is away stalls consumers a little, never fails them.
pub const HOLD_MAX: Duration = Duration::from_secs(5);
const HOLD_MAX_MS: i64 = 5_000;

/// At most one warning per this long that records were decided without a watermark.
const WARN_EVERY_MS: i64 = 30_000;

/// What a relay decides records by (see the module docs).
#[derive(Clone)]
pub enum Decider {
    /// The routing table in force when the record is relayed.
    Table(SharedTable),
    /// The route history at the record's timestamp.
    History(SharedHistory),
}

/// Whether the consumer behind a sidecar of `role` receives a record the routes send to
/// `routed_to` (`None`: the baseline's).
fn verdict(role: &Role, routed_to: Option<&str>) -> bool {
    match (role, routed_to) {
        (Role::Baseline, routed_to) => routed_to.is_none(),
        (Role::Fork { sandbox }, Some(to)) => to == sandbox,
        (Role::Fork { .. }, None) => false,
    }
}

/// Whether the consumer behind a sidecar of `role`, fronting `baseline`, receives a record whose
/// routing-key candidates are `candidates`, under `table` (see the module docs).
pub fn delivered(
    table: &SharedTable,
    baseline: &BaselineWorkload,
    role: &Role,
    candidates: &Candidates<'_>,
) -> bool {
    if candidates.is_empty() {
        return verdict(role, None);
    }
    let snapshot = table.load();
    let routed_to = (snapshot.table.baseline(baseline))
        .and_then(|rules| rules.route_any_port(candidates))
        .map(|d| &*d.sandbox);
    verdict(role, routed_to)
}

/// Whether the consumer behind a sidecar of `role` receives a record stamped `at_ms` whose
/// routing-key candidates are `candidates`, by the baseline's route `history`.
pub fn delivered_at(
    history: &History,
    role: &Role,
    candidates: &Candidates<'_>,
    at_ms: i64,
) -> bool {
    if candidates.is_empty() {
        return verdict(role, None);
    }
    verdict(role, history.route(candidates, at_ms).map(|s| &**s))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicVerdict {
    topic: Arc<str>,
    verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicLabel {
    topic: Arc<str>,
}

/// Distinct `topic` label values one sidecar reports; records of further topics count under
/// `_other`, so a pod that reads thousands of topics cannot swell the metrics without bound.
const MAX_TOPIC_LABELS: usize = 256;

/// The relay's counters: `kafka_records_total{topic,verdict="delivered"|"withheld"}`,
/// `kafka_batches_rewritten_total{topic}`, `kafka_rewritten_bytes_total{topic}`,
/// `kafka_ids_renamed_total`, `kafka_fetch_responses_total`. `topic` is the topic's name,
/// `_unknown` for a topic id no Metadata response named, `_other` past [`MAX_TOPIC_LABELS`].
#[derive(Debug)]
struct KafkaMetrics {
    records: Family<TopicVerdict, Counter>,
    batches_rewritten: Family<TopicLabel, Counter>,
    bytes_rewritten: Family<TopicLabel, Counter>,
    topics: std::sync::Mutex<std::collections::HashSet<Arc<str>>>,
    ids_renamed: Counter,
    fetch_responses: Counter,
    held: Counter,
    hold_seconds: Histogram,
    hold_expired: Counter,
    past_watermark: Counter,
    last_warning_ms: std::sync::atomic::AtomicI64,
}

impl KafkaMetrics {
    fn register(registry: &mut Registry) -> Self {
        let records = Family::<TopicVerdict, Counter>::default();
        registry.register(
            "kafka_records",
            "Records of Fetch responses, by topic and by whether this pod's consumer received them (delivered) or they were another consumer's to handle (withheld)",
            records.clone(),
        );
        let batches_rewritten = Family::<TopicLabel, Counter>::default();
        registry.register(
            "kafka_batches_rewritten",
            "Record batches written anew because records were withheld from them, by topic",
            batches_rewritten.clone(),
        );
        let bytes_rewritten = Family::<TopicLabel, Counter>::default();
        registry.register(
            "kafka_rewritten_bytes",
            "Bytes of the record batches written anew, by topic",
            bytes_rewritten.clone(),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        KafkaMetrics {
            records,
            batches_rewritten,
            bytes_rewritten,
            topics: Default::default(),
            ids_renamed: counter(
                registry,
                "kafka_ids_renamed",
                "Consumer group and transactional ids renamed for a fork, both ways",
            ),
            fetch_responses: counter(registry, "kafka_fetch_responses", "Fetch responses relayed"),
            held: counter(
                registry,
                "kafka_fetch_responses_held",
                "Fetch responses held until the route history's watermark passed the moment they were read",
            ),
            hold_seconds: {
                let h = Histogram::new(exponential_buckets(0.001, 2.0, 14));
                registry.register(
                    "kafka_hold_seconds",
                    "How long held Fetch responses waited for the route history's watermark",
                    h.clone(),
                );
                h
            },
            hold_expired: counter(
                registry,
                "kafka_hold_expired",
                "Fetch responses decided before the route history's watermark passed them, the route server being away longer than the longest hold: a route change meanwhile may give a record two consumers or none",
            ),
            past_watermark: counter(
                registry,
                "kafka_records_past_watermark",
                "Records decided while stamped at or after the route history's watermark (a producer clock ahead, or a hold that expired)",
            ),
            last_warning_ms: std::sync::atomic::AtomicI64::new(i64::MIN),
        }
    }

    /// Warns (at most every [`WARN_EVERY_MS`]) that a Fetch response read at `at_ms` is
    /// decided with a watermark that has not passed it.
    fn warn_unheld(&self, watermark: i64, at_ms: i64) {
        use std::sync::atomic::Ordering;
        let last = self.last_warning_ms.load(Ordering::Relaxed);
        if at_ms.saturating_sub(last) < WARN_EVERY_MS
            || self
                .last_warning_ms
                .compare_exchange(last, at_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        tracing::warn!(
            watermark,
            read_at = at_ms,
            "Kafka relay: the route history's watermark stopped (route server away?); records are decided with the history known, and a route change meanwhile may give a record two consumers or none (kafka_hold_expired_total)"
        );
    }

    /// The label a topic's records count under (see [`MAX_TOPIC_LABELS`]).
    fn label(&self, topic: &Arc<str>) -> Arc<str> {
        if topic.is_empty() {
            return Arc::from("_unknown");
        }
        let mut seen = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(topic) {
            return topic.clone();
        }
        if seen.len() < MAX_TOPIC_LABELS {
            seen.insert(topic.clone());
            return topic.clone();
        }
        Arc::from("_other")
    }

    fn add(&self, s: &SessionStats) {
        for (topic, stats) in &s.topics {
            let topic = self.label(topic);
            // One statement per handle: a `get_or_create` guard lives until the end of its
            // statement, and two on the same family in one expression deadlock.
            self.records
                .get_or_create(&TopicVerdict {
                    topic: topic.clone(),
                    verdict: "delivered",
                })
                .inc_by(stats.records_kept);
            self.records
                .get_or_create(&TopicVerdict {
                    topic: topic.clone(),
                    verdict: "withheld",
                })
                .inc_by(stats.records_dropped);
            if stats.batches_rewritten > 0 {
                self.batches_rewritten
                    .get_or_create(&TopicLabel {
                        topic: topic.clone(),
                    })
                    .inc_by(stats.batches_rewritten);
                self.bytes_rewritten
                    .get_or_create(&TopicLabel { topic })
                    .inc_by(stats.bytes_rewritten);
            }
        }
        self.ids_renamed.inc_by(s.ids_renamed);
        self.fetch_responses.inc_by(s.fetch_responses);
    }
}

/// The relay of one sidecar: its listeners, bound at start, and how connections are relayed.
pub struct KafkaListeners {
    pub listeners: Vec<TcpListener>,
    /// The IPv4 listener's address (what explicit mode advertises).
    pub addr: SocketAddr,
    pub to: KafkaUpstream,
    pub relay: KafkaRelay,
}

impl KafkaListeners {
    /// Binds 127.0.0.1 (required) and ::1 (when this host has IPv6 loopback) on the relay's
    /// port and builds the per-record decision.
    pub async fn bind(
        config: &KafkaConfig,
        decider: Decider,
        baseline: BaselineWorkload,
        extractor: KeyExtractor,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, config.listen_port));
        let first = TcpListener::bind(v4).await.map_err(|source| Error::Bind {
            what: "Kafka relay",
            addr: v4,
            source,
        })?;
        // Port 0 (tests): the port the system chose, which explicit mode advertises.
        let bound = first.local_addr().map_err(|source| Error::Bind {
            what: "Kafka relay",
            addr: v4,
            source,
        })?;
        let mut listeners = vec![first];
        // Explicit mode advertises one address, the IPv4 one; clients come only there.
        if config.broker.is_none() {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, config.listen_port));
            match TcpListener::bind(v6).await {
                Ok(l) => listeners.push(l),
                // No IPv6 loopback here: no IPv6 rules either (spur-init programs them only
                // when the kernel has IPv6), so nothing is redirected there.
                Err(e) => {
                    tracing::info!(addr = %v6, error = %e, "Kafka relay: no IPv6 loopback listener")
                }
            }
        }
        let metrics = Arc::new(KafkaMetrics::register(registry));
        let role = config.role.clone();
        let decide_role = role.clone();
        let (keep, hold): (Keep, Option<Hold>) = match decider {
            Decider::Table(table) => (
                Arc::new(move |_topic, _batch, record| {
                    spur_kafka::key::with_candidates(&extractor, record, |c| {
                        delivered(&table, &baseline, &decide_role, c)
                    })
                }),
                None,
            ),
            Decider::History(history) => {
                let (h, m) = (history.clone(), metrics.clone());
                let keep: Keep = Arc::new(move |_topic, _batch, record| {
                    if record.timestamp >= h.watermark() {
                        m.past_watermark.inc();
                    }
                    let history = h.load();
                    spur_kafka::key::with_candidates(&extractor, record, |c| {
                        delivered_at(&history, &decide_role, c, record.timestamp)
                    })
                });
                let m = metrics.clone();
                let hold: Hold = Arc::new(move |at_ms| {
                    let (h, m) = (history.clone(), m.clone());
                    Box::pin(async move {
                        let watermark = h.watermark();
                        if watermark > at_ms {
                            return;
                        }
                        // Held at most until HOLD_MAX past the last watermark: while the route
                        // server stays away, later responses are not held at all.
                        let budget = watermark.saturating_add(HOLD_MAX_MS) - at_ms;
                        let passed = if budget > 0 {
                            m.held.inc();
                            let start = std::time::Instant::now();
                            let wait = Duration::from_millis(budget.unsigned_abs());
                            let passed = h.wait_past(at_ms, wait).await;
                            m.hold_seconds.observe(start.elapsed().as_secs_f64());
                            passed
                        } else {
                            false
                        };
                        if !passed {
                            m.hold_expired.inc();
                            m.warn_unheld(h.watermark(), at_ms);
                        }
                    })
                });
                (keep, Some(hold))
            }
        };
        let on_stats: OnStats = Arc::new(move |s| metrics.add(s));
        Ok(KafkaListeners {
            listeners,
            to: match config.broker {
                Some(broker) => KafkaUpstream::Broker(broker),
                None => KafkaUpstream::Redirected,
            },
            addr: bound,
            relay: KafkaRelay {
                session: SessionConfig {
                    role,
                    limits: Limits::default(),
                    advertise: Vec::new(),
                    front: config
                        .broker
                        .map(|_| (bound.ip().to_string(), i32::from(bound.port()))),
                    topics: spur_kafka::TopicNames::default(),
                },
                max_frame: spur_kafka::frame::DEFAULT_MAX_FRAME,
                keep,
                on_stats,
                hold,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use spur_routing::rules::PortMapping;
    use spur_routing::{ExtractConfig, Location, RoutingRule, RuleTable};

    use super::*;

    fn baseline(name: &str) -> BaselineWorkload {
        BaselineWorkload {
            kind: "Deployment".into(),
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    fn rule(key: &str, name: &str, sandbox: &str) -> RoutingRule {
        RoutingRule {
            routing_key: key.into(),
            baseline: baseline(name),
            destination_sandbox: sandbox.into(),
            mappings: vec![PortMapping {
                workload_port: 8080,
                destinations: vec![Location {
                    host: format!("{name}-{sandbox}"),
                    port: 8080,
                }],
            }],
        }
    }

    fn verdicts(table: &SharedTable, role: &Role, baggage: Option<&str>) -> bool {
        let extractor = KeyExtractor::new(&ExtractConfig::default()).unwrap();
        let mut headers = http::HeaderMap::new();
        if let Some(b) = baggage {
            headers.insert("baggage", b.parse().unwrap());
        }
        let c = extractor.extract(&headers, None);
        delivered(table, &baseline("orders"), role, &c)
    }

    #[test]
    fn every_record_has_exactly_one_consumer() {
        let table = SharedTable::new();
        table.store(RuleTable::new(vec![
            rule("k1", "orders", "alice"),
            rule("k2", "orders", "bob"),
            // Another service's fork: the orders baseline still handles k3's records.
            rule("k3", "payments", "carol"),
        ]));
        let roles = [
            Role::Baseline,
            Role::Fork {
                sandbox: "alice".into(),
            },
            Role::Fork {
                sandbox: "bob".into(),
            },
            Role::Fork {
                sandbox: "carol".into(),
            },
        ];
        for (baggage, expected) in [
            (None, 0),
            (Some("sd-routing-key=k1"), 1),
            (Some("sd-routing-key=k2"), 2),
            (Some("sd-routing-key=k3"), 0),
            (Some("sd-routing-key=unknown"), 0),
        ] {
            let got: Vec<usize> = roles
                .iter()
                .enumerate()
                .filter(|(_, r)| verdicts(&table, r, baggage))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(got, [expected], "{baggage:?}");
        }
    }

    #[test]
    fn by_the_history_every_record_has_exactly_one_consumer_whenever_it_is_decided() {
        let span = |k: &str, s: &str, since, until| {
            spur_routing::Span::new(k.into(), s.into(), since, until).unwrap()
        };
        // alice has k1 from 1 000 to 2 000, bob from 2 000 on; carol has k2 from 1 500.
        let history = History::new(vec![
            span("k1", "alice", 1_000, Some(2_000)),
            span("k1", "bob", 2_000, None),
            span("k2", "carol", 1_500, None),
        ]);
        let extractor = KeyExtractor::new(&ExtractConfig::default()).unwrap();
        let roles = ["alice", "bob", "carol"].map(|s| Role::Fork { sandbox: s.into() });
        let roles: Vec<Role> = std::iter::once(Role::Baseline).chain(roles).collect();
        for (baggage, at, expected) in [
            (None, 1_500, 0),
            (Some("sd-routing-key=k1"), 999, 0),
            (Some("sd-routing-key=k1"), 1_000, 1),
            (Some("sd-routing-key=k1"), 1_999, 1),
            (Some("sd-routing-key=k1"), 2_000, 2),
            (Some("sd-routing-key=k2"), 1_499, 0),
            (Some("sd-routing-key=k2"), 1_500, 3),
            (Some("sd-routing-key=unknown"), 1_500, 0),
        ] {
            let mut headers = http::HeaderMap::new();
            if let Some(b) = baggage {
                headers.insert("baggage", b.parse().unwrap());
            }
            let c = extractor.extract(&headers, None);
            let got: Vec<usize> = (roles.iter().enumerate())
                .filter(|(_, r)| delivered_at(&history, r, &c, at))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(got, [expected], "{baggage:?} at {at}");
        }
    }

    #[test]
    fn topic_labels_are_bounded() {
        let m = KafkaMetrics::register(&mut Registry::default());
        assert_eq!(&*m.label(&Arc::from("")), "_unknown");
        for i in 0..MAX_TOPIC_LABELS {
            let t: Arc<str> = Arc::from(format!("t{i}"));
            assert_eq!(m.label(&t), t);
        }
        assert_eq!(&*m.label(&Arc::from("one-too-many")), "_other");
        assert_eq!(
            &*m.label(&Arc::from("t0")),
            "t0",
            "a topic seen before keeps its label"
        );
        let mut stats = SessionStats::default();
        stats.topics.push((
            Arc::from("t1"),
            spur_kafka::Stats {
                records_kept: 3,
                records_dropped: 2,
                ..Default::default()
            },
        ));
        m.add(&stats);
        let mut text = String::new();
        let mut registry = Registry::default();
        registry.register("kafka_records", "", m.records.clone());
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("kafka_records_total{topic=\"t1\",verdict=\"withheld\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn flags_are_validated_once() {
        let args = |ports: &str, sandbox: Option<&str>| KafkaArgs {
            kafka_ports: ports.into(),
            kafka_broker: None,
            kafka_proxy_port: 15007,
            fork_of_sandbox: sandbox.map(str::to_owned),
        };
        let explicit = |broker: &str, ports: &str| KafkaArgs {
            kafka_broker: Some(broker.into()),
            ..args(ports, Some("alice"))
        };
        let c = explicit("127.0.0.1:9092", "")
            .validate(false)
            .unwrap()
            .unwrap();
        assert_eq!(c.broker, Some(SocketAddr::from(([127, 0, 0, 1], 9092))));
        assert!(c.ports.is_empty());
        assert_eq!(
            explicit("", "").validate(false).unwrap_err().to_string(),
            "--fork-of-sandbox applies to the Kafka relay only: it needs --kafka-ports or --kafka-broker"
        );
        for (a, why) in [
            (explicit("127.0.0.1:9092", "9092"), "give one"),
            (explicit("127.0.0.1", ""), "not a reachable HOST:PORT"),
            (explicit("127.0.0.1:0", ""), "port 0 is not a port"),
        ] {
            let e = a.validate(true).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert_eq!(args("", None).validate(true).unwrap(), None);
        assert_eq!(args(" , ", None).validate(false).unwrap(), None);
        let c = args("9092", Some("alice")).validate(true).unwrap().unwrap();
        assert_eq!(
            c.role,
            Role::Fork {
                sandbox: "alice".into()
            }
        );
        for (a, transparent, why) in [
            (args("9092", None), false, "needs --transparent"),
            (args("", Some("alice")), true, "needs --kafka-ports"),
            (args("9092,15007", None), true, "cannot be a broker port"),
            (
                args("9092", Some("Alice_1")),
                true,
                "must be a sandbox name",
            ),
            (args("0", None), true, "port 0 is not a port"),
            (args("9092-9094", None), true, "--kafka-ports"),
        ] {
            let e = a.validate(transparent).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }
}
