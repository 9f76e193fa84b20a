//! W3C `baggage` and `tracestate` list parsing: zero-copy, bounded, and total on hostile input.
//!
//! Both headers are comma-separated lists that may arrive split over several header lines; the
//! [`List`] iterator walks such a combined list lazily without allocating. Limits are applied while
//! walking, never by buffering: a list is read up to [`MAX_BYTES`] bytes (cut at a member boundary
//! so that a member is never truncated into a different, shorter value) and up to a member count
//! ([`MAX_BAGGAGE_MEMBERS`] / [`MAX_TRACESTATE_MEMBERS`]); the rest is ignored.
//!
//! Malformed list members are skipped one by one: a bad member never hides the good ones, since the
//! routing key is often appended by a different component than the one that wrote the rest.

use std::borrow::Cow;
use std::fmt;
use std::iter::{Map, Once};

/// Bytes of a combined list (all header lines, one byte per line break) that are looked at:
/// the W3C baggage size limit, also applied to `tracestate` to bound the work on any header.
pub const MAX_BYTES: usize = 8192;
/// List members of `baggage` that are looked at: the W3C grammar's
/// `list-member 0*179( OWS "," OWS list-member )`.
pub const MAX_BAGGAGE_MEMBERS: usize = 180;
/// W3C trace-context: "There can be a maximum of 32 list-members in a list."
pub const MAX_TRACESTATE_MEMBERS: usize = 32;

/// One decoded `baggage` list member: `key=value;properties`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member<'a> {
    /// The member key (an RFC 9110 token).
    pub key: &'a str,
    /// The percent-decoded value; borrowed unless decoding changed it.
    pub value: Cow<'a, str>,
    /// Everything after the first `;`, OWS-trimmed and unparsed (empty if none).
    pub properties: &'a str,
}

/// One syntactically valid list member before value decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawMember<'a> {
    pub key: &'a str,
    /// The value as written (still percent-encoded for baggage).
    pub value: &'a str,
    /// Baggage properties after the first `;` (always empty for tracestate).
    pub properties: &'a str,
    /// The whole member as written, OWS-trimmed: what a rewriter copies to keep it byte-exact.
    pub raw: &'a str,
}

impl<'a> RawMember<'a> {
    /// The percent-decoded value, or `None` if it holds a bad `%` sequence or is not UTF-8 once
    /// decoded. Allocates only when the value contains a `%`.
    pub fn decode_value(&self) -> Option<Cow<'a, str>> {
        percent_decode(self.value, false)
    }
}

/// Which list grammar a [`List`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// W3C baggage: `key OWS "=" OWS value *( OWS ";" OWS property )`.
    Baggage,
    /// W3C trace-context `tracestate`: `key "=" value`, no properties, no encoding.
    TraceState,
}

impl Syntax {
    pub(crate) fn max_members(self) -> usize {
        match self {
            Syntax::Baggage => MAX_BAGGAGE_MEMBERS,
            Syntax::TraceState => MAX_TRACESTATE_MEMBERS,
        }
    }
}

/// Lazily yields the valid members of a list spread over several header lines, applying the
/// byte and member limits.
#[derive(Clone)]
pub struct List<'a, I> {
    lines: I,
    syntax: Syntax,
    /// The unread part of the current line; `None` when the next line must be fetched.
    rest: Option<&'a str>,
    bytes_left: usize,
    members_left: usize,
    first_line: bool,
    /// Set once a limit was hit: nothing more is read even if lines remain.
    done: bool,
}

impl<I> fmt::Debug for List<'_, I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("List")
            .field("syntax", &self.syntax)
            .field("rest", &self.rest)
            .field("bytes_left", &self.bytes_left)
            .field("members_left", &self.members_left)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<'a, I: Iterator<Item = &'a [u8]>> List<'a, I> {
    /// A list over raw header-line bytes with the default limits of `syntax`.
    pub fn new(lines: I, syntax: Syntax) -> Self {
        Self::with_limits(lines, syntax, MAX_BYTES, syntax.max_members())
    }

    /// A list with explicit limits (for tests and for callers that share a budget).
    pub fn with_limits(lines: I, syntax: Syntax, max_bytes: usize, max_members: usize) -> Self {
        List {
            lines,
            syntax,
            rest: None,
            bytes_left: max_bytes,
            members_left: max_members,
            first_line: true,
            done: false,
        }
    }

    /// Fetches the next usable line, charging it to the byte budget. Returns `false` when the
    /// list is exhausted or the budget is spent.
    fn next_line(&mut self) -> bool {
        while !self.done {
            let Some(line) = self.lines.next() else {
                self.done = true;
                return false;
            };
            // Combining header lines inserts a ',' between them; counting it (and only it) keeps
            // the budget equal to the size of the combined value. It also bounds the work done
            // on a flood of empty lines.
            let sep = usize::from(!self.first_line);
            self.first_line = false;
            let Some(avail) = self.bytes_left.checked_sub(sep) else {
                self.done = true;
                return false;
            };
            let bytes = if line.len() <= avail {
                self.bytes_left = avail - line.len();
                line
            } else {
                // Keep only the members that fit whole; a ',' right at the limit still closes a
                // member that fits.
                self.done = true;
                self.bytes_left = 0;
                let cut = line
                    .get(..=avail)
                    .and_then(|b| b.iter().rposition(|&c| c == b','))
                    .unwrap_or(0);
                line.get(..cut).unwrap_or_default()
            };
            // ',' is ASCII, so a cut there never splits a UTF-8 sequence of an otherwise valid line.
            if let Ok(s) = std::str::from_utf8(bytes) {
                self.rest = Some(s);
                return true;
            }
        }
        false
    }
}

impl<'a, I: Iterator<Item = &'a [u8]>> List<'a, I> {
    /// The next valid member whose key satisfies `want`. Keys are tested before the rest of the
    /// member is validated, so a caller looking for a few names does not pay for validating
    /// every other member (a matching key still has to be a valid one).
    pub fn next_where(&mut self, mut want: impl FnMut(&str) -> bool) -> Option<RawMember<'a>> {
        loop {
            let Some(rest) = self.rest else {
                if !self.next_line() {
                    return None;
                }
                continue;
            };
            let cut = Cut::scan(rest);
            self.rest = rest.get(cut.end + 1..);
            let entry = rest.get(..cut.end)?;
            let raw = trim_ows(entry);
            // Empty members are allowed by both specs (and appear when lines are joined), and
            // do not count against the member limit; the byte budget bounds them instead.
            if raw.is_empty() {
                continue;
            }
            if self.members_left == 0 {
                self.done = true;
                self.rest = None;
                return None;
            }
            self.members_left -= 1;
            let parsed = match self.syntax {
                Syntax::Baggage => parse_baggage_member(entry, raw, &cut, &mut want),
                Syntax::TraceState => parse_tracestate_member(entry, raw, &cut, &mut want),
            };
            if parsed.is_some() {
                return parsed;
            }
        }
    }
}

/// Where the first member of a list text ends and where its first `=` and `;` are, found in one
/// pass that jumps from separator to separator.
struct Cut {
    end: usize,
    eq: Option<usize>,
    semi: Option<usize>,
}

impl Cut {
    fn scan(s: &str) -> Cut {
        let b = s.as_bytes();
        let mut cut = Cut {
            end: b.len(),
            eq: None,
            semi: None,
        };
        let mut from = 0;
        while let Some(i) = next_separator(b, from) {
            match b.get(i) {
                Some(b',') => {
                    cut.end = i;
                    break;
                }
                Some(b'=') if cut.eq.is_none() => cut.eq = Some(i),
                Some(b';') if cut.semi.is_none() => cut.semi = Some(i),
                _ => {}
            }
            from = i + 1;
        }
        cut
    }
}

/// Index of the first `,`, `=` or `;` in `b` at or after `from`.
///
/// Eight bytes at a time (SWAR): a byte-by-byte loop with three compares per byte was most of
/// the cost of extracting a key from a typical `baggage` header.
fn next_separator(b: &[u8], from: usize) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // Flags (in the high bit) every byte of `w` equal to the byte repeated in `pat`. Only the
    // lowest flag is exact (a borrow can flag a byte above a match), which is all we use.
    let flag = |w: u64, pat: u64| {
        let x = w ^ pat;
        x.wrapping_sub(ONES) & !x & HIGHS
    };
    let rest = b.get(from..)?;
    let mut chunks = rest.chunks_exact(8);
    let mut offset = from;
    for chunk in &mut chunks {
        let w = u64::from_le_bytes(<[u8; 8]>::try_from(chunk).ok()?);
        let hits = flag(w, ONES * u64::from(b','))
            | flag(w, ONES * u64::from(b'='))
            | flag(w, ONES * u64::from(b';'));
        if hits != 0 {
            return Some(offset + (hits.trailing_zeros() / 8) as usize);
        }
        offset += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|c| matches!(c, b',' | b'=' | b';'))
        .map(|i| offset + i)
}

impl<'a, I: Iterator<Item = &'a [u8]>> Iterator for List<'a, I> {
    type Item = RawMember<'a>;

    fn next(&mut self) -> Option<RawMember<'a>> {
        self.next_where(|_| true)
    }
}

type OneLine<'a> = Once<&'a [u8]>;

/// Decoded members of one `baggage` header value.
#[derive(Debug, Clone)]
pub struct Members<'a> {
    list: List<'a, OneLine<'a>>,
}

impl<'a> Iterator for Members<'a> {
    type Item = Member<'a>;

    fn next(&mut self) -> Option<Member<'a>> {
        loop {
            let raw = self.list.next()?;
            // An undecodable value makes only this member unusable.
            if let Some(value) = raw.decode_value() {
                return Some(Member {
                    key: raw.key,
                    value,
                    properties: raw.properties,
                });
            }
        }
    }
}

/// The valid members of one `baggage` header value, percent-decoded, within the W3C limits.
pub fn members(value: &str) -> Members<'_> {
    Members {
        list: List::new(std::iter::once(value.as_bytes()), Syntax::Baggage),
    }
}

/// The valid members of one `tracestate` header value, within the W3C limits.
pub fn tracestate_members(value: &str) -> List<'_, OneLine<'_>> {
    List::new(std::iter::once(value.as_bytes()), Syntax::TraceState)
}

type ValueBytes<'a, V> = Map<V, fn(&'a http::HeaderValue) -> &'a [u8]>;

/// Raw members of a list carried by every line of one header (e.g. all `baggage` lines of a
/// request, combined as W3C and RFC 9110 require).
pub fn header_list<'a, V>(values: V, syntax: Syntax) -> List<'a, ValueBytes<'a, V::IntoIter>>
where
    V: IntoIterator<Item = &'a http::HeaderValue>,
{
    let as_bytes: fn(&'a http::HeaderValue) -> &'a [u8] = http::HeaderValue::as_bytes;
    List::new(values.into_iter().map(as_bytes), syntax)
}

/// `entry` is the untrimmed member text that `cut` indexes; `raw` is `entry` without OWS.
fn parse_baggage_member<'a>(
    entry: &'a str,
    raw: &'a str,
    cut: &Cut,
    want: impl FnOnce(&str) -> bool,
) -> Option<RawMember<'a>> {
    let eq = cut.eq?;
    let value_end = match cut.semi {
        Some(semi) if semi < eq => return None,
        Some(semi) => semi,
        None => cut.end,
    };
    let key = trim_ows(entry.get(..eq)?);
    if !want(key) {
        return None;
    }
    let value = trim_ows(entry.get(eq + 1..value_end)?);
    if !is_token(key) || !value.bytes().all(is_baggage_octet) {
        return None;
    }
    let properties = match cut.semi {
        Some(semi) => trim_ows(entry.get(semi + 1..)?),
        None => "",
    };
    Some(RawMember {
        key,
        value,
        properties,
        raw,
    })
}

/// As [`parse_baggage_member`]; tracestate allows no OWS around `=` and `;` is an ordinary
/// value character.
fn parse_tracestate_member<'a>(
    entry: &'a str,
    raw: &'a str,
    cut: &Cut,
    want: impl FnOnce(&str) -> bool,
) -> Option<RawMember<'a>> {
    let eq = cut.eq?;
    let key = entry.get(..eq)?.trim_start_matches([' ', '\t']);
    let value = entry.get(eq + 1..)?.trim_end_matches([' ', '\t']);
    if !want(key) || !is_tracestate_key(key) || !is_tracestate_value(value) {
        return None;
    }
    Some(RawMember {
        key,
        value,
        properties: "",
        raw,
    })
}

/// OWS = *( SP / HTAB ) (RFC 9110 §5.6.3).
pub fn trim_ows(s: &str) -> &str {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let b = s.as_bytes();
    let start = b.iter().position(|c| !is_ows(c)).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !is_ows(c)).map_or(start, |i| i + 1);
    s.get(start..end).unwrap_or_default()
}

/// RFC 9110 `token`: 1*tchar.
pub fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// RFC 9110 `tchar`. A table: every keyed request checks its baggage member's key with it, and
/// the chain of comparisons it replaces cost 13 instructions a byte.
fn is_tchar(b: u8) -> bool {
    const TCHAR: [bool; 256] = {
        let mut t = [false; 256];
        let mut i = 0;
        while i < 256 {
            let b = i as u8;
            t[i] = b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                );
            i += 1;
        }
        t
    };
    TCHAR[usize::from(b)]
}

/// W3C baggage `baggage-octet`: printable ASCII except SP, `"`, `,`, `;` and `\`.
pub fn is_baggage_octet(b: u8) -> bool {
    matches!(b, 0x21 | 0x23..=0x2B | 0x2D..=0x3A | 0x3C..=0x5B | 0x5D..=0x7E)
}

/// trace-context `key`: `simple-key` or `tenant-id@system-id`, lowercase, at most 256 chars.
fn is_tracestate_key(key: &str) -> bool {
    let part_ok = |p: &str, max: usize| {
        let b = p.as_bytes();
        matches!(b.first(), Some(c) if c.is_ascii_lowercase() || c.is_ascii_digit())
            && b.len() <= max
            && b.iter().all(|&c| {
                c.is_ascii_lowercase()
                    || c.is_ascii_digit()
                    || matches!(c, b'_' | b'-' | b'*' | b'/')
            })
    };
    match key.split_once('@') {
        None => part_ok(key, 256),
        Some((tenant, system)) => part_ok(tenant, 241) && part_ok(system, 14),
    }
}

/// trace-context `value`: 1-256 printable ASCII chars except `,` and `=`, not ending in SP.
fn is_tracestate_value(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 256
        && !v.ends_with(' ')
        && v.bytes()
            .all(|b| matches!(b, 0x20..=0x7E) && b != b',' && b != b'=')
}

/// Percent-decodes `s` (`plus_is_space`: form encoding, for query strings). `None` on a bad `%`
/// sequence or if the result is not UTF-8. Borrows when there is nothing to decode.
pub(crate) fn percent_decode(s: &str, plus_is_space: bool) -> Option<Cow<'_, str>> {
    if !s.bytes().any(|b| b == b'%' || (plus_is_space && b == b'+')) {
        return Some(Cow::Borrowed(s));
    }
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hi = hex(bytes.next()?)?;
                let lo = hex(bytes.next()?)?;
                out.push((hi << 4) | lo);
            }
            b'+' if plus_is_space => out.push(b' '),
            _ => out.push(b),
        }
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Appends `value` to `out` percent-encoded as a baggage value: every byte that is not a
/// `baggage-octet`, and `%` itself, becomes `%XX`.
pub fn encode_value(value: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for b in value.bytes() {
        if is_baggage_octet(b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0F)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tchar_table_is_rfc_9110s() {
        // tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" /
        // "|" / "~" / DIGIT / ALPHA
        let specials = b"!#$%&'*+-.^_`|~";
        for b in 0..=u8::MAX {
            let want = b.is_ascii_digit() || b.is_ascii_alphabetic() || specials.contains(&b);
            assert_eq!(is_tchar(b), want, "byte {b:#04x}");
        }
        assert!(is_token("sd-routing-key"));
        assert!(!is_token(""));
        assert!(!is_token("a b"));
        assert!(!is_token("k\u{e9}"));
    }

    fn kv(value: &str) -> Vec<(String, String, String)> {
        members(value)
            .map(|m| {
                (
                    m.key.to_owned(),
                    m.value.into_owned(),
                    m.properties.to_owned(),
                )
            })
            .collect()
    }

    fn kvs(items: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
        items
            .iter()
            .map(|(k, v, p)| ((*k).to_owned(), (*v).to_owned(), (*p).to_owned()))
            .collect()
    }

    #[test]
    fn parses_members_with_ows_and_properties() {
        assert_eq!(
            kv(" a = 1 ;p1;p2=x , b=2,\tc=3\t"),
            kvs(&[("a", "1", "p1;p2=x"), ("b", "2", ""), ("c", "3", "")])
        );
        assert_eq!(
            kv("a=b=c"),
            kvs(&[("a", "b=c", "")]),
            "'=' is a baggage-octet"
        );
        assert_eq!(kv("a="), kvs(&[("a", "", "")]), "empty values are allowed");
    }

    #[test]
    fn empty_members_are_tolerated() {
        assert_eq!(
            kv(",,a=1,, ,\t,b=2,"),
            kvs(&[("a", "1", ""), ("b", "2", "")])
        );
        assert!(kv("").is_empty());
        assert!(kv(",,,").is_empty());
    }

    #[test]
    fn malformed_members_are_skipped_individually() {
        assert_eq!(
            kv("noequals,=v,a b=1,ok=1,bad=sp ace,bad2=\"q\",bad3=x\\y,ok2=2"),
            kvs(&[("ok", "1", ""), ("ok2", "2", "")])
        );
    }

    #[test]
    fn percent_decoding_borrows_unless_needed() {
        let m: Vec<_> = members("a=plain,b=caf%C3%A9,c=%2D").collect();
        assert!(matches!(m[0].value, Cow::Borrowed("plain")));
        assert!(matches!(&m[1].value, Cow::Owned(s) if s == "café"));
        assert_eq!(m[2].value, "-");
        assert_eq!(
            kv("a=+"),
            kvs(&[("a", "+", "")]),
            "'+' is not a space in baggage"
        );
    }

    #[test]
    fn bad_percent_sequences_drop_only_that_member() {
        for bad in ["a=%", "a=%2", "a=%zz", "a=%C3", "a=%FF%FE", "a=x%"] {
            assert_eq!(kv(&format!("{bad},k=v")), kvs(&[("k", "v", "")]), "{bad}");
        }
    }

    #[test]
    fn member_limit() {
        let many: String = (0..500).map(|i| format!("k{i}=v,")).collect();
        let got: Vec<_> = members(&many).collect();
        assert_eq!(got.len(), MAX_BAGGAGE_MEMBERS);
        assert_eq!(got.last().map(|m| m.key), Some("k179"));
        let ts: String = (0..40).map(|i| format!("k{i}=v,")).collect();
        assert_eq!(tracestate_members(&ts).count(), MAX_TRACESTATE_MEMBERS);
    }

    #[test]
    fn byte_limit_never_truncates_a_member() {
        // The member straddling the limit is dropped rather than shortened.
        let filler = format!("f={}", "x".repeat(MAX_BYTES - 10));
        let v = format!("{filler},sd-routing-key=abcdefghijkl");
        let got: Vec<_> = members(&v).collect();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].key, "f");
        // A member ending exactly at the limit is kept.
        let exact = format!("f={}", "x".repeat(MAX_BYTES - 2));
        assert_eq!(exact.len(), MAX_BYTES);
        assert_eq!(members(&format!("{exact},b=1")).count(), 1);
        assert_eq!(members(&exact).count(), 1);
        // One oversized member yields nothing.
        assert_eq!(members(&"y".repeat(MAX_BYTES * 4)).count(), 0);
    }

    #[test]
    fn several_lines_share_the_budget() {
        let lines: [&[u8]; 3] = [b"a=1, b=2", b"", b"c=3"];
        let keys: Vec<_> = List::new(lines.into_iter(), Syntax::Baggage)
            .map(|m| m.key)
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
        // "a=1" (3) + ',' + "b=2" (3) = 7 bytes fit; the third line does not.
        let lines: [&[u8]; 3] = [b"a=1", b"b=2", b"c=3"];
        let keys: Vec<_> = List::with_limits(lines.into_iter(), Syntax::Baggage, 7, 100)
            .map(|m| m.key)
            .collect();
        assert_eq!(keys, ["a", "b"]);
        // Members count across lines.
        let lines: [&[u8]; 2] = [b"a=1,b=2", b"c=3,d=4"];
        let keys: Vec<_> = List::with_limits(lines.into_iter(), Syntax::Baggage, 100, 3)
            .map(|m| m.key)
            .collect();
        assert_eq!(keys, ["a", "b", "c"]);
    }

    #[test]
    fn non_utf8_lines_are_skipped() {
        let lines: [&[u8]; 3] = [b"a=1", b"b=\xff\xfe", b"c=3"];
        let keys: Vec<_> = List::new(lines.into_iter(), Syntax::Baggage)
            .map(|m| m.key)
            .collect();
        assert_eq!(keys, ["a", "c"]);
    }

    #[test]
    fn flood_of_empty_lines_is_bounded() {
        let lines = std::iter::repeat_n(&b""[..], 1_000_000);
        let mut list = List::new(lines, Syntax::Baggage);
        assert!(list.next().is_none());
    }

    #[test]
    fn separator_search_matches_a_plain_scan() {
        let text = b"ab=cd;ef,gh==;;,,0123456789abcdef=0123456789;abcdefgh,\xff\x80=\xac,";
        for from in 0..=text.len() + 1 {
            for end in from..=text.len() {
                let hay = &text[..end];
                let plain = hay
                    .get(from..)
                    .and_then(|r| r.iter().position(|c| b",=;".contains(c)))
                    .map(|i| i + from);
                assert_eq!(next_separator(hay, from), plain, "{from} {end}");
            }
        }
    }

    #[test]
    fn tracestate_grammar() {
        let got: Vec<_> =
            tracestate_members("sd-routing-key=k1, vendor@sys=a b,Upper=x,a=b=c,sd-sandbox=k1 ,x=")
                .map(|m| (m.key, m.value))
                .collect();
        assert_eq!(
            got,
            [
                ("sd-routing-key", "k1"),
                ("vendor@sys", "a b"),
                ("sd-sandbox", "k1")
            ]
        );
        // tracestate values are opaque: no percent-decoding, no properties.
        let m = tracestate_members("a=%41;p").next();
        assert_eq!(m.map(|m| (m.value, m.properties)), Some(("%41;p", "")));
    }

    #[test]
    fn header_list_combines_lines() {
        let mut h = http::HeaderMap::new();
        h.append("baggage", http::HeaderValue::from_static("a=1"));
        h.append("baggage", http::HeaderValue::from_static("b=2"));
        let keys: Vec<_> = header_list(h.get_all("baggage"), Syntax::Baggage)
            .map(|m| m.key)
            .collect();
        assert_eq!(keys, ["a", "b"]);
    }

    #[test]
    fn encode_round_trips() {
        for v in ["plain", "", "100%", "a b,c;d\\e\"f", "café ☕", "%41"] {
            let mut enc = String::new();
            encode_value(v, &mut enc);
            let line = format!("k={enc}");
            let got: Vec<_> = members(&line).collect();
            assert_eq!(got.len(), 1, "{enc}");
            assert_eq!(got[0].value, v);
        }
    }

    #[test]
    fn raw_member_keeps_original_text() {
        let v = http::HeaderValue::from_static(" a = %41 ;p ,b=1");
        let m = header_list([&v], Syntax::Baggage).next();
        assert_eq!(m.map(|m| m.raw), Some("a = %41 ;p"));
    }
}
