//! The `Date` field the proxy adds to a response that has none (RFC 9110 §6.6.1: a recipient
//! with a clock that forwards a response without one must add it; hyper's server did this for
//! the paths it served, the relays do it here), and to the responses the proxy makes itself.
//! Formatted at most once a second per thread, so a response costs a clock read and a
//! reference count.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderValue;

thread_local! {
    /// The second last formatted (`u64::MAX`: none yet) and its IMF-fixdate.
    static CACHED: RefCell<(u64, Option<HeaderValue>)> = const { RefCell::new((u64::MAX, None)) };
}

/// The current time as an HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`); `None` only for a clock
/// before 1970, where no date is better than a wrong one.
pub(crate) fn now() -> Option<HeaderValue> {
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).ok()?.as_secs();
    CACHED.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != secs {
            // IMF-fixdate is ASCII: always a valid field value.
            *c = (
                secs,
                HeaderValue::from_str(&httpdate::fmt_http_date(now)).ok(),
            );
        }
        c.1.clone()
    })
}

/// Adds `date: <now>` to `headers` unless they have one.
pub(crate) fn add_if_missing(headers: &mut http::HeaderMap) {
    if !headers.contains_key(http::header::DATE)
        && let Some(v) = now()
    {
        headers.insert(http::header::DATE, v);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_date_is_now_and_an_upstreams_is_kept() {
        let v = now().unwrap();
        let parsed = httpdate::parse_http_date(v.to_str().unwrap()).unwrap();
        let skew = SystemTime::now().duration_since(parsed).unwrap();
        assert!(skew.as_secs() <= 2, "{v:?} is {skew:?} old");
        assert!(v.as_bytes().ends_with(b" GMT"));

        let mut h = http::HeaderMap::new();
        add_if_missing(&mut h);
        assert_eq!(h.get_all(http::header::DATE).iter().count(), 1);
        let theirs = HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT");
        let mut h = http::HeaderMap::new();
        h.insert(http::header::DATE, theirs.clone());
        add_if_missing(&mut h);
        assert_eq!(h.get(http::header::DATE), Some(&theirs));
    }
}
