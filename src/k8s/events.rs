//! Publishing Kubernetes events about the objects the provisioner handles.
//!
//! Notes are cut to the 1 kB the API allows, and a failure to publish is
//! logged, never returned, since an event is a report and must not fail the
//! work it reports on. Events are sent from a task of their own, so the work
//! does not wait for them.
//!
//! A repeat of an event (same object, type, reason and action) within
//! [`SERIES_WINDOW`] adds to the first one's series instead of creating
//! another object, as kube-runtime's `Recorder` does. Unlike the `Recorder`,
//! which keeps a copy of every event it sent in that window (at 1000
//! claims, megabytes of the provisioner's peak), only each event's name and
//! count are kept, and at most [`MAX_SERIES`] of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

/// The longest note the events API accepts.
const MAX_NOTE: usize = 1000;

/// How long a repeat joins the first event's series (kube-runtime's value).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// Most series remembered; past it the oldest half is forgotten (their
/// repeats start new events).
pub const MAX_SERIES: usize = 4096;

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    Warning,
}

/// An event sent recently: what a repeat needs to join its series.
#[derive(Debug)]
struct Sent {
    name: String,
    count: i32,
    last: Instant,
}

/// Publishes events as one controller (and instance).
#[derive(Clone)]
pub struct Events {
    client: kube::Client,
    controller: String,
    instance: String,
    sent: Arc<Mutex<SeriesCache>>,
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
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            sent: Arc::default(),
        }
    }

    /// A `Normal` event.
    pub async fn normal(&self, regarding: &ObjectReference, reason: &str, note: &str) {
        self.publish(regarding, Kind::Normal, reason, note).await
    }

    /// A `Warning` event.
    pub async fn warning(&self, regarding: &ObjectReference, reason: &str, note: &str) {
        self.publish(regarding, Kind::Warning, reason, note).await
    }

    async fn publish(&self, regarding: &ObjectReference, kind: Kind, reason: &str, note: &str) {
        // An event is a write: inside a reconcile it takes the reconcile's
        // token, so failing reconciles that only report are paced too.
        crate::k8s::backoff::before_work().await;
        // Sent beside the work rather than in its path: two events per
        // provisioning were two API round trips of its latency, and nothing
        // waits for an event. Each send is bounded by the client's timeouts.
        let me = self.clone();
        let regarding = regarding.clone();
        let reason = reason.to_owned();
        let note = clip(note);
        tokio::spawn(async move {
            if let Err(e) = me.send(&regarding, kind, &reason, note).await {
                tracing::warn!(
                    reason,
                    object = regarding.name.as_deref().unwrap_or(""),
                    error = %e,
                    "cannot publish event"
                );
            }
        });
    }

    async fn send(
        &self,
        regarding: &ObjectReference,
        kind: Kind,
        reason: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        // A cluster-scoped object's events go to "default", as kubectl
        // describe looks for them there.
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let key = series_key(regarding, kind, reason);
        let repeat = self.note_repeat(&key);
        if let Some((name, count)) = repeat {
            let patch = serde_json::json!({"series": EventSeries {
                count,
                last_observed_time: MicroTime(Timestamp::now()),
            }});
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                // Gone (events expire): start a new one.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let now = Timestamp::now();
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or(&self.controller),
            now.as_nanosecond()
        );
        let event = K8sEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            action: Some(reason.to_owned()),
            reason: Some(reason.to_owned()),
            note: Some(note),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(
                match kind {
                    Kind::Normal => "Normal",
                    Kind::Warning => "Warning",
                }
                .to_owned(),
            ),
            ..K8sEvent::default()
        };
        api.create(&PostParams::default(), &event).await?;
        self.remember(key, name);
        Ok(())
    }

    fn note_repeat(&self, key: &str) -> Option<(String, i32)> {
        self.sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .repeat(key, Instant::now())
    }

    fn remember(&self, key: String, name: String) {
        self.sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, name, Instant::now());
    }
}

/// The events sent within the window, keyed by [`series_key`].
#[derive(Debug, Default)]
struct SeriesCache {
    sent: HashMap<String, Sent>,
}

impl SeriesCache {
    /// For an event sent within the window before `now`: its name and its
    /// new count.
    fn repeat(&mut self, key: &str, now: Instant) -> Option<(String, i32)> {
        let s = self
            .sent
            .get_mut(key)
            .filter(|s| now.saturating_duration_since(s.last) < SERIES_WINDOW)?;
        s.count = s.count.saturating_add(1);
        s.last = now;
        Some((s.name.clone(), s.count))
    }

    fn insert(&mut self, key: String, name: String, now: Instant) {
        if self.sent.len() >= MAX_SERIES {
            self.sent
                .retain(|_, s| now.saturating_duration_since(s.last) < SERIES_WINDOW);
        }
        if self.sent.len() >= MAX_SERIES {
            let mut ages: Vec<Instant> = self.sent.values().map(|s| s.last).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.sent.retain(|_, s| s.last > cut);
        }
        self.sent.insert(
            key,
            Sent {
                name,
                count: 1,
                last: now,
            },
        );
    }
}

/// What makes two events one series: the object, the type, the reason and
/// the action (which is the reason here). The note is not part of it, as
/// in kube-runtime's `Recorder`.
fn series_key(regarding: &ObjectReference, kind: Kind, reason: &str) -> String {
    let field = |f: &Option<String>| f.clone().unwrap_or_default();
    [
        format!("{kind:?}"),
        reason.to_owned(),
        field(&regarding.api_version),
        field(&regarding.kind),
        field(&regarding.namespace),
        field(&regarding.name),
        field(&regarding.uid),
    ]
    .join("\0")
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

    #[test]
    fn repeats_join_a_series_within_the_window_only() {
        let mut c = SeriesCache::default();
        let t0 = Instant::now();
        assert_eq!(c.repeat("k", t0), None);
        c.insert("k".into(), "ev.1".into(), t0);
        assert_eq!(
            c.repeat("k", t0 + Duration::from_secs(1)),
            Some(("ev.1".into(), 2))
        );
        assert_eq!(
            c.repeat("k", t0 + Duration::from_secs(2)),
            Some(("ev.1".into(), 3))
        );
        assert_eq!(
            c.repeat("k", t0 + Duration::from_secs(2) + SERIES_WINDOW),
            None
        );
    }

    #[test]
    fn remembers_at_most_max_series() {
        let mut c = SeriesCache::default();
        let t0 = Instant::now();
        for i in 0..3 * MAX_SERIES {
            c.insert(
                format!("k{i}"),
                format!("ev.{i}"),
                t0 + Duration::from_millis(i as u64),
            );
            assert!(c.sent.len() <= MAX_SERIES);
        }
        // The newest are kept.
        let last = 3 * MAX_SERIES - 1;
        assert!(c
            .repeat(&format!("k{last}"), t0 + Duration::from_secs(60))
            .is_some());
        assert_eq!(c.repeat("k0", t0 + Duration::from_secs(60)), None);
    }

    #[test]
    fn the_series_key_tells_objects_and_reasons_apart() {
        let pv = |name: &str| ObjectReference {
            kind: Some("PersistentVolume".into()),
            name: Some(name.into()),
            ..ObjectReference::default()
        };
        let a = series_key(&pv("a"), Kind::Warning, "VolumeFailedDelete");
        assert_eq!(a, series_key(&pv("a"), Kind::Warning, "VolumeFailedDelete"));
        assert_ne!(a, series_key(&pv("b"), Kind::Warning, "VolumeFailedDelete"));
        assert_ne!(a, series_key(&pv("a"), Kind::Normal, "VolumeFailedDelete"));
        assert_ne!(a, series_key(&pv("a"), Kind::Warning, "VolumeResizeFailed"));
    }
}
