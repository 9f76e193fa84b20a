//! Proxy metrics, registered into the caller's registry. Handles are resolved once at
//! construction so the request path only touches atomics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::detect::Protocol;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProtocolLabels {
    protocol: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FirstLabels {
    first: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

/// Why the HTTP/2 relay sent a request upstream again: each says the upstream had not processed
/// it (RFC 9113 §8.7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// The upstream reset the stream with REFUSED_STREAM.
    RefusedStream,
    /// The stream's id was above the last stream id of the upstream's GOAWAY, or the connection
    /// was going away (GOAWAY) when the stream was opened on it.
    GoAway,
    /// The connection closed as the stream was being opened on it: nothing was sent.
    Closed,
}

/// Who spoke first on a connection whose client was silent through protocol detection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Silent {
    /// The client, later: its bytes were detected as usual (an HTTP pool's spare connection).
    Client,
    /// The application: a server-first protocol, spliced as opaque TCP.
    Server,
    /// Neither: a side closed first (spliced, so the other side sees it), or nothing moved for
    /// the idle timeout, or the proxy drained.
    Nobody,
}

/// Where a request ended up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Forwarded to the original destination (the baseline application).
    Baseline,
    /// Forwarded to a sandbox destination from the routing table.
    Sandbox,
    /// Answered by the proxy itself with an error (bad request, upstream failure, …).
    Error,
}

#[derive(Clone, Debug)]
struct PerOutcome {
    requests: Counter,
    latency: Histogram,
}

#[derive(Clone, Debug)]
struct PerProtocol {
    accepted: Counter,
    active: Gauge,
}

/// The proxy's metrics (prefix chosen by the caller's registry):
/// `requests_total{outcome}`, `request_duration_seconds{outcome}` (time to response headers),
/// `connections_total{protocol}`, `active_connections{protocol}`,
/// `upstream_connects_total{result}`, `pool_stale_closed_total`, `http1_handovers_total`,
/// `kafka_refused_connections_total`, `detect_silent_total{first}`, `detect_silent_waiting`,
/// `upstream_stream_retries_total{cause}`.
#[derive(Clone, Debug)]
pub struct Metrics {
    baseline: PerOutcome,
    sandbox: PerOutcome,
    error: PerOutcome,
    http1: PerProtocol,
    http2: PerProtocol,
    tls: PerProtocol,
    tcp: PerProtocol,
    kafka: PerProtocol,
    connect_ok: Counter,
    connect_err: Counter,
    pub(crate) stale_closed: Counter,
    pub(crate) handovers: Counter,
    kafka_refused: Counter,
    silent_client: Counter,
    silent_server: Counter,
    silent_nobody: Counter,
    silent_waiting: Gauge,
    retry_refused: Counter,
    retry_goaway: Counter,
    retry_closed: Counter,
}

impl Metrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let requests = Family::<OutcomeLabels, Counter>::default();
        let latency = Family::<OutcomeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 2.0, 18))
        });
        let accepted = Family::<ProtocolLabels, Counter>::default();
        let active = Family::<ProtocolLabels, Gauge>::default();
        let connects = Family::<ResultLabels, Counter>::default();
        let stale_closed = Counter::default();
        let handovers = Counter::default();
        let kafka_refused = Counter::default();
        let silent = Family::<FirstLabels, Counter>::default();
        let silent_waiting = Gauge::default();
        let retries = Family::<CauseLabels, Counter>::default();
        registry.register(
            "upstream_stream_retries",
            "HTTP/2 requests the relay sent upstream again because the upstream had not processed them, by cause: refused_stream (RST_STREAM REFUSED_STREAM), goaway (the stream was above a GOAWAY's last stream id, or opened on a connection going away), closed (the connection closed as the stream was opened)",
            retries.clone(),
        );
        registry.register(
            "detect_silent_waiting",
            "Inbound connections silent past detectTimeout that wait for either side to speak (not yet in active_connections)",
            silent_waiting.clone(),
        );
        registry.register(
            "detect_silent",
            "Inbound connections whose client sent nothing within detectTimeout, by who spoke first: client (detected then, e.g. an HTTP pool's spare connection), server (a server-first protocol, opaque) or nobody",
            silent.clone(),
        );
        registry.register(
            "requests",
            "HTTP requests by where they were routed",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from request received to response headers sent",
            latency.clone(),
        );
        registry.register(
            "connections",
            "Accepted inbound connections by detected protocol",
            accepted.clone(),
        );
        registry.register(
            "active_connections",
            "Open inbound connections by detected protocol",
            active.clone(),
        );
        registry.register(
            "upstream_connects",
            "Upstream connection attempts by result",
            connects.clone(),
        );
        registry.register(
            "pool_stale_closed",
            "Pooled upstream connections closed because their destination left the routing table",
            stale_closed.clone(),
        );
        registry.register(
            "http1_handovers",
            "HTTP/1 connections the relay handed to the full (hyper) path, at a request it does not forward byte for byte",
            handovers.clone(),
        );
        registry.register(
            "kafka_refused_connections",
            "Kafka connections closed because a frame from the client or the broker was refused (the log line says which and why)",
            kafka_refused.clone(),
        );
        let outcome = |o: &'static str| PerOutcome {
            requests: requests
                .get_or_create(&OutcomeLabels { outcome: o })
                .clone(),
            latency: latency.get_or_create(&OutcomeLabels { outcome: o }).clone(),
        };
        let proto = |p: Protocol| PerProtocol {
            accepted: accepted
                .get_or_create(&ProtocolLabels {
                    protocol: p.as_str(),
                })
                .clone(),
            active: active
                .get_or_create(&ProtocolLabels {
                    protocol: p.as_str(),
                })
                .clone(),
        };
        // One statement per handle: a `get_or_create` guard lives until the end of its statement,
        // and two on the same family in one expression deadlock.
        let connect_ok = connects
            .get_or_create(&ResultLabels { result: "ok" })
            .clone();
        let connect_err = connects
            .get_or_create(&ResultLabels { result: "error" })
            .clone();
        let silent_client = silent
            .get_or_create(&FirstLabels { first: "client" })
            .clone();
        let silent_server = silent
            .get_or_create(&FirstLabels { first: "server" })
            .clone();
        let silent_nobody = silent
            .get_or_create(&FirstLabels { first: "nobody" })
            .clone();
        let retry_refused = retries
            .get_or_create(&CauseLabels {
                cause: "refused_stream",
            })
            .clone();
        let retry_goaway = retries
            .get_or_create(&CauseLabels { cause: "goaway" })
            .clone();
        let retry_closed = retries
            .get_or_create(&CauseLabels { cause: "closed" })
            .clone();
        Metrics {
            baseline: outcome("baseline"),
            sandbox: outcome("sandbox"),
            error: outcome("error"),
            http1: proto(Protocol::Http1),
            http2: proto(Protocol::Http2),
            tls: proto(Protocol::Tls),
            tcp: proto(Protocol::Opaque),
            kafka: proto(Protocol::Kafka),
            connect_ok,
            connect_err,
            stale_closed,
            handovers,
            kafka_refused,
            silent_client,
            silent_server,
            silent_nobody,
            silent_waiting,
            retry_refused,
            retry_goaway,
            retry_closed,
        }
    }

    /// Counts a request the HTTP/2 relay sends upstream again.
    pub(crate) fn stream_retry(&self, cause: Retry) {
        match cause {
            Retry::RefusedStream => self.retry_refused.inc(),
            Retry::GoAway => self.retry_goaway.inc(),
            Retry::Closed => self.retry_closed.inc(),
        };
    }

    pub(crate) fn request(&self, outcome: Outcome, seconds: f64) {
        let m = match outcome {
            Outcome::Baseline => &self.baseline,
            Outcome::Sandbox => &self.sandbox,
            Outcome::Error => &self.error,
        };
        m.requests.inc();
        m.latency.observe(seconds);
    }

    fn proto(&self, p: Protocol) -> &PerProtocol {
        match p {
            Protocol::Http1 => &self.http1,
            Protocol::Http2 => &self.http2,
            Protocol::Tls => &self.tls,
            Protocol::Opaque => &self.tcp,
            Protocol::Kafka => &self.kafka,
        }
    }

    /// Counts an accepted connection and keeps it in `active_connections` until the guard drops.
    pub(crate) fn connection(&self, p: Protocol) -> ActiveGuard {
        let m = self.proto(p);
        m.accepted.inc();
        m.active.inc();
        ActiveGuard(m.active.clone())
    }

    pub(crate) fn silent(&self, first: Silent) {
        match first {
            Silent::Client => self.silent_client.inc(),
            Silent::Server => self.silent_server.inc(),
            Silent::Nobody => self.silent_nobody.inc(),
        };
    }

    /// Counts a silent connection in `detect_silent_waiting` until the guard drops.
    pub(crate) fn silent_waiting(&self) -> ActiveGuard {
        self.silent_waiting.inc();
        ActiveGuard(self.silent_waiting.clone())
    }

    pub(crate) fn kafka_refused(&self) {
        self.kafka_refused.inc();
    }

    pub(crate) fn upstream_connect(&self, ok: bool) {
        if ok {
            self.connect_ok.inc()
        } else {
            self.connect_err.inc()
        };
    }

    /// Requests counted so far with this outcome (tests and the demo's self-check read it).
    pub fn requests_baseline(&self) -> u64 {
        self.baseline.requests.get()
    }
    pub fn requests_sandbox(&self) -> u64 {
        self.sandbox.requests.get()
    }
    pub fn requests_error(&self) -> u64 {
        self.error.requests.get()
    }
}

pub(crate) struct ActiveGuard(Gauge);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
