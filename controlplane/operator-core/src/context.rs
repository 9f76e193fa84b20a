//! What every reconciler shares: the client, the field manager, the event recorder, metrics and
//! the per-object failure counts behind the error policy's backoff (kept by the controller
//! kit, `spur_controller`).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};

use crate::Error;

/// Field manager of every server-side apply the operator makes (spec and status alike: nothing
/// else writes the fields it owns).
pub const FIELD_MANAGER: &str = "spur-operator";

/// How the operator applies the children it owns (stamped with [`DESIRED`]).
///
/// [`DESIRED`]: spur_api::keys::annotations::DESIRED
pub const OWNER: spur_controller::Owner = spur_controller::Owner {
    field_manager: FIELD_MANAGER,
    stamp: spur_api::keys::annotations::DESIRED,
};

/// The shared part of every controller's context; a feature's own configuration travels
/// beside it (the operator crate's `Context` holds both).
pub struct Context {
    pub client: Client,
    recorder: Recorder,
    /// Per-object failure counts: counted by the error policies ([`Context::retry`]), reset
    /// by `spur_controller::run` when a pass succeeds.
    backoff: spur_controller::Backoff,
    pub metrics: crate::Metrics,
    /// Every status write of the operator's controllers (skipping unchanged ones).
    pub status: spur_controller::StatusWriter,
}

impl Context {
    pub fn new(client: Client, instance: Option<String>, metrics: crate::Metrics) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance,
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            backoff: spur_controller::Backoff::default(),
            metrics,
            status: spur_controller::StatusWriter::new(FIELD_MANAGER),
        }
    }

    /// Publishes an event about `obj`; a failure to publish is logged, never fatal.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(fit_note(note)),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::debug!(error = %e, "cannot publish event");
        }
    }

    /// Exponential per-object backoff: 1 s, 2 s, 4 s … capped at 5 min; reset by a success.
    pub fn retry<K: Resource<DynamicType = ()>>(&self, obj: &K, err: &Error) -> Action {
        Action::requeue(self.retry_delay(obj, err))
    }

    /// The delay [`Context::retry`] would requeue after (counting the failure), for error
    /// policies that cap it.
    pub fn retry_delay<K: Resource<DynamicType = ()>>(&self, obj: &K, err: &Error) -> Duration {
        let delay = self.backoff.failed(obj, err);
        self.metrics.failure();
        delay
    }
}

/// Most bytes of an Event's note (events.k8s.io/v1 refuses a longer one, and the Event would
/// be lost).
const NOTE_MAX: usize = 1024;

/// `note`, cut at a character boundary with an ellipsis when it is longer than [`NOTE_MAX`].
fn fit_note(mut note: String) -> String {
    if note.len() <= NOTE_MAX {
        return note;
    }
    const MORE: &str = " …";
    let mut end = NOTE_MAX - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push_str(MORE);
    note
}

impl spur_controller::HasBackoff for Context {
    fn backoff(&self) -> &spur_controller::Backoff {
        &self.backoff
    }
}

/// Deletes `name` with background propagation. One that is already gone is not an error: a
/// reconcile working from a cache a moment old, or a delete that raced another, wanted exactly
/// that, and failing would only back the object off for nothing.
pub async fn delete_opt<K>(api: &kube::Api<K>, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    match api
        .delete(name, &kube::api::DeleteParams::background())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_note_is_cut_to_what_the_api_takes() {
        assert_eq!(fit_note("short".into()), "short");
        let long = "é".repeat(NOTE_MAX);
        let cut = fit_note(long);
        assert!(
            cut.len() <= NOTE_MAX && cut.ends_with(" …"),
            "{}",
            cut.len()
        );
        assert!(cut.starts_with("éé"));
        let exact = "x".repeat(NOTE_MAX);
        assert_eq!(fit_note(exact.clone()), exact);
    }
}
