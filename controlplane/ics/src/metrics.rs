//! The io context server's metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub method: &'static str,
    /// The gRPC code's name: `Ok`, `PermissionDenied`, ...
    pub code: String,
}

/// Counters of `spur-ics serve`.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub calls: Family<CallLabels, Counter>,
    /// Bytes of output values stored.
    pub output_bytes: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("spur_ics");
        r.register(
            "calls",
            "Calls by method and gRPC result code",
            m.calls.clone(),
        );
        r.register(
            "output_bytes",
            "Bytes of output values stored",
            m.output_bytes.clone(),
        );
        m
    }

    pub(crate) fn call(&self, method: &'static str, code: tonic::Code) {
        self.calls
            .get_or_create(&CallLabels {
                method,
                code: format!("{code:?}"),
            })
            .inc();
    }
}
