//! Routing keys of records: the same carriers and the same parser as HTTP requests
//! (`spur_routing::KeyExtractor`), read from record headers.
//!
//! Kafka header keys are case-sensitive strings, HTTP field names are not: a record header
//! counts as a carrier when its key equals a carrier's name ignoring ASCII case (OpenTelemetry's
//! Kafka instrumentation writes `baggage`, lower case, as HTTP/2 does).

use http::{HeaderMap, HeaderValue};
use spur_routing::{Candidates, KeyExtractor};

use crate::records::Record;

/// The record's carrier headers as an HTTP header map, for [`KeyExtractor::extract`]; `None`
/// (and nothing allocated) when the record has none. A header whose value is null or not a
/// valid HTTP field value is skipped, as a request's would be.
pub fn carrier_headers(extractor: &KeyExtractor, record: &Record<'_>) -> Option<HeaderMap> {
    let mut map: Option<HeaderMap> = None;
    for (name, value) in record.headers() {
        let Some(value) = value else { continue };
        let Some(carrier) = extractor
            .headers()
            .find(|h| h.as_str().as_bytes().eq_ignore_ascii_case(name))
        else {
            continue;
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        map.get_or_insert_with(HeaderMap::new)
            .append(carrier.clone(), value);
    }
    map
}

/// Calls `f` with the record's candidate routing keys in the extractor's precedence order
/// (no query parameter: records have none). Empty when the record carries no key.
pub fn with_candidates<R>(
    extractor: &KeyExtractor,
    record: &Record<'_>,
    f: impl FnOnce(&Candidates<'_>) -> R,
) -> R {
    match carrier_headers(extractor, record) {
        Some(map) => f(&extractor.extract(&map, None)),
        None => f(&Candidates::default()),
    }
}
