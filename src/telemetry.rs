//! Logging through `tracing`: JSON lines for log collectors, or text for
//! people. The level comes from `RUST_LOG` (default `info`).
//!
//! Shared by every daemon: the provisioner, the CSI server and the FUSE
//! mapper. Also the plain HTTP side they share (the Prometheus encoding and
//! the server), whatever their probes check.

use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable text.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?} (use text or json)")),
        }
    }
}

/// Installs the global subscriber, writing to stderr. Does nothing if one is
/// already installed (tests run several provisioners in one process).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,kube_runtime=warn,kube_client=warn"));
    use std::io::IsTerminal as _;
    // Colours only on a terminal: not in a log file or a container log.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// The metrics of `registry` in the Prometheus text format.
pub fn encode_metrics(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    // Encoding into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// A `/metrics` response: `body` (from [`encode_metrics`]) with the
/// OpenMetrics content type.
pub fn metrics_response(body: String) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

/// Serves `app` on `addr` until `shutdown` resolves: the HTTP side of every
/// daemon (probes and metrics). Returns the address actually bound (port 0
/// picks a free one) once listening, and the server task.
pub async fn serve_http(
    addr: std::net::SocketAddr,
    app: axum::Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(
    std::net::SocketAddr,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats() {
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert_eq!("text".parse(), Ok(LogFormat::Text));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
