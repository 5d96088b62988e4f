//! Fixtures shared by the integration tests: a real Ceph cluster and a real
//! Kubernetes control plane, both started by the project's own scripts.
#![allow(dead_code)]

pub mod aio;
pub mod artifacts;
pub mod ceph;
#[cfg(feature = "service")]
pub mod csi;
#[cfg(feature = "service")]
pub mod csi_addons;
pub mod data;
#[cfg(feature = "service")]
pub mod k8s;
#[cfg(feature = "service")]
pub mod kms;
#[cfg(feature = "service")]
pub mod legacy;
#[cfg(feature = "service")]
pub mod manifests;
#[cfg(feature = "service")]
pub mod node;
pub mod process;
#[cfg(feature = "service")]
pub mod provisioner;
#[cfg(feature = "service")]
pub mod replication;
#[cfg(feature = "service")]
pub mod snapshots;
#[cfg(feature = "service")]
pub mod topology;
