//! `RouteGroup`: a routing key of its own over every sandbox whose labels match, so that one
//! request can reach the forks of several sandboxes.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::error::Error;
use crate::sandbox::{Endpoint, MAX_ENDPOINTS, check_endpoints, check_owner_name, parse_ttl};
use crate::validation::*;

/// Deepest nesting of `any`/`all` (the top-level match is depth 1). Structural schemas cannot
/// recurse, so the schema spells out every level; the deepest one only takes `label`.
pub const MAX_MATCH_DEPTH: usize = 4;
/// Most children of one `any` or `all`.
pub const MAX_MATCH_ITEMS: usize = 8;
/// Longest label-value glob.
pub const MAX_GLOB_LEN: usize = 256;

/// Desired state of a route group.
// Cluster-scoped like the sandboxes it selects.
// `printcolumn(...)` repeats its keys by design; clippy takes that for a copy-paste slip.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "RouteGroup",
    plural = "routegroups",
    shortname = "rg",
    category = "spur",
    status = "RouteGroupStatus",
    derive = "PartialEq",
    doc = "A route group: its own routing key, routed to every sandbox whose labels match. Requests carrying the key reach the forks of all matched sandboxes at once.",
    validation = Rule::new("size(self.metadata.name) <= 63 && !self.metadata.name.contains('.')").message("a route group name must be a DNS-1123 label (at most 63 characters, no dots): it is used in label values and host names"),
    printcolumn(name = "Key", type_ = "string", json_path = ".status.routingKey", description = "Routing key"),
    printcolumn(name = "Sandboxes", type_ = "integer", json_path = ".status.readySandboxes", description = "Matched sandboxes that are ready"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Expires", type_ = "date", json_path = ".status.expiresAt", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct RouteGroupSpec {
    /// What the route group is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DESCRIPTION_MAX))]
    pub description: Option<String>,
    /// Which sandboxes belong to the group, by their `spec.labels`.
    #[serde(rename = "match")]
    pub selector: Match,
    /// Endpoints that get a preview URL carrying the group's routing key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = MAX_ENDPOINTS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub endpoints: Vec<Endpoint>,
    /// When the route group is deleted. Without it the group lives until deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<RouteGroupTtl>,
}

/// A route group's time to live.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteGroupTtl {
    /// A positive whole number of minutes (`m`), hours (`h`), days (`d`) or weeks (`w`), at
    /// most 4294967295, e.g. `90m` or `2d`.
    #[schemars(length(min = 2, max = 11), regex(pattern = TTL_PATTERN))]
    pub duration: String,
    /// What the duration counts from: `noMatchedSandboxes` (default, as in Signadot: from when
    /// the group last matched no sandbox; it lives while it matches one), `createdAt` or
    /// `updatedAt` (the last spec change the controller saw).
    #[serde(default)]
    pub offset_from: RouteGroupTtlOffset,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum RouteGroupTtlOffset {
    #[default]
    NoMatchedSandboxes,
    CreatedAt,
    UpdatedAt,
}

impl RouteGroupTtl {
    /// When a group created at `created`, last changed at `updated` and matching no sandbox
    /// since `unmatched` (`None` while it matches one) expires. `None`: it does not (yet), or
    /// the duration is malformed, or the instant is beyond what a timestamp can hold.
    pub fn expires_at(
        &self,
        created: Timestamp,
        updated: Timestamp,
        unmatched: Option<Timestamp>,
    ) -> Option<Timestamp> {
        let base = match self.offset_from {
            RouteGroupTtlOffset::NoMatchedSandboxes => unmatched?,
            RouteGroupTtlOffset::CreatedAt => created,
            RouteGroupTtlOffset::UpdatedAt => updated,
        };
        let d = SignedDuration::try_from(parse_ttl(&self.duration)?).ok()?;
        base.checked_add(d).ok()
    }
}

/// A predicate over sandbox labels: exactly one of `label`, `any` and `all`.
// Serialized through `MatchRepr`, an object with three optional fields, because that is the
// wire shape and YAML deserializers would otherwise expect enum tags (`!label`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MatchRepr", into = "MatchRepr")]
pub enum Match {
    /// The sandbox has label `key` and its value matches the glob `value`.
    Label(LabelMatch),
    /// At least one of these matches.
    Any(Vec<Match>),
    /// All of these match.
    All(Vec<Match>),
}

/// One label test. `value` is a glob with Go `path/filepath.Match` syntax: `*` (any run of
/// characters except `/`), `?` (one character except `/`), `[a-z]`, `[^a-z]` and `\` escapes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelMatch {
    /// Label key, compared exactly.
    pub key: String,
    /// Glob over the label value.
    pub value: String,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MatchRepr {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    label: Option<LabelMatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    any: Option<Vec<Match>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    all: Option<Vec<Match>>,
}

impl TryFrom<MatchRepr> for Match {
    type Error = &'static str;

    fn try_from(r: MatchRepr) -> Result<Self, Self::Error> {
        match (r.label, r.any, r.all) {
            (Some(l), None, None) => Ok(Match::Label(l)),
            (None, Some(a), None) => Ok(Match::Any(a)),
            (None, None, Some(a)) => Ok(Match::All(a)),
            _ => Err("a match needs exactly one of label, any and all"),
        }
    }
}

impl From<Match> for MatchRepr {
    fn from(m: Match) -> Self {
        let mut r = MatchRepr {
            label: None,
            any: None,
            all: None,
        };
        match m {
            Match::Label(l) => r.label = Some(l),
            Match::Any(a) => r.any = Some(a),
            Match::All(a) => r.all = Some(a),
        }
        r
    }
}

impl Match {
    /// Whether a sandbox with these labels belongs to the group. A malformed glob matches
    /// nothing ([`RouteGroupSpec::validate`] reports it).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Match::Label(l) => labels
                .get(&l.key)
                .is_some_and(|v| Glob::new(&l.value).is_ok_and(|g| g.matches(v))),
            Match::Any(ms) => ms.iter().any(|m| m.matches(labels)),
            Match::All(ms) => ms.iter().all(|m| m.matches(labels)),
        }
    }

    fn check(&self, c: &mut Checker, path: &str, depth: usize) {
        match self {
            Match::Label(l) => {
                c.require(
                    is_label_key(&l.key),
                    || format!("{path}.label.key"),
                    "must be a Kubernetes label key ([prefix/]name)",
                );
                if let Err(e) = Glob::new(&l.value) {
                    c.fail(format!("{path}.label.value"), e);
                }
            }
            Match::Any(ms) | Match::All(ms) => {
                let field = if matches!(self, Match::Any(_)) {
                    "any"
                } else {
                    "all"
                };
                let path = format!("{path}.{field}");
                if depth >= MAX_MATCH_DEPTH {
                    c.fail(
                        path,
                        format!("matches nest at most {MAX_MATCH_DEPTH} levels deep"),
                    );
                    return;
                }
                if ms.is_empty() {
                    c.fail(path.clone(), "must not be empty");
                }
                c.max_items(|| path.clone(), ms, MAX_MATCH_ITEMS);
                for (i, m) in ms.iter().enumerate() {
                    m.check(c, &format!("{path}[{i}]"), depth + 1);
                }
            }
        }
    }
}

impl JsonSchema for Match {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "RouteGroupMatch".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        match_schema(1)
    }
}

/// The schema of a match at `depth`, unrolled down to [`MAX_MATCH_DEPTH`].
fn match_schema(depth: usize) -> Schema {
    let label = json!({
        "description": "The sandbox has label `key` and its value matches the glob `value` (Go path/filepath.Match syntax: `*`, `?`, `[a-z]`, `[^a-z]`, `\\` escapes; `*` and `?` do not match `/`).",
        "type": "object",
        "required": ["key", "value"],
        "properties": {
            "key": {
                "description": "Label key, compared exactly.",
                "type": "string",
                "minLength": 1,
                "maxLength": LABEL_KEY_MAX,
                "pattern": LABEL_KEY_PATTERN,
            },
            "value": {
                "description": "Glob over the label value.",
                "type": "string",
                "maxLength": MAX_GLOB_LEN,
            },
        },
    });
    let mut schema = if depth >= MAX_MATCH_DEPTH {
        json!({
            "description": "A predicate over sandbox labels; at this depth only `label`.",
            "type": "object",
            "required": ["label"],
            "properties": { "label": label },
        })
    } else {
        let child = match_schema(depth + 1);
        let list = |what: &str| {
            json!({
                "description": format!("{what} of these matches."),
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_MATCH_ITEMS,
                "items": child,
            })
        };
        json!({
            "description": "A predicate over sandbox labels: exactly one of `label`, `any` and `all`.",
            "type": "object",
            "properties": {
                "label": label,
                "any": list("At least one"),
                "all": list("Each"),
            },
            "x-kubernetes-validations": [{
                "rule": "(has(self.label) ? 1 : 0) + (has(self.any) ? 1 : 0) + (has(self.all) ? 1 : 0) == 1",
                "message": "exactly one of label, any and all",
            }],
        })
    };
    // `json!` always builds an object here; the fallback keeps this panic-free.
    Schema::try_from(schema.take()).unwrap_or_default()
}

/// Observed state of a route group.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteGroupStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The group's routing key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = ROUTING_KEY_MAX), regex(pattern = ROUTING_KEY_PATTERN))]
    pub routing_key: Option<String>,
    /// Names of the sandboxes whose labels match, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub matched_sandboxes: Vec<String>,
    /// How many of the matched sandboxes are ready.
    #[serde(default)]
    pub ready_sandboxes: i32,
    /// `Ready` and friends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Preview URLs of `spec.endpoints`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub endpoints: Vec<crate::sandbox::EndpointStatus>,
    /// When the controller first saw the current spec (the base of `ttl.offsetFrom: updatedAt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
    /// Since when the group matches no sandbox (the base of `ttl.offsetFrom:
    /// noMatchedSandboxes`); absent while it matches one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unmatched_since: Option<Time>,
    /// When the group will be deleted, from `spec.ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
}

impl RouteGroup {
    /// [`RouteGroupSpec::validate`] plus the rule on the object's name.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        check_owner_name(&mut c, self.metadata.name.as_deref());
        self.spec.check(&mut c);
        c.finish("RouteGroup")
    }
}

impl RouteGroupSpec {
    /// Every rule of the schema and its CEL rules, plus glob syntax.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c);
        c.finish("RouteGroup")
    }

    fn check(&self, c: &mut Checker) {
        if let Some(d) = &self.description {
            c.max_len(|| "spec.description".into(), d, DESCRIPTION_MAX);
        }
        self.selector.check(c, "spec.match", 1);
        check_endpoints(c, "spec.endpoints", &self.endpoints);
        if let Some(ttl) = &self.ttl {
            c.require(
                parse_ttl(&ttl.duration).is_some(),
                || "spec.ttl.duration".into(),
                "must be a positive whole number (at most 4294967295) followed by m, h, d or w",
            );
        }
    }
}

// === glob ===

/// A compiled label-value glob (Go `path/filepath.Match` on Unix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob {
    tokens: Vec<Token>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Token {
    Literal(char),
    /// `?`
    One,
    /// `*`
    Run,
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
}

impl Glob {
    /// Compiles `pattern`, rejecting what Go rejects with `ErrBadPattern`.
    pub fn new(pattern: &str) -> Result<Glob, String> {
        if pattern.len() > MAX_GLOB_LEN {
            return Err(format!("glob is longer than {MAX_GLOB_LEN} bytes"));
        }
        let bad = |why: &str| format!("bad glob {pattern:?}: {why}");
        let mut chars = pattern.chars().peekable();
        let mut tokens = Vec::new();
        while let Some(ch) = chars.next() {
            tokens.push(match ch {
                '*' => Token::Run,
                '?' => Token::One,
                '\\' => Token::Literal(chars.next().ok_or_else(|| bad("trailing \\"))?),
                '[' => {
                    let negated = chars.next_if_eq(&'^').is_some();
                    let mut ranges = Vec::new();
                    loop {
                        if !ranges.is_empty() && chars.next_if_eq(&']').is_some() {
                            break;
                        }
                        let lo = class_char(&mut chars).ok_or_else(|| bad("malformed [...]"))?;
                        let hi = if chars.next_if_eq(&'-').is_some() {
                            class_char(&mut chars).ok_or_else(|| bad("malformed range"))?
                        } else {
                            lo
                        };
                        ranges.push((lo, hi));
                    }
                    Token::Class { negated, ranges }
                }
                c => Token::Literal(c),
            });
        }
        Ok(Glob { tokens })
    }

    /// Whether the whole of `s` matches.
    pub fn matches(&self, s: &str) -> bool {
        let s: Vec<char> = s.chars().collect();
        let (n, m) = (self.tokens.len(), s.len());
        // `next[j]`: tokens[i+1..] match s[j..]; built from the last token backwards, so the
        // cost is O(tokens × chars) whatever the pattern (no backtracking blow-up).
        let mut next = vec![false; m + 1];
        next[m] = true;
        for i in (0..n).rev() {
            let mut cur = vec![false; m + 1];
            for j in (0..=m).rev() {
                cur[j] = match &self.tokens[i] {
                    Token::Run => next[j] || (j < m && s[j] != '/' && cur[j + 1]),
                    t => j < m && t.accepts(s[j]) && next[j + 1],
                };
            }
            next = cur;
        }
        next[0]
    }
}

impl Token {
    fn accepts(&self, c: char) -> bool {
        match self {
            Token::Literal(l) => *l == c,
            Token::One => c != '/',
            Token::Run => false,
            Token::Class { negated, ranges } => {
                ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&c)) != *negated
            }
        }
    }
}

/// One character inside `[...]`: `-` and `]` must be escaped, as in Go.
fn class_char(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Option<char> {
    match chars.next()? {
        '\\' => chars.next(),
        '-' | ']' => None,
        c => Some(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(p: &str, s: &str) -> bool {
        Glob::new(p).unwrap().matches(s)
    }

    #[test]
    fn globs_follow_go_filepath_match() {
        // Cases from Go's path/filepath match_test.go (Unix).
        assert!(g("abc", "abc"));
        assert!(g("*", "abc"));
        assert!(g("*c", "abc"));
        assert!(!g("a*", "ab/c"));
        assert!(g("a*/b", "abc/b"));
        assert!(!g("a*/b", "a/c/b"));
        assert!(g("a*b*c*d*e*/f", "axbxcxdxe/f"));
        assert!(!g("a*b*c*d*e*/f", "axbxcxdxexxx/fff"));
        assert!(g("ab[c]", "abc"));
        assert!(g("ab[b-d]", "abc"));
        assert!(!g("ab[e-g]", "abc"));
        assert!(!g("ab[^c]", "abc"));
        assert!(g("ab[^e-g]", "abc"));
        assert!(!g("a?b", "a/b"));
        assert!(g("a\\*b", "a*b"));
        assert!(!g("a\\*b", "ab"));
        assert!(g("a[\\-]b", "a-b"));
        assert!(g("[\\]a]", "]"));
        assert!(g("*x", "xxx"));
        assert!(g("", ""));
        assert!(!g("", "a"));
        assert!(g("pr-*", "pr-42"));
        for bad in [
            "[", "[^", "[^bc", "a[", "[]a]", "[-]", "[x-]", "[-x]", "\\", "[a-b-c]", "[]",
        ] {
            assert!(Glob::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn long_patterns_stay_cheap() {
        let p = "*a".repeat(100);
        let s = "a".repeat(200) + "b";
        assert!(!g(&p, &s));
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn label(k: &str, v: &str) -> Match {
        Match::Label(LabelMatch {
            key: k.into(),
            value: v.into(),
        })
    }

    #[test]
    fn matches_nest() {
        let m = Match::All(vec![
            label("team", "payments"),
            Match::Any(vec![label("pr", "1*"), label("branch", "feature/*")]),
        ]);
        assert!(m.matches(&labels(&[("team", "payments"), ("pr", "123")])));
        assert!(m.matches(&labels(&[("team", "payments"), ("branch", "feature/x")])));
        assert!(!m.matches(&labels(&[("team", "payments"), ("branch", "feature/x/y")])));
        assert!(!m.matches(&labels(&[("team", "search"), ("pr", "123")])));
        assert!(!m.matches(&labels(&[("team", "payments")])));
        assert!(!label("team", "[").matches(&labels(&[("team", "[")])));
    }

    #[test]
    fn validate_reports_depth_globs_and_empty_lists() {
        let spec = |m| RouteGroupSpec {
            description: None,
            selector: m,
            endpoints: vec![],
            ttl: None,
        };
        assert!(spec(label("team", "x*")).validate().is_ok());
        let mut ttl = spec(label("team", "x*"));
        ttl.ttl = Some(RouteGroupTtl {
            duration: "0m".into(),
            offset_from: RouteGroupTtlOffset::default(),
        });
        let e = ttl.validate().unwrap_err().to_string();
        assert!(e.contains("spec.ttl.duration"), "{e}");
        let mut deep = label("a", "b");
        for _ in 0..MAX_MATCH_DEPTH - 1 {
            deep = Match::Any(vec![deep]);
        }
        assert!(spec(deep.clone()).validate().is_ok());
        let err = spec(Match::All(vec![deep]))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("levels deep"), "{err}");
        let err = spec(Match::Any(vec![])).validate().unwrap_err().to_string();
        assert!(err.contains("spec.match.any: must not be empty"), "{err}");
        let err = spec(Match::Any(vec![label("Bad Key", "[")]))
            .validate()
            .unwrap_err();
        assert_eq!(err.field_errors().len(), 2, "{err}");
        assert!(
            err.to_string().contains("spec.match.any[0].label.value"),
            "{err}"
        );
    }
}
