//! The exec audit trail (docs/access.md, "Audit"): the API server asks the webhook
//! `connect-audit.spur.dev` about every `CONNECT` to `pods/exec`, `pods/attach` and
//! `pods/portforward`; each is recorded as a `spur_audit` log line (user, pod, container,
//! command, tty) and an Event on the pod, and always allowed.
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

use crate::Metrics;

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
            command: field("command")
                .and_then(Value::as_array)
                .map(|c| {
                    c.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
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
