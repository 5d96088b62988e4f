//! Publishing Kubernetes events about the objects the provisioner handles.
//!
//! A thin layer over kube-runtime's [`Recorder`]: notes are cut to the 1 kB
//! the API allows, and a failure to publish is logged, never returned, since
//! an event is a report and must not fail the work it reports on. Events are
//! sent from a task of their own, so the work does not wait for them.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// The longest note the events API accepts.
const MAX_NOTE: usize = 1000;

/// Publishes events as one controller (and instance).
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Events")
    }
}

impl Events {
    /// A publisher reporting as `controller` (the provisioner name) from
    /// `instance` (this process).
    pub fn new(client: kube::Client, controller: &str, instance: &str) -> Events {
        Events {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: controller.to_owned(),
                    instance: Some(instance.to_owned()),
                },
            ),
        }
    }

    /// A `Normal` event.
    pub async fn normal(&self, regarding: &ObjectReference, reason: &str, note: &str) {
        self.publish(regarding, EventType::Normal, reason, note)
            .await
    }

    /// A `Warning` event.
    pub async fn warning(&self, regarding: &ObjectReference, reason: &str, note: &str) {
        self.publish(regarding, EventType::Warning, reason, note)
            .await
    }

    async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(clip(note)),
            action: reason.to_owned(),
            secondary: None,
        };
        // An event is a write: inside a reconcile it takes the reconcile's
        // token, so failing reconciles that only report are paced too.
        crate::k8s::backoff::before_work().await;
        // Sent beside the work rather than in its path: two events per
        // provisioning were two API round trips of its latency, and nothing
        // waits for an event. Each send is bounded by the client's timeouts.
        let recorder = self.recorder.clone();
        let regarding = regarding.clone();
        let reason = reason.to_owned();
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::warn!(
                    reason,
                    object = regarding.name.as_deref().unwrap_or(""),
                    error = %e,
                    "cannot publish event"
                );
            }
        });
    }
}

/// One line of at most 1000 bytes (the API limit), cut on a character
/// boundary.
pub fn clip(note: &str) -> String {
    let one_line = note.replace(['\n', '\r'], " ");
    if one_line.len() <= MAX_NOTE {
        return one_line;
    }
    let mut end = MAX_NOTE - 3;
    while !one_line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &one_line[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clips_long_and_multi_line_notes() {
        assert_eq!(clip("a\nb"), "a b");
        let long = "é".repeat(800);
        let c = clip(&long);
        assert!(c.len() <= MAX_NOTE && c.ends_with("..."));
    }
}
