//! Prometheus metrics, with the names sig-storage-lib-external-provisioner
//! uses so existing dashboards work, plus the duration of every Ceph call.

use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of the per-class metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// The StorageClass name.
    pub class: String,
}

/// Labels of the per-cluster metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    /// The clusterID.
    pub cluster: String,
}

/// Labels of the Ceph call durations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    /// The operation, such as `create` or `remove`.
    pub operation: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn op_histogram() -> Histogram {
    // 1 ms to ~16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

fn long_histogram() -> Histogram {
    // 10 ms to ~5.5 min: provisioning includes waiting on the API server.
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}

/// All the provisioner's metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    provision_total: Family<ClassLabels, Counter>,
    provision_failed_total: Family<ClassLabels, Counter>,
    provision_duration: HistogramFamily<ClassLabels>,
    delete_total: Family<ClassLabels, Counter>,
    delete_failed_total: Family<ClassLabels, Counter>,
    delete_duration: HistogramFamily<ClassLabels>,
    resize_total: Family<ClassLabels, Counter>,
    resize_failed_total: Family<ClassLabels, Counter>,
    ceph_op_duration: HistogramFamily<OpLabels>,
    ceph_connections: Gauge,
    cluster_reachable: Family<ClusterLabels, Gauge>,
    leader: Gauge,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            provision_total: Family::default(),
            provision_failed_total: Family::default(),
            provision_duration: Family::new_with_constructor(long_histogram),
            delete_total: Family::default(),
            delete_failed_total: Family::default(),
            delete_duration: Family::new_with_constructor(long_histogram),
            resize_total: Family::default(),
            resize_failed_total: Family::default(),
            ceph_op_duration: Family::new_with_constructor(op_histogram),
            ceph_connections: Gauge::default(),
            cluster_reachable: Family::default(),
            leader: Gauge::default(),
        };
        // Counters get their `_total` suffix from the encoder.
        registry.register(
            "controller_persistentvolumeclaim_provision",
            "Number of persistent volume provision requests",
            m.provision_total.clone(),
        );
        registry.register(
            "controller_persistentvolumeclaim_provision_failed",
            "Number of persistent volume provision failed attempts",
            m.provision_failed_total.clone(),
        );
        registry.register(
            "controller_persistentvolumeclaim_provision_duration_seconds",
            "Latency in seconds to provision persistent volumes",
            m.provision_duration.clone(),
        );
        registry.register(
            "controller_persistentvolume_delete",
            "Number of persistent volume delete requests",
            m.delete_total.clone(),
        );
        registry.register(
            "controller_persistentvolume_delete_failed",
            "Number of persistent volume delete failed attempts",
            m.delete_failed_total.clone(),
        );
        registry.register(
            "controller_persistentvolume_delete_duration_seconds",
            "Latency in seconds to delete persistent volumes",
            m.delete_duration.clone(),
        );
        registry.register(
            "rbdkit_volume_resize",
            "Number of volume expansions done",
            m.resize_total.clone(),
        );
        registry.register(
            "rbdkit_volume_resize_failed",
            "Number of volume expansion failed attempts",
            m.resize_failed_total.clone(),
        );
        registry.register(
            "rbdkit_ceph_op_duration_seconds",
            "Duration of Ceph calls made by the provisioner, by operation",
            m.ceph_op_duration.clone(),
        );
        registry.register(
            "rbdkit_ceph_connections",
            "Open Ceph connections, one per cluster and user",
            m.ceph_connections.clone(),
        );
        registry.register(
            "rbdkit_cluster_reachable",
            "1 while some monitor of the Ceph cluster answers, 0 while none does",
            m.cluster_reachable.clone(),
        );
        registry.register(
            "rbdkit_leader",
            "1 while this replica holds the leader lease",
            m.leader.clone(),
        );
        m
    }

    fn class(class: &str) -> ClassLabels {
        ClassLabels {
            class: class.to_owned(),
        }
    }

    /// A provisioning succeeded after `took` (from the first attempt).
    pub fn provisioned(&self, class: &str, took: Duration) {
        self.provision_total
            .get_or_create(&Self::class(class))
            .inc();
        self.provision_duration
            .get_or_create(&Self::class(class))
            .observe(took.as_secs_f64());
    }

    /// A provisioning attempt failed.
    pub fn provision_failed(&self, class: &str) {
        self.provision_failed_total
            .get_or_create(&Self::class(class))
            .inc();
    }

    /// A delete succeeded after `took`.
    pub fn deleted(&self, class: &str, took: Duration) {
        self.delete_total.get_or_create(&Self::class(class)).inc();
        self.delete_duration
            .get_or_create(&Self::class(class))
            .observe(took.as_secs_f64());
    }

    /// A delete attempt failed.
    pub fn delete_failed(&self, class: &str) {
        self.delete_failed_total
            .get_or_create(&Self::class(class))
            .inc();
    }

    /// An expansion succeeded.
    pub fn resized(&self, class: &str) {
        self.resize_total.get_or_create(&Self::class(class)).inc();
    }

    /// An expansion attempt failed.
    pub fn resize_failed(&self, class: &str) {
        self.resize_failed_total
            .get_or_create(&Self::class(class))
            .inc();
    }

    /// Records how long a Ceph call took.
    pub fn ceph_op(&self, operation: &str, started: Instant) {
        self.ceph_op_duration
            .get_or_create(&OpLabels {
                operation: operation.to_owned(),
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// Sets the number of open Ceph connections.
    pub fn set_connections(&self, n: usize) {
        self.ceph_connections.set(n as i64);
    }

    /// Sets whether the Ceph cluster `cluster` is reachable.
    pub fn set_cluster_reachable(&self, cluster: &str, reachable: bool) {
        self.cluster_reachable
            .get_or_create(&ClusterLabels {
                cluster: cluster.to_owned(),
            })
            .set(i64::from(reachable));
    }

    /// Sets whether this replica leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }
}

impl crate::volume::CephObserver for Metrics {
    fn ceph_op(&self, op: &str, started: Instant) {
        Metrics::ceph_op(self, op, started);
    }
    fn set_connections(&self, n: usize) {
        Metrics::set_connections(self, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_the_go_library_names() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.provisioned("fast", Duration::from_millis(300));
        m.provision_failed("fast");
        m.deleted("fast", Duration::from_millis(30));
        m.delete_failed("fast");
        m.ceph_op("create", Instant::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for name in [
            "controller_persistentvolumeclaim_provision_total{class=\"fast\"} 1",
            "controller_persistentvolumeclaim_provision_failed_total{class=\"fast\"} 1",
            "controller_persistentvolumeclaim_provision_duration_seconds_count{class=\"fast\"} 1",
            "controller_persistentvolume_delete_total{class=\"fast\"} 1",
            "controller_persistentvolume_delete_failed_total{class=\"fast\"} 1",
            "controller_persistentvolume_delete_duration_seconds_count{class=\"fast\"} 1",
            "rbdkit_ceph_op_duration_seconds_count{operation=\"create\"} 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}
