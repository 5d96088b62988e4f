//! What the reconcilers of other projects' custom resources share
//! (external-snapshotter's snapshot and group snapshot contents, and the
//! like): their `Resource` impls, waiting for a CRD to be installed, and the
//! controller loop around a reconcile function.
//!
//! The types are plain serde structs rather than `kube::CustomResource`
//! derives: rbdkit reads only the fields it acts on, and a CRD of a newer
//! version with more fields must not stop it.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Config};
use kube::Resource;
use serde::de::DeserializeOwned;

use crate::provisioner::controller::{Context, ReconcileError};

/// Implements [`kube::Resource`] for a custom resource type of the given
/// scope whose object metadata is its `metadata` field.
macro_rules! resource_impl {
    ($ty:ty, $scope:ty, group = $group:expr, version = $version:expr, kind = $kind:expr, plural = $plural:expr) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;
            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
pub(crate) use resource_impl;

/// [`resource_impl`] for a cluster-scoped type.
macro_rules! cluster_resource {
    ($ty:ty, $($rest:tt)*) => {
        $crate::provisioner::crd::resource_impl!($ty, kube::core::ClusterResourceScope, $($rest)*);
    };
}
pub(crate) use cluster_resource;

/// [`resource_impl`] for a namespaced type.
macro_rules! namespaced_resource {
    ($ty:ty, $($rest:tt)*) => {
        $crate::provisioner::crd::resource_impl!($ty, kube::core::NamespaceResourceScope, $($rest)*);
    };
}
pub(crate) use namespaced_resource;

/// How often a provisioner without a CRD looks for it again.
pub const CRD_POLL: Duration = Duration::from_secs(30);

/// Whether the CRD of `K` is installed (a list of one answers); `Err` for
/// any other API failure.
pub async fn installed<K>(client: &kube::Client) -> Result<bool, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let api: Api<K> = Api::all(client.clone());
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Nanoseconds since the epoch, as external-snapshotter's status fields
/// count time (0 before the epoch, saturating far after it).
pub fn nanos(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Now, in RFC 3339 (the form of a `metav1.Time`).
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Waits until the CRD of `K` is installed: says so once while it is not
/// (naming `what`, e.g. "VolumeSnapshotContent") and looks again every
/// [`CRD_POLL`], so CRDs can be installed after the provisioner started.
/// `false` when `shutdown` comes first.
pub async fn wait_installed<K>(
    client: &kube::Client,
    what: &str,
    shutdown: impl Future<Output = ()> + Clone,
) -> bool
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let crd = format!("{}.{}", K::plural(&()), K::group(&()));
    let mut warned = false;
    loop {
        match installed::<K>(client).await {
            Ok(true) => return true,
            Ok(false) if !warned => {
                tracing::warn!(
                    "the {what} CRD ({crd}) is not installed: {what}s are not handled until it is (looking again every {CRD_POLL:?})"
                );
                warned = true;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell whether the {what} CRD ({crd}) is installed; will look again")
            }
        }
        tokio::select! {
            _ = shutdown.clone() => return false,
            _ = tokio::time::sleep(CRD_POLL) => {}
        }
    }
}

/// Runs a controller of `K` with `reconcile` and `error_policy` until
/// `shutdown` resolves, once the CRD is installed ([`wait_installed`]).
/// With `enabled` false it only waits for `shutdown`.
pub async fn run<K, R, RF, E>(
    what: &'static str,
    ctx: Arc<Context>,
    config: Config,
    enabled: bool,
    shutdown: impl Future<Output = ()> + Clone + Send + Sync + 'static,
    reconcile: R,
    error_policy: E,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    R: FnMut(Arc<K>, Arc<Context>) -> RF,
    RF: Future<Output = Result<Action, ReconcileError>> + Send + 'static,
    E: Fn(Arc<K>, &ReconcileError, Arc<Context>) -> Action,
{
    use futures::StreamExt;
    if !enabled {
        tracing::info!("{what}s are not handled (disabled by a flag)");
        shutdown.await;
        return;
    }
    if !wait_installed::<K>(&ctx.client, what, shutdown.clone()).await {
        return;
    }
    tracing::info!("the {what} CRD is installed: handling {what}s");
    let objects: Api<K> = Api::all(ctx.client.clone());
    kube::runtime::Controller::new(
        objects,
        kube::runtime::watcher::Config::default().any_semantic(),
    )
    .with_config(config)
    .graceful_shutdown_on(shutdown)
    .run(reconcile, error_policy, ctx)
    .for_each(|r| async move {
        if let Err(e) = r {
            tracing::debug!(error = %e, "{what} controller");
        }
    })
    .await;
}
