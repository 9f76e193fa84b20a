//! Tunnel metrics, registered into the caller's registry (which picks the prefix). Handles are
//! resolved once at construction, so streams only touch atomics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::Transport;
use crate::wire::StreamKind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransportLabels {
    transport: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    transport: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug)]
pub(crate) struct PerKind {
    pub total: Counter,
    pub active: Gauge,
    pub bytes_in: Counter,
    pub bytes_out: Counter,
    pub rejected: Counter,
}

#[derive(Clone, Debug)]
pub(crate) struct PerTransport {
    pub total: Counter,
    pub active: Gauge,
}

/// Server: `sessions_total{transport}`, `sessions_active{transport}`,
/// `streams_total{kind}`, `streams_active{kind}`, `stream_bytes_received_total{kind}`,
/// `stream_bytes_sent_total{kind}`, `streams_rejected_total{kind}`, `auth_failures_total{reason}`,
/// `handshakes_shed_total{reason}`, `rtt_seconds`. Client: the same without `auth_failures`, plus `reconnects_total` and
/// `connect_attempts_total{transport,result}`. `kind` is `forward` (workstation → cluster) or
/// `reverse`; bytes are counted at this end.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub quic: PerTransport,
    pub h2: PerTransport,
    pub forward: PerKind,
    pub reverse: PerKind,
    auth_failures: Family<ReasonLabels, Counter>,
    handshakes_shed: Family<ReasonLabels, Counter>,
    pub reconnects: Counter,
    attempts: Family<AttemptLabels, Counter>,
    pub rtt: Histogram,
}

impl Metrics {
    fn build(registry: &mut Registry, server: bool) -> Self {
        let sessions = Family::<TransportLabels, Counter>::default();
        let sessions_active = Family::<TransportLabels, Gauge>::default();
        let streams = Family::<KindLabels, Counter>::default();
        let streams_active = Family::<KindLabels, Gauge>::default();
        let bytes_in = Family::<KindLabels, Counter>::default();
        let bytes_out = Family::<KindLabels, Counter>::default();
        let rejected = Family::<KindLabels, Counter>::default();
        let auth_failures = Family::<ReasonLabels, Counter>::default();
        let handshakes_shed = Family::<ReasonLabels, Counter>::default();
        let reconnects = Counter::default();
        let attempts = Family::<AttemptLabels, Counter>::default();
        let rtt = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register("sessions", "Tunnel sessions established", sessions.clone());
        registry.register(
            "sessions_active",
            "Tunnel sessions currently established",
            sessions_active.clone(),
        );
        registry.register("streams", "Tunnel streams established", streams.clone());
        registry.register(
            "streams_active",
            "Tunnel streams currently open",
            streams_active.clone(),
        );
        registry.register(
            "stream_bytes_received",
            "Bytes received on tunnel streams",
            bytes_in.clone(),
        );
        registry.register(
            "stream_bytes_sent",
            "Bytes sent on tunnel streams",
            bytes_out.clone(),
        );
        registry.register(
            "streams_rejected",
            "Stream opens rejected by the acceptor or failed before establishment",
            rejected.clone(),
        );
        registry.register(
            "rtt_seconds",
            "Control-channel round-trip time",
            rtt.clone(),
        );
        if server {
            registry.register(
                "auth_failures",
                "Sessions refused during the handshake, by reason",
                auth_failures.clone(),
            );
            registry.register(
                "handshakes_shed",
                "Connections closed before their handshake finished to keep room for others, by \
                 reason (peer_cap: their peer had its share in flight; evicted_oldest: the \
                 oldest handshake gave its slot to a new connection)",
                handshakes_shed.clone(),
            );
        } else {
            registry.register(
                "reconnects",
                "Sessions re-established after a previous one ended",
                reconnects.clone(),
            );
            registry.register(
                "connect_attempts",
                "Transport connection attempts by result",
                attempts.clone(),
            );
        }
        let transport = |t: Transport| PerTransport {
            total: sessions
                .get_or_create(&TransportLabels {
                    transport: t.as_str(),
                })
                .clone(),
            active: sessions_active
                .get_or_create(&TransportLabels {
                    transport: t.as_str(),
                })
                .clone(),
        };
        let kind = |k: StreamKind| {
            let l = KindLabels { kind: k.as_str() };
            PerKind {
                total: streams.get_or_create(&l).clone(),
                active: streams_active.get_or_create(&l).clone(),
                bytes_in: bytes_in.get_or_create(&l).clone(),
                bytes_out: bytes_out.get_or_create(&l).clone(),
                rejected: rejected.get_or_create(&l).clone(),
            }
        };
        Metrics {
            quic: transport(Transport::Quic),
            h2: transport(Transport::H2),
            forward: kind(StreamKind::Forward),
            reverse: kind(StreamKind::Reverse),
            auth_failures,
            handshakes_shed,
            reconnects,
            attempts,
            rtt,
        }
    }

    pub(crate) fn server(registry: &mut Registry) -> Self {
        Self::build(registry, true)
    }

    pub(crate) fn client(registry: &mut Registry) -> Self {
        Self::build(registry, false)
    }

    pub(crate) fn transport(&self, t: Transport) -> &PerTransport {
        match t {
            Transport::Quic => &self.quic,
            Transport::H2 => &self.h2,
        }
    }

    pub(crate) fn kind(&self, k: StreamKind) -> &PerKind {
        match k {
            StreamKind::Forward => &self.forward,
            StreamKind::Reverse => &self.reverse,
        }
    }

    pub(crate) fn auth_failure(&self, reason: &'static str) {
        self.auth_failures
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub(crate) fn handshake_shed(&self, reason: &'static str) {
        self.handshakes_shed
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub(crate) fn attempt(&self, t: Transport, ok: bool) {
        self.attempts
            .get_or_create(&AttemptLabels {
                transport: t.as_str(),
                result: if ok { "ok" } else { "error" },
            })
            .inc();
    }
}
