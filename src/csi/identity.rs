//! The CSI Identity service: who the plugin is, what it offers, and
//! whether it is ready.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::csi::driver::Driver;
use crate::csi::proto::{
    identity_server::Identity, plugin_capability, GetPluginCapabilitiesRequest,
    GetPluginCapabilitiesResponse, GetPluginInfoRequest, GetPluginInfoResponse, PluginCapability,
    ProbeRequest, ProbeResponse,
};

/// An extra readiness check (the node plugin checks its mapper).
pub type ReadyCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The Identity service.
pub struct IdentityService {
    driver: Arc<Driver>,
    controller: bool,
    probe_timeout: Duration,
    extra: Option<ReadyCheck>,
}

impl IdentityService {
    /// `controller`: whether the Controller service is served too.
    /// `extra`: a further readiness check, run on every Probe.
    pub fn new(
        driver: Arc<Driver>,
        controller: bool,
        probe_timeout: Duration,
        extra: Option<ReadyCheck>,
    ) -> IdentityService {
        IdentityService {
            driver,
            controller,
            probe_timeout,
            extra,
        }
    }
}

/// Whether some monitor of each configured cluster accepts a TCP
/// connection within `timeout`; the error names the first cluster none of
/// whose monitors answer. Needs no credentials.
pub fn monitors_reachable(driver: &Driver, timeout: Duration) -> Result<(), String> {
    let config = driver.clusters.config();
    let mut ids = config.ids();
    ids.sort();
    for id in ids {
        let Some(info) = config.get(&id) else {
            continue;
        };
        let ok = info.monitors.iter().any(|m| mon_reachable(m, timeout));
        if !ok {
            return Err(format!(
                "no monitor of Ceph cluster {id:?} ({}) answers",
                info.monitors.join(",")
            ));
        }
    }
    Ok(())
}

fn mon_reachable(mon: &str, timeout: Duration) -> bool {
    crate::volume::clusters::monitor_reachable(mon, timeout)
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.driver.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type as S;
        use plugin_capability::volume_expansion::Type as E;
        let mut caps = vec![PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: E::Online as i32,
                },
            )),
        }];
        let mut services = vec![S::VolumeAccessibilityConstraints];
        if self.controller {
            services.push(S::ControllerService);
            services.push(S::GroupControllerService);
        }
        for s in services {
            caps.push(PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service { r#type: s as i32 },
                )),
            });
        }
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: caps,
        }))
    }

    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let driver = Arc::clone(&self.driver);
        let timeout = self.probe_timeout;
        let extra = self.extra.clone();
        let check = tokio::task::spawn_blocking(move || {
            monitors_reachable(&driver, timeout)?;
            match extra {
                Some(f) => f(),
                None => Ok(()),
            }
        });
        // The checks are bounded themselves; this bounds the whole.
        let ready = match tokio::time::timeout(timeout * 4, check).await {
            Ok(Ok(Ok(()))) => true,
            Ok(Ok(Err(why))) => {
                tracing::warn!(%why, "probe: not ready");
                false
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "probe: check failed");
                false
            }
            Err(_) => {
                tracing::warn!("probe: checks ran past their bound");
                false
            }
        };
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitor_address_forms() {
        let t = Duration::from_millis(200);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(mon_reachable(&format!("127.0.0.1:{port}"), t));
        assert!(mon_reachable(
            &format!("[v2:127.0.0.1:{port}/0,v1:127.0.0.1:1/0]"),
            t
        ));
        drop(l);
        assert!(!mon_reachable(&format!("127.0.0.1:{port}"), t));
        assert!(!mon_reachable("no-such-host.invalid", t));
    }
}
