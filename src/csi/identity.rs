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

    /// Ready when this process can serve: its config is loaded (it is
    /// before the socket is bound) and, on a node, its default mapper
    /// answers. Cluster reachability is not part of it: one unreachable
    /// cluster in the config must not stop the provisioning of the others.
    /// NodeGetStorageHealth reports it on a node, and the provisioner's
    /// `rbdkit_cluster_reachable` metric and `/readyz` everywhere.
    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let Some(extra) = self.extra.clone() else {
            return Ok(Response::new(ProbeResponse { ready: Some(true) }));
        };
        let check = tokio::task::spawn_blocking(move || extra());
        // The check is bounded itself; this bounds the whole.
        let ready = match tokio::time::timeout(self.probe_timeout * 4, check).await {
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
                tracing::warn!("probe: the readiness check ran past its bound");
                false
            }
        };
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}
