//! How a sandbox's response differs from the baseline's: status, headers and trailers by name,
//! and bodies as JSON (structurally), gRPC (message by message), text (line by line) or bytes.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use spur_proto::traffic::{Body, Exchange, Header, Protocol};

use crate::text::{cap, encode_base64, hex};

/// Response headers a diff ignores: hop-by-hop ones and those that differ on every response.
/// `content-length` is ignored too whenever the bodies themselves are compared.
pub const IGNORED_HEADERS: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "x-request-id",
    "traceparent",
    "tracestate",
    "server-timing",
];
/// Body differences shown per pair: past this a person reads the bodies themselves.
pub const MAX_BODY_DIFFERENCES: usize = 40;

/// One way a sandbox's response differs from the baseline's.
#[derive(Debug, PartialEq)]
pub struct Difference {
    /// status, header, trailer, bodySize, json, grpc, line or binary; a smart test's findings
    /// add error (a transport error) and duration, and for the calls a request caused
    /// downstream call, callPath and callStatus ([`crate::calls`]).
    pub kind: &'static str,
    /// Where: a header name, a JSON path, a gRPC message index, a line number (in the side that
    /// has the line), a byte offset; empty for status and bodySize.
    pub at: String,
    /// What each side has there; None: nothing.
    pub baseline: Option<Value>,
    pub sandbox: Option<Value>,
}

impl Difference {
    fn new(kind: &'static str, at: impl ToString, b: Option<Value>, s: Option<Value>) -> Self {
        Difference {
            kind,
            at: at.to_string(),
            baseline: b,
            sandbox: s,
        }
    }

    /// A side it lacks is left out (`null` would be a JSON body's own value).
    pub fn to_json(&self) -> Value {
        let mut v = json!({"kind": self.kind, "at": self.at});
        for (side, value) in [("baseline", &self.baseline), ("sandbox", &self.sandbox)] {
            if let Some(value) = value {
                v[side] = value.clone();
            }
        }
        v
    }

    /// [`Self::render`] without the values a service answered, for places readable by more
    /// people than the service's own team (a cluster-scoped Sandbox's status, its Events): where
    /// and how it changed (added, removed, changed, or its JSON type), with status codes and
    /// durations, which say nothing of the data.
    pub fn render_shape(&self) -> String {
        let codes = matches!(self.kind, "status" | "duration" | "callStatus")
            || (matches!(self.kind, "header" | "trailer")
                && self.at.eq_ignore_ascii_case("grpc-status"));
        if codes {
            return self.render();
        }
        let what = match self.kind {
            "bodySize" => "body size".to_owned(),
            "error" => "error".to_owned(),
            "header" | "trailer" => format!("{} {}", self.kind, self.at),
            "grpc" => format!("grpc message {}", self.at),
            "line" => format!("line {}", self.at),
            "binary" => return "body: differs (binary)".to_owned(),
            "call" => format!("call {}", self.at),
            // A path may hold ids: where the call went, not what it asked for.
            "callPath" => format!("call {} path", group_of(&self.at)),
            _ => self.at.clone(),
        };
        match (&self.baseline, &self.sandbox) {
            (Some(b), Some(s)) if self.kind == "json" && json_type(b) != json_type(s) => {
                format!("{what}: {} → {}", json_type(b), json_type(s))
            }
            (Some(_), Some(_)) => format!("{what}: changed"),
            (None, Some(_)) => format!("{what}: added"),
            (Some(_), None) => format!("{what}: removed"),
            (None, None) => what,
        }
    }

    /// One line for a person.
    pub fn render(&self) -> String {
        // JSON text: quoted and escaped, so a value cannot drive the terminal.
        let show = |v: &Value| match v {
            Value::String(s) if self.kind == "grpc" => s.clone(),
            v => cap(&v.to_string(), 120),
        };
        let what = match self.kind {
            "status" => "status".to_owned(),
            "bodySize" => "body size".to_owned(),
            "error" | "duration" => self.kind.to_owned(),
            "header" | "trailer" => format!("{} {}", self.kind, self.at),
            "grpc" => format!("grpc message {}", self.at),
            "line" => format!("line {}", self.at),
            "binary" => return format!("body: differs from byte {} (binary)", self.at),
            "call" | "callPath" => format!("call {}", self.at),
            "callStatus" => format!("call {} status", self.at),
            _ => self.at.clone(),
        };
        match (&self.baseline, &self.sandbox) {
            (Some(b), Some(s)) if self.kind == "json" && json_type(b) != json_type(s) => {
                let (bt, st) = (json_type(b), json_type(s));
                format!("{what}: {bt} {} → {st} {}", show(b), show(s))
            }
            (Some(b), Some(s)) => format!("{what}: {} → {}", show(b), show(s)),
            (None, Some(s)) => format!("{what}: added {}", show(s)),
            (Some(b), None) => format!("{what}: removed {}", show(b)),
            (None, None) => what,
        }
    }
}

/// The group a `callPath` difference's place belongs to (`METHOD ns/workload`).
pub(crate) fn group_of(at: &str) -> &str {
    let mut spaces = at.match_indices(' ').map(|(i, _)| i);
    match (spaces.next(), spaces.next()) {
        (Some(_), Some(second)) => &at[..second],
        _ => at,
    }
}

/// How a sandbox's response differs from the baseline's.
#[derive(Debug, Default)]
pub struct Comparison {
    pub differences: Vec<Difference>,
    /// What the reader should know about how it was compared (truncation, differences left out).
    pub notes: Vec<String>,
}

/// Compares the responses of one pair: status, headers, trailers and body.
pub fn compare(baseline: &Exchange, sandbox: &Exchange) -> Comparison {
    let mut c = Comparison::default();
    if baseline.status != sandbox.status {
        let (b, s) = (baseline.status, sandbox.status);
        c.differences.push(Difference::new(
            "status",
            "",
            Some(b.into()),
            Some(s.into()),
        ));
    }
    let (bb, sb) = (body(baseline), body(sandbox));
    // Their lengths are the bodies' business then, with truncation taken into account.
    let skip_length = !bb.data.is_empty() || !sb.data.is_empty();
    let pick = |list: &[Header]| -> Vec<Header> {
        let keep = |h: &&Header| !(skip_length && h.name.eq_ignore_ascii_case("content-length"));
        list.iter().filter(keep).cloned().collect()
    };
    let (bh, sh) = (&baseline.response_headers, &sandbox.response_headers);
    c.differences
        .extend(header_diff(&pick(bh), &pick(sh), "header"));
    let (bt, st) = (&baseline.response_trailers, &sandbox.response_trailers);
    c.differences.extend(header_diff(bt, st, "trailer"));
    let shown = c.differences.len() + MAX_BODY_DIFFERENCES;
    compare_bodies(&bb, &sb, is_grpc(baseline) || is_grpc(sandbox), &mut c);
    if c.differences.len() > shown {
        let more = c.differences.len() - shown;
        c.differences.truncate(shown);
        c.notes
            .push(format!("{more} more body differences not shown"));
    }
    c
}

/// The response body (empty when none was captured).
pub fn body(x: &Exchange) -> Body {
    x.response_body.clone().unwrap_or_default()
}

fn is_grpc(x: &Exchange) -> bool {
    x.protocol == i32::from(Protocol::Grpc)
        || x.response_headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("content-type") && h.value.starts_with(b"application/grpc")
        })
}

/// Differences between two header lists, by lowercase name, ignoring [`IGNORED_HEADERS`]; the
/// values of a repeated name are compared joined with ", ".
fn header_diff(baseline: &[Header], sandbox: &[Header], kind: &'static str) -> Vec<Difference> {
    let group = |list: &[Header]| {
        let mut by_name: BTreeMap<String, String> = BTreeMap::new();
        for h in list {
            let name = h.name.to_ascii_lowercase();
            if !IGNORED_HEADERS.contains(&name.as_str()) {
                let joined = by_name.entry(name).or_default();
                if !joined.is_empty() {
                    joined.push_str(", ");
                }
                joined.push_str(&header_text(&h.value));
            }
        }
        by_name
    };
    let (b, s) = (group(baseline), group(sandbox));
    let names: BTreeSet<&String> = b.keys().chain(s.keys()).collect();
    let value =
        |map: &BTreeMap<String, String>, n: &String| map.get(n).map(|v| Value::from(v.as_str()));
    names
        .into_iter()
        .filter(|n| b.get(*n) != s.get(*n))
        .map(|n| Difference::new(kind, n, value(&b, n), value(&s, n)))
        .collect()
}

/// A header value as text: itself when UTF-8, else marked base64.
fn header_text(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => format!("<base64 {}>", encode_base64(value)),
    }
}

fn compare_bodies(b: &Body, s: &Body, grpc: bool, c: &mut Comparison) {
    let size = || Difference::new("bodySize", "", Some(b.size.into()), Some(s.size.into()));
    if b.data.is_empty() && s.data.is_empty() {
        if b.size != s.size {
            c.differences.push(size());
        }
        return;
    }
    let truncated = b.truncated || s.truncated;
    let n = if truncated {
        let n = b.data.len().min(s.data.len());
        c.notes.push(format!(
            "the capture truncated a body: compared the first {n} bytes"
        ));
        if b.size != s.size {
            c.differences.push(size());
        }
        n
    } else {
        b.data.len().max(s.data.len())
    };
    let (bd, sd) = (
        &b.data[..n.min(b.data.len())],
        &s.data[..n.min(s.data.len())],
    );
    if bd == sd {
        return;
    }
    if grpc {
        c.differences.extend(grpc_diff(bd, sd));
        return;
    }
    let parse = |d: &[u8]| serde_json::from_slice::<Value>(d).ok();
    if !truncated && let (Some(bj), Some(sj)) = (parse(bd), parse(sd)) {
        json_diff("$", &bj, &sj, &mut c.differences);
        return;
    }
    match (utf8_prefix(bd, truncated), utf8_prefix(sd, truncated)) {
        (Some(bt), Some(st)) => c.differences.extend(text_diff(bt, st)),
        _ => {
            let offset = bd.iter().zip(sd).take_while(|(x, y)| x == y).count();
            c.differences
                .push(Difference::new("binary", offset, None, None));
        }
    }
}

/// The text of `data`, allowing a character cut in two at the end of a truncated capture.
fn utf8_prefix(data: &[u8], truncated: bool) -> Option<&str> {
    match std::str::from_utf8(data) {
        Ok(text) => Some(text),
        Err(e) if truncated && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
}

/// Structural differences from `b` (baseline) to `s` (sandbox); object key order is ignored,
/// array elements are compared index by index.
fn json_diff(path: &str, b: &Value, s: &Value, out: &mut Vec<Difference>) {
    let mut side = |p: String, bv: Option<&Value>, sv: Option<&Value>| match (bv, sv) {
        (Some(bv), Some(sv)) => json_diff(&p, bv, sv, out),
        (bv, sv) => out.push(Difference::new("json", p, bv.cloned(), sv.cloned())),
    };
    match (b, s) {
        (Value::Object(bo), Value::Object(so)) => {
            let keys: BTreeSet<&String> = bo.keys().chain(so.keys()).collect();
            for k in keys {
                side(format!("{path}{}", json_key(k)), bo.get(k), so.get(k));
            }
        }
        (Value::Array(ba), Value::Array(sa)) => {
            for i in 0..ba.len().max(sa.len()) {
                side(format!("{path}[{i}]"), ba.get(i), sa.get(i));
            }
        }
        _ if b != s => {
            let d = Difference::new("json", path, Some(b.clone()), Some(s.clone()));
            out.push(d);
        }
        _ => {}
    }
}

/// `.name`, or `["a key"]` for a key that is not an identifier.
fn json_key(key: &str) -> String {
    let mut chars = key.chars();
    let ident = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ident {
        format!(".{key}")
    } else {
        format!("[{}]", Value::from(key))
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// One length-prefixed gRPC message: flag byte, 4-byte big-endian length, bytes.
#[derive(Debug, PartialEq)]
struct GrpcFrame<'a> {
    compressed: bool,
    len: u32,
    /// Shorter than `len` when the capture cut the message short.
    data: &'a [u8],
}

/// The messages in a gRPC body, and how many bytes at its end are too few for a frame header.
fn grpc_frames(mut body: &[u8]) -> (Vec<GrpcFrame<'_>>, usize) {
    let mut frames = Vec::new();
    while let Some((&[flag, l0, l1, l2, l3], rest)) = body.split_first_chunk::<5>() {
        let len = u32::from_be_bytes([l0, l1, l2, l3]);
        let n = rest.len().min(len as usize);
        let data = &rest[..n];
        frames.push(GrpcFrame {
            compressed: flag & 1 == 1,
            len,
            data,
        });
        body = &rest[n..];
    }
    (frames, body.len())
}

fn describe_frame(f: &GrpcFrame<'_>) -> Value {
    let mut out = format!("{} bytes", f.len);
    if f.compressed {
        out.push_str(", compressed");
    }
    if f.data.len() < f.len as usize {
        out.push_str(&format!(", {} captured", f.data.len()));
    }
    Value::from(format!("{out}: {}", hex(f.data, 32)))
}

/// Message by message; a message cut short by the capture is compared on what both hold.
fn grpc_diff(b: &[u8], s: &[u8]) -> Vec<Difference> {
    let ((bf, b_rest), (sf, s_rest)) = (grpc_frames(b), grpc_frames(s));
    let mut out = Vec::new();
    for i in 0..bf.len().max(sf.len()) {
        let (bm, sm) = (bf.get(i), sf.get(i));
        if let (Some(x), Some(y)) = (bm, sm) {
            let n = x.data.len().min(y.data.len());
            if x.compressed == y.compressed && x.len == y.len && x.data[..n] == y.data[..n] {
                continue;
            }
        }
        out.push(Difference::new(
            "grpc",
            i,
            bm.map(describe_frame),
            sm.map(describe_frame),
        ));
    }
    if out.is_empty() && b_rest != s_rest {
        // Only the few bytes after the last whole frame header differ.
        let offset = b.iter().zip(s).take_while(|(x, y)| x == y).count();
        out.push(Difference::new("binary", offset, None, None));
    }
    out
}

/// Lines only one side has, from a longest common subsequence; past a size where its table
/// would be too large, every line from the first difference to the last.
fn text_diff(b: &str, s: &str) -> Vec<Difference> {
    let (bl, sl): (Vec<&str>, Vec<&str>) = (b.lines().collect(), s.lines().collect());
    let head = bl.iter().zip(&sl).take_while(|(x, y)| x == y).count();
    let (bl, sl) = (&bl[head..], &sl[head..]);
    let tail = bl
        .iter()
        .rev()
        .zip(sl.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (bm, sm) = (&bl[..bl.len() - tail], &sl[..sl.len() - tail]);
    let removed = |i: usize| Difference::new("line", head + i + 1, Some(bm[i].into()), None);
    let added = |j: usize| Difference::new("line", head + j + 1, None, Some(sm[j].into()));
    if bm.len().saturating_mul(sm.len()) > 4_000_000 {
        return (0..bm.len())
            .map(removed)
            .chain((0..sm.len()).map(added))
            .collect();
    }
    // lcs[i * w + j]: the longest common subsequence of bm[i..] and sm[j..].
    let w = sm.len() + 1;
    let mut lcs = vec![0u32; (bm.len() + 1) * w];
    for i in (0..bm.len()).rev() {
        for j in (0..sm.len()).rev() {
            lcs[i * w + j] = if bm[i] == sm[j] {
                lcs[(i + 1) * w + j + 1] + 1
            } else {
                lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
            };
        }
    }
    let (mut out, mut i, mut j) = (Vec::new(), 0, 0);
    while i < bm.len() || j < sm.len() {
        if i < bm.len() && j < sm.len() && bm[i] == sm[j] {
            (i, j) = (i + 1, j + 1);
        } else if j == sm.len() || (i < bm.len() && lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            out.push(removed(i));
            i += 1;
        } else {
            out.push(added(j));
            j += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{body_json, headers_json};
    use crate::testing::{exchange, header};

    fn rendered(differences: &[Difference]) -> Vec<String> {
        differences.iter().map(Difference::render).collect()
    }

    #[test]
    fn json_diff_nested_arrays_and_types() {
        let b = json!({"a": 1, "items": [{"name": "a"}, {"name": "x"}], "gone": true,
                       "o": {"k": "v"}, "a key": 1});
        let s = json!({"o": {"k": "v"}, "items": [{"name": "b"}, {"name": "x"}, 3], "a": "1",
                       "new": null, "a key": 2});
        let mut out = Vec::new();
        json_diff("$", &b, &s, &mut out);
        assert_eq!(
            rendered(&out),
            [
                r#"$.a: number 1 → string "1""#,
                r#"$["a key"]: 1 → 2"#,
                "$.gone: removed true",
                r#"$.items[0].name: "a" → "b""#,
                "$.items[2]: added 3",
                "$.new: added null",
            ]
        );
        // An added null keeps its side; the missing side is left out.
        assert_eq!(
            out[5].to_json(),
            json!({"kind": "json", "at": "$.new", "sandbox": null})
        );
    }

    #[test]
    fn json_diff_ignores_key_order() {
        let b: Value = serde_json::from_str(r#"{"a": {"x": 1, "y": [1, 2]}, "b": 2}"#).unwrap();
        let s: Value = serde_json::from_str(r#"{"b": 2, "a": {"y": [1, 2], "x": 1}}"#).unwrap();
        let mut out = Vec::new();
        json_diff("$", &b, &s, &mut out);
        assert!(out.is_empty(), "{out:?}");
    }

    fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend((message.len() as u32).to_be_bytes());
        out.extend(message);
        out
    }

    #[test]
    fn grpc_frames_whole_cut_and_compressed() {
        let mut body = frame(0, b"\x0a\x01a");
        body.extend(frame(1, b"zz"));
        body.extend(frame(0, b"0123456789"));
        body.truncate(body.len() - 4);
        let (frames, rest) = grpc_frames(&body);
        assert_eq!(rest, 0);
        assert_eq!(
            frames,
            [
                GrpcFrame {
                    compressed: false,
                    len: 3,
                    data: b"\x0a\x01a"
                },
                GrpcFrame {
                    compressed: true,
                    len: 2,
                    data: b"zz"
                },
                GrpcFrame {
                    compressed: false,
                    len: 10,
                    data: b"012345"
                },
            ]
        );
        assert_eq!(
            describe_frame(&frames[2]),
            "10 bytes, 6 captured: 303132333435"
        );
        assert_eq!(describe_frame(&frames[1]), "2 bytes, compressed: 7a7a");
        // A header cut short is left over, not a frame.
        assert_eq!(grpc_frames(&[0, 0, 0]), (vec![], 3));
    }

    #[test]
    fn grpc_diff_message_by_message() {
        let b = [frame(0, b"same"), frame(0, b"old"), frame(0, b"x")].concat();
        let s = [frame(0, b"same"), frame(0, b"new")].concat();
        assert_eq!(
            rendered(&grpc_diff(&b, &s)),
            [
                "grpc message 1: 3 bytes: 6f6c64 → 3 bytes: 6e6577",
                "grpc message 2: removed 1 bytes: 78",
            ]
        );
    }

    #[test]
    fn truncated_bodies_compare_the_shorter_prefix() {
        let b = [frame(0, b"same"), frame(0, b"0123456789")].concat();
        let s = [frame(0, b"same"), frame(0, b"0123456789abcdef")].concat();
        let body = |data: &[u8], size: usize| Body {
            size: size as u64,
            data: data[..data.len().min(19)].to_vec(),
            truncated: data.len() > 19,
        };
        let mut c = Comparison::default();
        compare_bodies(&body(&b, b.len()), &body(&s, s.len()), true, &mut c);
        // The cut second message agrees as far as both were captured; only the lengths differ.
        assert_eq!(
            rendered(&c.differences),
            [
                "body size: 24 → 30",
                "grpc message 1: 10 bytes, 5 captured: 3031323334 → 16 bytes, 5 captured: 3031323334"
            ]
        );
        assert_eq!(
            c.notes,
            ["the capture truncated a body: compared the first 19 bytes"]
        );
    }

    #[test]
    fn header_diff_ignores_volatile_headers() {
        let mut b = exchange("api", "GET", "/", 0);
        let mut s = b.clone();
        b.response_headers = vec![
            header("Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
            header("x-request-id", b"1"),
            header("content-length", b"2"),
            header("content-type", b"application/json"),
            header("vary", b"a"),
            header("vary", b"b"),
        ];
        s.response_headers = vec![
            header("date", b"Tue, 02 Jan 2024 00:00:00 GMT"),
            header("X-Request-Id", b"2"),
            header("content-length", b"3"),
            header("content-type", b"text/plain"),
            header("vary", b"a, b"),
            header("x-new", b"\xff\x00"),
        ];
        b.response_trailers = vec![header("grpc-status", b"0")];
        s.response_trailers = vec![header("grpc-status", b"13")];
        b.response_body = Some(Body {
            size: 2,
            data: b"{}".to_vec(),
            truncated: false,
        });
        s.response_body = Some(Body {
            size: 3,
            data: b"{ }".to_vec(),
            truncated: false,
        });
        let c = compare(&b, &s);
        assert_eq!(
            rendered(&c.differences),
            [
                r#"header content-type: "application/json" → "text/plain""#,
                r#"header x-new: added "<base64 /wA=>""#,
                r#"trailer grpc-status: "0" → "13""#,
            ]
        );
        // Without captured bodies, content-length is all there is to compare.
        b.response_body = Some(Body {
            size: 2,
            data: vec![],
            truncated: true,
        });
        s.response_body = Some(Body {
            size: 3,
            data: vec![],
            truncated: true,
        });
        let c = compare(&b, &s);
        assert_eq!(
            c.differences[0].render(),
            r#"header content-length: "2" → "3""#
        );
        assert_eq!(
            c.differences.last().map(Difference::render).as_deref(),
            Some("body size: 2 → 3")
        );
    }

    #[test]
    fn non_utf8_header_values_are_marked() {
        let headers = [
            header("x-bin", b"\x80abc"),
            header("x-text", b"caf\xc3\xa9"),
        ];
        assert_eq!(
            headers_json(&headers),
            json!([["x-bin", "gGFiYw==", "base64"], ["x-text", "café"]])
        );
        assert_eq!(header_text(b"\x80abc"), "<base64 gGFiYw==>");
        let body = Body {
            size: 2,
            data: vec![0xff, 0x01],
            truncated: false,
        };
        assert_eq!(body_json(body)["encoding"], "base64");
    }

    #[test]
    fn text_diff_lines() {
        let b = "a\nb\nc\nd\n";
        let s = "a\nc\nX\nd\n";
        assert_eq!(
            rendered(&text_diff(b, s)),
            [r#"line 2: removed "b""#, r#"line 3: added "X""#]
        );
        let mut c = Comparison::default();
        let body = |t: &str| Body {
            size: t.len() as u64,
            data: t.into(),
            truncated: false,
        };
        compare_bodies(&body("x\u{1b}[2J"), &body("y"), false, &mut c);
        assert_eq!(
            rendered(&c.differences)[0],
            r#"line 1: removed "x\u001b[2J""#
        );
    }

    /// The shape names where and how, never a value the service answered; codes and
    /// durations, which hold no data, stay.
    #[test]
    fn the_shape_leaves_the_values_out() {
        let b = json!({"a": 1, "secret": "s3cr3t", "gone": "card 4111", "o": {"k": "v"}});
        let s = json!({"a": "1", "secret": "other", "new": "x-token"});
        let mut out = Vec::new();
        json_diff("$", &b, &s, &mut out);
        let shapes: Vec<String> = out.iter().map(Difference::render_shape).collect();
        assert_eq!(
            shapes,
            [
                "$.a: number → string",
                "$.gone: removed",
                "$.new: added",
                "$.o: removed",
                "$.secret: changed",
            ]
        );
        let lines: Vec<String> = text_diff("a\nb\n", "a\nc\n")
            .iter()
            .map(Difference::render_shape)
            .collect();
        assert_eq!(lines, ["line 2: removed", "line 2: added"]);
        let header = Difference::new("header", "x-user", Some(json!("ann")), Some(json!("bob")));
        assert_eq!(header.render_shape(), "header x-user: changed");
        let grpc = Difference::new(
            "trailer",
            "grpc-status",
            Some(json!("0")),
            Some(json!("14")),
        );
        assert_eq!(grpc.render_shape(), grpc.render());
        let status = Difference::new("status", "", Some(json!(200)), Some(json!(500)));
        assert_eq!(status.render_shape(), "status: 200 → 500");
    }
}
