//! The sidecar's Kafka relay (issue 44, `docs/async.md`): the pod's own connections to Kafka
//! brokers are redirected to it by the interception rules (`SPUR_KAFKA_PORTS`), and it relays
//! each to its original destination, so that the app's consumer receives only the records that
//! are its to handle.
//!
//! Who decides: the same routing table the sidecar routes HTTP with, for the same baseline
//! workload. A record's routing key (its headers, with the HTTP carriers and parser) that has a
//! rule for this baseline, on any port, belongs to the rule's sandbox:
//! - in a baseline pod, such a record is withheld (the fork handles it); every other record is
//!   delivered;
//! - in a fork pod (`--fork-of-sandbox S`), only records whose key routes this baseline to `S`
//!   are delivered, and the app's consumer group and transactional ids are renamed per sandbox,
//!   so the fork never joins the baseline's group.
//!
//! Who can use it: only the pod's own processes. The listeners are on loopback, and a connection
//! that was not redirected there (so has no broker as its original destination) is closed. The
//! relay connects to the broker the app chose, as the app would have: it adds no reach.
//!
//! Until the first routing table is in, connections wait in the listen queue, unanswered: a
//! baseline that relayed before knowing the routes would deliver records that are a fork's.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use clap::Args;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use spur_kafka::{Limits, Role, SessionConfig, SessionStats};
use spur_proxy::kafka::{KafkaRelay, Keep, OnStats};
use spur_routing::{BaselineWorkload, Candidates, KeyExtractor, SharedTable};
use tokio::net::TcpListener;

use crate::Error;

/// Flags of the Kafka relay (part of [`crate::SidecarArgs`]).
#[derive(Debug, Clone, Default, Args)]
pub struct KafkaArgs {
    /// Kafka broker ports, comma-separated: the pod's own connections to them are relayed by
    /// routing key (spur-init's rules read the same variable). Empty: no Kafka relay, no rule.
    #[arg(long, env = "SPUR_KAFKA_PORTS", default_value = "")]
    pub kafka_ports: String,
    /// Port the Kafka relay listens on, on 127.0.0.1 and ::1 (the interception rules redirect
    /// to it).
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
    /// Broker ports whose connections are redirected here.
    pub ports: BTreeSet<u16>,
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
        if ports.is_empty() {
            if self.fork_of_sandbox.is_some() {
                return Err(Error::Config(
                    "--fork-of-sandbox applies to the Kafka relay only: it needs --kafka-ports"
                        .into(),
                ));
            }
            return Ok(None);
        }
        if !transparent {
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
            listen_port: self.kafka_proxy_port,
            role,
        }))
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
    let routed_to = if candidates.is_empty() {
        None
    } else {
        let snapshot = table.load();
        snapshot
            .table
            .baseline(baseline)
            .and_then(|rules| rules.route_any_port(candidates))
            .map(|d| d.sandbox.clone())
    };
    match (role, routed_to) {
        (Role::Baseline, routed_to) => routed_to.is_none(),
        (Role::Fork { sandbox }, Some(to)) => *to == **sandbox,
        (Role::Fork { .. }, None) => false,
    }
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
        }
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
    pub relay: KafkaRelay,
}

impl KafkaListeners {
    /// Binds 127.0.0.1 (required) and ::1 (when this host has IPv6 loopback) on the relay's
    /// port and builds the per-record decision.
    pub async fn bind(
        config: &KafkaConfig,
        table: SharedTable,
        baseline: BaselineWorkload,
        extractor: KeyExtractor,
        registry: &mut Registry,
    ) -> Result<Self, Error> {
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, config.listen_port));
        let mut listeners = vec![TcpListener::bind(v4).await.map_err(|source| Error::Bind {
            what: "Kafka relay",
            addr: v4,
            source,
        })?];
        let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, config.listen_port));
        match TcpListener::bind(v6).await {
            Ok(l) => listeners.push(l),
            // No IPv6 loopback here: no IPv6 rules either (spur-init programs them only when
            // the kernel has IPv6), so nothing is redirected there.
            Err(e) => {
                tracing::info!(addr = %v6, error = %e, "Kafka relay: no IPv6 loopback listener")
            }
        }
        let metrics = KafkaMetrics::register(registry);
        let role = config.role.clone();
        let decide_role = role.clone();
        let keep: Keep = Arc::new(move |_topic, _batch, record| {
            spur_kafka::key::with_candidates(&extractor, record, |c| {
                delivered(&table, &baseline, &decide_role, c)
            })
        });
        let on_stats: OnStats = Arc::new(move |s| metrics.add(s));
        Ok(KafkaListeners {
            listeners,
            relay: KafkaRelay {
                session: SessionConfig {
                    role,
                    limits: Limits::default(),
                    advertise: Vec::new(),
                    topics: spur_kafka::TopicNames::default(),
                },
                max_frame: spur_kafka::frame::DEFAULT_MAX_FRAME,
                keep,
                on_stats,
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
            kafka_proxy_port: 15007,
            fork_of_sandbox: sandbox.map(str::to_owned),
        };
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
