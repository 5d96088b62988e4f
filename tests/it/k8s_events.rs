//! `rbdkit::k8s::events` against the real API server of the test control
//! plane: a repeat of an event joins the first one's series (one Event
//! object, its count raised), and another reason or object gets its own.
use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::json;

use rbdkit::k8s::events::Events;
use support::ceph::unique;
use support::k8s::ControlPlane;
use support::provisioner::from_json;

/// The events in `ns` once there are `want` of them whose series counts
/// add up to `total` (events are sent from a task of their own).
async fn events_settled(api: &Api<Event>, want: usize, total: i32) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = api.list(&ListParams::default()).await.unwrap().items;
        let sum: i32 = list
            .iter()
            .map(|e| e.series.as_ref().map_or(1, |s| s.count))
            .sum();
        if list.len() == want && sum == total {
            return list;
        }
        assert!(
            Instant::now() < deadline,
            "want {want} events adding up to {total}, have {list:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn repeats_join_one_series_per_object_and_reason() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let ns = unique("rbdkit-events");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &from_json(json!({ "metadata": { "name": ns } })),
        )
        .await
        .unwrap();
    let claim = |name: &str| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some(ns.clone()),
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        ..ObjectReference::default()
    };
    let events = Events::new(client.clone(), "events.rbdkit.test", "test-1");
    let api: Api<Event> = Api::namespaced(client.clone(), &ns);

    events
        .warning(&claim("a"), "ProvisioningFailed", "first try")
        .await;
    let first = events_settled(&api, 1, 1).await;
    assert!(first[0].series.is_none());
    for i in 2..=4 {
        events
            .warning(&claim("a"), "ProvisioningFailed", &format!("try {i}"))
            .await;
        events_settled(&api, 1, i).await;
    }
    events
        .normal(&claim("a"), "Provisioning", "another reason")
        .await;
    events
        .warning(&claim("b"), "ProvisioningFailed", "another object")
        .await;
    let all = events_settled(&api, 3, 6).await;
    let series = all
        .iter()
        .find(|e| e.series.is_some())
        .expect("one event has a series");
    assert_eq!(series.metadata.name, first[0].metadata.name);
    assert_eq!(series.series.as_ref().unwrap().count, 4);
    assert_eq!(series.reason.as_deref(), Some("ProvisioningFailed"));
    assert_eq!(
        series.regarding.as_ref().unwrap().name.as_deref(),
        Some("a")
    );
    assert_eq!(series.type_.as_deref(), Some("Warning"));
    assert_eq!(
        series.reporting_controller.as_deref(),
        Some("events.rbdkit.test")
    );
    assert_eq!(series.reporting_instance.as_deref(), Some("test-1"));
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
}
