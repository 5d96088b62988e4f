//! `rbdkit csi`'s HTTP side (`--http-addr`): `/healthz` (the gRPC server
//! answers on its socket), `/readyz` (its Probe says ready) and `/metrics`
//! (per-RPC counts, errors and latencies, Ceph call latencies, staged
//! volumes per mapper).
//!
//! Both probes go through the CSI socket itself, as kubelet and the
//! sidecars do, so a server whose gRPC side is stuck is not reported
//! healthy by a live HTTP side. Labels are RPC method names, gRPC codes,
//! Ceph operation names and mapper names: never a volume, a secret or
//! anything from a request's fields.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tonic::codegen::http;

use crate::csi::proto::identity_client::IdentityClient;
use crate::csi::proto::{GetPluginInfoRequest, ProbeRequest};

/// Labels of an RPC's count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// The CSI service (`Identity`, `Controller`, `GroupController`, `Node`).
    pub service: String,
    /// The method (`CreateVolume`).
    pub method: String,
    /// The gRPC status code (`OK`, `NotFound`, ...).
    pub code: String,
}

/// Labels of an RPC's latency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// The CSI service.
    pub service: String,
    /// The method.
    pub method: String,
}

/// Labels of a Ceph call's latency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    /// The operation (`open`, `metadata_set`, ...).
    pub operation: String,
}

/// Labels of the staged-volume count.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapperLabels {
    /// The mapper (`krbd`, `rbdkit-fuse`).
    pub mapper: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn rpc_histogram() -> Histogram {
    // 1 ms to ~65 s: a NodeStage maps, formats and mounts.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The CSI server's metrics. Cheap to clone; clones share them.
#[derive(Clone)]
pub struct CsiMetrics {
    rpcs: Family<RpcLabels, Counter>,
    errors: Family<MethodLabels, Counter>,
    duration: HistogramFamily<MethodLabels>,
    ceph_op_duration: HistogramFamily<OpLabels>,
    ceph_connections: Gauge,
    staged: Family<MapperLabels, Gauge>,
    ready: Gauge,
    registry: Arc<Mutex<Registry>>,
}

impl std::fmt::Debug for CsiMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CsiMetrics").finish_non_exhaustive()
    }
}

impl Default for CsiMetrics {
    fn default() -> Self {
        CsiMetrics::new()
    }
}

impl CsiMetrics {
    /// Creates the metrics in a registry of their own.
    pub fn new() -> CsiMetrics {
        let m = CsiMetrics {
            rpcs: Family::default(),
            errors: Family::default(),
            duration: Family::new_with_constructor(rpc_histogram),
            ceph_op_duration: Family::new_with_constructor(rpc_histogram),
            ceph_connections: Gauge::default(),
            staged: Family::default(),
            ready: Gauge::default(),
            registry: Arc::new(Mutex::new(Registry::default())),
        };
        let mut r = m.registry.lock().unwrap_or_else(|e| e.into_inner());
        // Counters get their `_total` suffix from the encoder.
        r.register(
            "rbdkit_csi_operations",
            "CSI calls served, by method and gRPC status code",
            m.rpcs.clone(),
        );
        r.register(
            "rbdkit_csi_operation_errors",
            "CSI calls that did not return OK, by method",
            m.errors.clone(),
        );
        r.register(
            "rbdkit_csi_operation_duration_seconds",
            "Latency of CSI calls, by method",
            m.duration.clone(),
        );
        r.register(
            "rbdkit_csi_ceph_op_duration_seconds",
            "Latency of Ceph calls made for CSI calls, by operation",
            m.ceph_op_duration.clone(),
        );
        r.register(
            "rbdkit_csi_ceph_connections",
            "Ceph connections in the cache",
            m.ceph_connections.clone(),
        );
        r.register(
            "rbdkit_csi_staged_volumes",
            "Volumes staged (mapped) on this node, by mapper",
            m.staged.clone(),
        );
        r.register(
            "rbdkit_csi_ready",
            "Whether the last /readyz found the server's Probe ready (1) or not (0)",
            m.ready.clone(),
        );
        drop(r);
        m
    }

    /// Records one RPC: `path` is the gRPC path (`/csi.v1.Node/NodeStageVolume`).
    pub fn rpc(&self, path: &str, code: &str, took: Duration) {
        let (service, method) = split_path(path);
        self.rpcs
            .get_or_create(&RpcLabels {
                service: service.clone(),
                method: method.clone(),
                code: code.to_owned(),
            })
            .inc();
        let m = MethodLabels { service, method };
        if code != "OK" {
            self.errors.get_or_create(&m).inc();
        }
        self.duration.get_or_create(&m).observe(took.as_secs_f64());
    }

    /// The metrics in the Prometheus text format, with the staged-volume
    /// count of `state_dir` read now.
    pub fn encode(&self, state_dir: Option<&std::path::Path>) -> String {
        if let Some(dir) = state_dir {
            self.staged.clear();
            for (mapper, n) in crate::csi::node::staged_volumes(dir) {
                self.staged
                    .get_or_create(&MapperLabels { mapper })
                    .set(n as i64);
            }
        }
        let r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        crate::telemetry::encode_metrics(&r)
    }
}

impl crate::volume::CephObserver for CsiMetrics {
    fn ceph_op(&self, op: &str, started: Instant) {
        self.ceph_op_duration
            .get_or_create(&OpLabels {
                operation: op.to_owned(),
            })
            .observe(started.elapsed().as_secs_f64());
    }
    fn set_connections(&self, n: usize) {
        self.ceph_connections.set(n as i64);
    }
}

/// The service and method of a gRPC path, bounded to names (anything else
/// is `unknown`: a client must not mint label values).
fn split_path(path: &str) -> (String, String) {
    let name_ok =
        |s: &str| !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric());
    let parsed = path
        .strip_prefix("/csi.v1.")
        .and_then(|rest| rest.split_once('/'))
        .filter(|(s, m)| name_ok(s) && name_ok(m));
    match parsed {
        Some((s, m)) => (s.to_owned(), m.to_owned()),
        None => ("unknown".to_owned(), "unknown".to_owned()),
    }
}

/// The name of a numeric gRPC status code.
fn code_name(code: &str) -> &'static str {
    match code.trim() {
        "0" => "OK",
        "1" => "Canceled",
        "2" => "Unknown",
        "3" => "InvalidArgument",
        "4" => "DeadlineExceeded",
        "5" => "NotFound",
        "6" => "AlreadyExists",
        "7" => "PermissionDenied",
        "8" => "ResourceExhausted",
        "9" => "FailedPrecondition",
        "10" => "Aborted",
        "11" => "OutOfRange",
        "12" => "Unimplemented",
        "13" => "Internal",
        "14" => "Unavailable",
        "15" => "DataLoss",
        "16" => "Unauthenticated",
        _ => "Unknown",
    }
}

/// A tower layer that counts and times every gRPC call of the server.
#[derive(Clone, Debug)]
pub struct RpcMetricsLayer(pub CsiMetrics);

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;

    fn layer(&self, inner: S) -> RpcMetrics<S> {
        RpcMetrics {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service [`RpcMetricsLayer`] wraps around the server's routes.
#[derive(Clone, Debug)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: CsiMetrics,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResBody: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let path = req.uri().path().to_owned();
        let started = Instant::now();
        let fut = self.inner.call(req);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let out = fut.await;
            // A handler's error travels in the headers (trailers-only); a
            // success's OK comes later in the trailers.
            let code = match &out {
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .map_or("OK", code_name),
                Err(_) => "Unavailable",
            };
            metrics.rpc(&path, code, started.elapsed());
            out
        })
    }
}

/// What the HTTP handlers need.
#[derive(Clone)]
struct Probe {
    metrics: CsiMetrics,
    socket: PathBuf,
    state_dir: Option<PathBuf>,
    timeout: Duration,
}

/// The router of `/healthz`, `/readyz` and `/metrics` for the server on
/// `socket`; `state_dir`: the node service's, for the staged-volume count.
pub fn router(
    metrics: CsiMetrics,
    socket: PathBuf,
    state_dir: Option<PathBuf>,
    timeout: Duration,
) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .with_state(Probe {
            metrics,
            socket,
            state_dir,
            timeout,
        })
}

async fn identity(p: &Probe) -> Result<IdentityClient<tonic::transport::Channel>, String> {
    crate::csi::client::unix_channel(&p.socket, Duration::ZERO, Some(p.timeout))
        .await
        .map(IdentityClient::new)
        .map_err(|e| format!("the CSI socket {} does not answer: {e}", p.socket.display()))
}

async fn healthz(State(p): State<Probe>) -> impl IntoResponse {
    let answer = async {
        identity(&p)
            .await?
            .get_plugin_info(GetPluginInfoRequest {})
            .await
            .map_err(|s| format!("GetPluginInfo: {}", s.message()))
    };
    match tokio::time::timeout(p.timeout * 2, answer).await {
        Ok(Ok(_)) => (StatusCode::OK, "ok".to_owned()),
        Ok(Err(why)) => (StatusCode::SERVICE_UNAVAILABLE, why),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the CSI server did not answer in time".to_owned(),
        ),
    }
}

async fn readyz(State(p): State<Probe>) -> impl IntoResponse {
    let answer = async {
        identity(&p)
            .await?
            .probe(ProbeRequest {})
            .await
            .map_err(|s| format!("Probe: {}", s.message()))
    };
    // Probe bounds its own checks at four timeouts.
    let out = match tokio::time::timeout(p.timeout * 6, answer).await {
        Ok(Ok(r)) if r.get_ref().ready != Some(false) => (StatusCode::OK, "ok".to_owned()),
        Ok(Ok(_)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "Probe: not ready (the server's log says why)".to_owned(),
        ),
        Ok(Err(why)) => (StatusCode::SERVICE_UNAVAILABLE, why),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the CSI server's Probe did not answer in time".to_owned(),
        ),
    };
    p.metrics.ready.set(i64::from(out.0 == StatusCode::OK));
    out
}

async fn metrics_handler(State(p): State<Probe>) -> impl IntoResponse {
    let m = p.metrics.clone();
    let dir = p.state_dir.clone();
    // Reading the stashes is file I/O.
    let body = tokio::task::spawn_blocking(move || m.encode(dir.as_deref()))
        .await
        .unwrap_or_default();
    crate::telemetry::metrics_response(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_names_only() {
        assert_eq!(
            split_path("/csi.v1.Node/NodeStageVolume"),
            ("Node".to_owned(), "NodeStageVolume".to_owned())
        );
        for bad in [
            "/other.Svc/M",
            "/csi.v1.Node/",
            "/csi.v1.Node/a-b",
            "/csi.v1.X/Y/Z",
        ] {
            assert_eq!(split_path(bad).0, "unknown", "{bad}");
        }
        assert_eq!(code_name("5"), "NotFound");
        assert_eq!(code_name("99"), "Unknown");
        let m = CsiMetrics::new();
        m.rpc(
            "/csi.v1.Controller/CreateVolume",
            "OK",
            Duration::from_millis(3),
        );
        m.rpc(
            "/csi.v1.Controller/CreateVolume",
            "InvalidArgument",
            Duration::from_millis(1),
        );
        let text = m.encode(None);
        assert!(
            text.contains(r#"rbdkit_csi_operations_total{service="Controller",method="CreateVolume",code="InvalidArgument"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"rbdkit_csi_operation_errors_total{service="Controller",method="CreateVolume"} 1"#
            ),
            "{text}"
        );
    }
}
