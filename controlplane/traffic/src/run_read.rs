//! ReadRun: what a run started for a user recorded of its own requests, cut down to what a
//! comparison of calls reads (proto/traffic.proto). Its caller holds the run's token, not a
//! right to the sandbox's traffic: it gets the run's marked requests and the calls they caused,
//! which the run's report shows anyway, and nothing else the sandbox's key carried meanwhile.

use spur_proto::traffic::{Exchange, Filter, Header};
use spur_smarttest::marker::{MARKER, is_of_run, marker_in};

use crate::Error;
use crate::runs::Run;
use crate::store::{Bodies, MAX_QUERY_LIMIT, MAX_REPLY_BYTES, Store};

/// Most exchanges one ReadRun returns (a run takes in as many).
pub const MAX_READ: usize = 10_000;
/// Start times are the sidecars' clocks, the run's start the store's: read from a little before.
const CLOCK_SLACK_MICROS: i64 = 5_000_000;
/// Pages of the store read at most for one ReadRun: a sandbox whose key carried much other
/// traffic during the run does not hold the store's one thread for long.
const MAX_PAGES: usize = 200;

/// What ReadRun found.
#[derive(Debug, Default)]
pub(crate) struct Read {
    /// Newest first.
    pub(crate) exchanges: Vec<Exchange>,
    /// More were recorded (or more were left unread) than returned.
    pub(crate) truncated: bool,
}

/// The run's own exchanges in `store` (those carrying one of its keys and a marker with its
/// `tag`), cut down by [`own`].
pub(crate) async fn read(store: &Store, run: &Run, tag: &str) -> Result<Read, Error> {
    let mut out = Read::default();
    let mut bytes = 0usize;
    let mut until = 0i64;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..MAX_PAGES {
        let filter = Filter {
            sandbox: run.sandbox.clone(),
            since_unix_micros: run
                .since_unix_micros
                .saturating_sub(CLOCK_SLACK_MICROS)
                .max(1),
            until_unix_micros: until,
            ..Filter::default()
        };
        let page = store
            .query_with(filter, MAX_QUERY_LIMIT, Bodies::Left)
            .await?;
        let mut oldest = i64::MAX;
        let mut new = 0usize;
        // Whether the store may have left exchanges out of this page: it was cut at the count
        // or at the bytes (an exchange without bodies is far below half of them).
        let page_bytes: usize = page.iter().map(prost::Message::encoded_len).sum();
        let full = page.len() >= MAX_QUERY_LIMIT as usize || page_bytes > MAX_REPLY_BYTES / 2;
        for stored in page {
            let Some(x) = stored.exchange else { continue };
            oldest = oldest.min(x.start_unix_micros);
            if !seen.insert(x.id.clone()) {
                continue;
            }
            new += 1;
            if let Some(mine) = own(run, tag, &x) {
                if out.exchanges.len() >= MAX_READ {
                    out.truncated = true;
                    return Ok(out);
                }
                bytes += prost::Message::encoded_len(&mine);
                if bytes > MAX_REPLY_BYTES / 2 {
                    out.truncated = true;
                    return Ok(out);
                }
                out.exchanges.push(mine);
            }
        }
        // A page with nothing new ends it; the next page ends after the oldest of this one
        // (its start time included, so exchanges sharing it are not lost). A full page that
        // cannot move on (more exchanges share one start time than a page holds) leaves some
        // unread: truncated.
        if new == 0 || oldest == i64::MAX || oldest + 1 == until {
            out.truncated |= full;
            return Ok(out);
        }
        until = oldest + 1;
    }
    out.truncated = true;
    Ok(out)
}

/// `x` as ReadRun returns it, if it is the run's: one of its keys and a marker of its `tag`.
/// Kept: the baseline, the sandbox and key, the protocol, method, path without its query,
/// status, `grpc-status`, whether it failed, the start and durations, and the marker as its one
/// request header. The query, every other header, the pod, the destination, the authority,
/// the error's text and the bodies (their sizes too) are left out.
pub(crate) fn own(run: &Run, tag: &str, x: &Exchange) -> Option<Exchange> {
    if x.routing_key != run.routing_key && x.routing_key != run.reference_key {
        return None;
    }
    let marker = marker_in(
        x.request_headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_slice())),
    )?;
    if !is_of_run(&marker, tag) {
        return None;
    }
    let grpc_status = |headers: &[Header]| -> Vec<Header> {
        headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("grpc-status"))
            .take(1)
            .cloned()
            .collect()
    };
    Some(Exchange {
        id: x.id.clone(),
        baseline: x.baseline.clone(),
        sandbox: x.sandbox.clone(),
        routing_key: x.routing_key.clone(),
        protocol: x.protocol,
        method: x.method.clone(),
        path: x.path.split('?').next().unwrap_or_default().to_owned(),
        status: x.status,
        request_headers: vec![Header {
            name: "baggage".into(),
            value: format!("{MARKER}={marker}").into_bytes(),
        }],
        response_headers: grpc_status(&x.response_headers),
        response_trailers: grpc_status(&x.response_trailers),
        start_unix_micros: x.start_unix_micros,
        response_micros: x.response_micros,
        duration_micros: x.duration_micros,
        error: if x.error.is_empty() {
            String::new()
        } else {
            "failed".into()
        },
        ..Exchange::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spur_proto::traffic::{Body, Workload};
    use std::time::Instant;

    fn run() -> Run {
        Run {
            sandbox: "sb".into(),
            routing_key: "key1".into(),
            reference_key: "spur-run-ref".into(),
            namespaces: ["shop".to_owned()].into(),
            until: Instant::now(),
            started_by: "ann".into(),
            since_unix_micros: 1,
            delegated: None,
        }
    }

    fn exchange(key: &str, baggage: &str) -> Exchange {
        Exchange {
            id: "7".into(),
            baseline: Some(Workload {
                kind: "Deployment".into(),
                namespace: "shop".into(),
                name: "catalog".into(),
            }),
            pod: "catalog-1".into(),
            sandbox: "sb".into(),
            routing_key: key.into(),
            destination: "10.0.0.1:8080".into(),
            method: "GET".into(),
            path: "/items?session=secret".into(),
            authority: "catalog.shop".into(),
            status: 200,
            request_headers: vec![
                Header {
                    name: "x-api-key".into(),
                    value: b"secret".to_vec(),
                },
                Header {
                    name: "baggage".into(),
                    value: baggage.as_bytes().to_vec(),
                },
            ],
            response_headers: vec![Header {
                name: "set-cookie".into(),
                value: b"secret".to_vec(),
            }],
            response_trailers: vec![Header {
                name: "grpc-status".into(),
                value: b"14".to_vec(),
            }],
            request_body: Some(Body {
                size: 6,
                data: b"secret".to_vec(),
                truncated: false,
            }),
            error: "connect to 10.0.0.1:8080 refused".into(),
            start_unix_micros: 5,
            ..Exchange::default()
        }
    }

    #[test]
    fn a_run_gets_its_own_marked_exchanges_with_nothing_but_what_calls_compare() {
        let r = run();
        let mine = own(&r, "t1", &exchange("key1", "sd=key1,spur-test-step=t1.0.s")).unwrap();
        assert_eq!(mine.path, "/items");
        assert_eq!(mine.method, "GET");
        assert_eq!(mine.status, 200);
        assert_eq!(mine.baseline.as_ref().unwrap().name, "catalog");
        assert_eq!(mine.request_headers.len(), 1);
        assert_eq!(mine.request_headers[0].value, b"spur-test-step=t1.0.s");
        assert!(mine.response_headers.is_empty());
        assert_eq!(mine.response_trailers[0].value, b"14");
        assert_eq!(mine.error, "failed");
        assert!(mine.request_body.is_none() && mine.response_body.is_none());
        assert!(mine.pod.is_empty() && mine.destination.is_empty() && mine.authority.is_empty());
        let printed = format!("{mine:?}");
        assert!(!printed.contains("secret"), "{printed}");

        // The reference key's too.
        assert!(
            own(
                &r,
                "t1",
                &exchange("spur-run-ref", "spur-test-step=t1.2.b2")
            )
            .is_some()
        );
        // Not: another key, no marker, another run's marker, a marker of no step.
        assert!(own(&r, "t1", &exchange("key2", "spur-test-step=t1.0.s")).is_none());
        assert!(own(&r, "t1", &exchange("key1", "sd=key1")).is_none());
        assert!(own(&r, "t1", &exchange("key1", "spur-test-step=t2.0.s")).is_none());
        assert!(own(&r, "t1", &exchange("key1", "spur-test-step=t1")).is_none());
    }

    #[tokio::test]
    async fn more_exchanges_at_one_start_time_than_a_page_holds_come_back_truncated() {
        let r = run();
        let at_once = |n: usize| {
            (0..n)
                .map(|i| Exchange {
                    id: format!("x{i}"),
                    start_unix_micros: 1_000,
                    ..exchange("key1", "spur-test-step=t1.0.s")
                })
                .collect::<Vec<_>>()
        };
        let page = MAX_QUERY_LIMIT as usize;
        let store = Store::open(None, crate::store::Limits::default()).unwrap();
        store.insert("catalog", at_once(page - 1)).await.unwrap();
        let got = read(&store, &r, "t1").await.unwrap();
        assert_eq!((got.exchanges.len(), got.truncated), (page - 1, false));

        let store = Store::open(None, crate::store::Limits::default()).unwrap();
        store.insert("catalog", at_once(page + 1)).await.unwrap();
        let got = read(&store, &r, "t1").await.unwrap();
        assert_eq!((got.exchanges.len(), got.truncated), (page, true));
    }
}
