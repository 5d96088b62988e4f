//! The HTTP endpoints for the kubelet and Prometheus: `/healthz` (the process
//! serves requests), `/readyz` (the caches have synced and this replica holds
//! the lease; still 200 but `degraded: …` naming them while some Ceph
//! clusters are unreachable or their operations time out) and `/metrics` (the Prometheus text format).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;

/// What the endpoints report. Cheap to clone; all clones share state.
#[derive(Clone, Default)]
pub struct Health {
    leader: Arc<AtomicBool>,
    synced: Arc<AtomicBool>,
    unreachable: Arc<std::sync::Mutex<BTreeSet<String>>>,
    timing_out: Arc<std::sync::Mutex<BTreeSet<String>>>,
    registry: Arc<std::sync::Mutex<Registry>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("leader", &self.is_leader())
            .field("synced", &self.is_synced())
            .finish()
    }
}

impl Health {
    /// State serving the metrics of `registry`.
    pub fn new(registry: Registry) -> Health {
        Health {
            leader: Arc::default(),
            synced: Arc::default(),
            unreachable: Arc::default(),
            timing_out: Arc::default(),
            registry: Arc::new(std::sync::Mutex::new(registry)),
        }
    }

    /// Records whether this replica holds the lease.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::SeqCst);
    }

    /// Records whether the controllers' caches have synced.
    pub fn set_synced(&self, synced: bool) {
        self.synced.store(synced, Ordering::SeqCst);
    }

    /// Records whether the Ceph cluster `cluster_id` is reachable.
    pub fn set_cluster_reachable(&self, cluster_id: &str, reachable: bool) {
        let mut set = self.unreachable.lock().unwrap_or_else(|e| e.into_inner());
        if reachable {
            set.remove(cluster_id);
        } else {
            set.insert(cluster_id.to_owned());
        }
    }

    /// Records whether operations on the Ceph cluster `cluster_id` time out
    /// (set by a timed-out call, cleared by the next one answered).
    pub fn set_cluster_ops_timing_out(&self, cluster_id: &str, timing_out: bool) {
        let mut set = self.timing_out.lock().unwrap_or_else(|e| e.into_inner());
        if timing_out {
            if set.insert(cluster_id.to_owned()) {
                tracing::warn!(cluster = %cluster_id, "Ceph operations time out; /readyz reports the cluster degraded");
            }
        } else if set.remove(cluster_id) {
            tracing::info!(cluster = %cluster_id, "Ceph operations answered again");
        }
    }

    /// The Ceph clusters whose last operation timed out, sorted.
    pub fn timing_out_clusters(&self) -> Vec<String> {
        self.timing_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The Ceph clusters currently unreachable, sorted.
    pub fn unreachable_clusters(&self) -> Vec<String> {
        self.unreachable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Whether this replica holds the lease.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    /// Whether the caches have synced.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Ready means: caches synced and lease held.
    pub fn is_ready(&self) -> bool {
        self.is_leader() && self.is_synced()
    }

    /// The metrics in the Prometheus text format.
    pub fn encode_metrics(&self) -> String {
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        crate::telemetry::encode_metrics(&registry)
    }

    /// The router with the three endpoints.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics))
            .with_state(self.clone())
    }

    /// Serves the endpoints on `addr` until `shutdown` resolves. Returns the
    /// address actually bound (port 0 picks a free one) once listening, and
    /// the server task.
    pub async fn serve(
        &self,
        addr: SocketAddr,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
        crate::telemetry::serve_http(addr, self.router(), shutdown).await
    }
}

async fn readyz(State(h): State<Health>) -> impl IntoResponse {
    match (h.is_leader(), h.is_synced()) {
        (true, true) => {
            // Still ready: the other clusters are served.
            let down = h.unreachable_clusters();
            let slow = h.timing_out_clusters();
            let mut why = Vec::new();
            if !down.is_empty() {
                why.push(format!("Ceph cluster(s) unreachable: {}", down.join(", ")));
            }
            if !slow.is_empty() {
                why.push(format!(
                    "Ceph operations timing out on cluster(s): {}",
                    slow.join(", ")
                ));
            }
            if why.is_empty() {
                (StatusCode::OK, "ok".to_owned())
            } else {
                (StatusCode::OK, format!("degraded: {}", why.join("; ")))
            }
        }
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not the leader".to_owned()),
        (true, false) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "caches not synced".to_owned(),
        ),
    }
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    crate::telemetry::metrics_response(h.encode_metrics())
}
