//! The JSON paths checks name, in the syntax the diff writes them (`$.items[0].name`,
//! `$["a key"]`): `$`, then `.name` (letters, digits, `_`, not starting with a digit), `[n]` or
//! `["any key"]` (a JSON string). Nothing else: no wildcards, filters or recursion.

use serde_json::Value;

/// Longest path accepted (bytes), and most segments.
pub const MAX_LEN: usize = 512;
pub const MAX_SEGMENTS: usize = 32;

/// One step of a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// A parsed path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonPath(pub Vec<Segment>);

impl JsonPath {
    pub fn parse(path: &str) -> Result<JsonPath, String> {
        if path.len() > MAX_LEN {
            return Err(format!("longer than {MAX_LEN} bytes"));
        }
        let mut rest = path
            .strip_prefix('$')
            .ok_or("must start with $ (e.g. $.items[0].name)")?;
        let mut segments = Vec::new();
        while !rest.is_empty() {
            if segments.len() == MAX_SEGMENTS {
                return Err(format!("more than {MAX_SEGMENTS} segments"));
            }
            if let Some(r) = rest.strip_prefix('.') {
                let n = r
                    .bytes()
                    .take_while(|b| b.is_ascii_alphanumeric() || *b == b'_')
                    .count();
                if n == 0 || r.as_bytes()[0].is_ascii_digit() {
                    return Err(format!(
                        "after '.' at byte {}: a name of letters, digits and _ (quote others: [\"a key\"])",
                        path.len() - r.len()
                    ));
                }
                segments.push(Segment::Key(r[..n].to_owned()));
                rest = &r[n..];
            } else if let Some(r) = rest.strip_prefix('[') {
                let at = path.len() - r.len();
                if r.starts_with('"') {
                    // A JSON string: serde_json reads exactly one and says where it ended.
                    let mut it = serde_json::Deserializer::from_str(r).into_iter::<String>();
                    let key = match it.next() {
                        Some(Ok(k)) => k,
                        _ => {
                            return Err(format!(
                                "at byte {at}: an unterminated or invalid quoted key"
                            ));
                        }
                    };
                    let r = &r[it.byte_offset()..];
                    rest = r
                        .strip_prefix(']')
                        .ok_or(format!("at byte {at}: a quoted key must be followed by ]"))?;
                    segments.push(Segment::Key(key));
                } else {
                    let n = r.bytes().take_while(u8::is_ascii_digit).count();
                    let index = r[..n]
                        .parse::<usize>()
                        .ok()
                        .filter(|_| n <= 9 && (n == 1 || !r.starts_with('0')))
                        .ok_or(format!(
                            "at byte {at}: [ must hold an index (no leading zeros) or a quoted key"
                        ))?;
                    rest = r[n..]
                        .strip_prefix(']')
                        .ok_or(format!("at byte {at}: an index must be followed by ]"))?;
                    segments.push(Segment::Index(index));
                }
            } else {
                return Err(format!(
                    "at byte {}: expected . or [",
                    path.len() - rest.len()
                ));
            }
        }
        Ok(JsonPath(segments))
    }

    /// The value at the path, if there is one.
    pub fn get<'a>(&self, mut v: &'a Value) -> Option<&'a Value> {
        for s in &self.0 {
            v = match s {
                Segment::Key(k) => v.as_object()?.get(k)?,
                Segment::Index(i) => v.as_array()?.get(*i)?,
            };
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_as_the_diff_writes_them() {
        let v = json!({"items": [{"name": "tea"}, {"a key": [1, 2]}], "_x1": true});
        let get = |p: &str| JsonPath::parse(p).unwrap().get(&v).cloned();
        assert_eq!(get("$.items[0].name"), Some(json!("tea")));
        assert_eq!(get(r#"$.items[1]["a key"][1]"#), Some(json!(2)));
        assert_eq!(get("$._x1"), Some(json!(true)));
        assert_eq!(get("$"), Some(v.clone()));
        assert_eq!(get("$.items[2]"), None);
        assert_eq!(get("$.items.name"), None);
        assert_eq!(get(r#"$["q\"]"]"#), None);
    }

    #[test]
    fn refused_with_where() {
        for (p, want) in [
            ("items", "must start with $"),
            ("$.", "after '.' at byte 2"),
            ("$.1a", "after '.'"),
            ("$[01]", "no leading zeros"),
            ("$[1", "followed by ]"),
            ("$[\"a\"", "followed by ]"),
            ("$[\"a", "unterminated"),
            ("$[-1]", "hold an index"),
            ("$x", "expected . or ["),
            ("$[9999999999]", "hold an index"),
        ] {
            let e = JsonPath::parse(p).unwrap_err();
            assert!(e.contains(want), "{p}: {e}");
        }
        assert!(JsonPath::parse(&format!("${}", ".a".repeat(33))).is_err());
        assert!(JsonPath::parse(&format!("$.{}", "a".repeat(600))).is_err());
    }
}
