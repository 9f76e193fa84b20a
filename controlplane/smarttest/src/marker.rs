//! The `baggage` member that marks a smart-test run's requests (docs/smart-tests.md,
//! "Downstream calls"): `spur-test-step=<run tag>.<step>.<pass>`. The runner writes it, services
//! that propagate baggage carry it on, and the traffic store reads it to return a run only its
//! own requests (ReadRun). One parser for both.

/// The `baggage` member's key.
pub const MARKER: &str = "spur-test-step";

/// The [`MARKER`] member of a request's headers (`(name, value)`), if a `baggage` header has
/// one; the first wins.
pub fn marker_in<'a>(headers: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Option<String> {
    headers
        .into_iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case("baggage"))
        .filter_map(|(_, value)| std::str::from_utf8(value).ok())
        .flat_map(spur_routing::baggage::members)
        .find(|m| m.key == MARKER)
        .map(|m| m.value.into_owned())
}

/// Whether `marker` is one of the run tagged `tag` (`<tag>.` and more).
pub fn is_of_run(marker: &str, tag: &str) -> bool {
    !tag.is_empty()
        && marker
            .strip_prefix(tag)
            .is_some_and(|rest| rest.len() > 1 && rest.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_read_from_any_baggage_header_and_belongs_to_one_run() {
        let headers = [
            ("content-type", &b"text/plain"[..]),
            ("Baggage", b"sb=key1, other=x"),
            ("baggage", b"spur-test-step=ab12.0.s;p=1"),
        ];
        let m = marker_in(headers).unwrap();
        assert_eq!(m, "ab12.0.s");
        assert!(is_of_run(&m, "ab12"));
        assert!(!is_of_run(&m, "ab1"), "a prefix of the tag is another run");
        assert!(!is_of_run(&m, ""));
        assert!(!is_of_run("ab12.", "ab12"));
        assert!(!is_of_run("ab12", "ab12"));
        assert_eq!(marker_in([("baggage", &b"sb=key1"[..])]), None);
        assert_eq!(marker_in([("baggage", &[0xff, 0xfe][..])]), None);
    }
}
