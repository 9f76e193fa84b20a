//! When the HTTP/2 relay sends a request upstream again: only when the upstream said it did not
//! process it (RFC 9113 §8.7), so that sending it again cannot do anything twice, and only a
//! few times. Whether the request can still be sent as it came (nothing of its body was sent)
//! is the exchange's part (`RequestSide::replayable`).
//!
//! The retry goes to the same destination (the route is not chosen again), through the pool:
//! on the shared connection after a REFUSED_STREAM (the connection is fine; an upstream over
//! its stream limit or overloaded refuses single streams), on a new one after a GOAWAY (the
//! connection that sent it fails every new stream from then on, `Pool::open_h2` drops it from
//! the pool and connects again).

use h2::Reason;
use http::Request;

use crate::Error;
use crate::metrics::Retry;

/// How many times a request goes again, at most (three attempts in all): enough to get past a
/// connection closing in a rolling update and a refusal or two, few enough that an upstream
/// refusing everything costs its clients little more than one round trip each.
pub(super) const MAX_RETRIES: usize = 2;

/// Why an upstream stream that failed before its response head was not processed, if it was
/// not: then the request may be sent again.
///
/// - RST_STREAM with REFUSED_STREAM from the upstream: "the stream is being closed prior to any
///   processing having occurred" (RFC 9113 §8.7).
/// - A GOAWAY from the upstream: h2 fails a stream with the peer's GOAWAY error only when the
///   stream's id is above the GOAWAY's last stream id (`recv_go_away` in
///   `h2/src/proto/streams/streams.rs`), which the upstream did not and will not process (RFC
///   9113 §6.8). The streams at or below it go on; if the connection then ends under them,
///   they fail with an I/O error, never this one, so they are not sent again.
///
/// Only a graceful GOAWAY (NO_ERROR: a server shutting down) is followed by a retry. One for an
/// error (PROTOCOL_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM, …) also leaves the stream
/// unprocessed, but the stream may be what caused it: sent again, it could take down a new
/// connection, and the other requests on it, each time.
///
/// Resets h2 itself sent, and every other error (the upstream's INTERNAL_ERROR, a lost
/// connection), may come after the upstream acted on the request, so they are not retried.
pub(super) fn unprocessed(e: &h2::Error) -> Option<Retry> {
    if !e.is_remote() {
        None
    } else if e.is_go_away() {
        (e.reason() == Some(Reason::NO_ERROR)).then_some(Retry::GoAway)
    } else if e.is_reset() && e.reason() == Some(Reason::REFUSED_STREAM) {
        Some(Retry::RefusedStream)
    } else {
        None
    }
}

/// Why a stream could not be opened at all, if the request may go again: the pooled connection
/// went away as it was opened (`Error::StreamNotOpened`), so h2 sent nothing of it.
pub(super) fn not_opened(e: &Error) -> Option<Retry> {
    match e {
        Error::StreamNotOpened { source, .. } if source.is_go_away() => Some(Retry::GoAway),
        Error::StreamNotOpened { .. } => Some(Retry::Closed),
        _ => None,
    }
}

/// A copy of a request head as h2 sends it: method, target, version and header fields.
/// Extensions are not copied; h2 drops them before sending (the one it reads, the extended
/// CONNECT protocol, never reaches the relay, which refuses CONNECT).
pub(super) fn copy_head(head: &Request<()>) -> Request<()> {
    let mut copy = Request::new(());
    *copy.method_mut() = head.method().clone();
    *copy.uri_mut() = head.uri().clone();
    *copy.version_mut() = head.version();
    *copy.headers_mut() = head.headers().clone();
    copy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copied_head_is_the_head_h2_would_send() {
        let head = Request::builder()
            .method("POST")
            .uri("http://app.example:8080/orders?id=7")
            .version(http::Version::HTTP_2)
            .header("baggage", "sd-routing-key=k1")
            .header("x-multi", "a")
            .header("x-multi", "b")
            .body(())
            .unwrap();
        let copy = copy_head(&head);
        assert_eq!(copy.method(), head.method());
        assert_eq!(copy.uri(), head.uri());
        assert_eq!(copy.version(), head.version());
        assert_eq!(copy.headers(), head.headers());
        let multi: Vec<_> = copy.headers().get_all("x-multi").iter().collect();
        assert_eq!(multi, ["a", "b"]);
    }

    #[test]
    fn only_errors_that_say_the_upstream_did_not_process_the_stream_are_retried() {
        // Errors an application can build: none of them is the upstream's word.
        assert_eq!(unprocessed(&h2::Error::from(Reason::REFUSED_STREAM)), None);
        assert_eq!(unprocessed(&h2::Error::from(Reason::NO_ERROR)), None);
        // A stream h2 could not open, and so never sent, goes again; any other failure to
        // open one (the head refused, a connect error) does not.
        let stream = Error::Stream {
            upstream: "app".into(),
            source: h2::Error::from(Reason::REFUSED_STREAM),
        };
        assert_eq!(not_opened(&stream), None);
        let gone = Error::StreamNotOpened {
            upstream: "app".into(),
            source: h2::Error::from(Reason::CANCEL),
        };
        assert_eq!(not_opened(&gone), Some(Retry::Closed));
        let timeout = Error::ConnectTimeout {
            upstream: "app".into(),
            timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(not_opened(&timeout), None);
    }
}
