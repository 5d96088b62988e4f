//! Building a Kubernetes client: from a kubeconfig file, or from the pod's
//! service account when running in a cluster.

use std::path::Path;

use anyhow::Context as _;

/// Where the pod's namespace is mounted in a cluster.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// A client for the kubeconfig at `path`, or the in-cluster configuration
/// when `path` is `None`.
pub async fn client(path: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match path {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("bad kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster()
            .context("no --kubeconfig given and not running in a cluster")?,
    };
    kube::Client::try_from(config).context("cannot build a Kubernetes client")
}

/// The namespace this process runs in: `$POD_NAMESPACE`, else the service
/// account's namespace file, else `default`.
pub fn own_namespace() -> String {
    if let Ok(ns) = std::env::var("POD_NAMESPACE") {
        if !ns.is_empty() {
            return ns;
        }
    }
    std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// A name for this process among replicas: `$POD_NAME`, else the host name,
/// with the process id appended so two processes on one host differ.
pub fn own_identity() -> String {
    let base = std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(hostname)
        .unwrap_or_else(|| "rbdkit".to_owned());
    format!("{base}_{}", std::process::id())
}

fn hostname() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}
