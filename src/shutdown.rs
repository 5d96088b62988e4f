//! The stop signal of the daemons (the provisioner and the CSI server).

/// Resolves on the first SIGTERM (what Kubernetes sends) or SIGINT.
pub(crate) async fn signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    tracing::info!("shutdown requested");
}
