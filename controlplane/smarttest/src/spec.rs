//! What a smart test is: an ordered list of HTTP and gRPC requests (or commands, `script`) with
//! optional checks. The
//! same types are the `SmartTest` resource's spec and the file `spur test run -f` reads; they are
//! validated once ([`TestSpec::validate`]) before anything is sent.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Method, Uri};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Error;
use crate::path::JsonPath;
use crate::script::{PreparedScript, ScriptStep};

/// Most steps in one test: each is sent three times (the sandbox once, the baseline twice).
pub const MAX_STEPS: usize = 100;
/// Most headers of one request.
pub const MAX_HEADERS: usize = 32;
/// Most checks of one step.
pub const MAX_CHECKS: usize = 16;
/// Largest request body of one step (bytes): the spec is stored in etcd.
pub const MAX_BODY: usize = 64 * 1024;
/// Most messages a step streams to a client-streaming method (`grpc.json` as a list).
pub const MAX_STREAM_MESSAGES: usize = 100;
/// Largest descriptor set (base64 characters: 512 KiB decoded).
pub const MAX_DESCRIPTOR_SET_BASE64: usize = 512 * 1024 / 3 * 4;
/// Longest step name, and its syntax (what [`TestSpec::validate`] checks).
pub const NAME_MAX: usize = 63;
pub const NAME_PATTERN: &str = "^[a-z]([-a-z0-9]*[a-z0-9])?$";
/// A request's timeout when the step sets none, and the most it may set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
pub const MAX_TIMEOUT: Duration = Duration::from_secs(60);
/// A script step's timeout when it sets none, and the most it may set: a script is a whole
/// test run (k6, a browser), not one request.
pub const DEFAULT_SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);
pub const MAX_SCRIPT_TIMEOUT: Duration = Duration::from_secs(600);

/// A test: requests sent in order, each to the baseline, to the sandbox and to the baseline again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TestSpec {
    /// The requests, in the order they are sent.
    pub steps: Vec<Step>,
}

/// One request, and what its answer must hold.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    /// Unique in the test: a lower-case name of letters, digits and dashes.
    #[schemars(length(min = 1, max = NAME_MAX), regex(pattern = NAME_PATTERN))]
    pub name: String,
    /// An HTTP request (HTTP/1.1). Exactly one of `http`, `grpc` and `script`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpRequest>,
    /// A unary gRPC call (HTTP/2 without TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcRequest>,
    /// A command run instead of a request (k6, Playwright, a test runner): its exit status is
    /// compared as a status, its standard output as a body (JSON field by field, else line by
    /// line); `SPUR_ROUTING_KEY` and `SPUR_BAGGAGE` are set on the sandbox's pass only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<ScriptStep>,
    /// Seconds to wait for the whole answer (default 10, at most 60), or for a script to exit
    /// (default 120, at most 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u32>,
    /// What the answer must hold; checked on both sides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_CHECKS))]
    pub checks: Vec<Check>,
}

/// An HTTP request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpRequest {
    /// GET when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// `http://host[:port]/path[?query]`: a Service's name (`backend.shop:8080`) in a cluster.
    pub url: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_HEADERS))]
    pub headers: Vec<HeaderEntry>,
    /// A body as text. At most one of `body` and `json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// A body as JSON (sent with `content-type: application/json` unless a header sets one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_value")]
    pub json: Option<Value>,
}

/// A unary gRPC call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRequest {
    /// `host:port` of the server (a Service's name in a cluster).
    pub target: String,
    /// `package.Service/Method`.
    pub method: String,
    /// The request message, protobuf-encoded, in base64 (empty: the message with every field
    /// at its default). At most one of `messageBase64` and `json`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message_base64: String,
    /// The request message as JSON (protobuf's JSON mapping); needs `descriptorSetBase64` or
    /// `reflection`. For a method the client streams to, a list of 1 to 100 messages, sent in
    /// order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_value")]
    pub json: Option<Value>,
    /// Learn the service's types from the server's gRPC reflection (`grpc.reflection.v1`, else
    /// `v1alpha`), asked at the baseline before the run: as with a descriptor set, the answers
    /// are compared field by field and `json` may give the request. At most one of this and
    /// `descriptorSetBase64`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reflection: bool,
    /// A FileDescriptorSet holding the service, in base64 (`protoc --include_imports
    /// --descriptor_set_out`, or `buf build -o`): the answers are then decoded and compared
    /// field by field, and JSON-path checks read them; without it they are compared message by
    /// message, byte by byte.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = MAX_DESCRIPTOR_SET_BASE64))]
    pub descriptor_set_base64: String,
    /// Request metadata.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_HEADERS))]
    pub metadata: Vec<HeaderEntry>,
}

/// A header (or gRPC metadata entry).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HeaderEntry {
    pub name: String,
    pub value: String,
}

/// One thing an answer must hold. Exactly one field is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Check {
    /// The HTTP status; a script's exit status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The gRPC status code (0 is OK).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u32>,
    /// A response header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<HeaderCheck>,
    /// A value in a JSON body (a script's standard output), by path (`$.items[0].name`,
    /// `$["a key"]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_path: Option<JsonPathCheck>,
}

/// A header's presence or value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderCheck {
    pub name: String,
    /// The value it must have; unset: only that it is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
}

/// A JSON value's presence or value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JsonPathCheck {
    pub path: String,
    /// The value it must have; unset: only that it is there (`exists: false`: that it is not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_value")]
    pub equals: Option<Value>,
    /// Whether the path must hold a value (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
}

/// A step ready to send: everything parsed and checked.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub name: String,
    /// How findings group it: `GET backend.shop:8080/items` (no query), `gRPC
    /// grpc-api.shop:9090/pkg.Svc/Get`, `SCRIPT <step name>` (not the command, which may hold
    /// what the Sandbox's wider readers should not see in its Events).
    pub endpoint: String,
    pub action: Action,
    pub timeout: Duration,
    pub checks: Vec<Check>,
}

/// What a step does on each pass.
#[derive(Clone, Debug)]
pub enum Action {
    Request(PreparedRequest),
    Script(PreparedScript),
}

impl Prepared {
    /// Its request, unless it is a script.
    pub fn request(&self) -> Option<&PreparedRequest> {
        match &self.action {
            Action::Request(r) => Some(r),
            Action::Script(_) => None,
        }
    }

    /// Its command, if it is a script.
    pub fn script(&self) -> Option<&PreparedScript> {
        match &self.action {
            Action::Script(s) => Some(s),
            Action::Request(_) => None,
        }
    }
}

/// The request of a [`Prepared`] step.
#[derive(Clone, Debug)]
pub struct PreparedRequest {
    pub grpc: bool,
    pub method: Method,
    /// Host and port to connect to.
    pub host: String,
    pub port: u16,
    /// The `Host` / `:authority`.
    pub authority: String,
    pub path_and_query: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Vec<u8>,
    /// A gRPC answer's message type, when the step gave a descriptor set: its answers are
    /// decoded to JSON for the checks and the diff.
    pub grpc_output: Option<prost_reflect::MessageDescriptor>,
    /// The method's answer is a stream: decoded, it is always a list, even of one message.
    pub grpc_server_streaming: bool,
    /// Set while the step's types are still to be learned by reflection (`reflect::resolve`
    /// clears it): the request's body is then empty until its JSON is encoded.
    pub reflect: Option<Reflect>,
}

/// What a step that learns its types by gRPC reflection still needs once they are known.
#[derive(Clone, Debug)]
pub struct Reflect {
    pub service: String,
    pub method: String,
    /// The request as JSON, to encode with the learned input type.
    pub json: Option<Value>,
}

impl TestSpec {
    /// A test a person wrote (a file's `steps:`): a field this build does not know, at any
    /// depth, is refused, naming where, so a typo is not silently dropped. (Read from the
    /// cluster, a test of a newer CRD is read with its unknown fields left aside.)
    pub fn from_file_value(value: Value) -> Result<Self, Error> {
        if let Some(first) = crate::strict::unknown_fields::<Self>(&value).first() {
            return Err(Error::Spec(format!("unknown field `{first}`")));
        }
        serde_json::from_value(value).map_err(|e| Error::Spec(e.to_string()))
    }

    /// Checks every step and returns them ready to send; the first problem is the error, naming
    /// the step and the field.
    pub fn validate(&self) -> Result<Vec<Prepared>, Error> {
        if self.steps.is_empty() {
            return Err(Error::Spec("a test needs at least one step".into()));
        }
        if self.steps.len() > MAX_STEPS {
            return Err(Error::Spec(format!(
                "{} steps: a test has at most {MAX_STEPS}",
                self.steps.len()
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        let mut out = Vec::with_capacity(self.steps.len());
        for (i, step) in self.steps.iter().enumerate() {
            let err = |what: String| Error::Spec(format!("steps[{i}] ({}): {what}", step.name));
            if !valid_name(&step.name) {
                return Err(err(format!(
                    "the name must be 1 to {NAME_MAX} lower-case letters, digits and dashes, starting with a letter"
                )));
            }
            if !seen.insert(step.name.as_str()) {
                return Err(err("another step has this name".into()));
            }
            out.push(step.prepare().map_err(err)?);
        }
        Ok(out)
    }
}

fn valid_name(name: &str) -> bool {
    (1..=NAME_MAX).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.ends_with('-')
}

impl Step {
    fn prepare(&self) -> Result<Prepared, String> {
        let (default, max) = if self.script.is_some() {
            (DEFAULT_SCRIPT_TIMEOUT, MAX_SCRIPT_TIMEOUT)
        } else {
            (DEFAULT_TIMEOUT, MAX_TIMEOUT)
        };
        let timeout = match self.timeout_seconds {
            None => default,
            Some(s) if s >= 1 && u64::from(s) <= max.as_secs() => Duration::from_secs(s.into()),
            Some(s) => {
                return Err(format!(
                    "timeoutSeconds {s}: must be 1 to {}",
                    max.as_secs()
                ));
            }
        };
        if self.checks.len() > MAX_CHECKS {
            return Err(format!("at most {MAX_CHECKS} checks"));
        }
        for (i, c) in self.checks.iter().enumerate() {
            c.validate(self.script.is_some())
                .map_err(|e| format!("checks[{i}]: {e}"))?;
            // A script has no headers and no gRPC status: such a check could never pass.
            if self.script.is_some() && (c.header.is_some() || c.grpc_status.is_some()) {
                return Err(format!(
                    "checks[{i}]: a script step checks its exit status (status) and its output (jsonPath), not a header or a gRPC status"
                ));
            }
        }
        let action = match (&self.http, &self.grpc, &self.script) {
            (Some(h), None, None) => Action::Request(h.prepare()?),
            (None, Some(g), None) => Action::Request(g.prepare()?),
            (None, None, Some(s)) => Action::Script(s.prepare()?),
            _ => return Err("set exactly one of http, grpc and script".into()),
        };
        let endpoint = match &action {
            Action::Request(r) if r.grpc => format!("gRPC {}{}", r.authority, r.path_and_query),
            Action::Request(r) => {
                let path = r.path_and_query.split('?').next().unwrap_or("/");
                format!("{} {}{}", r.method, r.authority, path)
            }
            Action::Script(_) => format!("SCRIPT {}", self.name),
        };
        Ok(Prepared {
            name: self.name.clone(),
            endpoint,
            action,
            timeout,
            checks: self.checks.clone(),
        })
    }
}

impl HttpRequest {
    fn prepare(&self) -> Result<PreparedRequest, String> {
        let method = match &self.method {
            None => Method::GET,
            Some(m) => Method::from_bytes(m.as_bytes())
                .ok()
                .filter(|m| m.as_str().bytes().all(|b| b.is_ascii_uppercase()))
                .ok_or_else(|| format!("http.method {m:?}: not an upper-case HTTP method"))?,
        };
        let uri: Uri = self
            .url
            .parse()
            .map_err(|e| format!("http.url {:?}: {e}", self.url))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "http.url {:?}: https is not supported yet; name the Service's plain-HTTP port (the sidecar routes by key on it)",
                    self.url
                ));
            }
            _ => return Err(format!("http.url {:?}: must start with http://", self.url)),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("http.url {:?}: no host", self.url))?;
        if authority.as_str().contains('@') {
            return Err(format!(
                "http.url {:?}: credentials in a URL are refused (they would be stored in the test); send a header",
                self.url
            ));
        }
        let body = match (&self.body, &self.json) {
            (Some(_), Some(_)) => return Err("set at most one of http.body and http.json".into()),
            (Some(b), None) => b.clone().into_bytes(),
            (None, Some(j)) => serde_json::to_vec(j).map_err(|e| format!("http.json: {e}"))?,
            (None, None) => Vec::new(),
        };
        if body.len() > MAX_BODY {
            return Err(format!(
                "a body of {} bytes: at most {MAX_BODY}",
                body.len()
            ));
        }
        let mut headers = headers(&self.headers, "http.headers")?;
        let has = |h: &[(HeaderName, HeaderValue)], n: &str| h.iter().any(|(k, _)| k == n);
        if self.json.is_some() && !has(&headers, "content-type") {
            headers.push((
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ));
        }
        Ok(PreparedRequest {
            grpc_output: None,
            grpc_server_streaming: false,
            reflect: None,
            grpc: false,
            method,
            host: authority.host().to_owned(),
            port: authority.port_u16().unwrap_or(80),
            authority: authority.as_str().to_owned(),
            path_and_query: uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
            headers,
            body,
        })
    }
}

/// Headers a test may not set: the routing key's carriers (the runner writes the sandbox's key,
/// and the baseline's requests must carry none) and those the connection owns.
fn reserved(name: &HeaderName) -> bool {
    spur_routing::carrier::Carrier::ALL
        .iter()
        .any(|c| c.header() == name.as_str())
        || matches!(
            name.as_str(),
            "host" | "content-length" | "transfer-encoding" | "connection" | "upgrade"
        )
}

pub(crate) fn headers(
    list: &[HeaderEntry],
    field: &str,
) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    if list.len() > MAX_HEADERS {
        return Err(format!("{field}: at most {MAX_HEADERS}"));
    }
    list.iter()
        .map(|h| {
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| format!("{field} {:?}: not a header name", h.name))?;
            if reserved(&name) {
                return Err(format!(
                    "{field} {name}: set by the runner (the routing key's carriers, framing)"
                ));
            }
            let value = HeaderValue::from_str(&h.value)
                .map_err(|_| format!("{field} {name}: the value is not a valid header value"))?;
            Ok((name, value))
        })
        .collect()
}

impl Check {
    /// Whether it can be checked (`script`: on a script step's pass, whose status is an exit
    /// status).
    fn validate(&self, script: bool) -> Result<(), String> {
        let set = [
            self.status.is_some(),
            self.grpc_status.is_some(),
            self.header.is_some(),
            self.json_path.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err("set exactly one of status, grpcStatus, header and jsonPath".into());
        }
        if let Some(s) = self.status
            && script
            && s > 255
        {
            return Err(format!("status {s}: an exit status is 0 to 255"));
        }
        if let Some(s) = self.status
            && !script
            && !(100..=599).contains(&s)
        {
            return Err(format!("status {s}: not an HTTP status"));
        }
        if let Some(s) = self.grpc_status
            && s > 16
        {
            return Err(format!("grpcStatus {s}: gRPC codes are 0 to 16"));
        }
        if let Some(h) = &self.header {
            HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| format!("header {:?}: not a header name", h.name))?;
        }
        if let Some(j) = &self.json_path {
            JsonPath::parse(&j.path).map_err(|e| format!("jsonPath {:?}: {e}", j.path))?;
            if j.exists == Some(false) && j.equals.is_some() {
                return Err("jsonPath: equals with exists: false can never hold".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http_step(name: &str, url: &str) -> Step {
        Step {
            name: name.into(),
            http: Some(HttpRequest {
                url: url.into(),
                ..HttpRequest::default()
            }),
            ..Step::default()
        }
    }

    fn one(step: Step) -> Result<Prepared, Error> {
        TestSpec { steps: vec![step] }
            .validate()
            .map(|mut v| v.remove(0))
    }

    fn refused(step: Step) -> String {
        one(step).unwrap_err().to_string()
    }

    #[test]
    fn an_http_step_is_parsed_once() {
        let mut s = http_step("list", "http://backend.shop:8080/items?limit=2");
        if let Some(h) = s.http.as_mut() {
            h.json = Some(serde_json::json!({"a": 1}));
            h.method = Some("POST".into());
        }
        let p = one(s).unwrap();
        assert_eq!(p.endpoint, "POST backend.shop:8080/items");
        let r = p.request().unwrap();
        assert_eq!((r.host.as_str(), r.port), ("backend.shop", 8080));
        assert_eq!(r.path_and_query, "/items?limit=2");
        assert_eq!(r.body, br#"{"a":1}"#);
        assert_eq!(r.headers[0].1, "application/json");
        assert_eq!(p.timeout, DEFAULT_TIMEOUT);
        let p = one(http_step("root", "http://api")).unwrap();
        let r = p.request().unwrap();
        assert_eq!((r.port, r.path_and_query.as_str()), (80, "/"));
    }

    #[test]
    fn a_grpc_step_is_framed() {
        let s = Step {
            name: "get".into(),
            grpc: Some(GrpcRequest {
                target: "grpc-api.shop:9090".into(),
                method: "shop.Items/Get".into(),
                message_base64: "CgFh".into(),
                ..GrpcRequest::default()
            }),
            ..Step::default()
        };
        let p = one(s).unwrap();
        assert_eq!(p.endpoint, "gRPC grpc-api.shop:9090/shop.Items/Get");
        let r = p.request().unwrap();
        assert_eq!(r.body, [0, 0, 0, 0, 3, 0x0a, 1, b'a']);
        assert!(r.grpc);
    }

    #[test]
    fn a_script_step_is_named_by_its_step_and_checks_what_a_script_has() {
        let script = |checks: Vec<Check>, timeout: Option<u32>| Step {
            name: "k6".into(),
            script: Some(crate::script::ScriptStep {
                command: vec!["k6".into(), "run".into(), "--vus=2".into()],
                env: Vec::new(),
            }),
            timeout_seconds: timeout,
            checks,
            ..Step::default()
        };
        let p = one(script(
            vec![Check {
                status: Some(0),
                ..Check::default()
            }],
            None,
        ))
        .unwrap();
        assert_eq!(p.endpoint, "SCRIPT k6", "the command stays out of findings");
        assert_eq!(p.timeout, DEFAULT_SCRIPT_TIMEOUT);
        assert_eq!(p.script().unwrap().args, ["run", "--vus=2"]);
        assert!(p.request().is_none());
        assert_eq!(
            one(script(vec![], Some(600))).unwrap().timeout.as_secs(),
            600
        );
        assert!(refused(script(vec![], Some(601))).contains("must be 1 to 600"));
        let exit = |n| Check {
            status: Some(n),
            ..Check::default()
        };
        assert!(refused(script(vec![exit(256)], None)).contains("an exit status is 0 to 255"));
        let header = Check {
            header: Some(HeaderCheck {
                name: "x".into(),
                equals: None,
            }),
            ..Check::default()
        };
        assert!(refused(script(vec![header], None)).contains("checks[0]: a script step checks"));
        let mut both = script(vec![], None);
        both.http = Some(HttpRequest {
            url: "http://a/".into(),
            ..HttpRequest::default()
        });
        assert!(refused(both).contains("exactly one of http, grpc and script"));
    }

    #[test]
    fn what_is_refused_says_where() {
        assert!(refused(http_step("Bad", "http://a")).contains("steps[0] (Bad): the name"));
        assert!(refused(http_step("a", "https://a")).contains("https is not supported"));
        assert!(refused(http_step("a", "ftp://a")).contains("must start with http://"));
        assert!(refused(http_step("a", "http://u:p@a/")).contains("credentials"));
        let mut s = http_step("a", "http://a");
        if let Some(h) = s.http.as_mut() {
            h.headers = vec![HeaderEntry {
                name: "baggage".into(),
                value: "sd-routing-key=x".into(),
            }];
        }
        assert!(refused(s).contains("http.headers baggage: set by the runner"));
        let mut s = http_step("a", "http://a");
        s.grpc = Some(GrpcRequest::default());
        assert!(refused(s).contains("exactly one of http, grpc and script"));
        let mut s = http_step("a", "http://a");
        s.timeout_seconds = Some(61);
        assert!(refused(s).contains("timeoutSeconds 61"));
        let mut s = http_step("a", "http://a");
        s.checks = vec![Check {
            status: Some(200),
            grpc_status: Some(0),
            ..Check::default()
        }];
        assert!(refused(s).contains("checks[0]: set exactly one"));
        let mut s = http_step("a", "http://a");
        s.checks = vec![Check {
            json_path: Some(JsonPathCheck {
                path: "items".into(),
                ..JsonPathCheck::default()
            }),
            ..Check::default()
        }];
        assert!(refused(s).contains("jsonPath \"items\""));
        let g = |method: &str, target: &str| Step {
            name: "g".into(),
            grpc: Some(GrpcRequest {
                target: target.into(),
                method: method.into(),
                ..GrpcRequest::default()
            }),
            ..Step::default()
        };
        assert!(refused(g("Get", "a:1")).contains("package.Service/Method"));
        assert!(refused(g("a.S/Get", "a")).contains("needs a port"));
        let two = TestSpec {
            steps: vec![http_step("a", "http://a"), http_step("a", "http://b")],
        };
        assert!(
            two.validate()
                .unwrap_err()
                .to_string()
                .contains("another step has this name")
        );
        assert!(
            TestSpec::default()
                .validate()
                .unwrap_err()
                .to_string()
                .contains("at least one step")
        );
    }

    #[test]
    fn the_spec_reads_as_yaml_written_by_hand() {
        let spec: TestSpec = serde_yaml_ng::from_str(
            r#"
steps:
  - name: list
    http: {url: "http://backend.shop:8080/items", headers: [{name: x-user, value: ann}]}
    checks:
      - status: 200
      - jsonPath: {path: "$.items[0].name", equals: tea}
  - name: get
    grpc: {target: "grpc-api.shop:9090", method: shop.Items/Get}
    checks: [{grpcStatus: 0}]
"#,
        )
        .unwrap();
        let steps = spec.validate().unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(
            steps[0].checks[1].json_path.as_ref().unwrap().equals,
            Some("tea".into())
        );
    }
}
