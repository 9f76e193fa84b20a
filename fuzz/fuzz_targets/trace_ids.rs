//! Fuzzes the trace-id parsers (`traceparent`, `b3`, `x-b3-traceid`, `uber-trace-id`): any bytes
//! as a value of each header. A parsed id is never zero, the cheap pre-test passes every
//! recorded one, and an id written back in the header's canonical form parses to the same id.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spur_routing::trace::{TraceCarrier, format_id, is_recorded, recorded_id};

fuzz_target!(|data: &[u8]| {
    for carrier in TraceCarrier::ALL {
        let Some(id) = carrier.trace_id(data) else {
            continue;
        };
        assert_ne!(id, 0, "{carrier:?}");
        // The four-byte pre-test never turns away a recorded trace.
        if is_recorded(id) {
            assert!(carrier.may_be_recorded(data), "{carrier:?}");
        }
        let hex = format_id(id);
        let canonical = match carrier {
            TraceCarrier::TraceParent => format!("00-{hex}-00f067aa0ba902b7-01"),
            TraceCarrier::B3 => format!("{hex}-00f067aa0ba902b7"),
            TraceCarrier::B3Multi => hex.clone(),
            TraceCarrier::Uber => format!("{hex}:1:0:1"),
        };
        assert_eq!(carrier.trace_id(canonical.as_bytes()), Some(id), "{canonical}");
        assert!(is_recorded(recorded_id(id)));
    }
});
