//! The exec audit trail (docs/access.md, "Audit"): the API server asks the webhook
//! `connect-audit.spur.dev` about every `CONNECT` to `pods/exec`, `pods/attach` and
//! `pods/portforward`; each is recorded as a `spur_audit` log line (user, pod, container,
//! command, tty) and an Event on the pod, and always allowed.
//!
//! Credentials on a command line are not recorded: JWTs, the value after `Bearer`/`Basic`,
//! values of `token=`, `password=`, `secret=` and the like, the argument after such a flag,
//! and long runs of hex or base64 (keys, tokens) become `<redacted>` ([`redact`]). What
//! remains is what an auditor needs: which program, which arguments.
//!
//! The answer never waits on the record: events go through a bounded queue to one publisher,
//! and when the queue is full the event is dropped and counted (the log line is written
//! anyway). Whether an exec may proceed while the webhook is down is the webhook
//! configuration's `failurePolicy` (the chart's `access.audit.failurePolicy`, Ignore by
//! default).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::Value;
use tokio::sync::mpsc;

use spur_operator_core::Metrics;

/// Events waiting to be published; beyond this, new ones are dropped and counted.
const QUEUE: usize = 1024;
/// Longest command text kept in an event note (Events refuse notes above 1 KiB).
const NOTE_MAX: usize = 900;

/// One connection to a pod, as the admission request describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connect {
    pub uid: String,
    pub user: String,
    pub groups: Vec<String>,
    pub namespace: String,
    pub pod: String,
    /// `exec`, `attach` or `portforward`.
    pub subresource: String,
    pub container: Option<String>,
    pub command: Vec<String>,
    pub tty: bool,
    pub stdin: bool,
    pub ports: Vec<i64>,
}

impl Connect {
    /// Reads the request of an AdmissionReview (as JSON: the options objects carry no
    /// metadata, so the typed readers do not apply).
    pub fn from_review(review: &Value) -> Result<Connect, String> {
        let req = review
            .get("request")
            .ok_or("the AdmissionReview has no request")?;
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
        let uid = text(req.get("uid")).ok_or("request.uid is missing")?;
        let user = req.get("userInfo");
        let object = req.get("object");
        let field = |k: &str| object.and_then(|o| o.get(k));
        Ok(Connect {
            uid,
            user: text(user.and_then(|u| u.get("username"))).unwrap_or_default(),
            groups: user
                .and_then(|u| u.get("groups"))
                .and_then(Value::as_array)
                .map(|g| {
                    g.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            namespace: text(req.get("namespace")).unwrap_or_default(),
            pod: text(req.get("name")).unwrap_or_default(),
            subresource: text(req.get("subResource")).unwrap_or_default(),
            container: text(field("container")),
            command: redact(
                &field("command")
                    .and_then(Value::as_array)
                    .map(|c| {
                        c.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default(),
            ),
            tty: field("tty").and_then(Value::as_bool).unwrap_or(false),
            stdin: field("stdin").and_then(Value::as_bool).unwrap_or(false),
            ports: field("ports")
                .and_then(Value::as_array)
                .map(|p| p.iter().filter_map(Value::as_i64).collect())
                .unwrap_or_default(),
        })
    }

    /// The event's reason: `Exec`, `Attach` or `PortForward`.
    pub fn reason(&self) -> &'static str {
        match self.subresource.as_str() {
            "exec" => "Exec",
            "attach" => "Attach",
            "portforward" => "PortForward",
            _ => "Connect",
        }
    }

    /// The event's note, for people.
    pub fn note(&self) -> String {
        let container = self.container.as_deref().unwrap_or("(default)");
        let mut note = match self.subresource.as_str() {
            "exec" => format!(
                "exec by {} into container {container}: {} (tty: {})",
                self.user,
                shell_words(&self.command),
                self.tty
            ),
            "attach" => format!(
                "attach by {} to container {container} (tty: {}, stdin: {})",
                self.user, self.tty, self.stdin
            ),
            "portforward" => format!("port-forward by {} to ports {:?}", self.user, self.ports),
            other => format!("{other} by {}", self.user),
        };
        if note.len() > NOTE_MAX {
            let mut cut = NOTE_MAX;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
            note.push_str(" …");
        }
        note
    }

    /// Writes the `spur_audit` log line.
    pub fn log(&self) {
        tracing::info!(
            target: "spur_audit",
            user = %self.user,
            groups = ?self.groups,
            namespace = %self.namespace,
            pod = %self.pod,
            action = %self.subresource,
            container = self.container.as_deref().unwrap_or(""),
            command = ?self.command,
            tty = self.tty,
            stdin = self.stdin,
            ports = ?self.ports,
            "pod connect"
        );
    }
}

/// Words that mark what follows them as a credential.
const SENSITIVE: [&str; 7] = [
    "token", "password", "passwd", "secret", "apikey", "api-key", "api_key",
];

fn is_sensitive_key(key: &str) -> bool {
    let k = key.trim_start_matches('-').to_ascii_lowercase();
    SENSITIVE.iter().any(|s| k.contains(s))
}

/// The command with credentials replaced by `<redacted>` (see the module docs).
pub fn redact(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut next_is_secret = false;
    for arg in args {
        if next_is_secret {
            out.push("<redacted>".to_owned());
            next_is_secret = false;
            continue;
        }
        if arg.starts_with('-') && !arg.contains('=') && is_sensitive_key(arg) {
            next_is_secret = true;
        }
        out.push(redact_text(arg));
    }
    out
}

/// Redacts credentials inside one argument (which may be a whole shell script).
fn redact_text(text: &str) -> String {
    let is_word = |c: char| c.is_ascii_alphanumeric() || "-_.+/=".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut after_scheme = false;
    let mut rest = text;
    while !rest.is_empty() {
        let start = rest.find(is_word).unwrap_or(rest.len());
        let (gap, tail) = rest.split_at(start);
        out.push_str(gap);
        // Only blanks may stand between `Bearer` and its value.
        if !gap.chars().all(|c| c == ' ' || c == '\t') {
            after_scheme = false;
        }
        let end = tail.find(|c: char| !is_word(c)).unwrap_or(tail.len());
        let (word, next) = tail.split_at(end);
        rest = next;
        if word.is_empty() {
            continue;
        }
        let lower = word.to_ascii_lowercase();
        if after_scheme || looks_like_credential(word) {
            out.push_str("<redacted>");
        } else if let Some((key, value)) = word.split_once('=')
            && !value.is_empty()
            && is_sensitive_key(key)
        {
            out.push_str(key);
            out.push_str("=<redacted>");
        } else {
            out.push_str(word);
        }
        after_scheme = lower == "bearer" || lower == "basic";
    }
    out
}

/// A JWT, or a long run of hex or base64 with both letters and digits (a key or token).
fn looks_like_credential(word: &str) -> bool {
    let word = word.trim_end_matches('=');
    if word.starts_with("eyJ") && word.matches('.').count() >= 2 {
        return true;
    }
    word.len() >= 32
        && !word.contains('/')
        && word.chars().any(|c| c.is_ascii_digit())
        && word.chars().any(|c| c.is_ascii_alphabetic())
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_+".contains(c))
}

/// The command as one would type it: arguments with spaces or quotes are quoted.
fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Hands events to the publisher task without waiting.
#[derive(Clone)]
pub(crate) struct Auditor {
    queue: mpsc::Sender<Connect>,
    metrics: Metrics,
}

impl Auditor {
    /// Starts the publisher; it ends when every sender is gone.
    pub(crate) fn start(client: Client, metrics: Metrics) -> Auditor {
        let (queue, mut rx) = mpsc::channel::<Connect>(QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "spur-audit".into(),
                instance: std::env::var("HOSTNAME").ok(),
            },
        );
        let m = metrics.clone();
        tokio::spawn(async move {
            while let Some(c) = rx.recv().await {
                let reference = ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(c.pod.clone()),
                    namespace: Some(c.namespace.clone()),
                    ..ObjectReference::default()
                };
                let ev = Event {
                    type_: EventType::Normal,
                    reason: c.reason().into(),
                    note: Some(c.note()),
                    action: "Connect".into(),
                    secondary: None,
                };
                match recorder.publish(&ev, &reference).await {
                    Ok(()) => m.audit("recorded"),
                    Err(e) => {
                        m.audit("event_failed");
                        tracing::warn!(namespace = %c.namespace, pod = %c.pod, error = %e, "cannot record the audit event (the log line was written)");
                    }
                }
            }
        });
        Auditor { queue, metrics }
    }

    /// Logs `c` now and queues its event.
    pub(crate) fn record(&self, c: Connect) {
        c.log();
        if self.queue.try_send(c).is_err() {
            self.metrics.audit("event_dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn credentials_on_a_command_line_are_redacted() {
        let jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlLXNpZ25hdHVyZQ";
        let hex = "3f9a1c0e5b7d2a4f6e8c0b1d3f5a7c9e1b3d5f7a9c0e2b4d6f8a0c2e4b6d8f0a";
        let script =
            format!("curl -H 'Authorization: Bearer {jwt}' https://x/api; echo {hex} > /tmp/t");
        let args: Vec<String> = [
            "sh",
            "-c",
            script.as_str(),
            "--token",
            "short-one",
            "--password=hunter2",
            "API_KEY=abc",
            "cat",
            "/etc/os-release",
            "ls",
            "-la",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let r = redact(&args);
        let all = r.join(" ");
        for secret in [jwt, hex, "short-one", "hunter2", "abc"] {
            assert!(!all.contains(secret), "{secret} in {all}");
        }
        assert_eq!(
            r[2],
            "curl -H 'Authorization: Bearer <redacted>' https://x/api; echo <redacted> > /tmp/t"
        );
        assert_eq!(
            &r[3..],
            [
                "--token",
                "<redacted>",
                "--password=<redacted>",
                "API_KEY=<redacted>",
                "cat",
                "/etc/os-release",
                "ls",
                "-la"
            ]
        );
        assert_eq!(
            redact_text("Authorization: Bearer abc"),
            "Authorization: Bearer <redacted>"
        );
        assert_eq!(redact_text("spur --version"), "spur --version");
    }

    #[test]
    fn an_exec_review_is_read_and_described() {
        let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "operation": "CONNECT", "name": "web-1", "namespace": "shop",
                "subResource": "exec",
                "userInfo": {"username": "alice", "groups": ["dev", "system:authenticated"]},
                "object": {"kind": "PodExecOptions", "apiVersion": "v1", "container": "app",
                    "command": ["sh", "-c", "echo it's me"], "tty": true, "stdin": true}}});
        let c = Connect::from_review(&review).unwrap();
        assert_eq!(c.user, "alice");
        assert_eq!(c.pod, "web-1");
        assert_eq!(c.reason(), "Exec");
        assert_eq!(
            c.note(),
            "exec by alice into container app: sh -c 'echo it'\\''s me' (tty: true)"
        );
        let long = Connect {
            command: vec!["x".repeat(5000)],
            ..c
        };
        assert!(long.note().len() < 1024);
        assert!(Connect::from_review(&json!({})).is_err());
        let pf = Connect::from_review(
            &json!({"request": {"uid": "u", "subResource": "portforward",
            "object": {"kind": "PodPortForwardOptions", "ports": [8080]}}}),
        )
        .unwrap();
        assert_eq!(pf.reason(), "PortForward");
        assert_eq!(pf.ports, vec![8080]);
    }
}
